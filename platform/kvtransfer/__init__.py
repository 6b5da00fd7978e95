"""KV transfer between pools: `KVHandle`, exporters and importers, chosen by backend name."""

from pdserve.kvtransfer.base import KVExporter, KVImporter
from pdserve.kvtransfer.local_backend import LocalImporter
from pdserve.kvtransfer.protocol import KVHandle, KVLayout, KVTransferError

__all__ = ["BACKENDS", "KVExporter", "KVHandle", "KVImporter", "KVLayout", "KVTransferError", "LocalImporter"]


def _ucx():
    from pdserve.kvtransfer.ucx_backend import UCXExporter, UCXImporter

    return UCXExporter, UCXImporter


def _local():
    return KVExporter, LocalImporter


# backend name -> () -> (exporter class, importer class); ucxx is imported only when chosen.
BACKENDS = {"ucx": _ucx, "local": _local}

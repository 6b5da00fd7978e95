"""KV transfer between pools: `KVHandle`, exporters and importers, chosen by backend name."""

from pdserve.kvtransfer.base import KVExporter, KVImporter
from pdserve.kvtransfer.local_backend import LocalImporter
from pdserve.kvtransfer.protocol import KVHandle, KVLayout, KVTransferError

__all__ = ["BACKENDS", "KVExporter", "KVHandle", "KVImporter", "KVLayout", "KVTransferError", "LocalImporter"]


def _ucx():
    from pdserve.kvtransfer.ucx_backend import UCXExporter, UCXImporter

    return UCXExporter, UCXImporter


def _ray():
    from pdserve.kvtransfer.ray_backend import RayImporter, RayKVExporter

    return RayKVExporter, RayImporter


def _local():
    return KVExporter, LocalImporter


# backend name -> () -> (exporter class, importer class); ucxx / ray are imported only when chosen.
BACKENDS = {"ucx": _ucx, "ray": _ray, "local": _local}

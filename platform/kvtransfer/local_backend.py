"""Same-process KV hand-off (colocated serving, tests): the importer calls the exporter directly.

`LocalImporter` finds exporters by id in a plain dict the application builds; bytes are copied
once from the exporter's staging buffer into the importer's blocks.
"""

from __future__ import annotations

import torch

from pdserve.kvtransfer import protocol as p
from pdserve.kvtransfer.base import KVExporter, KVImporter


class LocalImporter(KVImporter):
    def __init__(self, kv: torch.Tensor, layout: p.KVLayout, exporters: dict[str, KVExporter]):
        super().__init__(kv, layout)
        self.exporters = exporters

    def _fetch(self, handle: p.KVHandle, dst: list[int], heads: tuple[int, int], timeout_s: float,
               first_block: int, ack: bool) -> None:
        exporter = self._exporter(handle)
        data = exporter.read(handle.request_id, handle.lease_token, self.layout, first_block)
        try:
            self.store(dst, data)
        finally:
            exporter.release_buffer(data)
        if ack:
            exporter.ack(handle.request_id, handle.lease_token)

    def _release(self, handle: p.KVHandle, timeout_s: float) -> None:
        self._exporter(handle).ack(handle.request_id, handle.lease_token)

    def _exporter(self, handle: p.KVHandle) -> KVExporter:
        exporter = self.exporters.get(handle.exporter_id)
        if exporter is None:
            raise p.ExporterUnreachableError(f"no exporter {handle.exporter_id!r} in this process")
        return exporter

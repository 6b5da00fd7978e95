"""KV transfer through the Ray object store: the portable fallback where ucxx is missing.

The exporter lives in a named Ray actor (a prefill replica) that mixes in `RayKVExportMixin`, so
the actor answers `kv_read(request_id, token, layout) -> numpy array` and `kv_ack(request_id, token)`; the
handle's address is `ray:<actor name>`. `RayImporter` resolves the actor by name, reads with a
deadline, scatters into its own blocks and acks. Errors the exporter raises come back typed;
a dead or unreachable actor becomes `ExporterUnreachableError` (retryable).
"""

from __future__ import annotations

import warnings
from dataclasses import asdict

import numpy as np
import torch

from pdserve.kvtransfer import protocol as p
from pdserve.kvtransfer.base import KVExporter, KVImporter


class RayKVExporter(KVExporter):
    def __init__(self, actor_name: str, *args, namespace: str | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.actor_name, self.namespace = actor_name, namespace

    @property
    def address(self) -> str:
        return f"ray:{self.actor_name}" + (f"@{self.namespace}" if self.namespace else "")


class RayKVExportMixin:
    """For the actor that owns a `RayKVExporter` as `self.kv_exporter`."""

    kv_exporter: RayKVExporter

    def kv_read(self, request_id: str, token: str, layout: dict, first_block: int = 0) -> np.ndarray:
        data = self.kv_exporter.read(request_id, token, p.KVLayout(**layout), first_block)
        try:
            # A copy: Ray serialises the return value after this method returns, and the staging
            # buffer goes back to the pool now.
            return data.numpy().copy()
        finally:
            self.kv_exporter.release_buffer(data)

    def kv_ack(self, request_id: str, token: str) -> bool:
        return self.kv_exporter.ack(request_id, token)


class RayImporter(KVImporter):
    def _fetch(self, handle: p.KVHandle, dst: list[int], heads: tuple[int, int], timeout_s: float,
               first_block: int, ack: bool) -> None:
        import ray

        try:
            actor = self._actor(handle)
            read = actor.kv_read.remote(handle.request_id, handle.lease_token, asdict(self.layout), first_block)
            data = ray.get(read, timeout=timeout_s)
        except ray.exceptions.RayTaskError as e:
            if isinstance(e.cause, p.KVTransferError):
                raise e.cause from None
            raise p.ExporterUnreachableError(f"KV read from {handle.address} failed: {e}") from e
        except (ValueError, ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as e:
            raise p.ExporterUnreachableError(f"KV read from {handle.address} failed: {e!r}") from e
        with warnings.catch_warnings():
            # The object store hands out a read-only, zero-copy array; it is only read from here.
            warnings.simplefilter("ignore", UserWarning)
            tensor = torch.from_numpy(data)
        if tuple(tensor.shape) != self.expected_shape(len(dst), heads):
            raise p.ProtocolError(f"exporter sent blocks of shape {tuple(tensor.shape)}, "
                                  f"expected {self.expected_shape(len(dst), heads)}")
        self.store(dst, tensor)
        if ack:
            actor.kv_ack.remote(handle.request_id, handle.lease_token)

    def _release(self, handle: p.KVHandle, timeout_s: float) -> None:
        self._actor(handle).kv_ack.remote(handle.request_id, handle.lease_token)

    @staticmethod
    def _actor(handle: p.KVHandle):
        import ray

        if not handle.address.startswith("ray:"):
            raise p.ProtocolError(f"not a Ray exporter address: {handle.address!r}")
        name, _, namespace = handle.address[4:].partition("@")
        return ray.get_actor(name, namespace=namespace or None)

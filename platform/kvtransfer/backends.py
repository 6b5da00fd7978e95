"""The KV transfer backends by name (`transfer.backend`), and what the pools need to open one:
the exporter's options and the layout of an engine's cache."""

from __future__ import annotations

import torch

from pdserve.kvtransfer.base import KVExporter
from pdserve.kvtransfer.local_backend import LocalImporter
from pdserve.kvtransfer.protocol import KVLayout


def _tcp():
    from pdserve.kvtransfer.tcp_backend import TCPExporter, TCPImporter

    return TCPExporter, TCPImporter


def _ucx():
    from pdserve.kvtransfer.ucx_backend import UCXExporter, UCXImporter

    return UCXExporter, UCXImporter


def _local():
    return KVExporter, LocalImporter


# backend name -> () -> (exporter class, importer class); ucxx is imported only when chosen.
BACKENDS = {"tcp": _tcp, "ucx": _ucx, "local": _local}


def exporter_options(backend: str, host: str, shared_memory: bool) -> dict:
    """What only the network exporters take: the address they listen on, and whether importers on
    this host may copy straight out of their cache."""
    return {"host": host, "shared_memory": shared_memory} if backend != "local" else {}


def layout_of(kv: torch.Tensor, model_id: str, tp_size: int = 1, tp_rank: int = 0) -> KVLayout:
    """The layout of an engine's cache tensor `[layers, planes, blocks, block_size, local heads, head_dim]`:
    two planes (K, V) and this rank's share of the KV heads, or one plane, the latent layout
    (kv_cache.py), whose one latent every rank holds whole."""
    num_layers, planes, _, block_size, local_heads, head_dim = kv.shape
    is_latent = planes == 1
    return KVLayout(model_id, num_layers, block_size, local_heads if is_latent else local_heads * tp_size, head_dim,
                    str(kv.dtype).removeprefix("torch."), tp_size, tp_rank, is_latent)

"""Decode steps replayed as CUDA graphs (vLLM's and SGLang's "cudagraph" mode, decode only).

A decode step of a small model on a GPU is bound by the host: each of its few hundred kernels costs
the Python that launches it, on the thread that also schedules, samples and (in a served replica)
shares the GIL with the event loop. A graph captured once per batch size replays them all in one
call.

What that takes:
- Static inputs. One int64 buffer on the device holds every step's integers, as views that each
  captured graph reads: `[ids | positions | lengths | slots of each layer group]` of `max_batch`
  rows each, then the block tables, `[max_batch, groups, max_blocks]` (a model of one kind of
  layer has one group; Gemma 3's sliding and global layers have several, kv_groups.py). A step
  writes its values into a pinned host copy of the buffer and sends it in one copy. Table columns
  past a row's blocks keep stale block ids: the kernels stop at the row's length (and a sliding
  layer's start at its window's first block), so they are never read.
- Fixed batch sizes (1, 2, 4, 8, then every 8 up to `max_batch`). A batch of n runs the graph of
  the next size up; the extra rows repeat row 0 (same token, position and cache slot), so they
  write row 0's own K/V to row 0's slot and their logits are dropped.
- A forward pass without host syncs or data-dependent shapes: the dense models on the Triton
  attention path (sliding-window layers included: the kernels take the window and size their
  launch by it), and MoE models on one rank with the fused Triton experts (`triton_moe`: routing
  and grouping stay on the device, DeepSeek's group-limited routing too). DeepSeek-V3's latent
  cache is one group read by MLA's absorbed-decode kernel (`triton_mla`), which takes the same
  slots, table and lengths. Expert parallelism routes on the host (all-to-all sizes), so those
  models run eagerly (`supports_cuda_graphs`).

On a CPU (the unit tests), `DecodeGraphs` without `capture()` runs the same static buffers and
padding eagerly, which checks everything but the capture itself.
"""

from __future__ import annotations

import logging
import time

import torch

from pdserve.engine.attention import AttentionMetadata, forward_context
from pdserve.engine.kernels.paged_attention import GatherWorkspace
from pdserve.engine.kv_cache import KVCache

log = logging.getLogger(__name__)


def capture_sizes(max_batch: int) -> list[int]:
    """Batch sizes to capture: vLLM's 1, 2, 4, 8, then steps of 8, and max_batch itself."""
    sizes = [b for b in (1, 2, 4) if b < max_batch] + list(range(8, max_batch, 8)) + [max_batch]
    return sorted(set(sizes))


class DecodeGraphs:
    """One model's decode step over one KV cache, at each size of `capture_sizes(max_batch)`."""

    def __init__(self, model: torch.nn.Module, kv_cache: KVCache, max_batch: int, max_blocks: int,
                 device: str | torch.device):
        self.model = model
        self.kv_cache = kv_cache
        self.sizes = capture_sizes(max_batch)
        self.max_batch = max_batch
        self.max_blocks = max_blocks
        self.device = torch.device(device)
        self.num_groups = 1 if kv_cache.layer_groups is None else max(kv_cache.layer_groups) + 1
        self._num_rows = 3 + self.num_groups  # ids, positions, lengths, then each group's slots
        rows = self._num_rows * max_batch
        n = rows + max_batch * self.num_groups * max_blocks
        self._ints = torch.zeros(n, dtype=torch.long, device=self.device)
        self._host = torch.zeros(n, dtype=torch.long, pin_memory=self.device.type == "cuda")
        self._host_rows = self._host.numpy()[:rows].reshape(self._num_rows, max_batch)
        self._host_tables = self._host.numpy()[rows:].reshape(max_batch, self.num_groups, max_blocks)
        self._host_rows[2] = 1  # a length of 1 while capturing: a real key for the warm-up passes
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._logits: dict[int, torch.Tensor] = {}
        self._workspace = GatherWorkspace()

    def _forward(self, batch: int) -> torch.Tensor:
        """The decode step of the first `batch` rows of the static buffer, to logits `[batch, vocab]`."""
        mb = self.max_batch
        ids, positions, lens, *slots = (self._ints[i * mb:i * mb + batch] for i in range(self._num_rows))
        tables = self._ints[self._num_rows * mb:].view(mb, self.num_groups, self.max_blocks)[:batch]
        groups = [AttentionMetadata(slots[g], batch, tables[:, g], lens, []) for g in range(self.num_groups)]
        meta = groups[0]
        if self.num_groups > 1:
            meta.groups = groups
        with forward_context(meta, self.kv_cache, self._workspace):
            return self.model.compute_logits(self.model(ids, positions))

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every size, largest first so the smaller graphs reuse its memory pool. Warm-up
        passes write into cache slot 0: call this before the engine holds any KV."""
        t0 = time.perf_counter()
        self._ints.copy_(self._host)
        pool = None
        with torch.cuda.device(self.device):  # graphs are captured on the current device
            for batch in reversed(self.sizes):
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):  # warm-up off the capture stream (Triton compiles here)
                    for _ in range(2):
                        self._forward(batch)
                torch.cuda.current_stream().wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self._logits[batch] = self._forward(batch)
                pool = graph.pool()
                self._graphs[batch] = graph
            torch.cuda.synchronize()
        log.info("captured decode CUDA graphs for batch sizes %s in %.1fs", self.sizes, time.perf_counter() - t0)

    @torch.inference_mode()
    def run(self, ids: list[int], positions: list[int], lens: list[int], slots: list[list[int]],
            tables: list[list[list[int]]]) -> torch.Tensor:
        """Logits `[len(ids), vocab]` of one decode step; they stay valid until the next `run`.
        `slots` and `tables` hold each layer group's (`[group][row]`, `[group][row][block]`)."""
        n = len(ids)
        batch = next(b for b in self.sizes if b >= n)
        rows, host_tables = self._host_rows, self._host_tables
        for i, values in enumerate((ids, positions, lens, *slots)):
            rows[i, :n] = values
            rows[i, n:batch] = values[0]  # padding rows repeat row 0
        for g, group_tables in enumerate(tables):
            for i, table in enumerate(group_tables):
                host_tables[i, g, :len(table)] = table
            host_tables[n:batch, g, :len(group_tables[0])] = group_tables[0]
        used = self._num_rows * self.max_batch + batch * self.num_groups * self.max_blocks
        self._ints[:used].copy_(self._host[:used], non_blocking=True)
        if batch in self._graphs:
            self._graphs[batch].replay()
            return self._logits[batch][:n]
        return self._forward(batch)[:n]

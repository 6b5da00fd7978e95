"""The attention layer and the one forward context it reads.

The runner packs a step's tokens as `[decode tokens..., prefill chunks...]` and describes them in
an `AttentionMetadata`; it sets that, with the KV cache, through `forward_context(...)` for the
duration of one forward pass. Attention layers read it instead of taking it as an argument, so
the model code stays a plain `forward(input_ids, positions)` (STYLE.md point 12: the one explicit
global, always set through the context manager).
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass, field

import torch
from torch import nn

from pdserve.engine.kernels import ops
from pdserve.engine.kernels.paged_attention import GatherWorkspace, decode_mask, window_decode_tables
from pdserve.engine.kv_cache import KVCache


@dataclass
class PrefillChunkMeta:
    query_start: int  # index of the chunk's first token in the step's flattened tokens
    query_len: int
    context_len: int  # cached prefix + query_len
    block_table: torch.Tensor  # [num_blocks] int64


@dataclass(frozen=True)
class PrefillBatch:
    """A step's prefill chunks as one varlen batch (the Triton kernel's input: one launch a layer)."""
    cu_query_lens: torch.Tensor  # [chunks + 1], offsets into the prefill tokens
    context_lens: torch.Tensor  # [chunks]
    block_tables: torch.Tensor  # [chunks, max_blocks], padded with block 0 (never read)
    max_query_len: int


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64, where each token's K/V is written
    num_decode_tokens: int  # the first tokens: one per decoding sequence
    decode_block_tables: torch.Tensor | None  # [num_decodes, max_blocks]
    decode_seq_lens: torch.Tensor | None  # [num_decodes]
    prefills: list[PrefillChunkMeta]
    # A model of several layer groups (kv_groups.py): each group's metadata, this one first.
    groups: list["AttentionMetadata"] | None = None
    _prefill_batch: PrefillBatch | None = field(default=None, repr=False)
    _decode_mask: torch.Tensor | None = field(default=None, repr=False)
    _window_masks: dict = field(default_factory=dict, repr=False)

    def window_decode(self, block_size: int, dtype: torch.dtype, window: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A sliding-window layer's decode block tables cut to the window, and their mask
        (`window_decode_tables`), for the torch path: built on first use and shared by the step's
        layers of that window."""
        if window not in self._window_masks:
            self._window_masks[window] = window_decode_tables(self.decode_block_tables, self.decode_seq_lens,
                                                              block_size, window, dtype)
        return self._window_masks[window]

    def decode_mask(self, block_size: int, dtype: torch.dtype) -> torch.Tensor:
        """The torch path's `[num_decodes, 1, 1, max_blocks * block_size]` mask, built on first use
        and shared by every layer of the step."""
        if self._decode_mask is None:
            width = self.decode_block_tables.shape[1] * block_size
            self._decode_mask = decode_mask(self.decode_seq_lens, width, dtype)
        return self._decode_mask

    def prefill_batch(self) -> PrefillBatch:
        """The prefills as one batch, built on first use and shared by every layer of the step."""
        if self._prefill_batch is None:
            device = self.prefills[0].block_table.device
            lens = [p.query_len for p in self.prefills]
            cu = [0]
            for n in lens:
                cu.append(cu[-1] + n)
            width = max(p.block_table.numel() for p in self.prefills)
            tables = torch.zeros(len(self.prefills), width, dtype=torch.long, device=device)
            for row, p in zip(tables, self.prefills):
                row[:p.block_table.numel()] = p.block_table
            self._prefill_batch = PrefillBatch(
                torch.tensor(cu, dtype=torch.long, device=device),
                torch.tensor([p.context_len for p in self.prefills], dtype=torch.long, device=device),
                tables, max(lens))
        return self._prefill_batch


@dataclass
class ForwardContext:
    attn: AttentionMetadata
    kv_cache: KVCache
    workspace: GatherWorkspace


# Per thread: two engines in one process (both roles in a test, colocated setups) step on
# threads of their own.
_local = threading.local()


@contextlib.contextmanager
def forward_context(attn: AttentionMetadata, kv_cache: KVCache, workspace: GatherWorkspace):
    previous = getattr(_local, "context", None)
    _local.context = ForwardContext(attn, kv_cache, workspace)
    try:
        yield
    finally:
        _local.context = previous


def get_forward_context() -> ForwardContext:
    context = getattr(_local, "context", None)
    if context is None:
        raise RuntimeError("attention ran outside forward_context(...): the runner sets it per step")
    return context


class Attention(nn.Module):
    """Paged attention over this layer's slice of the KV cache (no weights of its own).

    A sliding-window layer (`sliding_window` W: each query sees its last W positions, itself
    included, as transformers' `kv_idx > q_idx - sliding_window`) passes W to the kernels, which
    read only the blocks its window reaches (its group's table may hold placeholders before them)."""

    def __init__(self, layer_idx: int, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 sliding_window: int | None = None):
        super().__init__()
        self.layer_idx = layer_idx
        self.sliding_window = sliding_window
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_written: bool = False) -> torch.Tensor:
        """q `[tokens, heads, head_dim]`, k/v `[tokens, kv_heads, head_dim]` (views are fine)
        -> `[tokens, heads * head_dim]`. `kv_written`: k and v are in the cache already (a
        projection wrote them there: `step_cache`)."""
        ctx = get_forward_context()
        meta = self._metadata(ctx)
        num_tokens = q.shape[0]
        k_cache, v_cache = ctx.kv_cache.layer(self.layer_idx).unbind(0)
        nd = meta.num_decode_tokens
        if not kv_written:
            ops.write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        if nd == num_tokens:  # a pure decode step, the common case: the kernel's output, no staging copy
            return self._decode(q, k_cache, v_cache, meta, ctx.workspace).reshape(num_tokens,
                                                                                  self.num_heads * self.head_dim)
        out = q.new_empty(num_tokens, self.num_heads, self.head_dim)
        if nd:
            out[:nd] = self._decode(q[:nd], k_cache, v_cache, meta, ctx.workspace)
        # the prefill chunks follow the decode tokens; on a GPU one launch takes them all
        ops.paged_prefill_attention(q, k, v, k_cache, v_cache, meta.prefills, meta.prefill_batch, self.scale, out,
                                    self.sliding_window)
        return out.view(num_tokens, self.num_heads * self.head_dim)

    def step_cache(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """This layer's K and V caches and this step's slots in them, for a kernel that writes the
        step's K and V itself (then `forward(..., kv_written=True)`)."""
        ctx = get_forward_context()
        k_cache, v_cache = ctx.kv_cache.layer(self.layer_idx).unbind(0)
        return k_cache, v_cache, self._metadata(ctx).slot_mapping

    def _metadata(self, ctx: ForwardContext) -> AttentionMetadata:
        """The step's metadata for this layer: its group's slots and block tables, where the
        model has several groups."""
        meta = ctx.attn
        return meta if meta.groups is None else meta.groups[ctx.kv_cache.layer_groups[self.layer_idx]]

    def _decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                workspace: GatherWorkspace) -> torch.Tensor:
        """The decode tokens' attention, on the kernel `ops` picks (the torch path's tables and mask
        built once a step)."""
        block_size, window = k_cache.shape[1], self.sliding_window

        def torch_inputs() -> tuple[torch.Tensor, torch.Tensor]:
            if window is not None:
                return meta.window_decode(block_size, q.dtype, window)
            return meta.decode_block_tables, meta.decode_mask(block_size, q.dtype)

        return ops.paged_decode_attention(q, k_cache, v_cache, meta.decode_block_tables, meta.decode_seq_lens,
                                          self.scale, workspace, torch_inputs, window)

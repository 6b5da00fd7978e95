"""Multi-head latent attention (MLA: DeepSeek-V2/V3) over the latent KV cache.

Each token of an MLA layer caches one vector (kv_cache.py's latent layout): the normalised latent
`c` (`kv_lora_rank` values) and the shared rotary key `k_r` (`qk_rope_head_dim`, rotated), no K/V
halves and no heads. Query head h's score against a cached token and its output are

    s_h = (q_nope,h . W_UK,h c + q_rope,h . k_r) * scale,    o_h = sum softmax(s_h) W_UV,h c

where kv_b_proj's rows are, head by head, W_UK,h `[qk_nope_head_dim, kv_lora_rank]` then
W_UV,h `[v_head_dim, kv_lora_rank]`. Two ways to compute it, equal in exact arithmetic:
- prefill chunks (`_prefill`): expand the context's latents into per-head K and V with kv_b_proj,
  then causal attention, as transformers computes every step;
- decode (`_decode`, weight-absorbed): fold W_UK into the query (`q_lat,h = W_UK,h^T q_nope,h`),
  score the cached vectors themselves as one key head `kv_lora_rank + qk_rope_head_dim` wide shared
  by every query head, take the probability-weighted latent, and apply W_UV after. A decode step
  reads each cached vector once and never expands the context.

In: the step's forward context (attention.py) and, per call, the rotated queries, the step's latent
vectors and kv_b_proj. Out: `[tokens, heads * v_head_dim]`. Under tensor parallelism a rank holds
its heads' rows of kv_b_proj (so of W_UK and W_UV) and the whole latent: every rank computes and
caches the same vectors. The decode path's attention over the cache runs on `ops.latent_decode_attention`:
on a GPU the Triton kernel (kernels/triton_mla.py: reads each sequence's blocks up to its length, no
host sync, so CUDA graphs capture it), elsewhere torch; the prefill path and the cache write are torch
on every device (the C kernels take the K/V layout only).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.engine.attention import AttentionMetadata, PrefillChunkMeta, get_forward_context
from pdserve.engine.kernels import ops


class LatentAttention(nn.Module):
    """Paged MLA over this layer's latent cache. `absorb(kv_b_weight)` (after loading) keeps W_UK and
    W_UV for the decode path; the prefill path expands through the kv_b projection it is given."""

    def __init__(self, layer_idx: int, num_heads: int, kv_lora_rank: int, qk_nope_head_dim: int,
                 qk_rope_head_dim: int, v_head_dim: int, scale: float):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = num_heads  # this rank's
        self.kv_lora_rank, self.qk_nope_head_dim = kv_lora_rank, qk_nope_head_dim
        self.qk_rope_head_dim, self.v_head_dim = qk_rope_head_dim, v_head_dim
        self.scale = scale
        self.w_uk: torch.Tensor | None = None  # [heads, qk_nope_head_dim, kv_lora_rank]
        self.w_uv: torch.Tensor | None = None  # [heads, kv_lora_rank, v_head_dim]

    def absorb(self, kv_b_weight: torch.Tensor) -> None:
        """Split this rank's kv_b_proj weight `[heads * (nope + v), kv_lora_rank]` into W_UK and W_UV."""
        w = kv_b_weight.view(self.num_heads, self.qk_nope_head_dim + self.v_head_dim, self.kv_lora_rank)
        self.w_uk = w[:, :self.qk_nope_head_dim].contiguous()
        self.w_uv = w[:, self.qk_nope_head_dim:].transpose(1, 2).contiguous()

    def forward(self, q: torch.Tensor, latent: torch.Tensor,
                kv_b_proj: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """q `[tokens, heads, qk_nope + qk_rope]` (rope part rotated), latent `[tokens, kv_lora +
        qk_rope]` (normalised latent, rotated k_r) -> `[tokens, heads * v_head_dim]`."""
        ctx = get_forward_context()
        meta = ctx.attn
        cache = ctx.kv_cache.layer(self.layer_idx)  # [num_blocks, block_size, latent_dim]
        cache.view(-1, cache.shape[-1]).index_copy_(0, meta.slot_mapping, latent.to(cache.dtype))
        num_tokens, nd = q.shape[0], meta.num_decode_tokens
        if nd == num_tokens:
            return self._decode(q, cache, meta).reshape(num_tokens, -1)
        out = q.new_empty(num_tokens, self.num_heads, self.v_head_dim)
        if nd:
            out[:nd] = self._decode(q[:nd], cache, meta)
        for p in meta.prefills:
            s, e = p.query_start, p.query_start + p.query_len
            out[s:e] = self._prefill(q[s:e], cache, p, kv_b_proj)
        return out.view(num_tokens, -1)

    def _decode(self, q: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """The weight-absorbed path: `[decodes, heads, v_head_dim]`."""
        nope = self.qk_nope_head_dim
        # q_lat[t, h] = W_UK,h^T q_nope[t, h]: [heads, tokens, nope] @ [heads, nope, rank]
        q_lat = torch.bmm(q[:, :, :nope].transpose(0, 1), self.w_uk).transpose(0, 1)
        out_lat = ops.latent_decode_attention(q_lat, q[:, :, nope:], cache, meta.decode_block_tables,
                                              meta.decode_seq_lens, self.scale,
                                              lambda: meta.decode_mask(cache.shape[1], q.dtype))
        return torch.bmm(out_lat.transpose(0, 1), self.w_uv).transpose(0, 1)  # W_UV after attention

    def _prefill(self, q: torch.Tensor, cache: torch.Tensor, p: PrefillChunkMeta,
                 kv_b_proj: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """One chunk, its context's latents (cached prefix and itself, as the cache holds them)
        expanded into per-head K and V: `[q_len, heads, v_head_dim]`."""
        q_len, n = q.shape[0], p.context_len
        nope, rank, rope = self.qk_nope_head_dim, self.kv_lora_rank, self.qk_rope_head_dim
        block_size, dim = cache.shape[1:]
        latents = cache.index_select(0, p.block_table[:-(-n // block_size)]).view(-1, dim)[:n].to(q.dtype)
        kv = kv_b_proj(latents[:, :rank].contiguous()).view(n, self.num_heads, nope + self.v_head_dim)
        k = torch.cat((kv[:, :, :nope], latents[:, None, rank:].expand(n, self.num_heads, rope)), dim=-1)
        v = kv[:, :, nope:]
        if n == q_len:
            mask, causal = None, True
        else:  # query i sits at position n - q_len + i and sees keys up to there
            q_pos = torch.arange(n - q_len, n, device=q.device)
            mask, causal = torch.arange(n, device=q.device)[None, :] <= q_pos[:, None], False
        out = F.scaled_dot_product_attention(q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0),
                                             v.transpose(0, 1).unsqueeze(0), attn_mask=mask, is_causal=causal,
                                             scale=self.scale)
        return out.squeeze(0).transpose(0, 1)

"""Turn a scheduled batch into tensors, run the model, sample.

In: a `SchedulerOutput` (tensor-free). The runner lays the step's tokens out as
`[decode tokens..., prefill chunks...]` (a chunk of one token counts as a decode: attention for a
single query is the same either way), builds positions, slot mapping, block tables and the
attention metadata, runs the forward pass inside `forward_context`, and samples the rows of
chunks that reach their request's last token. Out: `(request, token id, logprob)` triples.
It does not decide what runs or when a request stops.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.engine.attention import AttentionMetadata, PrefillChunkMeta, forward_context
from pdserve.engine.kernels.paged_attention import GatherWorkspace, decode_mask
from pdserve.engine.kv_cache import KVCache, KVCacheManager
from pdserve.engine.request import Request, TokenLogprob
from pdserve.engine.sampler import Sampler, token_logprob
from pdserve.engine.scheduler import ScheduledChunk, SchedulerOutput


@dataclass
class SampledToken:
    request: Request
    token_id: int
    logprob: TokenLogprob | None


class ModelRunner:
    def __init__(self, model: torch.nn.Module, kv_cache: KVCache, kv_manager: KVCacheManager, sampler: Sampler,
                 device: str | torch.device = "cpu"):
        self.model = model
        self.kv_cache = kv_cache
        self.kv_manager = kv_manager
        self.sampler = sampler
        self.device = torch.device(device)
        self.block_size = kv_cache.block_size
        self.workspace = GatherWorkspace()

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> list[SampledToken]:
        # Decodes first: attention handles them as one batch, prefill chunks one by one.
        chunks = [c for c in out.chunks if c.num_new_tokens == 1] + [c for c in out.chunks if c.num_new_tokens > 1]
        input_ids, positions, meta = self._prepare(chunks)
        with forward_context(meta, self.kv_cache, self.workspace):
            hidden = self.model(input_ids, positions)
        self._prompt_logprobs(chunks, hidden)

        # Rows whose logits we need: the last token of each chunk that reaches its request's end.
        sample_rows, requests, end = [], [], 0
        for c in chunks:
            end += c.num_new_tokens
            if c.samples:
                sample_rows.append(end - 1)
                requests.append(c.request)
        if not sample_rows:
            return []
        logits = self.model.compute_logits(hidden[self._tensor(sample_rows)])
        tokens, logprobs = self.sampler(logits, requests)
        return [SampledToken(r, t, lp) for r, t, lp in zip(requests, tokens, logprobs)]

    def _prepare(self, chunks: list[ScheduledChunk]) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """Token ids, positions and attention metadata for chunks ordered decodes first."""
        bs = self.block_size
        input_ids, positions, slots = [], [], []
        tables = [self.kv_manager.get_block_table(c.request.request_id) for c in chunks]
        for c, table in zip(chunks, tables):
            input_ids += c.request.all_token_ids[c.start:c.end]
            positions += range(c.start, c.end)
            slots += [table[p // bs] * bs + p % bs for p in range(c.start, c.end)]

        num_decodes = sum(1 for c in chunks if c.num_new_tokens == 1)
        decode_tables = decode_lens = mask = None
        if num_decodes:
            max_blocks = max(len(t) for t in tables[:num_decodes])
            # Pad with block 0: padded positions are masked out.
            decode_tables = self._tensor([t + [0] * (max_blocks - len(t)) for t in tables[:num_decodes]])
            decode_lens = self._tensor([c.end for c in chunks[:num_decodes]])
            mask = decode_mask(decode_lens, max_blocks * bs, self.kv_cache.dtype)
        prefills, start = [], num_decodes
        for c, table in zip(chunks[num_decodes:], tables[num_decodes:]):
            prefills.append(PrefillChunkMeta(start, c.num_new_tokens, c.end, self._tensor(table)))
            start += c.num_new_tokens
        meta = AttentionMetadata(self._tensor(slots), num_decodes, decode_tables, decode_lens, prefills, mask)
        return self._tensor(input_ids), self._tensor(positions), meta

    def _prompt_logprobs(self, chunks: list[ScheduledChunk], hidden: torch.Tensor) -> None:
        """Append prompt-token logprobs for chunks of requests that asked for them.

        The logits at position p score prompt token p + 1. Positions already scored (a request
        recomputed after preemption) are skipped, so each token is scored once, in order.
        """
        rows, targets, owners = [], [], []
        offset = 0
        for c in chunks:
            r = c.request
            if r.params.prompt_logprobs is not None:
                for p in range(max(c.start, len(r.prompt_logprobs) - 1), min(c.end, r.num_prompt_tokens - 1)):
                    rows.append(offset + p - c.start)
                    targets.append(r.prompt_token_ids[p + 1])
                    owners.append(r)
            offset += c.num_new_tokens
        if not rows:
            return
        logprobs = torch.log_softmax(self.model.compute_logits(hidden[self._tensor(rows)]).float(), dim=-1)
        for row, target, r in zip(logprobs, targets, owners):
            r.prompt_logprobs.append(token_logprob(row, target, r.params.prompt_logprobs))

    def _tensor(self, values) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)

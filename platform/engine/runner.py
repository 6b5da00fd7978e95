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
from pdserve.engine.scheduler import SchedulerOutput


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
        decodes = [c for c in out.chunks if c.num_new_tokens == 1]
        prefills = [c for c in out.chunks if c.num_new_tokens > 1]
        chunks = decodes + prefills
        input_ids, positions, slots = [], [], []
        tables = [self.kv_manager.get_block_table(c.request.request_id) for c in chunks]
        for c, table in zip(chunks, tables):
            input_ids += c.request.all_token_ids[c.start:c.end]
            pos = range(c.start, c.end)
            positions += pos
            bs = self.block_size
            slots += [table[p // bs] * bs + p % bs for p in pos]

        decode_tables = decode_lens = mask = None
        if decodes:
            max_blocks = max(len(t) for t in tables[:len(decodes)])
            # Pad with block 0: padded positions are masked out.
            decode_tables = self._tensor([t + [0] * (max_blocks - len(t)) for t in tables[:len(decodes)]])
            decode_lens = self._tensor([c.end for c in decodes])
            mask = decode_mask(decode_lens, max_blocks * self.block_size, self.kv_cache.dtype)
        meta = AttentionMetadata(self._tensor(slots), len(decodes), decode_tables, decode_lens, [], mask)
        start = len(decodes)
        for c, table in zip(prefills, tables[len(decodes):]):
            meta.prefills.append(PrefillChunkMeta(start, c.num_new_tokens, c.end, self._tensor(table)))
            start += c.num_new_tokens

        # Rows whose logits we need: the last token of each chunk that reaches its request's end.
        sample_rows, sample_chunks, end = [], [], 0
        for c in chunks:
            end += c.num_new_tokens
            if c.samples:
                sample_rows.append(end - 1)
                sample_chunks.append(c)

        with forward_context(meta, self.kv_cache, self.workspace):
            hidden = self.model(self._tensor(input_ids), self._tensor(positions))
        self._prompt_logprobs(chunks, hidden)
        if not sample_rows:
            return []
        logits = self.model.compute_logits(hidden[self._tensor(sample_rows)])
        requests = [c.request for c in sample_chunks]
        tokens, logprobs = self.sampler(logits, requests)
        return [SampledToken(r, t, lp) for r, t, lp in zip(requests, tokens, logprobs)]

    def _prompt_logprobs(self, chunks: list, hidden: torch.Tensor) -> None:
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

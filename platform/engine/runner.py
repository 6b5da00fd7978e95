"""Turn a scheduled batch into tensors, run the model, sample.

In: a `SchedulerOutput` (tensor-free). The runner lays the step's tokens out as
`[decode tokens..., prefill chunks...]` (a chunk of one token counts as a decode: attention for a
single query is the same either way) in a `StepInputs` (token ids, positions, slot mapping, block
tables, the rows that need logits), broadcasts it to the other ranks of a parallel replica, runs
the forward pass inside `forward_context` (`run_step`, which worker ranks run too), and samples
the rows of chunks that reach their request's last token. A decode-only step of a model that runs
in C on one rank skips all that: one call from token ids to logits (`_decode_in_one_call`); on a
GPU, one replay of a captured CUDA graph (`DecodeGraphs`).
Out: `(request, token id, logprob)` triples. A failure in sampling or logprobs is pinned to its
request: when the batch's sampling raises, each row is sampled alone, and a row that still raises
comes back with its `error` and no token (the engine aborts that request alone). A failure of the
forward pass raises. It does not decide what runs or when a request stops.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass

import torch

from pdserve.engine.attention import AttentionMetadata, PrefillChunkMeta, forward_context
from pdserve.engine.cuda_graphs import DecodeGraphs
from pdserve.engine.host_tensors import long_tensor
from pdserve.engine.kernels import cpu_decoder
from pdserve.engine.kernels.paged_attention import GatherWorkspace
from pdserve.engine.kv_cache import KVCache, KVCacheManager
from pdserve.engine.parallel import SINGLE, GroupInputs, ParallelState, StepInputs, broadcast_step
from pdserve.engine.outputs import TokenLogprob
from pdserve.engine.request import Request
from pdserve.engine.sampler import Sampler, needs_only_argmax, token_logprob
from pdserve.engine.scheduler import ScheduledChunk, SchedulerOutput


_UNDECIDED = object()


@dataclass
class SampledToken:
    request: Request
    token_id: int
    logprob: TokenLogprob | None
    error: Exception | None = None  # this request's sampling or logprobs failed: no token (-1)


class ModelRunner:
    def __init__(self, model: torch.nn.Module, kv_cache: KVCache, kv_manager: KVCacheManager | None,
                 sampler: Sampler | None, device: str | torch.device = "cpu", parallel: ParallelState = SINGLE,
                 decode_graphs: DecodeGraphs | None = None):
        self.model = model
        self.decode_graphs = decode_graphs  # decode steps as CUDA graphs, where captured
        self.kv_cache = kv_cache
        self.kv_manager = kv_manager  # None on worker ranks: the driver owns the block tables
        self.sampler = sampler
        self.device = torch.device(device)
        self.parallel = parallel
        self.block_size = kv_cache.block_size
        self.workspace = GatherWorkspace()
        # The model as one C call per decode step (cpu_decoder.DecoderModel), or None where it does not
        # run there; decided on the first decode-only step (a prefill pool's engine never takes one).
        self._c_decoder = _UNDECIDED

    def execute(self, out: SchedulerOutput) -> list[SampledToken]:
        # Decodes first: attention handles them as one batch, prefill chunks one by one.
        chunks = [c for c in out.chunks if c.num_new_tokens == 1] + [c for c in out.chunks if c.num_new_tokens > 1]
        prompt_rows = self._prompt_logprob_rows(chunks)
        # Rows whose logits we sample: the last token of each chunk that reaches its request's end.
        sample_rows, requests, end = [], [], 0
        for c in chunks:
            end += c.num_new_tokens
            if c.samples:
                sample_rows.append(end - 1)
                requests.append(c.request)
        self.sampler.start_masks(requests)  # grammar masks filled on other threads during the forward pass
        if chunks and not prompt_rows and len(requests) == end == len(chunks) and self.parallel.size == 1:
            decoded = self._decode_in_one_call(chunks, requests)
            if decoded is None and self.decode_graphs is not None and len(chunks) <= self.decode_graphs.max_batch:
                with torch.inference_mode():
                    decoded = self._sample(self.decode_graphs.run(*self._graph_rows(chunks)), requests)
            if decoded is not None:
                return decoded
        return self._execute(chunks, prompt_rows, sample_rows, requests)

    @torch.inference_mode()
    def _execute(self, chunks: list[ScheduledChunk], prompt_rows: list[tuple[int, int, Request]],
                 sample_rows: list[int], requests: list[Request]) -> list[SampledToken]:
        step = self._prepare(chunks, [row for row, _, _ in prompt_rows] + sample_rows, len(prompt_rows))
        if self.parallel.size > 1:
            broadcast_step(step, self.device)
        prompt_logits, logits = self.run_step(step)
        failed: dict[str, SampledToken] = {}
        if prompt_logits is not None:
            logprobs = torch.log_softmax(prompt_logits.float(), dim=-1)
            for row, (_, target, r) in zip(logprobs, prompt_rows):
                if r.request_id not in failed:
                    try:
                        r.prompt_logprobs.append(token_logprob(row, target, r.params.prompt_logprobs))
                    except Exception as e:  # noqa: BLE001 - this request's alone
                        failed[r.request_id] = SampledToken(r, -1, None, e)
        sampled = self._sample(logits, requests) if logits is not None else []
        if not failed:
            return sampled
        return [s for s in sampled if s.request.request_id not in failed] + list(failed.values())

    def _sample(self, logits: torch.Tensor, requests: list[Request]) -> list[SampledToken]:
        # A seeded row draws by its position (sampler.counter_seed): sampled again alone, it draws the same.
        try:
            tokens, logprobs = self.sampler(logits, requests)
        except Exception:  # noqa: BLE001 - pinned to the rows that raise alone, below
            return [self._sample_alone(logits[i:i + 1], r) for i, r in enumerate(requests)]
        return [SampledToken(r, t, lp) for r, t, lp in zip(requests, tokens, logprobs)]

    def _sample_alone(self, logits: torch.Tensor, r: Request) -> SampledToken:
        try:
            [token], [logprob] = self.sampler(logits, [r])
        except Exception as e:  # noqa: BLE001 - this request's alone
            return SampledToken(r, -1, None, e)
        return SampledToken(r, token, logprob)

    def _decode_in_one_call(self, chunks: list[ScheduledChunk], requests: list[Request]) -> list[SampledToken] | None:
        """A decode-only step where every row samples, in one C call from token ids to logits
        (or, when every request needs only its argmax, to tokens) where the model runs there
        (`cpu_decoder.decoder_for`); None where it does not. Its integers go as one int64 array,
        without tensors: on a cache the step's weights have just swept, each torch op (a tensor
        from a list, a split, a view, inference mode) costs ~10-60 us, a few percent of a batch-1
        step."""
        if self._c_decoder is _UNDECIDED:
            self._c_decoder = cpu_decoder.decoder_for(self.model, self.kv_cache)
        decoder = self._c_decoder
        if decoder is None:
            return None
        ids, positions, slots, lens, tables = self._decode_rows(chunks)
        width = max(len(t) for t in tables)
        ints = array("q", ids)
        for values in (positions, slots, lens):
            ints.extend(values)
        for t in tables:  # block tables, padded with block 0 (masked out by the lengths)
            ints.extend(t)
            ints.extend([0] * (width - len(t)))
        logits, tokens = decoder.decode_step(ints, len(chunks), width, greedy=needs_only_argmax(requests))
        if tokens is not None:
            return [SampledToken(r, t, None) for r, t in zip(requests, tokens)]
        with torch.inference_mode():
            return self._sample(logits, requests)

    def _decode_rows(self, chunks: list[ScheduledChunk]) -> tuple[list[int], list[int], list[int], list[int],
                                                                   list[list[int]]]:
        """A decode-only step's token ids, positions, cache slots, sequence lengths and block tables."""
        bs = self.block_size
        tables = [self.kv_manager.get_block_table(c.request.request_id) for c in chunks]
        return ([c.request.all_token_ids[c.start] for c in chunks], [c.start for c in chunks],
                [t[c.start // bs] * bs + c.start % bs for c, t in zip(chunks, tables)], [c.end for c in chunks],
                tables)

    def _graph_rows(self, chunks: list[ScheduledChunk]) -> tuple[list[int], list[int], list[int], list[list[int]],
                                                                  list[list[list[int]]]]:
        """A decode-only step's token ids, positions and sequence lengths, then each layer group's
        cache slots and block tables (`DecodeGraphs.run`'s arguments; one group where the model
        has one kind of layer)."""
        bs = self.block_size
        ids = [c.request.all_token_ids[c.start] for c in chunks]
        if self.kv_cache.layer_groups is None:
            groups = [[self.kv_manager.get_block_table(c.request.request_id) for c in chunks]]
        else:  # [request][group] -> [group][request]
            groups = [list(g) for g in zip(*(self.kv_manager.get_block_tables(c.request.request_id)
                                             for c in chunks))]
        slots = [[t[c.start // bs] * bs + c.start % bs for c, t in zip(chunks, tables)] for tables in groups]
        return ids, [c.start for c in chunks], [c.end for c in chunks], slots, groups

    @torch.inference_mode()
    def run_step(self, step: StepInputs) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The forward pass every rank runs: (prompt-logprob logits, sampling logits), each None
        when the step has no such rows (and on worker ranks, which only contribute shards)."""
        nd = 0 if step.decode_lens is None else step.decode_lens.numel()
        prefills = [PrefillChunkMeta(s, q, c, table) for s, q, c, table in step.prefills]
        meta = AttentionMetadata(step.slot_mapping, nd, step.decode_tables, step.decode_lens, prefills)
        if step.groups:  # a model of several layer groups: each its own slots and tables
            meta.groups = [meta] + [
                AttentionMetadata(g.slot_mapping, nd, g.decode_tables, step.decode_lens,
                                  [PrefillChunkMeta(s, q, c, table) for (s, q, c, _), table in
                                   zip(step.prefills, g.prefill_tables)]) for g in step.groups]
        k = step.num_prompt_rows
        with forward_context(meta, self.kv_cache, self.workspace):
            hidden = self.model(step.input_ids, step.positions)
        prompt = self.model.compute_logits(hidden[step.logit_rows[:k]]) if k else None
        sample = self.model.compute_logits(hidden[step.logit_rows[k:]]) if step.logit_rows.numel() > k else None
        return prompt, sample

    def _prepare(self, chunks: list[ScheduledChunk], logit_rows: list[int], num_prompt_rows: int) -> StepInputs:
        """The step's tensors for chunks ordered decodes first."""
        bs = self.block_size
        input_ids, positions, slots = [], [], []
        group_tables = None
        if self.kv_cache.layer_groups is not None:  # several layer groups: group 0's here, the rest below
            group_tables = [self.kv_manager.get_block_tables(c.request.request_id) for c in chunks]
            tables = [t[0] for t in group_tables]
        else:
            tables = [self.kv_manager.get_block_table(c.request.request_id) for c in chunks]
        for c, table in zip(chunks, tables):
            input_ids += c.request.all_token_ids[c.start:c.end]
            positions += range(c.start, c.end)
            slots += [table[p // bs] * bs + p % bs for p in range(c.start, c.end)]

        num_decodes = sum(1 for c in chunks if c.num_new_tokens == 1)
        max_blocks = max((len(t) for t in tables[:num_decodes]), default=0)
        # Pad with block 0: padded positions are masked out.
        decode_tables = [b for t in tables[:num_decodes] for b in t + [0] * (max_blocks - len(t))]
        decode_lens = [c.end for c in chunks[:num_decodes]]
        # One tensor for the step's integers, cut into views: each tensor built costs several
        # microseconds (and a host-to-device copy on GPUs); a batch-1 decode step is ~6 ms.
        parts = (input_ids, positions, slots, decode_tables, decode_lens, logit_rows)
        ids, pos, slot_mapping, tables_flat, lens, rows = self._tensor([v for part in parts for v in part]).split(
            [len(part) for part in parts])
        prefills, start = [], num_decodes
        for c, table in zip(chunks[num_decodes:], tables[num_decodes:]):
            prefills.append((start, c.num_new_tokens, c.end, self._tensor(table)))
            start += c.num_new_tokens
        groups = [] if group_tables is None else [
            self._group_inputs(chunks, [t[g] for t in group_tables], num_decodes, max_blocks)
            for g in range(1, len(group_tables[0]))]
        if not num_decodes:
            return StepInputs(ids, pos, slot_mapping, None, None, prefills, rows, num_prompt_rows, groups)
        return StepInputs(ids, pos, slot_mapping, tables_flat.view(num_decodes, max_blocks), lens, prefills, rows,
                          num_prompt_rows, groups)

    def _group_inputs(self, chunks: list[ScheduledChunk], tables: list[list[int]], num_decodes: int,
                      max_blocks: int) -> GroupInputs:
        """One more layer group's slots and block tables for the step (shapes as group 0's)."""
        bs = self.block_size
        slots = [table[p // bs] * bs + p % bs for c, table in zip(chunks, tables) for p in range(c.start, c.end)]
        decode = [b for t in tables[:num_decodes] for b in t + [0] * (max_blocks - len(t))]
        decode_tables = self._tensor(decode).view(num_decodes, max_blocks) if num_decodes else None
        return GroupInputs(self._tensor(slots), decode_tables, [self._tensor(t) for t in tables[num_decodes:]])

    @staticmethod
    def _prompt_logprob_rows(chunks: list[ScheduledChunk]) -> list[tuple[int, int, Request]]:
        """(row, target token, request) for prompt-token logprobs of chunks that asked for them.

        The logits at position p score prompt token p + 1. Positions already scored (a request
        recomputed after preemption) are skipped, so each token is scored once, in order.
        """
        out = []
        offset = 0
        for c in chunks:
            r = c.request
            if r.params.prompt_logprobs is not None:
                for p in range(max(c.start, len(r.prompt_logprobs) - 1), min(c.end, r.num_prompt_tokens - 1)):
                    out.append((offset + p - c.start, r.prompt_token_ids[p + 1], r))
            offset += c.num_new_tokens
        return out

    def _tensor(self, values) -> torch.Tensor:
        return long_tensor(values, self.device)

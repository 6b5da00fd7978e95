"""Turn a batch of next-token logits into sampled tokens, per-request parameters applied.

Order: grammar mask -> logit bias -> penalties -> greedy argmax, or temperature -> top-k ->
top-p -> min-p -> sample (a top-k of the vocabulary's size or more is no filter). vLLM applies
the mask after bias and penalties; the mask's -inf absorbs both (biases are finite, repetition
penalties positive), so the logits are the same, and the mask doubles as the copy that keeps the
caller's logits unwritten. Logit biases of the whole batch are added in one scatter; the grammar
mask is computed only for the rows whose request has a grammar (`Request.grammar`,
`pdserve.engine.grammar`), filled for all of them in one call into one packed bitmask (the
other rows allow every token), and applied to the whole batch in one pass (`ops.token_bitmask`),
which sets every token a grammar does not allow to -inf. The runner calls `start_masks` before
the forward pass: the masks depend only on the tokens each request has accepted, so they are
filled on a thread of their own (llguidance lets go of the GIL) while the model computes, and the
sampler takes them when it runs on the same requests.
Sampling draws `argmax(p / E)` with `E ~ Exp(1)` (equivalent to multinomial). A request with a seed
draws E from a generator seeded by its seed and the position of the token being drawn
(`counter_seed`), so its samples depend neither on what else is in the batch nor on which engine
draws them: a decode replica continues a sequence another engine began, the prefill replica that
drew its first token or a replica that died mid-stream, with no generator state carried over.
Log-probabilities are those of the model's raw logits (vLLM's default).

In: logits `[batch, vocab]` and the `Request`s they belong to (in the same order). Out: token ids
and, where asked, `TokenLogprob`s. It does not know about stop conditions.
"""

from __future__ import annotations

import operator
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from pdserve.engine.grammar import GrammarMatcher, allowed_token_bitmask
from pdserve.engine.kernels import ops
from pdserve.engine.outputs import TokenLogprob
from pdserve.engine.request import Request


class Sampler:
    def __init__(self, seed: int = 0):
        self.generator = torch.Generator().manual_seed(seed)
        self._mask_thread: ThreadPoolExecutor | None = None  # started with the first grammar
        self._pending: tuple[list[Request], Future] | None = None  # masks being filled for these requests

    def start_masks(self, requests: list[Request]) -> None:
        """Begin filling the grammar masks of `requests` (the rows the next call samples)."""
        self._pending = None
        rows = _grammar_rows(requests)
        if not rows:
            return
        if self._mask_thread is None:
            self._mask_thread = ThreadPoolExecutor(1, thread_name_prefix="pdserve-grammar-masks")
        self._pending = (list(requests), self._mask_thread.submit(allowed_token_bitmask, rows, len(requests),
                                                                  rows[0][1].vocab_size))

    def _bitmask(self, requests: list[Request]) -> torch.Tensor:
        """The batch's packed grammar masks (`allowed_token_bitmask`): the ones `start_masks`
        filled for these requests, else filled now."""
        pending, self._pending = self._pending, None
        if pending is not None and len(pending[0]) == len(requests) and all(map(operator.is_, pending[0], requests)):
            return torch.from_numpy(pending[1].result())
        rows = _grammar_rows(requests)
        return torch.from_numpy(allowed_token_bitmask(rows, len(requests), rows[0][1].vocab_size))

    def __call__(self, logits: torch.Tensor, requests: list[Request]) -> tuple[list[int], list[TokenLogprob | None]]:
        logits = logits.float()
        params = [r.params for r in requests]
        want_logprobs = [p.logprobs is not None for p in params]
        raw_logprobs = torch.log_softmax(logits, dim=-1) if any(want_logprobs) else None

        has_grammar = any(r.grammar is not None for r in requests)
        if has_grammar or any(p.has_penalties or p.logit_bias for p in params):
            # A copy either way: the caller's logits stay as they are.
            logits = ops.token_bitmask(logits, self._bitmask(requests)) if has_grammar else logits.clone()
            apply_logit_bias(logits, params)
            for i, r in enumerate(requests):
                if r.params.has_penalties:
                    apply_penalties(logits[i], r)

        if all(p.is_greedy for p in params):
            tokens = ops.argmax(logits)
        else:
            tokens = self._sample(logits, requests)
        token_list = tokens.tolist()

        logprobs: list[TokenLogprob | None] = [None] * len(requests)
        if raw_logprobs is not None:
            for i, want in enumerate(want_logprobs):
                if want:
                    logprobs[i] = token_logprob(raw_logprobs[i], token_list[i], params[i].logprobs)
        return token_list, logprobs

    def _sample(self, logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        params = [r.params for r in requests]
        greedy = torch.tensor([p.is_greedy for p in params])
        temperature = torch.tensor([p.temperature if not p.is_greedy else 1.0 for p in params])
        scaled = logits / temperature[:, None]
        vocab = logits.shape[-1]
        if any(0 < p.top_k < vocab or p.top_p < 1.0 or p.min_p > 0.0 for p in params):
            scaled = apply_filters(scaled, params)
        probs = scaled.softmax(dim=-1)
        noise = torch.empty_like(probs).exponential_(generator=self.generator)
        for i, r in enumerate(requests):
            if params[i].seed is not None and not params[i].is_greedy:
                position = torch.Generator(device=noise.device).manual_seed(counter_seed(params[i].seed,
                                                                                      r.num_output_tokens))
                noise[i].exponential_(generator=position)
        sampled = (probs / noise).argmax(dim=-1)
        return torch.where(greedy, ops.argmax(logits), sampled)


def counter_seed(seed: int, position: int) -> int:
    """The 64-bit seed of output position `position` of a sequence seeded `seed` (a signed 64-bit
    integer, SamplingParams): splitmix64 of the seed advanced `position + 1` steps, so nearby seeds
    and positions give unrelated streams."""
    x = (seed + 0x9E3779B97F4A7C15 * (position + 1)) % 2**64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) % 2**64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) % 2**64
    return x ^ (x >> 31)


def _grammar_rows(requests: list[Request]) -> list[tuple[int, GrammarMatcher]]:
    """(row, matcher) of each request that has a grammar."""
    return [(i, r.grammar) for i, r in enumerate(requests) if r.grammar is not None]


def needs_only_argmax(requests: list[Request]) -> bool:
    """Whether sampling these requests is each row's argmax and nothing else (greedy, no
    penalties, no logprobs): then a model that picks the argmax as it writes the logits (the C
    decode step) stands in for the sampler."""
    return all(r.params.is_greedy and not r.params.has_penalties and r.params.logprobs is None
               and not r.params.logit_bias and r.grammar is None for r in requests)


def apply_penalties(row: torch.Tensor, r: Request) -> None:
    """In place. Repetition (HF/CTRL style) over prompt and output; presence and frequency
    (OpenAI style) over the output only."""
    p = r.params
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(r.all_token_ids)), dtype=torch.long)
        vals = row[seen]
        row[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
    if (p.presence_penalty or p.frequency_penalty) and r.output_token_ids:
        counts = torch.bincount(torch.tensor(r.output_token_ids), minlength=row.shape[0])[: row.shape[0]]
        row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0)


def apply_logit_bias(logits: torch.Tensor, params) -> None:
    """In place: each row's `logit_bias`, the whole batch in one scatter (ids lie in the
    vocabulary: the engine checked them at admission)."""
    rows, tokens, biases = [], [], []
    for i, p in enumerate(params):
        for token, bias in p.logit_bias:
            rows.append(i)
            tokens.append(token)
            biases.append(bias)
    if rows:
        index = (torch.tensor(rows, device=logits.device), torch.tensor(tokens, device=logits.device))
        logits.index_put_(index, torch.tensor(biases, dtype=logits.dtype, device=logits.device), accumulate=True)


def apply_filters(logits: torch.Tensor, params) -> torch.Tensor:
    """Mask to -inf whatever top-k, top-p and min-p exclude, row by row parameters. A top-k of
    the vocabulary's size or more keeps every token."""
    vocab = logits.shape[-1]
    top_k = torch.tensor([min(p.top_k, vocab) if p.top_k > 0 else vocab for p in params])
    top_p = torch.tensor([p.top_p for p in params])
    min_p = torch.tensor([p.min_p for p in params])
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab)[None, :]
    remove = ranks >= top_k[:, None]
    probs = sorted_logits.masked_fill(remove, float("-inf")).softmax(dim=-1)
    # Drop a token when the tokens strictly before it already cover top_p; the first always stays.
    remove |= (probs.cumsum(dim=-1) - probs) >= top_p[:, None]
    remove |= probs < (min_p[:, None] * probs[:, :1])
    remove[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def token_logprob(row: torch.Tensor, token_id: int, num_top: int) -> TokenLogprob:
    lp = row[token_id].item()
    rank = int((row > lp).sum().item()) + 1
    top = ()
    if num_top:
        vals, ids = row.topk(min(num_top, row.shape[-1]))
        top = tuple(zip(ids.tolist(), vals.tolist()))
    return TokenLogprob(token_id, lp, rank, top)

"""The decode step in one C call (`cpu_decoder`): the same tokens, logprobs and KV cache as the
model layer by layer, whatever its threads do; which models it takes."""

from __future__ import annotations

from array import array

import pytest
import torch

from pdserve.engine.checkpoint import make_checkpoint
from pdserve.engine.kernels import cpu_decoder
from pdserve.engine.llm import LLM
from pdserve.engine.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def models(checkpoints, tmp_path_factory) -> dict[str, str]:
    """The session's tiny checkpoints and Qwen3's (q/k norms; a head_dim that is not hidden // heads),
    dense and MoE."""
    root = tmp_path_factory.mktemp("qwen3")
    return {**checkpoints, **{p: str(make_checkpoint(p, root / p, seed=0)) for p in ("tiny-qwen3", "tiny-qwen3-moe")}}


@pytest.mark.parametrize("preset,kv_cache_dtype,weight_dtype", [
    ("tiny-llama", "auto", "auto"), ("tiny-qwen2", "auto", "auto"),  # qwen2: qkv bias, tied embeddings
    ("tiny-qwen3", "auto", "auto"),  # qwen3: each q and k head normalised before rotary
    ("tiny-llama", "bfloat16", "auto"), ("tiny-llama", "auto", "bfloat16"), ("tiny-qwen2", "bfloat16", "bfloat16"),
    ("tiny-qwen3", "bfloat16", "bfloat16")])
def test_decode_steps_in_one_call_match_the_layer_by_layer_path(models, preset, kv_cache_dtype, weight_dtype,
                                                                monkeypatch):
    """A decode-only step runs in one C call from token ids to logits (`DecoderModel`); the same
    requests through the Python layers give the same tokens and logprobs, and leave the same bits
    in the KV cache (bf16: the C side rounds as torch does). Sequences of different lengths decode
    together, so attention reads different block tables in one call."""
    calls = []
    step = cpu_decoder.DecoderModel.decode_step
    monkeypatch.setattr(cpu_decoder.DecoderModel, "decode_step",
                        lambda self, *a, **kw: calls.append(1) or shapes.append(self.shape) or step(self, *a, **kw))
    shapes = []
    prompts = [list(range(5, 5 + n)) for n in (1, 9, 16, 17, 40)]
    params = SamplingParams(max_tokens=12, temperature=0.0, logprobs=3, ignore_eos=True)

    def generate(in_c: bool):
        with monkeypatch.context() as m:
            if not in_c:
                m.setattr(cpu_decoder, "decoder_for", lambda model, kv: None)
            llm = LLM(models[preset], block_size=4, kv_cache_dtype=kv_cache_dtype, weight_dtype=weight_dtype)
            outputs = [(o.token_ids, [lp.logprob for lp in o.logprobs]) for o in llm.generate(prompts, params)]
        return outputs, llm.engine.kv_cache.kv

    fused, fused_kv = generate(True)
    assert calls, "no decode step went through the one-call path"
    calls.clear()
    layered, layered_kv = generate(False)
    assert not calls
    assert fused_kv.dtype == (torch.bfloat16 if kv_cache_dtype == "bfloat16" else torch.float32)
    assert (shapes[0].weight_bf16, shapes[0].kv_bf16) == (weight_dtype == "bfloat16", kv_cache_dtype == "bfloat16")
    assert torch.equal(fused_kv, layered_kv)
    for (tokens, logprobs), (ref_tokens, ref_logprobs) in zip(fused, layered):
        assert tokens == ref_tokens
        torch.testing.assert_close(torch.tensor(logprobs), torch.tensor(ref_logprobs), atol=1e-4, rtol=1e-4)


def test_greedy_tokens_from_the_decode_step_are_its_logits_argmax(checkpoints, monkeypatch):
    """When every request only needs its argmax, the C decode step picks it as it writes the logits
    (each thread scans its own columns, then the threads' winners are compared): the same tokens as
    argmax over the logits, ties and NaN included, with the LM head split between two threads."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        llm = LLM(checkpoints["tiny-llama"], block_size=4)
        calls = []
        step = cpu_decoder.DecoderModel.decode_step
        monkeypatch.setattr(cpu_decoder.DecoderModel, "decode_step",
                            lambda self, *a, **kw: calls.append((self, a, kw)) or step(self, *a, **kw))
        prompts = [list(range(5, 5 + n)) for n in (1, 9, 16, 17, 40)]
        greedy = llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
        self, (ints, m, width), kw = calls[-1]
        assert m == len(prompts) and kw == {"greedy": True}, "plain greedy requests take their tokens from the step"
        # Same tokens as sampling from the logits (logprobs asked for: the sampler runs).
        sampled = llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=0))
        assert [o.token_ids for o in greedy] == [o.token_ids for o in sampled]

        head = llm.engine.model.lm_head
        panels = head.packed.view(-(-head.out_features // 16), -1, 16)  # [panels, in, 16]
        vocab = head.out_features
        original = head.packed.clone()

        def column(c: int) -> torch.Tensor:
            return panels[c // 16, :, c % 16]

        # (column, value) pairs over an all-zero head; [] alone: every logit 0, the first index wins.
        cases = [[], [(vocab - 3, float("nan")), (4, 1.0)], [(3, float("nan")), (vocab - 5, float("nan"))],
                 [(vocab - 10, 0.5)], [(vocab - 10, -0.5), (7, 0.5)]]
        _, tokens = step(self, ints, m, width, True)
        assert tokens == step(self, ints, m, width, False)[0].argmax(dim=-1).tolist()
        for case in cases:
            head.packed.zero_()
            for c, value in case:
                column(c).fill_(value)
            logits, tokens = step(self, ints, m, width, True)
            assert tokens == logits.argmax(dim=-1).tolist(), case
        head.packed.copy_(original)
    finally:
        torch.set_num_threads(threads)


def test_which_models_run_in_one_call(models, monkeypatch):
    """Dense models on the C kernels do (Qwen3 with its q/k norms too); a mixture of experts, or the
    torch path, does not (the runner then runs the model layer by layer)."""
    def decoder(preset: str):
        llm = LLM(models[preset], block_size=4)
        return cpu_decoder.decoder_for(llm.engine.model, llm.engine.kv_cache)

    assert isinstance(decoder("tiny-llama"), cpu_decoder.DecoderModel)
    assert isinstance(decoder("tiny-qwen3"), cpu_decoder.DecoderModel)
    assert decoder("tiny-mixtral") is None
    assert decoder("tiny-qwen3-moe") is None
    monkeypatch.setenv("PDSERVE_CPU_KERNELS", "torch")
    assert decoder("tiny-llama") is None


# -- The decode step's threads (pdserve_decoder) -------------------------------------------------
@pytest.fixture
def decode_steps(checkpoints, monkeypatch):
    """A tiny model after generating, and the decode steps it ran in one call: (ints, m, width)
    each. Twelve sequences of different lengths finish at different times (the batch shrinks from
    12), and the longest spans 24 blocks of 4 tokens."""
    llm = LLM(checkpoints["tiny-llama"], block_size=4)
    steps = []
    step = cpu_decoder.DecoderModel.decode_step
    with monkeypatch.context() as m:
        m.setattr(cpu_decoder.DecoderModel, "decode_step",
                  lambda self, ints, m_, width, greedy=False: steps.append((array("q", ints), m_, width))
                  or step(self, ints, m_, width, greedy))
        prompts = [list(range(5, 5 + n)) for n in (1, 3, 9, 16, 17, 20, 33, 40, 41, 52, 64, 80)]
        params = [SamplingParams(max_tokens=4 + 2 * i, temperature=0.0, ignore_eos=True) for i in range(12)]
        llm.generate(prompts, params)
    assert max(m_ for _, m_, _ in steps) == 12 and max(w for _, _, w in steps) > 16
    return llm, steps


def _replay(llm, steps, threads: int, chaos: tuple[int, int] | None, start: torch.Tensor):
    """The steps again on a fresh decoder (matmuls split into one-panel items) from the same cache
    contents: each step's logits and greedy tokens, and the decoder's counters."""
    model, kv = llm.engine.model, llm.engine.kv_cache
    kv.kv.copy_(start)
    decoder = cpu_decoder.decoder_for(model, kv)
    if chaos:
        decoder.chaos(*chaos)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return [decoder.decode_step(ints, m, width, greedy=True) for ints, m, width in steps], decoder.stats()
    finally:
        torch.set_num_threads(before)


def test_decode_step_results_do_not_depend_on_which_thread_computed_what(decode_steps, monkeypatch):
    """The decoder's threads share each phase's items and redo those a stalled thread sits on; a
    thread that wakes after its step has ended drops what it computed. Whatever the thread count
    and however threads stall (randomly here, for up to 0.5 ms before publishing and when a step
    begins, so late threads run into the following steps; 4 threads on 2 cores are descheduled
    too), every step's logits and tokens are the same bits as one thread's. The steps are replayed
    newest first, so the batch grows from 1 to 12 rows (the decoder's buffers grow mid-run)."""
    llm, steps = decode_steps
    monkeypatch.setattr(cpu_decoder, "DECODE_ITEM_BYTES", 1)  # one panel per item: many items per matmul
    steps = steps[::-1]
    start = llm.engine.kv_cache.kv.clone()
    expected, _ = _replay(llm, steps, 1, None, start)
    for threads, chaos in [(2, None), (2, (100, 500)), (4, (100, 500))]:
        got, stats = _replay(llm, steps, threads, chaos, start)
        for (logits, tokens), (want_logits, want_tokens) in zip(got, expected):
            assert torch.equal(logits, want_logits) and tokens == want_tokens, (threads, chaos)
        assert stats["steps"] == len(steps)
        if chaos:  # the stalls did make threads take over items and drop late results
            assert stats["redone"] > 0 and stats["dropped"] > 0, stats
        assert stats["stolen"] > 0, stats


def test_decode_step_rejects_out_of_range_inputs(decode_steps):
    """Indices are checked before anything runs: a bad token id, position, slot, length or block id
    raises ValueError and leaves the cache as it was."""
    llm, steps = decode_steps
    decoder = cpu_decoder.decoder_for(llm.engine.model, llm.engine.kv_cache)
    ints, m, width = steps[0]
    vocab, slots = decoder.shape.vocab, decoder.shape.num_blocks * decoder.shape.block_size
    before = llm.engine.kv_cache.kv.clone()
    for field, value in [(0, vocab), (0, -1), (1, decoder.shape.max_position), (2, slots), (3, 0),
                         (3, width * decoder.shape.block_size + 1), (4, decoder.shape.num_blocks)]:
        bad = array("q", ints)
        bad[field * m] = value
        with pytest.raises(ValueError, match="out of range"):
            decoder.decode_step(bad, m, width)
    assert torch.equal(llm.engine.kv_cache.kv, before)


def test_a_decoder_with_stalled_threads_frees_promptly(decode_steps):
    """Freeing a decoder joins its threads, stalled ones included (each finishes its item first)."""
    import time

    llm, steps = decode_steps
    decoder = cpu_decoder.decoder_for(llm.engine.model, llm.engine.kv_cache)
    decoder.chaos(1000, 20000)  # every thread sleeps up to 20 ms before every publish
    before = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        decoder.decode_step(*steps[0])
    finally:
        torch.set_num_threads(before)
    start = time.monotonic()
    decoder._free()
    assert time.monotonic() - start < 5

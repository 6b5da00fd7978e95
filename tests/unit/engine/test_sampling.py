"""Sampling parameters: filters, penalties, seeds, logprobs, stop conditions."""

import math

import pytest
import torch

from pdserve.engine.llm import LLM
from pdserve.engine.request import Request
from pdserve.engine.sampler import Sampler, apply_filters, apply_penalties
from pdserve.engine.sampling_params import SamplingParams
from pdserve.errors import InvalidRequestError


def _req(params, prompt=(1, 2, 3), output=()):
    r = Request("r", list(prompt), params, block_size=16)
    for t in output:
        r.append_token(t)
    return r


def test_filters_keep_exactly_the_allowed_tokens():
    logits = torch.log(torch.tensor([[0.5, 0.2, 0.15, 0.1, 0.05]] * 3))
    params = [SamplingParams(top_k=2), SamplingParams(top_p=0.8), SamplingParams(min_p=0.25)]
    kept = torch.isfinite(apply_filters(logits, params))
    assert kept[0].tolist() == [True, True, False, False, False]
    # 0.5 + 0.2 < 0.8, so the third token is needed to reach top_p; the fourth is not.
    assert kept[1].tolist() == [True, True, True, False, False]
    # min_p 0.25 of the top probability 0.5 keeps tokens with p >= 0.125.
    assert kept[2].tolist() == [True, True, True, False, False]


def test_penalties():
    row = torch.tensor([2.0, -2.0, 1.0, 1.0])
    apply_penalties(row, _req(SamplingParams(repetition_penalty=2.0), prompt=[0, 1]))
    assert row.tolist() == [1.0, -4.0, 1.0, 1.0]
    row = torch.tensor([0.0, 0.0, 0.0, 0.0])
    apply_penalties(row, _req(SamplingParams(presence_penalty=0.5, frequency_penalty=0.25), output=[2, 2, 3]))
    assert row.tolist() == [0.0, 0.0, -1.0, -0.75]


def test_sampler_greedy_and_logprobs():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    reqs = [_req(SamplingParams(temperature=0, logprobs=3)) for _ in range(3)]
    tokens, logprobs = Sampler()(logits, reqs)
    assert tokens == logits.argmax(-1).tolist()
    ref = torch.log_softmax(logits, -1)
    for i, lp in enumerate(logprobs):
        assert lp.token_id == tokens[i] and lp.rank == 1
        assert math.isclose(lp.logprob, ref[i, tokens[i]].item(), rel_tol=1e-6)
        assert [t for t, _ in lp.top] == ref[i].topk(3).indices.tolist()


def test_top_k_one_is_greedy():
    logits = torch.randn(4, 30, generator=torch.Generator().manual_seed(1))
    reqs = [_req(SamplingParams(temperature=1.0, top_k=1)) for _ in range(4)]
    tokens, _ = Sampler()(logits, reqs)
    assert tokens == logits.argmax(-1).tolist()


def test_sampling_follows_the_distribution():
    probs = torch.tensor([0.6, 0.3, 0.1])
    sampler = Sampler(seed=0)
    reqs = [_req(SamplingParams(temperature=1.0)) for _ in range(4000)]
    tokens, _ = sampler(probs.log().expand(4000, 3), reqs)
    freq = torch.bincount(torch.tensor(tokens), minlength=3) / 4000
    assert torch.allclose(freq, probs, atol=0.03)


def test_seeded_sampling_is_reproducible_and_independent_of_the_batch(tiny_llama):
    seeded = SamplingParams(max_tokens=20, temperature=1.0, top_p=0.9, seed=42)
    prompt = list(range(10, 40))
    [alone] = LLM(tiny_llama).generate([prompt], seeded)
    [again] = LLM(tiny_llama).generate([prompt], seeded)
    others = [list(range(50, 50 + n)) for n in (5, 70, 130)]
    crowd = LLM(tiny_llama, seed=9).generate(others[:1] + [prompt] + others[1:],
                                             [SamplingParams(max_tokens=30, temperature=1.0)] + [seeded]
                                             + [SamplingParams(max_tokens=25, temperature=0.7)] * 2)
    assert alone.token_ids == again.token_ids == crowd[1].token_ids
    [other_seed] = LLM(tiny_llama).generate([prompt], SamplingParams(max_tokens=20, temperature=1.0, seed=43))
    assert other_seed.token_ids != alone.token_ids


def test_stop_strings_cut_the_text(tiny_llama):
    llm = LLM(tiny_llama)
    prompt = "hello world the quick brown fox"
    [full] = llm.generate([prompt], SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
    stop = full.text[10:13]
    [cut] = llm.generate([prompt], SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, stop=[stop, "zzzz"]))
    assert cut.finish_reason == "stop" and cut.stop_reason == stop
    assert cut.text == full.text[: full.text.index(stop)]
    assert stop not in cut.text


def test_stop_token_and_max_tokens(tiny_llama):
    llm = LLM(tiny_llama)
    [full] = llm.generate(["paris is"], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    assert full.finish_reason == "length" and len(full.token_ids) == 12
    stop_id = full.token_ids[5]
    first = full.token_ids.index(stop_id)
    [cut] = llm.generate(["paris is"], SamplingParams(max_tokens=12, temperature=0, stop_token_ids=[stop_id]))
    assert cut.finish_reason == "stop" and cut.stop_reason == stop_id
    assert cut.token_ids == full.token_ids[: first + 1]


def test_eos_stops_unless_ignored(tiny_llama):
    llm = LLM(tiny_llama)
    eos = next(iter(llm.engine.eos_token_ids))
    # Force EOS to be the greedy choice by penalising nothing and asking for it as a stop: ignore_eos
    # must keep going past it while the default stops on it.
    [full] = llm.generate(["the"], SamplingParams(max_tokens=64, temperature=0, ignore_eos=True))
    if eos in full.token_ids:
        [stopped] = llm.generate(["the"], SamplingParams(max_tokens=64, temperature=0))
        assert stopped.token_ids[-1] == eos and stopped.finish_reason == "stop"
    llm.engine.eos_token_ids.add(full.token_ids[3])
    [stopped] = llm.generate(["the"], SamplingParams(max_tokens=64, temperature=0))
    assert stopped.finish_reason == "stop" and len(stopped.token_ids) <= 4
    [ignored] = llm.generate(["the"], SamplingParams(max_tokens=64, temperature=0, ignore_eos=True))
    assert ignored.token_ids == full.token_ids


@pytest.mark.parametrize("kwargs, param", [
    ({"temperature": -0.1}, "temperature"), ({"temperature": 2.5}, "temperature"),
    ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p"), ({"top_k": -2}, "top_k"),
    ({"min_p": 1.5}, "min_p"), ({"max_tokens": 0}, "max_tokens"), ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"presence_penalty": 3.0}, "presence_penalty"), ({"frequency_penalty": -3.0}, "frequency_penalty"),
    ({"logprobs": 21}, "logprobs"), ({"stop": [""]}, "stop"), ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"seed": "x"}, "seed"),
])
def test_invalid_sampling_parameters(kwargs, param):
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(**kwargs)
    assert e.value.param == param and param in str(e.value)

"""Every per-request value is checked before it reaches a tensor: each rule, its boundaries (the
largest allowed value passes, one past it fails naming the parameter), and values that are legal
but large (a top_k above the vocabulary) served as what they mean."""

import math

import pytest
import torch

from pdserve.config import EngineConfig
from pdserve.engine.engine import LLMEngine
from pdserve.engine.llm import LLM
from pdserve.engine.sampler import apply_filters, counter_seed, token_logprob
from pdserve.engine.sampling_params import SamplingParams
from pdserve.errors import InvalidRequestError

INT64_MAX, INT64_MIN = 2**63 - 1, -2**63


@pytest.mark.parametrize("kwargs", [
    {"top_k": 2**31 - 1}, {"top_k": 1}, {"top_k": 0}, {"top_k": -1},
    {"seed": INT64_MAX}, {"seed": INT64_MIN}, {"seed": 0},
    {"temperature": 0}, {"temperature": 2.0}, {"top_p": 1.0}, {"top_p": 1e-9}, {"min_p": 0.0}, {"min_p": 1},
    {"repetition_penalty": 2.0}, {"presence_penalty": -2.0}, {"presence_penalty": 2},
    {"frequency_penalty": 2.0}, {"logprobs": 20}, {"logprobs": 0}, {"prompt_logprobs": 20},
    {"max_tokens": 10**30}, {"stop_token_ids": [0]}, {"ignore_eos": True}, {"skip_special_tokens": False},
], ids=str)
def test_boundaries_pass(kwargs):
    SamplingParams(**kwargs)


@pytest.mark.parametrize("kwargs, param", [
    ({"top_k": 2**31}, "top_k"), ({"top_k": -2}, "top_k"), ({"top_k": 10**29}, "top_k"),
    ({"top_k": True}, "top_k"), ({"top_k": 1.0}, "top_k"),
    ({"seed": INT64_MAX + 1}, "seed"), ({"seed": INT64_MIN - 1}, "seed"), ({"seed": 2**64}, "seed"),
    ({"seed": True}, "seed"), ({"seed": 1.5}, "seed"),
    ({"max_tokens": True}, "max_tokens"), ({"max_tokens": 2.0}, "max_tokens"),
    ({"temperature": math.nan}, "temperature"), ({"temperature": math.inf}, "temperature"),
    ({"temperature": "1"}, "temperature"), ({"temperature": True}, "temperature"),
    ({"temperature": 2.0000001}, "temperature"), ({"top_p": math.nan}, "top_p"), ({"top_p": 0}, "top_p"),
    ({"min_p": math.inf}, "min_p"), ({"min_p": -math.inf}, "min_p"),
    ({"repetition_penalty": math.nan}, "repetition_penalty"), ({"repetition_penalty": 10**400}, "repetition_penalty"),
    ({"presence_penalty": -math.inf}, "presence_penalty"), ({"frequency_penalty": math.nan}, "frequency_penalty"),
    ({"frequency_penalty": 2.5}, "frequency_penalty"),
    ({"logprobs": True}, "logprobs"), ({"logprobs": -1}, "logprobs"), ({"prompt_logprobs": 21}, "prompt_logprobs"),
    ({"stop": 5}, "stop"), ({"stop": [5]}, "stop"),
    ({"stop_token_ids": [True]}, "stop_token_ids"), ({"stop_token_ids": 5}, "stop_token_ids"),
    ({"stop_token_ids": [1.0]}, "stop_token_ids"),
    ({"ignore_eos": 1}, "ignore_eos"), ({"skip_special_tokens": None}, "skip_special_tokens"),
], ids=str)
def test_invalid_values_name_their_parameter(kwargs, param):
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(**kwargs)
    assert e.value.param == param and str(e.value).startswith(param)


def test_huge_integers_give_short_messages():
    """An integer of thousands of digits is named by its size (Python would not print it at all)."""
    for kwargs in ({"seed": 10**5000}, {"top_k": -(10**5000)}, {"max_tokens": 1.5 + 0j}):
        with pytest.raises(InvalidRequestError) as e:
            SamplingParams(**kwargs)
        assert len(str(e.value)) < 120


def test_the_seed_range_maps_onto_generator_seeds():
    """Every signed 64-bit seed, at every position, gives a seed torch's generator takes; the
    extremes and neighbouring positions give distinct ones."""
    seeds = {(seed, position): counter_seed(seed, position)
             for seed in (INT64_MIN, -1, 0, 1, INT64_MAX) for position in (0, 1, 2**20)}
    assert all(0 <= v < 2**64 for v in seeds.values()) and len(set(seeds.values())) == len(seeds)
    for v in seeds.values():
        torch.Generator().manual_seed(v)


def test_stop_token_ids_must_lie_in_the_vocabulary(tiny_llama):
    engine = LLMEngine(EngineConfig(model=tiny_llama, num_kv_blocks=16))
    vocab = engine.arch.vocab_size
    engine.add_request("last", [5, 6], SamplingParams(max_tokens=2, stop_token_ids=[vocab - 1]))
    for bad in (vocab, 10**5000):
        with pytest.raises(InvalidRequestError) as e:
            engine.add_request("past", [5, 6], SamplingParams(max_tokens=2, stop_token_ids=[3, bad]))
        assert e.value.param == "stop_token_ids" and len(str(e.value)) < 120
    with pytest.raises(InvalidRequestError) as e:
        engine.add_request("prompt", [5, 10**5000], SamplingParams(max_tokens=2))
    assert e.value.param == "prompt" and len(str(e.value)) < 120
    assert engine.scheduler.num_unfinished == 1


def test_top_k_above_the_vocabulary_keeps_every_token():
    logits = torch.log(torch.tensor([[0.5, 0.2, 0.15, 0.1, 0.05]]))
    for top_k in (5, 6, 2**31 - 1):
        assert torch.isfinite(apply_filters(logits, [SamplingParams(top_k=top_k)])).all()
    # More top logprobs than the vocabulary has: all of them.
    assert len(token_logprob(logits[0].log_softmax(-1), 0, 20).top) == 5


def test_the_largest_top_k_samples_as_top_k_disabled(tiny_llama):
    llm = LLM(tiny_llama)
    vocab = llm.engine.arch.vocab_size
    prompt = list(range(10, 30))

    def tokens(top_k):
        params = SamplingParams(max_tokens=12, temperature=1.0, seed=3, top_k=top_k, ignore_eos=True)
        return llm.generate([prompt], params)[0].token_ids

    disabled = tokens(0)
    assert tokens(-1) == tokens(vocab) == tokens(vocab + 1) == tokens(2**31 - 1) == disabled
    assert tokens(1) != disabled  # (top_k does apply below the vocabulary)

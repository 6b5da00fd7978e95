"""Prefix-cache isolation: blocks are shared only between requests of the same cache salt, so one
tenant's cache hits say nothing about another's prompts; unsalted requests share as before."""

import pytest

from pdserve.config import EngineConfig
from pdserve.engine.block_hash import ROOT_BLOCK_HASH, block_hashes, root_hash
from pdserve.engine.engine import LLMEngine
from pdserve.engine.sampling_params import SamplingParams
from pdserve.errors import InvalidRequestError

PROMPT = list(range(3, 3 + 64))  # four 16-token blocks


def _cached_tokens(engine: LLMEngine, rid: str, salt: str | None) -> int:
    engine.add_request(rid, PROMPT, SamplingParams(max_tokens=1, temperature=0.0, cache_salt=salt))
    cached = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            cached = out.num_cached_tokens
    return cached


@pytest.fixture(scope="module")
def engine(tiny_llama):
    return LLMEngine(EngineConfig(model=tiny_llama, num_kv_blocks=64, block_size=16))


def test_salts_name_blocks_apart():
    assert root_hash(None) == root_hash("") == ROOT_BLOCK_HASH
    a, b = block_hashes(PROMPT, 16, root_hash("tenant-a")), block_hashes(PROMPT, 16, root_hash("tenant-b"))
    assert not set(a) & set(b) and not set(a) & set(block_hashes(PROMPT, 16))
    assert a == block_hashes(PROMPT, 16, root_hash("tenant-a"))  # the same in every process and pool


def test_blocks_are_shared_within_a_salt_only(engine):
    assert _cached_tokens(engine, "a1", "tenant-a") == 0
    assert _cached_tokens(engine, "a2", "tenant-a") == 48  # its own blocks (all but the last token's)
    assert _cached_tokens(engine, "b1", "tenant-b") == 0  # the same prompt, another tenant: no hit
    assert _cached_tokens(engine, "u1", None) == 0
    assert _cached_tokens(engine, "u2", None) == 48  # unsalted requests share as before
    assert engine.num_uncached_prompt_tokens(PROMPT, "tenant-a") == 16
    assert engine.num_uncached_prompt_tokens(PROMPT, "tenant-c") == 64


def test_a_salt_is_bounded():
    SamplingParams(cache_salt="s" * 512)
    for bad in ("s" * 513, 5):
        with pytest.raises(InvalidRequestError) as e:
            SamplingParams(cache_salt=bad)
        assert e.value.param == "cache_salt"

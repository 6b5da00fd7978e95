"""Incremental detokenization: the byte-level path gives what `tokenizers`' DecodeStream gives,
delta by delta, whatever the token ids (broken UTF-8, added and special tokens, unused ids)."""

import json
import random

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models
from tokenizers.decoders import DecodeStream

from pdserve.engine.tokenizer import IncrementalDetokenizer, Tokenizer


def _deltas_both_ways(tokenizer: Tokenizer, ids: list[int], skip_special_tokens: bool) -> tuple[list, list]:
    ours = IncrementalDetokenizer(tokenizer, skip_special_tokens=skip_special_tokens)
    assert ours.stream is None, "expected the byte-level path"
    reference = DecodeStream(skip_special_tokens=skip_special_tokens)
    return [ours.add(i) for i in ids], [reference.step(tokenizer.tok, i) or "" for i in ids]


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-qwen2"])
@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_byte_level_deltas_match_decode_stream_on_random_ids(checkpoints, preset, skip_special_tokens):
    tokenizer = Tokenizer(checkpoints[preset])
    n = tokenizer.vocab_size
    rng = random.Random(0)
    for _ in range(200):
        # Random ids make every kind of broken UTF-8; a few unused ids past the vocabulary too.
        ids = [rng.randrange(n + 3) for _ in range(rng.randrange(1, 40))]
        ours, reference = _deltas_both_ways(tokenizer, ids, skip_special_tokens)
        assert ours == reference, ids


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_byte_level_deltas_match_on_text_and_added_tokens(checkpoints, skip_special_tokens):
    tokenizer = Tokenizer(checkpoints["tiny-llama"])
    # Added tokens go through the byte-level decoder like the others ("\u00a9x" is the bytes A9 78, so
    # after the byte C3 it reads "\u00e9x"); one outside its alphabet (a space) is its own UTF-8.
    tokenizer.tok.add_tokens(["hello world", "\u00e9t\u00e9", "\u00a9x"])
    tokenizer.tok.add_special_tokens(["\u00a9y"])
    text = "na\u00efve caf\u00e9 \u65e5\u672c\u8a9e \U0001f600 hello world \u00e9t\u00e9 \u2028 tabs\tand\nlines"
    ids = tokenizer.encode(text, add_special_tokens=False)
    c3 = tokenizer.encode("\u00e9", add_special_tokens=False)[0]
    added = [tokenizer.tok.token_to_id(t) for t in ("\u00a9x", "\u00a9y")]
    ids = [3] + ids[:7] + [4, 1] + ids[7:] + [2, c3, added[0], c3, added[1], c3, 3] + ids[:2]
    ours, reference = _deltas_both_ways(tokenizer, ids, skip_special_tokens)
    assert ours == reference
    assert "".join(ours) == tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


def test_byte_level_path_cuts_at_stop_strings(checkpoints):
    tokenizer = Tokenizer(checkpoints["tiny-llama"])
    detok = IncrementalDetokenizer(tokenizer, stop=("caf",))
    text = "".join(detok.add(i) for i in tokenizer.encode("a caf\u00e9 b", add_special_tokens=False)) + detok.flush()
    assert text == "a " and detok.stopped_by == "caf"


def test_other_decoders_keep_decode_stream(tmp_path):
    tok = HFTokenizer(models.WordLevel({"\u2581hello": 0, "\u2581world": 1, "<unk>": 2}, unk_token="<unk>"))
    tok.decoder = decoders.Metaspace()
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({}))
    tokenizer = Tokenizer(tmp_path)
    assert tokenizer.byte_level_vocab is None
    detok = IncrementalDetokenizer(tokenizer)
    assert detok.stream is not None
    assert "".join(detok.add(i) for i in (0, 1)) == "hello world"


def test_a_stop_token_adds_no_text_even_with_special_tokens_kept(tiny_llama):
    """As vLLM: EOS or a token of `stop_token_ids` ends the output without its own text, so with
    `skip_special_tokens` false no `</s>` trails it (a tool call's parser reads that text)."""
    from pdserve.engine.llm import LLM
    from pdserve.engine.sampling_params import SamplingParams

    llm = LLM(tiny_llama, block_size=8, num_kv_blocks=64)
    eos = llm.engine.tokenizer.eos_token_id
    kept = dict(max_tokens=8, temperature=0, skip_special_tokens=False)
    [out] = llm.generate(["the quick brown"], SamplingParams(**kept, logit_bias=((eos, 100.0),)))
    assert (out.token_ids, out.text, out.finish_reason) == ([eos], "", "stop")
    [free] = llm.generate(["the quick brown"], SamplingParams(**kept, ignore_eos=True))
    second = free.token_ids[1]
    [out] = llm.generate(["the quick brown"], SamplingParams(**kept, stop_token_ids=(second,)))
    assert out.token_ids == free.token_ids[:2] and out.stop_reason == second
    assert out.text == llm.engine.tokenizer.decode(free.token_ids[:1], skip_special_tokens=False)

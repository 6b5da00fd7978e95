"""Every bound on a request's shape and every body-parsing rule, at its boundary: the largest
allowed value passes, one more is a 400 naming the `param`."""

import json

import pytest
from pydantic import ValidationError

from pdserve.config import GatewayConfig
from pdserve.errors import InvalidRequestError, PromptTooLongError
from pdserve.gateway.bounds import RequestBounds, check_logit_bias, max_chars_per_token, tokenizer_json
from pdserve.gateway.request_body import parse_json_object

BOUNDS = RequestBounds(max_prompts=3, max_sequences=6, max_n=2, max_stops=2, max_stop_chars=5,
                       max_stop_token_ids=2, max_logit_bias=2, max_messages=2, max_prompt_chars=10,
                       max_prompt_tokens=4)


def _param(fn, *args) -> str | None:
    with pytest.raises(InvalidRequestError) as e:
        fn(*args)
    return e.value.param


def test_counts_at_and_over_each_bound():
    at = {"prompt": ["a"] * 3, "messages": [{}] * 2, "stop": ["x"] * 2, "stop_token_ids": [1, 2],
          "logit_bias": {"1": 0, "2": 0}, "n": 2}
    BOUNDS.check_counts(at)
    for key, over in [("prompt", ["a"] * 4), ("prompt", [[1]] * 4), ("messages", [{}] * 3), ("stop", ["x"] * 3),
                      ("stop_token_ids", [1, 2, 3]), ("logit_bias", {"1": 0, "2": 0, "3": 0}), ("n", 3)]:
        assert _param(BOUNDS.check_counts, {**at, key: over}) == key
    BOUNDS.check_counts({"prompt": [1] * 4, "stop": "a str", "n": True})  # one prompt of token ids
    BOUNDS.check_counts({"prompt": "x", "messages": "not a list", "logit_bias": 5})  # types: pydantic's job


def test_prompt_message_and_stop_sizes_on_the_parsed_body():
    """Checked before the models are built (and, for large bodies, out of process): a prompt's
    characters or token ids, a chat's characters, a stop string's length. Wrong types pass, for
    the models to refuse."""
    at = [{"prompt": "x" * 10}, {"prompt": ["x" * 10, "y"]}, {"prompt": [1] * 4}, {"prompt": [[1] * 4, [2]]},
          {"messages": [{"content": "x" * 4}, {"content": [{"text": "x" * 3}, {"type": "image"}, "junk"],
                                               "tool_calls": [{"function": {"arguments": "{}1"}}, 5]}]},
          {"stop": "x" * 5}, {"stop": ["x" * 5, 7]}, {"prompt": 5, "messages": [5, {"content": 7}], "stop": 5}]
    for data in at:
        BOUNDS.check_counts(data)
    over = [("prompt", {"prompt": "x" * 11}), ("prompt", {"prompt": ["y", "x" * 11]}),
            ("prompt", {"prompt": [1] * 5}), ("prompt", {"prompt": [[2], [1] * 5]}),
            ("messages", {"messages": [{"content": "x" * 4}, {"content": [{"text": "x" * 7}]}]}),
            ("messages", {"messages": [{"content": "x" * 8, "tool_calls": [{"function": {"arguments": "{}1"}}]}]}),
            ("stop", {"stop": "x" * 6}), ("stop", {"stop": ["x", "x" * 6]})]
    for param, data in over:
        assert _param(BOUNDS.check_counts, data) == param
    with pytest.raises(PromptTooLongError):
        BOUNDS.check_counts({"prompt": [1] * 5})


def test_sequences_stops_and_characters():
    BOUNDS.check_sequences(3, 2)
    assert _param(BOUNDS.check_sequences, 4, 2) == "n"
    assert _param(BOUNDS.check_sequences, 7, 1) == "prompt"
    BOUNDS.check_stops(["12345", "x"])
    BOUNDS.check_stops("12345")
    assert _param(BOUNDS.check_stops, ["123456"]) == "stop"
    BOUNDS.check_prompt_chars(10, "prompt")
    assert _param(BOUNDS.check_prompt_chars, 11, "messages") == "messages"
    RequestBounds(*[1] * 8, max_prompt_chars=None).check_prompt_chars(10**9, "prompt")  # no bound


def test_logit_bias():
    assert check_logit_bias({"0": -100, "99": 100.0}, 100) == {0: -100, 99: 100.0}
    assert check_logit_bias(None, 100) == {}
    for bias in ({"100": 1}, {"-1": 1}, {"x": 1}, {"1": 100.5}, {"1": float("nan")}, {"1": float("inf")},
                 {"9" * 5000: 1}):
        assert _param(check_logit_bias, bias, 100) == "logit_bias"


def test_gateway_config_bounds_and_keys():
    b = RequestBounds.of(GatewayConfig(max_n=4), {"model": {"vocab": {"abc": 0, "abcdefg": 1}}}, 100)
    assert b.max_n == 4 and b.max_prompt_chars == 700 and b.max_prompt_tokens == 100
    assert b.max_prompts == GatewayConfig().max_prompts_per_request
    with pytest.raises(ValidationError, match="empty"):
        GatewayConfig(api_keys=["k", " "])


def test_characters_per_token_follow_what_tokenizing_keeps(tiny_llama):
    from pdserve.engine.tokenizer import Tokenizer

    tok = tokenizer_json(Tokenizer(tiny_llama))
    longest = max(len(p) for p in tok["model"]["vocab"])
    assert max_chars_per_token(tok) == longest  # byte-level BPE, no normalizer: every character kept
    nfc = {**tok, "normalizer": {"type": "NFC"}}
    assert max_chars_per_token(nfc) == 4 * longest
    seq = {**tok, "normalizer": {"type": "Sequence", "normalizers": [{"type": "NFKC"}, {"type": "StripAccents"}]}}
    assert max_chars_per_token(seq) is None  # accents stripped: no bound from the length
    split = {**tok, "pre_tokenizer": {"type": "Split", "behavior": "Removed"}}
    assert max_chars_per_token(split) is None
    assert max_chars_per_token({**tok, "pre_tokenizer": {"type": "WhitespaceSplit"}}) is None
    unigram = {"model": {"vocab": [["▁hello", -1.0], ["x", -2.0]]}}
    assert max_chars_per_token(unigram) == 6


@pytest.mark.parametrize("raw, match", [
    (b'{"prompt": "\xff"}', "UTF-8"),
    (b'{"prompt": ', "not valid JSON"),
    (b'{"prompt": NaN}', "NaN"),
    (b'{"prompt": Infinity}', "Infinity"),
    (b'{"a":' * 100_000 + b"1" + b"}" * 100_000, "nested too deeply"),
    (b'{"seed": ' + b"9" * 5000 + b"}", "not valid JSON"),
    (b'{"prompt": "a\\ud800b"}', "surrogate"),
    (b'{"prompt": ["ok", {"k\\udfff": 1}]}', "surrogate"),
    (b'[1, 2]', "JSON object"),
    (b'"x"', "JSON object"),
])
def test_malformed_bodies(raw, match):
    with pytest.raises(InvalidRequestError, match=match):
        parse_json_object(raw)


def test_well_formed_bodies_pass():
    assert parse_json_object(b'{"prompt": "\\ud83d\\ude00 \\u00e9", "seed": 18446744073709551616}') == {
        "prompt": "\U0001f600 \u00e9", "seed": 2**64}  # a pair of surrogates is one character
    deep = json.dumps({"a": [[[[{"b": "\\ud800 is text here"}]]]]}).encode()
    assert parse_json_object(deep)["a"][0][0][0][0]["b"] == "\\ud800 is text here"  # an escaped backslash

"""Bounds on one request's shape (the `gateway` config's `max_*` fields), checked before any
work: each violation is an `InvalidRequestError` naming the `param` (an OpenAI-shaped 400).

`check_counts` runs on the parsed JSON object, before the pydantic models build anything from
it (for large bodies, in a process of its own: `body_vetter.py`), so a request of 50,000
prompts costs a `len()`, not 50,000 objects, and a constraint's text (a JSON schema, regex,
choices or grammar: `structured.py`) over `max_structured_output_chars` is refused before
anything compiles it (a chat request's `tools` count among them), as are more than `max_tools`
tools, or tool calls in one message of the history, stop strings past their length, text
prompts (or a chat's messages) of more characters than the context could hold and prompts of
token ids longer than the context. The rest run on the validated request: `logit_bias` keys
and values, sequences per request.

The character bound (`max_prompt_chars`) rejects a text prompt that cannot fit `max_model_len`
whatever it says, without tokenizing it: no token of the vocabulary covers more characters than
its longest piece, so a prompt longer than `max_model_len` x that many characters is too long.
That holds where tokenizing keeps every character (byte-level or metaspace BPE, Unicode
normalization, which folds at most `_NORMALIZATION_FOLD` characters into one); a tokenizer whose
normalizer or pre-tokenizer may drop characters (strip, whitespace split) gets no such bound.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

from pdserve.config import GatewayConfig
from pdserve.errors import InvalidRequestError, PromptTooLongError
from pdserve.gateway.structured import constraint_chars

MAX_LOGIT_BIAS = 100.0  # OpenAI's range for a logit_bias value: [-100, 100]
# Unicode normalization (NFC/NFKC) composes at most three characters into one (Hangul L+V+T);
# one more for margin.
_NORMALIZATION_FOLD = 4
_KEEPS_CHARACTERS = {  # normalizers and pre-tokenizers that never drop input characters
    "normalizer": {"NFC", "NFD", "NFKC", "NFKD", "Prepend", "Lowercase", "Sequence", "Precompiled"},
    "pre_tokenizer": {"ByteLevel", "Metaspace", "Split", "Digits", "Punctuation", "UnicodeScripts", "Sequence"},
}


def max_chars_per_token(tokenizer_json: dict) -> int | None:
    """Most input characters one token can stand for under this tokenizer (tokenizer.json's
    parsed content), or None where its normalizer or pre-tokenizer may drop characters."""
    for part, kept in _KEEPS_CHARACTERS.items():
        for step in _steps(tokenizer_json.get(part)):
            if step.get("type") not in kept or (step.get("type") == "Split" and step.get("behavior") == "Removed"):
                return None
    vocab = tokenizer_json.get("model", {}).get("vocab") or {}
    pieces = vocab.keys() if isinstance(vocab, dict) else (entry[0] for entry in vocab)  # BPE / Unigram
    longest = max((len(p) for p in pieces), default=1)
    longest = max([longest] + [len(t.get("content", "")) for t in tokenizer_json.get("added_tokens", [])])
    return longest * (_NORMALIZATION_FOLD if tokenizer_json.get("normalizer") else 1)


def _steps(component: dict | None) -> list[dict]:
    if not component:
        return []
    inner = component.get("normalizers") or component.get("pretokenizers")
    return [step for c in inner for step in _steps(c)] if inner is not None else [component]


@dataclass(frozen=True)
class RequestBounds:
    max_prompts: int
    max_sequences: int
    max_n: int
    max_stops: int
    max_stop_chars: int
    max_stop_token_ids: int
    max_logit_bias: int
    max_messages: int
    max_prompt_chars: int | None  # None: no bound before tokenizing
    max_structured_output_chars: int = GatewayConfig.model_fields["max_structured_output_chars"].default
    max_tools: int = GatewayConfig.model_fields["max_tools"].default
    max_prompt_tokens: int | None = None  # max_model_len: a longer prompt of token ids cannot be served

    @classmethod
    def of(cls, gateway: GatewayConfig, tokenizer_json: dict, max_model_len: int) -> "RequestBounds":
        per_token = max_chars_per_token(tokenizer_json)
        return cls(gateway.max_prompts_per_request, gateway.max_sequences_per_request, gateway.max_n,
                   gateway.max_stop_sequences, gateway.max_stop_sequence_chars, gateway.max_stop_token_ids,
                   gateway.max_logit_bias_entries, gateway.max_chat_messages,
                   None if per_token is None else per_token * max_model_len, gateway.max_structured_output_chars,
                   gateway.max_tools, max_model_len)

    def check_counts(self, data: dict) -> None:
        """The sizes of a parsed body's lists and prompts, before anything is built from them."""
        prompt = data.get("prompt")
        prompts = prompt if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)) else [prompt]
        _at_most(len(prompts), self.max_prompts, "prompt", "prompts")
        for p in prompts:
            if isinstance(p, str):
                self.check_prompt_chars(len(p), "prompt")
            elif isinstance(p, list) and self.max_prompt_tokens is not None and len(p) > self.max_prompt_tokens:
                raise PromptTooLongError(f"this model's maximum context length is {self.max_prompt_tokens} tokens; "
                                         f"a prompt has {len(p)} token ids. Shorten it.", param="prompt")
        messages = data.get("messages")
        _at_most(_len(messages), self.max_messages, "messages", "messages")
        _at_most(_len(data.get("tools")), self.max_tools, "tools", "tools")
        for m in messages if isinstance(messages, list) else ():
            if isinstance(m, dict):
                _at_most(_len(m.get("tool_calls")), self.max_tools, "messages", "tool calls in a message")
        if isinstance(messages, list):
            self.check_prompt_chars(sum(_message_chars(m) for m in messages), "messages")
        stop = data.get("stop")
        stops = [stop] if isinstance(stop, str) else stop if isinstance(stop, list) else []
        _at_most(len(stops), self.max_stops, "stop", "stop sequences")
        self.check_stops([s for s in stops if isinstance(s, str)])
        _at_most(_len(data.get("stop_token_ids")), self.max_stop_token_ids, "stop_token_ids", "stop token ids")
        _at_most(_len(data.get("logit_bias")), self.max_logit_bias, "logit_bias", "logit_bias entries")
        chars, param = constraint_chars(data)
        if chars > self.max_structured_output_chars:
            raise InvalidRequestError(f"the output constraint has {chars} characters as JSON; at most "
                                      f"{self.max_structured_output_chars} are allowed", param=param)
        n = data.get("n")
        if isinstance(n, int) and not isinstance(n, bool) and n > self.max_n:
            raise InvalidRequestError(f"n must be at most {self.max_n}", param="n")

    def check_sequences(self, num_prompts: int, n: int) -> None:
        if num_prompts * n > self.max_sequences:
            raise InvalidRequestError(
                f"this request asks for {num_prompts * n} sequences ({num_prompts} prompts x n={n}); at most "
                f"{self.max_sequences} are allowed per request: split it", param="n" if n > 1 else "prompt")

    def check_stops(self, stop: str | list[str] | None) -> None:
        for s in [stop] if isinstance(stop, str) else stop or ():
            if len(s) > self.max_stop_chars:
                raise InvalidRequestError(f"a stop sequence has {len(s)} characters; at most {self.max_stop_chars} "
                                          "are allowed", param="stop")

    def check_prompt_chars(self, num_chars: int, param: str) -> None:
        if self.max_prompt_chars is not None and num_chars > self.max_prompt_chars:
            raise InvalidRequestError(
                f"the prompt has {num_chars} characters, more than this model's context could hold as tokens "
                f"(at most {self.max_prompt_chars}); shorten it", param=param)


def _message_chars(message) -> int:
    """A raw chat message's characters as the template receives them: its text (the content, or
    its parts' texts joined) and its tool calls' arguments. Values of wrong types count 0: the
    models reject them after."""
    if not isinstance(message, dict):
        return 0
    content, calls = message.get("content"), message.get("tool_calls")
    parts = [{"text": content}] if isinstance(content, str) else content if isinstance(content, list) else ()
    chars = sum(len(p["text"]) for p in parts if isinstance(p, dict) and isinstance(p.get("text"), str))
    for call in calls if isinstance(calls, list) else ():
        function = call.get("function") if isinstance(call, dict) else None
        arguments = function.get("arguments") if isinstance(function, dict) else None
        chars += len(arguments) if isinstance(arguments, str) else 0
    return chars


def check_logit_bias(bias: dict[str, float] | None, vocab_size: int) -> dict[int, float]:
    """`logit_bias` as {token id: bias}: keys are token ids of the vocabulary (as strings, in JSON),
    values finite and within +-100."""
    out = {}
    for key, value in (bias or {}).items():
        try:
            token = int(key)
        except ValueError:
            raise InvalidRequestError(f"logit_bias key {key[:32]!r} is not a token id", param="logit_bias") from None
        if not 0 <= token < vocab_size:
            raise InvalidRequestError(f"logit_bias key {token} is outside the vocabulary [0, {vocab_size})",
                                      param="logit_bias")
        if not math.isfinite(value) or abs(value) > MAX_LOGIT_BIAS:
            raise InvalidRequestError(f"logit_bias values lie in [-100, 100], got {value}", param="logit_bias")
        out[token] = value
    return out


def _len(x) -> int:
    return len(x) if isinstance(x, (list, dict)) else 0


def _at_most(count: int, limit: int, param: str, what: str) -> None:
    if count > limit:
        raise InvalidRequestError(f"at most {limit} {what} are allowed per request, got {count}", param=param)


def tokenizer_json(tokenizer) -> dict:
    """The parsed tokenizer.json of a pdserve `Tokenizer` (its `tokenizers` object's own form)."""
    return json.loads(tokenizer.tok.to_str())

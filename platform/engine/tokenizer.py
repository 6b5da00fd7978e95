"""Tokenizer of a local checkpoint: encode, decode, chat template, and incremental detokenization.

Reads tokenizer.json (the `tokenizers` library) and tokenizer_config.json (special tokens, chat
template, whether BOS is added). The chat template is rendered with Jinja2 in a sandbox, as
transformers does. `IncrementalDetokenizer` turns a stream of token ids into text deltas and cuts
at stop strings, holding back text that could still become one.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from pdserve.errors import InvalidRequestError, ModelLoadError


class Tokenizer:
    def __init__(self, model_dir: str | Path):
        from tokenizers import Tokenizer as HFTokenizer

        model_dir = Path(model_dir)
        if not model_dir.is_dir():
            raise ModelLoadError(f"{model_dir}: not a directory; pass a local checkpoint directory")
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise ModelLoadError(f"{model_dir}: no tokenizer.json (only fast tokenizers are supported)")
        self.tok = HFTokenizer.from_file(str(path))
        cfg_path = model_dir / "tokenizer_config.json"
        self.config = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
        self.chat_template: str | None = self.config.get("chat_template")
        self.bos_token = _token_str(self.config.get("bos_token"))
        self.eos_token = _token_str(self.config.get("eos_token"))
        self.eos_token_id = self.tok.token_to_id(self.eos_token) if self.eos_token else None
        self._template = None

    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # encode_batch lets go of the GIL while it works (encode does not): a long prompt tokenized
        # on a worker thread leaves the event loop and every other thread running.
        return self.tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tok.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None, **kwargs) -> str:
        """The prompt text, rendered as transformers renders it (the same `tojson`, `raise_exception`
        and `strftime_now`); `tools` are OpenAI's tool definitions, `kwargs` extra template
        variables. A template that fails on these messages is the request's fault (a 400)."""
        if not self.chat_template:
            raise InvalidRequestError("this model's tokenizer has no chat template; use /v1/completions",
                                      param="messages")
        if self._template is None:
            self._template = _compile_template(self.chat_template)
        from jinja2 import TemplateError

        try:
            return self._template.render(**kwargs, messages=messages, add_generation_prompt=add_generation_prompt,
                                         tools=tools, bos_token=self.bos_token or "", eos_token=self.eos_token or "")
        except (TemplateError, TypeError, ValueError) as e:
            raise InvalidRequestError(f"the chat template refused these messages: {str(e)[:300]}",
                                      param="messages") from None

    @cached_property
    def byte_level_vocab(self) -> ByteLevelVocab | None:
        """Each token's bytes, when the decoder is byte-level BPE's alone (GPT-2, Llama 3, Qwen2);
        None for other decoders (sentencepiece-style ones strip and replace characters)."""
        decoder = json.loads(self.tok.to_str()).get("decoder") or {}
        if decoder.get("type") != "ByteLevel":
            return None
        byte_of = _byte_level_alphabet()
        added = self.tok.get_added_tokens_decoder()
        pieces = []
        for i in range(self.tok.get_vocab_size(with_added_tokens=True)):
            token = added[i].content if i in added else self.tok.id_to_token(i)
            if token is None:
                pieces.append(b"")
            elif all(c in byte_of for c in token):
                pieces.append(bytes(byte_of[c] for c in token))
            else:  # what the decoder does with a token outside its alphabet: its own UTF-8
                pieces.append(token.encode())
        return ByteLevelVocab(pieces, frozenset(i for i, t in added.items() if t.special))

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        return self.encode_prompt_text(self.apply_chat_template(messages, add_generation_prompt))

    def encode_prompt_text(self, text: str) -> list[int]:
        """A rendered chat prompt's ids: the template writes BOS itself when the model wants one;
        do not add it twice."""
        ids = self.encode(text, add_special_tokens=True)
        if self.bos_token and text.startswith(self.bos_token) and len(ids) > 1 and ids[0] == ids[1]:
            ids = ids[1:]
        return ids


def _compile_template(source: str):
    """A chat template in a sandbox, with the helpers transformers gives templates."""
    from datetime import datetime

    from jinja2 import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise TemplateError(str(message))

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # transformers' filter: jinja2's own escapes HTML and sorts keys, which changes the prompt
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=lambda fmt: datetime.now().strftime(fmt))
    return env.from_string(source)


@dataclass
class ByteLevelVocab:
    pieces: list[bytes]  # by token id (added tokens too: the decoder reads them like any other); b"" if unused
    special: frozenset[int]


def _byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE's alphabet (GPT-2's `bytes_to_unicode`), character -> byte: printable bytes
    stand for themselves, the others for the characters from U+0100 on, in byte order."""
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), 256)}
    alphabet, shifted = {}, 0
    for b in range(256):
        if b in printable:
            alphabet[chr(b)] = b
        else:
            alphabet[chr(256 + shifted)] = b
            shifted += 1
    return alphabet


def _token_str(tok) -> str | None:
    if isinstance(tok, dict):
        return tok.get("content")
    return tok


class IncrementalDetokenizer:
    """Text deltas for one sequence's output tokens, with stop-string handling.

    `add(token_id)` returns the new text that is safe to emit; when a stop string appears, the
    text is cut before it and `stopped_by` names it. Up to `len(longest stop) - 1` characters are
    held back until it is clear they do not start a stop string; `flush()` releases them.

    Text comes out as `tokenizers`' `DecodeStream` gives it: a token whose bytes end in an
    incomplete or invalid UTF-8 sequence waits for the next. For byte-level vocabularies the
    bytes are joined here (~1 us a token against DecodeStream's ~30 us, which re-decodes its
    window through the Rust tokenizer on every call; a serving step pays it once per sequence).
    """

    def __init__(self, tokenizer: Tokenizer, stop: tuple[str, ...] = (), skip_special_tokens: bool = True):
        from tokenizers.decoders import DecodeStream

        self.tokenizer = tokenizer
        self.vocab = tokenizer.byte_level_vocab
        self.skip_special_tokens = skip_special_tokens
        self.pending = b""  # byte-level: bytes not yet a complete, valid UTF-8 text
        self.stream = DecodeStream(skip_special_tokens=skip_special_tokens) if self.vocab is None else None
        self.stop = stop
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.text = ""  # everything decoded so far (before any stop cut)
        self.emitted = 0  # characters of self.text already handed out
        self.stopped_by: str | None = None

    def add(self, token_id: int) -> str:
        if self.stopped_by is not None:
            return ""
        chunk = self._decode(token_id) if self.stream is None else self.stream.step(self.tokenizer.tok, token_id)
        if not chunk:
            return ""
        search_from = max(0, len(self.text) - self.hold)
        self.text += chunk
        hits = [(self.text.find(s, search_from), s) for s in self.stop]
        hits = [(idx, s) for idx, s in hits if idx != -1]
        if hits:
            idx, self.stopped_by = min(hits)
            self.text = self.text[:idx]
        limit = len(self.text) if self.stopped_by is not None else len(self.text) - self.hold
        return self._emit_to(limit)

    def flush(self) -> str:
        return self._emit_to(len(self.text))

    def _decode(self, token_id: int) -> str:
        """DecodeStream's step for a byte-level vocabulary."""
        if self.skip_special_tokens and token_id in self.vocab.special:
            return ""
        if 0 <= token_id < len(self.vocab.pieces):
            self.pending += self.vocab.pieces[token_id]
        text = self.pending.decode("utf-8", "replace")
        if text.endswith("\ufffd"):
            return ""
        self.pending = b""
        return text

    def _emit_to(self, limit: int) -> str:
        if limit <= self.emitted:
            return ""
        out = self.text[self.emitted:limit]
        self.emitted = limit
        return out

"""Tokenizer of a local checkpoint: encode, decode, chat template, and incremental detokenization.

Reads tokenizer.json (the `tokenizers` library) and tokenizer_config.json (special tokens, chat
template, whether BOS is added). The chat template is rendered with Jinja2 in a sandbox, as
transformers does. `IncrementalDetokenizer` turns a stream of token ids into text deltas and cuts
at stop strings, holding back text that could still become one.
"""

from __future__ import annotations

import json
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
        return self.tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tok.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        if not self.chat_template:
            raise InvalidRequestError("this model's tokenizer has no chat template; use /v1/completions",
                                      param="messages")
        if self._template is None:
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            self._template = env.from_string(self.chat_template)
        return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                     bos_token=self.bos_token or "", eos_token=self.eos_token or "")

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        # The template writes BOS itself when the model wants one; do not add it twice.
        text = self.apply_chat_template(messages, add_generation_prompt)
        ids = self.encode(text, add_special_tokens=True)
        if self.bos_token and text.startswith(self.bos_token) and len(ids) > 1 and ids[0] == ids[1]:
            ids = ids[1:]
        return ids


def _token_str(tok) -> str | None:
    if isinstance(tok, dict):
        return tok.get("content")
    return tok


class IncrementalDetokenizer:
    """Text deltas for one sequence's output tokens, with stop-string handling.

    `add(token_id)` returns the new text that is safe to emit; when a stop string appears, the
    text is cut before it and `stopped_by` names it. Up to `len(longest stop) - 1` characters are
    held back until it is clear they do not start a stop string; `flush()` releases them.
    """

    def __init__(self, tokenizer: Tokenizer, stop: tuple[str, ...] = (), skip_special_tokens: bool = True):
        from tokenizers.decoders import DecodeStream

        self.tokenizer = tokenizer
        self.stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        self.stop = stop
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.text = ""  # everything decoded so far (before any stop cut)
        self.emitted = 0  # characters of self.text already handed out
        self.stopped_by: str | None = None

    def add(self, token_id: int) -> str:
        if self.stopped_by is not None:
            return ""
        chunk = self.stream.step(self.tokenizer.tok, token_id)
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

    def _emit_to(self, limit: int) -> str:
        if limit <= self.emitted:
            return ""
        out = self.text[self.emitted:limit]
        self.emitted = limit
        return out

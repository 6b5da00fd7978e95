"""Grammar-constrained decoding on CPU (#45): xgrammar against llguidance, side by side in one run.

    python benchmarks/grammar_mask.py [--steps 200] [--repeats 3] [--vocabs 512,32000,150000]

What a constrained decode step adds on the engine's thread: filling one request's token bitmask
for the next position and advancing the matcher by the sampled token. Each library walks random
paths through four JSON schemas (a flat object, a nested one with arrays and enums, strings with
patterns and lengths, a 20-property record) under a seeded generator: at each step it fills the
mask, draws an allowed token (the draw is not timed) and advances; a path that ends restarts.
Grammar compile time is the time from schema to a matcher with its first mask filled (xgrammar
compiles eagerly with its cache off; llguidance builds its lexer lazily, so its first mask is part
of its compile), the median of `--repeats` compiles.

Vocabularies: the tiny models' byte-level BPE (512), and byte-level BPEs of 32k and 150k tokens
(Llama 2 / Qwen sized) trained here on the Python standard library's sources (nothing can be
downloaded); each is trained once and kept under the pdserve cache directory. JSON without free
whitespace, as pdserve serves it by default. Prints a markdown table and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import sysconfig
import time
from pathlib import Path

import numpy as np

from machine import machine_line  # this folder's scripts run with it on sys.path
from pdserve.engine.checkpoint import build_tokenizer, cache_dir

SCHEMAS = {
    "flat": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                              "age": {"type": "integer", "minimum": 0, "maximum": 150},
                                              "ok": {"type": "boolean"}},
             "required": ["name", "age", "ok"], "additionalProperties": False},
    "nested": {"type": "object", "properties": {
        "user": {"type": "object", "properties": {"id": {"type": "integer"},
                                                  "role": {"enum": ["admin", "user", "guest"]}},
                 "required": ["id", "role"], "additionalProperties": False},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 4},
        "scores": {"type": "array", "items": {"type": "number", "minimum": 0, "maximum": 1}, "maxItems": 3}},
        "required": ["user", "tags"], "additionalProperties": False},
    "patterns": {"type": "object", "properties": {
        "date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"},
        "code": {"type": "string", "pattern": "^[A-Z]{3}[0-9]{3}$"},
        "note": {"type": "string", "minLength": 2, "maxLength": 16}},
        "required": ["date", "code", "note"], "additionalProperties": False},
    "record20": {"type": "object", "properties": {
        f"field_{i}": [{"type": "integer"}, {"type": "string", "maxLength": 12}, {"type": "boolean"},
                       {"enum": ["a", "b", "c"]}][i % 4] for i in range(20)},
        "required": [f"field_{i}" for i in range(20)], "additionalProperties": False},
}


def _corpus() -> list[str]:
    lib = Path(sysconfig.get_paths()["stdlib"])
    texts = []
    for path in sorted(lib.rglob("*.py")):
        if "site-packages" in path.parts:
            continue
        try:
            texts.append(path.read_text(errors="ignore"))
        except OSError:
            pass
    return texts


def tokenizer_json(vocab_size: int) -> str:
    """A byte-level BPE's tokenizer.json with `vocab_size` tokens (the tiny models' own at 512)."""
    if vocab_size <= 1024:
        return build_tokenizer(vocab_size).to_str()
    path = cache_dir() / f"bench-bpe-{vocab_size}.json"
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(build_tokenizer(vocab_size, _corpus()).to_str())
    return path.read_text()


class LLGuidance:
    name = "llguidance"

    def __init__(self, tok_json: str, eos: int):
        import llguidance

        self.lib = llguidance
        self.tok = llguidance.LLTokenizer(tok_json, eos_token=eos)
        self.vocab = self.tok.vocab_size

    def compile(self, schema: dict):
        grammar = self.lib.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False})
        m = self.lib.LLMatcher(self.tok, grammar)
        assert not m.is_error(), m.get_error()
        return m

    def fill(self, m, mask) -> None:
        m.unsafe_compute_mask_ptr(mask.data_ptr(), mask.numel() * 4)  # what the engine calls

    def advance(self, m, token: int) -> None:
        assert m.consume_token(token), m.get_error()

    def is_done(self, m) -> bool:
        return m.is_stopped()


class XGrammar:
    name = "xgrammar"

    def __init__(self, tok_json: str, eos: int):
        import xgrammar

        self.lib = xgrammar
        vocab = json.loads(tok_json)
        pieces = [""] * (max(vocab["model"]["vocab"].values()) + 1)
        for piece, i in vocab["model"]["vocab"].items():
            pieces[i] = piece
        for t in vocab.get("added_tokens", []):
            pieces[t["id"]] = t["content"]
        self.vocab = len(pieces)
        info = xgrammar.TokenizerInfo(pieces, vocab_type=xgrammar.VocabType.BYTE_LEVEL, stop_token_ids=[eos])
        self.compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)

    def compile(self, schema: dict):
        return self.lib.GrammarMatcher(self.compiler.compile_json_schema(json.dumps(schema), any_whitespace=False))

    def fill(self, m, mask) -> None:
        m.fill_next_token_bitmask(mask, 0)

    def advance(self, m, token: int) -> None:
        assert m.accept_token(token)

    def is_done(self, m) -> bool:
        return m.is_terminated()


def allowed(mask, vocab: int) -> np.ndarray:
    bits = np.unpackbits(mask[0].numpy().view(np.uint8), bitorder="little")[:vocab]
    return np.flatnonzero(bits)


def measure(lib, schema: dict, steps: int, repeats: int, seed: int) -> dict:
    import torch

    mask = torch.full((1, (lib.vocab + 31) // 32), -1, dtype=torch.int32)
    compile_s = []
    for _ in range(repeats + 1):  # the first warms up
        t0 = time.perf_counter()
        m = lib.compile(schema)
        lib.fill(m, mask)
        compile_s.append(time.perf_counter() - t0)
    rng = np.random.default_rng(seed)
    fill_s, advance_s, num_paths = [], [], 1
    m = lib.compile(schema)
    for _ in range(steps):
        t0 = time.perf_counter()
        lib.fill(m, mask)
        t1 = time.perf_counter()
        ok = allowed(mask, lib.vocab)
        token = int(rng.choice(ok))
        t2 = time.perf_counter()
        lib.advance(m, token)
        t3 = time.perf_counter()
        fill_s.append(t1 - t0)
        advance_s.append(t3 - t2)
        if lib.is_done(m):
            m, num_paths = lib.compile(schema), num_paths + 1
    return {"compile_ms": statistics.median(compile_s[1:]) * 1e3,
            "fill_us": statistics.mean(fill_s) * 1e6, "fill_p99_us": float(np.percentile(fill_s, 99)) * 1e6,
            "advance_us": statistics.mean(advance_s) * 1e6, "paths": num_paths}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--vocabs", default="512,32000,150000")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    print(machine_line(), file=sys.stderr)
    import torch

    torch.set_num_threads(1)
    rows, import_s = [], {}
    for vocab_size in (int(v) for v in args.vocabs.split(",")):
        tok_json = tokenizer_json(vocab_size)
        eos = json.loads(tok_json)["added_tokens"][1]["id"]
        for cls in (LLGuidance, XGrammar):
            if cls.name not in import_s:
                t0 = time.perf_counter()
                __import__(cls.name)
                import_s[cls.name] = time.perf_counter() - t0
            t0 = time.perf_counter()
            lib = cls(tok_json, eos)
            setup_ms = (time.perf_counter() - t0) * 1e3
            measure(lib, SCHEMAS["flat"], 20, 1, args.seed)  # warm-up: the library's first masks
            for name, schema in SCHEMAS.items():
                r = measure(lib, schema, args.steps, args.repeats, args.seed)
                rows.append({"library": lib.name, "vocab": lib.vocab, "schema": name,
                             "tokenizer_setup_ms": setup_ms, **r})
    print("| vocab | schema | library | fill (us, mean / p99) | advance (us) | fill + advance (us) "
          "| compile (ms) | tokenizer setup (ms) |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['vocab']} | {r['schema']} | {r['library']} | {r['fill_us']:.0f} / {r['fill_p99_us']:.0f} "
              f"| {r['advance_us']:.0f} | {r['fill_us'] + r['advance_us']:.0f} | {r['compile_ms']:.1f} "
              f"| {r['tokenizer_setup_ms']:.0f} |")
    print("\nimport (s): " + ", ".join(f"{k} {v:.2f}" for k, v in import_s.items()))
    print(json.dumps({"bench": "grammar_mask", "steps": args.steps, "import_s": import_s, "rows": rows}))


if __name__ == "__main__":
    main()

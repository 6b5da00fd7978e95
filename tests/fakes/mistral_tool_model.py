"""A tiny checkpoint that calls tools as Mistral's v11 models do, made from a generated tiny one
(nothing downloaded): Mistral's control tokens as special tokens of its vocabulary, a chat
template with their conventions (tools in `[AVAILABLE_TOOLS]`, a call written
`[TOOL_CALLS]name[ARGS]{...}`, its result in `[TOOL_RESULTS]...[/TOOL_RESULTS]`), and weights
that make it call a tool on its own.

The weights are a next-token table: every layer's output projections are zero, so the last
position's hidden state is its token's embedding, and the embeddings of the tokens in `CHAINS`
are unit vectors that the LM head maps to their successor. After `[/INST]` the model writes
`CALL` and ends; after `[/TOOL_RESULTS]` it writes `ANSWER`. A table has one successor per
token, so the call's tokens must all differ: the argument text around the values is added as
tokens of its own (`PIECES`). Other tokens keep the base model's embeddings, with the table's
dimensions cleared.

The template picks the gateway's mistral call format, in v11's form, under the "auto" setting.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

SPECIAL = ("[INST]", "[/INST]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]", "[TOOL_CALLS]", "[ARGS]",
           "[TOOL_RESULTS]", "[/TOOL_RESULTS]")
PIECES = ('{"city": "', '", "unit": "', '"}')
CALL_NAME, CALL_ARGUMENTS = "weather", '{"city": "Paris", "unit": "c"}'
CALL = f"[TOOL_CALLS]{CALL_NAME}[ARGS]{CALL_ARGUMENTS}"
ANSWER = "It is sunny."
CHAINS = (("[/INST]", CALL), ("[/TOOL_RESULTS]", ANSWER))  # (last prompt token, what the model writes)
LOGIT = 4.0  # a successor's weight: its logit is 8x this (RMS-normed unit vector of 64 dims), others ~0

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}"
    "{% for message in messages %}"
    "{% if message.role in ('system', 'user') %}[INST]{{ message.content }}[/INST]"
    "{% elif message.role == 'assistant' %}{{ message.content }}"
    "{% for call in message.tool_calls or [] %}"
    "[TOOL_CALLS]{{ call.function.name }}[ARGS]{{ call.function.arguments | tojson }}"
    "{% endfor %}{{ eos_token }}"
    "{% elif message.role == 'tool' %}[TOOL_RESULTS]{{ message.content }}[/TOOL_RESULTS]"
    "{% endif %}"
    "{% endfor %}"
)


def make_mistral_tool_model(base_dir: str | Path, out_dir: str | Path) -> Path:
    """`base_dir` (a tiny Llama checkpoint from `make_checkpoint`) copied to `out_dir` as the model."""
    import torch
    from safetensors.torch import load_file, save_file
    from tokenizers import AddedToken, Tokenizer

    base, out = Path(base_dir), Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for f in base.iterdir():
        shutil.copy(f, out / f.name)
    tok = Tokenizer.from_file(str(base / "tokenizer.json"))
    tok.add_special_tokens([AddedToken(t, normalized=False) for t in SPECIAL])
    tok.add_tokens([AddedToken(p, normalized=False) for p in PIECES])
    tok.save(str(out / "tokenizer.json"))
    cfg = json.loads((base / "tokenizer_config.json").read_text())
    cfg["chat_template"] = CHAT_TEMPLATE
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2))

    weights = load_file(str(base / "model.safetensors"))
    vocab_size = tok.get_vocab_size(with_added_tokens=True)
    emb, head = weights["model.embed_tokens.weight"], weights["lm_head.weight"]
    grown = vocab_size - emb.shape[0]
    emb = torch.cat([emb, emb[-grown:].clone()])  # the new tokens start from existing rows
    head = torch.cat([head, head[-grown:].clone()])
    eos = tok.token_to_id(cfg["eos_token"])
    pairs = []
    for start, text in CHAINS:
        ids = [tok.token_to_id(start), *tok.encode(text, add_special_tokens=False).ids, eos]
        pairs += zip(ids, ids[1:])
    table = {}
    for token, successor in pairs:
        assert token not in table, f"token {tok.id_to_token(token)!r} would need two successors"
        table[token] = successor
    dims = list(range(len(table)))
    assert len(dims) <= emb.shape[1]
    emb[:, dims] = 0.0
    head[:, dims] = 0.0
    for dim, (token, successor) in zip(dims, table.items()):
        emb[token] = 0.0
        emb[token, dim] = 1.0
        head[successor, dim] = LOGIT
    weights["model.embed_tokens.weight"], weights["lm_head.weight"] = emb.contiguous(), head.contiguous()
    weights["model.norm.weight"] = torch.ones_like(weights["model.norm.weight"])
    for name in list(weights):
        if name.endswith(("self_attn.o_proj.weight", "mlp.down_proj.weight")):
            weights[name] = torch.zeros_like(weights[name])
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((base / "config.json").read_text())
    config["vocab_size"] = vocab_size
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out

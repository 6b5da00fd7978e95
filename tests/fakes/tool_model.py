"""A tiny checkpoint that calls tools and thinks as Qwen3 does, made from a generated tiny one
(nothing downloaded): the same weights, a Qwen3-style chat template (tools in a system block,
`<tool_call>` JSON, `<tool_response>` history, a `<think>` the template opens when
`enable_thinking` is true and leaves closed and empty otherwise), and `</think>` as a token of
its own (the unused `<unk>`, id 0, renamed) so a test can make it likely with `logit_bias`.

The template picks the gateway's Hermes call format and `<think>` reasoning parser under the
"auto" settings, as a real Qwen3 checkpoint's does.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

END_THINK_ID = 0

CHAT_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n"
    "{% if messages[0].role == 'system' %}{{ messages[0].content }}\n{% endif %}"
    "# Tools\n<tools>"
    "{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}\n</tools>\n"
    "Call one with <tool_call>\n{\"name\": <name>, \"arguments\": <object>}\n</tool_call><|im_end|>\n"
    "{% elif messages[0].role == 'system' %}<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if message.role == 'user' %}<|im_start|>user\n{{ message.content }}<|im_end|>\n"
    "{% elif message.role == 'assistant' %}<|im_start|>assistant\n{{ message.content.split('</think>')[-1] }}"
    "{% for call in message.tool_calls or [] %}\n<tool_call>\n"
    "{\"name\": \"{{ call.function.name }}\", \"arguments\": {{ call.function.arguments | tojson }}}\n</tool_call>"
    "{% endfor %}<|im_end|>\n"
    "{% elif message.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ message.content }}\n"
    "</tool_response><|im_end|>\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking %}<think>\n{% else %}<think>\n\n</think>\n\n{% endif %}"
    "{% endif %}"
)


def make_tool_model(base_dir: str | Path, out_dir: str | Path) -> Path:
    """`base_dir` (a tiny checkpoint from `make_checkpoint`) copied to `out_dir` as the tool model."""
    base, out = Path(base_dir), Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for f in base.iterdir():
        shutil.copy(f, out / f.name)
    tok = json.loads((base / "tokenizer.json").read_text())
    [unk] = [t for t in tok["added_tokens"] if t["id"] == END_THINK_ID]
    unk.update(content="</think>", special=False)
    vocab = tok["model"]["vocab"]
    vocab["</think>"] = vocab.pop("<unk>")
    (out / "tokenizer.json").write_text(json.dumps(tok))
    cfg = json.loads((base / "tokenizer_config.json").read_text())
    cfg.pop("unk_token", None)
    cfg["chat_template"] = CHAT_TEMPLATE
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2))
    return out

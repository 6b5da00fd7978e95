"""A hostile client's corpus: malformed bodies, values that once killed an engine, and requests past
every bound of the gateway's default config, each with the answer it must get. The unit tests send
it to `OpenAIService` alone, the e2e tests to a running app.

Every entry is `(name, path, body, status, param)`; a body is a dict (sent as JSON) or raw bytes.
The defaults it assumes: `max_body_bytes` 4 MiB, `max_n` 16, and a model whose context holds a few
hundred tokens (it asks for 1,000 prompt tokens and expects a 400).
"""

from __future__ import annotations


def completion(model: str | None = None, **fields) -> dict:
    return {"model": model, "prompt": "hello", "max_tokens": 2, **fields}


def chat(model: str | None = None, **fields) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **fields}


def hostile_requests(model: str | None = None) -> list[tuple[str, str, dict | bytes, int, str | None]]:
    def c(**fields):
        return {**completion(model), **fields}

    def m(**fields):
        return {**chat(model), **fields}

    user = {"role": "user", "content": "x"}
    long_prompt = [5] * 40  # long enough to be prefilled remotely in a disaggregated app
    return [
        ("top_k past any vocabulary", "/v1/completions", c(top_k=10**29), 400, "top_k"),
        ("top_k past any vocabulary, remote prefill", "/v1/completions", c(prompt=long_prompt, top_k=10**29), 400,
         "top_k"),
        ("seed of 2**64", "/v1/completions", c(seed=2**64), 400, "seed"),
        ("seed under -2**63", "/v1/completions", c(seed=-2**63 - 1), 400, "seed"),
        ("an integer of 5,000 digits", "/v1/completions", b'{"prompt": "hi", "seed": ' + b"9" * 5000 + b"}", 400,
         None),
        ("JSON nested 100,000 deep", "/v1/completions", b'{"prompt":' * 100_000 + b'"x"' + b"}" * 100_000, 400, None),
        ("a lone surrogate", "/v1/completions", b'{"prompt": "a\\ud800"}', 400, None),
        ("invalid UTF-8", "/v1/completions", b'{"prompt": "\xc3\x28"}', 400, None),
        ("NaN", "/v1/completions", b'{"prompt": "hi", "temperature": NaN}', 400, None),
        ("not an object", "/v1/completions", b"[]", 400, None),
        ("malformed JSON", "/v1/completions", b'{"prompt": ', 400, None),
        ("prompt of wrong type", "/v1/completions", c(prompt=5), 400, "prompt"),
        ("empty prompt list", "/v1/completions", c(prompt=[]), 400, "prompt"),
        ("n a string", "/v1/completions", c(n="2"), 400, "n"),
        ("temperature a string", "/v1/completions", c(temperature="hot"), 400, "temperature"),
        ("temperature out of range", "/v1/completions", c(temperature=7.5), 400, "temperature"),
        ("top_p zero", "/v1/completions", c(top_p=0), 400, "top_p"),
        ("max_tokens of 31 digits", "/v1/completions", c(max_tokens=10**30), 400, "max_tokens"),
        ("negative max_tokens", "/v1/completions", c(max_tokens=-1), 400, "max_tokens"),
        ("50,000 prompts", "/v1/completions", c(prompt=[[5]] * 50_000), 400, "prompt"),
        ("257 prompts", "/v1/completions", c(prompt=["hi"] * 257), 400, "prompt"),
        ("17 prompts x n=16", "/v1/completions", c(prompt=["hi"] * 17, n=16), 400, "n"),
        ("n=17", "/v1/completions", c(n=17), 400, "n"),
        ("17 stop strings", "/v1/completions", c(stop=["x"] * 17), 400, "stop"),
        ("100,000 stop strings", "/v1/completions", c(stop=["x"] * 100_000), 400, "stop"),
        ("a stop string of 513 characters", "/v1/completions", c(stop="x" * 513), 400, "stop"),
        ("a stop string of 2 MB", "/v1/completions", c(stop=["x" * 2_000_000]), 400, "stop"),
        ("65 stop_token_ids", "/v1/completions", c(stop_token_ids=list(range(65))), 400, "stop_token_ids"),
        ("stop_token_ids outside the vocabulary", "/v1/completions", c(stop_token_ids=[10**7]), 400,
         "stop_token_ids"),
        ("301 logit_bias entries", "/v1/completions", c(logit_bias={str(i): 1 for i in range(301)}), 400,
         "logit_bias"),
        ("logit_bias outside the vocabulary", "/v1/completions", c(logit_bias={"10000000": 1}), 400, "logit_bias"),
        ("logit_bias of 1000", "/v1/completions", c(logit_bias={"5": 1000}), 400, "logit_bias"),
        ("a body over 4 MiB", "/v1/completions", c(prompt="x" * (4 << 20)), 413, None),
        ("a text prompt past what the context could hold", "/v1/completions", c(prompt="x" * ((4 << 20) - 200)), 400,
         "prompt"),
        ("a prompt over the context", "/v1/completions", c(prompt="hello " * 10_000), 400, "prompt"),
        ("1,000 prompt tokens", "/v1/completions", c(prompt=[5] * 1000), 400, "prompt"),
        ("1.2 M prompt tokens", "/v1/completions", c(prompt=[5] * 1_200_000), 400, "prompt"),
        ("4 MiB of empty prompts, the costliest JSON to parse", "/v1/completions",
         b'{"prompt": [' + b",".join([b"[]"] * 1_390_000) + b"]}", 400, "prompt"),
        ("a token id outside the vocabulary", "/v1/completions", c(prompt=[10**7]), 400, "prompt"),
        ("an unknown model", "/v1/completions", c(model="gpt-17"), 404, None),
        ("stream_options without stream", "/v1/completions", c(stream_options={"include_usage": True}), 400,
         "stream_options"),
        ("2,049 chat messages", "/v1/chat/completions", m(messages=[user] * 2049), 400, "messages"),
        ("a chat message past what the context could hold", "/v1/chat/completions",
         m(messages=[{"role": "user", "content": "x" * 100_000}]), 400, "messages"),
        ("an unknown role", "/v1/chat/completions", m(messages=[{"role": "hacker", "content": "x"}]), 400, "messages"),
        ("a message without a role", "/v1/chat/completions", m(messages=[{"content": "x"}]), 400, "messages"),
        ("no messages", "/v1/chat/completions", m(messages=[]), 400, "messages"),
        ("top_logprobs 30", "/v1/chat/completions", m(top_logprobs=30, logprobs=True), 400, "top_logprobs"),
        ("detokenize outside the vocabulary", "/detokenize", {"tokens": [10**7]}, 400, "tokens"),
        ("tokenize both prompt and messages", "/tokenize", {"prompt": "x", "messages": [user]}, 400, "prompt"),
    ]

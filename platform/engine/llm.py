"""`LLM`: offline batch generation on one engine, the Python face of `pdserve generate`.

    llm = LLM("path/to/checkpoint")            # or LLM() for the tiny default model
    outs = llm.generate(["Hello", "Paris is"], SamplingParams(max_tokens=32, temperature=0))

Prompts are strings (tokenized with the checkpoint's tokenizer) or lists of token ids. Results
come back in prompt order. A request the engine fails (`RequestFailedError`) fails the call.
"""

from __future__ import annotations

from dataclasses import dataclass

from tqdm import tqdm

from pdserve.config import EngineConfig
from pdserve.engine.checkpoint import default_model
from pdserve.engine.engine import LLMEngine
from pdserve.engine.outputs import TokenLogprob
from pdserve.engine.sampling_params import SamplingParams


@dataclass
class Completion:
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str | None
    stop_reason: int | str | None
    logprobs: list[TokenLogprob]
    num_cached_tokens: int
    prompt_logprobs: list[TokenLogprob | None] | None = None


class LLM:
    def __init__(self, model: str | None = None, **engine_options):
        self.engine = LLMEngine(EngineConfig(model=str(model or default_model()), **engine_options))
        self.tokenizer = self.engine.tokenizer
        self._next_id = 0

    def generate(self, prompts: list[str] | list[list[int]] | str,
                 params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[Completion]:
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = params or SamplingParams()
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params_list)} sampling parameter sets")

        results: dict[str, Completion] = {}
        order = []
        for prompt, p in zip(prompts, params_list):
            ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
            rid = f"offline-{self._next_id}"
            self._next_id += 1
            self.engine.add_request(rid, ids, p)
            order.append(rid)
            results[rid] = Completion(prompt if isinstance(prompt, str) else None, ids, "", [], None, None, [], 0)

        bar = tqdm(total=len(order), desc="generating", unit="req", disable=not use_tqdm)
        try:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    c = results[out.request_id]
                    c.text += out.new_text
                    c.token_ids += out.new_token_ids
                    c.logprobs += out.new_logprobs
                    if out.prompt_logprobs is not None:
                        c.prompt_logprobs = out.prompt_logprobs
                    if out.finished:
                        c.finish_reason, c.stop_reason = out.finish_reason, out.stop_reason
                        c.num_cached_tokens = out.num_cached_tokens
                        bar.update(1)
                for _, error in self.engine.take_failed_requests():
                    raise error
        finally:
            bar.close()
            for rid in order:  # an exception mid-run must not leave blocks pinned
                self.engine.abort_request(rid)
        return [results[rid] for rid in order]

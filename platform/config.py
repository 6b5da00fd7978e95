"""One typed configuration for a pdserve deployment.

Pydantic at the edge (YAML, CLI flags) with a description on every field; the engine and the
other leaves take plain values that the builders read from here. No I/O happens in these classes.
Later sections (pools, router, transfer, gateway) join `EngineConfig` in this module.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class EngineConfig(BaseModel):
    """How one engine (a prefill, decode or unified replica, or the offline `LLM`) runs."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str = Field(description="Path to a local Hugging Face checkpoint directory "
                                   "(config.json, *.safetensors, tokenizer.json).")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="Weight and activation dtype; 'auto' takes the checkpoint's dtype.")
    device: str = Field("cpu", description="torch device for weights and KV cache, e.g. 'cpu' or 'cuda:0'.")
    block_size: int = Field(16, ge=1, le=1024, description="Tokens per KV-cache block.")
    num_kv_blocks: int | None = Field(
        None, ge=1, description="KV-cache blocks to allocate; overrides kv_cache_memory_bytes when set.")
    kv_cache_memory_bytes: int = Field(
        512 * 2**20, ge=1, description="Memory for the KV cache when num_kv_blocks is not set.")
    max_model_len: int | None = Field(
        None, ge=2, description="Longest prompt + output in tokens; default: the model's context length.")
    max_num_seqs: int = Field(64, ge=1, description="Most sequences in one batch.")
    max_num_batched_tokens: int = Field(
        2048, ge=1, description="Token budget of one engine step; longer prefills are chunked to fit.")
    enable_prefix_caching: bool = Field(True, description="Reuse KV blocks of identical prompt prefixes.")
    seed: int = Field(0, description="Seed of the sampling RNG for requests without a seed of their own.")
    num_threads: int | None = Field(None, ge=1, description="CPU threads for torch; default: all cores.")

    @model_validator(mode="after")
    def _check_budget(self) -> "EngineConfig":
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be at least "
                             f"max_num_seqs ({self.max_num_seqs}) so every running sequence can decode")
        return self

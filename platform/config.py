"""One typed configuration for a pdserve deployment.

Pydantic at the edge (YAML, CLI flags) with a description on every field; the engine and the
other leaves take plain values that the builders read from here. No I/O happens in these classes.
`ServeConfig` is the whole deployment: the YAML behind `pdserve serve CONFIG`, the arguments of
`pdserve.app:build_app`, and later the Helm chart's values.
"""

from __future__ import annotations

from pathlib import PurePath
from typing import Annotated, Any, Literal

from pydantic import (BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, create_model, field_validator,
                      model_serializer, model_validator)
from pydantic_core import PydanticCustomError


class EngineConfig(BaseModel):
    """How one engine (a prefill, decode or unified replica, or the offline `LLM`) runs."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str = Field(description="Path to a local Hugging Face checkpoint directory "
                                   "(config.json, *.safetensors, tokenizer.json).")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="Weight and activation dtype; 'auto' takes the checkpoint's dtype.")
    device: str = Field("cpu", pattern=r"^(cpu|cuda)(:\d+)?$",
                        description="torch device for weights and KV cache, e.g. 'cpu' or 'cuda:0' (ROCm too).")
    block_size: int = Field(16, ge=1, le=1024, description="Tokens per KV-cache block.")
    kv_cache_dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="dtype the KV cache holds; 'auto' takes the model's. bfloat16 under an fp32 model "
                            "halves the bytes attention reads and KV transfers move (K and V rounded once, when "
                            "written); prefill and decode pools must agree.")
    weight_dtype: Literal["auto", "bfloat16"] = Field(
        "auto", description="dtype the weight matrices are stored in; 'auto' keeps the model's. bfloat16 under an "
                            "fp32 model is weight-only bf16: the matrices are rounded once at load, activations "
                            "and sums stay fp32; on the CPU kernels it halves the bytes a decode step streams.")
    num_kv_blocks: int | None = Field(
        None, ge=1, description="KV-cache blocks to allocate; overrides kv_cache_memory_bytes when set.")
    kv_cache_memory_bytes: int = Field(
        512 * 2**20, ge=1, description="Memory for the KV cache when num_kv_blocks is not set; "
                                       "held from startup.")
    max_model_len: int | None = Field(
        None, ge=2, description="Longest prompt + output in tokens; default: the model's context length.")
    max_num_seqs: int = Field(64, ge=1, description="Most sequences in one batch.")
    max_num_batched_tokens: int = Field(
        2048, ge=1, description="Token budget of one engine step; longer prefills are chunked to fit.")
    long_prefill_token_threshold: int = Field(
        0, ge=0, description="Most tokens of one prompt's prefill in a step (0: no limit, as vLLM's default). "
                             "Below the token budget, prompts that arrive while a long one is prefilled join the "
                             "next step beside its next chunk instead of waiting for all of it (lower TTFT for "
                             "short prompts, more steps for long ones); vLLM's long_prefill_token_threshold.")
    split_prompts_to_fill_steps: bool = Field(
        True, description="Fill what is left of a step's token budget with the first chunk of the next waiting "
                          "prompt (vLLM's chunked prefill). Off: a prompt that would not finish in a step starts "
                          "only in one that prefills nothing else, so the prompt before it is not slowed by a "
                          "chunk of it. Off suits CPU prefill pools, where a larger step is no more efficient.")
    enable_prefix_caching: bool = Field(True, description="Reuse KV blocks of identical prompt prefixes.")
    grammar_cache_size: int = Field(
        256, ge=1, description="Compiled structured-output grammars (JSON schemas, regexes, choices, grammars) an "
                               "engine keeps, least recently used evicted; a request whose grammar is cached starts "
                               "without compiling (~1-20 ms a schema).")
    enforce_eager: bool = Field(
        False, description="On CUDA, run decode steps op by op instead of replaying CUDA graphs captured at "
                           "startup (one per batch size up to max_num_seqs; models on one rank on the Triton "
                           "kernels: dense, sliding-window, MoE with fused experts, latent attention). "
                           "Graphs take the step's kernel launches off the host; eager spares the capture's "
                           "seconds and memory. vLLM's enforce_eager.")
    seed: int = Field(0, description="Seed of the sampling RNG for requests without a seed of their own.")
    num_threads: int | None = Field(None, ge=1, description="CPU threads for torch (per rank); default: "
                                                            "torch's (OMP_NUM_THREADS, else all cores), no more than "
                                                            "the CPUs the process may run on, shared evenly by the "
                                                            "ranks of a parallel engine.")
    tensor_parallel_size: int = Field(1, ge=1, description="Ranks (devices) one engine spans; attention heads, "
                                                           "MLP and vocabulary are split across them.")
    enable_expert_parallel: bool = Field(
        False, description="MoE models: spread whole experts over the tensor-parallel ranks (tokens travel "
                            "by all-to-all) instead of splitting every expert.")
    distributed_backend: Literal["auto", "nccl", "gloo"] = Field(
        "auto", description="torch.distributed backend of a parallel engine; auto: nccl on CUDA/ROCm, gloo on CPU.")

    @model_validator(mode="after")
    def _check_budget(self) -> "EngineConfig":
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be at least "
                             f"max_num_seqs ({self.max_num_seqs}) so every running sequence can decode")
        return self


class _Overrides(BaseModel):
    """Base of a model whose fields are all optional overrides: only the fields written count.
    They alone are dumped (a field written as null too: it resets what it overrides to null), and
    two overrides are equal when they write the same fields with the same values."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    @model_serializer
    def _written(self) -> dict[str, Any]:
        return {name: value for name, value in self if name in self.model_fields_set}

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and self._written() == other._written()

    def __hash__(self) -> int:
        return hash(tuple(self._written().items()))


def _overrides_of(model: type[BaseModel], name: str, doc: str, exclude: set[str]) -> type[_Overrides]:
    """A model with `model`'s fields (less `exclude`), each optional: the same types, bounds and
    descriptions, so the two cannot drift. Cross-field checks stay `model`'s, run on the merge."""
    fields: dict[str, Any] = {}
    for field, info in model.model_fields.items():
        if field in exclude:
            continue
        annotation = Annotated[(info.annotation, *info.metadata)] if info.metadata else info.annotation
        # No default in the JSON schema: an unwritten override has none, it leaves the field as it is.
        fields[field] = (annotation, Field(None, description=info.description,
                                           json_schema_extra=lambda schema: schema.pop("default", None)))
    return create_model(name, __base__=_Overrides, __doc__=doc, __module__=__name__, **fields)


def _merged(*overrides: _Overrides) -> dict[str, Any]:
    """The fields written in `overrides`, later ones winning."""
    return {name: value for o in overrides for name, value in o._written().items()}


EngineOverrides = _overrides_of(
    EngineConfig, "EngineOverrides", exclude={"model"},
    doc="EngineConfig fields, each optional: the top-level `engine` sets them for every pool, a pool's `engine` "
        "for that pool (over the top-level's). The checkpoint is the config's own `model`.")


class AutoscalingSpec(BaseModel):
    """How a pool follows its load (pdserve.autoscale): Ray Serve autoscaling with pdserve's policy
    for the pool, within [min_replicas, max_replicas]; up after `upscale_delay_s` of wanting more,
    down after `downscale_delay_s` of wanting fewer (replicas being removed drain first)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    min_replicas: int = Field(1, ge=0, description="Fewest replicas; 0 only with scale_to_zero.")
    max_replicas: int = Field(4, ge=1, description="Most replicas.")
    scale_to_zero: bool = Field(False, description="Allow min_replicas 0 (the first request waits for a replica).")
    upscale_delay_s: float = Field(2.0, ge=0)
    downscale_delay_s: float = Field(60.0, ge=0)
    look_back_period_s: float = Field(5.0, gt=0, description="Window the replicas' figures are averaged over.")
    target_queued_prefill_tokens: float = Field(4096, gt=0, description="Prefill: waiting prompt tokens per replica.")
    target_ongoing_requests: float = Field(8, gt=0, description="Prefill: requests per replica, queued ones included.")
    target_running_sequences: float = Field(32, gt=0, description="Decode: running sequences per replica.")
    target_kv_usage: float = Field(0.7, gt=0, le=1, description="Decode: KV-cache occupancy per replica.")

    @model_validator(mode="after")
    def _check_bounds(self) -> "AutoscalingSpec":
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"min_replicas {self.min_replicas} exceeds max_replicas {self.max_replicas}")
        if self.min_replicas == 0 and not self.scale_to_zero:
            raise ValueError("min_replicas 0 scales the pool to zero: set scale_to_zero: true to allow it")
        return self


# What a pool's replica accepts at once unless its config says (`ServeConfig.max_ongoing_requests`): a
# whole batch (fewer, and a decode replica never fills one: a config with max_num_seqs 256 ran 64) and
# at least this many, so that past a small batch prompts are prefilled elsewhere while they wait for
# a sequence slot on the replica instead of in their callers' queues.
MIN_MAX_ONGOING_REQUESTS = 64


def default_max_ongoing_requests(max_num_seqs: int) -> int:
    return max(MIN_MAX_ONGOING_REQUESTS, max_num_seqs)


class PoolConfig(BaseModel):
    """One Ray Serve deployment of engine replicas (prefill, decode or unified)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    num_replicas: int = Field(1, ge=1, description="Replicas in this pool.")
    ray_actor_options: dict[str, Any] = Field(
        default_factory=lambda: {"num_cpus": 1},
        description="Per replica: num_cpus, num_gpus, accelerator_type, resources ({custom: amount}), ... "
                    "Different options per pool put prefill and decode on different node types.")
    max_ongoing_requests: int | None = Field(
        None, ge=1, description="Requests a replica accepts at once (more wait in their callers' queues). Default: "
                                "its engine's max_num_seqs, and at least 64. Below max_num_seqs it caps the batch.")
    health_check_period_s: float = Field(10.0, gt=0, description="How often Ray Serve checks a replica (a dead "
                                                                 "engine loop or rank worker fails the check).")
    max_queued_requests: int = Field(
        256, ge=-1, description="Requests a caller queues for this pool before answering 503; -1: no limit.")
    engine: EngineOverrides = Field(
        default_factory=EngineOverrides, description="EngineConfig fields that differ from the top-level engine in "
                                                     "this pool.")
    autoscaling: AutoscalingSpec | None = Field(
        None, description="Follow the pool's load between min and max replicas (num_replicas is then the start).")
    request_router_class: str | None = Field(
        None, description="Import path of the Ray Serve RequestRouter for this pool; default: pdserve's "
                          "(prefix-aware for prefill and unified pools, KV headroom for decode). Ray Serve's own: "
                          "ray.serve._private.request_router:PowerOfTwoChoicesRequestRouter.")


class TransferConfig(BaseModel):
    """How KV blocks move from prefill to decode (DESIGN section 5)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    backend: Literal["tcp", "ucx"] = Field(
        "tcp", description="tcp: plain TCP sockets, authenticated by each lease's token and bound to `host` (CPU "
                           "pools, and GPU pools whose links have no RDMA: GPU blocks go through host memory). "
                           "ucx: ucxx, for RDMA and CUDA-aware transports between GPU nodes; UCX also opens "
                           "unauthenticated TCP ports on every interface (docs/security.md). Both copy out of the "
                           "prefill replica's cache directly on the same host (shared_memory).")
    host: str = Field("auto", description="Address a prefill replica's KV listener advertises; "
                                          "'auto' takes the node's IP as Ray sees it.")
    lease_s: float = Field(30.0, gt=0, description="How long a prefill replica holds exported blocks for a pull.")
    timeout_s: float = Field(10.0, gt=0, description="A decode replica's deadline for one pull.")
    shared_memory: bool = Field(
        True, description="A decode replica on the prefill replica's host (CPU caches: shared memory) or GPU (CUDA "
                          "IPC) copies the blocks straight out of its cache; the backend carries only the request and "
                          "the ack. false: the blocks go over the backend's connection everywhere.")


class RouterConfig(BaseModel):
    """How requests are placed on replicas (DESIGN.md sections 2 and 3)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    redis_url: str | None = Field(
        None, description="Redis that carries the replicas' KV events, e.g. redis://host:6379/0: routing is "
                          "precise while it is reachable, approximate otherwise. None: `pdserve serve` starts a "
                          "private redis-server on loopback when one is installed; `build_app` routes approximately. "
                          "No password in it: it is rendered into the Serve config (see redis_password_env).")
    redis_password_env: str = Field(
        "PDSERVE_REDIS_PASSWORD", description="The environment variable that holds Redis' password, where one is "
                                              "needed (the Helm chart sets it from a Secret); unset: no password.")
    queue_weight: float = Field(
        3.0, ge=0, description="Prefill cost = uncached prompt tokens + queue_weight x queued prefill tokens. "
                               "1: each request's own shortest wait; higher spreads hot prefixes sooner.")
    approx_ttl_s: float = Field(120.0, gt=0, description="How long approximate mode trusts its own placements.")
    stats_period_s: float = Field(0.5, gt=0, description="How often replicas report queue and KV figures.")

    @field_validator("redis_url")
    @classmethod
    def _no_password_in_url(cls, url: str | None) -> str | None:
        from urllib.parse import urlsplit

        if url is not None and (urlsplit(url).password or urlsplit(url).username):
            raise ValueError("redis_url carries credentials, which would be written into the Serve config in plain "
                             "text: put the password in the environment variable redis_password_env names instead")
        return url


class GatewayConfig(BaseModel):
    """The OpenAI-compatible HTTP ingress."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    host: str = Field("127.0.0.1", description="HTTP bind address.")
    port: int = Field(8000, ge=0, le=65535, description="HTTP port.")
    ingress: Literal["haproxy", "proxy"] = Field(
        "haproxy", description="What takes HTTP on host:port when `pdserve serve` starts Ray. haproxy: Ray Serve's "
                               "HAProxy mode, HAProxy forwarding to each gateway replica's own HTTP server (one hop "
                               "less per streamed token); proxy: Ray Serve's Python proxy actor. Ray-wide: on a "
                               "cluster pdserve joins, set RAY_SERVE_ENABLE_HA_PROXY=1 on its nodes instead.")
    num_replicas: int = Field(1, ge=1, description="Gateway replicas.")
    ray_actor_options: dict[str, Any] = Field(default_factory=lambda: {"num_cpus": 0})
    served_model_name: str | None = Field(None, description="The model name clients send; default: the "
                                                            "checkpoint directory's name.")
    api_keys: list[str] = Field(default_factory=list, description="Accepted bearer tokens; empty: no auth.")
    cache_isolation: Literal["shared", "per_key"] | None = Field(
        None, description="Who shares prefix-cache blocks. per_key: only requests of the same API key (each key's "
                          "blocks are salted with a hash of it, plus the request's own cache_salt), so a tenant "
                          "learns nothing of another's prompts from cached_tokens or timing; shared: every request "
                          "(a request's cache_salt still isolates it). None: per_key when api_keys are set, else "
                          "shared.")
    enable_docs: bool = Field(False, description="Serve FastAPI's /docs, /redoc and /openapi.json (off: they "
                                                 "describe the API to anyone who can reach it).")
    # Bounds on one request, checked before any work (each violation is a 400 naming the `param`).
    max_body_bytes: int = Field(4 * 2**20, ge=1024, description="Larger request bodies get a 413; also the largest "
                                                                "gRPC message where `pdserve serve` starts Ray.")
    max_n: int = Field(16, ge=1, description="Largest `n` (choices per request) accepted.")
    max_prompts_per_request: int = Field(256, ge=1, description="Most prompts in one /v1/completions request.")
    max_sequences_per_request: int = Field(
        256, ge=1, description="Most sequences one request asks for (prompts x n): each is a call on the decode pool, "
                               "which queues at most its max_queued_requests per caller.")
    max_stop_sequences: int = Field(16, ge=0, description="Most `stop` strings (OpenAI: 4); every generated token "
                                                          "is checked against each.")
    max_stop_sequence_chars: int = Field(512, ge=1, description="Longest `stop` string, in characters.")
    max_stop_token_ids: int = Field(64, ge=0, description="Most `stop_token_ids`.")
    max_logit_bias_entries: int = Field(300, ge=0, description="Most `logit_bias` entries (OpenAI's limit); values "
                                                               "lie in [-100, 100].")
    max_chat_messages: int = Field(2048, ge=1, description="Most `messages` in one chat completion.")
    max_structured_output_chars: int = Field(
        65536, ge=1, description="Longest structured-output constraint, in characters: a `response_format` JSON "
                                 "schema, or `guided_json`/`guided_regex`/`guided_choice`/`guided_grammar` (and "
                                 "`structured_outputs`) as JSON text; a chat completion's `tools` too. Compiling is "
                                 "bounded too (llguidance's parser limits): a schema past them is a 400.")
    max_tools: int = Field(128, ge=1, description="Most `tools` in one chat completion (OpenAI's limit), and most "
                                                  "`tool_calls` in one message of its history.")
    tool_call_parser: Literal["auto", "none", "hermes", "llama3_json", "mistral"] = Field(
        "auto", description="How the model writes tool calls, read into `tool_calls` and enforced for `tool_choice` "
                            "required or a named function. hermes: `<tool_call>{json}</tool_call>` (Hermes, Qwen2.5, "
                            "Qwen3); llama3_json: `{\"name\": ..., \"parameters\": ...}` (Llama 3.1+); mistral: "
                            "`[TOOL_CALLS][...]` or, where the template writes `[ARGS]` (v11 tokenizers), "
                            "`[TOOL_CALLS]name[ARGS]{json}`. auto: from the chat template (the tag it writes); none: "
                            "requests with `tools` are refused.")
    reasoning_parser: Literal["auto", "none", "think"] = Field(
        "auto", description="Reasoning output: think splits a `<think>...</think>` section (Qwen3, QwQ, DeepSeek-R1) "
                            "into `reasoning_content`, and output constraints apply after it. auto: think when the "
                            "chat template mentions `</think>`; none: the whole output is content.")
    request_timeout_s: float = Field(
        600.0, gt=0, description="A request's deadline, end to end: past it the request is aborted wherever it is "
                                 "(queued, in prefill, streaming) and frees what it holds; the client gets a 504 (or "
                                 "an in-stream error). Also HAProxy's client timeout where `pdserve serve` starts Ray.")
    body_read_timeout_s: float = Field(
        30.0, gt=0, description="Longest the gateway waits for a request's body (a slow sender gets a 408), and then "
                                "for a large body's shape check in its own process. Ray Serve offers no setting for "
                                "HAProxy's own http-request timeout: this is the guard.")
    migration_limit: int = Field(
        3, ge=0, description="How many times one sequence may move to another decode replica when its own fails "
                             "mid-stream (dies, or its output connection drops): the gateway resubmits the prompt and "
                             "the tokens streamed so far, and the client sees one uninterrupted stream. Past it, the "
                             "stream ends with an in-stream error. 0: never (the stream ends at the first failure).")

    @field_validator("api_keys")
    @classmethod
    def _no_empty_keys(cls, keys: list[str]) -> list[str]:
        if any(not k.strip() for k in keys):
            raise ValueError("an API key is empty (or only whitespace): every key must be a non-empty token")
        return keys


class PoolRatio(BaseModel):
    """Keep the prefill:decode replica ratio of a disaggregated app within a band while both pools
    autoscale (pdserve.autoscale.policies.PoolRatioPolicy, an application-level Ray Serve policy)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    min_prefill_per_decode: float = Field(0.25, gt=0, description="Fewest prefill replicas per decode replica.")
    max_prefill_per_decode: float = Field(4.0, gt=0, description="Most prefill replicas per decode replica.")

    @model_validator(mode="after")
    def _check_band(self) -> "PoolRatio":
        if self.min_prefill_per_decode > self.max_prefill_per_decode:
            raise ValueError(f"min_prefill_per_decode {self.min_prefill_per_decode} exceeds "
                             f"max_prefill_per_decode {self.max_prefill_per_decode}")
        return self


class TelemetryConfig(BaseModel):
    """What a deployment reports besides its answers: metrics, traces and status (pdserve.telemetry)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    traces: Literal["none", "console", "otlp"] = Field(
        "none", description="Where OpenTelemetry spans go: none; console (each process's log); otlp (an OTLP/HTTP "
                            "collector at otlp_endpoint). A client's traceparent header is honoured.")
    otlp_endpoint: str | None = Field(
        None, description="OTLP/HTTP traces URL, e.g. http://otel-collector:4318/v1/traces; default: the standard "
                          "OTEL_EXPORTER_OTLP_(TRACES_)ENDPOINT variables, else http://localhost:4318/v1/traces.")
    service_name: str = Field("pdserve", description="The service.name resource attribute of every span.")
    sample_ratio: float = Field(1.0, ge=0, le=1, description="Share of new traces recorded (a client's sampled "
                                                                "traceparent is always followed).")
    export_delay_ms: int = Field(500, ge=1, description="Longest a finished span waits before it is exported.")
    metrics_period_s: float = Field(2.0, gt=0, description="How often replicas publish their gauges and counters "
                                                           "(ray.util.metrics) and their `pdserve status` line.")


class SLOConfig(BaseModel):
    """The latency a deployment serves to: each request's time to first token and the gaps between
    its tokens, met by `percentile` percent of requests."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    ttft_ms: float = Field(2000.0, gt=0, description="Time to first token. Placement predicts it from a request's "
                                                      "arrival at a decode replica; requests that waited this long "
                                                      "for a replica with room are routed after the others.")
    itl_ms: float = Field(100.0, gt=0, description="Gap between two tokens of a stream (inter-token latency).")
    percentile: float = Field(99.0, gt=0, lt=100, description="Share of requests (percent) the targets hold for: "
                                                             "how attainment is counted, the percentile of its "
                                                             "prediction errors placement adds as a margin, and the "
                                                             "share of prompts the prefill pool is sized to start "
                                                             "in time. Below 100: no pool size makes every prompt's "
                                                             "wait certain (99.9 asks for one in a thousand late).")


# Fields a config no longer takes -> what replaces them (`pdserve config validate` and the Helm
# chart say it where they meet one).
REMOVED_FIELDS = {name: "removed: where prompts are prefilled follows the latency target now; set slo: {ttft_ms, "
                        "itl_ms} instead (docs/serving.md, 'Where prompts are prefilled')"
                  for name in ("remote_prefill_min_tokens", "remote_prefill_max_queued_tokens",
                               "overflow_prefill_max_tokens", "remote_prefill_max_queued_tokens_long",
                               "overflow_prefill_pause_s", "early_first_token")}


class ServeConfig(BaseModel):
    """A whole pdserve deployment: model, pools, transfer and gateway."""

    model_config = ConfigDict(extra="forbid", frozen=True, json_schema_extra={"x-removed": REMOVED_FIELDS})

    @model_validator(mode="before")
    @classmethod
    def _no_removed_fields(cls, data: Any) -> Any:
        if isinstance(data, dict):
            _raise_all("ServeConfig", [((name,), REMOVED_FIELDS[name]) for name in data if name in REMOVED_FIELDS])
        return data

    name: str = Field("pdserve", description="Ray Serve application name.")
    model: str | None = Field(None, description="Local Hugging Face checkpoint directory; default: the tiny-llama "
                                                "preset, generated on first use.")
    engine: EngineOverrides = Field(default_factory=EngineOverrides,
                                    description="EngineConfig fields shared by all pools.")
    mode: Literal["disaggregated", "colocated"] = Field(
        "disaggregated", description="disaggregated: Prefill and Decode pools with KV transfer; "
                                     "colocated: one Unified pool, no transfer.")
    slo: SLOConfig | None = Field(
        None, description="The latency target: where each prompt is prefilled follows it (pdserve.decode.placement: "
                          "on the prefill pool while that meets the TTFT target, else on the decode replica in "
                          "chunks that keep its streams inside the ITL target). Unset: placement aims at "
                          "SLOConfig's defaults. With both pools autoscaling (disaggregated), one policy sizes them "
                          "together against it (pdserve.autoscale.policies.JointSloPolicy) instead of each on its "
                          "queue.")
    max_total_replicas: int | None = Field(
        None, ge=2, description="With slo and both pools autoscaling: the most replicas the two pools run together "
                                "(an accelerator budget they share); default: the sum of their max_replicas.")
    # validate_default: a pool left out still runs the top-level engine, which _check_pool_engine checks.
    prefill: PoolConfig = Field(default_factory=PoolConfig, validate_default=True,
                                description="The prefill pool (disaggregated mode).")
    decode: PoolConfig = Field(default_factory=PoolConfig, validate_default=True,
                               description="The decode pool; in colocated mode the one pool (Unified), which "
                                           "prefills too.")
    transfer: TransferConfig = Field(default_factory=TransferConfig)
    router: RouterConfig = Field(default_factory=RouterConfig)
    gateway: GatewayConfig = Field(default_factory=GatewayConfig)
    telemetry: TelemetryConfig = Field(default_factory=TelemetryConfig)
    pool_ratio: PoolRatio | None = Field(
        None, description="Disaggregated, both pools autoscaling: keep prefill:decode replicas within this band. "
                          "Applies where Ray Serve deploys from a config (`pdserve serve`, `serve deploy`, KubeRay).")

    @property
    def joint_autoscaling(self) -> bool:
        """Whether one policy sizes both pools against `slo` (disaggregated, both pools autoscaling)."""
        return (self.slo is not None and self.mode == "disaggregated" and self.prefill.autoscaling is not None
                and self.decode.autoscaling is not None)

    @property
    def served_model_name(self) -> str:
        """The model name clients send (and metrics carry): configured, or the checkpoint directory's name."""
        if self.gateway.served_model_name:
            return self.gateway.served_model_name
        if self.model is None:
            raise ValueError("resolve the model first (pdserve.app.resolve_model)")
        return PurePath(self.model).name

    def engine_config(self, pool: PoolConfig, unresolved_ok: bool = False) -> EngineConfig:
        """The engine a replica of `pool` runs (model resolved by the caller; with `unresolved_ok`,
        an unset model reads '-': for the fields that do not depend on it)."""
        if self.model is None and not unresolved_ok:
            raise ValueError("resolve the model first (pdserve.app.resolve_model)")
        return EngineConfig(model=self.model or "-", **_merged(self.engine, pool.engine))

    def max_ongoing_requests(self, pool: PoolConfig) -> int:
        """What a replica of `pool` accepts at once: its `max_ongoing_requests`, else the default
        that follows its engine's max_num_seqs."""
        return pool.max_ongoing_requests or default_max_ongoing_requests(
            self.engine_config(pool, unresolved_ok=True).max_num_seqs)

    @field_validator("prefill", "decode")
    @classmethod
    def _check_pool_engine(cls, pool: PoolConfig, info: ValidationInfo) -> PoolConfig:
        """A pool runs the top-level engine with its own overrides: EngineConfig's checks across
        fields (a step's token budget covers max_num_seqs) hold for that merge. Checked with the
        fields, so these problems are reported with every other, at the pool's `engine`."""
        top = info.data.get("engine")
        if top is None:  # the top-level engine has problems of its own, reported where they are written
            return pool
        try:
            EngineConfig(model="-", **_merged(top, pool.engine))
        except ValidationError as e:
            _raise_all("PoolConfig", [(("engine", *error["loc"]), error["msg"].removeprefix("Value error, "))
                                      for error in e.errors()])
        return pool

    @model_validator(mode="after")
    def _check_across_fields(self) -> "ServeConfig":
        """What no one field decides, checked once every field is valid; all reported together."""
        problems = []
        prefill, decode = (self.engine_config(pool, unresolved_ok=True) for pool in (self.prefill, self.decode))
        if self.mode == "disaggregated":
            p, d = prefill.tensor_parallel_size, decode.tensor_parallel_size
            if d < p or d % p:
                problems.append(f"prefill tensor_parallel_size {p} with decode tensor_parallel_size {d}: each decode "
                                "rank pulls its KV heads from one prefill rank, so the decode degree must be a "
                                "multiple of the prefill degree (equal, or k times it)")
        if self.joint_autoscaling:
            if self.pool_ratio is not None:
                problems.append("with slo and both pools autoscaling, one policy sizes the two pools together "
                                "against the latency target: drop pool_ratio")
            floor = self.prefill.autoscaling.min_replicas + self.decode.autoscaling.min_replicas
            if self.max_total_replicas is not None and self.max_total_replicas < floor:
                problems.append(f"max_total_replicas {self.max_total_replicas} is below the pools' min_replicas "
                                f"together ({floor})")
        elif self.max_total_replicas is not None:
            problems.append("max_total_replicas is the budget of the joint autoscaling policy: it needs slo, mode "
                            "disaggregated and autoscaling on both the prefill and the decode pool")
        if self.pool_ratio is not None and (self.mode != "disaggregated" or self.prefill.autoscaling is None
                                            or self.decode.autoscaling is None):
            problems.append("pool_ratio needs mode disaggregated and autoscaling on both the prefill and the "
                            "decode pool")
        _raise_all("ServeConfig", [((), message) for message in problems])
        return self


def _raise_all(title: str, problems: list[tuple[tuple[str, ...], str]]) -> None:
    """Raise every problem at once, each at its place (relative to the field or model being
    validated: pydantic reports a ValidationError raised by a validator under that place)."""
    if problems:
        raise ValidationError.from_exception_data(title, [
            {"type": PydanticCustomError("value_error", message), "loc": loc, "input": None}
            for loc, message in problems])

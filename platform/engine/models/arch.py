"""`ModelArch`: the architecture facts the engine needs, read from a checkpoint's config.json.

Accepts both config styles found in the wild: classic (`rope_theta`, `rope_scaling`,
`torch_dtype`) and transformers 5 (`rope_parameters`, `dtype`). Anything missing, malformed or
unsupported raises `ModelLoadError` / `UnsupportedModelError` naming the field.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from pdserve.engine.models.quantization import Fp8BlockScheme, parse_quantization
from pdserve.errors import ModelLoadError, UnsupportedModelError

# model_type -> the family file that implements it.
SUPPORTED_MODEL_TYPES = {"llama": "llama", "mistral": "llama", "qwen2": "llama", "qwen3": "llama", "phi3": "phi3",
                         "mixtral": "mixtral", "qwen3_moe": "mixtral",
                         "gemma3_text": "gemma3", "gemma3": "gemma3", "deepseek_v3": "deepseek_v3"}

if TYPE_CHECKING:
    import torch

# A config's dtype names -> torch's. torch is imported only where a dtype object is asked for:
# reading a config (the gateway, `pdserve simulate` and `plan` do) must not load it.
_DTYPES = {"float32": "float32", "float": "float32", "bfloat16": "bfloat16", "float16": "float16", "half": "float16"}
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def dtype_name(name: str) -> str:
    """torch's name of the dtype a config calls `name` (UnsupportedModelError for one not supported)."""
    try:
        return _DTYPES[name.removeprefix("torch.")]
    except KeyError:
        raise UnsupportedModelError(f"dtype {name!r} is not supported (use float32, bfloat16 or float16)") from None


def parse_dtype(name: str) -> torch.dtype:
    import torch

    return getattr(torch, dtype_name(name))


@dataclass(frozen=True)
class ModelArch:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    dtype_name: str  # the checkpoint's (float32, bfloat16, float16): `dtype` is torch's
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    sliding_window: int | None = None
    num_experts: int = 0
    num_experts_per_tok: int = 0
    qk_norm: bool = False  # Qwen3: an RMSNorm over each q and k head before rotary
    moe_intermediate_size: int = 0  # each expert's, where it differs from the dense MLPs' (Qwen3-MoE)
    norm_topk_prob: bool = True  # renormalise the chosen experts' weights to sum to 1 (Mixtral does)
    dense_layers: tuple[int, ...] = ()  # layers of an MoE model with a dense MLP instead of experts
    # Gemma 3: each layer's sliding window in tokens (None: a global layer); () when no layer slides
    # apart from the others (Mistral's one `sliding_window` for every layer is `sliding_window`).
    layer_windows: tuple[int | None, ...] = ()
    hidden_act: str = "silu"  # or gelu_pytorch_tanh (Gemma 3)
    query_pre_attn_scalar: float | None = None  # attention scale = this ** -0.5 (Gemma 3), else head_dim's
    local_rope_theta: float | None = None  # the sliding layers' rotary base, where it differs (Gemma 3)
    local_rope_scaling: dict | None = None
    final_logit_softcapping: float | None = None  # logits = cap * tanh(logits / cap)
    quantization: Fp8BlockScheme | None = None  # how the stored weights are quantized (quantization.py)
    # DeepSeek-V3's multi-head latent attention (MLA): each token caches one latent vector of
    # kv_lora_rank + qk_rope_head_dim values per layer; head_dim is qk_nope_head_dim + qk_rope_head_dim.
    kv_lora_rank: int = 0  # 0: not MLA
    q_lora_rank: int | None = None  # None: q comes from one projection (q_proj), not a low-rank pair
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleave: bool = False  # the checkpoint's rotary dimensions come in (even, odd) pairs
    # DeepSeekMoE: sigmoid scores, a bias that steers the choice (not the weights), top-k within
    # the `topk_group` best of `n_group` expert groups, weights scaled by routed_scaling_factor.
    num_shared_experts: int = 0
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def latent_dim(self) -> int:
        """Values an MLA layer caches per token (its latent cache's width)."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    def is_sparse_layer(self, layer_idx: int) -> bool:
        return self.is_moe and layer_idx not in self.dense_layers

    @property
    def family(self) -> str:
        return SUPPORTED_MODEL_TYPES[self.model_type]

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def dtype(self) -> torch.dtype:
        return parse_dtype(self.dtype_name)

    @property
    def dtype_bytes(self) -> int:
        return _DTYPE_BYTES[self.dtype_name]

    @property
    def context_len(self) -> int:
        """The longest sequence the model handles as configured."""
        if self.sliding_window:
            return min(self.max_position_embeddings, self.sliding_window)
        return self.max_position_embeddings

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> "ModelArch":
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise ModelLoadError(f"{model_dir}: no config.json; pass a Hugging Face checkpoint directory")
        try:
            cfg = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ModelLoadError(f"{path}: not valid JSON ({e})") from e
        return cls.from_dict(cfg, source=str(path))

    @classmethod
    def from_dict(cls, cfg: dict, source: str = "config") -> "ModelArch":
        model_type = cfg.get("model_type")
        if model_type in ("gemma3", "gemma3_text"):
            cfg = _gemma3_text_config(cfg)
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedModelError(
                f"{source}: model_type {model_type!r} is not supported "
                f"(supported: {', '.join(sorted(SUPPORTED_MODEL_TYPES))})")

        def need(key: str, kind=int):
            if key not in cfg or cfg[key] is None:
                raise ModelLoadError(f"{source}: missing required field {key!r}")
            try:
                value = kind(cfg[key])
            except (TypeError, ValueError):
                raise ModelLoadError(f"{source}: field {key!r} has a bad value {cfg[key]!r}") from None
            if kind is int and value <= 0:
                raise ModelLoadError(f"{source}: field {key!r} must be positive, got {value}")
            return value

        hidden = need("hidden_size")
        heads = need("num_attention_heads")
        kv_heads = int(cfg.get("num_key_value_heads") or heads)
        if heads % kv_heads or (not cfg.get("head_dim") and hidden % heads):
            raise ModelLoadError(f"{source}: num_attention_heads ({heads}) must be a multiple of num_key_value_heads "
                                 f"({kv_heads}) and, without head_dim, divide hidden_size ({hidden})")
        head_dim = int(cfg.get("head_dim") or hidden // heads)
        mla = _deepseek_v3_fields(cfg, source) if model_type == "deepseek_v3" else {}
        if mla:  # every head its own K after the latent's expansion; q and k heads are nope + rope wide
            kv_heads, head_dim = heads, mla["qk_nope_head_dim"] + mla["qk_rope_head_dim"]
        act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "silu"
        if act not in ("silu", "gelu_pytorch_tanh"):
            raise UnsupportedModelError(f"{source}: hidden_act {act!r} is not supported (silu, gelu_pytorch_tanh)")
        gemma = _gemma3_fields(cfg, source) if model_type in ("gemma3", "gemma3_text") else {}

        rope = dict(cfg.get("rope_parameters") or {})
        if gemma:  # Gemma 3 nests one rope config per layer type; the global layers' goes on below
            rope = dict(rope.get("full_attention") or {})
        theta = float(rope.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
        partial = float(rope.pop("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)) or 1.0)
        if partial != 1.0:
            raise UnsupportedModelError(f"{source}: partial_rotary_factor {partial} is not supported (rotary "
                                        f"embeddings over the whole head only)")
        scaling = dict(rope or cfg.get("rope_scaling") or {}) or None
        if scaling and scaling.get("rope_type", scaling.get("type")) == "default":
            scaling = None
        if scaling and scaling.get("rope_type", scaling.get("type")) in ("longrope", "su") \
                and "original_max_position_embeddings" not in scaling:  # Phi-3 keeps it beside rope_scaling
            scaling["original_max_position_embeddings"] = int(cfg.get("original_max_position_embeddings")
                                                              or need("max_position_embeddings"))

        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        window = cfg.get("sliding_window")
        if (model_type.startswith("qwen") and not cfg.get("use_sliding_window", False)) or gemma:
            window = None
        moe = _moe_fields(cfg, model_type, source)
        return cls(
            model_type=model_type,
            vocab_size=need("vocab_size"),
            hidden_size=hidden,
            intermediate_size=need("intermediate_size"),
            num_layers=need("num_hidden_layers"),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=need("max_position_embeddings"),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=model_type == "qwen2" or bool(cfg.get("attention_bias", False)),
            dtype_name=dtype_name(str(cfg.get("dtype") or cfg.get("torch_dtype") or "float32")),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            sliding_window=int(window) if window else None,
            qk_norm=model_type in ("qwen3", "qwen3_moe") or bool(gemma),
            hidden_act=act,
            quantization=parse_quantization(cfg.get("quantization_config"), source),
            **moe,
            **gemma,
            **mla,
        )


def _moe_fields(cfg: dict, model_type: str, source: str) -> dict:
    """The MoE fields of `ModelArch` from a Mixtral, Qwen3-MoE or DeepSeek-V3 config ({} for a dense model)."""
    if model_type == "deepseek_v3":
        return _deepseek_moe_fields(cfg, source)
    if model_type == "mixtral":
        return {"num_experts": int(cfg.get("num_local_experts", 0)),
                "num_experts_per_tok": int(cfg.get("num_experts_per_tok", 0))}
    if model_type != "qwen3_moe":
        return {}
    # Qwen3-MoE: hub checkpoints say num_experts; transformers 5 writes num_local_experts.
    experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
    step = int(cfg.get("decoder_sparse_step", 1) or 1)
    dense = set(cfg.get("mlp_only_layers") or ())
    layers = int(cfg["num_hidden_layers"])
    dense |= {i for i in range(layers) if (i + 1) % step}  # transformers: sparse where (i + 1) % step == 0
    if not experts or not cfg.get("num_experts_per_tok") or not cfg.get("moe_intermediate_size"):
        raise ModelLoadError(f"{source}: a qwen3_moe config needs num_experts, num_experts_per_tok and "
                             f"moe_intermediate_size")
    return {"num_experts": experts, "num_experts_per_tok": int(cfg["num_experts_per_tok"]),
            "moe_intermediate_size": int(cfg["moe_intermediate_size"]),
            "norm_topk_prob": bool(cfg.get("norm_topk_prob", False)),
            "dense_layers": tuple(sorted(i for i in dense if 0 <= i < layers))}


# Gemma3TextConfig's defaults: hub checkpoints (the 4B and larger ones nest the text model's config
# in `text_config`) write only the fields that differ from them.
_GEMMA3_TEXT_DEFAULTS = {"vocab_size": 262_208, "hidden_size": 2304, "intermediate_size": 9216,
                         "num_hidden_layers": 26, "num_attention_heads": 8, "num_key_value_heads": 4,
                         "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh",
                         "max_position_embeddings": 131_072, "rms_norm_eps": 1e-6, "tie_word_embeddings": True,
                         "query_pre_attn_scalar": 256, "sliding_window": 4096, "bos_token_id": 2,
                         "eos_token_id": 1, "rope_theta": 1_000_000.0}


def _gemma3_text_config(cfg: dict) -> dict:
    """A Gemma 3 config (`gemma3_text`, or `gemma3`'s `text_config`) with Gemma3TextConfig's defaults
    filled in; the top level's token ids, dtype and tying apply where the text config has none."""
    text = cfg.get("text_config") if cfg.get("model_type") == "gemma3" else cfg
    if not isinstance(text, dict):
        raise ModelLoadError("a gemma3 config needs its language model's config in 'text_config'")
    top = {k: cfg[k] for k in ("bos_token_id", "eos_token_id", "tie_word_embeddings", "dtype", "torch_dtype")
           if cfg.get(k) is not None}
    return {**_GEMMA3_TEXT_DEFAULTS, **top, **{k: v for k, v in text.items() if v is not None},
            "model_type": cfg["model_type"]}


def _gemma3_fields(cfg: dict, source: str) -> dict:
    """The Gemma 3 fields of `ModelArch`: which layers slide (`layer_types`, else every
    `sliding_window_pattern`-th layer is global), the local rotary settings (transformers 5 nests
    them per layer type in `rope_parameters`; older configs say `rope_local_base_freq`), the
    attention scale and the final logits' soft cap."""
    layers = int(cfg["num_hidden_layers"])
    types = cfg.get("layer_types")
    if types is None:
        pattern = int(cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern") or 6)
        types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)]
    if len(types) != layers or set(types) - {"sliding_attention", "full_attention"}:
        raise ModelLoadError(f"{source}: layer_types must name sliding_attention or full_attention for each of "
                             f"the {layers} layers, got {types!r}")
    if cfg.get("attn_logit_softcapping") is not None or cfg.get("use_bidirectional_attention"):
        raise UnsupportedModelError(f"{source}: attn_logit_softcapping and use_bidirectional_attention are not "
                                    f"supported (Gemma 3's causal language model uses neither)")
    window = int(cfg.get("sliding_window") or 0)
    if window <= 0:
        raise ModelLoadError(f"{source}: a gemma3 config needs a positive sliding_window")
    local = dict((cfg.get("rope_parameters") or {}).get("sliding_attention") or {})
    theta = float(local.pop("rope_theta", cfg.get("rope_local_base_freq", 10_000.0)))
    if local.get("rope_type", "default") == "default":
        local = {}
    cap = cfg.get("final_logit_softcapping")
    return {"layer_windows": tuple(window if t == "sliding_attention" else None for t in types),
            "query_pre_attn_scalar": float(cfg.get("query_pre_attn_scalar") or 256),
            "local_rope_theta": theta, "local_rope_scaling": local or None,
            "final_logit_softcapping": float(cap) if cap else None}


def _deepseek_v3_fields(cfg: dict, source: str) -> dict:
    """The MLA fields of `ModelArch` from a DeepSeek-V3 config. What this engine does not implement
    is refused by name; the multi-token-prediction layers (`num_nextn_predict_layers`) are not
    part of the causal language model and their tensors are skipped as the weights load."""
    def positive(key: str) -> int:
        value = cfg.get(key)
        if not isinstance(value, int) or value <= 0:
            raise ModelLoadError(f"{source}: a deepseek_v3 config needs a positive integer {key!r}, got {value!r}")
        return value

    q_lora = cfg.get("q_lora_rank")
    if q_lora is not None and (not isinstance(q_lora, int) or q_lora <= 0):
        raise ModelLoadError(f"{source}: q_lora_rank must be a positive integer or null, got {q_lora!r}")
    if cfg.get("attention_bias"):
        raise UnsupportedModelError(f"{source}: attention_bias is not supported for deepseek_v3 "
                                    f"(DeepSeek-V3's projections have no biases)")
    rope = positive("qk_rope_head_dim")
    if rope % 2:
        raise ModelLoadError(f"{source}: qk_rope_head_dim must be even, got {rope}")
    return {"kv_lora_rank": positive("kv_lora_rank"), "q_lora_rank": q_lora,
            "qk_nope_head_dim": positive("qk_nope_head_dim"), "qk_rope_head_dim": rope,
            "v_head_dim": positive("v_head_dim"), "rope_interleave": bool(cfg.get("rope_interleave", True))}


def _deepseek_moe_fields(cfg: dict, source: str) -> dict:
    """DeepSeekMoE's fields: the routed experts (sigmoid scores, `noaux_tc` group-limited top-k),
    the shared experts beside them, and the first `first_k_dense_replace` layers dense."""
    scoring, method = cfg.get("scoring_func", "sigmoid"), cfg.get("topk_method", "noaux_tc")
    if scoring != "sigmoid" or method != "noaux_tc":
        raise UnsupportedModelError(f"{source}: deepseek_v3 routing scoring_func={scoring!r}, topk_method={method!r} "
                                    f"is not supported (only sigmoid with noaux_tc, DeepSeek-V3's)")
    if int(cfg.get("moe_layer_freq", 1) or 1) != 1:
        raise UnsupportedModelError(f"{source}: moe_layer_freq {cfg['moe_layer_freq']} is not supported (every "
                                    f"layer from first_k_dense_replace on is sparse)")
    experts = int(cfg.get("n_routed_experts") or cfg.get("num_local_experts") or 0)
    top_k = int(cfg.get("num_experts_per_tok") or 0)
    groups, topk_groups = int(cfg.get("n_group") or 1), int(cfg.get("topk_group") or 1)
    layers = int(cfg["num_hidden_layers"])
    if not experts or not top_k or not cfg.get("moe_intermediate_size"):
        raise ModelLoadError(f"{source}: a deepseek_v3 config needs n_routed_experts, num_experts_per_tok and "
                             f"moe_intermediate_size")
    if experts % groups or experts // groups < 2 or not 0 < topk_groups <= groups \
            or top_k > topk_groups * (experts // groups):
        raise ModelLoadError(f"{source}: n_group {groups} must divide n_routed_experts {experts} into groups of at "
                             f"least 2, topk_group {topk_groups} be at most n_group, and num_experts_per_tok "
                             f"{top_k} fit in topk_group groups")
    first_dense = int(cfg.get("first_k_dense_replace") or 0)
    return {"num_experts": experts, "num_experts_per_tok": top_k,
            "moe_intermediate_size": int(cfg["moe_intermediate_size"]),
            "norm_topk_prob": bool(cfg.get("norm_topk_prob", True)),
            "dense_layers": tuple(range(min(first_dense, layers))),
            "num_shared_experts": int(cfg.get("n_shared_experts") or 0),
            "n_group": groups, "topk_group": topk_groups,
            "routed_scaling_factor": float(cfg.get("routed_scaling_factor", 1.0))}

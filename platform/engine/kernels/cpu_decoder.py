"""A decode step in one C call (`cpu_decoder.c`), token ids to logits, for a model that can run
there; and the weight layout that step streams.

- `decoder_for(model, kv)`: a `DecoderModel` over the model's weights and this KV cache, or None
  where the model does not run in C (the runner then runs its `forward` and `compute_logits`).
- `lay_out_weights(model, packed_dtype)`: after loading, every module's `finalize` (its weights
  laid out for the kernels that run it), the linears that pack for pdserve's C matmul back to
  back in one arena, in the order a decode step reads them.
- `DecoderModel`: the C decoder: `decode_step`, and `stats` and `chaos` for tests.

The step runs the same kernels as the model's layers (at batch 1 the Python between them had cost
~3 ms of a ~12 ms step), on threads of its own that share the work without waiting for one
another, so a thread descheduled by the replica's other processes does not stall the step.

What it reads of a model is the Llama family's layout, by attribute: `model.model` holds
`embed_tokens`, `rotary`, `layers` and `norm`, and `model.lm_head` the LM head; each layer its
`input_layernorm`, `self_attn` (`qkv_proj`, `o_proj`, `attn`, and Qwen3's `q_norm` and `k_norm`),
`post_attention_layernorm` and `mlp`, a dense SwiGLU MLP (`gate_up_proj`, `down_proj`) where it
runs in C; linears say how they are packed (`packed_for`, `packed`). It imports no model code and
knows nothing of scheduling.
"""

from __future__ import annotations

import ctypes
import weakref
from array import array

import torch
from torch import nn

from pdserve.engine.kernels import cpu_kernels
from pdserve.engine.kv_cache import KVCache

# Weight bytes per work item of a decode step's matmuls: ~5 us of streaming, enough to pay for the
# item's bookkeeping; small enough that a thread that finds its share done can take over the rest.
DECODE_ITEM_BYTES = 128 * 1024


def decoder_for(model: nn.Module, kv: KVCache) -> DecoderModel | None:
    """This model over this KV cache as one C call per decode step (the same kernels as its
    `forward` and `compute_logits`, without Python between them), where the model runs there: a
    dense fp32 Llama-family model on CPU, one rank, every linear packed for pdserve's C matmul in
    one dtype (fp32 or bf16), and a dense fp32 or bf16 cache. None otherwise. A new decoder each
    call: the caller keeps it (its threads start with its first step)."""
    if not _runs_in_c(model) or not cpu_kernels.usable_cache(kv.kv):
        return None
    return _decoder(model, kv)


def _runs_in_c(model: nn.Module) -> bool:
    """Whether `DecoderModel` can run this model (after `lay_out_weights`)."""
    def plain(layer: nn.Module) -> bool:
        a, mlp = layer.self_attn, layer.mlp
        return (hasattr(mlp, "gate_up_proj") and hasattr(mlp, "down_proj")  # dense, not a mixture of experts
                and a.o_proj.tp_size == 1 and a.o_proj.bias is None
                and _qk_norms_run_in_c(layer)
                and all(lin.packed_for == "pdserve" for lin in (a.qkv_proj, a.o_proj, mlp.gate_up_proj, mlp.down_proj))
                and cpu_kernels.usable(layer.input_layernorm.weight, layer.post_attention_layernorm.weight))

    if not getattr(model, "runs_in_c_decoder", True):  # Gemma 3: sliding windows, four norms a layer
        return False
    m = model.model
    packed = {mod.packed.dtype for mod in model.modules() if getattr(mod, "packed_for", None) == "pdserve"}
    return (model.parallel.size == 1 and model.lm_head.packed_for == "pdserve" and len(packed) == 1
            and cpu_kernels.usable(m.embed_tokens.weight, m.rotary.cos_sin, m.norm.weight)
            and m.embed_tokens.weight.is_contiguous() and m.rotary.cos_sin.is_contiguous()
            and all(plain(layer) for layer in m.layers))


def _qk_norms_run_in_c(layer: nn.Module) -> bool:
    """No q/k norms, or Qwen3's: an RMSNorm of each q and k head (`weight * x / rms(x)`, fp32 weights
    `[head_dim]`) with the layer's epsilon. Gemma 3's `(1 + w)` norms never get here (it does not
    run in C)."""
    a = layer.self_attn
    norms = [getattr(a, name, None) for name in ("q_norm", "k_norm")]
    if norms == [None, None]:
        return True
    return (None not in norms and all(n.eps == layer.input_layernorm.eps for n in norms)
            and cpu_kernels.usable(*(n.weight for n in norms)) and all(n.weight.is_contiguous() for n in norms))


def _decoder(model: nn.Module, kv: KVCache) -> DecoderModel:
    def address(t: torch.Tensor | None) -> int | None:
        return None if t is None else t.data_ptr()

    m, head = model.model, model.lm_head
    pointers, tensors = [], [kv.kv]
    for i, layer in enumerate(m.layers):
        a, mlp = layer.self_attn, layer.mlp
        k_cache, v_cache = kv.layer(i).unbind(0)
        q_norm, k_norm = (getattr(getattr(a, name, None), "weight", None) for name in ("q_norm", "k_norm"))
        weights = [layer.input_layernorm.weight, layer.post_attention_layernorm.weight, a.qkv_proj.packed,
                   a.qkv_proj.bias, q_norm, k_norm, a.o_proj.packed, mlp.gate_up_proj.packed, mlp.down_proj.packed]
        tensors += [w for w in weights if w is not None]
        pointers.append(DecoderLayerPointers(*(address(w) for w in weights), address(k_cache), address(v_cache)))
    first = m.layers[0]
    attn = first.self_attn.attn
    shape = DecoderShape(first.input_layernorm.weight.shape[0], attn.num_heads, attn.num_kv_heads, attn.head_dim,
                         first.mlp.intermediate_size, kv.block_size, head.out_features, kv.num_blocks,
                         m.rotary.cos_sin.shape[0], kv.dtype == torch.bfloat16, head.packed.dtype == torch.bfloat16,
                         first.input_layernorm.eps, attn.scale)
    return DecoderModel(pointers, shape, m.embed_tokens.weight, m.rotary.cos_sin, m.norm.weight, head.packed, tensors)


def lay_out_weights(model: nn.Module, packed_dtype: torch.dtype = torch.float32) -> None:
    """After loading (and the model's own `finalize`): each module's `finalize` lays its weights
    out for inference (see models/layers.py). The linears that pack for pdserve's matmul
    (`packs_for_pdserve`) go back to back into one arena of `packed_dtype` (fp32, or bf16 for
    weight-only bf16), in module order: the order a decode step reads them (each layer's, then the
    LM head)."""
    packing = [m for m in model.modules() if getattr(m, "packs_for_pdserve", False)]
    arena = cpu_kernels.packed_arena([tuple(m.weight.shape) for m in packing], packed_dtype) if packing else []
    for module, buffer in zip(packing, arena):
        module.finalize(buffer)
    in_arena = {id(m) for m in packing}
    for module in model.modules():
        if module is not model and hasattr(module, "finalize") and id(module) not in in_arena:
            module.finalize()


class DecoderLayerPointers(ctypes.Structure):
    """`pdserve_decoder_layer`: one layer's weights (norms, Qwen3's q/k norms or NULL; linears packed
    by `pack_linear`, in bf16 where the shape's `weight_bf16` says so) and its K and V caches
    `[num_blocks, block_size, kv_heads, head_dim]` (fp32, or bf16 where the shape's `kv_bf16` says
    so), by address."""
    _fields_ = [(name, ctypes.c_void_p) for name in ("input_norm", "post_norm", "qkv", "qkv_bias", "q_norm", "k_norm",
                                                     "o", "gate_up", "down", "k_cache", "v_cache")]


class DecoderShape(ctypes.Structure):
    """`pdserve_decoder_shape`."""
    _fields_ = [(name, ctypes.c_int64) for name in ("hidden", "heads", "kv_heads", "head_dim", "intermediate",
                                                    "block_size", "vocab", "num_blocks", "max_position", "kv_bf16",
                                                    "weight_bf16")] + [
        ("eps", ctypes.c_float), ("scale", ctypes.c_float)]


class _DecoderModelPointers(ctypes.Structure):
    """`pdserve_decoder_model`."""
    _fields_ = [("layers", ctypes.c_void_p), ("num_layers", ctypes.c_int64)] + [
        (name, ctypes.c_void_p) for name in ("embedding", "cos_sin", "final_norm", "lm_head")]


class DecoderModel:
    """A dense decoder model as the C side sees it (`pdserve_decoder`), for `decode_step`: its
    layers, the embedding table `[vocab rows, hidden]`, the rotary table `[max_position, 2,
    head_dim // 2]`, the final norm's weight and the LM head packed by `cpu_kernels.pack_linear`,
    all fp32 and dense. `tensors`: every tensor behind those addresses (weights, the KV cache), kept alive here
    for as long as the decoder's threads may read them. One caller at a time (the engine's loop)."""

    def __init__(self, layers: list[DecoderLayerPointers], shape: DecoderShape, embedding: torch.Tensor,
                 cos_sin: torch.Tensor, final_norm: torch.Tensor, lm_head: torch.Tensor,
                 tensors: list[torch.Tensor]):
        lib = cpu_kernels.load()
        self.shape = shape
        self._tensors = [embedding, cos_sin, final_norm, lm_head, *tensors]
        pointers = (DecoderLayerPointers * len(layers))(*layers)
        model = _DecoderModelPointers(ctypes.addressof(pointers), len(layers), embedding.data_ptr(),
                                      cos_sin.data_ptr(), final_norm.data_ptr(), lm_head.data_ptr())
        handle = lib.pdserve_decoder_new(ctypes.byref(model), ctypes.byref(shape), DECODE_ITEM_BYTES)  # copies
        if not handle:
            raise MemoryError("could not allocate the CPU decoder")
        self._handle = handle
        # Joins the decoder's threads and frees it when this object goes (or at exit), before the
        # tensors above can go.
        self._free = weakref.finalize(self, lib.pdserve_decoder_free, handle)

    def decode_step(self, ints: array, m: int, width: int,
                    greedy: bool = False) -> tuple[torch.Tensor, list[int] | None]:
        """Logits `[m, vocab]` of a decode-only step, one new token per sequence, and with `greedy`
        each row's argmax token (as `cpu_kernels.argmax`; else None). `ints`: int64, `m` token ids,
        then their positions, cache slots and sequence lengths (`m` each), then the block tables
        (`m` rows of `width`). Writes the tokens' K and V into the cache."""
        logits = torch.empty(m, self.shape.vocab, dtype=torch.float32)
        tokens = (ctypes.c_int64 * m)() if greedy else None
        failed = cpu_kernels.load().pdserve_decoder_step(self._handle, ints.buffer_info()[0], m, width,
                                                         logits.data_ptr(), tokens, torch.get_num_threads())
        if failed == 1:
            raise MemoryError("the CPU decode step could not allocate its buffers")
        if failed:
            raise ValueError("a decode step's token id, position, cache slot, length or block id is out of range")
        return logits, None if tokens is None else list(tokens)

    def stats(self) -> dict[str, int]:
        """Since this decoder was made: steps; items a thread took from another's share (`stolen`);
        items a thread computed because the one that claimed them sat on them (`redone`);
        results dropped because another thread published first (`dropped`)."""
        out = (ctypes.c_int64 * 4)()
        cpu_kernels.load().pdserve_decoder_stats(self._handle, out)
        return dict(zip(("steps", "stolen", "redone", "dropped"), out))

    def chaos(self, permille: int, max_us: int) -> None:
        """For tests: every thread sleeps up to `max_us` before `permille` of its publishes and of
        its steps, as threads descheduled by other processes would."""
        cpu_kernels.load().pdserve_decoder_chaos(self._handle, permille, max_us)

"""pdserve's fp32 CPU kernels (`cpu_*.c`, one file per kernel family; `cpu_runtime.h` lists
them): built into one library on first use, called through ctypes.

- `paged_decode_attention`: one pass over each sequence's KV blocks (no gather, no padding).
- `paged_prefill_attention`: a sequence's chunk of queries, causal over its cached prefix and
  itself, on the matmul's tiles (torch's CPU flash attention wastes much of a causal product).
  Both take a sliding window (a layer's last W positions), and then read only the blocks it reaches.
- `pack_linear` / `linear`: the linear layers' matmul over weights packed in column panels; at
  decode batch sizes it streams the weights faster than oneDNN's or MKL's matmul on these shapes.
  Panels hold fp32, or bf16 (weight-only bf16: rounded once when packed, widened exactly in
  registers, products and sums in fp32), which halves the bytes a decode step streams.
- the decode step in one call (`pdserve_decoder_*`): bound here, driven by `cpu_decoder.py`.
- `argmax`: greedy sampling's argmax over the vocabulary.
- `token_bitmask`: a grammar's packed token mask applied to logits (constrained decoding).
- `rms_norm` (optionally adding the residual first), `silu_mul`, `rotary_`: one pass each where
  torch runs several ops with temporaries; at decode batch sizes those per-op costs add up.

The C sources are compiled together, once per machine type, with the system C compiler into one
library in the cache directory (`$PDSERVE_CACHE_DIR/kernels`), keyed by every source and header,
the compiler, its flags and the CPU, so a shared cache serves mixed hosts.
`$PDSERVE_CPU_KERNELS_CFLAGS` adds flags (say `-mno-avx512f` to run the AVX2 kernels on a CPU that
has AVX-512). Replicas starting together may race to build it: each builds into a file of its
own and renames it into place, so a reader sees a whole library or none.

Where no compiler is found, or the build fails, `load()` logs why once and returns None, and
the model stays on the torch path. `PDSERVE_CPU_KERNELS=torch` chooses the torch path on
purpose (for comparisons). Callers check `usable(...)` first.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shlex
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

SOURCES = sorted(Path(__file__).parent.glob("cpu_*.c"))  # compiled together into one library
HEADERS = sorted(Path(__file__).parent.glob("cpu_*.h"))
_FLAGS = ["-O3", "-march=native", "-fopenmp", "-pthread", "-fPIC", "-shared", "-std=c11"]
CFLAGS_ENV = "PDSERVE_CPU_KERNELS_CFLAGS"  # appended to _FLAGS, e.g. "-mno-avx512f" (the AVX2 kernels)
_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_tried = False


class KernelBuildError(RuntimeError):
    """The C compiler failed on the kernel source (the message holds its output)."""


def enabled() -> bool:
    return os.environ.get("PDSERVE_CPU_KERNELS", "auto").lower() != "torch"


def _compiler() -> str | None:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def _cpu_id() -> str:
    """What `-march=native` depends on: the CPU's model and flags."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [ln for ln in f if ln.startswith(("model name", "flags"))][:2]
        return "".join(lines)
    except OSError:
        return platform.processor() or platform.machine()


def _build_key(compiler: str, flags: list[str]) -> str:
    """What the library depends on: every source and header (name and text), the compiler, its
    flags and the CPU."""
    digest = hashlib.sha256()
    for path in SOURCES + HEADERS:
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    digest.update(compiler.encode() + b"\0" + " ".join(flags).encode() + b"\0" + _cpu_id().encode())
    return digest.hexdigest()[:16]


def build(compiler: str, out_dir: Path) -> Path:
    """Compile the kernel sources into one library in `out_dir` (once per `_build_key`) and return its path."""
    flags = _FLAGS + shlex.split(os.environ.get(CFLAGS_ENV, ""))
    key = _build_key(compiler, flags)
    target = out_dir / f"cpu_kernels-{key}.so"
    if target.is_file():
        return target
    out_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=target.stem, suffix=".so.tmp", dir=out_dir)
    os.close(fd)
    try:
        result = subprocess.run([compiler, *flags, *map(str, SOURCES), "-o", tmp, "-lm"],
                                capture_output=True, text=True, timeout=120)
        if result.returncode != 0:
            raise KernelBuildError(f"{compiler} failed on the kernel sources:\n{result.stderr.strip()}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def load() -> ctypes.CDLL | None:
    """The kernel library, built on first use; None where it cannot be built (logged once)."""
    global _lib, _tried
    if _tried:
        return _lib
    with _lock:
        if _tried:
            return _lib
        from pdserve.engine.checkpoint import cache_dir

        compiler = _compiler()
        if compiler is None:
            logger.warning("no C compiler (cc, gcc or clang) found: the model runs on the slower torch path "
                           "on CPU; install gcc to build pdserve's kernels")
        else:
            try:
                lib = ctypes.CDLL(str(build(compiler, cache_dir() / "kernels")))
                for name, (restype, argtypes) in _SIGNATURES.items():
                    fn = getattr(lib, name)
                    fn.restype, fn.argtypes = restype, argtypes
                _lib = lib
            except (KernelBuildError, OSError, subprocess.SubprocessError, AttributeError) as e:
                logger.warning("the model runs on the slower torch path on CPU: %s", e)
        _tried = True
        return _lib


def usable(*tensors: torch.Tensor, dtypes: tuple[torch.dtype, ...] = (torch.float32,)) -> bool:
    """Whether the kernels take these tensors: of `dtypes` (fp32) on CPU, last dimension dense
    (each kernel's own layout needs are checked by its caller), and the library built. (Called
    several times per layer and step: kept to plain checks.)"""
    if not enabled():
        return False
    for t in tensors:
        if t.dtype not in dtypes or t.device.type != "cpu" or t.stride(-1) != 1:
            return False
    return load() is not None


def usable_cache(cache: torch.Tensor) -> bool:
    """Whether the kernels read this KV cache: dense, fp32 or bf16 (`usable`'s other checks)."""
    return cache.is_contiguous() and usable(cache, dtypes=(torch.float32, torch.bfloat16))


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                           window: int | None = None) -> torch.Tensor:
    """Same contract as `paged_attention.paged_decode_attention` (check `usable(q)` and `usable_cache`):
    q `[batch, num_heads, head_dim]`, caches `[num_blocks, block_size, num_kv_heads, head_dim]`,
    block_tables `[batch, width]` int64, seq_lens `[batch]` int64 -> `[batch, num_heads, head_dim]`.
    With a `window`, the tables are read from each window's first block on."""
    batch, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1:3]
    tables = block_tables.contiguous()
    lens = seq_lens.contiguous()
    out = torch.empty(batch, num_heads, head_dim, dtype=q.dtype)
    failed = load().pdserve_paged_decode_attention_f32(
        q.data_ptr(), q.stride(0), q.stride(1), k_cache.data_ptr(), v_cache.data_ptr(),
        k_cache.dtype == torch.bfloat16, tables.data_ptr(), tables.shape[1], lens.data_ptr(), out.data_ptr(), batch,
        num_heads, num_kv_heads, head_dim, block_size, window or 0, scale, torch.get_num_threads())
    if failed:
        raise MemoryError("the CPU attention kernel could not allocate its scratch memory")
    return out


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_table: torch.Tensor, context_len: int, scale: float,
                            out: torch.Tensor | None = None, window: int | None = None) -> torch.Tensor:
    """One sequence's chunk, as `paged_attention.paged_prefill_attention` computes it, with the
    chunk's K/V read from the cache (written there first). Check `usable(q)` and `usable_cache`.
    q `[q_len, num_heads, head_dim]` (heads dense within a token), block_table `[num_blocks]`
    int64 -> `out`, `[q_len, num_heads, head_dim]` with dense tokens (given, or new). With a
    `window`, the table is read from the first query's window's first block on."""
    q_len, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1:3]
    table = block_table.contiguous()
    if out is None:
        out = torch.empty(q_len, num_heads, head_dim, dtype=q.dtype)
    failed = load().pdserve_paged_prefill_attention_f32(
        q.data_ptr(), q.stride(0), q.stride(1), k_cache.data_ptr(), v_cache.data_ptr(),
        k_cache.dtype == torch.bfloat16, table.data_ptr(), context_len, q_len, out.data_ptr(), out.stride(0),
        num_heads, num_kv_heads, head_dim, block_size, window or 0, scale, torch.get_num_threads())
    if failed:
        raise MemoryError("the CPU attention kernel could not allocate its scratch memory")
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, delta: torch.Tensor | None = None) -> torch.Tensor:
    """`x / sqrt(mean(x^2) + eps) * weight` over the last dimension of dense `[rows, dim]` x; with
    `delta`, x += delta first, in place (the residual add fused into the next norm)."""
    out = torch.empty_like(x)
    load().pdserve_rms_norm_f32(x.data_ptr(), None if delta is None else delta.contiguous().data_ptr(),
                                weight.data_ptr(), out.data_ptr(), x.shape[0], x.shape[1], eps,
                                torch.get_num_threads())
    return out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """`silu(gate) * up` for dense `[rows, 2 * dim]` holding gate and up side by side -> `[rows, dim]`."""
    rows, dim = gate_up.shape[0], gate_up.shape[1] // 2
    out = gate_up.new_empty(rows, dim)
    load().pdserve_silu_mul_f32(gate_up.data_ptr(), out.data_ptr(), rows, dim, torch.get_num_threads())
    return out


def rotary_(x: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
    """Rotate x `[tokens, heads, head_dim]` in place (neox halves); heads dense within a token
    (`x.stride(1) == head_dim`), tokens at any stride; cos_sin dense `[tokens, 2, head_dim // 2]`."""
    tokens, heads, head_dim = x.shape
    load().pdserve_rotary_f32(x.data_ptr(), tokens, heads, head_dim, x.stride(0), cos_sin.data_ptr(),
                              torch.get_num_threads())
    return x


PACKED_DTYPES = (torch.float32, torch.bfloat16)  # what a packed weight's panels may hold


def packed_elements(out_features: int, in_features: int) -> int:
    """Elements `pack_linear` writes for an `[out, in]` weight."""
    return -(-out_features // PANEL) * PANEL * in_features


def pack_linear(weight: torch.Tensor, out: torch.Tensor | None = None,
                dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A dense fp32 `[out, in]` weight in `linear`'s layout: column panels `[ceil(out / 16), in, 16]`,
    zero-padded (flat), in `dtype` (fp32, or bf16 rounded to nearest even as torch rounds), on
    transparent huge pages where the kernel grants them. Written into `out` (flat,
    `packed_elements` long; its dtype wins) when given, else into a buffer of its own."""
    n, k = weight.shape
    weight = weight.contiguous()
    packed = torch.empty(packed_elements(n, k), dtype=dtype) if out is None else out
    if packed.dtype not in PACKED_DTYPES:
        raise ValueError(f"packed weights hold one of {PACKED_DTYPES}, not {packed.dtype}")
    load().pdserve_pack_linear_f32(weight.data_ptr(), n, k, packed.data_ptr(), packed.dtype == torch.bfloat16,
                                   torch.get_num_threads())
    return packed


def packed_arena(shapes: list[tuple[int, int]], dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    """Buffers for `pack_linear(w, out=...)`, one per `[out, in]` shape, back to back in one
    allocation that starts on a 2 MiB boundary and asks for 2 MiB pages as a whole.

    Packed one by one, a layer's matrices (1-6 MiB here) start anywhere: the huge pages the kernel
    grants cover only the whole 2 MiB pages inside each (56 of the benchmark model's 152 MiB stayed
    on 4 KiB pages). In one arena, in the order a decode step reads them, its 33 matrices take
    ~1.01x the time of one GEMV over the same bytes, down from ~1.055x (benchmarks/RESULTS.md)."""
    sizes = [packed_elements(n, k) for n, k in shapes]
    size = torch.empty(0, dtype=dtype).element_size()
    page = (2 << 20) // size  # elements in 2 MiB
    raw = torch.empty(sum(sizes) + page, dtype=dtype)
    start = -(raw.data_ptr() // size) % page
    arena = raw[start:start + sum(sizes)]
    load().pdserve_want_huge_pages(arena.data_ptr(), arena.numel() * size)
    return list(torch.split(arena, sizes))


def linear(x: torch.Tensor, packed: torch.Tensor, out_features: int, bias: torch.Tensor | None) -> torch.Tensor:
    """`x @ W^T + bias` for fp32 x `[..., in]` and W packed by `pack_linear` -> fp32 `[..., out_features]`."""
    k = x.shape[-1]
    rows = x.reshape(-1, k).contiguous()
    out = torch.empty(rows.shape[0], out_features, dtype=torch.float32)
    if rows.shape[0]:
        load().pdserve_linear_f32(rows.data_ptr(), rows.shape[0], k, packed.data_ptr(),
                                  packed.dtype == torch.bfloat16, out_features,
                                  None if bias is None else bias.contiguous().data_ptr(), out.data_ptr(),
                                  torch.get_num_threads())
    return out.view(*x.shape[:-1], out_features)


def argmax(x: torch.Tensor) -> torch.Tensor:
    """`x.argmax(dim=-1)` for dense `[rows, n]` x, n > 0 (torch's runs ~45 us over a 32k vocabulary)."""
    out = torch.empty(x.shape[0], dtype=torch.long)
    load().pdserve_argmax_f32(x.data_ptr(), x.shape[0], x.shape[1], out.data_ptr(), torch.get_num_threads())
    return out


def token_bitmask(x: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """A copy of dense fp32 `[rows, n]` x with -inf for every token dense int32 `[rows, words]`
    `bitmask` does not allow (bit t % 32 of word t // 32; tokens from 32 * words on: -inf)."""
    out = torch.empty_like(x)
    load().pdserve_token_bitmask_f32(x.data_ptr(), bitmask.data_ptr(), x.shape[0], x.shape[1], bitmask.shape[1],
                                     out.data_ptr())
    return out


PANEL = 16  # columns per panel of a packed weight (cpu_linear.h)
_P, _I, _F, _T = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
_SIGNATURES = {
    "pdserve_paged_decode_attention_f32": (ctypes.c_int, [_P, _I, _I, _P, _P, _T, _P, _I, _P, _P, _I, _I, _I, _I,
                                                          _I, _I, _F, _T]),
    "pdserve_paged_prefill_attention_f32": (ctypes.c_int, [_P, _I, _I, _P, _P, _T, _P, _I, _I, _P, _I, _I, _I, _I,
                                                           _I, _I, _F, _T]),
    "pdserve_rms_norm_f32": (None, [_P, _P, _P, _P, _I, _I, _F, _T]),
    "pdserve_silu_mul_f32": (None, [_P, _P, _I, _I, _T]),
    "pdserve_rotary_f32": (None, [_P, _I, _I, _I, _I, _P, _T]),
    "pdserve_pack_linear_f32": (None, [_P, _I, _I, _P, _T, _T]),
    "pdserve_want_huge_pages": (None, [_P, _I]),
    "pdserve_linear_f32": (None, [_P, _I, _I, _P, _T, _I, _P, _P, _T]),
    "pdserve_decoder_new": (_P, [_P, _P, _I]),
    "pdserve_decoder_free": (None, [_P]),
    "pdserve_decoder_step": (ctypes.c_int, [_P, _P, _I, _I, _P, _P, _T]),
    "pdserve_decoder_stats": (None, [_P, _P]),
    "pdserve_decoder_chaos": (None, [_P, _T, _T]),
    "pdserve_argmax_f32": (None, [_P, _I, _I, _P, _T]),
    "pdserve_token_bitmask_f32": (None, [_P, _P, _I, _I, _I, _P]),
}

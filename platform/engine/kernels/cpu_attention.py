"""The CPU decode-attention kernel (`cpu_attention.c`): built on first use, called through ctypes.

The C source is compiled once per machine type with the system C compiler into the cache
directory (`$PDSERVE_CACHE_DIR/kernels`), keyed by the source, the compiler and the CPU, so a
shared cache serves mixed hosts. Replicas starting together may race to build it: each builds
into a file of its own and renames it into place, so a reader sees a whole library or none.

Where no compiler is found, or the build fails, `load()` logs why once and returns None, and
attention stays on the torch path. `PDSERVE_CPU_ATTENTION=torch` chooses the torch path on
purpose (for comparisons).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_attention.c")
_FLAGS = ["-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-std=c11"]
_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_tried = False


class KernelBuildError(RuntimeError):
    """The C compiler failed on the kernel source (the message holds its output)."""


def enabled() -> bool:
    return os.environ.get("PDSERVE_CPU_ATTENTION", "auto").lower() != "torch"


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


def build(compiler: str, out_dir: Path) -> Path:
    """Compile the kernel into `out_dir` (once per source, compiler and CPU) and return its path."""
    key = hashlib.sha256(SOURCE.read_bytes() + compiler.encode() + " ".join(_FLAGS).encode()
                         + _cpu_id().encode()).hexdigest()[:16]
    target = out_dir / f"cpu_attention-{key}.so"
    if target.is_file():
        return target
    out_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=target.stem, suffix=".so.tmp", dir=out_dir)
    os.close(fd)
    try:
        result = subprocess.run([compiler, *_FLAGS, str(SOURCE), "-o", tmp, "-lm"],
                                capture_output=True, text=True, timeout=120)
        if result.returncode != 0:
            raise KernelBuildError(f"{compiler} failed on {SOURCE.name}:\n{result.stderr.strip()}")
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
            logger.warning("no C compiler (cc, gcc or clang) found: CPU decode attention runs on the slower "
                           "torch path; install gcc to build pdserve's kernel")
        else:
            try:
                lib = ctypes.CDLL(str(build(compiler, cache_dir() / "kernels")))
                fn = lib.pdserve_paged_decode_attention_f32
                fn.restype = ctypes.c_int
                fn.argtypes = ([ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64] + [ctypes.c_void_p] * 3
                               + [ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p] + [ctypes.c_int64] * 5
                               + [ctypes.c_float, ctypes.c_int])
                _lib = lib
            except (KernelBuildError, OSError, subprocess.SubprocessError) as e:
                logger.warning("CPU decode attention runs on the slower torch path: %s", e)
        _tried = True
        return _lib


def supports(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether the kernel takes these inputs: fp32 on CPU, dense cache, dense head dimension."""
    return (enabled() and q.device.type == "cpu" and q.dtype == torch.float32 and k_cache.dtype == torch.float32
            and k_cache.is_contiguous() and q.stride(-1) == 1 and load() is not None)


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """Same contract as `paged_attention.paged_decode_attention` (check `supports` first):
    q `[batch, num_heads, head_dim]`, caches `[num_blocks, block_size, num_kv_heads, head_dim]`,
    block_tables `[batch, width]` int64, seq_lens `[batch]` int64 -> `[batch, num_heads, head_dim]`."""
    batch, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1:3]
    tables = block_tables.contiguous()
    lens = seq_lens.contiguous()
    out = torch.empty(batch, num_heads, head_dim, dtype=q.dtype)
    failed = load().pdserve_paged_decode_attention_f32(
        q.data_ptr(), q.stride(0), q.stride(1), k_cache.data_ptr(), v_cache.data_ptr(), tables.data_ptr(),
        tables.shape[1], lens.data_ptr(), out.data_ptr(), batch, num_heads, num_kv_heads, head_dim, block_size,
        scale, torch.get_num_threads())
    if failed:
        raise MemoryError("the CPU attention kernel could not allocate its scratch memory")
    return out

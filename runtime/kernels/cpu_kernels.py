"""Our CPU kernels, built and loaded: paged attention, KV store and small ops (``cpu_kernels.c``,
wrapped here), int8/int4 weight products and the int8 KV cache (``quant_kernels.c`` and
``a8_kernels.c``, wrapped by ``quant_ops.py``), and a whole decode step in one call
(``decode_step.c``, driven by ``decode_step.py``).

The system C compiler builds them once per source, compiler and CPU (``-O3 -march=native
-fopenmp``) into the cache folder, where later processes find them; ctypes calls them and
releases the GIL meanwhile. An image ships them built for each x86-64 level instead
(:mod:`ladle.runtime.kernels.prebuilt`), so that its pods start without a compiler run.
Instruction sets are picked at build time from the compiler's predefined macros, so
``-march=native`` (or the level) decides; tests build extra variants with flags such as
``-mno-avx512f`` to run the portable paths too. Without a working compiler, :func:`load` returns
None and the engine keeps the plain torch path, which computes the same things.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
from pathlib import Path

import torch

from ladle.runtime.kernels import prebuilt
from ladle.runtime.models.loader import cache_dir

log = logging.getLogger(__name__)

FLAGS = ("-march=native", *prebuilt.COMMON_FLAGS)


_P, _I32, _I64, _F32 = ctypes.c_void_p, ctypes.c_int32, ctypes.c_int64, ctypes.c_float
# (return type, argument types) of each entry point in cpu_kernels.c.
_SIGNATURES: dict[str, tuple[type | None, list[type]]] = {
    **{
        f"ladle_paged_decode_attention_{kv}": (
            ctypes.c_int,
            [_P, _I64, _P, _P, _P, _I64, _P, _P, _I32, _I32, _I32, _I32, _I32, _F32, _I32],
        )
        for kv in ("f32", "f16")
    },
    "ladle_rms_norm_f32": (None, [_P, _P, _P, _P, _I64, _I32, _F32, _I32]),
    "ladle_rope_f32": (None, [_P, _I32, _I64, _P, _I32, _I64, _P, _P, _I64, _I32, _I32]),
    **{
        f"ladle_store_kv_{kv}": (None, [_P, _I64, _P, _I64, _P, _P, _P, _I64, _I32])
        for kv in ("f32", "f16")
    },
    "ladle_silu_and_mul_f32": (None, [_P, _P, _I64, _I32, _I32]),
    **{
        f"ladle_paged_prefill_attention_{kv}": (
            ctypes.c_int,
            [_P, _I64, _P, _P, _P, _I64, _P, _P, _P, _I32, _I32, _I32, _I32, _I32, _F32, _I32],
        )
        for kv in ("f32", "f16")
    },
    "ladle_quant_isa": (ctypes.c_int, []),
    "ladle_linear_i8": (
        ctypes.c_int,
        [_P, _I64, _P, _P, _P, _P, _I64, _I64, _I32, _I32, _I32],
    ),
    "ladle_linear_groups": (
        ctypes.c_int,
        [_P, _I64, _P, _P, _P, _P, _P, _I64, _I64, _I32, _I32, _I32, _I32, _P, _I32],
    ),
    "ladle_a8_supported": (ctypes.c_int, []),
    "ladle_dequantize_i8": (None, [_P, _P, _P, _I32, _I32, _I32]),
    "ladle_dequantize_groups": (None, [_P, _P, _P, _P, _I32, _I32, _I32, _I32, _I32]),
    "ladle_decode_step": (ctypes.c_int, [_P, _P, _P, _P, _P, _I64, _P, _I32, _I32, _P]),
    "ladle_store_kv_i8": (None, [_P, _I64, _P, _I64, _P, _P, _P, _P, _P, _I64, _I32, _I32]),
    "ladle_paged_decode_attention_i8": (
        ctypes.c_int,
        [_P, _I64, _P, _P, _P, _P, _P, _I64, _P, _P, _I32, _I32, _I32, _I32, _I32, _F32, _I32],
    ),
}


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


def _build(compiler: str, extra_flags: tuple[str, ...]) -> Path:
    version = subprocess.run(
        [compiler, "--version"], capture_output=True, text=True, check=True
    ).stdout
    sources = [s.read_text() for s in (*prebuilt.SOURCES, prebuilt.HEADER)]
    key = hashlib.sha256(
        "\0".join([*sources, version, _cpu_flags(), *FLAGS, *extra_flags]).encode()
    ).hexdigest()[:16]
    target = cache_dir() / "kernels" / f"cpu_kernels-{key}.so"
    if target.is_file():
        return target
    prebuilt.compile_library(compiler, (*FLAGS, *extra_flags), target)
    log.info("built the CPU kernels", extra={"path": str(target)})
    return target


def compiler() -> str | None:
    """The C compiler the kernels are built with: ``$CC``, else ``cc`` or ``gcc`` on PATH."""
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def _library(extra_flags: tuple[str, ...]) -> Path | None:
    """The image's prebuilt library for this CPU, else one built here (None: no compiler)."""
    if not extra_flags and (found := prebuilt.find()) is not None:
        level, path = found
        log.info("using the prebuilt CPU kernels", extra={"target": level, "path": str(path)})
        return path
    cc = compiler()
    if cc is None:
        log.warning("no C compiler found; the CPU path uses plain torch")
        return None
    return _build(cc, extra_flags)


@functools.cache
def load(extra_flags: tuple[str, ...] = ()) -> ctypes.CDLL | None:
    """The kernel library, or None (with a warning saying why) when it cannot be built.

    ``extra_flags`` follow ``-march=native`` (``("-mno-avx512f",)`` builds the AVX2 path on an
    AVX-512 machine); the engine always uses the plain build, or the image's prebuilt one."""
    try:
        path = _library(extra_flags)
        if path is None:
            return None
        lib = ctypes.CDLL(str(path))
    except (OSError, subprocess.CalledProcessError) as err:
        detail = getattr(err, "stderr", None) or str(err)
        log.warning(
            "could not build the CPU kernels; the CPU path uses plain torch",
            extra={"error": detail.strip()[-2000:]},
        )
        return None
    for name, (restype, argtypes) in _SIGNATURES.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = restype, argtypes
    return lib


# The cache types the fp32 kernels read and write, by their C names' suffix.
KV_DTYPES = {torch.float32: "f32", torch.float16: "f16"}


def _kv(key_cache: torch.Tensor, value_cache: torch.Tensor) -> str:
    assert key_cache.dtype == value_cache.dtype
    return KV_DTYPES[key_cache.dtype]


def silu_and_mul(lib: ctypes.CDLL, x: torch.Tensor) -> torch.Tensor:
    """``silu(x[..., :n]) * x[..., n:]`` for the fused gate/up output [T, 2n]."""
    x = x.contiguous()
    assert x.dtype == torch.float32
    n = x.shape[-1] // 2
    out = x.new_empty((*x.shape[:-1], n))
    lib.ladle_silu_and_mul_f32(
        x.data_ptr(), out.data_ptr(), x.numel() // (2 * n), n, torch.get_num_threads()
    )
    return out


def store_kv(
    lib: ctypes.CDLL,
    k: torch.Tensor,
    v: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slots: torch.Tensor,
) -> None:
    """``cache[slots[t]] = k[t]`` (and v): k, v [T, Hkv, D] fp32 with dense heads, possibly row
    views of the QKV output; caches [num_blocks, block_size, Hkv, D], fp32 or fp16 (rounded to
    nearest even); slots int64."""
    tokens, num_kv_heads, head_dim = k.shape
    assert k.dtype == v.dtype == torch.float32
    assert k.stride()[1:] == v.stride()[1:] == (head_dim, 1)
    assert key_cache.is_contiguous()
    assert value_cache.is_contiguous()
    assert slots.dtype == torch.int64
    assert slots.is_contiguous()
    getattr(lib, f"ladle_store_kv_{_kv(key_cache, value_cache)}")(
        k.data_ptr(),
        k.stride(0),
        v.data_ptr(),
        v.stride(0),
        key_cache.data_ptr(),
        value_cache.data_ptr(),
        slots.data_ptr(),
        tokens,
        num_kv_heads * head_dim,
    )


def rope_(
    lib: ctypes.CDLL, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> None:
    """Rotate q [T, Hq, D] and k [T, Hkv, D] in place. They may be row views of a wider buffer
    (the QKV output) as long as their heads are dense; cos and sin are [T, D/2]."""
    tokens, q_heads, head_dim = q.shape
    assert q.dtype == k.dtype == torch.float32
    assert q.stride()[1:] == k.stride()[1:] == (head_dim, 1)
    cos, sin = cos.reshape(tokens, -1).contiguous(), sin.reshape(tokens, -1).contiguous()
    assert cos.shape[1] * 2 == head_dim
    lib.ladle_rope_f32(
        q.data_ptr(),
        q_heads,
        q.stride(0),
        k.data_ptr(),
        k.shape[1],
        k.stride(0),
        cos.data_ptr(),
        sin.data_ptr(),
        tokens,
        head_dim,
        torch.get_num_threads(),
    )


def rms_norm(
    lib: ctypes.CDLL,
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """RMSNorm over the last dimension; with ``residual``, ``residual += x`` (in place) first
    and the sum is normalized. fp32, contiguous ``weight`` and ``residual``."""
    x = x.contiguous()
    assert x.dtype == weight.dtype == torch.float32
    assert weight.is_contiguous()
    if residual is not None:
        assert residual.is_contiguous()
        assert residual.shape == x.shape
    out = torch.empty_like(x)
    cols = x.shape[-1]
    lib.ladle_rms_norm_f32(
        x.data_ptr(),
        None if residual is None else residual.data_ptr(),
        weight.data_ptr(),
        out.data_ptr(),
        x.numel() // cols,
        cols,
        eps,
        torch.get_num_threads(),
    )
    return out


def paged_decode_attention(
    lib: ctypes.CDLL,
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor,
) -> None:
    """``out[s] = softmax(q[s] K_s^T * scale) V_s`` for one query token per sequence.

    q/out: [num_seqs, num_heads, head_dim] fp32 (q may be rows of the QKV output); caches:
    [num_blocks, block_size, num_kv_heads, head_dim] fp32 or fp16; block_tables int32 with unit
    column stride; seq_lens int32.
    """
    for t in (key_cache, value_cache, out, seq_lens):
        assert t.is_contiguous()
    assert q.stride()[1:] == (q.shape[2], 1)  # dense heads; tokens may be QKV rows apart
    assert block_tables.stride(1) == 1
    assert block_tables.dtype == seq_lens.dtype == torch.int32
    num_seqs, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    failed = getattr(lib, f"ladle_paged_decode_attention_{_kv(key_cache, value_cache)}")(
        q.data_ptr(),
        q.stride(0),
        key_cache.data_ptr(),
        value_cache.data_ptr(),
        block_tables.data_ptr(),
        block_tables.stride(0),
        seq_lens.data_ptr(),
        out.data_ptr(),
        num_seqs,
        num_heads,
        num_kv_heads,
        head_dim,
        block_size,
        scale,
        torch.get_num_threads(),
    )
    if failed:
        raise MemoryError("CPU decode attention could not allocate its score buffer")


def paged_prefill_attention(
    lib: ctypes.CDLL,
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start: torch.Tensor,
    scale: float,
    out: torch.Tensor,
) -> None:
    """Causal attention of every prefill chunk of a step over its whole paged context.

    q/out: the chunks' tokens [T, num_heads, head_dim] fp32 (q may be rows of the QKV output);
    caches fp32 or fp16; block_tables, seq_lens (context including the chunk) and query_start
    ([num_seqs + 1], row offsets into q from 0) describe the same sequences; int32.
    """
    for t in (key_cache, value_cache, out, seq_lens, query_start):
        assert t.is_contiguous()
    assert q.stride()[1:] == (q.shape[2], 1)
    assert block_tables.stride(1) == 1
    assert block_tables.dtype == seq_lens.dtype == query_start.dtype == torch.int32
    _, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    failed = getattr(lib, f"ladle_paged_prefill_attention_{_kv(key_cache, value_cache)}")(
        q.data_ptr(),
        q.stride(0),
        key_cache.data_ptr(),
        value_cache.data_ptr(),
        block_tables.data_ptr(),
        block_tables.stride(0),
        seq_lens.data_ptr(),
        query_start.data_ptr(),
        out.data_ptr(),
        seq_lens.shape[0],
        num_heads,
        num_kv_heads,
        head_dim,
        block_size,
        scale,
        torch.get_num_threads(),
    )
    if failed:
        raise MemoryError("CPU prefill attention could not allocate its score buffer")

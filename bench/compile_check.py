#!/usr/bin/env python3
"""Compile every Triton kernel for a GPU target without a GPU, and report registers/spills.

The interpreter proves what the kernels compute, not that they compile for a GPU: dot shape
limits, dtype rules and register pressure only show up in the real compiler. Triton ships
``ptxas`` and ``cuobjdump``, so this runs on any machine::

    .venv/bin/python bench/compile_check.py            # all serving specializations, sm_90
    .venv/bin/python bench/compile_check.py --quick    # one of each kernel (the test uses it)

Exits non-zero if a kernel fails to compile or spills registers to local memory.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT / "src") not in sys.path:
    sys.path.insert(0, str(ROOT / "src"))
os.environ.pop("TRITON_INTERPRET", None)  # compiled kernels, not interpreted ones

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from ladle.runtime.kernels import attention, attention_prefill, fused, kv_store  # noqa: E402

BF16, FP32 = torch.bfloat16, torch.float32
TRITON_TYPE = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


def attention_signature(kernel: Any, q: torch.dtype, int8: bool, splits: int) -> dict[str, str]:
    q_type = TRITON_TYPE[q]
    cache = "i8" if int8 else q_type
    pointers = {
        "q_ptr": q_type,
        "out_ptr": "fp32" if splits > 1 else q_type,
        "key_cache_ptr": cache,
        "value_cache_ptr": cache,
        "key_scale_ptr": "fp32" if int8 else cache,
        "value_scale_ptr": "fp32" if int8 else cache,
        "block_tables_ptr": "i32",
        "seq_lens_ptr": "i32",
        "query_start_ptr": "i32",
        "lse_ptr": "fp32",
    }
    return {
        name: "*" + pointers[name] if name in pointers else "fp32" if name == "qk_scale" else "i32"
        for name in kernel.arg_names
    }


def plain_signature(kernel: Any, pointers: dict[str, str]) -> dict[str, str]:
    return {n: pointers.get(n, "fp32" if n == "eps" else "i32") for n in kernel.arg_names}


Case = tuple[str, Any, dict[str, str], dict[str, Any]]


def cases(quick: bool) -> list[Case]:
    out: list[Case] = []
    shapes = [(4, 128)] if quick else [(1, 64), (4, 128), (7, 128), (8, 128)]
    for int8 in (False, True):
        for group, dim in shapes:
            for splits in (1,) if quick else (1, 8):
                config = attention.decode_config(BF16, dim, group, 16, splits, int8, 32)
                sig = attention_signature(attention._decode_split_kernel, BF16, int8, splits)
                name = f"decode g{group} d{dim} splits{splits}{' int8' if int8 else ''}"
                out.append((name, attention._decode_split_kernel, sig, config))
            config = attention_prefill.prefill_config(BF16, dim, group, 16, int8, 64, 32)
            sig = attention_signature(attention_prefill._prefill_kernel, BF16, int8, 1)
            out.append(
                (
                    f"prefill g{group} d{dim}{' int8' if int8 else ''}",
                    attention_prefill._prefill_kernel,
                    sig,
                    config,
                )
            )
    if not quick:
        for kernel, config in (
            (
                attention._decode_split_kernel,
                attention.decode_config(FP32, 64, 2, 16, 1, False, 32),
            ),
            (
                attention_prefill._prefill_kernel,
                attention_prefill.prefill_config(FP32, 64, 2, 16, False, 64, 32),
            ),
        ):
            sig = attention_signature(kernel, FP32, False, 1)
            out.append((f"{kernel.__name__} fp32", kernel, sig, config))
    merge = {"HEAD_DIM": 128, "NUM_SPLITS": 8, "BLOCK_S": 8, "BLOCK_D": 128}
    out.append(
        (
            "decode merge",
            attention._decode_merge_kernel,
            plain_signature(
                attention._decode_merge_kernel,
                {"partial_ptr": "*fp32", "lse_ptr": "*fp32", "out_ptr": "*bf16"},
            ),
            merge,
        )
    )
    for quantize in (False, True):
        cache = "*i8" if quantize else "*bf16"
        scale = "*fp32" if quantize else "*bf16"
        pointers = {
            "k_ptr": "*bf16",
            "v_ptr": "*bf16",
            "key_cache_ptr": cache,
            "value_cache_ptr": cache,
            "key_scale_ptr": scale,
            "value_scale_ptr": scale,
            "slot_ptr": "*i64",
        }
        config = {"HEAD_DIM": 128, "BLOCK_H": 8, "BLOCK_D": 128, "QUANTIZE": quantize}
        out.append(
            (
                f"kv store{' int8' if quantize else ''}",
                kv_store._store_kv_kernel,
                plain_signature(kv_store._store_kv_kernel, pointers),
                config,
            )
        )
    for residual in (False, True):
        pointers = dict.fromkeys(("x_ptr", "res_ptr", "w_ptr", "out_ptr", "res_out_ptr"), "*bf16")
        config = {"HAS_RESIDUAL": residual, "BLOCK": 8192, "num_warps": 8}
        out.append(
            (
                f"rms_norm residual={residual}",
                fused._rms_norm_kernel,
                plain_signature(fused._rms_norm_kernel, pointers),
                config,
            )
        )
    rope = dict.fromkeys(("q_ptr", "k_ptr", "cos_ptr", "sin_ptr"), "*bf16")
    out.append(
        (
            "rope",
            fused._rope_kernel,
            plain_signature(fused._rope_kernel, rope),
            {"HALF": 64, "BLOCK_HQ": 32, "BLOCK_HK": 8, "BLOCK_HALF": 64},
        )
    )
    silu = {"x_ptr": "*bf16", "out_ptr": "*bf16"}
    out.append(
        (
            "silu_and_mul",
            fused._silu_and_mul_kernel,
            plain_signature(fused._silu_and_mul_kernel, silu),
            {"BLOCK": 1024},
        )
    )
    return out


def resource_usage(cubin: bytes) -> tuple[int, int]:
    """Registers per thread and stack (spill) bytes, from the cuobjdump that Triton ships."""
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run(
            [str(tool), "-res-usage", f.name], capture_output=True, text=True, check=True
        ).stdout
    match = re.search(r"REG:(\d+) STACK:(\d+)", text)
    assert match, text
    return int(match.group(1)), int(match.group(2))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="one specialization of each kernel")
    parser.add_argument("--arch", type=int, default=90, help="compute capability, e.g. 90")
    args = parser.parse_args()
    target = GPUTarget("cuda", args.arch, 32)
    failures = 0
    for name, kernel, signature, config in cases(args.quick):
        constexprs = {k: v for k, v in config.items() if k != "num_warps"}
        options = {"num_warps": config.get("num_warps", 4)}
        full = {n: "constexpr" if n in constexprs else signature[n] for n in kernel.arg_names}
        compile_fn: Callable[..., Any] = triton.compile
        try:
            compiled = compile_fn(
                ASTSource(kernel, full, constexprs), target=target, options=options
            )
        except Exception as exc:
            failures += 1
            print(f"FAIL {name}: {type(exc).__name__}: {str(exc)[:300]}")
            continue
        regs, stack = resource_usage(compiled.asm["cubin"])
        mma = "mma" in compiled.asm["ptx"]
        spills = stack > 0
        failures += spills
        status = "SPILLS" if spills else "ok"
        warps = options["num_warps"]
        print(f"{status:<6} {name:<32} warps={warps} regs={regs} stack={stack} mma={mma}")
    print(f"{failures} problem(s)")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()

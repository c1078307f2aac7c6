"""Kernel tests run on CUDA when there is one, else on CPU under the Triton interpreter.

Triton reads ``TRITON_INTERPRET`` when it decorates a kernel and again when it launches one,
so the kernel modules are imported here with it set, and an autouse fixture sets it for each
test of this folder only. Nothing else in the suite runs Triton on CPU.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from random_weights import save_random_model, tiny_config

from ladle.runtime.models.loader import resolve_model

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
INTERPRET = DEVICE.type == "cpu"
# The C kernels' instruction-set paths, each built on this machine: the native build (AVX-512
# where the CPU has it), the AVX2 path, and the portable C.
BUILDS = {
    "native": (),
    "avx2": ("-mno-avx512f",),
    "portable": ("-mno-avx2", "-mno-avx512f", "-mno-fma", "-mno-f16c"),
}


def _import_kernels() -> None:
    saved = os.environ.get("TRITON_INTERPRET")
    if INTERPRET:
        os.environ["TRITON_INTERPRET"] = "1"
    try:
        import ladle.runtime.attention.triton_backend
        import ladle.runtime.kernels.attention
        import ladle.runtime.kernels.attention_prefill
        import ladle.runtime.kernels.fused
        import ladle.runtime.kernels.kv_store
        import ladle.runtime.kernels.lora_triton
        import ladle.runtime.kernels.quant_gemm  # noqa: F401
    finally:
        if saved is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = saved
    from ladle.runtime.kernels import attention, quant_gemm

    # A module imported earlier without the variable would hold compiled kernels.
    for module in (attention, quant_gemm):
        assert module.INTERPRETED == INTERPRET, "kernel modules were imported in the wrong mode"
    if INTERPRET:
        _interpreter_works()


def _interpreter_works() -> None:
    """One tiny interpreted kernel, so that a broken interpreter fails here, by name, rather
    than as every kernel test's InterpreterError. It breaks when a module collected before this
    folder imports a library that defines Triton kernels (PEFT, transformers' models) while
    ``TRITON_INTERPRET`` is unset: such test helpers must import them inside their functions."""
    from ladle.runtime.kernels.fused import silu_and_mul

    saved = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        silu_and_mul(torch.ones(1, 8))
    except Exception as exc:
        raise pytest.UsageError(
            "the Triton interpreter cannot run kernels in this process: a module collected "
            f"before tests/kernels imported Triton kernels without TRITON_INTERPRET ({exc!r})"
        ) from None
    finally:
        if saved is None:
            os.environ.pop("TRITON_INTERPRET", None)


_import_kernels()


@pytest.fixture(autouse=True)
def _triton_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    if INTERPRET:
        monkeypatch.setenv("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """Random-weight model folders ("llama" or "qwen3") with the default model's tokenizer and
    the first 1024 of its tokens: the tests feed token ids below that. The LM head is the
    largest GEMM, and the interpreter runs it program by program; at the full 49,152 the int8
    engine run alone took 48 s instead of 5."""
    tokenizer_dir = resolve_model(None)
    vocab = 1024
    built: dict[str, Path] = {}

    def build(arch: str) -> Path:
        if arch not in built:
            folder = tmp_path_factory.mktemp(f"tiny-{arch}")
            built[arch] = save_random_model(tiny_config(arch, vocab), folder, tokenizer_dir)
        return built[arch]

    return build

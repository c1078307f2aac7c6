"""Kernel tests run on CUDA when there is one, else on CPU under the Triton interpreter.

Triton reads ``TRITON_INTERPRET`` when it decorates a kernel and again when it launches one,
so the kernel modules are imported here with it set, and an autouse fixture sets it for each
test of this folder only. Nothing else in the suite runs Triton on CPU.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, Qwen3Config

from ladle.runtime.models.loader import resolve_model

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
INTERPRET = DEVICE.type == "cpu"


def _import_kernels() -> None:
    saved = os.environ.get("TRITON_INTERPRET")
    if INTERPRET:
        os.environ["TRITON_INTERPRET"] = "1"
    try:
        import ladle.runtime.attention.triton_backend
        import ladle.runtime.kernels.attention
        import ladle.runtime.kernels.fused
        import ladle.runtime.kernels.kv_store  # noqa: F401
    finally:
        if saved is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = saved
    from ladle.runtime.kernels import attention

    # A module imported earlier without the variable would hold compiled kernels.
    assert attention.INTERPRETED == INTERPRET, "kernel modules were imported in the wrong mode"


_import_kernels()


@pytest.fixture(autouse=True)
def _triton_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    if INTERPRET:
        monkeypatch.setenv("TRITON_INTERPRET", "1")


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def _tiny_config(arch: str, vocab: int) -> LlamaConfig | Qwen3Config:
    common: dict[str, Any] = {
        "vocab_size": vocab,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 256,
        "initializer_range": 0.3,
        "eos_token_id": 2,
        "bos_token_id": 1,
    }
    if arch == "llama":
        return LlamaConfig(
            **common,
            tie_word_embeddings=True,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 10000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            },
        )
    # Qwen3: per-head q/k RMSNorm, head_dim 32 != hidden / heads, yarn RoPE.
    return Qwen3Config(
        **common,
        head_dim=32,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    )


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """Random-weight model folders ("llama" or "qwen3") with the default model's tokenizer."""
    tokenizer_dir = resolve_model(None)
    vocab = AutoConfig.from_pretrained(tokenizer_dir).vocab_size
    built: dict[str, Path] = {}

    def build(arch: str) -> Path:
        if arch not in built:
            folder = tmp_path_factory.mktemp(f"tiny-{arch}")
            torch.manual_seed(1234)
            model = AutoModelForCausalLM.from_config(_tiny_config(arch, vocab), dtype=torch.float32)
            model.save_pretrained(folder)
            for name in TOKENIZER_FILES:
                if (tokenizer_dir / name).exists():
                    shutil.copy(tokenizer_dir / name, folder / name)
            built[arch] = folder
        return built[arch]

    return build

"""Shared fixtures: tiny random-weight models with the default model's tokenizer."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from random_weights import save_random_model, tiny_config
from transformers import AutoConfig

from ladle.runtime.models.loader import resolve_model


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """A random-weight model folder per architecture name, built once per session."""
    tokenizer_dir = resolve_model(None)
    vocab = AutoConfig.from_pretrained(tokenizer_dir).vocab_size
    built: dict[str, Path] = {}

    def build(arch: str) -> Path:
        if arch not in built:
            folder = tmp_path_factory.mktemp(f"tiny-{arch}")
            built[arch] = save_random_model(tiny_config(arch, vocab), folder, tokenizer_dir)
        return built[arch]

    return build

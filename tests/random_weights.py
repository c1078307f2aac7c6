"""Random-weight models built from configs, for tests where no hub is reachable (test tooling,
so the images do not ship it).

Each supported architecture gets a tiny config that also exercises one RoPE variant, so that a
test over all of them covers GQA, tied and untied embeddings, QKV bias, QK norm and every
static RoPE type.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    MistralConfig,
    PretrainedConfig,
    Qwen2Config,
    Qwen3Config,
)

TINY_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def tiny_config(arch: str, vocab_size: int) -> PretrainedConfig:
    common: dict[str, Any] = {
        "vocab_size": vocab_size,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 512,
        # Wide weights give peaked logits, so greedy comparisons are not decided by near-ties.
        "initializer_range": 0.3,
        "eos_token_id": 2,
        "bos_token_id": 1,
    }
    configs: dict[str, PretrainedConfig] = {
        "llama": LlamaConfig(
            **common,
            tie_word_embeddings=True,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 10000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        ),
        "mistral": MistralConfig(**common, sliding_window=None, head_dim=16),
        "qwen2": Qwen2Config(
            **common,
            tie_word_embeddings=False,
            rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
        ),
        # head_dim 32 != hidden / heads, per-head q/k RMSNorm, yarn RoPE.
        "qwen3": Qwen3Config(
            **common,
            head_dim=32,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 128,
            },
        ),
    }
    if arch not in configs:
        raise ValueError(f"no tiny config for {arch!r}; known: {', '.join(configs)}")
    return configs[arch]


def save_random_model(
    config: PretrainedConfig,
    folder: Path,
    tokenizer_dir: Path,
    seed: int = 1234,
    dtype: torch.dtype = torch.float32,
) -> Path:
    """Write an HF folder with seeded random weights and another model's tokenizer files."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.save_pretrained(folder)
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).exists():
            shutil.copy(tokenizer_dir / name, folder / name)
    return folder

"""Normalize HF configs of the supported architectures into one shape for our forward pass."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from ladle.runtime.config import ConfigError

# HF architecture name -> traits that differ within the Llama family.
SUPPORTED_ARCHITECTURES: dict[str, dict[str, bool]] = {
    "LlamaForCausalLM": {"qkv_bias": False, "qk_norm": False},
    "MistralForCausalLM": {"qkv_bias": False, "qk_norm": False},
    "Qwen2ForCausalLM": {"qkv_bias": True, "qk_norm": False},
    "Qwen3ForCausalLM": {"qkv_bias": False, "qk_norm": True},
}
# RoPE types whose frequencies do not depend on the current sequence length, so that cos/sin
# can be precomputed once for every position.
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    inv_freq: torch.Tensor
    rope_attention_scaling: float
    sliding_window: int | None

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim


def _rope(hf: Any) -> tuple[torch.Tensor, float]:
    params = dict(getattr(hf, "rope_parameters", None) or {})
    rope_type = params.get("rope_type", "default")
    if rope_type not in STATIC_ROPE_TYPES:
        raise ConfigError(
            f"rope_type {rope_type!r} is not supported; supported: {', '.join(STATIC_ROPE_TYPES)}"
        )
    if rope_type == "default":
        dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
        base = params["rope_theta"]
        return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)), 1.0
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf, torch.device("cpu"))
    return inv_freq, float(scaling)


def model_config_from_hf(hf: Any) -> ModelConfig:
    architectures = getattr(hf, "architectures", None) or []
    arch = next((a for a in architectures if a in SUPPORTED_ARCHITECTURES), None)
    if arch is None:
        raise ConfigError(
            f"unsupported architecture {architectures or hf.model_type!r}; "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    traits = SUPPORTED_ARCHITECTURES[arch]
    act = getattr(hf, "hidden_act", "silu")
    if act != "silu":
        raise ConfigError(f"hidden_act {act!r} is not supported (only silu)")
    inv_freq, scaling = _rope(hf)
    sliding = getattr(hf, "sliding_window", None)
    if arch.startswith("Qwen") and not getattr(hf, "use_sliding_window", False):
        sliding = None
    return ModelConfig(
        architecture=arch,
        vocab_size=hf.vocab_size,
        hidden_size=hf.hidden_size,
        intermediate_size=hf.intermediate_size,
        num_layers=hf.num_hidden_layers,
        num_heads=hf.num_attention_heads,
        num_kv_heads=getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads,
        head_dim=getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads,
        rms_norm_eps=hf.rms_norm_eps,
        max_position_embeddings=hf.max_position_embeddings,
        tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
        qkv_bias=traits["qkv_bias"] or bool(getattr(hf, "attention_bias", False)),
        qk_norm=traits["qk_norm"],
        inv_freq=inv_freq,
        rope_attention_scaling=scaling,
        sliding_window=sliding,
    )

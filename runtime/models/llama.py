"""Our forward pass for the Llama family (Llama/SmolLM2, Mistral, Qwen2, Qwen3).

Weights come straight from the HF state dict; Q/K/V and gate/up projections are concatenated
so that each layer runs four GEMMs. Numerics follow transformers' modeling code (RoPE in
rotate-half form, fp32 RMSNorm), so greedy outputs agree token for token. Linear layers and
embeddings are objects that may hold quantized weights (``ladle.runtime.quantization``); the
forward pass only calls them.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from ladle.runtime.attention.backend import AttentionBackend, AttentionMetadata, LayerKVCache
from ladle.runtime.kernels.ops import ops_for_backend
from ladle.runtime.lora.batch import LoRABatch
from ladle.runtime.lora.slots import LayerLoRA, LoRASlots
from ladle.runtime.models.config import ModelConfig
from ladle.runtime.parallel.group import Shard
from ladle.runtime.quantization.linear import DenseEmbedding, DenseLinear, Embedding, Linear

_LAYER_KEY = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
# HF parameter suffix -> (our fused tensor, slot within it).
_FUSED = {
    "self_attn.q_proj.weight": ("qkv", 0),
    "self_attn.k_proj.weight": ("qkv", 1),
    "self_attn.v_proj.weight": ("qkv", 2),
    "self_attn.q_proj.bias": ("qkv_bias", 0),
    "self_attn.k_proj.bias": ("qkv_bias", 1),
    "self_attn.v_proj.bias": ("qkv_bias", 2),
    "mlp.gate_proj.weight": ("gate_up", 0),
    "mlp.up_proj.weight": ("gate_up", 1),
}
_PLAIN = {
    "self_attn.o_proj.weight": "o_proj",
    "mlp.down_proj.weight": "down",
    "input_layernorm.weight": "input_norm",
    "post_attention_layernorm.weight": "post_norm",
    "self_attn.q_norm.weight": "q_norm",
    "self_attn.k_norm.weight": "k_norm",
}


@dataclass
class LayerWeights:
    qkv: Linear
    o_proj: Linear
    gate_up: Linear
    down: Linear
    input_norm: torch.Tensor
    post_norm: torch.Tensor
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    # The resident adapters' weights for this layer, once LoRA is enabled.
    lora: LayerLoRA | None = None


class LlamaModel:
    def __init__(
        self,
        config: ModelConfig,
        attention: AttentionBackend,
        dtype: torch.dtype,
        device: torch.device,
        shard: Shard | None = None,
    ) -> None:
        """``config``: the shape this rank computes (its slice's, with tensor parallelism)."""
        self.config = config
        self.shard = shard
        self.attention = attention
        # Norms, RoPE and SiLU-and-mul: fused Triton kernels with the Triton backend.
        self.ops = ops_for_backend(attention.name)
        self.dtype = dtype
        self.device = device
        self.scale = config.head_dim**-0.5
        self.layers: list[LayerWeights] = []
        self.embed: Embedding = DenseEmbedding(torch.empty(0))
        self.norm = torch.empty(0)
        self.lm_head: Linear = DenseLinear(torch.empty(0))
        positions = torch.arange(config.max_position_embeddings, dtype=torch.float)
        freqs = positions[:, None] * config.inv_freq[None, :]
        scaling = config.rope_attention_scaling
        self.cos = (freqs.cos() * scaling).to(device=device, dtype=dtype)
        self.sin = (freqs.sin() * scaling).to(device=device, dtype=dtype)

    def with_attention(self, attention: AttentionBackend) -> LlamaModel:
        """The same weight tensors (shared, not copied) behind another attention backend, with
        layer objects of its own so that swapping one of its linears leaves this model alone."""
        view = LlamaModel(self.config, attention, self.dtype, self.device, self.shard)
        view.layers = [dataclasses.replace(layer) for layer in self.layers]
        view.embed, view.norm, view.lm_head = self.embed, self.norm, self.lm_head
        return view

    def enable_lora(self, slots: LoRASlots) -> None:
        for layer, lora in zip(self.layers, slots.layers, strict=True):
            layer.lora = lora

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Take HF-named tensors, in any order, and build the fused per-layer weights (of this
        rank's slice, with tensor parallelism)."""
        cfg = self.config
        layout = None if self.shard is None else self.shard.layout
        parts: list[dict[str, object]] = [{} for _ in range(cfg.num_layers)]
        top: dict[str, torch.Tensor] = {}
        for name, tensor in weights:
            match = _LAYER_KEY.match(name)
            suffix = name if match is None else match.group(2)
            part = tensor if layout is None else layout.shard(suffix, tensor, cfg.head_dim)
            t = part.to(device=self.device, dtype=self.dtype)
            if match is None:
                top[name] = t
                continue
            layer = int(match.group(1))
            if suffix in _FUSED:
                key, slot = _FUSED[suffix]
                parts[layer].setdefault(key, {})[slot] = t  # type: ignore[index]
            elif suffix in _PLAIN:
                parts[layer][_PLAIN[suffix]] = t
        embed = top["model.embed_tokens.weight"]
        self.embed = DenseEmbedding(embed)
        self.norm = top["model.norm.weight"]
        self.lm_head = DenseLinear(embed if cfg.tie_word_embeddings else top["lm_head.weight"])
        self.layers = [self._layer(i, p) for i, p in enumerate(parts)]

    def _layer(self, index: int, p: dict[str, object]) -> LayerWeights:
        def fused(key: str, n: int) -> torch.Tensor | None:
            slots = p.get(key)
            if slots is None:
                return None
            assert isinstance(slots, dict)
            if len(slots) != n:
                raise ValueError(f"layer {index}: incomplete {key} weights in checkpoint")
            return torch.cat([slots[i] for i in range(n)], dim=0).contiguous()

        def plain(key: str) -> torch.Tensor:
            if key not in p:
                raise ValueError(f"layer {index}: missing {key} weight in checkpoint")
            t = p[key]
            assert isinstance(t, torch.Tensor)
            return t

        qkv, gate_up = fused("qkv", 3), fused("gate_up", 2)
        if qkv is None or gate_up is None:
            raise ValueError(f"layer {index}: missing projection weights in checkpoint")
        return LayerWeights(
            qkv=DenseLinear(qkv, fused("qkv_bias", 3) if self.config.qkv_bias else None),
            o_proj=DenseLinear(plain("o_proj")),
            gate_up=DenseLinear(gate_up),
            down=DenseLinear(plain("down")),
            input_norm=plain("input_norm"),
            post_norm=plain("post_norm"),
            q_norm=plain("q_norm") if self.config.qk_norm else None,
            k_norm=plain("k_norm") if self.config.qk_norm else None,
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        caches: list[LayerKVCache],
        meta: AttentionMetadata,
        lora: LoRABatch | None = None,
    ) -> torch.Tensor:
        """Hidden states after the final norm, one row per input token; ``lora`` adds each
        row's adapter to every projection's output."""
        cfg = self.config
        ops = self.ops
        n = input_ids.shape[0]
        eps = cfg.rms_norm_eps
        cos = self.cos[positions][:, None, :]
        sin = self.sin[positions][:, None, :]
        self.attention.begin_step(meta)
        residual = self._embed(input_ids)
        group = None if self.shard is None else self.shard.group
        # Each sublayer's output is added into the residual by the next norm (fused on GPU).
        first_norm = self.layers[0].input_norm if self.layers else self.norm
        x = ops.rms_norm(residual, first_norm, eps)
        for i, (layer, cache) in enumerate(zip(self.layers, caches, strict=True)):
            adapters = layer.lora
            qkv = layer.qkv(x)
            if lora is not None and adapters is not None:
                lora.add(adapters.qkv, x, qkv)
            q, k, v = qkv.split([cfg.q_size, cfg.kv_size, cfg.kv_size], dim=-1)
            q = q.view(n, cfg.num_heads, cfg.head_dim)
            k = k.view(n, cfg.num_kv_heads, cfg.head_dim)
            if layer.q_norm is not None and layer.k_norm is not None:
                q = ops.rms_norm(q, layer.q_norm, eps)
                k = ops.rms_norm(k, layer.k_norm, eps)
            q, k = ops.rope(q, k, cos, sin)
            v = v.view(n, cfg.num_kv_heads, cfg.head_dim)
            attn = self.attention.forward(q, k, v, cache, meta, self.scale)
            attn = attn.view(n, cfg.q_size)
            out = layer.o_proj(attn)
            if lora is not None and adapters is not None:
                lora.add(adapters.o_proj, attn, out)
            if group is not None:
                group.all_reduce(out)
            x, residual = ops.add_rms_norm(out, residual, layer.post_norm, eps)
            gate_up = layer.gate_up(x)
            if lora is not None and adapters is not None:
                lora.add(adapters.gate_up, x, gate_up)
            act = ops.silu_and_mul(gate_up)
            out = layer.down(act)
            if lora is not None and adapters is not None:
                lora.add(adapters.down, act, out)
            if group is not None:
                group.all_reduce(out)
            norm = self.layers[i + 1].input_norm if i + 1 < len(self.layers) else self.norm
            x, residual = ops.add_rms_norm(out, residual, norm, eps)
        return x

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows of the embedding; with tensor parallelism each rank looks up the ids in its
        vocabulary slice, zeros the rest, and the ranks sum."""
        if self.shard is None:
            return self.embed(ids)
        layout = self.shard.layout
        local = ids - layout.vocab_start
        inside = (local >= 0) & (local < layout.vocab_rows)
        rows = self.embed(torch.where(inside, local, 0)).masked_fill(~inside[:, None], 0)
        return self.shard.group.all_reduce(rows)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The logits over the whole vocabulary (on tensor-parallel ranks other than 0, over
        this rank's slice: only rank 0 samples)."""
        logits = self.lm_head(hidden).float()
        if self.shard is None:
            return logits
        gathered = self.shard.group.gather_columns(logits)
        return logits if gathered is None else gathered[:, : self.config.vocab_size]

    def weight_bytes(self) -> int:
        """Bytes of every weight the model holds, a tensor shared by several holders (a tied
        LM head) counted once."""
        holders: list[Linear | Embedding] = [self.embed, self.lm_head]
        for layer in self.layers:
            holders += [layer.qkv, layer.o_proj, layer.gate_up, layer.down]
        tensors = [t for h in holders for t in h.tensors()]
        for layer in self.layers:
            norms = (layer.input_norm, layer.post_norm, layer.q_norm, layer.k_norm)
            tensors += [t for t in norms if t is not None]
        tensors.append(self.norm)
        unique = {t.data_ptr(): t.nbytes for t in tensors}
        return sum(unique.values())

"""A decode step of the whole model in one C call (``decode_step.c``), for small batches on CPUs.

The per-op path spends a batch-1 step mostly around its arithmetic: a dozen torch ops and
ctypes calls per layer, each waking the thread team. :class:`CpuDecodeStep` describes the
model's weights and KV cache to C once (pointers in ctypes structures), owns the step's buffers
(nothing is allocated per step), and replaces ``LlamaModel.forward`` and the LM head for
decode-only batches of up to ``max_batch`` sequences. Larger batches are GEMMs, where
torch's kernels win and per-op overhead is spread over many rows; they keep the per-op path.
"""

from __future__ import annotations

import ctypes

import torch

from ladle.runtime.attention.backend import AttentionMetadata, LayerKVCache
from ladle.runtime.kernels import cpu_kernels
from ladle.runtime.lora.batch import LoRABatch
from ladle.runtime.lora.slots import ProjectionLoRA
from ladle.runtime.models.llama import LlamaModel
from ladle.runtime.quantization.formats import PANEL, GroupWeight, Int8Weight
from ladle.runtime.quantization.linear import DenseLinear, Linear, QuantizedLinear

# Up to this many decodes a step is bound by reading the weights once (GEMV); from there on
# it becomes a GEMM, which torch does better. (fp32 steps of up to 32 in the fused step won on
# short contexts but decoded workload A, contexts up to 324 tokens, at 158 against 180 tok/s.)
MAX_BATCH = 8
_DENSE, _INT8, _INT4, _INT8_GROUPS = 0, 1, 2, 3
# decode_step.c's op list: ops per layer, and the ints of one op's counters.
_OPS_PER_LAYER, _OP_COUNTER_INTS = 12, 16
_P = ctypes.c_void_p


class _Linear(ctypes.Structure):
    _fields_ = [
        ("kind", ctypes.c_int32),
        ("n", ctypes.c_int32),
        ("k", ctypes.c_int32),
        ("group_size", ctypes.c_int32),
        ("w", _P),
        ("scale", _P),
        ("offset", _P),
        ("bias", _P),
        ("lora_a", _P),
        ("lora_b", _P),
        ("lora_rank", ctypes.c_int32),
        ("lora_width", ctypes.c_int32),
        ("lora_end0", ctypes.c_int32),
        ("lora_end1", ctypes.c_int32),
        ("a8", _P),
    ]


class _Layer(ctypes.Structure):
    _fields_ = [
        ("qkv", _Linear),
        ("o_proj", _Linear),
        ("gate_up", _Linear),
        ("down", _Linear),
        ("input_norm", _P),
        ("post_norm", _P),
        ("q_norm", _P),
        ("k_norm", _P),
        ("key_cache", _P),
        ("value_cache", _P),
        ("key_scale", _P),
        ("value_scale", _P),
        ("kv_f16", ctypes.c_int32),
    ]


class _Model(ctypes.Structure):
    _fields_ = [
        ("num_layers", ctypes.c_int32),
        ("hidden", ctypes.c_int32),
        ("num_heads", ctypes.c_int32),
        ("num_kv_heads", ctypes.c_int32),
        ("head_dim", ctypes.c_int32),
        ("intermediate", ctypes.c_int32),
        ("block_size", ctypes.c_int32),
        ("eps", ctypes.c_float),
        ("scale", ctypes.c_float),
        ("layers", ctypes.POINTER(_Layer)),
        ("final_norm", _P),
        ("cos", _P),
        ("sin", _P),
        ("lm_head", _Linear),
    ]


class _Buffers(ctypes.Structure):
    _fields_ = [
        ("residual", _P),
        ("x", _P),
        ("qkv", _P),
        ("attn", _P),
        ("out", _P),
        ("gate_up", _P),
        ("act", _P),
        ("logits", _P),
        ("ld_qkv", ctypes.c_int64),
        ("ld_out", ctypes.c_int64),
        ("ld_gate_up", ctypes.c_int64),
        ("ld_logits", ctypes.c_int64),
        ("max_batch", ctypes.c_int64),
        ("counters", _P),
        ("lora_shrunk", _P),
        ("ld_lora", ctypes.c_int64),
    ]


def _padded(n: int) -> int:
    return -(-n // PANEL) * PANEL


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def supports(model: LlamaModel, caches: list[LayerKVCache]) -> bool:
    """fp32 on the CPU, every linear dense or in a C kernel format, a paged fp32, fp16 or int8
    cache."""
    if model.device.type != "cpu" or model.dtype != torch.float32 or not model.layers:
        return False
    if any(c.key.dtype not in (*cpu_kernels.KV_DTYPES, torch.int8) for c in caches):
        return False
    if model.config.intermediate_size % PANEL:  # gate and up are shared out in whole panels
        return False
    linears = [lin for L in model.layers for lin in (L.qkv, L.o_proj, L.gate_up, L.down)]
    linears.append(model.lm_head)
    return all(
        (isinstance(lin, DenseLinear) and lin.weight.is_contiguous())
        or (isinstance(lin, QuantizedLinear) and lin.kernels == "cpu")
        for lin in linears
    )


class CpuDecodeStep:
    """The model's forward pass for decode-only steps of up to ``max_batch`` sequences."""

    def __init__(
        self,
        lib: ctypes.CDLL,
        model: LlamaModel,
        caches: list[LayerKVCache],
        max_batch: int = MAX_BATCH,
    ) -> None:
        assert supports(model, caches)
        self._lib = lib
        self.model = model
        self.max_batch = max_batch
        cfg = model.config
        # Tensors the C structures point into (padded biases) must outlive them.
        self._keep: list[torch.Tensor] = []
        layers = (_Layer * cfg.num_layers)()
        for i, (weights, cache) in enumerate(zip(model.layers, caches, strict=True)):
            lora = weights.lora.projections() if weights.lora else {}
            layers[i] = _Layer(
                self._linear(weights.qkv, lora.get("qkv")),
                self._linear(weights.o_proj, lora.get("o_proj")),
                self._linear(weights.gate_up, lora.get("gate_up")),
                self._linear(weights.down, lora.get("down")),
                weights.input_norm.data_ptr(),
                weights.post_norm.data_ptr(),
                _ptr(weights.q_norm),
                _ptr(weights.k_norm),
                cache.key.data_ptr(),
                cache.value.data_ptr(),
                _ptr(cache.key_scale),
                _ptr(cache.value_scale),
                int(cache.key.dtype == torch.float16),
            )
        self._layers = layers
        cos, sin = model.cos.contiguous(), model.sin.contiguous()
        self._keep += [cos, sin]
        self._model = _Model(
            cfg.num_layers,
            cfg.hidden_size,
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
            cfg.intermediate_size,
            caches[0].key.shape[1],
            cfg.rms_norm_eps,
            model.scale,
            layers,
            model.norm.data_ptr(),
            cos.data_ptr(),
            sin.data_ptr(),
            self._linear(model.lm_head),
        )

        def buffer(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
            return torch.zeros(*shape, dtype=dtype)

        rows = max_batch
        qkv_width = _padded(cfg.q_size + 2 * cfg.kv_size)
        out_width = _padded(cfg.hidden_size)
        gate_up_width = _padded(2 * cfg.intermediate_size)
        self.residual, self.hidden = buffer(rows, cfg.hidden_size), buffer(rows, cfg.hidden_size)
        logits_width = _padded(cfg.vocab_size)
        work = [
            buffer(rows, w)
            for w in (qkv_width, cfg.q_size, out_width, gate_up_width, cfg.intermediate_size)
        ]
        self.logits = buffer(rows, logits_width)
        ops = 2 + _OPS_PER_LAYER * cfg.num_layers
        counters = buffer(ops * _OP_COUNTER_INTS, dtype=torch.int32)
        first = model.layers[0].lora
        # qkv's three slices make the widest shrink.
        lora_width = first.qkv.a.shape[1] if first else 1
        shrunk = buffer(rows, lora_width)
        self._keep += [*work, counters, shrunk]
        self._buffers = _Buffers(
            self.residual.data_ptr(),
            self.hidden.data_ptr(),
            *(t.data_ptr() for t in work),
            self.logits.data_ptr(),
            qkv_width,
            out_width,
            gate_up_width,
            logits_width,
            rows,
            counters.data_ptr(),
            shrunk.data_ptr(),
            shrunk.stride(0),
        )

    def _linear(self, lin: Linear, lora: ProjectionLoRA | None = None) -> _Linear:
        c = self._plain_linear(lin)
        if lora is not None:
            ends = (*lora.slice_ends, c.n, c.n)
            c.lora_a, c.lora_b = lora.a.data_ptr(), lora.b.data_ptr()
            c.lora_rank, c.lora_width = lora.rank, lora.a.shape[1]
            c.lora_end0, c.lora_end1 = ends[0], ends[1]
        return c

    def _plain_linear(self, lin: Linear) -> _Linear:
        if isinstance(lin, DenseLinear):
            n, k = lin.weight.shape
            return _Linear(_DENSE, n, k, 0, lin.weight.data_ptr(), None, None, _ptr(lin.bias))
        assert isinstance(lin, QuantizedLinear)
        weight = lin.weight
        n, k = weight.shape
        bias = lin.bias
        if bias is not None:  # the kernels write whole panels
            bias = torch.nn.functional.pad(bias, (0, _padded(n) - n)).contiguous()
            self._keep.append(bias)
        if isinstance(weight, Int8Weight):
            return _Linear(
                _INT8, n, k, 0, weight.qweight.data_ptr(), weight.scale.data_ptr(), None, _ptr(bias)
            )
        assert isinstance(weight, GroupWeight)
        c = _Linear(
            _INT4 if weight.bits == 4 else _INT8_GROUPS,
            n,
            k,
            weight.group_size,
            weight.qweight.data_ptr(),
            weight.scale.data_ptr(),
            weight.offset.data_ptr(),
            _ptr(bias),
        )
        c.a8 = _ptr(weight.a8)
        return c

    def can_run(self, meta: AttentionMetadata) -> bool:
        return meta.num_decodes == meta.num_seqs <= self.max_batch

    def run(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        lora: LoRABatch | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The final-normed hidden states [batch, hidden] and the logits [batch, vocab]: views
        of buffers that the next step overwrites. ``lora``: each row's adapter."""
        lora_slots = None if lora is None else lora.row_slots
        assert lora_slots is None or lora_slots.dtype == torch.int32
        batch = meta.num_seqs
        self.residual[:batch] = self.model.embed(input_ids)
        tables = meta.block_tables
        assert tables.stride(1) == 1
        assert positions.dtype == meta.slot_mapping.dtype == torch.int64
        failed = self._lib.ladle_decode_step(
            ctypes.byref(self._model),
            ctypes.byref(self._buffers),
            positions.data_ptr(),
            meta.slot_mapping.data_ptr(),
            tables.data_ptr(),
            tables.stride(0),
            meta.seq_lens.data_ptr(),
            batch,
            torch.get_num_threads(),
            _ptr(lora_slots),
        )
        if failed:
            raise MemoryError("the CPU decode step could not allocate its attention buffers")
        return self.hidden[:batch], self.logits[:batch, : self.model.config.vocab_size]


def for_model(model: LlamaModel, caches: list[LayerKVCache]) -> CpuDecodeStep | None:
    """The fused step where the model and cache allow it and the kernels build, else None."""
    if not supports(model, caches):
        return None
    lib = cpu_kernels.load()
    return None if lib is None else CpuDecodeStep(lib, model, caches)

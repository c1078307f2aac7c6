"""AWQ (Lin et al., 2023): activation-aware scaling and clipping before round to nearest.

**Why AWQ rather than GPTQ.** Our calibration text is whatever ships with Python (the language
reference's topics in ``pydoc_data``: English prose and code), while users serve every
language and domain. AWQ only measures how large each input channel's activations are and
protects the salient ones; GPTQ reconstructs each layer's outputs through the calibration
set's Hessian, which the AWQ paper shows to overfit a narrow calibration set (its cross-domain
results). AWQ also leaves the rounding itself as plain RTN, so the kernels are unchanged, and
its search has RTN as one of its candidates: on its own objective it never does worse.

For each layer, with X a linear's inputs over the calibration text:

1. **scales**: ``s = mean|X|^a`` per input channel (normalized), ``a`` from a grid in [0, 1)
   minimizing ``||X W^T - X (Q(W s) / s)^T||``: channels that carry large activations get finer
   steps. ``1 / s`` is folded into the op before the linear (the RMSNorm weight before QKV and
   gate/up, the up projection's rows before down; before O only without grouped KV heads, as
   AWQ does), so serving costs nothing extra. ``a = 0`` is plain RTN.
2. **clipping** (int4): per output channel and group, the range shrinks to ``r * absmax``,
   ``r`` in 1.0 ... 0.55, minimizing that group's share of the output error,
   ``d^T (X_g^T X_g) d`` for the group's weight error d. Query and key rows are not clipped
   (AWQ's choice: attention scores amplify their errors).

Calibration runs the full-precision model once over the text and keeps, per linear, the mean
absolute input of each channel, the Gram matrix of each group's inputs (all tokens, for the
clip search) and a fixed sample of input rows (for the scale search). Its result (scales and
clip ratios: 0.3 MB for int8, 12 MB for int4 in groups of 32) is cached per model and
settings, so it is paid once: 6-19 s for SmolLM2-135M on two cores, by CPU. A pod's cache starts
empty, so the runtime image bakes the default model's, for the
settings ``--quantization int8`` and ``int4`` default to (``bake.py``).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from ladle.runtime.attention.backend import KVCacheSpec
from ladle.runtime.attention.torch_backend import TorchAttentionBackend
from ladle.runtime.config import ConfigError, QuantizationConfig
from ladle.runtime.models.config import ModelConfig
from ladle.runtime.models.llama import LayerWeights, LlamaModel
from ladle.runtime.models.loader import cache_dir
from ladle.runtime.models.scoring import hidden_states
from ladle.runtime.parallel.layout import ShardLayout
from ladle.runtime.quantization import bake
from ladle.runtime.quantization.formats import fake_quantize_groups, quantize_int8
from ladle.runtime.quantization.linear import DenseLinear, Linear

log = logging.getLogger(__name__)

# Bump when the algorithm or the calibration text changes: it is part of the cache key.
VERSION = 1
CALIBRATION_SEQUENCES = 8
CALIBRATION_LENGTH = 256
SEQUENCES_PER_FORWARD = 4
# Input rows kept per linear for the scale search's loss.
SAMPLED_ROWS = 256
ALPHA_GRID = 10
CLIP_RATIOS = tuple(1.0 - i / 20 for i in range(10))
LINEARS = ("qkv", "o_proj", "gate_up", "down")

Key = tuple[int, str]


@dataclass
class Calibration:
    """Per (layer index, linear name): input-channel scales [K], and int4 clip ratios [N, G]."""

    scales: dict[Key, torch.Tensor]
    clips: dict[Key, torch.Tensor]

    def save(self, path: Path) -> None:
        tensors = {f"scale.{i}.{n}": t for (i, n), t in self.scales.items()}
        tensors |= {f"clip.{i}.{n}": t for (i, n), t in self.clips.items()}
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path.parent, suffix=".tmp", delete=False) as tmp:
            save_file({k: v.cpu().contiguous() for k, v in tensors.items()}, tmp.name)
        os.replace(tmp.name, path)

    def shard(self, layout: ShardLayout, cfg: ModelConfig, group_size: int | None) -> Calibration:
        """A rank's part of the whole model's calibration (``cfg``: the whole model's shape).
        Scales follow each linear's input channels: whole for QKV and gate/up (their input is
        the replicated hidden state), this rank's columns for O and down. Clip ratios follow
        the weights' rows for the column-parallel linears, their input groups for the
        row-parallel ones, which must start and end on a group boundary."""
        hd = cfg.head_dim
        q = slice(layout.q_heads.start * hd, layout.q_heads.stop * hd)
        kv = slice(layout.kv_heads.start * hd, layout.kv_heads.stop * hd)
        inter = slice(layout.intermediate.start, layout.intermediate.stop)
        columns = {"o_proj": q, "down": inter}
        scales = {k: s[columns[k[1]]] if k[1] in columns else s for k, s in self.scales.items()}

        def rows(name: str, clip: torch.Tensor) -> torch.Tensor:
            if name == "qkv":
                k0, v0 = cfg.q_size, cfg.q_size + cfg.kv_size
                parts = (q, slice(k0 + kv.start, k0 + kv.stop), slice(v0 + kv.start, v0 + kv.stop))
                return torch.cat([clip[part] for part in parts])
            if name == "gate_up":
                up = slice(cfg.intermediate_size + inter.start, cfg.intermediate_size + inter.stop)
                return torch.cat([clip[inter], clip[up]])
            part = columns[name]
            assert group_size is not None, "clips exist only for grouped weights"
            if part.start % group_size or part.stop % group_size:
                raise ConfigError(
                    f"quantization_group_size {group_size} does not divide this rank's "
                    f"{name} columns {part.start}..{part.stop}: choose a group size that "
                    "divides every rank's share of the heads and the MLP"
                )
            return clip[:, part.start // group_size : part.stop // group_size]

        clips = {k: rows(k[1], c) for k, c in self.clips.items()}
        return Calibration(scales, clips)

    @classmethod
    def load(cls, path: Path) -> Calibration:
        scales: dict[Key, torch.Tensor] = {}
        clips: dict[Key, torch.Tensor] = {}
        for name, tensor in load_file(str(path)).items():
            kind, layer, linear = name.split(".")
            (scales if kind == "scale" else clips)[(int(layer), linear)] = tensor
        return cls(scales, clips)


def calibration_text() -> str:
    """The Python language reference's topics, as every CPython installation ships them."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[name] for name in sorted(topics))


def calibration_sequences(tokenizer: object, count: int, length: int) -> list[list[int]]:
    """``count`` windows of ``length`` tokens spread evenly over the calibration text."""
    ids: list[int] = list(tokenizer.encode(calibration_text()))  # type: ignore[attr-defined]
    windows = len(ids) // length
    if windows < count:
        raise ValueError(f"the calibration text has {windows} windows of {length} tokens")
    step = windows // count
    return [ids[i * step * length : (i * step + 1) * length] for i in range(count)]


class _Recorder:
    """Wraps a linear during calibration: mean |input| per channel, a sample of rows, and with
    a group size the Gram matrix of each group's inputs."""

    def __init__(self, inner: Linear, pick: torch.Tensor, group_size: int | None) -> None:
        self.inner = inner
        self.pick = pick
        self.group_size = group_size
        self.abs_sum: torch.Tensor | None = None
        self.gram: torch.Tensor | None = None
        self.count = 0
        self.rows: list[torch.Tensor] = []

    def tensors(self) -> list[torch.Tensor]:
        return self.inner.tensors()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        total = xf.abs().sum(dim=0)
        self.abs_sum = total if self.abs_sum is None else self.abs_sum + total
        self.count += x.shape[0]
        self.rows.append(xf[self.pick[self.pick < x.shape[0]]])
        if self.group_size is not None:
            xg = _grouped(xf, self.group_size)
            gram = torch.bmm(xg.transpose(0, 1).transpose(1, 2), xg.transpose(0, 1))
            self.gram = gram if self.gram is None else self.gram + gram
        return self.inner(x)

    def mean_abs(self) -> torch.Tensor:
        assert self.abs_sum is not None
        return self.abs_sum / self.count

    def sample(self) -> torch.Tensor:
        return torch.cat(self.rows)


def _grouped(x: torch.Tensor, group_size: int) -> torch.Tensor:
    """[..., K] -> [..., G, group_size], zero-padded to whole groups."""
    pad = -x.shape[-1] % group_size
    padded: torch.Tensor = torch.nn.functional.pad(x, (0, pad))
    grouped: torch.Tensor = padded.unflatten(-1, (-1, group_size))
    return grouped


def _record(
    model: LlamaModel, sequences: list[list[int]], group_size: int | None
) -> dict[Key, _Recorder]:
    cfg = model.config
    spec = KVCacheSpec(
        cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, model.attention.spec.block_size, model.dtype
    )
    view = model.with_attention(TorchAttentionBackend(spec, model.device))
    tokens = SEQUENCES_PER_FORWARD * CALIBRATION_LENGTH
    forwards = -(-len(sequences) // SEQUENCES_PER_FORWARD)
    stride = max(tokens * forwards // SAMPLED_ROWS, 1)
    pick = torch.arange(0, tokens, stride, device=model.device)
    recorders: dict[Key, _Recorder] = {}
    for i, layer in enumerate(view.layers):
        for name in LINEARS:
            recorder = _Recorder(getattr(layer, name), pick, group_size)
            recorders[(i, name)] = recorder
            setattr(layer, name, recorder)
    for start in range(0, len(sequences), SEQUENCES_PER_FORWARD):
        hidden_states(view, sequences[start : start + SEQUENCES_PER_FORWARD])
    return recorders


FakeQuant = Callable[[torch.Tensor], torch.Tensor]


def _search_scale(
    x: torch.Tensor, mean_abs: torch.Tensor, w: torch.Tensor, fq: FakeQuant
) -> torch.Tensor:
    """The input-channel scales minimizing the quantized linear's output error on ``x``."""
    reference = x @ w.T
    best, best_loss = torch.ones_like(mean_abs), float("inf")
    for step in range(ALPHA_GRID):
        s = mean_abs.pow(step / ALPHA_GRID).clamp_min(1e-4)
        s = s / (s.max() * s.min()).sqrt()
        loss = float((x @ (fq(w * s) / s).T - reference).pow(2).mean())
        if loss < best_loss:
            best, best_loss = s, loss
    return best


def _search_clip(gram: torch.Tensor, w: torch.Tensor, group_size: int) -> torch.Tensor:
    """Per (output channel, group), the clip ratio minimizing that group's output error
    ``d^T G d`` (d: the group's weight error, G: the Gram matrix of its inputs)."""
    n = w.shape[0]
    groups = gram.shape[0]
    best = torch.ones(n, groups, device=w.device)
    best_err = torch.full((n, groups), float("inf"), device=w.device)
    for ratio in CLIP_RATIOS:
        clip = torch.full((n, groups), ratio, device=w.device)
        diff = _grouped(fake_quantize_groups(w, group_size, clip) - w, group_size).transpose(0, 1)
        err = (torch.bmm(diff, gram) * diff).sum(dim=2).T
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best = torch.where(better, clip, best)
    return best


def _fake_quant(config: QuantizationConfig) -> FakeQuant:
    group_size = config.group_size
    if group_size is None:
        return lambda w: quantize_int8(w).dequantize()
    return lambda w: fake_quantize_groups(w, group_size, bits=config.bits)


def _weight(linear: Linear) -> torch.Tensor:
    inner = linear.inner if isinstance(linear, _Recorder) else linear
    assert isinstance(inner, DenseLinear)
    return inner.weight.float()


def calibrate(
    model: LlamaModel, config: QuantizationConfig, sequences: list[list[int]]
) -> Calibration:
    """AWQ scales (and, for int4, clip ratios) for every projection of ``model``."""
    cfg = model.config
    # int4 searches clip ratios per group; 8 bits have steps fine enough to keep every range.
    clip_groups = config.group_size if config.weights == "int4" else None
    recorders = _record(model, sequences, clip_groups)
    fq = _fake_quant(config)
    scales: dict[Key, torch.Tensor] = {}
    clips: dict[Key, torch.Tensor] = {}
    for i, layer in enumerate(model.layers):
        for name in LINEARS:
            if name == "o_proj" and cfg.num_heads != cfg.num_kv_heads:
                continue  # nothing to fold 1/s into: V's channels are shared across heads
            rec = recorders[(i, name)]
            x, w = rec.sample(), _weight(getattr(layer, name))
            s = _search_scale(x, rec.mean_abs(), w, fq)
            scales[(i, name)] = s
            if clip_groups is not None:
                assert rec.gram is not None
                # The search sees the scaled problem: inputs x / s, weights w * s.
                inv = _grouped(1.0 / s, clip_groups)
                gram = rec.gram * inv[:, :, None] * inv[:, None, :]
                clip = _search_clip(gram, w * s, clip_groups)
                if name == "qkv":
                    clip[: cfg.q_size + cfg.kv_size] = 1.0
                clips[(i, name)] = clip
    return Calibration(scales, clips)


def apply_scales(model: LlamaModel, calibration: Calibration) -> None:
    """Fold each linear's input scales into it (``W * s``) and ``1 / s`` into the op before it,
    in place: the full-precision function is unchanged, only what quantization sees."""
    cfg = model.config
    for (i, name), scale in calibration.scales.items():
        layer = model.layers[i]
        s = scale.to(device=model.device, dtype=model.dtype)
        linear = getattr(layer, name)
        assert isinstance(linear, DenseLinear)
        linear.weight.mul_(s)
        _fold_inverse(layer, name, s, cfg.q_size, cfg.kv_size, cfg.intermediate_size)


def _fold_inverse(
    layer: LayerWeights, name: str, s: torch.Tensor, q_size: int, kv_size: int, inter: int
) -> None:
    if name == "qkv":
        layer.input_norm.div_(s)
    elif name == "gate_up":
        layer.post_norm.div_(s)
    elif name == "down":
        gate_up = layer.gate_up
        assert isinstance(gate_up, DenseLinear)
        gate_up.weight[inter:].div_(s[:, None])
    else:  # o_proj, heads == KV heads: V's output channels are O's input channels
        qkv = layer.qkv
        assert isinstance(qkv, DenseLinear)
        v = slice(q_size + kv_size, q_size + 2 * kv_size)
        qkv.weight[v].div_(s[:, None])
        if qkv.bias is not None:
            qkv.bias[v].div_(s)


def _cache_key(model_path: Path, config: QuantizationConfig) -> str:
    parts = [f"v{VERSION}", config.describe(), (model_path / "config.json").read_text()]
    for f in sorted(model_path.glob("*.safetensors")):
        stat = f.stat()
        parts.append(f"{f.name}:{stat.st_size}:{stat.st_mtime_ns}")
    parts.append(f"{CALIBRATION_SEQUENCES}x{CALIBRATION_LENGTH}:{SAMPLED_ROWS}")
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]


def calibration_file(model_path: Path, config: QuantizationConfig) -> str:
    """The calibration's file name: the model's files and the settings are in it."""
    return f"awq-{_cache_key(model_path, config)}.safetensors"


def _cached_path(model_path: Path, config: QuantizationConfig, folder: Path | None) -> Path:
    return (folder or cache_dir() / "calibration") / calibration_file(model_path, config)


def stored_calibration(
    model_path: Path, config: QuantizationConfig, folder: Path | None = None
) -> Calibration | None:
    """The calibration an image baked (``$LADLE_CALIBRATION_DIR``, read-only), else the one
    cached in ``folder`` (the cache's ``calibration`` folder by default), if either exists."""
    name = calibration_file(model_path, config)
    baked = os.environ.get(bake.ENV)
    cached = _cached_path(model_path, config, folder)
    for found, where in ([(Path(baked) / name, "baked")] if baked else []) + [(cached, "cached")]:
        if found.is_file():
            log.info(
                f"using the {where} AWQ calibration",
                extra={"quantization": config.describe(), "path": str(found)},
            )
            return Calibration.load(found)
    return None


@contextlib.contextmanager
def calibrating(model_path: Path, config: QuantizationConfig) -> Iterator[None]:
    """Held while one process calibrates: the ranks of a split model load at once, and one
    calibration of the whole model serves them all."""
    lock = _cached_path(model_path, config, None).with_suffix(".lock")
    lock.parent.mkdir(parents=True, exist_ok=True)
    with lock.open("w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        yield


def calibration_for(
    model: LlamaModel, config: QuantizationConfig, model_path: Path, folder: Path | None = None
) -> Calibration:
    """The calibration for this (whole) model and settings: a stored one, else computed now
    and saved in ``folder``. A pod's cache starts empty, so only a baked one spares it the
    calibration at every start."""
    stored = stored_calibration(model_path, config, folder)
    return stored if stored is not None else calibrate_and_save(model, config, model_path, folder)


def calibrate_and_save(
    model: LlamaModel, config: QuantizationConfig, model_path: Path, folder: Path | None = None
) -> Calibration:
    """Calibrate the whole ``model`` now, and save the result where ``stored_calibration``
    finds it."""
    path = _cached_path(model_path, config, folder)
    from transformers import AutoTokenizer

    started = time.monotonic()
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    sequences = calibration_sequences(tokenizer, CALIBRATION_SEQUENCES, CALIBRATION_LENGTH)
    log.info(
        "calibrating AWQ on the Python language reference",
        extra={"quantization": config.describe(), "tokens": sum(map(len, sequences))},
    )
    calibration = calibrate(model, config, sequences)
    calibration.save(path)
    log.info(
        "calibrated AWQ",
        extra={"seconds": round(time.monotonic() - started, 1), "path": str(path)},
    )
    return calibration

"""Engine arguments, named and defaulted like vLLM's so that users can bring their flags."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

from ladle.api.isvc import DEFAULT_MAX_NUM_SEQS
from ladle.flag_types import Invalid, existing_path, integer, memory, number, size_text
from ladle.runtime.spec_decode.config import SpeculativeConfig
from ladle.settings import Default, SettingError

SchedulingPolicy = Literal["fcfs", "priority"]
DTYPES = ("auto", "float32", "bfloat16", "float16")
KV_CACHE_DTYPES = ("auto", "float16", "int8")
WEIGHT_QUANTIZATIONS = ("none", "int8", "int4")
QUANTIZATION_METHODS = ("rtn", "awq", "gptq", "awq-gptq")
# int4 group size when none is given: llama.cpp's block size, and the best quality per byte in
# the quality table (docs/quantization.md). int8 is per output channel unless given one.
DEFAULT_GROUP_SIZE = 32


class ConfigError(SettingError):
    """A user-facing configuration problem; the message names the setting and what is allowed."""


class ModelMissing(ConfigError):
    """The model's files are not where the settings say. Unlike the settings themselves, they
    may yet arrive (a volume still being filled), so a restart may help."""


def parse_memory_size(value: str | int) -> int:
    """Bytes from a Kubernetes quantity (``4Gi``, ``4G``), ``4GiB``/``4GB`` or a byte count:
    one rule for the command line and the CRD (see ``ladle.settings.memory``)."""
    if isinstance(value, int):
        return value
    try:
        return memory(value)
    except Invalid as exc:
        raise ConfigError(f"invalid memory size {value!r}: {exc}") from None


@dataclass(frozen=True)
class QuantizationConfig:
    """Weight-only quantization applied at load (``ladle.runtime.quantization``)."""

    weights: str = "none"
    method: str = "awq"
    # Inputs per scale and offset; None: int8 per output channel (int4 always has groups).
    group_size: int | None = None

    @property
    def enabled(self) -> bool:
        return self.weights != "none"

    @property
    def uses_awq(self) -> bool:
        """AWQ's scales (and int4 clip ratios) are applied before rounding."""
        return self.method in ("awq", "awq-gptq")

    @property
    def uses_gptq(self) -> bool:
        """GPTQ rounds the weights rather than round to nearest."""
        return self.method in ("gptq", "awq-gptq")

    @property
    def bits(self) -> int:
        return 8 if self.weights == "int8" else 4

    def describe(self) -> str:
        """A short name: none, int8-awq, int8-awq-g32, int4-awq-g64."""
        if not self.enabled:
            return "none"
        groups = "" if self.group_size is None else f"-g{self.group_size}"
        return f"{self.weights}-{self.method}{groups}"


@dataclass
class EngineArgs:
    """Everything that shapes an engine instance. Field names follow vLLM's ``EngineArgs``."""

    model: str | None = None
    served_model_name: str | None = None
    dtype: str = "auto"
    device: str = "auto"
    max_model_len: int | None = None
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS
    max_num_batched_tokens: int = 2048
    block_size: int = 16
    enable_prefix_caching: bool = True
    kv_cache_memory: int = 4 << 30
    gpu_memory_utilization: float = 0.9
    num_gpu_blocks_override: int | None = None
    seed: int = 0
    scheduling_policy: SchedulingPolicy = "fcfs"
    attention_backend: str = "auto"
    enforce_eager: bool = False
    kv_cache_dtype: str = "auto"
    # vLLM's --quantization names a checkpoint's format; ours quantizes full-precision weights
    # at load. The method defaults to awq; the group size is int4's.
    quantization: str | None = None
    quantization_method: str | None = None
    quantization_group_size: int | None = None
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    # Adapters kept in CPU memory; None: max_loras (vLLM's default).
    max_cpu_loras: int | None = None
    # vLLM's: JSON text or a mapping ({"method": "ngram", "num_speculative_tokens": 4, ...}).
    speculative_config: str | dict[str, Any] | None = None
    # Ranks the model is split over (Megatron-style); rank r on GPU r, or CPU processes.
    tensor_parallel_size: int = 1
    # vLLM's multi-node flags: the ranks spread over nnodes machines, tensor_parallel_size /
    # nnodes each; node 0 serves, the others run their ranks headless.
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 29501
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ConfigError(f"dtype must be one of {', '.join(DTYPES)}; got {self.dtype!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ConfigError(
                f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}; "
                f"got {self.kv_cache_dtype!r}"
            )
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ConfigError(f"device must be auto, cpu or cuda[:N]; got {self.device!r}")
        for name in (
            "max_num_seqs",
            "max_num_batched_tokens",
            "block_size",
            "max_loras",
            "max_lora_rank",
            "tensor_parallel_size",
            "nnodes",
            "master_port",
        ):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1; got {getattr(self, name)}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ConfigError(f"max_model_len must be >= 1; got {self.max_model_len}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ConfigError(
                f"gpu_memory_utilization must be in (0, 1]; got {self.gpu_memory_utilization}"
            )
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ConfigError(
                f"scheduling_policy must be fcfs or priority; got {self.scheduling_policy!r}"
            )
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ConfigError(
                f"max_cpu_loras ({self.max_cpu_loras}) must be at least max_loras "
                f"({self.max_loras})"
            )
        self.kv_cache_memory = parse_memory_size(self.kv_cache_memory)
        quantization = self.quantization_config()  # validates
        self.speculative()  # validates
        if self.tensor_parallel_size > 1:
            self._check_tensor_parallel(quantization)
        if self.tensor_parallel_size % self.nnodes:
            raise ConfigError(
                f"tensor_parallel_size {self.tensor_parallel_size} does not spread evenly over "
                f"nnodes {self.nnodes}: each node runs tensor_parallel_size / nnodes ranks"
            )
        if not 0 <= self.node_rank < self.nnodes:
            raise ConfigError(f"node_rank must be 0 to nnodes - 1; got {self.node_rank}")

    def _check_tensor_parallel(self, quantization: QuantizationConfig) -> None:
        """What does not run split across ranks yet, refused before anything starts."""
        if self.enable_lora:
            raise ConfigError("enable_lora does not work with tensor_parallel_size > 1 yet")
        speculative = self.speculative()
        if speculative is not None and speculative.method == "draft_model":
            raise ConfigError(
                "speculative method draft_model does not work with tensor_parallel_size > 1 yet"
            )
        if quantization.enabled and quantization.uses_gptq:
            raise ConfigError(
                f"quantization_method {quantization.method} rounds each layer on the whole "
                "model's activations, which tensor_parallel_size > 1 splits; use "
                "quantization_method awq or rtn"
            )
        if self.device.startswith("cuda:"):
            raise ConfigError(
                "device cuda:N names one GPU; tensor parallelism uses GPUs 0 to "
                "tensor_parallel_size - 1 (narrow them with CUDA_VISIBLE_DEVICES)"
            )

    def quantization_config(self) -> QuantizationConfig:
        weights = self.quantization or "none"
        if weights not in WEIGHT_QUANTIZATIONS:
            raise ConfigError(
                f"quantization must be one of {', '.join(WEIGHT_QUANTIZATIONS)}; got {weights!r}"
            )
        method, group = self.quantization_method, self.quantization_group_size
        if weights == "none":
            if method is not None or group is not None:
                raise ConfigError(
                    "quantization_method and quantization_group_size need quantization int8 or int4"
                )
            return QuantizationConfig()
        if method is not None and method not in QUANTIZATION_METHODS:
            raise ConfigError(
                f"quantization_method must be one of {', '.join(QUANTIZATION_METHODS)}; "
                f"got {method!r}"
            )
        if weights == "int4" and group is None:
            group = DEFAULT_GROUP_SIZE
        if group is not None and (group < 32 or group % 32):
            raise ConfigError(
                f"quantization_group_size must be a positive multiple of 32; got {group}"
            )
        return QuantizationConfig(weights, method or "awq", group)

    def speculative(self) -> SpeculativeConfig | None:
        if self.speculative_config is None:
            return None
        return SpeculativeConfig.parse(self.speculative_config)

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> None:
        """Add the engine flags, spelled as vLLM spells them."""
        group = parser.add_argument_group("engine")
        defaults = EngineArgs()
        group.add_argument(
            "--model",
            type=_model_path,
            default=Default(None, "the embedded SmolLM2-135M-Instruct"),
            help="HF folder (config.json, safetensors, tokenizer) or .gguf file",
        )
        group.add_argument(
            "--served-model-name",
            default=Default(None, "the model folder's name"),
            help="the OpenAI `model` name",
        )
        group.add_argument(
            "--dtype", choices=DTYPES, default=defaults.dtype, help="weights and compute"
        )
        group.add_argument(
            "--device",
            type=_device,
            default=defaults.device,
            help="auto (CUDA when present), cpu or cuda[:N]",
        )
        group.add_argument(
            "--max-model-len",
            type=integer(1),
            default=Default(None, "the model's, lowered to what the KV cache holds"),
            help="tokens per sequence, prompt and output together",
        )
        group.add_argument(
            "--max-num-seqs",
            type=integer(1),
            default=defaults.max_num_seqs,
            help="sequences per engine step",
        )
        group.add_argument(
            "--max-num-batched-tokens",
            type=integer(1),
            default=defaults.max_num_batched_tokens,
            help="tokens per engine step (prefill chunks and decodes)",
        )
        group.add_argument(
            "--block-size",
            type=integer(1),
            default=defaults.block_size,
            help="tokens per KV cache block",
        )
        group.add_argument(
            "--enable-prefix-caching",
            action=argparse.BooleanOptionalAction,
            default=defaults.enable_prefix_caching,
            help="reuse the KV blocks of shared prompt prefixes",
        )
        group.add_argument(
            "--kv-cache-memory",
            type=memory,
            default=Default(defaults.kv_cache_memory, size_text(defaults.kv_cache_memory)),
            help="KV cache budget on the CPU: a Kubernetes quantity (4Gi = 4 x 2^30 bytes, "
            "4G = 4 x 10^9; 4GiB and 4GB too) or bytes",
        )
        group.add_argument(
            "--gpu-memory-utilization",
            type=number(above=0, maximum=1),
            default=defaults.gpu_memory_utilization,
            help="fraction of GPU memory for weights, activations and the KV cache",
        )
        group.add_argument(
            "--num-gpu-blocks-override",
            type=integer(1),
            default=Default(None, "sized from --gpu-memory-utilization"),
            help="KV cache blocks on the GPU",
        )
        group.add_argument(
            "--seed",
            type=integer(0),
            default=defaults.seed,
            help="engine seed for unseeded requests",
        )
        group.add_argument(
            "--scheduling-policy",
            choices=("fcfs", "priority"),
            default=defaults.scheduling_policy,
            help="fcfs, or priority (a request's `priority`, lower first)",
        )
        group.add_argument(
            "--attention-backend",
            choices=("auto", "cpu", "torch", "triton"),
            default=defaults.attention_backend,
            help="attention kernels",
        )
        group.add_argument(
            "--enforce-eager",
            action="store_true",
            help="run decode steps op by op: no CUDA graphs, no fused CPU decode step",
        )
        group.add_argument(
            "--kv-cache-dtype",
            choices=KV_CACHE_DTYPES,
            default=defaults.kv_cache_dtype,
            help="auto: the model's dtype; float16: half of fp32's memory (llama.cpp's default "
            "cache type); int8: per-token, per-head scales (a quarter of fp32's memory, half of "
            "bf16's)",
        )
        group.add_argument(
            "--quantization",
            "-q",
            choices=WEIGHT_QUANTIZATIONS,
            default=Default(None, "none"),
            help="quantize the weights at load: int8 per output channel (or in groups, with "
            "--quantization-group-size), int4 in groups",
        )
        group.add_argument(
            "--quantization-method",
            choices=QUANTIZATION_METHODS,
            default=Default(None, "awq, with --quantization"),
            help="rtn: round to nearest; awq: activation-aware scales (and int4 clipping) "
            "calibrated on text that ships with Python, cached after the first load; gptq: "
            "error-compensating rounding calibrated at every load; awq-gptq: both",
        )
        group.add_argument(
            "--quantization-group-size",
            type=integer(32),
            default=Default(None, f"{DEFAULT_GROUP_SIZE} for int4, per output channel for int8"),
            help="weights per scale and offset, a multiple of 32",
        )

        lora = parser.add_argument_group("LoRA adapters")
        lora.add_argument(
            "--enable-lora",
            action="store_true",
            help="serve LoRA adapters on top of the model, batched with it",
        )
        lora.add_argument(
            "--max-loras",
            type=integer(1),
            default=defaults.max_loras,
            help="adapters resident on the device at once: a step runs at most this many",
        )
        lora.add_argument(
            "--max-lora-rank",
            type=integer(1),
            default=defaults.max_lora_rank,
            help="the highest adapter rank served; every slot is sized for it",
        )
        lora.add_argument(
            "--max-cpu-loras",
            type=integer(1),
            default=Default(None, "--max-loras"),
            help="adapters kept in CPU memory; the rest are read from disk when needed",
        )

        spec = parser.add_argument_group("speculative decoding")
        spec.add_argument(
            "--speculative-config",
            type=_speculative_config,
            default=Default(None, "off"),
            help='vLLM\'s, as JSON: {"method": "ngram", "num_speculative_tokens": 4, '
            '"prompt_lookup_max": 4, "prompt_lookup_min": 2} drafts from earlier text of the '
            'prompt and output; {"method": "draft_model", "num_speculative_tokens": 4, '
            '"quantization": "int4"} drafts with a copy of the model rounded to int4 (or '
            '"model": another folder with the same vocabulary). Each step verifies the draft; '
            "greedy output is unchanged token for token, and sampled output keeps its "
            "distribution",
        )

        parallel = parser.add_argument_group("parallelism")
        parallel.add_argument(
            "--tensor-parallel-size",
            "-tp",
            type=integer(1),
            default=defaults.tensor_parallel_size,
            help="split every layer over this many ranks (GPUs 0 to N-1, or CPU processes): "
            "for models larger than one device",
        )
        parallel.add_argument(
            "--nnodes",
            type=integer(1),
            default=defaults.nnodes,
            help="machines the ranks spread over, tensor-parallel-size / nnodes each; every "
            "node needs LADLE_PARALLEL_SECRET, the same on all",
        )
        parallel.add_argument(
            "--node-rank",
            type=integer(0),
            default=defaults.node_rank,
            help="this machine's place: 0 serves the API, the others run their ranks headless",
        )
        parallel.add_argument(
            "--master-addr",
            default=defaults.master_addr,
            help="node 0's address, as the other nodes reach it",
        )
        parallel.add_argument(
            "--master-port",
            type=integer(1),
            default=defaults.master_port,
            help="node 0's rendezvous port; the port after it carries the step plans",
        )

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        names = {f.name for f in dataclasses.fields(cls)} - {"extra"}
        return cls(**{k: v for k, v in vars(args).items() if k in names})


def _model_path(text: str) -> str:
    """What ``resolve_model`` would refuse, said at once (it runs only once torch loads)."""
    path = existing_path(text)
    if path.is_file() and path.suffix != ".gguf":
        raise Invalid("expected a model folder or a .gguf file")
    if path.is_dir() and not (path / "config.json").is_file():
        raise Invalid(f"{path} has no config.json: expected an HF model folder or a .gguf file")
    return str(path)


def _device(text: str) -> str:
    name = text.strip()
    index = name.removeprefix("cuda:")
    if name in ("auto", "cpu", "cuda") or (name.startswith("cuda:") and index.isdigit()):
        return name
    raise Invalid("expected auto, cpu, cuda or cuda:N")


def _speculative_config(text: str) -> str:
    """The flag's JSON, checked at once (one line naming the key, never a traceback)."""
    try:
        SpeculativeConfig.parse(text)
    except SettingError as exc:
        raise Invalid(str(exc).removeprefix("speculative config: ")) from None
    return text

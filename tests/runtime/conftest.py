"""Shared fixtures for engine tests: the default model, transformers references, tiny models."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import transformers
from random_weights import save_random_model, tiny_config
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

from ladle.runtime.engine import LLMEngine
from ladle.runtime.models.loader import resolve_model


@pytest.fixture(scope="session")
def default_model_path() -> Path:
    return resolve_model(None)


@pytest.fixture(scope="session")
def tiny_model_factory(
    tmp_path_factory: pytest.TempPathFactory, default_model_path: Path
) -> Callable[[str], Path]:
    """Build (once per session) a random-weight model folder for an architecture name."""
    built: dict[str, Path] = {}
    vocab = AutoConfig.from_pretrained(default_model_path).vocab_size

    def build(arch: str) -> Path:
        if arch not in built:
            folder = tmp_path_factory.mktemp(f"tiny-{arch}")
            built[arch] = save_random_model(tiny_config(arch, vocab), folder, default_model_path)
        return built[arch]

    return build


@dataclass
class Reference:
    """transformers' greedy continuation, and its two best tokens with their logits at every
    generated position (what a near-tie is judged on)."""

    tokens: list[int]
    top2: torch.Tensor  # [num_new_tokens, 2] token ids
    top2_logits: torch.Tensor  # [num_new_tokens, 2]


# transformers' references of model folders, kept between runs: a fp32 greedy continuation is
# a function of the weights, the prompt, the length, the transformers and torch versions and
# the CPU's instruction set, which the key holds. Minutes of the suite are transformers
# generating the same continuations again.
REFERENCES = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "ladle" / "refs"


def _for_reference(model: PreTrainedModel) -> PreTrainedModel:
    model.eval()
    # Generate exactly the requested length, like the engine's ignore_eos, without
    # min_new_tokens (which would also mask EOS out of the argmax).
    model.generation_config.eos_token_id = None
    return model


def _folder_digest(folder: Path) -> str:
    digest = hashlib.sha256()
    for path in sorted(folder.iterdir()):
        if path.suffix in (".json", ".safetensors"):
            digest.update(path.name.encode())
            with path.open("rb") as f:
                while chunk := f.read(1 << 24):
                    digest.update(chunk)
    versions = (
        transformers.__version__,
        torch.__version__,
        torch.backends.cpu.get_cpu_capability(),
    )
    digest.update(repr(versions).encode())
    return digest.hexdigest()


class TransformersReference:
    """``source``: a model folder (its references are kept between runs), or a model already
    built (a PEFT model, for adapters)."""

    def __init__(self, source: Path | PreTrainedModel) -> None:
        self._source = source
        self._model = None if isinstance(source, Path) else _for_reference(source)
        self._digest = _folder_digest(source) if isinstance(source, Path) else None
        self._cache: dict[tuple[tuple[int, ...], int], Reference] = {}

    @property
    def model(self) -> PreTrainedModel:
        """Loaded when a reference is not kept yet."""
        if self._model is None:
            assert isinstance(self._source, Path)
            loaded = AutoModelForCausalLM.from_pretrained(self._source, dtype=torch.float32)
            self._model = _for_reference(loaded)
        return self._model

    def greedy(self, prompt: list[int], max_new_tokens: int) -> Reference:
        key = (tuple(prompt), max_new_tokens)
        if key not in self._cache:
            self._cache[key] = self._kept(prompt, max_new_tokens)
        return self._cache[key]

    def _kept(self, prompt: list[int], max_new_tokens: int) -> Reference:
        if self._digest is None:
            return self._generate(prompt, max_new_tokens)
        name = hashlib.sha256(f"{self._digest} {prompt} {max_new_tokens}".encode()).hexdigest()
        path = REFERENCES / f"{name}.pt"
        if path.exists():
            return Reference(**torch.load(path))
        ref = self._generate(prompt, max_new_tokens)
        REFERENCES.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(f".{os.getpid()}.tmp")
        torch.save(vars(ref), partial)
        partial.replace(path)
        return ref

    @torch.inference_mode()
    def _generate(self, prompt: list[int], max_new_tokens: int) -> Reference:
        out = self.model.generate(
            torch.tensor([prompt]),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
            pad_token_id=0,
        )
        top = torch.cat(out.logits, dim=0).float().topk(2)
        return Reference(out.sequences[0, len(prompt) :].tolist(), top.indices, top.values)


def assert_matches_reference(
    ours: list[int], ref: Reference, report: list[str], label: str
) -> bool:
    """Exact match, or a divergence that is a true near-tie (vLLM's rule): both tokens in
    transformers' top-2 with a logit gap under 1e-3. Returns whether the match was exact."""
    assert len(ours) == len(ref.tokens), f"{label}: length {len(ours)} != {len(ref.tokens)}"
    for pos, (a, b) in enumerate(zip(ours, ref.tokens, strict=True)):
        if a != b:
            top2 = ref.top2[pos].tolist()
            why = f"{label}: diverged at token {pos}: ours {a}, transformers {b}, top2 {top2}"
            assert a in top2, why
            assert b in top2, why
            gap = abs(float(ref.top2_logits[pos, 0] - ref.top2_logits[pos, 1]))
            assert gap < 1e-3, f"{why}, logit gap {gap:.2e}"
            report.append(f"{label}: near-tie divergence at token {pos} (gap {gap:.1e})")
            return False
    report.append(f"{label}: exact")
    return True


def assert_no_blocks_leaked(engine: LLMEngine) -> None:
    assert not engine.has_unfinished_requests()
    assert engine.kv.num_allocated_blocks() == 0
    assert not engine.kv.block_tables


@pytest.fixture(scope="session")
def default_reference(default_model_path: Path) -> TransformersReference:
    return TransformersReference(default_model_path)


@pytest.fixture
def match_report(request: pytest.FixtureRequest) -> Iterator[list[str]]:
    """Collect per-request match results and print them with the test's output (-rA)."""
    lines: list[str] = []
    yield lines
    exact = sum(1 for line in lines if line.endswith("exact"))
    print(f"\n{request.node.name}: {exact}/{len(lines)} exact matches")
    for line in lines:
        print("  " + line)

"""Shared fixtures for engine tests: the default model, transformers references, tiny models."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
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
    """transformers' greedy continuation plus its logits at every generated position."""

    tokens: list[int]
    logits: torch.Tensor  # [num_new_tokens, vocab]


class TransformersReference:
    """``source``: a model folder, or a model already built (a PEFT model, for adapters)."""

    def __init__(self, source: Path | PreTrainedModel) -> None:
        self.model: PreTrainedModel = (
            AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
            if isinstance(source, Path)
            else source
        )
        self.model.eval()
        # Generate exactly the requested length, like the engine's ignore_eos, without
        # min_new_tokens (which would also mask EOS out of the argmax).
        self.model.generation_config.eos_token_id = None
        self._cache: dict[tuple[tuple[int, ...], int], Reference] = {}

    @torch.inference_mode()
    def greedy(self, prompt: list[int], max_new_tokens: int) -> Reference:
        key = (tuple(prompt), max_new_tokens)
        if key not in self._cache:
            ids = torch.tensor([prompt])
            out = self.model.generate(
                ids,
                max_new_tokens=max_new_tokens,
                do_sample=False,
                output_logits=True,
                return_dict_in_generate=True,
                pad_token_id=0,
            )
            tokens = out.sequences[0, len(prompt) :].tolist()
            self._cache[key] = Reference(tokens, torch.cat(out.logits, dim=0).float())
        return self._cache[key]


def assert_matches_reference(
    ours: list[int], ref: Reference, report: list[str], label: str
) -> bool:
    """Exact match, or a divergence that is a true near-tie (vLLM's rule): both tokens in
    transformers' top-2 with a logit gap under 1e-3. Returns whether the match was exact."""
    assert len(ours) == len(ref.tokens), f"{label}: length {len(ours)} != {len(ref.tokens)}"
    for pos, (a, b) in enumerate(zip(ours, ref.tokens, strict=True)):
        if a != b:
            logits = ref.logits[pos]
            top2 = logits.topk(2).indices.tolist()
            gap = abs(float(logits[a] - logits[b]))
            why = f"{label}: diverged at token {pos}: ours {a}, transformers {b}, top2 {top2}"
            assert a in top2, why
            assert b in top2, why
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

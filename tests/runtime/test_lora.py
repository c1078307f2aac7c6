"""LoRA adapters in the engine: greedy outputs equal PEFT's on transformers, batches that mix
adapters give every request its own output, adapters take turns in too few slots, the prefix
cache is kept per adapter, and an adapter that cannot be served is refused by name."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from lora_adapters import peft_model, random_adapter, trained_adapter
from random_weights import TINY_ARCHITECTURES
from safetensors.torch import load_file, save_file

from ladle.runtime import LLM, LoRARequest, SamplingParams
from ladle.runtime.engine import LLMEngine
from ladle.runtime.errors import RequestError
from ladle.runtime.lora.adapter import LoRAError

from .conftest import TransformersReference, assert_matches_reference, assert_no_blocks_leaked

# Enough for these prompts; the CPU default (4 GiB) takes seconds to allocate per engine.
KV = "16Mi"
NEW_TOKENS = 24
# Held-out prompts: none of them is the trained adapter's toy prompt.
PROMPTS = [[1, 50, 60, 70, 80, 90], [1, 500, 600, 700], [1, 42] * 20, [1, 9000, 12, 7, 300]]
TOY_PROMPT, TOY_ANSWER = [1, 11, 22, 33, 44], [777, 888, 999, 777, 888, 999]


def greedy(tokens: int = NEW_TOKENS) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)


def run(engine: LLMEngine, requests: list[tuple[list[int], LoRARequest | None]]) -> list[list[int]]:
    """Add every request at once and step until done; outputs in request order."""
    for i, (prompt, lora) in enumerate(requests):
        engine.add_request(str(i), {"prompt_token_ids": prompt}, greedy(), lora_request=lora)
    done: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    return [done[str(i)] for i in range(len(requests))]


@pytest.fixture(scope="module")
def llama(tiny_model_factory: Callable[[str], Path]) -> Path:
    return tiny_model_factory("llama")


@pytest.fixture(scope="module")
def adapters(llama: Path, tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    """Three random adapters of different ranks and targets, and one trained on a toy task."""
    root = tmp_path_factory.mktemp("adapters")
    return [
        random_adapter(llama, root / "all-r8", seed=1),
        random_adapter(llama, root / "qv-r4", seed=2, rank=4, targets=("q_proj", "v_proj")),
        random_adapter(
            llama,
            root / "mlp-r16-rs",
            seed=3,
            rank=16,
            alpha=8,
            targets=("gate_proj", "up_proj", "down_proj", "o_proj"),
            use_rslora=True,
            alpha_pattern={"down_proj": 4},
        ),
        trained_adapter(llama, root / "trained", TOY_PROMPT, TOY_ANSWER),
    ]


def lora(index: int, folder: Path) -> LoRARequest:
    return LoRARequest(folder.name, index + 1, str(folder))


@pytest.mark.parametrize("arch", TINY_ARCHITECTURES)
@pytest.mark.parametrize("eager", [False, True], ids=["fused-cpu-step", "per-op"])
def test_greedy_output_matches_peft(
    arch: str,
    eager: bool,
    tiny_model_factory: Callable[[str], Path],
    tmp_path: Path,
    match_report: list[str],
) -> None:
    base = tiny_model_factory(arch)
    adapter = random_adapter(base, tmp_path / "adapter", seed=11)
    reference = TransformersReference(peft_model(base, adapter))
    engine = LLM(str(base), kv_cache_memory=KV, enable_lora=True, enforce_eager=eager).engine
    outputs = run(engine, [(p, lora(0, adapter)) for p in PROMPTS])
    for prompt, ours in zip(PROMPTS, outputs, strict=True):
        assert_matches_reference(ours, reference.greedy(prompt, NEW_TOKENS), match_report, arch)
    base_outputs = run(engine, [(p, None) for p in PROMPTS])
    assert base_outputs != outputs, "the adapter changed nothing: the test would prove nothing"
    assert_no_blocks_leaked(engine)


def test_every_kind_of_adapter_matches_peft(
    llama: Path, adapters: list[Path], match_report: list[str]
) -> None:
    """Ranks 4 to 16, attention-only and MLP-only targets, rsLoRA with a per-module alpha."""
    engine = LLM(str(llama), kv_cache_memory=KV, enable_lora=True, max_loras=4).engine
    for i, adapter in enumerate(adapters):
        reference = TransformersReference(peft_model(llama, adapter))
        outputs = run(engine, [(p, lora(i, adapter)) for p in PROMPTS])
        for prompt, ours in zip(PROMPTS, outputs, strict=True):
            ref = reference.greedy(prompt, NEW_TOKENS)
            assert_matches_reference(ours, ref, match_report, adapter.name)


def test_a_trained_adapter_answers_its_task_where_the_base_model_does_not(
    llama: Path, adapters: list[Path]
) -> None:
    trained = adapters[3]
    llm = LLM(str(llama), kv_cache_memory=KV, enable_lora=True)
    prompt = {"prompt_token_ids": TOY_PROMPT}
    params = greedy(len(TOY_ANSWER))
    tuned = llm.generate(prompt, params, use_tqdm=False, lora_request=lora(3, trained))
    plain = llm.generate(prompt, params, use_tqdm=False)
    assert tuned[0].outputs[0].token_ids == TOY_ANSWER
    assert plain[0].outputs[0].token_ids != TOY_ANSWER
    reference = peft_model(llama, trained).generate(
        torch.tensor([TOY_PROMPT]), max_new_tokens=len(TOY_ANSWER), do_sample=False
    )
    assert reference[0, len(TOY_PROMPT) :].tolist() == TOY_ANSWER


@pytest.mark.parametrize("eager", [False, True], ids=["fused-cpu-step", "per-op"])
def test_a_mixed_batch_gives_each_request_the_output_it_gets_alone(
    llama: Path, adapters: list[Path], eager: bool
) -> None:
    """The base model and three adapters in the same steps, prefills and decodes mixed."""
    engine = LLM(
        str(llama), kv_cache_memory=KV, enable_lora=True, max_loras=3, enforce_eager=eager
    ).engine
    requests: list[tuple[list[int], LoRARequest | None]] = [
        (prompt, None if i == 0 else lora(i - 1, adapters[i - 1]))
        for i, prompt in enumerate(PROMPTS)
    ]
    alone = [run(engine, [request])[0] for request in requests]
    engine.reset_prefix_cache()
    seen: list[list[str]] = []
    engine.iteration_observers.append(lambda _: seen.append(engine.stats().running_loras))
    together = run(engine, requests)
    assert together == alone
    assert ["all-r8", "mlp-r16-rs", "qv-r4"] in seen, "the adapters never ran in one step"
    assert_no_blocks_leaked(engine)


def test_more_adapters_than_slots_take_turns(llama: Path, adapters: list[Path]) -> None:
    """Four adapters, two slots, one kept in CPU memory: no step runs more than two, adapters
    are swapped in least recently used first (and read again from disk), and every request
    still gets its own output."""
    engine = LLM(
        str(llama), kv_cache_memory=KV, enable_lora=True, max_loras=2, max_cpu_loras=2
    ).engine
    requests = [(PROMPTS[i % 2], lora(i % 4, adapters[i % 4])) for i in range(8)]
    alone = [run(engine, [request])[0] for request in requests[:4]]
    assert engine.lora is not None
    loads = engine.lora.num_loads
    engine.reset_prefix_cache()
    widest = 0

    def observe(_: object) -> None:
        nonlocal widest
        widest = max(widest, len(engine.stats().running_loras))

    engine.iteration_observers.append(observe)
    together = run(engine, requests)
    assert together == alone * 2
    assert widest == 2
    assert engine.lora.num_loads - loads >= 4
    assert_no_blocks_leaked(engine)


def test_the_prefix_cache_is_kept_per_adapter(llama: Path, adapters: list[Path]) -> None:
    """A prompt the base model has cached is computed again under an adapter (its KV differs),
    and an adapter's own cached prefix is reused."""
    engine = LLM(str(llama), kv_cache_memory=KV, enable_lora=True).engine
    prompt = PROMPTS[2]  # 40 tokens: two full blocks
    reference = TransformersReference(peft_model(llama, adapters[0])).greedy(prompt, NEW_TOKENS)
    run(engine, [(prompt, None)])
    hits = engine.stats().prefix_cache_hits
    assert run(engine, [(prompt, lora(0, adapters[0]))])[0] == reference.tokens
    assert engine.stats().prefix_cache_hits == hits
    assert run(engine, [(prompt, lora(0, adapters[0]))])[0] == reference.tokens
    assert engine.stats().prefix_cache_hits > hits


@pytest.fixture
def served(llama: Path) -> Iterator[LLMEngine]:
    engine = LLM(str(llama), kv_cache_memory=KV, enable_lora=True, max_lora_rank=8).engine
    yield engine
    # Whatever was refused, the base model still serves.
    assert run(engine, [(PROMPTS[0], None)])[0]
    assert_no_blocks_leaked(engine)


def _copy(
    source: Path,
    folder: Path,
    config: dict[str, object] | None = None,
    drop: str | None = None,
    weights: bool = True,
) -> Path:
    """A copy of an adapter folder with its config changed, a weight dropped, or no weights."""
    folder.mkdir()
    settings = json.loads((source / "adapter_config.json").read_text()) | (config or {})
    (folder / "adapter_config.json").write_text(json.dumps(settings))
    if weights:
        tensors = load_file(source / "adapter_model.safetensors")
        kept = {k: v for k, v in tensors.items() if drop is None or drop not in k}
        save_file(kept, folder / "adapter_model.safetensors")
    return folder


def test_an_adapter_that_cannot_be_served_is_refused_by_name(
    served: LLMEngine,
    adapters: list[Path],
    tiny_model_factory: Callable[[str], Path],
    tmp_path: Path,
) -> None:
    other_base = random_adapter(tiny_model_factory("qwen3"), tmp_path / "qwen3", seed=5)
    cases = {
        "rank 16 exceeds --max-lora-rank 8": adapters[2],
        "no such folder": tmp_path / "missing",
        "adapter_model.safetensors is missing": _copy(
            adapters[0], tmp_path / "none", weights=False
        ),
        "made for another base model": other_base,
        "DoRA is not supported": _copy(adapters[0], tmp_path / "dora", {"use_dora": True}),
        "but not both A and B": _copy(adapters[0], tmp_path / "half", drop="1.mlp.up_proj.lora_B"),
    }
    for i, (message, folder) in enumerate(cases.items()):
        request = LoRARequest(f"bad-{i}", 100 + i, str(folder))
        with pytest.raises(LoRAError, match=message):
            served.add_lora(request)
        with pytest.raises(LoRAError, match=message):
            served.add_request(f"r{i}", "Hello", greedy(), lora_request=request)
    assert served.list_loras() == set()


def test_an_adapter_needs_lora_enabled(llama: Path, adapters: list[Path]) -> None:
    llm = LLM(str(llama), kv_cache_memory=KV)
    with pytest.raises(RequestError, match="--enable-lora"):
        llm.generate("Hello", greedy(), use_tqdm=False, lora_request=lora(0, adapters[0]))
    assert not llm.engine.has_unfinished_requests()


def test_adapters_are_added_listed_and_removed(served: LLMEngine, adapters: list[Path]) -> None:
    first, second = lora(0, adapters[0]), lora(1, adapters[1])
    assert served.add_lora(first)
    assert served.add_lora(second)
    assert not served.add_lora(first)
    assert served.list_loras() == {1, 2}
    assert served.remove_lora(1)
    assert not served.remove_lora(1)
    assert served.list_loras() == {2}

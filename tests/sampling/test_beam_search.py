"""Beam search in the engine: beams share blocks copy-on-write, dropped beams free theirs at
once, and the result is transformers' beam search (tiny model here; the default model in
test_parity.py)."""

from __future__ import annotations

import functools
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from ladle.runtime.beam_search import BeamCandidates, BeamHypothesis, BeamSearch, BeamSearchOutput
from ladle.runtime.engine import LLMEngine
from ladle.runtime.errors import RequestError
from ladle.runtime.llm import LLM
from ladle.runtime.sampling_params import BeamSearchParams, EarlyStopping, SamplingParams
from ladle.runtime.scheduler import Scheduler
from ladle.runtime.sequence import SequenceGroup

from .conftest import assert_no_blocks_leaked

PROMPTS = [list(range(2000, 2020)), [5, 900, 4000, 77, 12, 13], list(range(300, 333))]


# Tokens the tiny model ranks high among beam continuations of PROMPTS: declared EOS, so that
# beams finish early and the EOS, length-penalty and early-stopping rules all come into play.
FREQUENT_TOKENS = [23150, 21623, 34686]


@pytest.fixture(scope="module")
def eos_model_path(tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("tiny-eos")
    for file in tiny_model_path.iterdir():
        shutil.copy(file, folder / file.name)
    for name in ("config.json", "generation_config.json"):
        config = json.loads((folder / name).read_text())
        config["eos_token_id"] = [2, *FREQUENT_TOKENS]
        (folder / name).write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="module")
def eos_llm(eos_model_path: Path) -> LLM:
    return LLM(str(eos_model_path), kv_cache_memory="32MiB", max_model_len=256)


@pytest.fixture(scope="module")
def eos_hf(eos_model_path: Path) -> Any:
    return AutoModelForCausalLM.from_pretrained(eos_model_path, dtype=torch.float32).eval()


def transformers_best(model: Any, prompt: list[int], params: BeamSearchParams) -> list[int]:
    """transformers' best beam, with the engine's settings mapped one to one."""
    eos = model.generation_config.eos_token_id
    eos_ids = {eos} if isinstance(eos, int) else set(eos)
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt]),
            num_beams=params.beam_width,
            do_sample=False,
            max_new_tokens=params.max_tokens,
            length_penalty=params.length_penalty,
            early_stopping=params.early_stopping,
            eos_token_id=None if params.ignore_eos else eos,
            pad_token_id=2,
        )
    tokens: list[int] = out[0, len(prompt) :].tolist()
    if params.ignore_eos:
        return tokens
    # Beams shorter than the longest are padded: keep through the first EOS.
    ends = [i for i, t in enumerate(tokens) if t in eos_ids]
    return tokens[: ends[0] + 1] if ends else tokens


def test_beams_share_blocks_and_dropped_beams_free_theirs_at_once(tiny_llm: LLM) -> None:
    engine = tiny_llm.engine
    engine.add_request("beam", PROMPTS[0], BeamSearchParams(beam_width=4, max_tokens=10))
    shared_seen = False
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
        tables = list(engine.kv.block_tables.values())
        if not tables:
            continue
        assert len(tables) == 4  # always exactly beam_width live beams
        in_use = {b for t in tables for b in t}
        # Nothing but the live beams' blocks is held: dropped beams freed theirs in the step.
        assert engine.kv.num_allocated_blocks() == len(in_use)
        # The full prompt block is one physical block for all beams.
        assert len({t[0] for t in tables}) == 1
        shared_seen |= len(in_use) < sum(len(t) for t in tables)
    assert shared_seen
    (final,) = outputs
    assert len(final.outputs) == 4
    assert_no_blocks_leaked(engine)


@pytest.mark.parametrize(
    ("length_penalty", "early_stopping", "ignore_eos", "reasons"),
    [
        (1.0, False, False, {"length", "stop"}),
        (0.5, True, False, {"length", "stop"}),
        # A strong length penalty favours full-length beams over the early EOS ones.
        (2.0, "never", False, {"length"}),
        (0.0, "never", False, {"length", "stop"}),
        (-1.0, False, False, {"length", "stop"}),
        (1.0, True, True, {"length"}),
    ],
)
def test_tiny_model_matches_transformers(
    eos_llm: LLM,
    eos_hf: Any,
    length_penalty: float,
    early_stopping: EarlyStopping,
    ignore_eos: bool,
    reasons: set[str],
) -> None:
    params = BeamSearchParams(
        beam_width=4,
        max_tokens=8,
        length_penalty=length_penalty,
        early_stopping=early_stopping,
        ignore_eos=ignore_eos,
    )
    results: list[BeamSearchOutput] = eos_llm.beam_search(PROMPTS, params)
    seen = set()
    for prompt, result in zip(PROMPTS, results, strict=True):
        best = result.sequences[0]
        assert best.tokens[: len(prompt)] == prompt
        assert best.tokens[len(prompt) :] == transformers_best(eos_hf, prompt, params)
        assert 1 <= len(result.sequences) <= 4
        seen |= {s.finish_reason for s in result.sequences}
    assert seen == reasons
    assert_no_blocks_leaked(eos_llm.engine)


def _our_hypotheses(
    model: Any, prompt: list[int], params: BeamSearchParams, eos: int
) -> list[BeamHypothesis]:
    """Drive BeamSearch with the model's log-softmax, beam by beam, as the engine does."""
    search = BeamSearch(params, frozenset({eos}), params.max_tokens)
    beams: list[tuple[list[int], float]] = [([], 0.0)]
    while True:
        candidates = []
        for tokens, cumulative in beams:
            logits = model(torch.tensor([prompt + tokens])).logits[0, -1].float()
            top = logits.log_softmax(-1).topk(search.num_candidates)
            candidates.append(
                BeamCandidates(tokens, cumulative, top.indices.tolist(), top.values.tolist())
            )
        continuations = search.step(candidates)
        if search.done:
            return search.finished
        beams = [(beams[c.parent][0] + [c.token_id], c.cumulative_logprob) for c in continuations]


@functools.cache
def _small_vocab_model(seed: int) -> tuple[Any, int]:
    """A random 8-token model whose EOS is the token it most often ranks first or second, so
    that hypotheses fill up early and every rule (which candidates may finish, the length
    normalization, each early-stopping mode) decides the outcome somewhere."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=8,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        initializer_range=0.5,
        pad_token_id=0,
    )
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.inference_mode():
        greedy = model.generate(
            torch.tensor([SMALL_PROMPT]), max_new_tokens=8, do_sample=False, eos_token_id=None
        )
        ranked = model(greedy).logits[0].topk(2).indices.flatten().tolist()
    eos = max(set(ranked), key=ranked.count)
    model.generation_config.eos_token_id = eos
    return model, eos


SMALL_PROMPT = [5, 1, 2]


@pytest.mark.parametrize("early_stopping", [True, False, "never"])
@pytest.mark.parametrize("length_penalty", [-1.0, 0.0, 0.5, 1.0, 2.0])
@pytest.mark.parametrize(("seed", "max_tokens"), [(0, 7), (3, 4), (3, 7)])
def test_every_hypothesis_and_score_match_transformers(
    seed: int, max_tokens: int, length_penalty: float, early_stopping: EarlyStopping
) -> None:
    model, eos = _small_vocab_model(seed)
    params = BeamSearchParams(
        beam_width=4,
        max_tokens=max_tokens,
        length_penalty=length_penalty,
        early_stopping=early_stopping,
    )
    with torch.inference_mode():
        ours = _our_hypotheses(model, SMALL_PROMPT, params, eos)
        theirs = model.generate(
            torch.tensor([SMALL_PROMPT]),
            num_beams=4,
            num_return_sequences=4,
            do_sample=False,
            max_new_tokens=max_tokens,
            length_penalty=length_penalty,
            early_stopping=early_stopping,
            output_scores=True,
            return_dict_in_generate=True,
        )
    assert len(ours) == 4
    for hypothesis, row, score in zip(
        ours, theirs.sequences, theirs.sequences_scores.tolist(), strict=True
    ):
        tokens = row[len(SMALL_PROMPT) :].tolist()
        if eos in tokens:
            tokens = tokens[: tokens.index(eos) + 1]
        assert hypothesis.token_ids == tokens
        # We recompute each beam's logits; transformers reuses its KV cache.
        assert hypothesis.score == pytest.approx(score, rel=1e-5, abs=1e-5)


def test_beams_that_miss_a_step_rerun_with_their_siblings(
    tiny_chunked_engine: LLMEngine, tiny_llm: LLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A 6-token budget shared with a chunked prefill leaves some beams out of several steps;
    the others recompute their last token until all sample together, and the result is the
    same as the search run alone."""
    params = BeamSearchParams(beam_width=4, max_tokens=6)
    alone = tiny_llm.beam_search([PROMPTS[1]], params)[0]
    engine = tiny_chunked_engine
    partial_steps = 0
    advance = Scheduler._advance_beams

    def spy(self: Scheduler, group: SequenceGroup, update: Any) -> None:
        nonlocal partial_steps
        partial_steps += 0 < len(group.pending) < len(group.live)
        advance(self, group, update)

    monkeypatch.setattr(Scheduler, "_advance_beams", spy)
    engine.add_request("beam", PROMPTS[1][:4], params)
    engine.add_request("long", list(range(3000, 3030)), SamplingParams(max_tokens=2))
    engine.add_request("beam-full", PROMPTS[1], params)
    outputs = {}
    while engine.has_unfinished_requests():
        outputs.update({o.request_id: o for o in engine.step() if o.finished})
    assert partial_steps > 0
    crowded = outputs["beam-full"].outputs
    assert [c.token_ids for c in crowded] == [s.tokens[len(PROMPTS[1]) :] for s in alone.sequences]
    assert_no_blocks_leaked(engine)
    with pytest.raises(
        RequestError, match=r"beam_width: at most 6 \(set by max_num_batched_tokens\)"
    ):
        engine.add_request("wide", PROMPTS[1], BeamSearchParams(beam_width=7, max_tokens=2))

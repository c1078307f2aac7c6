"""Speculative decoding with n-gram drafts and with a draft model: greedy output token for token
the same as without it (across prompts, lengths, stop strings, penalties, preemption, the
prefix cache and every tiny architecture), sampled output from the same distribution, the
proposer, and the config's refusals."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from random_weights import TINY_ARCHITECTURES, save_random_model, tiny_config

from ladle.runtime import LLM, RequestOutput, SamplingParams
from ladle.runtime.config import ConfigError
from ladle.runtime.kernels import cpu_kernels, quant_ops
from ladle.runtime.quantization.formats import GroupWeight
from ladle.runtime.quantization.linear import QuantizedLinear
from ladle.runtime.sampler import Sampler
from ladle.runtime.sampling_params import SamplingParams as Params
from ladle.runtime.sequence import Sequence
from ladle.runtime.spec_decode.config import SpeculativeConfig, SpeculativeConfigError
from ladle.runtime.spec_decode.ngram import propose

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
         "prompt_lookup_min": 2}  # fmt: skip
# A copy of the model rounded to int4 drafts.
DRAFT_MODEL = {"method": "draft_model", "num_speculative_tokens": 4}
PASSAGE = (
    "The river flows through the old town, past the mill and the church, and under the stone "
    "bridge where the children fish in summer. In winter the river freezes and the people "
    "skate on it from the mill to the bridge."
)
PROMPTS = [
    f"Repeat this passage exactly.\n\nPassage: {PASSAGE}\n\nRepeated: {PASSAGE[:40]}",
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n",
    "Count: one, two, three, four, five, one, two, three, four, five, one, two,",
    "Write a short poem about the sea.",
]


def test_the_proposer_continues_the_latest_longest_match() -> None:
    assert propose([1, 2, 3, 4, 1, 2, 3], 1, 3, 4) == [4, 1, 2, 3]
    assert propose([9, 2, 3, 7, 1, 2, 3], 2, 2, 2) == [7, 1]
    # The latest occurrence wins; a longer n-gram before a shorter one.
    assert propose([5, 6, 1, 5, 7, 1, 5], 1, 2, 1) == [7]
    assert propose([1, 2, 3, 4, 5], 1, 3, 4) == []
    assert propose([1, 2, 1], 2, 3, 4) == []  # below the minimum n
    # Packed as 32-bit integers, a match must start on a token: 256 = bytes 00 01 00 00.
    assert propose([256, 1, 0, 0, 1], 1, 1, 3) == [0, 0, 1]


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (
            '{"method": "eagle", "num_speculative_tokens": 2}',
            "method must be one of ngram, draft_model",
        ),
        ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens must be 1"),
        ('{"method": "ngram", "num_speculative_tokens": 17}', "1 to 16; got 17"),
        ('{"method": "ngram"}', "num_speculative_tokens must be 1 to 16; got None"),
        (
            '{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, '
            '"prompt_lookup_max": 2}',
            "prompt_lookup_min <= prompt_lookup_max",
        ),
        ('{"method": "ngram", "num_speculative_tokens": 2, "k": 1}', "unknown key 'k'"),
        (
            '{"method": "draft_model", "num_speculative_tokens": 2, "prompt_lookup_min": 2}',
            "unknown key 'prompt_lookup_min' for method draft_model",
        ),
        (
            '{"method": "draft_model", "num_speculative_tokens": 2, "quantization": "int3"}',
            "quantization must be one of int4, int8, none; got 'int3'",
        ),
        (
            '{"method": "draft_model", "num_speculative_tokens": 2, "quantization": "none"}',
            "quantization none drafts with the model itself",
        ),
        ('{"method": "draft_model", "num_speculative_tokens": 2, "model": ""}', "model must be"),
        ("{method: ngram}", "not JSON"),
    ],
)
def test_a_config_that_cannot_run_is_refused_by_name(raw: str, message: str) -> None:
    with pytest.raises(SpeculativeConfigError, match=message):
        SpeculativeConfig.parse(raw)


def test_lookup_sizes_default_as_vllms_do() -> None:
    assert SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 3}) == (
        SpeculativeConfig("ngram", 3, 5, 5)
    )
    only_max = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}
    assert SpeculativeConfig.parse(only_max).prompt_lookup_min == 4


def _greedy(llm: LLM, params: SamplingParams, prompts: list[str] = PROMPTS) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]


SMALL_CACHE: dict[str, Any] = {"kv_cache_memory": "16Mi", "max_num_seqs": 8}


@pytest.fixture(scope="module")
def plain(default_model_path: Path) -> LLM:
    """The default model without drafts, with a KV cache small enough that the prompts below,
    run together, preempt one another."""
    return LLM(str(default_model_path), **SMALL_CACHE)


PlainOutputs = Callable[[SamplingParams, list[str]], list[RequestOutput]]


@pytest.fixture(scope="module")
def plain_outputs(plain: LLM) -> PlainOutputs:
    """The model's outputs without drafts, generated once for both drafters."""
    kept: dict[tuple[str, tuple[str, ...]], list[RequestOutput]] = {}

    def outputs(params: SamplingParams, prompts: list[str]) -> list[RequestOutput]:
        key = (repr(params), tuple(prompts))
        if key not in kept:
            kept[key] = plain.generate(prompts, params, use_tqdm=False)
        return kept[key]

    return outputs


@pytest.fixture(scope="module", params=["ngram", "draft_model"])
def pair(
    request: pytest.FixtureRequest, default_model_path: Path, plain_outputs: PlainOutputs
) -> tuple[PlainOutputs, LLM]:
    """The model without drafts, and with each drafter (the draft model's cache comes out of
    the same 16 MiB: fewer blocks, more preemption)."""
    config = NGRAM if request.param == "ngram" else DRAFT_MODEL
    return plain_outputs, LLM(str(default_model_path), speculative_config=config, **SMALL_CACHE)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_tokens=32, temperature=0, ignore_eos=True),
        SamplingParams(max_tokens=7, temperature=0),
        SamplingParams(max_tokens=64, temperature=0, stop=["bridge", "def div"]),
        SamplingParams(max_tokens=40, temperature=0, repetition_penalty=1.3, min_tokens=20),
        SamplingParams(max_tokens=32, temperature=0, logprobs=2),
        # Each sample of n > 1 is a request of its own, which drafts like any other.
        SamplingParams(max_tokens=32, temperature=0, n=2, logprobs=1),
    ],
    ids=["long", "short", "stop-strings", "penalties", "logprobs", "n2"],
)
def test_greedy_output_is_the_same_token_for_token(
    pair: tuple[PlainOutputs, LLM], params: SamplingParams
) -> None:
    plain, spec = pair
    before = spec.engine.stats().spec_decode.accepted_tokens
    outs = plain(params, PROMPTS)
    specs = spec.generate(PROMPTS, params, use_tqdm=False)
    for a, b in zip(outs, specs, strict=True):
        assert [c.token_ids for c in b.outputs] == [c.token_ids for c in a.outputs]
        assert b.outputs[0].text == a.outputs[0].text
        assert b.outputs[0].finish_reason == a.outputs[0].finish_reason
        if params.logprobs:
            assert b.outputs[0].logprobs is not None
            assert a.outputs[0].logprobs is not None
            for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True):
                assert x.keys() == y.keys()
                for token in x:
                    assert y[token].logprob == pytest.approx(x[token].logprob, abs=1e-3)
    # A repetition penalty rejects the repeats that prompt lookup drafts.
    if params.max_tokens and params.max_tokens > 8 and params.repetition_penalty == 1.0:
        assert spec.engine.stats().spec_decode.accepted_tokens > before, "no draft was accepted"


def test_preempted_sequences_that_speculate_still_give_the_same_output(
    pair: tuple[PlainOutputs, LLM],
) -> None:
    plain, spec = pair
    prompts = [p + f" {i}" for i in range(2) for p in PROMPTS]
    params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
    preempted = spec.engine.stats().num_preemptions
    expected = [list(o.outputs[0].token_ids) for o in plain(params, prompts)]
    assert _greedy(spec, params, prompts) == expected
    assert spec.engine.stats().num_preemptions > preempted, "nothing was preempted"


@pytest.mark.parametrize("arch", TINY_ARCHITECTURES)
def test_every_architecture_gives_the_same_greedy_output(
    tiny_model_factory: Callable[[str], Path], arch: str
) -> None:
    path = str(tiny_model_factory(arch))
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    plain = _greedy(LLM(path, kv_cache_memory="16Mi"), params)
    # Random weights seldom repeat two tokens: drafts from one-token matches, mostly rejected.
    for config in ({**NGRAM, "prompt_lookup_min": 1}, DRAFT_MODEL):
        spec = LLM(path, kv_cache_memory="16Mi", speculative_config=config)
        assert _greedy(spec, params) == plain, config["method"]
        assert spec.engine.stats().spec_decode.drafts > 0


def test_another_model_drafts_if_it_shares_the_vocabulary(
    plain: LLM, tiny_model_factory: Callable[[str], Path], tmp_path: Path
) -> None:
    """A random-weight drafter of the same vocabulary: its drafts are mostly wrong, the
    output is still the model's. One of another vocabulary is refused by name."""
    drafter = str(tiny_model_factory("qwen2"))
    config = {**DRAFT_MODEL, "model": drafter, "quantization": "int8"}
    spec = LLM(plain.engine.args.model, speculative_config=config, **SMALL_CACHE)
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    assert _greedy(spec, params) == _greedy(plain, params)
    counts = spec.engine.stats().spec_decode
    assert counts.drafts > 0
    assert (counts.acceptance_rate or 0) < 0.5
    other = save_random_model(
        tiny_config("llama", 1000), tmp_path / "other", Path(plain.engine.args.model or "")
    )
    with pytest.raises(ConfigError, match="vocabulary has 1000 tokens and the model's 49152"):
        LLM(plain.engine.args.model, speculative_config={**DRAFT_MODEL, "model": str(other)})


def test_the_model_drafting_for_itself_has_every_draft_accepted(plain: LLM) -> None:
    """The model's own weights, unrounded, as the draft model: its greedy drafts are the
    model's greedy tokens, so every one is accepted, over the prompt's cache, drafts fed after
    a step that accepted them all, and a prompt served again from the prefix cache. One
    position of the draft's cache missing or stale would show as a rejection."""
    config = {**DRAFT_MODEL, "model": plain.engine.args.model, "quantization": "none"}
    spec = LLM(plain.engine.args.model, speculative_config=config, **SMALL_CACHE)
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    for prompt in [PROMPTS[3], PROMPTS[0], PROMPTS[0]]:
        out = spec.generate([prompt], params, use_tqdm=False)[0]
        assert list(out.outputs[0].token_ids) == _greedy(plain, params, [prompt])[0]
    counts = spec.engine.stats().spec_decode
    assert out.num_cached_tokens > 0
    assert counts.draft_tokens > 3 * 40 // 2
    assert counts.accepted_tokens == counts.draft_tokens, counts


def test_the_int4_drafter_takes_int8_activations_and_keeps_its_acceptance(plain: LLM) -> None:
    """Where the CPU has VNNI, the rounded copy's decode products also round their activations
    (kernels/a8_kernels.c); its drafts must still be the model's tokens nearly always. Codes
    laid out wrong, or scaled wrong, would draft noise: greedy output unchanged, acceptance
    near zero."""
    lib = cpu_kernels.load()
    assert lib is not None, "the CPU kernels must build on the test machines"
    if not quant_ops.a8_supported(lib):
        pytest.skip("this CPU has no AVX-512 VNNI")
    spec = LLM(plain.engine.args.model, speculative_config=DRAFT_MODEL, **SMALL_CACHE)
    drafter = spec.engine.runner.drafter
    assert drafter is not None
    for layer in drafter.forward.model.layers:
        for linear in (layer.qkv, layer.o_proj, layer.gate_up, layer.down):
            assert isinstance(linear, QuantizedLinear)
            assert isinstance(linear.weight, GroupWeight)
            assert linear.weight.a8 is not None
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    assert _greedy(spec, params, PROMPTS[:2]) == _greedy(plain, params, PROMPTS[:2])
    counts = spec.engine.stats().spec_decode
    assert counts.draft_tokens > 16
    assert (counts.acceptance_rate or 0) > 0.7, counts


def test_a_prompt_from_the_prefix_cache_drafts_as_when_computed(
    pair: tuple[PlainOutputs, LLM],
) -> None:
    """Blocks handed out by the prefix cache hold the draft model's keys and values as well as
    the model's (computed in the same steps), so a cached prompt drafts as well as a fresh
    one."""
    spec = pair[1]
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    prompt = f"Summarise: {PASSAGE} {PASSAGE}"
    runs = []
    for _ in range(2):
        before = spec.engine.stats().spec_decode.accepted_tokens
        cached = spec.generate([prompt], params, use_tqdm=False)[0].num_cached_tokens
        runs.append((cached, spec.engine.stats().spec_decode.accepted_tokens - before))
    (cold, accepted_cold), (warm, accepted_warm) = runs
    assert cold == 0, runs
    assert warm > 32, runs
    assert accepted_warm >= 0.8 * accepted_cold > 0, runs


def _chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


def test_verification_leaves_the_sampled_distribution_unchanged() -> None:
    """One row per draft token and a bonus row: whatever the draft proposes, the first token
    out is distributed as the row's own distribution (temperature and top-k applied), and
    the second, after an accepted draft, as its row's."""
    torch.manual_seed(0)
    vocab = 6
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, 0.3], [0.1, 1.5, -0.5, 0.7, 0.0, 1.0]])
    params = Params(temperature=0.8, top_k=5, max_tokens=8)
    sampler = Sampler(torch.device("cpu"))
    seq = Sequence("r", [1, 2, 3], params, 0.0)
    first = torch.zeros(vocab)
    second = torch.zeros(vocab)
    for draft in ([0], [3]):  # a likely draft token and an unlikely one
        first.zero_()
        second.zero_()
        for _ in range(6000):
            tokens = [t.token_id for t in sampler.verify(logits, [seq], [draft])[0]]
            first[tokens[0]] += 1
            if len(tokens) == 2:
                second[tokens[1]] += 1
        want = [sampler.distribution(logits[i : i + 1], [seq])[0] for i in range(2)]
        kept = want[0] > 0
        assert first[~kept].sum() == 0, "a token top-k removed was drawn"
        # 4 degrees of freedom (5 tokens kept): p = 0.001 at 18.47.
        assert _chi_square(first[kept], want[0][kept]) < 18.47, (draft, first)
        kept = want[1] > 0
        assert _chi_square(second[kept], want[1][kept]) < 18.47, (draft, second)


def test_a_draft_never_takes_the_block_another_sequence_needs() -> None:
    """One free block, two decoding sequences that each could use it: A's draft would, and
    then B would have to be preempted. The draft is dropped instead; both decode."""
    from ladle.runtime.input_processor import Request
    from ladle.runtime.kv_cache.manager import KVCacheManager
    from ladle.runtime.model_runner import ModelRunnerOutput
    from ladle.runtime.sampler import TokenLogprobs
    from ladle.runtime.scheduler import Scheduler

    kv = KVCacheManager(num_blocks=5, block_size=4, enable_prefix_caching=False)
    config = SpeculativeConfig("ngram", 4, 1, 4)
    sched = Scheduler(kv, 8, 100, max_model_len=64, speculative=config)
    params = Params(max_tokens=16, temperature=0.0)
    sched.add_request(Request("a", None, [1, 2, 3, 4, 1, 2, 3], params, 0.0))
    sched.add_request(Request("b", None, [5, 6, 7, 9, 10, 11, 12, 13], params, 1.0))
    first = sched.schedule()  # both prefill: two blocks each, one left
    sampled = {i.seq.seq_id: TokenLogprobs(4 if i.seq.request_id == "a" else 14, 0.0)
               for i in first.scheduled}  # fmt: skip
    sched.update_from_output(first, ModelRunnerOutput(sampled=sampled))
    assert kv.num_free_blocks == 1
    # A's next draft (1 2 3 4, from the earlier 1 2 3 4) would need a third block; B needs one.
    a = sched.groups["a"].seqs[0]
    assert propose(a.token_ids, 1, 4, 4) == [1, 2, 3, 4]
    step = sched.schedule()
    assert not step.preempted
    assert {i.seq.request_id: (i.num_new_tokens, i.draft) for i in step.scheduled} == {
        "a": (1, []),
        "b": (1, []),
    }


def test_each_row_is_sampled_as_the_sequence_after_the_draft_tokens_before_it() -> None:
    """Greedy with a repetition penalty: token 2 leads row 1 unless it is already output.
    The draft [2] is accepted by row 0, so row 1 must see it as output (and pick 3), exactly
    as decoding one token at a time would."""
    sampler = Sampler(torch.device("cpu"))
    params = Params(temperature=0.0, repetition_penalty=2.0, max_tokens=8)
    logits = torch.tensor([[0.0, 0.0, 3.0, 1.0], [0.0, 0.0, 1.0, 0.9]])
    seq = Sequence("r", [0, 1], params, 0.0)
    tokens = [t.token_id for t in sampler.verify(logits, [seq], [[2]])[0]]
    one_by_one = [sampler(logits[:1], [seq])[0].token_id]
    seq.append_token(one_by_one[0])
    one_by_one.append(sampler(logits[1:], [seq])[0].token_id)
    assert tokens == one_by_one == [2, 3]

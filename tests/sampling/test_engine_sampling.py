"""The sampling surface through the engine, on a tiny random model with the real tokenizer:
n>1 forks, best_of, seeds, stop strings while streaming, finish reasons, logprobs."""

from __future__ import annotations

from typing import Any

import pytest

from ladle.runtime.engine import LLMEngine
from ladle.runtime.errors import RequestError
from ladle.runtime.llm import LLM
from ladle.runtime.outputs import RequestOutput
from ladle.runtime.sampling_params import RequestOutputKind, SamplingParams

from .conftest import assert_no_blocks_leaked

PROMPT = list(range(1000, 1040))  # 40 tokens: two full 16-token blocks and a partial one


def run(engine: LLMEngine, rid: str, prompt: Any, params: SamplingParams) -> list[RequestOutput]:
    """Every output of one request, stepping the engine to the end."""
    engine.add_request(rid, prompt, params)
    outputs = []
    while engine.has_unfinished_requests():
        outputs += [o for o in engine.step() if o.request_id == rid]
    return outputs


def test_n_samples_start_after_the_first_prefill_and_share_the_prompt_blocks(
    tiny_llm: LLM,
) -> None:
    engine = tiny_llm.engine
    params = SamplingParams(n=4, temperature=1.0, seed=11, max_tokens=6, ignore_eos=True)
    engine.add_request("n4", PROMPT, params)
    engine.step()  # the first sample's prefill: the other three start once it has sampled
    assert engine.kv.num_allocated_blocks() == 3
    assert engine.stats().num_waiting_seqs == 3
    engine.step()
    # The other three found the two full prompt blocks in the prefix cache and computed only
    # the partial one, each into a block of its own (without sharing this would be 4 * 3 = 12).
    assert engine.kv.num_allocated_blocks() == 2 + 4
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    final = outputs[-1]
    assert final.finished
    samples = [tuple(c.token_ids) for c in final.outputs]
    assert [c.index for c in final.outputs] == [0, 1, 2, 3]
    assert len(set(samples)) == 4
    assert all(len(s) == 6 for s in samples)
    assert_no_blocks_leaked(engine)


def test_an_n_request_ended_before_its_samples_start_reports_each_of_them_once(
    tiny_llm: LLM,
) -> None:
    """Its later samples wait for the first to sample: an abort (or a passed deadline) right
    after the first step still ends all of them, in one final output."""
    engine = tiny_llm.engine
    params = SamplingParams(n=3, max_tokens=6, ignore_eos=True)
    engine.add_request("aborted", PROMPT, params)
    (aborted,) = engine.abort_request("aborted")
    assert aborted.finished
    assert [(c.index, c.finish_reason) for c in aborted.outputs] == [(i, "abort") for i in range(3)]
    engine.add_request("expired", PROMPT, params, deadline=0.0)
    (expired,) = engine.step()
    assert expired.finished
    assert [c.finish_reason for c in expired.outputs] == ["abort"] * 3
    assert not engine.has_unfinished_requests()
    assert_no_blocks_leaked(engine)


def test_the_samples_ids_are_taken_while_their_request_runs(tiny_llm: LLM) -> None:
    """The scheduler knows sample i of request r as "i_r" (vLLM's child id): another request
    cannot take it, and a request whose samples' ids are taken is refused."""
    engine = tiny_llm.engine
    engine.add_request("r", PROMPT, SamplingParams(n=2, max_tokens=2))
    with pytest.raises(RequestError, match="'1_r' is already in use"):
        engine.add_request("1_r", PROMPT, SamplingParams(max_tokens=2))
    engine.add_request("0_x", PROMPT, SamplingParams(max_tokens=2))
    with pytest.raises(RequestError, match="'0_x' is already in use"):
        engine.add_request("x", PROMPT, SamplingParams(n=2, max_tokens=2))
    outputs: dict[str, RequestOutput] = {}
    while engine.has_unfinished_requests():
        outputs.update({o.request_id: o for o in engine.step() if o.finished})
    assert sorted(outputs) == ["0_x", "r"]
    assert len(outputs["r"].outputs) == 2
    assert_no_blocks_leaked(engine)


def test_a_sample_that_fails_fails_its_request_and_frees_the_others(
    tiny_llm: LLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = tiny_llm.engine
    execute = engine.runner.execute

    def execute_unless_poisoned(out: Any) -> Any:
        if any(i.seq.request_id == "1_poisoned" for i in out.scheduled):
            raise RuntimeError("kernel fault")
        return execute(out)

    monkeypatch.setattr(engine.runner, "execute", execute_unless_poisoned)
    engine.add_request("poisoned", PROMPT, SamplingParams(n=3, max_tokens=6, ignore_eos=True))
    engine.add_request("healthy", PROMPT, SamplingParams(n=2, max_tokens=6, ignore_eos=True))
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    assert done["poisoned"].error is not None
    assert "kernel fault" in done["poisoned"].error
    assert {c.finish_reason for c in done["poisoned"].outputs} == {"error"}
    assert done["healthy"].error is None
    assert [len(c.token_ids) for c in done["healthy"].outputs] == [6, 6]
    assert_no_blocks_leaked(engine)


def test_seeded_n_samples_are_reproducible_whatever_the_batch(tiny_llm: LLM) -> None:
    seeded = SamplingParams(n=2, temperature=1.0, seed=5, max_tokens=5, ignore_eos=True)
    noise = SamplingParams(n=3, temperature=1.5, max_tokens=7, ignore_eos=True)
    alone = tiny_llm.generate([PROMPT], seeded, use_tqdm=False)[0]
    crowded = tiny_llm.generate(
        [[7, 8, 9], PROMPT, PROMPT[5:]], [noise, seeded, noise], use_tqdm=False
    )[1]
    assert [c.token_ids for c in crowded.outputs] == [c.token_ids for c in alone.outputs]
    assert alone.outputs[0].token_ids != alone.outputs[1].token_ids


def test_best_of_returns_the_n_most_likely_of_its_samples(tiny_llm: LLM) -> None:
    common: dict[str, Any] = {"temperature": 1.0, "seed": 3, "max_tokens": 5, "logprobs": 0}
    all_four = tiny_llm.generate([PROMPT], SamplingParams(n=4, **common), use_tqdm=False)[0]
    best = tiny_llm.generate([PROMPT], SamplingParams(n=2, best_of=4, **common), use_tqdm=False)[0]
    ranked = sorted(all_four.outputs, key=lambda c: c.cumulative_logprob or 0.0, reverse=True)
    assert [c.token_ids for c in best.outputs] == [c.token_ids for c in ranked[:2]]
    assert [c.index for c in best.outputs] == [0, 1]
    for c in best.outputs:
        assert c.logprobs is not None
        total = sum(lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids, strict=True))
        assert c.cumulative_logprob == pytest.approx(total, abs=1e-5)


def _split_stop_string(tokenizer: Any, token_ids: list[int]) -> tuple[str, int]:
    """A stop string made of the end of one token and the start of the next."""
    pieces = [tokenizer.decode([t]) for t in token_ids]
    for k in range(1, len(pieces) - 1):
        a, b = pieces[k], pieces[k + 1]
        if len(a) >= 2 and len(b) >= 2 and a.isprintable() and b.isprintable():
            return a[-2:] + b[:2], k
    raise AssertionError(f"no two printable tokens in {pieces}")


def test_stop_string_split_across_tokens_never_streams(tiny_llm: LLM) -> None:
    engine = tiny_llm.engine
    tokenizer = tiny_llm.get_tokenizer()
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    free = run(engine, "free", PROMPT, greedy)[-1].outputs[0]
    stop, _ = _split_stop_string(tokenizer, free.token_ids)
    cut = free.text.find(stop)
    params = greedy.clone(stop=[stop], output_kind=RequestOutputKind.DELTA)
    streamed = ""
    seen: list[str] = []
    outputs = run(engine, "stream", PROMPT, params)
    for out in outputs:
        for c in out.outputs:
            streamed += c.text
        seen.append(streamed)
        assert len(streamed) <= cut  # no part of the stop string is ever shown
    final = outputs[-1].outputs[0]
    assert streamed == free.text[:cut]
    assert (final.finish_reason, final.stop_reason) == ("stop", stop)
    included = run(
        engine, "incl", PROMPT, greedy.clone(stop=[stop], include_stop_str_in_output=True)
    )
    assert included[-1].outputs[0].text == free.text[: cut + len(stop)]
    assert_no_blocks_leaked(engine)


def test_finish_reasons_say_what_stopped(tiny_llm: LLM) -> None:
    engine = tiny_llm.engine
    tokenizer = tiny_llm.get_tokenizer()
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    free = run(engine, "free", PROMPT, greedy)[-1].outputs[0]
    assert free.finish_reason == "length"
    assert free.stop_reason is None
    third = free.token_ids[2]
    stopped = run(engine, "tok", PROMPT, greedy.clone(stop_token_ids=[third]))[-1].outputs[0]
    assert (stopped.finish_reason, stopped.stop_reason) == ("stop", third)
    assert stopped.token_ids == free.token_ids[:3]
    assert stopped.text == tokenizer.decode(free.token_ids[:2])  # stop token text excluded
    kept = run(
        engine,
        "keep",
        PROMPT,
        greedy.clone(stop_token_ids=[third], include_stop_str_in_output=True),
    )[-1].outputs[0]
    assert kept.text == tokenizer.decode(free.token_ids[:3])
    engine.add_request("abort", PROMPT, greedy)
    engine.step()
    (aborted,) = engine.abort_request("abort")
    assert aborted.finished
    assert aborted.outputs[0].finish_reason == "abort"
    assert_no_blocks_leaked(engine)


def test_min_tokens_defers_stop_tokens(tiny_llm: LLM) -> None:
    engine = tiny_llm.engine
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    first = run(engine, "free", PROMPT, greedy)[-1].outputs[0].token_ids[0]
    out = run(engine, "min", PROMPT, greedy.clone(stop_token_ids=[first], min_tokens=3))
    tokens = out[-1].outputs[0].token_ids
    assert first not in tokens[:3]
    assert len(tokens) >= 3


def test_logprobs_and_prompt_logprobs_map_onto_openai(tiny_llm: LLM) -> None:
    engine = tiny_llm.engine
    tokenizer = tiny_llm.get_tokenizer()
    params = SamplingParams(
        temperature=0,
        max_tokens=4,
        ignore_eos=True,
        logprobs=3,
        prompt_logprobs=2,
        output_kind=RequestOutputKind.DELTA,
    )
    outputs = run(engine, "lp", PROMPT[:20], params)
    # Prompt logprobs come once, with the first output; position 0 has none.
    with_prompt = [o for o in outputs if o.prompt_logprobs is not None]
    assert len(with_prompt) == 1
    prompt_lps = with_prompt[0].prompt_logprobs
    assert prompt_lps is not None
    assert len(prompt_lps) == 20
    assert prompt_lps[0] is None
    for token, position in zip(PROMPT[1:20], prompt_lps[1:], strict=True):
        assert position is not None
        assert token in position
        assert len(position) <= 3
    token_ids = [t for o in outputs for c in o.outputs for t in c.token_ids]
    logprobs = [lp for o in outputs for c in o.outputs for lp in c.logprobs or []]
    assert len(logprobs) == len(token_ids) == 4
    for token, position in zip(token_ids, logprobs, strict=True):
        chosen = position[token]
        assert next(iter(position)) == token  # the sampled token comes first
        assert chosen.rank == 1  # greedy, no penalties
        assert chosen.decoded_token == tokenizer.decode([token])
        top = sorted(position.values(), key=lambda lp: lp.rank or 0)
        assert [lp.rank for lp in top] == [1, 2, 3]
        assert [lp.logprob for lp in top] == sorted((lp.logprob for lp in top), reverse=True)
    final = outputs[-1].outputs[0]
    total = sum(p[t].logprob for p, t in zip(logprobs, token_ids, strict=True))
    assert final.cumulative_logprob == pytest.approx(total, abs=1e-5)


def test_prompt_logprobs_survive_chunked_prefill(
    tiny_llm: LLM, tiny_chunked_engine: LLMEngine
) -> None:
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=2)
    whole = tiny_llm.generate([PROMPT[:20]], params, use_tqdm=False)[0].prompt_logprobs
    chunked = run(tiny_chunked_engine, "chunked", PROMPT[:20], params)[-1].prompt_logprobs
    assert whole is not None
    assert chunked is not None
    assert len(whole) == len(chunked) == 20
    for a, b in zip(whole[1:], chunked[1:], strict=True):
        assert a is not None
        assert b is not None
        assert list(a) == list(b)
        assert [lp.logprob for lp in a.values()] == pytest.approx(
            [lp.logprob for lp in b.values()], abs=1e-5
        )
    assert_no_blocks_leaked(tiny_chunked_engine)


def test_logprobs_above_the_engine_limit_are_refused(tiny_llm: LLM) -> None:
    from ladle.runtime.errors import RequestError

    with pytest.raises(RequestError, match="logprobs: must be <= 20") as info:
        tiny_llm.generate([PROMPT], SamplingParams(logprobs=21), use_tqdm=False)
    assert info.value.param == "logprobs"

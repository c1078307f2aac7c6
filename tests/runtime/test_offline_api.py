"""The vLLM-shaped offline API and the engine's request lifecycle, on a tiny model."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from pathlib import Path

import pytest

from ladle.runtime import LLM, AsyncLLM, EngineArgs, SamplingParams
from ladle.runtime.config import ConfigError
from ladle.runtime.engine import LLMEngine
from ladle.runtime.errors import RequestError
from ladle.runtime.sampling_params import RequestOutputKind, SamplingParamsError

from .conftest import assert_no_blocks_leaked


@pytest.fixture(scope="module")
def tiny_llm(tiny_model_factory: Callable[[str], Path]) -> LLM:
    return LLM(str(tiny_model_factory("llama")), kv_cache_memory="64MiB", max_model_len=256)


def test_generate_returns_outputs_in_prompt_order(tiny_llm: LLM) -> None:
    prompts = ["Hello there", "A much longer prompt that takes more tokens to encode", "Hi"]
    outs = tiny_llm.generate(prompts, SamplingParams(temperature=0, max_tokens=5), use_tqdm=False)
    assert [o.prompt for o in outs] == prompts
    for out in outs:
        assert out.finished
        completion = out.outputs[0]
        assert len(completion.token_ids) <= 5
        assert completion.finish_reason in ("stop", "length")
        assert completion.text == tiny_llm.get_tokenizer().decode(
            completion.token_ids, skip_special_tokens=True
        )
    assert_no_blocks_leaked(tiny_llm.engine)


def test_token_id_prompts_and_max_tokens(tiny_llm: LLM) -> None:
    params = SamplingParams(temperature=0, max_tokens=7, ignore_eos=True)
    by_ids = tiny_llm.generate([5, 6, 7, 8], params, use_tqdm=False)
    by_dict = tiny_llm.generate({"prompt_token_ids": [5, 6, 7, 8]}, params, use_tqdm=False)
    assert by_ids[0].prompt_token_ids == [5, 6, 7, 8]
    assert by_ids[0].outputs[0].token_ids == by_dict[0].outputs[0].token_ids
    assert len(by_ids[0].outputs[0].token_ids) == 7
    assert by_ids[0].outputs[0].finish_reason == "length"


def test_stop_token_ids_end_generation(tiny_llm: LLM) -> None:
    free = tiny_llm.generate(
        [5, 6, 7], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False
    )
    third = free[0].outputs[0].token_ids[2]
    stopped = tiny_llm.generate(
        [5, 6, 7],
        SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, stop_token_ids=[third]),
        use_tqdm=False,
    )[0].outputs[0]
    assert stopped.token_ids == free[0].outputs[0].token_ids[:3]
    assert (stopped.finish_reason, stopped.stop_reason) == ("stop", third)


def test_chat_applies_the_chat_template(tiny_llm: LLM) -> None:
    messages = [{"role": "user", "content": "Say hi"}]
    out = tiny_llm.chat(messages, SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)[0]
    expected = tiny_llm.get_tokenizer().apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert out.prompt_token_ids == list(expected)


def test_seeded_sampling_is_reproducible_whatever_the_batch(tiny_llm: LLM) -> None:
    seeded = SamplingParams(
        temperature=1.0, top_p=0.9, top_k=50, seed=42, max_tokens=12, ignore_eos=True
    )
    alone = tiny_llm.generate(["Once upon a time"], seeded, use_tqdm=False)[0].outputs[0].token_ids
    noisy = SamplingParams(temperature=1.3, max_tokens=12, ignore_eos=True)
    batch = tiny_llm.generate(
        ["Other prompt", "Once upon a time", "Yet another, longer, prompt here"],
        [noisy, seeded, noisy],
        use_tqdm=False,
    )
    assert batch[1].outputs[0].token_ids == alone
    other_seed = SamplingParams(
        temperature=1.0, top_p=0.9, top_k=50, seed=43, max_tokens=12, ignore_eos=True
    )
    assert (
        tiny_llm.generate(["Once upon a time"], other_seed, use_tqdm=False)[0].outputs[0].token_ids
        != alone
    )


def test_top_k_one_equals_greedy(tiny_llm: LLM) -> None:
    greedy = tiny_llm.generate(
        ["The sky"], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False
    )
    top1 = tiny_llm.generate(
        ["The sky"],
        SamplingParams(temperature=2.0, top_k=1, max_tokens=8, ignore_eos=True),
        use_tqdm=False,
    )
    assert top1[0].outputs[0].token_ids == greedy[0].outputs[0].token_ids


def test_abort_frees_blocks_at_once(tiny_llm: LLM) -> None:
    engine = tiny_llm.engine
    engine.add_request("long", "Tell me a story", SamplingParams(max_tokens=200, ignore_eos=True))
    engine.add_request("other", "Another one", SamplingParams(max_tokens=200, ignore_eos=True))
    engine.step()
    engine.step()
    assert engine.kv.num_allocated_blocks() > 0
    outs = engine.abort_request(["long", "other"])
    assert [o.outputs[0].finish_reason for o in outs] == ["abort", "abort"]
    assert all(o.finished for o in outs)
    assert_no_blocks_leaked(engine)


def test_async_engine_streams_deltas_and_aborts_on_close(tiny_llm: LLM) -> None:
    engine = tiny_llm.engine

    async def scenario() -> tuple[str, list[int]]:
        llm = AsyncLLM(engine)
        try:
            text, tokens = "", []
            params = SamplingParams(
                temperature=0, max_tokens=6, ignore_eos=True, output_kind=RequestOutputKind.DELTA
            )
            async for out in llm.generate("Streaming test", params, "s1"):
                text += out.outputs[0].text
                tokens += out.outputs[0].token_ids
            stream = llm.generate(
                "Abandoned", SamplingParams(max_tokens=500, ignore_eos=True), "s2"
            )
            await stream.__anext__()
            await stream.aclose()  # what a client disconnect does
            for _ in range(100):
                if not engine.has_unfinished_requests():
                    break
                await asyncio.sleep(0.05)
            return text, tokens
        finally:
            llm.shutdown()

    text, tokens = asyncio.run(scenario())
    assert len(tokens) == 6
    assert text == engine.tokenizer.decode(tokens, skip_special_tokens=True)
    assert_no_blocks_leaked(engine)


def test_prompt_longer_than_max_model_len_is_refused(tiny_llm: LLM) -> None:
    with pytest.raises(RequestError, match="maximum context length is 256"):
        tiny_llm.generate([[1] * 300], use_tqdm=False)
    assert_no_blocks_leaked(tiny_llm.engine)


def test_bad_sampling_params_name_the_parameter() -> None:
    with pytest.raises(SamplingParamsError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(SamplingParamsError, match="top_p"):
        SamplingParams(top_p=0)
    with pytest.raises(SamplingParamsError, match="max_tokens"):
        SamplingParams(max_tokens=0)


def test_clear_errors_for_bad_models_and_dtypes(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        LLMEngine(EngineArgs(model=str(tmp_path / "missing")))
    with pytest.raises(ConfigError, match=r"no config\.json"):
        LLMEngine(EngineArgs(model=str(tmp_path)))
    (tmp_path / "config.json").write_text(
        json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"})
    )
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ConfigError, match="unsupported architecture"):
        LLMEngine(EngineArgs(model=str(tmp_path)))
    with pytest.raises(ConfigError, match="dtype must be one of"):
        EngineArgs(dtype="float8")

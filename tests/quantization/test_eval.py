"""``ladle eval``: its metrics, its prompt files, the offline mode and the CLI."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
import torch

from ladle.cli import main as ladle
from ladle.runtime import LLM
from ladle.runtime.eval.metrics import GATES, Accumulator, EvalResult, top1, topk_kld
from ladle.runtime.eval.offline import evaluate_offline
from ladle.runtime.eval.online import Endpoint, _Client
from ladle.runtime.eval.prompts import PromptFileError, load_prompts


def full_kld(p: torch.Tensor, q: torch.Tensor) -> float:
    return float((p * (p.log() - q.log())).sum())


def test_topk_kld_is_exact_over_the_vocabulary_and_a_lower_bound_below_it() -> None:
    torch.manual_seed(0)
    for _ in range(20):
        logits = torch.randn(2, 50, dtype=torch.float64) * 3
        p, q = logits.softmax(-1)
        exact = full_kld(p, q)
        lp, lq = p.log().tolist(), q.log().tolist()
        everything = topk_kld(dict(enumerate(lp)), dict(enumerate(lq)))
        assert everything == pytest.approx(exact, rel=1e-9, abs=1e-12)
        for k in (1, 5, 20):
            top_p = dict(sorted(enumerate(lp), key=lambda t: -t[1])[:k])
            top_q = dict(sorted(enumerate(lq), key=lambda t: -t[1])[:k])
            assert 0.0 <= topk_kld(top_p, top_q) <= exact + 1e-12
    same = {1: math.log(0.5), 2: math.log(0.3)}
    assert topk_kld(same, same) == 0.0
    assert top1(same) == 1


def test_accumulator_and_gates() -> None:
    acc = Accumulator()
    for kld, same in ((0.001, True), (0.003, True), (0.002, False), (0.0, True)):
        acc.add_position(kld, same, math.log(10), math.log(11))
    acc.add_prompt(True)
    acc.add_prompt(False)
    result = acc.result("offline", "vocabulary", 8)
    assert result.kld_mean == pytest.approx(0.0015)
    assert result.kld_p99 == 0.003
    assert result.top1_agreement == 0.75
    assert result.ppl_reference == pytest.approx(10.0)
    assert result.ppl_delta == pytest.approx(0.1)
    assert result.greedy_agreement == 0.5
    assert EvalResult(**result.to_dict()) == result
    assert GATES["int8"].failures(result) == ["top-1 agreement 75.00% < 97%"]
    assert GATES["int4"].failures(result) == [
        "top-1 agreement 75.00% < 90%",
        "perplexity change +10.00% > +5%",
    ]
    with pytest.raises(ValueError, match="nothing was scored"):
        Accumulator().result("offline", "vocabulary", 8)


def test_a_candidate_that_answers_noise_fails_the_gate_instead_of_overflowing() -> None:
    """Thousands of nats a token (a LoRA adapter scaled far too high reads text that way):
    perplexity is infinite, the gate fails on it, and an adapter's gate says so."""
    acc = Accumulator()
    for _ in range(3):
        acc.add_position(5.0, False, 2.0, 4000.0)
    acc.add_prompt(False)
    result = acc.result("online", "top-20", 8)
    assert result.ppl_candidate == math.inf
    assert result.ppl_delta == math.inf
    assert GATES["adapter"].failures(result) == ["perplexity change +inf% > +10%"]
    close = Accumulator()
    close.add_position(0.0, True, 800.0, 800.5)  # both beyond exp's range; the ratio is not
    close.add_prompt(True)
    assert close.result("online", "top-20", 8).ppl_delta == pytest.approx(math.exp(0.5) - 1)


def test_default_prompts_cover_languages_and_code() -> None:
    prompts = load_prompts()
    kinds = {p.kind for p in prompts}
    assert {"english", "code", "french", "german", "chinese", "japanese", "russian"} <= kinds
    assert len({p.id for p in prompts}) == len(prompts) >= 30
    from pydoc_data.topics import topics

    calibration = "\n".join(topics.values())
    assert not any(p.text[:60] in calibration for p in prompts)


def test_prompt_files(tmp_path: Path) -> None:
    (tmp_path / "a.json").write_text(json.dumps(["one", {"prompt": "two", "id": "x"}]))
    (tmp_path / "b.jsonl").write_text('{"prompt": "one"}\n\n"two"\n')
    (tmp_path / "c.txt").write_text("first line\n\nsecond line\n")
    for name in ("a.json", "b.jsonl", "c.txt"):
        texts = [p.text for p in load_prompts(tmp_path / name)]
        assert len(texts) == 2
    assert load_prompts(tmp_path / "a.json")[1].id == "x"
    bad = {
        "d.json": ('{"prompt": "x"}', "holds a list"),
        "e.jsonl": ('{"text": "x"}', 'an object with a "prompt" string'),
        "f.jsonl": ("{", "invalid JSON"),
        "g.txt": ("\n\n", "no prompts"),
        "h.json": ('[""]', "the prompt is empty"),
    }
    for name, (content, message) in bad.items():
        (tmp_path / name).write_text(content)
        with pytest.raises(PromptFileError, match=message):
            load_prompts(tmp_path / name)
    with pytest.raises(PromptFileError, match="cannot read"):
        load_prompts(tmp_path / "missing.json")


def test_echo_protocol_for_servers_without_prompt_logprobs() -> None:
    """The legacy OpenAI shape (``echo`` + ``logprobs``): token texts as keys, the prompt's
    own tokens first, then the generated one, which is dropped; the greedy continuation is a
    request of its own (echo's text is the prompt's too)."""
    tokens = ["The", " cat", " sat", " down"]
    body = {
        "choices": [
            {
                "text": "The cat sat down",
                "logprobs": {
                    "tokens": tokens,
                    "token_logprobs": [None, -2.0, -1.5, -0.1],
                    "top_logprobs": [
                        None,
                        {" dog": -1.0, " cat": -2.0},
                        {" sat": -1.5},
                        {" down": -0.1},
                    ],
                },
            }
        ],
        "usage": {"prompt_tokens": 3, "completion_tokens": 1},
    }
    seen: list[dict[str, object]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        sent = json.loads(request.content)
        seen.append(sent)
        if "prompt_logprobs" in sent:
            return httpx.Response(400, json={"error": {"message": "unknown field"}})
        return httpx.Response(200, json=body)

    with httpx.Client(transport=httpx.MockTransport(handler)) as http:
        client = _Client(Endpoint("http://server/v1", model="m"), http, "auto")
        answer = client.answer("The cat sat", 2, 1)
    assert client.protocol == "echo"  # prompt_logprobs was refused, echo answered
    refused, echoed, greedy = seen
    assert refused["prompt_logprobs"] == 2
    assert (echoed["echo"], echoed["logprobs"], echoed["model"]) == (True, 2, "m")
    assert "echo" not in greedy
    assert (greedy["max_tokens"], greedy["temperature"]) == (1, 0.0)
    assert answer.scored.actual == [" cat", " sat"]
    assert answer.scored.logprobs == [{" dog": -1.0, " cat": -2.0}, {" sat": -1.5}]
    assert answer.greedy == "The cat sat down"


def test_online_mode_imports_without_torch() -> None:
    code = (
        "import sys; import ladle.runtime.eval.online, ladle.runtime.eval.command; "
        "assert 'torch' not in sys.modules, 'torch was imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


@pytest.fixture(scope="module")
def tiny_path(tiny_model: Callable[[str], Path]) -> Path:
    return tiny_model("llama")


@pytest.mark.slow
def test_offline_against_itself_and_int8(tiny_path: Path) -> None:
    prompts = load_prompts()[:3]
    engine = {"num_gpu_blocks_override": 64, "max_model_len": 256}
    reference = LLM(str(tiny_path), **engine)
    itself = evaluate_offline(reference, LLM(str(tiny_path), **engine), prompts, greedy_tokens=4)
    assert itself.kld_mean == 0.0
    assert itself.top1_agreement == 1.0
    assert itself.greedy_agreement == 1.0
    assert itself.ppl_delta == 0.0
    candidate = LLM(str(tiny_path), quantization="int8", kv_cache_dtype="int8", **engine)
    result = evaluate_offline(reference, candidate, prompts, greedy_tokens=4)
    assert result.num_tokens == itself.num_tokens > 100
    assert 0.0 < result.kld_mean < 0.05
    assert 0.75 < result.top1_agreement < 1.0  # random weights: flat distributions
    assert result.ppl_reference == itself.ppl_reference


@pytest.mark.slow
def test_cli_offline(tiny_path: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "r.json"
    argv = ["eval", "--model", str(tiny_path), "--max-prompts", "2", "--greedy-tokens", "4"]
    argv += ["--num-gpu-blocks-override", "64", "--max-model-len", "256", "--json", str(out)]
    assert ladle([*argv, "--quantization", "int8"]) == 0
    result = json.loads(out.read_text())
    assert result["mode"] == "offline"
    assert result["num_prompts"] == 2
    assert "top-1 agreement" in capsys.readouterr().out
    (tmp_path / "bad.json").write_text("{")
    assert ladle([*argv, "--prompts", str(tmp_path / "bad.json")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert err.startswith(f"ladle eval: {tmp_path / 'bad.json'}: invalid JSON")

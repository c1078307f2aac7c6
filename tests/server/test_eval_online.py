"""``ladle eval``'s online mode against real ``ladle serve`` processes: the library function
the canary analysis calls, and the CLI on top of it."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from ladle.runtime.eval.online import Endpoint, EvalError, evaluate_online
from ladle.runtime.eval.prompts import Prompt, load_prompts

from .conftest import Server, start_server

PROMPTS = [p for p in load_prompts() if p.kind in ("english", "code", "german")][:3]


@pytest.fixture(scope="module")
def quantized(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    srv = start_server(
        tmp_path_factory.mktemp("quantized"),
        "--served-model-name",
        "smollm2-int8",
        "--quantization",
        "int8",
        "--kv-cache-dtype",
        "int8",
    )
    yield srv
    assert srv.stop() == 0, "\n".join(srv.log_lines()[-30:])


@pytest.mark.slow
def test_a_server_against_itself_and_against_its_int8_variant(
    server: Server, quantized: Server
) -> None:
    reference = Endpoint(f"{server.url}/v1")
    same = evaluate_online(reference, reference, PROMPTS[:2], top_k=5, greedy_tokens=8)
    assert same.mode == "online"
    assert same.kld_over == "top-5"
    assert same.num_prompts == 2
    assert same.kld_mean == 0.0
    assert same.top1_agreement == 1.0
    assert same.ppl_delta == 0.0
    assert same.greedy_agreement == 1.0

    candidate = Endpoint(f"{quantized.url}/v1", model="smollm2-int8")
    result = evaluate_online(reference, candidate, PROMPTS, top_k=5, greedy_tokens=8)
    assert result.num_prompts == len(PROMPTS)
    assert 0.0 < result.kld_mean < 0.05
    assert 0.85 <= result.top1_agreement < 1.0
    assert abs(result.ppl_delta) < 0.05


def test_unreachable_or_mismatched_servers_raise_clear_errors(server: Server) -> None:
    reference = Endpoint(f"{server.url}/v1")
    with pytest.raises(EvalError, match=r"127\.0\.0\.1:9/v1/completions"):
        evaluate_online(reference, Endpoint("http://127.0.0.1:9/v1"), PROMPTS[:1])
    with pytest.raises(EvalError, match="HTTP 4"):
        evaluate_online(reference, Endpoint(f"{server.url}/v1", model="no-such-model"), PROMPTS[:1])
    prompt = [Prompt("p", "The quick brown fox jumps over the lazy dog.")]
    with pytest.raises(ValueError, match="top_k"):
        evaluate_online(reference, reference, prompt, top_k=0)


@pytest.mark.slow
def test_cli_online_writes_json_and_applies_the_gate(
    server: Server, quantized: Server, tmp_path: Path
) -> None:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": p.text}) for p in PROMPTS[:2]) + "\n")
    out = tmp_path / "result.json"
    argv = [
        sys.executable, "-m", "ladle.cli", "eval",
        "--reference-url", f"{server.url}/v1",
        "--candidate-url", f"{quantized.url}/v1",
        "--candidate-model", "smollm2-int8",
        "--prompts", str(prompts), "--greedy-tokens", "4", "--top-k", "5",
        "--json", str(out), "--gate", "int8",
    ]  # fmt: skip
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=600, check=False)
    result = json.loads(out.read_text())
    assert result["num_prompts"] == 2
    assert "KLD mean" in proc.stdout
    assert "gate int8" in proc.stdout
    # The verdict and the exit status agree.
    assert proc.returncode == (0 if "gate int8 passes" in proc.stdout else 1), proc.stderr
    bad = subprocess.run(
        [*argv[:4], "--reference-url", f"{server.url}/v1"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert bad.returncode != 0
    assert bad.stderr.strip().splitlines()[-1].startswith("ladle eval: give both")

"""LoRA adapters through a real ``ladle serve`` and the ``openai`` client: vLLM's flags and
endpoints, ``model: <adapter>``, ``/v1/models`` with parents, adapters added and removed
while the server runs, clear errors for adapters it cannot serve, and the metrics."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import yaml
from lora_adapters import random_adapter

from ladle.runtime import LLM, LoRARequest, SamplingParams

from .conftest import BASE_FLAGS, Server, start_gateway, start_server

PROMPT = [1, 50, 60, 70, 80, 90, 100]


@pytest.fixture(scope="module")
def adapters(tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("server-adapters")
    return {
        "alpha": random_adapter(tiny_model_path, root / "alpha", seed=1),
        "beta": random_adapter(
            tiny_model_path, root / "beta", seed=2, rank=4, targets=("q_proj", "v_proj")
        ),
        "gamma": random_adapter(tiny_model_path, root / "gamma", seed=3),
        "wide": random_adapter(tiny_model_path, root / "wide", seed=4, rank=32),
    }


@pytest.fixture(scope="module")
def lora_server(
    tiny_model_path: Path, adapters: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Server]:
    srv = start_server(
        tmp_path_factory.mktemp("lora-serve"),
        "--model", str(tiny_model_path),
        "--served-model-name", "tiny",
        "--enable-lora", "--max-loras", "2",
        "--lora-modules", f"alpha={adapters['alpha']}",
        f'{{"name": "beta", "path": "{adapters["beta"]}"}}',
    )  # fmt: skip
    yield srv
    assert srv.stop() == 0, "\n".join(srv.log_lines()[-30:])


@pytest.fixture(scope="module")
def expected(tiny_model_path: Path, adapters: dict[str, Path]) -> dict[str, str]:
    """Each model's greedy text from the offline engine, which tests/runtime/test_lora.py holds
    to PEFT's."""
    llm = LLM(str(tiny_model_path), enable_lora=True, max_loras=4, kv_cache_memory="64MiB")
    names = ["tiny", "alpha", "beta", "gamma"]
    requests = [None] + [LoRARequest(n, i + 1, str(adapters[n])) for i, n in enumerate(names[1:])]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": PROMPT}] * 4, params, False, lora_request=requests)
    return {name: out.outputs[0].text for name, out in zip(names, outs, strict=True)}


def complete(client: openai.OpenAI, model: str) -> str:
    out = client.completions.create(
        model=model, prompt=PROMPT, max_tokens=12, temperature=0, extra_body={"ignore_eos": True}
    )
    assert out.model == model
    return out.choices[0].text


def test_each_adapter_answers_under_its_name(lora_server: Server, expected: dict[str, str]) -> None:
    client = openai.OpenAI(base_url=f"{lora_server.url}/v1", api_key="none")
    models = {m.id: m for m in client.models.list().data}
    assert set(models) == {"tiny", "alpha", "beta"}
    assert models["alpha"].model_extra["parent"] == "tiny"
    assert models["tiny"].model_extra["parent"] is None
    for name in ("tiny", "alpha", "beta"):
        assert complete(client, name) == expected[name], name
    assert len({expected[n] for n in ("tiny", "alpha", "beta")}) == 3
    chat = client.chat.completions.create(
        model="beta", messages=[{"role": "user", "content": "Hi"}], max_tokens=4
    )
    assert chat.model == "beta"
    assert chat.choices[0].message.content


async def test_concurrent_requests_for_several_adapters_batch_together(
    lora_server: Server, expected: dict[str, str]
) -> None:
    """Base and both adapters at once, several each: every answer is its model's own."""
    client = openai.AsyncOpenAI(base_url=f"{lora_server.url}/v1", api_key="none")
    names = ["tiny", "alpha", "beta"] * 4

    async def one(model: str) -> str:
        out = await client.completions.create(
            model=model,
            prompt=PROMPT,
            max_tokens=12,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        return out.choices[0].text

    texts = await asyncio.gather(*(one(n) for n in names))
    assert texts == [expected[n] for n in names]
    page = httpx.get(f"{lora_server.url}/metrics").text
    assert 'ladle:lora_requests_total{lora_name="alpha",model_name="tiny"}' in page
    for name in ("ladle:lora_requests_info", "vllm:lora_requests_info"):
        info = [line for line in page.splitlines() if line.startswith(name + "{")]
        assert len(info) == 1
        assert 'max_lora="2"' in info[0]
        # GAIE's meaning: the adapters in the two slots, with no request in flight now.
        assert 'running_lora_adapters="alpha,beta"' in info[0]


def test_adapters_are_added_and_removed_without_a_restart(
    lora_server: Server, adapters: dict[str, Path], expected: dict[str, str]
) -> None:
    client = openai.OpenAI(base_url=f"{lora_server.url}/v1", api_key="none")
    pid = lora_server.proc.pid
    loaded = httpx.post(
        f"{lora_server.url}/v1/load_lora_adapter",
        json={"lora_name": "gamma", "lora_path": str(adapters["gamma"])},
    )
    assert loaded.status_code == 200, loaded.text
    assert complete(client, "gamma") == expected["gamma"]
    gone = httpx.post(f"{lora_server.url}/v1/unload_lora_adapter", json={"lora_name": "gamma"})
    assert gone.status_code == 200, gone.text
    with pytest.raises(openai.NotFoundError) as err:
        complete(client, "gamma")
    assert err.value.code == "model_not_found"
    assert "gamma" not in {m.id for m in client.models.list().data}
    again = httpx.post(f"{lora_server.url}/v1/unload_lora_adapter", json={"lora_name": "gamma"})
    assert again.status_code == 404
    assert lora_server.proc.pid == pid
    assert lora_server.proc.poll() is None


@pytest.mark.parametrize(
    ("name", "path", "message"),
    [
        ("big", "wide", "rank 32 exceeds --max-lora-rank 16"),
        ("nowhere", None, "no such folder"),
        ("tiny", "gamma", "is the base model's name"),
        ("alpha", "gamma", "already loaded"),
    ],
)
def test_an_adapter_it_cannot_serve_is_a_clear_400(
    lora_server: Server,
    adapters: dict[str, Path],
    expected: dict[str, str],
    name: str,
    path: str | None,
    message: str,
    tmp_path: Path,
) -> None:
    folder = str(adapters[path]) if path else str(tmp_path / "missing")
    answer = httpx.post(
        f"{lora_server.url}/v1/load_lora_adapter", json={"lora_name": name, "lora_path": folder}
    )
    assert answer.status_code == 400
    assert message in answer.json()["error"]["message"]
    client = openai.OpenAI(base_url=f"{lora_server.url}/v1", api_key="none")
    assert complete(client, "tiny") == expected["tiny"]
    assert complete(client, "alpha") == expected["alpha"]


def test_an_unknown_model_is_a_404(lora_server: Server) -> None:
    client = openai.OpenAI(base_url=f"{lora_server.url}/v1", api_key="none")
    with pytest.raises(openai.NotFoundError) as err:
        complete(client, "delta")
    assert err.value.code == "model_not_found"
    assert "'alpha'" in str(err.value)


@pytest.mark.parametrize(
    ("flags", "message", "code"),
    [
        # Settings no restart can change: EX_CONFIG.
        (["--lora-modules", "x=/nowhere"], "--lora-modules needs --enable-lora", os.EX_CONFIG),
        # The adapter's folder may yet appear on its volume.
        (["--enable-lora", "--lora-modules", "x=/nowhere"], "LoRA adapter 'x' at /nowhere", 2),
        (["--enable-lora", "--lora-modules", "x"], "expected NAME=PATH", 2),
    ],
)
def test_a_bad_adapter_flag_stops_startup_with_one_line(
    tiny_model_path: Path, flags: list[str], message: str, code: int
) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "ladle.cli", "serve", "--model", str(tiny_model_path),
         "--port", "0", *BASE_FLAGS, *flags],
        check=False, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == code
    assert message in done.stderr
    assert "Traceback" not in done.stderr


def write_modules(path: Path, modules: dict[str, Path]) -> None:
    """Replace the file at once, as the kubelet swaps a ConfigMap's files."""
    staged = path.with_suffix(".new")
    staged.write_text(json.dumps([{"name": n, "path": str(p)} for n, p in modules.items()]))
    os.replace(staged, path)


def wait_models(server: Server, expected: set[str], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        page = httpx.get(f"{server.url}/v1/models").json()
        models = {m["id"] for m in page["data"]}
        if models == expected:
            return
        assert time.monotonic() < deadline, f"served {models}, expected {expected}"
        time.sleep(0.2)


def adapter_states(server: Server) -> dict[str, str]:
    return {
        labels[0][1]: labels[1][1]
        for (name, labels), value in server.metrics().items()
        if name == "ladle:lora_adapters" and value == 1
    }


def test_the_modules_file_is_followed_without_a_restart(
    tiny_model_path: Path,
    adapters: dict[str, Path],
    expected: dict[str, str],
    tmp_path: Path,
) -> None:
    """What the operator's ConfigMap does to a pod: adapters added, removed, moved to another
    folder, one that cannot be served reported while the rest serve, and a broken file
    leaving the adapters as they were."""
    modules = tmp_path / "adapters.yaml"
    write_modules(modules, {"alpha": adapters["alpha"]})
    srv = start_server(
        tmp_path, "--model", str(tiny_model_path), "--served-model-name", "tiny",
        "--enable-lora", "--max-loras", "2", "--lora-modules-file", str(modules),
    )  # fmt: skip
    try:
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="none")
        wait_models(srv, {"tiny", "alpha"})  # loaded before the server turned ready
        assert complete(client, "alpha") == expected["alpha"]
        write_modules(modules, {"gamma": adapters["gamma"], "wide": adapters["wide"]})
        wait_models(srv, {"tiny", "gamma"})
        assert complete(client, "gamma") == expected["gamma"]
        with pytest.raises(openai.NotFoundError):
            complete(client, "alpha")
        assert adapter_states(srv) == {"gamma": "loaded", "wide": "failed"}
        assert any("exceeds --max-lora-rank" in line for line in srv.log_lines())
        report = httpx.get(f"{srv.url}/v1/lora_adapters").json()
        assert report["loaded"] == [{"name": "gamma", "path": str(adapters["gamma"])}]
        (wide,) = report["failed"]
        assert (wide["name"], wide["path"]) == ("wide", str(adapters["wide"]))
        assert "exceeds --max-lora-rank" in wide["error"]
        # The same name, another folder: loaded again from there.
        write_modules(modules, {"gamma": adapters["beta"]})
        deadline = time.monotonic() + 30
        while complete(client, "gamma") != expected["beta"]:
            assert time.monotonic() < deadline, "gamma was not loaded again from beta's folder"
            time.sleep(0.2)
        assert adapter_states(srv) == {"gamma": "loaded"}
        modules.write_text("name: not a list")
        time.sleep(3)  # more than one poll
        assert complete(client, "gamma") == expected["beta"]
        assert any("modules file is not valid" in line for line in srv.log_lines())
        assert srv.proc.poll() is None
    finally:
        assert srv.stop() == 0


def test_the_gateway_routes_an_adapter_to_the_service_that_serves_it(
    lora_server: Server, expected: dict[str, str], tmp_path: Path
) -> None:
    routes = yaml.safe_dump(
        {
            "services": [
                {
                    "name": "tiny",
                    "model": "tiny",
                    "endpoints": [lora_server.url],
                    "adapters": ["alpha", "beta"],
                }
            ]
        }
    )
    gateway = start_gateway(tmp_path, routes)
    try:
        client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="none")
        cards = {m.id: m.model_extra["parent"] for m in client.models.list().data}
        assert cards == {"tiny": None, "alpha": "tiny", "beta": "tiny"}
        for name in ("alpha", "beta", "tiny"):
            assert complete(client, name) == expected[name]
        with pytest.raises(openai.NotFoundError):
            complete(client, "gamma")
    finally:
        gateway.stop()

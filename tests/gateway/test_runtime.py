"""The gateway in front of real ``ladle serve`` processes: the OpenAI SDK through it, and a
pod killed mid-load (no unstarted request lost, every started stream finishes or ends with an
error event, none hangs)."""

from __future__ import annotations

import asyncio
import json
import signal
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from .conftest import Process, start_runtime

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

MODEL = "smollm2"


@pytest.fixture(scope="module")
def runtimes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Process]]:
    folder = tmp_path_factory.mktemp("runtimes")
    procs = [start_runtime(folder, MODEL) for _ in range(2)]
    yield procs
    for proc in procs:
        proc.stop()


async def test_the_openai_sdk_through_the_gateway(
    runtimes: list[Process], run_gateway: Any
) -> None:
    gw = await run_gateway(
        [{"name": "chat", "model": MODEL, "endpoints": [p.url for p in runtimes]}]
    )
    oai = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0)
    chat = await oai.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Say hi"}], max_tokens=4, temperature=0
    )
    assert chat.choices[0].message.content
    pieces = [
        c.choices[0].text
        async for c in await oai.completions.create(
            model=MODEL, prompt="One, two,", max_tokens=4, stream=True
        )
        if c.choices
    ]
    assert "".join(pieces)
    # The runtime's own 4xx passes through in OpenAI's shape.
    with pytest.raises(openai.BadRequestError) as caught:
        await oai.completions.create(model=MODEL, prompt="x", max_tokens=4, temperature=-1)
    assert caught.value.body is not None
    with pytest.raises(openai.NotFoundError):
        await oai.completions.create(model="no-such-model", prompt="x", max_tokens=4)


async def test_killing_a_pod_mid_load_loses_nothing_unstarted_and_hangs_no_stream(
    runtimes: list[Process], run_gateway: Any
) -> None:
    """Runs last in this module: it kills the second runtime."""
    survivor, victim = runtimes
    gw = await run_gateway(
        [
            {
                "name": "chat",
                "model": MODEL,
                "endpoints": [survivor.url, victim.url],
                "routing": {"prefixAffinity": False},  # least outstanding: both pods get streams
                "circuitBreaker": {"enabled": False},
            }
        ]
    )
    started = asyncio.Event()
    first_chunks = 0

    async def stream(client: httpx.AsyncClient, i: int) -> str:
        nonlocal first_chunks
        body = {
            "model": MODEL,
            "prompt": f"Count slowly {i}:",
            "max_tokens": 16,
            "stream": True,
            "ignore_eos": True,
        }
        text = ""
        async with client.stream("POST", gw.url + "/v1/completions", json=body) as r:
            assert r.status_code == 200
            async for piece in r.aiter_text():
                if not text:
                    first_chunks += 1
                    if first_chunks == 6:
                        started.set()
                text += piece
        return text

    async def plain(client: httpx.AsyncClient, i: int) -> int:
        body = {"model": MODEL, "prompt": f"After the kill {i}", "max_tokens": 2}
        return (await client.post(gw.url + "/v1/completions", json=body)).status_code

    async with httpx.AsyncClient(timeout=120) as client:
        streams = [asyncio.ensure_future(stream(client, i)) for i in range(6)]
        await asyncio.wait_for(started.wait(), 120)
        victim.proc.send_signal(signal.SIGKILL)
        victim.proc.wait()
        after = [asyncio.ensure_future(plain(client, i)) for i in range(6)]
        texts = await asyncio.wait_for(asyncio.gather(*streams), 120)
        codes = await asyncio.wait_for(asyncio.gather(*after), 120)
    assert codes == [200] * 6  # nothing that had not started was lost
    cut = 0
    for text in texts:
        events = [e for e in text.split("\n\n") if e]
        if events[-1] == "data: [DONE]":
            continue
        cut += 1
        assert (
            json.loads(events[-1].removeprefix("data: "))["error"]["code"]
            == "upstream_disconnected"
        )
    assert cut >= 1  # the victim held some of the streams, and each of those ended cleanly

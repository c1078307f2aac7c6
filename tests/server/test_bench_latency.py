"""``ladle bench latency`` without llama.cpp: its arguments, and a whole run against two fake
OpenAI-compatible streaming servers standing in for Ladle and the baseline."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from ladle.cli import main
from ladle.runtime.bench.latency import Run, format_table


class _FakeOpenAI(BaseHTTPRequestHandler):
    """Streams max_tokens one-word chunks, then usage, like a completions endpoint."""

    requests: list[dict[str, object]]

    def log_message(self, *args: object) -> None:
        pass

    def do_GET(self) -> None:
        body = json.dumps({"data": [{"id": "fake-model"}]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self) -> None:
        payload = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.requests.append(payload)
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        n = int(payload["max_tokens"])
        for _ in range(n):
            chunk = {"choices": [{"index": 0, "text": " word"}]}
            self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
            self.wfile.flush()
            time.sleep(0.001)
        usage = {"choices": [], "usage": {"prompt_tokens": 8, "completion_tokens": n}}
        self.wfile.write(f"data: {json.dumps(usage)}\n\ndata: [DONE]\n\n".encode())
        self.close_connection = True


@pytest.fixture
def fake_servers() -> Iterator[tuple[str, str, list[dict[str, object]]]]:
    seen: list[dict[str, object]] = []
    handler = type("Handler", (_FakeOpenAI,), {"requests": seen})
    servers = [ThreadingHTTPServer(("127.0.0.1", 0), handler) for _ in range(2)]
    threads = [threading.Thread(target=s.serve_forever, daemon=True) for s in servers]
    for t in threads:
        t.start()
    urls = [f"http://127.0.0.1:{s.server_address[1]}" for s in servers]
    yield urls[0], urls[1], seen
    for s in servers:
        s.shutdown()
        s.server_close()


def test_runs_both_servers_at_each_concurrency_and_prints_the_table(
    fake_servers: tuple[str, str, list[dict[str, object]]],
    capsys: pytest.CaptureFixture[str],
) -> None:
    ladle_url, baseline_url, seen = fake_servers
    code = main(
        [
            "bench",
            "latency",
            "--url",
            ladle_url,
            "--baseline",
            "llama.cpp",
            "--baseline-url",
            baseline_url,
            "--concurrency",
            "1,2",
            "--repeats",
            "2",
            "--output-len",
            "4",
            "--input-len",
            "8",
        ]
    )
    assert code == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| fp32 |")]
    # (concurrency, system) rows, Ladle's with its TPOT ratio against the baseline.
    assert [row.split(" | ")[1:3] for row in rows] == [
        ["1", "ladle"],
        ["1", "llama.cpp"],
        ["2", "ladle"],
        ["2", "llama.cpp"],
    ]
    assert all(row.count("[") == 6 for row in rows if "| ladle |" in row)
    assert all(row.rstrip(" |").endswith("-") for row in rows if "| llama.cpp |" in row)
    # Per round and concurrency, 4 requests per slot to each server, plus one probe request
    # per run and a two-request warm-up per server; greedy, streamed, max_tokens as asked.
    timed = [r for r in seen if r["max_tokens"] == 4 and "only checks" not in str(r["prompt"])]
    assert len(timed) == 2 * 2 * (4 * 1 + 4 * 2) + 2 * 2
    assert all(r["stream"] and r["temperature"] == 0.0 for r in timed)


def test_ratio_is_taken_within_each_round() -> None:
    def run(system: str, round_: int, tpot: float) -> Run:
        return Run("int8", system, 1, round_, 4, 0, tpot, tpot, 10.0, 20.0, 50.0)

    # Round 0: 10 vs 20 (0.5); round 1, a slow minute for both: 40 vs 40 (1.0).
    runs = [run("ladle", 0, 10), run("llama.cpp", 0, 20), run("ladle", 1, 40)]
    runs.append(run("llama.cpp", 1, 40))
    table = format_table(runs)
    ladle_row = next(line for line in table.splitlines() if "| ladle |" in line)
    assert ladle_row.endswith("| 0.75 [0.50-1.00] |")
    assert "| int8 | 1 | ladle | 25.0 [10.0-40.0] |" in ladle_row


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--baseline-url", "http://x"], "--baseline-url needs --baseline"),
        (["--url", "http://x", "--precisions", "fp32,int8"], "serve one precision"),
        (["--url", "http://x", "--baseline", "llama.cpp"], "give the baseline's --baseline-url"),
    ],
)
def test_inconsistent_arguments_are_one_line(argv: list[str], message: str) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["bench", "latency", *argv])
    assert message in str(exc.value)
    assert "\n" not in str(exc.value)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--precisions", "fp16"], "precisions from fp32, int8, int4"),
        (["--concurrency", "0,4"], "positive integers"),
        (["--repeats", "0"], "--repeats"),
        (["--output-len", "1"], "--output-len"),
    ],
)
def test_bad_values_are_one_line_and_exit_2(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["bench", "latency", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err
    assert err.count("\n") == 1

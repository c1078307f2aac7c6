"""A newcomer's mistakes, made through the real ``ladle`` command: each is one line on stderr
that names what to fix, with exit code 2 (1 where the setting was fine but the world was not),
and never a traceback.

The table is the point: a later mistake of the same class belongs in it."""

from __future__ import annotations

import itertools
import json
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest


@dataclass(frozen=True)
class Mistake:
    argv: tuple[str, ...]
    says: tuple[str, ...]  # every one appears in the line
    env: dict[str, str] = field(default_factory=dict)
    code: int = 2

    @property
    def prefix(self) -> str:
        """``ladle`` and the subcommand's words: who is speaking."""
        words = itertools.takewhile(lambda word: not word.startswith("-"), self.argv)
        command = " ".join(w for w in words if w in COMMAND_WORDS)
        return f"ladle {command}:" if command else "ladle:"


COMMAND_WORDS = {"serve", "generate", "bench", "operator", "gateway", "cluster", "up", "status",
                 "env"}  # fmt: skip

FILES = {
    "missing.yaml": None,
    "typo.yaml": "max-num-seqz: 4\n",
    "list.yaml": "max-num-seqs: [1, 2]\n",
    "broken.yaml": "max-num-seqs: [1,\n",
    "not-a-mapping.yaml": "- max-num-seqs\n",
    "static-shape.yaml": "- name: chat\n",
    "static-key.yaml": "services:\n- name: chat\n  model: m\n  endpoint: [http://h:1]\n",
    "static-url.yaml": "services:\n- name: chat\n  model: m\n  endpoints: ['h:8000']\n",
    "kubeconfig-broken": "clusters: [\n",
    "kubeconfig-no-context": "clusters: []\n",
    "kubeconfig-context": "current-context: kind\ncontexts: []\nclusters: []\nusers: []\n",
}

HELP_ME = "see 'ladle serve --help'"

MISTAKES: dict[str, Mistake] = {
    # -- settings, from each source ------------------------------------------------------
    "config file missing": Mistake(
        ("serve", "--config", "{tmp}/missing.yaml"), ("--config", "no such file")
    ),
    "config key misspelt": Mistake(
        ("serve", "--config", "{tmp}/typo.yaml"), ("'max-num-seqz'", "did you mean 'max-num-seqs'")
    ),
    "config list for a number": Mistake(
        ("serve", "--config", "{tmp}/list.yaml"), ("max-num-seqs", "whole number", "not list")
    ),
    "config not YAML": Mistake(
        ("serve", "--config", "{tmp}/broken.yaml"), ("broken.yaml", "not valid YAML at line 2")
    ),
    "config not a mapping": Mistake(
        ("serve", "--config", "{tmp}/not-a-mapping.yaml"), ("expected a mapping",)
    ),
    "config file from the environment, missing": Mistake(
        ("serve",), ("LADLE_SERVE_CONFIG=", "no such file"),
        env={"LADLE_SERVE_CONFIG": "{tmp}/missing.yaml"},
    ),
    "speculative method unknown": Mistake(
        ("serve", "--speculative-config", '{"method": "eagle", "num_speculative_tokens": 2}'),
        ("--speculative-config", "method must be one of ngram", "'eagle'"),
    ),
    "speculative tokens zero": Mistake(
        ("serve", "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 0}'),
        ("--speculative-config", "num_speculative_tokens must be 1 to 16; got 0"),
    ),
    "nodes that do not divide the ranks": Mistake(
        ("serve", "--tensor-parallel-size", "3", "--nnodes", "2"),
        ("tensor_parallel_size 3 does not spread evenly over nnodes 2",),
    ),
    "a second node without the shared secret": Mistake(
        ("serve", "--tensor-parallel-size", "2", "--nnodes", "2", "--node-rank", "1"),
        ("nnodes > 1 needs LADLE_PARALLEL_SECRET",),
    ),
    "tensor parallelism with LoRA": Mistake(
        ("serve", "--tensor-parallel-size", "2", "--enable-lora"),
        ("enable_lora does not work with tensor_parallel_size > 1 yet",),
    ),
    "config file named empty": Mistake(("serve", "--config", ""), ("--config ''", "not be empty")),
    "config file from the environment, empty": Mistake(
        ("serve",), ("LADLE_SERVE_CONFIG=''", "not be empty"), env={"LADLE_SERVE_CONFIG": ""},
    ),
    "variable not a number": Mistake(
        ("serve",), ("LADLE_SERVE_MAX_NUM_SEQS='abc'", "whole number >= 1"),
        env={"LADLE_SERVE_MAX_NUM_SEQS": "abc"},
    ),
    "variable misspelt": Mistake(
        ("serve",), ("LADLE_SERVE_MAX_NUM_SEQ ", "did you mean LADLE_SERVE_MAX_NUM_SEQS"),
        env={"LADLE_SERVE_MAX_NUM_SEQ": "4"},
    ),
    "boolean variable": Mistake(
        ("serve",), ("LADLE_SERVE_ENABLE_PREFIX_CACHING='maybe'", "true or false"),
        env={"LADLE_SERVE_ENABLE_PREFIX_CACHING": "maybe"},
    ),
    "flag misspelt": Mistake(("serve", "--max-num-seq", "4"), ("did you mean --max-num-seqs",)),
    "memory in milli": Mistake(("serve", "--kv-cache-memory", "512m"), ("'m' means milli",)),
    "port out of range": Mistake(("serve", "--port", "70000"), ("--port", "<= 65535")),
    "log level": Mistake(("serve", "--log-level", "verbose"), ("debug, info, warning, error",)),
    "api key file missing": Mistake(
        ("serve", "--api-key-file", "{tmp}/missing.yaml"), ("--api-key-file", "no such file")
    ),
    "model path missing": Mistake(("serve", "--model", "{tmp}/nope"), ("--model", "no such file")),
    "model folder without config.json": Mistake(
        ("serve", "--model", "{tmp}"), ("--model", "has no config.json")
    ),
    "model file not gguf": Mistake(
        ("serve", "--model", "{tmp}/typo.yaml"), ("--model", "a .gguf file")
    ),
    "generate: no tokens": Mistake(("generate", "--max-tokens", "0", "Hi"), (">= 1",)),
    "generate: negative temperature": Mistake(("generate", "--temperature", "-1", "Hi"), (">= 0",)),
    "unknown subcommand": Mistake(("srve",), ("invalid choice: 'srve'",)),
    # -- listening: the port is taken, the address is not this machine's ---------------
    "serve: port taken": Mistake(
        ("serve", "--port", "{busy}"), ("cannot listen on 127.0.0.1:{busy}", "--port")
    ),
    "serve: host not ours": Mistake(
        ("serve", "--host", "192.0.2.1", "--port", "8000"), ("cannot listen", "--host")
    ),
    "gateway: port taken": Mistake(
        ("gateway", "--static", "{static}", "--port", "{busy}"), ("cannot listen", "--port")
    ),
    # -- the gateway's files -------------------------------------------------------------
    "gateway: static file missing": Mistake(
        ("gateway", "--static", "{tmp}/missing.yaml"), ("--static", "no such file")
    ),
    "gateway: static file not YAML": Mistake(
        ("gateway", "--static", "{tmp}/broken.yaml"), ("not valid YAML at line 2",)
    ),
    "gateway: static file shape": Mistake(
        ("gateway", "--static", "{tmp}/static-shape.yaml"), ("'services' list",)
    ),
    "gateway: static key misspelt": Mistake(
        ("gateway", "--static", "{tmp}/static-key.yaml"), ("'endpoint'", "did you mean 'endpoints'")
    ),
    "gateway: static pod without scheme": Mistake(
        ("gateway", "--static", "{tmp}/static-url.yaml"), ("expected http://HOST:PORT",)
    ),
    "gateway: size in milli": Mistake(("gateway", "--max-request-size", "8m"), ("milli",)),
    # -- no cluster to talk to -----------------------------------------------------------
    "operator: kubeconfig missing": Mistake(
        ("operator",), ("cannot read the kubeconfig", "KUBECONFIG"),
        env={"KUBECONFIG": "{tmp}/missing.yaml"},
    ),
    "operator: kubeconfig not YAML": Mistake(
        ("operator",), ("not valid YAML", "ladle cluster env"),
        env={"KUBECONFIG": "{tmp}/kubeconfig-broken"},
    ),
    "operator: kubeconfig context missing": Mistake(
        ("operator",), ("'kind'", "does not define"),
        env={"KUBECONFIG": "{tmp}/kubeconfig-context"},
    ),
    "operator: kubeconfig without current-context": Mistake(
        ("operator",), ("Current context is not set", "KUBECONFIG"),
        env={"KUBECONFIG": "{tmp}/kubeconfig-no-context"},
    ),
    "operator: no kubeconfig at all": Mistake(
        ("operator",), ("no kubeconfig", "KUBECONFIG"), env={"KUBECONFIG": "", "HOME": "{tmp}"}
    ),
    "operator: boolean variable": Mistake(
        ("operator",), ("LADLE_OPERATOR_LEADER_ELECT='maybe'", "true or false"),
        env={"LADLE_OPERATOR_LEADER_ELECT": "maybe"},
    ),
    "operator: lease timings": Mistake(
        ("operator", "--lease-duration", "5", "--renew-deadline", "10"), ("--renew-deadline",)
    ),
    "gateway: kubeconfig missing": Mistake(
        ("gateway",), ("cannot read the kubeconfig", "--static"),
        env={"KUBECONFIG": "{tmp}/missing.yaml"},
    ),
    # -- the bench client and the local cluster ------------------------------------------
    "bench: nothing listens": Mistake(
        ("bench", "serve", "--base-url", "http://127.0.0.1:{closed}/v1", "--num-prompts", "1"),
        ("cannot reach http://127.0.0.1:{closed}/v1/models", "--base-url"),
        code=1,
    ),
    "bench: URL without scheme": Mistake(
        ("bench", "serve", "--base-url", "localhost:8000"), ("expected an http://",)
    ),
    "bench: header without a value": Mistake(
        ("bench", "serve", "--header", "x-ladle-priority"), ("--header", "expected KEY=VALUE")
    ),
    "cluster up: negative nodes": Mistake(("cluster", "up", "--nodes", "-1"), (">= 0",)),
    "cluster status: no cluster": Mistake(
        ("cluster", "status", "--state-dir", "{tmp}/none"), ("no cluster in", "ladle cluster up"),
        code=1,
    ),
    "cluster env: no cluster": Mistake(
        ("cluster", "env", "--state-dir", "{tmp}/none"), ("no cluster in", "--state-dir"), code=1
    ),
}  # fmt: skip


@pytest.fixture(scope="module")
def places(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """``{tmp}`` (with the files above), a ``{busy}`` port something listens on, a ``{closed}``
    one nothing does, and a ``{static}`` gateway file that is fine."""
    tmp = tmp_path_factory.mktemp("mistakes")
    for name, content in FILES.items():
        if content is not None:
            (tmp / name).write_text(content)
    static = tmp / "static.yaml"
    static.write_text("services:\n- name: chat\n  model: m\n  endpoints: ['http://127.0.0.1:9']\n")
    with socket.socket() as busy, socket.socket() as closed:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        closed.bind(("127.0.0.1", 0))
        yield {
            "tmp": str(tmp),
            "busy": str(busy.getsockname()[1]),
            "closed": str(closed.getsockname()[1]),
            "static": str(static),
        }


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def fill(text: str, places: dict[str, str]) -> str:
    for key, value in places.items():
        text = text.replace("{" + key + "}", value)
    return text


def run(mistake: Mistake, places: dict[str, str]) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("LADLE_")}
    env = {**clean, "KUBECONFIG": "/nonexistent", "COLUMNS": "400"}
    env.update({k: fill(v, places) for k, v in mistake.env.items()})
    return subprocess.run(
        [sys.executable, "-m", "ladle.cli", *(fill(arg, places) for arg in mistake.argv)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


@pytest.fixture(scope="module")
def outcomes(places: dict[str, str]) -> dict[str, subprocess.CompletedProcess[str]]:
    """Every mistake made at once, a few processes at a time (each is a Python start-up)."""
    with ThreadPoolExecutor(max_workers=4) as pool:
        futures = {name: pool.submit(run, mistake, places) for name, mistake in MISTAKES.items()}
        return {name: future.result() for name, future in futures.items()}


@pytest.mark.parametrize("name", list(MISTAKES))
def test_a_mistake_is_one_line_naming_what_to_fix(
    name: str, places: dict[str, str], outcomes: dict[str, subprocess.CompletedProcess[str]]
) -> None:
    mistake, result = MISTAKES[name], outcomes[name]
    assert "Traceback" not in result.stderr, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    line = lines[0]
    assert line.startswith(mistake.prefix), line
    for words in mistake.says:
        assert fill(words, places) in line, line
    assert result.returncode == mistake.code, line


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (("--max-model-len", "100000"), "max_model_len 100000 exceeds the model's 8192"),
        (
            ("--tensor-parallel-size", "4"),
            "tensor_parallel_size 4 does not split the model's 9 attention heads over its 3 KV "
            "heads; sizes that do: 2, 3, 9",
        ),
    ],
    ids=["max-model-len", "tensor-parallel-size"],
)
def test_an_engine_setting_the_model_refuses_is_one_error_line(
    flags: tuple[str, ...], says: str
) -> None:
    """Known only once the model's config is read: the server logs one error and exits with
    EX_CONFIG (78), which tells a supervisor that no restart will help."""
    result = subprocess.run(
        [sys.executable, "-m", "ladle.cli", "serve", *flags,
         "--port", str(free_port()), "--log-level", "error"],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert result.returncode == os.EX_CONFIG, result.stderr
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    record = json.loads(lines[0])
    assert record["level"] == "error"
    assert says in record["error"]


@pytest.mark.parametrize(
    "argv",
    [("serve", "--help"), ("cluster", "up", "--help"), ("gateway", "--help"), ("--version",)],
)
def test_one_bad_variable_never_breaks_another_command(argv: tuple[str, ...]) -> None:
    env = {
        **os.environ,
        "LADLE_OPERATOR_LEASE_DURATION": "15m",
        "LADLE_OPERATOR_LEADER_ELECT": "maybe",
        "LADLE_BENCH_SERVE_NUM_PROMPTS": "many",
    }
    result = subprocess.run(
        [sys.executable, "-m", "ladle.cli", *argv],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""


def test_nothing_is_left_behind_in_the_places_used(places: dict[str, str]) -> None:
    """The mistakes above created no cluster state and no files beside the inputs."""
    made = {p.name for p in Path(places["tmp"]).iterdir()}
    assert made == {name for name, content in FILES.items() if content} | {"static.yaml"}

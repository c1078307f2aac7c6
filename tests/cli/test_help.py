"""Every flag of every subcommand explains itself: a help line, its default and its variable,
named by one rule; the docs cover every flag of ``ladle serve`` and ``ladle gateway``."""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

import pytest

from ladle import logs
from ladle.cli import build_parser
from ladle.flag_types import LOG_LEVELS
from ladle.settings import env_name, leaf_parsers

DOCS = Path(__file__).resolve().parents[2] / "docs"


def options(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [
        a
        for a in parser._actions
        if a.option_strings and not isinstance(a, argparse._HelpAction | argparse._VersionAction)
    ]


COMMANDS = dict(leaf_parsers(build_parser()))


def test_the_tree_has_every_subcommand() -> None:
    assert {"serve", "generate", "bench serve", "bench throughput", "operator", "gateway"} <= set(
        COMMANDS
    )
    assert {"cluster build", "cluster up", "cluster env", "cluster down", "up", "down"} <= set(
        COMMANDS
    )


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_flag_shows_a_help_line_its_default_and_its_variable(command: str) -> None:
    for action in options(COMMANDS[command]):
        flag = max(action.option_strings, key=len)
        if isinstance(action, argparse.BooleanOptionalAction):
            flag = action.option_strings[0]
        text = action.help or ""
        match = re.fullmatch(r"(?s)(.+) \((?:default: (.+); )?env (\S+)\)", text)
        assert match, f"ladle {command} {flag}: {text!r}"
        assert match[1].strip(), f"ladle {command} {flag} has no help line"
        assert match[2], f"ladle {command} {flag} shows no default: {text!r}"
        assert match[2] not in ("None", "==SUPPRESS=="), f"ladle {command} {flag}: {text!r}"
        assert match[3] == env_name(command, flag), flag


def test_log_levels_are_spelled_the_same_everywhere() -> None:
    spellings = {
        command: next(a.metavar for a in options(leaf) if "--log-level" in a.option_strings)
        for command, leaf in COMMANDS.items()
        if any("--log-level" in a.option_strings for a in options(leaf))
    }
    assert set(spellings) >= {"serve", "gateway", "operator"}
    assert set(spellings.values()) == {"{debug,info,warning,error}"}
    # What logs.py and the docs promise --log-level takes is what it takes.
    stated = re.search(r"``level`` \(([^:]+): the names ``--log-level`` takes", logs.__doc__ or "")
    assert stated, "ladle.logs no longer says which levels --log-level takes"
    assert re.findall(r"``(\w+)``", stated[1]) == list(LOG_LEVELS)
    for doc in ("server.md", "gateway.md"):
        text = (DOCS / doc).read_text()
        (row,) = [line for line in text.splitlines() if line.startswith("| `--log-level`")]
        allowed = row.split("|")[-2]  # the flag, its default, then what it allows
        assert re.findall(r"`(\w+)`", allowed) == list(LOG_LEVELS), (doc, row)


@pytest.mark.parametrize(("command", "doc"), [("serve", "server.md"), ("gateway", "gateway.md")])
def test_the_docs_cover_every_flag_in_help(command: str, doc: str) -> None:
    text = (DOCS / doc).read_text().replace("--[no-]", "--")
    missing = [
        flag
        for action in options(COMMANDS[command])
        for flag in action.option_strings[:1]
        if not re.search(rf"`{re.escape(flag)}[` ]", text)
    ]
    assert not missing, f"docs/{doc} does not mention {missing}"


def test_help_imports_nothing_heavy() -> None:
    code = (
        "import sys; from ladle.cli import build_parser; build_parser(); "
        "print(sorted(m for m in ('torch', 'transformers', 'fastapi', 'kopf', 'yaml', "
        "'pythonjsonlogger', 'httpx') if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert out.stdout.strip() == "[]"

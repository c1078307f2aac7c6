"""Subcommands that other distributions add (``ladle.commands`` entry points): the development
package adds ``ladle cluster``, ``ladle up`` and ``ladle down``. Where it does not import, those
subcommands say so in one line and the rest of the command works."""

from __future__ import annotations

import subprocess
import sys

import pytest

# Runs `ladle` with the development package unimportable, as in an image that never installed
# it but kept its entry points (a half-removed install).
HIDDEN = """
import sys
class Hide:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "ladle_dev":
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None
sys.meta_path.insert(0, Hide())
from ladle.cli import main
sys.exit(main(sys.argv[1:]))
"""


def ladle(*argv: str, hide: bool) -> subprocess.CompletedProcess[str]:
    program = HIDDEN if hide else "import sys; from ladle.cli import main; sys.exit(main())"
    return subprocess.run(
        [sys.executable, "-c", program, *argv], capture_output=True, text=True, check=False
    )


def test_the_development_package_adds_its_subcommands() -> None:
    done = ladle("--help", hide=False)
    assert done.returncode == 0, done.stderr
    for word in ("cluster", "up", "down", "serve", "operator", "gateway"):
        assert f"\n    {word} " in done.stdout


@pytest.mark.parametrize("argv", [("cluster", "status"), ("up", "--wait", "5")])
def test_a_plugin_that_does_not_import_says_so_in_one_line(argv: tuple[str, ...]) -> None:
    done = ladle(*argv, hide=True)
    assert done.returncode == 2
    line = f"ladle {argv[0]}: its module does not import (No module named 'ladle_dev"
    assert done.stderr.startswith(line)
    assert done.stderr.count("\n") == 1
    assert "Traceback" not in done.stderr


def test_the_other_subcommands_work_without_the_plugin() -> None:
    done = ladle("serve", "--help", hide=True)
    assert done.returncode == 0, done.stderr
    assert "--max-num-seqs" in done.stdout
    listing = ladle("--help", hide=True).stdout
    assert "unavailable: No module named 'ladle_dev" in listing

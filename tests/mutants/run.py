"""Proof that the suite's checks can fail: apply each deliberate breakage of the product in
``breakages.toml`` to a throwaway copy of the checkout, run the tests named for it there, and
require that they fail.

    .venv/bin/python tests/mutants/run.py [--only TEXT] [--list] [--markdown]

The named tests first run once on the unbroken copy and must pass, or "caught" would mean
nothing. A breakage counts as caught only when pytest exits 1 (tests ran and failed): an
import or collection error (2, 4, 5) is a broken mutant, not a check that noticed. A breakage
whose ``old`` text is not found exactly once means the list went stale: the run stops and says
which. Exit status: 0 when every breakage was caught, 1 otherwise.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LIST = Path(__file__).with_name("breakages.toml")
TIMEOUT = 600


@dataclass(frozen=True)
class Breakage:
    name: str
    file: str
    old: str
    new: str
    tests: tuple[str, ...]


@dataclass(frozen=True)
class Outcome:
    breakage: Breakage
    caught: bool
    why: str
    seconds: float


def load() -> list[Breakage]:
    entries = tomllib.loads(LIST.read_text())["breakage"]
    return [Breakage(e["name"], e["file"], e["old"], e["new"], tuple(e["tests"])) for e in entries]


def copy_checkout(into: Path) -> None:
    """The tracked and the untracked-but-not-ignored files, links kept as links (the package's
    folders under src/ladle are links to the top-level ones)."""
    listed = subprocess.run(
        ["git", "-C", str(ROOT), "ls-files", "-co", "--exclude-standard", "-z"],
        capture_output=True, check=True,
    ).stdout.decode().split("\0")  # fmt: skip
    for name in filter(None, listed):
        source, target = ROOT / name, into / name
        if not source.exists() and not source.is_symlink():
            continue  # deleted in the work tree, not yet in the index
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(source, target, follow_symlinks=False)


def pytest(copy: Path, tests: tuple[str, ...]) -> tuple[int, str]:
    """Run ``tests`` in ``copy``, importing its ``ladle`` rather than the editable install."""
    argv = [sys.executable, "-m", "pytest", "-p", "no:xdist", "-p", "no:cacheprovider", "-q", "-x"]
    try:
        done = subprocess.run(
            [*argv, *tests],
            cwd=copy, env=environment(copy), capture_output=True, text=True, timeout=TIMEOUT,
            check=False,
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        return -1, f"timed out after {TIMEOUT} s"
    tail = (done.stdout + done.stderr).strip().splitlines()
    return done.returncode, tail[-1] if tail else ""


def checked_text(copy: Path, b: Breakage) -> str:
    """The file's text, once its ``old`` text is found there exactly once."""
    text = (copy / b.file).read_text()
    found = text.count(b.old)
    if found != 1:
        sys.exit(
            f"mutants: {b.name!r}: its old text is in {b.file} {found} times, not once; "
            "update tests/mutants/breakages.toml"
        )
    return text


def apply(copy: Path, b: Breakage) -> None:
    (copy / b.file).write_text(checked_text(copy, b).replace(b.old, b.new))


def environment(copy: Path) -> dict[str, str]:
    """The copy's ``src`` and ``dev/src`` first on the path, ahead of the editable installs'
    finders."""
    found = [str(copy / "src"), str(copy / "dev" / "src"), os.environ.get("PYTHONPATH")]
    path = os.pathsep.join(filter(None, found))
    return {**os.environ, "PYTHONPATH": path}


def check_imports_the_copy(copy: Path) -> None:
    """A mutant run against the original code would pass and count as missed for the wrong
    reason: make sure the copy's package is the one imported."""
    where = subprocess.run(
        [sys.executable, "-c", "import ladle.operator.desired as m; print(m.__file__)"],
        cwd=copy, env=environment(copy), capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    if not Path(where).resolve().is_relative_to(copy.resolve()):
        sys.exit(f"mutants: the copy imports ladle from {where}, not from {copy}")


def run(breakages: list[Breakage]) -> list[Outcome]:
    with tempfile.TemporaryDirectory(prefix="ladle-mutants-") as tmp:
        base = Path(tmp) / "base"
        copy_checkout(base)
        check_imports_the_copy(base)
        for b in breakages:  # a stale list stops the run before anything is timed
            checked_text(base, b)
        tests = tuple(dict.fromkeys(t for b in breakages for t in b.tests))
        code, last = pytest(base, tests)
        if code != 0:
            sys.exit(f"mutants: the named tests fail without any breakage ({last}); fix them first")
        print(f"baseline: {len(tests)} test targets pass unbroken", flush=True)
        outcomes = []
        for b in breakages:
            copy = Path(tmp) / "mutant"
            shutil.copytree(base, copy, symlinks=True)
            apply(copy, b)
            started = time.monotonic()
            code, last = pytest(copy, b.tests)
            seconds = time.monotonic() - started
            shutil.rmtree(copy)
            caught = code == 1
            why = last if code in (0, 1) else f"pytest exited {code}: {last}"
            outcome = Outcome(b, caught, why, seconds)
            outcomes.append(outcome)
            verdict = "caught" if caught else "MISSED"
            print(f"{verdict:7} {seconds:6.1f}s  {b.name}  ({why})", flush=True)
        return outcomes


def markdown(outcomes: list[Outcome]) -> str:
    rows = [
        "| Breakage | File | Tests that must fail | Result | Seconds |",
        "|---|---|---|---|---|",
    ]
    for o in outcomes:
        tests = "<br>".join(f"`{t}`" for t in o.breakage.tests)
        result = "caught" if o.caught else f"**missed** ({o.why})"
        rows.append(
            f"| {o.breakage.name} | `{o.breakage.file}` | {tests} | {result} | {o.seconds:.0f} |"
        )
    return "\n".join(rows)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", help="run the breakages whose name contains this text")
    parser.add_argument("--list", action="store_true", help="list the breakages and stop")
    parser.add_argument("--markdown", action="store_true", help="end with a Markdown table")
    args = parser.parse_args()
    breakages = [b for b in load() if args.only is None or args.only in b.name]
    if not breakages:
        sys.exit(f"mutants: no breakage named like {args.only!r}; see --list")
    if args.list:
        for b in breakages:
            print(f"{b.name}: {b.file} -> {', '.join(b.tests)}")
        return 0
    started = time.monotonic()
    outcomes = run(breakages)
    caught = sum(o.caught for o in outcomes)
    print(f"{caught} of {len(outcomes)} breakages caught in {time.monotonic() - started:.0f} s")
    if args.markdown:
        print(markdown(outcomes))
    return 0 if caught == len(outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())

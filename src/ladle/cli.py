"""The single ``ladle`` console script.

Each area contributes its subcommands through a module with an ``add_parsers`` function.
Those modules must import only the standard library at import time, so that ``ladle cluster``
or ``ladle operator`` never pay for importing torch. Other distributions add subcommands the
same way through the ``ladle.commands`` entry points: the development package (``ladle-dev``)
adds ``ladle cluster`` and ``ladle up``, which the images, installing ``ladle`` alone, lack.

Every subcommand's settings go through ``ladle.settings`` (flags, ``LADLE_*`` variables, a
``--config`` file), read only once that subcommand runs; a setting error anywhere in a command
is one line on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import sys
from collections.abc import Sequence
from types import ModuleType

from ladle import __version__
from ladle.settings import Parser, SettingError, attach_all, command_of, parse, resolve

# Modules that register subcommands, in the order they appear in ``ladle --help``.
COMMAND_MODULES = (
    "ladle.runtime.cli",
    "ladle.operator.cli",
    "ladle.gateway.cli",
)
# Subcommands that other distributions add, after those above.
ENTRY_POINTS = "ladle.commands"


def plugins() -> list[tuple[str, ModuleType | ImportError]]:
    """The subcommand modules other distributions register, by entry-point name; one that fails
    to import is kept as its error, so that a broken plugin costs its own subcommand only."""
    found: list[tuple[str, ModuleType | ImportError]] = []
    for entry in sorted(importlib.metadata.entry_points(group=ENTRY_POINTS), key=lambda e: e.name):
        try:
            found.append((entry.name, entry.load()))
        except ImportError as exc:
            found.append((entry.name, exc))
    return found


def add_broken(sub: argparse._SubParsersAction[Parser], name: str, exc: ImportError) -> None:
    """A subcommand that says in one line why its plugin did not load, instead of vanishing."""

    def fail(_: argparse.Namespace) -> int:
        print(f"ladle {name}: its module does not import ({exc}); reinstall it", file=sys.stderr)
        return 2

    # No prefix characters: every word after the name, flags too, is taken and ignored.
    broken = sub.add_parser(name, help=f"unavailable: {exc}", add_help=False, prefix_chars="\0")
    broken.add_argument("rest", nargs="*", help=argparse.SUPPRESS)
    broken.set_defaults(func=fail)


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="ladle",
        description="Kubernetes-native LLM serving.",
        epilog="Start with 'ladle serve' (the embedded default model on http://127.0.0.1:8000/v1) "
        "or 'ladle up' (a local cluster, the operator and gateway, a serving pod). Every flag of "
        "every command also reads LADLE_<COMMAND>_<FLAG> (ladle serve --port: LADLE_SERVE_PORT); "
        "'ladle COMMAND --help' lists them with their defaults.",
    )
    parser.add_argument("--version", action="version", version=f"ladle {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in COMMAND_MODULES:
        importlib.import_module(name).add_parsers(sub)
    for name, plugin in plugins():
        if isinstance(plugin, ImportError):
            add_broken(sub, name, plugin)
        else:
            plugin.add_parsers(sub)
    attach_all(parser)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parse(parser, argv)
    command = command_of(args)
    try:
        args = resolve(args, parser=parser)
        result: int | None = args.func(args)
    except SettingError as exc:
        print(f"ladle {command}: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return result or 0


if __name__ == "__main__":
    sys.exit(main())

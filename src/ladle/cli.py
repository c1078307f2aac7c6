"""The single ``ladle`` console script.

Each area contributes its subcommands through a module with an ``add_parsers`` function.
Those modules must import only the standard library at import time, so that ``ladle cluster``
or ``ladle operator`` never pay for importing torch.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from ladle import __version__

# Modules that register subcommands, in the order they appear in ``ladle --help``.
COMMAND_MODULES = (
    "ladle.runtime.cli",
    "ladle.operator.cli",
    "ladle.gateway.cli",
    "ladle.cluster.cli",
    "ladle.cluster.up_cli",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ladle", description="Kubernetes-native LLM serving.")
    parser.add_argument("--version", action="version", version=f"ladle {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in COMMAND_MODULES:
        importlib.import_module(name).add_parsers(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    result: int | None = args.func(args)
    return result or 0


if __name__ == "__main__":
    sys.exit(main())

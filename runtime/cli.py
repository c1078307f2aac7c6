"""``ladle`` subcommands of the runtime."""

from __future__ import annotations

import argparse


def add_parsers(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    del sub

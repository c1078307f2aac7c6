"""``ladle up`` and ``ladle down``: the whole system on this machine (see ``ladle_dev.cluster.up``).

Imports only the standard library at import time (see ``ladle.cli``).
"""

from __future__ import annotations

import argparse

from ladle.flag_types import seconds
from ladle_dev.cluster.cli import add_node_args, add_state_arg, default_state_dir, node_options


def add_parsers(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    up = sub.add_parser(
        "up",
        help="the whole system: cluster, operator, a GPUPool and the default model, serving",
        description="Start the local cluster with local nodes, install the Helm chart (the "
        "operator runs as pods), apply examples/gpupool.yaml and examples/smollm2.yaml, wait "
        "for a Ready runtime pod, and print its OpenAI base URL and a curl that works.",
    )
    add_state_arg(up)
    add_node_args(up, kwok_nodes=0)
    up.add_argument(
        "--wait",
        type=seconds(above=0),
        default=600.0,
        metavar="SECONDS",
        help="seconds to wait for the chart and the pod",
    )
    up.set_defaults(func=_up)

    down = sub.add_parser("down", help="stop everything `ladle up` started and remove its state")
    add_state_arg(down)
    down.set_defaults(func=_down)


def _up(args: argparse.Namespace) -> int:
    from ladle_dev.cluster.up import main_up

    return main_up(args.state_dir or default_state_dir(), node_options(args), args.wait)


def _down(args: argparse.Namespace) -> int:
    from ladle_dev.cluster.up import main_down

    return main_down(args.state_dir or default_state_dir())

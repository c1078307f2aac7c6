"""``ladle cluster build|up|down|status``: a real local Kubernetes with fake GPU nodes (kwok)
and local nodes (a real kubelet and containerd each) that run Ladle's images.

Imports only the standard library at import time (see ``ladle.cli``); the work happens in
``ladle_dev.cluster.build`` and ``ladle_dev.cluster.control_plane``, imported by the handlers.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from ladle.flag_types import integer, seconds
from ladle.settings import Default


def default_state_dir() -> Path:
    """Where ``up`` keeps a cluster unless told otherwise (next to the binary cache)."""
    from ladle_dev.cluster.build import cache_root

    return cache_root() / "clusters" / "default"


def add_parsers(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    cluster = sub.add_parser(
        "cluster",
        help="a local Kubernetes (control plane, kwok GPU nodes, local nodes with real pods)",
        description="Build and run a real local Kubernetes control plane with fake GPU nodes "
        "(kwok) and local nodes (kubelet, containerd and runc) that run Ladle's images.",
    )
    verbs = cluster.add_subparsers(dest="verb", metavar="VERB", required=True)

    p = verbs.add_parser(
        "build",
        help="build the pinned binaries into the versioned cache, and Ladle's images (buildah) "
        "for the local nodes",
    )
    p.add_argument("--force", action="store_true", help="rebuild the binaries even if cached")
    p.add_argument(
        "--no-images",
        action="store_true",
        help="build the binaries only (a cluster without local nodes needs no images)",
    )
    p.add_argument("--print-bin-dir", action="store_true", help="only print the bin folder")
    p.set_defaults(func=_build)

    p = verbs.add_parser("up", help="start the control plane, kwok nodes and local nodes")
    add_state_arg(p)
    add_node_args(p, kwok_nodes=2)
    p.set_defaults(func=_up)

    p = verbs.add_parser(
        "env",
        help="print the shell line that puts this cluster's kubectl and helm first on PATH",
        description="Print `export PATH=...:$PATH KUBECONFIG=...` for the cluster's own kubectl "
        "and helm (an older kubectl elsewhere on PATH would shadow them). Use it as "
        'eval "$(ladle cluster env)".',
    )
    add_state_arg(p)
    p.set_defaults(func=_env)

    p = verbs.add_parser("down", help="stop the processes `up` started and remove the state")
    add_state_arg(p)
    p.set_defaults(func=_down)

    p = verbs.add_parser("status", help="show processes, API health and nodes")
    add_state_arg(p)
    p.set_defaults(func=_status)


def add_state_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--state-dir",
        type=Path,
        default=Default(None, "$LADLE_CACHE_DIR/clusters/default"),
        metavar="DIR",
        help="cluster state folder (kubeconfig, certificates, logs)",
    )


def add_node_args(parser: argparse.ArgumentParser, *, kwok_nodes: int) -> None:
    """Flags shaping the cluster's nodes (shared by `ladle cluster up` and `ladle up`)."""
    parser.add_argument(
        "--nodes", type=integer(0), default=kwok_nodes, help="fake GPU nodes (kwok)"
    )
    parser.add_argument(
        "--gpus-per-node", type=integer(0), default=8, help="nvidia.com/gpu per kwok node"
    )
    parser.add_argument(
        "--gpu-product", default="NVIDIA-H200", help="nvidia.com/gpu.product label of kwok nodes"
    )
    parser.add_argument(
        "--local-nodes",
        type=integer(0),
        default=2,
        help="local nodes, a kubelet and containerd each (0 for kwok only)",
    )
    parser.add_argument(
        "--local-gpus", type=integer(0), default=4, help="fake nvidia.com/gpu per local node"
    )
    parser.add_argument(
        "--local-taint",
        action=argparse.BooleanOptionalAction,
        default=Default(None, "only when kwok nodes run beside them"),
        help="taint local nodes NoSchedule",
    )
    parser.add_argument(
        "--timeout",
        type=seconds(above=0),
        default=300.0,
        metavar="SECONDS",
        help="seconds to wait for Ready (local nodes import the images first)",
    )


def node_options(args: argparse.Namespace) -> Any:
    from ladle_dev.cluster.control_plane import Options

    return Options(
        nodes=args.nodes,
        gpus_per_node=args.gpus_per_node,
        gpu_product=args.gpu_product,
        timeout=args.timeout,
        local_nodes=args.local_nodes,
        local_gpus=args.local_gpus,
        local_taint=args.local_taint,
    )


def _build(args: argparse.Namespace) -> int:
    from ladle_dev.cluster import build, gaie, images, jaeger, sre_tools

    if args.print_bin_dir:
        print(build.bin_dir())
        return 0
    try:
        build.build(force=args.force)
        sre_tools.TOOLSET.build_missing(force=args.force)
        gaie.TOOLSET.build_missing(force=args.force)
        jaeger.TOOLSET.build_missing(force=args.force)
        if not args.no_images:
            for built in images.build_all():
                size = built.size / 2**30
                print(f"{built.reference}: {built.image_id[:12]}, {size:.2f} GiB", flush=True)
    except build.BuildError as exc:
        print(f"ladle cluster build: {exc}", file=sys.stderr)
        return 1
    return 0


def _up(args: argparse.Namespace) -> int:
    from ladle.words import plural
    from ladle_dev.cluster.control_plane import Cluster, ClusterError

    cluster = Cluster(args.state_dir or default_state_dir())
    options = node_options(args)
    print(f"starting cluster in {cluster.state_dir} ...", flush=True)
    try:
        seconds = cluster.up(options)
    except ClusterError as exc:
        print(f"ladle cluster up: {exc}", file=sys.stderr)
        if cluster.log_dir.is_dir():  # not when it refused before starting anything
            print(f"logs kept in {cluster.log_dir}", file=sys.stderr)
        return 1
    print(
        f"cluster Ready in {seconds:.1f}s: {cluster.server}, "
        f"{plural(args.nodes, 'kwok GPU node')}, {plural(args.local_nodes, 'local node')}"
    )
    print(f"kubeconfig: {cluster.kubeconfig}")
    print('the cluster\'s own kubectl and helm, first on PATH (or: eval "$(ladle cluster env)"):')
    print(cluster.shell_env)
    return 0


def _env(args: argparse.Namespace) -> int:
    from ladle_dev.cluster.control_plane import Cluster

    cluster = Cluster(args.state_dir or default_state_dir())
    if not cluster.kubeconfig.is_file():
        print(
            f"ladle cluster env: no cluster in {cluster.state_dir} (start one with ladle cluster "
            "up or ladle up, or pass its --state-dir)",
            file=sys.stderr,
        )
        return 1
    print(cluster.shell_env)
    return 0


def _down(args: argparse.Namespace) -> int:
    from ladle_dev.cluster.control_plane import Cluster

    cluster = Cluster(args.state_dir or default_state_dir())
    if not cluster.state_dir.exists():
        print(f"no cluster in {cluster.state_dir}: nothing to stop")
        return 0
    stopped = cluster.down()
    print(f"stopped {', '.join(stopped) or 'nothing'}; removed {cluster.state_dir}")
    return 0


def _status(args: argparse.Namespace) -> int:
    from ladle_dev.cluster.control_plane import Cluster, ClusterError

    cluster = Cluster(args.state_dir or default_state_dir())
    try:
        report = cluster.status()
    except ClusterError as exc:
        print(f"ladle cluster status: {exc} (start one with ladle cluster up)", file=sys.stderr)
        return 1
    print(json.dumps(report, indent=2))
    healthy = report.get("readyz") == "ok" and all(report["processes"].values())
    return 0 if healthy else 1

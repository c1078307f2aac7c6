"""A machine other than node 0 (``ladle serve --node-rank N``, N > 0): it runs its share of
the ranks, headless, each connecting to rank 0; rank 0 tells them what to load."""

from __future__ import annotations

import logging
import subprocess
import sys
import time

from ladle.runtime.config import EngineArgs
from ladle.runtime.parallel.worker import child_env

log = logging.getLogger(__name__)


def run_node(args: EngineArgs) -> int:
    """Start this node's ranks and wait: when one ends, stop the others (the group cannot
    step without it) and exit with its code, so that the pod restarts as a whole."""
    local = args.tensor_parallel_size // args.nnodes
    first = args.node_rank * local
    address = f"{args.master_addr}:{args.master_port + 1}"
    ranks = [
        subprocess.Popen(
            [sys.executable, "-m", "ladle.runtime.parallel", "--connect", address, str(rank)],
            env=child_env(),
        )
        for rank in range(first, first + local)
    ]
    log.info("ranks started", extra={"ranks": list(range(first, first + local)), "to": address})
    try:
        while all(rank.poll() is None for rank in ranks):
            time.sleep(0.5)
    finally:
        for rank in ranks:
            if rank.poll() is None:
                rank.terminate()
        for rank in ranks:
            rank.wait()
    code = (
        next(rank.returncode for rank in ranks if rank.returncode != 0)
        if any(rank.returncode for rank in ranks)
        else 0
    )
    log.info("ranks ended", extra={"exit_code": code})
    return code

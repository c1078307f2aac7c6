"""A tensor-parallel rank other than 0: its slice of the model, and a loop that runs each
step's plan as rank 0 sends it.

It runs as its own interpreter (``python -m ladle.runtime.parallel FD``, ``FD`` its end of a
socket pair with rank 0), so that starting it never re-runs the user's script, as
``multiprocessing``'s spawn would.
"""

from __future__ import annotations

import ctypes
import logging
import os
import pickle
import signal
import time
from dataclasses import dataclass
from multiprocessing.connection import Client, Connection
from typing import Any

import torch
from torch.distributed import TCPStore  # type: ignore[attr-defined]
from transformers import AutoConfig

from ladle import logs
from ladle.runtime.config import EngineArgs
from ladle.runtime.forward_pass import ForwardPass
from ladle.runtime.models.build import build_model, kv_budget_blocks, resolve_dtype
from ladle.runtime.models.config import model_config_from_hf
from ladle.runtime.models.llama import LlamaModel
from ladle.runtime.models.loader import resolve_model
from ladle.runtime.parallel.group import JOIN_TIMEOUT, Shard, TensorParallelGroup
from ladle.runtime.parallel.layout import shard_layout
from ladle.runtime.parallel.secret import parallel_secret

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkerSpec:
    args: EngineArgs
    rank: int
    size: int
    device: str
    # Rank 0's rendezvous store.
    host: str
    store_port: int
    # Rank 0's log level: this rank's logs are JSON lines at the same level.
    log_level: str


@dataclass(frozen=True)
class Loaded:
    """A rank's report once its slice is loaded: the KV blocks its memory holds."""

    blocks: int


@dataclass(frozen=True)
class LoadFailed:
    message: str


def send(channel: Connection, message: object) -> None:
    """Plain pickle: ``Connection.send``'s pickler, which torch extends, would share tensors
    through file descriptors that the other process cannot open."""
    channel.send_bytes(pickle.dumps(message))


def receive(channel: Connection) -> Any:
    return pickle.loads(channel.recv_bytes())


_PR_SET_PDEATHSIG = 1  # linux/prctl.h
_PARENT_VARIABLE = "LADLE_RANK_PARENT"


def connect(host: str, port: int) -> Connection:
    """Rank 0's plan listener on another machine, which may start after this one (its pod
    scheduled later, its image still pulling): tried again each second, for ten minutes."""
    deadline = time.monotonic() + 600
    while True:
        try:
            return Client((host, port), authkey=parallel_secret())
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(1)


def child_env() -> dict[str, str]:
    """The environment of a rank this process starts: its own, and its pid, which the rank
    checks in :func:`die_with_parent`."""
    return {**os.environ, _PARENT_VARIABLE: str(os.getpid())}


def die_with_parent() -> None:
    """First thing in a rank a node started (``ladle serve --node-rank N``, whose main thread
    waits on its ranks): the kernel kills the rank when that process dies, however it dies,
    so no rank outlives its node. Set in the rank itself (a ``preexec_fn`` is unsafe beside
    threads); a parent gone before that is caught by the pid check."""
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if str(os.getppid()) != os.environ.get(_PARENT_VARIABLE, str(os.getppid())):
        raise SystemExit("the process that started this rank is gone")


def threads_per_rank(size: int) -> int:
    """CPU ranks share the machine's cores rather than each claiming all of them."""
    return max(1, (os.cpu_count() or 1) // size)


def _load(spec: WorkerSpec, group: TensorParallelGroup) -> tuple[LlamaModel, int]:
    device = torch.device(spec.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(threads_per_rank(spec.size))
    args = spec.args
    path = resolve_model(args.model)
    cfg = model_config_from_hf(AutoConfig.from_pretrained(path))
    shard = Shard(shard_layout(cfg, spec.size, spec.rank), group)
    model, kv_spec = build_model(args, cfg, path, device, resolve_dtype(args.dtype, device), shard)
    return model, kv_budget_blocks(args, model, kv_spec)


def serve(channel: Connection) -> None:
    """Load this rank's slice and report; join the group; then run plans until rank 0 sends
    None or its end of the channel closes. A failure while serving ends the process, which
    fails rank 0's step at once instead of leaving it waiting in a collective."""
    spec: WorkerSpec = receive(channel)
    logs.configure(spec.log_level)
    group = TensorParallelGroup(spec.rank, spec.size, torch.device(spec.device))
    try:
        model, blocks = _load(spec, group)
    except Exception as exc:
        send(channel, LoadFailed(f"rank {spec.rank}: {exc}"))
        raise
    send(channel, Loaded(blocks))
    try:
        blocks = receive(channel)
    except EOFError:  # rank 0 gave up starting
        return
    group.join(TCPStore(spec.host, spec.store_port, spec.size, timeout=JOIN_TIMEOUT))
    forward = ForwardPass(model, model.attention.allocate(blocks), model.device)
    try:
        while True:
            try:
                plan = receive(channel)
            except EOFError:
                break
            if plan is None:
                break
            forward(plan)
    finally:
        group.close()

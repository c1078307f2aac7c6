"""Rank 0's side of tensor parallelism: it starts the other ranks, agrees the KV cache size
with them, forms the group, and sends them each step's plan.

The plans travel over a socket pair (``multiprocessing.connection``; TCP from other machines),
not a collective: an idle server may wait hours for its next request, and a collective would
time out meanwhile; and a rank that dies closes its end, so rank 0 learns of it at once.
"""

from __future__ import annotations

import contextlib
import logging
import subprocess
import sys
from multiprocessing import Pipe
from multiprocessing.connection import Connection, Listener

import torch
import torch.distributed as dist
from torch.distributed import TCPStore  # type: ignore[attr-defined]

from ladle.runtime.config import ConfigError, EngineArgs
from ladle.runtime.forward_pass import StepPlan
from ladle.runtime.parallel import worker
from ladle.runtime.parallel.group import JOIN_TIMEOUT, RankFailure, TensorParallelGroup
from ladle.runtime.parallel.secret import parallel_secret

_HOST = "127.0.0.1"


class Peers:
    def __init__(
        self,
        group: TensorParallelGroup,
        store: TCPStore,
        processes: list[subprocess.Popen[bytes]],
        channels: list[Connection],
    ) -> None:
        self.group = group
        self.store = store
        self.processes = processes
        self.channels = channels

    @classmethod
    def start(cls, args: EngineArgs, size: int, device: torch.device) -> Peers:
        """Start this node's other ranks (rank r on GPU r), which begin loading their slices
        at once; with ``nnodes`` > 1, wait until every other node's ranks have connected too.
        Rank 0 keeps its share of the CPU threads."""
        if dist.is_initialized():
            raise ConfigError(
                "this process already runs a tensor-parallel engine (torch.distributed has "
                "one group per process); shut that engine down first"
            )
        local = size // args.nnodes
        if device.type == "cpu":
            torch.set_num_threads(worker.threads_per_rank(local))
        spread = args.nnodes > 1
        secret = parallel_secret() if spread else b""
        host = "0.0.0.0" if spread else _HOST
        port = args.master_port if spread else 0
        store = TCPStore(host, port, size, is_master=True, timeout=JOIN_TIMEOUT,
                         wait_for_workers=False)  # fmt: skip
        level = logging.getLevelName(logging.getLogger().getEffectiveLevel()).lower()

        def spec(rank: int) -> worker.WorkerSpec:
            return worker.WorkerSpec(
                args=args,
                rank=rank,
                size=size,
                device=f"cuda:{rank % local}" if device.type == "cuda" else "cpu",
                host=args.master_addr if rank >= local else _HOST,
                store_port=store.port,
                log_level=level,
            )

        processes: list[subprocess.Popen[bytes]] = []
        channels: dict[int, Connection] = {}
        for rank in range(1, local):
            ours, theirs = Pipe()
            fd = theirs.fileno()
            command = [sys.executable, "-m", "ladle.runtime.parallel", str(fd)]
            processes.append(subprocess.Popen(command, pass_fds=[fd], env=worker.child_env()))
            theirs.close()
            worker.send(ours, spec(rank))
            channels[rank] = ours
        if spread:
            with Listener((host, args.master_port + 1), authkey=secret) as listener:
                while len(channels) < size - 1:
                    channel = listener.accept()
                    rank = worker.receive(channel)
                    worker.send(channel, spec(rank))
                    channels[rank] = channel
        ordered = [channels[rank] for rank in range(1, size)]
        return cls(TensorParallelGroup(0, size, device), store, processes, ordered)

    def agree_blocks(self, blocks: int) -> int:
        """Wait for every rank to load its slice; the KV blocks every rank holds (each sizes
        its own memory), told to all. Then the ranks meet, ready for steps."""
        for rank, channel in enumerate(self.channels, start=1):
            try:
                report = worker.receive(channel)
            except EOFError:
                raise RankFailure(self._gone(rank)) from None
            if isinstance(report, worker.LoadFailed):
                raise ConfigError(report.message)
            blocks = min(blocks, report.blocks)
        for channel in self.channels:
            worker.send(channel, blocks)
        self.group.join(self.store)
        return blocks

    def _gone(self, rank: int) -> str:
        if rank <= len(self.processes):  # on this machine
            return f"tensor-parallel rank {rank} exited ({self.processes[rank - 1].wait()})"
        return f"tensor-parallel rank {rank}, on another node, disconnected"

    def send(self, plan: StepPlan) -> None:
        """A rank that died closed its end: the write fails (or the step's collective
        does), so a step needs no :meth:`check` of its own; the engine loop checks each turn."""
        try:
            for channel in self.channels:
                worker.send(channel, plan)
        except OSError as exc:
            raise RankFailure(f"a tensor-parallel rank stopped listening: {exc}") from exc

    def check(self) -> None:
        """Raise if a rank has exited: the replica cannot compute another token. A rank never
        writes once loaded, so a channel with something to read has been closed (a rank on
        another node whose process or machine went away)."""
        for rank, process in enumerate(self.processes, start=1):
            code = process.poll()
            if code is not None:
                raise RankFailure(f"tensor-parallel rank {rank} exited ({code})")
        for rank, channel in enumerate(self.channels, start=1):
            if channel.poll():
                raise RankFailure(self._gone(rank))

    def close(self) -> None:
        """Tell the ranks to stop, and wait for them (briefly: a hung rank is killed)."""
        for channel in self.channels:
            with contextlib.suppress(OSError):
                worker.send(channel, None)
            channel.close()
        for process in self.processes:
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        self.group.close()

"""The collectives of a tensor-parallel forward pass, over ``torch.distributed``."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed import Store  # type: ignore[attr-defined]

from ladle.runtime.parallel.layout import ShardLayout

# Every rank has loaded its slice when the ranks meet; joining takes seconds.
JOIN_TIMEOUT = timedelta(minutes=2)
# Within a step a rank waits this long for the others (the server's liveness window): a rank
# that died or hangs fails the step instead of stalling it for ever.
STEP_TIMEOUT = timedelta(seconds=60)


class RankFailure(RuntimeError):
    """Another rank died or stopped answering: the group cannot run a step again."""


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


class TensorParallelGroup:
    """The ranks of one model replica. Each rank loads its slice first and joins the others
    after (``join``), so that a rank that fails to load is reported by the channel that
    carries plans instead of leaving the others in a rendezvous."""

    def __init__(self, rank: int, size: int, device: torch.device) -> None:
        self.rank = rank
        self.size = size
        self.device = device
        self.step_group: dist.ProcessGroup | None = None

    def join(self, store: Store) -> None:
        dist.init_process_group(
            backend_for(device=self.device),
            store=store,
            rank=self.rank,
            world_size=self.size,
            timeout=JOIN_TIMEOUT,
        )
        step_group = dist.new_group(list(range(self.size)), timeout=STEP_TIMEOUT)
        assert isinstance(step_group, dist.ProcessGroup), "every rank is in the group"
        self.step_group = step_group

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum the ranks' partial outputs of a row-parallel layer, in place."""
        try:
            dist.all_reduce(x, group=self.step_group)
        except RuntimeError as exc:
            raise RankFailure(f"tensor-parallel all-reduce failed: {exc}") from exc
        return x

    def gather_columns(self, x: torch.Tensor) -> torch.Tensor | None:
        """On rank 0, every rank's ``x`` side by side along the last axis, in rank order (the
        logits of each rank's vocabulary slice); None on the others, which do not sample."""
        parts = [torch.empty_like(x) for _ in range(self.size)] if self.rank == 0 else None
        try:
            dist.gather(x.contiguous(), parts, dst=0, group=self.step_group)
        except RuntimeError as exc:
            raise RankFailure(f"tensor-parallel gather failed: {exc}") from exc
        return None if parts is None else torch.cat(parts, dim=-1)

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


@dataclass(frozen=True)
class Shard:
    """What a rank's model needs to run its slice: which slice, and the ranks to meet."""

    layout: ShardLayout
    group: TensorParallelGroup

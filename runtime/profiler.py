"""On-demand ``torch.profiler`` traces of a live engine (``/start_profile``, ``/stop_profile``).

torch.profiler records only the thread that started it, so starting and stopping run on the
engine's thread (:meth:`AsyncLLM.call`); writing the trace, the slow part, runs on neither that
thread nor the event loop.
"""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path
from typing import TYPE_CHECKING

from ladle.runtime.config import ConfigError

if TYPE_CHECKING:
    from torch.profiler import profile


class ProfilerStateError(RuntimeError):
    """Start while running, or stop while not: the caller's mistake, not the server's."""


class EngineProfiler:
    """One profile at a time, written to ``trace_dir`` as a gzipped Chrome/Perfetto trace."""

    def __init__(self, trace_dir: Path, max_seconds: float = 60.0) -> None:
        try:
            trace_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            problem = exc.strerror
            raise ConfigError(f"profile-dir {trace_dir}: cannot create it: {problem}") from None
        if not os.access(trace_dir, os.W_OK | os.X_OK):
            raise ConfigError(f"profile-dir {trace_dir}: not writable")
        self.trace_dir = trace_dir
        # A profile still running this long after its start stops itself (the events of a
        # long one would fill the memory, and its trace the disk).
        self.max_seconds = max_seconds
        self._running: profile | None = None
        self._started = 0.0
        self._count = 0
        # The trace of the last profile the cap stopped, for the next /stop_profile to name.
        self.capped: Path | None = None

    @property
    def running(self) -> bool:
        return self._running is not None

    @property
    def session(self) -> int:
        """Which profile is running, or ran last: the capped stop compares it with its own."""
        return self._count + (self._running is not None)

    def start(self) -> int:
        """On the engine thread; the new profile's session."""
        import torch
        from torch.profiler import ProfilerActivity, profile

        if self._running is not None:
            raise ProfilerStateError("the profiler is already running; POST /stop_profile first")
        activities = [ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(ProfilerActivity.CUDA)
        prof = profile(activities=activities, record_shapes=True)
        prof.start()
        self.capped = None
        self._running = prof
        self._started = time.time()
        return self.session

    def stop(self) -> tuple[profile, Path]:
        """On the engine thread: the stopped profile and the file to export it to."""
        prof = self._running
        if prof is None:
            if self.capped is not None:
                raise ProfilerStateError(
                    f"the profiler is not running: the last profile stopped itself after "
                    f"{self.max_seconds:g} s (--profile-max-seconds) and wrote {self.capped}"
                )
            raise ProfilerStateError("the profiler is not running; POST /start_profile first")
        self._running = None
        prof.stop()
        self._count += 1
        # The host is the pod's name; the count tells apart profiles started in one second.
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(self._started))
        name = f"ladle-{socket.gethostname()}-{stamp}-{self._count}.pt.trace.json.gz"
        return prof, self.trace_dir / name

    def stop_session(self, session: int) -> tuple[profile, Path] | None:
        """On the engine thread: stop ``session`` if it is still the one running (the cap's
        stop; None when /stop_profile came first)."""
        if self._running is None or self.session != session:
            return None
        return self.stop()


def export(prof: profile, path: Path) -> Path:
    """Write the trace (seconds for a long profile); atomically, so a reader never sees half."""
    partial = path.with_name(f".{path.name}.partial.gz")
    prof.export_chrome_trace(str(partial))
    partial.replace(path)
    return path

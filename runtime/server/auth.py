"""Bearer API keys from flags or from a mounted Secret file, compared in constant time."""

from __future__ import annotations

import hmac
import logging
import os
from pathlib import Path

from ladle.logs import Recurring
from ladle.runtime.config import ConfigError

log = logging.getLogger("ladle.server")


class ApiKeys:
    """The accepted keys. A Secret mounted as a file is updated in place when it rotates, so
    the file is re-read whenever its modification time changes."""

    def __init__(self, keys: list[str], key_file: Path | None = None) -> None:
        self._static = [k.encode() for k in keys if k]
        self._file = key_file
        self._file_mtime: int | None = None
        self._file_keys: list[bytes] = []
        self._file_state = Recurring(
            log,
            "api key file unreadable; keeping the previous keys",
            "api key file readable again",
            path=str(key_file),
        )
        if key_file is not None:
            self._reload()
            if not self._file_keys:
                raise ConfigError(f"api key file {key_file} holds no key")

    @property
    def enabled(self) -> bool:
        return bool(self._static) or self._file is not None

    def _reload(self) -> None:
        assert self._file is not None
        try:
            mtime = os.stat(self._file).st_mtime_ns
            if mtime == self._file_mtime:
                return
            lines = self._file.read_text().splitlines()
        except OSError as exc:
            if self._file_mtime is None:
                raise ConfigError(f"cannot read api key file {self._file}: {exc}") from None
            self._file_state.failed(exc.strerror or exc)
            return
        self._file_keys = [line.strip().encode() for line in lines if line.strip()]
        self._file_mtime = mtime
        self._file_state.recovered(keys=len(self._file_keys))

    def check(self, presented: str) -> bool:
        """Compare against every key, without stopping early, so timing reveals nothing."""
        if self._file is not None:
            self._reload()
        candidate = presented.encode()
        matched = False
        for key in [*self._static, *self._file_keys]:
            matched |= hmac.compare_digest(candidate, key)
        return matched

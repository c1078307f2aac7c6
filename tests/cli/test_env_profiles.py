"""``ladle serve --env-profile``: each profile changes exactly the settings its table row
claims, and it stays under the file, the environment and the command line."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from ladle.cli import build_parser
from ladle.runtime.limits import RequestLimits
from ladle.runtime.server.settings import ServerSettings
from ladle.settings import SettingError, parse, resolve

# docs/server.md's table of profiles, as effective settings (ServerSettings and RequestLimits
# fields) that differ from the defaults.
CLAIMED: dict[str, dict[str, Any]] = {
    "dev": {"log_level": "debug", "log_prompts": True, "liveness_timeout": 600, "drain_timeout": 2},
    "staging": {"audit_log": "-", "max_waiting_requests": 256, "request_timeout": 600},
    "prod": {
        "log_level": "warning",
        "audit_log": "-",
        "max_waiting_requests": 256,
        "request_timeout": 300,
        "max_request_size": 4 << 20,
        "max_n": 16,
        "max_prompts": 64,
    },
}


def effective(*argv: str, environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """What ``ladle serve`` would run with: its server settings and request limits."""
    parser = build_parser()
    args = resolve(parse(parser, ["serve", *argv]), dict(environ or {}), parser)
    server = dataclasses.asdict(ServerSettings.from_namespace(args))
    return {**server, **dataclasses.asdict(RequestLimits.from_cli_args(args))}


def diff(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    return {k: b[k] for k in a if a[k] != b[k]}


@pytest.mark.parametrize("profile", CLAIMED)
def test_a_profile_changes_what_it_claims(profile: str) -> None:
    assert diff(effective(), effective("--env-profile", profile)) == CLAIMED[profile]


def test_staging_to_prod() -> None:
    staging, prod = effective("--env-profile", "staging"), effective("--env-profile", "prod")
    assert diff(staging, prod) == {
        "log_level": "warning",
        "request_timeout": 300,
        "max_request_size": 4 << 20,
        "max_n": 16,
        "max_prompts": 64,
    }


def test_every_other_source_wins(tmp_path: Path) -> None:
    config = tmp_path / "serve.yaml"
    config.write_text("env-profile: prod\nrequest-timeout: 120\nmax-n: 4\nlog-level: info\n")
    from_file = effective("--config", str(config))
    assert from_file["max_waiting_requests"] == 256  # the profile the file names
    assert (from_file["request_timeout"], from_file["max_n"]) == (120, 4)  # the file over it
    environ = {"LADLE_SERVE_MAX_N": "8", "LADLE_SERVE_LOG_LEVEL": "debug"}
    from_env = effective("--config", str(config), environ=environ)
    assert (from_env["max_n"], from_env["log_level"]) == (8, "debug")
    from_cli = effective("--config", str(config), "--max-n", "2", environ=environ)
    assert from_cli["max_n"] == 2
    # The command line's profile over the environment's over the file's.
    environ["LADLE_SERVE_ENV_PROFILE"] = "dev"
    assert effective("--config", str(config), environ=environ)["liveness_timeout"] == 600
    chosen = effective("--config", str(config), "--env-profile", "staging", environ=environ)
    assert (chosen["request_timeout"], chosen["log_prompts"]) == (120, False)


def test_an_unknown_profile_is_one_line(tmp_path: Path) -> None:
    config = tmp_path / "serve.yaml"
    config.write_text("env-profile: qa\n")
    with pytest.raises(SettingError, match=r"env-profile='qa'.*expected one of dev, staging"):
        effective("--config", str(config))
    done = subprocess.run(
        [sys.executable, "-m", "ladle.cli", "serve", "--env-profile", "qa"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert (done.returncode, done.stderr) == (
        2,
        "ladle serve: --env-profile 'qa': expected one of dev, staging, prod\n",
    )

"""One probe attempt, and lifecycle hook handlers, as the kubelet runs them.

httpGet goes to the pod's address (success is a status from 200 to 399, the body ignored),
tcpSocket only connects, exec runs the command inside the container's mount and UTS namespaces
(``nsenter``) as its user, with its environment. grpc probes are reported as failing, with a
message saying they are not supported here.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import aiohttp

from ladle.cluster.agent.kube import JSON

USER_AGENT = "kube-probe/1.37"


@dataclass(frozen=True)
class Target:
    """Where a container lives, for probes and hooks."""

    pod_ip: str
    pid: int
    uid: int
    gid: int
    env: Mapping[str, str]


@dataclass(frozen=True)
class Result:
    ok: bool
    message: str = ""


async def http_get(
    session: aiohttp.ClientSession, target: Target, handler: JSON, port: int, timeout: float
) -> Result:
    scheme = str(handler.get("scheme", "HTTP")).lower()
    host = handler.get("host") or target.pod_ip
    path = handler.get("path", "/")
    if not path.startswith("/"):
        path = "/" + path
    url = f"{scheme}://{host}:{port}{path}"
    headers = {"User-Agent": USER_AGENT, "Accept": "*/*"}
    headers.update({h["name"]: h["value"] for h in handler.get("httpHeaders") or []})
    try:
        async with session.get(
            url,
            headers=headers,
            ssl=False,
            allow_redirects=True,
            timeout=aiohttp.ClientTimeout(total=timeout),
        ) as rsp:
            await rsp.read()
            if 200 <= rsp.status < 400:
                return Result(True)
            return Result(False, f"HTTP probe failed with statuscode: {rsp.status}")
    except TimeoutError:
        return Result(
            False,
            f'Get "{url}": context deadline exceeded (Client.Timeout exceeded while awaiting '
            "headers)",
        )
    except (aiohttp.ClientError, OSError) as err:
        return Result(False, f'Get "{url}": {_dial_error(err, host, port)}')


def _dial_error(err: BaseException, host: str, port: int) -> str:
    cause = err
    while cause.__cause__ is not None or cause.__context__ is not None:
        cause = cause.__cause__ or cause.__context__  # type: ignore[assignment]
    if isinstance(cause, ConnectionRefusedError) or "refused" in str(err).lower():
        return f"dial tcp {host}:{port}: connect: connection refused"
    return str(err) or type(err).__name__


async def tcp_socket(target: Target, handler: JSON, port: int, timeout: float) -> Result:
    host = handler.get("host") or target.pod_ip
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout)
    except TimeoutError:
        return Result(False, f"dial tcp {host}:{port}: i/o timeout")
    except OSError as err:
        return Result(False, _dial_error(err, host, port))
    writer.close()
    with contextlib.suppress(OSError):
        await writer.wait_closed()
    return Result(True)


def nsenter_argv(target: Target, command: Sequence[str]) -> list[str]:
    """Run ``command`` in the container: its mounts, root, working directory and user."""
    return [
        "nsenter",
        f"--target={target.pid}",
        "--mount",
        "--uts",
        "--root",
        "--wd",
        f"--setuid={target.uid}",
        f"--setgid={target.gid}",
        "--",
        *command,
    ]


async def exec_command(target: Target, command: Sequence[str], timeout: float) -> Result:
    proc = await asyncio.create_subprocess_exec(
        *nsenter_argv(target, command),
        env=dict(target.env),
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    try:
        output, _ = await asyncio.wait_for(proc.communicate(), timeout)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        return Result(False, f"command timed out after {timeout:g}s")
    if proc.returncode == 0:
        return Result(True)
    text = output.decode(errors="replace").strip()
    return Result(False, f"command {list(command)!r} exited with {proc.returncode}: {text}")


async def run_handler(
    session: aiohttp.ClientSession,
    target: Target,
    kind: str,
    handler: JSON,
    port: int | None,
    timeout: float,
) -> Result:
    """One probe or hook action: httpGet, tcpSocket, exec, sleep (hooks) or grpc (refused)."""
    if kind == "httpGet":
        assert port is not None
        return await http_get(session, target, handler, port, timeout)
    if kind == "tcpSocket":
        assert port is not None
        return await tcp_socket(target, handler, port, timeout)
    if kind == "exec":
        return await exec_command(target, handler.get("command") or [], timeout)
    if kind == "sleep":
        await asyncio.sleep(min(float(handler.get("seconds", 0)), timeout))
        return Result(True)
    return Result(False, f"{kind} probes are not supported by the ladle node agent")

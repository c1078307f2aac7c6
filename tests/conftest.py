import os
import sys
from pathlib import Path

import pytest

# The two workers, the local cluster's pods and the servers tests start share two cores.
# libgomp's threads spin while they wait for work, on the cores the others wait for: beside one
# busy core, the engine-against-transformers test took 1.5x as long spinning (63.5 and 87.4 s
# against 41.6 and 56.0 s passive, alternated). Set before anything loads torch; the processes
# tests start inherit it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

# Shared test helpers (kube_harness) live beside this file; appended, so that nothing here
# can shadow a standard-library module.
sys.path.append(str(Path(__file__).resolve().parent))

pytest_plugins = ["ladle_dev.pytest_plugin"]

# `make test` runs two pytest-xdist workers with --dist loadgroup. A worker takes a whole
# group: one module (its module fixtures, servers and models, are set up once), or the whole
# end-to-end package, which shares one chart install across its modules. Each worker that
# needs Kubernetes starts its own cluster, on a network of its own. Local nodes start only when
# a test asks for them, and every module that does joins the end-to-end group: one worker's
# cluster holds them, so the machine's disk holds two unpacked runtime images, not four.
E2E = Path(__file__).resolve().parent / "e2e"


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    local = {item.path for item in items if "k8s_local_nodes" in getattr(item, "fixturenames", ())}
    for item in items:
        group = "e2e" if item.path.is_relative_to(E2E) or item.path in local else str(item.path)
        item.add_marker(pytest.mark.xdist_group(group))


def pytest_configure(config: pytest.Config) -> None:
    """xdist hands the group to its scheduler as a node-id suffix, which pytest 9.2 ignores
    (pytest-xdist#1386): every module is then spread over both workers, sets up its models and
    servers twice, and the suite runs minutes slower without failing."""
    if config.getoption("dist", "no") == "loadgroup" and pytest.version_tuple[:2] >= (9, 2):
        raise pytest.UsageError(
            f"pytest {pytest.__version__} breaks --dist loadgroup: install the pytest pinned in "
            "constraints.txt (make setup)"
        )


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """Seconds of tests each xdist worker ran: the suite lasts as long as the busiest, so this
    says which group to trim (or rebalance) when it runs long."""
    busy: dict[str, float] = {}
    for reports in terminalreporter.stats.values():
        for report in reports:
            worker = getattr(getattr(report, "node", None), "gateway", None)
            duration = getattr(report, "duration", None)
            if worker is not None and isinstance(duration, float):
                busy[worker.id] = busy.get(worker.id, 0.0) + duration
    if busy:
        line = ", ".join(f"{worker} {seconds:.0f} s" for worker, seconds in sorted(busy.items()))
        terminalreporter.write_line(f"test time per worker: {line}")

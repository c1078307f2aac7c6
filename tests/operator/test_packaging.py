"""crds/, the chart and manifests/ agree; the Dockerfiles copy and run what the package holds.

There is no container engine here, so the Dockerfiles are checked for what can be checked:
pinned bases, non-root users, entry points that exist, sources that exist, and that the wheel
they install carries the operator and imports nothing the operator image leaves out.
"""

from __future__ import annotations

import ast
import importlib.metadata
import json
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

import pytest
import yaml
from packaging.requirements import Requirement

from ladle.operator.runtime_pod import RUNTIME_UID
from ladle.runtime.kernels import prebuilt
from ladle_dev.cluster import build

ROOT = Path(__file__).resolve().parents[2]


def helm() -> Path:
    path = build.bin_dir() / "helm"
    if not path.is_file():
        pytest.fail("helm is not built: run `ladle cluster build`")
    return path


def load_all(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def test_generated_chart_crds_and_manifests_are_current() -> None:
    result = subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts" / "gen_manifests.py"),
            "--check",
            "--helm",
            str(helm()),
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stderr


def test_crds_chart_and_manifests_carry_the_same_crds() -> None:
    sources = {p.name: p.read_text() for p in sorted((ROOT / "crds").glob("*.yaml"))}
    chart = {p.name: p.read_text() for p in sorted((ROOT / "charts/ladle/crds").glob("*.yaml"))}
    assert sources
    assert chart == sources
    expected = {
        doc["metadata"]["name"]: doc for text in sources.values() for doc in [yaml.safe_load(text)]
    }
    manifests = {
        doc["metadata"]["name"]: doc
        for doc in load_all(ROOT / "manifests" / "ladle.yaml")
        if doc.get("kind") == "CustomResourceDefinition"
    }
    assert manifests == expected


def dockerfile(name: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, with continuation lines joined."""
    text = (ROOT / name).read_text().replace("\\\n", " ")
    out = []
    for raw in text.splitlines():
        line = raw.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


@pytest.mark.parametrize(
    ("name", "entrypoint"),
    [("Dockerfile.operator", ["ladle", "operator"]), ("Dockerfile.runtime", ["ladle", "serve"])],
)
def test_dockerfile_is_pinned_non_root_and_runs_a_real_subcommand(
    name: str, entrypoint: list[str]
) -> None:
    steps = dockerfile(name)
    args = dict(arg.split("=", 1) for word, arg in steps if word == "ARG")
    # A base image pinned to a patch release of the project's Python and a Debian release.
    assert re.fullmatch(r"python:3\.11\.\d+-slim-bookworm", args["PYTHON_IMAGE"])
    assert all(arg.split()[0] == "${PYTHON_IMAGE}" for word, arg in steps if word == "FROM")
    users = [arg for word, arg in steps if word == "USER"]
    assert users == [f"{RUNTIME_UID}:{RUNTIME_UID}"]
    final_entry = [arg for word, arg in steps if word == "ENTRYPOINT"][-1]
    assert json.loads(final_entry) == entrypoint  # exec form
    scripts = tomllib_scripts()
    assert scripts["ladle"] == "ladle.cli:main"
    help_text = subprocess.run(
        [sys.executable, "-m", "ladle.cli", entrypoint[1], "--help"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert help_text.returncode == 0, help_text.stderr
    for word, arg in steps:
        if word == "COPY" and not arg.startswith("--from"):
            for source in arg.split()[:-1]:
                assert (ROOT / source).exists(), f"{name} copies missing {source}"


def tomllib_scripts() -> dict[str, str]:
    import tomllib

    data = tomllib.loads((ROOT / "pyproject.toml").read_text())
    scripts: dict[str, str] = data["project"]["scripts"]
    return scripts


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Built as the Dockerfiles' first stage builds it, from what they copy: a build from the
    checkout itself would reuse whatever an earlier build left under build/."""
    context = tmp_path_factory.mktemp("context")
    steps = dockerfile("Dockerfile.runtime")
    second = [i for i, (word, _) in enumerate(steps) if word == "FROM"][1]
    for word, arg in steps[:second]:
        if word != "COPY":
            continue
        *sources, target = arg.split()
        for source in sources:
            if (ROOT / source).is_dir():
                skip = shutil.ignore_patterns("__pycache__", "*.egg-info")
                shutil.copytree(ROOT / source, context / target, symlinks=True, ignore=skip)
            else:
                shutil.copy(ROOT / source, context / target)
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(out), str(context)],
        check=True,
    )  # fmt: skip
    (path,) = out.glob("ladle-*.whl")
    return path


def test_wheel_carries_the_operator_and_the_console_script(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        entry_points = next(n for n in names if n.endswith("entry_points.txt"))
        assert "ladle = ladle.cli:main" in zf.read(entry_points).decode()
    for component in ("operator", "gateway"):
        for module in sorted((ROOT / component).glob("*.py")):
            assert f"ladle/{component}/{module.name}" in names
    # A namespace package: an __init__ would shadow the stdlib `operator` from the repo root.
    assert "ladle/operator/__init__.py" not in names
    assert "ladle/cli.py" in names
    # The runtime builds its CPU kernels from these sources on first use.
    for source in (*prebuilt.SOURCES, prebuilt.HEADER):
        assert f"ladle/runtime/kernels/{source.name}" in names


def test_wheel_holds_no_development_code(wheel: Path) -> None:
    """The images install this wheel: the local cluster, its Go builds and the pytest plugin
    live in the development package (dev/), and no module in the wheel imports test tooling."""
    tooling = {"pytest", "hypothesis", "ladle_dev", "schemathesis", "openai"}
    found = []
    with zipfile.ZipFile(wheel) as zf:
        names = [n for n in zf.namelist() if n.startswith("ladle/")]
        for name in names:
            if not name.endswith(".py"):
                continue
            for node in ast.walk(ast.parse(zf.read(name), name)):
                if isinstance(node, ast.Import):
                    modules = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    modules = [node.module]
                else:
                    continue
                found += [f"{name}: {m}" for m in modules if m.split(".")[0] in tooling]
    assert len(names) > 100
    assert not [n for n in names if n.startswith("ladle/cluster/") or "pytest" in n]
    assert found == []


@pytest.mark.parametrize("command", ["operator", "gateway"])
def test_control_plane_imports_only_what_its_image_installs(command: str) -> None:
    """Dockerfile.operator installs the wheel with --no-deps plus a short list, and runs both
    `ladle operator` and `ladle gateway`. Import each (and the gateway's tracing) with every
    other distribution hidden, as in that image: it must still load."""
    install = next(
        arg for word, arg in dockerfile("Dockerfile.operator") if word == "RUN" and "kopf" in arg
    )
    listed = re.search(r"constraints\.txt ([^&]+)", install)
    assert listed is not None
    allowed = closure(listed.group(1).split()) | {"ladle"}
    probe = f"""
import importlib.metadata, re, sys
allowed = {sorted(allowed)!r}
owners = importlib.metadata.packages_distributions()
def canonical(name): return re.sub(r"[-_.]+", "-", name).lower()
# Wraps every finder, so that a hidden distribution is found by none, exactly as if absent.
class HideUninstalled:
    def __init__(self, finders): self.finders = finders
    def find_spec(self, name, path=None, target=None):
        dists = owners.get(name.split(".")[0])
        if dists and not any(canonical(d) in allowed for d in dists):
            return None
        for finder in self.finders:
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                return spec
        return None
sys.meta_path[:] = [HideUninstalled(list(sys.meta_path))]
import ladle.{command}.main, ladle.{command}.cli, ladle.cli
import ladle.tracing  # loaded once --otlp-traces-endpoint is given
ladle.cli.build_parser().parse_args(["{command}", "--help"])
"""
    result = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stderr
    assert f"usage: ladle {command}" in result.stdout


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def closure(roots: list[str]) -> set[str]:
    """Distributions pip installs for ``roots`` (their non-extra requirements, transitively)."""
    seen: set[str] = set()
    todo = [canonical(r) for r in roots]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        for text in importlib.metadata.requires(name) or ():
            req = Requirement(text)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(canonical(req.name))
    return seen


def test_every_flag_the_operator_renders_is_a_ladle_serve_flag() -> None:
    """The operator and the runtime meet at the command line (and the same keys in --config):
    render a spec that sets every engine field and check each flag against `ladle serve`."""
    from ladle.api import parse_isvc
    from ladle.operator.config import OperatorConfig
    from ladle.operator.desired import desired_children
    from ladle.operator.runtime_flags import engine_config

    crd = yaml.safe_load((ROOT / "crds" / "ladle.dev_inferenceservices.yaml").read_text())
    spec_schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    engine_fields = spec_schema["properties"]["engine"]["properties"]
    engine = {
        "dtype": "bfloat16",
        "maxModelLen": 4096,
        "maxNumSeqs": 64,
        "schedulingPolicy": "fcfs",
        "maxNumBatchedTokens": 4096,
        "blockSize": 16,
        "enablePrefixCaching": False,
        "kvCacheMemory": "2Gi",
        "seed": 1,
        "maxWaitingRequests": 100,
        "drainTimeoutSeconds": 20,
        "maxLoras": 2,
        "maxLoraRank": 32,
        "maxCpuLoras": 4,
        "speculative": {"method": "ngram", "numSpeculativeTokens": 4, "promptLookupMax": 3},
    }
    assert set(engine) | {"gpuMemoryUtilization"} == set(engine_fields)
    obj = {
        "metadata": {
            "name": "x",
            "namespace": "n",
            "uid": "u",
            "generation": 1,
            "annotations": {"ladle.dev/profiling": "enabled"},
        },
        "spec": {
            "model": {"name": "m", "source": {"pvc": {"claimName": "c", "path": "p"}}},
            "resources": {"gpus": 0},
            "engine": engine,
            "apiKeySecret": {"name": "s", "key": "k"},
            "adapters": [{"name": "a", "source": {"pvc": {"claimName": "c", "path": "a"}}}],
        },
    }
    isvc = parse_isvc(obj)
    gpu = parse_isvc({**obj, "spec": {**obj["spec"], "resources": {"gpus": 1},
                                      "engine": {"gpuMemoryUtilization": 0.5}}})  # fmt: skip
    keys = set(engine_config(isvc)) | set(engine_config(gpu))
    config = OperatorConfig(config_map_threshold_bytes=10**6, runtime_env_profile="prod")
    args = desired_children(isvc, None, 1, config)
    rendered = args.deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    flags = {a.removeprefix("--") for a in rendered if a.startswith("--")}
    assert {"env-profile", "profile-dir"} <= flags

    result = subprocess.run(
        [sys.executable, "-m", "ladle.cli", "serve", "--help"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    known = set(re.findall(r"--([a-z][a-z0-9-]+)", result.stdout))
    assert flags <= known, f"not ladle serve flags: {flags - known}"
    assert keys <= known, f"not ladle serve settings: {keys - known}"
    dtypes = re.search(r"--dtype \{([^}]+)\}", result.stdout)
    assert dtypes is not None
    assert set(engine_fields["dtype"]["enum"]) <= set(dtypes.group(1).split(","))

"""Prometheus, promtool and the kstatus probe are cached under their own key: pinning a new
Prometheus never rebuilds Kubernetes (about 25 minutes cold), and the reverse."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from ladle_dev.cluster import build, sre_tools


@pytest.fixture
def hack_copy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    copy = tmp_path / "hack-k8s"
    shutil.copytree(build.HACK_DIR, copy, ignore=shutil.ignore_patterns("*.sh", "*.go"))
    monkeypatch.setattr(build, "HACK_DIR", copy)
    monkeypatch.setenv("LADLE_CACHE_DIR", str(tmp_path / "cache"))
    return copy


def test_the_tools_have_their_own_cache_key(hack_copy: Path, tmp_path: Path) -> None:
    cluster, tools = build.versions_hash(), sre_tools.TOOLSET.bin_dir()
    assert tools == tmp_path / "cache" / "sre-tools" / tools.parent.name / "bin"
    assert sre_tools.TOOLSET.missing() == ["promtool", "prometheus", "kstatus-compute"]
    gomod = hack_copy / "prometheus" / "go.mod"
    gomod.write_text(gomod.read_text().replace("v0.316.0", "v0.316.1"))
    assert sre_tools.TOOLSET.bin_dir() != tools
    assert build.versions_hash() == cluster
    kube = hack_copy / "kubernetes" / "go.mod"
    kube.write_text(kube.read_text() + "\n// bumped\n")
    assert build.versions_hash() != cluster


@pytest.mark.parametrize("name", ["prometheus", "promtool"])
def test_the_built_binaries_carry_their_version_and_no_cloud_discovery(name: str) -> None:
    path = sre_tools.TOOLSET.bin_dir() / name
    if not path.is_file():
        pytest.fail(f"{name} is not built: run `make cluster-build`")
    shown = subprocess.run(
        [str(path), "--version"], capture_output=True, text=True, check=True
    ).stdout
    assert f"{name}, version v0.316.0" in shown
    assert "tags:             remove_all_sd,enable_kubernetes_sd" in shown

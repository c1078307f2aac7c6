"""The binary cache is keyed by the pinned versions: a bump builds afresh, no bump reuses."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from ladle_dev.cluster import build


@pytest.fixture
def hack_copy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    copy = tmp_path / "hack-k8s"
    shutil.copytree(build.HACK_DIR, copy, ignore=shutil.ignore_patterns("*.sh"))
    monkeypatch.setattr(build, "HACK_DIR", copy)
    monkeypatch.setenv("LADLE_CACHE_DIR", str(tmp_path / "cache"))
    return copy


def test_cache_folder_follows_ladle_cache_dir(hack_copy: Path, tmp_path: Path) -> None:
    assert build.bin_dir() == tmp_path / "cache" / "k8s" / build.versions_hash() / "bin"
    assert build.missing() == [tool.name for tool in build.TOOLS] + ["stages"]


def test_version_bump_changes_the_cache_key(hack_copy: Path) -> None:
    before = build.versions_hash()
    assert build.versions_hash() == before
    gomod = hack_copy / "kwok" / "go.mod"
    gomod.write_text(
        gomod.read_text().replace("sigs.k8s.io/kwok v0.8.0", "sigs.k8s.io/kwok v0.8.1")
    )
    assert build.versions_hash() != before


def test_present_binaries_are_reused(hack_copy: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    bins = build.bin_dir()
    bins.mkdir(parents=True)
    for tool in build.TOOLS:
        (bins / tool.name).write_bytes(b"")
    build.stages_dir().mkdir()
    for stage in build.KWOK_STAGES:
        (build.stages_dir() / Path(stage).name).write_text("kind: Stage\n")
    assert build.missing() == []

    # Nothing to do, so the Go toolchain is not even looked for.
    def no_go() -> str:
        raise AssertionError("build() looked for Go although everything was cached")

    monkeypatch.setattr(build, "find_go", no_go)
    assert build.build() == bins


def test_a_new_pin_removes_the_binaries_of_the_old_ones(hack_copy: Path) -> None:
    current = build.build_dir()
    old = current.parent / "0123456789abcdef"
    for folder in (current / "bin", old / "bin"):
        folder.mkdir(parents=True)
        (folder / "kubelet").write_bytes(b"")
    build.prune(current)
    assert (current / "bin" / "kubelet").is_file()
    assert not old.exists()

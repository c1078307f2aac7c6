"""The layering rule (docs/architecture.md), read from the product's own imports.

Shared modules (``ladle.api``, ``ladle.kube``, ``ladle.settings``, ...) sit under every
component and import none; the runtime imports neither the operator nor the gateway; the
gateway imports no operator module; and no product module imports the development package
(``ladle_dev``: the local cluster, its Go builds and the pytest plugin), which the images leave
out. Imports inside functions count: they break the layers all the same.
"""

from __future__ import annotations

import ast
import os
from pathlib import Path

import ladle

PACKAGE = Path(ladle.__file__).parent
COMPONENTS = ("operator", "runtime", "gateway", "monitoring")
DEVELOPMENT = "ladle_dev"
# (importer, imported): component layers that may not be crossed.
FORBIDDEN = {
    ("runtime", "operator"),
    ("runtime", "gateway"),
    ("gateway", "operator"),
    ("operator", "gateway"),
    ("monitoring", "operator"),
    ("monitoring", "runtime"),
    ("monitoring", "gateway"),
}


# Frameworks a component must not import itself: kopf is the operator's framework (the
# gateway logs in through ladle.kube), and the runtime knows nothing of Kubernetes.
FRAMEWORKS = {"gateway": {"kopf"}, "runtime": {"kopf", "kubernetes"}}


def layer(module: str) -> str | None:
    """``shared`` for ladle's top-level modules, the component's name for its packages, the
    development package's name for it, None for anything else."""
    parts = module.split(".")
    if parts[0] == DEVELOPMENT:
        return DEVELOPMENT
    if parts[0] != "ladle":
        return None
    if len(parts) > 1 and parts[1] in COMPONENTS:
        return parts[1]
    return "shared"


def imports() -> list[tuple[str, str]]:
    found = []
    paths = [
        Path(folder, file)
        for folder, _, files in os.walk(PACKAGE, followlinks=True)
        for file in files
        if file.endswith(".py")
    ]
    for path in sorted(paths):
        name = ".".join(("ladle", *path.relative_to(PACKAGE).with_suffix("").parts))
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                found.append((name, node.module))
            elif isinstance(node, ast.Import):
                found.extend((name, alias.name) for alias in node.names)
    return found


def test_the_package_is_read_through_its_component_links() -> None:
    # The components live at the top level and are linked into src/ladle; a broken link would
    # leave them out of the walk and the rule below vacuous.
    read = {layer(importer) for importer, _ in imports()}
    assert read == {"shared", *COMPONENTS}


def test_no_import_crosses_a_layer() -> None:
    crossings = []
    for importer, imported in imports():
        outer, inner = layer(importer), layer(imported)
        if outer is None or inner is None or outer == inner:
            continue
        if (
            (outer, inner) in FORBIDDEN
            or (outer == "shared" and inner != "shared")
            or inner == DEVELOPMENT
        ):
            crossings.append(f"{importer} imports {imported}")
    assert crossings == []


def test_kopf_and_kubernetes_stay_out_of_the_components_that_do_not_need_them() -> None:
    used = [
        f"{importer} imports {imported}"
        for importer, imported in imports()
        if imported.split(".")[0] in FRAMEWORKS.get(layer(importer) or "", set())
    ]
    assert used == []

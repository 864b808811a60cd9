"""The import graph of fsmount reads top to bottom: no module imports one above it, and nothing outside
fsmount/data/ reaches into the data package's private modules."""

from __future__ import annotations

import ast
from pathlib import Path

import fsmount

PACKAGE = Path(fsmount.__file__).parent
# Lower numbers are lower layers; a module may import only modules of a strictly lower layer.
LAYERS = {
    "fsmount.capabilities": -2,
    "fsmount.sysmem": -1, "fsmount.holders": -1, "fsmount.residency": -1, "fsmount.mountinfo": -1,
    "fsmount": 0, "fsmount.config": 0, "fsmount.safetensors": 0,
    "fsmount.data.identity": 1, "fsmount.data.store": 2,
    "fsmount.data.presigned": 3, "fsmount.data.chunk_file": 3, "fsmount.data.cache_dir": 3,
    "fsmount.data.budget": 3, "fsmount.data.trailing": 3, "fsmount.data.credentials": 3, "fsmount.data.boto3_store": 4,
    "fsmount.data.levels": 4, "fsmount.data.disk_cache": 5, "fsmount.data.cache_admin": 5,
    "fsmount.data.shared_tier": 5, "fsmount.data.uploads": 5,
    "fsmount.data.engine": 6, "fsmount.data": 7,
    "fsmount.saved_names": 8,
    "fsmount.namespace": 9, "fsmount.readahead": 9,
    "fsmount.handles": 10, "fsmount.pagecache": 10, "fsmount.new_file": 10,
    "fsmount.write_staging": 9, "fsmount.tree_changes": 10,
    "fsmount.streaming": 11, "fsmount.writes": 11,
    "fsmount.stats": 12,
    "fsmount.operations": 13, "fsmount.prometheus": 13, "fsmount.stats_table": 13,
    "fsmount.cleanup_command": 13,
    "fsmount.mount": 14, "fsmount.prefetch_command": 14,
    "fsmount.mount_users": 15,
    "fsmount.cli": 16,
    "fsmount.__main__": 17,
}
TESTING = "fsmount.testing"  # support for tests, bench and demo: may import anything, imported by nothing


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imported(path: Path) -> set[str]:
    """Every fsmount module a file imports, at any depth (inside functions and TYPE_CHECKING too)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names if a.name.startswith("fsmount")}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("fsmount"):
            names.add(node.module)
            names |= {f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in LAYERS}
    return names


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in PACKAGE.rglob("*.py")}


def test_every_module_has_a_layer() -> None:
    unplaced = [m for m in modules() if m not in LAYERS and not m.startswith(TESTING)]
    assert not unplaced, f"give these a layer in LAYERS: {unplaced}"


def test_no_module_imports_one_above_it() -> None:
    wrong = []
    for name, path in modules().items():
        if name.startswith(TESTING):
            continue
        for target in imported(path):
            if target.startswith(TESTING):
                wrong.append(f"{name} imports test support {target}")
            elif LAYERS[target] >= LAYERS[name] and target != name:
                wrong.append(f"{name} (layer {LAYERS[name]}) imports {target} (layer {LAYERS[target]})")
    assert not wrong, "\n".join(wrong)


def test_the_data_package_is_used_through_its_face() -> None:
    wrong = [f"{name} imports {target}" for name, path in modules().items()
             if not name.startswith(("fsmount.data", TESTING))
             for target in imported(path) if target.startswith("fsmount.data.")]
    assert not wrong, "import these names from fsmount.data:\n" + "\n".join(wrong)

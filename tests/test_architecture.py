"""The package's imports point one way: down the layer table of docs/architecture.md, and never in a cycle.

Every import of a ``lightning_grpo`` module counts: top-level, function-local and ``TYPE_CHECKING`` ones.
"""

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "lightning_grpo"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


MODULES = {_module_name(p): p for p in PACKAGE.rglob("*.py")}


def _resolve(name: str) -> str:
    """The package module an import names (``from lightning_grpo import functional`` -> lightning_grpo.functional)."""
    while name not in MODULES and "." in name:
        name = name.rsplit(".", 1)[0]
    return name


def imports_of(path: Path, name: str = "") -> set[str]:
    """Every ``lightning_grpo`` module ``path`` (the module ``name``, default: from its place) imports."""
    found: set[str] = set()
    name = name or _module_name(path)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(_resolve(a.name) for a in node.names if a.name.split(".")[0] == "lightning_grpo")
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            if base.split(".")[0] != "lightning_grpo":
                continue
            for alias in node.names:
                full = f"{base}.{alias.name}"
                found.add(_resolve(full) if full in MODULES else _resolve(base))
    found.discard(name)
    return found


def layer_table() -> dict[str, int]:
    """``module prefix -> layer`` from the table under "## Layers" in docs/architecture.md."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    table = {}
    for layer, modules in re.findall(r"^\| (\d) [^|]*\| ([^|]+) \|$", text, flags=re.MULTILINE):
        for name in modules.split(","):
            name = name.strip()
            table[name if name == "lightning_grpo" else f"lightning_grpo.{name}"] = int(layer)
    return table


def layer_of(module: str, table: dict[str, int]) -> int:
    """The layer of the most specific row naming ``module`` or a package above it; the ``lightning_grpo`` row is the
    package's own ``__init__`` only, so a module that no row names is an error."""
    name = module
    while name not in table:
        if name.count(".") < 1 or name.rsplit(".", 1)[0] == "lightning_grpo":
            raise AssertionError(f"{module} is in no layer of docs/architecture.md: add it to the table")
        name = name.rsplit(".", 1)[0]
    return table[name]


GRAPH = {name: imports_of(path) for name, path in MODULES.items()}


def test_the_layer_table_covers_every_module():
    table = layer_table()
    assert len(table) > 10, table
    for module in MODULES:
        layer_of(module, table)


def test_a_module_in_no_row_fails():
    """The coverage check can fail: a new top-level module, or one in a new folder, is in no row."""
    table = layer_table()
    for unlisted in ("lightning_grpo.unlisted", "lightning_grpo.newroom.thing"):
        with pytest.raises(AssertionError, match="is in no layer"):
            layer_of(unlisted, table)
    assert layer_of("lightning_grpo", table) == 4


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_point_down_the_layers(module):
    table = layer_table()
    mine = layer_of(module, table)
    upward = sorted(f"{m} (layer {layer_of(m, table)})" for m in GRAPH[module] if layer_of(m, table) > mine)
    assert not upward, f"{module} (layer {mine}) imports upward: {upward}"


def find_cycle(graph: dict[str, set[str]]) -> list[str]:
    """One import cycle of ``graph`` as ``[a, b, ..., a]``, or [] when there is none (depth-first search)."""
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done
    path: list[str] = []

    def visit(node: str) -> list[str]:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return []

    for module in sorted(graph):
        if module not in state and (cycle := visit(module)):
            return cycle
    return []


def test_no_import_cycle():
    cycle = find_cycle(GRAPH)
    assert not cycle, "import cycle: " + " -> ".join(cycle)


def test_the_checker_finds_an_upward_import_and_a_cycle(tmp_path):
    """The checks can fail: a pure module importing the LightningModule is flagged, and so is a two-file cycle."""
    table = layer_table()
    bad = tmp_path / "probe.py"
    bad.write_text("def f():\n    from lightning_grpo.module import GRPOModule\n    from . import shaping\n")
    assert imports_of(bad, "lightning_grpo.algorithm.probe") == {"lightning_grpo.module",
                                                                  "lightning_grpo.algorithm.shaping"}
    assert layer_of("lightning_grpo.module", table) > layer_of("lightning_grpo.functional", table)
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) == []

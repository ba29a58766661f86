"""The package's imports point one way: down the layer table of docs/architecture.md, and never in a cycle.

Every import of a ``lightning_grpo`` module counts: top-level, function-local and ``TYPE_CHECKING`` ones. The graph
is checked three ways: module by module (no cycle); collapsed to folders (each top-level folder, or top-level file, is
one node and one row of the layer table: no cycle, and no folder importing a folder of a higher layer); and, inside
every folder at every depth, collapsed to that folder's subfolders and files (``rollout/engines``,
``rollout/engines/vllm``, ``rollout/server``, ``rollout/engine_registry.py``, ...: no cycle, so a subfolder's
imports of its siblings run one way). Module basenames are unique (but ``__init__.py`` and the settings files of
``config/``).
"""

import ast
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "lightning_grpo"


def _module_name(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def modules_under(root: Path) -> dict[str, Path]:
    """Every module of the ``lightning_grpo`` package under ``root`` (a checkout, or a planted tree): name -> file."""
    return {_module_name(p, root): p for p in (root / "lightning_grpo").rglob("*.py")}


MODULES = modules_under(ROOT)


def _resolve(name: str, modules: dict[str, Path]) -> str:
    """The package module an import names (``from lightning_grpo import functional`` -> lightning_grpo.functional)."""
    while name not in modules and "." in name:
        name = name.rsplit(".", 1)[0]
    return name


def imports_of(path: Path, name: str = "", modules: dict[str, Path] = MODULES) -> set[str]:
    """Every ``lightning_grpo`` module ``path`` (the module ``name``, default: from its place) imports, resolved
    against ``modules`` (default: the package's)."""
    found: set[str] = set()
    name = name or _module_name(path)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(_resolve(a.name, modules) for a in node.names if a.name.split(".")[0] == "lightning_grpo")
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            if base.split(".")[0] != "lightning_grpo":
                continue
            for alias in node.names:
                full = f"{base}.{alias.name}"
                found.add(_resolve(full, modules) if full in modules else _resolve(base, modules))
    found.discard(name)
    return found


def folder_of(module: str) -> str:
    """The top-level folder (or top-level file) a module is in: ``lightning_grpo.rollout.engines.hf`` -> ``rollout``,
    ``lightning_grpo.config`` -> ``config``; the package's own ``__init__`` is ``lightning_grpo``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def folder_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """``graph`` collapsed to folders: folder a -> folder b when a module of a imports a module of b (a != b)."""
    folders: dict[str, set[str]] = {}
    for module, imported in graph.items():
        mine = folder_of(module)
        folders.setdefault(mine, set()).update(folder_of(m) for m in imported if folder_of(m) != mine)
    return folders


def layer_table() -> dict[str, int]:
    """``folder -> layer`` from the table under "## Layers" in docs/architecture.md (rows ``| <layer> | <folders> |
    ... |``; folders sharing a layer may not import each other)."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    section = text.split("## Layers", 1)[1].split("\n## ", 1)[0]
    table = {}
    for layer, folders in re.findall(r"^\| (\d+) \| ([\w, ]+) \|", section, flags=re.MULTILINE):
        for name in folders.split(","):
            table[name.strip()] = int(layer)
    return table


def layer_of(module: str, table: dict[str, int]) -> int:
    """The layer of ``module``'s folder; a folder that no row names is an error."""
    folder = folder_of(module)
    if folder not in table:
        raise AssertionError(f"{module}: its folder {folder!r} is in no layer of docs/architecture.md: add a row")
    return table[folder]


GRAPH = {name: imports_of(path) for name, path in MODULES.items()}
FOLDERS = folder_graph(GRAPH)


def upward_imports(graph: dict[str, set[str]], table: dict[str, int]) -> list[str]:
    """Every import of a module of another folder of the same or a higher layer, as ``a (layer) -> b (layer)``."""
    found = []
    for module, imported in sorted(graph.items()):
        mine = layer_of(module, table)
        found += [f"{module} (layer {mine}) -> {m} (layer {layer_of(m, table)})" for m in sorted(imported)
                  if folder_of(m) != folder_of(module) and layer_of(m, table) >= mine]
    return found


def test_the_layer_table_names_every_folder_once():
    table = layer_table()
    assert set(table) == set(FOLDERS), (f"folders without a row: {sorted(set(FOLDERS) - set(table))}; rows without "
                                        f"a folder: {sorted(set(table) - set(FOLDERS))}")
    assert table["protocols"] == 0 and all(layer > 0 for name, layer in table.items() if name != "protocols")


def test_a_module_in_no_row_fails():
    """The coverage check can fail: a module of a new folder, or a new top-level module, is in no row."""
    table = layer_table()
    for unlisted in ("lightning_grpo.unlisted", "lightning_grpo.newroom.thing"):
        with pytest.raises(AssertionError, match="is in no layer"):
            layer_of(unlisted, table)
    assert layer_of("lightning_grpo", table) == max(table.values())


@pytest.mark.parametrize("folder", sorted(FOLDERS))
def test_folders_import_down_the_layers(folder):
    table = layer_table()
    mine = {m: imported for m, imported in GRAPH.items() if folder_of(m) == folder}
    upward = upward_imports(mine, table)
    assert not upward, f"{folder} (layer {table[folder]}) imports its own layer or a higher one: {upward}"


def test_protocols_import_only_torch_and_the_standard_library():
    """The shared vocabulary is a leaf: no package module outside it, no third-party package but torch."""
    allowed = set(sys.stdlib_module_names) | {"torch", "lightning_grpo"}
    for name, path in MODULES.items():
        if folder_of(name) != "protocols":
            continue
        assert all(folder_of(m) == "protocols" for m in GRAPH[name]), (name, GRAPH[name])
        for node in ast.walk(ast.parse(path.read_text())):
            roots = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
            assert all(root.split(".")[0] in allowed for root in roots), (name, roots)


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


def test_no_folder_cycle():
    cycle = find_cycle(FOLDERS)
    assert not cycle, "folder cycle: " + " -> ".join(cycle)


def _node(module: str, package: str, modules: dict[str, Path]) -> str:
    """The child of ``package`` that ``module`` is in, as a path: a subfolder (``rollout/engines``), a file
    (``rollout/engine_registry.py``) or the package's own ``__init__.py``."""
    folder = "/".join(package.split(".")[1:])
    prefix = f"{folder}/" if folder else ""
    if module == package:
        return f"{prefix}__init__.py"
    child = f"{package}.{module[len(package) + 1:].split('.')[0]}"
    return f"{prefix}{child.rsplit('.', 1)[1]}" + ("" if modules[child].name == "__init__.py" else ".py")


def subfolder_graphs(graph: dict[str, set[str]], modules: dict[str, Path]) -> dict[str, dict[str, set[str]]]:
    """For every package (folder) at every depth, ``graph`` inside it collapsed to its children: a subfolder or a file
    is one node, a -> b when a module in a imports a module in b (a != b); imports leaving the folder are left out."""
    graphs: dict[str, dict[str, set[str]]] = {}
    for package in sorted(n for n, p in modules.items() if p.name == "__init__.py"):
        inside = {m: imported for m, imported in graph.items() if m == package or m.startswith(f"{package}.")}
        children: dict[str, set[str]] = graphs.setdefault(package, {})
        for module, imported in inside.items():
            mine = _node(module, package, modules)
            children.setdefault(mine, set()).update(
                node for m in imported if (m == package or m.startswith(f"{package}."))
                and (node := _node(m, package, modules)) != mine)
    return graphs


def subfolder_cycles(graph: dict[str, set[str]], modules: dict[str, Path]) -> dict[str, list[str]]:
    """One cycle per package whose children (:func:`subfolder_graphs`) import each other in a circle."""
    return {package: cycle for package, children in subfolder_graphs(graph, modules).items()
            if (cycle := find_cycle(children))}


SUBFOLDERS = subfolder_graphs(GRAPH, MODULES)


@pytest.mark.parametrize("package", sorted(SUBFOLDERS))
def test_no_subfolder_cycle(package):
    """Inside each folder, its subfolders and files import each other one way (review 4 found ``rollout/engines``
    <-> ``rollout/registry.py`` <-> ``rollout/server``, which the folder-level check could not see)."""
    cycle = find_cycle(SUBFOLDERS[package])
    assert not cycle, f"cycle inside {package}: " + " -> ".join(cycle)


def test_the_subfolder_check_finds_a_planted_cycle(tmp_path):
    """The subfolder check can fail, at every depth: in a planted tree whose modules import in lines (no module cycle,
    and the top folder's one room imports nothing outside it), the two subfolders of ``room`` import each other
    (a/x -> b/y -> a/z), and inside ``room/a`` a subfolder and a file do (a/deep/p -> a/q -> a/deep/s): both found, each
    in its own folder, named by their paths."""
    package = tmp_path / "lightning_grpo"
    for folder in ("", "room", "room/a", "room/a/deep", "room/b"):
        (package / folder).mkdir(parents=True, exist_ok=True)
        (package / folder / "__init__.py").write_text("")
    planted = {"room/a/x.py": "from lightning_grpo.room.b import y\n",
               "room/b/y.py": "def f():\n    from lightning_grpo.room.a.z import g\n",
               "room/a/z.py": "g = 1\n",
               "room/a/deep/p.py": "from lightning_grpo.room.a import q\n",
               "room/a/q.py": "from lightning_grpo.room.a.deep.s import h\n",
               "room/a/deep/s.py": "h = 1\n"}
    for path, text in planted.items():
        (package / path).write_text(text)
    modules = modules_under(tmp_path)
    graph = {name: imports_of(path, name, modules) for name, path in modules.items()}
    assert graph["lightning_grpo.room.a.x"] == {"lightning_grpo.room.b.y"}
    assert graph["lightning_grpo.room.a.deep.p"] == {"lightning_grpo.room.a.q"}
    assert find_cycle(graph) == [] and find_cycle(folder_graph(graph)) == []
    assert subfolder_cycles(graph, modules) == {"lightning_grpo.room": ["room/a", "room/b", "room/a"],
                                                "lightning_grpo.room.a": ["room/a/deep", "room/a/q.py", "room/a/deep"]}
    assert subfolder_graphs(graph, modules)["lightning_grpo.room"] == {"room/__init__.py": set(), "room/a": {"room/b"},
                                                                      "room/b": {"room/a"}}


def repeated_basenames(paths: list[Path], package: Path) -> dict[str, list[str]]:
    """The module basenames that repeat among ``paths`` (files of ``package``), with where: ``__init__.py`` may, and
    so may a settings file of ``config/`` that mirrors its concept's module (``config/correction.py`` beside
    ``algorithm/correction.py``): at most one such file and one module elsewhere share a name."""
    by_name: dict[str, list[str]] = {}
    for path in paths:
        by_name.setdefault(path.name, []).append(str(path.relative_to(package)))
    repeated = {}
    for name, where in sorted(by_name.items()):
        settings = [w for w in where if w.startswith("config/")]
        if name != "__init__.py" and (len(settings) > 1 or len(where) - len(settings) > 1):
            repeated[name] = sorted(where)
    return repeated


def test_module_basenames_are_unique():
    """A file's name says what it is wherever it is found (a search, a traceback, an editor tab): no two modules share
    a basename, but ``__init__.py`` and the ``config/`` settings files named after their concept's module."""
    repeated = repeated_basenames(sorted(PACKAGE.rglob("*.py")), PACKAGE)
    assert not repeated, repeated


def test_the_basename_check_finds_a_repeat(tmp_path):
    """The basename check can fail: two ``images.py`` and two settings files of one name are found; ``__init__.py``
    and a ``config/`` settings file beside its concept's module are not."""
    names = ["__init__.py", "config/__init__.py", "config/correction.py", "algorithm/correction.py", "data/images.py",
             "rollout/images.py", "config/x.py", "config/sub/x.py"]
    paths = [tmp_path / name for name in names]
    assert repeated_basenames(paths, tmp_path) == {"images.py": ["data/images.py", "rollout/images.py"],
                                                   "x.py": ["config/sub/x.py", "config/x.py"]}


def test_test_file_basenames_are_unique():
    """pytest imports each test file by its basename (no folder of test files holds an ``__init__.py``: pytest's
    "prepend" imports put the file's folder on ``sys.path``), so two test files of one name would clash."""
    by_name: dict[str, list[str]] = {}
    for path in sorted((ROOT / "tests").rglob("test_*.py")):
        by_name.setdefault(path.name, []).append(str(path.relative_to(ROOT)))
        assert not (path.parent / "__init__.py").exists(), path.parent
    assert not {name: where for name, where in by_name.items() if len(where) > 1}


def _probe_section() -> str:
    text = (ROOT / "docs" / "architecture.md").read_text()
    return text.split("## Probes that remain", 1)[1].split("\n## ", 1)[0]


def test_few_probes_cross_a_seam_and_docs_architecture_names_each():
    """Architecture review 3's count of seam-crossing ``isinstance``/``getattr``/``hasattr`` lines (59 there; 53 by
    these rules at the pass's start) stays at most 15, every probe of a name a package class declares is classified,
    and docs/architecture.md's table names each remaining one by its file (as many rows as probes)."""
    from support.seam_probes import seam_lines, unclassified

    assert not unclassified(), "classify these in tests/support/seam_probes.py NAMED: " + ", ".join(
        f"{p.path}:{p.line} {p.call}" for p in unclassified())
    seams = seam_lines()
    assert len(seams) <= 15, [f"{p.path}:{p.line} {p.call}" for p in seams]
    rows = re.findall(r"^\| `(lightning_grpo/[^`]+)` \|", _probe_section(), flags=re.MULTILINE)
    assert sorted(rows) == sorted(p.path for p in seams), [f"{p.path}:{p.line} {p.call}" for p in seams]
    assert f"{len(seams)} of the package's" in " ".join(_probe_section().split())


def test_the_probe_count_sees_a_planted_seam_probe(tmp_path):
    """The classification can fail: a planted hot-path ``isinstance`` on a package protocol, a reach-in by a name a
    package class declares and a probe of Lightning's strategy are counted; a value check and an HF config read are
    not."""
    from support.seam_probes import probes

    package = tmp_path / "lightning_grpo"
    package.mkdir()
    (package / "planted.py").write_text(
        "from lightning_grpo.data.source import PromptSource\n\n\n"
        "class Mine:\n    def __init__(self):\n        self.policy = None\n\n\n"
        "def f(data, module, trainer, config, value):\n"
        "    a = isinstance(data, PromptSource)\n"
        "    b = getattr(module, 'policy', None)\n"
        "    c = getattr(trainer.strategy, 'world_size', 1)\n"
        "    d = isinstance(value, (int, float))\n"
        "    e = getattr(config, 'rope_theta', None)\n")
    found = {p.call: p.seam for p in probes(tmp_path)}
    assert found == {"isinstance(data, PromptSource)": True, "getattr(module, 'policy', None)": True,
                     "getattr(trainer.strategy, 'world_size', 1)": True, "isinstance(value, (int, float))": False,
                     "getattr(config, 'rope_theta', None)": False}


#: Architecture review 4's grep (section 0) for a branch on whether a rollout row's images, episode or environment
#: mask is there: ``grep -rn "images is None\|images is not None\|has_images(\|episodes is None\|..." lightning_grpo``.
OPTIONAL_FIELD_BRANCH = re.compile(r"images is None|images is not None|has_images\(|episodes is None|"
                                   r"episodes is not None|env_mask is None|env_mask is not None")


def optional_field_branches(package: Path) -> list[str]:
    """``path:line: text`` of each line of ``package``'s modules that :data:`OPTIONAL_FIELD_BRANCH` matches."""
    return [f"{path.relative_to(package.parent)}:{number}: {line.strip()}"
            for path in sorted(package.rglob("*.py"))
            for number, line in enumerate(path.read_text().splitlines(), start=1) if OPTIONAL_FIELD_BRANCH.search(line)]


def test_few_branches_ask_whether_a_rollout_row_field_is_there():
    """One row shape out (review 4, section 5.4): every rollout and experience row carries its environment mask,
    episode and images, so at most 10 lines of the package ask whether one is there (37 at the pass's start; those
    left ask whether the policy has an image encoder)."""
    found = optional_field_branches(PACKAGE)
    assert len(found) <= 10, "\n".join(found)


def test_the_branch_count_sees_a_planted_branch(tmp_path):
    package = tmp_path / "lightning_grpo"
    (package / "sub").mkdir(parents=True)
    (package / "sub" / "planted.py").write_text(
        "def f(out, images):\n"
        "    if out.env_mask is None or has_images(images):\n"
        "        return out.episodes is not None\n"
        "    return not any(images)\n")
    assert optional_field_branches(package) == [
        "lightning_grpo/sub/planted.py:2: if out.env_mask is None or has_images(images):",
        "lightning_grpo/sub/planted.py:3: return out.episodes is not None"]


def test_the_engine_protocols_reach_no_capability_through_a_type_ignore():
    """``protocols/engine.py`` declares what an engine is (``EngineCapabilities``, ``ImageRolloutEngine``), so nothing
    in it needs a ``type: ignore`` to reach a member an engine may lack."""
    assert "type: ignore" not in (PACKAGE / "protocols" / "engine.py").read_text()

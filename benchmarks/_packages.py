"""Which Python distributions the GPU benchmark may use: those of its GPU machine, and the wheels carried there.

Two committed lists (``name`` or ``name==version`` a line, ``#`` comments):

* ``benchmarks/gpu_machine_packages.txt``: what the GPU machine has installed (with the versions read there);
* ``benchmarks/gpu_wheels.txt``: the wheels carried to it (every line ``name==version``), none of them already there.

The dry run (``bash benchmarks/gpu.sh --dry-run``) runs the benchmark's own code on a CPU machine that has many more
distributions (vLLM, megatron-core, ...): :func:`hide_others` makes every installed distribution outside
:func:`allowed_distributions` unimportable in that process (``sys.modules[top_level] = None``: ``import`` raises
``ImportError`` and ``importlib.util.find_spec`` answers None, as where it is not installed). An import that the GPU
machine could not satisfy then fails the dry run, in CI, instead of the GPU run.

Command line (run by ``benchmarks/gpu_wheels.sh`` and ``benchmarks/gpu.sh``)::

    python benchmarks/_packages.py check-wheels .whl   # the downloaded wheels against both lists; prints their size
    python benchmarks/_packages.py preflight           # every carried distribution is importable here
"""

from __future__ import annotations

import email.parser
import functools
import importlib.metadata
import re
import sys
import zipfile
from pathlib import Path
from typing import Iterable, Mapping, Optional

HERE = Path(__file__).resolve().parent
MACHINE_LIST = HERE / "gpu_machine_packages.txt"
WHEEL_LIST = HERE / "gpu_wheels.txt"
#: This repository's own distribution (importable everywhere the benchmark runs: it runs from the checkout).
OWN = "lightning-grpo"
#: PEP 508 marker environment of the GPU machine (CPython 3.12 on x86-64 Linux).
TARGET_ENVIRONMENT = {
    "python_version": "3.12", "python_full_version": "3.12.3", "implementation_name": "cpython",
    "platform_python_implementation": "CPython", "sys_platform": "linux", "platform_system": "Linux",
    "platform_machine": "x86_64", "os_name": "posix", "extra": "",
}
_NAME = re.compile(r"[A-Za-z0-9]([A-Za-z0-9._-]*[A-Za-z0-9])?")
_VERSION = re.compile(r"[0-9][A-Za-z0-9.+!-]*")


def canonical(name: str) -> str:
    """PEP 503's normalized name: lower case, runs of ``-``, ``_``, ``.`` as one ``-``."""
    return re.sub(r"[-_.]+", "-", name).lower()


def read_list(path: Path, versions_required: bool = False) -> dict[str, Optional[str]]:
    """``{canonical name: version or None}`` of a package list (see the module docstring).

    Raises:
        ValueError: a line that is no ``name`` / ``name==version``, a name listed twice, or (``versions_required``)
            a line without a version; the file and line are named.
    """
    packages: dict[str, Optional[str]] = {}
    for number, raw in enumerate(Path(path).read_text().splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        name, separator, version = line.partition("==")
        if not _NAME.fullmatch(name) or (separator and not _VERSION.fullmatch(version)):
            raise ValueError(f"{path}:{number}: {raw!r} is not `name` or `name==version`")
        if versions_required and not version:
            raise ValueError(f"{path}:{number}: {raw!r} has no version (`name==version`)")
        if canonical(name) in packages:
            raise ValueError(f"{path}:{number}: {name} is listed twice")
        packages[canonical(name)] = version or None
    return packages


def machine_packages(path: Path = MACHINE_LIST) -> dict[str, Optional[str]]:
    """The GPU machine's installed distributions (:data:`MACHINE_LIST`)."""
    return read_list(path)


def carried_wheels(path: Path = WHEEL_LIST, machine: Optional[Mapping[str, Optional[str]]] = None) -> dict[str, str]:
    """The carried wheels (:data:`WHEEL_LIST`), ``{canonical name: version}``.

    Raises:
        ValueError: see :func:`read_list`; or a wheel of a distribution the machine already has (two copies of one
            distribution on one path: the carried one would shadow the machine's, which its other packages were
            installed against).
    """
    wheels = read_list(path, versions_required=True)
    machine = machine_packages() if machine is None else machine
    both = sorted(set(wheels) & set(machine))
    if both:
        raise ValueError(f"{path}: {', '.join(both)} already installed on the GPU machine ({MACHINE_LIST.name})")
    return {name: str(version) for name, version in wheels.items()}


def _requirements(requires: Iterable[str], environment: Optional[dict] = None) -> list:
    """The ``Requires-Dist`` entries that apply (no extras; markers evaluated in ``environment``, default here)."""
    from packaging.requirements import Requirement

    out = []
    for text in requires:
        requirement = Requirement(text)
        if requirement.marker is None or requirement.marker.evaluate(environment or {"extra": ""}):
            out.append(requirement)
    return out


def allowed_distributions(machine: Mapping[str, Optional[str]], wheels: Mapping[str, str]) -> set[str]:
    """What the benchmark may import: the machine's distributions and what they require (as installed here:
    the machine satisfies its own packages' requirements), the carried wheels (their requirements are NOT added: each
    must be on the machine or carried too), and this repository (canonical names)."""
    allowed, todo = set(machine), list(machine)
    while todo:
        try:
            requires = importlib.metadata.distribution(todo.pop()).requires or []
        except importlib.metadata.PackageNotFoundError:
            continue
        for requirement in _requirements(requires):
            name = canonical(requirement.name)
            if name not in allowed:
                allowed.add(name)
                todo.append(name)
    return allowed | set(wheels) | {OWN}


@functools.lru_cache(maxsize=1)
def _owners() -> Mapping[str, list[str]]:
    """``importlib.metadata.packages_distributions()``, read once (it reads every installed distribution's files)."""
    return importlib.metadata.packages_distributions()


def hide_others(allowed: set[str]) -> list[str]:
    """Make the top-level modules of every installed distribution outside ``allowed`` unimportable in this process
    (``sys.modules[name] = None``); a module that an allowed distribution also provides stays. Returns the hidden
    names, sorted.

    Raises:
        RuntimeError: such a module is imported already (hide before importing anything else).
    """
    hidden = []
    for top, distributions in _owners().items():
        if not top.isidentifier() or any(canonical(d) in allowed for d in distributions):
            continue
        if sys.modules.get(top) is not None:
            raise RuntimeError(f"{top} (from {', '.join(distributions)}) is imported already; hide it before")
        sys.modules[top] = None  # type: ignore[assignment]
        hidden.append(top)
    return sorted(hidden)


def imported_modules() -> dict[str, list[str]]:
    """``{top-level module: canonical names of the installed distributions that provide it}`` for every such module
    this process has imported (a namespace such as ``google`` can have several)."""
    owners = _owners()
    return {name: sorted(canonical(d) for d in owners[name]) for name, module in list(sys.modules.items())
            if module is not None and "." not in name and name in owners}


def outside(modules: Mapping[str, Iterable[str]], allowed: set[str]) -> list[str]:
    """``"module (distributions)"`` for each imported module that no allowed distribution provides (what the GPU
    machine could not import), sorted."""
    return sorted(f"{name} ({', '.join(names)})" for name, names in modules.items()
                  if not any(n in allowed for n in names))


def missing_here(wheels: Mapping[str, str]) -> dict[str, Optional[str]]:
    """The carried distributions not installed here (``{name: None}``) or installed in another version
    (``{name: installed version}``)."""
    out: dict[str, Optional[str]] = {}
    for name, version in wheels.items():
        try:
            installed = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
            continue
        if installed != version:
            out[name] = installed
    return out


def wheel_metadata(path: Path) -> tuple[str, str, list[str]]:
    """``(canonical name, version, Requires-Dist entries)`` of a wheel file.

    Raises:
        ValueError: the wheel has no ``*.dist-info/METADATA``.
    """
    with zipfile.ZipFile(path) as archive:
        members = [m for m in archive.namelist() if m.endswith(".dist-info/METADATA") and m.count("/") == 1]
        if not members:
            raise ValueError(f"{path}: no *.dist-info/METADATA")
        message = email.parser.Parser().parsestr(archive.read(members[0]).decode())
    return canonical(message["Name"]), message["Version"], message.get_all("Requires-Dist") or []


def check_wheel_folder(folder: Path, machine: Mapping[str, Optional[str]],
                       wheels: Mapping[str, str]) -> tuple[list[str], list[str], int]:
    """Check the downloaded wheels against both lists.

    Returns:
        ``(problems, unchecked, total_bytes)``: problems (a listed wheel missing or there twice, a wheel not listed,
        a requirement that neither list provides, or that a listed version does not meet); the requirements on a
        machine distribution whose version is not known (they cannot be checked here); the wheels' total size.
    """
    from packaging.version import Version

    problems: list[str] = []
    unchecked: list[str] = []
    found: dict[str, list[str]] = {}
    total = 0
    for path in sorted(Path(folder).glob("*.whl")):
        name, version, requires = wheel_metadata(path)
        total += path.stat().st_size
        found.setdefault(name, []).append(version)
        if wheels.get(name) != version:
            problems.append(f"{path.name}: not in {WHEEL_LIST.name} (remove it: one version of each)")
            continue
        for requirement in _requirements(requires, TARGET_ENVIRONMENT):
            needed = canonical(requirement.name)
            have = wheels.get(needed, machine.get(needed))
            if needed not in wheels and needed not in machine:
                problems.append(f"{name}=={version} requires {requirement}: neither on the GPU machine nor carried")
            elif have is None:
                if str(requirement.specifier):
                    unchecked.append(f"{name}=={version} requires {requirement} (the machine's version is unknown)")
            elif not requirement.specifier.contains(Version(have), prereleases=True):
                problems.append(f"{name}=={version} requires {requirement}, but {needed} is {have}")
    for name, version in wheels.items():
        if found.get(name, []).count(version) != 1:
            problems.append(f"{name}=={version}: {len(found.get(name, []))} wheels of it in {folder} (want 1)")
    return problems, unchecked, total


def main(argv: Optional[list[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    machine = machine_packages()
    wheels = carried_wheels(machine=machine)
    if argv[:1] == ["check-wheels"] and len(argv) == 2:
        problems, unchecked, total = check_wheel_folder(Path(argv[1]), machine, wheels)
        for line in unchecked:
            print(f"unchecked: {line}")
        for line in problems:
            print(f"PROBLEM: {line}")
        print(f"{len(wheels)} wheels, {total} bytes ({total / 2**20:.2f} MiB) in {argv[1]}")
        return 1 if problems else 0
    if argv == ["preflight"]:
        missing = missing_here(wheels)
        absent = sorted(name for name, version in missing.items() if version is None)
        for name, version in sorted(missing.items()):
            if version is not None:
                print(f"note: {name} {version} is installed here; {WHEEL_LIST.name} lists {wheels[name]}")
        if absent:
            print(f"missing: {', '.join(absent)}. Download them with `bash benchmarks/gpu_wheels.sh` (into .whl/) "
                  "and bring .whl/ along: benchmarks/gpu.sh installs them from there.")
            return 1
        return 0
    print("usage: python benchmarks/_packages.py check-wheels FOLDER | preflight", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())

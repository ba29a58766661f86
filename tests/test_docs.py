"""The README's and the docs pages' links, paths, commands and code blocks point at what exists, so they cannot rot.

For every page (README.md, docs/*.md, tests/README.md, benchmarks/README.md), without loading a model or starting a
process:

* links: every relative link's file exists, and its ``#anchor`` is a heading of that file (GitHub's slugs);
* ``python`` blocks compile; every import in them resolves (the module imports, each imported name is an attribute
  or a submodule), and every keyword argument of a call to something imported is a parameter of it;
* shell commands (``bash`` / ``sh`` / ``console`` blocks, and inline spans that start with ``lightning-grpo``):
  ``lightning-grpo <sub>`` names a real subcommand and each ``--flag`` is an option of it (``--model.*``,
  ``--model.config.*``, ``--data.*``, ``--trainer.*`` against ``GRPOModule``, ``GRPOConfig`` (dataclass fields,
  nested ones too), ``PromptDataModule`` and ``lightning.Trainer``; ``serve`` / ``plot`` against their parsers);
  ``--config`` files, ``python`` / ``bash`` scripts and repository paths exist; inline ``--model.x`` style flags too;
* ``yaml`` blocks of a CLI config: every key under ``model`` / ``data`` / ``trainer`` is an argument;
* inline code: a repository path (``lightning_grpo/...``, ``tests/...``, ``recipes/...``, ...; globs and ``{a,b}``
  expanded) exists, a ``lightning_grpo.x.Y`` name resolves, and a call such as ``GRPOConfig(field=...)`` names
  real parameters;
* the README's package map and docs/architecture.md's file table list exactly the package's folders and files.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import importlib
import inspect
import re
import shlex
import types
import typing
from functools import cache
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "lightning_grpo"
PAGES = sorted([ROOT / "README.md", ROOT / "tests" / "README.md", ROOT / "benchmarks" / "README.md",
                *(ROOT / "docs").glob("*.md")])
#: the repository's top folders: an inline span or a command argument under one of them is a path that must exist
REPO_DIRS = ("lightning_grpo", "tests", "benchmarks", "recipes", "scripts", "docs")
#: options of LightningCLI's subcommands beyond the ``--model.*`` / ``--data.*`` / ``--trainer.*`` trees
CLI_OPTIONS = {"config", "print_config", "help", "seed_everything", "ckpt_path", "validate_before_fit"}
#: LightningCLI's ``--optimizer`` / ``--lr_scheduler``: a class path, whose own arguments follow (not checked here)
CLASS_OPTIONS = {"optimizer", "lr_scheduler"}
#: ``lightning-grpo <sub>`` dispatched by ``lightning_grpo.cli.main`` before LightningCLI
OWN_SUBCOMMANDS = ("serve", "health", "launch", "plot")


# ---------------------------------------------------------------------------------------------------------- markdown
@dataclasses.dataclass
class Block:
    """A fenced code block: its language (may be empty), its text, the line of its opening fence."""

    lang: str
    code: str
    line: int


def fenced_blocks(text: str) -> list[Block]:
    """The fenced code blocks of a markdown text, with their language and first line number."""
    blocks, lang, start, body = [], None, 0, []
    for number, line in enumerate(text.split("\n"), 1):
        if line.startswith("```"):
            if lang is None:
                lang, start, body = line[3:].strip().lower(), number, []
            else:
                blocks.append(Block(lang, "\n".join(body), start))
                lang = None
        elif lang is not None:
            body.append(line)
    return blocks


def prose(text: str) -> str:
    """The text outside fenced code blocks (one empty line in place of each code line, so numbers match)."""
    out, fenced = [], False
    for line in text.split("\n"):
        if line.startswith("```"):
            fenced = not fenced
            out.append("")
        else:
            out.append("" if fenced else line)
    return "\n".join(out)


def inline_spans(text: str) -> Iterator[tuple[int, str]]:
    """``(line number, content)`` of every inline code span outside code blocks (a span broken over two lines is
    joined with a space, as markdown renders it)."""
    outside = prose(text)
    for match in re.finditer(r"(?<!`)`([^`]+)`(?!`)", outside):
        if "\n\n" not in match.group(1):
            yield outside[: match.start()].count("\n") + 1, " ".join(match.group(1).split())


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(text: str) -> set[str]:
    found: set[str] = set()
    for heading in re.findall(r"^#{1,6} +(.+?) *#*$", prose(text), flags=re.MULTILINE):
        base = name = slug(heading)
        k = 0
        while name in found:
            k += 1
            name = f"{base}-{k}"
        found.add(name)
    return found


# --------------------------------------------------------------------------------------------- what the code offers
def _unwrap(annotation: Any) -> list[Any]:
    """The classes an annotation allows (``Optional[X]`` -> ``[X]``, ``Union[A, B]`` -> ``[A, B]``)."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return [a for a in typing.get_args(annotation) if a is not type(None)]
    return [annotation]


def _parameters(target: Any) -> Optional[dict[str, Any]]:
    """``name -> annotation`` of a dataclass's fields or a callable's parameters; None when it takes ``**kwargs``."""
    if dataclasses.is_dataclass(target) and isinstance(target, type):
        hints = typing.get_type_hints(target)
        return {f.name: hints.get(f.name, f.type) for f in dataclasses.fields(target)}
    function = target.__init__ if isinstance(target, type) else target
    try:
        signature = inspect.signature(function)
    except (TypeError, ValueError):
        return None
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in signature.parameters.values()):
        return None
    try:
        hints = typing.get_type_hints(function)
    except Exception:  # an unresolvable annotation only means no nested checks below this parameter
        hints = {}
    return {name: hints.get(name, p.annotation) for name, p in signature.parameters.items()
            if name != "self" and p.kind is not inspect.Parameter.VAR_POSITIONAL}


def unknown_key(target: Any, path: list[str]) -> Optional[str]:
    """Why ``path`` is not a chain of parameters of ``target`` (recursively through the dataclasses and classes their
    annotations name), or None when it is one."""
    if not path or path[0] in ("class_path", "init_args", "dict_kwargs"):
        return None  # a subclass given by class path: its arguments are the subclass's
    params = _parameters(target)
    if params is None:
        return None
    if path[0] not in params:
        return f"{path[0]!r} is no argument of {getattr(target, '__name__', target)}"
    if len(path) == 1:
        return None
    nested = [c for c in _unwrap(params[path[0]]) if isinstance(c, type)]
    if not nested:
        return None  # a dict, a list or a plain type: what is under it is a value
    misses = [unknown_key(c, path[1:]) for c in nested]
    return None if any(m is None for m in misses) else misses[0]


@cache
def cli_roots() -> dict[str, Any]:
    import lightning as L

    from lightning_grpo.data import PromptDataModule
    from lightning_grpo.module import GRPOModule

    return {"model": GRPOModule, "data": PromptDataModule, "trainer": L.Trainer}


@cache
def lightning_subcommands() -> tuple[str, ...]:
    from lightning_grpo.cli import GRPOCLI

    return tuple(GRPOCLI.subcommands())


class _Parser(Exception):
    """Carries the parser out of a main function at its ``parse_args`` call, before the main does anything."""


def _raise_parser(self: argparse.ArgumentParser, *args: Any, **kwargs: Any) -> None:
    raise _Parser(self)


def _argparse_options(main: Callable[[list[str]], None]) -> frozenset[str]:
    """The ``--options`` of the parser an argparse main builds (the main is stopped at its ``parse_args``)."""
    original = argparse.ArgumentParser.parse_args
    argparse.ArgumentParser.parse_args = _raise_parser  # type: ignore[method-assign]
    try:
        main([])
    except _Parser as stop:
        parser = stop.args[0]
    else:
        raise AssertionError(f"{main.__name__} never called parse_args")
    finally:
        argparse.ArgumentParser.parse_args = original  # type: ignore[method-assign]
    return frozenset(s[2:] for s in parser._option_string_actions if s.startswith("--"))


@cache
def own_subcommand_options() -> dict[str, frozenset[str]]:
    from lightning_grpo import cli

    assert all(f'"{name}"' in inspect.getsource(cli.main) for name in OWN_SUBCOMMANDS), "cli.main dispatch changed"
    return {"serve": _argparse_options(cli.serve_main), "health": _argparse_options(cli.health_main),
            "launch": _argparse_options(cli.launch_main), "plot": _argparse_options(cli.plot_main)}


def cli_flag_problem(subcommand: str, flag: str) -> Optional[str]:
    """Why ``lightning-grpo <subcommand> --<flag>`` is not an option (None when it is)."""
    flag = flag.split("=", 1)[0].rstrip("+")
    if subcommand in OWN_SUBCOMMANDS:
        options = own_subcommand_options()[subcommand]
        return None if flag in options else f"`lightning-grpo {subcommand}` has no option --{flag}"
    root, *path = flag.split(".")
    if root in CLASS_OPTIONS:
        return None
    if not path:
        return None if root in CLI_OPTIONS or root in cli_roots() else f"LightningCLI has no option --{flag}"
    if root not in cli_roots():
        return f"--{flag}: no --{root}.* options (only {sorted(cli_roots())})"
    missing = unknown_key(cli_roots()[root], path)
    return None if missing is None else f"--{flag}: {missing}"


# ------------------------------------------------------------------------------------------------------ the checks
def _path_exists(span: str) -> bool:
    """A repository path, with ``{a,b}`` alternatives and ``*`` globs, names at least one existing file or folder."""
    match = re.search(r"\{([^{}]*)\}", span)
    if match:
        return all(_path_exists(span[: match.start()] + alt + span[match.end():]) for alt in match.group(1).split(","))
    if "*" in span:
        return any(ROOT.glob(span.rstrip("/")))
    return (ROOT / span).exists()


def _is_repo_path(token: str) -> bool:
    return bool(re.fullmatch(r"(?:%s)/[\w./*{},-]*" % "|".join(REPO_DIRS), token)) and "..." not in token


def check_links(page: Path, text: str) -> list[str]:
    problems = []
    for number, line in enumerate(prose(text).split("\n"), 1):
        for target in re.findall(r"\]\(([^)\s]+)\)", line):
            if re.match(r"[a-z]+:", target):
                continue  # https:, mailto:
            file, _, anchor = target.partition("#")
            resolved = (page.parent / file).resolve() if file else page
            if not resolved.exists():
                problems.append(f"{page.name}:{number}: link to missing {target}")
            elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved.read_text()):
                problems.append(f"{page.name}:{number}: no heading #{anchor} in {resolved.relative_to(ROOT)}")
    return problems


def _resolve_dotted(name: str) -> Optional[str]:
    """Why the dotted name ``a.b.c`` is neither a module nor an attribute of one (None when it is one)."""
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for i, attr in enumerate(parts[cut:], cut):
            if not hasattr(obj, attr):
                try:
                    obj = importlib.import_module(".".join(parts[: i + 1]))
                    continue
                except ImportError:
                    return f"{'.'.join(parts[:i])} has no {attr!r}"
            obj = getattr(obj, attr)
        return None
    return f"no module {parts[0]!r}"


def _namespace(tree: ast.AST) -> dict[str, Any]:
    """What the imports of a snippet bind (alias -> object); raises ImportError/AttributeError for a missing one."""
    names: dict[str, Any] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                module = importlib.import_module(alias.name)
                names[alias.asname or alias.name.split(".")[0]] = (
                    module if alias.asname else importlib.import_module(alias.name.split(".")[0]))
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            module = importlib.import_module(node.module)
            for alias in node.names:
                if alias.name == "*":
                    continue
                if not hasattr(module, alias.name):
                    try:
                        importlib.import_module(f"{node.module}.{alias.name}")
                    except ImportError:
                        raise ImportError(f"cannot import {alias.name!r} from {node.module!r}") from None
                names[alias.asname or alias.name] = getattr(module, alias.name)
    return names


def _callee(func: ast.expr, names: dict[str, Any]) -> Any:
    if isinstance(func, ast.Name):
        return names.get(func.id)
    if isinstance(func, ast.Attribute):
        owner = _callee(func.value, names)
        return None if owner is None else getattr(owner, func.attr, None)
    return None


def _keyword_problems(tree: ast.AST, names: dict[str, Any]) -> list[str]:
    problems = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and node.keywords:
            target = _callee(node.func, names)
            if target is None or not callable(target):
                continue
            params = _parameters(target)
            for keyword in node.keywords:
                if params is not None and keyword.arg is not None and keyword.arg not in params:
                    problems.append(f"{ast.unparse(node.func)}() has no parameter {keyword.arg!r}")
    return problems


def check_python(page: Path, block: Block) -> list[str]:
    where = f"{page.name}:{block.line}"
    try:
        tree = compile(block.code, where, "exec", ast.PyCF_ONLY_AST)
        compile(tree, where, "exec")
    except SyntaxError as err:
        return [f"{where}: python block does not compile: {err}"]
    try:
        names = _namespace(tree)
    except (ImportError, AttributeError) as err:
        return [f"{where}: python block: {err}"]
    return [f"{where}: {problem}" for problem in _keyword_problems(tree, names)]


def _commands(code: str) -> Iterator[tuple[int, list[str]]]:
    """``(line offset, tokens)`` of each command of a shell block (continuations joined, comments, prompts and
    ``VAR=value`` prefixes dropped)."""
    lines = code.split("\n")
    i = 0
    while i < len(lines):
        start, line = i, lines[i]
        while line.endswith("\\") and i + 1 < len(lines):
            i += 1
            line = line[:-1] + " " + lines[i]
        i += 1
        line = re.sub(r"^\s*\$ ", "", line)
        try:
            tokens = shlex.split(line, comments=True)
        except ValueError:
            tokens = line.split()
        while tokens and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", tokens[0]):
            tokens = tokens[1:]
        if tokens:
            yield start, tokens


def check_command(where: str, tokens: list[str]) -> list[str]:
    problems = []
    tokens = [t for t in (t.strip("[]") for t in tokens) if t]
    program = tokens[0].removeprefix(".venv/bin/")
    args = tokens[1:]
    script = program in ("python", "python3", "bash", "sh") and bool(args) and not args[0].startswith("-")
    if script and not (ROOT / args[0]).is_file():
        problems.append(f"{where}: `{program} {args[0]}`: no such file")
    for previous, token in list(zip(tokens[:-1], args, strict=True))[1 if script else 0:]:
        if previous == "--config" and not (ROOT / token).is_file():
            problems.append(f"{where}: --config {token}: no such file")
        elif _is_repo_path(token) and not _path_exists(token):
            problems.append(f"{where}: {token}: no such path")
    if program != "lightning-grpo":
        return problems
    subcommand = args[0] if args else None
    if subcommand is None or subcommand.startswith("-"):
        return problems
    if subcommand not in lightning_subcommands() + OWN_SUBCOMMANDS:
        return problems + [f"{where}: `lightning-grpo {subcommand}` is no subcommand"]
    own, passed = args[1:], []
    if subcommand == "launch" and "--" in own:  # `launch ... -- <fit arguments>`
        own, passed = own[:own.index("--")], own[own.index("--") + 1:]
    for flags, checked_as in ((own, subcommand), (passed, "fit")):
        for token in flags:
            if token.startswith("--"):
                problem = cli_flag_problem(checked_as, token[2:])
                if problem:
                    problems.append(f"{where}: {problem}")
    return problems


def check_yaml(page: Path, block: Block) -> list[str]:
    where = f"{page.name}:{block.line}"
    try:
        config = yaml.safe_load(block.code)
    except yaml.YAMLError as err:
        return [f"{where}: yaml block does not parse: {err}"]
    if not isinstance(config, dict) or not set(config) & set(cli_roots()):
        return []  # not a lightning-grpo config

    def walk(value: Any, path: list[str]) -> Iterator[list[str]]:
        if isinstance(value, dict) and value and "class_path" not in value:
            for key, sub in value.items():
                yield from walk(sub, [*path, str(key)])
        else:
            yield path

    problems = []
    for path in walk(config, []):
        problem = cli_flag_problem("fit", ".".join(path))
        if problem:
            problems.append(f"{where}: yaml key {'.'.join(path)}: {problem}")
    return problems


def check_spans(page: Path, text: str) -> list[str]:
    problems = []
    top = {p.stem for p in PACKAGE.iterdir() if p.suffix == ".py" or (p / "__init__.py").exists()} - {"__init__"}
    inline_names = {"lightning_grpo": importlib.import_module("lightning_grpo"),
                    "L": importlib.import_module("lightning"),
                    **{n: getattr(importlib.import_module("lightning_grpo"), n) for n in ("GRPOConfig", "GRPOModule")},
                    "PromptDataModule": importlib.import_module("lightning_grpo.data").PromptDataModule,
                    "ModelCheckpoint": importlib.import_module("lightning.pytorch.callbacks").ModelCheckpoint}
    for number, span in inline_spans(text):
        where = f"{page.name}:{number}"
        if _is_repo_path(span):
            if "<" not in span and not _path_exists(span):
                problems.append(f"{where}: `{span}`: no such path")
        elif re.fullmatch(r"[\w/]+/\w+\.py", span):  # a package-relative module path
            if not any((base / span).exists() for base in (ROOT, PACKAGE, page.parent)):
                problems.append(f"{where}: `{span}`: no such file")
        dotted = re.match(r"lightning_grpo(\.[A-Za-z_]\w*)+", span)
        if dotted:
            problem = _resolve_dotted(dotted.group(0))
            if problem:
                problems.append(f"{where}: `{dotted.group(0)}`: {problem}")
        elif page.name == "architecture.md" and re.fullmatch(r"[a-z_]+(\.[A-Za-z_]\w*)+", span) \
                and span.split(".")[0] in top:
            problem = _resolve_dotted(f"lightning_grpo.{span}")
            if problem:
                problems.append(f"{where}: `{span}`: {problem}")
        tokens = span.split()
        if tokens and tokens[0].removeprefix(".venv/bin/") == "lightning-grpo":
            problems += check_command(where, tokens)
        elif tokens and re.fullmatch(r"--(model|data|trainer)\.[\w.]+(=.*)?", tokens[0]):
            problems += check_command(where, ["lightning-grpo", "fit", *tokens])
        if re.match(r"(%s|L\.Trainer|lightning_grpo\.[\w.]+)\(" % "|".join(inline_names), span):
            try:
                tree = ast.parse(span, mode="eval")
            except SyntaxError:
                continue
            problems += [f"{where}: {p}" for p in _keyword_problems(tree, inline_names)]
    return problems


def check_page(page: Path, text: str) -> list[str]:
    problems = check_links(page, text) + check_spans(page, text)
    for block in fenced_blocks(text):
        if block.lang == "python":
            problems += check_python(page, block)
        elif block.lang in ("bash", "sh", "console", "shell"):
            for offset, tokens in _commands(block.code):
                problems += check_command(f"{page.name}:{block.line + 1 + offset}", tokens)
        elif block.lang == "yaml":
            problems += check_yaml(page, block)
    return problems


# ------------------------------------------------------------------------------------------------------- the tests
@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_page_references_exist(page: Path) -> None:
    problems = check_page(page, page.read_text())
    assert not problems, "\n".join(problems)


BAD_PAGE = """# Bad

## A section

A [missing page](nowhere.md), a [missing anchor](architecture.md#no-such-heading), `lightning_grpo/no_such.py`,
`lightning_grpo.functional.no_such_function`, `GRPOConfig(no_such_field=1)` and
`--model.config.no_such_knob 4`.

```python
from lightning_grpo import GRPOConfig, NoSuchThing
```

```python
import lightning as L

trainer = L.Trainer(max_stepz=10)
```

```python
def broken(:
```

```bash
lightning-grpo fitt --config recipes/gsm8k_grpo.yaml
lightning-grpo fit --config recipes/no_such.yaml --model.config.num_generationz 4 --trainer.max_stepz 3
lightning-grpo fit --data.prompts_per_stepz 4 --model.lora.rank 8 --nope
lightning-grpo serve --model PATH --portz 8000
lightning-grpo launch --nodes 2 --nodez 2 -- --trainer.max_steps 3 --trainer.max_stepz 3
python recipes/no_such.py
bash scripts/no_such.sh tests/no_such_test.py
```

```yaml
model:
  config:
    num_generationz: 4
  lora:
    r: 16
trainer:
  max_stepz: 3
```
"""


def test_checker_flags_every_kind_of_rot() -> None:
    """The checker is not vacuous: each broken reference of a small bad page is reported, and only those."""
    problems = "\n".join(check_page(ROOT / "docs" / "_bad.md", BAD_PAGE))
    expected = [
        "link to missing nowhere.md", "no heading #no-such-heading in docs/architecture.md",
        "`lightning_grpo/no_such.py`: no such path", "lightning_grpo.functional has no 'no_such_function'",
        "GRPOConfig() has no parameter 'no_such_field'", "'no_such_knob' is no argument of GRPOConfig",
        "cannot import 'NoSuchThing' from 'lightning_grpo'", "L.Trainer() has no parameter 'max_stepz'",
        "python block does not compile", "`lightning-grpo fitt` is no subcommand",
        "--config recipes/no_such.yaml: no such file", "'num_generationz' is no argument of GRPOConfig",
        "--trainer.max_stepz: 'max_stepz' is no argument of Trainer",
        "'prompts_per_stepz' is no argument of PromptDataModule",
        "--model.lora.rank: 'rank' is no argument of LoraConfig", "LightningCLI has no option --nope",
        "`lightning-grpo serve` has no option --portz", "`lightning-grpo launch` has no option --nodez",
        "_bad.md:28: --trainer.max_stepz", "`python recipes/no_such.py`: no such file",
        "`bash scripts/no_such.sh`: no such file", "tests/no_such_test.py: no such path",
        "yaml key model.config.num_generationz", "yaml key trainer.max_stepz",
    ]
    for fragment in expected:
        assert fragment in problems, f"not flagged: {fragment}\n{problems}"
    assert len(problems.split("\n")) == len(expected), problems  # nothing valid (lora.r, --model PATH) is flagged


def test_checker_accepts_nested_config_flags() -> None:
    """A nested dataclass field resolves through its parent's annotation (``--model.lora.r``, a LoraConfig field)."""
    assert cli_flag_problem("fit", "model.lora.r") is None
    assert cli_flag_problem("fit", "model.config.num_generations") is None
    assert cli_flag_problem("fit", "trainer.callbacks+") is None
    assert cli_flag_problem("fit", "optimizer.momentum") is None and cli_flag_problem("fit", "lr_scheduler") is None
    assert cli_flag_problem("fit", "model.lora.rr") is not None


def _table_paths(text: str, section: str) -> set[str]:
    """The backticked ``lightning_grpo/...`` paths in the first column of the tables under ``## <section>``."""
    body = text.split(f"\n## {section}\n", 1)[1].split("\n## ", 1)[0]
    paths = set()
    for row in re.findall(r"^\| ([^|]+) \|", body, flags=re.MULTILINE):
        paths.update(p for p in re.findall(r"`([^`]+)`", row) if p.startswith("lightning_grpo/"))
    return paths


def test_readme_package_map_matches_the_tree() -> None:
    entries = {f"lightning_grpo/{p.name}/" if p.is_dir() else f"lightning_grpo/{p.name}" for p in PACKAGE.iterdir()
               if (p.suffix == ".py" and p.name != "__init__.py") or (p / "__init__.py").exists()}
    assert _table_paths((ROOT / "README.md").read_text(), "How it fits together") == entries


def test_architecture_file_table_matches_the_tree() -> None:
    files = {str(p.relative_to(ROOT)) for p in PACKAGE.rglob("*.py") if p.name != "__init__.py"}
    assert _table_paths((ROOT / "docs" / "architecture.md").read_text(), "Files") == files


def test_readme_is_a_newcomers_page() -> None:
    """The README stays short, keeps the two set-up commands, and links every docs page."""
    text = (ROOT / "README.md").read_text()
    assert len(text.encode()) < 10_000
    commands = [tokens for block in fenced_blocks(text) if block.lang == "bash" for _, tokens in _commands(block.code)]
    assert ["bash", "scripts/train.sh"] in commands and ["bash", "scripts/test.sh"] in commands
    linked = {(ROOT / t.split("#")[0]).resolve() for t in re.findall(r"\]\(([^)#\s]+)", text)}
    assert {p.resolve() for p in (ROOT / "docs").glob("*.md")} - linked == set()


def test_argparse_option_reader_reads_the_parser() -> None:
    """The serve/plot option reader sees exactly the options the parser was given, and stops the main before it runs."""
    ran = []

    def main(argv: list[str]) -> None:
        parser = argparse.ArgumentParser(description="see --not-an-option in the text")
        parser.add_argument("--alpha-beta")
        parser.add_argument("-q", "--quiet", action="store_true")
        parser.parse_args(argv)
        ran.append(True)

    assert _argparse_options(main) == {"alpha-beta", "quiet", "help"}
    assert ran == [] and argparse.ArgumentParser.parse_args is not _raise_parser

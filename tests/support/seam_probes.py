"""The probes of the package that cross a seam at run time, counted the way architecture review 3 (section 1.3) did.

Review 3 grepped ``isinstance|getattr(|hasattr(`` over ``lightning_grpo`` and classified each line by hand; a line
"crosses a seam" when what it asks about is a component that another part of the package, or Lightning, hands over
(a model or policy, an engine, a backend or strategy, a datamodule, a reward function, a callback, a logger, an
optimizer, a batch, a sampler, a sandbox) instead of being declared where it is made. The other lines check a value
where it enters, probe a library's surface (HF configs and modules, PEFT layers, DTensor, FSDP, vLLM, megatron-core,
the standard library), reflect over a record's fields, walk a syntax tree, read the object's own attributes or test an
exception's type.

This module makes that classification a rule plus a table, so the figure can be reproduced and a new probe cannot go
uncounted: each probe call is classified by the first rule that applies,

0. :data:`SEAMS` lists the probes that no rule below can see as seams (a type or a member name held in a variable):
   **seams**;
1. ``isinstance`` against ``ast`` classes: a syntax tree; against exception classes: an error's type; against
   builtins, the standard library, ``numbers``, ``torch.Tensor``/``torch.device``, ``nn.Module`` subclasses of torch
   or a third-party library other than Lightning and PEFT (FSDP units, megatron-core's optimizers): a value or a
   library's surface;
2. ``isinstance`` against a class the package defines (a ``Protocol`` or a concrete class), a class of Lightning
   (``lightning.*``) or ``peft.PeftModel``: **a seam**, unless :data:`NOT_SEAMS` says why not (a user value checked
   where it enters);
3. ``getattr``/``hasattr`` with a computed name: reflection; on ``self``: the object's own attribute;
4. ``getattr``/``hasattr`` with a constant name that no package class declares: a library's or Python's surface,
   except on a Lightning object (a subject naming the trainer, strategy, precision plugin, LightningModule,
   optimizer, logger or callback): **a seam** (Lightning's surface);
5. ``getattr``/``hasattr`` with a constant name some package class declares: :data:`NAMED` says which it is (a named
   reach-in across a seam, or a library attribute that shares a name with one of ours); a probe it does not list
   fails :func:`unclassified`.

A line holding a seam probe counts once (as in the review, which counted lines). Run
``PYTHONPATH=tests python -m support.seam_probes [ROOT]`` for the table and the count (``ROOT``: a checkout, default
this one); ``tests/test_architecture.py`` checks the count and that docs/architecture.md names each remaining one.
"""

from __future__ import annotations

import ast
import builtins
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional

ROOT = Path(__file__).resolve().parents[2]
PROBE_LINE = re.compile(r"isinstance|getattr\(|hasattr\(")

#: Type names that are values, library surface or standard library (rule 1), besides builtins and exceptions.
VALUE_TYPES = {
    "Mapping", "Sequence", "Tensor", "torch.Tensor", "Fraction", "numbers.Integral", "numbers.Real", "type",
    "functools.partial", "torch.device", "nn.Module", "nn.Linear", "nn.Dropout", "nn.ModuleList", "FSDPModule",
    "FullyShardedDataParallel", "MixedPrecisionPolicy", "ChainedOptimizer", "LoraConfig",
}
#: Library-object names in a getattr subject that mark Lightning's surface (rule 4).
LIGHTNING_SUBJECTS = ("trainer", "strategy", "precision_plugin", "lightning_module", "optimizer", "logger",
                      "callback")
#: Rule 0, ``(path, call) -> why``: seam probes whose type or member name is a variable.
SEAMS: dict[tuple[str, str], str] = {
    ("lightning_grpo/callbacks/completions.py", "isinstance(logger, cls)"):
        "Lightning's loggers: which of them receives the completion table, and how (picked once at setup)",
    ("lightning_grpo/rollout/adapter.py", "getattr(engine, name)"):
        "which members of RolloutEngine a user engine declares (read once, when it enters)",
    ("lightning_grpo/rollout/adapter.py", "hasattr(engine, name)"):
        "which members of RolloutEngine a user engine declares (read once, when it enters)",
}
#: Rule 2 exceptions, ``(path, call) -> why the probe is no seam``: package types checked where a user value enters.
NOT_SEAMS: dict[tuple[str, str], str] = {
    ("lightning_grpo/episodes/environment.py", "isinstance(result, EnvStep)"):
        "validates what a user environment's step returned (a TypeError names it)",
    ("lightning_grpo/episodes/tools.py", "isinstance(spec, Tool)"):
        "normalizes the module's tools= argument where it enters",
    ("lightning_grpo/episodes/build.py", "isinstance(agent, AgentRollout)"):
        "normalizes the module's agent= argument (a function or its AgentRollout settings) where it enters",
    ("lightning_grpo/config.py", "isinstance(getattr(self, name), group)"):
        "validates a config group the user passed",
    ("lightning_grpo/config/groups.py", "isinstance(getattr(self, name), group)"):
        "validates a config group the user passed",
    ("lightning_grpo/config/__init__.py", "isinstance(getattr(self, name), group)"):
        "validates a config group the user passed",
    ("lightning_grpo/config/grpo.py", "isinstance(getattr(self, name), group)"):
        "validates a config group the user passed",
    ("lightning_grpo/rewards/plain_data.py", "isinstance(err, PlainDataError)"): "an error's type",
    ("lightning_grpo/episodes/python_tool.py", "isinstance(sandbox, PythonSandbox)"):
        "validates the sandbox a user passes to python_tool, where it enters (a TypeError names it)",
}
#: Rule 5, ``(path, call) -> (seam?, why)``: constant names that a package class declares too.
NAMED: dict[tuple[str, str], tuple[bool, str]] = {
    ("lightning_grpo/callbacks/progress.py", "getattr(batch, 'step_end', True)"):
        (True, "reads a field of the loop's batch by name"),
    ("lightning_grpo/strategies/megatron/strategy.py", "getattr(self.lightning_module, 'policy', None)"):
        (True, "reaches into the LightningModule for its policy"),
    ("lightning_grpo/models/lora.py", "getattr(root, attribute)"): (True, "reaches into the module for its policy"),
    ("lightning_grpo/strategies/megatron/policy.py", "getattr(self.hf_model, 'config', None)"):
        (False, "an HF model's config"),
    ("lightning_grpo/rollout/engines/probe.py", "getattr(model, 'config', None)"): (False, "an HF model's config"),
    ("lightning_grpo/training/logprobs.py", "getattr(model, 'config', None)"): (False, "an HF model's config"),
    ("lightning_grpo/training/logprob_head.py", "getattr(model, 'config', None)"): (False, "an HF model's config"),
    ("lightning_grpo/models/loading.py", "getattr(model, 'config', None)"): (False, "an HF model's config"),
    ("lightning_grpo/models/moe.py", "getattr(model, 'config', None)"): (False, "an HF model's config"),
    ("lightning_grpo/models/moe.py", "getattr(config, 'model_type', '')"): (False, "an HF config's model type"),
    ("lightning_grpo/models/moe.py", "getattr(config, 'model_type', None)"): (False, "an HF config's model type"),
    ("lightning_grpo/training/routing_replay.py", "getattr(model, 'config', None)"): (False, "an HF model's config"),
    ("lightning_grpo/training/routing_replay.py", "getattr(config_of_model, 'model_type', None)"):
        (False, "an HF config's model type"),
    ("lightning_grpo/models/lora.py", "getattr(base_model(policy), 'config', None)"): (False, "an HF model's config"),
    ("lightning_grpo/models/hf_weights.py", "getattr(model, 'config', None)"): (False, "an HF model's config"),
    ("lightning_grpo/strategies/module_weights.py", "getattr(model, 'config', None)"): (False, "an HF model's config"),
    ("lightning_grpo/strategies/module_weights.py", "getattr(base, 'config', None)"): (False, "an HF model's config"),
    ("lightning_grpo/rollout/engines/hf.py", "getattr(model, 'generation_config', None)"):
        (False, "an HF model's generation config"),
    ("lightning_grpo/rollout/engines/hf.py", "getattr(self.model, 'generation_config', None)"):
        (False, "an HF model's generation config"),
    ("lightning_grpo/episodes/build.py", "getattr(policy, 'generation_config', None)"):
        (False, "an HF model's generation config"),
    ("lightning_grpo/rollout/engines/vllm/colocated.py",
     "getattr(model_config.hf_text_config, 'tie_word_embeddings', False)"):
        (False, "vLLM's model config"),
    ("lightning_grpo/rollout/server/async_engine.py",
     "getattr(model_config.hf_text_config, 'tie_word_embeddings', False)"):
        (False, "vLLM's model config"),
    ("lightning_grpo/strategies/megatron/model.py", "getattr(config, 'tie_word_embeddings', False)"):
        (False, "an HF config"),
    ("lightning_grpo/strategies/megatron/model.py", "getattr(config, 'pad_token_id', None)"): (False, "an HF config"),
    ("lightning_grpo/strategies/megatron/model.py", "getattr(config, 'head_dim', None)"): (False, "an HF config"),
    ("lightning_grpo/rollout/engines/vllm/kv_cache.py", "getattr(text, 'head_dim', None)"): (False, "an HF config"),
    ("lightning_grpo/strategies/backend.py", "getattr(gradient_clip_algorithm, 'value', gradient_clip_algorithm)"):
        (False, "Lightning's GradClipAlgorithmType enum value (a user setting)"),
    ("lightning_grpo/rollout/server/vllm_extension.py", "getattr(self, 'rank', 0)"): (False, "vLLM worker's rank"),
    ("lightning_grpo/rollout/server/asgi.py", "getattr(err, 'headers', None)"): (False, "Starlette's HTTP error"),
    ("lightning_grpo/models/hf_weights.py", "getattr(layer, 'merged', False)"): (False, "a PEFT LoRA layer"),
    ("lightning_grpo/models/hf_weights.py", "getattr(layer, 'disable_adapters', False)"): (False, "a PEFT LoRA layer"),
    ("lightning_grpo/models/hf_weights.py", "hasattr(m, k)"): (False, "a PEFT LoRA layer"),
    ("lightning_grpo/rollout/prompts.py", "getattr(tokenizer, 'name_or_path', '')"): (False, "an HF tokenizer"),
    ("lightning_grpo/rollout/prompts.py", "getattr(tokenizer, 'chat_template', None)"): (False, "an HF tokenizer"),
    ("lightning_grpo/episodes/chat.py", "getattr(tokenizer, 'chat_template', None)"): (False, "an HF tokenizer"),
    ("lightning_grpo/rewards/pool.py", "getattr(fn, '__name__', None)"): (False, "a function's name"),
    ("lightning_grpo/rewards/scoring.py", "getattr(fn, '__name__', None)"): (False, "a function's name"),
    ("lightning_grpo/episodes/tools.py", "getattr(function, '__name__', function)"): (False, "a function's name"),
    ("lightning_grpo/rewards/code_harness.py", "getattr(_builtins, kind, None)"): (False, "the builtins"),
    ("lightning_grpo/strategies/megatron/pipeline.py", "hasattr(model, 'module')"):
        (False, "megatron-core's DDP wrapper"),
    ("lightning_grpo/strategies/megatron/pipeline.py", "hasattr(model, 'post_process')"):
        (False, "megatron-core's GPTModel"),
    ("lightning_grpo/strategies/megatron/strategy.py", "getattr(p, 'shared', False)"):
        (False, "megatron-core's parameter attribute"),
    ("lightning_grpo/strategies/megatron/strategy.py", "getattr(p, 'tensor_model_parallel', False)"):
        (False, "megatron-core's parameter attribute"),
    ("lightning_grpo/models/dropout.py", "getattr(module, 'attention_dropout', None)"): (False, "an HF attention"),
    ("lightning_grpo/models/embedded.py", "hasattr(model.config, 'quantization_config')"): (False, "an HF config"),
    ("lightning_grpo/cli.py", "getattr(config, 'max_prompt_length', GRPOConfig().max_prompt_length)"):
        (False, "the parsed command line's config (a user value)"),
    ("lightning_grpo/models/lora.py", "getattr(getattr(base_model(policy), 'config', None), 'tie_word_embeddings', "
     "False)"): (False, "an HF config"),
    ("lightning_grpo/rollout/engines/probe.py", "getattr(getattr(model, 'config', None), 'vocab_size', 0)"):
        (False, "an HF config"),
    ("lightning_grpo/strategies/local.py", "getattr(self.strategy, 'world_size', 1)"):
        (True, "Lightning's surface: the strategy's world size by name"),
    ("lightning_grpo/strategies/megatron/model.py", "getattr(config, 'model_type', None)"): (False, "an HF config"),
    ("lightning_grpo/strategies/megatron/model.py", "getattr(config, 'rope_theta', None)"): (False, "an HF config"),
    ("lightning_grpo/training/logprob_head.py", "getattr(config, 'model_type', '')"): (False, "an HF config"),
    ("lightning_grpo/training/layout_limits.py", "getattr(each, 'model_type', '')"): (False, "an HF config"),
    ("lightning_grpo/training/logprobs.py", "getattr(config, 'model_type', '')"): (False, "an HF config"),
    ("lightning_grpo/models/lora.py", "getattr(getattr(base, 'config', None), 'tie_word_embeddings', False)"):
        (False, "an HF config"),
    ("lightning_grpo/models/lora.py", "getattr(base, 'config', None)"): (False, "an HF model's config"),
    ("lightning_grpo/strategies/module_weights.py", "getattr(config, 'tie_word_embeddings', False)"):
        (False, "an HF config"),
    ("lightning_grpo/strategies/module_weights.py", "getattr(config, 'vocab_size', 0)"): (False, "an HF config"),
    ("lightning_grpo/protocols/vision.py", "getattr(config, 'model_type', '')"): (False, "an HF config"),
    ("lightning_grpo/demos/tiny_vision_models.py", "getattr(text_config, 'tie_word_embeddings', False)"):
        (False, "an HF config"),
}


@dataclass(frozen=True)
class Probe:
    """One ``isinstance``/``getattr``/``hasattr`` call: where, its source, and how it is classified."""

    path: str
    line: int
    call: str
    seam: bool
    why: str


def _dotted(node: ast.AST) -> str:
    return ast.unparse(node)


def declared_names(root: Path) -> set[str]:
    """Every attribute name a class of the package declares: methods, properties, class-level names and fields, and
    ``self.<name> = ...`` assignments in its methods."""
    names: set[str] = set()
    for path in (root / "lightning_grpo").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ClassDef):
                continue
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    names.add(item.name)
                elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                    names.add(item.target.id)
                elif isinstance(item, ast.Assign):
                    names.update(t.id for t in item.targets if isinstance(t, ast.Name))
            for sub in ast.walk(node):
                targets = sub.targets if isinstance(sub, ast.Assign) else [sub.target] if isinstance(
                    sub, ast.AnnAssign) else []
                for t in targets:
                    if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self":
                        names.add(t.attr)
    return names


def package_classes(root: Path) -> set[str]:
    """The names of the classes the package defines."""
    return {node.name for path in (root / "lightning_grpo").rglob("*.py")
            for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.ClassDef)}


def _imported_from(tree: ast.Module) -> dict[str, str]:
    """``name -> module`` of every ``from module import name`` in a module."""
    found = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            for alias in node.names:
                found[alias.asname or alias.name] = node.module
    return found


def _is_exception(name: str) -> bool:
    value = getattr(builtins, name, None)
    return (isinstance(value, type) and issubclass(value, BaseException)) or name.endswith(("Error", "Exception"))


def _classify_isinstance(path: str, call: str, types_: list[str], imports: dict[str, str],
                         classes: set[str]) -> tuple[bool, str]:
    if all(t.startswith("ast.") for t in types_):
        return False, "a syntax tree"
    if all(_is_exception(t.rsplit(".", 1)[-1]) for t in types_):
        return False, "an error's type"
    seams = []
    for t in types_:
        origin = imports.get(t.split(".")[0], "")
        if origin.startswith("lightning_grpo") or (t in classes and not origin):
            seams.append(f"the package's {t}")
        elif origin.startswith("lightning"):
            seams.append(f"Lightning's {t}")
        elif t == "PeftModel":
            seams.append("peft's PeftModel (what the policy is)")
    if not seams:
        return False, "a value or a library's surface"
    if (path, call) in NOT_SEAMS:
        return False, NOT_SEAMS[(path, call)]
    return True, "isinstance on " + ", ".join(seams)


def probes(root: Path = ROOT) -> Iterator[Probe]:
    """Every probe call on a line the review's grep matches, classified (module docstring)."""
    names, classes = declared_names(root), package_classes(root)
    for file in sorted((root / "lightning_grpo").rglob("*.py")):
        path = file.relative_to(root).as_posix()
        text = file.read_text()
        tree = ast.parse(text)
        imports = _imported_from(tree)
        lines = {i for i, line in enumerate(text.splitlines(), 1) if PROBE_LINE.search(line)}
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                    and node.func.id in ("isinstance", "getattr", "hasattr") and node.lineno in lines
                    and len(node.args) >= 2):
                continue
            call = _dotted(node)
            subject, what = node.args[0], node.args[1]
            if (path, call) in SEAMS:
                seam, why = True, SEAMS[(path, call)]
            elif node.func.id == "isinstance":
                types_ = [_dotted(e) for e in what.elts] if isinstance(what, ast.Tuple) else [_dotted(what)]
                if all(t in VALUE_TYPES or t in dir(builtins) for t in types_) and not any(
                        _is_exception(t) for t in types_):
                    seam, why = False, "a value or a library's surface"
                else:
                    seam, why = _classify_isinstance(path, call, types_, imports, classes)
            elif not (isinstance(what, ast.Constant) and isinstance(what.value, str)):
                seam, why = False, "reflection (a computed name)"
            elif isinstance(subject, ast.Name) and subject.id == "self":
                seam, why = False, "the object's own attribute"
            elif what.value in names:
                if (path, call) not in NAMED:
                    seam, why = True, "UNCLASSIFIED: a name a package class declares (add it to NAMED)"
                else:
                    seam, why = NAMED[(path, call)]
            elif any(part in _dotted(subject).lower() for part in LIGHTNING_SUBJECTS):
                seam, why = True, f"Lightning's surface ({what.value!r})"
            else:
                seam, why = False, "a library's or Python's surface"
            yield Probe(path, node.lineno, call, seam, why)


def seam_lines(root: Path = ROOT) -> list[Probe]:
    """The seam-crossing probes, one per line (the first seam probe of a line stands for it)."""
    seen: dict[tuple[str, int], Probe] = {}
    for probe in probes(root):
        if probe.seam and (probe.path, probe.line) not in seen:
            seen[(probe.path, probe.line)] = probe
    return sorted(seen.values(), key=lambda p: (p.path, p.line))


def unclassified(root: Path = ROOT) -> list[Probe]:
    """Probes of rule 5 that :data:`NAMED` does not list."""
    return [p for p in probes(root) if p.why.startswith("UNCLASSIFIED")]


def probe_line_count(root: Path = ROOT) -> int:
    """The review's grep: lines of the package matching ``isinstance|getattr(|hasattr(``."""
    return sum(1 for f in (root / "lightning_grpo").rglob("*.py") for line in f.read_text().splitlines()
               if PROBE_LINE.search(line))


def main(argv: Optional[list[str]] = None) -> None:
    root = Path((argv or sys.argv[1:] or [str(ROOT)])[0]).resolve()
    seams = seam_lines(root)
    for p in seams:
        print(f"{p.path}:{p.line}: {p.call}  -- {p.why}")
    print(f"{len(seams)} of {probe_line_count(root)} probe lines cross a seam")


if __name__ == "__main__":
    main()

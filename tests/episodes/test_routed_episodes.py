"""Routed experts of multi-turn episodes (routing replay R3): the turn loop accumulates, turn by turn, the experts
of the tokens each engine call fed to the model (the prompt in turn 0, each model token when the next was sampled,
a turn's last token and the environment's tokens in the next turn's prefill), so that every token of an episode
carries the experts its routers chose, at its place in ``[prompt, completion]``; checked against a forward of each
whole episode, position by position, with the HF engine on a tiny Qwen3-MoE."""

from dataclasses import replace

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from lightning_grpo.episodes import ChatFormat, EpisodeRunner, HermesToolCallParser
from lightning_grpo.models.moe import MoeRouters
from lightning_grpo.protocols.engine import EngineCapabilities
from lightning_grpo.protocols.rollout import completion_mask_from_eos
from lightning_grpo.protocols.sampler import EncodedPrompts
from lightning_grpo.protocols.sampling import SamplingConfig
from lightning_grpo.rollout.engines.hf import HFRolloutEngine
from support.episodes import EchoEnvironment


class EndingEngine:
    """The HF engine whose model turns end after 2, 3, 4, ... tokens (row by row): the last token is replaced by EOS
    (a random tiny model never samples it). That token was never fed to the model, so its routed experts stay -1
    (the next turn's prefill records them)."""

    capabilities = EngineCapabilities(uses_policy_parameters=True)

    def __init__(self, engine: HFRolloutEngine, eos: int) -> None:
        self.engine, self.eos, self.calls = engine, eos, 0

    @property
    def pad_token_id(self) -> int:
        return self.engine.pad_token_id

    def generate(self, prompt_ids, num_generations, sampling):
        out = self.engine.generate(prompt_ids, num_generations, sampling)
        ids, routed = out.completion_ids.clone(), out.completion_routed_experts.clone()
        for row in range(len(ids)):
            end = 2 + (row + self.calls) % 3
            ids[row, end - 1], ids[row, end:] = self.eos, self.pad_token_id
            routed[row, end - 1:] = -1
        self.calls += 1
        mask, truncated = completion_mask_from_eos(ids, [self.eos])
        return replace(out, completion_ids=ids, completion_mask=mask, truncated=truncated,
                       completion_routed_experts=routed)


@pytest.fixture(scope="module")
def policy(tiny_qwen3_moe_path):
    model = AutoModelForCausalLM.from_pretrained(tiny_qwen3_moe_path, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(tiny_qwen3_moe_path), MoeRouters(model)


def test_each_tokens_experts_are_accumulated_over_the_turns(policy):
    model, tokenizer, routers = policy
    _check_episodes(EndingEngine(HFRolloutEngine(model, tokenizer, routing=routers), tokenizer.eos_token_id), policy)


@pytest.mark.engine
def test_the_vllm_engines_routing_is_accumulated_over_the_turns(policy, tiny_qwen3_moe_path, vllm_engine):
    """The same with the colocated vLLM engine recording the routing in its worker, on a prompt of more than 256
    tokens: each turn's prompt repeats the episode so far, which vLLM takes from its prefix cache where whole
    128-token blocks of it were computed by an earlier request, of this turn or an earlier one (the recorder fills those
    positions from that request)."""
    pytest.importorskip("vllm")
    from lightning_grpo.rollout.engines.vllm.routing_capture import _CAPTURERS

    _, tokenizer, _ = policy
    engine = vllm_engine(tiny_qwen3_moe_path, record_routing=True)
    _check_episodes(EndingEngine(engine, tokenizer.eos_token_id), policy, "Add these: " + "1 + 2 + 3 + " * 30)
    records = engine.llm.collective_rpc(lambda w: [(r.tag, r.first) for r in _CAPTURERS[w].records.values()])[0]
    hits = {tag.split(":")[0] for tag, first in records if tag is not None and first}  # the calls with a cache hit
    assert len(hits) == 3  # the first turn's call (a sibling's blocks) and each later turn's (an earlier turn's)


def _check_episodes(engine, policy, question="What is 1 + 1?"):
    model, tokenizer, routers = policy
    eos = tokenizer.eos_token_id
    runner = EpisodeRunner(ChatFormat(tokenizer, [eos], [], HermesToolCallParser()), lambda: EchoEnvironment(turns=3),
                           max_turns=3, max_tokens=400)
    prompts = [[{"role": "user", "content": question}], [{"role": "user", "content": "Say hi"}]]
    prompt_ids, _ = runner.encode_prompts(prompts, 1024)
    torch.manual_seed(0)
    out = runner.sample(engine, EncodedPrompts.of(prompt_ids), 2, SamplingConfig(max_new_tokens=6))
    assert [e.model_turns for e in out.episodes] == [3] * 4 and out.env_mask.sum() > 0
    n, t = out.completion_ids.shape
    assert out.prompt_routed_experts.shape == (*out.prompt_ids.shape, 2, 2)
    assert out.completion_routed_experts.shape == (n, t, 2, 2)
    real = (out.completion_mask | out.env_mask).bool()
    assert (out.prompt_routed_experts[~out.prompt_mask.bool()] == -1).all()
    assert (out.completion_routed_experts[~real] == -1).all()
    for row in range(n):
        prompt = out.prompt_ids[row][out.prompt_mask[row].bool()]
        length = int(real[row].sum())
        ids = torch.cat([prompt, out.completion_ids[row, :length]])
        with torch.no_grad(), routers.record() as calls:
            model(ids[None])
        own = calls[0].sort(dim=-1).values  # the whole episode routed in one forward
        assert torch.equal(out.prompt_routed_experts[row][out.prompt_mask[row].bool()].sort(-1).values,
                           own[: len(prompt)])
        routed = out.completion_routed_experts[row, :length]
        assert (routed[:-1] >= 0).all() and (routed[-1] == -1).all()  # only the episode's last token was never fed
        assert torch.equal(routed[:-1].sort(-1).values, own[len(prompt): len(prompt) + length - 1]), row

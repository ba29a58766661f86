"""Routing replay and the load-balancing loss in the trainer (:mod:`lightning_grpo.training.routing_replay`): the routed
experts reach every forward layout position by position (padded, packed and shared-prefix layouts give the logprobs of
each sequence replayed alone), survive micro-batching and checkpoints with their tokens, "R2" records the old
policy's routing, the routers' disagreement is counted exactly, and the load-balancing loss is transformers' on one
micro-batch. A tiny random Qwen3-MoE, no Trainer."""

import dataclasses
import math

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

from lightning_grpo import GRPOConfig
from lightning_grpo import functional as F
from lightning_grpo.episodes.build import rollout_path
from lightning_grpo.experience.passes import LogprobPasses
from lightning_grpo.loop.resume import experience_from_state, experience_state
from lightning_grpo.models.moe import MoeRouters
from lightning_grpo.protocols.collectives import Collectives
from lightning_grpo.protocols.rollout import RolloutOutput, StopFlag
from lightning_grpo.protocols.tokens import token_fields
from lightning_grpo.training.experience import Experience, micro_batches
from lightning_grpo.training.logprobs import CompletionLogprobs
from lightning_grpo.training.packing import arrange, padded_source
from lightning_grpo.training.routing_replay import DISAGREEMENT, PolicyRouting
from support.moe import experts_of

LAYERS, TOP_K, EXPERTS = 2, 2, 8
#: rows 0, 1, 3 share a prompt, rows 4, 5 share another; row 2 has no loss tokens
GROUPS = ([0, 1, 3], [4, 5])
LAYOUTS = {"padded": dict(padding_free=False), "packed": dict(shared_prefix=False),
           "shared_prefix": dict(shared_prefix=True)}


@pytest.fixture(scope="module")
def policy(tiny_qwen3_moe_path):
    model = AutoModelForCausalLM.from_pretrained(tiny_qwen3_moe_path, dtype=torch.float32).eval()
    return model, MoeRouters(model)


def _experience(routed: bool = True) -> Experience:
    g = torch.Generator().manual_seed(0)
    prompt_lengths, completion_lengths = [5, 5, 3, 5, 2, 2], [4, 1, 0, 3, 4, 2]
    prompt_ids = torch.zeros(6, 5, dtype=torch.long)
    prompt_mask = torch.zeros(6, 5, dtype=torch.long)
    for group in (*GROUPS, [2]):
        length = prompt_lengths[group[0]]
        ids = torch.randint(3, 2000, (length,), generator=g)
        for row in group:
            prompt_ids[row, 5 - length:], prompt_mask[row, 5 - length:] = ids, 1  # left-padded
    completion_ids = torch.randint(3, 2000, (6, 4), generator=g)
    completion_mask = torch.tensor([[1] * n + [0] * (4 - n) for n in completion_lengths])
    batch = Experience(prompt_ids=prompt_ids, prompt_mask=prompt_mask, completion_ids=completion_ids,
                       completion_mask=completion_mask, advantages=torch.linspace(-1, 1, 6))
    if routed:
        batch.prompt_routed_experts = experts_of(prompt_ids, prompt_mask, LAYERS, TOP_K, EXPERTS)
        batch.completion_routed_experts = experts_of(completion_ids, completion_mask, LAYERS, TOP_K, EXPERTS)
    return batch


def _computer(policy, mode="R3", **knobs) -> tuple[CompletionLogprobs, PolicyRouting]:
    config = GRPOConfig(routing_replay=mode, **knobs)
    routing = PolicyRouting(config, policy[1])
    computer = CompletionLogprobs(config)
    computer.use_routing(routing)
    return computer, routing


def _alone(policy, batch: Experience) -> torch.Tensor:
    """Each sequence alone, unpadded, replaying its own routed experts: its logprobs at its loss tokens."""
    model, routers = policy
    out = torch.zeros(batch.completion_ids.shape)
    for row in range(len(batch)):
        n = int(batch.completion_mask[row].sum())
        if n == 0:
            continue
        real = batch.prompt_mask[row].bool()
        ids = torch.cat([batch.prompt_ids[row][real], batch.completion_ids[row, :n]])
        experts = torch.cat([batch.prompt_routed_experts[row][real], batch.completion_routed_experts[row, :n]])
        with torch.no_grad(), routers.replay(experts):
            logits = model(ids[None]).logits[0]
        p = int(real.sum())
        out[row, :n] = F.token_logprobs(logits[p - 1 : p - 1 + n][None], ids[p:][None], 1.0)[0][0]
    return out


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_every_layout_replays_each_tokens_experts(policy, layout):
    """The replayed logprobs of the padded, packed and shared-prefix layouts are each sequence's replayed alone, and
    differ from the unreplayed ones (the routed experts are not the routers' own)."""
    batch = _experience()
    computer, _ = _computer(policy, **LAYOUTS[layout])
    with torch.no_grad():
        replayed, _ = computer(policy[0], batch)
        plain, _ = CompletionLogprobs(GRPOConfig(**LAYOUTS[layout]))(policy[0], batch)
    mask = batch.completion_mask.bool()
    torch.testing.assert_close(replayed[mask], _alone(policy, batch)[mask], atol=1e-5, rtol=0)
    assert (replayed - plain)[mask].abs().max() > 1e-2


def test_the_own_routing_replayed_gives_the_plain_logprobs_in_the_packed_layout(policy):
    """The routing the model chooses itself (recorded row by row), replayed in the packed layout, changes no
    logprob."""
    model, routers = policy
    batch = _experience(routed=False)
    prompt = torch.full((6, 5, LAYERS, TOP_K), -1, dtype=torch.int16)
    completion = torch.full((6, 4, LAYERS, TOP_K), -1, dtype=torch.int16)
    for row in range(6):
        real, n = batch.prompt_mask[row].bool(), int(batch.completion_mask[row].sum())
        with torch.no_grad(), routers.record() as calls:
            model(torch.cat([batch.prompt_ids[row][real], batch.completion_ids[row, :n]])[None])
        prompt[row, real], completion[row, :n] = calls[0][: int(real.sum())], calls[0][int(real.sum()):]
    batch.prompt_routed_experts, batch.completion_routed_experts = prompt, completion
    computer, _ = _computer(policy, shared_prefix=False)
    with torch.no_grad():
        replayed, _ = computer(model, batch)
        plain, _ = CompletionLogprobs(GRPOConfig(shared_prefix=False))(model, batch)
    torch.testing.assert_close(replayed, plain, atol=1e-6, rtol=0)


def test_micro_batches_checkpoints_and_joins_keep_the_experts_on_their_tokens():
    """accumulate_grad_batches 1 and 2 (and a token budget), an experience checkpoint and a rollout's state and join:
    every value is still its token's (:func:`experts_of` of the ids), -1 at every pad."""
    batch = _experience()

    def check(b):
        assert torch.equal(b.prompt_routed_experts, experts_of(b.prompt_ids, b.prompt_mask, LAYERS, TOP_K, EXPERTS))
        assert torch.equal(b.completion_routed_experts,
                           experts_of(b.completion_ids, b.completion_mask, LAYERS, TOP_K, EXPERTS))

    for accumulate, budget in ((1, None), (2, None), (1, 12)):
        parts = list(micro_batches(batch, mini_batch_size=6, accumulate_grad_batches=accumulate, num_iterations=1,
                                   loss_type="grpo", max_new_tokens=4, max_tokens_per_microbatch=budget))
        assert budget is not None or len(parts) == accumulate
        assert sorted(r for p in parts for r in p.rows.tolist()) == list(range(6))
        for part in parts:
            check(part)
    check(experience_from_state(experience_state(batch), torch.device("cpu")))
    rollout = RolloutOutput(prompt_ids=batch.prompt_ids, prompt_mask=batch.prompt_mask,
                            completion_ids=batch.completion_ids, completion_mask=batch.completion_mask,
                            truncated=torch.zeros(6, dtype=torch.bool), completions=[""] * 6,
                            prompt_routed_experts=batch.prompt_routed_experts,
                            completion_routed_experts=batch.completion_routed_experts)
    assert {"prompt_routed_experts", "completion_routed_experts"} <= {n for n, _ in token_fields(RolloutOutput)}
    restored = RolloutOutput.from_state(rollout.state())
    assert torch.equal(restored.prompt_routed_experts, rollout.prompt_routed_experts)
    assert torch.equal(restored.completion_routed_experts, rollout.completion_routed_experts)
    joined = RolloutOutput.cat([rollout.select(torch.tensor([2])), rollout.select(torch.tensor([0, 4]))], 0)
    check(Experience.of(joined, torch.device("cpu")))
    with pytest.raises(ValueError, match="prompt_routed_experts: some of the rollouts joined have it"):
        RolloutOutput.cat([rollout, dataclasses.replace(rollout, prompt_routed_experts=None,
                                                        completion_routed_experts=None)], 0)


def test_the_disagreement_is_the_share_of_positions_whose_own_top_k_set_differs(policy):
    """The model's own routing replayed everywhere but at 5 positions of the last MoE layer (whose input is then the
    own routing's): 5 of 2 x (real positions) pairs disagree."""
    model, routers = policy
    batch = _experience(routed=False)
    source = padded_source(6, 5, 4, torch.device("cpu"))
    with torch.no_grad(), routers.record() as calls:
        model(torch.cat([batch.prompt_ids, batch.completion_ids], 1),
              attention_mask=torch.cat([batch.prompt_mask, batch.completion_mask], 1))
    own = calls[0].view(6, 9, LAYERS, TOP_K)
    real = torch.cat([batch.prompt_mask, batch.completion_mask], 1).bool()
    routed = torch.where(real[..., None, None], own, -1)
    changed = real.nonzero()[:5]
    for row, col in changed.tolist():
        routed[row, col, 1] = (routed[row, col, 1] + 1) % EXPERTS
    batch.prompt_routed_experts, batch.completion_routed_experts = routed[:, :5], routed[:, 5:]
    computer, routing = _computer(policy, padding_free=False)
    computer(model, batch)  # with gradient: a training forward
    assert arrange(batch.prompt_routed_experts, batch.completion_routed_experts, source).shape == (6, 9, 2, 2)
    assert routing.step_metrics(Collectives())[DISAGREEMENT] == pytest.approx(5 / (2 * int(real.sum())))
    assert math.isnan(routing.step_metrics(Collectives())[DISAGREEMENT])  # reset: nothing counted since
    with torch.no_grad():
        computer(model, batch)  # an old-logprob pass is not a training forward: not counted
    assert math.isnan(routing.step_metrics(Collectives())[DISAGREEMENT])


def test_r2_records_the_old_policys_own_routing_in_every_layout(policy):
    """The old-logprob pass of "R2" stores each token's experts as the routers chose them: the same in the padded and
    shared-prefix layouts (a shared prompt given to each row of its group), each row's own routing alone."""
    model, routers = policy
    recorded = {}
    for layout in ("padded", "shared_prefix"):
        batch = _experience(routed=False)
        computer, _ = _computer(policy, mode="R2", num_iterations=2, **LAYOUTS[layout])
        LogprobPasses(computer.config, computer).run(batch, torch.zeros(6), torch.ones(6, dtype=torch.bool), {},
                                                     model, None, micro_batch_size=4,
                                                     forward_context=torch.no_grad)
        assert batch.old_logprobs is not None
        recorded[layout] = (batch.prompt_routed_experts, batch.completion_routed_experts)
    for row in (0, 1, 3, 4, 5):  # the rows laid out (row 2 has no loss token)
        real = batch.prompt_mask[row].bool()
        n = int(batch.completion_mask[row].sum())
        with torch.no_grad(), routers.record() as calls:
            model(torch.cat([batch.prompt_ids[row][real], batch.completion_ids[row, :n]])[None])
        own = calls[0].sort(-1).values
        for prompt, completion in recorded.values():
            assert torch.equal(prompt[row][real].sort(-1).values, own[: int(real.sum())]), row
            assert torch.equal(completion[row, :n].sort(-1).values, own[int(real.sum()):]), row
            assert (completion[row, n:] == -1).all() and (prompt[row][~real] == -1).all()


def test_the_aux_loss_is_transformers_load_balancing_loss_on_one_micro_batch(policy):
    """Switch's load-balancing loss over the loss tokens of a one-micro-batch step, padded layout, no replay, equals
    ``load_balancing_loss_func`` of the same router logits masked to the loss tokens."""
    model, routers = policy
    batch = _experience(routed=False)
    computer, routing = _computer(policy, mode="off", router_aux_loss_coef=0.01, padding_free=False)
    routing.prepare_step(model, [batch], lambda b: computer(model, b), Collectives())
    logits = []
    with routers.observe(lambda layer, lg, experts, recomputing: logits.append(lg.detach())):
        computer(model, batch)
    aux = routing.aux_loss()
    mask = torch.cat([torch.zeros_like(batch.prompt_mask), batch.completion_mask], 1)
    expected = load_balancing_loss_func(tuple(logits), EXPERTS, TOP_K, mask)
    assert aux.requires_grad and float(aux.detach()) == pytest.approx(float(expected), rel=1e-6)
    assert routing.step_metrics(Collectives())["aux_loss"] == pytest.approx(float(expected), rel=1e-6)


def test_r3_without_routed_experts_and_other_misuse_are_errors(policy, tiny_llama_path):
    computer, _ = _computer(policy)
    with pytest.raises(ValueError, match="routing_replay='R3': this micro-batch carries no routed experts"):
        computer(policy[0], _experience(routed=False))
    with pytest.raises(ValueError, match=r"GRPOConfig.routing_replay='R4' is invalid.*off, R3, R2"):
        GRPOConfig(routing_replay="R4")
    with pytest.raises(ValueError, match="routing_replay_diagnostics"):
        GRPOConfig(routing_replay_diagnostics=True)
    with pytest.raises(ValueError, match="router_aux_loss_coef"):
        GRPOConfig(router_aux_loss_coef=-0.1)
    for knob in (dict(routing_replay="R3"), dict(router_aux_loss_coef=0.01)):
        with pytest.raises(ValueError, match="max_tokens_per_microbatch='auto' is invalid: measures synthetic"):
            GRPOConfig(max_tokens_per_microbatch="auto", **knob)
    dense = AutoModelForCausalLM.from_pretrained(tiny_llama_path)
    with pytest.raises(ValueError, match=r"GRPOConfig.routing_replay='R3' needs a mixture-of-experts policy .*"
                                         r"\(model_type='llama'\)"):
        PolicyRouting.of(GRPOConfig(routing_replay="R3"), dense)
    with pytest.raises(ValueError, match=r"GRPOConfig.router_aux_loss_coef=0.01 needs a mixture-of-experts"):
        PolicyRouting.of(GRPOConfig(router_aux_loss_coef=0.01), dense)
    assert PolicyRouting.of(GRPOConfig(), dense) is None
    with pytest.raises(ValueError, match=r"routing_replay='R3' is not supported with GRPOModule\(agent=...\)"):
        rollout_path(GRPOConfig(routing_replay="R3"), AutoTokenizer.from_pretrained(tiny_llama_path), dense, (), None,
                     None, StopFlag(), agent=lambda base_url, api_key, row: None)

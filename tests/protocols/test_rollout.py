"""One row shape out (:class:`lightning_grpo.protocols.rollout.RolloutOutput`): every row has its environment mask, its
episode record and its images, whoever sampled it; a single-turn rollout is a rollout of one-turn episodes, and a
checkpoint written before that (None for all three) loads as one. Values worked by hand."""

import io

import pytest
import torch

from lightning_grpo.protocols.episode import EpisodeRecord, Turn
from lightning_grpo.protocols.rollout import RolloutOutput, finish_rollout
from lightning_grpo.protocols.vision import PromptImage
from lightning_grpo.training.experience import Experience


class _Texts:
    """Decodes each id as a letter (``1 -> "a"``); pad 0 is a special token, skipped."""

    def batch_decode(self, rows, skip_special_tokens=True):
        return ["".join(chr(96 + t) for t in row if t) for row in rows]


def _single_turn() -> RolloutOutput:
    """Two prompts, G = 2, as an engine returns them: rows 0 and 2 end after 2 and 1 tokens, rows 1 and 3 are cut at
    3 (truncated)."""
    prompt_ids, prompt_mask = torch.tensor([[0, 5], [6, 7]]), torch.tensor([[0, 1], [1, 1]])
    completion_ids = torch.tensor([[1, 2, 0], [1, 1, 1], [2, 0, 0], [3, 3, 3]])
    completion_mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0], [1, 1, 1]])
    truncated = torch.tensor([False, True, False, True])
    return finish_rollout(prompt_ids, prompt_mask, 2, completion_ids, completion_mask, truncated, None, _Texts(), 0,
                          weight_version=4)


def _roundtrip(state):
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def test_a_single_turn_rollout_is_one_turn_episodes_with_no_environment_token():
    out = _single_turn()
    assert out.completions == ["ab", "aaa", "b", "ccc"]
    assert out.env_mask.dtype == torch.long and out.env_mask.tolist() == [[0, 0, 0]] * 4
    assert out.images == [(), (), (), ()]
    first = out.episodes[0]
    assert first == EpisodeRecord(turns=[Turn("model", 0, 2, [{"role": "assistant", "content": "ab"}])],
                                  model_turns=1, weight_version=4, done=True, single_turn=True)
    assert [(e.turns[0].end, e.truncated, e.done, e.final_text) for e in out.episodes] == [
        (2, False, True, "ab"), (3, True, False, "aaa"), (1, False, True, "b"), (3, True, False, "ccc")]
    picked = RolloutOutput.cat([out.select(torch.tensor([3, 0])), out.select(torch.tensor([2]))], pad_token_id=0)
    assert [e.final_text for e in picked.episodes] == ["ccc", "ab", "b"] and picked.images == [(), (), ()]
    assert picked.env_mask.shape == picked.completion_mask.shape and picked.env_mask.sum() == 0


def test_images_and_episodes_are_one_per_row():
    out = _single_turn()
    with pytest.raises(ValueError, match="RolloutOutput has 1 episodes and 4 image entries for 4 rows"):
        RolloutOutput(out.prompt_ids, out.prompt_mask, out.completion_ids, out.completion_mask, out.truncated,
                      out.completions, episodes=out.episodes[:1])
    with pytest.raises(ValueError, match="Experience has 3 image entries for 4 rows"):
        Experience(prompt_ids=out.prompt_ids, prompt_mask=out.prompt_mask, completion_ids=out.completion_ids,
                   completion_mask=out.completion_mask, advantages=torch.zeros(4), images=[()] * 3)


def test_a_checkpoint_written_before_every_row_had_its_mask_episode_and_images_loads():
    """A rollout saved when single-turn rollouts had None for ``env_mask``, ``episodes`` and ``images`` (and rows
    without images None, episode records without ``single_turn``) loads as one of one-turn episodes; a multi-turn
    one keeps its own."""
    out = _single_turn()
    old = out.state()
    old.update(env_mask=None, episodes=None, images=None)
    restored = RolloutOutput.from_state(_roundtrip(old))
    assert torch.equal(restored.env_mask, torch.zeros(4, 3, dtype=torch.long))
    assert restored.episodes == out.episodes and restored.images == [(), (), (), ()]
    image = PromptImage({"pixel_values": torch.ones(1, 3)}, num_tokens=2)
    turns = [Turn("model", 0, 1, [{"role": "assistant", "content": "x"}]), Turn("env", 1, 3, [])]
    episode = EpisodeRecord(turns=turns, model_turns=1, tool_calls=1).state()
    del episode["single_turn"]  # a record saved before the field
    env_mask = torch.tensor([[0, 1, 1]] * 4)
    multi = out.state()
    multi.update(env_mask=env_mask, episodes=[episode] * 4, images=[[image.state()], [[0], [0], None, None]])
    restored = RolloutOutput.from_state(_roundtrip(multi))
    assert torch.equal(restored.env_mask, env_mask) and not restored.episodes[0].single_turn
    assert [e.tool_calls for e in restored.episodes] == [1] * 4
    assert restored.images[0] is restored.images[1] and restored.images[0][0].num_tokens == 2
    assert restored.images[2:] == [(), ()]

"""What an exact resume stores beyond Lightning's state (loop/resume.py): every RNG state round trips through a
weights-only checkpoint, an Experience round trips as plain data, and a checkpoint of another process count is
refused."""

import io
import random

import numpy as np
import pytest
import torch

from lightning_grpo.loop.resume import experience_from_state, experience_state, rng_states, set_rng_states, this_process
from lightning_grpo.training.experience import Experience


def _roundtrip(state):
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def _draws():
    """Draws of every generator; the gaussians come from the values numpy and Python cached before the state."""
    return torch.rand(3).tolist(), np.random.rand(3).tolist(), [random.random() for _ in range(3)], \
        np.random.randn(), random.gauss(0, 1)


def test_rng_states_round_trip_through_a_weights_only_checkpoint():
    torch.manual_seed(1)
    np.random.seed(2)
    random.seed(3)
    np.random.randn()  # leaves a cached gaussian in numpy's state
    random.gauss(0, 1)  # and in Python's
    state = _roundtrip(rng_states())
    expected = _draws()
    torch.manual_seed(9)
    np.random.seed(9)
    random.seed(9)
    assert _draws() != expected
    set_rng_states(state)
    assert _draws() == expected


def test_an_experience_round_trips_as_plain_data():
    experience = Experience(prompt_ids=torch.tensor([[1, 2]]), prompt_mask=torch.ones(1, 2, dtype=torch.long),
                            completion_ids=torch.tensor([[3, 4]]), completion_mask=torch.tensor([[1, 0]]),
                            advantages=torch.tensor([0.5]), old_logprobs=torch.tensor([[-1.0, 0.0]]),
                            loss_normalizer=3.0, step_end=False, metrics={"reward": 1.0}, rows=torch.tensor([7]))
    restored = experience_from_state(_roundtrip(experience_state(experience)), torch.device("cpu"))
    for name in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "advantages", "old_logprobs",
                 "rows"):
        assert torch.equal(getattr(restored, name), getattr(experience, name)), name
    assert restored.ref_logprobs is None and restored.loss_normalizer == 3.0 and restored.step_end is False
    assert restored.metrics == {"reward": 1.0}


def test_an_experience_saved_before_every_row_had_its_env_mask_and_images_loads():
    """A checkpoint's experience of a single-turn rollout saved with None for ``env_mask`` and ``images`` gets an
    all-zero mask (its attention mask is the completion mask) and no images per row."""
    experience = Experience(prompt_ids=torch.tensor([[1, 2], [1, 2]]), prompt_mask=torch.ones(2, 2, dtype=torch.long),
                            completion_ids=torch.tensor([[3, 4], [5, 6]]),
                            completion_mask=torch.tensor([[1, 0], [1, 1]]), advantages=torch.tensor([0.5, -0.5]))
    old = experience_state(experience)
    old.update(env_mask=None, images=None)
    restored = experience_from_state(_roundtrip(old), torch.device("cpu"))
    assert restored.env_mask.tolist() == [[0, 0], [0, 0]] and restored.images == [(), ()]
    assert restored.completion_attention_mask.tolist() == [[1, 0], [1, 1]]


def test_this_process_takes_its_entry_and_refuses_another_process_count():
    assert this_process(None, "RNG states") is None
    assert this_process(["only"], "RNG states") == "only"
    message = "the checkpoint's partly used rollouts come from 2 processes but this run has 1"
    with pytest.raises(ValueError, match=message):
        this_process(["a", "b"], "partly used rollouts")

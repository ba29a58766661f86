"""``GRPOConfig.streaming``: its defaults, the sizes derived from ``prompts_per_step``, and every bad value an error
naming the field and the value."""

import re

import pytest

from lightning_grpo.config import EngineConfig, GRPOConfig, StreamingConfig
from lightning_grpo.config.correction import CorrectionConfig


def test_defaults_are_off_and_the_fixed_schedule_is_unchanged():
    config = GRPOConfig()
    assert config.streaming == StreamingConfig() and not config.streaming.enabled
    assert config.streaming.max_off_policy_steps == 8 and config.streaming.on_stale == "drop"  # prime-rl's default
    assert config.tis_cap() is None  # synchronous: no cap unless set
    on = GRPOConfig(streaming=StreamingConfig(enabled=True))
    assert on.tis_cap() == 2.0  # stale samples are always corrected, as with max_staleness > 0
    assert GRPOConfig(streaming=StreamingConfig(enabled=True), importance_sampling_cap=3.0).tis_cap() == 3.0
    assert GRPOConfig.from_dict({"streaming": {"enabled": True, "on_stale": "regenerate"}}).streaming == \
        StreamingConfig(enabled=True, on_stale="regenerate")


def test_sizes_derived_from_prompts_per_step():
    assert StreamingConfig(enabled=True).sizes(4) == (8, 12)
    assert StreamingConfig(enabled=True, max_inflight_groups=3).sizes(4) == (3, 7)
    assert StreamingConfig(enabled=True, max_inflight_groups=3, buffer_groups=5).sizes(4) == (3, 5)
    with pytest.raises(ValueError, match=re.escape("GRPOConfig.streaming.buffer_groups=3 is invalid: must be >= the "
                                                   "datamodule's prompts_per_step=4")):
        StreamingConfig(enabled=True, max_inflight_groups=2, buffer_groups=3).sizes(4)


@pytest.mark.parametrize("kwargs, message", [
    ({"enabled": True, "on_stale": "keep"}, "streaming.on_stale='keep' is invalid: choose one of drop, regenerate"),
    ({"enabled": True, "max_inflight_groups": 0}, "streaming.max_inflight_groups=0 is invalid: must be an int >= 1"),
    ({"enabled": True, "buffer_groups": 2.5}, "streaming.buffer_groups=2.5 is invalid: must be an int >= 1"),
    ({"enabled": True, "max_off_policy_steps": -1}, "streaming.max_off_policy_steps=-1 is invalid: must be an int"),
    ({"enabled": True, "max_off_policy_steps": True}, "streaming.max_off_policy_steps=True is invalid"),
    ({"enabled": "yes"}, "streaming.enabled='yes' is invalid: must be True or False"),
    ({"enabled": True, "max_inflight_groups": 4, "buffer_groups": 3},
     "streaming.buffer_groups=3 is invalid: must be >= streaming.max_inflight_groups=4"),
    ({"max_off_policy_steps": 2}, "streaming.max_off_policy_steps=2 is invalid: is read only with streaming.enabled"),
    ({"newest_version_only": True}, "streaming.newest_version_only=True is invalid: is read only with streaming"),
])
def test_bad_streaming_values_name_the_field(kwargs, message):
    with pytest.raises(ValueError, match="^GRPOConfig." + re.escape(message)):
        StreamingConfig(**kwargs)


@pytest.mark.parametrize("kwargs, message", [
    ({"max_staleness": 1}, "streaming.enabled=True is invalid: streams rollouts; max_staleness=1 is the fixed"),
    ({"engine": EngineConfig(sync_every=2)}, "streaming.enabled=True is invalid: sends the weights after every "
                                             "optimizer step; engine.sync_every=2 must be 1"),
    ({"engine": EngineConfig(enable_sleep_mode=True)}, "streaming.enabled=True is invalid: needs the engines awake"),
    ({"correction": CorrectionConfig(bypass_mode=True)}, "correction.bypass_mode=True is invalid: with "
                                                         "streaming.enabled trains stale samples"),
])
def test_streaming_refuses_settings_it_cannot_run(kwargs, message):
    with pytest.raises(ValueError, match="^GRPOConfig." + re.escape(message)):
        GRPOConfig(streaming=StreamingConfig(enabled=True), **kwargs)
    GRPOConfig(streaming=StreamingConfig(enabled=True), correction=CorrectionConfig(bypass_mode=True, geo_mask_low=0.9))

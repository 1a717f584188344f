"""EngineConfig (nanoserve/config/engine.py): each setting has one default, its concern's, and the
scheduler the engine builds from the defaults is the device's."""

from dataclasses import fields

import pytest

from nanoserve.config import (
    FAIR_SHARE_ROWS_DEFAULT,
    PREFILL_STEP_MS_DEFAULT,
    CacheConfig,
    EngineConfig,
    LoadConfig,
    ParallelConfig,
    SchedulerConfig,
)
from nanoserve.errors import InvalidRequestError

ENGINE_DEFAULTS = {f.name: f.default for f in fields(EngineConfig)}
# The scheduler's values the engine resolves at start-up (the model's context, the device's share).
RESOLVED = {"max_model_len", "fair_share_rows"}


@pytest.mark.parametrize("concern", [LoadConfig, CacheConfig, SchedulerConfig, ParallelConfig])
def test_every_setting_a_caller_passes_has_its_concerns_default(concern):
    shared = [f for f in fields(concern) if f.name in ENGINE_DEFAULTS and f.name not in RESOLVED]
    assert shared
    assert {f.name: ENGINE_DEFAULTS[f.name] for f in shared} == {f.name: f.default for f in shared}


@pytest.mark.parametrize("concern", [LoadConfig, CacheConfig, ParallelConfig])
def test_every_load_cache_and_parallel_setting_is_one_a_caller_passes(concern):
    assert {f.name for f in fields(concern)} <= set(ENGINE_DEFAULTS)


@pytest.mark.parametrize("device_type", ["cpu", "cuda"])
def test_the_default_scheduler_runs_with_the_devices_fair_share_and_pace(device_type):
    scheduler = EngineConfig().scheduler_config(max_model_len=300, kv_window=8, device_type=device_type)
    assert scheduler.fair_share_rows == FAIR_SHARE_ROWS_DEFAULT[device_type]
    step_ms = PREFILL_STEP_MS_DEFAULT[device_type]
    assert scheduler.prefill_step_s == (None if step_ms is None else step_ms / 1e3)
    assert (scheduler.max_model_len, scheduler.kv_window) == (300, 8)
    assert scheduler.enable_prefix_caching and scheduler.max_prefill_tokens_while_decoding == 64
    assert scheduler.prefill_pace_min_tokens == 16


def test_a_stated_fair_share_and_an_infinite_step_override_the_devices():
    config = EngineConfig(fair_share_rows=float("inf"), prefill_step_ms=float("inf"))
    scheduler = config.scheduler_config(max_model_len=300, kv_window=0, device_type="cpu")
    assert scheduler.fair_share_rows == float("inf") and scheduler.prefill_step_s is None


@pytest.mark.parametrize(("field", "value"), [
    ("task", "chat"), ("pooling", "max"), ("kv_cache_dtype", "int4"), ("tensor_parallel_size", 0),
    ("scheduling_policy", "lifo"), ("fair_share_rows", -1.0), ("max_prefill_tokens_while_decoding", 0),
    ("long_prefill_token_threshold", 0), ("prefill_step_ms", 0.0), ("max_num_seqs", 0)])
def test_a_bad_setting_is_refused_by_name_when_the_config_is_built(field, value):
    with pytest.raises(InvalidRequestError) as error:
        EngineConfig(**{field: value})
    assert error.value.param == field

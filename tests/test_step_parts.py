"""The step-parts benchmark (nanoserve.bench.experiments.step_parts) on the tiny model: it replays a real
decode step without disturbing what the step reads, names every part once, and refuses bad
options by name before building an engine."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig

from nanoserve.bench.experiments import step_parts
from nanoserve.config import EngineConfig
from nanoserve.engine.core import Engine


def test_the_replayed_step_is_a_decode_step_and_timing_it_leaves_its_logits_unchanged(tiny_model_dir):
    engine = Engine(EngineConfig(model=str(tiny_model_dir), device="cpu", max_num_seqs=3, max_model_len=48,
                                 batch_invariant=True))
    batch = step_parts.capture_decode_batch(engine, 3, 32)
    assert batch.input_ids.shape[0] == 3 and all(g.rows_per_seq == 1 for g in batch.groups)
    before = engine.model.forward(batch, engine.kv_cache)
    best = step_parts.step_parts(engine, batch, turns=2)
    assert torch.equal(engine.model.forward(batch, engine.kv_cache), before)
    assert {"forward", "embedding", "layers", "final_norm", "lm_head", "argmax"} <= set(best)
    assert all(0 < seconds < float("inf") for seconds in best.values())


@pytest.mark.parametrize("input_len", [32, 100])
def test_the_table_prices_the_streamed_parts_against_the_roofline(tiny_model_dir, input_len):
    """The layers stream their weights and the K/V of the decoded row's context (its prompt and
    the tokens decoded before the captured step), read against the roofline."""
    frame = step_parts.measure(1, input_len=input_len, dtype="float32", threads=1, turns=2,
                               model=str(tiny_model_dir), linear_kernel=None, read_gbs=10.0)
    by_part = frame.set_index("part")
    assert list(frame.part).count("forward") == 1
    streamed = by_part.loc["forward", "bytes"]
    assert streamed == by_part.loc["layers", "bytes"] + by_part.loc["lm_head", "bytes"] > 0
    assert by_part.loc["forward", "roofline_forward_ms"] == pytest.approx(1e3 * streamed / 10e9)
    config = AutoConfig.from_pretrained(tiny_model_dir)
    token_bytes = 2 * config.num_hidden_layers * config.num_key_value_heads * (
        config.hidden_size // config.num_attention_heads) * 2  # float16 K/V, the CPU default
    engine = Engine(EngineConfig(model=str(tiny_model_dir), device="cpu", dtype="float32"))
    layers = engine.model.weights.layers
    weights = sum(step_parts.weight_bytes(m) for layer in layers for m in layer.matrices())
    kv_bytes = by_part.loc["layers", "bytes"] - weights
    assert input_len * token_bytes <= kv_bytes < (input_len + 4) * token_bytes
    if "layers_attention" in by_part.index:  # the fused native layers time their attention inside
        assert by_part.loc["layers_attention", "bytes"] == kv_bytes
        assert by_part.loc["layers_projections", "bytes"] == weights


@pytest.mark.parametrize(("argv", "option"), [(["--slots", "1,x"], "--slots"), (["--turns", "0"], "--turns"),
                                              (["--input-len", "0"], "--input-len")])
def test_bad_options_exit_2_naming_the_option(argv, option, capsys):
    with pytest.raises(SystemExit) as exited:
        step_parts.main(argv)
    assert exited.value.code == 2
    assert option in capsys.readouterr().err

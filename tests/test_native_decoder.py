"""One native call for every decoder layer of a step (nanoserve.native.decoder): it leaves the
bits the loop of separate native calls leaves (logits and the K/V it writes), on prefill chunks
and decode steps mixed, and it runs only where it can do exactly that."""

from __future__ import annotations

import pytest
import torch
from families import step
from test_model import CONFIG, WEIGHTS, Cache

from nanoserve import native
from nanoserve.model.decoder import Llama
from nanoserve.model.linear import KERNELS, QUANTIZED_KERNELS

pytestmark = pytest.mark.skipif(native.library() is None, reason=f"{native.status()}")

PROMPTS = {"a": [(7 * i + 3) % 300 for i in range(13)], "b": [(11 * i + 5) % 300 for i in range(70)]}


def _model(format_name: str, fused: bool) -> Llama:
    if format_name == "float32":
        model = Llama(CONFIG, WEIGHTS, batch_invariant=True, linear_kernel=KERNELS["native"])
    else:
        model = Llama(CONFIG, WEIGHTS.quantized(format_name), batch_invariant=True,
                      linear_kernel=QUANTIZED_KERNELS["native-quant-x8"])
    assert model.decoder is not None
    if not fused:
        model.decoder = None
    return model


def _run(model: Llama) -> tuple[list[dict[str, torch.Tensor]], Cache]:
    cache, outputs = Cache(), []
    a, b = PROMPTS["a"], PROMPTS["b"]
    outputs.append(step(model, cache, [("a", a, 0)]))
    outputs.append(step(model, cache, [("a", [5], len(a)), ("b", b[:40], 0)]))  # a decode beside a chunk
    outputs.append(step(model, cache, [("b", b[40:], 40)]))
    for i in range(3):
        outputs.append(step(model, cache, [("a", [9 + i], len(a) + 1 + i), ("b", [3 + i], len(b) + i)]))
    return outputs, cache


@pytest.mark.parametrize("format_name", ["q4_0", "q8_0", "float32"])
def test_one_call_per_step_leaves_the_bits_of_the_separate_calls(format_name):
    fused, fused_cache = _run(_model(format_name, fused=True))
    separate, separate_cache = _run(_model(format_name, fused=False))
    for one, other in zip(fused, separate, strict=True):
        assert one.keys() == other.keys()
        assert all(torch.equal(one[seq], other[seq]) for seq in one)
    for one, other in zip(fused_cache.kv.k + fused_cache.kv.v, separate_cache.kv.k + separate_cache.kv.v,
                          strict=True):
        assert torch.equal(one, other)


@pytest.mark.parametrize("fused", [True, False])
def test_a_fused_step_makes_a_few_native_calls_whatever_the_layer_count(fused):
    model, cache = _model("q4_0", fused=fused), Cache()
    before = native.calls()
    step(model, cache, [("a", PROMPTS["a"], 0)])
    calls = native.calls() - before
    # fused: the embedding lookup, the decoder, the final norm, the head; else 9 a layer more
    assert calls <= 4 if fused else calls >= 9 * CONFIG.num_layers


def test_matrices_not_in_the_repacked_layout_keep_the_separate_calls():
    assert Llama(CONFIG, WEIGHTS.quantized("q8_0"), batch_invariant=True,
                 linear_kernel=QUANTIZED_KERNELS["native-quant"]).decoder is None
    assert Llama(CONFIG, WEIGHTS, batch_invariant=True, linear_kernel=KERNELS["aten-tile16"]).decoder is None
    assert Llama(CONFIG, WEIGHTS.quantized("q8_0"), batch_invariant=True, native=False,
                 linear_kernel=QUANTIZED_KERNELS["native-quant-x8"]).decoder is None


def test_the_decoder_times_its_projections_only_when_asked():
    model = _model("q4_0", fused=True)
    _run(model)
    assert model.decoder.linear_s is None
    model.decoder.linear_s = 0.0
    _run(model)
    assert model.decoder.linear_s > 0

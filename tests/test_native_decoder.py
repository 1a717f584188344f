"""One native call for every decoder layer of a step (nanoserve.native.decoder): it leaves the
bits the loop of separate native calls leaves (logits and the K/V it writes), on prefill chunks
and decode steps mixed, and it runs only where it can do exactly that."""

from __future__ import annotations

import pytest
import torch
from families import Cache as FamilyCache
from families import assert_same_steps, step
from test_model import CONFIG, WEIGHTS, Cache
from test_native_lora import random_weights

from nanoserve import native
from nanoserve.model.decoder import DecoderLM
from nanoserve.model.linear import KERNELS, QUANTIZED_KERNELS
from nanoserve.model.lora import Adapter, LoRARequest, load_adapter
from nanoserve.quant import QuantizedWeight

pytestmark = pytest.mark.skipif(native.library() is None, reason=f"{native.status()}")

PROMPTS = {"a": [(7 * i + 3) % 300 for i in range(13)], "b": [(11 * i + 5) % 300 for i in range(70)]}


def _model(format_name: str, fused: bool) -> DecoderLM:
    if format_name == "float32":
        model = DecoderLM(CONFIG, WEIGHTS, batch_invariant=True, linear_kernel=KERNELS["native"])
    else:
        model = DecoderLM(CONFIG, WEIGHTS.quantized(format_name), batch_invariant=True,
                          linear_kernel=QUANTIZED_KERNELS["native-quant-x8"])
    assert model.decoder is not None
    if not fused:
        model.decoder = None
    return model


def _run(model: DecoderLM,
         adapters: dict[str, Adapter] | None = None) -> tuple[list[dict[str, torch.Tensor]], Cache]:
    cache, outputs = (Cache() if model.config is CONFIG else FamilyCache(model.config)), []
    vocab = model.config.vocab_size  # the family checkpoints' are smaller than the prompts' ids
    a, b = ([t % vocab for t in PROMPTS[seq]] for seq in "ab")
    outputs.append(step(model, cache, [("a", a, 0)], adapters))
    # a decode beside a chunk
    outputs.append(step(model, cache, [("a", [5], len(a)), ("b", b[:40], 0)], adapters))
    outputs.append(step(model, cache, [("b", b[40:], 40)], adapters))
    for i in range(3):
        outputs.append(step(model, cache, [("a", [9 + i], len(a) + 1 + i), ("b", [3 + i], len(b) + i)],
                            adapters))
    return outputs, cache


def _adapters(model: DecoderLM) -> list[Adapter]:
    """Rank 16 on every module; rank 1 on q and v only; rank 8 on o and down only."""
    specs = [(16, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
             (1, ["q_proj", "v_proj"]), (8, ["o_proj", "down_proj"])]
    assert model.native_lora
    return [load_adapter(LoRARequest(f"a{i}", i + 1, "/none"), random_weights(rank, modules, seed=i), CONFIG,
                         serial=i, pack=model.linear_kernel.pack, matmul=model.linear, dtype=torch.float32,
                         device=torch.device("cpu"), native=True) for i, (rank, modules) in enumerate(specs)]


@pytest.mark.parametrize("format_name", ["q4_0", "q8_0", "float32"])
def test_one_call_per_step_leaves_the_bits_of_the_separate_calls(format_name):
    assert_same_steps(_run(_model(format_name, fused=True)), _run(_model(format_name, fused=False)))


@pytest.mark.parametrize("format_name", ["q4_0", "float32"])
@pytest.mark.parametrize("who", [(0, None), (1, 2), (0, 1)],
                         ids=["one-and-none", "subsets", "all-and-subset"])
def test_lora_steps_in_one_call_leave_the_bits_of_the_separate_calls(format_name, who):
    results = []
    for fused in (True, False):
        model = _model(format_name, fused)
        pool = _adapters(model)
        results.append(_run(model, {seq: pool[i] for seq, i in zip("ab", who, strict=True) if i is not None}))
    assert_same_steps(*results)
    (fused_outputs, _), _ = results
    base, _ = _run(_model(format_name, fused=True))
    assert not torch.equal(base[-1]["a"], fused_outputs[-1]["a"]), "no update applied"


def test_a_lora_step_runs_in_one_native_call():
    model, cache = _model("q4_0", fused=True), Cache()
    pool = _adapters(model)
    before = native.calls()
    step(model, cache, [("a", PROMPTS["a"], 0), ("b", PROMPTS["b"][:20], 0)], {"a": pool[0], "b": pool[1]})
    assert native.calls() - before <= 4


@pytest.mark.parametrize("fused", [True, False])
def test_a_fused_step_makes_a_few_native_calls_whatever_the_layer_count(fused):
    model, cache = _model("q4_0", fused=fused), Cache()
    before = native.calls()
    step(model, cache, [("a", PROMPTS["a"], 0)])
    calls = native.calls() - before
    # fused: the embedding lookup, the decoder, the final norm, the head; else 9 a layer more
    assert calls <= 4 if fused else calls >= 9 * CONFIG.num_layers


def test_matrices_not_in_the_repacked_layout_keep_the_separate_calls():
    assert DecoderLM(CONFIG, WEIGHTS.quantized("q8_0"), batch_invariant=True,
                     linear_kernel=QUANTIZED_KERNELS["native-quant"]).decoder is None
    assert DecoderLM(CONFIG, WEIGHTS, batch_invariant=True,
                     linear_kernel=KERNELS["aten-tile16"]).decoder is None
    assert DecoderLM(CONFIG, WEIGHTS.quantized("q8_0"), batch_invariant=True, native=False,
                     linear_kernel=QUANTIZED_KERNELS["native-quant-x8"]).decoder is None


def test_the_decoder_times_its_projections_only_when_asked():
    model = _model("q4_0", fused=True)
    _run(model)
    assert model.decoder.linear_s is None
    model.decoder.linear_s = 0.0
    _run(model)
    assert model.decoder.linear_s > 0


def _q4_k_m_type(name: str):
    """llama-quantize's Q4_K_M as it comes out on a model whose width is not whole super-blocks
    for every matrix (the default model's): Q5_0 where Q4_K cannot go, Q8_0 for some v, Q4_K
    and Q6_K downs by layer, one Q5_1 to cover the other offset layout."""
    from gguf import GGMLQuantizationType as T

    kind = name.split(".")[-2]
    layer = int(name.split(".")[1]) if name.startswith("blk.") else -1
    if kind == "ffn_down":
        return T.Q6_K if layer % 2 else T.Q4_K
    if kind == "attn_v":
        return T.Q8_0 if layer % 2 == 0 else T.Q5_0
    if kind == "attn_output":
        return T.Q5_1
    return T.Q8_0 if name == "token_embd.weight" else T.Q5_0


def _iq4_xs_type(name: str):
    """An IQ4_XS file's mix: IQ4_XS, v in Q5_K (llama-quantize's choice for 4 or more query heads
    a KV head), IQ4_NL (its fallback) or Q8_0, an IQ4_NL output projection, one Q6_K down, a
    Q6_K token table."""
    from gguf import GGMLQuantizationType as T

    kind = name.split(".")[-2]
    layer = int(name.split(".")[1]) if name.startswith("blk.") else -1
    if kind == "attn_v":
        return (T.Q5_K, T.IQ4_NL, T.Q8_0)[layer]
    if kind == "attn_output":
        return T.IQ4_NL
    if kind == "ffn_down" and layer == 1:
        return T.Q6_K
    return T.Q6_K if name == "token_embd.weight" else T.IQ4_XS


def _low_bit_type(name: str):
    """llama-quantize's Q2_K and Q3_K_M mixes on a model whose widths are whole super-blocks:
    Q2_K or Q3_K q, k, gate and up by layer (q and k stacked beside a Q5_K or Q4_K v), Q3_K o,
    Q3_K and Q6_K downs by layer."""
    from gguf import GGMLQuantizationType as T

    kind = name.split(".")[-2]
    layer = int(name.split(".")[1]) if name.startswith("blk.") else -1
    if kind == "attn_v":
        return T.Q5_K if layer == 0 else T.Q4_K
    if kind == "ffn_down":
        return T.Q6_K if layer % 2 else T.Q3_K
    if kind == "attn_output":
        return T.Q3_K
    if name == "token_embd.weight":
        return T.Q8_0
    return T.Q3_K if layer % 2 else T.Q2_K


def _mixed_model(tmp_path, matrix_type=_q4_k_m_type, hidden_size: int = 64,
                 intermediate_size: int = 256, tensor_hook=None) -> DecoderLM:
    from tiny_model import write_tiny_gguf, write_tiny_llama

    from nanoserve.loading.weights import load_weights

    widths = {"hidden_size": hidden_size, "intermediate_size": intermediate_size}
    model_dir = write_tiny_llama(tmp_path / "mixed", **widths, num_heads=4, num_kv_heads=2, num_layers=3)
    path = write_tiny_gguf(tmp_path / "mixed.gguf", model_dir, matrix_type=matrix_type,
                           tensor_hook=tensor_hook)
    config, weights = load_weights(model_dir, dtype=torch.float32, device=torch.device("cpu"), gguf=path)
    return DecoderLM(config, weights, batch_invariant=True,
                     linear_kernel=QUANTIZED_KERNELS["native-quant-x8"])


def _assert_one_call_gives_the_separate_calls_bits(model: DecoderLM, separate_model: DecoderLM) -> None:
    """`model` (its one-call decoder) steps to the bits of the same weights' per-layer calls, and
    a request alone to its bits in a crowd."""
    from families import crowd_logits

    fused = _run(model)
    separate_model.decoder = None
    assert_same_steps(fused, _run(separate_model))
    vocab = model.config.vocab_size
    prompts = [[(7 * i + 3 * seq) % vocab for i in range(n)] for seq, n in enumerate((13, 21, 20))]
    alone, crowd = crowd_logits(model, prompts, crowd=False), crowd_logits(model, prompts, crowd=True)
    assert all(torch.equal(a, c) for a, c in zip(alone, crowd, strict=True))


def test_a_q4_k_m_mix_of_layouts_runs_in_one_call_with_the_bits_of_the_separate_calls(tmp_path):

    from nanoserve.native.repack import KRepackedWeight, RepackedWeight
    from nanoserve.quant import QuantizedStack

    model = _mixed_model(tmp_path)
    assert model.decoder is not None
    layers = model.weights.layers
    assert isinstance(layers[0].qkv, QuantizedStack)  # q, k in Q5_0 beside v in Q8_0
    assert [p.layout.name for p in layers[0].qkv.parts] == ["q5_1", "q5_1", "q8_0"]
    assert isinstance(layers[1].qkv, RepackedWeight) and layers[1].qkv.layout.name == "q5_1"
    assert [type(w.down) for w in layers] == [KRepackedWeight] * 3
    assert [w.down.format.name for w in layers] == ["q4_k", "q6_k", "q4_k"]
    _assert_one_call_gives_the_separate_calls_bits(model, _mixed_model(tmp_path))


def test_an_iq4_xs_mix_of_layouts_runs_in_one_call_with_the_bits_of_the_separate_calls(tmp_path):

    from nanoserve.native.repack import KRepackedWeight, RepackedWeight
    from nanoserve.quant import QuantizedStack

    model = _mixed_model(tmp_path, _iq4_xs_type, hidden_size=256)
    assert model.decoder is not None
    layers = model.weights.layers
    assert all(isinstance(w.qkv, QuantizedStack) for w in layers)  # q, k in IQ4_XS beside v
    assert [p.format.name for p in layers[0].qkv.parts] == ["iq4_xs", "iq4_xs", "q5_k"]
    assert [type(p) for p in layers[0].qkv.parts] == [KRepackedWeight] * 3
    assert [w.qkv.parts[2].layout.name for w in layers[1:]] == ["iq4_nl", "q8_0"]
    assert all(isinstance(w.o, RepackedWeight) and w.o.layout.name == "iq4_nl" for w in layers)
    assert [w.down.format.name for w in layers] == ["iq4_xs", "q6_k", "iq4_xs"]
    separate_model = _mixed_model(tmp_path, _iq4_xs_type, hidden_size=256)
    _assert_one_call_gives_the_separate_calls_bits(model, separate_model)


def test_q2_k_and_q3_k_m_mixes_run_in_one_call_with_the_bits_of_the_separate_calls(tmp_path):

    from nanoserve.native.repack import KRepackedWeight
    from nanoserve.quant import QuantizedStack

    model = _mixed_model(tmp_path, _low_bit_type, hidden_size=256, intermediate_size=512)
    assert model.decoder is not None
    layers = model.weights.layers
    assert isinstance(layers[0].qkv, QuantizedStack)
    assert [(type(p), p.format.name) for p in layers[0].qkv.parts] == [(KRepackedWeight, "q2_k")] * 2 + [
        (KRepackedWeight, "q5_k")]
    assert [w.down.format.name for w in layers] == ["q3_k", "q6_k", "q3_k"]
    assert [w.o.format.name for w in layers] == ["q3_k"] * 3
    separate_model = _mixed_model(tmp_path, _low_bit_type, hidden_size=256, intermediate_size=512)
    _assert_one_call_gives_the_separate_calls_bits(model, separate_model)


def test_a_matrix_with_no_repacked_layout_keeps_the_separate_calls(tmp_path):
    from gguf import GGMLQuantizationType as T

    down = "blk.1.ffn_down.weight"

    def one_q4_0(name: str):
        return T.Q4_0 if name == down else _q4_k_m_type(name)

    def beyond_f16_offset(name: str, values):  # d = 70000 / 8: the Q4_1 layout's m = -8 d overflows f16
        if name == down:
            values = values.copy()
            values[0, 0] = 70000.0
        return values

    model = _mixed_model(tmp_path, one_q4_0, tensor_hook=beyond_f16_offset)
    assert isinstance(model.weights.layers[1].down, QuantizedWeight)  # no layout: the file's rows
    assert model.decoder is None
    cache, before = FamilyCache(model.config), native.calls()
    logits = step(model, cache, [("a", PROMPTS["a"], 0)])["a"]
    assert torch.isfinite(logits).all() and native.calls() - before >= 9 * model.config.num_layers


@pytest.mark.parametrize("file_type", ["F16", "BF16"])
def test_f16_and_bf16_files_run_in_one_call_with_the_bits_of_the_separate_calls(tmp_path, file_type):
    from gguf import GGMLQuantizationType as T

    from nanoserve.native.matmul import HalfPanels

    def every_matrix(name: str):
        return T[file_type]

    model = _mixed_model(tmp_path, every_matrix)
    assert model.decoder is not None
    matrices = [m for w in model.weights.layers for m in (w.qkv, w.o, w.gate_up, w.down)]
    assert all(isinstance(m, HalfPanels) for m in matrices)
    _assert_one_call_gives_the_separate_calls_bits(model, _mixed_model(tmp_path, every_matrix))


def test_a_stack_mixing_f16_panels_with_block_layouts_runs_in_one_call_with_the_separate_calls_bits(tmp_path):
    """v in F16 beside q and k in Q5_0: the stack's parts read the float input and its quantized
    copy in the same stage; one layer's down in BF16 between K layouts."""
    from gguf import GGMLQuantizationType as T

    from nanoserve.native.matmul import HalfPanels
    from nanoserve.quant import QuantizedStack

    def mixed(name: str):
        if name.split(".")[-2] == "attn_v":
            return T.F16
        return T.BF16 if name == "blk.1.ffn_down.weight" else _q4_k_m_type(name)

    model = _mixed_model(tmp_path, mixed)
    assert model.decoder is not None
    layers = model.weights.layers
    assert isinstance(layers[0].qkv, QuantizedStack) and isinstance(layers[0].qkv.parts[-1], HalfPanels)
    assert isinstance(layers[1].down, HalfPanels)
    separate_model = _mixed_model(tmp_path, mixed)
    separate_model.decoder = None
    assert_same_steps(_run(model), _run(separate_model))


# The families whose switches the one-call decoder takes (tests/test_families.py's checkpoints):
# Gemma 2's soft cap and window, Gemma 3's local RoPE and q/k norms, Qwen3's q/k norms, a window,
# GELU's tanh form with one K/V head.
ONE_CALL_FAMILIES = ["gemma2-softcap-window-5", "gemma3-local-rope-window-6", "qwen3-head-dim-32",
                     "mistral-window-5", "llama-gelu-tanh-head-dim-24-one-kv-head"]


def _family_models(name: str, tmp_path) -> tuple[DecoderLM, DecoderLM, object]:
    """Two models of one family's checkpoint on the native float kernel (one to run in one call,
    one for the separate calls), and the transformers model they were saved from."""
    import families
    from test_families import CASES

    from nanoserve.loading.weights import load_weights

    families.require_transformers()
    case = next(c for c in CASES if c.name == name)
    reference = families.write_checkpoint(case, tmp_path)
    models = []
    for _ in range(2):
        config, weights = load_weights(tmp_path, dtype=torch.float32, device=torch.device("cpu"))
        models.append(DecoderLM(config, weights, batch_invariant=True, linear_kernel=KERNELS["native"]))
    return models[0], models[1], reference


@pytest.mark.parametrize("name", ONE_CALL_FAMILIES)
def test_a_familys_switches_run_in_one_call_with_the_bits_of_the_separate_calls(name, tmp_path):
    model, separate, _ = _family_models(name, tmp_path)
    assert model.decoder is not None and separate.decoder is not None
    _assert_one_call_gives_the_separate_calls_bits(model, separate)


@pytest.mark.parametrize("name", ONE_CALL_FAMILIES)
def test_a_familys_one_call_logits_match_transformers(name, tmp_path):
    import families

    model, _, reference = _family_models(name, tmp_path)
    assert model.decoder is not None
    for prompt in ([5, 17, 33, 8, 91, 4, 60], [7, 150, 9, *range(100, 118)]):
        expected = families.reference_logits(reference, prompt)
        torch.testing.assert_close(families.prefill_logits(model, prompt), expected, atol=1e-4, rtol=0)
        chunked = families.prefill_logits(model, prompt, chunk=4)
        torch.testing.assert_close(chunked, expected, atol=1e-4, rtol=0)


def test_a_family_the_stages_cannot_run_keeps_the_separate_calls(tmp_path):
    model, _, _ = _family_models("qwen2", tmp_path)  # q, k and v biases
    assert model.decoder is None

"""Mixtures of experts against transformers: tiny random Qwen3-MoE, Qwen2-MoE, Mixtral and OLMoE
checkpoints built by transformers' own config classes (tests/families.py), loaded by nanoserve.

Properties, per checkpoint: last-position logits within 1e-4 of transformers' float32 forward
(native and torch small ops, batch-invariant and plain); greedy tokens equal over 32 steps; a
request's logits bit-identical alone and in a crowd (rows routed to other experts beside it),
on both paths. The sizes catch wrong assumptions: top-k 1, 2 and 4; 8 and 60 experts (most of
60 see no row in a step); a shared expert; dense layers between sparse ones (mlp_only_layers,
decoder_sparse_step); experts narrower and wider than the dense MLP; renormalised and raw
top-k weights; OLMoE's q/k norms over the whole projection.
"""

import dataclasses

import families
import gguf
import pytest
import torch
from families import (
    Case,
    assert_same_steps,
    crowd_logits,
    greedy,
    load_model,
    prefill_logits,
    reference_greedy,
)

from nanoserve import native as native_library
from nanoserve.errors import InvalidRequestError, UnsupportedModelError
from nanoserve.loading.hf_config import read_model_config
from nanoserve.model.linear import KERNELS, QUANTIZED_KERNELS
from nanoserve.model.moe import ExpertTally, MixtureOfExperts, route
from nanoserve.native import ops as native_ops
from nanoserve.native.moe import NativeExperts

families.require_transformers()

CASES = [
    Case("qwen3-moe-8-experts-top2-renormalised-dense-layer-1", "Qwen3MoeConfig",
         {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "norm_topk_prob": True,
          "mlp_only_layers": [1], "head_dim": 32}),
    Case("qwen2-moe-60-experts-top4-shared-sparse-step-2", "Qwen2MoeConfig",
         {"num_experts": 60, "num_experts_per_tok": 4, "moe_intermediate_size": 24,
          "shared_expert_intermediate_size": 80, "decoder_sparse_step": 2, "num_hidden_layers": 3}),
    Case("mixtral-8-experts-top1", "MixtralConfig",
         {"num_local_experts": 8, "num_experts_per_tok": 1, "intermediate_size": 48}),
    Case("olmoe-8-experts-top2-raw-weights", "OlmoeConfig",
         {"num_experts": 8, "num_experts_per_tok": 2, "num_key_value_heads": 4, "norm_topk_prob": False}),
]
PROMPTS = [[5, 17, 33, 8, 91, 4, 60], [3, *range(40, 52)], [7, 150, 9, *range(100, 118)]]
NATIVE = [pytest.param(True, id="native-ops"), pytest.param(False, id="torch-ops")]
if native_ops.load() is None:
    NATIVE[0] = pytest.param(True, id="native-ops", marks=pytest.mark.skip(reason="no native library here"))
FORMS = [pytest.param(True, True, id="native-ops", marks=NATIVE[0].marks),
         pytest.param(False, True, id="torch-ops-invariant"),
         pytest.param(False, False, id="torch-ops-plain")]


@pytest.fixture(scope="module", params=CASES, ids=[c.name for c in CASES])
def checkpoint(request, tmp_path_factory):
    """(case, saved directory, transformers model, its last-position logits of PROMPTS)."""
    case = request.param
    path = tmp_path_factory.mktemp(case.name)
    model = families.write_checkpoint(case, path)
    return case, path, model, [families.reference_logits(model, p) for p in PROMPTS]


def test_the_checkpoint_has_the_sparse_and_dense_layers_its_config_says(checkpoint):
    _, path, hf_model, _ = checkpoint
    model = load_model(path)
    hf_sparse = [hasattr(layer.mlp, "experts") or hasattr(layer, "block_sparse_moe")
                 for layer in hf_model.model.layers]
    assert [layer.moe is not None for layer in model.weights.layers] == hf_sparse
    assert any(hf_sparse)


@pytest.mark.parametrize(("native", "batch_invariant"), FORMS)
def test_last_position_logits_match_transformers(checkpoint, native, batch_invariant):
    _, path, _, expected = checkpoint
    model = load_model(path, batch_invariant=batch_invariant, native=native)
    for prompt, reference in zip(PROMPTS, expected, strict=True):
        torch.testing.assert_close(prefill_logits(model, prompt), reference, atol=1e-4, rtol=0)


def test_greedy_tokens_equal_transformers_over_32_steps(checkpoint):
    _, path, hf_model, _ = checkpoint
    prompt = PROMPTS[0]
    assert greedy(load_model(path), prompt, 32) == reference_greedy(hf_model, prompt, 32)


@pytest.mark.parametrize("native", NATIVE)
def test_a_request_is_bit_identical_alone_and_in_a_crowd(checkpoint, native):
    model = load_model(checkpoint[1], native=native)
    for alone, crowded in zip(*(crowd_logits(model, PROMPTS, crowd) for crowd in (False, True)),
                              strict=True):
        assert torch.equal(alone, crowded)


@pytest.mark.parametrize("native", NATIVE)
def test_a_prefill_in_chunks_is_bit_identical_to_one_prefill(checkpoint, native):
    model = load_model(checkpoint[1], native=native)
    prompt = PROMPTS[2]
    assert torch.equal(prefill_logits(model, prompt, chunk=5), prefill_logits(model, prompt))


@pytest.mark.parametrize("native", NATIVE)
def test_every_row_of_a_sparse_layer_is_its_bits_alone(native, tmp_path):
    """The block itself over 40 random rows (60 experts, top-4: rows share experts in every
    combination): each row's output equals that row run alone, bit for bit."""
    case = CASES[1]
    families.write_checkpoint(case, tmp_path)
    model = load_model(tmp_path, native=native)
    layer = next(w for w in model.weights.layers if w.moe is not None)
    x = torch.randn(40, model.config.hidden_size, generator=torch.Generator().manual_seed(3))
    crowd = model.moe(x, layer.moe)
    for row in range(x.shape[0]):
        assert torch.equal(model.moe(x[row:row + 1], layer.moe)[0], crowd[row])


def test_the_router_matches_transformers_top_k_and_renormalisation():
    transformers = families.transformers
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    for renormalize in (True, False):
        hf_config = transformers.Qwen3MoeConfig(
            hidden_size=16, num_attention_heads=2, num_key_value_heads=1, num_experts=8,
            num_experts_per_tok=3, norm_topk_prob=renormalize)
        router = Qwen3MoeTopKRouter(hf_config)
        torch.nn.init.normal_(router.weight)
        x = torch.randn(9, 16)
        _, hf_weights, hf_experts = router(x)
        raw = {**hf_config.to_dict(), "num_hidden_layers": 1}
        ours = route(x @ router.weight.detach().T, read_model_config(raw).experts)
        assert torch.equal(ours.experts, hf_experts)
        torch.testing.assert_close(ours.weights, hf_weights, atol=1e-6, rtol=0)


def test_the_step_groups_rows_by_expert_once_each():
    """One gate_up and one down per expert with rows, over exactly the rows routed to it, ascending."""
    experts = mixtral_experts(count=4, top_k=2)
    calls: list[tuple[str, int, list[float]]] = []
    x = torch.randn(6, 8)
    weights = random_moe_weights(4, 8, 4)

    def linear(a, w):
        for kind, matrices in (("gate_up", weights.gate_up), ("down", weights.down)):
            calls.extend((kind, e, a[:, 0].tolist()) for e, m in enumerate(matrices) if m is w)
        return a @ w.T

    block = MixtureOfExperts(experts, linear, lambda gate_up: gate_up.chunk(2, dim=-1)[1])
    routing = route(x @ weights.router.T, experts)
    block(x, weights)
    hit = sorted({int(e) for e in routing.experts.flatten()})
    assert [(kind, e) for kind, e, _ in calls] == [("gate_up", e) for e in hit] + [("down", e) for e in hit]
    for kind, e, firsts in calls:
        if kind == "gate_up":
            rows = [r for r in range(6) if e in routing.experts[r].tolist()]
            assert firsts == x[rows, 0].tolist()


def mixtral_experts(count: int, top_k: int, hidden: int = 8, width: int = 4):
    return read_model_config({**families.transformers.MixtralConfig(
        hidden_size=hidden, intermediate_size=width, num_local_experts=count, num_experts_per_tok=top_k,
        num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1).to_dict()}).experts


def random_moe_weights(count: int, hidden: int, width: int, top_k: int = 2):
    from nanoserve.model.weights import MoEWeights

    g = torch.Generator().manual_seed(0)
    return MoEWeights(torch.randn(count, hidden, generator=g),
                      [torch.randn(2 * width, hidden, generator=g) for _ in range(count)],
                      [torch.randn(hidden, width, generator=g) for _ in range(count)], top_k=top_k)


@pytest.mark.parametrize(("changes", "field"), [
    ({"scoring_func": "sigmoid"}, "scoring_func"),
    ({"routed_scaling_factor": 2.5}, "routed_scaling_factor"),
    ({"topk_group": 4}, "topk_group"),
    ({"expert_parallel_size": 2}, "expert_parallel_size"),
    ({"num_experts_per_tok": 9}, "num_experts_per_tok"),
    ({"mlp_only_layers": [5]}, "mlp_only_layers"),
    ({"use_sliding_window": True}, "use_sliding_window"),
])
def test_a_router_or_expert_option_not_implemented_is_refused_by_name(changes, field):
    raw = {**families.transformers.Qwen3MoeConfig(num_experts=8, num_experts_per_tok=2,
                                                  num_hidden_layers=2).to_dict(), **changes}
    with pytest.raises(UnsupportedModelError, match=f"'{field}'"):
        read_model_config(raw)


def test_olmoe_clip_qkv_is_refused_before_weights_load(tmp_path):
    case = Case("olmoe-clip", "OlmoeConfig", {**CASES[3].fields, "clip_qkv": 8.0})
    families.write_checkpoint(case, tmp_path)
    with pytest.raises(UnsupportedModelError, match="'clip_qkv'"):
        load_model(tmp_path)


GGUF_CASES = [(CASES[0], "qwen3moe"), (CASES[1], "qwen2moe"), (CASES[2], "llama"), (CASES[3], "olmoe")]


@pytest.mark.parametrize(("case", "architecture"), GGUF_CASES, ids=[a for _, a in GGUF_CASES])
def test_a_gguf_of_the_same_weights_gives_transformers_logits_and_tokens(case, architecture, tmp_path):
    """Written by the `gguf` package as llama.cpp's converter lays it out (experts stacked in
    ffn_*_exps), read through the importer and through the blocks path (`gguf=`)."""
    from nanoserve.loading.gguf import convert_gguf

    hf_model = families.write_checkpoint(case, tmp_path / "hf")
    path = families.write_gguf(tmp_path / "hf", tmp_path / "model.gguf", architecture)
    imported = load_model(convert_gguf(path, tmp_path / "imported"))
    blocks = load_model(tmp_path / "imported", gguf=path)
    for prompt in PROMPTS[:2]:
        reference = families.reference_logits(hf_model, prompt)
        torch.testing.assert_close(prefill_logits(imported, prompt), reference, atol=1e-4, rtol=0)
        torch.testing.assert_close(prefill_logits(blocks, prompt), reference, atol=1e-4, rtol=0)
    assert greedy(blocks, PROMPTS[0], 32) == reference_greedy(hf_model, PROMPTS[0], 32)


@pytest.mark.parametrize(("key", "write"), [
    ("expert_gating_func", lambda w: w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)),
    ("expert_weights_scale", lambda w: w.add_expert_weights_scale(2.5)),
    ("expert_group_count", lambda w: w.add_expert_group_count(4)),
])
def test_gguf_expert_metadata_not_implemented_is_refused_by_name(key, write, tmp_path):
    from nanoserve.loading.gguf import convert_gguf

    families.write_checkpoint(CASES[0], tmp_path / "hf")
    path = families.write_gguf(tmp_path / "hf", tmp_path / "model.gguf", "qwen3moe", extra_metadata=write)
    with pytest.raises(UnsupportedModelError, match=key):
        convert_gguf(path, tmp_path / "imported")


def test_q8_0_experts_are_split_as_whole_rows_of_blocks(tmp_path):
    """Stacked experts in Q8_0 blocks, read on the blocks path (each expert a slice of the
    stack's rows), against transformers running the same blocks as the `gguf` package
    dequantizes them."""
    from gguf.quants import dequantize, quantize

    from nanoserve.loading.gguf import import_metadata

    hf_model = families.write_checkpoint(CASES[0], tmp_path / "hf")
    q8_0 = gguf.GGMLQuantizationType.Q8_0
    path = families.write_gguf(tmp_path / "hf", tmp_path / "model.gguf", "qwen3moe", expert_type=q8_0)
    import_metadata(path, tmp_path / "imported")
    blocks = load_model(tmp_path / "imported", gguf=path)
    with torch.no_grad():
        for layer in hf_model.model.layers:
            if hasattr(layer.mlp, "experts"):
                for p in (layer.mlp.experts.gate_up_proj, layer.mlp.experts.down_proj):
                    rounded = dequantize(quantize(p.detach().numpy(), q8_0), q8_0)
                    p.copy_(torch.from_numpy(rounded.reshape(p.shape)))
    for prompt in PROMPTS[:2]:
        reference = families.reference_logits(hf_model, prompt)
        torch.testing.assert_close(prefill_logits(blocks, prompt), reference, atol=1e-4, rtol=0)


@pytest.mark.parametrize("case", [CASES[1], CASES[2]], ids=[CASES[1].name, CASES[2].name])
def test_two_ranks_split_the_experts_and_give_the_logits_of_one(case, tmp_path):
    """Every expert (and the shared one) split by its intermediate dimension over 2 gloo ranks,
    one thread each, the router replicated: the ranks' logits, joined by vocabulary, lie within
    1e-5 of one rank's and within 1e-4 of transformers'."""
    from rank_threads import in_threads

    from nanoserve.distributed.collectives import Collectives
    from nanoserve.distributed.shards import Shard, local_config
    from nanoserve.loading.weights import load_weights
    from nanoserve.model.decoder import DecoderLM

    hf_model = families.write_checkpoint(case, tmp_path)
    world, prompt = 2, PROMPTS[1]

    def work(group, rank):
        shard = Shard(rank, world)
        config, weights = load_weights(tmp_path, dtype=torch.float32, device=torch.device("cpu"), shard=shard)
        start, count, _ = shard.vocab_rows(config.vocab_size)
        collectives = Collectives(group, shard, start, count, ordered=True)
        model = DecoderLM(local_config(config, world), weights, batch_invariant=True,
                          tensor_parallel=collectives)
        assert all(len(w.moe.gate_up) == config.experts.count for w in model.weights.layers if w.moe)
        return prefill_logits(model, prompt)[:count]

    joined = torch.cat(in_threads(world, work))
    torch.testing.assert_close(joined, prefill_logits(load_model(tmp_path), prompt), atol=1e-5, rtol=0)
    torch.testing.assert_close(joined, families.reference_logits(hf_model, prompt), atol=1e-4, rtol=0)


def test_a_size_that_does_not_divide_the_experts_width_is_refused_naming_the_option():
    from nanoserve.distributed.shards import check_shardable
    from nanoserve.errors import InvalidRequestError

    config = read_model_config(families.transformers.Qwen3MoeConfig(
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=30, num_hidden_layers=1,
        intermediate_size=64).to_dict())
    with pytest.raises(InvalidRequestError, match="experts' width 30") as error:
        check_shardable(config, 4)
    assert error.value.param == "tensor_parallel_size"


def test_a_lora_on_the_mlp_of_a_sparse_layer_is_refused_naming_the_tensor():
    """A sparse layer has no gate/up/down for an adapter's update to follow (the experts run in
    their place): an adapter targeting them is refused, not loaded and silently skipped; the
    same modules on a dense layer and attention on a sparse one are taken."""
    from nanoserve.model.lora import AdapterTensor, check_weights

    config = read_model_config(CASES[0].config().to_dict())  # layer 0 sparse, layer 1 dense
    assert config.is_sparse(0) and not config.is_sparse(1)
    rank, hidden, width = 2, config.hidden_size, config.intermediate_size

    def pair(layer: int, module: str, width_in: int, width_out: int) -> list[AdapterTensor]:
        key = f"layers.{layer}.{module}"
        return [AdapterTensor(f"{key}.A", layer, module, "A", torch.zeros(rank, width_in)),
                AdapterTensor(f"{key}.B", layer, module, "B", torch.zeros(width_out, rank))]

    q_width = config.num_heads * config.head_dim
    taken = check_weights("ok", config, rank, 1.0, pair(0, "q_proj", hidden, q_width)
                          + pair(1, "gate_proj", hidden, width) + pair(1, "down_proj", width, hidden))
    assert set(taken.layers[0]) == {"q_proj"} and set(taken.layers[1]) == {"gate_proj", "down_proj"}
    for module, shape in (("gate_proj", (hidden, width)), ("down_proj", (width, hidden))):
        with pytest.raises(InvalidRequestError) as error:
            check_weights("moe-adapter", config, rank, 1.0, pair(0, module, *shape))
        assert f"layers.0.{module}.A" in error.value.message and "mixture of experts" in error.value.message
        assert error.value.param == "lora_path"


def test_the_engine_serves_a_mixture_of_experts_end_to_end(tmp_path, tiny_model_dir):
    """Through LLM (the kernel measured and self-tested on the experts' shapes, the scheduler,
    the sampler): greedy tokens equal transformers', alone and beside another request."""
    import shutil

    from nanoserve.llm import LLM
    from nanoserve.sampling_params import SamplingParams

    case = Case(CASES[1].name, CASES[1].config_class, {**CASES[1].fields, "vocab_size": 400})
    hf_model = families.write_checkpoint(case, tmp_path)
    for file in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_model_dir / file, tmp_path / file)
    llm = LLM(str(tmp_path), device="cpu", num_kv_blocks=64, max_num_seqs=4)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompt, other = PROMPTS[0], PROMPTS[2]
    results = llm.generate([{"prompt_token_ids": prompt}, {"prompt_token_ids": other}], params)
    alone = llm.generate([{"prompt_token_ids": prompt}], params)[0]
    expected = reference_greedy(hf_model, prompt, 12)
    assert results[0].outputs[0].token_ids == alone.outputs[0].token_ids == expected


# The native experts (csrc/stages/moe.c): one call a sparse layer where the experts are native matrices.
NEEDS_NATIVE = pytest.mark.skipif(native_ops.load() is None, reason="no native library here")
X8 = QUANTIZED_KERNELS["native-quant-x8"]


@dataclasses.dataclass(frozen=True)
class ExpertFormats:
    """The GGUF types of a layer's experts: gate and up (stacked into one matrix of one format,
    or a stack of two), and expert e's down in downs[e % len(downs)]."""

    gate: str
    up: str
    downs: tuple[str, ...]


def same(format_name: str) -> ExpertFormats:
    return ExpertFormats(format_name, format_name, (format_name,))


# (kernel, the experts' formats or None for float32 panels, hidden, width): float and half panels
# on widths that leave partial 16-column panels; blocks on whole blocks (K types: 256 values).
NATIVE_FORMS = [pytest.param(KERNELS["native"], None, 40, 24, id="float32-panels"),
                pytest.param(X8, same("q8_0"), 64, 32, id="q8_0-repacked"),
                pytest.param(X8, same("q4_0"), 64, 96, id="q4_0-repacked"),
                *(pytest.param(X8, same(f), 256, 256, id=f"{f}-repacked")
                  for f in ("q4_k", "q5_k", "q6_k", "q2_k", "q3_k", "iq4_xs")),
                pytest.param(X8, same("f16"), 40, 24, id="f16-panels"),
                pytest.param(X8, ExpertFormats("q4_k", "q4_k", ("q6_k",)), 256, 256, id="q4_k-q6_k-downs"),
                # a stack (gate and up in two formats); downs of two kinds, so the sums wait at a barrier
                pytest.param(X8, ExpertFormats("iq4_xs", "q5_k", ("q6_k", "bf16")), 256, 256,
                             id="stacked-gate-up-mixed-downs")]


def expert_matrices(formats: ExpertFormats, count: int, hidden: int, width: int):
    """(gate_up, down) per expert: random blocks in `formats`, gate and up stacked as the loader
    stacks them."""
    from nanoserve import quant

    g = torch.Generator().manual_seed(0)

    def blocks(format_name: str, rows: int, columns: int):
        return quant.random_weight(format_name, rows, columns, generator=g)

    gate_up = [quant.stack_rows([blocks(formats.gate, width, hidden), blocks(formats.up, width, hidden)])
               for _ in range(count)]
    down = [blocks(formats.downs[e % len(formats.downs)], hidden, width) for e in range(count)]
    return gate_up, down


def native_layer(kernel, formats, hidden, width, count=60, top_k=4):
    """(block, packed weights, native experts): a sparse layer as the model packs it for `kernel`."""
    weights = random_moe_weights(count, hidden, width, top_k)
    if formats is not None:  # the router stays float, as --quantize keeps it
        gate_up, down = expert_matrices(formats, count, hidden, width)
        weights = dataclasses.replace(weights, gate_up=gate_up, down=down)
    packed = weights.with_matrices(kernel.pack, lambda m: m)
    spec = mixtral_experts(count, top_k, hidden, width)
    block = MixtureOfExperts(spec, kernel.apply, native_ops.load().silu_mul)
    experts = NativeExperts.for_layer(packed.router, packed.gate_up, packed.down, top_k, renormalize=True,
                                      float_panels=formats is None)
    assert experts is not None
    return block, packed, experts


@NEEDS_NATIVE
@pytest.mark.parametrize(("kernel", "formats", "hidden", "width"), NATIVE_FORMS)
def test_one_native_call_gives_the_loops_bits_and_each_row_its_bits_alone(kernel, formats, hidden, width):
    """60 experts, top-4: most experts see no row, the others from 1 to many; given route()'s
    routing the one call equals the loop through the same kernels bit for bit, and routing
    itself, every row has the bits of its own call alone (70 rows: the router and the gather
    split across the threads; a row alone: both on one thread)."""
    block, packed, experts = native_layer(kernel, formats, hidden, width)
    x = torch.randn(70, hidden, generator=torch.Generator().manual_seed(5))
    routing = route(block.linear(x, packed.router), block.spec)
    assert torch.equal(experts(x, routing.experts, routing.weights), block(x, packed))
    routed = block(x, packed, experts)  # routed in the call too
    for row in (0, 17, 69):
        assert torch.equal(block(x[row:row + 1], packed, experts)[0], routed[row])


@NEEDS_NATIVE
@pytest.mark.parametrize("renormalize", [True, False], ids=["renormalised", "raw"])
def test_the_native_routing_picks_routes_experts_and_runs_them_with_its_weights(renormalize):
    """The call that routes the rows itself picks route()'s experts with its weights to 1e-6,
    and its sum is the bits of the call given those experts and weights."""
    block, packed, experts = native_layer(KERNELS["native"], None, 40, 24)
    experts = NativeExperts.for_layer(packed.router, packed.gate_up, packed.down, 4, renormalize=renormalize,
                                      float_panels=True)
    spec = dataclasses.replace(block.spec, renormalize=renormalize)
    x = torch.randn(33, 40, generator=torch.Generator().manual_seed(8))
    out, chosen, weights = experts.routed(x)
    reference = route(block.linear(x, packed.router), spec)
    assert torch.equal(chosen.sort(dim=1).values, reference.experts.sort(dim=1).values)
    order = chosen.argsort(dim=1)
    expected = reference.weights.gather(1, reference.experts.argsort(dim=1))
    torch.testing.assert_close(weights.gather(1, order), expected, atol=1e-6, rtol=0)
    assert torch.equal(out, experts(x, chosen, weights))


@NEEDS_NATIVE
def test_the_native_experts_are_one_native_call_and_bad_routing_is_refused():
    block, packed, experts = native_layer(KERNELS["native"], None, 40, 24)
    x = torch.randn(9, 40)
    routing = route(block.linear(x, packed.router), block.spec)
    before = native_library.calls()
    experts.routed(x)
    assert native_library.calls() - before == 1
    outside = routing.experts.clone()
    outside[3, 1] = 60
    with pytest.raises(IndexError, match=r"expert indices must lie in \[0, 60\)"):
        experts(x, outside, routing.weights)
    with pytest.raises(ValueError, match="experts must be int64"):
        experts(x, routing.experts.int(), routing.weights)
    with pytest.raises(ValueError, match="x must be float32"):
        experts(x.double(), routing.experts, routing.weights)


@NEEDS_NATIVE
def test_a_model_on_native_matrices_runs_its_experts_natively_as_transformers_does(checkpoint, monkeypatch):
    """Every sparse layer one native call (the loop's routing and grouping, with its host read,
    made to raise), logits within 1e-4 of transformers, a request's logits alone == in a crowd."""
    from nanoserve.loading.weights import load_weights
    from nanoserve.model import moe
    from nanoserve.model.decoder import DecoderLM

    _, path, _, expected = checkpoint
    config, weights = load_weights(path, dtype=torch.float32, device=torch.device("cpu"))
    model = DecoderLM(config, weights, batch_invariant=True, linear_kernel=KERNELS["native"])
    assert [e is not None for e in model.native_experts] == [w.moe is not None for w in model.weights.layers]

    def no_grouping(*_):
        raise AssertionError("the loop's routing or grouping ran")

    monkeypatch.setattr(moe, "group_by_expert", no_grouping)
    monkeypatch.setattr(moe, "route", no_grouping)
    for prompt, reference in zip(PROMPTS, expected, strict=True):
        torch.testing.assert_close(prefill_logits(model, prompt), reference, atol=1e-4, rtol=0)
    for alone, crowded in zip(*(crowd_logits(model, PROMPTS, crowd) for crowd in (False, True)), strict=True):
        assert torch.equal(alone, crowded)


@pytest.mark.parametrize("use_native", [pytest.param(True, id="native", marks=NEEDS_NATIVE),
                                        pytest.param(False, id="loop")])
def test_the_tally_counts_each_experts_rows_and_times_only_the_experts_hit(use_native):
    if use_native:
        block, packed, experts = native_layer(KERNELS["native"], None, 40, 24, count=8, top_k=2)
    else:
        block = MixtureOfExperts(mixtral_experts(8, 2, 40, 24), lambda a, w: a @ w.T,
                                 lambda gate_up: gate_up.chunk(2, dim=-1)[1])
        packed, experts = random_moe_weights(8, 40, 24), None
    x = torch.randn(5, 40, generator=torch.Generator().manual_seed(2))
    block.tally = ExpertTally.zeros(8)
    block(x, packed, experts)
    block(x[:2], packed, experts)
    chosen = route(block.linear(x, packed.router), block.spec).experts
    expected = torch.bincount(torch.cat([chosen.flatten(), chosen[:2].flatten()]), minlength=8)
    assert torch.equal(block.tally.rows, expected)
    assert block.tally.calls == 2
    assert torch.equal(block.tally.seconds > 0, expected > 0)


QUANTIZED_TP_CASE = Case("qwen2-moe-q8_0-whole-blocks", "Qwen2MoeConfig",
                         {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
                          "shared_expert_intermediate_size": 64, "num_hidden_layers": 2})


@NEEDS_NATIVE
def test_two_ranks_on_q8_0_experts_give_the_logits_of_one_bit_for_bit(tmp_path):
    """Every matrix in Q8_0 blocks (--quantize), experts and the shared expert split as the dense
    MLP on blocks: gate/up by width, down by output after one gather of every expert's slices.
    Two gloo ranks in threads decode one rank's logits bit for bit, two requests in one step
    (one rank runs the native experts' one call; the ranks route through it and run the loop with
    its gathers)."""
    from families import Cache, step
    from rank_threads import in_threads

    from nanoserve.distributed import shards
    from nanoserve.distributed.collectives import Collectives
    from nanoserve.distributed.shards import Shard
    from nanoserve.loading.weights import load_weights
    from nanoserve.model.decoder import DecoderLM

    families.write_checkpoint(QUANTIZED_TP_CASE, tmp_path)
    kernel, world = QUANTIZED_KERNELS["native-quant-x8"], 2
    assert shards.splits_by_output(None, "q8_0")

    def decode(shard=None, group=None) -> list[torch.Tensor]:
        config, weights = load_weights(tmp_path, dtype=torch.float32, device=torch.device("cpu"), shard=shard)
        collectives = None
        if shard is not None:
            start, count, _ = shard.vocab_rows(config.vocab_size)
            collectives = Collectives(group, shard, start, count, ordered=True)
        local = shards.local_config(config, world if shard else 1)
        model = DecoderLM(local, weights.quantized("q8_0"), batch_invariant=True, linear_kernel=kernel,
                          tensor_parallel=collectives)
        assert any(e is not None for e in model.native_experts)
        cache, seen = Cache(local), []
        positions = {"a": len(PROMPTS[0]), "b": len(PROMPTS[2])}
        chunks = [("a", PROMPTS[0], 0), ("b", PROMPTS[2], 0)]
        for _ in range(4):
            out, chunks = step(model, cache, chunks), []
            for seq in ("a", "b"):
                logits = out[seq].unsqueeze(0)
                if collectives is not None:
                    logits = collectives.all_gather(logits)
                seen.append(logits[0, :config.vocab_size])
                chunks.append((seq, [int(seen[-1].argmax())], positions[seq]))
                positions[seq] += 1
        return seen

    one = decode()
    for rank_logits in in_threads(world, lambda group, rank: decode(Shard(rank, world, True), group)):
        for got, want in zip(rank_logits, one, strict=True):
            assert torch.equal(got, want)


def test_the_profile_histogram_routes_every_decode_row_to_top_k_experts_in_every_sparse_layer(
        tmp_path, tiny_model_dir):
    """`profile`'s experts section: each decode step of N requests routes N rows to top_k experts
    in each sparse layer, so the histogram sums to N * top_k * sparse layers a step; an expert
    with no row has no matmul time."""
    import shutil

    from nanoserve.bench.profile import ProfileSpec, build_engine, expert_profile

    case = Case(CASES[1].name, CASES[1].config_class, {**CASES[1].fields, "vocab_size": 400})
    families.write_checkpoint(case, tmp_path)
    for file in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_model_dir / file, tmp_path / file)
    spec = ProfileSpec(batch_sizes=(1, 3), input_len=5, output_len=6, model=str(tmp_path), device="cpu")
    frame = expert_profile(build_engine(spec), spec)
    experts = read_model_config(case.config().to_dict()).experts
    sparse = sum(experts.sparse_layers)
    assert sorted(frame["batch_size"].unique()) == [1, 3]
    for batch_size, rows in frame.groupby("batch_size"):
        assert len(rows) == experts.count
        assert rows["rows_per_step"].sum() == pytest.approx(batch_size * experts.top_k * sparse)
        assert ((rows["expert_ms_per_step"] > 0) == (rows["rows_per_step"] > 0)).all()
    dense = ProfileSpec(batch_sizes=(1,), model=str(tiny_model_dir), device="cpu")
    assert expert_profile(build_engine(dense), dense) is None


# The one-call decoder (csrc/stages/decoder.c) over a Llama stack whose MLPs are experts: widths in whole
# blocks of 32, as it asks; three layers, so a sparse layer's sums feed the next layer's norm.
FUSED_CASE = Case("mixtral-8-experts-top2-whole-blocks", "MixtralConfig",
                  {"num_local_experts": 8, "num_experts_per_tok": 2, "intermediate_size": 64,
                   "num_hidden_layers": 3})
FUSED_FORMS = [pytest.param("float32", KERNELS["native"], id="float32-panels"),
               pytest.param("q8_0", QUANTIZED_KERNELS["native-quant-x8"], id="q8_0-repacked"),
               pytest.param("q4_0", QUANTIZED_KERNELS["native-quant-x8"], id="q4_0-repacked")]


@pytest.fixture(scope="module")
def fused_checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp(FUSED_CASE.name)
    families.write_checkpoint(FUSED_CASE, path)
    return path


def fused_model(path, format_name, kernel, *, fused: bool, gguf=None):
    """The checkpoint (its matrices from the `gguf` file where given) in `format_name`."""
    from nanoserve.loading.weights import load_weights
    from nanoserve.model.decoder import DecoderLM

    config, weights = load_weights(path, dtype=torch.float32, device=torch.device("cpu"), gguf=gguf)
    if format_name != "float32":
        weights = weights.quantized(format_name)
    model = DecoderLM(config, weights, batch_invariant=True, linear_kernel=kernel)
    assert model.decoder is not None and model.decoder.sparse_layers == config.num_layers
    if not fused:
        model.decoder = None
    return model


def fused_steps(model) -> tuple[list[dict[str, torch.Tensor]], families.Cache]:
    """A prefill, a decode beside a chunk, the chunk's end, then three decode steps of two."""
    from families import Cache, step

    cache, outputs = Cache(model.config), []
    a, b = PROMPTS[0], PROMPTS[2]
    outputs.append(step(model, cache, [("a", a, 0)]))
    outputs.append(step(model, cache, [("a", [5], len(a)), ("b", b[:11], 0)]))
    outputs.append(step(model, cache, [("b", b[11:], 11)]))
    for i in range(3):
        outputs.append(step(model, cache, [("a", [9 + i], len(a) + 1 + i), ("b", [3 + i], len(b) + i)]))
    return outputs, cache


@NEEDS_NATIVE
@pytest.mark.parametrize(("format_name", "kernel"), FUSED_FORMS)
def test_the_one_call_decoder_runs_sparse_layers_to_the_bits_of_the_per_layer_calls(fused_checkpoint,
                                                                                      format_name, kernel):
    """Logits and the K/V written, fused == one native call per sparse layer, bit for bit; and
    in the fused decoder a request's logits alone == in a crowd."""
    fused = fused_model(fused_checkpoint, format_name, kernel, fused=True)
    separate = fused_model(fused_checkpoint, format_name, kernel, fused=False)
    assert_same_steps(fused_steps(fused), fused_steps(separate))
    for alone, crowded in zip(*(crowd_logits(fused, PROMPTS, crowd) for crowd in (False, True)), strict=True):
        assert torch.equal(alone, crowded)


# A Mixtral whose experts are in the K layouts, as published GGUFs keep them: widths of whole
# 256-value super-blocks.
K_FUSED_CASE = Case("mixtral-8-experts-top2-super-blocks", "MixtralConfig",
                    {"num_local_experts": 8, "num_experts_per_tok": 2, "hidden_size": 256,
                     "intermediate_size": 256})


def _gguf_mix(experts: dict[str, str], attention: dict[str, str] | None = None, downs_by_layer=None):
    """A GGUF name -> its type: the experts' stacks by kind, the attention's by kind (else Q8_0),
    a layer's down in downs_by_layer[layer] where given; the router float32 (llama-quantize
    keeps ffn_gate_inp so)."""
    def matrix_type(name: str):
        kind = name.split(".")[-2]
        if kind == "ffn_gate_inp":
            return None
        picked = {**(attention or {}), **experts}.get(kind, "q8_0")
        if kind == "ffn_down_exps" and downs_by_layer is not None:
            picked = downs_by_layer[int(name.split(".")[1])]
        return gguf.GGMLQuantizationType[picked.upper()]

    return matrix_type


# (the file's types, each sparse layer's (gate_up, down) formats as loaded)
GGUF_EXPERT_MIXES = [
    pytest.param(_gguf_mix({"ffn_gate_exps": "q4_k", "ffn_up_exps": "q4_k", "ffn_down_exps": "q6_k"}),
                 [("q4_k", "q6_k")] * 2, id="q4_k_m-q4_k-q6_k-downs"),
    pytest.param(_gguf_mix({"ffn_gate_exps": "iq4_xs", "ffn_up_exps": "iq4_xs"},
                           {"attn_q": "iq4_xs", "attn_k": "iq4_xs", "attn_v": "q5_k",
                            "attn_output": "iq4_xs"},
                           downs_by_layer=("iq4_xs", "q6_k")),
                 [("iq4_xs", "iq4_xs"), ("iq4_xs", "q6_k")], id="iq4_xs-a-q6_k-down"),
    pytest.param(_gguf_mix({"ffn_gate_exps": "q5_k", "ffn_up_exps": "f16", "ffn_down_exps": "bf16"}),
                 [("q5_k+f16", "bf16")] * 2, id="stacked-q5_k-f16-bf16-downs")]


@NEEDS_NATIVE
@pytest.mark.parametrize(("matrix_type", "loaded"), GGUF_EXPERT_MIXES)
def test_a_gguf_of_experts_in_its_layouts_runs_them_in_the_one_call_decoder_to_the_per_layer_calls_bits(
        tmp_path, matrix_type, loaded):
    """A GGUF's stacked experts in the types a published file mixes, through the loader: the
    decoder is built with every sparse layer's experts in it (fused_model asserts it, rather than
    leave them to the per-layer calls); logits and K/V == one native call per sparse layer, bit
    for bit; a request's logits alone == in a crowd."""
    from nanoserve.loading.gguf import import_metadata
    from nanoserve.quant import QuantizedStack

    def formats(packed) -> str:  # a kernel's packed matrix keeps its GGUF format
        parts = packed.parts if isinstance(packed, QuantizedStack) else (packed,)
        return "+".join(p.format.name for p in parts)

    families.write_checkpoint(K_FUSED_CASE, tmp_path / "hf")
    path = families.write_gguf(tmp_path / "hf", tmp_path / "model.gguf", "llama", matrix_type=matrix_type)
    import_metadata(path, tmp_path / "imported")
    fused = fused_model(tmp_path / "imported", "float32", X8, fused=True, gguf=path)
    separate = fused_model(tmp_path / "imported", "float32", X8, fused=False, gguf=path)
    assert [(formats(w.moe.gate_up[0]), formats(w.moe.down[0])) for w in fused.weights.layers] == loaded
    outputs, cache = fused_steps(fused)
    assert all(torch.isfinite(logits).all() for step_out in outputs for logits in step_out.values())
    assert_same_steps((outputs, cache), fused_steps(separate))
    for alone, crowded in zip(*(crowd_logits(fused, PROMPTS, crowd) for crowd in (False, True)), strict=True):
        assert torch.equal(alone, crowded)


@NEEDS_NATIVE
def test_a_fused_sparse_step_is_a_few_native_calls_and_tallies_every_routed_row(fused_checkpoint):
    """The whole stack one call (the per-layer experts' calls made to raise); the profile's
    tally counts each row top_k times a sparse layer, and times only the experts hit."""
    from families import Cache, step

    model = fused_model(fused_checkpoint, "q4_0", QUANTIZED_KERNELS["native-quant-x8"], fused=True)
    for experts in model.native_experts:
        experts._run = None  # any per-layer call would raise a TypeError
    model.moe.tally = tally = ExpertTally.zeros(8)
    before = native_library.calls()
    step(model, Cache(model.config), [("a", PROMPTS[1], 0)])
    assert native_library.calls() - before <= 4  # the embedding, the decoder, the final norm, the head
    layers = model.config.num_layers
    assert tally.calls == layers
    assert int(tally.rows.sum()) == len(PROMPTS[1]) * 2 * layers
    assert torch.equal(tally.seconds > 0, tally.rows > 0)


def test_bench_moe_refuses_an_unknown_linear_kernel_naming_the_option():
    from typer.testing import CliRunner

    from nanoserve_cli.main import app

    result = CliRunner().invoke(app, ["bench", "moe", "--linear-kernel", "blas9000"])
    assert result.exit_code == 2, result.output
    assert "--linear-kernel" in result.output and "Traceback" not in result.output


@NEEDS_NATIVE
def test_bench_moe_layouts_times_the_loop_and_the_one_call_and_refuses_a_width_a_layout_cannot_hold(
        tmp_path, capsys):
    import csv

    from nanoserve.bench.experiments import moe_layouts

    out = tmp_path / "moe_layouts.csv"
    moe_layouts.main(["--mixes", "q4_k_m,f16", "--rows", "1,3", "--experts", "4", "--hidden", "256",
                      "--width", "256", "--repeat", "1", "--out", str(out)])
    records = list(csv.DictReader(out.open()))
    assert [(r["mix"], r["down"], r["rows"]) for r in records] == [
        ("q4_k_m", "q6_k", "1"), ("q4_k_m", "q6_k", "3"), ("f16", "f16", "1"), ("f16", "f16", "3")]
    assert all(float(r["loop_ms"]) > 0 and float(r["one_call_ms"]) > 0 for r in records)
    with pytest.raises(SystemExit):
        moe_layouts.main(["--mixes", "q4_k_m", "--hidden", "288", "--out", str(out)])
    error = capsys.readouterr().err
    assert "--mixes q4_k_m: q4_k needs --hidden and --width in whole 256-value blocks" in error

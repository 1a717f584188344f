"""Multi-LoRA serving, held against transformers + PEFT: an adapter trained nowhere but built
here with random weights on a tiny model gives our engine the logprobs PEFT's model gives
(float32, within 1e-4); a row with its adapter has the same bits alone and beside rows with
other adapters and none; the prefix cache never hands one adapter's K/V to another; a bad
adapter is refused by name and nothing of it stays loaded. llama.cpp's GGUF LoRA, written here
by the `gguf` package from a PEFT adapter as llama.cpp's converter writes it, gives the outputs
of that PEFT adapter."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from test_gguf_import import native_off
from tiny_model import write_tiny_llama

from nanoserve import LoRARequest
from nanoserve import native as native_library
from nanoserve.errors import InvalidRequestError
from nanoserve.llm import LLM
from nanoserve.sampling_params import SamplingParams

peft = pytest.importorskip("peft", reason="peft (the dev extra) is not installed")
transformers = pytest.importorskip("transformers")

ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=0)
PROMPT = "Once upon a time, in a small village"


def build_adapter(model_dir: Path, out: Path, *, seed: int, rank: int = 4,
                  targets: list[str] = ALL_TARGETS) -> Path:
    """A PEFT LoRA adapter with random A and B (PEFT starts B at zero: no update at all)."""
    torch.manual_seed(seed)
    base = transformers.AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    model = peft.get_peft_model(base, peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets,
                                                      lora_dropout=0.0))
    with torch.no_grad():
        for name, weight in model.named_parameters():
            if "lora_" in name:
                weight.copy_(torch.randn_like(weight) * 0.2)
    model.save_pretrained(out)
    return out


def peft_logprobs(model_dir: Path, adapter_dir: Path, prompt_ids: list[int],
                  token_ids: list[int]) -> list[float]:
    """The PEFT model's logprob of each generated token, teacher-forced."""
    base = transformers.AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    model = peft.PeftModel.from_pretrained(base, adapter_dir).eval()
    ids = torch.tensor([prompt_ids + token_ids])
    with torch.no_grad():
        logits = model(ids).logits[0].float()
    logprobs = torch.log_softmax(logits, dim=-1)
    start = len(prompt_ids) - 1
    return [logprobs[start + i, token].item() for i, token in enumerate(token_ids)]


@pytest.fixture(scope="module")
def adapters(tiny_model_dir, tmp_path_factory) -> list[Path]:
    root = tmp_path_factory.mktemp("adapters")
    return [build_adapter(tiny_model_dir, root / f"a{i}", seed=i) for i in range(3)]


def lora_llm(model_dir, **options) -> LLM:
    """float32 K/V: PEFT's own arithmetic (the default float16 cache's agreement is
    test_reference_parity's)."""
    return LLM(str(model_dir), dtype="float32", device="cpu", batch_invariant=True, enable_lora=True,
               max_loras=4, max_lora_rank=8, num_kv_blocks=64, kv_cache_dtype="float32", **options)


def lora_llm_on(model_dir, monkeypatch, *, native: bool) -> LLM:
    """`lora_llm`, started with the native kernels (where the library loads) or without them."""
    if native:
        return lora_llm(model_dir)
    with native_off(monkeypatch):
        return lora_llm(model_dir)


def requests_of(adapters: list[Path]) -> list[LoRARequest]:
    return [LoRARequest(f"adapter-{i}", i + 1, str(path)) for i, path in enumerate(adapters)]


@pytest.mark.parametrize("native", [True, False], ids=["native", "torch"])
def test_an_adapter_gives_the_logprobs_transformers_and_peft_give(tiny_model_dir, adapters, monkeypatch,
                                                                   native):
    lora = requests_of(adapters)[0]
    llm = lora_llm_on(tiny_model_dir, monkeypatch, native=native)
    got = llm.generate([PROMPT], GREEDY, lora_request=lora)[0]
    base = llm.generate([PROMPT], GREEDY)[0]
    expected = peft_logprobs(tiny_model_dir, adapters[0], got.prompt_token_ids, got.token_ids)
    ours = [entry.logprob for entry in got.logprobs]
    assert max(abs(a - b) for a, b in zip(ours, expected, strict=True)) < 1e-4
    assert base.token_ids != got.token_ids or [e.logprob for e in base.logprobs] != ours, "no update applied"


@pytest.mark.parametrize("native", [True, False], ids=["native", "torch"])
def test_an_attention_adapter_on_a_mixture_of_experts_gives_peft_logprobs(tiny_model_dir, tmp_path,
                                                                           monkeypatch, native):
    """The experts run where the MLP would (a stage of the one-call decoder where that runs);
    the attention modules' updates still apply around them as PEFT applies them."""
    import shutil

    import families
    from test_moe import CASES

    mixtral = next(case for case in CASES if case.config_class == "MixtralConfig")
    model_dir = tmp_path / "moe"
    families.write_checkpoint(families.Case(mixtral.name, mixtral.config_class,
                                            {**mixtral.fields, "vocab_size": 400}), model_dir)
    for file in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_model_dir / file, model_dir / file)
    adapter = build_adapter(model_dir, tmp_path / "adapter", seed=3, targets=["q_proj", "v_proj", "o_proj"])
    llm = lora_llm_on(model_dir, monkeypatch, native=native)
    got = llm.generate([PROMPT], GREEDY, lora_request=LoRARequest("attention", 1, str(adapter)))[0]
    expected = peft_logprobs(model_dir, adapter, got.prompt_token_ids, got.token_ids)
    assert max(abs(a - b) for a, b in zip([e.logprob for e in got.logprobs], expected, strict=True)) < 1e-4


@pytest.mark.parametrize("native", [True, False], ids=["native", "torch"])
def test_a_row_with_its_adapter_has_the_same_bits_alone_and_beside_other_adapters(tiny_model_dir, adapters,
                                                                                  monkeypatch, native):
    loras = requests_of(adapters)
    llm = lora_llm_on(tiny_model_dir, monkeypatch, native=native)
    prompts = [f"{PROMPT} {i}" + " the" * i for i in range(6)]
    per_prompt = [loras[i % 3] if i % 4 != 3 else None for i in range(6)]
    crowd = llm.generate(prompts, GREEDY, lora_request=per_prompt)
    for prompt, lora, together in zip(prompts, per_prompt, crowd, strict=True):
        alone = llm.generate([prompt], GREEDY, lora_request=lora)[0]
        assert alone.token_ids == together.token_ids
        assert [e.logprob for e in alone.logprobs] == [e.logprob for e in together.logprobs]
    assert llm.engine.pool.is_completely_free


def test_the_prefix_cache_never_gives_one_adapters_kv_to_another(tiny_model_dir, adapters):
    lora = requests_of(adapters)[1]
    long_prompt = PROMPT + " and the old baker" * 6
    fresh = lora_llm(tiny_model_dir).generate([long_prompt], GREEDY, lora_request=lora)[0]
    warmed = lora_llm(tiny_model_dir)
    warmed.generate([long_prompt], GREEDY)  # the base model's K/V of the prompt, cached
    again = warmed.generate([long_prompt], GREEDY, lora_request=lora)[0]
    assert [e.logprob for e in again.logprobs] == [e.logprob for e in fresh.logprobs]


def refused(llm: LLM, lora: LoRARequest) -> InvalidRequestError:
    with pytest.raises(InvalidRequestError) as error:
        llm.generate([PROMPT], GREEDY, lora_request=lora)
    assert llm.engine.list_loras() == [], "a refused adapter stayed loaded"
    assert not llm.engine.has_unfinished()
    return error.value


def test_bad_adapters_are_refused_by_name_and_nothing_of_them_loads(tiny_model_dir, tmp_path):
    llm = lora_llm(tiny_model_dir)
    wide = build_adapter(tiny_model_dir, tmp_path / "wide", seed=5, rank=16)
    error = refused(llm, LoRARequest("wide", 1, str(wide)))
    assert "max_lora_rank=8" in error.message and "r=16" in error.message
    assert "is not a PEFT adapter folder" in refused(llm, LoRARequest("none", 2, str(tmp_path))).message
    other_base = write_tiny_llama(tmp_path / "other", hidden_size=32, intermediate_size=64)
    error = refused(llm, LoRARequest("other", 3, str(build_adapter(other_base, tmp_path / "o", seed=6))))
    assert "shape" in error.message and error.param == "lora_path"
    odd = build_adapter(tiny_model_dir, tmp_path / "odd", seed=7)
    config = json.loads((odd / "adapter_config.json").read_text())
    (odd / "adapter_config.json").write_text(json.dumps(config | {"target_modules": ["q_proj", "lm_head"]}))
    assert "lm_head" in refused(llm, LoRARequest("odd", 4, str(odd))).message


def test_lora_requests_without_enable_lora_are_refused_by_name(tiny_model_dir, adapters):
    plain = LLM(str(tiny_model_dir), device="cpu", num_kv_blocks=32)
    with pytest.raises(InvalidRequestError) as error:
        plain.generate([PROMPT], GREEDY, lora_request=requests_of(adapters)[0])
    assert error.value.param == "lora_request"
    with pytest.raises(InvalidRequestError) as error:
        LLM(str(tiny_model_dir), device="cpu", num_kv_blocks=32, enable_lora=True, max_loras=2,
            max_cpu_loras=1)
    assert error.value.param == "max_cpu_loras"


_first_kernel: dict[str, str] = {}


def default_lora_llm(model_dir, **options) -> LLM:
    """vLLM's multi-LoRA example's engine: enable_lora and every other LoRA option at its default.
    Each runs the first one's linear kernel (measured at start-up, it may flip on a busy
    machine), so engines compared with each other differ in their adapters only."""
    llm = LLM(str(model_dir), dtype="float32", device="cpu", enable_lora=True, num_kv_blocks=64,
              linear_kernel=_first_kernel.get("name"), **options)
    _first_kernel.setdefault("name", llm.engine.kernel_choice.kernel.name)
    return llm


def outputs_of(results) -> list[tuple[list[int], list[float]]]:
    return [(r.token_ids, [e.logprob for e in r.logprobs]) for r in results]


def test_vllms_multi_lora_example_runs_with_the_defaults_each_output_as_alone(tiny_model_dir, adapters):
    """Two adapters with max_loras=1, in sequence and in one generate call: each request's
    tokens and logprobs are those of an engine that only ever saw its adapter (or none)."""
    loras = requests_of(adapters)[:2]
    prompts = [f"{PROMPT} {i}" + " the" * i for i in range(5)]
    per_prompt = [loras[0], loras[1], None, loras[1], loras[0]]
    alone = []
    for prompt, lora in zip(prompts, per_prompt, strict=True):
        with default_lora_llm(tiny_model_dir) as own:
            alone += outputs_of(own.generate([prompt], GREEDY, lora_request=lora))
    with default_lora_llm(tiny_model_dir) as llm:
        in_sequence = [outputs_of(llm.generate([p], GREEDY, lora_request=lora))[0]
                       for p, lora in zip(prompts, per_prompt, strict=True)]
        together = outputs_of(llm.generate(prompts, GREEDY, lora_request=per_prompt))
        assert llm.engine.pool.is_completely_free
    assert in_sequence == alone
    assert together == alone


def test_idle_adapters_beyond_max_cpu_loras_are_unloaded_least_recently_used_first(tiny_model_dir, adapters):
    loras = requests_of(adapters)
    with default_lora_llm(tiny_model_dir, max_cpu_loras=2) as llm:
        first = outputs_of(llm.generate([PROMPT], GREEDY, lora_request=loras[0]))
        llm.generate([PROMPT], GREEDY, lora_request=loras[1])
        llm.generate([PROMPT], GREEDY, lora_request=loras[0])  # a use: adapter-1 is now the oldest
        llm.generate([PROMPT], GREEDY, lora_request=loras[2])
        assert [a.name for a in llm.engine.list_loras()] == ["adapter-0", "adapter-2"]
        assert outputs_of(llm.generate([PROMPT], GREEDY, lora_request=loras[1])) != first
        assert [a.name for a in llm.engine.list_loras()] == ["adapter-2", "adapter-1"]
        assert outputs_of(llm.generate([PROMPT], GREEDY, lora_request=loras[0])) == first  # loaded again
        llm.engine.remove_lora("adapter-2")  # the LRU unloaded it: its owner's unload still succeeds
        with pytest.raises(InvalidRequestError):
            llm.engine.remove_lora("never-loaded")


def test_an_adapter_a_request_holds_is_not_unloaded(tiny_model_dir, adapters):
    loras = requests_of(adapters)
    with default_lora_llm(tiny_model_dir, max_cpu_loras=1) as llm:
        engine = llm.engine
        held = engine.add_request(PROMPT, GREEDY, lora_request=loras[0])
        engine.add_request(PROMPT, GREEDY, lora_request=loras[1])
        assert [a.name for a in engine.list_loras()] == ["adapter-0", "adapter-1"]
        while engine.has_unfinished():
            engine.step()
        assert held not in engine.requests
        engine.add_request(PROMPT, GREEDY, lora_request=loras[2])
        assert [a.name for a in engine.list_loras()] == ["adapter-2"]
        while engine.has_unfinished():
            engine.step()


# -- llama.cpp's GGUF LoRA ----------------------------------------------------------------------

GGUF_NAMES = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output",
              "gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down"}


def llama_cpp_permute(weights: np.ndarray, num_heads: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute, which its LoRA converter applies to B's rows."""
    rows = weights.shape[0]
    halves = weights.reshape(num_heads, 2, rows // num_heads // 2, *weights.shape[1:])
    return halves.swapaxes(1, 2).reshape(weights.shape)


def write_gguf_lora(adapter_dir: Path, model_dir: Path, out: Path, *,
                    general_type: str = "adapter") -> Path:
    """The PEFT adapter as convert_lora_to_gguf.py writes it for a llama: general.type adapter,
    adapter.type lora, adapter.lora.alpha, `blk.N.<tensor>.weight.lora_a/_b`, Q and K rows of B
    permuted as the base model's are."""
    config = json.loads((adapter_dir / "adapter_config.json").read_text())
    model = json.loads((model_dir / "config.json").read_text())
    heads = {"q_proj": model["num_attention_heads"], "k_proj": model["num_key_value_heads"]}
    writer = gguf.GGUFWriter(str(out), "llama")
    writer.add_type(general_type)
    writer.add_string("adapter.type", "lora")
    writer.add_float32("adapter.lora.alpha", float(config["lora_alpha"]))
    for key, tensor in sorted(load_file(str(adapter_dir / "adapter_model.safetensors")).items()):
        parts = key.split(".")  # base_model.model.model.layers.N.self_attn.q_proj.lora_A.weight
        layer, module, which = parts[4], parts[6], parts[7][-1].lower()
        values = tensor.float().numpy()
        if which == "b" and module in heads:
            values = llama_cpp_permute(values, heads[module])
        writer.add_tensor(f"blk.{layer}.{GGUF_NAMES[module]}.weight.lora_{which}",
                          np.ascontiguousarray(values))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


@pytest.mark.parametrize("native", [True, False], ids=["native", "torch"])
def test_a_gguf_lora_gives_the_outputs_of_the_peft_adapter_it_was_converted_from(
        tiny_model_dir, adapters, tmp_path, monkeypatch, native):
    gguf_file = write_gguf_lora(adapters[0], tiny_model_dir, tmp_path / "adapter.gguf")
    llm = lora_llm_on(tiny_model_dir, monkeypatch, native=native)
    from_gguf = llm.generate([PROMPT], GREEDY, lora_request=LoRARequest("gguf", 1, str(gguf_file)))[0]
    from_peft = llm.generate([PROMPT], GREEDY, lora_request=LoRARequest("peft", 2, str(adapters[0])))[0]
    assert from_gguf.token_ids == from_peft.token_ids
    assert [e.logprob for e in from_gguf.logprobs] == [e.logprob for e in from_peft.logprobs]
    expected = peft_logprobs(tiny_model_dir, adapters[0], from_gguf.prompt_token_ids, from_gguf.token_ids)
    ours = [entry.logprob for entry in from_gguf.logprobs]
    assert max(abs(a - b) for a, b in zip(ours, expected, strict=True)) < 1e-4


def test_bad_gguf_loras_are_refused_by_name_and_nothing_of_them_loads(tiny_model_dir, adapters, tmp_path):
    llm = lora_llm(tiny_model_dir)
    model_file = write_gguf_lora(adapters[0], tiny_model_dir, tmp_path / "model.gguf", general_type="model")
    assert "general.type is 'model'" in refused(llm, LoRARequest("model", 1, str(model_file))).message
    wide = build_adapter(tiny_model_dir, tmp_path / "wide", seed=5, rank=16)
    wide_file = write_gguf_lora(wide, tiny_model_dir, tmp_path / "w.gguf")
    error = refused(llm, LoRARequest("wide", 2, str(wide_file)))
    assert "max_lora_rank=8" in error.message and "r=16" in error.message
    other_base = write_tiny_llama(tmp_path / "other", hidden_size=32, intermediate_size=64)
    other_adapter = build_adapter(other_base, tmp_path / "o", seed=6)
    other = write_gguf_lora(other_adapter, other_base, tmp_path / "o.gguf")
    error = refused(llm, LoRARequest("other", 3, str(other)))
    assert "shape" in error.message and error.param == "lora_path"
    (tmp_path / "junk.bin").write_bytes(b"not an adapter")
    junk = refused(llm, LoRARequest("junk", 4, str(tmp_path / "junk.bin")))
    assert "neither a PEFT adapter folder" in junk.message


@pytest.fixture(scope="module")
def ragged_adapters(tiny_model_dir, tmp_path_factory) -> list[Path]:
    """Rank 1 on every module, rank 8 (max_lora_rank) on q and v only, rank 2 on o, up and down."""
    root = tmp_path_factory.mktemp("ragged")
    specs = [(1, ALL_TARGETS), (8, ["q_proj", "v_proj"]), (2, ["o_proj", "up_proj", "down_proj"])]
    return [build_adapter(tiny_model_dir, root / f"r{rank}", seed=10 + i, rank=rank, targets=targets)
            for i, (rank, targets) in enumerate(specs)]


@pytest.mark.parametrize("native", [
    pytest.param(True, id="native", marks=pytest.mark.skipif(
        native_library.library() is None, reason="the adapters' C stages need the native library")),
    pytest.param(False, id="torch")])
def test_ragged_ranks_and_subsets_of_targets_give_peft_logprobs_alone_and_in_a_crowd(
        tiny_model_dir, ragged_adapters, monkeypatch, native):
    loras = requests_of(ragged_adapters)
    llm = lora_llm_on(tiny_model_dir, monkeypatch, native=native)
    prompts = [f"{PROMPT} {i}" for i in range(4)]
    per_prompt = [*loras, None]
    crowd = llm.generate(prompts, GREEDY, lora_request=per_prompt)
    assert all(adapter.native is not None for adapter in llm.engine.list_loras()) is native
    for prompt, lora, together in zip(prompts, per_prompt, crowd, strict=True):
        alone = llm.generate([prompt], GREEDY, lora_request=lora)[0]
        assert alone.token_ids == together.token_ids
        assert [e.logprob for e in alone.logprobs] == [e.logprob for e in together.logprobs]
        if lora is not None:
            expected = peft_logprobs(tiny_model_dir, Path(lora.lora_path), together.prompt_token_ids,
                                     together.token_ids)
            ours = [entry.logprob for entry in together.logprobs]
            assert max(abs(a - b) for a, b in zip(ours, expected, strict=True)) < 1e-4

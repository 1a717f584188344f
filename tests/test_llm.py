"""The library in vLLM's shapes: code written for vLLM's offline API runs unchanged here."""

from __future__ import annotations

import pytest

from nanoserve import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_model_dir) -> LLM:
    return LLM(str(tiny_model_dir), num_kv_blocks=64)


def test_vllm_offline_quickstart_runs_unchanged(llm: LLM, capsys: pytest.CaptureFixture) -> None:
    # vLLM's examples/offline_inference/basic/basic.py, with `LLM(model=...)` pointed at the tiny model.
    prompts = [
        "Hello, my name is",
        "The president of the United States is",
        "The capital of France is",
        "The future of AI is",
    ]
    sampling_params = SamplingParams(temperature=0.8, top_p=0.95)
    outputs = llm.generate(prompts, sampling_params)
    print("\nGenerated Outputs:\n" + "-" * 60)
    for output in outputs:
        prompt = output.prompt
        generated_text = output.outputs[0].text
        print(f"Prompt:    {prompt!r}")
        print(f"Output:    {generated_text!r}")
        print("-" * 60)
    printed = capsys.readouterr().out
    assert [o.prompt for o in outputs] == prompts
    assert all(f"Prompt:    {p!r}" in printed for p in prompts)
    assert all(len(o.outputs) == 1 and o.outputs[0].finish_reason in ("stop", "length") for o in outputs)


def test_prompt_dicts_token_ids_and_the_sampling_params_keyword_agree(llm: LLM) -> None:
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    [text] = llm.generate("Hello there", sampling_params=params)
    ids = text.prompt_token_ids
    results = llm.generate([{"prompt": "Hello there"}, {"prompt_token_ids": ids}, ids], params)
    assert [r.outputs[0].token_ids for r in results] == [text.token_ids] * 3
    assert [r.prompt for r in results] == ["Hello there", None, None]
    assert all(r.prompt_token_ids == ids for r in results)
    with pytest.raises(ValueError, match="multi_modal_data"):
        llm.generate({"prompt": "x", "multi_modal_data": {}}, params)


def test_n_outputs_per_prompt_with_seeds_that_differ_and_reproduce(llm: LLM) -> None:
    params = SamplingParams(n=3, max_tokens=6, temperature=1.0, seed=7, logprobs=0, ignore_eos=True)
    [result] = llm.generate("Once", params)
    assert [o.index for o in result.outputs] == [0, 1, 2]
    assert len({tuple(o.token_ids) for o in result.outputs}) > 1
    again = llm.generate("Once", SamplingParams(max_tokens=6, temperature=1.0, seed=8, logprobs=0,
                                                ignore_eos=True))[0]
    assert again.outputs[0].token_ids == result.outputs[1].token_ids
    for output in result.outputs:
        assert output.cumulative_logprob == sum(e.logprob for e in output.logprobs)
    assert llm.generate("Once", SamplingParams(max_tokens=2))[0].outputs[0].cumulative_logprob is None


def test_chat_takes_one_conversation_or_a_batch_and_template_options(llm: LLM) -> None:
    params = SamplingParams(max_tokens=4, temperature=0.0)
    one = [{"role": "user", "content": "hello"}]
    two = [{"role": "user", "content": "bye"}]
    [single] = llm.chat(one, params)
    batch = llm.chat([one, two], sampling_params=params)
    assert batch[0].token_ids == single.token_ids and len(batch) == 2
    template = "{% for m in messages %}{{ m.content }}{% endfor %}{{ tools | length }}"
    [custom] = llm.chat(one, params, chat_template=template, tools=[{"type": "function"}])
    assert custom.prompt_token_ids == llm.tokenizer.encode("hello1", add_bos=False)
    [open_turn] = llm.chat(one, params, add_generation_prompt=False)
    assert open_turn.prompt_token_ids != single.prompt_token_ids


@pytest.mark.parametrize("rows", [-1.0, float("nan")])
def test_a_bad_fair_share_is_refused_naming_the_field_before_the_model_loads(rows, tmp_path):
    with pytest.raises(ValueError, match="fair_share_rows"):
        LLM(str(tmp_path / "missing"), fair_share_rows=rows)

"""`nanoserve generate` as a user meets it: streamed text, a summary line, exit 2 on bad input."""

import subprocess
import sys

import pytest
from typer.testing import CliRunner

from nanoserve_cli.main import app

runner = CliRunner()


def generate(*args):
    return runner.invoke(app, ["generate", *args])


@pytest.mark.parametrize(
    ("args", "option"),
    [
        (["--temperature", "-1"], "--temperature"),
        (["--top-p", "1.5"], "--top-p"),
        (["--top-k", "-2"], "--top-k"),
        (["--min-p", "2"], "--min-p"),
        (["--typical-p", "0"], "--typical-p"),
        (["--top-n-sigma", "-2"], "--top-n-sigma"),
        (["--dry-multiplier", "-1"], "--dry-multiplier"),
        (["--xtc-threshold", "2"], "--xtc-threshold"),
        (["--mirostat", "3"], "--mirostat"),
        (["--mirostat", "2", "--top-k", "40"], "--top-k"),
        (["--max-tokens", "0"], "--max-tokens"),
        (["--dtype", "float8"], "--dtype"),
        (["--device", "tpu"], "--device"),
        (["--threads", "0"], "--threads"),
        (["--linear-kernel", "blas9000"], "--linear-kernel"),
        ([arg for i in range(65) for arg in ("--stop", f"s{i}")], "--stop"),
    ],
)
def test_bad_option_exits_2_naming_the_option_without_a_traceback(args, option, tiny_model_dir):
    result = generate("hi", "--model", str(tiny_model_dir), *args)
    assert result.exit_code == 2, result.output
    assert option in result.output
    assert "Traceback" not in result.output


def test_unreadable_model_path_exits_2_naming_the_model_option(tmp_path):
    result = generate("hi", "--model", str(tmp_path / "missing"))
    assert result.exit_code == 2 and "--model" in result.output


def test_gguf_of_an_unsupported_architecture_exits_2(tmp_path, tiny_model_dir):
    from tiny_model import write_tiny_gguf

    path = write_tiny_gguf(tmp_path / "gpt2.gguf", tiny_model_dir, architecture="gpt2")
    result = generate("hi", "--model", str(path))
    assert result.exit_code == 2 and "gpt2" in result.output and "Traceback" not in result.output


def test_generate_streams_the_same_text_as_the_library_and_prints_a_summary(tiny_model_dir):
    from nanoserve.llm import LLM
    from nanoserve.sampling_params import SamplingParams

    expected = LLM(str(tiny_model_dir)).generate(
        ["hello"], SamplingParams(max_tokens=8, temperature=0.0))[0].text
    # A real process, so stdout and stderr stay apart as a shell user sees them.
    cmd = [sys.executable, "-m", "nanoserve", "generate", "hello", "--model", str(tiny_model_dir),
           "--max-tokens", "8"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=True)
    assert done.stdout == expected + "\n"
    assert "prompt" in done.stderr and "tokens/s" in done.stderr and "time to first token" in done.stderr


def test_chat_wraps_the_prompt_in_the_models_template(tiny_model_dir):
    from nanoserve.llm import LLM
    from nanoserve.sampling_params import SamplingParams

    llm = LLM(str(tiny_model_dir))
    params = SamplingParams(max_tokens=6, temperature=0.0)
    [chat] = llm.chat([{"role": "user", "content": "hello"}], params)
    plain = llm.generate(["hello"], params)[0]
    assert chat.prompt_token_ids != plain.prompt_token_ids
    result = generate("hello", "--model", str(tiny_model_dir), "--chat", "--max-tokens", "6")
    assert result.exit_code == 0, result.output
    assert result.stdout == chat.text + "\n"


def test_a_kernel_this_machine_cannot_run_exits_2_naming_the_option(tiny_model_dir):
    """oneDNN kernels are CPU-only: asking for one on CUDA (or for one that fails the
    self-test) is refused at start-up by name, never swapped for another without a word."""
    from nanoserve.model.linear import KERNELS, LinearKernel

    refused = LinearKernel("cuda-only", "test", KERNELS["aten"].pack, KERNELS["aten"].apply, ("cuda",))
    KERNELS["cuda-only"] = refused
    try:
        result = generate("hi", "--model", str(tiny_model_dir), "--linear-kernel", "cuda-only",
                          "--device", "cpu", "--max-tokens", "2")
    finally:
        del KERNELS["cuda-only"]
    assert result.exit_code == 2, result.output
    assert "--linear-kernel" in result.output and "Traceback" not in result.output


def test_generate_prints_the_kernel_it_chose_and_why(tiny_model_dir):
    result = generate("hi", "--model", str(tiny_model_dir), "--max-tokens", "2")
    assert result.exit_code == 0, result.output
    assert "linear kernel:" in result.output and "batch-invariant forward" in result.output


def test_generate_samples_with_typical_p_and_top_n_sigma_as_the_library_does(tiny_model_dir):
    from nanoserve.llm import LLM
    from nanoserve.sampling_params import SamplingParams

    modes = {"temperature": 1.5, "seed": 3, "typical_p": 0.7, "top_n_sigma": 1.5}
    expected = LLM(str(tiny_model_dir)).generate(["hi"], SamplingParams(max_tokens=5, **modes))[0].text
    result = generate("hi", "--model", str(tiny_model_dir), "--max-tokens", "5", "--temperature", "1.5",
                      "--seed", "3", "--typical-p", "0.7", "--top-n-sigma", "1.5")
    assert result.exit_code == 0, result.output
    assert expected in result.stdout


def test_generate_samples_with_dry_xtc_and_mirostat_as_the_library_does(tiny_model_dir):
    from nanoserve.llm import LLM
    from nanoserve.sampling_params import SamplingParams

    llm = LLM(str(tiny_model_dir))
    for modes, args in [
        ({"dry_multiplier": 2.0, "dry_allowed_length": 1, "dry_sequence_breakers": (".",),
          "xtc_probability": 0.9, "xtc_threshold": 0.02},
         ["--dry-multiplier", "2", "--dry-allowed-length", "1", "--dry-sequence-breaker", ".",
          "--xtc-probability", "0.9", "--xtc-threshold", "0.02"]),
        ({"mirostat": 2, "mirostat_tau": 2.0, "mirostat_eta": 0.3},
         ["--mirostat", "2", "--mirostat-ent", "2", "--mirostat-lr", "0.3"]),
    ]:
        params = SamplingParams(max_tokens=5, temperature=1.5, seed=3, **modes)
        expected = llm.generate(["hi"], params)[0].text
        result = generate("hi", "--model", str(tiny_model_dir), "--max-tokens", "5", "--temperature", "1.5",
                          "--seed", "3", *args)
        assert result.exit_code == 0, result.output
        assert expected in result.stdout


def test_generate_constrains_to_a_json_schema_file_or_a_regex_and_samples_p_less(tiny_model_dir, tmp_path):
    import json

    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}},
              "required": ["n"], "additionalProperties": False}
    (tmp_path / "schema.json").write_text(json.dumps(schema))
    base = ["hi", "--model", str(tiny_model_dir), "--max-tokens", "20", "--temperature", "1.0", "--seed", "1"]
    answer = generate(*base, "--json-schema", str(tmp_path / "schema.json"), "--p-less")
    assert answer.exit_code == 0, answer.output
    assert 0 <= json.loads(answer.stdout.strip())["n"] <= 99
    answer = generate(*base, "--regex", "[xyz]{3}")
    assert answer.exit_code == 0 and set(answer.stdout.strip()) <= set("xyz")


@pytest.mark.parametrize(("args", "option"), [
    (["--regex", "(?<=a)b"], "--regex"), (["--json-schema", "SCHEMA"], "--json-schema"),
    (["--json-schema", "MISSING"], "--json-schema"), (["--regex", "a", "--json-schema", "SCHEMA"], "--regex"),
])
def test_a_bad_constraint_exits_2_naming_the_option(args, option, tiny_model_dir, tmp_path):
    (tmp_path / "bad.json").write_text('{"type": "foo"}')
    paths = {"SCHEMA": str(tmp_path / "bad.json"), "MISSING": str(tmp_path / "missing.json")}
    result = generate("hi", "--model", str(tiny_model_dir), *[paths.get(a, a) for a in args])
    assert result.exit_code == 2, result.output
    assert option in result.output and "Traceback" not in result.output


def test_a_dash_prompt_is_read_from_stdin(tiny_model_dir):
    args = ["generate", "--model", str(tiny_model_dir), "--max-tokens", "4"]
    piped = runner.invoke(app, [*args, "-"], input="hello there")
    given = runner.invoke(app, [*args, "hello there"])
    assert piped.exit_code == 0 and given.exit_code == 0, piped.output
    assert piped.stdout == given.stdout


@pytest.mark.parametrize(("change", "named"), [
    ({"model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"]}, "'deepseek_v3'"),
    ({"num_local_experts": 8}, "'num_local_experts' = 8"),
    ({"rope_scaling": {"rope_type": "mrope", "factor": 2.0}}, "'mrope'"),
    ({"num_key_value_heads": 3}, "num_key_value_heads 3"),
])
def test_a_config_nanoserve_cannot_honour_exits_2_naming_the_field(tmp_path, tiny_model_dir, change, named):
    import json
    import shutil

    target = tmp_path / "model"
    shutil.copytree(tiny_model_dir, target)
    config = json.loads((target / "config.json").read_text())
    (target / "config.json").write_text(json.dumps({**config, **change}))
    result = generate("hi", "--model", str(target))
    assert result.exit_code == 2 and named in result.output and "Traceback" not in result.output



@pytest.fixture
def built_configs(monkeypatch):
    """The EngineConfigs generate hands the LLM, caught before any model loads (the command
    then exits 2 with the error raised in the LLM's place)."""
    from nanoserve.errors import NanoserveError
    from nanoserve.llm import LLM

    built = []

    def capture(config):
        built.append(config)
        raise NanoserveError("stop before loading")

    monkeypatch.setattr(LLM, "from_config", capture)
    return built


def test_every_engine_option_generate_takes_reaches_the_engine_config(built_configs):
    from nanoserve.config import EngineConfig

    result = generate("hi", "--model", "some/model", "--dtype", "float32", "--device", "cpu",
                      "--no-batch-invariant", "--no-prefix-caching", "--max-model-len", "64",
                      "--kv-cache-gb", "0.5", "--threads", "1", "--linear-kernel", "aten",
                      "--quantize", "q8_0", "--speculative-tokens", "3", "--speculative-ngram-min", "1",
                      "--speculative-ngram-max", "5", "--speculative-policy", "always",
                      "--speculative-disable-by-batch-size", "8", "--async-scheduling", "-tp", "2")
    assert result.exit_code == 2 and "stop before loading" in result.output, result.output
    assert built_configs == [EngineConfig(
        model="some/model", dtype="float32", device="cpu", batch_invariant=False, enable_prefix_caching=False,
        max_model_len=64, kv_cache_gb=0.5, threads=1, linear_kernel="aten", quantize="q8_0",
        speculative_tokens=3, speculative_ngram_min=1, speculative_ngram_max=5, speculative_policy="always",
        speculative_disable_by_batch_size=8, async_scheduling=True, tensor_parallel_size=2, max_num_seqs=1)]


def test_a_draft_model_reaches_the_engine_config_with_its_method(built_configs):
    result = generate("hi", "--speculative-tokens", "2", "--speculative-method", "draft",
                      "--draft-model", "org/draft")
    assert result.exit_code == 2, result.output
    assert (built_configs[0].speculative_method, built_configs[0].draft_model) == ("draft", "org/draft")


def test_engine_options_refuse_a_name_that_is_no_option_and_a_command_without_the_parameter():
    from nanoserve_cli.options import engine_options

    with pytest.raises(ValueError, match="no_such_option"):
        engine_options(omit=("no_such_option",))
    with pytest.raises(TypeError, match="engine"):
        engine_options()(lambda prompt: None)

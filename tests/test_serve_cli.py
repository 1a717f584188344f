"""`nanoserve serve` refuses a bad start before it loads anything: exit 2, naming the option."""

from pathlib import Path

import pytest
from typer.testing import CliRunner

from nanoserve_cli.main import app

runner = CliRunner()


@pytest.mark.parametrize(("args", "env", "option"), [
    (["--api-key", ""], {}, "--api-key"),
    (["--api-key", "  "], {}, "--api-key"),
    (["--api-key", " k1 "], {}, "--api-key"),
    (["--api-key", "clé"], {}, "--api-key"),
    (["--api-key", "two words"], {}, "--api-key"),
    ([], {"NANOSERVE_API_KEY": "k1\n"}, "--api-key"),
    (["--header-timeout-s", "0"], {}, "--header-timeout-s"),
    ([], {"NANOSERVE_API_KEY": ""}, "--api-key"),
    (["--log-level", "verbose"], {}, "--log-level"),
    (["--log-level", ""], {}, "--log-level"),
    (["--seed", "-1"], {}, "--seed"),
    (["--fair-share-rows", "-1"], {}, "--fair-share-rows"),
    (["--fair-share-rows", "nan"], {}, "--fair-share-rows"),
    (["--fair-share-rows", "some"], {}, "--fair-share-rows"),
    (["--long-prefill-token-threshold", "0"], {}, "--long-prefill-token-threshold"),
    (["--prefill-step-ms", "0"], {}, "--prefill-step-ms"),
    (["--prefill-step-ms", "-5"], {}, "--prefill-step-ms"),
    (["--prefill-step-ms", "inf"], {}, "--prefill-step-ms"),
    (["--prefill-step-ms", "soon"], {}, "--prefill-step-ms"),
    (["--api-key", "k1", "--api-key", "k1"], {}, "--api-key number 2: the key of tenant 'api-key-2' is"),
    (["--api-key", "k1", "--api-key", ""], {}, "--api-key number 2"),
    (["--api-key", "k1", "--prefix-cache-scope", "everyone"], {}, "--prefix-cache-scope"),
    (["--prefix-cache-scope", "tenant"], {}, "--prefix-cache-scope needs --api-key"),
    (["--api-key", "k1", "--max-concurrent-requests-per-tenant", "0"], {},
     "--max-concurrent-requests-per-tenant"),
    (["--max-concurrent-requests-per-tenant", "2"], {}, "--max-concurrent-requests-per-tenant"),
    (["--api-keys-file", "/no/such/keys"], {}, "--api-keys-file"),
    (["--reasoning-parser", "qwen"], {}, "--reasoning-parser"),
    (["--reasoning-budget", "-1"], {}, "--reasoning-budget"),
    (["--task", "classify"], {}, "--task"),
    (["--pooling", "cls"], {}, "--pooling"),
    (["--prefix-cache-dir", "/tmp/kv", "-tp", "2"], {}, "--prefix-cache-dir"),
    (["--prefix-cache-dir", "/tmp/kv", "--no-prefix-caching"], {}, "--prefix-cache-dir"),
    (["--prefix-cache-dir-max-gb", "0"], {}, "--prefix-cache-dir-max-gb"),
    (["--max-loras", "2", "--max-cpu-loras", "1"], {}, "--max-cpu-loras"),
])
def test_a_bad_serve_option_exits_2_naming_it_before_loading_the_model(args, env, option, tmp_path):
    # The model path does not exist: reaching it would fail naming --model instead.
    result = runner.invoke(app, ["serve", "--model", str(tmp_path / "missing"), *args], env=env)
    assert result.exit_code == 2, result.output
    assert option in result.output
    assert "Traceback" not in result.output


@pytest.mark.parametrize(("text", "says"), [
    ("alice k1\nbob\n", "line 2"),
    ("alice k1\nbob k1\n", "tenant 'bob' is also the key of tenant 'alice'"),
    ("alice k1\nalice k2\n", "'alice' is given twice"),
    ("alice k\x01\n", "printable ASCII"),
    ("# nothing\n", "no keys"),
])
def test_a_bad_keys_file_exits_2_naming_the_file_and_line_never_the_key(text, says, tmp_path):
    keys = tmp_path / "keys"
    keys.write_text(text)
    result = runner.invoke(app, ["serve", "--model", str(tmp_path / "missing"), "--api-keys-file", str(keys)])
    assert result.exit_code == 2, result.output
    assert "--api-keys-file" in result.output and says in " ".join(result.output.split())
    assert "Traceback" not in result.output


def test_a_hub_id_is_served_under_its_own_name_not_its_snapshot_hash(tmp_path):
    from nanoserve_cli.serve import _served_name

    snapshot = tmp_path / "0123456789abcdef0123456789abcdef01234567"
    assert _served_name("org/tiny@main", snapshot) == "org/tiny"
    assert _served_name(str(tmp_path), tmp_path) == tmp_path.name
    assert _served_name(None, tmp_path) == tmp_path.name
    assert _served_name(None, tmp_path, Path("/models/SmolLM2-135M-Instruct.Q4_1.gguf")) == (
        "SmolLM2-135M-Instruct.Q4_1")


def test_a_model_that_fails_to_load_stops_the_server_with_exit_2_naming_it(tiny_model_dir, tmp_path):
    """The engine loads on its own thread after the socket is up; when the load fails the
    server must not stay up answering 503 for ever: it exits 2 with the loader's message."""
    import shutil
    import socket
    import subprocess
    import sys

    broken = tmp_path / "no-weights"
    shutil.copytree(tiny_model_dir, broken, ignore=shutil.ignore_patterns("*.safetensors*"))
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    result = subprocess.run(
        [sys.executable, "-c", "from nanoserve_cli.main import app; app()", "serve", "--model", str(broken),
         "--port", str(port)],
        capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr[-2000:]
    assert "has no .safetensors weights" in result.stderr
    assert "Traceback" not in result.stderr

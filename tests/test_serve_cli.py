"""`nanoserve serve` refuses a bad start before it loads anything: exit 2, naming the option."""

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
])
def test_a_bad_serve_option_exits_2_naming_it_before_loading_the_model(args, env, option, tmp_path):
    # The model path does not exist: reaching it would fail naming --model instead.
    result = runner.invoke(app, ["serve", "--model", str(tmp_path / "missing"), *args], env=env)
    assert result.exit_code == 2, result.output
    assert option in result.output
    assert "Traceback" not in result.output


def test_a_hub_id_is_served_under_its_own_name_not_its_snapshot_hash(tmp_path):
    from nanoserve_cli.serve import _served_name

    snapshot = tmp_path / "0123456789abcdef0123456789abcdef01234567"
    assert _served_name("org/tiny@main", snapshot) == "org/tiny"
    assert _served_name(str(tmp_path), tmp_path) == tmp_path.name
    assert _served_name(None, tmp_path) == tmp_path.name

"""The per-type decode benchmark's edges (nanoserve.bench.experiments.quant_types): its model shape and its
refusals. No timing is asserted anywhere."""

from __future__ import annotations

import pytest

from nanoserve.bench.experiments.quant_types import DEFAULT_TYPES, ModelShape, main
from nanoserve.quant import FORMATS


@pytest.mark.parametrize("argv", [["--types", "q5_0,q9_9"], ["--types", "q5_0,q2_k"], ["--repeat", "0"],
                                  ["--slots", "1,x"], ["--slots", "0"]])
def test_bad_options_exit_2_naming_the_option(argv, capsys):
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2
    assert argv[0] in capsys.readouterr().err


def test_every_matrix_of_the_shape_is_whole_blocks_of_every_type():
    shape = ModelShape(layers=2, hidden=512, heads=8, kv_heads=2, intermediate=1536, vocab=1000, context=64,
                       rms_eps=1e-5, rope_base=1e4)
    matrices = shape.matrices()
    assert len(matrices) == 1 + 7 * 2
    assert matrices["blk.1.attn_k.weight"] == (128, 512)
    for name in DEFAULT_TYPES:
        assert all(cols % FORMATS[name].values == 0 for _, cols in matrices.values()), name


def test_without_the_native_kernels_it_exits_2_rather_than_time_float32(monkeypatch, capsys):
    from nanoserve import native

    monkeypatch.setenv("NANOSERVE_NO_NATIVE", "1")
    native._load.cache_clear()
    try:
        with pytest.raises(SystemExit) as exited:
            main(["--slots", "1"])
    finally:
        monkeypatch.delenv("NANOSERVE_NO_NATIVE")
        native._load.cache_clear()
    assert exited.value.code == 2
    assert "native kernels: off" in capsys.readouterr().err

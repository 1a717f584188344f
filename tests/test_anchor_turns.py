"""Pairing nanoserve's and llama.cpp's decode figures turn by turn (nanoserve.bench.anchor_turns):
ratios within a turn only, the median over turns, mismatched slots and bad options refused."""

from __future__ import annotations

import pandas as pd
import pytest

from nanoserve.bench import anchor_turns


def _ours(tokens_per_s: dict[int, float]) -> pd.DataFrame:
    return pd.DataFrame({"slots": list(tokens_per_s), "decode_tokens_per_s": list(tokens_per_s.values())})


def _theirs(tokens_per_s: dict[int, float]) -> pd.DataFrame:
    return pd.DataFrame({"engine": "llama.cpp", "slots": list(tokens_per_s),
                         "decode_tok_s": list(tokens_per_s.values())})


def test_each_turns_ratio_is_its_own_pair_and_the_median_is_over_the_turns():
    figures = [({1: 100.0, 16: 300.0}, {1: 50.0, 16: 100.0}), ({1: 90.0, 16: 330.0}, {1: 90.0, 16: 110.0}),
               ({1: 120.0, 16: 200.0}, {1: 80.0, 16: 100.0})]
    turns = pd.concat([anchor_turns.paired_turn(_ours(ours), _theirs(theirs), turn)
                       for turn, (ours, theirs) in enumerate(figures, start=1)])
    table = anchor_turns.with_medians(turns)
    ratio = table.set_index(["turn", "slots"]).ratio
    assert ratio[("1", 1)] == 2.0 and ratio[("2", 1)] == 1.0 and ratio[("3", 1)] == 1.5
    assert ratio[("median", 1)] == 1.5 and ratio[("median", 16)] == 3.0


def test_a_turn_whose_slot_counts_differ_is_refused():
    with pytest.raises(ValueError, match="slots"):
        anchor_turns.paired_turn(_ours({1: 100.0, 16: 300.0}), _theirs({1: 50.0}), 1)


@pytest.mark.parametrize(("argv", "option"), [(["--weights", "q5_k"], "--weights"),
                                              (["--slots", "1,0"], "--slots"), (["--turns", "0"], "--turns"),
                                              (["--anchor", "/nonexistent/llamacpp-bench"], "--anchor")])
def test_bad_options_exit_2_naming_the_option_before_running_anything(argv, option, capsys):
    with pytest.raises(SystemExit) as exited:
        anchor_turns.main(argv)
    assert exited.value.code == 2
    assert option in capsys.readouterr().err

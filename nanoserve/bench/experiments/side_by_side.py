"""What the comparisons against llama.cpp share (`llamacpp_compare`, `mtmd_compare`).

Owns: the machine columns every row carries, the order of the two sides in each turn, the
median row over turns and the CSV of every turn with the medians after them, and the check that
the counted options are at least 1.
Refuses: running either engine and naming figures (each comparison does).
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar

from nanoserve.bench.hardware import git_commit
from nanoserve.machine import cpu_model, vector_flags

Row = dict[str, object]
Ours = TypeVar("Ours")
Theirs = TypeVar("Theirs")


def machine_columns() -> Row:
    return {"cpu_model": cpu_model(), "cpu_flags": " ".join(vector_flags()), "cores": os.cpu_count(),
            "git_commit": git_commit()}


def in_turn_order(turn: int, theirs: Callable[[], Theirs], ours: Callable[[], Ours]) -> tuple[Ours, Theirs]:
    """Both sides, llama.cpp first in odd turns: the order swaps every turn, so neither side
    always runs on a warmer machine."""
    if turn % 2:
        their_figures = theirs()
        return ours(), their_figures
    our_figures = ours()
    return our_figures, theirs()


def median_rows(rows: list[Row], key: Sequence[str] = ()) -> list[Row]:
    """Per group of rows alike in `key`'s columns: the median over turns of every float figure,
    the ratios' medians included (each turn's ratio pairs the figures of that turn)."""
    medians = []
    for group_key in dict.fromkeys(tuple(row[k] for k in key) for row in rows):
        group = [row for row in rows if tuple(row[k] for k in key) == group_key]
        median = dict(group[0]) | {"turn": "median"}
        for column, value in group[0].items():
            if isinstance(value, float):
                median[column] = round(statistics.median(float(row[column]) for row in group), 3)
        medians.append(median)
    return medians


def write_turns_csv(out: Path, rows: list[Row], key: Sequence[str] = ()) -> list[Row]:
    """Every turn's row, then the median rows (`median_rows`), to `out`; returns the medians."""
    medians = median_rows(rows, key)
    out.parent.mkdir(parents=True, exist_ok=True)
    columns = list(dict.fromkeys(column for row in rows + medians for column in row))
    with out.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows + medians)
    return medians


def require_at_least_one(parser: argparse.ArgumentParser, args: argparse.Namespace,
                         names: Sequence[str]) -> None:
    """Exit 2 naming the first of `names` (argparse dests) below 1."""
    for name in names:
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")

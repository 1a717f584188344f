"""Decode tokens/s against llama.cpp: alternating turns on one machine, the ratio per turn and its median.

Owns: running `nanoserve bench` and the llama.cpp anchor script (`../shared/anchors/llamacpp-bench`,
llama-batched-bench on the same GGUF) one after the other, turn after turn, so both sides see the
same neighbours; pairing each turn's decode tokens/s by slot count (ours: `decode_tokens_per_s`,
theirs: S_TG); and writing every turn's ratio and the median of the turns to one CSV that names the
CPU. Refuses: comparing runs from different turns, and a turn whose slot counts do not match.

    python -m nanoserve.bench.anchor_turns --weights q4_1 --slots 1,16 --turns 3 \
        --out results/decode_vs_llamacpp_q4_1.csv
"""

from __future__ import annotations

import argparse
import io
import subprocess
import tempfile
from pathlib import Path

import pandas as pd

from nanoserve.bench.hardware import REPO_ROOT, describe_machine

# llama.cpp's weights name -> the `nanoserve bench --dtype` that runs the same file's numbers.
DTYPE_FOR_WEIGHTS = {"q4_1": "auto", "f32": "float32"}
ANCHOR = REPO_ROOT.parent / "shared" / "anchors" / "llamacpp-bench"


def paired_turn(ours: pd.DataFrame, theirs: pd.DataFrame, turn: int) -> pd.DataFrame:
    """One turn's rows: decode tokens/s of both engines at each slot count, and ours over theirs."""
    ours = ours.groupby("slots", as_index=False).decode_tokens_per_s.median()
    theirs = theirs.groupby("slots", as_index=False).decode_tok_s.median()
    if sorted(ours.slots) != sorted(theirs.slots):
        raise ValueError(f"turn {turn}: nanoserve ran slots {sorted(ours.slots)}, "
                         f"llama.cpp {sorted(theirs.slots)}")
    both = ours.merge(theirs, on="slots").rename(columns={"decode_tokens_per_s": "nanoserve_decode_tok_s",
                                                          "decode_tok_s": "llamacpp_decode_tok_s"})
    return both.assign(turn=str(turn), ratio=both.nanoserve_decode_tok_s / both.llamacpp_decode_tok_s)


def with_medians(turns: pd.DataFrame) -> pd.DataFrame:
    """The turns' rows, then one `median` row per slot count (each column's median over the turns)."""
    columns = ["nanoserve_decode_tok_s", "llamacpp_decode_tok_s", "ratio"]
    medians = turns.groupby("slots", as_index=False)[columns].median().assign(turn="median")
    return pd.concat([turns, medians], ignore_index=True)


def run_turn(weights: str, slots: str, turn: int, anchor: Path, scratch: Path) -> pd.DataFrame:
    ours_csv = scratch / f"nanoserve_{weights}_{turn}.csv"
    subprocess.run(["nanoserve", "bench", "--slots", slots, "--params", "greedy", "--dtype",
                    DTYPE_FOR_WEIGHTS[weights], "--out", str(ours_csv), "--no-chart"], check=True)
    theirs = subprocess.run([str(anchor), slots, weights], check=True, capture_output=True, text=True).stdout
    return paired_turn(pd.read_csv(ours_csv), pd.read_csv(io.StringIO(theirs)), turn)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m nanoserve.bench.anchor_turns",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--weights", default="q4_1", help=f"one of {', '.join(DTYPE_FOR_WEIGHTS)}")
    parser.add_argument("--slots", default="1,16", help="concurrent slots, comma separated")
    parser.add_argument("--turns", type=int, default=3, help="alternating turns (the median is reported)")
    parser.add_argument("--anchor", type=Path, default=ANCHOR, help="the llama.cpp anchor script")
    parser.add_argument("--out", type=Path, default=None,
                        help="default results/decode_vs_llamacpp_<weights>.csv")
    args = parser.parse_args(argv)
    if args.weights not in DTYPE_FOR_WEIGHTS:
        parser.error(f"--weights must be one of {', '.join(DTYPE_FOR_WEIGHTS)}; got {args.weights!r}")
    if not all(part.isdigit() and int(part) > 0 for part in args.slots.split(",")):
        parser.error(f"--slots must be comma-separated positive integers; got {args.slots!r}")
    if args.turns < 1:
        parser.error("--turns must be at least 1")
    if not args.anchor.is_file():
        parser.error(f"--anchor: no llama.cpp anchor script at {args.anchor}")
    with tempfile.TemporaryDirectory() as scratch:
        turns = pd.concat([run_turn(args.weights, args.slots, turn, args.anchor, Path(scratch))
                           for turn in range(1, args.turns + 1)], ignore_index=True)
    machine = describe_machine()
    table = with_medians(turns).assign(weights=args.weights, cpu_model=machine.cpu_model, cores=machine.cores,
                                       git_commit=machine.git_commit, timestamp=machine.timestamp)
    out = args.out or REPO_ROOT / "results" / f"decode_vs_llamacpp_{args.weights}.csv"
    out.parent.mkdir(parents=True, exist_ok=True)
    table.to_csv(out, index=False)
    shown = ["turn", "slots", "nanoserve_decode_tok_s", "llamacpp_decode_tok_s", "ratio"]
    print(table[shown].to_string(index=False))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()

"""What tool_choice "auto"'s lazy grammar costs a step: the token mask's time per token.

Owns: walking one reply (free text, then a Hermes call) through the hermes format's auto
grammar on the default model's vocabulary, and the same reply's free text alone, timing each
step's `fill_next_token_bitmask`, beside an any-JSON-object grammar on a JSON text (the
structured-output cost README.md already records); the three in alternating turns, in one
process. `python -m nanoserve.bench.experiments.tool_grammar --out results/tool_grammar_mask.csv`.
Refuses: judging; it measures, and the figures are read against a decode step's time.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import llguidance
import llguidance.numpy
import numpy as np
import pandas as pd

from nanoserve.bench.hardware import describe_machine
from nanoserve.loading.default_model import resolve_model
from nanoserve.server.parsers.tool_formats import FORMATS, Vocabulary
from nanoserve.tokenizer import Tokenizer

SCHEMAS = {"get_weather": {"type": "object", "properties": {"city": {"type": "string"},
                                                           "unit": {"enum": ["c", "f"]}},
                           "required": ["city", "unit"]},
           "get_time": {"type": "object", "properties": {"zone": {"type": "integer"}}, "required": ["zone"]}}
FREE_TEXT = "The weather in Paris is mild today, with a light breeze and some clouds over the river."
CALL = ' <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>'
JSON_TEXT = '{"city": "Paris", "unit": "c", "note": "mild today with a light breeze and some clouds"}'


def mask_us_per_token(tokenizer: Tokenizer, lltokenizer: llguidance.LLTokenizer, grammar: str,
                      text: str) -> float:
    """Mean microseconds of one step's mask over the tokens of `text`, which the grammar takes."""
    matcher = llguidance.LLMatcher(lltokenizer, grammar, log_level=0)
    bitmask = np.zeros((1, -(-tokenizer.vocab_size // 32)), dtype=np.int32)
    ids = tokenizer.encode(text, add_bos=False)
    spent_s = 0.0
    for token in ids:
        start_s = time.perf_counter()
        llguidance.numpy.fill_next_token_bitmask(matcher, bitmask, 0)
        spent_s += time.perf_counter() - start_s
        if not matcher.consume_token(token):
            raise RuntimeError(f"the grammar refused the walk's text: {matcher.get_error()}")
    return spent_s / len(ids) * 1e6


def measure(model_dir: Path, turns: int) -> pd.DataFrame:
    tokenizer = Tokenizer.from_dir(model_dir)
    lltokenizer = llguidance.LLTokenizer(tokenizer.backend.to_str(), n_vocab=tokenizer.vocab_size,
                                         eos_token=sorted(tokenizer.eos_token_ids))
    auto = llguidance.LLMatcher.grammar_from_lark(
        FORMATS["hermes"](Vocabulary.of(tokenizer)).auto_grammar(SCHEMAS, parallel=True))
    any_object = llguidance.LLMatcher.grammar_from_json_schema({"type": "object"})
    cases = {"auto_free_text": (auto, FREE_TEXT), "auto_free_text_then_call": (auto, FREE_TEXT + CALL),
             "json_object": (any_object, JSON_TEXT)}
    rows = [{"turn": turn, "case": case, "vocab_size": tokenizer.vocab_size,
             "mask_us_per_token": mask_us_per_token(tokenizer, lltokenizer, *walk)}
            for turn in range(turns) for case, walk in cases.items()]
    return pd.DataFrame(rows).assign(**describe_machine("cpu").columns())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="a folder, GGUF or hub id; default: the default model")
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--out", type=Path, default=Path("results/tool_grammar_mask.csv"))
    args = parser.parse_args(argv)
    if args.turns < 1:
        parser.error("--turns must be >= 1")
    frame = measure(resolve_model(args.model, float_weights=False).dir, args.turns)  # its tokenizer alone
    args.out.parent.mkdir(parents=True, exist_ok=True)
    frame.to_csv(args.out, index=False, float_format="%.6g")
    for case, group in frame.groupby("case", sort=False):
        print(f"{case}: median {statistics.median(group['mask_us_per_token']):.0f} us per token")
    print(f"{frame['cpu_model'][0]}; wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

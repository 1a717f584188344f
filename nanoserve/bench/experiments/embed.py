"""Embeddings: what pooling through the engine's batched step costs, against the reference and
beside generation.

Owns two measurements on one model (the default model unless `--model`), in float32 on the CPU,
taken in alternating turns so a neighbour's noise falls on both sides of each ratio:
- throughput: prompt tokens per second of `LLM.embed` over a fixed set of prompts of mixed
  length, against transformers' `AutoModel` forward of the same token ids, one prompt at a time
  (how a sentence-transformers user runs it at batch 1, with no padding to cost it); the ratio
  ours / transformers per turn;
- neighbours: the generation tokens per second of decoding requests alone, and with a stream of
  embedding requests sharing their steps (each embedding's prompt chunks ride the decodes'
  steps under the prefill budget); the ratio with / alone per turn (DESIGN invariant 5: no
  request slows another by more than 2x).
Every turn is a row of the CSV with the machine's columns; the summary prints each ratio's
median over the turns. `python -m nanoserve.bench.experiments.embed --turns 3 --out results/embeddings.csv`.
Refuses: judging; it measures, and README.md states what the figures mean.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import pandas as pd
import torch

from nanoserve.bench.hardware import describe_machine
from nanoserve.llm import LLM
from nanoserve.loading.default_model import resolve_model_dir
from nanoserve.pooling_params import PoolingParams
from nanoserve.sampling_params import SamplingParams

SENTENCE = ("the engine pools each prompt's final hidden states into one vector while other requests "
            "decode beside it in the same batched step")


def prompts(tokenizer, count: int, shortest: int, longest: int) -> list[list[int]]:
    """`count` token-id prompts, lengths spread evenly over [shortest, longest]."""
    text = " ".join([SENTENCE] * (longest // len(SENTENCE.split()) + 2))
    ids = tokenizer.encode(text)
    step = (longest - shortest) / max(1, count - 1)
    return [ids[:shortest + round(i * step)] for i in range(count)]


def embed_tokens_per_s(llm: LLM, batch: list[list[int]]) -> float:
    start = time.perf_counter()
    llm.embed(batch)
    return sum(map(len, batch)) / (time.perf_counter() - start)


@torch.inference_mode()
def reference_tokens_per_s(model, batch: list[list[int]]) -> float:
    start = time.perf_counter()
    for ids in batch:
        model(torch.tensor([ids])).last_hidden_state[0, -1]
    return sum(map(len, batch)) / (time.perf_counter() - start)


def generation_tokens_per_s(llm: LLM, decoders: int, max_tokens: int, beside: list[list[int]]) -> float:
    """Generation tokens per second of `decoders` greedy requests, with `beside` embedded as they run
    (one arriving every other step, so prompt chunks share the decodes' steps throughout)."""
    engine = llm.engine
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for i in range(decoders):
        engine.add_request(f"request {i}: {SENTENCE}", params)
    engine.step()  # the decoders' prefill, outside the timed part
    arrivals = list(beside)
    generated, start = 0, time.perf_counter()
    while engine.has_unfinished():
        if arrivals and engine.stats.steps % 2 == 0:
            engine.add_request(arrivals.pop(0), pooling=PoolingParams())
        generated += sum(len(out.token_ids) for out in engine.step())
    return generated / (time.perf_counter() - start)


def measure(model: str | None, turns: int, count: int, shortest: int, longest: int, decoders: int,
            max_tokens: int) -> pd.DataFrame:
    import transformers  # the baseline extra: only this measurement needs it

    model_dir = resolve_model_dir(model)
    llm = LLM(str(model_dir), dtype="float32", device="cpu", kv_cache_gb=0.25)
    reference = transformers.AutoModel.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    batch = prompts(llm.tokenizer, count, shortest, longest)
    rows = []
    for turn in range(turns):
        ours, theirs = embed_tokens_per_s(llm, batch), reference_tokens_per_s(reference, batch)
        alone = generation_tokens_per_s(llm, decoders, max_tokens, [])
        beside = generation_tokens_per_s(llm, decoders, max_tokens, batch)
        rows.append({"turn": turn, "prompts": count, "prompt_tokens": sum(map(len, batch)),
                     "embed_tokens_per_s": ours, "transformers_tokens_per_s": theirs,
                     "embed_vs_transformers": ours / theirs, "decoders": decoders,
                     "generation_tokens_per_s_alone": alone,
                     "generation_tokens_per_s_beside_embeddings": beside,
                     "generation_beside_vs_alone": beside / alone,
                     "linear_kernel": llm.engine.kernel_choice.kernel.name, "model": str(model_dir)})
    return pd.DataFrame(rows).assign(**describe_machine("cpu").columns())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="default: the default model")
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--shortest", type=int, default=16)
    parser.add_argument("--longest", type=int, default=256)
    parser.add_argument("--decoders", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--out", type=Path, default=Path("results/embeddings.csv"))
    args = parser.parse_args(argv)
    if args.turns < 1 or args.prompts < 1 or not 1 <= args.shortest <= args.longest:
        parser.error("--turns and --prompts must be >= 1, and 1 <= --shortest <= --longest")
    frame = measure(args.model, args.turns, args.prompts, args.shortest, args.longest, args.decoders,
                    args.max_tokens)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    frame.to_csv(args.out, index=False, float_format="%.6g")
    for ratio in ("embed_vs_transformers", "generation_beside_vs_alone"):
        print(f"{ratio}: median {statistics.median(frame[ratio]):.3f} over {len(frame)} turns "
              f"({', '.join(f'{value:.3f}' for value in frame[ratio])})")
    print(f"{frame['cpu_model'][0]}; wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

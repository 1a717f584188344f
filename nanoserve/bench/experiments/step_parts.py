"""Where one decode step's forward goes, part by part, read against the memory roofline.

Owns: replaying one real decode step's forward (captured from an engine running the chosen
model) and timing each of its parts alone, the best of many turns taken round-robin so that a
neighbour's burst disturbs every part alike: the embedding, the step's context, every layer
(the one native call, or the per-op loop), the layers' projections inside it, the final norm,
the head, and the greedy argmax; beside them the bytes each part streams and the GB/s it
reached, against the best streaming read of this machine (`hardware.read_bandwidth_gbs`). With
the fused native layers, their attention (RoPE, K/V write and the paged attention) is timed
inside them, against the K/V bytes the step reads at --input-len's context.
The shortest turn is the least disturbed one on a shared machine, so these are lower bounds of
a quiet step, not the step `profile` measures through the engine (that one adds the host).
Refuses: printing beyond one table (the CSV is the record).

    python -m nanoserve.bench.experiments.step_parts --slots 1,16 --out results/step_parts_q4_1.csv
    python -m nanoserve.bench.experiments.step_parts --slots 1 --input-len 8000 --turns 50 \
        --out results/step_parts_q4_1_8k.csv
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from pathlib import Path

import pandas as pd
import torch

from nanoserve.bench.driver import run_closed_loop
from nanoserve.bench.hardware import describe_machine, read_bandwidth_gbs
from nanoserve.bench.offline import kv_blocks_for, sampling_params, synthetic_prompts
from nanoserve.config import EngineConfig
from nanoserve.engine.core import Engine
from nanoserve.model.batch import ForwardBatch
from nanoserve.model.kv_cache import bytes_per_token
from nanoserve.model.linear import embedding


def weight_bytes(weight: object) -> int:
    """Bytes a matmul streams from `weight`: its blocks (packed or not) or its tensor."""
    if isinstance(weight, torch.Tensor):
        return weight.numel() * weight.element_size()
    return weight.nbytes


def capture_decode_batch(engine: Engine, slots: int, input_len: int) -> ForwardBatch:
    """The ForwardBatch of a real decode step of `slots` rows after `input_len`-token prompts
    (the cache holds their context)."""
    model, captured = engine.model, []
    forward = model.forward

    def spy(batch: ForwardBatch, kv_cache) -> torch.Tensor:
        if batch.input_ids.shape[0] == slots and all(g.rows_per_seq == 1 for g in batch.groups):
            captured.append(batch)
        return forward(batch, kv_cache)

    model.forward = spy
    try:
        prompts = synthetic_prompts(slots, input_len, engine.vocab_size)
        work = [(prompt, sampling_params("greedy", row, 4)) for row, prompt in enumerate(prompts)]
        run_closed_loop(engine, work, slots=slots)
    finally:
        model.forward = forward
    if not captured:
        raise RuntimeError(f"no decode step of {slots} rows ran")
    return captured[-1]


def step_parts(engine: Engine, batch: ForwardBatch, turns: int) -> dict[str, float]:
    """Best seconds of each part of the forward over `turns` round-robin turns."""
    model, kv_cache, w = engine.model, engine.kv_cache, engine.model.weights
    step = model._step_context(batch, kv_cache)
    first_hidden = embedding(batch.input_ids, w.embed, threads=model.threads)
    decoder = model.decoder if not batch.adapter_rows else None

    def layers() -> None:
        hidden = first_hidden.clone()
        if decoder is not None:
            decoder.run(hidden, batch.slot_mapping, step.paged, kv_cache, step.normed, step.attended,
                        step.activated, threads=model.threads)
        else:
            model._layers(hidden, step, kv_cache)

    last = model._add_norm(first_hidden[batch.logits_rows], None, w.norm)
    logits = model.linear(last, w.lm_head)
    parts: dict[str, Callable[[], object]] = {
        "forward": lambda: model.forward(batch, kv_cache),
        "embedding": lambda: embedding(batch.input_ids, w.embed, threads=model.threads),
        "step_context": lambda: model._step_context(batch, kv_cache),
        "layers": layers,
        "final_norm": lambda: model._add_norm(first_hidden[batch.logits_rows], None, w.norm),
        "lm_head": lambda: model.linear(last, w.lm_head),
        "argmax": lambda: logits.argmax(-1),
    }
    best = dict.fromkeys(parts, float("inf"))
    inside = {"layers_projections": "linear_s", "layers_attention": "attention_s"}
    best |= dict.fromkeys(inside, float("inf"))
    for _ in range(turns):
        for name, run in parts.items():
            timed_inside = name == "layers" and decoder is not None
            for attribute in inside.values() if timed_inside else ():
                setattr(decoder, attribute, 0.0)
            start = time.perf_counter()
            run()
            best[name] = min(best[name], time.perf_counter() - start)
            for part, attribute in inside.items() if timed_inside else ():
                best[part] = min(best[part], getattr(decoder, attribute))
                setattr(decoder, attribute, None)
    if decoder is None:
        for part in inside:
            del best[part]
    return best


def measure(slots: int, *, input_len: int, dtype: str, threads: int | None, turns: int, model: str | None,
            linear_kernel: str | None, read_gbs: float) -> pd.DataFrame:
    """One row per part of a `slots`-row decode step after `input_len`-token prompts;
    `read_gbs`: this machine's streaming read."""
    engine = Engine(EngineConfig(model=model, dtype=dtype, max_num_seqs=slots, max_model_len=input_len + 8,
                                 batch_invariant=True, num_kv_blocks=kv_blocks_for(slots, input_len + 8),
                                 max_num_batched_tokens=max(512, min(input_len * slots, 2048)),
                                 threads=threads, linear_kernel=linear_kernel))
    batch = capture_decode_batch(engine, slots, input_len)
    best = step_parts(engine, batch, turns)
    weights = engine.model.weights
    layer_bytes = sum(weight_bytes(m) for layer in weights.layers for m in layer.matrices())
    head_bytes = weight_bytes(weights.lm_head)
    # Each row reads the K/V of its context: its positions up to the one it decodes.
    token_bytes = bytes_per_token(engine.model_config, engine.kv_cache.cache_dtype)
    kv_bytes = int((batch.positions + 1).sum()) * token_bytes
    streamed = {"layers": layer_bytes + kv_bytes, "layers_projections": layer_bytes,
                "layers_attention": kv_bytes, "lm_head": head_bytes,
                "forward": layer_bytes + kv_bytes + head_bytes}
    rows = [{"slots": slots, "part": part, "best_ms": 1e3 * seconds, "bytes": streamed.get(part, 0),
             "gb_per_s": streamed[part] / seconds / 1e9 if part in streamed else None,
             "share_of_forward": seconds / best["forward"]} for part, seconds in best.items()]
    frame = pd.DataFrame(rows)
    roofline_ms = 1e3 * streamed["forward"] / (read_gbs * 1e9)
    return frame.assign(read_gbs=read_gbs, roofline_forward_ms=roofline_ms, turns=turns, input_len=input_len,
                        kv_cache_dtype=engine.kv_cache.cache_dtype, dtype=dtype,
                        weight_format=engine.weight_format, linear_kernel=engine.model.linear_kernel.name,
                        fused_layers=engine.model.decoder is not None, threads=engine.threads,
                        **{k: v for k, v in describe_machine().columns().items() if k != "threads"})


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m nanoserve.bench.experiments.step_parts",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--slots", default="1,16", help="decode rows per step, comma separated")
    parser.add_argument("--input-len", type=int, default=32, help="prompt tokens before the decode step")
    parser.add_argument("--dtype", default="auto",
                        help="as nanoserve bench: auto (the GGUF's blocks), float32, ...")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--turns", type=int, default=200, help="round-robin turns; the best of each part")
    parser.add_argument("--model", default=None)
    parser.add_argument("--linear-kernel", default=None,
                        help="pin the matmul kernel (e.g. native-quant-x8) instead of measuring the choice")
    parser.add_argument("--out", type=Path, default=Path("results/step_parts_q4_1.csv"))
    args = parser.parse_args(argv)
    try:
        slots = [int(s) for s in args.slots.split(",")]
    except ValueError:
        parser.error(f"--slots must be comma-separated integers; got {args.slots!r}")
    if any(s < 1 for s in slots) or args.turns < 1 or args.input_len < 1:
        parser.error("--slots, --turns and --input-len must be at least 1")
    read_gbs = read_bandwidth_gbs()
    frame = pd.concat([measure(s, input_len=args.input_len, dtype=args.dtype, threads=args.threads,
                               turns=args.turns, model=args.model, linear_kernel=args.linear_kernel,
                               read_gbs=read_gbs)
                       for s in slots])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    frame.to_csv(args.out, index=False)
    print(frame[["slots", "part", "best_ms", "gb_per_s", "share_of_forward", "read_gbs",
                 "roofline_forward_ms"]].to_string(index=False, float_format=lambda v: f"{v:.3f}"))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

"""`nanoserve bench serve`: streaming clients against a server, beside the offline engine.

Against a running server (`--base-url`) or one it starts itself (`--launch`, the default model
or `--launch-model`, on a free loopback port). One pass per `--max-concurrency` value, repeated
`--turns` times; with `--offline` (needs `--launch`) each server pass is followed by the same
prompts and parameters through an engine in this process with as many requests in flight (it
idles while the server runs, so the two never share the CPU). Prints a table and the median
server/offline ratio, and writes `serve.csv` (vLLM `bench serve` key names, plus the machine).
"""

from __future__ import annotations

import asyncio
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import typer

from nanoserve_cli.app import app  # noqa: F401  (bench_app hangs off it)
from nanoserve_cli.bench import bench_app, checked
from nanoserve_cli.serve import API_KEY_ENV

SHOWN = ("completed", "failed", "output_throughput", "request_throughput", "mean_ttft_ms", "median_ttft_ms",
         "p99_ttft_ms", "median_tpot_ms", "median_itl_ms", "p99_itl_ms", "median_e2el_ms")


def _concurrency(text: str) -> tuple[int, ...]:
    from nanoserve.bench.offline import parse_int_list

    return parse_int_list(text, minimum=1)


@bench_app.command("serve")
def bench_serve(
    base_url: Annotated[str | None, typer.Option(help="Server to measure, e.g. http://127.0.0.1:8000.")]
    = None,
    model: Annotated[str | None, typer.Option(help="Model name to send; default: the server's first.")]
    = None,
    num_prompts: Annotated[int | None, typer.Option(
        min=1, help="Requests per pass; default: 2 x the concurrency (at least 8).")] = None,
    request_rate: Annotated[float, typer.Option(
        min=0.001, help="Poisson arrivals per second; inf sends every request at once.")] = math.inf,
    max_concurrency: Annotated[str, typer.Option(
        callback=checked(_concurrency), metavar="N,N,...",
        help="Most requests in flight; a list runs one pass each, e.g. 1,8,32.")] = "1",
    input_len: Annotated[int, typer.Option(min=1, help="Words per prompt (about one token each).")] = 32,
    output_len: Annotated[int, typer.Option(min=1, help="Tokens per request (greedy, EOS ignored).")] = 64,
    shared_prefix_len: Annotated[int, typer.Option(
        min=0, help="Leading words every prompt shares (part of --input-len), as a system prompt.")] = 0,
    seed: Annotated[int, typer.Option(help="Seed of the prompts and the arrival times.")] = 0,
    out_dir: Annotated[Path, typer.Option(help="Where serve.csv and the server log go.")] = Path("results"),
    launch: Annotated[bool, typer.Option(help="Start `nanoserve serve` on a free loopback port.")] = False,
    launch_model: Annotated[str | None, typer.Option(
        help="With --launch: the model to serve; default: SmolLM2-135M-Instruct.")] = None,
    max_model_len: Annotated[int, typer.Option(
        min=2, help="With --launch / --offline: the engines' context length.")] = 1024,
    offline: Annotated[bool, typer.Option(
        help="With --launch: also run the workload on the offline engine in this process.")] = False,
    api_key: Annotated[str | None, typer.Option(
        envvar=API_KEY_ENV, help="Bearer token, if the server wants one.")] = None,
    turns: Annotated[int, typer.Option(
        min=1, help="Repeat every pass; with --offline each turn pairs a server and an offline pass.")] = 1,
) -> None:
    """Measure a server with streaming clients: TTFT, TPOT, ITL, E2EL and throughput."""
    from nanoserve.bench import serve as bench

    concurrencies: tuple[int, ...] = max_concurrency  # parsed by its callback
    if (base_url is None) == (not launch):
        raise typer.BadParameter("give exactly one of --base-url and --launch", param_hint="--base-url")
    if offline and not launch:
        raise typer.BadParameter("--offline needs --launch (the same model in both)", param_hint="--offline")
    if shared_prefix_len > input_len:
        raise typer.BadParameter(f"{shared_prefix_len} is more than --input-len {input_len}",
                                 param_hint="--shared-prefix-len")
    workloads = [bench.Workload(num_prompts or max(8, 2 * c), input_len, output_len, seed, shared_prefix_len)
                 for c in concurrencies]
    pass_options = PassOptions(model, request_rate, seed, api_key)
    if not launch:
        rows = [_server_pass(bench, base_url, pass_options, c, workload, turn) for turn in range(turns)
                for c, workload in zip(concurrencies, workloads, strict=True)]
        _write(rows, out_dir / "serve.csv")
        return
    # The offline engine loads first and idles while the server runs: the two never overlap.
    runner = bench.OfflineRunner({"model": launch_model, "max_model_len": max_model_len,
                                  "max_num_seqs": max(concurrencies)}) if offline else None
    serve_args = [*(["--model", launch_model] if launch_model else []),
                  "--max-model-len", str(max_model_len), "--max-num-seqs", str(max(concurrencies))]
    rows = []
    with bench.launched_server(serve_args, log_path=out_dir / "serve.log") as url:
        for turn in range(turns):
            for concurrency, workload in zip(concurrencies, workloads, strict=True):
                rows.append(_server_pass(bench, url, pass_options, concurrency, workload, turn))
                if runner is not None:
                    typer.echo(f"offline engine, {concurrency} in flight ...", err=True)
                    load_1min = os.getloadavg()[0]
                    metrics = runner.run(workload.prompts(), output_len, concurrency)
                    rows.append({"mode": "offline", "turn": turn, "max_concurrency": concurrency,
                                 **_workload_columns(workload), **metrics, "load_1min": load_1min})
    _write(rows, out_dir / "serve.csv")


@dataclass(frozen=True)
class PassOptions:
    model: str | None
    request_rate: float
    seed: int
    api_key: str | None


def _server_pass(bench, base_url: str, options: PassOptions, concurrency: int, workload, turn: int) -> dict:
    model = options.model or asyncio.run(bench.served_model_name(base_url, options.api_key))
    typer.echo(f"server, {concurrency} concurrent clients, {workload.num_prompts} requests ...", err=True)
    prompts = workload.prompts()
    load_1min = os.getloadavg()[0]  # other work on the machine moves every figure
    asyncio.run(bench.run_clients(base_url, model, prompts[:2], 4, api_key=options.api_key))  # warm-up
    results, duration_s = asyncio.run(bench.run_clients(
        base_url, model, prompts, workload.output_len, request_rate=options.request_rate,
        max_concurrency=concurrency, seed=options.seed, api_key=options.api_key))
    errors = sorted({r.error for r in results if not r.success})
    if errors:
        typer.echo(f"  {len(errors)} kinds of failure, e.g. {errors[0]}", err=True)
    return {"mode": "server", "turn": turn, "max_concurrency": concurrency,
            "request_rate": options.request_rate, **_workload_columns(workload),
            **bench.summarize(results, duration_s), "load_1min": load_1min}


def _workload_columns(workload) -> dict[str, int]:
    return {"num_prompts": workload.num_prompts, "input_len": workload.input_len,
            "output_len": workload.output_len, "shared_prefix_len": workload.shared_prefix_len}


def _write(rows: list[dict], path: Path) -> None:
    import pandas as pd

    from nanoserve.bench.hardware import describe_machine

    frame = pd.DataFrame(rows)
    offline = frame[frame["mode"] == "offline"].set_index(["turn", "max_concurrency"])["output_throughput"]
    if not offline.empty:
        frame["server_vs_offline"] = [
            row.output_throughput / offline[row.turn, row.max_concurrency]
            if row.mode == "server" else math.nan for row in frame.itertuples()]
    for name, value in describe_machine("cpu").columns().items():
        frame[name] = value
    path.parent.mkdir(parents=True, exist_ok=True)
    frame.to_csv(path, index=False, float_format="%.6g")
    shown = [c for c in ("mode", "turn", "max_concurrency", *SHOWN, "server_vs_offline") if c in frame]
    typer.echo(frame[shown].to_string(index=False, float_format=lambda v: f"{v:.2f}"))
    if not offline.empty:
        medians = frame[frame["mode"] == "server"].groupby("max_concurrency")["server_vs_offline"].median()
        typer.echo("server / offline output tokens/s, median over turns: "
                   + ", ".join(f"{c} clients {ratio:.3f}" for c, ratio in medians.items()))
    typer.echo(f"wrote {path}")

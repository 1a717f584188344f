"""`nanoserve bench serve`: streaming clients against a server, beside the offline engine.

Against a running server (`--base-url`) or one it starts itself (`--launch`, the default model
or `--launch-model`, on a free loopback port). One pass per `--max-concurrency` value, repeated
`--turns` times; with `--offline` (needs `--launch`) each server pass is followed by the same
prompts and parameters through an engine in this process with as many requests in flight (it
idles while the server runs, so the two never share the CPU). Prints a table and the median
server/offline ratio, and writes `serve.csv` (vLLM `bench serve` key names, plus the machine).
With `--launch --data-parallel-size N` it starts two servers, N replicas (--threads each) and
one engine with N times the threads, and runs each pass on both in turns (the order swapped
every turn; the idle one takes no CPU), writing `serve_data_parallel.csv` with the ratio of
output tokens/s and of p99 TTFT, N replicas over one engine, per turn and as medians.
"""

from __future__ import annotations

import asyncio
import contextlib
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


def _neighbour_kinds(text: str | None) -> tuple[str, ...] | None:
    from nanoserve.bench.neighbours import KINDS

    if text is None:
        return None
    kinds = tuple(k.strip() for k in text.split(",") if k.strip())
    if kinds == ("all",):
        return KINDS
    unknown = [k for k in kinds if k not in KINDS]
    if unknown or not kinds:
        raise ValueError(f"unknown neighbour kind {', '.join(unknown) or repr(text)}; "
                         f"the kinds are all, {', '.join(KINDS)}")
    return kinds


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
    neighbour: Annotated[str | None, typer.Option(
        callback=checked(_neighbour_kinds), metavar="KIND,KIND,...",
        help="Instead of the throughput passes: time one ordinary request (greedy, 16 tokens) alone, "
             "beside each heavy neighbour KIND, and after, --turns times; writes neighbours.csv. "
             "Kinds: all, plain-n1, plain-n16, prefill-3000, ... (nanoserve/bench/neighbours.py).")] = None,
    launch_arg: Annotated[list[str] | None, typer.Option(
        help="With --launch: one more `nanoserve serve` argument (repeatable), e.g. "
             "--launch-arg=--max-num-seqs=8.")] = None,
    endpoint: Annotated[str, typer.Option(
        help="completions, or chat (each prompt as one user message; TTFT at the first content).")]
    = "completions",
    data_parallel_size: Annotated[int, typer.Option(
        "--data-parallel-size", "-dp", min=1,
        help="With --launch: compare N data-parallel replicas (--threads each) against one engine "
             "with N x --threads, in alternating turns; writes serve_data_parallel.csv.")] = 1,
    threads: Annotated[int | None, typer.Option(
        min=1, help="With --data-parallel-size: each replica's threads (one engine gets N x this); "
                    "default: the cores split.")] = None,
) -> None:
    """Measure a server with streaming clients: TTFT, TPOT, ITL, E2EL and throughput."""
    from nanoserve.bench import serve as bench

    concurrencies: tuple[int, ...] = max_concurrency  # parsed by its callback
    if (base_url is None) == (not launch):
        raise typer.BadParameter("give exactly one of --base-url and --launch", param_hint="--base-url")
    if neighbour is not None:
        _neighbour_bench(neighbour, base_url, launch_model, max_model_len, list(launch_arg or ()),
                         PassOptions(model, request_rate, seed, api_key, endpoint), turns, out_dir)
        return
    if offline and not launch:
        raise typer.BadParameter("--offline needs --launch (the same model in both)", param_hint="--offline")
    if endpoint not in bench.ENDPOINTS:
        raise typer.BadParameter(f"one of {', '.join(bench.ENDPOINTS)}; got {endpoint!r}",
                                 param_hint="--endpoint")
    if data_parallel_size > 1 and (not launch or offline):
        raise typer.BadParameter("needs --launch (it starts both servers) and no --offline",
                                 param_hint="--data-parallel-size")
    if threads is not None and data_parallel_size == 1:
        raise typer.BadParameter("only with --data-parallel-size N > 1 (else use --launch-arg=--threads=T)",
                                 param_hint="--threads")
    if shared_prefix_len > input_len:
        raise typer.BadParameter(f"{shared_prefix_len} is more than --input-len {input_len}",
                                 param_hint="--shared-prefix-len")
    workloads = [bench.Workload(num_prompts or max(8, 2 * c), input_len, output_len, seed, shared_prefix_len)
                 for c in concurrencies]
    pass_options = PassOptions(model, request_rate, seed, api_key, endpoint)
    if data_parallel_size > 1:
        base_args = [*(["--model", launch_model] if launch_model else []),
                     "--max-model-len", str(max_model_len), "--max-num-seqs", str(max(concurrencies)),
                     *(launch_arg or ())]
        _data_parallel_bench(bench, base_args, data_parallel_size, threads, pass_options,
                             list(zip(concurrencies, workloads, strict=True)), turns, out_dir)
        return
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
    endpoint: str = "completions"


def _server_pass(bench, base_url: str, options: PassOptions, concurrency: int, workload, turn: int) -> dict:
    model = options.model or asyncio.run(bench.served_model_name(base_url, options.api_key))
    typer.echo(f"server, {concurrency} concurrent clients, {workload.num_prompts} requests ...", err=True)
    prompts = workload.prompts()
    load_1min = os.getloadavg()[0]  # other work on the machine moves every figure
    asyncio.run(bench.run_clients(base_url, model, prompts[:2], 4, api_key=options.api_key))  # warm-up
    results, duration_s = asyncio.run(bench.run_clients(
        base_url, model, prompts, workload.output_len, request_rate=options.request_rate,
        max_concurrency=concurrency, seed=options.seed, api_key=options.api_key, endpoint=options.endpoint))
    errors = sorted({r.error for r in results if not r.success})
    if errors:
        typer.echo(f"  {len(errors)} kinds of failure, e.g. {errors[0]}", err=True)
    return {"mode": "server", "turn": turn, "max_concurrency": concurrency, "endpoint": options.endpoint,
            "request_rate": options.request_rate, **_workload_columns(workload),
            **bench.summarize(results, duration_s), "load_1min": load_1min}


def _data_parallel_bench(bench, base_args: list[str], size: int, threads: int | None, options: PassOptions,
                         passes: list, turns: int, out_dir: Path) -> None:
    """Every pass on N replicas and on one engine with their threads, in turns (order swapped
    each turn); both servers stay up, the idle one takes no CPU."""
    servers = {1: [*base_args, *(["--threads", str(size * threads)] if threads else [])],
               size: [*base_args, "--data-parallel-size", str(size),
                      *(["--threads", str(threads)] if threads else [])]}
    rows = []
    with contextlib.ExitStack() as stack:
        urls = {n: stack.enter_context(bench.launched_server(args, log_path=out_dir / f"serve_dp{n}.log"))
                for n, args in servers.items()}
        for turn in range(turns):
            for concurrency, workload in passes:
                for n in (sorted(urls) if turn % 2 == 0 else sorted(urls, reverse=True)):
                    typer.echo(f"turn {turn}: data_parallel_size {n}", err=True)
                    row = _server_pass(bench, urls[n], options, concurrency, workload, turn)
                    rows.append({**row, "data_parallel_size": n, "server_args": " ".join(servers[n])})
    _write_data_parallel(rows, size, out_dir / "serve_data_parallel.csv")


def _write_data_parallel(rows: list[dict], size: int, path: Path) -> None:
    import pandas as pd

    from nanoserve.bench.hardware import describe_machine

    frame = pd.DataFrame(rows)
    one = frame[frame["data_parallel_size"] == 1].set_index(["turn", "max_concurrency"])
    for column in ("output_throughput", "p99_ttft_ms"):
        frame[f"{column}_vs_one_engine"] = [
            getattr(row, column) / one.loc[(row.turn, row.max_concurrency), column]
            for row in frame.itertuples()]
    for name, value in describe_machine("cpu").columns().items():
        frame[name] = value
    path.parent.mkdir(parents=True, exist_ok=True)
    frame.to_csv(path, index=False, float_format="%.6g")
    shown = ["data_parallel_size", "turn", "max_concurrency", "completed", "failed", "output_throughput",
             "p99_ttft_ms", "median_ttft_ms", "output_throughput_vs_one_engine", "p99_ttft_ms_vs_one_engine"]
    typer.echo(frame[shown].to_string(index=False, float_format=lambda v: f"{v:.2f}"))
    replicas = frame[frame["data_parallel_size"] == size].groupby("max_concurrency")
    for concurrency, group in replicas:
        typer.echo(f"{concurrency} clients, {size} replicas / one engine, median over {len(group)} turns: "
                   f"output tokens/s {group['output_throughput_vs_one_engine'].median():.3f}, "
                   f"p99 TTFT {group['p99_ttft_ms_vs_one_engine'].median():.3f}")
    typer.echo(f"wrote {path}")


def _neighbour_bench(kinds: tuple[str, ...], base_url: str | None, launch_model: str | None,
                     max_model_len: int, launch_args: list[str], options: PassOptions, turns: int,
                     out_dir: Path) -> None:
    from nanoserve.bench import neighbours
    from nanoserve.bench import serve as bench

    def run(url: str) -> list:
        model = options.model or asyncio.run(bench.served_model_name(url, options.api_key))

        def show(result) -> None:
            typer.echo(f"  {result.kind} turn {result.turn}: during / alone {result.ratio:.2f} "
                       f"(alone {result.alone.e2e_s:.2f} s, during {result.during.e2e_s:.2f} s, "
                       f"after {result.after.e2e_s:.2f} s; neighbour HTTP {result.neighbour_status})",
                       err=True)

        return asyncio.run(neighbours.run_neighbours(url, model, kinds, turns, seed=options.seed,
                                                     api_key=options.api_key, on_result=show))

    load_1min = os.getloadavg()[0]
    if base_url is not None:
        results = run(base_url)
    else:
        # A 4,000-token context and a 3,000-token prompt must fit beside their outputs.
        serve_args = [*(["--model", launch_model] if launch_model else []),
                      "--max-model-len", str(max(max_model_len, 6144)), *launch_args]
        with bench.launched_server(serve_args, log_path=out_dir / "neighbours.log") as url:
            results = run(url)
    _write_neighbours(results, load_1min, " ".join(launch_args), out_dir / "neighbours.csv")


def _write_neighbours(results: list, load_1min: float, server_args: str, path: Path) -> None:
    import pandas as pd

    from nanoserve.bench.hardware import describe_machine
    from nanoserve.bench.neighbours import median_ratios

    frame = pd.DataFrame([r.row() for r in results])
    frame["load_1min"], frame["server_args"] = load_1min, server_args
    for name, value in describe_machine("cpu").columns().items():
        frame[name] = value
    path.parent.mkdir(parents=True, exist_ok=True)
    frame.to_csv(path, index=False, float_format="%.6g")
    medians = median_ratios(results)
    spread = frame.groupby("neighbour")["ratio"].agg(["min", "max"])
    drift = frame.groupby("neighbour")["after_vs_alone"].median()
    typer.echo("neighbour: ordinary request's time during / alone, median over turns "
               "(prefill-3000: time per output token) [min..max]; after / alone")
    for kind, ratio in medians.items():
        low, high = spread.loc[kind, "min"], spread.loc[kind, "max"]
        typer.echo(f"  {kind:22s} {ratio:6.2f}  [{low:.2f}..{high:.2f}]  {drift[kind]:.2f}")
    typer.echo(f"wrote {path}")


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

"""`nanoserve bench`: the offline throughput sweep (the callback) and its subcommands.

Parses and checks the sweep's options, shows a progress bar and a table, and writes the CSV
and the chart; `nanoserve.bench.offline` does the measuring.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Annotated

import typer

from nanoserve_cli import options
from nanoserve_cli.app import app

bench_app = typer.Typer(
    invoke_without_command=True,
    no_args_is_help=False,
    help="Measure the engine: the offline sweep (no subcommand) or `bench serve`.",
)
app.add_typer(bench_app, name="bench")

DEFAULT_OUT = Path("results/bench.csv")


def checked(parse: Callable[[str], object]) -> Callable[[str], object]:
    """An option callback that turns a ValueError into a usage error (exit 2) naming the option."""

    def callback(text: str) -> object:
        try:
            return parse(text)
        except ValueError as error:
            raise typer.BadParameter(str(error)) from None

    return callback


def _slots(text: str) -> tuple[int, ...]:
    from nanoserve.bench.offline import parse_int_list

    return parse_int_list(text, minimum=1)


def _params(text: str) -> tuple[str, ...]:
    from nanoserve.bench.offline import PARAM_MIXES, parse_choice_list

    return parse_choice_list(text, PARAM_MIXES)


def _dtypes(text: str) -> tuple[str, ...]:
    from nanoserve.bench.offline import parse_choice_list
    from nanoserve.config import DTYPES, QUANTIZED

    return parse_choice_list(text, (*DTYPES, QUANTIZED, "auto"))


def _switches(text: str) -> tuple[bool, ...]:
    from nanoserve.bench.offline import parse_choice_list

    return tuple(value == "on" for value in parse_choice_list(text, ("off", "on")))


def _drafts(text: str) -> tuple[int, ...]:
    from nanoserve.bench.offline import parse_int_list
    from nanoserve.engine.spec_decode import MAX_SPECULATIVE_TOKENS

    values = parse_int_list(text, minimum=0)
    if any(value > MAX_SPECULATIVE_TOKENS for value in values):
        raise ValueError(f"at most {MAX_SPECULATIVE_TOKENS} drafts; got {text!r}")
    return values


def _prompt_kind(text: str) -> str:
    from nanoserve.bench.offline import PROMPT_KINDS, parse_choice_list

    (kind,) = parse_choice_list(text, PROMPT_KINDS)
    return kind


def _baseline(text: str | None) -> str | None:
    from nanoserve.bench.offline import BASELINES

    if text is not None and text not in BASELINES:
        raise ValueError(f"{text!r} is not one of {', '.join(BASELINES)}")
    return text


# List options arrive as text and leave their callback parsed (a tuple), or as a usage error.
Slots = Annotated[str, typer.Option(
    callback=checked(_slots), metavar="N,N,...", help="Concurrent requests per configuration, e.g. 1,2,4,8.")]
Params = Annotated[str, typer.Option(
    callback=checked(_params), metavar="MIX,...",
    help="Sampling mixes: greedy, top_p (T 0.8, p 0.9), top_k (T 0.8, k 50), mixed (rows cycle the three).")]
Dtypes = Annotated[str, typer.Option(
    "--dtype", callback=checked(_dtypes), metavar="DTYPE,...",
    help="auto (the default model: its GGUF quantization), quantized, float32, bfloat16, float16 "
         "(a list sweeps).")]
BatchInvariantSweep = Annotated[str, typer.Option(
    "--batch-invariant", callback=checked(_switches), metavar="off|on|off,on",
    help="Batch-invariant kernels; off,on runs both side by side and reports the ratio.")]
PrefixCachingSweep = Annotated[str, typer.Option(
    "--prefix-caching", callback=checked(_switches), metavar="off|on|off,on",
    help="Automatic prefix caching; off,on runs both side by side.")]
SharedPrefixLen = Annotated[int, typer.Option(
    min=0, help="Leading prompt tokens every request shares (part of --input-len), as a system "
                "prompt; the warm-up runs see it too.")]
SpeculativeSweep = Annotated[str, typer.Option(
    "--speculative-tokens", callback=checked(_drafts), metavar="K,K,...",
    help="Speculative drafts per request per step (0 off); 0,4 runs both side by side and reports "
         "the ratio and whether the tokens are the same.")]
AsyncSchedulingSweep = Annotated[str, typer.Option(
    "--async-scheduling", callback=checked(_switches), metavar="off|on|off,on",
    help="Deferred output (each step launched before the last one's tokens are resolved); off,on "
         "runs both side by side and reports the ratio and whether the tokens are the same.")]
PromptKind = Annotated[str, typer.Option(
    "--prompts", callback=checked(_prompt_kind),
    help="synthetic: random ids of --input-len; repeat: chat prompts asking to fix one typo in code "
         "given in the prompt, the reply begun with its code fence, so the answer copies the code "
         "(EOS ends a request).")]
Baseline = Annotated[str | None, typer.Option(
    callback=checked(_baseline), help="Also run this engine on the same workload: transformers.")]
InputLen = Annotated[int, typer.Option(min=1, help="Prompt length in tokens (synthetic token ids).")]
OutputLen = Annotated[int, typer.Option(min=1, help="Tokens generated per request (EOS ignored).")]
NumRequests = Annotated[int | None, typer.Option(min=1, help="Requests per configuration; default: = slots.")]
Warmup = Annotated[int, typer.Option(min=0, help="Untimed short runs before each configuration.")]
Repeat = Annotated[int, typer.Option(min=1, help="Timed runs per configuration; the median one is kept.")]
Out = Annotated[Path, typer.Option(help="CSV to write; the chart goes beside it as .png.")]


# The options every engine of the sweep shares; the sweep's own axes (dtype, batch invariance,
# prefix caching, drafts, deferred output) are lists, declared above.
SWEEP_SHARES = ("model", "device", "threads", "linear_kernel", "tensor_parallel_size", "kv_cache_dtype",
                "prefill_step_ms")


@bench_app.callback()
@options.engine_options(only=SWEEP_SHARES)
def bench(
    ctx: typer.Context,
    slots: Slots = "1,2,4,8",
    params: Params = "greedy",
    input_len: InputLen = 32,
    output_len: OutputLen = 64,
    num_requests: NumRequests = None,
    warmup: Warmup = 1,
    repeat: Repeat = 1,
    baseline: Baseline = None,
    dtype: Dtypes = "auto",
    batch_invariant: BatchInvariantSweep = "on",
    prefix_caching: PrefixCachingSweep = "on",
    shared_prefix_len: SharedPrefixLen = 0,
    speculative_tokens: SpeculativeSweep = "0",
    async_scheduling: AsyncSchedulingSweep = "off",
    prompts: PromptKind = "synthetic",
    *,
    engine: options.EngineOptions,
    out: Out = DEFAULT_OUT,
    chart: Annotated[bool, typer.Option("--chart/--no-chart", help="Write the PNG chart.")] = True,
    append: Annotated[bool, typer.Option(
        "--append", help="Keep the rows already in --out, replacing those this run measures again.")] = False,
) -> None:
    """Offline throughput: every slots x params x dtype configuration, with its baseline beside it."""
    if ctx.invoked_subcommand is not None:
        return
    from nanoserve.bench.offline import SweepSpec, Workload

    engine.check()
    if shared_prefix_len > input_len:
        options.fail(f"--shared-prefix-len ({shared_prefix_len}) must be at most --input-len ({input_len})")
    spec = SweepSpec(slots=slots, params=params, dtypes=dtype, batch_invariant=batch_invariant,
                     prefix_caching=prefix_caching, speculative_tokens=speculative_tokens,
                     async_scheduling=async_scheduling,
                     baseline=baseline, model=engine.model, device=engine.device, threads=engine.threads,
                     linear_kernel=engine.linear_kernel, tensor_parallel_size=engine.tensor_parallel_size,
                     kv_cache_dtype=engine.kv_cache_dtype, prefill_step_ms=engine.prefill_step_ms,
                     workload=Workload(input_len, output_len, num_requests, warmup, repeat,
                                       shared_prefix_len, prompts))
    run_offline(spec, out, chart=chart, append=append)


def run_offline(spec, out: Path, *, chart: bool, append: bool = False) -> None:
    import pandas as pd
    from rich.console import Console

    from nanoserve.bench import charts
    from nanoserve.bench.offline import Sweep, merge_rows
    from nanoserve.errors import NanoserveError

    console = Console(stderr=True)
    try:
        with console.status("loading the engines and probing the hardware"):
            sweep = Sweep(spec)
        result = _with_progress(sweep, console)
    except (NanoserveError, RuntimeError) as error:
        options.fail(str(error))
    out.parent.mkdir(parents=True, exist_ok=True)
    frame = merge_rows(pd.read_csv(out), result.frame) if append and out.is_file() else result.frame
    frame.to_csv(out, index=False, float_format="%.6g")
    Console(width=None if sys.stdout.isatty() else 200).print(bench_table(result))
    console.print(f"wrote {out}")
    if chart:
        console.print(f"wrote {charts.throughput_chart(frame, out.with_suffix('.png'))}")


def _with_progress(sweep, console):
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=True) as bar:
        task = bar.add_task("loading", total=None)

        def advance(config, done: int, total: int) -> None:
            bar.update(task, completed=done, total=total, description=config.label)

        return sweep.run(progress=advance)


def bench_table(result):
    from rich.table import Table

    limits = result.limits
    table = Table(title=f"{result.machine.label}\nmeasured read {limits.read_gbs:.1f} GB/s, "
                        f"GEMM peak {limits.peak_gflops:.0f} GFLOP/s", title_justify="left")
    headers = ("engine", "dtype", "slots", "params", "tok/s", "req/s", "TTFT ms p50", "TPOT ms p50",
               "step ms", "roof ms", "GB/s", "GFLOP/s", "readbacks/step", "x baseline", "x plain")
    for header in headers:
        table.add_column(header, justify="left" if header in ("engine", "dtype", "params") else "right")
    for row in result.frame.itertuples():
        engine = row.engine + (" (batch-inv)" if row.batch_invariant else "")
        engine += " (no prefix cache)" if row.engine == "nanoserve" and not row.prefix_caching else ""
        drafts = getattr(row, "speculative_tokens", 0)
        engine += (f" ({drafts} drafts: x{row.ratio_to_no_speculation:.2f}, decoding "
                   f"x{row.decode_ratio_to_no_speculation:.2f})" if drafts else "")
        deferred = row.engine == "nanoserve" and bool(getattr(row, "async_scheduling", False))
        engine += f" (deferred output: x{row.ratio_to_sync_output:.2f})" if deferred else ""
        roof_ms = max(getattr(row, "memory_limit_step_ms", float("nan")),
                      getattr(row, "compute_limit_step_ms", float("nan")))
        table.add_row(engine, row.dtype, str(row.slots), row.params, _f(row.output_tokens_per_s, 1),
                      _f(row.requests_per_s, 2), _f(row.ttft_median_ms, 0), _f(row.tpot_median_ms, 1),
                      _f(getattr(row, "decode_step_ms", None), 1), _f(roof_ms, 1),
                      _f(getattr(row, "achieved_read_gbs", None), 1),
                      _f(getattr(row, "achieved_gflops", None), 1),
                      _f(getattr(row, "readbacks_per_decode_step", None), 2),
                      _f(row.ratio_to_baseline, 2), _f(row.ratio_to_plain_kernels, 2))
    return table


def _f(value: float | None, digits: int) -> str:
    if value is None or value != value:  # NaN: the figure does not apply to this row
        return "-"
    return f"{value:.{digits}f}"

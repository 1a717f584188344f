"""`nanoserve profile`: what each phase of a decode step costs, over batch sizes."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from nanoserve_cli import options
from nanoserve_cli.app import app
from nanoserve_cli.bench import checked

DEFAULT_OUT = Path("results/profile.csv")


def _batch_sizes(text: str) -> tuple[int, ...]:
    from nanoserve.bench.offline import parse_int_list

    return parse_int_list(text, minimum=1)


def _mix(text: str) -> str:
    from nanoserve.bench.offline import PARAM_MIXES

    if text not in PARAM_MIXES:
        raise ValueError(f"{text!r} is not one of {', '.join(PARAM_MIXES)}")
    return text


def _dtype(text: str) -> str:
    from nanoserve.config import DTYPES, QUANTIZED

    choices = (*DTYPES, QUANTIZED, "auto")
    if text not in choices:
        raise ValueError(f"{text!r} is not one of {', '.join(choices)}")
    return text


def _switches(text: str | None) -> tuple[bool, ...] | None:
    from nanoserve.bench.offline import parse_choice_list

    if text is None:
        return None
    return tuple(value == "on" for value in parse_choice_list(text, ("off", "on")))


def _one_switch(text: str) -> bool:
    switches = _switches(text)
    if len(switches) != 1:  # bench sweeps both; a profile measures one engine
        raise ValueError(f"profile runs one engine: give off or on, not {text!r}")
    return switches[0]


def _slots(text: str | None) -> tuple[int, ...] | None:
    return None if text is None else _batch_sizes(text)


# One name for "requests decoding together" across bench, profile and syncbench: --slots.
Slots = Annotated[str, typer.Option(
    callback=checked(_slots), metavar="N,N,...", help="Requests decoding together (concurrent slots).")]
OldBatchSizes = Annotated[str | None, typer.Option(
    "--batch-sizes", hidden=True, callback=checked(_slots), help="Deprecated spelling of --slots.")]
Dtype = Annotated[str, typer.Option(callback=checked(_dtype), help=(
    "auto (as generate and serve: the default model's GGUF in its own quantization), quantized, "
    "float32, bfloat16 or float16; the CSV's weight_format column says what ran."))]
PrefixCaching = Annotated[str, typer.Option(
    "--prefix-caching", callback=checked(_one_switch), metavar="off|on",
    help="Automatic prefix caching, as bench's option (one engine here: off or on).")]


# The engine options of the one engine profiled; its dtype and prefix caching are spelt as bench's
# sweeps (above), one value each.
ENGINE_OPTIONS = ("model", "device", "batch_invariant", "threads", "linear_kernel", "tensor_parallel_size",
                  "kv_cache_dtype")


@app.command()
@options.engine_options(only=ENGINE_OPTIONS)
def profile(
    slots: Slots = "1,2,4,8,16",
    input_len: Annotated[int, typer.Option(min=1, help="Prompt length in tokens.")] = 32,
    output_len: Annotated[int, typer.Option(min=2, help="Tokens generated per request.")] = 64,
    params: Annotated[str, typer.Option(
        callback=checked(_mix), help="Sampling mix: greedy, top_p, top_k or mixed.")] = "greedy",
    dtype: Dtype = "float32",
    prefix_caching: PrefixCaching = "on",
    *,
    engine: options.EngineOptions,
    out: Annotated[Path, typer.Option(help="CSV to write; the chart goes beside it as .png.")] = DEFAULT_OUT,
    trace: Annotated[Path | None, typer.Option(
        help="Also write a torch.profiler Chrome trace (a few steps per batch size) here.")] = None,
    chart: Annotated[bool, typer.Option("--chart/--no-chart", help="Write the stacked bar chart.")] = True,
    native_ops: Annotated[str | None, typer.Option(
        callback=checked(_switches), metavar="off|on|off,on",
        help="The forward's small ops in C (on) or torch (off); off,on alternates them per batch "
             "size in one engine. Default: as the engine runs them.")] = None,
    batch_sizes: OldBatchSizes = None,
) -> None:
    """Per-phase cost and readbacks of a decode step (schedule, prepare, forward, sample, collect),
    and the forward split into its matrix multiplies and the rest."""
    from nanoserve.bench.profile import ProfileSpec

    engine.check()
    spec = ProfileSpec(batch_sizes=options.slots_or_deprecated(slots, batch_sizes, "--batch-sizes"),
                       input_len=input_len, output_len=output_len, params=params,
                       dtype=dtype, batch_invariant=engine.batch_invariant, prefix_caching=prefix_caching,
                       model=engine.model, device=engine.device, threads=engine.threads,
                       linear_kernel=engine.linear_kernel, trace_path=trace, native_ops=native_ops,
                       tensor_parallel_size=engine.tensor_parallel_size, kv_cache_dtype=engine.kv_cache_dtype)
    run_profile(spec, out, chart=chart)


def run_profile(spec, out: Path, *, chart: bool) -> None:
    from rich.console import Console

    from nanoserve.bench import charts
    from nanoserve.bench.hardware import describe_machine
    from nanoserve.bench.profile import build_engine, expert_profile, profile_engine
    from nanoserve.errors import NanoserveError

    console = Console(stderr=True)
    try:
        with console.status("loading the engine"):
            engine = build_engine(spec)
        with console.status("profiling") as status:
            def progress(batch_size: int, done: int, total: int) -> None:
                status.update(f"profiling batch size {batch_size} ({done}/{total})")

            frame = profile_engine(engine, spec, progress)
            status.update("profiling the experts")
            experts = expert_profile(engine, spec)
    except NanoserveError as error:
        options.fail(str(error))
    machine = describe_machine(engine.device)
    frame = frame.assign(**machine.columns(), **engine.kernel_choice.columns())
    out.parent.mkdir(parents=True, exist_ok=True)
    frame.to_csv(out, index=False, float_format="%.6g")
    Console(width=None if sys.stdout.isatty() else 200).print(profile_table(frame, machine.label))
    console.print(f"wrote {out}")
    if experts is not None:
        experts_out = out.with_name(f"{out.stem}_experts.csv")
        experts.assign(**machine.columns()).to_csv(experts_out, index=False, float_format="%.6g")
        Console(width=None if sys.stdout.isatty() else 200).print(experts_table(experts))
        console.print(f"wrote {experts_out}")
    if spec.trace_path is not None:
        console.print(f"wrote {spec.trace_path} (open in ui.perfetto.dev or chrome://tracing)")
    if chart:
        console.print(f"wrote {charts.phase_chart(frame, out.with_suffix('.png'))}")


def profile_table(frame, title: str):
    from rich.table import Table

    from nanoserve.bench.profile import PHASES

    table = Table(title=title, title_justify="left")
    table.add_column("batch", justify="right")
    table.add_column("small ops")
    table.add_column("step ms", justify="right")
    table.add_column("roofline ms (share)", justify="right")
    for phase in PHASES:
        table.add_column(f"{phase} ms (rb)", justify="right")
    table.add_column("other ms", justify="right")
    table.add_column("forward: linears ms", justify="right")
    table.add_column("forward: attention ms (share of step)", justify="right")
    with_peak = "linear_peak_fraction" in frame.columns
    if with_peak:
        table.add_column(f"linears / {frame['peak_isa'].iloc[0]} peak", justify="right")
    table.add_column("forward: rest ms (per row)", justify="right")
    table.add_column("native calls", justify="right")
    table.add_column("tok/s", justify="right")
    for row in frame.itertuples():
        phases = [f"{getattr(row, f'{p}_ms'):.2f} ({getattr(row, f'{p}_readbacks'):.0f})" for p in PHASES]
        table.add_row(str(row.batch_size), "native" if row.native_ops else "torch", f"{row.step_ms:.2f}",
                      f"{row.roofline_step_ms:.2f} ({row.roofline_fraction:.2f})", *phases,
                      f"{row.other_ms:.2f}",
                      f"{row.forward_linear_ms:.2f}",
                      f"{row.forward_attention_ms:.2f} ({row.attention_share:.2f})",
                      *([f"{row.linear_peak_fraction:.2f}"] if with_peak else []),
                      f"{row.forward_rest_ms:.2f} ({row.forward_rest_ms_per_row:.2f})",
                      f"{row.native_calls_per_step:.0f}", f"{row.decode_tokens_per_s:.1f}")
    return table


def experts_table(frame):
    """Per expert (rows) and batch size (columns): rows routed per decode step and matmul ms per step."""
    from rich.table import Table

    table = Table(title="experts: rows routed per decode step (all sparse layers) / matmul ms per step",
                  title_justify="left")
    table.add_column("expert", justify="right")
    sizes = sorted(frame["batch_size"].unique())
    for size in sizes:
        table.add_column(f"batch {size}", justify="right")
    cells = frame.set_index(["expert", "batch_size"])
    for expert in sorted(frame["expert"].unique()):
        table.add_row(str(expert), *(f"{cells.at[(expert, s), 'rows_per_step']:.1f} / "
                                     f"{cells.at[(expert, s), 'expert_ms_per_step']:.2f}" for s in sizes))
    return table

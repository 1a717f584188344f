"""PNG charts of the bench, profile and syncbench CSVs (matplotlib, Agg: no display needed).

Owns: tokens/s against slots (one line per sampling mix, the baseline dashed in the same
colour, the roofline dotted), the stacked per-phase cost of a decode step per batch size, and
the sampling step's time against rows (the batched sampler solid, the per-row loop dashed in
the same colour); the machine line under every title; writing the PNG.
Refuses: computing figures; it draws the columns `offline`, `profile` and `syncbench` wrote.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt
import pandas as pd

PHASE_COLOURS = {"schedule": "#4c72b0", "prepare": "#dd8452", "forward": "#55a868",
                 "sample": "#c44e52", "collect": "#8172b3", "other": "#937860"}
# The forward band split when the profile timed its matrix multiplies and its attention.
FORWARD_SPLIT = {"forward_linear": ("forward: linears", "#55a868"),
                 "forward_attention": ("forward: attention", "#2f7d4a"),
                 "forward_rest": ("forward: the rest", "#a6d8b0")}


def _series_label(row: pd.Series, *, many_dtypes: bool, many_kernels: bool) -> str:
    label = str(row.params)
    if many_dtypes:
        label += f" {row['dtype']}"
    if many_kernels and row.batch_invariant:
        label += " batch-invariant"
    return label


def machine_line(frame: pd.DataFrame) -> str:
    """The machine a CSV's rows ran on, from its own columns."""
    row = frame.iloc[0]
    where = row.device_name if str(row.device) != "cpu" else row.cpu_model
    return f"{where}, {row.cores} cores, {row.threads} threads, torch {row.torch_version}"


def _in_mix_order(frame: pd.DataFrame) -> pd.DataFrame:
    mixes = ("greedy", "top_p", "top_k", "typical_p", "top_n_sigma", "p_less", "mixed", "structured")
    order = {mix: i for i, mix in enumerate(mixes)}
    return frame.sort_values(["engine", "params", "slots"], kind="stable",
                             key=lambda column: column.map(order) if column.name == "params" else column)


def throughput_chart(frame: pd.DataFrame, path: Path) -> Path:
    """Output tokens/s against concurrent requests, read against the baseline and the roofline."""
    fig, ax = plt.subplots(figsize=(8, 5.5))
    frame = _in_mix_order(frame)
    ours = frame[frame.engine == "nanoserve"]
    many_dtypes, many_kernels = ours.dtype.nunique() > 1, ours.batch_invariant.nunique() > 1
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    colour_of: dict[str, str] = {}
    for (mix, dtype, invariant), group in ours.groupby(["params", "dtype", "batch_invariant"], sort=False):
        label = _series_label(group.iloc[0], many_dtypes=many_dtypes, many_kernels=many_kernels)
        colour = colour_of.setdefault(f"{mix} {dtype}", colours[len(colour_of) % len(colours)])
        group = group.sort_values("slots")
        ax.plot(group.slots, group.output_tokens_per_s, marker="o", color=colour,
                linestyle="-." if invariant else "-", label=f"nanoserve {label}")
    for (engine, mix, dtype), group in frame[frame.engine != "nanoserve"].groupby(
            ["engine", "params", "dtype"], sort=False):
        colour = colour_of.get(f"{mix} {dtype}", "grey")
        group = group.sort_values("slots")
        suffix = f" {dtype}" if many_dtypes else ""
        ax.plot(group.slots, group.output_tokens_per_s, marker="s", linestyle="--", color=colour,
                alpha=0.8, label=f"{engine} {mix}{suffix}")
    if "roofline_decode_tokens_per_s" in ours:
        roof = ours.groupby("slots").roofline_decode_tokens_per_s.max().sort_index()
        ax.plot(roof.index, roof.values, linestyle=":", color="black",
                label="decode roofline (measured read GB/s, GEMM peak)")
    _log_axes(ax, frame.slots, "concurrent requests (slots)", "output tokens/s")
    first = frame.iloc[0]
    ax.set_title(f"nanoserve offline: prompt {first.input_len}, {first.output_len} new tokens, EOS ignored\n"
                 f"{machine_line(frame)}; measured {frame.measured_read_gbs.median():.1f} GB/s read, "
                 f"{frame.measured_peak_gflops.median():.0f} GFLOP/s GEMM", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="upper left")
    return _save(fig, path)


def phase_chart(frame: pd.DataFrame, path: Path) -> Path:
    """Stacked milliseconds per decode step, one bar per batch size, one band per phase."""
    bands = {p: (p, colour) for p, colour in PHASE_COLOURS.items() if f"{p}_ms" in frame}
    if "forward_linear_ms" in frame:
        split = {n: b for n, b in FORWARD_SPLIT.items() if f"{n}_ms" in frame}
        bands = {n: b for p, band in bands.items()
                 for n, b in (split.items() if p == "forward" else [(p, band)])}
    frame = frame.sort_values("batch_size", kind="stable")
    fig, ax = plt.subplots(figsize=(8, 5.5))
    positions = range(len(frame))
    bottom = [0.0] * len(frame)
    for band, (label, colour) in bands.items():
        values = frame[f"{band}_ms"].fillna(0.0).tolist()
        ax.bar(positions, values, bottom=bottom, color=colour, label=label)
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    for x, (top, rate) in enumerate(zip(bottom, frame.decode_tokens_per_s, strict=True)):
        ax.annotate(f"{rate:.0f} tok/s", (x, top), ha="center", va="bottom", fontsize=8)
    labels = [str(b) for b in frame.batch_size]
    if "native_ops" in frame and frame.native_ops.nunique() > 1:  # small ops side by side
        labels = [f"{b}\n{'native' if n else 'torch'}" for b, n in zip(frame.batch_size, frame.native_ops,
                                                                       strict=True)]
    ax.set_xticks(list(positions), labels)
    ax.set_xlabel("decode batch size (requests in the step)")
    ax.set_ylabel("ms per decode step")
    first = frame.iloc[0]
    kernels = ", batch-invariant" if first.batch_invariant else ""
    ax.set_title(f"nanoserve decode step by phase: {first['dtype']}{kernels}, {first.params}, prompt "
                 f"{first.input_len}, {first.output_len} new tokens\n{machine_line(frame)}", fontsize=9)
    ax.legend(fontsize=8)
    ax.grid(True, axis="y", alpha=0.3)
    return _save(fig, path)


def syncbench_chart(frame: pd.DataFrame, path: Path) -> Path:
    """Milliseconds per sampling step against rows: the batched sampler beside the per-row loop."""
    fig, ax = plt.subplots(figsize=(8, 5.5))
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for colour, (mix, group) in zip(colours, frame.groupby("mix", sort=False), strict=False):
        group = group.sort_values("rows")
        ax.plot(group.rows, group.engine_ms, marker="o", color=colour, label=f"batched sampler, {mix}")
        ax.plot(group.rows, group.baseline_ms, marker="s", linestyle="--", color=colour, alpha=0.8,
                label=f"per-row loop, {mix}")
    _log_axes(ax, frame.rows, "rows in the step", "ms per sampling step (median, incl. readback)")
    first = frame.iloc[0]
    ax.set_title(f"syncbench: vocab {first.vocab}, {first.logits_source} logits, {first['dtype']}\n"
                 f"{machine_line(frame)}", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    return _save(fig, path)


def _log_axes(ax: plt.Axes, x_values: pd.Series, xlabel: str, ylabel: str) -> None:
    """Powers-of-two x ticks at the measured values, a log y axis: how every sweep is read."""
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ticks = sorted(x_values.unique())
    ax.set_xticks(ticks, [str(t) for t in ticks])
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)


def _save(fig: plt.Figure, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path

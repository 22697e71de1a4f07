"""Reports of a benchmark run: the Markdown table, the README block and the plot.

Reads the results types of :mod:`benchmarks.results`; never imports the harness.

The README's results block is written only by :func:`write_readme` (``python -m benchmarks
--write-readme``), and ``tests/test_benchmarks.py`` checks that it still has the format that
:func:`report` produces, so the README cannot drift from what the benchmark prints.
"""

from __future__ import annotations

import importlib.util
import textwrap
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from benchmarks.results import Result, fmt_load, fmt_ratio, ratio

README_BEGIN = "<!-- benchmark-results:begin (written by python -m benchmarks --write-readme) -->"
README_END = "<!-- benchmark-results:end -->"
TABLE_HEADER = (
    "| scenario | case | TorchRL | cpprb | floor | fastreplay | speedup | vs cpprb "
    "| fastreplay/floor | correct | machine |",
    "|---|---|---|---|---|---|---|---|---|---|---|",
)
REFERENCE_NOTE = (
    "cpprb: cpprb's time on the same workload, where it was timed; vs cpprb = cpprb time / "
    "fastreplay time (above 1: fastreplay is faster). floor: the simplest code that moves the "
    "same rows and touches the same tree cells (NumPy arrays, no TensorDict, no TorchRL; see "
    "docs/benchmarks.md); fastreplay/floor = fastreplay time / floor time (1: as fast as that "
    "code; below 1: faster, where fastreplay's kernels overlap their cache misses and the "
    "floor's do not)."
)
PARITY = 0.1  # speedups within 1 +/- PARITY count as the same speed in the plot
# the plot's markers for the other references, at TorchRL time / their time
MARKERS: dict[str, dict[str, Any]] = {
    "cpprb": {"marker": "D", "s": 28, "c": "#264653"},
    "floor": {"marker": "^", "s": 36, "c": "#7b2cbf"},
}
MARK_LABELS = {
    "cpprb": "cpprb (TorchRL time / cpprb time)",
    "floor": "floor (TorchRL time / floor time)",
}


def _legend_style(style: Mapping[str, Any]) -> dict[str, Any]:
    return {"marker": style["marker"], "color": style["c"], "markersize": 6}


def machine_line(env: Mapping[str, Any]) -> str:
    """``2 CPUs (model), torch 2.15.0, torchrl 0.14.1, tensordict 0.14.3, 1 torch thread``."""
    threads = env["torch_threads"]
    return (
        f"{env['usable_cpus']} CPUs ({env['cpu_model']}), "
        f"{'CUDA ' + env['cuda'] + ', ' if env.get('cuda') else ''}"
        f"Python {env['python']}, torch {env['torch']}, torchrl {env['torchrl']}, "
        f"tensordict {env['tensordict']}, {threads} torch thread{'s' if threads != 1 else ''}"
    )


# --------------------------------------------------------------------------- reports


def fmt_s(seconds: float | None) -> str:
    """``135 us``, ``19.6 us``, ``2.01 ms``, ``1.20 s`` (three digits); ``n/a`` for ``None``."""
    if seconds is None:
        return "n/a"
    if seconds < 1e-3:
        micro = seconds * 1e6
        return f"{micro:.{2 if micro < 10 else 1 if micro < 100 else 0}f} us"
    if seconds < 1:
        return f"{seconds * 1e3:.2f} ms"
    return f"{seconds:.2f} s"


def parse_seconds(text: str) -> float | None:
    """Inverse of the table's time format (``"135 us"``, ``"2.01 ms"``, ``"1.20 s"``)."""
    if text == "n/a":
        return None
    value, unit = text.split()
    return float(value) * {"us": 1e-6, "ms": 1e-3, "s": 1.0}[unit]


def fmt_measure(seconds: float | None, rate_unit: str | None = None) -> str:
    """A table cell: :func:`fmt_s`, or the throughput ``1 / seconds`` in ``rate_unit``.

    ``fmt_measure(0.0061, "steps/s")`` is ``"163.9 steps/s"``; ``n/a`` where nothing was
    measured.
    """
    if rate_unit is None:
        return fmt_s(seconds)
    if seconds is None or not seconds > 0:
        return "n/a"
    return f"{1 / seconds:,.1f} {rate_unit}"


def parse_measure(text: str) -> float | None:
    """Inverse of :func:`fmt_measure`: seconds per call (per step for a throughput)."""
    if text == "n/a":
        return None
    value, unit = text.split(maxsplit=1)
    if unit.endswith("/s"):
        return 1 / float(value.replace(",", ""))
    return parse_seconds(text)


def speedup_note(results: Iterable[Result]) -> str | None:
    """What the speedup column divides, where some rows are throughputs; else ``None``."""
    rates = {r.rate_unit: r.speedup_definition for r in results if r.rate_unit}
    if not rates:
        return None
    scenarios = sorted({r.scenario for r in results if r.rate_unit})
    note = (
        f"Rows in {', '.join(rates)} ({', '.join(scenarios)}) are throughputs: their speedup is "
        f"{'; '.join(rates.values())}."
    )
    if any(not r.rate_unit for r in results):
        note += " The other rows are median times per call: TorchRL time / fastreplay time."
    return note + " Above 1: fastreplay is faster."


def markdown_table(results: list[Result], busy: Mapping[str, bool] | None = None) -> str:
    """Results as a Markdown table; ``busy[scenario]`` marks rows timed on a busy machine."""
    busy = busy or {}
    lines = list(TABLE_HEADER)
    for r in results:
        machine = "**busy**" if busy.get(r.scenario) else "quiet"
        lines.append(
            f"| {r.scenario} | {r.case} | {fmt_measure(r.torchrl_s, r.rate_unit)} "
            f"| {fmt_s(r.cpprb_s)} | {fmt_s(r.floor_s)} "
            f"| {fmt_measure(r.fastreplay_s, r.rate_unit)} "
            f"| {fmt_ratio(r.speedup)} | {fmt_ratio(r.vs_cpprb)} | {fmt_ratio(r.over_floor)} "
            f"| {'yes' if r.correct else 'NO'} | {machine} |"
        )
    return "\n".join(lines)


def busy_warning(loads: Mapping[str, Mapping[str, Any]]) -> str | None:
    """A warning naming the scenarios that ran on a busy machine, or ``None``."""
    busy = {name: load for name, load in loads.items() if load["busy"]}
    if not busy:
        return None
    details = "; ".join(f"{name}: {fmt_load(load)}" for name, load in busy.items())
    return (
        f"WARNING: the machine was busy with other processes ({details}). Rows marked busy may "
        "be off in either direction; rerun on a quiet machine before trusting them."
    )


def report(payload: Mapping[str, Any]) -> str:
    """``results.md``: the machine line, any busy warning, then the table."""
    env = payload["environment"]
    results = [Result(**_result_fields(r)) for r in payload["results"]]
    measured = {r.scenario for r in results}  # a scenario with no rows needs no warning
    loads = {name: load for name, load in payload["scenarios"].items() if name in measured}
    lines = [
        f"`{payload['command']}` on {machine_line(env)}; fastreplay and TorchRL repetitions "
        f"interleaved; {payload['elapsed_s']:.0f} s.",
        "",
    ]
    warning = busy_warning(loads)
    if warning:
        lines += [f"> **{warning}**", ""]
    lines.append(markdown_table(results, {n: load["busy"] for n, load in loads.items()}))
    note = speedup_note(results)
    if note:
        lines += ["", note]
    if any(r.cpprb_s is not None or r.floor_s is not None for r in results):
        lines += ["", REFERENCE_NOTE]
    skipped = payload.get("not_measured") or {}
    if skipped:
        lines += [""] + [f"- {name}: not measured: {why}" for name, why in skipped.items()]
    return "\n".join(lines) + "\n"


def _result_fields(row: Mapping[str, Any]) -> dict[str, Any]:
    names = Result.__dataclass_fields__
    return {k: v for k, v in row.items() if k in names}


def write_readme(path: Path, block: str) -> None:
    """Replace the text between the README's result markers with ``block``."""
    text = path.read_text(encoding="utf-8")
    begin, end = text.find(README_BEGIN), text.find(README_END)
    if begin < 0 or end < begin:
        raise ValueError(f"{path}: markers {README_BEGIN!r} ... {README_END!r} not found")
    new = text[: begin + len(README_BEGIN)] + "\n" + block.strip() + "\n" + text[end:]
    path.write_text(new, encoding="utf-8")


def readme_block(path: Path) -> str:
    """The text between the README's result markers."""
    text = path.read_text(encoding="utf-8")
    return text.split(README_BEGIN, 1)[1].split(README_END, 1)[0].strip()


# --------------------------------------------------------------------------- plot


def plot_skip_reason(results: list[Result], env: Mapping[str, Any] | None = None) -> str | None:
    """Why :func:`plot` would draw nothing, or ``None`` where it draws.

    The plot shows speedups, so it needs a case timed on both sides, and matplotlib.
    """
    if not results:
        return "nothing was measured"
    if all(r.speedup is None for r in results):
        why = "no case has a TorchRL time to compare with"
        if env is not None and not env.get("torchrl_compiled_extension", True):
            why += "; TorchRL's compiled extension did not load, so its side was not timed"
        return why
    if importlib.util.find_spec("matplotlib") is None:
        return "matplotlib is not installed (pip install matplotlib)"
    return None


def plot(
    results: list[Result],
    path: Path,
    *,
    env: Mapping[str, Any] | None = None,
    loads: Mapping[str, Mapping[str, Any]] | None = None,
    descriptions: Mapping[str, str] | None = None,
) -> bool:
    """Speedup bars from 1x on a log scale, one panel per scenario.

    Where a case timed cpprb or a floor, a marker on its row shows TorchRL time / their time
    on the same axis (the gap to the bar is fastreplay's ratio to them), and the bar's label
    gives ``vs cpprb`` and fastreplay's multiple of the floor.

    Returns:
        False, writing nothing, where :func:`plot_skip_reason` gives a reason.
    """
    if plot_skip_reason(results) is not None:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch
    from matplotlib.ticker import FuncFormatter, NullFormatter

    loads, descriptions = loads or {}, descriptions or {}
    rows = [r for r in results if r.speedup is not None]
    scenarios = list(dict.fromkeys(r.scenario for r in rows))
    per = {s: [r for r in rows if r.scenario == s] for s in scenarios}
    index = {s: [k for k, r in enumerate(rows) if r.scenario == s] for s in scenarios}
    marked: set[str] = set()
    colors = {"faster": "#2a9d8f", "parity": "#9e9e9e", "slower": "#e76f51"}

    def kind(v: float) -> str:
        if v > 1 + PARITY:
            return "faster"
        return "slower" if v < 1 - PARITY else "parity"

    # cpprb and the floor on the same axis: TorchRL time / their time, a marker on the row
    marks = {
        "cpprb": [ratio(r.torchrl_s, r.cpprb_s) for r in rows],
        "floor": [ratio(r.torchrl_s, r.floor_s) for r in rows],
    }
    values = [r.speedup for r in rows] + [v for vs in marks.values() for v in vs if v]
    lo = min(min(values), 1.0) / 3.0
    hi = max(max(values), 1.0) * 6.0
    heights = [len(per[s]) * 0.36 + 0.9 for s in scenarios]
    fig, axes = plt.subplots(
        len(scenarios),
        1,
        figsize=(11, sum(heights) + 1.6),
        sharex=True,
        squeeze=False,
        height_ratios=heights,
        layout="constrained",
    )
    any_busy = False
    for ax, scenario in zip(axes[:, 0], scenarios, strict=True):
        items = per[scenario]
        busy = bool(loads.get(scenario, {}).get("busy"))
        any_busy |= busy
        y = list(range(len(items)))
        vals = [r.speedup for r in items]
        ax.barh(
            y,
            [v - 1.0 for v in vals],
            left=1.0,
            height=0.62,
            color=[colors[kind(v)] for v in vals],
            hatch="///" if busy else None,
            edgecolor="white" if busy else None,
            linewidth=0,
        )
        # a tick at each value: a bar from 1x to about 1x has no visible length
        ax.scatter(vals, y, marker="|", s=160, linewidths=2, c=[colors[kind(v)] for v in vals])
        for name, style in MARKERS.items():
            at = [(m, i) for i, m in enumerate(marks[name][k] for k in index[scenario]) if m]
            if at:
                ax.scatter(*zip(*at, strict=True), zorder=3, **style)
                marked.add(name)
        ax.axvline(1.0, color="black", linewidth=0.9)
        ax.set_yticks(y, [r.case for r in items], fontsize=8)
        ax.set_ylim(len(items) - 0.5, -0.5)
        ax.set_xscale("log")
        ax.set_xlim(lo, hi)
        ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: f"{x:g}x"))
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.grid(axis="x", which="major", color="#dddddd", linewidth=0.6)
        ax.set_axisbelow(True)
        for i, v in enumerate(vals):
            right = v >= 1.0
            label = f"{v:.2f}x" if v < 10 else fmt_ratio(v)  # 0.88x is not 0.9x near parity
            if items[i].vs_cpprb is not None:
                label += f"; vs cpprb {items[i].vs_cpprb:.2f}x"
            if items[i].over_floor is not None:
                label += f"; {items[i].over_floor:.2f}x the floor"
            ax.text(
                v * (1.08 if right else 1 / 1.08),
                i,
                label,
                va="center",
                ha="left" if right else "right",
                fontsize=8,
                clip_on=True,
                zorder=4,  # over the cpprb and floor markers, which it may cross
                bbox={"facecolor": "white", "edgecolor": "none", "alpha": 0.7, "pad": 0.5},
            )
        title = textwrap.shorten(f"{scenario}: {descriptions.get(scenario, '')}", 110)
        rates = {r.speedup_definition for r in items if r.rate_unit}
        if rates:
            title += f"\nspeedup = {'; '.join(sorted(rates))}"
        if busy:
            title += f"\nBUSY machine ({fmt_load(loads[scenario])}): timings unreliable"
        ax.set_title(title, fontsize=9, loc="left", color="#b00020" if busy else "black")
    axes[-1, 0].set_xlabel(
        "speedup = TorchRL time / fastreplay time, or for a throughput fastreplay's / TorchRL's "
        "(log scale; right of 1x: fastreplay faster)",
        fontsize=9,
    )
    handles = [
        Patch(color=colors["faster"], label=f"fastreplay faster (> {1 + PARITY:g}x)"),
        Patch(color=colors["parity"], label=f"same speed ({1 - PARITY:g}x to {1 + PARITY:g}x)"),
        Patch(color=colors["slower"], label=f"fastreplay slower (< {1 - PARITY:g}x)"),
    ]
    handles += [
        Line2D([], [], linestyle="none", label=MARK_LABELS[name], **_legend_style(MARKERS[name]))
        for name in MARKERS
        if name in marked
    ]
    if any_busy:
        handles.append(
            Patch(facecolor="#cccccc", hatch="///", edgecolor="white", label="busy machine")
        )
    title = "fastreplay vs TorchRL: speedup per case"
    if env is not None:
        quiet = all(not loads.get(s, {}).get("busy") for s in scenarios)
        title += (
            f"\n{machine_line(env)}\nboth libraries timed in one process, repetitions "
            "interleaved (ppo: chunked vs one-shot, memory in separate processes); machine "
            + ("quiet" if quiet else "BUSY in the hatched panels")
        )
    fig.suptitle(title, fontsize=9)
    fig.legend(
        handles=handles,
        loc="outside lower center",
        ncol=min(len(handles), 4),
        fontsize=8,
        frameon=False,
    )
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True

"""Side-by-side benchmark harness shared by every fastreplay scenario.

Each scenario times fastreplay and TorchRL in the same process on the same workload, checks
that both gave correct answers, and reports medians and the TorchRL/fastreplay ratio
("speedup": above 1 means fastreplay is faster). Absolute times on shared machines are noise;
the ratios are what we report.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import json
import math
import os
import pkgutil
import platform
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

_SUFFIX = {"k": 10**3, "K": 10**3, "M": 10**6, "G": 10**9}


def parse_count(text: str) -> int:
    """Parse ``"6M"``, ``"346M"``, ``"1_000"`` or ``"10k"`` into an int."""
    text = text.strip().replace("_", "")
    if text and text[-1] in _SUFFIX:
        return int(float(text[:-1]) * _SUFFIX[text[-1]])
    return int(text)


def parse_counts(text: str) -> list[int]:
    """Parse a comma-separated list of counts (``"6M,600M"``)."""
    return [parse_count(t) for t in text.split(",") if t.strip()]


def fmt_count(n: int) -> str:
    """Format ``346_000_000`` as ``"346M"``."""
    for suffix, scale in (("G", 10**9), ("M", 10**6), ("k", 10**3)):
        if n >= scale and n % (scale // 1000 or 1) == 0:
            value = n / scale
            return f"{value:g}{suffix}"
    return str(n)


@dataclass
class Result:
    """One measured case: a fastreplay median and, when comparable, TorchRL's."""

    scenario: str
    case: str
    fastreplay_s: float
    torchrl_s: float | None
    correct: bool
    params: dict[str, Any] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def speedup(self) -> float | None:
        """TorchRL time / fastreplay time (above 1: fastreplay is faster)."""
        if self.torchrl_s is None or self.fastreplay_s <= 0:
            return None
        return self.torchrl_s / self.fastreplay_s


def median_seconds(
    fn: Callable[[], object],
    *,
    repeats: int = 7,
    warmup: int = 1,
    setup: Callable[[], object] | None = None,
) -> float:
    """Median wall time of ``fn()`` over ``repeats`` calls; ``setup()`` runs untimed first.

    As :mod:`timeit` does, garbage is collected once up front and the collector is disabled
    while timing, so a collection triggered by one library's garbage is not billed to the other.
    """
    for _ in range(warmup):
        if setup is not None:
            setup()
        fn()
    gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    times = []
    try:
        for _ in range(repeats):
            if setup is not None:
                setup()
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    finally:
        if enabled:
            gc.enable()
    return statistics.median(times)


@contextmanager
def progress(total: int, desc: str) -> Iterator[Callable[[int], None]]:
    """A progress bar on stderr for long fills; yields ``advance(n)``."""
    try:
        from tqdm import tqdm
    except ImportError:  # bench extra not installed: print a line per 10%
        done = [0, 0]

        def advance(n: int) -> None:
            done[0] += n
            tenth = 10 * done[0] // max(total, 1)
            if tenth > done[1]:
                done[1] = tenth
                print(f"{desc}: {10 * tenth}%", file=sys.stderr, flush=True)

        yield advance
        return
    bar = tqdm(total=total, desc=desc, unit="it", unit_scale=True, file=sys.stderr, leave=False)
    try:
        yield bar.update
    finally:
        bar.close()


def peak_rss_bytes() -> int:
    """Peak resident set size of this process so far (Linux ``ru_maxrss`` is in KiB)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def discover() -> dict[str, ModuleType]:
    """Import every scenario module of :mod:`benchmarks.scenarios`."""
    from benchmarks import scenarios

    found = {}
    for info in sorted(pkgutil.iter_modules(scenarios.__path__), key=lambda i: i.name):
        if info.name.startswith("_"):
            continue
        module = importlib.import_module(f"benchmarks.scenarios.{info.name}")
        found[module.NAME] = module
    return found


def environment() -> dict[str, Any]:
    """Versions and machine facts stored beside the results."""
    import tensordict
    import torch
    import torchrl

    try:
        import torchrl._torchrl as ext

        ext_ok = hasattr(ext, "SumSegmentTreeFp32")
    except Exception:
        ext_ok = False
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torchrl": torchrl.__version__,
        "tensordict": tensordict.__version__,
        "torchrl_compiled_extension": ext_ok,
        "cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "machine": platform.machine(),
    }


def _fmt_s(seconds: float | None) -> str:
    if seconds is None:
        return "n/a"
    if seconds < 1e-3:
        return f"{seconds * 1e6:.0f} us"
    if seconds < 1:
        return f"{seconds * 1e3:.2f} ms"
    return f"{seconds:.2f} s"


def markdown_table(results: list[Result]) -> str:
    """Results as a Markdown table (the one pasted into README and docs)."""
    lines = [
        "| scenario | case | TorchRL | fastreplay | speedup | correct |",
        "|---|---|---|---|---|---|",
    ]
    for r in results:
        speedup = "n/a" if r.speedup is None else f"{r.speedup:,.1f}x"
        lines.append(
            f"| {r.scenario} | {r.case} | {_fmt_s(r.torchrl_s)} | {_fmt_s(r.fastreplay_s)} "
            f"| {speedup} | {'yes' if r.correct else 'NO'} |"
        )
    return "\n".join(lines)


def plot(results: list[Result], path: Path) -> bool:
    """Bar chart of speedups (log scale); returns False if matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    rows = [r for r in results if r.speedup is not None]
    fig, ax = plt.subplots(figsize=(10, 0.45 * max(len(rows), 1) + 1.5))
    labels = [f"{r.scenario}: {r.case}" for r in rows]
    values = [r.speedup for r in rows]
    colors = ["tab:green" if v >= 1 else "tab:red" for v in values]
    ax.barh(range(len(rows)), values, color=colors)
    ax.set_yticks(range(len(rows)), labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xscale("log")
    ax.axvline(1.0, color="black", linewidth=0.8)
    ax.set_xlabel("speedup over TorchRL (TorchRL time / fastreplay time, log scale)")
    ax.set_title("fastreplay vs TorchRL, same process, same workload")
    for i, v in enumerate(values):
        ax.text(v, i, f" {v:,.1f}x", va="center", fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def main(argv: list[str] | None = None) -> int:
    """Run the selected scenarios, print the table, write JSON and PNG into ``--out``."""
    scenarios = discover()
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks",
        description="fastreplay vs TorchRL, side by side in one process. Speedup = "
        "TorchRL time / fastreplay time.",
    )
    parser.add_argument(
        "--only",
        default=",".join(scenarios),
        help=f"comma-separated scenarios to run (default: all of {', '.join(scenarios)})",
    )
    parser.add_argument("--out", type=Path, default=Path("bench-results"), help="output folder")
    parser.add_argument("--repeats", type=int, default=7, help="timed calls per median")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch intra-op threads for both libraries (default: torch's default); "
        "1 gives steadier ratios on a loaded machine",
    )
    for name, module in scenarios.items():
        group = parser.add_argument_group(f"{name}: {module.DESCRIPTION}")
        module.add_arguments(group)
    args = parser.parse_args(argv)

    selected = [s.strip() for s in args.only.split(",") if s.strip()]
    unknown = sorted(set(selected) - set(scenarios))
    if unknown:
        parser.error(f"--only: unknown scenario(s) {unknown}; choose from {sorted(scenarios)}")

    import torch

    torch.manual_seed(args.seed)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    env = environment()
    print(
        f"torch {env['torch']}, torchrl {env['torchrl']}, tensordict {env['tensordict']}, "
        f"TorchRL compiled extension: {'yes' if env['torchrl_compiled_extension'] else 'no'}",
        flush=True,
    )
    results: list[Result] = []
    t0 = time.perf_counter()
    for name in selected:
        print(f"\n== {name}: {scenarios[name].DESCRIPTION}", flush=True)
        new = scenarios[name].run(args)
        for r in new:
            speed = "n/a" if r.speedup is None else f"{r.speedup:,.1f}x"
            print(
                f"  {r.case:<48} TorchRL {_fmt_s(r.torchrl_s):>10}  "
                f"fastreplay {_fmt_s(r.fastreplay_s):>10}  speedup {speed:>9}  "
                f"{'ok' if r.correct else 'WRONG'}",
                flush=True,
            )
        results.extend(new)
    elapsed = time.perf_counter() - t0

    args.out.mkdir(parents=True, exist_ok=True)
    table = markdown_table(results)
    print("\n" + table)
    payload = {
        "command": " ".join(
            ["python -m benchmarks", *(argv if argv is not None else sys.argv[1:])]
        ),
        "environment": env,
        "elapsed_s": elapsed,
        "results": [asdict(r) | {"speedup": r.speedup} for r in results],
    }
    (args.out / "results.json").write_text(json.dumps(payload, indent=2, default=str))
    (args.out / "results.md").write_text(table + "\n")
    plotted = plot(results, args.out / "results.png")
    print(
        f"\nwrote {args.out / 'results.json'}, {args.out / 'results.md'}"
        + (f", {args.out / 'results.png'}" if plotted else " (no plot: matplotlib missing)")
        + f" in {elapsed:.0f} s"
    )
    wrong = [r for r in results if not r.correct]
    if wrong:
        print(f"{len(wrong)} case(s) gave WRONG answers", file=sys.stderr)
        return 1
    if not results:
        print("no results", file=sys.stderr)
        return 1
    return 0 if all(not math.isnan(r.fastreplay_s) for r in results) else 1

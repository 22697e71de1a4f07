"""Side-by-side benchmark harness shared by every fastreplay scenario.

Each scenario times fastreplay and TorchRL on the same workload, checks that both gave correct
answers, and reports medians and the TorchRL/fastreplay ratio ("speedup": above 1 means
fastreplay is faster). Absolute times on shared machines are noise; the ratios are what we
report. To keep the ratios honest on a machine that other processes share:

* timings run with one torch intra-op thread unless ``--threads`` says otherwise;
* :func:`interleaved_seconds` alternates the two sides' repetitions, so both see the same load;
* the load average, the CPU count and the CPU time other processes took are recorded before and
  after every scenario, and the table flags the scenarios that ran on a busy machine.

``python -m benchmarks --help`` never imports torch: scenario options, and the checks of values
that must fit together, come from the registry :mod:`benchmarks.scenarios` and the torch-free
:mod:`benchmarks.arguments`; a scenario's module is imported only to run. Every value is checked
before anything runs (:func:`parse_arguments`): a bad one is a usage error (exit code 2) naming
the option.

A scenario that cannot measure anything here raises :class:`NotMeasured` with the reason; it is
reported as "not measured", never as timed on a busy machine. With the output redirected (not a
terminal), TorchRL's INFO log lines and progress bars are left out; see :func:`progress`.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import importlib.util
import json
import logging
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path
from types import ModuleType
from typing import Any

from benchmarks import report
from benchmarks.arguments import CountError as CountError
from benchmarks.arguments import check_sizes as check_sizes
from benchmarks.arguments import choice_list as choice_list
from benchmarks.arguments import count_text as count_text
from benchmarks.arguments import counts_text as counts_text
from benchmarks.arguments import fmt_count as fmt_count
from benchmarks.arguments import non_negative_int as non_negative_int
from benchmarks.arguments import parse_count as parse_count
from benchmarks.arguments import parse_counts as parse_counts
from benchmarks.arguments import positive_int as positive_int
from benchmarks.arguments import positive_seconds as positive_seconds
from benchmarks.arguments import seed_int as seed_int
from benchmarks.arguments import sizes_and_capacity as sizes_and_capacity
from benchmarks.results import NotMeasured as NotMeasured
from benchmarks.results import Result as Result
from benchmarks.results import fmt_load as fmt_load
from benchmarks.results import fmt_ratio as fmt_ratio
from benchmarks.results import ratio as ratio
from benchmarks.scenarios import SCENARIOS
from benchmarks.scenarios import Scenario as Scenario

ROOT = Path(__file__).resolve().parents[1]


def _timed_calls(
    fn: Callable[[], object], setup: Callable[[], object] | None, n: int, out: list[float]
) -> None:
    for _ in range(n):
        if setup is not None:
            setup()
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)


@contextmanager
def _gc_off() -> Iterator[None]:
    gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


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
    To compare two libraries, prefer :func:`interleaved_seconds`.
    """
    for _ in range(warmup):
        if setup is not None:
            setup()
        fn()
    times: list[float] = []
    with _gc_off():
        _timed_calls(fn, setup, repeats, times)
    return statistics.median(times)


def interleaved_order(repeats: Mapping[str, int]) -> list[str]:
    """The order of calls for :func:`interleaved_seconds`: each name's calls spread evenly.

    With equal counts the names alternate, and every other round runs them in reverse
    (``a b b a a b ...``), so neither side always runs right after the other. With unequal
    counts the rarer side's calls are spread evenly among the others'.
    """
    slots = []
    for k, (name, n) in enumerate(repeats.items()):
        for i in range(n):
            # position in [0, 1); ties broken by round parity, then name order
            position = (i + 0.5) / n
            flip = i % 2
            slots.append((position, k if not flip else -k, name))
    slots.sort()
    return [name for _, _, name in slots]


def interleaved_seconds(
    fns: Mapping[str, Callable[[], object]],
    *,
    repeats: int | Mapping[str, int] = 7,
    warmup: int = 1,
    setup: Mapping[str, Callable[[], object]] | None = None,
) -> dict[str, float]:
    """Median wall time of each of ``fns``, their timed calls interleaved.

    Both libraries then share whatever the machine was doing while they ran: a burst of load
    from another process slows both sides' calls, not one side's whole median.

    Args:
        fns: name -> zero-argument callable (e.g. ``{"fastreplay": ..., "torchrl": ...}``).
        repeats: timed calls per name (an int for all, or per name).
        warmup: untimed calls per name first (also interleaved).
        setup: optional name -> callable run untimed before each call of that name.

    Returns:
        name -> median seconds, in the order of ``fns``.
    """
    setup = setup or {}
    counts = {name: repeats if isinstance(repeats, int) else repeats[name] for name in fns}
    for _ in range(warmup):
        for name, fn in fns.items():
            if name in setup:
                setup[name]()
            fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    with _gc_off():
        for name in interleaved_order(counts):
            _timed_calls(fns[name], setup.get(name), 1, times[name])
    return {name: statistics.median(t) for name, t in times.items()}


PLAIN_PROGRESS_EVERY_S = 10.0  # seconds between plain progress lines (output not a terminal)


def interactive() -> bool:
    """Whether both stdout and stderr are terminals (not redirected to a file or a pipe)."""
    return sys.stdout.isatty() and sys.stderr.isatty()


@contextmanager
def progress(total: int, desc: str) -> Iterator[Callable[[int], None]]:
    """Progress of a long fill on stderr; yields ``advance(n)``.

    On a terminal, a tqdm bar (erased when done). Redirected to a file, or without tqdm, plain
    lines instead of a bar's carriage returns: one every :data:`PLAIN_PROGRESS_EVERY_S`
    seconds, so short fills print nothing.
    """
    tqdm = None
    if sys.stderr.isatty():
        try:
            from tqdm import tqdm
        except ImportError:  # bench extra not installed: plain lines
            tqdm = None
    if tqdm is None:
        start = time.perf_counter()
        state = {"done": 0, "printed": start}

        def advance(n: int) -> None:
            state["done"] += n
            now = time.perf_counter()
            if now - state["printed"] >= PLAIN_PROGRESS_EVERY_S:
                state["printed"] = now
                percent = 100 * state["done"] // max(total, 1)
                print(f"{desc}: {percent}% after {now - start:.0f} s", file=sys.stderr, flush=True)

        yield advance
        return
    bar = tqdm(total=total, desc=desc, unit="it", unit_scale=True, file=sys.stderr, leave=False)
    try:
        yield bar.update
    finally:
        bar.close()


@contextmanager
def quiet_torchrl_log() -> Iterator[None]:
    """Hide TorchRL's INFO log lines while the output goes to a file or a pipe.

    TorchRL logs an INFO line, with terminal colour codes, for every storage it initialises.
    On a terminal, or when ``RL_LOGGING_LEVEL`` chooses the level, nothing changes; otherwise
    the ``torchrl`` logger shows warnings and errors only until the block ends.
    """
    if interactive() or "RL_LOGGING_LEVEL" in os.environ:
        yield
        return
    logger = logging.getLogger("torchrl")
    level = logger.level
    logger.setLevel(max(logging.WARNING, logger.getEffectiveLevel()))
    try:
        yield
    finally:
        logger.setLevel(level)


def peak_rss_bytes() -> int:
    """Peak resident set size of this process so far (Linux ``ru_maxrss`` is in KiB)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


# --------------------------------------------------------------------------- machine load


def _usable_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def load_snapshot() -> dict[str, Any]:
    """Load average, CPU count, and CPU time used so far by the machine and by this process.

    The machine's busy time comes from ``/proc/stat`` (Linux; ``None`` elsewhere), ours from
    ``getrusage`` (this process and its finished children, e.g. the ``ppo`` scenario's).
    """
    import resource

    snap: dict[str, Any] = {"time": time.time(), "wall": time.perf_counter()}
    try:
        snap["loadavg"] = list(os.getloadavg())
    except OSError:
        snap["loadavg"] = None
    snap["cpus"] = os.cpu_count()
    snap["usable_cpus"] = _usable_cpus()
    own = 0.0
    for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN):
        usage = resource.getrusage(who)
        own += usage.ru_utime + usage.ru_stime
    snap["own_cpu_s"] = own
    try:
        fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
        ticks = [int(x) for x in fields]
        # user nice system idle iowait irq softirq steal (guest time is inside user)
        busy = ticks[0] + ticks[1] + ticks[2] + sum(ticks[5:8])
        snap["machine_busy_cpu_s"] = busy / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        snap["machine_busy_cpu_s"] = None
    try:
        line = Path("/proc/pressure/cpu").read_text().splitlines()[0]
        snap["cpu_pressure_us"] = int(line.rsplit("total=", 1)[1])
    except (OSError, ValueError, IndexError):
        snap["cpu_pressure_us"] = None
    return snap


def is_busy(other_cores: float | None, cpus: int) -> bool:
    """Whether other processes took enough CPU to distort timings.

    Busy means more than a quarter of the machine's cores (at least half a core) went to
    other processes on average. Where that is unknown (no ``/proc/stat``, or a scenario shorter
    than a second), :func:`load_summary` calls the machine busy if its 1-minute load average
    exceeded its CPU count when the scenario started.
    """
    return other_cores is not None and other_cores > max(0.5, 0.25 * cpus)


def load_summary(before: Mapping[str, Any], after: Mapping[str, Any]) -> dict[str, Any]:
    """What the machine did while a scenario ran, from two :func:`load_snapshot` readings."""
    wall = max(after["wall"] - before["wall"], 1e-9)
    own = (after["own_cpu_s"] - before["own_cpu_s"]) / wall
    other = None
    known = before["machine_busy_cpu_s"] is not None and after["machine_busy_cpu_s"] is not None
    if known and wall >= 1.0:  # /proc/stat counts in clock ticks: too coarse below a second
        machine = (after["machine_busy_cpu_s"] - before["machine_busy_cpu_s"]) / wall
        other = max(machine - own, 0.0)
    pressure = None
    if before["cpu_pressure_us"] is not None and after["cpu_pressure_us"] is not None:
        pressure = (after["cpu_pressure_us"] - before["cpu_pressure_us"]) / 1e6 / wall
    cpus = after["usable_cpus"] or 1
    return {
        "seconds": wall,
        "loadavg_before": before["loadavg"],
        "loadavg_after": after["loadavg"],
        "cpus_before": before["cpus"],
        "cpus_after": after["cpus"],
        "usable_cpus": cpus,
        "own_cores": own,
        "other_processes_cores": other,
        "cpu_pressure": pressure,
        "busy": is_busy(other, cpus)
        if other is not None
        else bool(before["loadavg"] and before["loadavg"][0] > cpus),
    }


# --------------------------------------------------------------------------- scenarios


def scenario_specs() -> dict[str, Scenario]:
    """Every scenario of :data:`benchmarks.scenarios.SCENARIOS`, by name, in running order."""
    return {scenario.name: scenario for scenario in SCENARIOS}


def discover() -> dict[str, ModuleType]:
    """Import every scenario module of :mod:`benchmarks.scenarios` (imports torch)."""
    return {name: importlib.import_module(s.module) for name, s in scenario_specs().items()}


def environment() -> dict[str, Any]:
    """Versions and machine facts stored beside the results."""
    import tensordict
    import torch
    import torchrl

    try:
        ext = importlib.import_module("torchrl._torchrl")
        ext_ok = hasattr(ext, "SumSegmentTreeFp32")
    except Exception:
        ext_ok = False
    versions = {}
    for name in ("fastreplay", "numba", "numpy"):
        try:
            from importlib.metadata import version

            versions[name] = version(name)
        except Exception:
            versions[name] = None
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torchrl": torchrl.__version__,
        "tensordict": tensordict.__version__,
        **versions,
        "git_commit": _git_commit(),
        "torchrl_compiled_extension": ext_ok,
        "cpus": os.cpu_count(),
        "usable_cpus": _usable_cpus(),
        "cpu_model": _cpu_model(),
        "torch_threads": torch.get_num_threads(),
        "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "machine": platform.machine(),
        "system": platform.system(),
    }


def _git_commit() -> str | None:
    try:
        done = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    if done.returncode != 0:
        return None
    return done.stdout.strip() or None


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return " ".join(line.split(":", 1)[1].split())
    except OSError:
        pass
    return platform.processor() or platform.machine()


# --------------------------------------------------------------------------- command line


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Shows every option's default, unless its help already says it (``default: ...``)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.help and "default:" in action.help:
            return action.help
        return super()._get_help_string(action)


def build_parser(specs: Mapping[str, Scenario]) -> argparse.ArgumentParser:
    """The command line: harness options, then one group per scenario."""
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks",
        formatter_class=_HelpFormatter,
        description=(
            "Time fastreplay and TorchRL side by side on the same workloads, check both\n"
            "answers, and report the speedup: TorchRL time / fastreplay time (above 1:\n"
            "fastreplay is faster).\n\n"
            "Writes results.json (timings, versions, the machine and its load before and\n"
            "after each scenario), results.md and results.png into --out. Counts take k, M\n"
            "and G suffixes (6M = 6,000,000). Every value is checked before anything runs:\n"
            "a bad value, or values that do not fit together, is a usage error."
        ),
        epilog=(
            "Threads: with several torch threads on cores that other processes also use,\n"
            "every parallel op waits for its slowest thread, and a descheduled thread costs\n"
            "a whole scheduler time slice (milliseconds). Keep --threads 1 (the default) on\n"
            "a shared machine; the table flags scenarios that ran while it was busy."
        ),
    )
    names = ",".join(specs)
    parser.add_argument(
        "--only",
        type=choice_list(*specs),
        default=names,
        metavar="NAMES",
        help="comma-separated scenarios to run",
    )
    parser.add_argument(
        "--out", type=Path, default=Path("bench-results"), help="folder for the result files"
    )
    parser.add_argument(
        "--repeats",
        type=positive_int,
        default=7,
        help="timed calls per median (some scenarios time cheap calls more often)",
    )
    parser.add_argument(
        "--seed", type=seed_int, default=0, help="seed for torch and the samplers (0 to 2**64-1)"
    )
    parser.add_argument(
        "--threads",
        type=non_negative_int,
        default=1,
        help="torch intra-op threads (and numba threads) for both libraries; 0: torch's "
        "default, one per core",
    )
    parser.add_argument(
        "--write-readme",
        action="store_true",
        help="also write the results into the repository's README.md, between its result "
        "markers (not done if an answer was wrong)",
    )
    for name, spec in specs.items():
        group = parser.add_argument_group(f"{name}: {spec.description}")
        spec.add_arguments(group)
        for action in group._group_actions:
            if not action.help:  # still show the default
                action.help = " "
    return parser


def check_arguments(
    parser: argparse.ArgumentParser, args: argparse.Namespace, specs: Mapping[str, Scenario]
) -> None:
    """Check what each value's ``type=`` cannot: values that must fit together.

    Every scenario's ``check_arguments(args)`` runs (whether or not ``--only`` selects it: its
    defaults always pass, so only values given on the command line can fail), then the
    harness's own checks.

    Raises:
        SystemExit: through ``parser.error`` (exit code 2), listing every problem found.
    """
    problems = []
    if args.out.exists() and not args.out.is_dir():
        problems.append(
            f"--out {args.out}: is a file; pass a folder (created if missing) for the results"
        )
    for spec in specs.values():
        if spec.check_arguments is not None:
            problems += spec.check_arguments(args)
    if problems:
        parser.error("\n".join(problems))


def parse_arguments(
    argv: list[str] | None = None, specs: Mapping[str, Scenario] | None = None
) -> argparse.Namespace:
    """Parse and check the command line; a usage error exits with code 2 before anything runs."""
    specs = scenario_specs() if specs is None else specs
    parser = build_parser(specs)
    args = parser.parse_args(argv)
    check_arguments(parser, args, specs)
    return args


def _describe(scenario: Scenario) -> str:
    baseline = scenario.baseline
    return scenario.description + (f" (vs {baseline})" if baseline else "")


def _case_line(r: Result) -> str:
    line = (
        f"  {r.case:<52} TorchRL {report.fmt_measure(r.torchrl_s, r.rate_unit):>10}  "
        f"fastreplay {report.fmt_measure(r.fastreplay_s, r.rate_unit):>10}  "
        f"speedup {fmt_ratio(r.speedup):>9}  {'ok' if r.correct else 'WRONG'}"
    )
    if r.cpprb_s is not None:
        line += f"  cpprb {report.fmt_s(r.cpprb_s)} (vs cpprb {fmt_ratio(r.vs_cpprb)})"
    if r.floor_s is not None:
        line += f"  floor {report.fmt_s(r.floor_s)} (fastreplay/floor {fmt_ratio(r.over_floor)})"
    return line + (f"  (speedup = {r.speedup_definition})" if r.rate_unit else "")


def main(argv: list[str] | None = None) -> int:
    """Run the selected scenarios, print the table, write JSON, Markdown and PNG into ``--out``."""
    specs = scenario_specs()
    args = parse_arguments(argv, specs)
    selected = [s.strip() for s in args.only.split(",") if s.strip()]

    if args.threads and "NUMBA_NUM_THREADS" not in os.environ:
        os.environ["NUMBA_NUM_THREADS"] = str(args.threads)  # read when numba is imported
    import torch

    torch.manual_seed(args.seed)
    if args.threads:
        torch.set_num_threads(args.threads)
    modules = {name: importlib.import_module(specs[name].module) for name in selected}
    env = environment()
    print(
        f"{report.machine_line(env)}; TorchRL compiled extension: "
        f"{'yes' if env['torchrl_compiled_extension'] else 'no'}",
        flush=True,
    )
    results: list[Result] = []
    loads: dict[str, dict[str, Any]] = {}
    not_measured: dict[str, str] = {}
    t0 = time.perf_counter()
    with quiet_torchrl_log():
        for name in selected:
            module = modules[name]
            print(f"\n== {name}: {specs[name].description}", flush=True)
            before = load_snapshot()
            try:
                new = module.run(args)
            except NotMeasured as why:
                new, not_measured[name] = [], str(why)
            else:
                if not new:
                    not_measured[name] = "no case ran (see the messages above)"
            if name in not_measured:  # no timing to distrust: no load verdict either
                print(f"  not measured: {not_measured[name]}", flush=True)
                continue
            loads[name] = load = load_summary(before, load_snapshot())
            for r in new:
                print(_case_line(r), flush=True)
            state = "BUSY: timings unreliable" if load["busy"] else "quiet"
            print(f"  machine: {fmt_load(load)} ({state})", flush=True)
            results.extend(new)
    elapsed = time.perf_counter() - t0

    payload = {
        "command": " ".join(
            ["python -m benchmarks", *(argv if argv is not None else sys.argv[1:])]
        ),
        "environment": env,
        "threads": args.threads,
        "elapsed_s": elapsed,
        "scenarios": loads,
        "not_measured": not_measured,
        "results": [asdict(r) | r.ratios() for r in results],
    }
    args.out.mkdir(parents=True, exist_ok=True)
    text = report.report(payload)
    print("\n" + text)
    warning = report.busy_warning({r.scenario: loads[r.scenario] for r in results})
    if warning:
        print(warning, file=sys.stderr)
    (args.out / "results.json").write_text(json.dumps(payload, indent=2, default=str))
    (args.out / "results.md").write_text(text)
    no_plot = report.plot_skip_reason(results, env)
    if no_plot is None:
        report.plot(
            results,
            args.out / "results.png",
            env=env,
            loads=loads,
            descriptions={n: _describe(specs[n]) for n in modules},
        )
    print(
        f"wrote {args.out / 'results.json'}, {args.out / 'results.md'}"
        + (f", {args.out / 'results.png'}" if no_plot is None else f" (no plot: {no_plot})")
        + f" in {elapsed:.0f} s"
    )
    wrong = [r for r in results if not r.correct]
    if wrong:
        print(f"{len(wrong)} case(s) gave WRONG answers", file=sys.stderr)
        return 1
    if not results:
        print("no results", file=sys.stderr)
        return 1
    if args.write_readme:
        report.write_readme(ROOT / "README.md", text)
        print(f"wrote the table into {ROOT / 'README.md'}")
    return 0 if all(not math.isnan(r.fastreplay_s) for r in results) else 1

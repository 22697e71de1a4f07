"""The benchmark harness: command line, interleaved timing, machine load, reports, README block."""

from __future__ import annotations

import argparse
import ast
import importlib
import itertools
import json
import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from benchmarks import harness, report, scenarios
from benchmarks.harness import (
    CountError,
    NotMeasured,
    Result,
    build_parser,
    fmt_ratio,
    interleaved_order,
    interleaved_seconds,
    is_busy,
    load_snapshot,
    load_summary,
    main,
    parse_arguments,
    parse_count,
    parse_counts,
    ratio,
    scenario_specs,
)

import fastreplay
from conftest import REPO


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "src"), str(REPO)])
    return env


def _python(code: str) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a fresh interpreter at the repository root (bounded: 120 s)."""
    return subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )


# --------------------------------------------------------------------------- command line


def test_help_does_not_import_torch_and_shows_every_default() -> None:
    code = (
        "import runpy, sys\n"
        "sys.argv = ['benchmarks', '--help']\n"  # python -m benchmarks --help
        "try:\n"
        "    runpy.run_module('benchmarks', run_name='__main__', alter_sys=True)\n"
        "except SystemExit as exit:\n"
        "    assert exit.code == 0, exit.code\n"
        "heavy = sorted(m for m in ('torch', 'tensordict', 'torchrl', 'fastreplay', 'numpy')\n"
        "               if m in sys.modules)\n"
        "print('HEAVY', heavy)\n"
    )
    done = _python(code)
    assert done.returncode == 0, done.stderr
    assert "HEAVY []" in done.stdout, done.stdout[-500:]
    text = " ".join(done.stdout.split())  # help lines wrap anywhere
    for spec in scenario_specs().values():
        assert f"{spec.name}: {spec.description}" in text
    assert "(default: 6M)" in text and "(default: 1)" in text  # --capacity, --threads


def test_every_option_is_explained_and_shows_its_default() -> None:
    parser = build_parser(scenario_specs())
    formatter = parser._get_formatter()
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        name = action.option_strings[0]
        assert action.help and action.help.strip(), f"{name} has no help"
        assert "default" in formatter._get_help_string(action), f"{name} hides its default"


def test_registry_lists_every_scenario_module_once() -> None:
    """Every module of ``benchmarks/scenarios`` is registered, runs, and carries its name."""
    specs = scenario_specs()
    assert {"slice", "prioritized", "ppo", "pin"} <= set(specs)
    assert len({spec.module for spec in specs.values()}) == len(specs)
    folder = Path(scenarios.__file__).parent
    files = {f"benchmarks.scenarios.{p.stem}" for p in folder.glob("[!_]*.py")}
    assert files == {spec.module for spec in specs.values()}
    for name, spec in specs.items():
        module = importlib.import_module(spec.module)
        assert name == module.NAME and callable(module.run), name
        # the registry and benchmarks.arguments are the one source of a scenario's options
        for defined_twice in ("DESCRIPTION", "add_arguments", "check_arguments", "BASELINE"):
            assert not hasattr(module, defined_twice), (name, defined_twice)


@pytest.fixture
def _no_benchmark(monkeypatch):
    """Fail (instead of running for minutes) if the command line goes past its checks."""

    def ran(*_args, **_kwargs):
        raise AssertionError("a benchmark started: the arguments were not refused")

    monkeypatch.setattr(harness, "environment", ran)
    monkeypatch.setattr(harness, "load_snapshot", ran)


@pytest.mark.usefixtures("_no_benchmark")
@pytest.mark.parametrize(
    ("argv", "flag", "shown"),
    [
        (["--capacity", "6X"], "--capacity", "'6X' is not a count"),
        (["--stored", "-5"], "--stored", "'-5' is not a count"),
        (["--episode-len", "1000,fifty"], "--episode-len", "'fifty' is not a count"),
        (["--per-capacity", "1M,x"], "--per-capacity", "'x' is not a count"),
        (["--ppo-batch", "big"], "--ppo-batch", "'big' is not a count"),
        (["--repeats", "0"], "--repeats", "must be at least 1"),
        (["--threads", "-1"], "--threads", "'-1' is not a count"),
        (["--only", "slice,nope"], "--only", "'slice,nope': give a comma-separated list"),
        (["--end", "done,flag"], "--end", "give a comma-separated list of done, traj"),
        (["--pin-shape", "84x84xRGB"], "--pin-shape", "HxWxC"),
        # sizes <= 0
        (["--episode-len", "0"], "--episode-len", "'0': every count must be at least 1, got 0"),
        (["--episode-len", "1000,0"], "--episode-len", "must be at least 1, got 0"),
        (["--per-capacity", "0"], "--per-capacity", "'0': every count must be at least 1"),
        (["--per-dumps-capacity", "0"], "--per-dumps-capacity", "must be at least 1"),
        (["--capacity", "0"], "--capacity", "'0': must be at least 1"),
        (["--stored", "0"], "--stored", "'0': must be at least 1"),
        (["--num-slices", "0"], "--num-slices", "'0': must be at least 1"),
        (["--ppo-batch", "0"], "--ppo-batch", "'0': must be at least 1"),
        (["--ppo-chunk", "0"], "--ppo-chunk", "'0': must be at least 1"),
        (["--pin-batch", "0"], "--pin-batch", "'0': must be at least 1"),
        (["--pin-size", "0"], "--pin-size", "'0': must be at least 1"),
        (["--pslice-stored", "0"], "--pslice-stored", "must be at least 1"),
        (["--pslice-capacity", "0"], "--pslice-capacity", "'0': must be at least 1"),
        (["--swor-stored", "1M,0"], "--swor-stored", "must be at least 1, got 0"),
        (["--swor-capacity", "0"], "--swor-capacity", "'0': must be at least 1"),
        (["--hs-stored", "1M,0"], "--hs-stored", "must be at least 1, got 0"),
        (["--hs-batch", "0"], "--hs-batch", "'0': must be at least 1"),
        (["--scale-writers", "0"], "--scale-writers", "'0': every count must be at least 1"),
        (["--scale-capacity", "0"], "--scale-capacity", "'0': must be at least 1"),
        (["--scale-capacity", "1M,2M"], "--scale-capacity", "'1M,2M' is not a count"),
        (["--scale-slice-stored", "0"], "--scale-slice-stored", "must be at least 1"),
        (["--scale-episode", "0"], "--scale-episode", "'0': must be at least 1"),
        (["--scale-batch", "0"], "--scale-batch", "'0': must be at least 1"),
        (["--scale-write-rate", "-5"], "--scale-write-rate", "'-5' is not a count"),
        (["--scale-seconds", "-1"], "--scale-seconds", "'-1': give a number of seconds above 0"),
        (["--scale-seconds", "0"], "--scale-seconds", "'0': give a number of seconds above 0"),
        (["--scale-seconds", "nan"], "--scale-seconds", "'nan': give a number of seconds"),
        (["--scale-seconds", "inf"], "--scale-seconds", "'inf': give a number of seconds"),
        (["--scale-slices", "256"], "--scale-slices", "'256': write the slice batch as SLICESx"),
        (["--scale-slices", "0x32"], "--scale-slices", "both at least 1"),
        (["--seed", str(2**64)], "--seed", "a seed must be below 2**64"),
        # lists with unknown or repeated names
        (["--scale-kinds", "bogus"], "--scale-kinds", "'bogus': give a comma-separated list of"),
        (["--scale-kinds", "slice,slice"], "--scale-kinds", "slice listed twice"),
        (["--per-backends", "numba,cuda"], "--per-backends", "list of numba, torch"),
        (["--only", "slice,slice"], "--only", "slice listed twice"),
        (["--end", "done,done"], "--end", "done listed twice"),
        (["--episode-len", "50,50"], "--episode-len", "50 listed twice"),
    ],
)
def test_bad_values_are_argparse_errors(argv, flag, shown, capsys) -> None:
    with pytest.raises(SystemExit) as exit:
        main(argv)
    assert exit.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {flag}:" in err and shown in err, err
    assert "Traceback" not in err


@pytest.mark.usefixtures("_no_benchmark")
@pytest.mark.parametrize(
    ("argv", "shown"),
    [
        (["--stored", "10M", "--capacity", "6M"], "--stored 10M exceeds --capacity 6M"),
        (["--slice-len", "64", "--episode-len", "1000,50"], "--slice-len 64 is longer than"),
        (["--stored", "10", "--capacity", "100"], "--slice-len 32 is longer than --stored 10"),
        (["--slice-len", "4", "--rotate-lengths", "8"], "--rotate-lengths 8 around --slice-len 4"),
        (["--per-capacity", "1M,1"], "--per-capacity 1M,1: 'lower the max item'"),
        (
            ["--pslice-stored", "5M", "--pslice-capacity", "1M"],
            "--pslice-stored 5M exceeds --pslice-capacity 1M",
        ),
        (["--pslice-episode-len", "16"], "--pslice-slice-len 32 is longer than --pslice-episode"),
        (["--pslice-stored", "20"], "--pslice-slice-len 32 is longer than the smallest"),
        (["--swor-stored", "2M", "--swor-capacity", "1M"], "--swor-stored 2M exceeds"),
        (["--swor-episode-len", "10"], "--swor-episode-len 10 is shorter than --swor-slice-len"),
        (  # every size refused: the largest one's reason
            ["--swor-stored", "1k,100k"],
            "100k items stored (capacity 120k) hold 100 episodes of 1000 steps, fewer than "
            "--swor-num-slices 256",
        ),
        (["--scale-slices", "256x2000"], "--scale-slices 256x2000: slices of 2000 steps are"),
        (["--scale-slice-stored", "7M"], "--scale-slice-stored 7M exceeds --scale-slice-capac"),
        (["--scale-episode", "20000"], "--scale-episode 20000: at most 10000"),
        (["--out", __file__], f"--out {__file__}: is a file; pass a folder"),
    ],
)
def test_values_that_do_not_fit_together_are_usage_errors(argv, shown, capsys) -> None:
    with pytest.raises(SystemExit) as exit:
        main(argv)
    assert exit.value.code == 2
    err = capsys.readouterr().err
    assert f"error: {shown}" in err or f"\n{shown}" in err, err
    assert "Traceback" not in err


@pytest.mark.usefixtures("_no_benchmark")
def test_every_problem_is_listed_at_once(capsys) -> None:
    with pytest.raises(SystemExit):
        main(["--stored", "10M", "--capacity", "6M", "--scale-slices", "8x2000"])
    err = capsys.readouterr().err
    assert "--stored 10M exceeds" in err and "--scale-slices 8x2000" in err


@pytest.mark.parametrize("argv", [["--stored", "10M", "--capacity", "6M"], ["--per-capacity", "0"]])
def test_command_line_refuses_bad_values_before_importing_torch(argv) -> None:
    code = (
        "import sys\n"
        "from benchmarks import harness\n"
        "def ran(*args):\n"
        "    raise SystemExit('a benchmark started')\n"
        "harness.environment = ran\n"
        "try:\n"
        f"    harness.main({argv!r})\n"
        "except SystemExit as exit:\n"
        "    print('EXIT', exit.code)\n"
        "print('TORCH', 'torch' in sys.modules)\n"
    )
    done = _python(code)
    assert "EXIT 2" in done.stdout and "TORCH False" in done.stdout, done.stdout + done.stderr
    assert argv[0] in done.stderr and argv[1] in done.stderr, done.stderr
    assert "Traceback" not in done.stderr


def test_every_option_has_a_checking_type_and_the_defaults_pass() -> None:
    specs = scenario_specs()
    parser = build_parser(specs)
    for action in parser._actions:
        if action.nargs == 0:  # --help, flags
            continue
        assert action.type is not None, f"{action.option_strings[0]} takes any value"
    args = parser.parse_args([])
    checked = {name for name, spec in specs.items() if spec.check_arguments is not None}
    assert {"slice", "prioritized", "prioritized_slice", "slice_without_replacement"} <= checked
    assert {"scale-out"} <= checked
    for name in checked:
        assert specs[name].check_arguments(args) == [], name


def test_good_values_parse() -> None:
    args = parse_arguments(
        ["--capacity", "600M", "--per-capacity", "1M,10M", "--threads", "0", "--only", "slice"]
    )
    assert (args.capacity, args.per_capacity, args.threads) == ("600M", "1M,10M", 0)
    assert args.repeats == 7 and args.threads == 0


def test_parse_count() -> None:
    assert parse_count("6M") == 6_000_000
    assert parse_count("1_000") == 1000
    assert parse_count("1.5G") == 1_500_000_000
    assert parse_count(7) == 7
    assert parse_counts("1M, 10k") == [1_000_000, 10_000]
    for bad in ("6X", "", "1.5", "M", "1e6"):
        with pytest.raises(CountError, match="not a"):
            parse_count(bad)
    assert issubclass(CountError, ValueError)


# --------------------------------------------------------------------------- timing


def test_interleaved_order_alternates_and_spreads() -> None:
    assert interleaved_order({"a": 3, "b": 3}) == ["a", "b", "b", "a", "a", "b"]
    order = interleaved_order({"fast": 9, "slow": 3})
    assert order.count("fast") == 9 and order.count("slow") == 3
    slow_at = [i for i, name in enumerate(order) if name == "slow"]
    assert slow_at[0] > 0 and slow_at[-1] < len(order) - 1  # spread, not bunched at one end
    assert max(b - a for a, b in itertools.pairwise(slow_at)) <= 5  # 12 calls / 3, +1


def test_interleaved_seconds_runs_setup_before_each_call_and_returns_medians() -> None:
    log: list[str] = []
    fns = {"x": lambda: log.append("x"), "y": lambda: log.append("y")}
    setup = {"x": lambda: log.append("setup x")}
    times = interleaved_seconds(fns, repeats={"x": 2, "y": 4}, warmup=1, setup=setup)
    assert list(times) == ["x", "y"] and all(t >= 0 for t in times.values())
    assert log.count("x") == 3 and log.count("y") == 5 and log.count("setup x") == 3
    for i, entry in enumerate(log):
        if entry == "x":
            assert log[i - 1] == "setup x"
    timed = [e for e in log[3:] if not e.startswith("setup")]
    assert timed[0] != timed[1] or timed[1] != timed[2]  # interleaved, not 'x x y y y y'


# --------------------------------------------------------------------------- load


def _snap(wall: float, own: float, machine: float | None, load: float = 0.3) -> dict:
    return {
        "time": wall,
        "wall": wall,
        "loadavg": [load, load, load],
        "cpus": 2,
        "usable_cpus": 2,
        "own_cpu_s": own,
        "machine_busy_cpu_s": machine,
        "cpu_pressure_us": None,
    }


def test_load_summary_separates_our_cpu_from_other_processes() -> None:
    quiet = load_summary(_snap(0, 0, 100), _snap(10, 9.5, 110))
    assert quiet["own_cores"] == pytest.approx(0.95)
    assert quiet["other_processes_cores"] == pytest.approx(0.05)
    assert not quiet["busy"]
    busy = load_summary(_snap(0, 0, 100, 0.5), _snap(10, 5, 124, 5.9))
    assert busy["other_processes_cores"] == pytest.approx(1.9)
    assert busy["busy"] and busy["loadavg_after"][0] == 5.9
    unknown = load_summary(_snap(0, 0, None), _snap(10, 5, None))
    assert unknown["other_processes_cores"] is None and not unknown["busy"]
    short = load_summary(_snap(0, 0, 100, 5.5), _snap(0.2, 0.1, 100.1, 5.5))
    assert short["other_processes_cores"] is None and short["busy"]  # from the load average
    assert not is_busy(0.5, 2) and is_busy(0.6, 2) and not is_busy(3.0, 16) and is_busy(4.1, 16)


def test_load_snapshot_reads_this_machine() -> None:
    snap = load_snapshot()
    assert snap["cpus"] == os.cpu_count() and snap["usable_cpus"] >= 1
    assert snap["own_cpu_s"] > 0
    if sys.platform == "linux":
        assert snap["machine_busy_cpu_s"] > 0 and len(snap["loadavg"]) == 3


# --------------------------------------------------------------------------- reports


def test_ratio_with_zero_or_missing_denominator_is_undefined_not_huge() -> None:
    assert ratio(67_330_048.0, 0) is None
    assert ratio(None, 1.0) is None and ratio(1.0, None) is None
    assert fmt_ratio(ratio(67_330_048.0, 0), "n/a: nothing measured") == "n/a: nothing measured"
    assert fmt_ratio(ratio(3.0, 2.0)) == "1.5x"
    assert fmt_ratio(0.0152) == "0.015x" and fmt_ratio(0.099) == "0.099x"  # not 0.0x
    assert Result("s", "c", 0.0, 1.0, True).speedup is None


def _payload(busy_ppo: bool = True) -> dict:
    results = [
        Result("slice", "6M/5M ep50 done online", 0.000896, 0.00756, True),
        Result("slice", "6M/5M ep50 done static", 0.000401, 0.000399, True),
        Result("ppo", "chunked vs one-shot, batch 100k", 0.2, 0.25, True),
    ]
    quiet = load_summary(_snap(0, 0, 100), _snap(10, 9.5, 110))
    busy = load_summary(_snap(0, 0, 100, 3.0), _snap(10, 5, 124, 5.9))
    return {
        "command": "python -m benchmarks --out bench-results",
        "environment": {
            "usable_cpus": 2,
            "cpu_model": "Some CPU",
            "cuda": None,
            "python": "3.11.7",
            "torch": "2.15.0",
            "torchrl": "0.14.1",
            "tensordict": "0.14.3",
            "torch_threads": 1,
        },
        "elapsed_s": 95.0,
        "scenarios": {"slice": quiet, "ppo": busy if busy_ppo else quiet},
        "results": [vars(r) | {"speedup": r.speedup} for r in results],
    }


def test_report_flags_busy_scenarios() -> None:
    text = report.report(_payload())
    assert "WARNING: the machine was busy" in text and "ppo: load average 3.0 -> 5.9" in text
    rows = [line for line in text.splitlines() if line.startswith("| ppo")]
    assert rows and rows[0].endswith("| **busy** |")
    row = "| slice | 6M/5M ep50 done online | 7.56 ms | n/a | n/a | 896 us | 8.4x | n/a | n/a |"
    assert row + " yes | quiet |" in text
    quiet = report.report(_payload(busy_ppo=False))
    assert "WARNING" not in quiet and "**busy**" not in quiet


def test_write_readme_replaces_only_the_block(tmp_path: Path) -> None:
    readme = tmp_path / "README.md"
    readme.write_text(
        f"# x\n\nbefore\n\n{report.README_BEGIN}\nold\n{report.README_END}\n\nafter\n"
    )
    text = report.report(_payload())
    report.write_readme(readme, text)
    assert report.readme_block(readme) == text.strip()
    assert readme.read_text().startswith("# x\n\nbefore\n") and "after" in readme.read_text()
    assert "old" not in readme.read_text()
    readme.write_text("no markers")
    with pytest.raises(ValueError, match="markers"):
        report.write_readme(readme, text)


def _check_block(block: str) -> None:
    """The format :func:`report.report` writes: checked so the README cannot drift."""
    lines = block.splitlines()
    assert lines[0].startswith("`python -m benchmarks") and "--write-readme" in lines[0]
    assert re.search(
        r"torch [\w.+]+, torchrl [\w.]+, tensordict [\w.]+, \d+ torch threads?", lines[0]
    )
    table = [line for line in lines if line.startswith("|")]
    assert tuple(table[:2]) == report.TABLE_HEADER
    specs = scenario_specs()
    busy_rows = references = 0
    for row in table[2:]:
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert len(cells) == 11, row
        scenario, _case, torchrl, cpprb, floor, fast, speedup, vs_cpprb, over_floor = cells[:9]
        correct, machine = cells[9:]
        assert scenario in specs and correct == "yes" and machine in ("quiet", "**busy**"), row
        busy_rows += machine == "**busy**"
        t_fast = report.parse_measure(fast)
        # the times are rounded to 3 significant digits (throughputs to 0.1), the ratios to 0.1
        for numerator, denominator, shown in (
            (torchrl, fast, speedup),
            (cpprb, fast, vs_cpprb),
            (fast, floor, over_floor),
        ):
            top, bottom = report.parse_measure(numerator), report.parse_measure(denominator)
            if top is None or bottom is None:
                assert shown == "n/a", row
                continue
            value = float(shown.rstrip("x").replace(",", ""))
            assert value == pytest.approx(top / bottom, rel=0.02, abs=0.051), row
        assert ("/s" in torchrl) == ("/s" in fast), row
        assert "/s" not in cpprb + floor, row  # the references are times per call
        assert t_fast is not None, row
        references += cpprb != "n/a" or floor != "n/a"
    assert ("WARNING: the machine was busy" in block) == (busy_rows > 0)
    assert (report.REFERENCE_NOTE in " ".join(block.split())) == (references > 0)


def test_report_format_check_accepts_what_report_writes() -> None:
    payload = _payload()
    payload["command"] += " --write-readme"
    _check_block(report.report(payload))
    payload["results"].append(asdict_result(_throughput_row()))
    payload["scenarios"]["scale-out"] = payload["scenarios"]["slice"]
    _check_block(report.report(payload))


def asdict_result(r: Result) -> dict:
    return vars(r) | r.ratios()


def _throughput_row() -> Result:
    return Result(
        "scale-out", "slice 1 writer, 6M/5M", 1 / 164.0, 1 / 168.0, True, rate_unit="steps/s"
    )


def test_throughput_rows_show_steps_per_s_and_their_ratio() -> None:
    """One measure per row: the cells and the speedup of a throughput row both use steps/s."""
    row = _throughput_row()
    assert row.speedup == pytest.approx(164.0 / 168.0)
    assert row.speedup_definition == "fastreplay steps/s / TorchRL steps/s"
    table = report.markdown_table([row])
    cells = (
        "| scale-out | slice 1 writer, 6M/5M | 168.0 steps/s | n/a | n/a | 164.0 steps/s | 1.0x |"
    )
    assert cells in table
    payload = _payload()
    payload["results"].append(asdict_result(row))
    payload["scenarios"]["scale-out"] = payload["scenarios"]["slice"]
    text = report.report(payload)
    assert "speedup is fastreplay steps/s / TorchRL steps/s" in text
    assert "other rows are median times per call: TorchRL time / fastreplay time" in text
    assert report.parse_measure("1,234.5 steps/s") == pytest.approx(1 / 1234.5)


def test_readme_results_block_is_what_the_benchmark_writes() -> None:
    block = report.readme_block(REPO / "README.md")
    assert block, "README results block is empty: run python -m benchmarks --write-readme"
    _check_block(block)


def test_plot_renders(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    payload = _payload()
    results = [Result(**report._result_fields(r)) for r in payload["results"]]
    results.append(Result("slice", "slower", 2.0, 1.0, True))
    results.append(Result("pin", "no baseline", 1.0, None, True))
    path = tmp_path / "results.png"
    assert report.plot(
        results, path, env=payload["environment"], loads=payload["scenarios"], descriptions={}
    )
    assert path.stat().st_size > 10_000
    assert not report.plot([Result("pin", "x", 1.0, None, True)], tmp_path / "none.png")


# --------------------------------------------------------------------------- end to end


@pytest.fixture
def _restore_threads(monkeypatch):
    monkeypatch.setenv("NUMBA_NUM_THREADS", os.environ.get("NUMBA_NUM_THREADS", "1"))
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.mark.usefixtures("_restore_threads")
def test_small_run_writes_results_with_load_and_threads(tmp_path: Path, capsys) -> None:
    argv = ["--only", "slice", "--capacity", "2001", "--stored", "1507", "--episode-len", "50"]
    argv += ["--end", "done", "--num-slices", "4", "--slice-len", "8", "--repeats", "3"]
    argv += ["--rotate-items", "3001", "--rotate-lengths", "3"]
    assert main([*argv, "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "machine: load average" in out and "1 torch thread" in out
    payload = json.loads((tmp_path / "results.json").read_text())
    assert payload["threads"] == 1 and payload["environment"]["torch_threads"] == 1
    load = payload["scenarios"]["slice"]
    for key in ("loadavg_before", "loadavg_after", "cpus_before", "cpus_after", "busy"):
        assert key in load
    assert [r["case"] for r in payload["results"]] == [
        "2.001k/1.507k ep50 done static",
        "2.001k/1.507k ep50 done online",
        "3.001k rotate3 done static",
        "3.001k rotate3 done online",
    ]
    assert all(r["correct"] and r["speedup"] > 0 for r in payload["results"])
    rotating = payload["results"][2]
    assert rotating["params"]["slice_lengths"] == [7, 8, 9]
    assert rotating["extra"]["length_rows_rebuilt"] == 0  # no rebuild per sample
    md = (tmp_path / "results.md").read_text()
    assert md.count("| slice |") == 4


def test_harness_import_is_light() -> None:
    """The harness itself (imported by every scenario) stays free of heavy imports."""
    source = Path(harness.__file__).read_text() + Path(report.__file__).read_text()
    top_level = [line for line in source.splitlines() if re.match(r"^(import|from) ", line)]
    assert not [line for line in top_level if re.search(r"\b(torch|matplotlib|numpy)\b", line)]


def test_times_keep_three_significant_digits() -> None:
    """Short times are not rounded to whole microseconds (the speedup must follow the times)."""
    from benchmarks import report

    assert report.fmt_s(19.55e-6) == "19.6 us"
    assert report.fmt_s(5.104e-6) == "5.10 us"
    assert report.fmt_s(135.4e-6) == "135 us"
    for seconds in (3.21e-6, 19.55e-6, 412.7e-6, 2.013e-3, 1.204):
        assert report.parse_seconds(report.fmt_s(seconds)) == pytest.approx(seconds, rel=5e-3)


# --------------------------------------------------------------------------- what the run prints


def _scale_case(steps_per_s: float, median_step_s: float) -> dict:
    return {
        "median_step_s": median_step_s,
        "mean_step_s": 1 / steps_per_s,
        "steps_per_s": steps_per_s,
        "items_written_per_s": 1000.0,
        "invalid_samples": 0,
        "steps": 100,
        "writers_ok": True,
    }


@pytest.mark.usefixtures("_restore_threads")
def test_scale_out_speedup_is_the_ratio_of_the_steps_per_s_it_prints(
    tmp_path, capsys, monkeypatch
) -> None:
    """164 vs 168 steps/s is 1.0x, whatever the median steps (here 3.9 vs 3.1 ms) say."""
    from benchmarks.scenarios import scale_out

    cases = {"fastreplay": _scale_case(164.0, 3.9e-3), "torchrl": _scale_case(168.0, 3.1e-3)}
    monkeypatch.setattr(scale_out, "_run_case", lambda lib, *_: cases[lib])
    argv = ["--only", "scale-out", "--scale-kinds", "slice", "--scale-writers", "2"]
    assert main([*argv, "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "fastreplay: learner    164.0 steps/s" in out and "learner    168.0 steps/s" in out
    line = next(x for x in out.splitlines() if x.startswith("  slice 2 writers") and "speedup" in x)
    assert "TorchRL 168.0 steps/s" in line and "fastreplay 164.0 steps/s" in line
    assert re.search(r"speedup +1\.0x  ok", line), line
    assert "(speedup = fastreplay steps/s / TorchRL steps/s)" in line
    assert "| 168.0 steps/s | n/a | n/a | 164.0 steps/s | 1.0x | n/a | n/a |" in out
    (row,) = json.loads((tmp_path / "results.json").read_text())["results"]
    assert row["speedup"] == pytest.approx(164 / 168) and row["rate_unit"] == "steps/s"
    assert row["extra"]["fastreplay_median_step_s"] == 3.9e-3  # kept beside the throughput


def _fake_pin(monkeypatch, run) -> None:
    from benchmarks.scenarios import pin

    monkeypatch.setattr(pin, "run", run)


def _busy(monkeypatch) -> None:
    real = harness.load_summary
    monkeypatch.setattr(harness, "load_summary", lambda a, b: real(a, b) | {"busy": True})


@pytest.mark.usefixtures("_restore_threads")
def test_a_scenario_that_measured_nothing_says_why_and_is_never_busy(
    tmp_path, capsys, monkeypatch
) -> None:
    def run(args):
        raise NotMeasured("no CUDA device, so there is no host-to-device copy to time")

    _fake_pin(monkeypatch, run)
    _busy(monkeypatch)
    assert main(["--only", "pin", "--out", str(tmp_path)]) == 1  # no results at all
    captured = capsys.readouterr()
    section = captured.out.split("== pin:", 1)[1]
    assert "not measured: no CUDA device, so there is no host-to-device copy to time" in section
    assert "BUSY" not in section and "busy" not in captured.err
    assert "(no plot: nothing was measured)" in captured.out
    payload = json.loads((tmp_path / "results.json").read_text())
    assert payload["scenarios"] == {} and "no CUDA device" in payload["not_measured"]["pin"]
    assert "- pin: not measured: no CUDA device" in (tmp_path / "results.md").read_text()


@pytest.mark.usefixtures("_restore_threads")
def test_a_scenario_returning_no_case_is_not_measured_either(tmp_path, capsys, monkeypatch):
    _fake_pin(monkeypatch, lambda args: [])
    _busy(monkeypatch)
    assert main(["--only", "pin", "--out", str(tmp_path)]) == 1
    section = capsys.readouterr().out.split("== pin:", 1)[1]
    assert "not measured: no case ran" in section and "BUSY" not in section


@pytest.mark.usefixtures("_restore_threads")
def test_no_plot_gives_the_true_reason(tmp_path, capsys, monkeypatch) -> None:
    pytest.importorskip("matplotlib")
    _fake_pin(monkeypatch, lambda args: [Result("pin", "fastreplay only", 1e-3, None, True)])
    assert main(["--only", "pin", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "(no plot: no case has a TorchRL time to compare with" in out
    assert "matplotlib" not in out and not (tmp_path / "results.png").exists()


def test_plot_skip_reason() -> None:
    both = Result("slice", "x", 1.0, 2.0, True)
    only = Result("prioritized", "y", 1.0, None, True)
    assert report.plot_skip_reason([]) == "nothing was measured"
    assert report.plot_skip_reason([only]).startswith("no case has a TorchRL time")
    no_ext = report.plot_skip_reason([only], {"torchrl_compiled_extension": False})
    assert "TorchRL's compiled extension did not load" in no_ext
    if importlib.util.find_spec("matplotlib") is None:
        assert "matplotlib is not installed" in report.plot_skip_reason([both, only])
    else:
        assert report.plot_skip_reason([both, only]) is None


@pytest.mark.usefixtures("_restore_threads")
def test_redirected_output_has_no_torchrl_info_lines_nor_progress_bars(
    tmp_path, capsys, monkeypatch
) -> None:
    """capsys streams are not terminals, as when the output goes to a file."""
    monkeypatch.delenv("RL_LOGGING_LEVEL", raising=False)
    monkeypatch.setattr(harness, "PLAIN_PROGRESS_EVERY_S", 0.0)
    logger = logging.getLogger("torchrl")
    seen = []

    def run(args):
        seen.append(logger.isEnabledFor(logging.INFO))
        with harness.progress(10, "fill 10") as advance:
            advance(5)
            advance(5)
        return [Result("pin", "x", 1e-3, 2e-3, True)]

    _fake_pin(monkeypatch, run)
    level = logger.level
    assert main(["--only", "pin", "--out", str(tmp_path)]) == 0
    assert seen == [False] and logger.level == level  # silenced while running, then restored
    err = capsys.readouterr().err
    assert "\r" not in err and "fill 10: 50% after 0 s\nfill 10: 100% after 0 s\n" in err


def test_progress_prints_nothing_for_a_short_fill_when_redirected(capsys) -> None:
    with harness.progress(10, "fill 10") as advance:
        advance(10)
    assert capsys.readouterr().err == ""


def _imports(path: Path) -> set[str]:
    """Every ``benchmarks`` module ``path`` imports, at the top or inside a function."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        found |= {n for n in names if n.startswith("benchmarks")}
    return found


def test_benchmark_modules_import_no_circle() -> None:
    root = REPO / "benchmarks"
    modules = {
        ".".join(p.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__"): p
        for p in root.rglob("*.py")
    }
    graph = {m: {i for i in _imports(p) if i in modules and i != m} for m, p in modules.items()}
    assert graph["benchmarks.report"] >= {"benchmarks.results"}
    state: dict[str, str] = {}

    def visit(module: str, path: list[str]) -> None:
        state[module] = "open"
        for dep in sorted(graph[module]):
            assert state.get(dep) != "open", " -> ".join([*path, module, dep])
            if dep not in state:
                visit(dep, [*path, module])
        state[module] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module, [])


def test_ab_step_compares_two_source_trees() -> None:
    """``python -m benchmarks.ab_step``: both sides run, every part is printed with a ratio."""
    src = str(REPO / "src")
    sizes = ["--stored", "3000", "--steps", "20", "--rounds", "2"]
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.ab_step", "--base", src, "--head", src, *sizes],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    rows = [line.split() for line in out.splitlines() if line.startswith(("per ", "slice "))]
    assert len(rows) == 6
    for row in rows:
        for base, head, shown in (map(float, row[-6:-3]), map(float, row[-3:])):  # median, min
            assert base > 0 and head > 0 and shown == pytest.approx(head / base, abs=0.01)


@pytest.mark.usefixtures("_restore_threads")
def test_staleness_scenario_small_run_is_correct(tmp_path: Path) -> None:
    argv = ["--only", "staleness", "--stale-stored", "5001", "--stale-versions", "7"]
    assert main([*argv, "--stale-batch", "16", "--repeats", "3", "--out", str(tmp_path)]) == 0
    payload = json.loads((tmp_path / "results.json").read_text())
    assert [r["case"] for r in payload["results"]] == [
        "5.001k stored, 7 versions, same consumer",
        "5.001k stored, 7 versions, consumer +1",
    ]
    assert all(r["correct"] and r["speedup"] > 0 for r in payload["results"])


def test_sequence_scenario_small(tmp_path: Path, capsys) -> None:
    """The sequence scenario, small: both cases run, and fastreplay's agrees with TorchRL's."""
    argv = ["--only", "sequence", "--seq-capacity", "5001", "--seq-episode", "70"]
    code = main([*argv, "--repeats", "1", "--out", str(tmp_path)])
    payload = json.loads((tmp_path / "results.json").read_text())
    if not hasattr(fastreplay, "Sequence"):  # TorchRL 0.13: no sample units, said so
        assert code == 1 and payload["results"] == []  # (1: no results)
        assert "has no sample units" in payload["not_measured"]["sequence"]
        capsys.readouterr()
        return
    assert code == 0
    cases = [r["case"] for r in payload["results"]]
    assert cases == [
        "static sample, 5.001k",
        "online step (extend 1000, sample, update priorities), 5.001k",
    ]
    assert all(r["correct"] and r["torchrl_s"] > 0 for r in payload["results"])
    capsys.readouterr()


# --------------------------------------------------------------------------- cpprb and the floor


def _referenced_row() -> Result:
    return Result(
        "whole_step",
        "PER step, fastreplay buffer, 1M",
        0.5e-3,
        2.5e-3,
        True,
        cpprb_s=1e-3,
        floor_s=0.2e-3,
    )


def test_reference_columns_show_cpprb_and_the_floor_with_their_ratios() -> None:
    row = _referenced_row()
    assert row.vs_cpprb == pytest.approx(2.0) and row.over_floor == pytest.approx(2.5)
    assert row.ratios() == {"speedup": 5.0, "vs_cpprb": 2.0, "over_floor": 2.5}
    assert Result("s", "c", 1.0, None, True).ratios() == {
        "speedup": None,
        "vs_cpprb": None,
        "over_floor": None,
    }
    table = report.markdown_table([row])
    expected = "| 2.50 ms | 1.00 ms | 200 us | 500 us | 5.0x | 2.0x | 2.5x | yes | quiet |"
    assert expected in table
    payload = _payload()
    payload["command"] += " --write-readme"
    assert report.REFERENCE_NOTE not in report.report(payload)
    payload["results"].append(asdict_result(row))
    payload["scenarios"]["whole_step"] = payload["scenarios"]["slice"]
    text = report.report(payload)
    assert report.REFERENCE_NOTE in text
    _check_block(text)
    # a ratio that does not follow its times is caught
    with pytest.raises(AssertionError):
        _check_block(text.replace("| 2.0x | 2.5x |", "| 2.0x | 3.5x |"))


def test_plot_marks_cpprb_and_the_floor(tmp_path: Path, monkeypatch) -> None:
    pytest.importorskip("matplotlib")
    from matplotlib.axes import Axes

    markers: list[str | None] = []
    scatter = Axes.scatter

    def spy(self, *args, **kwargs):
        markers.append(kwargs.get("marker"))
        return scatter(self, *args, **kwargs)

    monkeypatch.setattr(Axes, "scatter", spy)
    payload = _payload()
    results = [Result(**report._result_fields(r)) for r in payload["results"]]
    assert report.plot(results, tmp_path / "plain.png", env=payload["environment"])
    assert set(markers) == {"|"}  # no reference: the value ticks only
    markers.clear()
    path = tmp_path / "results.png"
    assert report.plot([*results, _referenced_row()], path, env=payload["environment"])
    assert {"D", "^"} <= set(markers) and path.stat().st_size > 10_000


@pytest.mark.usefixtures("_restore_threads")
def test_small_whole_step_run_times_cpprb_and_the_floor(tmp_path: Path, capsys) -> None:
    argv = ["--only", "whole_step", "--step-per-capacity", "2001", "--repeats", "1"]
    argv += ["--step-slice-capacity", "20001", "--step-slice-stored", "15000"]
    assert main([*argv, "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    rows = json.loads((tmp_path / "results.json").read_text())["results"]
    from benchmarks.floor import KIND

    note = "" if KIND == "numba" else " (floor: NumPy, no numba)"  # the rows say which floor
    assert [r["case"] for r in rows] == [
        case + note
        for case in (
            "PER step, fastreplay buffer (extend 16, sample 256, td_error, "
            "update_tensordict_priority), 2.001k",
            "PER step, fastreplay buffer, general path, 2.001k",
            "PER step, fastreplay buffer, update_priority(index, p), 2.001k",
            "slice static, fastreplay buffer, 20.001k/15k ep1000",
            "slice static, fastreplay buffer, general path, 20.001k/15k ep1000",
            "slice online (extend 1000 + sample), fastreplay buffer, 20.001k/15k ep1000",
            "slice online (extend 1000 + sample), fastreplay buffer, general path, "
            "20.001k/15k ep1000",
        )
    ]
    assert {r["extra"]["floor_kind"] for r in rows} == {KIND}
    cpprb = importlib.util.find_spec("cpprb") is not None
    for r in rows:
        assert r["correct"] and r["extra"]["floor_correct"], r["case"]
        assert r["floor_s"] > 0 and r["over_floor"] == pytest.approx(
            r["fastreplay_s"] / r["floor_s"]
        )
        per = r["case"].startswith("PER")
        assert (r["cpprb_s"] is not None) == (per and cpprb), r["case"]
        if r["cpprb_s"] is not None:
            assert r["vs_cpprb"] == pytest.approx(r["cpprb_s"] / r["fastreplay_s"])
    md = (tmp_path / "results.md").read_text()
    header = next(line for line in md.splitlines() if line.startswith("| scenario"))
    assert header == report.TABLE_HEADER[0]
    assert report.REFERENCE_NOTE in md and "fastreplay/floor" in out


def test_the_floor_without_numba_gives_the_same_trees(monkeypatch) -> None:
    """The pure-NumPy floor passes the same checks as the compiled one."""
    from benchmarks import floor
    from benchmarks.scenarios import whole_step

    assert whole_step._floor_agrees(3)
    monkeypatch.setattr(floor, "numba", None)
    assert whole_step._floor_agrees(3)
    source = np.arange(70, dtype=np.int64).reshape(35, 2)
    starts = np.array([0, 30, 7])  # the second run wraps round the end
    out = np.empty((12, 2), np.int64)
    floor.gather_runs(source, starts, 4, out)
    expected = source[((starts[:, None] + np.arange(4)) % 35).reshape(-1)]
    assert np.array_equal(out, expected)


def test_the_floor_check_catches_a_tree_that_is_not_updated(monkeypatch) -> None:
    from benchmarks import floor
    from benchmarks.scenarios import whole_step

    monkeypatch.setattr(floor, "_propagate_numpy", lambda *args: None)
    assert not whole_step._floor_agrees(3)


@pytest.mark.usefixtures("_restore_threads")
def test_startup_row_times_a_fresh_process_on_each_side(tmp_path: Path) -> None:
    argv = ["--only", "startup", "--startup-cases", "warm", "--startup-runs", "1"]
    assert main([*argv, "--out", str(tmp_path)]) == 0
    (row,) = json.loads((tmp_path / "results.json").read_text())["results"]
    numba = importlib.util.find_spec("numba") is not None
    suffix = "warm numba cache" if numba else "no numba"
    assert row["case"] == f"import + PER buffer + first extend/sample/update_priority, {suffix}"
    assert row["correct"] and row["fastreplay_s"] > 0 and row["extra"]["dependencies_s"] > 0
    assert row["extra"]["numba_imported"] == numba
    assert (row["torchrl_s"] is not None) == harness.environment()["torchrl_compiled_extension"]


def test_startup_sides_must_draw_the_same_sample() -> None:
    from benchmarks.scenarios import startup

    ours = {"index": [3, 1], "weight": [1.0, 0.5]}
    assert startup._agree(ours, {"index": [3, 1], "weight": [1.0, 0.5000001]})
    assert not startup._agree(ours, {"index": [3, 2], "weight": [1.0, 0.5]})
    assert not startup._agree(ours, {"index": [3, 1], "weight": [1.0, 0.6]})
    assert startup._agree(ours, None) and not startup._agree({**ours, "index": [16, 1]}, None)


def test_her_streaming_small_run_is_correct(tmp_path: Path) -> None:
    """HER, streaming slice and can_sample rows, small: every case checked against TorchRL."""
    import torchrl.data as trl

    if not hasattr(trl, "StreamingSliceSampler"):
        pytest.skip("TorchRL 0.13 has no StreamingSliceSampler nor can_sample")
    argv = ["--only", "her_streaming", "--hs-stored", "3001", "--hs-batch", "64"]
    argv += ["--hs-episode-len", "50", "--repeats", "3"]
    assert main([*argv, "--out", str(tmp_path)]) == 0
    payload = json.loads((tmp_path / "results.json").read_text())
    assert [r["case"] for r in payload["results"]] == [
        "her sample after extend(1000), 3.001k",
        "streaming sample after extend(1000), 3.001k",
        "can_sample after extend(1000), 3.001k",
    ]
    assert all(r["correct"] and r["speedup"] > 0 for r in payload["results"])


@pytest.mark.usefixtures("_restore_threads")
def test_gpu_scenario_small_on_the_host_is_correct(tmp_path: Path, capsys) -> None:
    """Every row of the gpu scenario runs on the host at a tiny size, every side correct."""
    argv = ["--only", "gpu", "--gpu-device", "cpu", "--gpu-stored", "2000", "--gpu-batch", "8"]
    argv += ["--gpu-pin-stored", "32", "--gpu-logp-batch", "600", "--repeats", "1"]
    assert main([*argv, "--out", str(tmp_path)]) == 0
    payload = json.loads((tmp_path / "results.json").read_text())
    cases = [r["case"] for r in payload["results"]]
    assert cases == [
        "uniform step (extend 64, sample 8), 2k, cpu",
        "PER step (extend 1, sample 8, update), 2k, cpu",
        "slice online step (extend 500, sample 8x4), 2k, cpu",
        "slice static sample (8x4), 2k, cpu",
        "sample + copy, 8x84x84x3 uint8, cpu",
        "chunked log-prob (default budget) vs one-shot, 600, cpu",
    ]
    for row in payload["results"]:
        assert row["correct"] and row["floor_s"] > 0, row["case"]
        if row["torchrl_s"] is None:  # only TorchRL's PER without its compiled trees
            assert row["case"].startswith("PER") and "torchrl_not_run" in row["extra"]
    capsys.readouterr()


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device")
def test_gpu_scenario_without_cuda_is_not_measured_and_says_why(tmp_path: Path, capsys) -> None:
    assert main(["--only", "gpu", "--out", str(tmp_path)]) == 1  # no results at all
    payload = json.loads((tmp_path / "results.json").read_text())
    reason = payload["not_measured"]["gpu"]
    assert "no CUDA device" in reason and "--gpu-device cpu" in reason
    assert "not measured: no CUDA device" in capsys.readouterr().out


def test_gpu_scenario_refuses_a_storage_smaller_than_two_episodes(capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--only", "gpu", "--gpu-stored", "999"])
    assert exit_info.value.code == 2
    assert "--gpu-stored 999: at least 1000" in capsys.readouterr().err

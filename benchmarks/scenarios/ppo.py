"""PPO old log-probs: one-shot ``actor.log_prob`` vs ``fastreplay.chunked_log_prob``.

Each computation runs in its own fresh process (:mod:`benchmarks.ppo_memory`) so that its peak
resident set size is its own. The "TorchRL" column is the one-shot call TorchRL users write
(``actor.log_prob(data)`` under ``no_grad``); "fastreplay" is the chunked one. Both answers are
saved and compared with ``torch.testing.assert_close`` (float32 defaults). The times come from
the second process, which after its memory reading times both computations, interleaved.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from benchmarks.harness import (
    Result,
    fmt_count,
    fmt_ratio,
    ratio,
)

NAME = "ppo"

_ROOT = Path(__file__).resolve().parents[2]


def _measure(mode: str, args, out: Path, *extra: str) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(_ROOT / "src"), str(_ROOT), env.get("PYTHONPATH", "")]
    ).rstrip(os.pathsep)
    command = [
        sys.executable,
        "-m",
        "benchmarks.ppo_memory",
        f"--mode={mode}",
        f"--batch={args.ppo_batch}",
        f"--chunk={args.ppo_chunk}",
        f"--repeats={args.repeats}",
        f"--seed={args.seed}",
        f"--threads={args.threads if args.ppo_threads is None else args.ppo_threads}",
        f"--out={out}",
        *extra,
    ]
    done = subprocess.run(command, env=env, cwd=_ROOT, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def run(args) -> list[Result]:
    with tempfile.TemporaryDirectory() as tmp:
        one_shot = _measure("one-shot", args, Path(tmp) / "one_shot.pt", "--repeats=0")
        chunked = _measure("chunked", args, Path(tmp) / "chunked.pt", "--time-both")
        expected = torch.load(Path(tmp) / "one_shot.pt")
        actual = torch.load(Path(tmp) / "chunked.pt")
    try:
        torch.testing.assert_close(actual, expected)
        correct = actual.shape == (args.ppo_batch,)
    except AssertionError as err:
        print(f"  chunked log-probs differ from the one-shot ones: {err}", file=sys.stderr)
        correct = False

    mib = 2**20
    seconds = chunked["seconds_both"]
    memory_ratio = ratio(one_shot["extra_rss"], chunked["extra_rss"])
    total_ratio = ratio(one_shot["peak_rss"], chunked["peak_rss"])
    time_ratio = ratio(seconds["chunked"], seconds["one-shot"])
    lower = (
        "n/a: the chunked run grew no higher than its warm-up"
        if memory_ratio is None
        else (f"{fmt_ratio(memory_ratio)} lower")
    )
    print(
        f"  peak extra RSS: one-shot {one_shot['extra_rss'] / mib:,.0f} MiB, chunked "
        f"{chunked['extra_rss'] / mib:,.0f} MiB ({lower}; output itself "
        f"{chunked['output_bytes'] / mib:,.1f} MiB); peak total RSS "
        f"{one_shot['peak_rss'] / mib:,.0f} vs {chunked['peak_rss'] / mib:,.0f} MiB "
        f"({fmt_ratio(total_ratio)}); time chunked/one-shot {fmt_ratio(time_ratio)}",
        flush=True,
    )
    case = (
        f"chunked vs one-shot, batch {fmt_count(args.ppo_batch)}, chunk {args.ppo_chunk}, "
        f"{chunked['threads']} thr"
    )
    return [
        Result(
            scenario=NAME,
            case=case,
            fastreplay_s=seconds["chunked"],
            torchrl_s=seconds["one-shot"],
            correct=correct,
            params={
                "batch": args.ppo_batch,
                "chunk_size": args.ppo_chunk,
                "obs_dim": 64,
                "threads": chunked["threads"],
            },
            extra={
                "one_shot": one_shot,
                "chunked": chunked,
                "extra_rss_ratio": memory_ratio,
                "peak_rss_ratio": total_ratio,
                "time_ratio_chunked_over_one_shot": time_ratio,
            },
        )
    ]

"""fastreplay against another checkout of itself: the online steps, part by part, alternated.

A change that moves code (a refactor, a new bookkeeping step) should cost nothing: this times
the parts of two online steps through fastreplay's ``TensorDictReplayBuffer`` with 1 torch
thread, for each of two source trees, in fresh processes that alternate (so that both see the
same machine load; base first in every other round), and prints the medians over rounds side
by side with their ratio, then each side's smallest round and theirs (this machine's speed can
differ between processes: quote both)::

    git worktree add /tmp/base <commit>
    python -m benchmarks.ab_step --base /tmp/base/src --head src --rounds 3

The steps: PER (``extend`` 16 rows of ``obs[4]``, ``sample()`` of 256 with weights, the loss's
``td_error`` written, ``update_tensordict_priority``) and slices (``extend`` 100 steps of a new
episode, ``sample()`` of 8 slices of 32, then a ``sample()`` with nothing written), at
``--stored`` items. ``--child`` runs one side and prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _parts(stored: int, steps: int) -> dict[str, float]:
    import numpy as np
    import torch
    from tensordict import TensorDict
    from torchrl.data import LazyTensorStorage

    import fastreplay

    torch.set_num_threads(1)
    per = fastreplay.TensorDictReplayBuffer(
        storage=LazyTensorStorage(stored),
        sampler=fastreplay.PrioritizedSampler(stored, 0.7, 0.5),
        batch_size=256,
        priority_key="td_error",
    )
    per.extend(TensorDict(obs=torch.randn(stored, 4), batch_size=[stored]))
    slices = fastreplay.TensorDictReplayBuffer(
        storage=LazyTensorStorage(stored),
        sampler=fastreplay.SliceSampler(num_slices=8, traj_key="episode"),
        batch_size=256,
    )
    episode = torch.arange(stored) // 1000
    slices.extend(TensorDict(episode=episode, obs=torch.randn(stored, 4), batch_size=[stored]))
    new = TensorDict(obs=torch.randn(16, 4), batch_size=[16])
    td_error = torch.rand(256) + 0.1
    times: dict[str, list[float]] = {}
    next_episode = stored // 1000
    for step in range(steps):
        clock = [time.perf_counter()]
        per.extend(new)
        clock.append(time.perf_counter())
        batch = per.sample()
        clock.append(time.perf_counter())
        batch["td_error"] = td_error
        per.update_tensordict_priority(batch)
        clock.append(time.perf_counter())
        rows = TensorDict(
            episode=torch.full((100,), next_episode), obs=torch.randn(100, 4), batch_size=[100]
        )
        next_episode += 1
        clock.append(time.perf_counter())
        slices.extend(rows)
        clock.append(time.perf_counter())
        slices.sample()
        clock.append(time.perf_counter())
        slices.sample()
        clock.append(time.perf_counter())
        if step < steps // 5:  # warm-up
            continue
        names = ("per extend", "per sample", "per update_tensordict_priority", None)
        names += ("slice extend", "slice sample after a write", "slice sample")
        for name, start, stop in zip(names, clock[:-1], clock[1:], strict=True):
            if name is not None:
                times.setdefault(name, []).append((stop - start) * 1e6)
    return {name: float(np.median(values)) for name, values in times.items()}


def _child(src: str, stored: int, steps: int) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": os.path.abspath(src)}
    command = [sys.executable, "-m", "benchmarks.ab_step", "--child"]
    command += ["--stored", str(stored), "--steps", str(steps)]
    out = subprocess.run(command, env=env, cwd=REPO, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", help="the other checkout's src folder")
    parser.add_argument("--head", default=str(REPO / "src"), help="this checkout's src folder")
    parser.add_argument("--stored", type=int, default=1_000_000, help="items stored")
    parser.add_argument("--steps", type=int, default=2000, help="timed steps per process")
    parser.add_argument("--rounds", type=int, default=3, help="processes per side")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(_parts(args.stored, args.steps)))
        return 0
    if not args.base:
        parser.error("--base is required (the src folder of the checkout to compare with)")
    runs: dict[str, list[dict[str, float]]] = {"base": [], "head": []}
    for round_ in range(args.rounds):
        # base first in even rounds, head first in odd ones: neither side always goes first
        for side in ("base", "head") if round_ % 2 == 0 else ("head", "base"):
            runs[side].append(_child(getattr(args, side), args.stored, args.steps))
    print(
        f"{'part (us, over rounds)':34} {'base':>9} {'head':>9} {'head/base':>10}"
        f" {'base min':>9} {'head min':>9} {'min ratio':>10}"
    )
    for name in runs["base"][0]:
        base = sorted(r[name] for r in runs["base"])
        head = sorted(r[name] for r in runs["head"])
        b, h = base[len(base) // 2], head[len(head) // 2]
        print(
            f"{name:34} {b:9.1f} {h:9.1f} {h / b:10.2f}"
            f" {base[0]:9.1f} {head[0]:9.1f} {head[0] / base[0]:10.2f}"
        )
    load = os.getloadavg()[0]
    print(f"load average (1 min) at the end: {load:.2f} on {os.cpu_count()} cores")
    return 0


if __name__ == "__main__":
    sys.exit(main())

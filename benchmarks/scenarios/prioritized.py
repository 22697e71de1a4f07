"""PrioritizedSampler: live-max maintenance, online PER step, dumps/loads (vs TorchRL).

Needs TorchRL's compiled extension for the TorchRL side; without it only fastreplay is timed.
"""

from __future__ import annotations

import argparse
import math
import shutil
import tempfile
from pathlib import Path

import torch
from tensordict import TensorDict
from torchrl.data import LazyTensorStorage, TensorDictReplayBuffer
from torchrl.data import PrioritizedSampler as TorchRLSampler

from benchmarks.harness import Result, fmt_count, interleaved_seconds, parse_counts, progress
from fastreplay import PrioritizedSampler

NAME = "prioritized"
DESCRIPTION = "PrioritizedSampler: lower the max item, online PER step, dumps+loads"
ALPHA, BETA = 0.7, 0.5
CHUNK = 1_000_000


def add_arguments(group: argparse._ArgumentGroup) -> None:
    group.add_argument(
        "--per-capacity",
        default="1M",
        help="capacities for 'lower the max' and the online PER step (e.g. 1M,10M,100M)",
    )
    group.add_argument(
        "--per-online-max",
        default="10M",
        help="skip the online PER step above this capacity (it builds a storage)",
    )
    group.add_argument("--per-dumps-capacity", default="1M", help="capacities for dumps+loads")


def _torchrl_ok() -> bool:
    try:
        TorchRLSampler(2, 1.0, 1.0)
    except RuntimeError:
        return False
    return True


def _fill(sampler, capacity: int, priority: torch.Tensor) -> None:
    with progress(capacity, f"fill {type(sampler).__module__.split('.')[0]}") as advance:
        for start in range(0, capacity, CHUNK):
            stop = min(start + CHUNK, capacity)
            sampler.update_priority(torch.arange(start, stop), priority[start:stop])
            advance(stop - start)


def _lower_max(capacity: int, repeats: int, torchrl_ok: bool) -> Result:
    """Re-prioritise the current max item below the rest: the live max must move."""
    gen = torch.Generator().manual_seed(capacity)
    priority = torch.rand(capacity, generator=gen) + 0.5  # in [0.5, 1.5)
    second = float(priority.max())
    top = int(torch.randint(capacity, (1,), generator=gen))
    ours = PrioritizedSampler(capacity, ALPHA, BETA)
    _fill(ours, capacity, priority)
    samplers = {"fastreplay": ours}
    if torchrl_ok:
        theirs = TorchRLSampler(capacity, ALPHA, BETA, max_priority_within_buffer=True)
        _fill(theirs, capacity, priority)
        samplers["torchrl"] = theirs
    index, high, low = torch.tensor([top]), torch.tensor([10.0]), torch.tensor([0.1])
    times = interleaved_seconds(
        {name: (lambda s=s: s.update_priority(index, low)) for name, s in samplers.items()},
        setup={name: (lambda s=s: s.update_priority(index, high)) for name, s in samplers.items()},
        repeats=repeats,
    )
    correct = True
    for name, sampler in samplers.items():
        assert float(sampler.default_priority) != 10.0
        expected = second if priority[top] != second else float(priority.topk(2)[0][1])
        got = float(sampler.default_priority)
        # ours is exact; TorchRL inverts (p + eps) ** alpha from a float32 tree
        tol = 0.0 if name == "fastreplay" else 1e-5
        correct &= math.isclose(got, expected, rel_tol=tol)
    del samplers
    return Result(
        NAME,
        f"lower the max item, {fmt_count(capacity)} capacity",
        times["fastreplay"],
        times.get("torchrl"),
        correct,
        params={"capacity": capacity, "alpha": ALPHA, "torchrl_max_within_buffer": True},
    )


def _online_step(capacity: int, repeats: int, torchrl_ok: bool) -> Result:
    """Extend 16 new items (default priority), sample 256, update those 256 priorities."""
    gen = torch.Generator().manual_seed(capacity + 1)
    samplers = {"fastreplay": PrioritizedSampler(capacity, ALPHA, BETA)}
    if torchrl_ok:  # TorchRL's default configuration, compiled C++ trees
        samplers["torchrl"] = TorchRLSampler(capacity, ALPHA, BETA)
    init = TensorDict({"obs": torch.arange(capacity, dtype=torch.float32)}, [capacity])
    init["td_error"] = torch.rand(capacity, generator=gen)
    new = TensorDict({"obs": torch.zeros(16)}, [16])
    buffers = {}
    for name, sampler in samplers.items():
        rb = TensorDictReplayBuffer(
            storage=LazyTensorStorage(capacity), sampler=sampler, priority_key="td_error"
        )
        for start in range(0, capacity, CHUNK):
            rb.extend(init[start : start + CHUNK])
        buffers[name] = rb

    def step(rb: TensorDictReplayBuffer) -> None:
        rb.extend(new.clone())
        batch = rb.sample(256)
        rb.update_priority(batch["index"], batch["obs"].abs().add(0.1))

    times = interleaved_seconds(
        {name: (lambda rb=rb: step(rb)) for name, rb in buffers.items()}, repeats=3 * repeats
    )
    ours = samplers["fastreplay"]
    correct = ours.default_priority == float(ours._trees.raw().max())
    batch = buffers["fastreplay"].sample(256)
    correct &= bool(torch.isfinite(batch["priority_weight"]).all())
    del buffers, samplers, init
    return Result(
        NAME,
        f"online PER step (extend 16, sample 256, update 256), {fmt_count(capacity)}",
        times["fastreplay"],
        times.get("torchrl"),
        correct,
        params={"capacity": capacity, "alpha": ALPHA, "beta": BETA},
    )


def _dumps_loads(capacity: int, repeats: int, torchrl_ok: bool) -> Result:
    priority = torch.rand(capacity, generator=torch.Generator().manual_seed(2)) + 0.1
    samplers = {"fastreplay": PrioritizedSampler(capacity, ALPHA, BETA)}
    if torchrl_ok:
        samplers["torchrl"] = TorchRLSampler(capacity, ALPHA, BETA)
    correct = True
    root = Path(tempfile.mkdtemp(prefix="fastreplay-per-"))
    try:
        round_trips, fresh_makers, holders = {}, {}, {}
        for name, sampler in samplers.items():
            _fill(sampler, capacity, priority)
            path = root / name
            holder: list = []
            cls = type(sampler)

            def make_fresh(cls=cls, holder=holder) -> None:
                # a new sampler each call: TorchRL's loads fails on a sampler that loaded once
                holder[:] = [cls(capacity, ALPHA, BETA)]

            def round_trip(sampler=sampler, holder=holder, path=path) -> None:
                sampler.dumps(path)
                holder[0].loads(path)

            round_trips[name], fresh_makers[name], holders[name] = round_trip, make_fresh, holder
        times = interleaved_seconds(round_trips, setup=fresh_makers, repeats=max(3, repeats // 2))
        for name, sampler in samplers.items():
            fresh = holders[name][0]
            if name == "fastreplay":
                correct &= all(
                    torch.equal(a, b)
                    for a, b in zip(sampler._trees.levels, fresh._trees.levels, strict=True)
                )
            else:
                correct &= math.isclose(
                    fresh._sum_tree.query(0, capacity), sampler._sum_tree.query(0, capacity)
                )
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return Result(
        NAME,
        f"dumps + loads, {fmt_count(capacity)} capacity",
        times["fastreplay"],
        times.get("torchrl"),
        correct,
        params={"capacity": capacity},
    )


def run(args: argparse.Namespace) -> list[Result]:
    torchrl_ok = _torchrl_ok()
    results = []
    online_max = parse_counts(args.per_online_max)[0]
    for capacity in parse_counts(args.per_capacity):
        results.append(_lower_max(capacity, args.repeats, torchrl_ok))
        if capacity <= online_max:
            results.append(_online_step(capacity, args.repeats, torchrl_ok))
    for capacity in parse_counts(args.per_dumps_capacity):
        results.append(_dumps_loads(capacity, args.repeats, torchrl_ok))
    return results

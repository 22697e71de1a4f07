"""PrioritizedSampler: each PER call, the online step, bulk writes, live max, dumps+loads.

Every case runs fastreplay once per tree backend present (``numba`` when installed, ``torch``
always) against TorchRL's compiled trees, in one process, calls interleaved. Needs TorchRL's
compiled extension for the TorchRL side; without it only fastreplay is timed.

Cases per capacity (``--per-capacity``, 1M and 10M by default; 100M on request):

* ``extend 16``: TorchRL's ``TensorDictReplayBuffer.extend`` of 16 items, with each side's
  sampler in it (new items get the default priority through ``mark_update``);
* ``sample(256)``: ``sampler.sample(storage, 256)``;
* ``update_priority(256)``: ``sampler.update_priority`` of 256 random slots;
* ``online PER step``: extend 16, sample 256 through the buffer, update those 256 priorities,
  in TorchRL's ``TensorDictReplayBuffer`` with each side's sampler in it (the rows say
  "fastreplay sampler in TorchRL's buffer"; ``whole_step`` times fastreplay's own buffer);
* ``update_priority(all)``: one call writing every slot in random order, in a fresh process
  per side, with its peak extra resident memory (``VmHWM`` after a reset, minus ``VmRSS``
  before; in ``results.json``);
* ``lower the max item``: re-prioritise the max item below the rest (TorchRL with
  ``max_priority_within_buffer=True``, which rescans its tree).

Correct: every backend holds exactly the same raw priorities as the others after the same
calls, masses agree, the total mass matches TorchRL's float32 tree, the live max is the
brute-force max, and sampled weights are finite.
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

from benchmarks.harness import (
    Result,
    fmt_count,
    interleaved_seconds,
    median_seconds,
    parse_counts,
    progress,
)
from fastreplay import PrioritizedSampler
from fastreplay._core.trees.interface import available_backends

NAME = "prioritized"
ALPHA, BETA = 0.7, 0.5
CHUNK = 1_000_000


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


def _samplers(capacity: int, backends: list[str], torchrl_ok: bool, **kwargs) -> dict:
    samplers = {b: PrioritizedSampler(capacity, ALPHA, BETA, backend=b) for b in backends}
    if torchrl_ok:  # TorchRL's default configuration, compiled C++ trees
        samplers["torchrl"] = TorchRLSampler(capacity, ALPHA, BETA, **kwargs)
    return samplers


def _results(case: str, times: dict[str, float], correct: bool, params: dict, **extra) -> list:
    return [
        Result(
            NAME,
            f"{case} [{name}]",
            seconds,
            times.get("torchrl"),
            correct,
            params={**params, "backend": name},
            extra={key: value.get(name) for key, value in extra.items()},
        )
        for name, seconds in times.items()
        if name != "torchrl"
    ]


def _calls(capacity: int, backends: list[str], repeats: int, torchrl_ok: bool) -> list[Result]:
    """Extend 16, sample(256), update_priority(256) and the whole online step, per backend."""
    gen = torch.Generator().manual_seed(capacity + 1)
    samplers = _samplers(capacity, backends, torchrl_ok)
    errors = torch.rand(capacity, generator=gen) + 0.05
    buffers = {}
    for name, sampler in samplers.items():
        rb = TensorDictReplayBuffer(
            storage=LazyTensorStorage(capacity), sampler=sampler, priority_key="td_error"
        )
        with progress(capacity, f"fill {name}") as advance:
            for start in range(0, capacity, CHUNK):
                stop = min(start + CHUNK, capacity)
                obs = torch.arange(start, stop, dtype=torch.float32)
                rb.extend(TensorDict({"obs": obs, "td_error": errors[start:stop]}, [stop - start]))
                advance(stop - start)
        buffers[name] = rb
    n = 3 * repeats
    new = TensorDict({"obs": torch.zeros(16)}, [16])
    updates = [
        (torch.randint(capacity, (256,), generator=gen), torch.rand(256, generator=gen) + 0.05)
        for _ in range(n + 1)
    ]
    params = {"capacity": capacity, "alpha": ALPHA, "beta": BETA}
    results = []

    # identical calls on every side: the leaves must stay identical across backends
    ext = interleaved_seconds(
        {k: (lambda rb=rb: rb.extend(new.clone())) for k, rb in buffers.items()}, repeats=n
    )
    smp = interleaved_seconds(
        {
            k: (lambda s=s, rb=rb: s.sample(rb.storage, 256))
            for k, (s, rb) in _pairs(samplers, buffers)
        },
        repeats=n,
    )
    it = {k: iter(updates) for k in samplers}
    upd = interleaved_seconds(
        {k: (lambda s=s, k=k: s.update_priority(*next(it[k]))) for k, s in samplers.items()},
        repeats=n,
    )
    correct = _consistent(samplers, capacity)

    def step(rb: TensorDictReplayBuffer) -> None:
        rb.extend(new.clone())
        batch = rb.sample(256)
        rb.update_priority(batch["index"], batch["obs"].abs().add(0.1))

    whole = interleaved_seconds(
        {k: (lambda rb=rb: step(rb)) for k, rb in buffers.items()}, repeats=n
    )
    for name in backends:
        ours = samplers[name]
        correct &= ours._default_value() == float(ours._trees.raw().max())  # exact live max
        batch = buffers[name].sample(256)
        correct &= bool(torch.isfinite(batch["priority_weight"]).all())
    label = fmt_count(capacity)
    results += _results(
        f"extend 16, fastreplay sampler in TorchRL's buffer, {label}", ext, correct, params
    )
    results += _results(f"sample(256), {label}", smp, correct, params)
    results += _results(f"update_priority(256), {label}", upd, correct, params)
    results += _results(
        f"online PER step, fastreplay sampler in TorchRL's buffer (extend 16, sample 256, "
        f"update 256), {label}",
        whole,
        correct,
        params,
    )
    del buffers, samplers
    return results


def _pairs(samplers: dict, buffers: dict):
    return ((k, (s, buffers[k])) for k, s in samplers.items())


def _consistent(samplers: dict, capacity: int) -> bool:
    """Same raw leaves on every backend, close masses, total close to TorchRL's."""
    ours = [s for k, s in samplers.items() if k != "torchrl"]
    first = ours[0]._trees
    correct = True
    for other in ours[1:]:
        correct &= torch.equal(first.raw(), other._trees.raw())
        correct &= torch.allclose(first.leaf_mass(), other._trees.leaf_mass(), rtol=1e-6, atol=0)
        correct &= math.isclose(first.total(), other._trees.total(), rel_tol=1e-9)
    if "torchrl" in samplers:
        theirs = samplers["torchrl"]._sum_tree.query(0, capacity)
        correct &= math.isclose(first.total(), theirs, rel_tol=1e-4)
    return bool(correct)


_BULK_CHILD = """
import gc, json, sys, time
import torch
torch.set_num_threads(int(sys.argv[3]))
name, capacity = sys.argv[1], int(sys.argv[2])
if name == "torchrl":
    from torchrl.data import PrioritizedSampler
    sampler = PrioritizedSampler(capacity, 0.7, 0.5)
else:
    from fastreplay import PrioritizedSampler
    sampler = PrioritizedSampler(capacity, 0.7, 0.5, backend=name)
gen = torch.Generator().manual_seed(capacity + 2)
index = torch.randperm(capacity, generator=gen)
priority = torch.rand(capacity, generator=gen) + 0.05
sampler.update_priority(index[:16], priority[:16])  # compile or load kernels first
def status(field):
    with open("/proc/self/status") as file:
        return next(int(l.split()[1]) * 1024 for l in file if l.startswith(field))
gc.collect()
with open("/proc/self/clear_refs", "w") as file:
    file.write("5")  # reset the peak resident set size (VmHWM) to the current one
before = status("VmRSS")
t0 = time.perf_counter()
sampler.update_priority(index, priority)
seconds = time.perf_counter() - t0
peak = status("VmHWM") - before
total = sampler._sum_tree.query(0, capacity) if name == "torchrl" else sampler._trees.total()
live = float(priority.max()) if name == "torchrl" else sampler._default_value()
ok = live == float(priority.max())
print(json.dumps({"seconds": seconds, "peak": peak, "total": total, "ok": ok}))
"""


def _bulk(capacity: int, backends: list[str], torchrl_ok: bool) -> list[Result]:
    """One update_priority call writing every slot (random order), each in a fresh process.

    A fresh process per side, so that the peak extra resident memory (``VmHWM`` after a
    reset, minus ``VmRSS`` before) is not hidden by memory an earlier case freed.
    """
    import json
    import os
    import subprocess
    import sys

    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    runs = {}
    for name in [*backends, *(["torchrl"] if torchrl_ok else [])]:
        out = subprocess.run(
            [sys.executable, "-c", _BULK_CHILD, name, str(capacity), str(torch.get_num_threads())],
            capture_output=True,
            text=True,
            env=env,
            check=True,
        )
        runs[name] = json.loads(out.stdout.strip().splitlines()[-1])
    first = runs[backends[0]]["total"]
    correct = all(run["ok"] for run in runs.values())
    correct &= all(math.isclose(run["total"], first, rel_tol=1e-4) for run in runs.values())
    return _results(
        f"update_priority(all {fmt_count(capacity)}), one call",
        {name: run["seconds"] for name, run in runs.items()},
        correct,
        {"capacity": capacity},
        peak_extra_bytes={name: run["peak"] for name, run in runs.items()},
        torchrl_peak_extra_bytes={name: runs.get("torchrl", {}).get("peak") for name in backends},
    )


def _lower_max(capacity: int, backends: list[str], repeats: int, torchrl_ok: bool) -> list:
    """Re-prioritise the current max item below the rest: the live max must move."""
    gen = torch.Generator().manual_seed(capacity)
    priority = torch.rand(capacity, generator=gen) + 0.5  # in [0.5, 1.5)
    top = int(priority.argmax())
    second = float(priority.topk(2)[0][1])
    samplers = _samplers(capacity, backends, torchrl_ok, max_priority_within_buffer=True)
    for sampler in samplers.values():
        _fill(sampler, capacity, priority)
    index, high, low = torch.tensor([top]), torch.tensor([10.0]), torch.tensor([0.1])
    correct = True
    times = interleaved_seconds(
        {name: (lambda s=s: s.update_priority(index, low)) for name, s in samplers.items()},
        setup={name: (lambda s=s: s.update_priority(index, high)) for name, s in samplers.items()},
        repeats=repeats,
    )
    for name, sampler in samplers.items():
        got = float(sampler.default_priority) if name == "torchrl" else sampler._default_value()
        # ours is exact; TorchRL inverts (p + eps) ** alpha from a float32 tree
        tol = 1e-5 if name == "torchrl" else 0.0
        correct &= math.isclose(got, second, rel_tol=tol)
    del samplers
    return _results(
        f"lower the max item, {fmt_count(capacity)} capacity",
        times,
        correct,
        {"capacity": capacity, "alpha": ALPHA, "torchrl_max_within_buffer": True},
    )


def _dumps_loads(capacity: int, repeats: int, torchrl_ok: bool) -> Result:
    priority = torch.rand(capacity, generator=torch.Generator().manual_seed(2)) + 0.1
    samplers = {"fastreplay": PrioritizedSampler(capacity, ALPHA, BETA)}
    if torchrl_ok:
        samplers["torchrl"] = TorchRLSampler(capacity, ALPHA, BETA)
    times, correct = {}, True
    root = Path(tempfile.mkdtemp(prefix="fastreplay-per-"))
    try:
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

            times[name] = median_seconds(round_trip, setup=make_fresh, repeats=max(3, repeats // 2))
            fresh = holder[0]
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
    chosen = args.per_backends or ",".join(available_backends())
    backends = [b.strip() for b in chosen.split(",") if b.strip()]
    results = []
    for capacity in parse_counts(args.per_capacity):
        results += _calls(capacity, backends, args.repeats, torchrl_ok)
        results += _bulk(capacity, backends, torchrl_ok)
        results += _lower_max(capacity, backends, args.repeats, torchrl_ok)
    for capacity in parse_counts(args.per_dumps_capacity):
        results.append(_dumps_loads(capacity, args.repeats, torchrl_ok))
    return results

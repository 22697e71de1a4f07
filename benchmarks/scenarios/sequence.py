"""Sequence sample units (R2D2-style sequence PER): TorchRL's boundary scan vs the index.

``sample_unit=Sequence(length=32, burn_in=8)`` with 64 anchors drawn by a prioritized
sampler, on a storage of ``obs[4]`` and ``("next", "done")`` holding episodes of
``--seq-episode`` steps (1,000), full at ``--seq-capacity`` (1M and 10M by default; 50M as
an opt-in size). Cases:

* ``static``: ``sample`` with no write in between (TorchRL serves its cached boundaries);
* ``online``: ``extend`` 1,000 rows, ``sample``, ``update_tensordict_priority`` with the
  ``td_error`` ``priority_key`` (TorchRL rescans the whole done entry after each write).

Sides: TorchRL's ``TensorDictReplayBuffer`` with its ``PrioritizedSampler`` (compiled) and
``Sequence``; fastreplay's ``TensorDictPrioritizedReplayBuffer`` with ``fastreplay.Sequence``.
Calls interleaved in one process. Correct: on a small odd-capacity buffer written in
wrapping chunks, fastreplay's buffer and unit give TorchRL's samples and info, key by key,
and the same priorities (same sampler class on both sides); on the timed buffers every
valid window is consecutive steps of one episode.
"""

from __future__ import annotations

import argparse

import torch
from tensordict import TensorDict
from torchrl.data import LazyTensorStorage
from torchrl.data import PrioritizedSampler as TorchRLPrioritizedSampler
from torchrl.data import TensorDictReplayBuffer as TorchRLBuffer

import fastreplay
from benchmarks.harness import (
    NotMeasured,
    Result,
    fmt_count,
    interleaved_seconds,
    parse_counts,
    progress,
)

NAME = "sequence"
ALPHA, BETA = 0.7, 0.5
BATCH, LENGTH, BURN_IN = 64, 32, 8
CHUNK = 1_000_000
DONE = ("next", "done")


def _rows(first: int, n: int, episode: int) -> TensorDict:
    """Rows ``first .. first + n`` of the stream: ``obs = [step, episode, 0, 0]``."""
    position = torch.arange(first, first + n)
    obs = torch.zeros(n, 4)
    obs[:, 0] = (position % episode).float()
    obs[:, 1] = (position // episode).float()
    return TensorDict(
        {"obs": obs, DONE: (position % episode == episode - 1)[:, None], "td_error": torch.ones(n)},
        [n],
    )


def _torchrl_compiled() -> bool:
    try:
        TorchRLPrioritizedSampler(2, 1.0, 1.0)
    except RuntimeError:
        return False
    return True


def _buffers(capacity: int, torchrl_sampler: bool) -> dict:
    def sampler():
        if torchrl_sampler:
            return TorchRLPrioritizedSampler(capacity, ALPHA, BETA)
        return fastreplay.PrioritizedSampler(capacity, ALPHA, BETA)

    return {
        "fastreplay": fastreplay.TensorDictPrioritizedReplayBuffer(
            alpha=ALPHA,
            beta=BETA,
            storage=LazyTensorStorage(capacity),
            batch_size=BATCH,
            priority_key="td_error",
            sample_unit=fastreplay.Sequence(LENGTH, burn_in=BURN_IN),
        ),
        "torchrl": TorchRLBuffer(
            storage=LazyTensorStorage(capacity),
            sampler=sampler(),
            batch_size=BATCH,
            priority_key="td_error",
            sample_unit=fastreplay._torchrl.TorchRLSequence(LENGTH, burn_in=BURN_IN),
        ),
    }


def _fill(buffers: dict, capacity: int, episode: int) -> None:
    with progress(capacity, f"fill sequence {fmt_count(capacity)}") as advance:
        for start in range(0, capacity, CHUNK):
            n = min(CHUNK, capacity - start)
            rows = _rows(start, n, episode)
            for rb in buffers.values():
                rb.extend(rows)
            advance(n)


def _online(rb, rows: TensorDict) -> None:
    rb.extend(rows)
    batch = rb.sample()
    batch["td_error"] = batch["obs"][:, 0] * 0.001 + 0.05
    rb.update_tensordict_priority(batch)


def _windows_valid(batch: TensorDict) -> bool:
    """Each window's valid records: consecutive steps of one episode, in order."""
    total = BURN_IN + LENGTH
    obs = batch["obs"].reshape(-1, total, 4)
    valid = batch["validity_mask"].reshape(-1, total)
    ok = True
    for b in range(obs.shape[0]):
        rows = obs[b][valid[b]]
        ok &= bool((rows[:, 1] == rows[0, 1]).all() and (rows[1:, 0] - rows[:-1, 0] == 1).all())
    return ok


def _agrees_with_torchrl(seed: int) -> bool:
    """Small odd buffer, wrapping writes: fastreplay's buffer and unit give TorchRL's results."""
    capacity, runs = 1_001, []
    for side in ("torchrl", "fastreplay"):
        unit_cls = fastreplay._torchrl.TorchRLSequence if side == "torchrl" else fastreplay.Sequence
        buffer_cls = TorchRLBuffer if side == "torchrl" else fastreplay.TensorDictReplayBuffer
        rb = buffer_cls(
            storage=LazyTensorStorage(capacity),
            sampler=fastreplay.PrioritizedSampler(capacity, ALPHA, BETA),
            batch_size=16,
            priority_key="td_error",
            sample_unit=unit_cls(12, burn_in=4, bootstrap=2),
            generator=torch.Generator().manual_seed(seed),
        )
        out, written = [], 0
        for step in range(12):
            n = 373 if step % 4 == 0 else 37
            rb.extend(_rows(written, n, 50))
            written += n
            batch, info = rb.sample(return_info=True)
            out.append((batch.clone(), info))
            batch["td_error"] = batch["obs"][:, 0] * 0.01 + 0.05
            rb.update_tensordict_priority(batch)
        runs.append((out, rb))
    (ref, ref_rb), (got, rb) = runs
    ok = True
    for (a, info_a), (b, info_b) in zip(got, ref, strict=True):
        keys = list(a.keys(True, True))
        ok &= set(keys) == set(b.keys(True, True)) and list(info_a) == list(info_b)
        ok &= all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in keys)
        ok &= all(torch.equal(info_a[k], info_b[k]) for k in info_a)
    trees = [r.sampler._sum_tree for r in (rb, ref_rb)]
    ok &= all(trees[0][i] == trees[1][i] for i in range(capacity))
    return bool(ok)


def _run_capacity(capacity: int, args: argparse.Namespace, cases: list[str]) -> list[Result]:
    torchrl_sampler = _torchrl_compiled()
    buffers = _buffers(capacity, torchrl_sampler)
    _fill(buffers, capacity, args.seq_episode)
    correct = _agrees_with_torchrl(args.seed)
    params = {"capacity": capacity, "batch": BATCH, "length": LENGTH, "burn_in": BURN_IN}
    params["episode"] = args.seq_episode
    extra = {"torchrl_sampler": "compiled" if torchrl_sampler else "fastreplay"}
    results = []
    label = fmt_count(capacity)
    if "static" in cases:
        fns = {name: rb.sample for name, rb in buffers.items()}
        times = interleaved_seconds(fns, repeats=20 * args.repeats, warmup=3)
        ok = correct and all(_windows_valid(rb.sample()) for rb in buffers.values())
        print(_row(f"static sample {label}", times), flush=True)
        results.append(
            Result(
                NAME,
                f"static sample, {label}",
                times["fastreplay"],
                times["torchrl"],
                ok,
                params,
                extra,
            )
        )
    if "online" in cases:

        def step(rb):
            written = [capacity]  # each side continues its own stream

            def call() -> None:
                _online(rb, _rows(written[0], 1000, args.seq_episode))
                written[0] += 1000

            return call

        fns = {name: step(rb) for name, rb in buffers.items()}
        times = interleaved_seconds(fns, repeats=5 * args.repeats, warmup=2)
        ok = correct and all(_windows_valid(rb.sample()) for rb in buffers.values())
        print(_row(f"online step {label}", times), flush=True)
        results.append(
            Result(
                NAME,
                f"online step (extend 1000, sample, update priorities), {label}",
                times["fastreplay"],
                times["torchrl"],
                ok,
                params,
                extra,
            )
        )
    return results


def _row(label: str, times: dict) -> str:
    parts = [f"{name} {seconds * 1e3:.3f} ms" for name, seconds in times.items()]
    speedup = times["torchrl"] / times["fastreplay"]
    return f"  {label}: {', '.join(parts)}; torchrl/fastreplay {speedup:.2f}"


def run(args: argparse.Namespace) -> list[Result]:
    if not hasattr(fastreplay, "Sequence"):
        raise NotMeasured(
            f"TorchRL {fastreplay._torchrl.TORCHRL_VERSION} has no sample units "
            "(TorchRL 0.14 added them)"
        )
    cases = [c.strip() for c in args.seq_cases.split(",") if c.strip()]
    results = []
    for capacity in parse_counts(args.seq_capacity):
        results += _run_capacity(capacity, args, cases)
    return results

"""SliceSamplerWithoutReplacement: fastreplay vs TorchRL, online step and static sample.

Each side has its own ``LazyTensorStorage`` holding only ``("next", "done")`` flags (episodes
of ``--swor-episode-len`` steps). Cases:

* ``online``: ``extend(1000)`` then sample ``--swor-num-slices`` slices of
  ``--swor-slice-len`` steps, timed together;
* ``static``: ``sample`` only, no writes in between.

The two sides' repetitions are interleaved. Correctness: after the same writes and with the
same seed, both samplers return bit-identical indices and flags, and every slice stays in one
trajectory.
"""

from __future__ import annotations

import argparse

import torch
from torchrl.data import LazyTensorStorage, ReplayBuffer
from torchrl.data import SliceSamplerWithoutReplacement as TorchRLSliceSamplerWithoutReplacement

from benchmarks.harness import (
    Result,
    count_text,
    counts_text,
    fmt_count,
    positive_int,
    progress,
)
from benchmarks.scenarios.prioritized_slice import _done, interleaved_medians, run_sizes
from fastreplay import SliceSamplerWithoutReplacement

NAME = "slice_without_replacement"
DESCRIPTION = "SliceSamplerWithoutReplacement: online step (extend 1000 + sample) and static"

_CHUNK = 1 << 22
_DONE = ("next", "done")


def add_arguments(group: argparse._ArgumentGroup) -> None:
    group.add_argument(
        "--swor-stored",
        type=counts_text,
        default="1M",
        help="items stored, comma-separated (e.g. 1M,5M,50M)",
    )
    group.add_argument(
        "--swor-capacity",
        type=count_text,
        default=None,
        help="storage capacity (default: 1.2x the largest --swor-stored)",
    )
    group.add_argument(
        "--swor-episode-len", type=positive_int, default=1000, help="steps per episode"
    )
    group.add_argument(
        "--swor-num-slices", type=positive_int, default=256, help="slices per sampled batch"
    )
    group.add_argument("--swor-slice-len", type=positive_int, default=32, help="steps per slice")


def _slices_ok(storage: LazyTensorStorage, index: tuple, num_slices: int) -> bool:
    rows = index[0].view(num_slices, -1)
    step = (rows[:, 1:] - rows[:, :-1]) % storage._storage.shape[0]
    done = storage._storage.get(_DONE)[rows.reshape(-1)].view(num_slices, -1)
    return bool((step == 1).all()) and not bool(done[:, :-1].any())


def run(args: argparse.Namespace) -> list[Result]:
    return run_sizes(args.swor_stored, args.swor_capacity, lambda n, c: _run_size(args, n, c))


def _online_step(
    rb: ReplayBuffer, sampler, offset: list[int], batch: int, episode_len: int
) -> tuple[tuple, dict]:
    steps = torch.arange(offset[0], offset[0] + 1000)
    offset[0] += 1000
    rb.extend(_done(steps, episode_len))
    return sampler.sample(rb._storage, batch)


def _run_size(args: argparse.Namespace, stored: int, capacity: int) -> list[Result]:
    batch = args.swor_num_slices * args.swor_slice_len
    ep = args.swor_episode_len
    kw = {"slice_len": args.swor_slice_len, "end_key": _DONE}
    fast = SliceSamplerWithoutReplacement(**kw)
    ref = TorchRLSliceSamplerWithoutReplacement(**kw)
    buffers = [
        ReplayBuffer(storage=LazyTensorStorage(capacity), sampler=s, batch_size=batch)
        for s in (fast, ref)
    ]
    with progress(stored, f"fill {fmt_count(stored)} (episodes of {ep})") as bar:
        for lo in range(0, stored, _CHUNK):
            steps = torch.arange(lo, min(lo + _CHUNK, stored))
            for rb in buffers:
                rb.extend(_done(steps, ep))
            bar(steps.numel())
    storages = [rb._storage for rb in buffers]

    t_fast_static, t_tr_static = interleaved_medians(
        [lambda: fast.sample(storages[0], batch), lambda: ref.sample(storages[1], batch)],
        [25, 25],
    )
    offsets = [[stored], [stored]]
    t_fast_online, t_tr_online = interleaved_medians(
        [
            lambda: _online_step(buffers[0], fast, offsets[0], batch, ep),
            lambda: _online_step(buffers[1], ref, offsets[1], batch, ep),
        ],
        [25, max(3, min(args.repeats, 7))],
    )
    # Same writes, same seed: bit-identical samples (both start a fresh epoch).
    while offsets[1][0] < offsets[0][0]:
        _online_step(buffers[1], ref, offsets[1], batch, ep)
    for sampler in (fast, ref):
        sampler._sample_list = None
        sampler._rng = torch.Generator().manual_seed(args.seed)
    (idx_f, info_f), (idx_t, info_t) = (
        fast.sample(storages[0], batch),
        ref.sample(storages[1], batch),
    )
    fast._rng = ref._rng = None
    correct = all(torch.equal(a, b) for a, b in zip(idx_f, idx_t, strict=True))
    correct &= all(torch.equal(info_f[k], info_t[k]) for k in info_t)
    correct &= _slices_ok(storages[0], idx_f, args.swor_num_slices)

    params = {
        "capacity": capacity,
        "stored": stored,
        "episode_len": ep,
        "num_slices": args.swor_num_slices,
        "slice_len": args.swor_slice_len,
    }
    size = f"{fmt_count(capacity)}/{fmt_count(stored)} ep{ep}"
    return [
        Result(NAME, f"{size} online", t_fast_online, t_tr_online, correct, params),
        Result(NAME, f"{size} static", t_fast_static, t_tr_static, correct, params),
    ]

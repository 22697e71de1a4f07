"""SliceSamplerWithoutReplacement: fastreplay vs TorchRL, online step and static sample.

Each side has its own ``LazyTensorStorage`` holding only ``("next", "done")`` flags (episodes
of ``--swor-episode-len`` steps). Cases:

* ``online``: ``extend(1000)`` then sample ``--swor-num-slices`` slices of
  ``--swor-slice-len`` steps, timed together;
* ``static``: ``sample`` only, no writes in between.

The two sides' repetitions are interleaved. Correctness, after the same writes: with
``shuffle=False`` and the same seed both samplers return bit-identical indices and flags; with
``shuffle=True`` (where fastreplay draws its epoch permutation differently) every slice stays in
one trajectory of TorchRL's boundaries, a batch holds ``num_slices`` distinct trajectories and
consecutive batches of one epoch never repeat one. A size that stores fewer trajectories than
``--swor-num-slices`` (or episodes shorter than a slice) is refused with a message.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np
import torch
from torchrl.data import LazyTensorStorage, ReplayBuffer
from torchrl.data import SliceSamplerWithoutReplacement as TorchRLSliceSamplerWithoutReplacement

from benchmarks.arguments import swor_refusal
from benchmarks.harness import (
    Result,
    fmt_count,
    progress,
)
from benchmarks.scenarios.prioritized_slice import (
    _CHUNK,
    _DONE,
    _done,
    interleaved_medians,
    run_sizes,
)
from fastreplay import SliceSamplerWithoutReplacement

NAME = "slice_without_replacement"


def _slices_ok(storage: LazyTensorStorage, index: tuple, num_slices: int) -> bool:
    rows = index[0].view(num_slices, -1)
    step = (rows[:, 1:] - rows[:, :-1]) % storage._storage.shape[0]
    done = storage._storage.get(_DONE)[rows.reshape(-1)].view(num_slices, -1)
    return bool((step == 1).all()) and not bool(done[:, :-1].any())


def run(args: argparse.Namespace) -> list[Result]:
    def run_size(stored: int, capacity: int) -> list[Result]:
        why = swor_refusal(args, stored, capacity)
        if why is not None:
            print(f"  {NAME}: skipped {fmt_count(stored)} stored: {why}", file=sys.stderr)
            return []
        return _run_size(args, stored, capacity)

    return run_sizes(args.swor_stored, args.swor_capacity, run_size)


def _trajectory_of(
    ref: TorchRLSliceSamplerWithoutReplacement, storage: LazyTensorStorage, rows: torch.Tensor
) -> np.ndarray:
    """Number of the trajectory (TorchRL's boundaries) holding each row, -1 where none does."""
    start, stop, _ = ref._get_stop_and_length(storage)
    start, stop = start[:, 0].numpy(), stop[:, 0].numpy()
    size = storage._storage.shape[0]
    order = np.argsort(start, kind="stable")
    rows = rows.numpy()
    # The last trajectory starting at or before the row (or the one wrapping past the end).
    found = order[(np.searchsorted(start[order], rows, side="right") - 1) % len(order)]
    inside = (rows - start[found]) % size <= (stop[found] - start[found]) % size
    return np.where(inside, found, -1)


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
    # Same writes: with shuffle=False and the same seed, bit-identical samples.
    while offsets[1][0] < offsets[0][0]:
        _online_step(buffers[1], ref, offsets[1], batch, ep)
    num_slices = args.swor_num_slices
    for sampler in (fast, ref):
        sampler.shuffle, sampler._sample_list = False, None
        sampler._rng = torch.Generator().manual_seed(args.seed)
    (idx_f, info_f), (idx_t, info_t) = (
        fast.sample(storages[0], batch),
        ref.sample(storages[1], batch),
    )
    correct = all(torch.equal(a, b) for a, b in zip(idx_f, idx_t, strict=True))
    correct &= all(torch.equal(info_f[k], info_t[k]) for k in info_t)
    # shuffle=True: valid slices of distinct trajectories, none repeated within an epoch.
    fast.shuffle, fast._sample_list, ref.shuffle = True, None, True
    epoch = min(4, ref._storage_len_buffer // num_slices)
    seen = []
    for _ in range(epoch):
        idx_f, _ = fast.sample(storages[0], batch)
        slices = idx_f[0].numel() // args.swor_slice_len  # fewer if short episodes were drawn
        correct &= slices > num_slices // 2 and _slices_ok(storages[0], idx_f, slices)
        firsts = idx_f[0].view(slices, -1)[:, 0]
        seen.append(_trajectory_of(ref, storages[1], firsts))
    seen = np.concatenate(seen)
    correct &= bool((seen >= 0).all()) and np.unique(seen).size == seen.size
    fast._rng = ref._rng = None

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

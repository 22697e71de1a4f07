"""PrioritizedSliceSampler: fastreplay vs TorchRL, online step and static sample.

Each side has its own ``LazyTensorStorage`` holding only ``("next", "done")`` flags (episodes
of ``--pslice-episode-len`` steps) and its own sampler; both get the same priorities. Cases:

* ``online``: ``extend(1000)``, sample ``--pslice-num-slices`` slices of
  ``--pslice-slice-len`` steps, then ``update_priority`` of the sampled steps, timed together.
* ``static``: ``sample`` only, no writes in between (TorchRL with ``cache_values=True``).

The two sides' repetitions are interleaved. Correctness: every slice of both sides stays in
one trajectory (consecutive rows, a done flag only on its last step) and fastreplay's weights
equal ``(m_start / m_min) ** -beta`` recomputed from its trees.
"""

from __future__ import annotations

import argparse
import gc
from collections.abc import Callable

import torch
from tensordict import TensorDict
from torchrl.data import LazyTensorStorage, ReplayBuffer
from torchrl.data import PrioritizedSliceSampler as TorchRLPrioritizedSliceSampler

from benchmarks.harness import (
    Result,
    fmt_count,
    interleaved_seconds,
    progress,
    sizes_and_capacity,
)
from fastreplay import PrioritizedSliceSampler

NAME = "prioritized_slice"

_CHUNK = 1 << 22
_DONE = ("next", "done")
_ALPHA, _BETA = 0.7, 0.5


def interleaved_medians(fns: list[Callable[[], object]], repeats: list[int]) -> list[float]:
    """Median time of each ``fns[i]`` over ``repeats[i]`` calls, the calls interleaved."""
    times = interleaved_seconds(dict(enumerate(fns)), repeats=dict(enumerate(repeats)))
    return [times[i] for i in range(len(fns))]


def _done(steps: torch.Tensor, episode_len: int) -> TensorDict:
    return TensorDict({_DONE: (steps % episode_len == episode_len - 1)[:, None]}, [len(steps)])


def _priority(steps: torch.Tensor) -> torch.Tensor:
    """Deterministic pseudo-random priorities in [0.1, 2.1) for global steps ``steps``."""
    return (0.1 + 2.0 * ((steps * 2654435761) % 1000003).double() / 1000003).float()


def _slices_ok(storage: LazyTensorStorage, index: tuple, info: dict) -> bool:
    rows, truncated = index[0], info[("next", "truncated")].view(-1)
    ends = truncated.nonzero().view(-1)
    step = (rows[1:] - rows[:-1]) % storage._storage.shape[0]
    inside = torch.ones_like(truncated)
    inside[ends] = False  # last step of each slice
    if not bool((step[inside[:-1]] == 1).all()):
        return False
    done = storage._storage.get(_DONE)[rows].view(-1)
    return not bool((done & inside).any())


def run_sizes(
    stored: str, capacity: str | None, run_size: Callable[[int, int], list[Result]]
) -> list[Result]:
    """``run_size(items stored, capacity)`` for each comma-separated size in ``stored``.

    ``capacity`` defaults to 1.2x the largest size, so every size shares one capacity.
    """
    sizes, slots = sizes_and_capacity(stored, capacity)
    results = []
    for size in sizes:
        results.extend(run_size(size, slots))
        gc.collect()
    return results


def run(args: argparse.Namespace) -> list[Result]:
    return run_sizes(args.pslice_stored, args.pslice_capacity, lambda n, c: _run_size(args, n, c))


def _online_step(
    rb: ReplayBuffer, sampler, offset: list[int], batch: int, episode_len: int
) -> tuple[tuple, dict]:
    """extend(1000), sample, update the sampled steps' priorities."""
    steps = torch.arange(offset[0], offset[0] + 1000)
    offset[0] += 1000
    rb.extend(_done(steps, episode_len))
    index, info = sampler.sample(rb._storage, batch)
    rb.update_priority(index, _priority(index[0] + offset[0]))
    return index, info


def _run_size(args: argparse.Namespace, stored: int, capacity: int) -> list[Result]:
    batch = args.pslice_num_slices * args.pslice_slice_len
    ep = args.pslice_episode_len
    kw = {"slice_len": args.pslice_slice_len, "end_key": _DONE}
    fast = PrioritizedSliceSampler(capacity, _ALPHA, _BETA, **kw)
    ref = TorchRLPrioritizedSliceSampler(capacity, _ALPHA, _BETA, **kw)
    ref_static = TorchRLPrioritizedSliceSampler(capacity, _ALPHA, _BETA, cache_values=True, **kw)
    samplers = (fast, ref, ref_static)
    buffers = [
        ReplayBuffer(storage=LazyTensorStorage(capacity), sampler=s, batch_size=batch)
        for s in samplers
    ]
    with progress(stored, f"fill {fmt_count(stored)} (episodes of {ep})") as bar:
        for lo in range(0, stored, _CHUNK):
            steps = torch.arange(lo, min(lo + _CHUNK, stored))
            for rb in buffers:
                index = rb.extend(_done(steps, ep))
                rb.update_priority(index, _priority(steps))
            bar(steps.numel())
    storages = [rb._storage for rb in buffers]

    # Static: no writes between samples (TorchRL with its cache), interleaved.
    t_fast_static, t_tr_static = interleaved_medians(
        [lambda: fast.sample(storages[0], batch), lambda: ref_static.sample(storages[2], batch)],
        [25, 25],
    )
    idx_s, info_s = ref_static.sample(storages[2], batch)
    correct = _slices_ok(storages[2], idx_s, info_s)

    # Online: one checked step on each side, then interleaved timing.
    offsets = [[stored], [stored]]
    idx_f, info_f = _online_step(buffers[0], fast, offsets[0], batch, ep)
    idx_t, info_t = _online_step(buffers[1], ref, offsets[1], batch, ep)
    correct &= _slices_ok(storages[0], idx_f, info_f) and _slices_ok(storages[1], idx_t, info_t)
    fns = [lambda: _online_step(buffers[0], fast, offsets[0], batch, ep)]
    repeats = [25]
    if stored <= args.pslice_skip_torchrl_online_above:
        fns.append(lambda: _online_step(buffers[1], ref, offsets[1], batch, ep))
        repeats.append(max(3, min(args.repeats, 7)))
    medians = interleaved_medians(fns, repeats)
    # fastreplay's weights: (m_start / m_min) ** -beta from its own trees, per step.
    idx_f, info_f = fast.sample(storages[0], batch)
    starts = idx_f[0].view(args.pslice_num_slices, -1)[:, 0]  # strict slices: equal lengths
    mass = fast._trees.mass(starts).to(torch.float64)
    weight = torch.pow(mass / fast._trees.min_mass(), -_BETA).to(torch.float32)
    weight = weight.repeat_interleave(args.pslice_slice_len)
    correct &= _slices_ok(storages[0], idx_f, info_f)
    correct &= bool(torch.allclose(info_f["priority_weight"], weight))

    params = {
        "capacity": capacity,
        "stored": stored,
        "episode_len": ep,
        "num_slices": args.pslice_num_slices,
        "slice_len": args.pslice_slice_len,
    }
    size = f"{fmt_count(capacity)}/{fmt_count(stored)} ep{ep}"
    t_tr_online = medians[1] if len(medians) > 1 else None
    return [
        Result(NAME, f"{size} online", medians[0], t_tr_online, correct, params),
        Result(NAME, f"{size} static", t_fast_static, t_tr_static, correct, params),
    ]

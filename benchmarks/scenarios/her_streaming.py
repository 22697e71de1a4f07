"""HERReplayBuffer, StreamingSliceSampler and can_sample after a write: fastreplay vs TorchRL.

Each side has its own ``LazyTensorStorage`` of ``stored + 100k`` rows (room for the online
writes, so TorchRL's ``HERReplayBuffer`` never wraps: its episode cache raises once full),
filled with episodes of ``--hs-episode-len`` steps. Cases, each an online step timed whole:

* ``her``: ``extend(1000)`` then ``sample(--hs-batch)`` of an ``HERReplayBuffer``
  (``strategy="future"``); TorchRL rereads every done flag at that sample.
* ``streaming``: ``extend(1000)`` then ``sample`` of ``--hs-batch`` slices of 32 steps from a
  ``StreamingSliceSampler``: 31 fresh windows, the rest from the uniform fallback, which
  TorchRL draws after rescanning every stored trajectory boundary.
* ``can_sample``: ``extend(1000)`` then ``SliceSampler.can_sample`` (what ``sample(wait=True)``,
  ``wait_until_sampleable`` and the nightly's ``RateLimitedReplayBuffer`` ask).

Both sides run the same number of steps, interleaved. Correctness, after them: the same seed
gives the same HER sample (every key) and the same streaming indices and info, and
``can_sample``/``_sampleable_count`` give TorchRL's answers.
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
import torchrl.data as trl
from tensordict import TensorDict
from torchrl.data import LazyTensorStorage

import fastreplay
from benchmarks.harness import (
    NotMeasured,
    Result,
    fmt_count,
    progress,
)
from benchmarks.scenarios.prioritized_slice import interleaved_medians

NAME = "her_streaming"

_CHUNK = 1 << 22
_ROOM = 100_000  # rows left free for the online writes
_SLICE = 32


def _her_data(steps: torch.Tensor, episode_len: int) -> TensorDict:
    obs = (steps // episode_len) * 10_000 + steps % episode_len
    n = len(steps)
    return TensorDict(
        {
            "desired_goal": torch.full((n, 1), -1),
            "achieved_goal": obs[:, None],
            ("next", "reward"): torch.zeros(n, 1),
            ("next", "done"): (steps % episode_len == episode_len - 1)[:, None],
        },
        [n],
    )


def _done(steps: torch.Tensor, episode_len: int) -> TensorDict:
    return TensorDict(
        {("next", "done"): (steps % episode_len == episode_len - 1)[:, None]}, [len(steps)]
    )


def _reward(td: Any) -> torch.Tensor:
    return (td["achieved_goal"] == td["desired_goal"]).all(-1, keepdim=True).float()


def _fill(buffers: list[Any], stored: int, make: Any, ep: int, desc: str) -> None:
    with progress(stored * len(buffers), desc) as bar:
        for lo in range(0, stored, _CHUNK):
            steps = torch.arange(lo, min(lo + _CHUNK, stored))
            for rb in buffers:
                rb.extend(make(steps, ep))
                bar(steps.numel())


def _online(rb: Any, make: Any, offset: list[int], ep: int, then: Any) -> Any:
    steps = torch.arange(offset[0], offset[0] + 1000)
    offset[0] += 1000
    rb.extend(make(steps, ep))
    return then()


def _same(a: Any, b: Any) -> bool:
    keys = set(a.keys(True, True))
    return keys == set(b.keys(True, True)) and all(torch.equal(a[k], b[k]) for k in keys)


def _her(args: argparse.Namespace, stored: int, params: dict) -> Result:
    ep, batch = args.hs_episode_len, args.hs_batch
    capacity = stored + _ROOM
    buffers = [
        cls(reward_fn=_reward, storage=LazyTensorStorage(capacity), batch_size=batch)
        for cls in (fastreplay.HERReplayBuffer, trl.HERReplayBuffer)
    ]
    _fill(buffers, stored, _her_data, ep, f"fill HER {fmt_count(stored)}")
    offsets = [[stored], [stored]]
    calls = [rb.sample for rb in buffers]
    t_fast, t_ref = _online_medians(args, buffers, _her_data, offsets, ep, calls)
    samples = []
    for rb in buffers:
        torch.manual_seed(args.seed)
        samples.append(rb.sample())
    correct = offsets[0] == offsets[1] and _same(*samples)
    return Result(
        NAME, f"her sample after extend(1000), {fmt_count(stored)}", t_fast, t_ref, correct, params
    )


def _slice_pair(name: str, stored: int, ep: int, desc: str) -> tuple[list, list]:
    """The sampler ``name`` of fastreplay and of TorchRL (32-step slices), in TorchRL's buffers.

    Each buffer is filled with ``stored`` steps of done flags.
    """
    samplers = [
        getattr(module, name)(slice_len=_SLICE, end_key=("next", "done"))
        for module in (fastreplay, trl)
    ]
    buffers = [
        trl.TensorDictReplayBuffer(storage=LazyTensorStorage(stored + _ROOM), sampler=s)
        for s in samplers
    ]
    _fill(buffers, stored, _done, ep, f"fill {desc} {fmt_count(stored)}")
    return samplers, buffers


def _online_medians(
    args: argparse.Namespace, buffers: list, make: Any, offsets: list, ep: int, calls: list
) -> tuple[float, float]:
    """Medians of ``extend(1000)`` (rows from ``make``) + ``calls[i]()`` on ``buffers[i]``."""
    repeats = max(3, min(args.repeats, 9))
    return interleaved_medians(
        [
            lambda i=i: _online(buffers[i], make, offsets[i], ep, calls[i])
            for i in range(len(buffers))
        ],
        [repeats] * len(buffers),
    )


def _streaming(args: argparse.Namespace, stored: int, params: dict) -> Result:
    ep, batch = args.hs_episode_len, args.hs_batch * _SLICE
    samplers, buffers = _slice_pair("StreamingSliceSampler", stored, ep, "streaming")
    for rb, sampler in zip(buffers, samplers, strict=True):  # serve the windows queued by the fill
        while len(sampler._queued_slices) > args.hs_batch:
            rb.sample(batch)
    offsets = [[stored], [stored]]
    t_fast, t_ref = _online_medians(
        args,
        buffers,
        _done,
        offsets,
        ep,
        [
            lambda s=s, rb=rb: s.sample(rb.storage, batch)
            for s, rb in zip(samplers, buffers, strict=True)
        ],
    )
    results = []
    for rb, sampler in zip(buffers, samplers, strict=True):
        sampler._rng = torch.Generator().manual_seed(args.seed)
        results.append(
            _online(
                rb, _done, [offsets[0][0]], ep, lambda s=sampler, r=rb: s.sample(r.storage, batch)
            )
        )
        sampler._rng = None
    (idx_f, info_f), (idx_t, info_t) = results
    correct = all(torch.equal(a, b) for a, b in zip(idx_f, idx_t, strict=True))
    correct &= info_f.keys() == info_t.keys() and all(
        torch.equal(info_f[k], info_t[k]) for k in info_t
    )
    return Result(
        NAME,
        f"streaming sample after extend(1000), {fmt_count(stored)}",
        t_fast,
        t_ref,
        bool(correct),
        params,
    )


def _can_sample(args: argparse.Namespace, stored: int, params: dict) -> Result:
    ep, batch = args.hs_episode_len, args.hs_batch * _SLICE
    samplers, buffers = _slice_pair("SliceSampler", stored, ep, "can_sample")
    offsets = [[stored], [stored]]
    t_fast, t_ref = _online_medians(
        args,
        buffers,
        _done,
        offsets,
        ep,
        [
            lambda s=s, rb=rb: s.can_sample(rb.storage, batch)
            for s, rb in zip(samplers, buffers, strict=True)
        ],
    )
    answers = [
        (s.can_sample(rb.storage, batch), int(s._sampleable_count(rb.storage, batch)))
        for s, rb in zip(samplers, buffers, strict=True)
    ]
    correct = answers[0] == answers[1] and answers[0][0]
    return Result(
        NAME,
        f"can_sample after extend(1000), {fmt_count(stored)}",
        t_fast,
        t_ref,
        bool(correct),
        params,
    )


def run(args: argparse.Namespace) -> list[Result]:
    if not hasattr(trl, "StreamingSliceSampler") or not hasattr(trl.SliceSampler, "can_sample"):
        raise NotMeasured("this TorchRL has no StreamingSliceSampler / can_sample (0.13)")
    results = []
    for stored in sorted({int(s) for s in _sizes(args.hs_stored)}):
        params = {
            "stored": stored,
            "capacity": stored + _ROOM,
            "episode_len": args.hs_episode_len,
            "batch": args.hs_batch,
        }
        for case in (_her, _streaming, _can_sample):
            results.append(case(args, stored, params))
    return results


def _sizes(text: str) -> list[int]:
    from benchmarks.harness import parse_counts

    return parse_counts(text)

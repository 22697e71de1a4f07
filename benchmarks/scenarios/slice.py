"""SliceSampler: fastreplay vs TorchRL on a large, partly filled storage (pytorch/rl #2669).

One ``LazyTensorStorage`` holding only the boundary key (``("next", "done")`` flags or
``"traj"`` ids) is shared by both samplers. Cases:

* ``static``: no writes between samples; TorchRL uses ``cache_values=True``.
* ``online``: ``extend(1000)`` then ``sample``, timed together (the extend is the same code for
  both; each write bumps the storage revision, so TorchRL rescans the storage).
* ``rotate<k>``: a full storage of ``--rotate-items`` items, episodes of 1 to 3 x
  ``--slice-len`` steps, and each ``sample`` asks for the next of ``k`` slice lengths
  (``--rotate-lengths``, around ``--slice-len``), static and online as above: with
  ``strict_length`` the short episodes are filtered per length.

Both samplers get the same seed before one online sample (one per slice length in the rotating
cases): their indices must be identical, and every slice must stay inside one trajectory.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from tensordict import TensorDict
from torchrl.data import LazyTensorStorage, ReplayBuffer
from torchrl.data import SliceSampler as TorchRLSliceSampler

from benchmarks.harness import (
    Result,
    fmt_count,
    interleaved_seconds,
    parse_count,
    parse_counts,
    progress,
)
from fastreplay import SliceSampler

NAME = "slice"

_CHUNK = 1 << 23
_DONE = ("next", "done")


def _fill(rb: ReplayBuffer, stored: int, episode_len: int, end: str, offset: int = 0) -> None:
    with progress(stored, f"fill {fmt_count(stored)} ({end}, episodes of {episode_len})") as bar:
        for lo in range(0, stored, _CHUNK):
            steps = torch.arange(offset + lo, offset + min(lo + _CHUNK, stored))
            rb.extend(_steps_data(steps, episode_len, end))
            bar(steps.numel())


def _slices_ok(storage: LazyTensorStorage, index: tuple, num_slices: int, end: str) -> bool:
    rows = index[0].view(num_slices, -1)
    step = (rows[:, 1:] - rows[:, :-1]) % storage._storage.shape[0]
    if not bool((step == 1).all()):
        return False
    if end == "done":  # a done flag may only sit on the last step of a slice
        done = storage._storage.get(_DONE)[index[0]].view(num_slices, -1)
        return not bool(done[:, :-1].any())
    traj = storage._storage.get("traj")[index[0]].view(num_slices, -1)
    return bool((traj == traj[:, :1]).all())


def _hwm_bytes() -> tuple[int, int]:
    """(peak RSS, current RSS) in bytes, from /proc/self/status."""
    fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines())
    return int(fields["VmHWM"].split()[0]) * 1024, int(fields["VmRSS"].split()[0]) * 1024


def _peak_extra_bytes(fn) -> int | None:
    """Peak RSS growth while ``fn`` runs (Linux: resets the high-water mark first)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        _, rss = _hwm_bytes()
        fn()
        hwm_after, _ = _hwm_bytes()
        return max(hwm_after - rss, 0)
    except OSError:
        return None


def run(args: argparse.Namespace) -> list[Result]:
    capacity, stored = parse_count(args.capacity), parse_count(args.stored)
    batch = args.num_slices * args.slice_len
    results = []
    for end in [e.strip() for e in args.end.split(",") if e.strip()]:
        for episode_len in [parse_count(x) for x in args.episode_len.split(",")]:
            key = {"end_key": _DONE} if end == "done" else {"traj_key": "traj"}
            storage = LazyTensorStorage(capacity)
            fast = SliceSampler(num_slices=args.num_slices, **key)
            rb = ReplayBuffer(storage=storage, sampler=fast, batch_size=batch)
            _fill(rb, stored, episode_len, end)
            online = TorchRLSliceSampler(num_slices=args.num_slices, **key)
            static = TorchRLSliceSampler(num_slices=args.num_slices, cache_values=True, **key)
            written = [stored]

            def write_1000(rb=rb, episode_len=episode_len, end=end, written=written) -> None:
                _fill_quiet(rb, 1000, episode_len, end, written[0])
                written[0] += 1000

            fast.sample(storage, batch)  # first sample: indexes the fill (untimed, like
            static.sample(storage, batch)  # TorchRL's cache fill)
            static_times = interleaved_seconds(
                {
                    "fastreplay": lambda f=fast, s=storage: f.sample(s, batch),
                    "torchrl": lambda t=static, s=storage: t.sample(s, batch),
                },
                repeats=25,
            )
            t_fast_static, t_tr_static = static_times["fastreplay"], static_times["torchrl"]
            extra = _peak_extra_bytes(lambda f=fast, s=storage: f.sample(s, batch))

            # Same seed, same storage: bit-identical indices, all slices inside one trajectory.
            write_1000()
            fast._rng = torch.Generator().manual_seed(args.seed)
            online._rng = torch.Generator().manual_seed(args.seed)
            idx_fast, _ = fast.sample(storage, batch)
            idx_tr, _ = online.sample(storage, batch)
            fast._rng = online._rng = None
            correct = all(torch.equal(a, b) for a, b in zip(idx_fast, idx_tr, strict=True))
            correct &= _slices_ok(storage, idx_fast, args.num_slices, end)
            correct &= _slices_ok(storage, idx_tr, args.num_slices, end)

            def online_fast(f=fast, w=write_1000, s=storage) -> None:
                w()
                f.sample(s, batch)

            def online_tr(o=online, w=write_1000, s=storage) -> None:
                w()
                o.sample(s, batch)

            repeats = max(3, min(args.repeats, 7))
            online_times = interleaved_seconds(
                {"fastreplay": online_fast, "torchrl": online_tr},
                repeats={"fastreplay": 25, "torchrl": repeats},
            )
            t_fast_online, t_tr_online = online_times["fastreplay"], online_times["torchrl"]
            params = {
                "capacity": capacity,
                "stored": stored,
                "episode_len": episode_len,
                "end": end,
                "num_slices": args.num_slices,
                "slice_len": args.slice_len,
            }
            size = f"{fmt_count(capacity)}/{fmt_count(stored)} ep{episode_len} {end}"
            info = {
                "index_bytes": fast._fr_index.nbytes(),
                "trajectories": fast._fr_index.num_trajectories,
                "sample_peak_extra_bytes": extra,
            }
            results.append(
                Result(NAME, f"{size} static", t_fast_static, t_tr_static, correct, params, info)
            )
            results.append(
                Result(NAME, f"{size} online", t_fast_online, t_tr_online, correct, params, info)
            )
            print(
                f"  {size}: index {info['index_bytes'] / 2**20:.1f} MiB for "
                f"{info['trajectories']:,} trajectories; sample peak extra RSS "
                f"{'n/a' if extra is None else f'{extra / 2**20:.1f} MiB'}",
                flush=True,
            )
            del rb, fast, online, static
    if args.rotate_lengths:
        results += _rotating(args)
    return results


def _episodes(slice_len: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """One period of 97 episodes of 1 to 3 x ``slice_len`` steps: done flags and episode ids."""
    lengths = 1 + (torch.arange(97) * 37) % (3 * slice_len)
    ends = torch.cumsum(lengths, 0)
    done = torch.zeros(int(ends[-1]), dtype=torch.bool)
    done[ends - 1] = True
    return done, torch.searchsorted(ends, torch.arange(int(ends[-1])), right=True), 97


def _varied_data(steps: torch.Tensor, period: tuple, end: str) -> TensorDict:
    done, episode, count = period
    where = steps % done.numel()
    if end == "done":
        return TensorDict({_DONE: done[where][:, None]}, [len(steps)])
    return TensorDict({"traj": steps // done.numel() * count + episode[where]}, [len(steps)])


def _rotating(args: argparse.Namespace) -> list[Result]:
    """Slice lengths rotating from one sample to the next, on full storages."""
    lengths = [args.slice_len + i - args.rotate_lengths // 2 for i in range(args.rotate_lengths)]
    period = _episodes(args.slice_len)
    results = []
    for end in [e.strip() for e in args.end.split(",") if e.strip()]:
        for items in parse_counts(args.rotate_items):
            key = {"end_key": _DONE} if end == "done" else {"traj_key": "traj"}
            storage = LazyTensorStorage(items)
            fast = SliceSampler(num_slices=args.num_slices, **key)
            rb = ReplayBuffer(storage=storage, sampler=fast, batch_size=args.num_slices)
            with progress(items, f"fill {fmt_count(items)} ({end}, varied episodes)") as bar:
                for lo in range(0, items, _CHUNK):
                    steps = torch.arange(lo, min(lo + _CHUNK, items))
                    rb.extend(_varied_data(steps, period, end))
                    bar(steps.numel())
            online = TorchRLSliceSampler(num_slices=args.num_slices, **key)
            static = TorchRLSliceSampler(num_slices=args.num_slices, cache_values=True, **key)
            written = [items]

            def write_1000(rb=rb, end=end, written=written) -> None:
                steps = torch.arange(written[0], written[0] + 1000)
                rb.extend(_varied_data(steps, period, end))
                written[0] += 1000

            def rotate(sampler, storage=storage, write=None):
                turn = [0]

                def call() -> None:
                    if write is not None:
                        write()
                    length = lengths[turn[0] % len(lengths)]
                    turn[0] += 1
                    sampler.sample(storage, args.num_slices * length)

                return call

            for length in lengths:  # untimed: each length's first sample builds its state
                fast.sample(storage, args.num_slices * length)
                static.sample(storage, args.num_slices * length)
            rows_built = sum(c.eligible.counts.builds for c in fast._fr_index.cols)
            static_times = interleaved_seconds(
                {"fastreplay": rotate(fast), "torchrl": rotate(static)},
                repeats=3 * len(lengths),
            )
            correct = True
            for length in lengths:  # same seed, same storage: bit-identical, inside trajectories
                write_1000()
                fast._rng = torch.Generator().manual_seed(args.seed)
                online._rng = torch.Generator().manual_seed(args.seed)
                idx_fast, _ = fast.sample(storage, args.num_slices * length)
                idx_tr, _ = online.sample(storage, args.num_slices * length)
                correct &= all(torch.equal(a, b) for a, b in zip(idx_fast, idx_tr, strict=True))
                correct &= _slices_ok(storage, idx_fast, args.num_slices, end)
            fast._rng = online._rng = None
            online_times = interleaved_seconds(
                {
                    "fastreplay": rotate(fast, write=write_1000),
                    "torchrl": rotate(online, write=write_1000),
                },
                repeats={"fastreplay": 3 * len(lengths), "torchrl": max(3, min(args.repeats, 7))},
            )
            index = fast._fr_index
            info = {
                "index_bytes": index.nbytes(),
                "trajectories": index.num_trajectories,
                "slice_lengths": lengths,
                # after the first sample of each length: 0 (no rebuild per sample)
                "length_rows_rebuilt": sum(c.eligible.counts.builds for c in index.cols)
                - rows_built,
            }
            correct &= info["length_rows_rebuilt"] == 0
            params = {
                "capacity": items,
                "stored": items,
                "end": end,
                "num_slices": args.num_slices,
                "slice_lengths": lengths,
            }
            size = f"{fmt_count(items)} rotate{len(lengths)} {end}"
            for case, times in (("static", static_times), ("online", online_times)):
                results.append(
                    Result(
                        NAME,
                        f"{size} {case}",
                        times["fastreplay"],
                        times["torchrl"],
                        correct,
                        params,
                        info,
                    )
                )
            print(
                f"  {size}: index {info['index_bytes'] / 2**20:.1f} MiB for "
                f"{info['trajectories']:,} trajectories; slice lengths {lengths}",
                flush=True,
            )
            del rb, fast, online, static
    return results


def _fill_quiet(rb: ReplayBuffer, n: int, episode_len: int, end: str, offset: int) -> None:
    rb.extend(_steps_data(torch.arange(offset, offset + n), episode_len, end))


def _steps_data(steps: torch.Tensor, episode_len: int, end: str) -> TensorDict:
    """The boundary key for global steps ``steps``: done flags or trajectory ids."""
    if end == "done":
        return TensorDict({_DONE: (steps % episode_len == episode_len - 1)[:, None]}, [len(steps)])
    return TensorDict({"traj": steps // episode_len}, [len(steps)])

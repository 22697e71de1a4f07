"""Writer processes x one learner on a shared storage: fastreplay vs TorchRL, same topology.

TorchRL's collector topology: the learner builds a ``shared=True`` buffer on
``LazyMemmapStorage(shared_init=True)``, prefills it, then ``N`` forked writer processes
``extend`` episodes as fast as they can while the learner samples for a fixed time:

* ``prioritized``: ``TensorDictPrioritizedReplayBuffer(sync=False)``; a learner step is
  ``sample`` + ``update_tensordict_priority``. Storage full at ``--scale-capacity``.
* ``slice``: ``TensorDictReplayBuffer`` + ``SliceSampler`` (``traj_key``); a learner step is
  ``sample``. ``--scale-slice-stored`` items prefilled in ``--scale-slice-capacity``.

Reported per case: learner throughput in steps/s (learner steps / seconds spent in them, that
is 1 / the mean step; the sample checks between steps are not counted), which the table shows,
with speedup = fastreplay steps/s / TorchRL steps/s; the median step (``results.json``); items
written/s by all writers together; and invalid samples (a row nobody wrote, ``obs`` not
matching its trajectory, a slice crossing episodes): ``correct`` means zero on both sides.
With ``--scale-ray`` the same workload also runs through ``RayReplayBuffer`` (writer tasks,
the learner is the driver) for fastreplay's buffers, without a TorchRL comparison.

Rows are tagged: writer ``w`` writes trajectory ids ``w * 10**9 + episode``, the prefill is
written as the writer after the last one, and ``obs = traj * 10_000 + step in the episode``
(so episodes are at most 10,000 steps long).
"""

from __future__ import annotations

import argparse
import functools
import multiprocessing
import statistics
import time
from typing import Any

import torch
import torchrl.data as trl
from tensordict import TensorDict
from torchrl.data import LazyMemmapStorage, LazyTensorStorage

import fastreplay
from benchmarks.arguments import SCALE_STEP_LIMIT, SCALE_TRAJ_STRIDE, scale_slices
from benchmarks.harness import (
    Result,
    fmt_count,
    parse_count,
    parse_counts,
    progress,
)

NAME = "scale-out"
ALPHA, BETA = 0.7, 0.5
_PREFILL_CHUNK = 1 << 20


def _episodes(writer: int, first_step: int, n: int, episode: int) -> TensorDict:
    """``n`` steps from global step ``first_step`` of ``writer``: obs = traj * 10_000 + step."""
    steps = torch.arange(first_step, first_step + n)
    traj = writer * SCALE_TRAJ_STRIDE + steps // episode
    return TensorDict(
        traj=traj,
        obs=traj * SCALE_STEP_LIMIT + steps % episode,
        written=torch.ones(n, dtype=torch.bool),
        batch_size=[n],
    )


def _invalid(sample: TensorDict, slices: int | None) -> bool:
    obs, traj = sample["obs"].reshape(-1), sample["traj"].reshape(-1)
    bad = not bool(sample["written"].all()) or not torch.equal(obs // SCALE_STEP_LIMIT, traj)
    if slices and not bad:
        rows = obs.view(slices, -1)
        bad = not bool((rows[:, 1:] - rows[:, :-1] == 1).all())
    return bad


def _build(module: Any, kind: str, capacity: int, args: argparse.Namespace) -> Any:
    storage = LazyMemmapStorage(capacity, shared_init=True)
    if kind == "prioritized":
        return module.TensorDictPrioritizedReplayBuffer(
            alpha=ALPHA, beta=BETA, storage=storage, batch_size=args.scale_batch,
            shared=True, sync=False,
        )  # fmt: skip
    num_slices, slice_len = scale_slices(args.scale_slices)
    return module.TensorDictReplayBuffer(
        storage=storage,
        sampler=module.SliceSampler(num_slices=num_slices, traj_key="traj"),
        batch_size=num_slices * slice_len,
        shared=True,
    )


def _writer_loop(
    rb: Any, writer: int, episode: int, stop: Any, written: Any, rate: int = 0
) -> None:
    torch.set_num_threads(1)
    step, start = 0, time.perf_counter()
    while not stop.is_set():
        rb.extend(_episodes(writer, step, episode, episode))
        step += episode
        written.value = step
        if rate:  # paced: both libraries then get the same write load
            time.sleep(max(0.0, start + step / rate - time.perf_counter()))


def _learner_step(rb: Any, kind: str) -> TensorDict:
    sample = rb.sample()
    if kind == "prioritized":
        sample["td_error"] = (sample["obs"] % SCALE_STEP_LIMIT).float() / 1_000 + 0.01
        rb.update_tensordict_priority(sample)
    return sample


def _learn(rb: Any, kind: str, slices: int | None, seconds: float) -> tuple[list[float], int]:
    times, invalid = [], 0
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        t0 = time.perf_counter()
        sample = _learner_step(rb, kind)
        times.append(time.perf_counter() - t0)
        invalid += _invalid(sample, slices)
    return times, invalid


def _run_case(lib: str, kind: str, writers: int, args: argparse.Namespace) -> dict[str, Any]:
    module = trl if lib == "torchrl" else fastreplay
    capacity, stored, slices = _sizes(kind, args)
    rb = _build(module, kind, capacity, args)
    with progress(stored, f"{lib} {kind}: prefill {fmt_count(stored)}") as advance:
        for lo in range(0, stored, _PREFILL_CHUNK):
            n = min(_PREFILL_CHUNK, stored - lo)
            rb.extend(_episodes(writers, lo, n, args.scale_episode))  # after the writers' ids
            advance(n)
    _learner_step(rb, kind)  # first sample: builds what it builds (untimed)
    ctx = multiprocessing.get_context("fork")
    stop = ctx.Event()
    counts = [ctx.Value("q", 0) for _ in range(writers)]
    procs = [
        ctx.Process(
            target=_writer_loop,
            args=(rb, w, args.scale_episode, stop, counts[w], args.scale_write_rate),
        )
        for w in range(writers)
    ]
    t0 = time.perf_counter()
    for p in procs:
        p.start()
    times, invalid = _learn(rb, kind, slices, args.scale_seconds)
    stop.set()
    for p in procs:
        p.join(120)
    elapsed = time.perf_counter() - t0
    written = sum(c.value for c in counts)
    ok = all(p.exitcode == 0 for p in procs)
    storage = rb._storage
    del rb
    if hasattr(storage, "cleanup"):
        storage.cleanup()
    return {
        "median_step_s": statistics.median(times) if times else float("nan"),
        "mean_step_s": statistics.fmean(times) if times else float("nan"),
        "steps_per_s": len(times) / sum(times) if times else 0.0,
        "items_written_per_s": written / elapsed,
        "invalid_samples": invalid,
        "steps": len(times),
        "writers_ok": ok,
    }


def _sizes(kind: str, args: argparse.Namespace) -> tuple[int, int, int | None]:
    if kind == "prioritized":
        capacity = parse_count(args.scale_capacity)
        return capacity, capacity, None
    return (
        parse_count(args.scale_slice_capacity),
        parse_count(args.scale_slice_stored),
        scale_slices(args.scale_slices)[0],
    )


def _torchrl_per_ok() -> bool:
    try:
        trl.PrioritizedSampler(2, 1.0, 1.0)
    except RuntimeError:
        return False
    return True


def run(args: argparse.Namespace) -> list[Result]:
    torch_per = _torchrl_per_ok()
    results = []
    kinds = [k.strip() for k in args.scale_kinds.split(",") if k.strip()]
    for kind in kinds:
        capacity, stored, _ = _sizes(kind, args)
        for i, writers in enumerate(parse_counts(args.scale_writers)):
            libs = ["fastreplay", "torchrl"]
            if kind == "prioritized" and not torch_per:
                libs = ["fastreplay"]
                print("  TorchRL's prioritized sampler needs its compiled extension: skipped")
            order = libs if i % 2 == 0 else libs[::-1]  # interleave which side runs first
            out = {lib: _run_case(lib, kind, writers, args) for lib in order}
            fast, base = out["fastreplay"], out.get("torchrl")
            correct = all(o["invalid_samples"] == 0 and o["writers_ok"] for o in out.values())
            size = f"{fmt_count(capacity)}" + (f"/{fmt_count(stored)}" if stored < capacity else "")
            case = f"{kind} {writers} writer{'s' if writers > 1 else ''}, {size}"
            if args.scale_write_rate:
                case += f", {fmt_count(args.scale_write_rate)} items/s each"
            extra = {f"{lib}_{key}": value for lib, o in out.items() for key, value in o.items()}
            results.append(  # times: the mean step, so the speedup is the steps/s ratio
                Result(
                    NAME,
                    case,
                    fast["mean_step_s"],
                    base["mean_step_s"] if base else None,
                    correct,
                    {"kind": kind, "writers": writers, "capacity": capacity, "stored": stored},
                    extra,
                    rate_unit="steps/s",
                )
            )
            for lib, o in out.items():
                print(
                    f"  {case} {lib:>10}: learner {o['steps_per_s']:8.1f} steps/s, "
                    f"writers {o['items_written_per_s']:10,.0f} items/s, "
                    f"invalid samples {o['invalid_samples']}",
                    flush=True,
                )
        if args.scale_ray:
            results.extend(_run_ray(kind, args))
    return results


# ------------------------------------------------------------------------------------ Ray
def _run_ray(kind: str, args: argparse.Namespace) -> list[Result]:
    try:
        import ray
    except ImportError:
        print("  --scale-ray: Ray is not installed (pip install ray): skipped")
        return []
    from torchrl.data import RayReplayBuffer

    capacity, stored, slices = _sizes(kind, args)
    writers = 2
    if not ray.is_initialized():
        ray.init(num_cpus=writers + 1, include_dashboard=False, log_to_driver=False)
    if kind == "prioritized":
        rb = RayReplayBuffer(
            replay_buffer_cls=fastreplay.TensorDictPrioritizedReplayBuffer,
            alpha=ALPHA,
            beta=BETA,
            storage=functools.partial(LazyTensorStorage, capacity),
            batch_size=args.scale_batch,
            remote_config={"num_cpus": 1},
        )
    else:
        num_slices, slice_len = scale_slices(args.scale_slices)
        rb = RayReplayBuffer(
            replay_buffer_cls=fastreplay.TensorDictReplayBuffer,
            storage=functools.partial(LazyTensorStorage, capacity),
            sampler=functools.partial(
                fastreplay.SliceSampler, num_slices=num_slices, traj_key="traj"
            ),
            batch_size=num_slices * slice_len,
            remote_config={"num_cpus": 1},
        )
    try:
        for lo in range(0, stored, _PREFILL_CHUNK):
            n = min(_PREFILL_CHUNK, stored - lo)
            rb.extend(_episodes(writers, lo, n, args.scale_episode))  # after the writers' ids
        _learner_step(rb, kind)
        write = ray.remote(num_cpus=0)(_ray_writer)
        t0 = time.perf_counter()
        tasks = [
            write.remote(rb.client(), w, args.scale_episode, args.scale_seconds)
            for w in range(writers)
        ]
        times, invalid = _learn(rb, kind, slices, args.scale_seconds)
        written = sum(ray.get(tasks))
        elapsed = time.perf_counter() - t0
    finally:
        rb.close()
    mean = statistics.fmean(times) if times else float("nan")
    rate = len(times) / sum(times) if times else 0.0
    print(
        f"  ray {kind}, {writers} writer tasks: learner {rate:8.1f} steps/s, writers "
        f"{written / elapsed:10,.0f} items/s, invalid samples {invalid}",
        flush=True,
    )
    extra = {"steps_per_s": rate, "items_written_per_s": written / elapsed}
    extra["median_step_s"] = statistics.median(times) if times else float("nan")
    extra["invalid_samples"] = invalid
    case = f"ray {kind} {writers} writer tasks, {fmt_count(capacity)}"
    return [
        Result(NAME, case, mean, None, invalid == 0, {"kind": kind}, extra, rate_unit="steps/s")
    ]


def _ray_writer(client: Any, writer: int, episode: int, seconds: float) -> int:
    step, end = 0, time.perf_counter() + seconds
    while time.perf_counter() < end:
        client.extend(_episodes(writer, step, episode, episode))
        step += episode
    return step

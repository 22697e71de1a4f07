"""A whole training step through the buffer, TensorDict glue included.

With fast samplers, the TensorDict work around them (writing rows into the storage, reading
the sampled rows back, adding ``index`` and the weights) is most of a step. Cases:

* ``PER step``, fastreplay buffer: as TorchRL's losses and trainers drive PER, on buffers built
  with ``priority_key="td_error"`` and filled with random priorities (``--step-per-capacity``,
  1M and 10M by default): ``extend`` 16 rows of ``obs[4]``, ``sample()`` (256, with importance
  weights), the loss writes ``td_error``, ``update_tensordict_priority`` of the sample; and the
  same step with ``update_priority(index, p)`` (its own rows). Sides: TorchRL's
  ``TensorDictReplayBuffer`` with its compiled ``PrioritizedSampler``; fastreplay's
  ``TensorDictReplayBuffer`` with its ``PrioritizedSampler`` through its direct path and, on the
  same buffer, through TorchRL's general path (``general path`` rows: what the direct path
  saves); cpprb's ``PrioritizedReplayBuffer`` (``add``, ``sample``, ``update_priorities``) when
  cpprb is installed (``pip install cpprb``); the floor (:mod:`benchmarks.floor`); the sampler's
  calls alone on bare tensors (``results.json``).
* ``slice``: ``SliceSampler`` with 256 slices of 32 on a storage of ``obs[4]``, ``action``,
  ``reward``, ``episode`` and ``("next", "done")`` (``--step-slice-capacity`` /
  ``--step-slice-stored``, episodes of ``--step-slice-episode`` steps): ``static`` (no writes
  between samples; TorchRL with ``cache_values=True``) and ``online`` (``extend`` 1,000 rows
  then ``sample``), with the floor's gather of the same runs (and write of 1,000 rows).

All calls of one case are interleaved in one process. Correct: every side's sample holds the
stored rows at its indices with valid weights or trajectories; for the same seed fastreplay's
direct and general paths give identical samples (keys, dtypes, values, ``info``) and leave
identical buffer state, with either way of writing priorities back; fastreplay's slice samples
are identical to TorchRL's; the floor's trees, rows and weights are fastreplay's and brute
force's (see :func:`_floor_agrees`).
"""

from __future__ import annotations

import argparse
import math

import numpy as np
import torch
from tensordict import TensorDict
from torchrl.data import LazyTensorStorage
from torchrl.data import PrioritizedSampler as TorchRLPrioritizedSampler
from torchrl.data import SliceSampler as TorchRLSliceSampler
from torchrl.data import TensorDictReplayBuffer as TorchRLBuffer

import fastreplay
from benchmarks.floor import KIND as FLOOR_KIND
from benchmarks.floor import PerFloor, gather_runs, write_rows
from benchmarks.harness import (
    Result,
    fmt_count,
    interleaved_seconds,
    parse_count,
    parse_counts,
    progress,
)
from fastreplay._torchrl import last_cursor_row, mutation_revision

NAME = "whole_step"
ALPHA, BETA = 0.7, 0.5
CHUNK = 1_000_000


# --------------------------------------------------------------------------- PER step


def _cpprb():
    try:
        import cpprb
    except ImportError:
        return None
    return cpprb


def _torchrl_compiled() -> bool:
    try:
        TorchRLPrioritizedSampler(2, 1.0, 1.0)
    except RuntimeError:
        return False
    return True


def _per_buffers(capacity: int, torchrl_ok: bool, seed: int) -> dict:
    buffers: dict = {
        "fastreplay": fastreplay.TensorDictReplayBuffer(
            storage=LazyTensorStorage(capacity),
            sampler=fastreplay.PrioritizedSampler(capacity, ALPHA, BETA),
            batch_size=256,
            priority_key="td_error",
        )
    }
    if torchrl_ok:
        buffers["torchrl"] = TorchRLBuffer(
            storage=LazyTensorStorage(capacity),
            sampler=TorchRLPrioritizedSampler(capacity, ALPHA, BETA),
            batch_size=256,
            priority_key="td_error",
        )
    cpprb = _cpprb()
    if cpprb is not None:
        buffers["cpprb"] = cpprb.PrioritizedReplayBuffer(
            capacity, {"obs": {"shape": 4}}, alpha=ALPHA
        )
    buffers["floor"] = PerFloor(capacity, ALPHA, BETA, seed=seed)
    gen = torch.Generator().manual_seed(seed)
    with progress(capacity, f"fill PER {fmt_count(capacity)}") as advance:
        for start in range(0, capacity, CHUNK):
            stop = min(start + CHUNK, capacity)
            obs = torch.randn(stop - start, 4, generator=gen)
            priority = torch.rand(stop - start, generator=gen) + 0.05
            for name, rb in buffers.items():
                if name == "cpprb":
                    rb.add(obs=obs.numpy(), priorities=priority.numpy())
                elif name == "floor":
                    rb.fill(start, obs.numpy(), priority.numpy())
                else:
                    rb.extend(TensorDict(obs=obs, batch_size=[stop - start]))
                    rb.update_priority(torch.arange(start, stop), priority)
            advance(stop - start)
    buffers["floor"].rebuild()
    return buffers


def _td_error_step(rb, new: TensorDict) -> None:
    """A step as TorchRL's losses and trainers drive PER: the loss writes ``td_error``."""
    rb.extend(new)
    batch = rb.sample()
    batch["td_error"] = batch["obs"][:, 0].abs() + 0.05
    rb.update_tensordict_priority(batch)


def _index_step(rb, new: TensorDict) -> None:
    """The same step with the priorities passed by index: ``update_priority(index, p)``."""
    rb.extend(new)
    batch = rb.sample()
    rb.update_priority(batch["index"], batch["obs"][:, 0].abs() + 0.05)


def _sampler_step(sampler, storage, new_index: torch.Tensor) -> None:
    """The sampler's share of a PER step, on bare tensors (no buffer, no TensorDict)."""
    sampler.mark_update(new_index, storage=storage)
    index, _ = sampler.sample(storage, 256)
    sampler.update_priority(index, torch.rand(256) + 0.05, storage=storage)


def _cpprb_step(rb, new: np.ndarray) -> None:
    rb.add(obs=new)
    batch = rb.sample(256, beta=BETA)
    rb.update_priorities(batch["indexes"], np.abs(batch["obs"][:, 0]) + 0.05)


def _general(rb, fn):
    """``fn(rb)`` through TorchRL's general path (fastreplay's direct path switched off)."""
    rb._fr_fast = False
    try:
        return fn(rb)
    finally:
        rb._fr_fast = True


def _valid_per_sample(rb, batch: TensorDict) -> bool:
    index = batch["index"]
    ok = bool(((index >= 0) & (index < len(rb))).all())
    ok &= bool(torch.isfinite(batch["priority_weight"]).all())
    ok &= bool((batch["priority_weight"] > 0).all())
    return ok and torch.equal(batch["obs"], rb.storage._storage["obs"][index])


def _same_sample(a: TensorDict, b: TensorDict) -> bool:
    keys = list(a.keys(True, True))
    if keys != list(b.keys(True, True)) or a.batch_size != b.batch_size or a.device != b.device:
        return False
    return all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in keys)


def _same_state(a, b) -> bool:
    """Same rows, cursor, count, length, last cursor, revision and priorities."""
    sa, sb = a.storage, b.storage
    ok = _same_sample(sa._storage, sb._storage)
    ok &= (a.writer._cursor, a.writer._write_count) == (b.writer._cursor, b.writer._write_count)
    ok &= (len(sa), last_cursor_row(sa)) == (len(sb), last_cursor_row(sb))
    ok &= mutation_revision(sa, 0) == mutation_revision(sb, 0)
    ok &= torch.equal(torch.as_tensor(sa._last_cursor), torch.as_tensor(sb._last_cursor))
    trees_a, trees_b = getattr(a.sampler, "_trees", None), getattr(b.sampler, "_trees", None)
    if trees_a is not None:
        ok &= torch.equal(trees_a.raw(), trees_b.raw())
    return bool(ok)


def _per_paths_agree(seed: int) -> bool:
    """Direct and general path from the same state and seed: same samples, same state.

    Both ways of writing priorities back run: ``update_tensordict_priority`` of the sample
    with the loss's ``td_error`` on even steps, ``update_priority(index, p)`` on odd ones.
    """
    capacity = 1_001  # odd, and wraps around several times
    gen = torch.Generator().manual_seed(seed)
    pair = []
    for _ in range(2):
        rb = fastreplay.TensorDictReplayBuffer(
            storage=LazyTensorStorage(capacity),
            sampler=fastreplay.PrioritizedSampler(capacity, ALPHA, BETA),
            batch_size=64,
            priority_key="td_error",
        )
        rb.sampler._rng = torch.Generator().manual_seed(seed)
        pair.append(rb)
    fast, general = pair
    general._fr_fast = False
    ok = True
    for step in range(40):
        rows = 16 if step % 3 else 373
        data = TensorDict(
            obs=torch.randn(rows, 4, generator=gen),
            td_error=torch.rand(rows, generator=gen),
            batch_size=[rows],
        )
        ok &= torch.equal(fast.extend(data), general.extend(data))
        a, info_a = fast.sample(return_info=True)
        b, info_b = general.sample(return_info=True)
        ok &= _same_sample(a, b) and list(info_a) == list(info_b)
        ok &= all(torch.equal(info_a[k], info_b[k]) for k in info_a)
        priority = torch.rand(64, generator=gen) + 0.01
        if step % 2:
            fast.update_priority(a["index"], priority)
            general.update_priority(b["index"], priority)
        else:
            a["td_error"], b["td_error"] = priority, priority.clone()
            fast.update_tensordict_priority(a)
            general.update_tensordict_priority(b)
    return bool(ok and _same_state(fast, general))


def _floor_agrees(seed: int) -> bool:
    """The floor's trees and rows against fastreplay's and against brute force (small, odd).

    From the same fill, the same 16-row write (wrapping round the end) and the same
    priority updates, the floor's leaves equal fastreplay's (both float32 masses) and the
    totals and minima agree; the floor's descents are the brute-force prefix-sum search; one
    step as timed gathers the rows at its indices with the brute-force weights, and leaves
    the leaves and roots the brute-force ones.
    """
    capacity, batch = 1_001, 64
    gen = torch.Generator().manual_seed(seed)
    obs = torch.randn(capacity, 4, generator=gen)
    priority = torch.rand(capacity, generator=gen) + 0.05
    rb = fastreplay.TensorDictReplayBuffer(
        storage=LazyTensorStorage(capacity),
        # the floor gives new rows the all-time max, as TorchRL does
        sampler=fastreplay.PrioritizedSampler(
            capacity, ALPHA, BETA, max_priority_within_buffer=False
        ),
        batch_size=batch,
        priority_key="td_error",
    )
    rb.extend(TensorDict(obs=obs, batch_size=[capacity]))
    rb.update_priority(torch.arange(capacity), priority)
    floor = PerFloor(capacity, ALPHA, BETA, batch=batch, seed=seed)
    floor.fill(0, obs.numpy(), priority.numpy())
    floor.rebuild()
    new = torch.randn(16, 4, generator=gen)
    rb.extend(TensorDict(obs=new, batch_size=[16]))
    floor.write(new.numpy())
    sample = rb.sample()
    sample["td_error"] = sample["obs"][:, 0].abs() + 0.05
    rb.update_tensordict_priority(sample)
    floor.update(sample["index"].numpy(), sample["td_error"].double().numpy())
    trees = rb.sampler._trees
    ok = np.array_equal(floor.leaves(), trees.leaf_mass().numpy())
    ok &= math.isclose(floor.total(), trees.total(), rel_tol=1e-12)
    ok &= floor.min_mass() == trees.min_mass()
    ok &= np.array_equal(floor.obs, rb.storage._storage["obs"].numpy())
    # descents: the brute-force search of the prefix sums
    prefix = np.cumsum(floor.leaves())
    u = np.random.default_rng(seed).random(4096) * floor.total()
    ok &= np.array_equal(floor.descend(u), np.searchsorted(prefix, u, side="right"))
    # one step as timed, against brute force from the state before it
    before, max_p = floor.leaves().copy(), floor.state[2]
    new = np.random.default_rng(seed + 1).standard_normal((16, 4)).astype(np.float32)
    floor.step(new)
    rows = np.arange(16)  # the cursor wrapped to 16 rows after the first write
    before[rows + 16] = (max_p + 1e-8) ** ALPHA
    before = before.astype(np.float32).astype(np.float64)
    index = floor.out_index
    ok &= np.array_equal(floor.obs[rows + 16], new)
    ok &= np.array_equal(floor.out_obs, floor.obs[index])
    expected = (before[index] / before.min()) ** -BETA
    ok &= np.allclose(floor.out_weight, expected, rtol=1e-12, atol=0)
    td = np.abs(floor.out_obs[:, 0].astype(np.float64)) + 0.05
    last = {int(j): k for k, j in enumerate(index)}  # the last write of a slot wins
    mass = ((td + 1e-8) ** ALPHA).astype(np.float32).astype(np.float64)
    ok &= all(floor.leaves()[j] == mass[k] for j, k in last.items())
    ok &= math.isclose(floor.total(), float(floor.leaves().sum()), rel_tol=1e-12)
    ok &= floor.min_mass() == float(floor.leaves().min())
    return bool(ok)


def _floor_state_ok(floor: PerFloor) -> bool:
    """After the timed steps: roots from the leaves, the last sample's rows and weights valid."""
    leaves = floor.leaves()
    ok = math.isclose(floor.total(), float(leaves.sum()), rel_tol=1e-9)
    ok &= floor.min_mass() == float(leaves.min())
    ok &= bool(np.array_equal(floor.out_obs, floor.obs[floor.out_index]))
    ok &= bool((np.isfinite(floor.out_weight) & (floor.out_weight > 0)).all())
    return bool(ok)


def _per(capacity: int, args: argparse.Namespace, torchrl_ok: bool) -> list[Result]:
    buffers = _per_buffers(capacity, torchrl_ok, args.seed + capacity)
    new = TensorDict(obs=torch.randn(16, 4), batch_size=[16])
    new_np = new["obs"].numpy().copy()
    rb, floor = buffers["fastreplay"], buffers["floor"]
    fns = {
        "fastreplay": lambda rb=rb: _td_error_step(rb, new),
        "general": lambda rb=rb: _general(rb, lambda b: _td_error_step(b, new)),
        "fastreplay by index": lambda rb=rb: _index_step(rb, new),
    }
    if "torchrl" in buffers:
        fns["torchrl"] = lambda t=buffers["torchrl"]: _td_error_step(t, new)
        fns["torchrl by index"] = lambda t=buffers["torchrl"]: _index_step(t, new)
    if "cpprb" in buffers:
        fns["cpprb"] = lambda c=buffers["cpprb"]: _cpprb_step(c, new_np)
    fns["floor"] = lambda f=floor: f.step(new_np)
    new_index = torch.arange(16)
    fns["sampler alone"] = lambda rb=rb: _sampler_step(rb.sampler, rb.storage, new_index)
    times = interleaved_seconds(fns, repeats=50 * args.repeats, warmup=20)

    # Answers: valid samples on every side; the direct path reads what the general one reads;
    # the floor's trees and rows are fastreplay's and brute force's.
    correct = _per_paths_agree(args.seed)
    floor_ok = _floor_agrees(args.seed) and _floor_state_ok(floor)
    seed = args.seed + 7
    rb.sampler._rng = torch.Generator().manual_seed(seed)
    fast_batch, fast_info = rb.sample(256, return_info=True)
    rb.sampler._rng = torch.Generator().manual_seed(seed)
    general_batch, general_info = _general(rb, lambda b: b.sample(256, return_info=True))
    rb.sampler._rng = None
    correct &= _same_sample(fast_batch, general_batch) and _valid_per_sample(rb, fast_batch)
    correct &= all(torch.equal(fast_info[k], general_info[k]) for k in fast_info)
    if "torchrl" in buffers:
        correct &= _valid_per_sample(buffers["torchrl"], buffers["torchrl"].sample(256))
    if "cpprb" in buffers:
        batch = buffers["cpprb"].sample(256, beta=BETA)
        correct &= bool((batch["indexes"] < capacity).all() and np.isfinite(batch["weights"]).all())
    correct &= floor_ok
    label = fmt_count(capacity)
    extra = {
        "general_path_s": times["general"],
        "sampler_alone_s": times["sampler alone"],
        "floor_kind": FLOOR_KIND,
        "floor_correct": floor_ok,
    }
    params = {"capacity": capacity, "alpha": ALPHA, "beta": BETA, "extend": 16, "batch": 256}
    _print_row(f"PER step {label}", times)
    floor_note = "" if FLOOR_KIND == "numba" else f" (floor: {FLOOR_KIND})"
    refs = {"cpprb_s": times.get("cpprb"), "floor_s": times["floor"]}
    step = "extend 16, sample 256, td_error, update_tensordict_priority"
    del buffers, rb, fns, floor
    return [
        Result(
            NAME,
            f"PER step, fastreplay buffer ({step}), {label}{floor_note}",
            times["fastreplay"],
            times.get("torchrl"),
            correct,
            params,
            extra,
            **refs,
        ),
        Result(
            NAME,
            f"PER step, fastreplay buffer, general path, {label}{floor_note}",
            times["general"],
            times.get("torchrl"),
            correct,
            params,
            extra,
            **refs,
        ),
        Result(
            NAME,
            f"PER step, fastreplay buffer, update_priority(index, p), {label}{floor_note}",
            times["fastreplay by index"],
            times.get("torchrl by index"),
            correct,
            params | {"priorities": "update_priority(index, p)"},
            extra,
            **refs,
        ),
    ]


def _print_row(label: str, times: dict) -> None:
    parts = [f"{name} {seconds * 1e3:.3f} ms" for name, seconds in times.items()]
    base = times["fastreplay"]
    ratios = [
        f"fastreplay/{name} {base / seconds:.2f}"
        for name, seconds in times.items()
        if name != "fastreplay" and seconds
    ]
    print(f"  {label}: {', '.join(parts)}; {', '.join(ratios)}", flush=True)


# --------------------------------------------------------------------------- slice step

_DONE = ("next", "done")
NUM_SLICES, SLICE_LEN = 256, 32


def _slice_rows(steps: torch.Tensor, episode: int, gen: torch.Generator) -> TensorDict:
    n = steps.numel()
    return TensorDict(
        {
            "obs": torch.randn(n, 4, generator=gen),
            "action": torch.randint(4, (n,), generator=gen),
            "reward": torch.randn(n, 1, generator=gen),
            "episode": steps // episode,
            _DONE: (steps % episode == episode - 1)[:, None],
        },
        [n],
    )


def _slice(args: argparse.Namespace) -> list[Result]:
    capacity = parse_count(args.step_slice_capacity)
    stored = parse_count(args.step_slice_stored)
    episode = args.step_slice_episode
    batch = NUM_SLICES * SLICE_LEN
    buffers = {
        "fastreplay": fastreplay.TensorDictReplayBuffer(
            storage=LazyTensorStorage(capacity),
            sampler=fastreplay.SliceSampler(num_slices=NUM_SLICES),
            batch_size=batch,
        ),
        "torchrl": TorchRLBuffer(
            storage=LazyTensorStorage(capacity),
            sampler=TorchRLSliceSampler(num_slices=NUM_SLICES, cache_values=True),
            batch_size=batch,
        ),
    }
    gen = torch.Generator().manual_seed(args.seed)
    with progress(stored, f"fill slices {fmt_count(stored)}") as advance:
        for start in range(0, stored, CHUNK):
            rows = _slice_rows(torch.arange(start, min(start + CHUNK, stored)), episode, gen)
            for rb in buffers.values():
                rb.extend(rows)
            advance(rows.numel())
    rb, tr = buffers["fastreplay"], buffers["torchrl"]
    written = [stored]

    def same_seed_samples() -> bool:
        out = []
        for sample in (
            lambda: rb.sample(return_info=True),
            lambda: _general(rb, lambda b: b.sample(return_info=True)),
            lambda: tr.sample(return_info=True),
        ):
            rb.sampler._rng = torch.Generator().manual_seed(args.seed)
            tr.sampler._rng = torch.Generator().manual_seed(args.seed)
            out.append(sample())
        rb.sampler._rng = tr.sampler._rng = None
        (a, ia), (b, ib), (c, ic) = out
        ok = _same_sample(a, b) and _same_sample(a, c) and _slices_ok(a, capacity)
        for info in (ib, ic):
            ok &= list(ia) == list(info)
            for key in ia:
                x, y = ia[key], info[key]
                ok &= all(map(torch.equal, x, y)) if isinstance(x, tuple) else torch.equal(x, y)
        return bool(ok)

    rb.sample()  # index the fill (untimed, as TorchRL's cache fill)
    tr.sample()
    correct = same_seed_samples()
    floor = SliceFloor(rb, stored, pool=16)
    static = interleaved_seconds(
        {
            "fastreplay": rb.sample,
            "general": lambda: _general(rb, lambda b: b.sample()),
            "torchrl": tr.sample,
            "floor": floor.gather,
        },
        repeats=max(5, 3 * args.repeats),
    )
    floor_ok = floor.matches_samples(rb)

    # Every online call writes the same new rows into both buffers: the other buffer's copy
    # in the untimed setup. Their contents then stay identical for the final check.
    pending: list[TensorDict] = []

    def prepare(other) -> None:
        rows = _slice_rows(torch.arange(written[0], written[0] + 1000), episode, gen)
        written[0] += 1000
        other.extend(rows)
        pending[:] = [rows]

    def online(target, read) -> None:
        target.extend(pending[0])
        read()

    floor_rows = [0]

    def prepare_floor() -> None:
        rows = _slice_rows(torch.arange(floor_rows[0], floor_rows[0] + 1000), episode, gen)
        floor_rows[0] += 1000
        floor.pending = {key: floor.as_rows(rows[key].numpy()) for key in floor.keys}

    online_times = interleaved_seconds(
        {
            "fastreplay": lambda: online(rb, rb.sample),
            "general": lambda: _general(rb, lambda b: online(b, b.sample)),
            "torchrl": lambda: online(tr, tr.sample),
            "floor": floor.write_and_gather,
        },
        setup={
            "fastreplay": lambda: prepare(tr),
            "general": lambda: prepare(tr),
            "torchrl": lambda: prepare(rb),
            "floor": prepare_floor,
        },
        repeats={
            "fastreplay": max(5, 3 * args.repeats),
            "general": max(3, args.repeats),
            "torchrl": max(3, args.repeats),
            "floor": max(5, 3 * args.repeats),
        },
    )
    correct &= same_seed_samples()
    floor_ok &= floor.gathered_its_rows()
    correct &= floor_ok
    params = {
        "capacity": capacity,
        "stored": stored,
        "episode_len": episode,
        "num_slices": NUM_SLICES,
        "slice_len": SLICE_LEN,
    }
    size = f"{fmt_count(capacity)}/{fmt_count(stored)} ep{episode}"
    _print_row(f"slice static {size}", static)
    _print_row(f"slice online {size}", online_times)
    results = []
    floor_note = "" if FLOOR_KIND == "numba" else f" (floor: {FLOOR_KIND})"
    for case, times in (("static", static), ("online (extend 1000 + sample)", online_times)):
        extra = {"general_path_s": times["general"], "floor_kind": FLOOR_KIND}
        extra["floor_correct"] = floor_ok
        results.append(
            Result(
                NAME,
                f"slice {case}, fastreplay buffer, {size}{floor_note}",
                times["fastreplay"],
                times["torchrl"],
                correct,
                params,
                extra,
                floor_s=times["floor"],
            )
        )
        results.append(
            Result(
                NAME,
                f"slice {case}, fastreplay buffer, general path, {size}{floor_note}",
                times["general"],
                times["torchrl"],
                correct,
                params,
                extra,
                floor_s=times["floor"],
            )
        )
    return results


class SliceFloor:
    """The slice step's floor: every field in a 2-D NumPy array, 256 runs gathered from them.

    The arrays are a copy of fastreplay's storage; the runs are those of ``pool`` samples
    fastreplay drew (untimed), gathered in turn, so that the floor reads the same rows as a
    sample does, not one batch kept warm in the cache. ``write_and_gather`` first writes the
    1,000 rows of ``pending`` at the floor's cursor, as the online step's ``extend``.
    """

    keys = ("obs", "action", "reward", "episode", _DONE)

    def __init__(self, rb, stored: int, pool: int) -> None:
        storage = rb.storage._storage
        self.capacity = len(storage)
        self.arrays = {key: self.as_rows(storage[key].numpy()).copy() for key in self.keys}
        self.samples = [rb.sample() for _ in range(pool)]
        self.starts = [
            s["index"].reshape(NUM_SLICES, SLICE_LEN)[:, 0].numpy().copy() for s in self.samples
        ]
        self.out = {
            key: np.empty((NUM_SLICES * SLICE_LEN, a.shape[1]), a.dtype)
            for key, a in self.arrays.items()
        }
        self.turn, self.cursor = 0, stored % self.capacity
        self.pending: dict = {}
        self.written: list = []

    @staticmethod
    def as_rows(array: np.ndarray) -> np.ndarray:
        """A field as (rows, features): a view. O(1)."""
        return array.reshape(len(array), -1)

    def gather(self) -> None:
        """The next pool sample's 256 runs of every field into ``out``. O(rows gathered)."""
        starts = self.starts[self.turn % len(self.starts)]
        self.turn += 1
        for key, array in self.arrays.items():
            gather_runs(array, starts, SLICE_LEN, self.out[key])

    def write_and_gather(self) -> None:
        """The online step: write ``pending`` at the cursor, then :meth:`gather`. O(rows)."""
        for key, rows in self.pending.items():
            write_rows(self.arrays[key], self.cursor, rows)
        self.written = [self.cursor, self.pending]
        self.cursor = (self.cursor + 1000) % self.capacity
        self.gather()

    def matches_samples(self, rb) -> bool:
        """Before any write: the floor gathered the stored rows of fastreplay's samples.

        Field by field against the storage at each sample's index, and against the sample
        itself for the fields the sampler leaves as stored (it sets ``("next", "done")`` at
        the slices' ends).
        """
        ok = True
        stored = rb.storage._storage
        for turn, sample in enumerate(self.samples):
            self.turn = turn
            self.gather()
            for key in self.keys:
                rows = stored[key][sample["index"]].numpy()
                ok &= np.array_equal(self.out[key], self.as_rows(rows))
                if key != _DONE:
                    ok &= np.array_equal(self.out[key], self.as_rows(sample[key].numpy()))
        return bool(ok)

    def gathered_its_rows(self) -> bool:
        """After the writes: the last gather is the brute-force one, the last write is there."""
        starts = self.starts[(self.turn - 1) % len(self.starts)]
        rows = (starts[:, None] + np.arange(SLICE_LEN)).reshape(-1) % self.capacity
        ok = all(np.array_equal(self.out[k], self.arrays[k][rows]) for k in self.keys)
        cursor, pending = self.written
        written = (cursor + np.arange(1000)) % self.capacity
        ok &= all(np.array_equal(self.arrays[k][written], pending[k]) for k in self.keys)
        return bool(ok)


def _slices_ok(sample: TensorDict, capacity: int) -> bool:
    """Every slice: consecutive rows of one episode, a done flag only on its last step.

    Consecutive round the storage's end: a slice may continue from the last row to row 0.
    """
    index = sample["index"].reshape(NUM_SLICES, -1)
    episode = sample["episode"].reshape(NUM_SLICES, -1)
    done = sample[_DONE].reshape(NUM_SLICES, -1)
    ok = bool((episode == episode[:, :1]).all())
    ok &= bool(((index[:, 1:] - index[:, :-1]) % capacity == 1).all())
    return ok and not bool(done[:, :-1].any())


def run(args: argparse.Namespace) -> list[Result]:
    cases = [c.strip() for c in args.step_cases.split(",") if c.strip()]
    results = []
    if "per" in cases:
        torchrl_ok = _torchrl_compiled()
        for capacity in parse_counts(args.step_per_capacity):
            results += _per(capacity, args, torchrl_ok)
    if "slice" in cases:
        results += _slice(args)
    return results

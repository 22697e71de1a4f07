"""The GPU learner: buffers with a CUDA storage, pinned delivery and chunked log-probs.

Five rows, each with fastreplay's time, TorchRL's where TorchRL runs, and a floor: the simplest
torch code moving the same data (no TensorDict, no TorchRL), on ``--gpu-device``:

* ``uniform step``: a LeanRL-style SAC buffer, ``LazyTensorStorage(stored, device=...)`` with
  ``obs[17]``, ``next_obs[17]``, ``action[6]``, ``reward``, ``done``; per step ``extend`` 64
  new rows (made inside the timing) then ``sample()`` of ``--gpu-batch``. Floor: five
  ``index_copy_``, one ``randint``, five ``index_select``.
* ``PER step``: ``TensorDictReplayBuffer(priority_key="td_error")`` with
  ``PrioritizedSampler(stored, 0.6, 0.4)``; per step ``extend`` 1 row, ``sample()``, write
  ``td_error``, ``update_tensordict_priority``. TorchRL's sampler needs its compiled segment
  trees (absent from the package index's CUDA wheels): where it raises, its time is missing
  and the reason recorded. Floor: ``multinomial`` over a priority vector, five gathers, the
  weights, one ``index_put_`` of the new priorities. Where triton is installed, the same
  buffer with ``PrioritizedSampler(..., backend="triton")`` is timed too (its trees' walk and
  writes as one Triton kernel each), in ``extra["fastreplay_triton_trees_s"]``.
* ``slice online step``: a TD-MPC2-like buffer (episodes of 500 steps under ``episode``),
  ``SliceSampler(slice_len=4, traj_key="episode")``; per step ``extend`` one episode, then
  sample ``--gpu-batch`` slices of 4. ``slice static sample``: the sample alone. Floor: random
  starts inside the stored episodes plus offsets, five ``index_select``.
* ``pinned sample + copy``: ``--gpu-batch`` uint8 84x84x3 frames, 1 thread, no prefetch:
  fastreplay ``pin_memory=True, device=...`` against TorchRL ``pin_memory=True`` then
  ``.to(device, non_blocking=True)``. Floor: ``index_select`` into a pinned buffer, one
  non-blocking copy. On the host (``--gpu-device cpu``) nothing can be pinned: the row times
  the same reads without pinning.
* ``chunked log-prob``: an MLP 64-512-512-16 ``TanhNormal`` actor on ``--gpu-logp-batch``
  samples: ``chunked_log_prob`` with its default budget (fastreplay) against the one-shot
  ``actor.log_prob`` under ``no_grad`` (TorchRL's column: what TorchRL users write); the
  floor is the bare MLP and ``Normal`` log-density on the whole batch. On CUDA, the peak
  extra memory of both is recorded.

Every side's answer is checked: sampled rows equal the storage's rows at the returned index
(slices: consecutive steps of one episode), weights in (0, 1], log-probs equal the one-shot
ones. Without CUDA the scenario is not measured (the reason says so) unless
``--gpu-device cpu`` asks for the same rows on the host (the tests do, at a tiny size).
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
from collections.abc import Callable
from typing import Any

import torch
from tensordict import TensorDict
from torchrl.data import LazyTensorStorage
from torchrl.data import PrioritizedSampler as TorchRLPrioritizedSampler
from torchrl.data import SliceSampler as TorchRLSliceSampler
from torchrl.data import TensorDictReplayBuffer as TorchRLBuffer

from benchmarks.arguments import GPU_EPISODE
from benchmarks.harness import (
    NotMeasured,
    Result,
    fmt_count,
    interleaved_seconds,
    parse_count,
)
from fastreplay import PrioritizedSampler, SliceSampler, TensorDictReplayBuffer, chunked_log_prob

NAME = "gpu"
_KEYS = {"obs": 17, "next_obs": 17, "action": 6, "reward": 1, "done": 1}
_EPISODE = GPU_EPISODE
_SLICE = 4
_FRAME = (84, 84, 3)


def _sync(device: torch.device) -> Callable[[], None]:
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return lambda: None


def _rows(n: int, device: torch.device, gen: torch.Generator | None = None) -> TensorDict:
    cols = {k: torch.randn(n, d, device=device, generator=gen) for k, d in _KEYS.items()}
    return TensorDict(cols, batch_size=[n], device=device)


def _matches_storage(sample: Any, stored: dict[str, torch.Tensor], index: torch.Tensor) -> bool:
    index = index.to(next(iter(stored.values())).device)
    return all(torch.equal(sample[k].to(v.device), v[index]) for k, v in stored.items())


def _uniform(args: argparse.Namespace, device: torch.device, n: int, batch: int) -> Result:
    sync = _sync(device)
    start = _rows(n, device, torch.Generator(device=device).manual_seed(args.seed))
    sides: dict[str, Any] = {}
    for side, cls in (("fastreplay", TensorDictReplayBuffer), ("torchrl", TorchRLBuffer)):
        rb = cls(storage=LazyTensorStorage(n, device=device), batch_size=batch)
        rb.extend(start.clone())
        sides[side] = rb
    cols = {k: v.clone() for k, v in start.items()}
    cursor = [0]
    arange = torch.arange(64, device=device)

    def floor() -> object:
        new = _rows(64, device)
        where = (arange + cursor[0]) % n
        cursor[0] = (cursor[0] + 64) % n
        for key, col in cols.items():
            col.index_copy_(0, where, new[key])
        idx = torch.randint(n, (batch,), device=device)
        out = {key: torch.index_select(col, 0, idx) for key, col in cols.items()}
        sync()
        return out, idx

    def step(rb: Any) -> Callable[[], object]:
        def run() -> object:
            rb.extend(_rows(64, device))
            out = rb.sample()
            sync()
            return out

        return run

    fns = {"fastreplay": step(sides["fastreplay"]), "torchrl": step(sides["torchrl"])}
    fns["floor"] = floor
    correct = True
    for side, fn in fns.items():
        out = fn()
        if side == "floor":
            data, idx = out  # type: ignore[misc]
            correct &= _matches_storage(data, cols, idx)
        else:
            stored = {k: v for k, v in sides[side].storage._storage.items()}
            correct &= _matches_storage(out, stored, out["index"])
    times = interleaved_seconds(fns, repeats=args.repeats)
    return Result(
        scenario=NAME,
        case=f"uniform step (extend 64, sample {batch}), {fmt_count(n)}, {device.type}",
        fastreplay_s=times["fastreplay"],
        torchrl_s=times["torchrl"],
        floor_s=times["floor"],
        correct=bool(correct),
        params={"stored": n, "batch": batch, "device": str(device)},
    )


def _per(args: argparse.Namespace, device: torch.device, n: int, batch: int) -> Result:
    sync = _sync(device)
    start = _rows(n, device, torch.Generator(device=device).manual_seed(args.seed))
    fns: dict[str, Callable[[], object]] = {}
    extra: dict[str, Any] = {}
    buffers: dict[str, Any] = {}
    makers: dict[str, tuple[Any, Any]] = {
        "fastreplay": (TensorDictReplayBuffer, PrioritizedSampler),
        "torchrl": (TorchRLBuffer, TorchRLPrioritizedSampler),
    }
    if device.type == "cuda" and importlib.util.find_spec("triton") is not None:
        # the same buffer with the trees' walk and writes as Triton kernels (backend="triton")
        makers["fastreplay_triton"] = (
            TensorDictReplayBuffer,
            functools.partial(PrioritizedSampler, backend="triton"),
        )
    for side, (cls, sampler_cls) in makers.items():
        try:
            rb = cls(
                storage=LazyTensorStorage(n, device=device),
                sampler=sampler_cls(n, 0.6, 0.4),
                priority_key="td_error",
                batch_size=batch,
            )
            rb.extend(start.clone())
            rb.sample()
        except (RuntimeError, ImportError, NotImplementedError) as err:
            extra[f"{side}_not_run"] = f"{type(err).__name__}: {err}"
            continue
        buffers[side] = rb

        def run(rb: Any = rb) -> object:
            rb.extend(_rows(1, device))
            out = rb.sample()
            out["td_error"] = torch.rand(out.batch_size, device=device)
            rb.update_tensordict_priority(out)
            sync()
            return out

        fns[side] = run
    cols = {k: v.clone() for k, v in start.items()}
    priority = torch.ones(n, device=device)
    cursor = [0]

    def floor() -> object:
        new = _rows(1, device)
        where = torch.tensor([cursor[0]], device=device)
        cursor[0] = (cursor[0] + 1) % n
        for key, col in cols.items():
            col.index_copy_(0, where, new[key])
        priority.index_fill_(0, where, 1.0)
        p = priority.pow(0.6)
        idx = torch.multinomial(p, batch, replacement=True)
        out = {key: torch.index_select(col, 0, idx) for key, col in cols.items()}
        prob = p[idx] / p.sum()
        weight = (prob * n).pow(-0.4)
        weight = weight / weight.max()
        priority.index_put_((idx,), torch.rand(batch, device=device) + 1e-6)
        sync()
        return out, idx, weight

    fns["floor"] = floor
    correct = "fastreplay" in fns
    for side, fn in fns.items():
        out = fn()
        if side == "floor":
            data, idx, weight = out  # type: ignore[misc]
            correct &= _matches_storage(data, cols, idx)
        else:
            stored = {k: v for k, v in buffers[side].storage._storage.items() if k in _KEYS}
            # the rows written by this call's extend moved under the sample: compare now
            correct &= _matches_storage(out, stored, out["index"])
            weight = out["priority_weight"]
        correct &= bool(((weight > 0) & (weight <= 1 + 1e-6)).all())
    times = interleaved_seconds(fns, repeats=args.repeats)
    if "fastreplay_triton" in times:
        extra["fastreplay_triton_trees_s"] = times["fastreplay_triton"]
    return Result(
        scenario=NAME,
        case=f"PER step (extend 1, sample {batch}, update), {fmt_count(n)}, {device.type}",
        fastreplay_s=times["fastreplay"],
        torchrl_s=times.get("torchrl"),
        floor_s=times["floor"],
        correct=bool(correct),
        params={"stored": n, "batch": batch, "device": str(device)},
        extra=extra,
    )


def _episodes(n_rows: int, first: int, device: torch.device) -> TensorDict:
    steps = torch.arange(n_rows, device=device)
    data = _rows(n_rows, device)
    data["episode"] = first + steps // _EPISODE
    data["step"] = steps % _EPISODE
    return data


def _slices_ok(sample: Any, n_slices: int) -> bool:
    episode = sample["episode"].reshape(n_slices, _SLICE)
    step = sample["step"].reshape(n_slices, _SLICE)
    consecutive = (step[:, 1:] - step[:, :-1] == 1).all()
    return bool((episode == episode[:, :1]).all() and consecutive)


def _slice(args: argparse.Namespace, device: torch.device, n: int, batch: int) -> list[Result]:
    sync = _sync(device)
    n = n - n % _EPISODE
    makers = {
        "fastreplay": (TensorDictReplayBuffer, SliceSampler),
        "torchrl": (TorchRLBuffer, TorchRLSliceSampler),
    }
    filled = _episodes(n, 0, device)
    buffers = {}
    for side, (cls, sampler_cls) in makers.items():
        rb = cls(
            storage=LazyTensorStorage(n, device=device),
            sampler=sampler_cls(slice_len=_SLICE, traj_key="episode"),
            batch_size=batch * _SLICE,
        )
        rb.extend(filled.clone())
        buffers[side] = rb
    cols = {k: v.clone() for k, v in filled.items()}
    offsets = torch.arange(_SLICE, device=device)
    counter = {"episode": n // _EPISODE, "cursor": 0}

    def floor_sample() -> object:
        # every stored episode is whole and _EPISODE long: a start is any step < _EPISODE - 3
        episode = torch.randint(n // _EPISODE, (batch,), device=device)
        step = torch.randint(_EPISODE - _SLICE + 1, (batch,), device=device)
        idx = ((episode * _EPISODE + step)[:, None] + offsets).reshape(-1)
        out = {key: torch.index_select(col, 0, idx) for key, col in cols.items()}
        sync()
        return out

    def floor_online() -> object:
        new = _episodes(_EPISODE, counter["episode"], device)
        counter["episode"] += 1
        where = torch.arange(_EPISODE, device=device) + counter["cursor"]
        counter["cursor"] = (counter["cursor"] + _EPISODE) % n
        for key, col in cols.items():
            col.index_copy_(0, where, new[key])
        return floor_sample()

    def sample(rb: Any) -> Callable[[], object]:
        def run() -> object:
            out = rb.sample()
            sync()
            return out

        return run

    episodes = {side: [n // _EPISODE] for side in buffers}

    def online(side: str) -> Callable[[], object]:
        rb = buffers[side]

        def run() -> object:
            rb.extend(_episodes(_EPISODE, episodes[side][0], device))
            episodes[side][0] += 1
            out = rb.sample()
            sync()
            return out

        return run

    results = []
    for case, fns in (
        (
            f"slice online step (extend {_EPISODE}, sample {batch}x{_SLICE})",
            {
                "fastreplay": online("fastreplay"),
                "torchrl": online("torchrl"),
                "floor": floor_online,
            },
        ),
        (
            f"slice static sample ({batch}x{_SLICE})",
            {
                "fastreplay": sample(buffers["fastreplay"]),
                "torchrl": sample(buffers["torchrl"]),
                "floor": floor_sample,
            },
        ),
    ):
        correct = all(_slices_ok(fn(), batch) for fn in fns.values())
        times = interleaved_seconds(fns, repeats=args.repeats)
        results.append(
            Result(
                scenario=NAME,
                case=f"{case}, {fmt_count(n)}, {device.type}",
                fastreplay_s=times["fastreplay"],
                torchrl_s=times["torchrl"],
                floor_s=times["floor"],
                correct=bool(correct),
                params={"stored": n, "slices": batch, "device": str(device)},
            )
        )
    return results


def _pin(args: argparse.Namespace, device: torch.device, batch: int) -> Result:
    sync = _sync(device)
    n = args.gpu_pin_stored
    gen = torch.Generator().manual_seed(args.seed)
    frames = torch.randint(0, 255, (n, *_FRAME), dtype=torch.uint8, generator=gen)
    data = TensorDict(pixels=frames, step=torch.arange(n), batch_size=[n])
    pin = device.type != "cpu"
    theirs = TorchRLBuffer(
        storage=LazyTensorStorage(n),
        batch_size=batch,
        pin_memory=pin,
        generator=torch.Generator().manual_seed(1),
    )
    ours = TensorDictReplayBuffer(
        storage=LazyTensorStorage(n),
        batch_size=batch,
        pin_memory=pin,
        device=device,
        generator=torch.Generator().manual_seed(1),
    )
    theirs.extend(data)
    ours.extend(data)
    staging = torch.empty((batch, *_FRAME), dtype=torch.uint8, pin_memory=pin)

    def floor() -> object:
        idx = torch.randint(n, (batch,))
        torch.index_select(frames, 0, idx, out=staging)
        out = staging.to(device, non_blocking=True)
        sync()
        return out, idx

    def torchrl_step() -> object:
        out = theirs.sample().to(device, non_blocking=True)
        sync()
        return out

    def ours_step() -> object:
        out = ours.sample()
        sync()
        return out

    a, b = torchrl_step(), ours_step()  # same generator seed: the same indices
    got, idx = floor()  # type: ignore[misc]
    correct = (
        b["pixels"].device.type == device.type
        and torch.equal(a["pixels"].cpu(), b["pixels"].cpu())
        and torch.equal(b["pixels"].cpu(), frames[b["step"].cpu()])
        and torch.equal(got.cpu(), frames[idx])  # type: ignore[union-attr]
    )
    times = interleaved_seconds(
        {"fastreplay": ours_step, "torchrl": torchrl_step, "floor": floor}, repeats=args.repeats
    )
    return Result(
        scenario=NAME,
        case=f"{'pinned ' if pin else ''}sample + copy, {batch}x84x84x3 uint8, {device.type}",
        fastreplay_s=times["fastreplay"],
        torchrl_s=times["torchrl"],
        floor_s=times["floor"],
        correct=bool(correct),
        params={"batch": batch, "stored": n, "pinned": pin, "device": str(device)},
    )


def _actor(device: torch.device) -> Any:
    from tensordict.nn import NormalParamExtractor, TensorDictModule
    from torchrl.modules import ProbabilisticActor, TanhNormal

    torch.manual_seed(0)
    net = torch.nn.Sequential(
        torch.nn.Linear(64, 512),
        torch.nn.ReLU(),
        torch.nn.Linear(512, 512),
        torch.nn.ReLU(),
        torch.nn.Linear(512, 16),
        NormalParamExtractor(),
    ).to(device)
    actor = ProbabilisticActor(
        TensorDictModule(net, ["obs"], ["loc", "scale"]),
        in_keys=["loc", "scale"],
        distribution_class=TanhNormal,
    )
    return actor, net


def _peak(device: torch.device, fn: Callable[[], Any]) -> tuple[Any, int | None]:
    if device.type != "cuda":
        return fn(), None
    torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    out = fn()
    torch.cuda.synchronize(device)
    return out, torch.cuda.max_memory_allocated(device) - base


def _logp(args: argparse.Namespace, device: torch.device) -> Result:
    sync = _sync(device)
    n = parse_count(args.gpu_logp_batch)
    actor, net = _actor(device)
    gen = torch.Generator(device=device).manual_seed(args.seed)
    obs = torch.randn(n, 64, device=device, generator=gen)
    action = torch.rand(n, 8, device=device, generator=gen) * 1.8 - 0.9
    data = TensorDict(obs=obs, action=action, batch_size=[n], device=device)

    def one_shot() -> torch.Tensor:
        with torch.no_grad():
            out = actor.log_prob(data.copy())
        sync()
        return out

    def chunked() -> torch.Tensor:
        out = chunked_log_prob(actor, data.copy())
        sync()
        return out

    def floor() -> torch.Tensor:
        with torch.no_grad():
            loc, scale = net(obs)
            out = torch.distributions.Normal(loc, scale).log_prob(action)
        sync()
        return out

    actor.eval()
    want, one_shot_bytes = _peak(device, one_shot)
    got, chunked_bytes = _peak(device, chunked)
    correct = bool(torch.allclose(got, want, rtol=1e-4, atol=1e-4))
    floor()
    times = interleaved_seconds(
        {"fastreplay": chunked, "torchrl": one_shot, "floor": floor}, repeats=args.repeats
    )
    extra: dict[str, Any] = {}
    if one_shot_bytes is not None:
        extra = {"peak_extra_bytes_one_shot": one_shot_bytes, "peak_extra_bytes": chunked_bytes}
    return Result(
        scenario=NAME,
        case=f"chunked log-prob (default budget) vs one-shot, {fmt_count(n)}, {device.type}",
        fastreplay_s=times["fastreplay"],
        torchrl_s=times["torchrl"],
        floor_s=times["floor"],
        correct=correct,
        params={"batch": n, "device": str(device)},
        extra=extra,
    )


def run(args: argparse.Namespace) -> list[Result]:
    device = torch.device(args.gpu_device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise NotMeasured(
            "no CUDA device: the uniform, PER, slice, pin and chunked log-prob rows need one "
            "(--gpu-device cpu runs them on the host)"
        )
    n, batch = parse_count(args.gpu_stored), args.gpu_batch
    results = [_uniform(args, device, n, batch), _per(args, device, n, batch)]
    results += _slice(args, device, n, batch)
    results.append(_pin(args, device, batch))
    results.append(_logp(args, device))
    return results

"""fastreplay's storages against TorchRL's on TorchRL's general path: ``sample`` alternated.

``fastreplay.LazyTensorStorage`` is TorchRL's ``LazyTensorStorage`` with a faster ``get``
(:mod:`fastreplay.storages`). That ``get`` is what a buffer's ``sample`` calls on TorchRL's
general path: TorchRL's own ``TensorDictReplayBuffer``, or fastreplay's with a transform,
``prefetch`` or shared. This times ``sample()`` of ``--batch`` rows of ``obs[4]`` (plus
``action`` and ``reward``) from ``--stored`` items with 1 torch thread, for each case with
TorchRL's storage and with fastreplay's, built in one process and alternated call by call
(the same load for both sides), and prints each side's median per call, their ratio and the
load average::

    python -m benchmarks.storage_get --stored 1000000 --rounds 5 --calls 200

Cases: TorchRL's ``TensorDictReplayBuffer`` with fastreplay's ``PrioritizedSampler``
(``torchrl buffer + PER``); fastreplay's ``TensorDictReplayBuffer`` with a transform (a
``Compose`` of one ``ExcludeTransform``, so TorchRL's general path) and fastreplay's
``PrioritizedSampler`` (``fastreplay buffer + transform``); TorchRL's ``TensorDictReplayBuffer``
with TorchRL's ``RandomSampler`` (``torchrl buffer + uniform``); fastreplay's
``TensorDictReplayBuffer`` with fastreplay's ``PrioritizedSampler`` and no transform
(``fastreplay buffer, direct path``: the storage's ``get`` is not called, both sides should take
the same time). Before timing, each case
checks that both sides return identical samples for the same seed.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from typing import Any


def _cases(stored: int, batch: int) -> dict[str, Callable[[Any], Any]]:
    import torch
    from torchrl.data import TensorDictReplayBuffer as TorchRLBuffer
    from torchrl.data.replay_buffers import RandomSampler
    from torchrl.envs import Compose, ExcludeTransform

    import fastreplay

    def torchrl_per(storage: Any) -> Any:
        return TorchRLBuffer(
            storage=storage,
            sampler=fastreplay.PrioritizedSampler(stored, 0.7, 0.5),
            batch_size=batch,
        )

    def fastreplay_transform(storage: Any) -> Any:
        return fastreplay.TensorDictReplayBuffer(
            storage=storage,
            sampler=fastreplay.PrioritizedSampler(stored, 0.7, 0.5),
            batch_size=batch,
            transform=Compose(ExcludeTransform("extra")),
        )

    def torchrl_uniform(storage: Any) -> Any:
        return TorchRLBuffer(storage=storage, sampler=RandomSampler(), batch_size=batch)

    def fastreplay_direct(storage: Any) -> Any:
        return fastreplay.TensorDictReplayBuffer(
            storage=storage,
            sampler=fastreplay.PrioritizedSampler(stored, 0.7, 0.5),
            batch_size=batch,
        )

    del torch
    return {
        "torchrl buffer + PER": torchrl_per,
        "fastreplay buffer + transform": fastreplay_transform,
        "torchrl buffer + uniform": torchrl_uniform,
        "fastreplay buffer, direct path": fastreplay_direct,
    }


def _same(a: Any, b: Any) -> None:
    import torch

    assert a.batch_size == b.batch_size and a.device == b.device
    assert list(a.keys(True, True)) == list(b.keys(True, True))
    for key in a.keys(True, True):
        x, y = a.get(key), b.get(key)
        assert type(x) is type(y) and x.dtype == y.dtype and torch.equal(x, y), key


def main(argv: list[str] | None = None) -> dict[str, tuple[float, float]]:
    """Run the cases; returns ``{case: (TorchRL's storage, fastreplay's) median seconds}``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stored", type=int, default=1_000_000)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=200)
    args = parser.parse_args(argv)

    import numpy as np
    import torch
    from tensordict import TensorDict
    from torchrl.data import LazyTensorStorage as TorchRLStorage

    import fastreplay

    torch.set_num_threads(1)
    n = args.stored
    data = TensorDict(
        obs=torch.randn(n, 4),
        action=torch.randint(0, 4, (n,)),
        reward=torch.randn(n),
        extra=torch.zeros(n, 1),
        batch_size=[n],
    )
    results: dict[str, tuple[float, float]] = {}
    for case, build in _cases(n, args.batch).items():
        sides, first = [], []
        for cls in (TorchRLStorage, fastreplay.LazyTensorStorage):
            rb = build(cls(n))
            rb.extend(data)
            torch.manual_seed(1)
            np.random.seed(1)  # noqa: NPY002 (the priority samplers' draws: TorchRL's RNG)
            first.append(rb.sample())
            sides.append(rb)
        _same(*first)
        times: list[list[float]] = [[], []]
        for round_ in range(args.rounds):
            for call in range(args.calls):
                for side in (0, 1) if (round_ + call) % 2 == 0 else (1, 0):
                    start = time.perf_counter()
                    sides[side].sample()
                    times[side].append(time.perf_counter() - start)
        old, new = (statistics.median(t) for t in times)
        results[case] = (old, new)
        print(
            f"{case:32s} torchrl storage {old * 1e6:7.1f} us  fastreplay storage "
            f"{new * 1e6:7.1f} us  ratio {new / old:.3f}  load {os.getloadavg()[0]:.2f}",
            flush=True,
        )
    return results


if __name__ == "__main__":
    main()

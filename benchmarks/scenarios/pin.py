"""Host-to-device delivery of a sample: fastreplay's pinned buffer vs TorchRL's.

Only meaningful with CUDA: without it the scenario is reported as not measured, with the reason.
"""

from __future__ import annotations

import argparse

import torch
from tensordict import TensorDict
from torchrl.data import LazyTensorStorage
from torchrl.data import TensorDictReplayBuffer as TorchRLBuffer

from benchmarks.harness import NotMeasured, Result, interleaved_seconds
from fastreplay import TensorDictReplayBuffer

NAME = "pin"


def _device_transform(td: TensorDict) -> TensorDict:
    # A transform returning a ``device=None`` TensorDict: TorchRL 0.14.1 does not pin it.
    return TensorDict(pixels=td["pixels"], step=td["step"], batch_size=td.batch_size)


def run(args: argparse.Namespace) -> list[Result]:
    if not torch.cuda.is_available():
        raise NotMeasured("no CUDA device, so there is no host-to-device copy to time")
    shape = tuple(int(s) for s in args.pin_shape.split("x"))
    n, batch = args.pin_size, args.pin_batch
    gen = torch.Generator().manual_seed(args.seed)
    data = TensorDict(
        pixels=torch.randint(0, 255, (n, *shape), dtype=torch.uint8, generator=gen),
        step=torch.arange(n),
        batch_size=[n],
    )
    cuda = torch.device("cuda")
    results = []
    for case, transform in (("plain", None), ("device=None transform", _device_transform)):
        torchrl_rb = TorchRLBuffer(
            storage=LazyTensorStorage(n),
            batch_size=batch,
            pin_memory=True,
            transform=transform,
            generator=torch.Generator().manual_seed(1),
        )
        ours = TensorDictReplayBuffer(
            storage=LazyTensorStorage(n),
            batch_size=batch,
            pin_memory=True,
            device=cuda,
            transform=transform,
            generator=torch.Generator().manual_seed(1),
        )
        torchrl_rb.extend(data)
        ours.extend(data)

        def torchrl_step(rb: TorchRLBuffer = torchrl_rb) -> TensorDict:
            out = rb.sample().to(cuda, non_blocking=True)
            torch.cuda.synchronize()
            return out

        def ours_step(rb: TensorDictReplayBuffer = ours) -> TensorDict:
            out = rb.sample()
            torch.cuda.synchronize()
            return out

        a, b = torchrl_step(), ours_step()  # same generator seed: the same indices
        correct = (
            b["pixels"].device.type == "cuda"
            and torch.equal(a["pixels"].cpu(), b["pixels"].cpu())
            and torch.equal(b["pixels"].cpu(), data["pixels"][b["step"].cpu()])
        )
        times = interleaved_seconds(
            {"fastreplay": ours_step, "torchrl": torchrl_step}, repeats=args.repeats
        )
        t_torchrl, t_ours = times["torchrl"], times["fastreplay"]
        results.append(
            Result(
                scenario=NAME,
                case=f"{case}, {batch}x{args.pin_shape} uint8",
                fastreplay_s=t_ours,
                torchrl_s=t_torchrl,
                correct=bool(correct),
                params={"batch": batch, "stored": n, "shape": args.pin_shape},
            )
        )
    return results

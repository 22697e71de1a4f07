"""StalenessAwareSampler: ``sample(batch)`` cost, fastreplay vs TorchRL.

Each side has its own ``LazyTensorStorage`` holding only ``policy_version`` (``--stale-versions``
versions in equal runs, the newest last). Cases per stored size:

* ``same consumer``: ``sample`` only, ``consumer_version`` unchanged between calls;
* ``consumer +1``: ``consumer_version`` advances before every ``sample``, as a training loop
  does after each optimizer step (fastreplay recomputes its ``V`` bucket weights then).

TorchRL's ``torch.multinomial`` takes at most 2**24 items: above that only fastreplay is timed.
Correctness: fastreplay's per-item probabilities equal the brute-force weights
``1 / (staleness + 1)`` (float32, as TorchRL's) normalised in float64 (relative 1e-9), and
each sample's ``staleness`` info equals ``consumer_version - version`` of the rows drawn.
"""

from __future__ import annotations

import argparse

import torch
from tensordict import TensorDict
from torchrl.data import LazyTensorStorage, ReplayBuffer
from torchrl.data import StalenessAwareSampler as TorchRLStalenessAwareSampler

from benchmarks.harness import (
    Result,
    fmt_count,
    interleaved_seconds,
    parse_counts,
)
from fastreplay import StalenessAwareSampler

NAME = "staleness"
_MULTINOMIAL_MAX = 2**24


def _buffer(sampler: object, versions: torch.Tensor) -> ReplayBuffer:
    rb = ReplayBuffer(storage=LazyTensorStorage(versions.numel()), sampler=sampler)
    rb.extend(TensorDict({"policy_version": versions}, [versions.numel()]))
    return rb


def _correct(sampler: StalenessAwareSampler, rb: ReplayBuffer, batch: int) -> bool:
    versions = rb.storage._storage["policy_version"]
    weight = (1.0 / (sampler.consumer_version - versions.float() + 1.0)).double()  # TorchRL's
    expected = weight / weight.sum()
    probs = sampler.probabilities(rb.storage)
    index, info = sampler.sample(rb.storage, batch)
    return bool(
        torch.allclose(probs, expected, rtol=1e-9, atol=0)
        and torch.equal(info["staleness"], sampler.consumer_version - versions[index].float())
    )


def run(args: argparse.Namespace) -> list[Result]:
    results = []
    batch, n_versions = args.stale_batch, args.stale_versions
    for stored in parse_counts(args.stale_stored):
        versions = torch.arange(stored, dtype=torch.int64) * n_versions // stored
        ours = StalenessAwareSampler()
        ours_rb = _buffer(ours, versions)
        theirs = TorchRLStalenessAwareSampler() if stored <= _MULTINOMIAL_MAX else None
        theirs_rb = _buffer(theirs, versions.clone()) if theirs is not None else None
        for case, advance in (("same consumer", 0), ("consumer +1", 1)):
            for sampler in (ours, theirs):
                if sampler is not None:
                    sampler.consumer_version = n_versions

            def ours_step(
                advance: int = advance,
                sampler: StalenessAwareSampler = ours,
                rb: ReplayBuffer = ours_rb,
            ) -> object:
                sampler.consumer_version += advance
                return sampler.sample(rb.storage, batch)

            fns = {"fastreplay": ours_step}
            if theirs is not None and theirs_rb is not None:

                def theirs_step(
                    advance: int = advance,
                    sampler: TorchRLStalenessAwareSampler = theirs,
                    rb: ReplayBuffer = theirs_rb,
                ) -> object:
                    sampler.consumer_version += advance
                    return sampler.sample(rb.storage, batch)

                fns["torchrl"] = theirs_step
            times = interleaved_seconds(fns, repeats=args.repeats)
            results.append(
                Result(
                    scenario=NAME,
                    case=f"{fmt_count(stored)} stored, {n_versions} versions, {case}",
                    fastreplay_s=times["fastreplay"],
                    torchrl_s=times.get("torchrl"),
                    correct=_correct(ours, ours_rb, batch),
                    params={"stored": stored, "batch": batch, "versions": n_versions},
                )
            )
    return results

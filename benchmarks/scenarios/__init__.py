"""The benchmark scenarios: their registry, read without importing torch.

:data:`SCENARIOS` lists every scenario in the order it runs: its name (for ``--only``), its
description, the module that runs it, and its options' functions in :mod:`benchmarks.arguments`.
``python -m benchmarks --help`` and the argument checks read only this registry and that module;
a scenario's module is imported when it runs. A scenario module defines ``NAME`` (the name
here, which its results carry) and ``run(args) -> list[Result]``.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from benchmarks import arguments as a


@dataclass(frozen=True)
class Scenario:
    """One scenario: what ``--help``, the argument checks and the harness need to run it.

    Attributes:
        name: the scenario's name on the command line (``--only``) and in the results.
        description: one line, shown in ``--help``, the log and the plot.
        module: the module whose ``run(args)`` runs it (imported only to run).
        add_arguments: adds the scenario's options to an argument group.
        check_arguments: the problems of values that must fit together (empty when they do).
        baseline: what the "TorchRL" column holds, when it is something else.
    """

    name: str
    description: str
    module: str
    add_arguments: Callable[[Any], None]
    check_arguments: Callable[[argparse.Namespace], list[str]] | None = None
    baseline: str | None = None


_M = "benchmarks.scenarios."

SCENARIOS: tuple[Scenario, ...] = (
    Scenario(
        "gpu",
        "CUDA storages (uniform, PER, slice), pinned delivery and chunked log-probs, with floors "
        "(needs CUDA, or --gpu-device cpu)",
        _M + "gpu",
        a.add_gpu,
        a.check_gpu,
    ),
    Scenario(
        "her_streaming",
        "HERReplayBuffer / StreamingSliceSampler sample and can_sample after extend(1000)",
        _M + "her_streaming",
        a.add_her_streaming,
    ),
    Scenario(
        "pin",
        "sample + copy to CUDA of uint8 pixel batches (needs CUDA; skipped without it)",
        _M + "pin",
        a.add_pin,
    ),
    Scenario(
        "ppo",
        "PPO old log-probs, 2x256 MLP policy, obs dim 64: peak RSS and time",
        _M + "ppo",
        a.add_ppo,
        baseline="one-shot actor.log_prob",
    ),
    Scenario(
        "prioritized",
        "PrioritizedSampler: each PER call and the online step per backend, bulk, dumps",
        _M + "prioritized",
        a.add_prioritized,
        a.check_prioritized,
    ),
    Scenario(
        "prioritized_slice",
        "PrioritizedSliceSampler: online step (extend 1000 + sample + update) and static",
        _M + "prioritized_slice",
        a.add_prioritized_slice,
        a.check_prioritized_slice,
    ),
    Scenario(
        "scale-out",
        "N writer processes x 1 learner on a shared memmap storage (and Ray)",
        _M + "scale_out",
        a.add_scale_out,
        a.check_scale_out,
    ),
    Scenario(
        "sequence",
        "Sequence sample units (64 x Sequence(32, burn_in=8), PER)",
        _M + "sequence",
        a.add_sequence,
    ),
    Scenario(
        "slice",
        "SliceSampler at large capacity, static and online (extend 1000 + sample)",
        _M + "slice",
        a.add_slice,
        a.check_slice,
    ),
    Scenario(
        "slice_without_replacement",
        "SliceSamplerWithoutReplacement: online step (extend 1000 + sample) and static",
        _M + "slice_without_replacement",
        a.add_slice_without_replacement,
        a.check_slice_without_replacement,
    ),
    Scenario(
        "staleness",
        "StalenessAwareSampler: sample(batch) at a fixed and an advancing consumer version",
        _M + "staleness",
        a.add_staleness,
    ),
    Scenario(
        "startup",
        "Start-up in a fresh process: import, build a PER buffer, first extend/sample/update",
        _M + "startup",
        a.add_startup,
    ),
    Scenario(
        "whole_step",
        "A whole step through the buffer (PER vs TorchRL and cpprb; slices)",
        _M + "whole_step",
        a.add_whole_step,
    ),
)

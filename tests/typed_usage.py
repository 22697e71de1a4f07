"""fastreplay's public API as a typed user script uses it; ``tests/test_typing.py`` runs mypy on it.

Not a test module (pytest collects ``test_*.py`` only). Each function builds one public class
with its documented arguments and calls its main methods, as a training script would; mypy must
accept the whole file with no ignore comment. ``main()`` runs every function but the Ray one
(``tests/test_typing.py`` runs it too, so the examples stay working code); the Ray buffer is
type-checked only, since building it starts Ray.
"""

from __future__ import annotations

import functools
import math
from typing import TYPE_CHECKING

import torch
from tensordict import TensorDict
from tensordict.nn import NormalParamExtractor, TensorDictModule
from torchrl.data import LazyTensorStorage, ReplayBuffer
from torchrl.modules import ProbabilisticActor

import fastreplay
from fastreplay import (
    PrioritizedSampler,
    PrioritizedSliceSampler,
    RayReplayBuffer,
    SliceSampler,
    SliceSamplerWithoutReplacement,
    TensorDictPrioritizedReplayBuffer,
    TensorDictReplayBuffer,
    chunked_log_prob,
)

DONE = ("next", "done")


def episodes(steps: int = 60, length: int = 10) -> TensorDict:
    """``steps`` steps of episodes of ``length`` steps, with ids, done flags and observations."""
    episode = torch.arange(steps) // length
    done = torch.zeros(steps, 1, dtype=torch.bool)
    done[length - 1 :: length] = True
    return TensorDict({"episode": episode, "obs": torch.randn(steps, 3), DONE: done}, [steps])


def slice_sampler() -> None:
    sampler = SliceSampler(num_slices=4, traj_key="episode", strict_length=False, span=(0, 2))
    rb = TensorDictReplayBuffer(storage=LazyTensorStorage(100), sampler=sampler, batch_size=16)
    rb.extend(episodes())
    batch: TensorDict = rb.sample()
    assert batch.ndim == 1  # slices clipped at episode ends: up to 16 steps
    sampler.num_slices = 2  # read at the next sample, as in TorchRL
    sampler.end_key = DONE
    sampler.invalidate_boundaries()
    index, info = sampler.sample(rb.storage, 8)
    assert 0 < index[0].numel() <= 8 and isinstance(info, dict)
    by_length = SliceSampler(slice_len=4, end_key=DONE, pad_output=True, strict_length=False)
    keys = SliceSampler(slice_len=4, traj_key="episode", use_gpu=False)  # every TorchRL version
    assert by_length.slice_len == keys.slice_len == 4


def slice_sampler_without_replacement() -> None:
    sampler = SliceSampler(replacement=False, num_slices=2, end_key=DONE)
    assert isinstance(sampler, SliceSamplerWithoutReplacement)
    direct = SliceSamplerWithoutReplacement(
        num_slices=2, traj_key="episode", drop_last=True, shuffle=False
    )
    rb = ReplayBuffer(storage=LazyTensorStorage(100), sampler=direct, batch_size=8)
    rb.extend(episodes())
    rb.sample()
    direct.drop_last = False
    assert isinstance(direct.ran_out, bool)
    state = direct.state_dict()
    direct.load_state_dict(state)


def prioritized_sampler() -> None:
    sampler = PrioritizedSampler(
        100,
        alpha=0.7,
        beta=0.5,
        eps=1e-6,
        dtype=torch.float64,
        max_priority_within_buffer=True,
        upper_priority=100.0,
        initial_priority=1.0,
    )
    rb = ReplayBuffer(storage=LazyTensorStorage(100), sampler=sampler, batch_size=8)
    index = rb.extend(episodes())
    sampler.update_priority(index, torch.rand(index.shape[0]) + 0.1)
    sampler.alpha = 0.6
    priority = sampler.default_priority
    assert sampler.backend in ("numba", "torch") and float(priority) > 0
    sampler.load_state_dict(sampler.state_dict())
    rb.sample()


def prioritized_slice_sampler() -> None:
    sampler = PrioritizedSliceSampler(
        max_capacity=100,
        alpha=0.7,
        beta=0.5,
        slice_len=4,
        traj_key="episode",
        strict_length=True,
        upper_priority=math.inf,
        initial_priority=1.0,
    )
    assert isinstance(sampler, SliceSampler) and isinstance(sampler, PrioritizedSampler)
    rb = TensorDictReplayBuffer(storage=LazyTensorStorage(100), sampler=sampler)
    index = rb.extend(episodes())
    rb.update_priority(index, torch.rand(index.shape[0]) + 0.1)
    assert rb.sample(8).shape == (8,)
    sampler.num_slices, sampler.slice_len = 4, None  # TD-MPC's num_slices before each sample
    batch = rb.sample(4 * 5)
    assert batch.shape == (20,)


def prioritized_buffer() -> None:
    rb = TensorDictPrioritizedReplayBuffer(
        alpha=0.7,
        beta=0.5,
        eps=1e-8,
        storage=LazyTensorStorage(100),
        batch_size=8,
        priority_key="td_error",
        pin_memory=False,
        device="cpu",
    )
    rb.extend(episodes().set("td_error", torch.rand(60)))  # initial priorities
    batch: TensorDict = rb.sample()
    batch["td_error"] = torch.rand(8) + 0.1
    rb.update_tensordict_priority(batch)


def actor_log_prob() -> None:
    actor = ProbabilisticActor(
        TensorDictModule(
            torch.nn.Sequential(torch.nn.Linear(3, 4), NormalParamExtractor()),
            in_keys=["obs"],
            out_keys=["loc", "scale"],
        ),
        in_keys=["loc", "scale"],
        distribution_class=torch.distributions.Normal,
    )
    data = episodes().set("action", torch.randn(60, 2))
    log_prob = chunked_log_prob(actor, data, chunk_size=16, out_key="old_log_prob")
    assert isinstance(log_prob, torch.Tensor) and log_prob.shape[0] == 60


def ray_buffer() -> None:  # type-checked only: building it starts Ray
    rb = RayReplayBuffer(
        replay_buffer_cls=TensorDictPrioritizedReplayBuffer,
        alpha=0.7,
        beta=0.5,
        storage=functools.partial(LazyTensorStorage, 1_000),
        batch_size=32,
    )
    rb.extend(episodes())


if TYPE_CHECKING:  # the signatures a user's editor shows: every type resolved
    from typing_extensions import reveal_type

    reveal_type(chunked_log_prob)
    reveal_type(SliceSampler(replacement=False, num_slices=2))
    reveal_type(PrioritizedSliceSampler(10, 0.7, 0.5, num_slices=2))
    reveal_type(fastreplay.__version__)


def main() -> None:
    """Run every example but the Ray one."""
    torch.manual_seed(0)
    slice_sampler()
    slice_sampler_without_replacement()
    prioritized_sampler()
    prioritized_slice_sampler()
    prioritized_buffer()
    actor_log_prob()


if __name__ == "__main__":
    main()

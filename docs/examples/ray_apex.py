"""Ape-X with Ray: writer actors extend a fastreplay buffer held by a Ray actor; the driver learns.

Run with ``python docs/examples/ray_apex.py`` (needs Ray: ``pip install ray``).
``tests/test_ray.py`` runs :func:`main` on its local Ray instance.
"""

from __future__ import annotations

import functools
from typing import Any

import ray
import torch
from tensordict import TensorDict
from torchrl.data import LazyTensorStorage

import fastreplay

EPISODE = 25


@ray.remote(num_cpus=0)
class Actor:
    """An Ape-X actor: writes whole episodes through a buffer client."""

    def __init__(self, client: Any, actor_id: int) -> None:
        self.client = client
        self.actor_id = actor_id

    def run(self, episodes: int) -> int:
        """Write ``episodes`` episodes; returns the number of steps written."""
        for number in range(episodes):
            episode_id = self.actor_id * 1_000 + number
            self.client.extend(
                TensorDict(
                    episode=torch.full((EPISODE,), episode_id),
                    obs=episode_id * 10_000 + torch.arange(EPISODE),
                    batch_size=[EPISODE],
                )
            )
        return episodes * EPISODE


def main(num_actors: int = 2, episodes: int = 20, steps: int = 20) -> dict[str, Any]:
    """Write with ``num_actors`` Ray actors, learn on the driver; returns what it checked."""
    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=2, include_dashboard=False)
    rb = fastreplay.RayReplayBuffer(  # raises here if the actor cannot build the buffer
        replay_buffer_cls=fastreplay.TensorDictPrioritizedReplayBuffer,
        alpha=0.7,
        beta=0.5,
        storage=functools.partial(LazyTensorStorage, 1_000),
        batch_size=64,
        remote_config={"num_cpus": 0},
    )
    try:
        actors = [Actor.remote(rb.client(), i) for i in range(num_actors)]
        written = sum(ray.get([a.run.remote(episodes) for a in actors]))
        for _ in range(steps):  # the learner: sample, TD errors, priorities back to the actor
            batch = rb.sample()
            assert torch.equal(batch["obs"] // 10_000, batch["episode"])
            batch["td_error"] = (batch["obs"] % 10_000).float() + 1.0
            rb.update_tensordict_priority(batch)
        sampler = ray.get(rb._rb._getattr.remote("_sampler"))
        return {
            "written": written,
            "stored": len(rb),
            "live_max": sampler.default_priority,
            "max_stored_priority": float(sampler.state_dict()["_raw"].max()),
        }
    finally:
        rb.close()
        if started:
            ray.shutdown()


if __name__ == "__main__":
    print(main())

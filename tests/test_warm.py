"""``python -m fastreplay.warm``: after it, a fresh process's first PER steps compile nothing."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import REPO

pytest.importorskip("numba")

_STEPS = """
import json
import torch
from tensordict import TensorDict
from torchrl.data import LazyTensorStorage
import fastreplay
from fastreplay._core.trees import numba_kernels

for dtype in (torch.float32, torch.float64):
    for capacity in (1001, 40001):  # a bulk write of 40001 priorities takes the compiled pow
        rb = fastreplay.TensorDictReplayBuffer(
            storage=LazyTensorStorage(capacity), batch_size=64, priority_key="td_error",
            sampler=fastreplay.PrioritizedSampler(capacity, 0.7, 0.5, dtype=dtype),
        )
        rb.extend(TensorDict(obs=torch.zeros(capacity, 4), batch_size=[capacity]))
        rb.update_priority(torch.arange(capacity), torch.rand(capacity) + 0.1)
        for _ in range(3):
            rb.extend(TensorDict(obs=torch.zeros(16, 4), batch_size=[16]))
            sample = rb.sample()
            sample["td_error"] = sample["obs"][:, 0] + 1.0
            rb.update_tensordict_priority(sample)
            rb.update_priority(sample["index"], 2.0)
        state = rb.state_dict()
        rb.load_state_dict(state)
stats = {}
for name, kernel in vars(numba_kernels).items():
    if getattr(kernel, "signatures", None):
        counts = kernel.stats
        stats[name] = [sum(counts.cache_hits.values()), sum(counts.cache_misses.values())]
print(json.dumps(stats))
"""


def _run(args: list[str], cache: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "NUMBA_CACHE_DIR": cache}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "src"), str(REPO)])
    return subprocess.run(
        [sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=600
    )


@pytest.mark.slow
def test_warm_fills_the_cache_the_first_steps_read(tmp_path) -> None:
    """Without warming, the steps compile; after ``python -m fastreplay.warm``, they only load."""
    cold = _run(["-c", _STEPS], str(tmp_path / "unwarmed"))
    assert cold.returncode == 0, cold.stderr[-2000:]
    compiled = json.loads(cold.stdout.strip().splitlines()[-1])
    assert any(misses for _, misses in compiled.values())  # the check can fail
    cache = str(tmp_path / "warmed")
    done = _run(["-m", "fastreplay.warm"], cache)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "numba kernels ready in" in done.stdout and cache in done.stdout
    steps = _run(["-c", _STEPS], cache)
    assert steps.returncode == 0, steps.stderr[-2000:]
    stats = json.loads(steps.stdout.strip().splitlines()[-1])
    assert stats and set(stats) >= {"_mark_update", "_sample", "_check_and_write"}
    for name, (hits, misses) in stats.items():
        assert misses == 0 and hits > 0, (name, hits, misses)


def test_warm_returns_the_kernels_it_compiled() -> None:
    from fastreplay.warm import warm

    kernels = warm()
    assert {"_mark_update", "_sample", "_check_and_write", "_write_priorities"} <= set(kernels)
    assert kernels["_check_and_write"] >= 2  # float32 and float64 priorities

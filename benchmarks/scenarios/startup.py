"""Start-up: what a fresh process pays before its first PER step, fastreplay against TorchRL.

Each run is a fresh Python process that first imports torch, tensordict and ``torchrl.data``
(both libraries need them; not timed), then times: ``import fastreplay`` (nothing for TorchRL,
already imported), building a ``TensorDictPrioritizedReplayBuffer`` (alpha 0.7, beta 0.5, a
``LazyTensorStorage`` of 1,000 rows, batch 16), the first ``extend`` of 16 rows of ``obs[4]``,
the first ``sample`` and the first ``update_priority``. Cases:

* ``warm``: numba's cache as the user's processes find it. Each side runs ``--startup-runs``
  times, alternating; the last run is reported (the first one fills the caches: numba's
  compiled kernels, Python's bytecode).
* ``cold``: fastreplay with ``NUMBA_CACHE_DIR`` pointed at an empty temporary folder, so every
  kernel the step uses compiles (a fresh container, a read-only install; see
  ``python -m fastreplay.warm``). TorchRL has no such cache: its column repeats its warm time.

Correct: with NumPy's global RNG seeded, both libraries sample the same 16 indices with the
same weights (TorchRL's CPU sampler draws from it, and fastreplay draws the same numbers).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile

from benchmarks.harness import NotMeasured, Result

NAME = "startup"

CHILD = """
import json, sys, time
t0 = time.perf_counter()
import numpy as np
import torch
import tensordict
from torchrl.data import LazyTensorStorage
from torchrl.data import TensorDictPrioritizedReplayBuffer as TorchRLBuffer
side = sys.argv[1]
torch.set_num_threads(1)
np.random.seed(0)
t1 = time.perf_counter()
if side == "fastreplay":
    import fastreplay
    buffer_class = fastreplay.TensorDictPrioritizedReplayBuffer
else:
    buffer_class = TorchRLBuffer
try:
    rb = buffer_class(alpha=0.7, beta=0.5, storage=LazyTensorStorage(1000), batch_size=16)
except RuntimeError as error:  # TorchRL without its compiled extension
    if side == "fastreplay":
        raise
    print(json.dumps({"unavailable": str(error)}))
    sys.exit(0)
obs = torch.arange(64, dtype=torch.float32).reshape(16, 4)
rb.extend(tensordict.TensorDict(obs=obs, batch_size=[16]))
batch = rb.sample()
rb.update_priority(batch["index"], batch["obs"][:, 0] + 1.0)
t2 = time.perf_counter()
print(json.dumps({
    "seconds": t2 - t1,
    "dependencies_s": t1 - t0,
    "index": batch["index"].tolist(),
    "weight": batch["priority_weight"].tolist(),
    "numba": "numba" in sys.modules,
}))
"""


def _child(side: str, env: dict[str, str]) -> dict | None:
    """One fresh process; ``None`` where TorchRL's side cannot run here (no compiled trees)."""
    done = subprocess.run(
        [sys.executable, "-c", CHILD, side],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"the {side} start-up process failed:\n{done.stderr[-2000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    return None if "unavailable" in result else result


def _agree(ours: dict, theirs: dict | None) -> bool:
    if theirs is None:  # nothing to compare with: the sample must still be valid
        return all(0 <= i < 16 for i in ours["index"]) and all(w > 0 for w in ours["weight"])
    if ours["index"] != theirs["index"]:
        return False
    pairs = zip(ours["weight"], theirs["weight"], strict=True)
    return all(abs(a - b) <= 1e-6 * abs(b) for a, b in pairs)


def run(args: argparse.Namespace) -> list[Result]:
    cases = [c.strip() for c in args.startup_cases.split(",") if c.strip()]
    numba = importlib.util.find_spec("numba") is not None
    if not numba and "cold" in cases:  # no compiled kernels, no cache to empty
        print("  cold: not run, numba is not installed (fastreplay uses its torch trees)")
        cases.remove("cold")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    results = []
    warm: dict[str, dict | None] = {}
    if "warm" in cases or "cold" in cases:
        for _ in range(args.startup_runs if "warm" in cases else 1):
            for side in ("fastreplay", "torchrl"):
                warm[side] = _child(side, env)
    ours, theirs = warm["fastreplay"], warm["torchrl"]
    if ours is None:
        raise NotMeasured("fastreplay's start-up process gave no result")
    torchrl_s = theirs["seconds"] if theirs else None
    params = {"capacity": 1000, "extend": 16, "batch": 16}
    extra = {
        "dependencies_s": ours["dependencies_s"],
        "numba_imported": ours["numba"],
        "runs": args.startup_runs,
        "bytecode_written": not sys.dont_write_bytecode,
    }
    if "warm" in cases:
        results.append(
            Result(
                NAME,
                "import + PER buffer + first extend/sample/update_priority, "
                + ("warm numba cache" if numba else "no numba"),
                ours["seconds"],
                torchrl_s,
                _agree(ours, theirs),
                params,
                extra,
            )
        )
    if "cold" in cases:
        with tempfile.TemporaryDirectory(prefix="fastreplay-numba-cache-") as empty:
            cold = _child("fastreplay", {**env, "NUMBA_CACHE_DIR": empty})
        assert cold is not None
        results.append(
            Result(
                NAME,
                "import + PER buffer + first extend/sample/update_priority, empty numba cache",
                cold["seconds"],
                torchrl_s,
                _agree(cold, theirs),
                params | {"numba_cache": "empty"},
                extra | {"dependencies_s": cold["dependencies_s"]},
            )
        )
    return results

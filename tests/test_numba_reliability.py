"""The default (numba) install in hostile places: other processes, read-only installs.

Each test runs its scenario in a fresh Python process: a crash (a segfault from trees that
point at freed memory) or an import error then fails the test instead of killing pytest, and
the process starts without the caches and modules this one already holds.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from conftest import REPO, requires_numba
from fastreplay._core.trees.interface import available_backends


def _run(
    args: list[str], *, env: dict[str, str] | None = None, timeout: int = 300
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        args, env=env, capture_output=True, text=True, timeout=timeout, check=False, cwd=REPO
    )


def _pythonpath(*first: Path | str) -> str:
    return os.pathsep.join([*map(str, first), os.environ.get("PYTHONPATH", "")])


# ---------------------------------------------------------------- pickled for another process
_SEND = textwrap.dedent(
    """
    import math
    import multiprocessing as mp
    import sys

    import torch
    from tensordict import TensorDict
    from torchrl.data import LazyTensorStorage, ReplayBuffer

    import fastreplay
    from fastreplay import PrioritizedSampler

    N, ALPHA, BETA, EPS = 1000, 0.7, 0.5, 1e-8


    def mass(raw):
        return ((raw.double() + EPS) ** ALPHA).float().double()  # as a float32 sampler keeps it


    def check(sampler, storage, raw, where):
        expected = torch.zeros(sampler._slots, dtype=torch.float64)
        expected[: raw.numel()] = mass(raw)
        assert torch.equal(sampler._trees.leaf_mass(), expected), where
        total = math.fsum(expected.tolist())
        assert abs(sampler._trees.total() - total) <= 1e-12 * total, (where, total)
        assert sampler._trees.min_mass() == expected[: raw.numel()].min().item(), where
        index, info = sampler.sample(storage, 512)
        assert 0 <= int(index.min()) and int(index.max()) < raw.numel(), where
        weight = (expected[index] / expected[: raw.numel()].min()) ** -BETA
        torch.testing.assert_close(info["priority_weight"], weight.float(), rtol=1e-5, atol=0)


    def receive(queue, results):
        for _ in range(int(sys.argv[2])):
            got = queue.get(timeout=120)
            sampler = got if isinstance(got, PrioritizedSampler) else got.sampler
            total = sampler._trees.total()
            # this process owns its copy: writing it must not reach the sender's trees
            sampler.update_priority(torch.arange(5), torch.full((5,), 100.0))
            results.put((sampler.backend, total, sampler._trees.total()))


    if __name__ == "__main__":
        ctx = mp.get_context("spawn")
        queue, results = ctx.Queue(), ctx.Queue()
        gen = torch.Generator().manual_seed(0)
        sent = []
        for backend in sys.argv[1].split(","):
            sampler = PrioritizedSampler(N, ALPHA, BETA, eps=EPS, backend=backend)
            rb = ReplayBuffer(storage=LazyTensorStorage(N), sampler=sampler)
            rb.extend(torch.arange(100))
            sent.append((sampler, rb.storage, torch.rand(100, generator=gen) + 0.1, sampler))
        tdrb = fastreplay.TensorDictPrioritizedReplayBuffer(
            alpha=ALPHA, beta=BETA, eps=EPS, storage=LazyTensorStorage(N), priority_key="td"
        )
        raw = torch.rand(100, generator=gen) + 0.1
        tdrb.extend(TensorDict({"obs": torch.arange(100), "td": raw}, [100]))
        sent.append((tdrb.sampler, tdrb.storage, raw, tdrb))
        for sampler, storage, raw, _ in sent:
            sampler.update_priority(torch.arange(100), raw, storage=storage)
        receiver = ctx.Process(target=receive, args=(queue, results))
        receiver.start()
        for *_, obj in sent:
            queue.put(obj)  # pickled in a feeder thread: the tensors move to shared memory
        received = [results.get(timeout=240) for _ in sent]  # every copy was taken and written
        receiver.join(60)
        assert receiver.exitcode == 0, receiver.exitcode
        for (sampler, storage, raw, _), (backend, total, _) in zip(sent, received):
            assert backend == sampler.backend and total == sampler._trees.total()
            check(sampler, storage, raw, f"{backend}: after the put")
            raw = torch.rand(100, generator=gen) + 0.1  # the sender keeps writing and sampling
            sampler.update_priority(torch.arange(100), raw, storage=storage)
            check(sampler, storage, raw, f"{backend}: after an update")
        print("OK", [backend for backend, *_ in received])
    """
)


def test_a_sampler_put_on_a_multiprocessing_queue_keeps_working_in_the_sender(
    tmp_path: Path,
) -> None:
    """``mp.Queue.put`` of samplers (every backend) and of a TensorDictPrioritizedReplayBuffer,
    taken by a spawned process: pickling moves torch tensors to shared memory, which must not
    leave the sender's trees stale, and the receiver's copy is its own. Exact masses, totals
    and weights against a brute-force model afterwards, in both processes' order of writes."""
    script = tmp_path / "send.py"
    script.write_text(_SEND)
    backends = ",".join(available_backends())
    count = len(available_backends()) + 1
    env = {**os.environ, "PYTHONPATH": _pythonpath(REPO / "src")}
    done = _run([sys.executable, str(script), backends, str(count)], env=env)
    assert done.returncode == 0, (done.returncode, done.stdout, done.stderr[-3000:])
    assert done.stdout.splitlines()[-1].startswith("OK"), done.stdout


# ---------------------------------------------------------------- read-only installs
_IMPORT = textwrap.dedent(
    """
    import os
    import sys
    import warnings

    import numba  # third-party imports first: only fastreplay's import runs under "error"
    import tensordict
    import torch
    import torchrl.data

    folder = os.path.join(os.path.dirname(sys.argv[1]), "__pycache__")
    if sys.argv[2] == "read-only":  # the scenario holds: nothing can be written there
        for path in (folder, os.environ["XDG_CACHE_HOME"]):
            try:
                open(os.path.join(path, "probe"), "w").close()
            except OSError:
                continue
            sys.exit(f"{path} is writable: the scenario does not hold")
    warnings.simplefilter("error")  # as in a test suite: a warning would fail the import
    import fastreplay
    from fastreplay import PrioritizedSampler
    from fastreplay._core import numba_jit
    from fastreplay._core.trees import numba_kernels  # the kernels: defined

    assert numba_kernels.NUMBA_AVAILABLE

    assert os.path.samefile(fastreplay.__file__, sys.argv[1]), fastreplay.__file__
    print("cache:", numba_jit._cache)
    if sys.argv[2] == "read-only":  # the kernels compile without a cache, and run
        sampler = PrioritizedSampler(8, 1.0, 1.0, eps=0.0, backend="numba")
        sampler.update_priority(torch.arange(4), torch.tensor([1.0, 2.0, 3.0, 4.0]))
        class Storage:  # four stored items (a TorchRL storage would log to stdout)
            ndim, device = 1, None

            def __len__(self):
                return 4

        index, info = sampler.sample(Storage(), 64)
        assert sampler._trees.total() == 10.0 and int(index.max()) < 4
        assert torch.equal(info["priority_weight"], 1.0 / (index + 1.0))
        print("sampled")
    """
)


def _read_only(folder: Path, args: list[str]) -> list[str]:
    """``args`` run with ``folder`` read-only (a read-only bind mount for root, who ignores
    file permissions, in a private mount namespace); skips where that cannot be arranged."""
    for path in [folder, *folder.rglob("*")]:
        path.chmod(path.stat().st_mode & ~0o222)
    if os.geteuid() != 0:
        return args
    mount = 'mount --bind "$0" "$0" && mount -o remount,ro,bind "$0" && exec "$@"'
    wrap = ["unshare", "-m", "sh", "-c", mount, str(folder)]
    if shutil.which("unshare") is None or _run([*wrap, "true"], timeout=30).returncode != 0:
        pytest.skip("running as root without mount namespaces: no folder can be read-only")
    return [*wrap, *args]


@requires_numba
def test_import_works_where_numba_cannot_cache_and_says_how_to_enable_it(
    tmp_path: Path,
) -> None:
    """Read-only package and cache dir, no NUMBA_CACHE_DIR (numba's locators: the in-tree
    ``__pycache__``, the user-wide cache dir; IPython and zip locators do not apply): importing
    works with warnings as errors, the kernels compile without a cache, and one log message
    names ``NUMBA_CACHE_DIR``."""
    site = tmp_path / "ro"
    shutil.copytree(
        REPO / "src" / "fastreplay",
        site / "pkg" / "fastreplay",
        ignore=shutil.ignore_patterns("__pycache__"),
    )
    (site / "pkg" / "fastreplay" / "__pycache__").mkdir()
    home = site / "home"
    (home / ".cache").mkdir(parents=True)
    script = tmp_path / "import_it.py"
    script.write_text(_IMPORT)
    env = {**os.environ, "HOME": str(home), "XDG_CACHE_HOME": str(home / ".cache")}
    env.pop("NUMBA_CACHE_DIR", None)
    env["PYTHONPATH"] = _pythonpath(site / "pkg")
    init = site / "pkg" / "fastreplay" / "__init__.py"
    args = _read_only(site, [sys.executable, str(script), str(init), "read-only"])
    done = _run(args, env=env)
    assert done.returncode == 0, (done.returncode, done.stdout, done.stderr[-3000:])
    assert done.stdout.split() == ["cache:", "False", "sampled"], done.stdout
    assert done.stderr.count("NUMBA_CACHE_DIR=/some/writable/dir") == 1, done.stderr


@requires_numba
def test_import_with_a_writable_cache_says_nothing(tmp_path: Path) -> None:
    """The usual case: kernels cached (here in ``NUMBA_CACHE_DIR``), no message, no warning."""
    script = tmp_path / "import_it.py"
    script.write_text(_IMPORT)
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "cache")}
    env["PYTHONPATH"] = _pythonpath(REPO / "src")
    init = REPO / "src" / "fastreplay" / "__init__.py"
    done = _run([sys.executable, str(script), str(init), "writable"], env=env)
    assert done.returncode == 0, (done.returncode, done.stdout, done.stderr[-3000:])
    assert done.stdout.split() == ["cache:", "True"], done.stdout
    assert "NUMBA_CACHE_DIR" not in done.stderr and "fastreplay" not in done.stderr, done.stderr


@pytest.mark.parametrize("backend", available_backends())
def test_trees_unpickled_from_read_only_buffers_own_writable_trees(backend: str) -> None:
    """Pickle protocol 5 with out-of-band buffers (Ray's object store hands back read-only ones)."""
    import pickle

    import torch
    from torchrl.data import LazyTensorStorage, ReplayBuffer

    from fastreplay import PrioritizedSampler

    sampler = PrioritizedSampler(11, alpha=1.0, beta=1.0, backend=backend)
    rb = ReplayBuffer(storage=LazyTensorStorage(11), sampler=sampler, batch_size=4)
    index = rb.extend(torch.arange(11))
    rb.update_priority(index, torch.arange(1.0, 12.0))
    buffers: list[pickle.PickleBuffer] = []
    payload = pickle.dumps(sampler, protocol=5, buffer_callback=buffers.append)
    copy = pickle.loads(payload, buffers=[memoryview(b).toreadonly() for b in buffers])
    copy.update_priority(torch.tensor([0, 10]), torch.tensor([100.0, 0.5]))
    expected = [100.0, *range(2, 11), 0.5]
    assert copy._sum_tree.query(0, 11) == pytest.approx(sum(expected))
    assert float(copy.default_priority) == 100.0
    assert sampler._sum_tree.query(0, 11) == pytest.approx(sum(range(1, 12)))  # the original

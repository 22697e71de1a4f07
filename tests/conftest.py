"""Shared test configuration and fixtures."""

from __future__ import annotations

import ast
import functools
import gc
import importlib
import importlib.util
import math
import os
from collections.abc import Callable
from multiprocessing import resource_tracker
from pathlib import Path
from typing import Any

import pytest
import torch

if not torch.cuda.is_available():
    # The "triton" tree backend's kernels run on CPU tensors under Triton's interpreter. It is
    # chosen when triton is imported (tensordict imports it), so before anything else is.
    os.environ.setdefault("TRITON_INTERPRET", "1")

from fastreplay._core.trees.interface import available_backends
from fastreplay._torchrl import (
    SHORT_FLAT_BATCH_MESSAGE,
    SLICE_SAMPLER_ARGS,
    STORAGE_HAS_REVISION,
    TORCHRL_VERSION,
)

REPO = Path(__file__).resolve().parents[1]
PACKAGE = Path(importlib.util.find_spec("fastreplay").submodule_search_locations[0])


def module_name(path: Path) -> str:
    """The dotted name of the fastreplay module at ``path`` (a package: its folder)."""
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def module_path(module: str) -> Path:
    """The file of the fastreplay module ``module`` (a package: its ``__init__.py``)."""
    relative = Path(*module.split(".")[1:])
    package = PACKAGE / relative / "__init__.py"
    return package if package.exists() else (PACKAGE / relative).with_suffix(".py")


def is_fastreplay_module(name: str) -> bool:
    """Whether ``name`` is fastreplay or one of its existing modules."""
    return name == "fastreplay" or (name.startswith("fastreplay.") and module_path(name).exists())


def imported_names(node: ast.Import | ast.ImportFrom, package: str) -> list[str]:
    """The modules one import statement names, relative ones resolved against ``package``.

    ``from X import a`` names ``X.a`` where that is a fastreplay module, else ``X``.
    """
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if node.level:
        parts = package.split(".")
        base = ".".join(parts[: len(parts) - node.level + 1])
        target = f"{base}.{node.module}" if node.module else base
    else:
        target = node.module or ""
    return [
        sub if is_fastreplay_module(sub) else target
        for sub in (f"{target}.{alias.name}" for alias in node.names)
    ]


def _collections_deferred(send: Callable[..., Any]) -> Callable[..., Any]:
    """``send`` with the garbage collector's automatic runs deferred until it returns."""

    @functools.wraps(send)
    def deferred(*args: Any, **kwargs: Any) -> Any:
        if not gc.isenabled():
            return send(*args, **kwargs)
        gc.disable()
        try:
            return send(*args, **kwargs)
        finally:
            gc.enable()

    deferred.__wrapped_by_fastreplay_tests__ = True  # type: ignore[attr-defined]
    return deferred


def guard_resource_tracker() -> None:
    """No garbage collection while this process talks to multiprocessing's resource tracker.

    TorchRL sets the start method to ``"spawn"`` on import, so every ``mp.Value`` (TorchRL's
    writer and storage counters, five per buffer, and fastreplay's shared-buffer counters)
    holds a named semaphore, registered with the resource tracker and unregistered by a
    finaliser once collected. A collection that starts inside ``register`` runs such a
    finaliser while the tracker's lock is held: Python 3.12 refuses the reentrant call
    (``ReentrantCallError``) and warns that the semaphore might leak, an error in this suite
    (warnings are errors). The guard defers automatic collections for the duration of one
    message to the tracker (one ``os.write``); no warning is filtered. Idempotent.
    """
    tracker = getattr(resource_tracker, "ResourceTracker", None)
    for name in ("_send", "ensure_running"):  # a message; starting the tracker (a spawn's)
        method = getattr(tracker, name, None)
        if method is not None and not getattr(method, "__wrapped_by_fastreplay_tests__", False):
            setattr(tracker, name, _collections_deferred(method))
    instance = getattr(resource_tracker, "_resource_tracker", None)
    if instance is not None:  # the module's alias, bound at its import
        resource_tracker.ensure_running = instance.ensure_running


guard_resource_tracker()


def torchrl_extension_available() -> bool:
    """Whether TorchRL's compiled extension (segment trees) loads on this torch build."""
    try:
        ext = importlib.import_module("torchrl._torchrl")
    except Exception:
        return False
    return hasattr(ext, "SumSegmentTreeFp32")


TORCHRL_EXT = torchrl_extension_available()
requires_torchrl_ext = pytest.mark.skipif(
    not TORCHRL_EXT,
    reason="TorchRL's compiled extension (torchrl._torchrl) does not load on this torch "
    f"build ({torch.__version__}); it is only used here as a reference",
)
# TorchRL's own warning (the nightly's) when a flat slice sample is shorter than asked for:
# ignored, by its text, in the tests that sample short slices on purpose.
short_flat_batches = pytest.mark.filterwarnings(f"ignore:{SHORT_FLAT_BATCH_MESSAGE}:UserWarning")


def _missing_slice_args(names: object) -> list[str]:
    return sorted(str(n) for n in names if n not in SLICE_SAMPLER_ARGS)


def requires_slice_args(*names: str) -> pytest.MarkDecorator:
    """Skip where the installed TorchRL's ``SliceSampler`` lacks an argument (0.13: end_keys...)."""
    missing = _missing_slice_args(names)
    return pytest.mark.skipif(
        bool(missing), reason=f"TorchRL {TORCHRL_VERSION}'s SliceSampler takes no {missing}"
    )


def skip_unless_slice_args(kwargs: object) -> None:
    """In a test: skip if ``kwargs`` names an argument the installed ``SliceSampler`` lacks."""
    missing = _missing_slice_args(kwargs)
    if missing:
        pytest.skip(f"TorchRL {TORCHRL_VERSION}'s SliceSampler takes no {missing}")


# Writes a sampler is not told about are seen through the storage's write counter, and the
# newest row of a storage written by other processes through its shared last cursor: TorchRL
# 0.13's storages have neither (see fastreplay._torchrl.STORAGE_HAS_REVISION).
requires_storage_revision = pytest.mark.skipif(
    not STORAGE_HAS_REVISION,
    reason=f"TorchRL {TORCHRL_VERSION}'s storages count no writes and share no write cursor "
    "with other processes: writes a sampler is not told about need invalidate_boundaries() "
    "there (tests/test_versions.py pins it)",
)
requires_cuda = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device (none on this machine)"
)
requires_numba = pytest.mark.skipif(
    "numba" not in available_backends(),
    reason="numba is not installed here (optional extra 'fast'): only the torch backend runs",
)
requires_triton = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None,
    reason="triton is not installed here (it ships with torch's CUDA builds): the triton tree "
    "backend's kernels are not run",
)


def assert_same_sample(got: tuple, expected: tuple) -> None:
    """Two samplers' ``sample`` results ``(index, info)``: equal index tensors and info."""
    assert len(got[0]) == len(expected[0])
    for a, b in zip(got[0], expected[0], strict=True):
        assert torch.equal(a, b)
    assert got[1].keys() == expected[1].keys()
    for key in got[1]:
        assert torch.equal(got[1][key], expected[1][key]), key


def assert_same_tensordict(a: Any, b: Any) -> None:
    """Same leaves (keys in any order), each of the same type and dtype and equal."""
    assert set(a.keys(True, True)) == set(b.keys(True, True))
    assert a.batch_size == b.batch_size
    for key in a.keys(True, True):
        va, vb = a.get(key), b.get(key)
        assert type(va) is type(vb), key
        if isinstance(va, torch.Tensor):
            assert va.dtype == vb.dtype and torch.equal(va, vb), key
        else:
            assert va == vb, key


def shutdown(buffer: object) -> None:
    """Stop ``buffer``'s background threads: ``buffer.shutdown()`` where TorchRL has it (0.14
    on); on TorchRL 0.13, which has no ``shutdown``, its prefetch executor's."""
    stop = getattr(buffer, "shutdown", None)
    if stop is not None:
        stop()
        return
    executor = getattr(buffer, "_prefetch_executor", None)
    if executor is not None:
        executor.shutdown(wait=True)


def synchronize(buffer: object) -> None:
    """Wait for ``buffer``'s pending background updates (``synchronize()``, TorchRL 0.14 on);
    TorchRL 0.13's buffers update in the calling thread: nothing to wait for."""
    wait = getattr(buffer, "synchronize", None)
    if wait is not None:
        wait()


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


@pytest.fixture(params=["torch", pytest.param("numba", marks=requires_numba)])
def backend(request: pytest.FixtureRequest) -> str:
    """Each priority-tree backend: ``"torch"``, and ``"numba"`` where numba is installed."""
    return request.param


def chi2_pvalue(observed: torch.Tensor, expected: torch.Tensor) -> float:
    """Upper tail of the chi-square statistic (Wilson-Hilferty normal approximation)."""
    dof = observed.numel() - 1
    stat = float(((observed - expected) ** 2 / expected).sum())
    z = ((stat / dof) ** (1 / 3) - (1 - 2 / (9 * dof))) / math.sqrt(2 / (9 * dof))
    return 0.5 * math.erfc(z / math.sqrt(2))


def trajectory_key(mode: str) -> dict:
    """A slice sampler's trajectory argument: ``traj_key`` for ``"ids"``, else ``end_key``."""
    return {"traj_key": "traj"} if mode == "ids" else {"end_key": ("next", "done")}


def record_storage_reads(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """From now on, the number of rows each slice sampler reads from its storage.

    Patches ``IndexSync._read`` (every slice sampler reads its storage through it) to
    append the row count of every read to the returned list.
    """
    from fastreplay.samplers._index_sync import IndexSync

    reads: list[int] = []
    original = IndexSync._read

    def recording(leaves: object, first: int, n: int, *rest: object) -> object:
        reads.append(n)
        return original(leaves, first, n, *rest)

    monkeypatch.setattr(IndexSync, "_read", staticmethod(recording))
    return reads

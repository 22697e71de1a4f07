"""``large_zeros``: the arrays behind large priority trees, on huge pages where Linux allows."""

from __future__ import annotations

import os
import pickle
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from conftest import REPO
from fastreplay._core.memory import (
    HUGE_PAGE,
    MIN_BYTES,
    advise_huge_pages,
    huge_pages_advised,
    large_zeros,
)
from fastreplay._core.trees.interface import available_backends

_THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _thp_mode() -> str | None:
    """The selected transparent-huge-page mode (``always``/``madvise``/``never``), or None."""
    try:
        found = re.search(r"\[(\w+)\]", _THP.read_text())
    except OSError:
        return None
    return found.group(1) if found else None


def _anon_huge_kib(address: int) -> int:
    """``AnonHugePages`` of the mapping of this process that holds ``address``, in KiB."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = re.match(r"([0-9a-f]+)-([0-9a-f]+) ", line)
        if head:
            inside = int(head.group(1), 16) <= address < int(head.group(2), 16)
        elif inside and line.startswith("AnonHugePages:"):
            return int(line.split()[1])
    raise AssertionError(f"no mapping holds address {address:#x}")


def test_small_arrays_are_plain_numpy_zeros() -> None:
    array = large_zeros((3, 100), np.float64)
    assert array.flags.owndata and array.flags.writeable and array.flags.c_contiguous
    assert array.shape == (3, 100) and array.dtype == np.float64
    assert not array.any()


@pytest.mark.parametrize("dtype", [np.float64, np.float32, np.int64])
def test_large_arrays_are_zeroed_writable_and_contiguous(dtype) -> None:
    shape = (3, MIN_BYTES // 8 + 13)  # odd: the end is not on a page boundary
    array = large_zeros(shape, dtype)
    assert array.shape == shape and array.dtype == dtype
    assert array.flags.writeable and array.flags.c_contiguous and array.flags.aligned
    assert not array.any()
    array[:, -1] = 7  # the last element is inside the mapping
    array[0, 0] = 1
    assert array.sum() == 1 + 3 * 7
    if huge_pages_advised(array.nbytes):
        assert array.ctypes.data % HUGE_PAGE == 0
        assert not array.flags.owndata  # lives on the advised mapping


def test_pickled_copies_hold_the_values() -> None:
    array = large_zeros((MIN_BYTES // 8,), np.float64)
    array[::4096] = np.arange(array[::4096].size)
    copy = pickle.loads(pickle.dumps(array))
    assert np.array_equal(copy, array)
    copy[0] = -1.0
    assert array[0] == 0.0


@pytest.mark.skipif(
    not sys.platform.startswith("linux") or _thp_mode() not in ("always", "madvise"),
    reason="transparent huge pages are not available (not Linux, or set to 'never')",
)
def test_large_arrays_get_huge_pages_where_linux_offers_them() -> None:
    array = large_zeros((8 * HUGE_PAGE // 8,), np.float64)  # 8 huge pages
    assert huge_pages_advised(array.nbytes)
    array[:] = 1.0  # fault every page in
    assert _anon_huge_kib(array.ctypes.data) > 0


@pytest.mark.skipif(
    "numba" not in available_backends(),
    reason="numba is not installed here (optional extra 'fast')",
)
def test_large_numba_trees_live_on_advised_memory_and_pickle_back_there() -> None:
    import torch

    from fastreplay._core.trees.numba_backend import NumbaPriorityTrees

    trees = NumbaPriorityTrees(200_003)  # about 5 MiB of trees
    index = torch.tensor([0, 7, 200_002])
    raw = torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64)
    trees.update(index, raw, raw)
    copy = pickle.loads(pickle.dumps(trees))
    for tree in (trees, copy):
        assert huge_pages_advised(tree._tree.nbytes)
        assert not tree._tree.flags.owndata and tree._tree.ctypes.data % HUGE_PAGE == 0
        assert (tree.total(), tree.min_mass(), tree.max_raw()) == (6.0, 1.0, 3.0)
    copy.update(torch.tensor([7]), torch.tensor([5.0]), torch.tensor([5.0]))  # its own trees
    assert (copy.total(), trees.total()) == (9.0, 6.0)


def test_advice_covers_only_whole_huge_pages_inside_the_range() -> None:
    array = large_zeros((4 * HUGE_PAGE,), np.uint8)
    start = array.ctypes.data
    if huge_pages_advised(array.nbytes):
        # [start + 1, start + 1 + 6 MiB) holds the whole pages [start + 2 MiB, start + 6 MiB)
        assert advise_huge_pages(start + 1, 3 * HUGE_PAGE) == 2 * HUGE_PAGE
        assert advise_huge_pages(start, 4 * HUGE_PAGE) == 4 * HUGE_PAGE
    assert advise_huge_pages(start + 1, HUGE_PAGE) == 0  # no whole huge page inside


@pytest.mark.skipif(
    not sys.platform.startswith("linux") or _thp_mode() not in ("always", "madvise"),
    reason="transparent huge pages are not available (not Linux, or set to 'never')",
)
@pytest.mark.parametrize("delayed_init", [False, True])
def test_a_lazy_storage_s_rows_after_the_first_write_get_huge_pages(delayed_init) -> None:
    """In a fresh process, as a training script starts: the storage's memory is new.

    (In a process that already freed large blocks, the C library may serve the storage from
    memory it already holds, whose pages keep their size: the advice is for new memory.)
    """
    script = textwrap.dedent(
        f"""
        import torch
        from tensordict import TensorDict
        from torchrl.data import LazyTensorStorage

        import fastreplay
        from test_memory import _anon_huge_kib

        rows = {3 * MIN_BYTES // 16}  # obs float32[4]: 16 bytes a row
        rb = fastreplay.TensorDictReplayBuffer(
            storage=LazyTensorStorage(rows), batch_size=8, delayed_init={delayed_init}
        )
        first = TensorDict(obs=torch.arange(40.0).reshape(10, 4), batch_size=[10])
        rb.extend(first)
        rb.extend(TensorDict(obs=torch.ones(rows - 10, 4), batch_size=[rows - 10]))
        obs = rb.storage._storage["obs"]
        assert torch.equal(obs[:10], first["obs"]) and bool((obs[10:] == 1).all())
        print("huge KiB:", _anon_huge_kib(obs.data_ptr() + obs.untyped_storage().nbytes() // 2))
        """
    )
    path = os.pathsep.join([str(REPO / "src"), str(REPO / "tests")])
    env = {**os.environ, "PYTHONPATH": path + os.pathsep + os.environ.get("PYTHONPATH", "")}
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    kib = int(done.stdout.split("huge KiB:")[1].split()[0])
    assert kib > 0, done.stdout


def test_the_environment_variable_turns_the_advice_off(monkeypatch) -> None:
    monkeypatch.setenv("FASTREPLAY_HUGE_PAGES", "0")
    array = large_zeros((MIN_BYTES,), np.uint8)
    assert array.flags.owndata and not huge_pages_advised(array.nbytes)
    assert advise_huge_pages(array.ctypes.data, array.nbytes) == 0

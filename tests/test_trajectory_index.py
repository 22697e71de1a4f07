"""The pure trajectory index against a one-shot recomputation over the whole storage."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fastreplay._core.trajectory_index import TrajectoryIndex
from fastreplay._torchrl import find_start_stop_traj


def _reference(storage: np.ndarray, size: int, cursor: int, mode: str) -> list[tuple]:
    """TorchRL's one-shot recovery over the stored rows, as sorted (col, start, stop, len)."""
    data = torch.from_numpy(storage[:size])
    full = size == storage.shape[0]
    kw = {"trajectory": data} if mode == "ids" else {"end": data}
    start, stop, length = find_start_stop_traj(at_capacity=full, cursor=cursor, **kw)
    col = start[:, 1] if start.shape[1] > 1 else torch.zeros_like(length)
    return list(
        zip(col.tolist(), start[:, 0].tolist(), stop[:, 0].tolist(), length.tolist(), strict=True)
    )


@pytest.mark.parametrize("mode", ["done", "ids"])
@pytest.mark.parametrize("rows,columns", [(7, 1), (50, 3), (1023, 1)])
def test_random_writes_match_one_shot_recovery(mode: str, rows: int, columns: int) -> None:
    rng = np.random.default_rng(rows * 10 + columns)
    index = TrajectoryIndex(rows, columns, mode)
    storage = np.zeros((rows, columns), dtype=bool if mode == "done" else np.int64)
    cursor, size, next_id = -1, 0, np.arange(columns)
    for _ in range(40):
        n = int(rng.integers(1, 2 * rows + 2))
        if mode == "done":
            signal = rng.random((n, columns)) < 0.2
        else:  # non-monotonic ids: a new id is drawn from a small range, so ids repeat
            change = rng.random((n, columns)) < 0.2
            signal = np.where(change, rng.integers(0, 5, (n, columns)), -1)
            for t in range(n):
                signal[t] = np.where(signal[t] < 0, next_id, signal[t])
                next_id = signal[t]
        first = (cursor + 1) % rows
        index.write(first, signal)
        for t in range(n):
            storage[(first + t) % rows] = signal[t]
        cursor, size = (first + n - 1) % rows, min(rows, size + n)
        start, stop, length, col = index.boundaries()
        got = list(zip(col.tolist(), start.tolist(), stop.tolist(), length.tolist(), strict=True))
        assert got == _reference(storage, size, cursor, mode)
        assert index.size == size and index.cursor == cursor


def test_select_ranks_follow_torchrl_order_with_length_filter() -> None:
    index = TrajectoryIndex(20, 2, "done")
    done = np.zeros((27, 2), dtype=bool)
    done[[1, 4, 10, 12, 20], 0] = True
    done[[2, 9, 15, 25], 1] = True
    index.write(0, done)
    start, _, length, col = index.boundaries()
    for min_length in (1, 3, 6):
        eligible = np.flatnonzero(length >= min_length)
        assert index.counts(min_length).sum() == eligible.size
        s, n, c = index.select(np.arange(eligible.size), min_length)
        np.testing.assert_array_equal(s, start[eligible])
        np.testing.assert_array_equal(n, length[eligible])
        np.testing.assert_array_equal(c, col[eligible])


def test_episode_longer_than_capacity_keeps_only_the_last_rows() -> None:
    index = TrajectoryIndex(7, 1, "ids")
    for _ in range(5):
        index.write((index.cursor + 1) % 7, np.zeros((3, 1), dtype=np.int64))
    start, stop, length, _ = index.boundaries()
    # 15 rows into 7: the cursor is row 0, so the one trajectory runs from row 1 round to 0
    assert (start.tolist(), stop.tolist(), length.tolist()) == ([1], [0], [7])
    assert index.num_trajectories == 1


def test_memory_is_proportional_to_trajectories_not_rows() -> None:
    index = TrajectoryIndex(10**9, 1, "done")
    done = np.zeros((10_000, 1), dtype=bool)
    done[999::1000] = True
    index.write(0, done)
    assert index.num_trajectories == 10
    assert index.nbytes() < 10_000


def test_bad_first_row_is_rejected_and_index_unchanged() -> None:
    index = TrajectoryIndex(7, 1, "done")
    index.write(0, np.zeros((3, 1), dtype=bool))
    before = [a.tolist() for a in index.boundaries()]
    with pytest.raises(ValueError, match=r"first_row=5 does not follow the last written row 2"):
        index.write(5, np.zeros((1, 1), dtype=bool))
    assert [a.tolist() for a in index.boundaries()] == before
    with pytest.raises(ValueError, match=r"mode must be 'done' or 'ids', got mode='x'"):
        TrajectoryIndex(7, 1, "x")


def _assert_locate_matches_boundaries(index: TrajectoryIndex, rows: int, columns: int) -> None:
    """``locate`` of every stored (row, column) against the trajectories ``boundaries`` lists."""
    start, _, length, column = index.boundaries()
    expected = {}
    for s, steps, c in zip(start.tolist(), length.tolist(), column.tolist(), strict=True):
        for p in range(steps):
            expected[((s + p) % rows, c)] = (s, steps)
    keys = sorted(expected)
    assert len(keys) == index.size * columns
    got = index.locate(np.array([k[0] for k in keys]), np.array([k[1] for k in keys]))
    assert list(zip(*(g.tolist() for g in got), strict=True)) == [expected[k] for k in keys]


@pytest.mark.parametrize("rows,columns,mode", [(7, 1, "done"), (50, 1, "ids"), (13, 3, "done")])
def test_locate_matches_the_boundaries(rows: int, columns: int, mode: str) -> None:
    gen = torch.Generator().manual_seed(rows)
    index = TrajectoryIndex(rows, columns, mode)
    first, last_id = 0, torch.zeros(columns, dtype=torch.long)
    for n in (3, rows - 1, 2 * rows + 1, 5, rows):  # partial, wrapping, longer than rows
        if mode == "done":
            signal = torch.rand(n, columns, generator=gen) < 0.25
        else:
            signal = last_id + torch.cumsum(torch.rand(n, columns, generator=gen) < 0.25, 0)
            last_id = signal[-1]
        index.write(first, signal.numpy())
        first = (first + n) % rows
        _assert_locate_matches_boundaries(index, rows, columns)


@pytest.mark.parametrize("rows,columns", [(7, 1), (50, 1), (13, 3)])
def test_locate_matches_the_boundaries_while_the_trajectory_ring_wraps(
    rows: int, columns: int
) -> None:
    rng = np.random.default_rng(rows)
    index = TrajectoryIndex(rows, columns, "done")
    first, wrapped = 0, False
    for _ in range(60):
        n = int(rng.integers(1, rows + 3))
        index.write(first, rng.random((n, columns)) < 0.4)
        first = (first + n) % rows
        ring = index.cols[0].positions
        wrapped |= ring.head + ring.count > ring.data.shape[0]
        _assert_locate_matches_boundaries(index, rows, columns)
    assert wrapped  # the search over two pieces of the ring ran


@pytest.mark.parametrize("mode", ["done", "ids"])
def test_laps_around_a_full_storage_never_start_over_and_keep_memory_flat(
    monkeypatch, mode: str
) -> None:
    rows, columns, length = 1001, 2, 37  # episodes run across row 0 at shifting offsets
    rng = np.random.default_rng(1)
    index = TrajectoryIndex(rows, columns, mode)
    written = 0

    def write(n: int) -> None:
        nonlocal written
        step = written + np.arange(n)[:, None] + np.array([0, 11])  # one offset per column
        signal = step % length == length - 1 if mode == "done" else step // length
        index.write(written % rows, signal)
        written += n
        index.select(rng.integers(0, index.counts(8).sum(), 16), 8)  # the eligibility rings

    while written < 2 * rows:
        write(int(rng.integers(1, rows // 3)))
    settled = index.nbytes()
    monkeypatch.setattr(index, "reset", lambda: pytest.fail("the index started over"))
    while written < 30 * rows:  # each write shorter than the storage: no rebuild needed
        write(int(rng.integers(1, rows // 3)))
        assert index.nbytes() == settled  # rings reuse their slots: O(trajectories) memory
    start, stop, _, _ = index.boundaries()
    assert index.size == rows and (start > stop).any()
    storage = np.empty((rows, columns), dtype=bool if mode == "done" else np.int64)
    step = written - rows + np.arange(rows)[:, None] + np.array([0, 11])
    storage[(written - rows + np.arange(rows)) % rows] = (
        step % length == length - 1 if mode == "done" else step // length
    )
    got = index.boundaries()
    got = list(zip(got[3].tolist(), got[0].tolist(), got[1].tolist(), got[2].tolist(), strict=True))
    assert got == _reference(storage, rows, index.cursor, mode)


@pytest.mark.parametrize("rows,columns", [(7, 1), (61, 3)])
def test_windows_match_the_boundaries_after_every_write(rows: int, columns: int) -> None:
    """``windows(k)``: sum of ``max(0, L - k + 1)`` per column, kept through trims and laps."""
    rng = np.random.default_rng(rows + columns)
    index = TrajectoryIndex(rows, columns, "done")
    lengths = (1, 2, 3, 5, 9)
    for step in range(120):
        n = int(rng.integers(1, rows + 5))
        index.write((index.cursor + 1) % rows, rng.random((n, columns)) < 0.25)
        _, _, length, col = index.boundaries()
        # the eligibility rings of a few lengths exist from the first write on; others are
        # built lazily mid-run (step 60): both kept in step by every later write
        for k in lengths if step >= 60 else lengths[:3]:
            expected = [
                int(np.clip(length[col == c] - k + 1, 0, None).sum()) for c in range(columns)
            ]
            assert index.windows(k).tolist() == expected, (step, k)

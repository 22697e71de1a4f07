"""The pure trajectory index against a one-shot recomputation over the whole storage."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fastreplay._core.eligible_counts import BLOCK
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

    while written < 4 * rows:  # settling: the length's counts, then its exact ring, are built
        write(int(rng.integers(1, rows // 3)))
    settled = index.nbytes()
    assert [list(column.eligible.exact) for column in index.cols] == [[8]] * columns
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


def _brute_eligible(index: TrajectoryIndex, min_length: int) -> tuple[np.ndarray, ...]:
    """The trajectories at least ``min_length`` long, in TorchRL's order, from scratch."""
    start, _, length, col = index.boundaries()
    keep = length >= min_length
    return start[keep], length[keep], col[keep]


def _check_every_length(index: TrajectoryIndex, lengths: list[int]) -> None:
    for min_length in lengths:
        start, length, col = _brute_eligible(index, min_length)
        counts = index.counts(min_length)
        assert counts.sum() == start.size, min_length
        assert counts.tolist() == np.bincount(col, minlength=index.columns).tolist()
        s, n, c = index.select(np.arange(start.size), min_length)
        np.testing.assert_array_equal(s, start)
        np.testing.assert_array_equal(n, length)
        np.testing.assert_array_equal(c, col)


@pytest.mark.parametrize("mode", ["done", "ids"])
@pytest.mark.parametrize(
    "rows,columns,budget,hot",
    [(997, 1, None, None), (601, 3, None, None), (499, 2, 1, None), (997, 2, None, 5)],
)
def test_any_number_of_lengths_match_a_from_scratch_filter(
    mode: str, rows: int, columns: int, budget: int | None, hot: int | None
) -> None:
    """Counts and selections for many distinct lengths, through writes that wrap around.

    ``budget=1`` keeps one length's counts at a time: every other length is rebuilt. ``hot``:
    a length asked for many times in a row after each write, which gets an exact ring.
    """
    rng = np.random.default_rng(rows + columns)
    index = TrajectoryIndex(rows, columns, mode)
    last_id = np.zeros(columns, dtype=np.int64)
    first, most = 0, 0
    for step in range(60):
        n = int(rng.integers(1, rows // 2 if step % 10 else 2 * rows + 3))
        p_end = float(rng.choice([0.02, 0.1, 0.5]))
        if mode == "done":
            signal = rng.random((n, columns)) < p_end
        else:
            signal = last_id + np.cumsum(rng.random((n, columns)) < p_end, 0)
            last_id = signal[-1]
        index.write(first, signal)
        first = (first + n) % rows
        most = max(most, index.cols[0].trajs.count)
        if budget is not None:
            for column in index.cols:
                column.eligible.counts.budget = lambda: budget
        lengths = rng.integers(1, 80, int(rng.integers(1, 12))).tolist()
        _check_every_length(index, ([hot] * 20 if hot else []) + lengths)
        for c in range(columns):  # the rotation search against a scan
            for min_length in lengths[:3]:
                column = index.cols[c]
                count = column.eligible_count(min_length)
                records = column.eligible_records(min_length, np.arange(count))
                after = (records[:, 1] + records[:, 2] - 1) % rows > index.cursor
                expected = int(np.argmin(after)) if not after.all() else count
                assert index._rotation_of(c, min_length) == expected
    assert index.size == rows and most > 3 * BLOCK  # wrapped, with several blocks per column
    if hot:  # its exact ring served the selects (rebuilt if another length evicted it)
        assert all(column.eligible.exact_builds for column in index.cols)


def test_the_oldest_trajectory_shrinking_below_a_length_leaves_it() -> None:
    index = TrajectoryIndex(20, 1, "done")
    done = np.zeros((20, 1), dtype=bool)
    done[[9, 14, 19]] = True  # lengths 10, 5, 5
    index.write(0, done)
    assert index.counts(6).tolist() == [1] and index.counts(4).tolist() == [3]
    index.write(0, np.zeros((3, 1), dtype=bool))  # the oldest loses 3 rows: 7 long
    assert index.counts(6).tolist() == [1] and index.counts(8).tolist() == [0]
    index.write(3, np.zeros((2, 1), dtype=bool))  # 5 long: no longer eligible for 6
    assert index.counts(6).tolist() == [0]
    _check_every_length(index, [2, 5, 6, 7, 8])


@pytest.mark.parametrize("columns", [1, 3])
def test_rotating_lengths_build_each_length_once(columns: int) -> None:
    """8 lengths in turn over many samples and writes: one build per length, not per sample."""
    rows = 20_011
    index = TrajectoryIndex(rows, columns, "done")
    rng = np.random.default_rng(0)
    first = 0
    lengths = [2, 3, 5, 8, 13, 21, 34, 55]
    for step in range(400):
        n = int(rng.integers(50, 500))
        index.write(first, rng.random((n, columns)) < 0.05)
        first = (first + n) % rows
        min_length = lengths[step % len(lengths)]
        count = int(index.counts(min_length).sum())
        if count:
            index.select(rng.integers(0, count, 64), min_length)
    assert index.size == rows  # wrapped
    assert [c.eligible.counts.builds for c in index.cols] == [len(lengths)] * columns
    assert [c.eligible.exact_builds for c in index.cols] == [0] * columns  # no ring churn
    _check_every_length(index, lengths)


def test_memory_of_the_length_counts_stays_within_the_budget() -> None:
    rows = 200_003
    index = TrajectoryIndex(rows, 1, "done")
    done = np.zeros((rows, 1), dtype=bool)
    done[4::5] = True  # 40,000 trajectories of 5 steps... plus some longer ones
    done[::997] = False
    index.write(0, done)
    column = index.cols[0]
    for min_length in range(2, 1000):  # far more lengths than fit
        index.counts(min_length)
    budget = max(1 << 20, column.trajs.data.nbytes)
    assert column.eligible.counts.cum.nbytes <= budget
    assert 0 < len(column.eligible.counts.rows) < 998 and column.eligible.counts.builds == 998
    assert index.nbytes() <= column.trajs.data.nbytes + column.positions.data.nbytes + budget + (
        column.eligible.counts.lengths.nbytes * 3
    )
    _check_every_length(index, [2, 5, 6, 500, 998, 999])  # the least recent ones, rebuilt


def test_a_length_kept_to_gets_one_exact_ring() -> None:
    """One length, many samples and writes: one row build, then one ring build, then none."""
    rows = 20_011
    index = TrajectoryIndex(rows, 1, "done")
    rng = np.random.default_rng(1)
    first = 0
    for _ in range(300):
        n = int(rng.integers(50, 500))
        index.write(first, rng.random((n, 1)) < 0.05)
        first = (first + n) % rows
        index.select(rng.integers(0, int(index.counts(16).sum()), 64), 16)
    eligible = index.cols[0].eligible
    assert (eligible.counts.builds, eligible.exact_builds, list(eligible.exact)) == (1, 1, [16])
    _check_every_length(index, [16])


def test_a_sampler_kept_to_one_length_gets_its_ring_after_a_few_selects() -> None:
    """However many trajectories: the first ring comes after RECENT selects, not after the
    scans add up to a build (which would take thousands of samples at hundreds of millions
    of items); selects are then O(batch)."""
    from fastreplay._core.eligible_counts import RECENT

    rows = 400_003
    index = TrajectoryIndex(rows, 1, "done")
    done = np.zeros((rows, 1), dtype=bool)
    done[49::50] = True  # 8,000 trajectories of 50 steps
    index.write(0, done)
    eligible = index.cols[0].eligible
    rng = np.random.default_rng(2)
    for _ in range(RECENT - 1):
        index.select(rng.integers(0, int(index.counts(32).sum()), 8), 32)
    assert eligible.exact_builds == 0  # 15 selects of 8 ranks: far from a ring build's work
    index.select(rng.integers(0, int(index.counts(32).sum()), 8), 32)
    assert (eligible.exact_builds, list(eligible.exact)) == (1, [32])
    _check_every_length(index, [32])

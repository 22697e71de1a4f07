"""``HERReplayBuffer``: fastreplay's relabels exactly as TorchRL's, reading only what is written.

Reference: TorchRL's own ``HERReplayBuffer``, same seed, same writes. Its episode-ends cache key
holds the storage's last cursor, a tensor after ``extend``, and comparing two of them raises
once the storage is full (a deliberate difference, ``docs/migration.md``, pinned below): the
reference is TorchRL's class with that key made of the cursor's row and the write count, every
other line TorchRL's. Data: ``achieved_goal = obs = traj * 10_000 + step``, so a goal drawn
from another episode is visible in the sample.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torchrl.data as trl
from tensordict import TensorDict
from torchrl.data import LazyMemmapStorage, LazyTensorStorage

import fastreplay
from conformance.conftest import extend_in_two
from conftest import assert_same_tensordict, record_storage_reads, requires_storage_revision
from fastreplay._torchrl import her_cursor
from fastreplay.buffers.her import _IndexedEpisodes

STRATEGIES = ("future", "final", "episode", "random")
TERMINATED = ("next", "terminated")


class TorchRLReference(trl.HERReplayBuffer):
    """TorchRL's ``HERReplayBuffer`` with a cache key that compares (its own raises when full)."""

    def _storage_cache_key(self, storage: Any) -> tuple:
        return (
            len(storage),
            her_cursor(storage._last_cursor),
            bool(storage._is_full),
            self._writer._write_count,
        )


def reward_fn(td: Any) -> torch.Tensor:
    return (td["achieved_goal"] == td["desired_goal"]).all(-1, keepdim=True).float()


def transitions(n: int, lengths: list[int], first_id: int, *, flag: Any = ("next", "done")):
    """``n`` steps of back-to-back episodes (lengths cycling), the last one left open."""
    ids: list[int] = []
    steps: list[int] = []
    k = first_id
    while len(ids) < n:
        length = lengths[k % len(lengths)]
        ids += [k] * length
        steps += list(range(length))
        k += 1
    traj, step = torch.tensor(ids[:n]), torch.tensor(steps[:n])
    done = torch.zeros(n, dtype=torch.bool)
    done[:-1] = traj[1:] != traj[:-1]
    obs = traj * 10_000 + step
    data = TensorDict(
        {
            "obs": obs,
            "desired_goal": torch.full((n, 1), -1),
            "achieved_goal": obs[:, None],
            ("next", "desired_goal"): torch.full((n, 1), -1),
            ("next", "reward"): torch.zeros(n, 1),
            flag: done[:, None],
        },
        [n],
    )
    return data, int(traj[-1]) + (1 if done[-1] else 0)


def _run(cls: type, storage: Any, writes: int, write: str, **kwargs: Any) -> list[Any]:
    """Writes of 5 to 15 steps (episodes continuing across writes), two samples after each."""
    torch.manual_seed(7)
    rb = cls(reward_fn=reward_fn, storage=storage, batch_size=16, **kwargs)
    out, first = [], 0
    for w in range(writes):
        data, first = transitions(5 + (3 * w) % 11, [5, 1, 9, 3], first)
        if write == "add":
            for row in data.unbind(0):
                rb.add(row)
        elif write == "extend_in_two" and len(data) > 1:
            extend_in_two(rb, data)
        else:
            rb.extend(data)
        out += [rb.sample().clone(), rb.sample().clone()]
    return out


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("capacity", [37, 64])
@pytest.mark.parametrize("write", ["extend", "extend_in_two", "add"])
def test_samples_are_torchrl_s_bit_for_bit(strategy: str, capacity: int, write: str) -> None:
    writes = 14  # 14 writes of 5..15 steps: every capacity wraps at least once
    expected = _run(TorchRLReference, LazyTensorStorage(capacity), writes, write, strategy=strategy)
    got = _run(
        fastreplay.HERReplayBuffer, LazyTensorStorage(capacity), writes, write, strategy=strategy
    )
    for a, b in zip(got, expected, strict=True):
        assert_same_tensordict(a, b)
    if strategy != "random":  # before the first wrap (24 steps), goals come from the episode
        for sample in got[:6]:
            relabelled = sample[: int(16 * 0.8)]
            goal_episode = relabelled["desired_goal"][:, 0] // 10_000
            assert (goal_episode == relabelled["obs"] // 10_000).all()


def _torchrl_ranges(rb: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """TorchRL's episode range of every stored row, from its one-shot scan."""
    ends = trl.HERReplayBuffer._build_episode_cache(rb, rb._storage)
    rows = torch.arange(len(rb._storage))
    return trl.HERReplayBuffer._get_episode_range(rb, rows, ends)


@pytest.mark.parametrize("flag", [("next", "done"), TERMINATED, "uint8"])
@pytest.mark.parametrize("capacity", [1, 13, 40])
def test_every_row_s_episode_is_torchrl_s(flag: Any, capacity: int) -> None:
    """Brute force over every stored row, after every write, through wrap-around."""
    key = ("next", "done") if flag == "uint8" else flag
    rb = fastreplay.HERReplayBuffer(
        reward_fn=reward_fn, storage=LazyTensorStorage(capacity), batch_size=4
    )
    first = 0
    for w in range(25):
        data, first = transitions(1 + (7 * w) % 9, [4, 1, 17, 2, 6], first, flag=key)
        if flag == "uint8":
            data[key] = data[key].to(torch.uint8)
        rb.extend(data)
        ends = rb._get_episode_ends(rb._storage)
        assert isinstance(ends, _IndexedEpisodes)  # the index serves it
        rows = torch.arange(len(rb._storage))
        got = rb._get_episode_range(rows, ends)
        expected = _torchrl_ranges(rb)
        assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1]), w


def test_writes_are_read_once_never_the_whole_storage(monkeypatch: pytest.MonkeyPatch) -> None:
    """After the first sample, each write's rows are read once; TorchRL's scan never runs."""
    rb = fastreplay.HERReplayBuffer(
        reward_fn=reward_fn, storage=LazyTensorStorage(10_001), batch_size=32
    )
    data, first = transitions(9_000, [50, 7, 120], 0)
    rb.extend(data)
    rb.sample()
    reads = record_storage_reads(monkeypatch)

    def scan(*args: Any) -> None:
        raise AssertionError("HERReplayBuffer scanned the whole storage")

    monkeypatch.setattr(trl.HERReplayBuffer, "_build_episode_cache", scan)
    written = []
    for w in range(20):  # 20 writes, wrapping around the end of the storage
        data, first = transitions(97 + w, [50, 7, 120], first)
        rb.extend(data)
        written.append(len(data))
        rb.sample()
        rb.sample()
    assert reads == written  # one read per write, of its rows: no rebuild


@requires_storage_revision
def test_unreported_write_is_seen_through_the_storage() -> None:
    """A write straight to the storage (no notification) rebuilds the episodes once."""
    rbs = []
    for cls in (TorchRLReference, fastreplay.HERReplayBuffer):
        torch.manual_seed(3)
        rb = cls(reward_fn=reward_fn, storage=LazyTensorStorage(29), batch_size=8)
        data, first = transitions(40, [6, 3], 0)
        rb.extend(data)
        rb.sample()
        patch, _ = transitions(5, [2], first)
        rb._storage.set(torch.arange(3, 8), patch)  # not told to the buffer
        rbs.append([rb.sample().clone() for _ in range(3)])
    for a, b in zip(*rbs, strict=True):
        assert_same_tensordict(a, b)


@pytest.mark.parametrize("case", ["float-flags", "no-flags"])
def test_storages_the_index_does_not_cover_keep_torchrl_s_lookup(case: str) -> None:
    """Float done flags: TorchRL's scan, same samples. No flag key: TorchRL's ``KeyError``."""
    results = []
    for cls in (TorchRLReference, fastreplay.HERReplayBuffer):
        torch.manual_seed(5)
        rb = cls(reward_fn=reward_fn, storage=LazyTensorStorage(31), batch_size=8)
        data, _ = transitions(25, [4, 6], 0)
        if case == "float-flags":
            data["next", "done"] = data["next", "done"].float()
        else:
            del data["next", "done"]
        rb.extend(data)
        if case == "no-flags":
            with pytest.raises(KeyError, match="Neither"):
                rb.sample()
            results.append(None)
            continue
        results.append([rb.sample().clone() for _ in range(3)])
    if case == "float-flags":
        for a, b in zip(*results, strict=True):
            assert_same_tensordict(a, b)


def test_empty_and_checkpoints_rebuild(tmp_path: Any) -> None:
    """``empty()``, ``load_state_dict`` and ``loads``: the next sample reads the storage again."""
    rb = fastreplay.HERReplayBuffer(
        reward_fn=reward_fn, storage=LazyTensorStorage(23), batch_size=8
    )
    data, first = transitions(30, [5, 2], 0)
    rb.extend(data)
    rb.sample()
    state = rb.state_dict()
    ends = trl.HERReplayBuffer._build_episode_cache(rb, rb._storage)  # TorchRL's format
    assert torch.equal(state["_her"]["episode_ends_cache"], ends)
    reference = trl.HERReplayBuffer(reward_fn=reward_fn, storage=LazyTensorStorage(23))
    reference.load_state_dict(state)  # TorchRL's class loads it, its cache too
    assert torch.equal(reference._episode_ends_cache, ends)
    assert reference._last_cache_key[0] == 23 and reference._last_cache_key[2] is True
    rb.dumps(tmp_path / "rb")
    rb.empty()
    data, first = transitions(12, [3], first)
    rb.extend(data)
    assert (rb.sample()["obs"] // 10_000 >= 8).all()  # nothing from before ``empty``
    for restore in (lambda: rb.load_state_dict(state), lambda: rb.loads(tmp_path / "rb")):
        restore()
        ends = rb._get_episode_ends(rb._storage)
        expected = _torchrl_ranges(rb)
        got = rb._get_episode_range(torch.arange(len(rb._storage)), ends)
        assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])


def test_memmap_storage_and_a_sampler_argument() -> None:
    """Other storages and samplers TorchRL's HER takes: same samples."""
    runs = []
    for cls in (TorchRLReference, fastreplay.HERReplayBuffer):
        runs.append(
            _run(
                cls,
                LazyMemmapStorage(41),
                8,
                "extend",
                sampler=trl.SamplerWithoutReplacement(),
                her_ratio=0.5,
            )
        )
    for a, b in zip(*runs, strict=True):
        assert_same_tensordict(a, b)


def test_torchrl_raises_once_full_where_fastreplay_samples() -> None:
    """Deliberate difference (docs/migration.md): TorchRL's cache key compares cursor tensors."""
    for cls in (trl.HERReplayBuffer, fastreplay.HERReplayBuffer):
        rb = cls(reward_fn=reward_fn, storage=LazyTensorStorage(20), batch_size=8)
        first = 0
        for _ in range(2):
            data, first = transitions(15, [4], first)
            rb.extend(data)
            rb.sample()
        data, first = transitions(7, [4], first)
        rb.extend(data)
        if cls is trl.HERReplayBuffer:
            with pytest.raises(RuntimeError):
                rb.sample()
        else:
            assert rb.sample().batch_size == (8,)


def test_pinning_arguments_are_fastreplay_s() -> None:
    rb = fastreplay.HERReplayBuffer(
        reward_fn=reward_fn, storage=LazyTensorStorage(11), batch_size=4, device="cpu"
    )
    assert rb.device == torch.device("cpu") and rb.pin_memory is False
    with pytest.raises(ValueError, match="her_ratio"):
        fastreplay.HERReplayBuffer(reward_fn=reward_fn, her_ratio=1.5)

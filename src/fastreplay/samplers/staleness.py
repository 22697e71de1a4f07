"""``fastreplay.StalenessAwareSampler``: TorchRL's staleness-weighted sampler in O(log V) a draw.

A thin adapter over :class:`fastreplay._core.version_buckets.VersionBuckets` (items grouped by
the policy version stored with them, a sum tree over the groups). It keeps the groups in step
with the storage from the rows each ``extend``/``add`` reports, and rereads the whole version
column where it was written behind its back: the storage's write counter moved, or the
column's tensor was written in place (its version counter moved) by anything other than the
writes reported from this process, whether or not a reported write came after.
"""

from __future__ import annotations

import weakref
from typing import Any

import numpy as np
import torch
from tensordict import TensorDictBase

from fastreplay._core.trees.interface import make_trees
from fastreplay._core.version_buckets import VersionBuckets
from fastreplay._signature import ConstructorSignature
from fastreplay._torchrl import (
    Storage,
    TensorStorage,
    mutation_revision,
    staleness_settings,
    storage_len,
)
from fastreplay._torchrl import TorchRLStalenessAwareSampler as _TorchRLStalenessAwareSampler
from fastreplay.samplers._index_sync import reporting_remote

__all__ = ["StalenessAwareSampler"]

_PENDING_LIMIT = 1 << 22  # reported rows kept before a full reread is cheaper


class StalenessAwareSampler(_TorchRLStalenessAwareSampler):
    """Samples by freshness, as :class:`torchrl.data.StalenessAwareSampler`, in O(log V) a draw.

    Same arguments, attributes (``consumer_version``, ``max_staleness``,
    ``increment_consumer_version``), info (``"staleness"``), errors and checkpoints
    (``state_dict``, ``dumps``/``loads``) as TorchRL's: item ``i`` with policy version ``v_i``
    has staleness ``s_i = consumer_version - v_i``; items with ``s_i > max_staleness`` are
    excluded (``max_staleness >= 0``), the others drawn with probability proportional to
    ``staleness_weight_fn(s_i)`` (``1 / (s_i + 1)`` by default), with replacement only when the
    batch is larger than the items that pass, as TorchRL's ``torch.multinomial`` call.

    TorchRL reads every item's version and draws with ``torch.multinomial`` over all ``N``
    stored items at each ``sample``: O(N) a call, and ``torch.multinomial`` refuses more than
    2**24 items. Here the items are grouped by version (``V`` distinct versions stored): a
    write of ``k`` items costs O(k), a change of ``consumer_version`` O(V) at the next sample
    (``staleness_weight_fn`` is called on the ``V`` versions' staleness, so it must act
    elementwise, as the default does; a given function is called at every ``sample``, as
    TorchRL does, so its state is read anew), and each draw O(log V) (a sum tree over the versions,
    see :class:`fastreplay._core.version_buckets.VersionBuckets`). Any number of items.

    The draws are equal in distribution to TorchRL's, not in their random stream: they come
    from torch's global RNG (as ``torch.multinomial``'s), two uniforms per draw.

    What keeps TorchRL's own code (its results, errors and cost): a storage that is not a
    ``TensorStorage`` of a TensorDict, with ``ndim > 1`` (whose flat indices TorchRL's buffers
    do not read back either), or whose version entry holds more than one number per item; an
    empty storage, a missing key, every item excluded, a weight that is NaN, infinite or
    negative, every weight 0, ``batch_size <= 0``, and a batch without replacement larger than
    the items of positive weight (TorchRL then completes it with items of weight 0).

    Args:
        max_staleness: items with staleness above it are never drawn; ``-1`` (default): no
            limit.
        staleness_weight_fn: maps a float32 tensor of staleness values to their weights,
            elementwise. Defaults to ``1 / (s + 1)``.
        version_key: the storage's entry holding each item's policy version. Defaults to
            ``"policy_version"``.
        backend: the sum tree's backend, ``"numba"``, ``"torch"`` or ``None`` (numba when it
            is installed), as :class:`fastreplay.PrioritizedSampler`'s.

    Example:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> from torchrl.data import LazyTensorStorage
        >>> from fastreplay import StalenessAwareSampler, TensorDictReplayBuffer
        >>> sampler = StalenessAwareSampler(max_staleness=2)
        >>> rb = TensorDictReplayBuffer(storage=LazyTensorStorage(9), sampler=sampler,
        ...                             batch_size=4)
        >>> for version in range(4):
        ...     _ = rb.extend(TensorDict({"policy_version": torch.full((3,), version)}, [3]))
        >>> sampler.consumer_version = 4
        >>> sample = rb.sample()  # staleness 1 or 2: the items of version 3 and 2 only
        >>> sorted(set(sample["policy_version"].tolist())) in ([2], [3], [2, 3])
        True
    """

    __signature__ = ConstructorSignature()
    _fr_local_writes = 0  # class default: a sampler pickled by an earlier version has none

    def __init__(
        self,
        max_staleness: int = -1,
        staleness_weight_fn: Any = None,
        version_key: Any = "policy_version",
        *,
        backend: str | None = None,
    ) -> None:
        make_trees(1, backend=backend)  # raises a bad or unavailable backend now
        super().__init__(
            max_staleness=max_staleness,
            staleness_weight_fn=staleness_weight_fn,
            version_key=version_key,
        )
        self._fr_backend = backend
        # TorchRL's default weight is stateless: its weights are kept until the staleness
        # changes. Any other function is called at every sample, as TorchRL does.
        self._fr_default_fn = staleness_settings(self)[1] if staleness_weight_fn is None else None
        self._fr_core: VersionBuckets | None = None
        self._fr_seen: tuple | None = None
        self._fr_token: tuple | None = None
        self._fr_pending: list[np.ndarray] = []
        self._fr_pending_rows = 0
        self._fr_pending_writes = 0
        self._fr_local_writes = 0  # of those, the writes made in this process
        self._fr_revision = 0
        self._fr_dirty = True

    @property
    def backend(self) -> str:
        """The sum tree's backend: ``"numba"`` (compiled loops) or ``"torch"``."""
        if self._fr_core is not None:
            return self._fr_core.backend
        return make_trees(1, backend=self._fr_backend).backend

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state.update(_fr_core=None, _fr_seen=None, _fr_pending=[], _fr_dirty=True)
        state.update(_fr_pending_rows=0, _fr_pending_writes=0, _fr_local_writes=0)
        return state

    # ------------------------------------------------------------------ writes
    def add(self, index: Any) -> None:
        """Note the row ``index`` written. O(1)."""
        self._record(index)

    def extend(self, index: Any) -> None:
        """Note the rows ``index`` written. O(1) (they are read at the next ``sample``)."""
        self._record(index)

    def _record(self, index: Any) -> None:
        self._fr_pending_writes += 1
        if not reporting_remote():  # another process's write moves no version counter here
            self._fr_local_writes += 1
        if self._fr_dirty:
            return
        try:
            rows = torch.as_tensor(index).reshape(-1).to("cpu", torch.int64).numpy()
        except (TypeError, ValueError, RuntimeError):  # an index format this does not read
            self._fr_dirty = True
            return
        self._fr_pending.append(rows)
        self._fr_pending_rows += rows.size
        if self._fr_pending_rows > _PENDING_LIMIT:
            self.invalidate_versions()

    def invalidate_versions(self) -> None:
        """Reread every stored version at the next ``sample`` (O(items stored) then).

        For writes to the version entry that neither ``extend``/``add`` reported, nor the
        storage counted, nor torch's version counter of the entry shows: edits made by another
        process, or through ``tensor.data`` or a NumPy view. In-place edits through a view of
        the storage in this process are seen without it. fastreplay's buffers call it after a
        write that raised part way.
        """
        self._fr_dirty = True
        self._fr_pending, self._fr_pending_rows = [], 0

    invalidate_boundaries = invalidate_versions  # the name fastreplay's buffers call

    def _empty(self) -> None:
        super()._empty()
        self.invalidate_versions()

    # ------------------------------------------------------------------ sampling
    def _versions_leaf(self, storage: Storage) -> torch.Tensor | None:
        """The version column this sampler reads directly, or ``None`` for TorchRL's path."""
        if not isinstance(storage, TensorStorage) or storage.ndim != 1:
            return None
        backing = getattr(storage, "_storage", None)
        if not isinstance(backing, TensorDictBase):
            return None
        leaf = backing.get(staleness_settings(self)[0], None)
        if not isinstance(leaf, torch.Tensor) or leaf.ndim < 1:
            return None
        if leaf.shape[0] != storage.max_size or leaf[:1].numel() != 1:
            return None
        return leaf

    def _sync(self, storage: Storage, leaf: torch.Tensor, n: int) -> VersionBuckets:
        """The buckets, in step with the first ``n`` stored versions."""
        expected = self._fr_revision + self._fr_pending_writes
        revision = mutation_revision(storage, expected)
        seen = self._fr_seen
        core = self._fr_core
        same = (
            core is not None
            and seen is not None
            and seen[0]() is storage
            and seen[1:4] == (leaf.data_ptr(), leaf.shape, leaf.dtype)
            and n >= seen[5]
        )
        if (
            same
            and core is not None
            and seen is not None
            and not self._fr_dirty
            and revision == expected
            # Each write reported from this process moves the version entry's counter by one;
            # any other move is an edit nobody reported (through a view): reread.
            and leaf._version == seen[4] + self._fr_local_writes
            and self._fr_pending_rows < max(n // 2, 1)
        ):
            if self._fr_pending:
                rows = np.unique(np.concatenate(self._fr_pending))
                values = leaf[torch.from_numpy(rows).to(leaf.device)].reshape(-1).float()
                core.write(rows, values.cpu().numpy())
        else:
            if core is None or core.slots != leaf.shape[0]:
                core = VersionBuckets(leaf.shape[0], backend=self._fr_backend)
            core.rebuild(leaf[:n].reshape(-1).float().cpu().numpy())
            self._fr_core, self._fr_token = core, None
        self._fr_seen = (weakref.ref(storage), leaf.data_ptr(), leaf.shape, leaf.dtype)
        self._fr_seen += (leaf._version, n)
        self._fr_revision, self._fr_dirty = revision, False
        self._fr_pending, self._fr_pending_rows, self._fr_pending_writes = [], 0, 0
        self._fr_local_writes = 0
        return core

    def sample(self, storage: Storage, batch_size: int) -> tuple[torch.Tensor, dict]:
        """``batch_size`` indices by freshness, and their ``"staleness"``.

        O(batch log V) a call, plus O(k) for ``k`` rows written since the last call and O(V)
        after a change of ``consumer_version``, ``max_staleness`` or the weight function, and
        at every call for a ``staleness_weight_fn`` given (one call on the ``V`` versions'
        staleness: a function with state, such as an annealed temperature, is read anew).
        """
        n = storage_len(storage)
        leaf = self._versions_leaf(storage) if n > 0 else None
        if leaf is None or batch_size <= 0:
            return super().sample(storage, batch_size)
        core = self._sync(storage, leaf, n)
        consumer, max_staleness = self.consumer_version, self.max_staleness
        weight_fn = staleness_settings(self)[1]
        token = (
            None if isinstance(consumer, torch.Tensor) else (type(consumer), consumer),
            max_staleness,
            weight_fn,
        )
        if (
            token[0] is None
            or token != self._fr_token
            or not core.current
            or weight_fn is not self._fr_default_fn
        ):
            self._fr_token = None
            if not core.refresh(weight_fn, consumer, max_staleness):
                return super().sample(storage, batch_size)  # TorchRL's error
            self._fr_token = token
        replacement = batch_size > core.n_valid
        if not replacement and batch_size > core.n_positive:
            return super().sample(storage, batch_size)  # weight-0 items complete the batch
        items = core.sample(batch_size, replacement)
        index = torch.from_numpy(items).to(leaf.device)
        keys = torch.from_numpy(core._keys[core.bucket_of[items]]).to(leaf.device)
        return index, {"staleness": consumer - keys}

    def probabilities(self, storage: Storage) -> torch.Tensor:
        """Each stored item's probability of being drawn (float64, ``len(storage)``). O(N).

        For tests and inspection: TorchRL's ``weights / weights.sum()``, in float64.

        Raises:
            ValueError: the storage is one whose sampling TorchRL's code does (see above).
        """
        n = storage_len(storage)
        leaf = self._versions_leaf(storage) if n > 0 else None
        if leaf is None:
            raise ValueError(
                f"probabilities() reads a 1-D TensorStorage holding "
                f"{staleness_settings(self)[0]!r}, "
                f"got {type(storage).__name__} with {n} items; sample() uses TorchRL's code there"
            )
        core = self._sync(storage, leaf, n)
        weight_fn = staleness_settings(self)[1]
        if not core.refresh(weight_fn, self.consumer_version, self.max_staleness):
            raise ValueError(
                "no item can be drawn (all excluded, or a weight is 0, NaN, infinite or "
                "negative everywhere): sample() raises TorchRL's error"
            )
        self._fr_token = None
        return core.probabilities()[:n]

"""Row writes into, and row gathers from, the leaf tensors of a TensorDict storage.

Pure core, no TorchRL imports. A replay buffer's ``TensorStorage`` keeps its rows in one
``TensorDict`` whose leaves have the storage capacity as first dimension. TorchRL writes and
reads it through ``TensorDict.__setitem__`` / ``__getitem__`` with an index tensor, which
re-validates keys, shapes and batch sizes on every call. When the incoming rows have exactly
the stored structure (same keys, feature shapes, dtypes, CPU tensors), the same result is one
copy per leaf (``index_copy_``, :func:`write_rows`) and one ``index_select`` per leaf
(:func:`gather_rows`).

:func:`write_pairs` and :func:`gather_plan` decide whether that holds; ``None`` means "take
the general path" and nothing was touched.

Example:
    >>> import torch
    >>> from tensordict import TensorDict
    >>> store = TensorDict(obs=torch.zeros(5, 2), index=torch.zeros(5, dtype=torch.long),
    ...                    batch_size=[5])
    >>> rows = TensorDict(obs=torch.ones(3, 2), batch_size=[3])
    >>> pairs = write_pairs(store, rows, skip="index")
    >>> write_rows(pairs, torch.tensor([4, 0, 1]))
    >>> store["obs"][:, 0].tolist()
    [1.0, 1.0, 0.0, 0.0, 1.0]
    >>> plan = gather_plan(store)
    >>> sample, _ = gather_rows(plan, torch.tensor([4, 2]), stored=5)
    >>> sample["obs"][:, 0].tolist()
    [1.0, 0.0]
"""

from __future__ import annotations

from typing import Any

import torch
from tensordict import MemoryMappedTensor, TensorDict

__all__ = ["gather_plan", "gather_rows", "write_pairs", "write_rows"]

_PLAIN_TENSORS = (torch.Tensor, MemoryMappedTensor)

# A gather plan: (batch size after the first dimension, device, entries) for one level, where
# an entry is (key, leaf tensor) or (key, nested plan).
Plan = tuple[torch.Size, Any, list[tuple[str, Any]]]


def write_pairs(
    store: TensorDict, rows: TensorDict, *, skip: str | None = None
) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
    """``(stored leaf, incoming leaf)`` pairs, or ``None`` if ``rows`` is not a plain match.

    A plain match: ``rows`` and every nested level are exactly ``TensorDict`` (no lazy
    stacks, tensorclasses or non-tensor data), with exactly the keys of ``store`` at the same
    level (``skip`` excepted at the top level: it is absent from ``rows``), the same batch
    size after the first dimension, and leaves that are plain CPU tensors of the stored dtype
    and feature shape that do not require grad. ``store``'s leaves must be plain CPU tensors
    too. O(number of leaves).

    Args:
        store: The storage ``TensorDict`` (first dimension: capacity).
        rows: The incoming rows (first dimension: number of rows).
        skip: A top-level key of ``store`` that ``rows`` must not hold (written separately).
    """
    if type(rows) is not TensorDict or type(store) is not TensorDict:
        return None
    pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
    return pairs if _pair_level(store, rows, skip, pairs) else None


def _pair_level(store: TensorDict, rows: TensorDict, skip: str | None, pairs: list) -> bool:
    stored, incoming = store._tensordict, rows._tensordict
    if rows.batch_size[1:] != store.batch_size[1:]:
        return False
    if skip is not None:
        if skip in incoming or skip not in stored:
            return False
        if len(incoming) != len(stored) - 1:
            return False
    elif len(incoming) != len(stored):
        return False
    for key, leaf in stored.items():
        if key == skip:
            continue
        value = incoming.get(key)
        if value is None:
            return False
        if type(leaf) is TensorDict:
            if type(value) is not TensorDict or not _pair_level(leaf, value, None, pairs):
                return False
            continue
        if (
            type(leaf) not in _PLAIN_TENSORS
            or type(value) not in _PLAIN_TENSORS
            or value.dtype != leaf.dtype
            or value.shape[1:] != leaf.shape[1:]
            or not (value.is_cpu and leaf.is_cpu)
            or value.requires_grad
        ):
            return False
        pairs.append((leaf, value))
    return True


def write_rows(pairs: list[tuple[torch.Tensor, torch.Tensor]], index: torch.Tensor) -> None:
    """Copy row ``i`` of each incoming leaf into row ``index[i]`` of its stored leaf.

    One ``index_copy_`` per leaf (the writer's rows, wrapped around the capacity already).
    The caller guarantees that no row of ``index`` repeats and that the dtypes match
    (:func:`write_pairs`). O(rows written x row size).

    Args:
        pairs: From :func:`write_pairs`, plus any leaf written separately.
        index: 1-D long tensor of the rows to write, one per incoming row.
    """
    for leaf, value in pairs:
        leaf.index_copy_(0, index, value)


def gather_plan(store: TensorDict) -> Plan | None:
    """How to read rows of ``store``, or ``None`` if a level is not a plain ``TensorDict``.

    Plain: every level is exactly ``TensorDict`` without dimension names, and every leaf a
    plain CPU tensor. O(number of leaves).
    """
    if type(store) is not TensorDict or store._td_dim_names is not None:
        return None
    entries: list[tuple[str, Any]] = []
    for key, leaf in store._tensordict.items():
        if type(leaf) is TensorDict:
            nested = gather_plan(leaf)
            if nested is None:
                return None
            entries.append((key, nested))
        elif type(leaf) in _PLAIN_TENSORS and leaf.is_cpu:
            entries.append((key, leaf))
        else:
            return None
    return store.batch_size[1:], store._device, entries


def gather_rows(
    plan: Plan, index: torch.Tensor, stored: int, extra: dict | None = None
) -> tuple[TensorDict, bool]:
    """The rows ``index`` of the planned storage, as ``storage[:stored][index]`` returns them.

    One ``index_select`` per leaf into a new contiguous tensor; the ``TensorDict`` levels are
    built without re-validation (batch size ``[len(index), *rest]``, the stored devices).
    O(len(index) x row size).

    Args:
        plan: From :func:`gather_plan`.
        index: 1-D integer tensor of rows (on CPU).
        stored: Number of filled rows; a row at or past it raises ``IndexError``.
        extra: Top-level entries set afterwards, as ``TensorDict.set`` would (a stored entry
            of the same name keeps its place and is not read). Only string keys with a CPU
            tensor of shape ``[len(index)]`` are set here.

    Returns:
        The sample, and whether every entry of ``extra`` was set.

    Raises:
        IndexError: a row outside ``[0, stored)``.
    """
    head = index.shape  # 1-D: torch.Size([len(index)])
    rest, device, _ = plan
    put = {}
    if extra:
        for key, value in extra.items():
            if (
                type(key) is str
                and type(value) is torch.Tensor
                and value.shape == head
                and value.is_cpu
                and (device is None or device.type == "cpu")
                and not rest
            ):
                put[key] = value
    out = _gather_level(plan, index, stored, head, put)
    for key, value in put.items():
        if key not in out._tensordict:
            out._tensordict[key] = value
    return out, len(put) == len(extra or ())


def _gather_level(
    plan: Plan, index: torch.Tensor, stored: int, head: torch.Size, put: dict
) -> TensorDict:
    rest, device, entries = plan
    out = {}
    for key, leaf in entries:
        if key in put:
            out[key] = put[key]
        elif type(leaf) is tuple:
            out[key] = _gather_level(leaf, index, stored, head, {})
        else:
            source = leaf if leaf.shape[0] == stored else leaf.narrow(0, 0, stored)
            out[key] = torch.index_select(source, 0, index)
    return TensorDict._new_unsafe(out, batch_size=head + rest, device=device, nested=False)

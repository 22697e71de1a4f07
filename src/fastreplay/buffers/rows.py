"""Row writes into, and row gathers from, the leaf tensors of a TensorDict storage.

No TorchRL classes: tensordict's fields are read and TensorDicts built through the compat
module (:func:`fastreplay._torchrl.td_parts`, :data:`fastreplay._torchrl.new_tensordict`). A
replay buffer's ``TensorStorage`` keeps its rows in one
``TensorDict`` whose leaves have the storage capacity as first dimension. TorchRL writes and
reads it through ``TensorDict.__setitem__`` / ``__getitem__`` with an index tensor, which
re-validates keys, shapes and batch sizes on every call. When the incoming rows have exactly
the stored structure (same keys, feature shapes, dtypes, on the stored device), the same result
is one copy per leaf (``index_copy_``, :func:`write_rows`) and one ``index_select`` per leaf
(:func:`gather_rows`). On an accelerator (a CUDA storage) those are a fixed number of kernel
launches and nothing here reads a value of the device on the host: the row counts and
cursors are host integers, the row indices live on the storage's device.

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

from collections.abc import Callable
from typing import Any

import torch
from tensordict import MemoryMappedTensor, TensorDict

from fastreplay._torchrl import TensorDictFields, new_tensordict, td_parts

__all__ = [
    "entry",
    "gather_plan",
    "gather_rows",
    "on_device",
    "priority_rows",
    "write_pairs",
    "write_plan",
    "write_rows",
]

_PLAIN_TENSORS = (torch.Tensor, MemoryMappedTensor)

# A gather plan: (batch size after the first dimension, device, entries, flat) for one level,
# where an entry is (key, leaf tensor) or (key, nested plan), and ``flat``: one level of
# leaves with no dimension after the first, all on the level's device (the CPU when the
# level has none: the common storage, gathered by :func:`_gather_flat`).
Plan = tuple[torch.Size, Any, list[tuple[str, Any]], bool]

_NO_REST = torch.Size([])

# Makes the tensor a gather writes into: (shape, dtype) -> uninitialised tensor.
Alloc = Callable[[torch.Size, torch.dtype], torch.Tensor]


def write_pairs(
    store: TensorDict, rows: TensorDict, *, skip: str | None = None
) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
    """``(stored leaf, incoming leaf)`` pairs, or ``None`` if ``rows`` is not a plain match.

    A plain match: ``rows`` and every nested level are exactly ``TensorDict`` (no lazy
    stacks, tensorclasses or non-tensor data), with exactly the keys of ``store`` at the same
    level (``skip`` excepted at the top level: it is absent from ``rows``), the same batch
    size after the first dimension, and leaves that are plain tensors of the stored dtype,
    feature shape and device that do not require grad. ``store``'s leaves must be plain
    tensors too. O(number of leaves).

    Args:
        store: The storage ``TensorDict`` (first dimension: capacity).
        rows: The incoming rows (first dimension: number of rows).
        skip: A top-level key of ``store`` that ``rows`` must not hold (written separately).
    """
    plan = write_plan(store, rows, skip=skip)
    return None if plan is None else plan[0]


def write_plan(
    store: TensorDict, rows: TensorDict, *, skip: str | None = None
) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], int, Any, Any, int] | None:
    """:func:`write_pairs`, with what a write needs besides, or ``None`` (not a plain match).

    Returns:
        ``(pairs, rows in rows, the stored leaf at skip (None without skip), rows's device,
        rows in store)``. O(number of leaves).
    """
    if type(rows) is not TensorDict or type(store) is not TensorDict:
        return None
    stored, stored_size, _, _ = td_parts(store)
    incoming, incoming_size, device, _ = td_parts(rows)
    pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
    if not _pair_level(stored, stored_size, incoming, incoming_size, skip, pairs):
        return None
    n = incoming_size[0] if incoming_size else 0
    skipped = None if skip is None else stored[skip]
    return pairs, n, skipped, device, stored_size[0]


def _pair_level(
    stored: dict,
    stored_size: torch.Size,
    incoming: dict,
    incoming_size: torch.Size,
    skip: str | None,
    pairs: list,
) -> bool:
    """One level of :func:`write_plan`: the entries and batch sizes of both TensorDicts."""
    if not _same_rest(incoming_size, stored_size):
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
            if type(value) is not TensorDict:
                return False
            nested, nested_size, _, _ = td_parts(leaf)
            given, given_size, _, _ = td_parts(value)
            if not _pair_level(nested, nested_size, given, given_size, None, pairs):
                return False
            continue
        if (
            type(leaf) not in _PLAIN_TENSORS
            or type(value) not in _PLAIN_TENSORS
            or value.dtype != leaf.dtype
            or not _same_rest(value.shape, leaf.shape)
            or not ((value.is_cpu and leaf.is_cpu) or value.device == leaf.device)
            or value.requires_grad
        ):
            return False
        pairs.append((leaf, value))
    return True


def _same_rest(a: torch.Size, b: torch.Size) -> bool:
    """``a[1:] == b[1:]``; the common ranks without slicing (a ``torch.Size`` slice is slow)."""
    rank = len(a)
    if rank != len(b):
        return False
    if rank == 1:
        return True
    if rank == 2:
        return a[1] == b[1]
    return a[1:] == b[1:]


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
    plain tensor, on the CPU, or on the level's device (an accelerator storage's TensorDict
    carries its device). O(number of leaves).
    """
    if type(store) is not TensorDict:
        return None
    fields, size, device, names = td_parts(store)
    if names is not None:
        return None
    entries: list[tuple[str, Any]] = []
    flat = True
    on_host = device is None or device.type == "cpu"
    for key, leaf in fields.items():
        if type(leaf) is TensorDict:
            nested = gather_plan(leaf)
            if nested is None:
                return None
            entries.append((key, nested))
            flat = False
        elif type(leaf) in _PLAIN_TENSORS and (leaf.is_cpu if on_host else leaf.device == device):
            entries.append((key, leaf))
        else:
            return None
    rest = _NO_REST if len(size) == 1 else size[1:]  # (a torch.Size slice is slow)
    return rest, device, entries, flat and not rest


def on_device(value: torch.Tensor, device: Any) -> bool:
    """Whether ``value`` lies on ``device`` (``None``: the CPU, as a plan's level). O(1)."""
    if device is None or device.type == "cpu":
        return value.is_cpu
    return value.device == device


def gather_rows(
    plan: Plan,
    index: torch.Tensor,
    stored: int,
    extra: dict | None = None,
    run: int | None = None,
    alloc: Alloc | None = None,
) -> tuple[TensorDict, bool]:
    """The rows ``index`` of the planned storage, as ``storage[:stored][index]`` returns them.

    One ``index_select`` per leaf into a new contiguous tensor; the ``TensorDict`` levels are
    built without re-validation (batch size ``[len(index), *rest]``, the stored devices).
    With ``run``, an ``index`` made of runs of ``run`` consecutive rows (a slice sampler's)
    is gathered one run at a time (one ``index_select`` over a windowed view per leaf);
    anything else is gathered row by row. O(len(index) x row size).

    Args:
        plan: From :func:`gather_plan`.
        index: 1-D integer tensor of rows, on the plan's device (the CPU if it has none).
        stored: Number of filled rows; a row at or past it raises ``IndexError``.
        extra: Entries set afterwards, as ``TensorDict.set`` would in this order (a stored
            entry of the same name keeps its place and is not read; new ones come last in
            their level). Keys are strings or tuples of strings naming existing levels;
            values are tensors on the level's device (the CPU if it has none) whose leading
            dimensions are the level's batch size. If one entry does not fit that, none is set.
        run: Length of the runs ``index`` may be made of (checked; ``None``: row by row).
        alloc: Where the gathered leaves go: called with the shape and dtype of each, it
            returns an uninitialised tensor the ``index_select`` writes into (``out=``), e.g.
            pinned host memory; ``None``: new tensors.

    Returns:
        The sample, and whether the entries of ``extra`` were set.

    Raises:
        IndexError: a row outside ``[0, stored)``.
    """
    head = index.shape  # 1-D: torch.Size([len(index)])
    starts = _run_starts(index, run, stored) if run is not None else None
    if starts is None and plan[3]:
        data = _gather_flat(plan, index, stored, head, extra, alloc)
        if data is not None:
            return data, True
    put: dict = {}
    complete = not extra or _place(plan, head, extra, put)
    if not complete:
        put = {}
    return _gather_level(plan, index, stored, head, put, starts, run, alloc), complete


def _select(source: torch.Tensor, index: torch.Tensor, alloc: Alloc | None) -> torch.Tensor:
    """``torch.index_select(source, 0, index)``, into ``alloc``'s tensor when given."""
    if alloc is None:
        return torch.index_select(source, 0, index)
    out = alloc(index.shape + source.shape[1:], source.dtype)
    return torch.index_select(source, 0, index, out=out)


def _gather_flat(
    plan: Plan,
    index: torch.Tensor,
    stored: int,
    head: torch.Size,
    extra: dict | None,
    alloc: Alloc | None = None,
) -> TensorDict | None:
    """:func:`gather_rows` for a flat plan, row by row, if every ``extra`` entry fits; else None.

    ``extra`` fits if its keys are strings and its values tensors of ``len(index)`` rows on
    the plan's device; nothing is gathered otherwise.
    """
    if extra:
        n = head[0]
        device = plan[1]
        for key, value in extra.items():
            if (
                type(key) is not str
                or type(value) is not torch.Tensor
                or not value.ndim
                or value.shape[0] != n
                or not (value.is_cpu if device is None else on_device(value, device))
            ):
                return None
    else:
        extra = {}
    out = TensorDictFields()
    for key, leaf in plan[2]:
        value = extra.get(key)
        if value is not None:  # a stored entry of that name keeps its place, not read
            out[key] = value
        else:
            source = leaf if leaf.shape[0] == stored else leaf.narrow(0, 0, stored)
            out[key] = _select(source, index, alloc)
    for key, value in extra.items():
        if key not in out:
            out[key] = value
    return new_tensordict(out, head, plan[1])


def _place(plan: Plan, head: torch.Size, extra: dict, put: dict) -> bool:
    """Sort ``extra`` into a tree of levels in ``put``; False if an entry does not fit."""
    rest, device = plan[0], plan[1]
    flat = not rest
    for key, value in extra.items():
        if flat and type(key) is str:  # the common case: a top-level entry of shape [n, ...]
            if (
                type(value) is not torch.Tensor
                or key in put
                or value.shape[:1] != head
                or not on_device(value, device)
            ):
                return False
            put[key] = value
            continue
        path = (key,) if type(key) is str else key
        if type(path) is not tuple or not path or type(value) is not torch.Tensor:
            return False
        level, node = plan, put
        for name in path[:-1]:
            nested = _entry(level, name)
            if type(name) is not str or type(nested) is not tuple:
                return False  # no such level (TensorDict.set would create or refuse one)
            level, node = nested, node.setdefault(name, {})
            if type(node) is not dict:
                return False
        rest, device = level[0], level[1]
        batch = head + rest
        if (
            type(path[-1]) is not str
            or path[-1] in node
            or not on_device(value, device)
            or value.shape[: len(batch)] != batch
        ):
            return False
        node[path[-1]] = value
    return True


def _entry(plan: Plan, name: str) -> Any:
    for key, leaf in plan[2]:
        if key == name:
            return leaf
    return None


_RUN_OFFSETS: dict[tuple[int, torch.device], torch.Tensor] = {}


def _run_starts(index: torch.Tensor, run: int | None, stored: int) -> torch.Tensor | None:
    """First rows of the runs of ``run`` consecutive rows ``index`` is made of, or None.

    The check (``torch.equal``) reads its result on the host, so it runs on host indices
    only: an ``index`` on an accelerator is gathered row by row (``None``), the same rows with
    the same number of launches and no synchronisation. O(len(index)).
    """
    n = index.shape[0]
    if run is None or run < 2 or n % run or n == 0 or stored < run or not index.is_cpu:
        return None
    offsets = _RUN_OFFSETS.get((run, index.device))
    if offsets is None:
        offsets = _RUN_OFFSETS[(run, index.device)] = torch.arange(run, device=index.device)
    runs = index.reshape(n // run, run)
    starts = runs[:, 0]
    if index.dtype != torch.long or not torch.equal(runs, starts.unsqueeze(1) + offsets):
        return None
    return starts


def _gather_level(
    plan: Plan,
    index: torch.Tensor,
    stored: int,
    head: torch.Size,
    put: dict,
    starts: torch.Tensor | None,
    run: int | None,
    alloc: Alloc | None = None,
) -> TensorDict:
    rest, device, entries = plan[0], plan[1], plan[2]
    out = TensorDictFields()
    for key, leaf in entries:
        value = put.get(key)
        if value is not None and type(value) is not dict:
            out[key] = value
        elif type(leaf) is tuple:
            out[key] = _gather_level(leaf, index, stored, head, value or {}, starts, run, alloc)
        else:
            source = leaf if leaf.shape[0] == stored else leaf.narrow(0, 0, stored)
            if starts is None:
                out[key] = _select(source, index, alloc)
            else:  # windows of ``run`` rows starting at every row; one pick per run
                step = source.stride()
                windows = source.as_strided(
                    (stored - run + 1, run, *source.shape[1:]),  # type: ignore[operator]
                    (step[0], *step),
                    source.storage_offset(),
                )
                picked = _select(windows, starts, alloc)
                out[key] = picked.view(head + source.shape[1:])
    for key, value in put.items():
        if key not in out:
            out[key] = value
    return new_tensordict(out, head + rest if rest else head, device)


# ---------------------------------------------------------------------- reads of a TensorDict
def entry(data: Any, key: Any) -> Any:
    """``data.get(key)`` (``None`` if absent); a top-level ``str`` key without key parsing."""
    if type(data) is TensorDict and type(key) is str:
        return td_parts(data)[0].get(key)
    return data.get(key, None)


def priority_rows(data: Any, key: Any) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(index, priority)`` of a 1-D sample whose priorities need no reduction, else ``None``.

    ``TensorDictReplayBuffer.update_tensordict_priority`` reshapes the priority at ``key`` to
    ``[batch, -1]`` and reduces the last dimension (``max``, ``min``, ``mean``, ``median`` or
    ``sum``): for a floating-point ``[batch]`` or ``[batch, 1]`` priority every reduction
    returns it unchanged, and its ``index`` needs no reduction either. O(1).
    """
    if type(data) is not TensorDict or type(key) is not str:
        return None
    fields, shape, _, _ = td_parts(data)
    if len(shape) != 1:
        return None
    priority, index = fields.get(key), fields.get("index")
    if (
        type(priority) is not torch.Tensor
        or type(index) is not torch.Tensor
        or not priority.dtype.is_floating_point
        or index.shape != shape
        or priority.shape[:1] != shape
        or priority.numel() != shape[0]
    ):
        return None
    return index, priority.reshape(shape)

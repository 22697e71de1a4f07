"""Priority trees for accelerators: a fixed, shallow layout and no host reads per step.

:class:`DevicePriorityTrees` (backend ``"device"``) keeps the three trees of
:class:`fastreplay._core.trees.torch_backend.PriorityTrees` (sum and min of the mass, negated
min of the raw priorities), but in a layout whose depth never changes: ``B ** 3`` leaves
(``B`` the smallest branching with ``B ** 3 > capacity``: 101 at 1M slots, 216 at 10M), two
levels of ``B ** 2`` and ``B`` nodes and the root. Every hot operation is a fixed sequence
of torch ops whatever the batch size or the capacity, and reads nothing back to the host, so
on a GPU it queues kernels without waiting for them:

* :meth:`sample_live` (the sampler's draw): the total and the smallest mass are read from the
  root on the device; the walk descends three levels, each a gather of ``B`` children, a
  ``cumsum`` and a search, guarded so that it never passes a group's last child with mass
  (rounding cannot land on an empty slot, with no check read back). About 40 ops.
* :meth:`mark_update` with an index on the device: clears the slots, reads the live max from
  the root (the max over the other slots: the exact live-max rule of
  :meth:`fastreplay._core.trees.interface.PriorityTreeBackend.mark_update`), and writes it
  capped by ``upper`` (``initial`` while nothing is stored) with ``torch.where`` and
  ``torch.clamp``. ``-1`` markers write nothing (they go to a padding slot that stays empty).
  An index on the host is range-checked there first (free: no device value is read); an index
  already on the device is not (reading it would wait for the device): the writers produce it.
* :meth:`check_and_write` (``update_priority``): one host read, the four bounds of the batch
  (index range, smallest and largest priority) that TorchRL's errors need, then a fixed
  sequence of ops.

The mass is ``torch.pow`` on every device (float64 masses may differ from the C library's
``pow`` of the other backends in the last bit on the CPU; float32 masses round alike).
Draws agree with the other backends except within rounding of a boundary between two leaves.

Example:
    >>> import torch
    >>> trees = DevicePriorityTrees(1000)
    >>> trees.branching, trees.levels[0].shape[1]
    (11, 1331)
    >>> trees.check_and_write(torch.tensor([0, 3]), torch.tensor([1.0, 3.0]), 7, 0.0, 1.0, True)
    (3.0, 3)
    >>> index, weight = trees.sample_live(torch.tensor([0.1, 0.9], dtype=torch.float64), 1.0, True)
    >>> index.tolist(), weight.tolist()
    ([0, 3], [1.0, 0.3333333432674408])
"""

from __future__ import annotations

import math

import torch

from fastreplay._core.trees.ops import check_mass, validate
from fastreplay._core.trees.torch_backend import _BATCHED_SEARCHSORTED, PriorityTrees

__all__ = ["DevicePriorityTrees", "branching_for", "on_host"]

_INF = math.inf
_DEPTH = 3  # leaf level, two internal levels, then the root


def on_host(index: torch.Tensor) -> bool:
    """Whether ``index`` lives in host memory, where reading it waits for no device. O(1)."""
    return index.device.type == "cpu"


def branching_for(capacity: int) -> int:
    """Smallest ``B >= 2`` with ``B ** 3 > capacity`` (one padding slot at least). O(1)."""
    b = max(2, math.ceil((capacity + 1) ** (1 / _DEPTH)))
    while b**_DEPTH <= capacity:
        b += 1
    while b > 2 and (b - 1) ** _DEPTH > capacity:
        b -= 1
    return b


class DevicePriorityTrees(PriorityTrees):
    """Sum, min and negated-min trees of fixed depth 3; no host reads in the hot paths.

    Args:
        capacity: number of leaf slots.
        device: where the trees live (any device; the CPU for tests).
        branching: ignored unless larger than :func:`branching_for` ``(capacity)``.

    Memory: ``24 * B ** 3 * (1 + 1 / B + 1 / B ** 2)`` bytes, ``B ** 3`` at most
    ``capacity + 3 * capacity ** (2 / 3)`` or so. Implements
    :class:`fastreplay._core.trees.interface.PriorityTreeBackend`.
    """

    backend = "device"
    sync_free = True
    """The sampler may call :meth:`sample_live` and pass host indices to :meth:`mark_update`."""

    def __init__(
        self,
        capacity: int,
        *,
        device: torch.device | str | None = None,
        branching: int | None = None,
    ) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be a positive int, got capacity={capacity}")
        b = max(branching or 2, branching_for(capacity))
        self.capacity = int(capacity)
        self.branching = b
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        neutral = torch.tensor([[0.0], [_INF], [_INF]], dtype=torch.float64, device=self.device)
        sizes = [b**3, b**2, b, 1]
        self.levels = [neutral.expand(3, n).clone() for n in sizes]
        self._views()

    def _views(self) -> None:
        super()._views()
        self._trash = self.levels[0].shape[1] - 1  # a padding slot: -1 markers write here
        self._zero = torch.zeros((), dtype=torch.float64, device=self.device)
        # beyond this many gathered children a write rebuilds the levels instead (O(capacity))
        self._bulk_from = max(4 * self.levels[0].shape[1], 1 << 22)

    # ------------------------------------------------------------------ writes
    def update(
        self,
        index: torch.Tensor,
        mass: torch.Tensor | float,
        raw: torch.Tensor | float,
        *,
        rebuild: bool = True,
    ) -> None:
        """Write ``mass`` and ``raw`` (one per index, or one for all) at in-range ``index``.

        A fixed number of ops (no host read); a repeated slot takes its last value.
        O(k B) for small writes, O(capacity) when ``k * B`` exceeds ``4 * capacity``.
        """
        index = self._index(index)
        if isinstance(mass, torch.Tensor) and isinstance(raw, torch.Tensor):
            mass, raw = self._float(mass), self._float(raw)
            leaves = torch.stack(torch.broadcast_tensors(mass, mass, raw.neg()))
        else:
            values = [[float(mass)], [float(mass)], [-float(raw)]]
            leaves = torch.tensor(values, dtype=torch.float64, device=self.device)
        self._write(index, leaves, rebuild)

    def _write(self, index: torch.Tensor, leaves: torch.Tensor, rebuild: bool = True) -> None:
        """Write leaf columns ``leaves`` (3, k), or one column for all, at ``index``."""
        k = index.numel()
        if not k:
            return
        if leaves.shape[1] == 1:  # one value for all: repeats write the same value
            leaves = leaves.expand(3, k)
        elif k > 1:
            leaves = leaves.index_select(1, self._last_wins(index))
        self.levels[0].index_copy_(1, index, leaves)
        if not rebuild:
            return
        if k * self.branching > self._bulk_from:
            self.rebuild()
        else:
            self._propagate(index)

    def check_and_write(
        self,
        index: torch.Tensor,
        raw: torch.Tensor,
        stored: int,
        eps: float,
        alpha: float,
        f32: bool,
    ) -> tuple[float, int]:
        """Check, then write raw priorities ``raw`` and their mass at ``index``.

        One host read (the batch's bounds: index range, smallest and largest priority, whether
        any entry is not a ``-1`` marker), then a fixed number of ops. Bad entries raise the
        other backends' errors (:func:`fastreplay._core.trees.ops.validate`). O(k B).
        """
        index, raw = self._index(index), self._float(raw)
        k = index.numel()
        if k > max(self.capacity // 16, self.bulk_chunk):  # bulk: bounded chunks
            return super().check_and_write(index, raw, stored, eps, alpha, f32)
        keep = index.ne(-1)
        values = raw.expand(k)
        bounds = torch.stack(
            [
                torch.where(keep, index, 0).amin().to(torch.float64),
                index.amax().to(torch.float64),
                torch.where(keep, values, _INF).amin(),
                torch.where(keep, values, -_INF).amax(),
            ]
        )
        i_min, i_max, p_min, p_max = bounds.tolist()  # the one host read
        if i_max == -1:  # only -1 markers
            return -_INF, -1
        if not (i_min >= 0 and i_max < stored and p_min >= 0 and p_max < _INF):
            validate(index, raw, stored, eps, alpha, f32, self.capacity)  # raises, naming them
        check_mass(p_max, eps, alpha, f32, self.capacity)
        self._write_checked(index, keep, raw, eps, alpha, f32)
        return p_max, int(i_max)

    def _write_checked(
        self,
        index: torch.Tensor,
        keep: torch.Tensor,
        raw: torch.Tensor,
        eps: float,
        alpha: float,
        f32: bool,
    ) -> None:
        """Write checked priorities (one per slot, or one for all); ``~keep`` entries skipped."""
        raw = raw.reshape(-1)
        mass = torch.pow(raw + eps, alpha)
        if f32:
            mass = mass.to(torch.float32).to(torch.float64)
        column = torch.stack(torch.broadcast_tensors(mass, mass, raw.neg()))
        leaves = torch.where(keep, column, self._neutral)  # -1 markers: neutral, at the trash
        self._write(torch.where(keep, index, self._trash), leaves)

    def mark_update(  # type: ignore[override]
        self,
        index: torch.Tensor,
        stored: int,
        eps: float,
        alpha: float,
        f32: bool,
        initial: float,
        upper: float,
        all_time_max: float | None,
    ) -> tuple[float | torch.Tensor, int]:
        """Write the default priority at every slot of ``index`` (``-1`` skipped).

        An index on the host (trees elsewhere, or on the CPU) is checked there first, as
        the other backends check it. Then a fixed number of ops, no host read. Returns
        ``(value, largest slot)``: with the live max (``all_time_max=None``) the value is a
        0-dim float64 tensor on :attr:`device`; the largest slot is ``stored - 1`` when the
        index lives on an accelerator (not read back). O(k B).
        """
        i_max = stored - 1
        if on_host(index):  # host values: checking them waits for nothing
            i_lo, i_hi = (bound.item() for bound in torch.aminmax(index))
            if not 0 <= i_lo <= i_hi < stored:
                zero = torch.zeros(1, dtype=torch.float64)
                checked = validate(index, zero, stored, eps, alpha, f32, self.capacity)
                if checked is None:
                    return -_INF, -1
                i_hi = checked[3]
            i_max = int(i_hi)
        index = self._index(index)
        if all_time_max is not None:  # a host float: checked and computed on the host
            live = initial if all_time_max == -_INF else all_time_max
            priority = min(live, upper)
            check_mass(priority, eps, alpha, f32, self.capacity)
            value = torch.full((), priority, dtype=torch.float64, device=self.device)
            self._mark_on_device(index, value, eps, alpha, f32)
            return priority, i_max
        return self._mark_live(index, eps, alpha, f32, initial, upper), i_max

    def _mark_live(
        self, index: torch.Tensor, eps: float, alpha: float, f32: bool, initial: float, upper: float
    ) -> torch.Tensor:
        """Clear ``index``, then write the max of the other slots there. No host read.

        The live max over the other slots is the default priority whether or not a slot of
        ``index`` held the max. It was checked when written (and ``initial`` when the sampler
        was built, ``upper`` only lowers it), so no mass check is needed.
        """
        keep = index.ne(-1)
        index = torch.where(keep, index, self._trash)
        self._write(index, self._neutral)
        live = self._root[2].neg()
        value = torch.where(live == -_INF, initial, live).clamp_max(upper)
        self._write_checked(index, keep, value, eps, alpha, f32)
        return value

    def _mark_on_device(
        self, index: torch.Tensor, value: torch.Tensor, eps: float, alpha: float, f32: bool
    ) -> None:
        keep = index.ne(-1)
        self._write_checked(torch.where(keep, index, self._trash), keep, value, eps, alpha, f32)

    # ------------------------------------------------------------------ sampling
    def search_with_mass(self, prefix: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Leaf of each prefix mass and its mass: a guarded walk, no host read. O(s B)."""
        node = self._walk(self._float(prefix))
        return node, self._leaf_rows[0].index_select(0, node)

    def search(self, prefix: torch.Tensor, *, guard: bool = False) -> torch.Tensor:
        """Smallest ``i`` with ``sum(mass[: i + 1]) > prefix`` (no host read). O(s B).

        Past the total: the last slot with mass. Found slots have positive mass while the
        total is.
        """
        return self._walk(self._float(prefix))

    def _walk(self, prefix: torch.Tensor) -> torch.Tensor:
        """Descend the three levels for every prefix at once, never past a last positive child.

        In each group the choice is the number of children whose running sum is at most
        ``min(prefix, just below the group's sum)``: the child where the prefix falls, or the
        group's last child with mass when rounding overshoots the group.
        """
        b = self.branching
        # the top: one row of b sums, searched by every prefix at once
        top = self._top_row
        cumsum = top.cumsum(0)
        bound = torch.minimum(prefix, torch.nextafter(cumsum[-1], self._zero))
        node = torch.searchsorted(cumsum, bound, right=True).clamp_max_(b - 1)
        column = (prefix - (cumsum - top).index_select(0, node)).view(-1, 1)
        for depth in (1, 0):
            children = self._sum_groups[depth].index_select(0, node)
            cumsum = children.cumsum(1)
            bound = torch.minimum(column, torch.nextafter(cumsum[:, -1:], self._zero))
            if _BATCHED_SEARCHSORTED:
                choice = torch.searchsorted(cumsum, bound, right=True)
            else:
                choice = (cumsum <= bound).sum(1, keepdim=True)
            choice = choice.clamp_max_(b - 1)  # only an empty group (no mass at all) needs it
            if depth:
                column = column - (cumsum - children).gather(1, choice)
            node = torch.add(choice.view(-1), node, alpha=b)
        return node

    def sample_live(
        self, draw: torch.Tensor, beta: float, f32: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`sample` with the total and the smallest mass read from the root on the device.

        For trees whose every written mass is positive and with at least one slot written
        (the sampler checks both on the host): no host read, about 40 ops. O(s B).
        """
        draw = draw if draw.device == self.device else draw.to(self.device)
        index, mass = self.search_with_mass(draw.mul_(self._root[0]))
        weight = torch.div(mass, self._root[1]).pow_(-beta)
        return index, weight.to(torch.float32) if f32 else weight

    def sample(
        self,
        draw: torch.Tensor,
        total: float,
        m_min: float,
        beta: float,
        f32: bool,
        limit: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The interface's ``sample`` (totals given by the caller); weights by ``torch.pow``."""
        index, weight = super().sample(draw, total, m_min, beta, True, limit)
        if f32:
            return index, weight
        mass = self._leaf_rows[0].index_select(0, index)
        return index, torch.pow(mass / m_min, -beta)

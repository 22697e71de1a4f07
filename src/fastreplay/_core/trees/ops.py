"""Checked priority writes and sampling on priority trees (no TorchRL imports).

The sampler-level operations of the tree interface
(:class:`fastreplay._core.trees.interface.PriorityTreeBackend`), shared by both backends:

* :func:`validate` and :func:`check_mass`: the atomic checks of a priority write, with the
  error classes and messages the samplers raise (:class:`PriorityOverflowError` for a mass that
  does not fit the dtype). The numba backend checks in its compiled kernel and calls these
  only to raise (or to decide a mass near the dtype's limit exactly);
* :class:`TorchTreeOps`, the pure-torch backend's ``check_and_write`` (bulk writes in chunks
  of bounded memory), ``mark_update`` and ``sample``, mixed into
  :class:`fastreplay._core.trees.torch_backend.PriorityTrees`.

Example:
    >>> import torch
    >>> from fastreplay._core.trees.torch_backend import PriorityTrees
    >>> trees = PriorityTrees(7)
    >>> trees.check_and_write(torch.tensor([0, 3]), torch.tensor([1.0, 3.0]), 7, 0.0, 1.0, True)
    (3.0, 3)
    >>> validate(torch.tensor([1]), torch.tensor([-1.0]), 7, 0.0, 1.0, True, 7)
    Traceback (most recent call last):
    ...
    ValueError: priority must be finite and >= 0, got index 1: -1.0 (pass e.g. ...
"""

from __future__ import annotations

import itertools
import math
import sys
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from fastreplay.errors import PriorityOverflowError

__all__ = [
    "FLOAT32_LIMIT",
    "PriorityOverflowError",
    "TorchTreeOps",
    "c_pow",
    "check_mass",
    "mass_bound",
    "mass_of",
    "validate",
]

# A float64 value rounds to a finite float32 iff it is below FLT_MAX + half an ulp (2 ** 103).
FLOAT32_LIMIT = float(torch.finfo(torch.float32).max) + 2.0**103


def mass_limit(f32: bool, slots: int) -> float:
    """Masses must stay below this: a finite float32, or a finite float64 sum over ``slots``."""
    return FLOAT32_LIMIT if f32 else sys.float_info.max / slots


def mass_bound(f32: bool, slots: int) -> float:
    """A mass below this fits for sure (:func:`check_mass` decides the rest). O(1)."""
    return mass_limit(f32, slots) * (1 - 1e-12)


def check_mass(
    p_max: float, eps: float, alpha: float, f32: bool, slots: int, what: str = "priority"
) -> None:
    """Raise :class:`PriorityOverflowError` if ``(p_max + eps) ** alpha`` overflows. O(1).

    float32: the mass must round to a finite float32. float64: the sum over every one of the
    ``slots`` must stay finite, so the mass must be below ``float64 max / slots``. ``what``
    (``"priority"``, ``"initial_priority"`` or ``"alpha"``) words the message.
    """
    if p_max == -math.inf:  # nothing stored, or a write of only -1 markers: no mass
        return
    limit = mass_limit(f32, slots)
    try:
        mass = (p_max + eps) ** alpha
    except OverflowError:
        mass = math.inf
    if mass < limit * (1 - 1e-12):
        return
    dtype = torch.float32 if f32 else torch.float64
    exact = torch.pow(torch.tensor(p_max, dtype=torch.float64) + eps, alpha)
    if float(exact) < limit and math.isfinite(float(exact.to(dtype))):
        return
    if what == "initial_priority":
        cause = f"initial_priority={p_max!r} gives a"
        fix = "lower initial_priority or alpha"
    elif what == "alpha":
        cause = f"setting alpha={alpha} would give the stored priority {p_max!r} a"
        fix = "lower the priorities first, keep a smaller alpha"
    else:
        cause = f"priority {p_max!r} gives a"
        fix = "rescale the priorities (e.g. clip TD errors), lower alpha"
    raise PriorityOverflowError(
        f"{cause} sampling mass (p + eps) ** alpha = {mass:.4g} that does not fit "
        f"dtype={str(dtype).removeprefix('torch.')} (limit {limit:.4g}); {fix} or build the "
        "sampler with dtype=torch.float64; nothing was changed"
    )


_COMPILED_POW_MIN = 1 << 14
"""Elements from which :func:`c_pow` uses numba's compiled loop, where numba is installed."""


def _compiled_pow() -> Any:
    """The compiled ``pow`` loop, or ``None`` without numba (imported at first use)."""
    from fastreplay._core.trees.numba_kernels import NUMBA_AVAILABLE, _pow_each

    return _pow_each if NUMBA_AVAILABLE else None


def _c_pow_one(x: float, y: float) -> float:
    """``pow(x, y)`` of the C library for one value, special cases included (no exception)."""
    with np.errstate(all="ignore"):
        return float(np.float64(x) ** np.float64(y))  # numpy's scalar power: the C ``pow``


def c_pow(base: torch.Tensor, exponent: float) -> torch.Tensor:
    """``base ** exponent`` for a float64 ``base``, by the C library's ``pow``. O(k).

    The numba backend's compiled ``**`` calls the C library's ``pow``. On the CPU, ``torch.pow``
    computes most elements with SLEEF's vectorized ``pow`` instead (within one ulp; about 2% of
    float64 results differ from the C library's in the last bit), so float64 masses and weights
    are computed here for both backends to hold the same bits: on Python floats (``math.pow``
    is the C ``pow``; about 0.15 us per element, 40 us for 256 where ``torch.pow`` takes 6 us),
    or, from :data:`_COMPILED_POW_MIN` elements on (bulk writes, ``alpha`` changes) and where
    numba is installed, by a compiled loop (a few ns per element). On other devices:
    ``torch.pow``.
    """
    if base.device.type != "cpu":
        return torch.pow(base, exponent)
    if base.numel() >= _COMPILED_POW_MIN:
        compiled = _compiled_pow()
        if compiled is not None:
            flat = base.reshape(-1).contiguous().numpy()
            out = np.empty_like(flat)
            compiled(flat, float(exponent), out)
            return torch.from_numpy(out).reshape(base.shape)
    values = base.reshape(-1).tolist()
    try:
        out = list(map(math.pow, values, itertools.repeat(exponent, len(values))))
    except (OverflowError, ValueError):  # inf, nan where Python raises: C's results
        out = [_c_pow_one(x, exponent) for x in values]
    return torch.from_numpy(np.array(out, dtype=np.float64)).reshape(base.shape)


def mass_of(raw: torch.Tensor, eps: float, alpha: float, f32: bool) -> torch.Tensor:
    """Sampling mass ``(raw + eps) ** alpha`` in float64, rounded to float32 if ``f32``. O(k).

    float64 masses come from the C library's ``pow`` (:func:`c_pow`), as the numba backend's;
    float32 ones round ``torch.pow``'s float64 result, which can differ from that in the last
    float64 bit only, and so round alike except within one float64 ulp of a float32 rounding
    midpoint (about one value in 10**10).
    """
    raw = raw if raw.dtype == torch.float64 else raw.to(torch.float64)
    if not f32:
        return c_pow(raw + eps, alpha)
    return torch.pow(raw + eps, alpha).to(torch.float32)


def _show(index: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, limit: int = 5) -> str:
    """``"index 3: nan, index 7: -1.0"`` for the first ``limit`` entries where ``mask``."""
    where = mask.nonzero().flatten()
    shown = [f"index {int(index[i])}: {float(values[i])!r}" for i in where[:limit].tolist()]
    more = f" (and {where.numel() - limit} more)" if where.numel() > limit else ""
    return ", ".join(shown) + more


def validate(
    flat: torch.Tensor,
    raw: torch.Tensor,
    stored: int,
    eps: float,
    alpha: float,
    f32: bool,
    slots: int,
) -> tuple[torch.Tensor, torch.Tensor, float, int] | None:
    """Drop ``-1`` markers, check ranges; raise ValueError naming bad entries. O(k).

    ``raw`` holds one float64 priority per slot of ``flat``, or one for all. Returns
    ``(flat, raw, max priority, max slot)`` for the entries to write, or ``None`` if every
    entry is a ``-1`` marker (TorchRL's ``MaxValueWriter`` marks rows it did not write so).

    Raises:
        ValueError: an index outside ``[0, stored)``, or a NaN, infinite or negative
            priority; the message names the first offending entries.
        PriorityOverflowError: the largest priority's mass does not fit (:func:`check_mass`).
    """
    # Two fused reductions validate the common (valid) case; ``raw`` may be one value.
    bounds = [*torch.aminmax(flat), *(torch.aminmax(raw) if raw.numel() > 1 else (raw, raw))]
    if flat.is_cpu:  # reading a CPU scalar is cheaper than stacking four
        i_min, i_max, p_min, p_max = (value.item() for value in bounds)
    else:  # one host sync
        i_min, i_max, p_min, p_max = torch.stack(
            [value.to(torch.float64).reshape(()) for value in bounds]
        ).tolist()
    if i_min == -1:  # MaxValueWriter's "do not update" marker
        keep = flat != -1
        flat, raw = flat[keep], raw[keep] if raw.numel() > 1 else raw
        return validate(flat, raw, stored, eps, alpha, f32, slots) if flat.numel() else None
    if not (i_min >= 0 and i_max < stored and p_min >= 0 and p_max < math.inf):
        raw = raw.expand(flat.shape)
        bad_p = ~((raw >= 0) & (raw < math.inf))
        bad_i = (flat < 0) | (flat >= stored)
        problems = []
        if bool(bad_i.any()):
            shown = flat[bad_i]
            more = f" (and {shown.numel() - 5} more)" if shown.numel() > 5 else ""
            problems.append(
                f"index outside the stored range [0, {stored}): {shown[:5].tolist()}{more} "
                "(pass indices of stored items, e.g. the 'index' a sample returned)"
            )
        if bool(bad_p.any()):
            problems.append(
                f"priority must be finite and >= 0, got {_show(flat, raw, bad_p)} (pass e.g. "
                "td_error.abs(); torch.nan_to_num replaces NaN and inf)"
            )
        raise ValueError("; ".join(problems) + "; nothing was updated")
    check_mass(p_max, eps, alpha, f32, slots)  # the mass is monotone: check the largest
    return flat, raw, p_max, int(i_max)


class TorchTreeOps:
    """The sampler operations of :class:`~fastreplay._core.trees.torch_backend.PriorityTrees`.

    See :class:`fastreplay._core.trees.interface.PriorityTreeBackend` for the contract.
    """

    bulk_chunk = 1 << 16  # smallest chunk of a bulk write (chunks are capacity / 16 or this)

    if TYPE_CHECKING:  # what the mixin uses of PriorityTrees
        capacity: int
        device: torch.device

        def update(
            self,
            index: torch.Tensor,
            mass: torch.Tensor | float,
            raw: torch.Tensor | float,
            *,
            rebuild: bool = True,
        ) -> None: ...
        def rebuild(self) -> None: ...
        def clear(self, index: torch.Tensor) -> None: ...
        def max_raw(self) -> float: ...
        def max_raw_of(self, index: torch.Tensor) -> float: ...
        def leaf_mass(self) -> torch.Tensor: ...
        def search_with_mass(self, prefix: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...

    def check_and_write(
        self,
        index: torch.Tensor,
        raw: torch.Tensor,
        stored: int,
        eps: float,
        alpha: float,
        f32: bool,
    ) -> tuple[float, int]:
        """Check, then write raw priorities (one per slot, or one for all) and their mass.

        O(k log_B capacity); writes of more than ``max(capacity / 16, bulk_chunk)`` slots go
        in chunks of that size (bounded temporaries): every chunk is checked before any is
        written, then the leaves of each are stored and the nodes rebuilt once, O(capacity).
        """
        step = max(self.capacity // 16, self.bulk_chunk)
        if index.numel() <= step:
            raw = raw if raw.dtype == torch.float64 else raw.to(torch.float64)
            checked = validate(index, raw, stored, eps, alpha, f32, self.capacity)
            if checked is None:
                return -math.inf, -1
            self.update(checked[0], mass_of(checked[1], eps, alpha, f32), checked[1])
            return checked[2], checked[3]
        # Later chunks overwrite earlier ones, so the last occurrence of a slot still wins.
        raw = raw.expand(index.shape)
        chunks = [(index[i : i + step], raw[i : i + step]) for i in range(0, raw.numel(), step)]
        for part, values in chunks:
            validate(part, values.to(torch.float64), stored, eps, alpha, f32, self.capacity)
        p_max, i_max = -math.inf, -1
        for part, values in chunks:
            checked = validate(
                part, values.to(torch.float64), stored, eps, alpha, f32, self.capacity
            )
            if checked is not None:
                p_max, i_max = max(p_max, checked[2]), max(i_max, checked[3])
                mass = mass_of(checked[1], eps, alpha, f32)
                self.update(checked[0], mass, checked[1], rebuild=False)
        self.rebuild()  # once, after the leaves of every chunk
        return p_max, i_max

    def mark_update(
        self,
        index: torch.Tensor,
        stored: int,
        eps: float,
        alpha: float,
        f32: bool,
        initial: float,
        upper: float,
        all_time_max: float | None,
    ) -> tuple[float, int]:
        """Write the default priority at every slot of ``index``. O(k log_B capacity).

        See :meth:`fastreplay._core.trees.interface.PriorityTreeBackend.mark_update`.
        """
        i_min, i_max = (bound.item() for bound in torch.aminmax(index))
        if not 0 <= i_min <= i_max < stored:  # -1 markers, or a bad index (raises first)
            zero = torch.zeros(1, dtype=torch.float64, device=self.device)
            checked = validate(index, zero, stored, eps, alpha, f32, self.capacity)
            if checked is None:
                return -math.inf, -1
            index, i_max = checked[0], checked[3]
        # One value for all: no dedupe. Clear the slots first if one holds the live max.
        if all_time_max is None and self.max_raw_of(index) >= self.max_raw():
            self.clear(index)
        live = self.max_raw() if all_time_max is None else all_time_max
        priority = min(initial if live == -math.inf else live, upper)
        check_mass(priority, eps, alpha, f32, self.capacity)
        mass = (priority + eps) ** alpha  # as the numba backend computes it
        if f32:
            mass = float(np.float32(mass))
        self.update(index, mass, priority)
        return priority, int(i_max)

    def sample(
        self,
        draw: torch.Tensor,
        total: float,
        m_min: float,
        beta: float,
        f32: bool,
        limit: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Leaves for uniform float64 ``draw`` (scaled in place) and their IS weights.

        O(s log_B capacity), plus O(limit) if a draw past ``limit`` moves (rare).
        """
        draw = draw if draw.device == self.device else draw.to(self.device)
        index, mass = self.search_with_mass(draw.mul_(total))
        if limit is not None:
            over = index >= limit
            if bool(over.any()):  # rounding: the last slot below ``limit`` with mass
                below = self.leaf_mass()[:limit]
                last = int(below.nonzero()[-1])
                index, mass = torch.where(over, last, index), torch.where(over, below[last], mass)
        if f32:  # rounded to float32: see mass_of
            return index, torch.pow(mass / m_min, -beta).to(torch.float32)
        return index, c_pow(mass / m_min, -beta)

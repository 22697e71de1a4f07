"""What a benchmark run produces: measured cases, and how a ratio or a load reads.

The harness (:mod:`benchmarks.harness`) fills these in, the reports (:mod:`benchmarks.report`)
read them; this module imports neither, so the two never import each other.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


class NotMeasured(Exception):
    """Raised by a scenario's ``run`` when nothing can be measured here; says why.

    The harness prints ``not measured: <reason>`` for that scenario, records the reason in
    ``results.json`` and goes on with the next scenario; it never flags such a scenario busy.
    """


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    """``numerator / denominator``, or ``None`` where it is undefined (missing or <= 0)."""
    if numerator is None or denominator is None or denominator <= 0 or numerator < 0:
        return None
    return numerator / denominator


def fmt_ratio(value: float | None, undefined: str = "n/a") -> str:
    """``12.3x``, ``0.015x`` below 0.1; ``undefined`` (say why) where :func:`ratio` gave ``None``.

    Two significant digits below 0.1, so that a ratio such as a start-up's 0.015x is not
    shown as ``0.0x``.
    """
    if value is None or math.isnan(value):
        return undefined
    if 0 < value < 0.1:
        return f"{value:.2g}x"
    return f"{value:,.1f}x"


@dataclass
class Result:
    """One measured case: fastreplay's time per call and, when comparable, TorchRL's.

    ``fastreplay_s`` and ``torchrl_s`` are seconds per call: a median for most scenarios.
    A throughput case sets ``rate_unit`` (e.g. ``"steps/s"``): its times are then the mean time
    per step (1 / throughput), reports show the throughput itself, and :attr:`speedup` is
    fastreplay's throughput / TorchRL's, the same number.

    Two optional references sit beside TorchRL's time, in seconds per call like it:
    ``cpprb_s``, cpprb's time on the same workload where cpprb was timed, and ``floor_s``, the
    time of the simplest code that moves the same rows and touches the same tree cells (no
    TensorDict, no TorchRL; see ``docs/benchmarks.md``). Both stay ``None`` where a case has
    no such reference, as in every scenario that does not set them.
    """

    scenario: str
    case: str
    fastreplay_s: float
    torchrl_s: float | None
    correct: bool
    params: dict[str, Any] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)
    rate_unit: str | None = None
    cpprb_s: float | None = None
    floor_s: float | None = None

    @property
    def speedup(self) -> float | None:
        """TorchRL time / fastreplay time (above 1: fastreplay is faster).

        For a throughput case (``rate_unit`` set) this equals fastreplay's throughput /
        TorchRL's.
        """
        return ratio(self.torchrl_s, self.fastreplay_s)

    @property
    def vs_cpprb(self) -> float | None:
        """The time ratio cpprb / fastreplay (above 1: fastreplay is faster); ``None`` untimed."""
        return ratio(self.cpprb_s, self.fastreplay_s)

    @property
    def over_floor(self) -> float | None:
        """The time ratio fastreplay / floor: how many floors a call costs; ``None`` without one."""
        return ratio(self.fastreplay_s, self.floor_s)

    def ratios(self) -> dict[str, float | None]:
        """The derived ratios stored beside the fields in ``results.json``."""
        return {"speedup": self.speedup, "vs_cpprb": self.vs_cpprb, "over_floor": self.over_floor}

    @property
    def speedup_definition(self) -> str:
        """What :attr:`speedup` divides, in words (``"TorchRL time / fastreplay time"``)."""
        if self.rate_unit:
            return f"fastreplay {self.rate_unit} / TorchRL {self.rate_unit}"
        return "TorchRL time / fastreplay time"


def fmt_load(load: Mapping[str, Any]) -> str:
    """One line: load averages and the cores other processes used."""
    before, after = load.get("loadavg_before"), load.get("loadavg_after")
    text = "load average n/a"
    if before and after:
        text = f"load average {before[0]:.1f} -> {after[0]:.1f}"
    other = load.get("other_processes_cores")
    if other is not None:
        text += f", other processes used {other:.1f} of {load['usable_cpus']} cores"
    return text

"""Every scenario's command-line options and their checks, without importing torch.

``python -m benchmarks --help`` and the checks of the values given (:func:`benchmarks.harness.
parse_arguments`) read only this module and the registry, :mod:`benchmarks.scenarios`, so they
never import torch, TensorDict, TorchRL or fastreplay; a scenario module is imported when it
runs. For each scenario: ``add_<name>(group)`` adds its options to an argument group, and
``check_<name>(args)`` (where values must fit together) returns the problems found, empty when
there are none. Every option has a checking ``type=`` (the helpers below).
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import re
from collections.abc import Callable

_SUFFIX = {"k": 10**3, "K": 10**3, "M": 10**6, "G": 10**9}
_COUNT = re.compile(r"^(\d+(?:\.\d+)?)([kKMG]?)$")


class CountError(argparse.ArgumentTypeError, ValueError):
    """A count that does not parse (raised by :func:`parse_count`; argparse prints it)."""


def parse_count(text: str | int) -> int:
    """Parse ``"6M"``, ``"346M"``, ``"1_000"`` or ``"10k"`` into an int (ints pass through).

    Raises:
        CountError: (a ``ValueError`` and an ``argparse.ArgumentTypeError``) for anything else.
    """
    if isinstance(text, int):
        return text
    match = _COUNT.match(text.strip().replace("_", ""))
    if match is None:
        raise CountError(
            f"{text!r} is not a count: write digits with an optional k, M or G suffix "
            "(1000, 10k, 6M, 1.5G)"
        )
    value = float(match[1]) * _SUFFIX.get(match[2], 1)
    if value != int(value):
        raise CountError(f"{text!r} is not a whole number of items")
    return int(value)


def parse_counts(text: str) -> list[int]:
    """Parse a comma-separated list of counts (``"6M,600M"``)."""
    counts = [parse_count(t) for t in text.split(",") if t.strip()]
    if not counts:
        raise CountError(f"{text!r}: give at least one count (e.g. 1M or 1M,10M)")
    return counts


def positive_int(text: str) -> int:
    """Argparse ``type=``: a count of at least 1 (suffixes allowed: ``10k``)."""
    value = parse_count(text)
    if value < 1:
        raise CountError(f"{text!r}: must be at least 1")
    return value


def non_negative_int(text: str) -> int:
    """Argparse ``type=``: a count of at least 0 (suffixes allowed: ``10k``)."""
    return parse_count(text)


def seed_int(text: str) -> int:
    """Argparse ``type=``: a seed torch accepts, 0 to 2**64 - 1."""
    value = parse_count(text)
    if value >= 2**64:
        raise CountError(f"{text!r}: a seed must be below 2**64 (18446744073709551616)")
    return value


def count_text(text: str) -> str:
    """Argparse ``type=``: a count of at least 1, kept as written (``"6M"``)."""
    positive_int(text)
    return text


def counts_text(text: str) -> str:
    """Argparse ``type=``: comma-separated counts, each at least 1, none twice; kept as written."""
    counts = parse_counts(text)
    if min(counts) < 1:
        raise CountError(f"{text!r}: every count must be at least 1, got {min(counts)}")
    twice = sorted({fmt_count(n) for n in counts if counts.count(n) > 1})
    if twice:
        raise CountError(f"{text!r}: {', '.join(twice)} listed twice; give each count once")
    return text


def positive_seconds(text: str) -> float:
    """Argparse ``type=``: a finite number of seconds above 0 (``5``, ``0.5``)."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(
            f"{text!r}: give a number of seconds above 0 (e.g. 5 or 0.5)"
        )
    return value


def sizes_and_capacity(stored: str, capacity: str | None) -> tuple[list[int], int]:
    """The stored sizes of ``"1M,5M"`` and the capacity: ``capacity``, or 1.2x the largest size."""
    sizes = parse_counts(stored)
    return sizes, parse_count(capacity) if capacity else int(1.2 * max(sizes))


def check_sizes(prefix: str, stored: str, capacity: str | None, slice_len: int) -> list[str]:
    """Problems of ``--<prefix>-stored`` and ``--<prefix>-capacity`` with strict slices.

    Every stored size must fit in the capacity, and hold a whole slice of ``slice_len`` steps.
    """
    problems = []
    sizes, slots = sizes_and_capacity(stored, capacity)
    if max(sizes) > slots:
        problems.append(
            f"--{prefix}-stored {stored} exceeds --{prefix}-capacity {capacity}: store at most "
            "the capacity (or leave the capacity out: 1.2x the largest size)"
        )
    if slice_len > min(sizes):
        problems.append(
            f"--{prefix}-slice-len {slice_len} is longer than the smallest --{prefix}-stored "
            f"({fmt_count(min(sizes))}): no trajectory holds a whole slice"
        )
    return problems


def choice_list(*choices: str) -> Callable[[str], str]:
    """Argparse ``type=``: a comma-separated subset of ``choices``, each once, kept as written."""

    def check(text: str) -> str:
        items = [t.strip() for t in text.split(",") if t.strip()]
        bad = [t for t in items if t not in choices]
        if bad or not items:
            raise argparse.ArgumentTypeError(
                f"{text!r}: give a comma-separated list of {', '.join(choices)}"
            )
        twice = sorted({t for t in items if items.count(t) > 1})
        if twice:
            raise argparse.ArgumentTypeError(
                f"{text!r}: {', '.join(twice)} listed twice; give each name once"
            )
        return text

    check.__name__ = check.__qualname__ = f"choice_list({', '.join(choices)})"
    return check


def fmt_count(n: int) -> str:
    """Format ``346_000_000`` as ``"346M"``."""
    for suffix, scale in (("G", 10**9), ("M", 10**6), ("k", 10**3)):
        if n >= scale and n % (scale // 1000 or 1) == 0:
            value = n / scale
            return f"{value:g}{suffix}"
    return str(n)


# ----------------------------------------------------------------------------- her_streaming


def add_her_streaming(group: argparse._ArgumentGroup) -> None:
    group.add_argument(
        "--hs-stored",
        type=counts_text,
        default="1M,10M",
        help="items stored, comma-separated (e.g. 1M,10M,50M)",
    )
    group.add_argument(
        "--hs-episode-len", type=positive_int, default=1000, help="steps per episode"
    )
    group.add_argument(
        "--hs-batch", type=positive_int, default=256, help="transitions / slices per sample"
    )


# --------------------------------------------------------------------------------------- gpu

GPU_EPISODE = 500  # the slice rows' episode length (benchmarks.scenarios.gpu)


def add_gpu(group: argparse._ArgumentGroup) -> None:
    group.add_argument(
        "--gpu-device",
        type=gpu_device,
        default="cuda",
        help="device of the storages and samples: cuda, or cpu to run the rows on the host",
    )
    group.add_argument(
        "--gpu-stored", type=count_text, default="1M", help="capacity of the CUDA storages"
    )
    group.add_argument(
        "--gpu-batch", type=positive_int, default=256, help="samples (or slices) per sample()"
    )
    group.add_argument(
        "--gpu-pin-stored", type=positive_int, default=2048, help="frames stored for the pin row"
    )
    group.add_argument(
        "--gpu-logp-batch",
        type=count_text,
        default="4M",
        help="samples whose log-probs the chunked log-prob row computes",
    )


def gpu_device(text: str) -> str:
    if text not in ("cuda", "cpu") and not text.startswith("cuda:"):
        raise argparse.ArgumentTypeError(f"{text!r}: pass cuda, cuda:N or cpu")
    return text


def check_gpu(args: argparse.Namespace) -> list[str]:
    """Usage errors: values that do not fit together."""
    stored = parse_count(args.gpu_stored)
    if stored < 2 * GPU_EPISODE:
        return [f"--gpu-stored {args.gpu_stored}: at least {2 * GPU_EPISODE} (two episodes)"]
    return []


# --------------------------------------------------------------------------------------- pin


def add_pin(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--pin-batch", type=positive_int, default=256, help="samples per batch")
    group.add_argument("--pin-size", type=positive_int, default=2048, help="items stored")
    group.add_argument(
        "--pin-shape", type=pin_shape, default="84x84x3", help="uint8 pixel shape per item, HxWxC"
    )


def pin_shape(text: str) -> str:
    if not all(part.isdigit() and int(part) > 0 for part in text.split("x")):
        raise argparse.ArgumentTypeError(f"{text!r}: write the shape as HxWxC, e.g. 84x84x3")
    return text


# --------------------------------------------------------------------------------------- ppo


def add_ppo(group: argparse._ArgumentGroup) -> None:
    group.add_argument(
        "--ppo-batch",
        type=positive_int,
        default="100k",
        help="observations per batch (1M shows the memory gap best)",
    )
    group.add_argument(
        "--ppo-chunk", type=positive_int, default=8192, help="chunk_size of chunked_log_prob"
    )
    group.add_argument(
        "--ppo-threads",
        type=non_negative_int,
        default=None,
        help="torch threads in both ppo processes (default: --threads; 0: torch's default). "
        "Chunks run many more parallel regions than one big call, so with several threads on "
        "cores that other processes use the chunked time suffers most",
    )


# ------------------------------------------------------------------------------- prioritized


def add_prioritized(group: argparse._ArgumentGroup) -> None:
    group.add_argument(
        "--per-capacity",
        type=counts_text,
        default="1M,10M",
        help="capacities for the per-call cases, the online step, the bulk update and "
        "'lower the max' (e.g. 1M,10M,100M)",
    )
    group.add_argument(
        "--per-backends",
        type=choice_list("numba", "torch"),
        default=None,
        help="fastreplay tree backends to time, comma-separated (default: every one installed)",
    )
    group.add_argument(
        "--per-dumps-capacity",
        type=counts_text,
        default="1M",
        help="capacities for dumps+loads, comma-separated",
    )


def check_prioritized(args: argparse.Namespace) -> list[str]:
    """Values the cases cannot run with."""
    problems = []
    small = [n for n in parse_counts(args.per_capacity) if n < 2]
    if small:
        problems.append(
            f"--per-capacity {args.per_capacity}: 'lower the max item' moves the max below a "
            "second item, so every capacity must be at least 2"
        )
    chosen = (args.per_backends or "").split(",")
    selected = "prioritized" in {t.strip() for t in args.only.split(",")}
    if selected and "numba" in chosen and importlib.util.find_spec("numba") is None:
        problems.append(
            f"--per-backends {args.per_backends}: numba is not installed (pip install "
            "numba); pass --per-backends torch"
        )
    return problems


# ------------------------------------------------------------------------- prioritized_slice


def add_prioritized_slice(group: argparse._ArgumentGroup) -> None:
    group.add_argument(
        "--pslice-stored",
        type=counts_text,
        default="1M",
        help="items stored, comma-separated (e.g. 1M,5M,50M)",
    )
    group.add_argument(
        "--pslice-capacity",
        type=count_text,
        default=None,
        help="storage capacity (default: 1.2x the largest --pslice-stored)",
    )
    group.add_argument(
        "--pslice-episode-len", type=positive_int, default=1000, help="steps per episode"
    )
    group.add_argument(
        "--pslice-num-slices", type=positive_int, default=256, help="slices per sampled batch"
    )
    group.add_argument("--pslice-slice-len", type=positive_int, default=32, help="steps per slice")
    group.add_argument(
        "--pslice-skip-torchrl-online-above",
        type=non_negative_int,
        default="60M",
        help="time TorchRL's online step only up to this many stored items",
    )


def check_prioritized_slice(args: argparse.Namespace) -> list[str]:
    """Values that do not fit together (the sampler's slices are strict: full length)."""
    ep, slice_len = args.pslice_episode_len, args.pslice_slice_len
    problems = check_sizes("pslice", args.pslice_stored, args.pslice_capacity, slice_len)
    if slice_len > ep:
        problems.append(
            f"--pslice-slice-len {slice_len} is longer than --pslice-episode-len {ep}: no "
            "episode holds a whole slice; pass a longer episode or a shorter slice"
        )
    return problems


# --------------------------------------------------------------------------------- scale_out

SCALE_TRAJ_STRIDE = 1_000_000_000  # trajectory ids of one writer: writer * stride + episode
SCALE_STEP_LIMIT = 10_000  # obs = traj * SCALE_STEP_LIMIT + step in the episode


def add_scale_out(group: argparse._ArgumentGroup) -> None:
    group.add_argument(
        "--scale-writers", type=counts_text, default="1,2,4", help="writer process counts"
    )
    group.add_argument(
        "--scale-kinds",
        type=choice_list("prioritized", "slice"),
        default="prioritized,slice",
        help="learners to run, comma-separated: prioritized, slice",
    )
    group.add_argument(
        "--scale-capacity", type=count_text, default="1M", help="prioritized: capacity (full)"
    )
    group.add_argument(
        "--scale-slice-capacity", type=count_text, default="6M", help="slice: capacity"
    )
    group.add_argument(
        "--scale-slice-stored", type=count_text, default="5M", help="slice: items prefilled"
    )
    group.add_argument(
        "--scale-episode",
        type=positive_int,
        default=1000,
        help=f"episode length, at most {SCALE_STEP_LIMIT:,}",
    )
    group.add_argument(
        "--scale-seconds", type=positive_seconds, default=5.0, help="seconds per case"
    )
    group.add_argument(
        "--scale-batch", type=positive_int, default=256, help="prioritized batch size"
    )
    group.add_argument(
        "--scale-slices",
        type=scale_slices_text,
        default="256x32",
        help="slice batch: SLICESxLENGTH, the length at most --scale-episode",
    )
    group.add_argument(
        "--scale-write-rate",
        type=non_negative_int,
        default=0,
        help="items/s per writer (default 0: as fast as the writer can)",
    )
    group.add_argument(
        "--scale-ray", action="store_true", help="also run the workload through RayReplayBuffer"
    )


def scale_slices_text(text: str) -> str:
    """Argparse ``type=``: ``SLICESxLENGTH`` (``256x32``), both at least 1; kept as written."""
    parts = text.split("x")
    if len(parts) != 2 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise argparse.ArgumentTypeError(
            f"{text!r}: write the slice batch as SLICESxLENGTH, both at least 1 (e.g. 256x32: "
            "256 slices of 32 steps)"
        )
    return text


def scale_slices(text: str) -> tuple[int, int]:
    """``"256x32"`` -> ``(256, 32)``: slices per batch and steps per slice."""
    num_slices, slice_len = (int(x) for x in text.split("x"))
    return num_slices, slice_len


def check_scale_out(args: argparse.Namespace) -> list[str]:
    """Values that do not fit together."""
    problems = []
    episode, (_, slice_len) = args.scale_episode, scale_slices(args.scale_slices)
    capacity, stored = parse_count(args.scale_slice_capacity), parse_count(args.scale_slice_stored)
    if episode > SCALE_STEP_LIMIT:
        problems.append(
            f"--scale-episode {episode}: at most {SCALE_STEP_LIMIT} (each row's obs encodes its "
            "step in the episode below that, and every sample is checked against it)"
        )
    if slice_len > episode:
        problems.append(
            f"--scale-slices {args.scale_slices}: slices of {slice_len} steps are longer than "
            f"the episodes (--scale-episode {episode}); pass a length of at most {episode}"
        )
    if stored > capacity:
        problems.append(
            f"--scale-slice-stored {args.scale_slice_stored} exceeds --scale-slice-capacity "
            f"{args.scale_slice_capacity}: prefill at most the capacity"
        )
    if slice_len > stored:
        problems.append(
            f"--scale-slices {args.scale_slices}: slices of {slice_len} steps are longer than "
            f"the prefill (--scale-slice-stored {args.scale_slice_stored})"
        )
    prefill = max(stored, parse_count(args.scale_capacity))
    if prefill // episode >= SCALE_TRAJ_STRIDE:
        problems.append(
            f"--scale-episode {episode}: a prefill of {fmt_count(prefill)} items makes more than "
            f"{SCALE_TRAJ_STRIDE:,} episodes; pass longer episodes"
        )
    return problems


# ---------------------------------------------------------------------------------- sequence


def add_sequence(group: argparse._ArgumentGroup) -> None:
    group.add_argument(
        "--seq-cases",
        type=choice_list("static", "online"),
        default="static,online",
        help="which sequence cases to run, comma-separated",
    )
    group.add_argument(
        "--seq-capacity",
        type=counts_text,
        default="1M,10M",
        help="storage capacities (filled) for the sequence cases, comma-separated (50M: opt-in)",
    )
    group.add_argument(
        "--seq-episode",
        type=positive_int,
        default=1000,
        help="episode length of the sequence cases' data",
    )


# ------------------------------------------------------------------------------------- slice


def add_slice(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--capacity", type=count_text, default="6M", help="storage capacity (items)")
    group.add_argument(
        "--stored", type=count_text, default="5M", help="items written before timing starts"
    )
    group.add_argument(
        "--episode-len",
        type=counts_text,
        default="1000,50",
        help="episode lengths to run, comma-separated (one pair of rows each)",
    )
    group.add_argument(
        "--end",
        type=choice_list("done", "traj"),
        default="done,traj",
        help="how trajectories are marked, comma-separated: 'done' = ('next', 'done') flags "
        "(end_key), 'traj' = trajectory ids (traj_key)",
    )
    group.add_argument(
        "--num-slices", type=positive_int, default=256, help="slices per sampled batch"
    )
    group.add_argument(
        "--slice-len", type=positive_int, default=32, help="steps per slice (batch = slices x len)"
    )
    group.add_argument(
        "--rotate-items",
        type=counts_text,
        default="2M,8M",
        help="full storages (items) for the rotating slice lengths, comma-separated",
    )
    group.add_argument(
        "--rotate-lengths",
        type=non_negative_int,
        default=8,
        help="slice lengths rotated from one sample to the next, around --slice-len (0: none)",
    )


def check_slice(args: argparse.Namespace) -> list[str]:
    """Values that do not fit together (the sampler's slices are strict: full length)."""
    problems = []
    capacity, stored = parse_count(args.capacity), parse_count(args.stored)
    if stored > capacity:
        problems.append(
            f"--stored {args.stored} exceeds --capacity {args.capacity}: this scenario times a "
            "partly filled storage; store at most the capacity"
        )
    shortest = min(parse_counts(args.episode_len))
    if args.slice_len > min(shortest, stored):
        what = f"--episode-len {shortest}" if shortest <= stored else f"--stored {args.stored}"
        problems.append(
            f"--slice-len {args.slice_len} is longer than {what}: no trajectory holds a whole "
            f"slice; pass --slice-len {min(shortest, stored)} or less"
        )
    if args.rotate_lengths and args.slice_len - args.rotate_lengths // 2 < 2:
        problems.append(
            f"--rotate-lengths {args.rotate_lengths} around --slice-len {args.slice_len} "
            "reaches slices shorter than 2 steps; pass --rotate-lengths "
            f"{max(0, 2 * (args.slice_len - 2))} or less"
        )
    return problems


# ----------------------------------------------------------------- slice_without_replacement


def add_slice_without_replacement(group: argparse._ArgumentGroup) -> None:
    group.add_argument(
        "--swor-stored",
        type=counts_text,
        default="1M",
        help="items stored, comma-separated (e.g. 1M,5M,50M)",
    )
    group.add_argument(
        "--swor-capacity",
        type=count_text,
        default=None,
        help="storage capacity (default: 1.2x the largest --swor-stored)",
    )
    group.add_argument(
        "--swor-episode-len", type=positive_int, default=1000, help="steps per episode"
    )
    group.add_argument(
        "--swor-num-slices", type=positive_int, default=256, help="slices per sampled batch"
    )
    group.add_argument("--swor-slice-len", type=positive_int, default=32, help="steps per slice")


def swor_refusal(args: argparse.Namespace, stored: int, capacity: int) -> str | None:
    """Why ``stored`` items cannot be benchmarked with these arguments, or ``None``."""
    ep, slices, slice_len = args.swor_episode_len, args.swor_num_slices, args.swor_slice_len
    if ep < slice_len:
        return (
            f"--swor-episode-len {ep} is shorter than --swor-slice-len {slice_len}: no episode "
            "holds a slice; pass a longer episode or a shorter slice"
        )
    episodes = min(stored, capacity) // ep
    if episodes < slices:
        return (
            f"{fmt_count(stored)} items stored (capacity {fmt_count(capacity)}) hold "
            f"{episodes} episodes of {ep} steps, fewer than --swor-num-slices {slices}: a batch "
            f"cannot take {slices} distinct episodes; store at least {fmt_count(slices * ep)} "
            "items, or pass a smaller --swor-num-slices or --swor-episode-len"
        )
    return None


def check_slice_without_replacement(args: argparse.Namespace) -> list[str]:
    """Values that do not fit together.

    A size refused by :func:`swor_refusal` is skipped at run time, with the reason; a run where
    every size is refused would measure nothing, so that is a usage error.
    """
    problems = check_sizes("swor", args.swor_stored, args.swor_capacity, args.swor_slice_len)
    if problems:
        return problems
    sizes, capacity = sizes_and_capacity(args.swor_stored, args.swor_capacity)
    refusals = [swor_refusal(args, stored, capacity) for stored in sizes]
    if all(refusals):
        return [refusals[-1]]  # the largest size's reason, when they differ
    return []


# --------------------------------------------------------------------------------- staleness


def add_staleness(group: argparse._ArgumentGroup) -> None:
    group.add_argument(
        "--stale-stored",
        type=counts_text,
        default="1M,10M",
        help="items stored, comma-separated (e.g. 1M,10M,20M)",
    )
    group.add_argument("--stale-batch", type=positive_int, default=256, help="samples per call")
    group.add_argument(
        "--stale-versions", type=positive_int, default=100, help="distinct versions stored"
    )


# ----------------------------------------------------------------------------------- startup


def add_startup(group: argparse._ArgumentGroup) -> None:
    group.add_argument(
        "--startup-cases",
        type=choice_list("warm", "cold"),
        default="warm,cold",
        help="which start-up cases to run, comma-separated",
    )
    group.add_argument(
        "--startup-runs",
        type=positive_int,
        default=2,
        help="fresh processes per side for the warm case; the last one is reported",
    )


# -------------------------------------------------------------------------------- whole_step


def add_whole_step(group: argparse._ArgumentGroup) -> None:
    group.add_argument(
        "--step-cases",
        type=choice_list("per", "slice"),
        default="per,slice",
        help="which whole-step cases to run, comma-separated",
    )
    group.add_argument(
        "--step-per-capacity",
        type=counts_text,
        default="1M,10M",
        help="buffer capacities (all filled) for the PER step, comma-separated",
    )
    group.add_argument(
        "--step-slice-capacity",
        type=count_text,
        default="8M",
        help="storage capacity for the slice step",
    )
    group.add_argument(
        "--step-slice-stored",
        type=count_text,
        default="6M",
        help="rows written before the slice step is timed",
    )
    group.add_argument(
        "--step-slice-episode",
        type=positive_int,
        default=1000,
        help="episode length of the slice step's data",
    )

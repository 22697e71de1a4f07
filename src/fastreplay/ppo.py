"""Old-policy log-probabilities for PPO in bounded memory (tianshou #1164, fixed in #1168).

PPO's ratio ``pi_theta(a|s) / pi_old(a|s)`` needs the old policy's log-probability of every stored
action. Recomputing it with one ``actor.log_prob(data)`` call materialises the actor's hidden
activations and distribution parameters for the whole batch at once, which runs out of memory on
large batches. :func:`chunked_log_prob` computes the same numbers chunk by chunk under
``torch.no_grad()`` and writes them into a pre-allocated output, so the extra memory is bounded by
the chunk size instead of the batch size.

This module only depends on ``tensordict``: a TorchRL loss module is accepted by duck typing (any
object with ``tensor_keys.sample_log_prob``).
"""

from __future__ import annotations

import operator
import re
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any, TypeAlias

import numpy as np
import torch
from tensordict import NestedKey, TensorDict, TensorDictBase, is_tensor_collection
from tensordict.nn import ProbabilisticTensorDictModule, ProbabilisticTensorDictSequential

__all__ = ["chunked_log_prob", "default_budget", "default_max_memory"]

# Declared as an alias: type checkers then resolve ``actor``'s type in the public signature
# (an undeclared ``X | Y`` of classes they cannot see is read as a variable, not a type).
ProbabilisticActorLike: TypeAlias = (
    ProbabilisticTensorDictModule | ProbabilisticTensorDictSequential
)


def _check_chunk_size(chunk_size: Any) -> int:
    try:
        if isinstance(chunk_size, bool):
            raise TypeError
        size = operator.index(chunk_size)  # int, or a numpy / torch integer scalar
    except TypeError:
        raise TypeError(
            f"chunk_size must be an int, got {chunk_size!r} of type {type(chunk_size).__name__}; "
            "pass a positive integer such as chunk_size=8192"
        ) from None
    if size < 1:
        raise ValueError(
            f"chunk_size must be >= 1, got {size}; pass the largest number of batch elements "
            "the actor may process at once, e.g. chunk_size=8192"
        )
    return size


_UNITS = {
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_MEMORY = re.compile(r"\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([a-zA-Z]*)\s*")

#: Elements in the first chunk of a memory-budgeted call, from which the bytes per element
#: are measured (smaller when the batch is).
PROBE_ELEMENTS = 256

#: The default budget's ceiling on the host (and on accelerators whose free memory torch
#: cannot tell).
HOST_BUDGET = 2**30

#: By default a chunk holds at most this fraction (1 / ``DEFAULT_SHARE``) of what the one-shot
#: call would hold at once, as measured on the first chunk.
DEFAULT_SHARE = 10

#: The default budget's floor: below it, calls of a few thousand rows cost more in per-call
#: overhead (kernel launches, TensorDict slicing) than they save in memory.
MIN_DEFAULT_BUDGET = 64 * 2**20


def _check_max_memory(max_memory: Any) -> int:
    """Bytes from an int (or integer scalar) or a string such as ``"1GiB"`` / ``"512 MB"``."""
    if isinstance(max_memory, str):
        match = _MEMORY.fullmatch(max_memory)
        unit = match.group(2).lower() if match else ""
        if not match or unit not in _UNITS | {"": 1}:
            raise ValueError(
                f"max_memory={max_memory!r} is not a memory size; pass a number of bytes or a "
                "string made of a number and one of the units B, kB, MB, GB, TB, KiB, MiB, "
                "GiB, TiB, e.g. max_memory='1GiB'"
            )
        size = int(float(match.group(1)) * _UNITS.get(unit, 1))
    else:
        try:
            if isinstance(max_memory, bool):
                raise TypeError
            size = operator.index(max_memory)
        except TypeError:
            raise TypeError(
                f"max_memory must be a number of bytes (int) or a string such as '1GiB', got "
                f"{max_memory!r} of type {type(max_memory).__name__}; pass e.g. "
                "max_memory='1GiB' or max_memory=2**30"
            ) from None
    if size < 1:
        raise ValueError(
            f"max_memory must be at least 1 byte, got {max_memory!r}; pass the extra memory "
            "the actor may use at once, e.g. max_memory='1GiB'"
        )
    return size


def default_max_memory(device: torch.device | str | None) -> int:
    """The ceiling of the memory budget ``chunked_log_prob`` uses when given neither size.

    On a CUDA device: a quarter of its free memory (``torch.cuda.mem_get_info``). Elsewhere
    (the host, or ``device=None``): 1 GiB (:data:`HOST_BUDGET`). The budget itself is
    :func:`default_budget`: a tenth of the one-shot footprint, between
    :data:`MIN_DEFAULT_BUDGET` and this ceiling. O(1).

    Args:
        device: The device of the data.

    Example:
        >>> default_max_memory("cpu") == 2**30
        True
    """
    device = torch.device(device) if device is not None else torch.device("cpu")
    if device.type == "cuda" and torch.cuda.is_available():
        free, _ = torch.cuda.mem_get_info(device)
        return max(1, free // 4)
    return HOST_BUDGET


def default_budget(one_shot_bytes: int, device: torch.device | str | None) -> int:
    """The memory budget of a ``chunked_log_prob`` call given neither size.

    ``one_shot_bytes // DEFAULT_SHARE`` (a tenth of what the one-shot call would hold at once),
    raised to :data:`MIN_DEFAULT_BUDGET` (64 MiB: smaller calls are overhead-bound) and capped
    at :func:`default_max_memory` (a quarter of a CUDA device's free memory, 1 GiB on the host).
    So a batch whose one-shot footprint is below 640 MiB runs in few calls at about one-shot
    speed, and a larger one in at least ten, each under a tenth of the one-shot memory. O(1).

    Args:
        one_shot_bytes: What the one-shot call would hold at once (bytes per element, measured
            on the first chunk, times the elements).
        device: The device of the data.

    Example:
        >>> default_budget(100 * 2**30, "cpu") == 2**30  # capped on the host
        True
        >>> default_budget(5 * 2**30, "cpu") == 5 * 2**30 // 10  # a tenth of the footprint
        True
        >>> default_budget(2**20, "cpu") == MIN_DEFAULT_BUDGET
        True
    """
    ceiling = default_max_memory(device)
    return min(ceiling, max(MIN_DEFAULT_BUDGET, one_shot_bytes // DEFAULT_SHARE))


def _tensor_bytes(value: Any) -> int:
    if isinstance(value, torch.Tensor) and not is_tensor_collection(value):
        return value.numel() * value.element_size()
    if is_tensor_collection(value):
        return 0  # TensorDicts carry their inputs along: their new leaves are counted below
    if isinstance(value, (tuple, list)):
        return sum(_tensor_bytes(v) for v in value)
    return 0


@contextmanager
def _counting_outputs(actor: torch.nn.Module) -> Iterator[list[int]]:
    """Sum the bytes of the tensors every submodule returns while the block runs."""
    total = [0]

    def hook(module: torch.nn.Module, args: Any, output: Any) -> None:
        total[0] += _tensor_bytes(output)

    handles = [module.register_forward_hook(hook) for module in actor.modules()]
    try:
        yield total
    finally:
        for handle in handles:
            handle.remove()


def _as_key_list(keys: NestedKey | Sequence[NestedKey]) -> list[NestedKey]:
    if isinstance(keys, (str, tuple)):
        return [keys]
    return list(keys)


def _check_actor(actor: object) -> None:
    if not isinstance(actor, (ProbabilisticTensorDictModule, ProbabilisticTensorDictSequential)):
        raise TypeError(
            f"actor must be a probabilistic actor (torchrl ProbabilisticActor or tensordict "
            f"ProbabilisticTensorDictModule / ProbabilisticTensorDictSequential), got "
            f"{type(actor).__name__}; wrap your network in ProbabilisticActor(module, "
            "in_keys=..., distribution_class=...)"
        )


def _resolve_out_keys(out_key: Any, actor: ProbabilisticActorLike) -> list[NestedKey]:
    """The keys to write, in the order of ``actor.log_prob_keys``."""
    if out_key is None:
        return list(actor.log_prob_keys)
    tensor_keys = getattr(out_key, "tensor_keys", None)
    if tensor_keys is not None:
        if not hasattr(tensor_keys, "sample_log_prob"):
            raise TypeError(
                f"out_key is a {type(out_key).__name__} whose tensor_keys has no "
                "'sample_log_prob'; pass a PPO loss module (ClipPPOLoss, KLPENPPOLoss, ...) "
                "or a key"
            )
        return _as_key_list(tensor_keys.sample_log_prob)
    if isinstance(out_key, (str, tuple, list)) and out_key:
        keys = _as_key_list(out_key)
        if all(isinstance(k, (str, tuple)) for k in keys):
            return keys
    raise TypeError(
        f"out_key must be None, a key (str or tuple of str), a list of keys or a PPO loss "
        f"module, got {out_key!r} of type {type(out_key).__name__}"
    )


def _validate(
    actor: ProbabilisticActorLike, data: Any, out_keys: list[NestedKey]
) -> list[NestedKey]:
    """Check everything that can be checked before computing; returns the action keys."""
    if not is_tensor_collection(data):
        raise TypeError(f"data must be a TensorDict, got {type(data).__name__}")
    lp_keys = list(actor.log_prob_keys)
    if len(out_keys) != len(lp_keys):
        raise ValueError(
            f"out_key names {len(out_keys)} key(s) {out_keys}, but the actor produces "
            f"{len(lp_keys)} log-prob(s) {lp_keys}; pass one key per log-prob, in that order"
        )
    action_keys = list(actor.dist_sample_keys)
    present = set(data.keys(include_nested=True))
    missing = [k for k in action_keys if k not in present]
    if missing:
        raise KeyError(
            f"data has no stored action under {missing} (the actor's dist_sample_keys are "
            f"{action_keys}; data has keys {sorted(map(str, present))}); store the actions the "
            "policy took before computing their log-probabilities"
        )
    return action_keys


@contextmanager
def _frozen_actor(actor: torch.nn.Module) -> Iterator[None]:
    """Eval mode and no grad; per-module train flags restored on exit.

    The random number generators are left alone: restoring a saved global RNG state would undo
    the draws other threads (a prefetching replay buffer, a collector) made in the meantime.
    """
    modes = [(m, m.training) for m in actor.modules()]
    try:
        actor.eval()
        with torch.no_grad():
            yield
    finally:
        for module, training in modes:
            module.training = training


def _check_sequential(sequential: object) -> bool | None:
    if sequential is None or isinstance(sequential, (bool, np.bool_)):
        return None if sequential is None else bool(sequential)
    raise TypeError(
        f"sequential must be None, True or False, got {sequential!r} of type "
        f"{type(sequential).__name__}; pass sequential=None to detect recurrent modules"
    )


def _in_recurrent_mode(actor: torch.nn.Module) -> bool:
    """Whether a submodule runs along time.

    True for TorchRL ``LSTMModule``/``GRUModule`` in recurrent mode, or anything else exposing a
    true ``recurrent_mode``. Read at call time, so ``torchrl.modules.set_recurrent_mode`` counts.
    O(number of submodules).
    """
    return any(bool(getattr(module, "recurrent_mode", False)) for module in actor.modules())


def _rows_per_chunk(
    batch_size: torch.Size, chunk_size: int, sequential: bool, why: str
) -> tuple[int, int]:
    """``(elements per row, rows per chunk)``: the unit that is never split, and how many fit.

    Independent elements: a row is one element. Sequential: a row is one sequence along the
    last batch dim (time), which a chunk never cuts.
    """
    if not sequential:
        return 1, chunk_size
    steps = batch_size[-1]
    if len(batch_size) == 1:
        raise ValueError(
            f"data has batch_size {list(batch_size)}: one sequence of {steps} steps, which "
            f"{why} must see whole, is longer than chunk_size={chunk_size}; reshape data to "
            "[num_sequences, time] (e.g. data.reshape(num_envs, -1)) so that chunks can hold "
            "whole sequences, or pass chunk_size >= "
            f"{steps}"
        )
    if steps > chunk_size:
        raise ValueError(
            f"chunk_size={chunk_size} is smaller than the time dim of data (batch_size "
            f"{list(batch_size)}, {steps} steps per sequence); {why} must see each sequence "
            f"whole, so chunks hold whole sequences: pass chunk_size >= {steps} (a multiple of "
            f"{steps} uses it fully)"
        )
    return steps, chunk_size // steps


def _chunk_log_probs(
    actor: ProbabilisticActorLike, chunk: TensorDictBase, lp_keys: list[NestedKey]
) -> list[torch.Tensor]:
    """One ``actor.log_prob`` call; one tensor per log-prob key, batch dim first."""
    lp: Any = actor.log_prob(chunk)  # a tensor, or a TensorDict of them
    if not is_tensor_collection(lp):
        return [lp]
    found = set(lp.keys(include_nested=True, leaves_only=True))
    missing = [k for k in lp_keys if k not in found]
    if missing:
        raise RuntimeError(
            f"actor.log_prob returned a TensorDict without the log-prob key(s) {missing} listed "
            f"in actor.log_prob_keys (got {sorted(map(str, found))})"
        )
    return [lp.get(k) for k in lp_keys]


def _check_sizes(chunk_size: Any, max_memory: Any) -> tuple[int | None, int | None]:
    """``(chunk_size, budget in bytes)``: one of them, or neither (the default budget)."""
    if chunk_size is not None and max_memory is not None:
        raise ValueError(
            f"chunk_size={chunk_size!r} and max_memory={max_memory!r} were both given; pass "
            "one of them: chunk_size fixes the number of elements per call, max_memory chooses "
            "it from a memory budget"
        )
    if chunk_size is not None:
        return _check_chunk_size(chunk_size), None
    if max_memory is not None:
        return None, _check_max_memory(max_memory)
    return None, None


def _chunked(
    actor: ProbabilisticActorLike,
    flat: TensorDictBase,
    lp_keys: list[NestedKey],
    rows: int,
    budget: int | None,
    default: bool = False,
) -> list[torch.Tensor]:
    """The log-probs of ``flat``'s rows, ``rows`` at a time, into pre-allocated outputs.

    With ``budget``, the first chunk measures the bytes per row (:func:`_counting_outputs`)
    and sets ``rows`` for the others; with ``default``, the budget is then
    :func:`default_budget` of the whole batch's footprint. O(rows of ``flat``).
    """
    outputs: list[torch.Tensor] = []
    n_rows = flat.batch_size[0]
    start = 0
    while start < n_rows:
        stop = min(start + rows, n_rows)
        if budget is not None and not outputs:
            with _counting_outputs(actor) as produced:
                results = _chunk_log_probs(actor, flat[start:stop], lp_keys)
            used = produced[0] + sum(map(_tensor_bytes, results))
            if default:
                budget = default_budget(used * n_rows // (stop - start), results[0].device)
            rows = max(1, budget * (stop - start) // used) if used else n_rows
        else:
            results = _chunk_log_probs(actor, flat[start:stop], lp_keys)
        if not outputs:
            outputs = [r.new_empty((n_rows, *r.shape[1:])) for r in results]
        for out, r in zip(outputs, results, strict=True):
            out[start:stop] = r
        start = stop
    return outputs


def chunked_log_prob(
    actor: ProbabilisticActorLike,
    data: TensorDictBase,
    *,
    chunk_size: int | None = None,
    out_key: NestedKey | Sequence[NestedKey] | Any | None = None,
    sequential: bool | None = None,
    max_memory: int | str | None = None,
) -> torch.Tensor | TensorDictBase:
    """Log-probability of the stored actions under the actor's current parameters, in chunks.

    The drop-in replacement for ``with torch.no_grad(): data[key] = actor.log_prob(data)``
    before a PPO update. ``data`` (any batch shape) is flattened and fed to ``actor.log_prob`` in
    chunks of at most ``chunk_size`` elements; each chunk's result is copied into a pre-allocated
    output, which is reshaped to ``data.batch_size`` and written into ``data``.

    Recurrent actors are never cut inside a sequence. When a submodule runs along time (TorchRL
    ``LSTMModule``/``GRUModule`` in recurrent mode, by ``default_recurrent_mode`` or
    ``set_recurrent_mode``), or with ``sequential=True``, the last batch dim of ``data`` is time
    and is kept whole: ``data`` is viewed as ``[num_sequences, time]`` and each chunk holds
    ``chunk_size // time`` whole sequences. A sequence longer than ``chunk_size`` is refused
    (``ValueError``), never split. Empty and 0-dim batches, and sequential batches that fit in one
    chunk, are one call on ``data`` as it is: the one-shot computation itself.

    The computation runs under ``torch.no_grad()`` with the actor in eval mode (so dropout and
    batch-norm do not depend on how the batch is split); each module's train/eval flag is
    restored afterwards. Random number generators are never saved or restored: an actor that
    draws (few do: ``log_prob`` evaluates a density) draws from them as the one-shot call would,
    and draws made by other threads meanwhile are kept. The result equals the one-shot
    ``actor.eval(); actor.log_prob(data)`` under ``no_grad`` up to round-off: matrix and
    elementwise kernels may round differently with the batch size (1-2 ulp in float64 for a
    ``Linear``/``softplus`` actor on our CPU; categorical and composite actors came out
    bit-identical). Each chunk equals the actor's own output on that chunk bit for bit.

    The chunk size is given (``chunk_size``) or chosen from a memory budget (``max_memory``,
    the default): the first chunk, of :data:`PROBE_ELEMENTS` elements (whole sequences for a
    sequential actor), is computed while forward hooks add up the bytes of every tensor each
    submodule returns, plus the log-probs themselves; that sum, an upper bound of what the
    chunk held at once under ``no_grad`` (distribution temporaries aside), divided by the
    chunk's rows, gives the bytes per row, and the remaining chunks hold
    ``max_memory // bytes_per_row`` rows (at least one row, one whole sequence). With neither
    argument the budget is :func:`default_budget`: a tenth of the one-shot footprint measured
    that way, at least 64 MiB, at most a quarter of the free memory of a CUDA ``data.device``
    (1 GiB on the host).

    Complexity: O(batch) time, like the one-shot call; peak extra memory O(chunk_size) (about
    ``max_memory``) for the actor's activations and distribution parameters, plus the O(batch)
    output itself.

    Args:
        actor: A probabilistic actor: TorchRL ``ProbabilisticActor`` or tensordict
            ``ProbabilisticTensorDictModule`` / ``ProbabilisticTensorDictSequential``, including
            ``CompositeDistribution`` actors with several action heads.
        data: TensorDict holding the actor's inputs and the stored actions under the actor's
            ``dist_sample_keys``. Only the log-prob entries are written; nothing else changes.
        chunk_size: Largest number of (flattened) batch elements passed to the actor at once.
            ``None`` (default): chosen from ``max_memory``.
        out_key: Where to write. ``None`` (default): the actor's ``log_prob_keys``, which is what
            ``ClipPPOLoss`` / ``KLPENPPOLoss`` built on this actor read. A PPO loss module: its
            ``tensor_keys.sample_log_prob``. Or a key / list of keys, one per log-prob key of the
            actor, in the order of ``actor.log_prob_keys``.
        sequential: Whether the actor mixes information along the last batch dim of ``data``
            (time), so that sequences must be passed whole. ``None`` (default): detected, true
            when a submodule has a true ``recurrent_mode`` at call time. Pass ``True`` for other
            sequence models (temporal convolutions, attention over time), ``False`` to treat
            every batch element as independent.
        max_memory: Memory budget for one chunk's activations and results, in bytes or as a
            string (``"1GiB"``, ``"512MB"``: units B, kB, MB, GB, TB, KiB, MiB, GiB, TiB).
            ``None`` (default, without ``chunk_size``): :func:`default_budget`. Not with
            ``chunk_size``.

    Returns:
        The log-probabilities (a tensor with leading dims ``data.batch_size``) for a single
        log-prob key; a TensorDict keyed by the output keys for a composite actor with several.
        Nothing returned or written requires grad.

    Raises:
        TypeError: ``chunk_size`` is not an int, ``max_memory`` neither an int nor a string,
            ``actor`` is not probabilistic, ``data`` is not a TensorDict, or ``out_key`` or
            ``sequential`` has the wrong type.
        ValueError: ``chunk_size`` < 1, ``max_memory`` not a size or below 1 byte, both
            ``chunk_size`` and ``max_memory`` given, ``out_key`` names the wrong number of
            keys, or a sequence (the last batch dim, for a sequential actor) is longer than
            ``chunk_size``.
        KeyError: a stored action is missing from ``data``.
        In every case ``data`` is left unchanged.

    Example:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> from tensordict.nn import NormalParamExtractor, TensorDictModule
        >>> from torchrl.modules import ProbabilisticActor
        >>> from fastreplay import chunked_log_prob
        >>> _ = torch.manual_seed(0)
        >>> net = torch.nn.Sequential(torch.nn.Linear(3, 4), NormalParamExtractor())
        >>> actor = ProbabilisticActor(
        ...     TensorDictModule(net, ["obs"], ["loc", "scale"]),
        ...     in_keys=["loc", "scale"],
        ...     distribution_class=torch.distributions.Normal,
        ... )
        >>> obs, action = torch.randn(5, 7, 3), torch.randn(5, 7, 2)
        >>> data = TensorDict(obs=obs, action=action, batch_size=[5, 7])
        >>> lp = chunked_log_prob(actor, data, chunk_size=8)
        >>> lp.shape, lp.requires_grad, data["action_log_prob"] is lp
        (torch.Size([5, 7, 2]), False, True)
        >>> with torch.no_grad():
        ...     torch.testing.assert_close(lp, actor.log_prob(data.copy()))
    """
    chunk_size, budget = _check_sizes(chunk_size, max_memory)
    sequential = _check_sequential(sequential)
    _check_actor(actor)
    out_keys = _resolve_out_keys(out_key, actor)
    action_keys = _validate(actor, data, out_keys)
    lp_keys = list(actor.log_prob_keys)
    default = chunk_size is None and budget is None
    if default:
        budget = MIN_DEFAULT_BUDGET  # set from the first chunk (default_budget)

    batch_size = data.batch_size
    numel = batch_size.numel()
    if sequential is None:
        sequential = _in_recurrent_mode(actor)
        why = "the actor, which has a submodule in recurrent mode,"
    else:
        why = "an actor with sequential=True"
    # Shallow selection of what the actor reads: the actor's intermediate outputs go into
    # per-chunk TensorDicts, never into ``data``.
    src = data.select(*actor.in_keys, *action_keys, strict=False)
    if chunk_size is not None:
        one_call = numel == 0 or len(batch_size) == 0 or (sequential and numel <= chunk_size)
    else:  # one sequence that cannot be cut is one call, whatever the budget
        one_call = numel == 0 or len(batch_size) == 0 or (sequential and len(batch_size) == 1)
    if not one_call:
        if chunk_size is not None:
            steps, rows = _rows_per_chunk(batch_size, chunk_size, sequential, why)
        else:  # a first, small chunk measures the bytes per row; the budget gives the rest
            steps = batch_size[-1] if sequential else 1
            rows = max(1, PROBE_ELEMENTS // steps)
        # Independent elements: [numel]. Sequences: [num_sequences, time], time kept whole.
        shape = (numel // steps, steps) if sequential else (numel,)
        flat = src if src.batch_size == shape else src.reshape(*shape)

    outputs: list[torch.Tensor] = []
    with _frozen_actor(actor):
        if one_call:
            # Nothing to split (an empty or 0-dim batch, or one that fits in a chunk with
            # sequences kept whole): the one-shot call itself, on ``data``'s own shape.
            outputs = _chunk_log_probs(actor, src, lp_keys)
        else:
            outputs = _chunked(actor, flat, lp_keys, rows, budget, default)

    if one_call:
        shaped = outputs
    else:
        lead = flat.batch_dims
        shaped = [out.reshape((*batch_size, *out.shape[lead:])) for out in outputs]
    for key, value in zip(out_keys, shaped, strict=True):
        data.set(key, value)
    if len(shaped) == 1:
        return shaped[0]
    result = TensorDict(batch_size=batch_size, device=data.device)
    for key, value in zip(out_keys, shaped, strict=True):
        result.set(key, value)
    return result

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
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any, TypeAlias

import numpy as np
import torch
from tensordict import NestedKey, TensorDict, TensorDictBase, is_tensor_collection
from tensordict.nn import ProbabilisticTensorDictModule, ProbabilisticTensorDictSequential

__all__ = ["chunked_log_prob"]

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


def chunked_log_prob(
    actor: ProbabilisticActorLike,
    data: TensorDictBase,
    *,
    chunk_size: int,
    out_key: NestedKey | Sequence[NestedKey] | Any | None = None,
    sequential: bool | None = None,
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

    Complexity: O(batch) time, like the one-shot call; peak extra memory O(chunk_size) for the
    actor's activations and distribution parameters, plus the O(batch) output itself.

    Args:
        actor: A probabilistic actor: TorchRL ``ProbabilisticActor`` or tensordict
            ``ProbabilisticTensorDictModule`` / ``ProbabilisticTensorDictSequential``, including
            ``CompositeDistribution`` actors with several action heads.
        data: TensorDict holding the actor's inputs and the stored actions under the actor's
            ``dist_sample_keys``. Only the log-prob entries are written; nothing else changes.
        chunk_size: Largest number of (flattened) batch elements passed to the actor at once.
        out_key: Where to write. ``None`` (default): the actor's ``log_prob_keys``, which is what
            ``ClipPPOLoss`` / ``KLPENPPOLoss`` built on this actor read. A PPO loss module: its
            ``tensor_keys.sample_log_prob``. Or a key / list of keys, one per log-prob key of the
            actor, in the order of ``actor.log_prob_keys``.
        sequential: Whether the actor mixes information along the last batch dim of ``data``
            (time), so that sequences must be passed whole. ``None`` (default): detected, true
            when a submodule has a true ``recurrent_mode`` at call time. Pass ``True`` for other
            sequence models (temporal convolutions, attention over time), ``False`` to treat
            every batch element as independent.

    Returns:
        The log-probabilities (a tensor with leading dims ``data.batch_size``) for a single
        log-prob key; a TensorDict keyed by the output keys for a composite actor with several.
        Nothing returned or written requires grad.

    Raises:
        TypeError: ``chunk_size`` is not an int, ``actor`` is not probabilistic, ``data`` is not a
            TensorDict, or ``out_key`` or ``sequential`` has the wrong type.
        ValueError: ``chunk_size`` < 1, ``out_key`` names the wrong number of keys, or a
            sequence (the last batch dim, for a sequential actor) is longer than
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
    chunk_size = _check_chunk_size(chunk_size)
    sequential = _check_sequential(sequential)
    _check_actor(actor)
    out_keys = _resolve_out_keys(out_key, actor)
    action_keys = _validate(actor, data, out_keys)
    lp_keys = list(actor.log_prob_keys)

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
    one_call = numel == 0 or len(batch_size) == 0 or (sequential and numel <= chunk_size)
    if not one_call:
        steps, rows = _rows_per_chunk(batch_size, chunk_size, sequential, why)
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
            n_rows = flat.batch_size[0]
            for start in range(0, n_rows, rows):
                stop = min(start + rows, n_rows)
                results = _chunk_log_probs(actor, flat[start:stop], lp_keys)
                if not outputs:
                    outputs = [r.new_empty((n_rows, *r.shape[1:])) for r in results]
                for out, r in zip(outputs, results, strict=True):
                    out[start:stop] = r

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

"""chunked_log_prob against the one-shot ``actor.log_prob`` computation, and with ClipPPOLoss."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tensordict import TensorDict
from tensordict.nn import (
    CompositeDistribution,
    NormalParamExtractor,
    TensorDictModule,
    TensorDictSequential,
)
from torch import nn
from torchrl.modules import (
    GRUModule,
    IndependentNormal,
    LSTMModule,
    ProbabilisticActor,
    ValueOperator,
    set_recurrent_mode,
)
from torchrl.objectives import ClipPPOLoss, KLPENPPOLoss

import fastreplay.ppo
from fastreplay import chunked_log_prob
from fastreplay._torchrl import TORCHRL_VERSION
from fastreplay.ppo import default_max_memory

OBS, ACT = 5, 3


class BatchRecorder(nn.Module):
    """Identity layer that records the leading batch size of every call."""

    def __init__(self) -> None:
        super().__init__()
        self.sizes: list[int] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.sizes.append(x.shape[0])
        return x


def normal_actor(
    dtype=torch.float32, dropout: float = 0.0, distribution_class=torch.distributions.Normal
) -> ProbabilisticActor:
    layers = [BatchRecorder(), nn.Linear(OBS, 16), nn.Tanh()]
    if dropout:
        layers.append(nn.Dropout(dropout))
    layers += [nn.Linear(16, 2 * ACT), NormalParamExtractor()]
    net = TensorDictModule(nn.Sequential(*layers), ["obs"], ["loc", "scale"])
    actor = ProbabilisticActor(
        net,
        in_keys=["loc", "scale"],
        distribution_class=distribution_class,
        return_log_prob=True,
    )
    return actor.to(dtype)


def categorical_actor(dtype=torch.float32) -> ProbabilisticActor:
    net = TensorDictModule(nn.Sequential(nn.Linear(OBS, 4), nn.ReLU()), ["obs"], ["logits"])
    actor = ProbabilisticActor(
        net, in_keys=["logits"], distribution_class=torch.distributions.Categorical
    )
    return actor.to(dtype)


class TwoHeads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(OBS, 2 * ACT + 4)

    def forward(self, obs: torch.Tensor):
        y = self.body(obs)
        return y[..., :ACT], y[..., ACT : 2 * ACT].exp(), y[..., 2 * ACT :]


def composite_actor(dtype=torch.float32) -> ProbabilisticActor:
    net = TensorDictModule(
        TwoHeads(),
        ["obs"],
        [("params", "move", "loc"), ("params", "move", "scale"), ("params", "grip", "logits")],
    )
    actor = ProbabilisticActor(
        net,
        in_keys=["params"],
        out_keys=["move", "grip"],
        distribution_class=CompositeDistribution,
        distribution_kwargs={
            "distribution_map": {
                "move": torch.distributions.Normal,
                "grip": torch.distributions.Categorical,
            }
        },
        return_log_prob=True,
    )
    return actor.to(dtype)


def make_data(actor, batch_size, dtype=torch.float32) -> TensorDict:
    """Observations, and actions sampled from the actor (then dropped: only obs + actions)."""
    obs = torch.randn(*batch_size, OBS, dtype=dtype)
    with torch.no_grad():
        full = actor(TensorDict(obs=obs, batch_size=batch_size))
    return full.select("obs", *actor.dist_sample_keys)


def one_shot(actor, data):
    """The reference: the whole batch in one call, eval mode, no grad."""
    actor.eval()
    with torch.no_grad():
        lp = actor.log_prob(data.copy())
    if isinstance(lp, torch.Tensor):
        return lp
    return lp.select(*actor.log_prob_keys)


def assert_unchanged(data: TensorDict, before: TensorDict) -> None:
    assert set(data.keys(True, True)) == set(before.keys(True, True))
    for key in before.keys(True, True):
        assert torch.equal(data.get(key), before.get(key)), key


def assert_same64(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Float64 agreement to the last bits.

    Not ``torch.equal``: PyTorch's CPU kernels are not batch-size invariant. MKL's float64 GEMM
    rounds the last rows of a matrix differently for different row counts, and the vectorised
    softplus / sigmoid kernels compute the tail of a tensor through another code path, so the
    one-shot call itself changes by an ulp when the batch grows (see docs/chunked_log_prob.md).
    A misplaced chunk or a wrong reshape moves values by O(1), twelve orders above this bound.
    """
    assert actual.dtype == expected.dtype == torch.float64
    torch.testing.assert_close(actual, expected, rtol=1e-12, atol=1e-12)


def recorder(actor) -> BatchRecorder:
    return next(m for m in actor.modules() if isinstance(m, BatchRecorder))


# -- equality with the one-shot computation ----------------------------------------------------

CASES = [  # batch shape, chunk size
    ((1023,), 100),
    ((1023,), 1),
    ((7, 13), 10),
    ((7, 13), 91),
    ((3, 4, 5), 7),
    ((50,), 1000),
    ((64,), 64),
]


@pytest.mark.parametrize(("batch_size", "chunk_size"), CASES)
@pytest.mark.parametrize("make_actor", [normal_actor, categorical_actor])
def test_float64_matches_one_shot(make_actor, batch_size, chunk_size):
    actor = make_actor(torch.float64)
    data = make_data(actor, batch_size, torch.float64)
    expected = one_shot(actor, data)
    lp = chunked_log_prob(actor, data, chunk_size=chunk_size)
    assert lp.dtype == torch.float64
    assert lp.shape == expected.shape
    assert lp.shape[: len(batch_size)] == torch.Size(batch_size)
    assert_same64(lp, expected)
    assert data.get(actor.log_prob_keys[0]) is lp


@pytest.mark.parametrize(("batch_size", "chunk_size"), CASES)
def test_float32_close_to_one_shot(batch_size, chunk_size):
    actor = normal_actor(torch.float32)
    data = make_data(actor, batch_size)
    expected = one_shot(actor, data)
    lp = chunked_log_prob(actor, data, chunk_size=chunk_size)
    torch.testing.assert_close(lp, expected)


@settings(max_examples=20, deadline=None)
@given(
    shape=st.lists(st.integers(1, 9), min_size=1, max_size=3),
    chunk_size=st.integers(1, 40),
)
def test_any_shape_and_chunk_float64(shape, chunk_size):
    torch.manual_seed(len(shape) * 100 + chunk_size)
    actor = normal_actor(torch.float64)
    data = make_data(actor, shape, torch.float64)
    expected = one_shot(actor, data)
    rec = recorder(actor)
    rec.sizes.clear()
    lp = chunked_log_prob(actor, data, chunk_size=chunk_size)
    assert_same64(lp, expected)
    numel = int(np.prod(shape))
    assert sum(rec.sizes) == numel
    assert max(rec.sizes) <= chunk_size


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("make_actor", [normal_actor, categorical_actor])
def test_bitwise_equal_to_one_shot_per_chunk(make_actor, dtype):
    """Exact: each chunk's values are the actor's own output on that chunk, in place."""
    actor = make_actor(dtype)
    data = make_data(actor, (7, 13), dtype)
    lp = chunked_log_prob(actor, data, chunk_size=10)
    flat = data.reshape(-1)
    pieces = [one_shot(actor, flat[i : i + 10]) for i in range(0, 91, 10)]
    assert torch.equal(lp.reshape(91, *lp.shape[2:]), torch.cat(pieces))


def test_actor_sees_only_chunks_of_at_most_chunk_size():
    actor = normal_actor()
    data = make_data(actor, (1023,))
    rec = recorder(actor)
    rec.sizes.clear()
    chunked_log_prob(actor, data, chunk_size=100)
    assert rec.sizes == [100] * 10 + [23]
    rec.sizes.clear()
    chunked_log_prob(actor, data.reshape(31, 33), chunk_size=500)
    assert rec.sizes == [500, 500, 23]
    rec.sizes.clear()
    one_shot(actor, data)  # the reference does see the whole batch
    assert rec.sizes == [1023]


def test_chunk_size_numpy_int_accepted():
    actor = normal_actor(torch.float64)
    data = make_data(actor, (20,), torch.float64)
    lp = chunked_log_prob(actor, data, chunk_size=np.int64(6))
    assert_same64(lp, one_shot(actor, data))


def test_empty_batch():
    actor = normal_actor()
    data = make_data(actor, (0,))
    lp = chunked_log_prob(actor, data, chunk_size=8)
    assert lp.shape == (0, ACT)
    assert data.get("action_log_prob") is lp


@pytest.mark.parametrize("batch_size", [(0, 5), (3, 0), (0,), (), (2, 0, 3)])
@pytest.mark.parametrize("make_actor", [normal_actor, categorical_actor, composite_actor])
def test_empty_and_0dim_batches_match_one_shot(make_actor, batch_size):
    actor = make_actor(torch.float64)
    data = make_data(actor, batch_size, torch.float64)
    expected = one_shot(actor, data)
    result = chunked_log_prob(actor, data, chunk_size=4)
    if isinstance(expected, torch.Tensor):
        assert result.shape == expected.shape and result.dtype == expected.dtype
        assert_same64(result, expected)
        assert data.get(actor.log_prob_keys[0]) is result
    else:
        assert result.batch_size == torch.Size(batch_size)
        for key in actor.log_prob_keys:
            assert result[key].shape == expected[key].shape
            assert_same64(result[key], expected[key])
            assert data[key] is result[key]


# -- recurrent actors: sequences are never cut ---------------------------------------------------

HIDDEN = 8


def recurrent_actor(kind: str, recurrent_mode: bool | None = True) -> ProbabilisticActor:
    """LSTM/GRU body (TorchRL's modules), Normal head, float64."""
    cls = LSTMModule if kind == "lstm" else GRUModule
    rnn = cls(
        input_size=OBS,
        hidden_size=HIDDEN,
        in_key="obs",
        out_key="features",
        default_recurrent_mode=recurrent_mode,
    )
    head = TensorDictModule(
        nn.Sequential(BatchRecorder(), nn.Linear(HIDDEN, 2 * ACT), NormalParamExtractor()),
        ["features"],
        ["loc", "scale"],
    )
    actor = ProbabilisticActor(
        TensorDictSequential(rnn, head),
        in_keys=["loc", "scale"],
        distribution_class=torch.distributions.Normal,
    )
    return actor.to(torch.float64)


def rollout(batch_size: tuple[int, ...], *, episode_len: int = 5) -> TensorDict:
    """obs, actions and ``is_init`` (episodes of ``episode_len`` steps restart mid-row)."""
    steps = torch.arange(batch_size[-1]).expand(batch_size)
    return TensorDict(
        obs=torch.randn(*batch_size, OBS, dtype=torch.float64),
        action=torch.randn(*batch_size, ACT, dtype=torch.float64),
        is_init=(steps % episode_len == 0)[..., None],
        batch_size=batch_size,
    )


@pytest.mark.parametrize("kind", ["lstm", "gru"])
@pytest.mark.parametrize(
    ("batch_size", "chunk_size", "rows_per_call"),
    [
        ((4, 16), 16, 1),
        ((4, 16), 40, 2),
        ((4, 16), 48, 3),
        ((2, 3, 16), 33, 2),
        ((4, 16), 64, 4),
        ((40, 1), 8, 8),  # one-step sequences: still [sequences, time], never one long row
    ],
)
def test_recurrent_actor_chunks_whole_sequences(kind, batch_size, chunk_size, rows_per_call):
    actor = recurrent_actor(kind)
    data = rollout(batch_size)
    if batch_size[-1] == 1:
        data["is_init"].zero_()  # nothing marks the rows apart: only the shape does
    expected = one_shot(actor, data)
    rec = recorder(actor)
    rec.sizes.clear()
    lp = chunked_log_prob(actor, data, chunk_size=chunk_size)
    assert lp.shape == (*batch_size, ACT)
    assert_same64(lp, expected)
    # Every call held whole sequences of 16 steps, at most chunk_size elements.
    rows = int(np.prod(batch_size[:-1]))
    if rows_per_call < rows:
        assert rec.sizes[0] == rows_per_call and sum(rec.sizes) == rows


@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_cutting_sequences_would_be_wrong(kind):
    """Negative control: flattening a recurrent batch (sequential=False) changes the answer."""
    actor = recurrent_actor(kind)
    data = rollout((4, 16))
    expected = one_shot(actor, data)
    cut = chunked_log_prob(actor, data.copy(), chunk_size=8, sequential=False)
    assert (cut - expected).abs().max() > 1e-3


@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_recurrent_sequence_longer_than_chunk_is_refused(kind):
    actor = recurrent_actor(kind)
    data = rollout((4, 16))
    before = data.clone()
    with pytest.raises(ValueError, match=r"chunk_size=8 is smaller than the time dim.*16 steps"):
        chunked_log_prob(actor, data, chunk_size=8)
    assert_unchanged(data, before)
    flat = rollout((40,))
    with pytest.raises(ValueError, match=r"one sequence of 40 steps.*reshape data"):
        chunked_log_prob(actor, flat, chunk_size=8)
    # A 1-dim batch that fits in a chunk is the one-shot call.
    assert_same64(chunked_log_prob(actor, flat, chunk_size=40), one_shot(actor, flat))


def test_recurrent_empty_batches_are_the_one_shot_call():
    actor = recurrent_actor("lstm")
    data = rollout((0, 16))
    lp = chunked_log_prob(actor, data, chunk_size=8)
    assert lp.shape == (0, 16, ACT)
    assert_same64(lp, one_shot(actor, data))
    # No time steps at all: TorchRL's LSTM fails on the one-shot call, and the same way here.
    steps = TensorDict(
        obs=torch.randn(3, 0, OBS, dtype=torch.float64),
        action=torch.randn(3, 0, ACT, dtype=torch.float64),
        is_init=torch.zeros(3, 0, 1, dtype=torch.bool),
        batch_size=[3, 0],
    )
    with pytest.raises(IndexError) as one_shot_error:
        one_shot(actor, steps)
    with pytest.raises(IndexError, match=re.escape(str(one_shot_error.value))):
        chunked_log_prob(actor, steps, chunk_size=8)
    assert "action_log_prob" not in steps


def test_recurrent_mode_from_the_context_manager():
    actor = recurrent_actor("lstm", recurrent_mode=None)  # sequential (step) mode by default
    data = rollout((4, 16))
    with set_recurrent_mode(True):
        expected = one_shot(actor, data)
        lp = chunked_log_prob(actor, data.copy(), chunk_size=40)
        with pytest.raises(ValueError, match="recurrent mode"):
            chunked_log_prob(actor, data.copy(), chunk_size=8)
    assert_same64(lp, expected)


@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_step_mode_rnn_flattens_like_any_actor(kind):
    """Outside recurrent mode each element is one step from its stored state: independent."""
    actor = recurrent_actor(kind, recurrent_mode=False)
    data = rollout((4, 16))
    expected = one_shot(actor, data)
    rec = recorder(actor)
    rec.sizes.clear()
    assert_same64(chunked_log_prob(actor, data, chunk_size=7), expected)
    assert max(rec.sizes) == 7


class CumulativeOverTime(nn.Module):
    """A sequence model TorchRL knows nothing about: running mean over the time dim."""

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        steps = torch.arange(1, obs.shape[-2] + 1, dtype=obs.dtype)[:, None]
        return obs.cumsum(-2) / steps


def test_sequential_true_for_custom_sequence_models():
    net = TensorDictModule(
        nn.Sequential(CumulativeOverTime(), nn.Linear(OBS, 2 * ACT), NormalParamExtractor()),
        ["obs"],
        ["loc", "scale"],
    )
    actor = ProbabilisticActor(
        net, in_keys=["loc", "scale"], distribution_class=torch.distributions.Normal
    ).to(torch.float64)
    data = rollout((5, 12))
    expected = one_shot(actor, data)
    assert_same64(chunked_log_prob(actor, data.copy(), chunk_size=30, sequential=True), expected)
    with pytest.raises(TypeError, match=r"sequential must be None, True or False, got 'yes'"):
        chunked_log_prob(actor, data, chunk_size=30, sequential="yes")
    assert_same64(
        chunked_log_prob(actor, data.copy(), chunk_size=30, sequential=np.bool_(True)), expected
    )


# -- composite distributions --------------------------------------------------------------------


@pytest.mark.parametrize(("batch_size", "chunk_size"), [((1023,), 100), ((7, 13), 10)])
def test_composite_two_heads_float64(batch_size, chunk_size):
    actor = composite_actor(torch.float64)
    assert actor.log_prob_keys == ["move_log_prob", "grip_log_prob"]
    data = make_data(actor, batch_size, torch.float64)
    expected = one_shot(actor, data)
    result = chunked_log_prob(actor, data, chunk_size=chunk_size)
    assert result.batch_size == torch.Size(batch_size)
    assert set(result.keys()) == {"move_log_prob", "grip_log_prob"}
    assert result["move_log_prob"].shape == (*batch_size, ACT)
    assert result["grip_log_prob"].shape == batch_size
    for key in actor.log_prob_keys:
        assert_same64(result[key], expected[key])
        assert data[key] is result[key]
    # Only the log-probs were added; the distribution parameters stayed in the chunks.
    assert set(data.keys()) == {"obs", "move", "grip", "move_log_prob", "grip_log_prob"}


def test_composite_custom_out_keys_follow_log_prob_keys_order():
    actor = composite_actor()
    data = make_data(actor, (30,))
    expected = one_shot(actor, data)
    out = chunked_log_prob(actor, data, chunk_size=7, out_key=["old_move", ("old", "grip")])
    torch.testing.assert_close(data["old_move"], expected["move_log_prob"])
    torch.testing.assert_close(data["old", "grip"], expected["grip_log_prob"])
    assert set(out.keys(True, True)) == {"old_move", ("old", "grip")}


# -- state left as it was -----------------------------------------------------------------------


def test_train_mode_dropout_restored_and_rng_untouched():
    actor = normal_actor(torch.float64, dropout=0.5)
    actor.train()
    actor.module[0].module[0].eval()  # a mixed mode must survive too
    modes = [m.training for m in actor.modules()]
    data = make_data(actor, (200,), torch.float64)
    rng = torch.get_rng_state()
    lp = chunked_log_prob(actor, data, chunk_size=33)
    assert torch.equal(torch.get_rng_state(), rng)  # eval mode: nothing drew
    assert [m.training for m in actor.modules()] == modes
    # Dropout was off: chunking does not change the answer, repeating does not either.
    assert_same64(lp, one_shot(actor, data))
    actor.train()
    actor.module[0].module[0].eval()
    again = chunked_log_prob(actor, data.exclude("action_log_prob"), chunk_size=33)
    assert torch.equal(lp, again)


class HandOff(nn.Module):
    """Identity layer that, on its first call, lets another thread run to completion."""

    def __init__(self, other_thread) -> None:
        super().__init__()
        self.other_thread = other_thread

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.other_thread.is_alive() and self.other_thread.ident is None:
            self.other_thread.start()
            self.other_thread.join()
        return x


def test_global_rng_draws_of_another_thread_are_kept():
    """A thread (a prefetching buffer, a collector) draws from the global RNG while
    chunked_log_prob runs: its draws must not be undone, or it would repeat them."""
    import threading

    drawn: list[torch.Tensor] = []
    other = threading.Thread(target=lambda: drawn.append(torch.randint(0, 1000, (8,))))
    actor = normal_actor(torch.float64)
    data = make_data(actor, (40,), torch.float64)
    actor.module[0].module.insert(0, HandOff(other))
    torch.manual_seed(123)
    chunked_log_prob(actor, data, chunk_size=7)
    assert len(drawn) == 1  # the other thread ran in the middle of the computation
    after = torch.randint(0, 1000, (8,))
    torch.manual_seed(123)
    first, second = torch.randint(0, 1000, (8,)), torch.randint(0, 1000, (8,))
    assert torch.equal(drawn[0], first)
    # The global stream went on from where the other thread left it: no repeated draws.
    assert torch.equal(after, second)


def test_actor_in_eval_mode_stays_in_eval_mode():
    actor = normal_actor()
    actor.eval()
    chunked_log_prob(actor, make_data(actor, (10,)), chunk_size=3)
    assert not any(m.training for m in actor.modules())


def test_nothing_written_requires_grad():
    actor = normal_actor()
    assert all(p.requires_grad for p in actor.parameters())
    data = make_data(actor, (40,))
    assert actor.log_prob(data.copy()).requires_grad  # what the naive call would store
    lp = chunked_log_prob(actor, data, chunk_size=16)
    assert not lp.requires_grad
    assert not any(v.requires_grad for v in data.values(True, True))
    assert torch.is_grad_enabled()


def test_only_the_log_prob_key_is_added():
    actor = normal_actor()
    data = make_data(actor, (7, 13))
    data["extra"] = torch.arange(91).reshape(7, 13)
    before = data.clone()
    chunked_log_prob(actor, data, chunk_size=10)
    assert_unchanged(data.exclude("action_log_prob"), before)


def test_existing_log_prob_is_overwritten_not_reused():
    actor = normal_actor(torch.float64)
    data = make_data(actor, (25,), torch.float64)
    data["action_log_prob"] = torch.full((25, ACT), 123.0, dtype=torch.float64)
    lp = chunked_log_prob(actor, data, chunk_size=4)
    assert_same64(lp, one_shot(actor, data.exclude("action_log_prob")))


# -- out_key and loss modules -------------------------------------------------------------------


def value_net() -> ValueOperator:
    return ValueOperator(nn.Linear(OBS, 1), in_keys=["obs"])


@pytest.mark.parametrize("loss_cls", [ClipPPOLoss, KLPENPPOLoss])
def test_loss_module_gives_the_key(loss_cls):
    actor = normal_actor()
    loss = loss_cls(actor, value_net())
    loss.set_keys(sample_log_prob="old_log_prob")
    data = make_data(actor, (12,))
    lp = chunked_log_prob(actor, data, chunk_size=5, out_key=loss)
    assert data["old_log_prob"] is lp
    assert data.get("action_log_prob", None) is None


def test_default_key_is_the_one_clip_ppo_reads():
    for actor in (normal_actor(), composite_actor()):
        loss = ClipPPOLoss(actor, value_net())
        keys = loss.tensor_keys.sample_log_prob
        keys = [keys] if isinstance(keys, str) else list(keys)
        data = make_data(actor, (9,))
        chunked_log_prob(actor, data, chunk_size=4)
        assert all(k in data.keys(True) for k in keys), (keys, list(data.keys()))


def ppo_batch(actor, batch_size=(8, 16)) -> TensorDict:
    data = make_data(actor, batch_size)
    data["advantage"] = torch.randn(*batch_size, 1)
    data["value_target"] = torch.randn(*batch_size, 1)
    return data


def independent_normal_actor() -> ProbabilisticActor:
    """:func:`normal_actor` with one log-prob per step (summed over the action's dimensions)."""
    return normal_actor(distribution_class=IndependentNormal)


def ppo_actor(kind: str) -> ProbabilisticActor:
    """The actor of a ``ClipPPOLoss`` test; skips a set-up the installed TorchRL rejects.

    TorchRL 0.13's ``ClipPPOLoss`` rejects a per-dimension log-prob (``Normal``: one per
    action dimension) even when it comes from the one-shot ``actor.log_prob`` call; 0.14 on
    take it.
    """
    actor = normal_actor() if kind == "normal" else independent_normal_actor()
    data = ppo_batch(actor)
    with torch.no_grad():
        data["action_log_prob"] = actor.log_prob(data.copy())
    try:
        ClipPPOLoss(actor, value_net(), entropy_coeff=0.0)(data)
    except RuntimeError as err:
        if kind == "normal" and "must match the size" in str(err):
            pytest.skip(
                f"TorchRL {TORCHRL_VERSION}'s ClipPPOLoss rejects a per-dimension log-prob "
                f"even from the one-shot actor.log_prob call: {err}"
            )
        raise
    return actor


PPO_ACTORS = pytest.mark.parametrize("kind", ["normal", "independent_normal"])


@PPO_ACTORS
def test_clip_ppo_loss_trains_on_the_result(kind):
    actor = ppo_actor(kind)
    loss = ClipPPOLoss(actor, value_net(), entropy_coeff=0.0)
    data = ppo_batch(actor)
    with pytest.raises(KeyError, match="log-prob"):
        loss(data)  # without the old log-prob, ClipPPOLoss refuses
    chunked_log_prob(actor, data, chunk_size=10, out_key=loss)
    actor.train()
    out = loss(data)
    # Same parameters as the old policy: ratio 1, KL 0, nothing clipped.
    torch.testing.assert_close(out["kl_approx"], torch.tensor(0.0), atol=1e-6, rtol=0)
    assert out["clip_fraction"] == 0
    total = out["loss_objective"] + out["loss_critic"]
    total.backward()
    assert all(p.grad is not None for p in actor.parameters())


def test_clip_ppo_loss_on_composite_actor():
    actor = composite_actor()
    loss = ClipPPOLoss(actor, value_net(), entropy_coeff=0.0)
    data = ppo_batch(actor, (33,))
    chunked_log_prob(actor, data, chunk_size=8)
    out = loss(data)
    torch.testing.assert_close(out["kl_approx"], torch.tensor(0.0), atol=1e-6, rtol=0)
    out["loss_objective"].backward()


@PPO_ACTORS
def test_clip_ppo_loss_rejects_what_the_naive_call_stores(kind):
    """The check we must pass: ClipPPOLoss raises on a stored log-prob that requires grad."""
    actor = ppo_actor(kind)
    loss = ClipPPOLoss(actor, value_net())
    data = ppo_batch(actor)
    data["action_log_prob"] = actor.log_prob(data.copy())
    with pytest.raises(RuntimeError, match="requires grad"):
        loss(data)
    chunked_log_prob(actor, data, chunk_size=10)
    loss(data)


# -- bad input ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("chunk_size", "error", "match"),
    [
        (0, ValueError, r"chunk_size must be >= 1, got 0"),
        (-5, ValueError, r"chunk_size must be >= 1, got -5"),
        (8.0, TypeError, r"chunk_size must be an int, got 8.0 of type float"),
        ("8", TypeError, r"chunk_size must be an int, got '8'"),
        (True, TypeError, r"chunk_size must be an int, got True of type bool"),
    ],
)
def test_bad_chunk_size(chunk_size, error, match):
    actor = normal_actor()
    data = make_data(actor, (10,))
    before = data.clone()
    with pytest.raises(error, match=match):
        chunked_log_prob(actor, data, chunk_size=chunk_size)
    assert_unchanged(data, before)


def test_missing_action_key():
    actor = normal_actor()
    data = make_data(actor, (10,)).exclude("action")
    before = data.clone()
    with pytest.raises(KeyError, match=r"no stored action under \['action'\]"):
        chunked_log_prob(actor, data, chunk_size=4)
    assert_unchanged(data, before)


def test_missing_one_head_of_a_composite_action():
    actor = composite_actor()
    data = make_data(actor, (10,)).exclude("grip")
    before = data.clone()
    with pytest.raises(KeyError, match=r"\['grip'\]"):
        chunked_log_prob(actor, data, chunk_size=4)
    assert_unchanged(data, before)


def test_actor_not_probabilistic():
    net = TensorDictModule(nn.Linear(OBS, ACT), ["obs"], ["action"])
    data = TensorDict(obs=torch.randn(10, OBS), action=torch.randn(10, ACT), batch_size=[10])
    before = data.clone()
    with pytest.raises(TypeError, match=r"actor must be a probabilistic actor.*TensorDictModule"):
        chunked_log_prob(net, data, chunk_size=4)
    with pytest.raises(TypeError, match=r"got Linear"):
        chunked_log_prob(nn.Linear(OBS, ACT), data, chunk_size=4)
    assert_unchanged(data, before)


def test_data_not_a_tensordict():
    actor = normal_actor()
    with pytest.raises(TypeError, match=r"data must be a TensorDict, got dict"):
        chunked_log_prob(actor, {"obs": torch.randn(3, OBS)}, chunk_size=4)


@pytest.mark.parametrize(
    ("out_key", "error", "match"),
    [
        (["a", "b"], ValueError, r"out_key names 2 key\(s\).*produces 1 log-prob"),
        (3, TypeError, r"out_key must be None, a key"),
        ([], TypeError, r"out_key must be None, a key"),
    ],
)
def test_bad_out_key(out_key, error, match):
    actor = normal_actor()
    data = make_data(actor, (10,))
    before = data.clone()
    with pytest.raises(error, match=match):
        chunked_log_prob(actor, data, chunk_size=4, out_key=out_key)
    assert_unchanged(data, before)


def test_actor_failure_leaves_data_unchanged():
    actor = normal_actor()
    data = TensorDict(obs=torch.randn(10, OBS + 1), action=torch.randn(10, ACT), batch_size=[10])
    before = data.clone()
    actor.train()
    rng = torch.get_rng_state()
    with pytest.raises(RuntimeError):
        chunked_log_prob(actor, data, chunk_size=4)
    assert_unchanged(data, before)
    assert actor.training
    assert torch.equal(torch.get_rng_state(), rng)


# -- chunk size chosen from a memory budget ----------------------------------------------------

# What normal_actor (float64) produces per element, in doubles: the recorder's output (5), the
# two Linear layers and the Tanh (16 + 16 + 6), NormalParamExtractor's loc and scale (3 + 3) and
# its scale mapping (3), the Sequential's returned pair (3 + 3), and the log-prob (3).
NORMAL64_BYTES = 8 * (5 + 16 + 16 + 6 + 3 + 3 + 3 + 3 + 3 + 3)


def test_budget_gives_the_chunk_size():
    actor = normal_actor(torch.float64)
    data = make_data(actor, (1000,), torch.float64)
    expected = one_shot(actor, data)
    rec = recorder(actor)
    rec.sizes.clear()
    lp = chunked_log_prob(actor, data, max_memory=100 * NORMAL64_BYTES)
    assert_same64(lp, expected)
    # The first chunk (fastreplay.ppo.PROBE_ELEMENTS) measures; then 100 rows fit the budget.
    assert rec.sizes == [256] + [100] * 7 + [44]
    rec.sizes.clear()
    chunked_log_prob(actor, data.copy(), max_memory=f"{200 * NORMAL64_BYTES / 1000}kB")
    assert rec.sizes == [256] + [200] * 3 + [144]


def test_budget_chunks_equal_fixed_chunks_bit_for_bit():
    actor = normal_actor(torch.float64)
    data = make_data(actor, (1000,), torch.float64)
    by_budget = chunked_log_prob(actor, data.copy(), max_memory=50 * NORMAL64_BYTES)
    flat = data.reshape(-1)
    pieces = [one_shot(actor, flat[:256])]
    pieces += [one_shot(actor, flat[i : i + 50]) for i in range(256, 1000, 50)]
    assert torch.equal(by_budget, torch.cat(pieces))


def test_tiny_budget_still_makes_progress():
    actor = normal_actor(torch.float64)
    data = make_data(actor, (300,), torch.float64)
    rec = recorder(actor)
    rec.sizes.clear()
    lp = chunked_log_prob(actor, data, max_memory=1)
    assert rec.sizes == [256] + [1] * 44
    assert_same64(lp, one_shot(actor, data))


def test_default_is_a_budget():
    actor = normal_actor(torch.float64)
    data = make_data(actor, (1000,), torch.float64)
    assert default_max_memory(data.device) == default_max_memory("cpu") == 2**30
    rec = recorder(actor)
    rec.sizes.clear()
    lp = chunked_log_prob(actor, data)  # 1 GiB on the host: the rest in one chunk
    assert rec.sizes == [256, 744]
    assert_same64(lp, one_shot(actor, data))
    rec.sizes.clear()
    chunked_log_prob(actor, data.copy(), chunk_size=None, max_memory=None)
    assert rec.sizes == [256, 744]


def test_default_budget_is_a_tenth_of_the_one_shot_footprint(monkeypatch):
    # The floor lowered so that a small batch shows the rule: a tenth of the footprint measured
    # on the first chunk (NORMAL64_BYTES a row, 10,256 rows), between the floor and the ceiling.
    actor = normal_actor(torch.float64)
    data = make_data(actor, (10_256,), torch.float64)
    one_shot_bytes = 10_256 * NORMAL64_BYTES
    monkeypatch.setattr(fastreplay.ppo, "MIN_DEFAULT_BUDGET", 1)
    assert fastreplay.ppo.default_budget(one_shot_bytes, "cpu") == one_shot_bytes // 10
    rec = recorder(actor)
    rec.sizes.clear()
    lp = chunked_log_prob(actor, data)
    assert rec.sizes == [256] + [1025] * 9 + [775]
    assert max(rec.sizes) * NORMAL64_BYTES <= one_shot_bytes / 10
    assert_same64(lp, one_shot(actor, data))
    # The floor: never below it, whatever the footprint.
    monkeypatch.setattr(fastreplay.ppo, "MIN_DEFAULT_BUDGET", 2000 * NORMAL64_BYTES)
    rec.sizes.clear()
    chunked_log_prob(actor, data.copy())
    assert rec.sizes == [256] + [2000] * 5
    # The ceiling: default_max_memory of the device.
    monkeypatch.setattr(fastreplay.ppo, "HOST_BUDGET", 500 * NORMAL64_BYTES)
    rec.sizes.clear()
    chunked_log_prob(actor, data.copy())
    assert rec.sizes == [256] + [500] * 20
    assert fastreplay.ppo.default_budget(10**12, "cpu") == 500 * NORMAL64_BYTES


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_default_budget_on_cuda_is_a_quarter_of_free_memory():
    free, _ = torch.cuda.mem_get_info()
    budget = default_max_memory("cuda")
    assert abs(budget - free // 4) <= free // 100
    actor = normal_actor(torch.float64).to("cuda")
    data = make_data(actor.cpu(), (5000,), torch.float64).to("cuda")
    actor.to("cuda")
    expected = one_shot(actor, data)
    torch.testing.assert_close(chunked_log_prob(actor, data), expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_budget_keeps_sequences_whole(kind):
    actor = recurrent_actor(kind)
    data = rollout((40, 16))
    expected = one_shot(actor, data)
    rec = recorder(actor)
    rec.sizes.clear()
    lp = chunked_log_prob(actor, data, max_memory=1)
    assert_same64(lp, expected)
    # 256 elements: 16 sequences of 16 steps; then one whole sequence per call.
    assert rec.sizes == [16] + [1] * 24
    one = rollout((16,))  # a single sequence is one call, whatever the budget
    expected = one_shot(actor, one)
    rec.sizes.clear()
    assert_same64(chunked_log_prob(actor, one, max_memory=1), expected)
    assert rec.sizes == [16]


@pytest.mark.parametrize(
    ("text", "size"),
    [
        ("1GiB", 2**30),
        ("512 MiB", 512 * 2**20),
        ("1.5GB", 1_500_000_000),
        ("64kB", 64_000),
        ("2KiB", 2048),
        ("100", 100),
        ("7b", 7),
        (np.int64(4096), 4096),
        (10**12, 10**12),
    ],
)
def test_max_memory_sizes(text, size):
    assert fastreplay.ppo._check_max_memory(text) == size


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"max_memory": "1 GiBs"}, ValueError, r"max_memory='1 GiBs' is not a memory size.*'1GiB'"),
        ({"max_memory": "lots"}, ValueError, r"max_memory='lots' is not a memory size"),
        ({"max_memory": ""}, ValueError, r"max_memory='' is not a memory size"),
        ({"max_memory": 0}, ValueError, r"max_memory must be at least 1 byte, got 0"),
        ({"max_memory": "0.1B"}, ValueError, r"at least 1 byte, got '0.1B'"),
        ({"max_memory": -1}, ValueError, r"at least 1 byte, got -1"),
        ({"max_memory": 1.5}, TypeError, r"max_memory must be .*got 1.5 of type float"),
        ({"max_memory": True}, TypeError, r"got True of type bool"),
        (
            {"max_memory": "1GiB", "chunk_size": 8},
            ValueError,
            r"chunk_size=8 and max_memory='1GiB' were both given; pass one of them",
        ),
    ],
)
def test_bad_max_memory(kwargs, error, match):
    actor = normal_actor()
    data = make_data(actor, (10,))
    before = data.clone()
    with pytest.raises(error, match=match):
        chunked_log_prob(actor, data, **kwargs)
    assert_unchanged(data, before)

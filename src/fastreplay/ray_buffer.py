"""``fastreplay.RayReplayBuffer``: Ray replay buffers whose construction errors are raised there.

TorchRL's ``RayReplayBuffer`` (and ``ReplayBuffer(service_backend="ray")``) builds the buffer
inside a Ray actor and returns at once. When the actor's constructor raises (a sampler given a
bad argument, ``shared=True`` with a storage that cannot be shared...), Ray keeps the error in
the dead actor, and the user meets it at the first call (``sample``, ``extend``,
``write_count``), as an ``ActorDiedError`` whose text holds the traceback. With TorchRL's
buffers the half-built actor also crashes while Ray formats the error, so the original
exception is lost.

Here the actor is built from a subclass of the requested buffer class whose ``__init__`` keeps
its exception instead of raising it, and construction waits for one cheap remote call that
returns it: the error is raised in the constructing process, with the class and message the
buffer raised, and the actor is killed. Every construction then costs one actor start-up and
one round trip, which the first call would otherwise pay.

* :class:`RayReplayBuffer`: TorchRL's, checked so, for any ``replay_buffer_cls``.
* fastreplay's buffer classes give TorchRL the checked actor class from ``as_remote``, so
  ``torchrl.data.RayReplayBuffer(replay_buffer_cls=fastreplay.TensorDictReplayBuffer, ...)``
  and ``fastreplay.TensorDictReplayBuffer(..., service_backend="ray")`` behave the same.

This module imports Ray only when a buffer is built.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import inspect
import pickle
import re
import traceback
from typing import Any

from fastreplay._signature import ConstructorSignature
from fastreplay._torchrl import TorchRLRayReplayBuffer as _TorchRLRayReplayBuffer
from fastreplay._torchrl import TorchRLReplayBuffer as _TorchRLReplayBuffer
from fastreplay.errors import ReplayBufferClassError

__all__ = ["RayReplayBuffer", "ReplayBufferClassError", "checked_actor_class"]

_INSTALL = "pip install ray"


def _ray_installed() -> bool:
    return importlib.util.find_spec("ray") is not None


class _ForwardingSignature(ConstructorSignature):
    """:class:`ConstructorSignature`, ending in ``**kwargs``: they go to ``replay_buffer_cls``."""

    def __get__(self, instance: Any, owner: type) -> inspect.Signature | None:
        signature = super().__get__(instance, owner)
        if signature is None:
            return None
        params = list(signature.parameters.values())
        if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
            params.append(inspect.Parameter("kwargs", inspect.Parameter.VAR_KEYWORD))
        return signature.replace(parameters=params)


def _check_buffer_class(replay_buffer_cls: Any) -> None:
    if not (
        isinstance(replay_buffer_cls, type) and issubclass(replay_buffer_cls, _TorchRLReplayBuffer)
    ):
        shown = getattr(replay_buffer_cls, "__name__", None) or repr(replay_buffer_cls)
        raise ReplayBufferClassError(
            f"replay_buffer_cls={shown} (of type {type(replay_buffer_cls).__name__}) is not a "
            "replay-buffer class; pass the class itself, e.g. "
            "replay_buffer_cls=fastreplay.TensorDictReplayBuffer, and its arguments as keywords "
            "(storage, sampler and writer as constructors: functools.partial(...))."
        )


@functools.cache
def _guarded(cls: type) -> type:
    """A subclass of ``cls`` whose ``__init__`` keeps its exception for :func:`_fr_init_error`."""

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        self._fr_construction = None
        try:
            cls.__init__(self, *args, **kwargs)  # type: ignore[misc]  # the class's own
        except Exception as err:  # kept, sent back and raised by the constructing process
            remote = "".join(traceback.format_exception(err))
            try:
                pickle.dumps(err)
            except Exception:
                err = RuntimeError(f"{type(err).__name__}: {err}")
            self._fr_construction = (err, remote)

    def _fr_init_error(self: Any) -> tuple[BaseException, str] | None:
        """The constructor's exception and its traceback, or ``None``."""
        return self._fr_construction

    return type(cls)(
        cls.__name__,
        (cls,),
        {
            "__init__": __init__,
            "_fr_init_error": _fr_init_error,
            "__module__": cls.__module__,
            "__qualname__": cls.__qualname__,
            "__doc__": cls.__doc__,
        },
    )


class _CheckedActorClass:
    """A Ray actor class whose ``remote(...)`` returns only once the buffer is built.

    Everything else (``options``...) is the Ray actor class's.
    """

    def __init__(self, cls: type, actor_cls: Any) -> None:
        self._cls = cls
        self._actor_cls = actor_cls

    def __getattr__(self, name: str) -> Any:
        return getattr(self._actor_cls, name)

    def remote(self, *args: Any, **kwargs: Any) -> Any:
        """Start the actor, wait for its constructor, raise its error here. O(one round trip)."""
        import ray

        actor = self._actor_cls.remote(*args, **kwargs)
        name = self._cls.__name__
        try:
            outcome = ray.get(actor._fr_init_error.remote())
        except ray.exceptions.RayError as err:
            with contextlib.suppress(Exception):
                ray.kill(actor, no_restart=True)
            raise RuntimeError(
                f"the Ray actor holding {name} did not start ({_last_error_line(err)}); "
                f"{self._cls.__module__.split('.')[0]} and every class passed to the buffer must "
                "be importable on the Ray workers: install them there, or start Ray with a "
                "runtime_env that provides them (ray.init(runtime_env={'env_vars': "
                "{'PYTHONPATH': ...}}), or ray_init_config={'runtime_env': ...} when the buffer "
                "starts Ray)."
            ) from err
        if outcome is None:
            return actor
        with contextlib.suppress(Exception):
            ray.kill(actor, no_restart=True)
        error, remote = outcome
        if hasattr(error, "add_note"):  # Python 3.11+
            error.add_note(f"Raised by {name}(...) in its Ray actor:\n{remote}")
        raise error


def _last_error_line(err: BaseException) -> str:
    """The ``ImportError`` line of a Ray error's text, else its first error line or class."""
    lines = [line.strip() for line in str(err).splitlines()]
    found = [line for line in lines if re.match(r"^[\w.]+(Error|Exception): ", line)]
    imports = [line for line in found if line.startswith(("ModuleNotFoundError", "ImportError"))]
    return (imports or found or [type(err).__name__])[0]


def checked_actor_class(cls: type, remote_config: dict[str, Any] | None = None) -> Any:
    """Ray actor class for ``cls`` whose ``remote(...)`` raises the constructor's error.

    What fastreplay's buffers return from ``as_remote``, and what :class:`RayReplayBuffer`
    builds its actor from.

    Args:
        cls: A TorchRL replay-buffer class (fastreplay's or TorchRL's).
        remote_config: Keyword arguments of ``ray.remote`` (``num_cpus``...), as TorchRL's
            ``as_remote`` takes them; ``None`` for TorchRL's defaults.
    """
    guarded = _guarded(cls)
    as_remote = _TorchRLReplayBuffer.as_remote.__func__  # TorchRL's, applied to the subclass
    return _CheckedActorClass(cls, as_remote(guarded, remote_config))


class _CheckedClass:
    """Stands for ``replay_buffer_cls`` in TorchRL's ``RayReplayBuffer.__init__``."""

    def __init__(self, cls: type) -> None:
        self._cls = cls

    def as_remote(self, remote_config: dict[str, Any] | None = None) -> Any:
        return checked_actor_class(self._cls, remote_config)


class RayReplayBuffer(_TorchRLRayReplayBuffer):
    """TorchRL's ``RayReplayBuffer`` that raises the remote constructor's error at construction.

    Same arguments and behaviour as :class:`torchrl.data.RayReplayBuffer` (the buffer lives in
    a Ray actor built from ``replay_buffer_cls`` and the keyword arguments; storage, sampler and
    writer preferably as constructors, ``functools.partial``), for any ``replay_buffer_cls``,
    fastreplay's or TorchRL's. One difference: construction returns once the buffer is built in
    the actor. If building it fails (a sampler given a bad argument, ``shared=True`` with a
    storage that cannot be shared, a storage constructor that raises...), the actor is stopped
    and the error is raised here, with the class and message the buffer raised, instead of at
    the first ``sample``/``extend`` as an ``ActorDiedError``.

    Construction costs one actor start-up and one round trip (what the first call pays with
    TorchRL's class). With ``delayed_init=True`` the buffer builds its components at first use,
    as asked, so their errors come then.

    Args:
        replay_buffer_cls: The buffer class built in the actor. Defaults to TorchRL's
            ``ReplayBuffer``.
        ray_init_config: Arguments of ``ray.init()`` if Ray is not started yet.
        remote_config: Arguments of ``ray.remote`` for the actor (``num_cpus``...). Defaults to
            TorchRL's (one CPU).
        transport: ``"auto"``, ``"ray"`` or ``"distributed"``, as in TorchRL.
        transport_options: Options of the ``"distributed"`` transport.
        delayed_init: Build the buffer's components at first use.
        **kwargs: Arguments of ``replay_buffer_cls`` (``storage``, ``sampler``, ``batch_size``,
            ``alpha``...).

    Raises:
        RuntimeError: Ray is not installed (as TorchRL), or the actor did not start (its class
            is not importable on the Ray workers).
        ReplayBufferClassError: ``replay_buffer_cls`` is not a replay-buffer class (a
            ``TypeError`` and an ``AttributeError``, TorchRL's class there).
        Exception: Whatever ``replay_buffer_cls(**kwargs)`` raised in the actor, unchanged but
            for a note with the remote traceback.

    Example:
        >>> import functools
        >>> from torchrl.data import LazyTensorStorage
        >>> import fastreplay
        >>> fastreplay.RayReplayBuffer(
        ...     replay_buffer_cls=functools.partial(fastreplay.TensorDictReplayBuffer),
        ...     storage=functools.partial(LazyTensorStorage, 1_000),
        ... )
        Traceback (most recent call last):
        ...
        fastreplay.errors.ReplayBufferClassError: replay_buffer_cls=functools.partial(...) ...
    """

    __signature__ = _ForwardingSignature()  # TorchRL's metaclass hides __init__

    def __init__(
        self,
        *,
        replay_buffer_cls: type[_TorchRLReplayBuffer] = _TorchRLReplayBuffer,
        ray_init_config: dict[str, Any] | None = None,
        remote_config: dict[str, Any] | None = None,
        transport: str = "auto",
        transport_options: dict[str, Any] | None = None,
        delayed_init: bool = False,
        **kwargs: Any,
    ) -> None:
        _check_buffer_class(replay_buffer_cls)
        if not _ray_installed():
            raise RuntimeError(
                f"{type(self).__name__} keeps the buffer in a Ray actor, and Ray is not "
                f"installed; {_INSTALL}, or use fastreplay's buffers directly (writer processes "
                "share a storage with shared=True: see docs/scale_out.md)."
            )
        super().__init__(
            replay_buffer_cls=_CheckedClass(replay_buffer_cls),
            ray_init_config=ray_init_config,
            remote_config=remote_config,
            transport=transport,
            transport_options=transport_options,
            delayed_init=delayed_init,
            **kwargs,
        )
        self._service_cls = replay_buffer_cls

"""Real constructor signatures for classes built by TorchRL's metaclasses.

TorchRL builds samplers and buffers through metaclasses whose ``__call__(cls, *args, **kwargs)``
hides ``__init__`` from :func:`inspect.signature` (and so from ``help()`` and IDEs). Each public
fastreplay class sets ``__signature__ = ConstructorSignature()`` in its body: the signature is
then read from ``__init__`` itself, each time it is asked for, so a subclass or a new argument
shows up without a list to keep in sync.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable
from typing import Any

__all__ = ["ConstructorSignature", "constructor_signature"]

_P = inspect.Parameter
_VARIADIC = (_P.VAR_POSITIONAL, _P.VAR_KEYWORD)


def constructor_signature(cls: type, extra: Iterable[inspect.Parameter] = ()) -> inspect.Signature:
    """The arguments ``cls(...)`` accepts, read from the ``__init__`` chain. O(MRO length).

    ``extra`` comes first, then ``__init__``'s arguments. While the parameters gathered so far
    end in ``**kwargs``, the next ``__init__`` up the MRO (the one those keywords reach, in
    TorchRL's subclasses) adds its arguments as keyword-only ones, except names already taken.
    Keyword-only arguments of the metaclass's ``__call__`` (TorchRL's ``use_ray_service``...)
    come last.
    ``*args``/``**kwargs`` remain only where no ``__init__`` up the chain names them.

    Args:
        cls: The class.
        extra: Parameters the metaclass accepts that no ``__init__`` names.

    Example:
        >>> class Base:
        ...     def __init__(self, size: int, *, seed: int = 0) -> None: ...
        >>> class Child(Base):
        ...     def __init__(self, *, device: str = "cpu", **kwargs) -> None: ...
        >>> constructor_signature(Child)
        <Signature (*, device: 'str' = 'cpu', size: 'int', seed: 'int' = 0)>
    """
    params: dict[str, inspect.Parameter] = {}
    var_kw: inspect.Parameter | None = None
    var_pos: inspect.Parameter | None = None
    first = True
    for klass in cls.__mro__:
        init = vars(klass).get("__init__")
        if init is None:
            continue
        if klass is object:
            break
        own = list(inspect.signature(init).parameters.values())[1:]  # without ``self``
        passthrough = all(p.kind in _VARIADIC for p in own)  # (*args, **kwargs): look further
        for param in own:
            if param.kind in _VARIADIC or param.name in params:
                continue
            if not first and not passthrough:
                param = param.replace(kind=_P.KEYWORD_ONLY)  # reached through **kwargs only
            params[param.name] = param
        var_pos = next((p for p in own if p.kind is _P.VAR_POSITIONAL), None) if first else var_pos
        var_kw = next((p for p in own if p.kind is _P.VAR_KEYWORD), None)
        first = first and passthrough
        if var_kw is None:
            break
    call = type(cls).__call__
    late: list[inspect.Parameter] = []
    if call is not type.__call__:
        late = [p for p in inspect.signature(call).parameters.values() if p.kind is _P.KEYWORD_ONLY]
    ordered = [
        *(p.replace(kind=_P.KEYWORD_ONLY) for p in extra if p.name not in params),
        *params.values(),
        *(p for p in late if p.name not in params),
    ]
    ordered.sort(key=lambda p: p.kind)  # stable: keeps the order within each kind
    if var_pos is not None:
        ordered.insert(sum(p.kind < _P.VAR_POSITIONAL for p in ordered), var_pos)
    if var_kw is not None:
        ordered.append(var_kw)
    return inspect.Signature(ordered)


class ConstructorSignature:
    """``__signature__`` for a class body: :func:`constructor_signature` of the class read.

    On an instance it is ``None``, so :func:`inspect.signature` of a callable instance falls
    back to its ``__call__``.

    Args:
        extra: Parameters the metaclass accepts that no ``__init__`` names.

    Example:
        >>> import inspect
        >>> class Meta(type):
        ...     def __call__(cls, *args, **kwargs):
        ...         return super().__call__(*args, **kwargs)
        >>> class Sampler(metaclass=Meta):
        ...     __signature__ = ConstructorSignature()
        ...
        ...     def __init__(self, capacity: int, alpha: float = 0.6) -> None: ...
        >>> inspect.signature(Sampler)
        <Signature (capacity: 'int', alpha: 'float' = 0.6)>
    """

    def __init__(self, extra: Iterable[inspect.Parameter] = ()) -> None:
        self._extra = tuple(extra)

    def __get__(self, instance: Any, owner: type) -> inspect.Signature | None:
        if instance is not None:
            return None
        return constructor_signature(owner, self._extra)

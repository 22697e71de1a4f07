"""The public API: every exported class shows its real constructor arguments."""

from __future__ import annotations

import ast
import inspect
import pydoc
from pathlib import Path

import pytest
import torchrl.data as trl

import fastreplay
from fastreplay._signature import ConstructorSignature, constructor_signature

_P = inspect.Parameter
PUBLIC_CLASSES = sorted(
    name for name in fastreplay.__all__ if inspect.isclass(getattr(fastreplay, name))
)


def _named(params: object) -> set[str]:
    return {p.name for p in params if p.kind not in (_P.VAR_POSITIONAL, _P.VAR_KEYWORD)}


def test_every_public_class_is_checked() -> None:
    assert {"PrioritizedSampler", "SliceSampler", "TensorDictReplayBuffer"} <= set(PUBLIC_CLASSES)


@pytest.mark.parametrize("name", PUBLIC_CLASSES)
def test_signature_names_the_constructor_arguments(name: str) -> None:
    cls = getattr(fastreplay, name)
    params = inspect.signature(cls).parameters.values()
    kinds = {p.kind for p in params}
    if name == "RayReplayBuffer":  # its **kwargs go to replay_buffer_cls: theirs, not its own
        kinds.discard(_P.VAR_KEYWORD)
    assert _P.VAR_POSITIONAL not in kinds and _P.VAR_KEYWORD not in kinds, (
        f"inspect.signature({name}) still has *args/**kwargs: set "
        "`__signature__ = ConstructorSignature()` in the class body"
    )
    named = _named(params)
    init = _named(list(inspect.signature(cls.__init__).parameters.values())[1:])
    assert init <= named, f"{name}: __init__ accepts {sorted(init - named)}, not shown"
    upstream = getattr(trl, name, None)
    if upstream is not None:  # a drop-in: every argument TorchRL's class takes is shown
        torchrl_args = _named(list(inspect.signature(upstream.__init__).parameters.values())[1:])
        assert torchrl_args <= named, f"{name}: TorchRL's {sorted(torchrl_args - named)} missing"
    shown = pydoc.render_doc(cls)
    assert "(*args, **kwargs)" not in shown.split("\n", 3)[2], shown[:300]


def test_buffers_show_torchrl_arguments_and_their_own() -> None:
    params = inspect.signature(fastreplay.TensorDictReplayBuffer).parameters
    assert {"pin_memory", "device", "priority_key", "storage", "sampler", "prefetch"} <= set(params)
    assert params["device"].default is None and params["priority_key"].default == "td_error"
    per = inspect.signature(fastreplay.TensorDictPrioritizedReplayBuffer).parameters
    assert per["alpha"].default is _P.empty and per["eps"].default == 1e-8
    upstream = inspect.signature(trl.TensorDictPrioritizedReplayBuffer.__init__).parameters
    transport = {"transport"} & set(upstream)  # TorchRL 0.14 on
    assert {"device", "sampler_device", "priority_key", *transport} <= set(per)
    assert inspect.signature(fastreplay.PrioritizedSampler).parameters["max_capacity"].kind is (
        _P.POSITIONAL_OR_KEYWORD
    )


def test_signature_follows_init_in_subclasses() -> None:
    """Read from ``__init__`` each time: a subclass (or a new argument) shows up by itself."""

    class Mine(fastreplay.TensorDictReplayBuffer):
        def __init__(self, scale: float, *, name: str = "x", **kwargs: object) -> None:
            super().__init__(**kwargs)

    params = list(inspect.signature(Mine).parameters)
    assert params[:3] == ["scale", "name", "pin_memory"] and "storage" in params

    class Opaque(fastreplay.PrioritizedSampler):
        def __init__(self, *args: object, **kwargs: object) -> None:  # a pure pass-through
            super().__init__(*args, **kwargs)

    assert inspect.signature(Opaque) == inspect.signature(fastreplay.PrioritizedSampler)


def test_constructor_signature_keeps_unresolved_variadics() -> None:
    class Meta(type):
        def __call__(cls, *args: object, mode: str = "a", **kwargs: object) -> object:
            return super().__call__(*args, **kwargs)

    class Loose(metaclass=Meta):
        __signature__ = ConstructorSignature(
            extra=[_P("flag", _P.POSITIONAL_OR_KEYWORD, default=False)]
        )

        def __init__(self, size: int, *args: object, **kwargs: object) -> None: ...

    sig = inspect.signature(Loose)
    assert str(sig) == "(size: 'int', *args: 'object', flag=False, mode: 'str' = 'a', " + (
        "**kwargs: 'object')"
    )
    assert constructor_signature(Loose) != sig  # ``extra`` only where asked for
    assert Loose.__dict__["__signature__"].__get__(Loose(1), Loose) is None  # instances


SAMPLERS = [name for name in PUBLIC_CLASSES if "Sampler" in name]


@pytest.mark.parametrize("name", SAMPLERS)
def test_samplers_mirror_torchrl_s_class_relations(name: str) -> None:
    """Where TorchRL's ``A`` subclasses TorchRL's ``B``, fastreplay's ``A`` subclasses its ``B``.

    So ``isinstance(sampler, fastreplay.SliceSampler)`` holds for the without-replacement and
    prioritized slice samplers, as ``isinstance(..., torchrl.data.SliceSampler)`` does.
    """
    cls, upstream = getattr(fastreplay, name), getattr(trl, name)
    assert issubclass(cls, upstream)
    for other in SAMPLERS:
        if issubclass(upstream, getattr(trl, other)):
            assert issubclass(cls, getattr(fastreplay, other)), (
                f"TorchRL's {name} is a TorchRL {other}; fastreplay's {name} is not a "
                f"fastreplay.{other}"
            )


def test_slice_sampler_module_does_not_import_its_subclasses() -> None:
    """``SliceSampler(replacement=False)`` finds its class in a registry, not by an import."""
    from fastreplay.samplers import slice as slice_module

    imported = set()
    for node in ast.walk(ast.parse(Path(slice_module.__file__).read_text())):
        if isinstance(node, ast.Import):
            imported.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            imported.add(node.module)
    subclasses = {
        m
        for m in imported
        if m.startswith("fastreplay.samplers.") and not m.rsplit(".", 1)[1].startswith("_")
    }  # its private helpers (the index sync) are no sampler
    assert not subclasses, imported


# Where users import each error class from (the modules that raise them re-export them).
_ERROR_EXPORTS = {
    "fastreplay.samplers.slice": ("MissingKeyError", "SignalTypeError", "SliceSamplerError"),
    "fastreplay.samplers.prioritized": (
        "CheckpointError",
        "PriorityOverflowError",
        "PriorityShapeError",
    ),
    "fastreplay.ray_buffer": ("ReplayBufferClassError",),
}


@pytest.mark.parametrize(
    ("module", "name"), [(m, n) for m, ns in _ERROR_EXPORTS.items() for n in ns]
)
def test_error_classes_live_in_fastreplay_errors(module: str, name: str) -> None:
    import importlib
    import pickle

    from fastreplay import errors

    cls = getattr(importlib.import_module(module), name)
    assert cls is getattr(errors, name) and cls.__module__ == "fastreplay.errors"
    assert name in errors.__all__
    error = pickle.loads(pickle.dumps(cls("message")))
    assert type(error) is cls and str(error) == "message"
    # A pickle naming the class where it is re-exported loads too.
    old = pickle.dumps(cls("message"), protocol=0).replace(b"fastreplay.errors", module.encode())
    assert type(pickle.loads(old)) is cls


def test_every_error_class_is_defined_in_fastreplay_errors() -> None:
    """No class deriving from ``Exception`` is defined elsewhere, nor renamed via ``__module__``."""
    root = Path(fastreplay.__file__).parent
    elsewhere = []
    for path in sorted(root.rglob("*.py")):
        if path.name == "errors.py" and path.parent == root:
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Attribute) and t.attr == "__module__" for t in node.targets
            ):
                elsewhere.append(f"{path.relative_to(root)}:{node.lineno}: sets __module__")
            if isinstance(node, ast.ClassDef) and any(
                isinstance(base, ast.Name) and base.id.endswith(("Error", "Exception"))
                for base in node.bases
            ):
                elsewhere.append(f"{path.relative_to(root)}: {node.name}")
    assert not elsewhere, elsewhere

"""Measured design limits: reliance on TorchRL's internals, inheritance depth, import cycles.

Each figure is held to a ceiling written here that fails in both directions: a change that
makes a figure worse fails, and so does one that improves it, with a message saying to lower
the ceiling (so the ceiling always records today's figure and cannot drift back up unnoticed).
All figures come from static scans of ``src/fastreplay`` (no TorchRL source is read), except the
MRO depth, which is read from the imported classes.

- **Private names of TorchRL or tensordict.** A use is an attribute access ``x._name`` (read,
  write or delete), a string ``"_name"`` passed to ``getattr``/``hasattr``/``setattr``/
  ``delattr``, a key ``"_name"`` read from or written to an object's ``__dict__`` (directly or
  through a local name bound to it), or ``from torchrl... import _name``, where ``_name`` is an
  underscore name (not a dunder) that fastreplay never defines: not a function, class or
  variable of its own, not a parameter, not set on ``self``/``cls`` and not a key fastreplay
  writes into a ``__dict__``. A handful of private names that belong to Python or torch
  (:data:`NOT_TORCHRL`) are left out. Counted inside the compat layer (``_torchrl.py`` or a
  ``_compat/`` package), outside it, and in ``_core/`` (which must stay at 0).
- **Longest MRO** among the classes ``fastreplay`` exports (``len(cls.__mro__)``).
- **Import cycles** among fastreplay's modules, from every import statement naming one (in
  function bodies too: an import deferred into a function hides a cycle without removing it),
  except under ``if TYPE_CHECKING:``. Only the modules named count: importing ``a.b.c`` also
  runs ``a/__init__`` and ``a/b/__init__``, which are not edges here.
- **Sampler attributes read by the pure core**: attributes that a class of ``_core/`` reads on
  ``self`` without owning them (not a method or valued class attribute of it or of a ``_core``
  class related to it, not set in its ``__init__``), that a sampler class of
  ``fastreplay.samplers`` defines or sets: a mixin of ``_core`` reading its host sampler.
"""

from __future__ import annotations

import ast
import inspect
from collections.abc import Iterator
from pathlib import Path

import pytest

import fastreplay
from conftest import PACKAGE, imported_names, module_name

# --------------------------------------------------------------------------------- ceilings
PRIVATE_IN_COMPAT = 79  # in _torchrl.py (or a _compat/ package)
PRIVATE_OUTSIDE_COMPAT = 0
PRIVATE_IN_CORE = 0  # the pure core never touches TorchRL's or tensordict's internals
LONGEST_MRO = 8  # PrioritizedSliceSampler, SliceSamplerWithoutReplacement
# Each cycle: the modules of one strongly connected component of the import graph.
KNOWN_CYCLES: frozenset[frozenset[str]] = frozenset()


def _names(text: str) -> frozenset[str]:
    return frozenset(text.split())


# What the pure core's mixins read from the sampler that hosts them, per module.
SAMPLER_READS_IN_CORE: dict[str, frozenset[str]] = {}
SAMPLER_READS_IN_CORE_CEILING = 0  # module-attribute pairs in SAMPLER_READS_IN_CORE

# Private names of Python or torch, not of TorchRL or tensordict.
NOT_TORCHRL = {
    "_getframe": "sys._getframe",
    "_fields": "a namedtuple's field names (public namedtuple API)",
    "_modules": "torch.nn.Module's registry of submodules",
    "_version": "torch.Tensor's version counter (bumped by every in-place write)",
}
ACCESSORS = ("getattr", "hasattr", "setattr", "delattr")
COMPAT = ("_torchrl.py", "_compat/")


def _lower_or_raise(name: str, found: int, ceiling: int, detail: str = "") -> None:
    assert found <= ceiling, f"{name}: {found} > ceiling {ceiling}{detail}"
    assert found == ceiling, (
        f"{name} improved: {found} < ceiling {ceiling}; lower the ceiling in "
        f"tests/test_design.py to {found}"
    )


def _files() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def _private(name: object) -> bool:
    return (
        isinstance(name, str)
        and name.startswith("_")
        and not (name.startswith("__") and name.endswith("__"))
    )


def _const(node: ast.AST) -> object:
    return node.value if isinstance(node, ast.Constant) else None


def _on_self(node: ast.AST) -> bool:
    return isinstance(node, ast.Name) and node.id in ("self", "cls")


def defined_names(tree: ast.AST) -> set[str]:
    """The names a module defines: defs, classes, variables, parameters, its own attributes."""
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            out.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            out.add(node.id)
        elif isinstance(node, ast.arg):
            out.add(node.arg)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            if _on_self(node.value):
                out.add(node.attr)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            if node.func.id == "setattr" and len(node.args) >= 2 and _on_self(node.args[0]):
                out.add(str(_const(node.args[1])))
        elif (
            isinstance(node, ast.Subscript)
            and isinstance(node.ctx, ast.Store)
            and isinstance(_const(node.slice), str)
        ):  # obj.__dict__["_fr_x"] = ...
            out.add(str(_const(node.slice)))
    return out


def _dict_aliases(tree: ast.AST) -> set[str]:
    """Local names bound to an object's ``__dict__`` (``state = self.__dict__``)."""
    return {
        node.targets[0].id
        for node in ast.walk(tree)
        if isinstance(node, ast.Assign)
        and len(node.targets) == 1
        and isinstance(node.targets[0], ast.Name)
        and isinstance(node.value, ast.Attribute)
        and node.value.attr == "__dict__"
    }


def private_uses(tree: ast.AST, own: set[str]) -> Iterator[tuple[int, str]]:
    """``(line, name)`` for each use in ``tree`` of a private name not in ``own``."""
    aliases = _dict_aliases(tree)

    def is_dict(node: ast.AST) -> bool:
        return (isinstance(node, ast.Attribute) and node.attr == "__dict__") or (
            isinstance(node, ast.Name) and node.id in aliases
        )

    for node in ast.walk(tree):
        names: list[object] = []
        if isinstance(node, ast.Attribute):
            names = [node.attr]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            if node.func.id in ACCESSORS and len(node.args) >= 2:
                names = [_const(node.args[1])]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            if node.func.attr in ("get", "pop", "setdefault") and is_dict(node.func.value):
                names = [_const(node.args[0])] if node.args else []
        elif isinstance(node, ast.Subscript) and is_dict(node.value):
            names = [_const(node.slice)]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in (
            "torchrl",
            "tensordict",
        ):
            names = [alias.name for alias in node.names]
        for name in names:
            if _private(name) and name not in own and name not in NOT_TORCHRL:
                yield node.lineno, str(name)


def _scan_private() -> dict[str, list[str]]:
    trees = {path: ast.parse(path.read_text(encoding="utf-8")) for path in _files()}
    own = set().union(*(defined_names(tree) for tree in trees.values()))
    return {
        str(path.relative_to(PACKAGE)).replace("\\", "/"): [
            f"{line}:{name}" for line, name in private_uses(tree, own)
        ]
        for path, tree in trees.items()
    }


def _in_compat(relative: str) -> bool:
    return any(relative == c or relative.startswith(c) for c in COMPAT)


def _detail(uses: dict[str, list[str]]) -> str:
    return "".join(
        f"\n  {path}: {', '.join(sorted(found))}" for path, found in uses.items() if found
    )


def test_private_name_scan_finds_each_kind_of_use() -> None:
    source = (
        "import torch\n"
        "from torchrl.data.replay_buffers.samplers import _REPLACEMENT_DISPATCH\n"
        "class Mine:\n"
        "    def __init__(self):\n"
        "        self._own = 1\n"
        "    def f(self, buffer, storage):\n"
        "        state = buffer.__dict__\n"
        "        a = buffer._sampler, self._own, storage.__dict__.get('_len_value')\n"
        "        storage._cursor_value = 3\n"
        "        b = getattr(buffer, '_writer', None), hasattr(buffer, '_own')\n"
        "        state['_fr_mine'] = state.get('_transform'), state['_batch_size']\n"
        "        return state.get('_fr_mine'), sys._getframe(1), buffer.__class__\n"
    )
    tree = ast.parse(source)
    found = sorted(name for _, name in private_uses(tree, defined_names(tree)))
    assert found == [
        "_REPLACEMENT_DISPATCH",
        "_batch_size",
        "_cursor_value",
        "_len_value",
        "_sampler",
        "_transform",
        "_writer",
    ]


def test_private_names_of_torchrl_and_tensordict() -> None:
    uses = _scan_private()
    compat = {p: u for p, u in uses.items() if _in_compat(p)}
    outside = {p: u for p, u in uses.items() if not _in_compat(p)}
    core = {p: u for p, u in uses.items() if p.startswith("_core/")}
    counts = {
        "in the compat layer": sum(map(len, compat.values())),
        "outside it": sum(map(len, outside.values())),
        "in _core": sum(map(len, core.values())),
    }
    print(f"private names of TorchRL/tensordict used: {counts}")
    _lower_or_raise("private names in _core", counts["in _core"], PRIVATE_IN_CORE, _detail(core))
    _lower_or_raise(
        "private names outside the compat layer",
        counts["outside it"],
        PRIVATE_OUTSIDE_COMPAT,
        "; move them behind an accessor of the compat layer:" + _detail(outside),
    )
    _lower_or_raise(
        "private names in the compat layer",
        counts["in the compat layer"],
        PRIVATE_IN_COMPAT,
        _detail(compat),
    )


def test_longest_public_mro() -> None:
    depths = {
        name: len(obj.__mro__)
        for name in fastreplay.__all__
        if inspect.isclass(obj := getattr(fastreplay, name))
    }
    longest = max(depths.values())
    print(f"longest public MRO: {longest} ({[n for n, d in depths.items() if d == longest]})")
    _lower_or_raise("longest public MRO", longest, LONGEST_MRO, f": {depths}")


# ----------------------------------------------------------------------------- import cycles
def _imports(node: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    """The import statements under ``node``, but not those under ``if TYPE_CHECKING:``."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.Import | ast.ImportFrom):
            yield child
        elif isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
            for other in child.orelse:
                yield from _imports(ast.Module(body=[other], type_ignores=[]))
        else:
            yield from _imports(child)


def import_edges(source: str, module: str, is_package: bool) -> set[str]:
    """The fastreplay modules that ``module``'s import statements name, relative ones resolved."""
    package = module if is_package else module.rpartition(".")[0]
    out = {name for node in _imports(ast.parse(source)) for name in imported_names(node, package)}
    return {m for m in out if m.split(".")[0] == "fastreplay" and m != module}


def import_cycles(graph: dict[str, set[str]]) -> set[frozenset[str]]:
    """The strongly connected components of ``graph`` with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: set[frozenset[str]] = set()

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = set()
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.add(top)
                if top == node:
                    break
            if len(component) > 1:
                found.add(frozenset(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_import_cycle_finder() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"e"}}
    assert import_cycles(graph) == {frozenset({"a", "b", "c"})}
    source = (
        "from typing import TYPE_CHECKING\n"
        "from . import errors\n"
        "from .samplers import _index_sync\n"
        "from fastreplay._core.trees import interface as _\n"
        "if TYPE_CHECKING:\n    from fastreplay import buffers\n"
        "try:\n    import fastreplay.ppo\nexcept ImportError:\n    pass\n"
        "def f():\n    from fastreplay import warm\n"
        "if TYPE_CHECKING:\n    from fastreplay import buffers\n"
        "else:\n    import fastreplay.ray_buffer\n"
    )
    assert import_edges(source, "fastreplay._torchrl", False) == {
        "fastreplay.errors",
        "fastreplay.samplers._index_sync",
        "fastreplay._core.trees.interface",
        "fastreplay.ppo",
        "fastreplay.warm",
        "fastreplay.ray_buffer",
    }


def test_import_cycles_are_the_known_ones() -> None:
    graph = {
        module_name(p): import_edges(
            p.read_text(encoding="utf-8"), module_name(p), p.name == "__init__.py"
        )
        for p in _files()
    }
    cycles = import_cycles(graph)
    print(f"import cycles: {sorted(sorted(c) for c in cycles)}")
    new = [sorted(c) for c in cycles - KNOWN_CYCLES]
    gone = [sorted(c) for c in KNOWN_CYCLES - cycles]
    assert not new, f"new import cycles: {new}"
    assert not gone, f"import cycles gone (remove them from KNOWN_CYCLES): {gone}"


# -------------------------------------------------------- sampler attributes read by the core
_INIT = ("__init__", "__new__", "__post_init__", "__setstate__")


def _class_body(cls: ast.ClassDef) -> Iterator[ast.stmt]:
    for node in cls.body:
        if not (isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)):
            yield node


def _owned(cls: ast.ClassDef) -> set[str]:
    """Methods, valued class attributes and ``__init__``-set attributes of ``cls`` itself."""
    own = set()
    for node in _class_body(cls):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            own.add(node.name)
            if node.name in _INIT:
                own |= {
                    n.attr
                    for n in ast.walk(node)
                    if isinstance(n, ast.Attribute)
                    and isinstance(n.ctx, ast.Store)
                    and _on_self(n.value)
                }
        elif isinstance(node, ast.Assign):
            own |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            own |= {node.target.id} if isinstance(node.target, ast.Name) else set()
    return own


def _sampler_attributes() -> set[str]:
    out = set()
    for path in (PACKAGE / "samplers").rglob("*.py"):
        for cls in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(cls, ast.ClassDef):
                for n in ast.walk(cls):
                    if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef):
                        out.add(n.name)
                    elif (
                        isinstance(n, ast.Attribute)
                        and isinstance(n.ctx, ast.Store)
                        and _on_self(n.value)
                    ):
                        out.add(n.attr)
    return out


def _core_sources() -> dict[str, str]:
    return {
        module_name(path): path.read_text(encoding="utf-8")
        for path in sorted((PACKAGE / "_core").rglob("*.py"))
    }


def core_sampler_reads(sources: dict[str, str], sampler: set[str]) -> dict[str, set[str]]:
    """Per module of ``sources``: the ``sampler`` attributes its classes use on ``self`` unowned."""
    classes: dict[str, tuple[str, ast.ClassDef]] = {}
    for module, source in sources.items():
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.ClassDef):
                classes[node.name] = (module, node)
    related: dict[str, set[str]] = {name: {name} for name in classes}  # bases and subclasses
    for name, (_, cls) in classes.items():
        for base in cls.bases:
            if isinstance(base, ast.Name) and base.id in classes:
                related[name].add(base.id)
                related[base.id].add(name)
    out: dict[str, set[str]] = {}
    for name, (module, cls) in classes.items():
        owned = set().union(*(_owned(classes[r][1]) for r in related[name]))
        for node in ast.walk(cls):
            attr = None
            if isinstance(node, ast.Attribute) and _on_self(node.value):
                attr = node.attr
            elif (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id in ACCESSORS
                and len(node.args) >= 2
                and _on_self(node.args[0])
            ):
                attr = _const(node.args[1])
            if isinstance(attr, str) and attr in sampler and attr not in owned:
                out.setdefault(module, set()).add(attr)
    return out


def test_core_reads_of_sampler_attributes() -> None:
    found = core_sampler_reads(_core_sources(), _sampler_attributes())
    total = sum(map(len, found.values()))
    print(f"sampler attributes read by _core: {total} {found}")
    new = {m: sorted(a - SAMPLER_READS_IN_CORE.get(m, frozenset())) for m, a in found.items()}
    assert not any(new.values()), f"_core reads more sampler attributes: {new}"
    assert sum(map(len, SAMPLER_READS_IN_CORE.values())) == SAMPLER_READS_IN_CORE_CEILING
    gone = {m: sorted(a - found.get(m, set())) for m, a in SAMPLER_READS_IN_CORE.items()}
    assert not any(gone.values()), (
        f"_core no longer reads {gone}: drop them from SAMPLER_READS_IN_CORE and lower "
        f"SAMPLER_READS_IN_CORE_CEILING to {total}"
    )
    _lower_or_raise("sampler attributes read by _core", total, SAMPLER_READS_IN_CORE_CEILING)


@pytest.mark.parametrize("kind", ["read", "getattr", "hasattr"])
def test_core_sampler_read_scan_finds_a_mixin(kind: str) -> None:
    read = "self._alpha" if kind == "read" else f"{kind}(self, '_alpha')"
    sources = {
        "m": "class Mixin:\n"
        "    _alpha: float  # declared for the host: not owned\n"
        "    _owned_value = 1\n"
        "    def f(self):\n"
        f"        return {read}, self._owned_value, self._tree, self._beta\n",
        "n": "class Core(Mixin):\n    def __init__(self):\n        self._tree = 1\n",
        "o": "class Owner:\n    def __init__(self):\n        self._beta = 2\n",
    }
    sampler = {"_alpha", "_owned_value", "_tree", "_beta"}
    assert core_sampler_reads(sources, sampler) == {"m": {"_alpha", "_beta"}}
    assert "_alpha" in _sampler_attributes()  # PrioritizedSampler sets it

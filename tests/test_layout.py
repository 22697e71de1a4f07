"""The package layout: ``fastreplay._core`` is pure, and README's tree is the real one.

``fastreplay._core`` holds the pure cores (trajectory index, slice indices, epoch
permutations, priority trees...): they import neither TorchRL nor tensordict, directly or
through another fastreplay module. Checked twice: statically (every import statement of every
file, wherever it stands, resolved to the module it names) and dynamically (a fresh
interpreter imports every module of ``_core`` and must end with neither in ``sys.modules``).
"""

from __future__ import annotations

import ast
import importlib.util
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from conftest import PACKAGE, REPO, imported_names, module_name, module_path

FORBIDDEN = ("torchrl", "tensordict")
# fastreplay modules outside ``_core`` that the cores may import: pure themselves (checked).
PURE_OUTSIDE = ("fastreplay.errors",)
# Modules next to the cores that import tensordict but never TorchRL themselves, with the
# fastreplay modules each may import: ``rows`` reads tensordict's internals through the compat
# module, the one place that touches them.
TENSORDICT_ONLY = {
    "fastreplay.buffers.rows": {"fastreplay._torchrl"},
    "fastreplay.buffers.pinning": set(),
}
MAX_CORE_LINES = 400  # a core that grows past this is doing two things


def _imported(source: str, module: str, is_package: bool) -> list[tuple[int, str]]:
    """``(line, module)`` for every module an import in ``source`` names, relative ones resolved.

    ``from X import a`` yields ``X.a`` where that is a fastreplay module, else ``X``.
    """
    package = module if is_package else module.rpartition(".")[0]
    return [
        (node.lineno, name)
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Import | ast.ImportFrom)
        for name in imported_names(node, package)
    ]


def offending_imports(source: str, module: str, is_package: bool = False) -> list[str]:
    """The imports in ``source`` (of ``module``) that a pure core must not make."""
    bad = []
    for line, name in _imported(source, module, is_package):
        top = name.split(".")[0]
        if top in FORBIDDEN:
            bad.append(f"{module}:{line} imports {name}")
        elif top == "fastreplay" and not (
            name.startswith("fastreplay._core") or name in PURE_OUTSIDE
        ):
            bad.append(f"{module}:{line} imports {name} (outside fastreplay._core)")
    return bad


def _core_files() -> list[Path]:
    return sorted((PACKAGE / "_core").rglob("*.py"))


def test_core_package_has_the_pure_cores() -> None:
    names = {module_name(p) for p in _core_files()}
    assert {
        "fastreplay._core.trajectory_index",
        "fastreplay._core.slice_index",
        "fastreplay._core.trees.interface",
        "fastreplay._core.trees.numba_backend",
        "fastreplay._core.trees.torch_backend",
    } <= names, names


@pytest.mark.parametrize(
    "path",
    [*_core_files(), *(module_path(m) for m in PURE_OUTSIDE)],
    ids=lambda p: str(p.relative_to(PACKAGE)),
)
def test_pure_modules_import_no_torchrl_or_tensordict(path: Path) -> None:
    source = path.read_text(encoding="utf-8")
    assert not offending_imports(source, module_name(path), path.name == "__init__.py")


@pytest.mark.parametrize("path", _core_files(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_cores_stay_small(path: Path) -> None:
    lines = len(path.read_text(encoding="utf-8").splitlines())
    assert lines <= MAX_CORE_LINES, f"{path.name} has {lines} lines"


@pytest.mark.parametrize("module", TENSORDICT_ONLY)
def test_tensordict_helpers_import_no_torchrl(module: str) -> None:
    path = module_path(module)
    imported = _imported(path.read_text(encoding="utf-8"), module, False)
    assert not [name for _, name in imported if name.split(".")[0] == "torchrl"]
    allowed = TENSORDICT_ONLY[module] | {"fastreplay"}
    assert not [n for _, n in imported if n.startswith("fastreplay") and n not in allowed]


@pytest.mark.parametrize(
    "source",
    [
        "import torchrl",
        "import tensordict.nn as nn",
        "from torchrl.data import SliceSampler",
        "from tensordict import TensorDict",
        "def f():\n    from torchrl import data\n",
        "if TYPE_CHECKING:\n    from tensordict import TensorDictBase\n",
        "from fastreplay import SliceSampler",  # runs fastreplay/__init__: TorchRL
        "from fastreplay import _torchrl",
        "import fastreplay.buffers",
        "from fastreplay.samplers import slice",
        "from ... import buffers",  # fastreplay._core.trees.x -> fastreplay.buffers
        "from ...samplers.slice import SliceSampler",
        "from ... import _core, _fast_io",
    ],
)
def test_offending_imports_are_found(source: str) -> None:
    assert offending_imports(source, "fastreplay._core.trees.x"), source


@pytest.mark.parametrize(
    "source",
    [
        "import numpy as np\nimport torch",
        "from . import ops",
        "from .ops import check_mass",
        "from .. import memory",
        "from ..memory import large_zeros",
        "from fastreplay._core.trees.interface import make_trees",
        "from fastreplay.errors import SliceSamplerError",
        "from ... import errors",
        "import fastreplay._core.memory",
    ],
)
def test_pure_imports_are_accepted(source: str) -> None:
    assert not offending_imports(source, "fastreplay._core.trees.x"), source


# Imports every module of ``fastreplay._core`` (and the pure modules it may use) in a fresh
# interpreter, without running ``fastreplay/__init__.py`` (which imports the TorchRL adapters),
# then prints the forbidden packages found in ``sys.modules`` and the fastreplay modules loaded.
_IMPORT_ALL = textwrap.dedent(
    """
    import importlib, json, pkgutil, sys, types
    root, forbidden, extra = sys.argv[1], sys.argv[2].split(","), sys.argv[3:]
    package = types.ModuleType("fastreplay")
    package.__path__ = [root]
    sys.modules["fastreplay"] = package
    core = importlib.import_module("fastreplay._core")
    names = [i.name for i in pkgutil.walk_packages(core.__path__, "fastreplay._core.")]
    missing = []  # modules of an optional package that is not installed (triton)
    for name in [*names, *extra]:
        try:
            importlib.import_module(name)
        except ModuleNotFoundError as error:
            if error.name != "triton":
                raise
            missing.append(name)
    print(json.dumps({
        "imported": sorted(names),
        "missing": missing,
        "forbidden": sorted(m for m in sys.modules if m.split(".")[0] in forbidden),
        "fastreplay": sorted(m for m in sys.modules if m.startswith("fastreplay.")),
    }))
    """
)


def _import_all(root: Path, *extra: str) -> dict:
    import json

    proc = subprocess.run(
        [sys.executable, "-c", _IMPORT_ALL, str(root), ",".join(FORBIDDEN), *extra],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.splitlines()[-1])


def test_importing_every_core_module_loads_no_torchrl_or_tensordict() -> None:
    result = _import_all(PACKAGE, *PURE_OUTSIDE)
    expected = {module_name(p) for p in _core_files()} - {"fastreplay._core"}
    assert set(result["imported"]) == expected
    # Only the Triton kernels need an optional package (triton) to import, and only there.
    has_triton = importlib.util.find_spec("triton") is not None
    assert result["missing"] == ([] if has_triton else ["fastreplay._core.trees.triton_kernels"])
    assert result["forbidden"] == []
    outside = [
        m
        for m in result["fastreplay"]
        if not m.startswith("fastreplay._core") and m != "fastreplay"
    ]
    assert set(outside) <= set(PURE_OUTSIDE), outside


def test_dynamic_check_finds_a_core_module_that_imports_tensordict(tmp_path: Path) -> None:
    """The same check on a package whose core imports tensordict (at call-free import time)."""
    core = tmp_path / "fastreplay" / "_core"
    core.mkdir(parents=True)
    (core / "__init__.py").write_text("")
    (core / "helper.py").write_text("import importlib\nimportlib.import_module('tensordict')\n")
    result = _import_all(tmp_path / "fastreplay")
    assert result["imported"] == ["fastreplay._core.helper"]
    assert "tensordict" in result["forbidden"]


# ----------------------------------------------------------------------- README's layout tree
_TREE_LINE = re.compile(r"^(?P<prefix>(?:│   |    )*)(?:├── |└── )?(?P<name>\S+)")


def readme_tree(text: str) -> list[str]:
    """The paths named in the ``text`` block under README's ``## Layout``, from the repo root."""
    section = text.split("\n## Layout\n", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```text\n(.*?)```", section, flags=re.S)
    assert block, "README's Layout section has no ```text tree"
    lines = block.group(1).splitlines()
    assert lines[0] == ".", lines[0]
    parents: list[str] = []
    paths = []
    for line in lines[1:]:
        m = _TREE_LINE.match(line)
        assert m, line
        depth = len(m["prefix"]) // 4
        parents = parents[:depth]
        path = "".join(parents) + m["name"]
        paths.append(path)
        if path.endswith("/"):
            parents.append(m["name"])
    return paths


def test_readme_tree_parser() -> None:
    lines = ["x", "## Layout", "", "```text", ".", "├── a/", "│   ├── b.py  what it is"]
    lines += ["│   └── c/", "│       └── d.py", "└── e", "```", "## Next"]
    text = "\n".join(lines)
    assert readme_tree(text) == ["a/", "a/b.py", "a/c/", "a/c/d.py", "e"]


def test_readme_layout_is_the_real_tree() -> None:
    named = readme_tree((REPO / "README.md").read_text(encoding="utf-8"))
    missing = [p for p in named if not (REPO / p.rstrip("/")).exists()]
    assert not missing, f"README's Layout names paths that do not exist: {missing}"
    modules = sorted(
        str(p.relative_to(REPO))
        for p in (REPO / "src" / "fastreplay").rglob("*.py")
        if not (p.name == "__init__.py" and p.parent != REPO / "src" / "fastreplay")
    )
    unnamed = [m for m in modules if m not in named]
    assert not unnamed, f"README's Layout does not name: {unnamed} (subpackages: their folder)"
    folders = {f"{p.parent.relative_to(REPO)}/" for p in (REPO / "src").rglob("__init__.py")}
    assert not folders - set(named), folders - set(named)

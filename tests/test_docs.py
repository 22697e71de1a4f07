"""Every example we ship runs: README and docs/ code blocks, and docstring examples."""

from __future__ import annotations

import doctest
import importlib
import importlib.util
import pkgutil
import re
from pathlib import Path

import pytest

import fastreplay
from conftest import REPO
from fastreplay._torchrl import HAS_SAMPLE_UNITS, TORCHRL_VERSION
from markdown_runner import extract_blocks, run_markdown

MARKDOWN = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]

# Blocks fenced ``python no-run`` on purpose, per file: changing one is a visible decision.
EXPECTED_NOT_RUNNABLE: dict[str, int] = {
    "README.md": 1,
    "docs/migration.md": 1,
    "docs/scale_out.md": 1,  # Ray set-up; run as docs/examples/ray_apex.py by tests/test_ray.py
}


def _modules() -> list[str]:
    names = [fastreplay.__name__]
    for info in pkgutil.walk_packages(fastreplay.__path__, prefix="fastreplay."):
        names.append(info.name)
    return names


@pytest.mark.parametrize("path", MARKDOWN, ids=lambda p: str(p.relative_to(REPO)))
def test_markdown_examples_run(path: Path) -> None:
    rel = str(path.relative_to(REPO))
    if rel == "docs/sequence_units.md" and not HAS_SAMPLE_UNITS:
        pytest.skip(f"TorchRL {TORCHRL_VERSION} has no sample units")
    executed, not_runnable = run_markdown(path)
    assert not_runnable == EXPECTED_NOT_RUNNABLE.get(rel, 0), (
        f"{rel} has {not_runnable} 'python no-run' blocks; update EXPECTED_NOT_RUNNABLE "
        "if this is deliberate"
    )
    if path.name != "README.md" or executed:
        return
    pytest.fail("README.md must contain at least one runnable Python example")


# Modules that need an optional package to import, and that package.
NEEDS = {"fastreplay._core.trees.triton_kernels": "triton"}


@pytest.mark.parametrize("module", _modules())
def test_docstring_examples_run(module: str) -> None:
    package = NEEDS.get(module)
    if package is not None and importlib.util.find_spec(package) is None:
        pytest.skip(f"{module} needs {package}, which is not installed here")
    mod = importlib.import_module(module)
    result = doctest.testmod(mod, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0, f"{result.failed} docstring example(s) failed in {module}"


def test_public_api_has_docstring_examples() -> None:
    """Each public name exported by fastreplay documents itself with an example."""
    missing = [
        name
        for name in fastreplay.__all__
        if not name.startswith("__") and ">>>" not in (getattr(fastreplay, name).__doc__ or "")
    ]
    assert not missing, f"public names without a docstring example: {missing}"


def test_broken_readme_example_fails(tmp_path: Path) -> None:
    """A README example using an unimported name (TorchRL's ``gc.collect()``) fails."""
    broken = tmp_path / "README.md"
    text = (REPO / "README.md").read_text(encoding="utf-8")
    broken.write_text(text + "\n```python\ngc.collect()\n```\n", encoding="utf-8")
    with pytest.raises(NameError, match="'gc' is not defined"):
        run_markdown(broken)


def test_ambiguous_python_fence_is_rejected(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("```py\nraise SystemExit\n```\n", encoding="utf-8")
    with pytest.raises(ValueError, match="ambiguous"):
        extract_blocks(page)


def test_no_run_blocks_are_counted_not_executed(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        "```python\nx = 1\n```\n\n```python no-run\nraise SystemExit\n```\n", encoding="utf-8"
    )
    assert run_markdown(page) == (1, 1)


def _readme_setup_commands() -> list[str]:
    text = (REPO / "README.md").read_text(encoding="utf-8")
    first_blocks = re.findall(r"```(?:bash|sh|shell)\n(.*?)```", text, flags=re.S)[:2]
    return [b.strip() for b in first_blocks]


def test_readme_opens_with_two_setup_commands() -> None:
    text = (REPO / "README.md").read_text(encoding="utf-8")
    commands = _readme_setup_commands()
    assert len(commands) == 2 and all("\n" not in c for c in commands), commands
    # Nothing but the title and one-line intro may precede them.
    head = text.split("```", 1)[0]
    assert head.count("\n## ") == 0, "the set-up commands must come before any section"
    assert "benchmarks" in commands[0] and "pytest" in commands[1], commands


def test_ci_runs_the_readme_test_command() -> None:
    """Each step of the README's test command, verbatim and in order (pass 1 runs its lint and
    type checks between the install and pytest)."""
    steps = [step.strip() for step in _readme_setup_commands()[1].split(" && ")]
    ci_steps = [
        step.strip()
        for line in (REPO / ".ci" / "run").read_text().splitlines()
        if not line.lstrip().startswith("#")
        for step in line.split(" && ")
    ]
    positions = [ci_steps.index(step) if step in ci_steps else -1 for step in steps]
    assert -1 not in positions and positions == sorted(positions), (
        f".ci/run must run the README's test command's steps in order: {steps}"
    )

"""The CI passes really run on the torch builds they claim, and the package metadata is current.

Lint and format are checked once, by ``.ci/run`` pass 1 (``ruff check .``, ``ruff format
--check .``), not from pytest.
"""

from __future__ import annotations

import os
import re

import pytest
import torch

from conftest import REPO, TORCHRL_EXT


def test_torchrl_extension_matches_ci_expectation() -> None:
    expected = os.environ.get("FASTREPLAY_EXPECT_TORCHRL_EXT")
    if expected is None:
        pytest.skip("FASTREPLAY_EXPECT_TORCHRL_EXT not set (only .ci/run sets it)")
    assert (expected == "1") == TORCHRL_EXT, (
        f"torch {torch.__version__}: TorchRL compiled extension loaded={TORCHRL_EXT}, "
        f"but .ci/run expected {expected!r}"
    )


# ``torchrl._torchrl`` or ``from torchrl import _torchrl`` (fastreplay's own compat module is
# ``fastreplay._torchrl``: a different name).
_EXTENSION = re.compile(r"torchrl\._torchrl\b|from\s+torchrl\s+import\s+(\(\s*)?_torchrl\b")


def test_extension_pattern_finds_the_extension_only() -> None:
    assert _EXTENSION.search("import torchrl._torchrl as ext")
    assert _EXTENSION.search("from torchrl import _torchrl")
    assert not _EXTENSION.search("from fastreplay._torchrl import Storage")


def test_fastreplay_source_never_names_torchrl_extension() -> None:
    """fastreplay must work where ``torchrl._torchrl`` does not load (CI pass 2 runs there)."""
    offenders = [
        str(p.relative_to(REPO))
        for p in (REPO / "src" / "fastreplay").rglob("*.py")
        if _EXTENSION.search(p.read_text(encoding="utf-8"))
    ]
    assert not offenders, offenders


def test_package_metadata_uses_the_spdx_license_form() -> None:
    """``project.license`` as a table and license classifiers are deprecated by setuptools."""
    import tomllib

    project = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))
    assert project["project"]["license"] == "MIT"
    assert project["project"]["license-files"] == ["LICENSE"]
    assert not [c for c in project["project"]["classifiers"] if c.startswith("License ::")]
    requires = project["build-system"]["requires"]
    assert "setuptools>=77" in requires, requires  # the first setuptools reading SPDX licenses


def test_install_hints_name_commands_that_work() -> None:
    """fastreplay is not on a package index: a hint must name what pip can install."""
    hint = re.compile(r"'fastreplay\[(?!.* @ git\+)")  # an extra of a package not on an index
    offenders = [
        f"{p.relative_to(REPO)}:{n}"
        for root in ("src", "benchmarks", "docs", "tests")
        for p in sorted((REPO / root).rglob("*"))
        if p.suffix in {".py", ".md"}
        for n, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1)
        if hint.search(line)
    ]
    assert not offenders, offenders

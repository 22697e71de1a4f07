"""The CI passes really run on the torch builds they claim, and the code is lint-clean."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import TORCHRL_EXT

REPO = Path(__file__).resolve().parents[1]


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


def _ruff() -> list[str]:
    exe = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which("ruff")
    if exe is None:
        pytest.skip("ruff is not installed (pip install -e '.[test]')")
    return [exe]


def test_ruff_lint_clean() -> None:
    proc = subprocess.run([*_ruff(), "check", "."], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_ruff_format_clean() -> None:
    proc = subprocess.run(
        [*_ruff(), "format", "--check", "."], cwd=REPO, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr

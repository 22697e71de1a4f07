"""Type checkers accept fastreplay's public API as users call it (``tests/typed_usage.py``).

mypy checks the usage file as it checks a user's script against an installed fastreplay: the
package is analysed (``MYPYPATH`` points at ``src``, whose ``py.typed`` marks it typed) but only
the user file's errors are reported (``--follow-imports=silent``, as for installed packages).
TorchRL and tensordict ship no type information, so their imports are ignored, as a user must.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys

import pytest

from conftest import REPO, short_flat_batches

USAGE = REPO / "tests" / "typed_usage.py"


def test_the_usage_file_needs_no_type_ignore() -> None:
    assert "type: ignore" not in USAGE.read_text()


@pytest.mark.skipif(
    importlib.util.find_spec("mypy") is None,
    reason="mypy is not installed (it is in the test extra; pip install mypy)",
)
def test_mypy_accepts_the_documented_usage_with_every_type_resolved() -> None:
    command = [
        sys.executable,
        "-m",
        "mypy",
        "--strict",
        "--follow-imports=silent",
        "--ignore-missing-imports",
        "--cache-dir",
        str(REPO / ".pytest_cache" / "mypy"),  # a cold run analyses torch: ~30 s on 2 cores
        str(USAGE),
    ]
    env = {**os.environ, "MYPYPATH": str(REPO / "src")}
    result = subprocess.run(
        command, capture_output=True, text=True, timeout=300, cwd=REPO, env=env, check=False
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    revealed = re.findall(r'Revealed type is "(.*)"', output)
    assert len(revealed) == 4, output
    # An annotation mypy cannot resolve shows as ``Name?`` (and accepts anything).
    assert not [t for t in revealed if "?" in t], revealed
    assert revealed[1] == "fastreplay.samplers.slice.SliceSampler", revealed


@short_flat_batches  # strict_length=False slices: TorchRL's nightly warns there too
def test_the_usage_file_runs() -> None:
    """The typed examples are working code (all but the Ray buffer, which starts Ray)."""
    spec = importlib.util.spec_from_file_location("typed_usage", USAGE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.main()

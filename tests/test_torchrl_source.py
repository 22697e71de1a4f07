"""fastreplay runs on TorchRL's code objects only: it never compiles, executes or reads its source.

* an AST scan of ``src/fastreplay`` finds no ``compile``/``exec``/``eval``, no ``ast.parse``,
  no ``inspect.getsource*`` and no ``linecache``;
* with a TorchRL installed as ``.pyc`` files only (slim images, frozen apps), ``import
  fastreplay`` works, and its samples are TorchRL's (a ``Sequence`` with float done flags, a
  ``SliceSampler``), in a fresh interpreter;
* a ``Sequence.expand`` patched into TorchRL's class runs in fastreplay's buffers as in
  TorchRL's, patched before or after ``import fastreplay``;
* warnings TorchRL's samplers emit at their caller's line are attributed to TorchRL's module,
  and a sampler's exception shows fastreplay's frames, not a line of TorchRL's.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import py_compile
import subprocess
import sys
import traceback
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torchrl
import torchrl.data as trl
from tensordict import TensorDict

import fastreplay
from fastreplay import _torchrl as compat

PACKAGE = Path(importlib.util.find_spec("fastreplay").submodule_search_locations[0])
TORCHRL_DIR = Path(torchrl.__file__).parent
FORBIDDEN_CALLS = {"compile", "exec", "eval", "__import__"}
FORBIDDEN_ATTRIBUTES = {
    ("ast", "parse"),
    ("inspect", "getsource"),
    ("inspect", "getsourcelines"),
    ("inspect", "getsourcefile"),
    ("inspect", "findsource"),
}
SEQUENCE_CONFIG = {"length": 3, "burn_in": 0, "bootstrap": 0}


def _source_reads(text: str, name: str) -> list[str]:
    """The calls in ``text`` (module ``name``) that compile, execute or read Python source."""
    found = []
    for node in ast.walk(ast.parse(text)):
        where = f"{name}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [a.name for a in node.names]
            module = getattr(node, "module", None)
            if "linecache" in names or module == "linecache":
                found.append(f"{where} imports linecache")
        elif isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, ast.Name) and func.id in FORBIDDEN_CALLS:
                found.append(f"{where} calls {func.id}")
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            pair = (node.value.id, node.attr)
            if pair in FORBIDDEN_ATTRIBUTES or node.value.id == "linecache":
                found.append(f"{where} uses {'.'.join(pair)}")
    return found


def test_no_source_is_compiled_executed_or_read() -> None:
    files = sorted(PACKAGE.rglob("*.py"))
    assert len(files) > 20
    found = [
        hit
        for path in files
        for hit in _source_reads(path.read_text(), str(path.relative_to(PACKAGE.parent)))
    ]
    assert found == []


def test_source_scan_finds_what_it_looks_for() -> None:
    probe = (
        "import inspect, linecache\nexec('x = 1')\ncode = compile('1', 'f', 'eval')\n"
        "lines = inspect.getsourcelines(len)\nimport ast\nast.parse('1')\n"
    )
    assert [hit.split(" ", 1)[1] for hit in _source_reads(probe, "probe")] == [
        "imports linecache",
        "calls exec",
        "calls compile",
        "uses inspect.getsourcelines",
        "uses ast.parse",
    ]


def test_compat_module_imports_no_fastreplay_module() -> None:
    """``_torchrl`` is the bottom layer: what it needs lives in it (no import circle)."""
    tree = ast.parse((PACKAGE / "_torchrl.py").read_text())
    imported = [
        alias.name if isinstance(node, ast.Import) else f"{node.module}"
        for node in ast.walk(tree)
        if isinstance(node, (ast.Import, ast.ImportFrom))
        for alias in node.names
    ]
    assert imported and not [name for name in imported if name.split(".")[0] == "fastreplay"]
    assert not [
        node.module
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.level  # relative imports
    ]


# --------------------------------------------------------------------------- source-less TorchRL
def _sourceless_copy(destination: Path) -> Path:
    """TorchRL as ``.pyc`` files in the legacy layout (``x.pyc`` beside nothing), no ``.py``."""
    view = destination / "torchrl"
    for directory, folders, files in os.walk(TORCHRL_DIR):
        folders[:] = [f for f in folders if f != "__pycache__"]
        relative = Path(directory).relative_to(TORCHRL_DIR)
        (view / relative).mkdir(parents=True, exist_ok=True)
        for name in files:
            source = Path(directory) / name
            target = view / relative / name
            if name.endswith(".py"):
                py_compile.compile(
                    str(source), cfile=str(target) + "c", dfile=str(target), doraise=True
                )
            else:
                os.symlink(source, target)
    return destination


@pytest.fixture(scope="module")
def sourceless(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _sourceless_copy(tmp_path_factory.mktemp("sourceless"))


SAMPLES_SCRIPT = r"""
import inspect, json, sys, warnings
warnings.simplefilter("error")
import torch, torchrl
import torchrl.data as trl
from tensordict import TensorDict
import fastreplay
from fastreplay import _torchrl as compat

out = {"torchrl": torchrl.__file__}
try:
    inspect.getsource(trl.SliceSampler)
    out["source"] = True
except (OSError, TypeError):
    out["source"] = False

def slices(cls, buffer):
    traj = torch.arange(60) // 7
    data = TensorDict({"traj": traj, "obs": torch.arange(60)}, [60])
    rb = buffer(storage=trl.LazyTensorStorage(60), batch_size=12,
                sampler=cls(num_slices=3, traj_key="traj"))
    rb.extend(data)
    torch.manual_seed(0)
    return [rb.sample()["obs"].tolist() for _ in range(3)]

out["slices"] = [
    slices(trl.SliceSampler, trl.TensorDictReplayBuffer),
    slices(fastreplay.SliceSampler, fastreplay.TensorDictReplayBuffer),
    slices(fastreplay.SliceSampler, trl.TensorDictReplayBuffer),
]

if compat.HAS_SAMPLE_UNITS:
    def sequence(unit, buffer):
        done = torch.zeros(20, 1)
        done[4] = done[19] = 1.0  # float flags: TorchRL's boundary object answers
        data = TensorDict({"obs": torch.arange(20), ("next", "done"): done}, [20])
        rb = buffer(storage=trl.LazyTensorStorage(20), batch_size=4, sample_unit=unit(UNIT_ARGS))
        rb.extend(data)
        direct = rb._sample_unit.expand(torch.tensor([4, 19]), {}, rb.storage)[0].tolist()
        torch.manual_seed(0)
        return direct, [rb.sample()["obs"].tolist() for _ in range(3)]

    out["sequence"] = [
        sequence(trl.replay_buffers.Sequence, trl.TensorDictReplayBuffer),
        sequence(fastreplay.Sequence, fastreplay.TensorDictReplayBuffer),
        sequence(trl.replay_buffers.Sequence, fastreplay.TensorDictReplayBuffer),
        sequence(fastreplay.Sequence, trl.TensorDictReplayBuffer),
    ]
print(json.dumps(out))
""".replace("UNIT_ARGS", ", ".join(f"{k}={v}" for k, v in SEQUENCE_CONFIG.items()))


def _run(script: str, *paths: Path | str) -> Any:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(map(str, (*paths, PACKAGE.parent)))}
    env["OMP_NUM_THREADS"] = "1"
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_sourceless_torchrl_imports_and_samples_as_torchrl(sourceless: Path) -> None:
    """``.pyc``-only TorchRL: ``import fastreplay`` works; samples are TorchRL's."""
    out = _run(SAMPLES_SCRIPT, sourceless)
    assert out["torchrl"].startswith(str(sourceless))
    assert out["source"] is False  # the view really has no source
    theirs, *ours = out["slices"]
    assert all(mine == theirs for mine in ours)
    if compat.HAS_SAMPLE_UNITS:
        theirs, *ours = out["sequence"]
        assert theirs[0] == [4, 4, 4, 19, 19, 19]
        assert all(mine == theirs for mine in ours)


# --------------------------------------------------------------------------- patched expand
requires_units = pytest.mark.skipif(
    not compat.HAS_SAMPLE_UNITS, reason=f"TorchRL {compat.TORCHRL_VERSION} has no sample units"
)


def _episodes() -> TensorDict:
    done = torch.zeros(30, 1, dtype=torch.bool)
    done[[6, 13, 21, 29]] = True
    return TensorDict({"obs": torch.arange(30), ("next", "done"): done}, [30])


def _patched_samples(unit_side: str, buffer_side: str) -> list[tuple[list, list]]:
    unit = (fastreplay.Sequence if unit_side == "fastreplay" else trl.replay_buffers.Sequence)(
        **SEQUENCE_CONFIG
    )
    buffer = (
        fastreplay.TensorDictReplayBuffer
        if buffer_side == "fastreplay"
        else trl.TensorDictReplayBuffer
    )
    rb = buffer(storage=trl.LazyTensorStorage(30), batch_size=6, sample_unit=unit)
    rb.extend(_episodes())
    torch.manual_seed(0)
    found = []
    for _ in range(3):
        data, info = rb.sample(return_info=True)
        found.append((data["obs"].tolist(), info["patched"].tolist()))
    return found


def _adds_info(original: Any) -> Any:
    """A user's patch of ``Sequence.expand``: TorchRL's, plus an info entry."""

    def expand(self: Any, index: Any, info: dict, storage: Any) -> Any:
        index, info = original(self, index, info, storage)
        info["patched"] = index + 1000
        return index, info

    return expand


@requires_units
@pytest.mark.parametrize("unit_side", ["fastreplay", "torchrl"])
def test_patched_sequence_expand_runs_after_import(
    unit_side: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(compat.TorchRLSequence, "expand", _adds_info(compat.TorchRLSequence.expand))
    theirs = _patched_samples("torchrl", "torchrl")
    assert _patched_samples(unit_side, "fastreplay") == theirs
    assert _patched_samples(unit_side, "torchrl") == theirs


PATCHED_FIRST = r"""
import json, torch
from torchrl.data.replay_buffers.sample_units import Sequence
original = Sequence.expand

def expand(self, index, info, storage):
    index, info = original(self, index, info, storage)
    info["patched"] = index + 1000
    return index, info

Sequence.expand = expand  # before fastreplay is imported

import fastreplay
import torchrl.data as trl
from tensordict import TensorDict

def samples(unit_cls, buffer):
    done = torch.zeros(30, 1, dtype=torch.bool)
    done[[6, 13, 21, 29]] = True
    rb = buffer(storage=trl.LazyTensorStorage(30), batch_size=6, sample_unit=unit_cls(UNIT_ARGS))
    rb.extend(TensorDict({"obs": torch.arange(30), ("next", "done"): done}, [30]))
    torch.manual_seed(0)
    found = []
    for _ in range(3):
        data, info = rb.sample(return_info=True)
        found.append((data["obs"].tolist(), info["patched"].tolist()))
    return found

print(json.dumps([
    samples(trl.replay_buffers.Sequence, trl.TensorDictReplayBuffer),
    samples(fastreplay.Sequence, fastreplay.TensorDictReplayBuffer),
    samples(trl.replay_buffers.Sequence, fastreplay.TensorDictReplayBuffer),
    samples(fastreplay.Sequence, trl.TensorDictReplayBuffer),
]))
""".replace("UNIT_ARGS", ", ".join(f"{k}={v}" for k, v in SEQUENCE_CONFIG.items()))


@requires_units
def test_patched_sequence_expand_runs_when_patched_before_import() -> None:
    theirs, *ours = _run(PATCHED_FIRST)
    assert all(mine == theirs for mine in ours)


# --------------------------------------------------------------------------- attribution
requires_fragmented_warning = pytest.mark.skipif(
    not (compat.WARNS_SHORT_FLAT_BATCH and "fragmented" in compat.SLICE_SAMPLER_ARGS),
    reason=f"TorchRL {compat.TORCHRL_VERSION}'s SliceSampler does not warn on short flat batches"
    if not compat.WARNS_SHORT_FLAT_BATCH
    else f"TorchRL {compat.TORCHRL_VERSION}'s SliceSampler takes no fragmented",
)


def _fragments() -> TensorDict:
    lengths = [2, 9, 3]
    traj = torch.cat([torch.full((lengths[i % 3],), i) for i in range(20)])[:59]
    step = torch.cat([torch.arange(lengths[i % 3]) for i in range(20)])[:59]
    return TensorDict({"traj": traj, "step_count": step, "obs": torch.arange(59)}, [59])


def _fragmented_warnings(sampler_cls: type, buffer_cls: type) -> list[tuple]:
    sampler = sampler_cls(num_slices=4, traj_key="traj", strict_length=False, fragmented=True)
    rb = buffer_cls(storage=trl.LazyTensorStorage(60), sampler=sampler, batch_size=24)
    rb.extend(_fragments())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.manual_seed(0)
        rb.sample()
    return [(w.category, str(w.message), w.filename, w.lineno) for w in caught]


@requires_fragmented_warning
@pytest.mark.parametrize("buffer_side", ["fastreplay", "torchrl"])
def test_fragmented_short_batch_warning_is_torchrl_s(buffer_side: str) -> None:
    """``SliceSampler(fragmented=True)``: TorchRL's warning, file and line; its filter applies."""
    buffer_cls = (
        fastreplay.TensorDictReplayBuffer
        if buffer_side == "fastreplay"
        else trl.TensorDictReplayBuffer
    )
    theirs = _fragmented_warnings(trl.SliceSampler, trl.TensorDictReplayBuffer)
    assert len(theirs) == 1 and theirs[0][1].startswith(compat.SHORT_FLAT_BATCH_MESSAGE)
    assert _fragmented_warnings(fastreplay.SliceSampler, buffer_cls) == theirs
    sampler = fastreplay.SliceSampler(
        num_slices=4, traj_key="traj", strict_length=False, fragmented=True
    )
    rb = buffer_cls(storage=trl.LazyTensorStorage(60), sampler=sampler, batch_size=24)
    rb.extend(_fragments())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warnings.filterwarnings("ignore", module="torchrl")
        assert rb.sample().numel() < 24


def test_sampler_error_shows_fastreplay_frames() -> None:
    """An error raised in a sampler on the direct path: no frame of TorchRL's between."""
    sampler = fastreplay.SliceSampler(num_slices=2, traj_key="traj")
    rb = fastreplay.TensorDictReplayBuffer(
        storage=trl.LazyTensorStorage(60), sampler=sampler, batch_size=8
    )
    rb.extend(_fragments())
    rb.sample()

    def broken(storage: Any, batch_size: int) -> Any:
        raise RuntimeError("the sampler failed")

    sampler.sample = broken  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match="the sampler failed") as caught:
        rb.sample()
    frames = traceback.extract_tb(caught.value.__traceback__)
    assert frames[-1].name == "broken"
    paths = [Path(f.filename) for f in frames]
    assert any(p.is_relative_to(PACKAGE) for p in paths)
    # the frame that called the sampler is fastreplay's own (or TorchRL's real ``_sample``)
    caller = frames[-2]
    if Path(caller.filename).is_relative_to(TORCHRL_DIR):
        assert caller.name == "_sample"
    else:
        assert Path(caller.filename).is_relative_to(PACKAGE)


def test_left_span_warning_needs_no_source(monkeypatch: pytest.MonkeyPatch) -> None:
    """TorchRL's left-span warning, where ``inspect`` cannot read TorchRL's source."""
    import inspect

    def no_source(*args: Any, **kwargs: Any) -> Any:
        raise OSError("could not get source code")

    compat._left_span_site.cache_clear()
    monkeypatch.setattr(inspect, "getsourcelines", no_source)
    monkeypatch.setattr(inspect, "getsource", no_source)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fastreplay.PrioritizedSliceSampler(10, 1.0, 1.0, num_slices=2, span=True)
    finally:
        compat._left_span_site.cache_clear()
    (warning,) = caught
    init = trl.PrioritizedSliceSampler.__init__
    assert warning.filename == init.__code__.co_filename
    assert warning.lineno > init.__code__.co_firstlineno  # the warn statement, not the def
    assert str(warning.message).startswith(compat.LEFT_SPAN_MESSAGE)

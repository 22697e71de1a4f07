"""Extract and execute the Python code blocks of Markdown files.

Every fenced block whose info string is exactly ``python`` is executed, in order, in one
namespace per file (a page reads like a tutorial: later blocks may use names from earlier
ones). A block that is deliberately not runnable is fenced as ``python no-run`` and is
counted, never executed. Any other spelling of a Python fence (``py``, ``python3``,
``python skip``...) is rejected, so a block can never silently escape execution.
"""

from __future__ import annotations

import re
import textwrap
from dataclasses import dataclass
from pathlib import Path

FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})(?P<info>[^\n`]*)$")
RUNNABLE = "python"
NOT_RUNNABLE = "python no-run"
_PYTHONISH = re.compile(r"^(py|python|python3|pycon|ipython)\b")


@dataclass(frozen=True)
class CodeBlock:
    """One fenced code block of a Markdown file."""

    path: Path
    line: int  # 1-based line of the opening fence
    info: str
    source: str

    @property
    def runnable(self) -> bool:
        return self.info == RUNNABLE


def extract_blocks(path: Path) -> list[CodeBlock]:
    """Return the Python code blocks of ``path`` (runnable and ``no-run``).

    Raises:
        ValueError: if a fence is unterminated or a Python-looking fence uses an info
            string other than ``python`` or ``python no-run``.
    """
    lines = Path(path).read_text(encoding="utf-8").splitlines()
    blocks: list[CodeBlock] = []
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        fence, info, start = m["fence"], m["info"].strip(), i
        body: list[str] = []
        i += 1
        while i < len(lines) and not re.match(rf"^[ \t]*{re.escape(fence)}[ \t]*$", lines[i]):
            body.append(lines[i])
            i += 1
        if i == len(lines):
            raise ValueError(f"{path}:{start + 1}: unterminated code fence {fence!r}")
        i += 1
        if _PYTHONISH.match(info) and info not in (RUNNABLE, NOT_RUNNABLE):
            raise ValueError(
                f"{path}:{start + 1}: code fence info {info!r} is ambiguous; use "
                f"{RUNNABLE!r} for a block the test suite runs, or {NOT_RUNNABLE!r} for a "
                "block that is deliberately not runnable"
            )
        if info in (RUNNABLE, NOT_RUNNABLE):
            source = textwrap.dedent("\n".join(body)) + "\n"
            blocks.append(CodeBlock(Path(path), start + 1, info, source))
    return blocks


def run_markdown(path: Path) -> tuple[int, int]:
    """Execute every runnable Python block of ``path`` in one fresh namespace.

    Returns:
        ``(executed, not_runnable)`` block counts.

    Raises:
        Exception: whatever a block raises, with the file and line in a note.
    """
    namespace: dict[str, object] = {"__name__": f"__markdown__{Path(path).stem}"}
    executed = skipped = 0
    for block in extract_blocks(path):
        if not block.runnable:
            skipped += 1
            continue
        code = compile(block.source, f"{block.path}:{block.line}", "exec")
        try:
            exec(code, namespace)
        except BaseException as exc:
            if hasattr(exc, "add_note"):  # Python >= 3.11
                exc.add_note(f"in the code block of {block.path} at line {block.line}")
            raise
        executed += 1
    return executed, skipped

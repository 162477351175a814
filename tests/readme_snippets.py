"""The README's python code blocks, for the tests that run them (a helper
module shared by tests/test_readme.py and tests/test_llmcompressor.py)."""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"
# A block whose first line says this needs the llm-compressor environment.
LLMC_MARK = "make llmcompressor-env"


@dataclasses.dataclass(frozen=True)
class Snippet:
    line: int  # line of the opening fence in README.md
    code: str

    @property
    def needs_llmcompressor(self) -> bool:
        return LLMC_MARK in self.code.splitlines()[0]

    def __str__(self):
        return f"README.md:{self.line}"


def python_snippets(path: Path = README) -> list[Snippet]:
    text = path.read_text()
    out = []
    for m in re.finditer(r"^```python\n(.*?)^```", text, re.S | re.M):
        out.append(Snippet(text.count("\n", 0, m.start()) + 1, m.group(1)))
    return out


def run_snippet(snippet: Snippet, cwd: Path, timeout: int = 600) -> subprocess.CompletedProcess:
    """Runs the block as a user would: a fresh interpreter (this one), in a
    directory that is not the repository root, with nothing switched on that
    the block does not switch on itself, and no network (offline hub)."""
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "PYTHONSAFEPATH", "OBSKERNELS_BACKEND")}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    script = cwd / f"readme_{snippet.line}.py"
    script.write_text(snippet.code)
    return subprocess.run([sys.executable, str(script)], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)

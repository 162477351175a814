"""Every python block of the README runs as written (CPU only here), so the
README cannot rot. A block marked as needing llm-compressor is compiled here
and run by tests/test_llmcompressor.py in that environment."""

import pytest
from helpers import python_snippets, run_snippet

SNIPPETS = python_snippets()


def test_the_readme_has_its_examples():
    assert len(SNIPPETS) >= 3
    assert sum(s.needs_llmcompressor for s in SNIPPETS) >= 1  # the oneshot recipe
    text = "\n".join(s.code for s in SNIPPETS)
    assert "start_calibration(model)" in text and "oneshot(" in text


@pytest.mark.parametrize("snippet", [s for s in SNIPPETS if not s.needs_llmcompressor], ids=str)
def test_snippet_runs(snippet, tmp_path):
    done = run_snippet(snippet, tmp_path)
    assert done.returncode == 0, f"{snippet} failed:\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"


@pytest.mark.parametrize("snippet", [s for s in SNIPPETS if s.needs_llmcompressor], ids=str)
def test_llmcompressor_snippet_compiles(snippet):
    compile(snippet.code, str(snippet), "exec")

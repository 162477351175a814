"""Every python block of the README runs as written (CPU only here), so the
README cannot rot. A block marked as needing llm-compressor is compiled here
and run by tests/test_llmcompressor.py in that environment."""

import re
from pathlib import Path

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


# --------------------------------------------------------------------------- #
# links between the project's markdown files
# --------------------------------------------------------------------------- #
ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "obskernels" / "bench" / "README.md"]
LINK = re.compile(r"\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)
CODE = re.compile(r"`[^`\n]*`")  # inline code: `kernel[grid](...)` is no link


def _slug(heading: str) -> str:
    """A heading's anchor as GitHub makes it: lower case, punctuation
    dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(path: Path) -> set:
    text = FENCE.sub("", path.read_text())
    return {_slug(m.group(1)) for m in re.finditer(r"^#+ (.*)$", text, re.M)}


def test_slug_is_githubs():
    assert _slug("Benchmarks: `make bench`") == "benchmarks-make-bench"
    assert _slug("As llm-compressor's backend") == "as-llm-compressors-backend"
    assert _slug("6. Triton on a GPU versus the interpreter") == "6-triton-on-a-gpu-versus-the-interpreter"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_links_resolve(doc):
    """Every relative link of the project's markdown names a file that
    exists and, with a fragment, one of that file's headings."""
    broken = []
    for target in LINK.findall(CODE.sub("", FENCE.sub("", doc.read_text()))):
        if target.startswith(("http://", "https://", "mailto:")):
            continue
        file, _, fragment = target.partition("#")
        path = (doc.parent / file).resolve() if file else doc
        if not path.exists():
            broken.append(target)
        elif fragment and path.suffix == ".md" and fragment not in _anchors(path):
            broken.append(target)
    assert not broken, f"{doc.name}: links to nothing: {broken}"

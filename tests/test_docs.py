"""The docs stay inside the repository: nothing links outside it, every results file they cite
exists, and docs/results holds only files a page, the README or the CHANGELOG cites (by name, by a
brace list such as ``ab_{a,b}.json``, by ``stem.*``, by their folder, or as another output of the same
run: ``x.json`` beside a cited ``x.txt``)."""
from __future__ import annotations

import fnmatch
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "results"


def _pages() -> dict[Path, str]:
    pages = [*sorted((ROOT / "docs").glob("*.md")), ROOT / "README.md", ROOT / "CHANGELOG.md"]
    return {p: p.read_text() for p in pages if p.exists()}


def _expand(text: str) -> list[str]:
    m = re.search(r"\{([^{}]*)\}", text)
    if m is None:
        return [text]
    return [x for alt in m.group(1).split(",") for x in _expand(text[:m.start()] + alt + text[m.end():])]


def _cited() -> set[str]:
    """Every docs/results/... path the pages name, relative to docs/results, braces expanded."""
    found = set()
    for text in _pages().values():
        for m in re.finditer(r"(?:docs/)?results/([A-Za-z0-9_.{},*/-]*[A-Za-z0-9_*}/])", text):
            found.update(_expand(m.group(1)))
    return found


def test_nothing_links_outside_the_repository():
    sources = {**_pages(), **{p: p.read_text() for p in (ROOT / "foldc").rglob("*.py")}}
    outside = [f"{p.relative_to(ROOT)}: {m.group(0)}" for p, text in sources.items()
               for m in re.finditer(r"\.\./shared\b[^\s)`]*|(?<![\w.])/work/[^\s)`]*", text)]
    assert outside == []


def test_every_cited_result_exists():
    missing = sorted(c for c in _cited() if "*" not in c and not (RESULTS / c).exists())
    assert missing == []


def test_docs_results_holds_only_cited_files():
    names = {x for text in _pages().values()
             for m in re.finditer(r"[A-Za-z0-9_.{},-]+\.(?:json|txt|png|md|log|csv|gz)\b", text) for x in _expand(m.group(0))}
    cited = _cited() | names
    files = sorted(str(p.relative_to(RESULTS)) for p in RESULTS.rglob("*") if p.is_file())
    assert files, "docs/results is empty"
    stems = {c.split("/")[-1].split(".")[0] for c in cited}   # a run's other outputs (.json beside .txt)
    uncited = [f for f in files if f.split("/")[-1].split(".")[0] not in stems and
               not any(f == c or fnmatch.fnmatch(f, c) or f.startswith(c.rstrip("/") + "/") for c in cited)]
    assert uncited == []


def test_the_architecture_page_example_runs():
    """docs/architecture.md's example (Triton's interpreter, CPU): plan_launch and run give the
    float64 answer within fp16's bar."""
    import numpy

    if tuple(int(p) for p in numpy.__version__.split(".")[:2]) >= (2, 4):
        import pytest

        pytest.skip(f"triton 3.6's interpreter needs numpy < 2.4; this python has {numpy.__version__}")
    import foldc
    from foldc.testing import rel_l2

    page = (ROOT / "docs" / "architecture.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", page, re.S)
    assert len(blocks) == 1
    scope: dict = {}
    exec(compile(blocks[0], "docs/architecture.md", "exec"), scope)   # noqa: S102 - the page's own example
    assert rel_l2(scope["out"], foldc.attention_reference(scope["q"], scope["k"], scope["v"])) < 2e-3

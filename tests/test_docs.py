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
    import foldc
    from foldc.testing import rel_l2

    page = (ROOT / "docs" / "architecture.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", page, re.S)
    assert len(blocks) == 1
    scope: dict = {}
    exec(compile(blocks[0], "docs/architecture.md", "exec"), scope)   # noqa: S102 - the page's own example
    assert rel_l2(scope["out"], foldc.attention_reference(scope["q"], scope["k"], scope["v"])) < 2e-3


def test_the_readme_example_runs():
    """README.md's "Using it" example runs as written on the CPU (the float64 executor, and Triton's interpreter
    for target="auto"), and the fused kernel gives the float64 answer within fp16's bar."""
    import foldc
    from foldc.testing import rel_l2

    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    assert len(blocks) == 1
    scope: dict = {}
    exec(compile(blocks[0], "README.md", "exec"), scope)   # noqa: S102 - the page's own example
    assert scope["plan"].folds == {"qk": "acc-fold", "pv": "acc-fold"}
    assert rel_l2(scope["out"], foldc.attention_reference(scope["q"], scope["k"], scope["v"])) < 2e-3


def _user_pages() -> dict[Path, str]:
    """README.md and docs/*.md (not the CHANGELOG: it names what was, not what is)."""
    return {p: t for p, t in _pages().items() if p.name != "CHANGELOG.md"}


def _resolve(dotted: str):
    """The object ``dotted`` ("foldc.serving.PagedDecodeWrapper.plan") names: the longest importable module
    prefix, then attributes. Raises (ImportError, AttributeError) when it does not exist."""
    import importlib

    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError as err:
            if err.name is not None and not dotted.startswith(err.name):   # a dependency (transformers) is missing
                raise
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(dotted)


def test_every_foldc_name_the_pages_mention_exists():
    """Each ``foldc.x.y`` and ``torch.ops.foldc.op`` in a code span of the README or a docs page is a name the
    package has (a module, a class, a function, an attribute of one)."""
    import importlib.util

    import torch

    import foldc.ops  # noqa: F401 - registers torch.ops.foldc
    import foldc.serving  # noqa: F401 - registers the append op

    hf = importlib.util.find_spec("transformers") is not None
    missing = []
    for page, text in _user_pages().items():
        fence = re.compile(r"^```\w*\n(.*?)^```", re.M | re.S)
        for span in fence.findall(text) + re.findall(r"`([^`]+)`", fence.sub("", text)):
            for name in re.findall(r"(?<![\w.])(?:torch\.ops\.)?foldc(?:\.[A-Za-z_]\w*)+", span):
                if name.startswith("foldc.integrations") and not hf:
                    continue
                try:
                    if name.startswith("torch.ops."):
                        getattr(torch.ops.foldc, name.split(".")[3])
                    else:
                        _resolve(name)
                except (ImportError, AttributeError, RuntimeError) as err:
                    missing.append(f"{page.name}: {name} ({type(err).__name__})")
    assert sorted(set(missing)) == []


def test_every_repository_path_the_pages_name_exists():
    """foldc/..., tests/..., benchmarks/..., examples/... paths in the README and docs name files or folders that
    exist (not those a command writes, ``> path``, nor an old commit's, ``git show REV:path``)."""
    missing = []
    for page, text in _user_pages().items():
        written = set(re.findall(r"> ([\w./-]+)", text))
        for m in re.finditer(r"(?<![\w/.:-])((?:foldc|tests|benchmarks|examples)/[\w./-]*\w/?)", text):
            path = m.group(1)
            if "*" in path or path in written or (ROOT / path).exists():
                continue
            missing.append(f"{page.name}: {path}")
    assert missing == []


def _sections(page: str) -> list[str]:
    text = (ROOT / page).read_text()
    return ([h.strip() for h in re.findall(r"^#+ (.*)$", text, re.M)]
            + [b.strip() for b in re.findall(r"\*\*([^*\n]+?)\.?\*\*", text)])


def test_every_cited_section_exists():
    """A reference such as ``docs/perf.md, "Layout grid"`` (in a page, a docstring, a test or a benchmark) names a
    heading of that page, or the bold lead of one of its paragraphs (a heading may go on: "Layout grid (H200, ...)")."""
    sources = {**_pages(), **{p: p.read_text() for d in ("foldc", "tests", "benchmarks", "examples")
                              for p in (ROOT / d).rglob("*.py")}}
    broken = []
    for path, text in sources.items():
        for m in re.finditer(r"((?:docs/)?[\w]+\.md)\)?,? \(?\"([^\"]+)\"", text):
            page = m.group(1) if m.group(1).startswith("docs/") or m.group(1) == "README.md" else f"docs/{m.group(1)}"
            title = " ".join(m.group(2).replace("`", "").replace("#", " ").split())   # a comment may wrap it
            if not (ROOT / page).exists() or not any(re.sub(r"`", "", s).startswith(title) for s in _sections(page)):
                broken.append(f"{path.relative_to(ROOT)}: {page}, \"{m.group(2)}\"")
    assert broken == []


def test_each_pass_cites_the_equations_the_derivation_lists():
    """foldc/passes/*.py: the module docstring's "equations ..." and the pass's ``equation`` are the row of
    docs/derivation.md's "Where each pass stands" table for that module, and every one is a numbered equation."""
    import importlib

    derivation = (ROOT / "docs" / "derivation.md").read_text()
    numbered = set(re.findall(r"\((\d+[a-z]?)\)\s*$", derivation, re.M))
    table = dict(re.findall(r"^\| `foldc/passes/(\w+)\.py` \| ([^|]+) \|", derivation, re.M))
    assert table, "derivation.md lost its 'Where each pass stands' table"
    wrong = []
    for module, cell in table.items():
        listed = set(re.findall(r"\((\d+[a-z]?)\)", cell))
        mod = importlib.import_module(f"foldc.passes.{module}")
        doc = re.search(r"equations ([\d, and]+)", " ".join(mod.__doc__.split()))
        docstring = set(re.findall(r"\d+[a-z]?", doc.group(1))) if doc else set()
        passes = [v for v in vars(mod).values() if isinstance(v, type) and v.__module__ == mod.__name__
                  and isinstance(getattr(v, "equation", None), str) and v.equation]
        declared = {e.strip() for p in passes for e in p.equation.split(",")}
        for what, got in (("module docstring", docstring), ("equation", declared)):
            if got != listed:
                wrong.append(f"{module}: {what} {sorted(got)} but derivation.md lists {sorted(listed)}")
        if not listed <= numbered:
            wrong.append(f"{module}: {sorted(listed - numbered)} is no numbered equation of derivation.md")
    assert wrong == []

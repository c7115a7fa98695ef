"""Every ```python block in README.md and docs/**/*.md runs as a test; every public name has a
docstring."""

from __future__ import annotations

import inspect
import re
import sys
import types
import warnings
from pathlib import Path

import pytest

import functional_opt as fo

ROOT = Path(__file__).resolve().parent.parent
DOC_FILES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def _blocks() -> list[tuple[str, str]]:
    out = []
    for path in DOC_FILES:
        text = path.read_text()
        for i, match in enumerate(BLOCK.finditer(text)):
            line = text[: match.start()].count("\n") + 1
            out.append((f"{path.relative_to(ROOT)}:{line}#{i}", match.group(1)))
    return out


BLOCKS = _blocks()


def test_docs_have_examples() -> None:
    assert any(name.startswith("docs/") for name, _ in BLOCKS)


@pytest.mark.parametrize("source", [b for _, b in BLOCKS], ids=[n for n, _ in BLOCKS])
def test_doc_example_runs(source: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    # run as the code of an importable module, as a user's would be (torch.compile imports the
    # module of the functions it traces)
    module = types.ModuleType("__doc_example__")
    monkeypatch.setitem(sys.modules, module.__name__, module)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        exec(compile(source, "<doc example>", "exec"), module.__dict__)
    fallbacks = [str(w.message) for w in caught if str(w.message).startswith("fused:")]
    assert not fallbacks, fallbacks  # the engine compiled what the examples fuse
    for w in caught:  # the others go through the suite's warning filters as they came
        warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)


@pytest.mark.parametrize("name", sorted(fo.__all__))
def test_public_names_have_docstrings(name: str) -> None:
    obj = getattr(fo, name)
    if inspect.ismodule(obj) or inspect.isfunction(obj) or inspect.isclass(obj):
        doc = inspect.getdoc(obj)
        assert doc and len(doc) > 20, f"{name} needs a docstring"

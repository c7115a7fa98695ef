"""Griffe extension for the API reference (``mkdocs.yml`` loads it; it is not a docs page).

* ``pyproject.toml`` installs the top-level ``adapters/`` folder as the subpackage
  ``functional_opt.adapters`` (a setuptools ``package-dir`` mapping). Griffe reads packages from
  the file system and so would never find that subpackage inside ``functional_opt/``; this
  extension loads the folder and attaches it under ``functional_opt`` once that package is loaded.
* The docstrings use Sphinx roles (``:func:`chain```); Markdown has none, so they are rendered
  as inline code.
* Parameters whose name starts with ``_`` are internal (e.g. ``_moment_dtype``) and are left out
  of the rendered signatures.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import griffe

# subpackage path -> folder, relative to the repository root (as in pyproject.toml)
MAPPED = {"functional_opt.adapters": "adapters"}

ROLE = re.compile(r":(?:func|class|meth|attr|mod|data|obj|exc):`~?([^`]+)`")


class PackageDirMapping(griffe.Extension):
    """Attach package-dir mapped folders, render Sphinx roles, hide private parameters."""

    def on_package(self, *, pkg: griffe.Module, loader: griffe.GriffeLoader, **kwargs: Any) -> None:
        root = Path(str(pkg.filepath)).parent.parent
        for dotted, folder in MAPPED.items():
            parent_name, _, name = dotted.rpartition(".")
            init = root / folder / "__init__.py"
            if parent_name != pkg.path or name in pkg.members or not init.exists():
                continue
            # griffe has no public call for "load this folder as a submodule of that package";
            # _load_module(..., parent=...) is what griffe itself uses for submodules.
            sub = loader._load_module(name, init, submodules=True, parent=pkg)
            pkg.set_member(name, sub)
        _tidy(pkg)


def _tidy(obj: griffe.Object) -> None:
    if obj.docstring is not None:
        obj.docstring.value = ROLE.sub(r"``\1``", obj.docstring.value)
    if isinstance(obj, griffe.Function):
        for name in [p.name for p in obj.parameters if p.name.startswith("_")]:
            del obj.parameters[name]
    for member in obj.members.values():
        if not member.is_alias:
            _tidy(member)  # type: ignore[arg-type]

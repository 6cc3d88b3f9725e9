"""``act_hf.patches`` when act_hf runs from a source tree (``PYTHONPATH=.``, as on the GPU machine) rather than
from an install.

The families live in ``patches/`` beside the package; an install (wheel or editable) maps that folder to
``act_hf.patches``. A plain checkout on ``sys.path`` has no such mapping, so :func:`install` adds a finder for
that one name, behind every other finder: an installed mapping always wins.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
from pathlib import Path

__all__ = ["install"]

PACKAGE = "act_hf.patches"
_PACKAGE_DIR = Path(__file__).resolve().parent
TREE_PATCHES = _PACKAGE_DIR.parent / "patches"


class _FamiliesFinder(importlib.abc.MetaPathFinder):
    """Finds ``act_hf.patches`` in the source tree's ``patches/``; its submodules then resolve through the
    package's ``__path__`` as usual."""

    def find_spec(self, fullname: str, path=None, target=None) -> importlib.machinery.ModuleSpec | None:
        if fullname != PACKAGE:
            return None
        return importlib.util.spec_from_file_location(fullname, TREE_PATCHES / "__init__.py",
                                                      submodule_search_locations=[str(TREE_PATCHES)])


def install() -> None:
    """Add the finder once, last, when this is a source tree (``patches/__init__.py`` beside the package and
    none inside it)."""
    if (_PACKAGE_DIR / "patches").is_dir() or not (TREE_PATCHES / "__init__.py").is_file():
        return
    if not any(isinstance(finder, _FamiliesFinder) for finder in sys.meta_path):
        sys.meta_path.append(_FamiliesFinder())

"""Sphinx configuration for the decent_optim documentation.

Build with ``sphinx-build -W -b html docs docs/_build/html`` (warnings are errors). The
topology pictures and the table of spectral gaps are generated at build time by
``topology_figures.py`` from the package itself, so they always match the code.
"""

from __future__ import annotations

import sys
from pathlib import Path

from sphinx.application import Sphinx

DOCS = Path(__file__).resolve().parent
sys.path.insert(0, str(DOCS.parent))  # document the checkout, also when it is not installed
sys.path.insert(0, str(DOCS))

import decent_optim  # noqa: E402

project = "decent_optim"
author = "decent_optim developers"
copyright = "2026, decent_optim developers"
release = decent_optim.__version__
version = ".".join(release.split(".")[:2])

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.mathjax",
    "sphinx.ext.viewcode",
]

exclude_patterns = ["_build", "_generated", "Thumbs.db", ".DS_Store"]
templates_path: list[str] = []

# Google-style docstrings, as the package writes them.
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False

autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_default_options = {"members": True, "show-inheritance": True}
# The frameworks of decent_optim.integrations are optional extras: the docs build the same
# whether they are installed or not.
autodoc_mock_imports = ["transformers", "accelerate", "lightning"]

# No intersphinx: CI builds offline. References to torch stay plain text (nitpicky is off).
nitpicky = False

html_theme = "furo"
html_title = f"decent_optim {release}"
html_static_path: list[str] = []


def _generate_figures(app: Sphinx) -> None:
    import topology_figures

    topology_figures.generate(DOCS / "_generated")


def setup(app: Sphinx) -> None:
    app.connect("builder-inited", _generate_figures)

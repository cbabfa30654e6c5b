"""Sphinx configuration for collective_gc (builds offline: no intersphinx)."""

from __future__ import annotations

import os
import sys

# Document the working tree, whatever is installed.
sys.path.insert(0, os.path.abspath(".."))

import collective_gc  # noqa: E402  (after the path change)

project = "collective_gc"
author = "collective_gc contributors"
copyright = "collective_gc contributors"
release = collective_gc.__version__
version = release

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",  # the docstrings' "Args:" and "Attributes:" sections
    "myst_parser",  # Markdown pages (loader.md, petsc.md)
]
source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build", "Thumbs.db", ".DS_Store"]

autodoc_member_order = "bysource"
autodoc_typehints = "signature"
napoleon_google_docstring = True
napoleon_numpy_docstring = False
myst_heading_anchors = 3

html_theme = "alabaster"
html_static_path: list[str] = []

"""Sphinx configuration: the guides of docs/ (MyST markdown) and the API reference
generated from the docstrings (autodoc + napoleon, Google style). `make docs` builds it
with warnings as errors."""

import inspect
import os
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the checkout's packages, not another installed copy
os.environ.setdefault("JAX_PLATFORMS", "cpu")

project = "jaxrope"
author = "jaxrope authors"
copyright = "jaxrope authors"
extensions = ["myst_parser", "sphinx.ext.autodoc", "sphinx.ext.napoleon"]
source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
exclude_patterns = ["_build"]
root_doc = "index"

# The API reference documents what each public module's __all__ lists, in source order.
autodoc_default_options = {"members": True, "undoc-members": True, "member-order": "bysource"}
autodoc_typehints = "description"
autodoc_typehints_format = "short"
napoleon_google_docstring = True
napoleon_numpy_docstring = False
# Attributes sections as fields, not as objects: a NamedTuple's fields are documented once.
napoleon_use_ivar = True

# Headings get anchors, so the guides link to sections as `page.md#a-heading`.
myst_heading_anchors = 3
myst_enable_extensions = ["colon_fence"]

html_theme = "alabaster"
html_title = "jaxrope"


def _drop_type_docstrings(app, what, name, obj, options, lines):
    """A constant without a doc comment would show its type's docstring (dict's, frozenset's)."""
    doc = type(obj).__doc__
    if what == "data" and doc and "\n".join(lines).strip() == inspect.cleandoc(doc).strip():
        lines.clear()


def setup(app):
    app.connect("autodoc-process-docstring", _drop_type_docstrings)

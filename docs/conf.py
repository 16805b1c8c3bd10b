"""Sphinx configuration of the torchrl_grpo documentation.

Build (warnings are errors) and run every example of the site and of the docstrings::

    .venv/bin/python -m sphinx -W --keep-going -b html docs docs/_build/html
    .venv/bin/python -m sphinx -W --keep-going -b doctest docs docs/_build/doctest

Autodoc reads the installed package (``pip install -e .[docs]``). Nothing is downloaded at build
time: no intersphinx, and the diagram of the data path is a literal block.
"""

from __future__ import annotations

import doctest

from sphinx.util.inspect import signature, stringify_signature

import torchrl_grpo

project = "torchrl_grpo"
author = "torchrl_grpo contributors"
copyright = "2025, torchrl_grpo contributors"
release = torchrl_grpo.__version__
version = release

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.autosectionlabel",
    "sphinx.ext.doctest",
    "sphinx.ext.mathjax",
    "sphinx.ext.napoleon",
    "sphinx.ext.viewcode",
]

exclude_patterns = ["_build"]

# Sections are linked as :ref:`page:Section title`, so pages need no explicit labels. A title used
# twice in one page (likely in tutorials) would make its label ambiguous: that warning is silenced
# rather than failing the build, and such a title should not be linked to.
autosectionlabel_prefix_document = True
suppress_warnings = ["autosectionlabel.*"]
templates_path: list[str] = []

# --- autodoc / napoleon: Google-style docstrings of the installed package ------------------------
autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autodoc_class_signature = "mixed"
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False

# --- doctest: the >>> examples of the pages and of the docstrings pulled in by autodoc -----------
# Docstring examples run under pytest with their module's globals; here they get the public names.
doctest_global_setup = """
import logging
logging.getLogger("torchrl").setLevel(logging.WARNING)
import torch
torch.set_num_threads(1)
from torchrl_grpo import *
from torchrl_grpo.advantages import *
from torchrl_grpo.loss import *
from torchrl_grpo.loss_terms import *
from torchrl_grpo.rewards import *
from torchrl_grpo.token_dist import *
from torchrl_grpo.llm.lean_wrapper import *
from torchrl_grpo.loss.presets import EXAMPLE_SETUP
exec(EXAMPLE_SETUP)  # example_policy and example_batch, as the presets' examples expect
"""
doctest_test_doctest_blocks = "default"
# The flags of pytest.ini, so that an example passes under both runners.
doctest_default_flags = (
    doctest.ELLIPSIS
    | doctest.NORMALIZE_WHITESPACE
    | doctest.IGNORE_EXCEPTION_DETAIL
    | doctest.DONT_ACCEPT_TRUE_FOR_1
)

# --- HTML --------------------------------------------------------------------------------------
html_theme = "furo"
html_title = f"torchrl_grpo {release}"


def _constructor_signature(app, what, name, obj, options, sig, return_annotation):
    """Show a loss's ``__init__`` arguments, not ``LossModule.__new__(*args, **kwargs)``.

    torchrl's ``LossModule`` defines ``__new__(cls, *args, **kwargs)``, which autodoc prefers to
    ``__init__`` when it builds a class signature.
    """
    if what != "class" or sig != "(*args, **kwargs)" or "__init__" not in vars(obj):
        return None
    init = signature(obj.__init__, bound_method=True, type_aliases=app.config.autodoc_type_aliases)
    return stringify_signature(init, show_return_annotation=False), return_annotation


def setup(app):
    app.connect("autodoc-process-signature", _constructor_signature)

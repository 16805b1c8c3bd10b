"""The namespace of the presets' docstring examples (``example_policy``, ``example_batch``):
one set-up, ``torchrl_grpo.loss.presets.EXAMPLE_SETUP``, run before each doctest (Sphinx runs it
from ``docs/conf.py``). The tests' own fixtures are in ``test/conftest.py``."""

import pytest


@pytest.fixture(autouse=True)
def _presets_example(request, doctest_namespace):
    if request.node.name.startswith("torchrl_grpo.loss.presets."):
        from torchrl_grpo.loss.presets import EXAMPLE_SETUP

        exec(EXAMPLE_SETUP, doctest_namespace)

"""Run torchrl's own ``TestMCAdvantage`` (``test_torchrl_mcadvantage.py``, copied from pytorch/rl)
against this package's transform: ``torchrl.objectives.llm.grpo.MCAdvantage`` is replaced by
:class:`torchrl_grpo.MCAdvantage` while the copied file is imported (it binds the name then),
and put back once collection is over, so that every other test sees torchrl's own class."""

import pytest
import torchrl.objectives.llm as torchrl_llm
import torchrl.objectives.llm.grpo as torchrl_grpo_module

from torchrl_grpo import MCAdvantage

#: Tests of torchrl's suite that read a private attribute of torchrl's own class.
PRIVATE = {
    "test_mc_advantage_mixed_lazy_plain_trajectories_return_plain_tensordict": (
        "reads torchrl's private MCAdvantage._queue_list"
    ),
}

_ORIGINAL = torchrl_grpo_module.MCAdvantage, torchrl_llm.MCAdvantage
torchrl_grpo_module.MCAdvantage = torchrl_llm.MCAdvantage = MCAdvantage


def pytest_collection_modifyitems(config, items):
    for item in items:
        reason = PRIVATE.get(getattr(item, "originalname", item.name))
        if reason is not None and "torchrl_suite" in str(item.fspath):
            item.add_marker(pytest.mark.xfail(reason=reason, strict=True))


def pytest_collection_finish(session):
    torchrl_grpo_module.MCAdvantage, torchrl_llm.MCAdvantage = _ORIGINAL

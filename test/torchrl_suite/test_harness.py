"""The harness of torchrl's copied suite (conftest.py): what it runs is this package's class."""

import torchrl.objectives.llm as torchrl_llm
import torchrl.objectives.llm.grpo as torchrl_grpo_module
from test_torchrl_mcadvantage import MCAdvantage as copied

from torchrl_grpo import MCAdvantage


def test_the_copied_suite_runs_this_package_s_transform():
    assert copied is MCAdvantage
    for module in (torchrl_llm, torchrl_grpo_module):  # torchrl's own class is back for others
        assert module.MCAdvantage.__module__.startswith("torchrl.objectives.llm")

"""The harness of torchrl's copied suite (conftest.py): what it runs is this package's classes."""

import test_torchrl_losses
import test_torchrl_mcadvantage
import torchrl.objectives.llm as torchrl_llm
import torchrl.objectives.llm.grpo as torchrl_grpo_module

from torchrl_grpo import MCAdvantage
from torchrl_grpo.loss import CISPOLoss, CISPOLossOutput, GRPOLoss, GRPOLossOutput


def test_the_copied_suite_runs_this_package_s_transform():
    assert test_torchrl_mcadvantage.MCAdvantage is MCAdvantage
    for module in (torchrl_llm, torchrl_grpo_module):  # torchrl's own class is back for others
        assert module.MCAdvantage.__module__.startswith("torchrl.objectives.llm")


def test_the_copied_suite_runs_this_package_s_losses():
    ours = {
        "GRPOLoss": GRPOLoss,
        "GRPOLossOutput": GRPOLossOutput,
        "CISPOLoss": CISPOLoss,
        "CISPOLossOutput": CISPOLossOutput,
    }
    for name, cls in ours.items():
        assert getattr(test_torchrl_losses, name) is cls
        for module in (torchrl_llm, torchrl_grpo_module):  # torchrl's own classes are back
            assert getattr(module, name).__module__.startswith("torchrl.objectives.llm"), name

"""Run torchrl's own ``TestMCAdvantage`` and ``TestLosses`` (``test_torchrl_mcadvantage.py`` and
``test_torchrl_losses.py``, copied from pytorch/rl) against this package's classes: the names
of :data:`REPLACED` in ``torchrl.objectives.llm.grpo`` (and ``torchrl.objectives.llm``) are
this package's while the copied files are imported (they bind the names then), and torchrl's
again once collection is over, so that every other test sees torchrl's own classes."""

import pytest
import torch
import torchrl.objectives.llm as torchrl_llm
import torchrl.objectives.llm.grpo as torchrl_grpo_module
from helpers.llm import qwen_chat_tokenizer
from torchrl.testing import MockTransformerModel

import torchrl_grpo
import torchrl_grpo.loss

#: torchrl's name -> this package's class put in its place while the copied suite is collected.
REPLACED = {
    "MCAdvantage": torchrl_grpo.MCAdvantage,
    "GRPOLoss": torchrl_grpo.loss.GRPOLoss,
    "GRPOLossOutput": torchrl_grpo.loss.GRPOLossOutput,
    "CISPOLoss": torchrl_grpo.loss.CISPOLoss,
    "CISPOLossOutput": torchrl_grpo.loss.CISPOLossOutput,
}

#: Tests of torchrl's suite that read a private attribute of torchrl's own class.
PRIVATE = {
    "test_mc_advantage_mixed_lazy_plain_trajectories_return_plain_tensordict": (
        "reads torchrl's private MCAdvantage._queue_list"
    ),
}

_MODULES = (torchrl_grpo_module, torchrl_llm)
_ORIGINAL = [{name: getattr(module, name) for name in REPLACED} for module in _MODULES]
for _module in _MODULES:
    for _name, _ours in REPLACED.items():
        setattr(_module, _name, _ours)


def pytest_collection_modifyitems(config, items):
    for item in items:
        reason = PRIVATE.get(getattr(item, "originalname", item.name))
        if reason is not None and "torchrl_suite" in str(item.fspath):
            item.add_marker(pytest.mark.xfail(reason=reason, strict=True))


def pytest_collection_finish(session):
    for module, original in zip(_MODULES, _ORIGINAL, strict=True):
        for name, theirs in original.items():
            setattr(module, name, theirs)


# torchrl's fixture of its test/conftest.py (pytorch/rl at ae9719f17, MIT licence, Copyright (c)
# Meta Platforms, Inc. and affiliates): a mock model the losses score with. One change: the
# model's tokenizer (which the wrapper asks it for) is the local one of ``_mock_data_grpo``,
# where torchrl's mock downloads the Hub's Qwen tokenizer.
class _LocalTokenizerMock(MockTransformerModel):
    def get_tokenizer(self):
        return qwen_chat_tokenizer()


@pytest.fixture
def mock_transformer_model():
    """Fixture that provides a mock transformer model factory."""

    def _make_model(
        vocab_size: int = 1024, device: torch.device | str | int = "cpu"
    ) -> MockTransformerModel:
        """Make a mock transformer model."""
        device = torch.device(device)
        return _LocalTokenizerMock(vocab_size, device)

    return _make_model

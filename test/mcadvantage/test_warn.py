"""Tests of torchrl_grpo/mcadvantage/warn.py: warnings name the user's line."""

import pytest

from torchrl_grpo.mcadvantage.warn import warn


def test_the_first_frame_outside_the_package():
    with pytest.warns(RuntimeWarning, match="here") as seen:
        warn("here")
    assert seen[0].filename == __file__


def test_the_category():
    with pytest.warns(UserWarning, match="there"):
        warn("there", UserWarning)

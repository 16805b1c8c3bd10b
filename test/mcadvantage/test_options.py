"""Tests of torchrl_grpo/mcadvantage/options.py: the settings, checked once."""

import pytest
import torch

from torchrl_grpo import MCAdvantage
from torchrl_grpo.mcadvantage import (
    GroupRelative,
    RewardToGo,
    Staleness,
    StepGroups,
    TrajectoryIds,
)
from torchrl_grpo.mcadvantage.options import (
    KEYWORDS,
    SETTINGS,
    Limits,
    TrajectoryKeys,
    make_options,
    read_setting,
    with_setting,
)


class TestIntegerArguments:
    @pytest.mark.parametrize(
        "kw, name",
        [
            (dict(grpo_size=2.7), "grpo_size"),
            (dict(grpo_size=2.0), "grpo_size"),
            (dict(grpo_size=True), "grpo_size"),
            (dict(grpo_size="4"), "grpo_size"),
            (dict(grpo_size=2, candidate_group_size=3.5), "candidate_group_size"),
            (dict(grpo_size=2, candidate_selection_min_size=False), "candidate_selection_min_size"),
            (dict(grpo_size=2, limits=Limits(max_groups=1.5)), "Limits' max_groups"),
            (dict(grpo_size=2, limits=Limits(max_age=True)), "Limits' max_age"),
        ],
    )
    def test_non_integers_are_rejected(self, kw, name):
        with pytest.raises(TypeError, match=f"{name} must be an integer, got"):
            MCAdvantage(**kw)

    def test_integer_types_are_converted(self):
        import numpy as np

        t = MCAdvantage(
            np.int64(4),
            trajectory_return="sum",
            candidate_group_size=torch.tensor(6),
            limits=Limits(max_groups=np.int32(3)),
        )
        assert (t.grpo_size, t.candidate_group_size, t.max_pending_groups) == (4, 6, 3)
        assert all(type(v) is int for v in (t.grpo_size, t.candidate_group_size))


class TestMakeOptions:
    def test_arguments_grouped_by_the_step_that_reads_them(self):
        options = make_options(4, "seed", trajectory_return="sum", max_pending_groups=3)
        assert options.grpo_size == 4 and options.keys.group == "seed"
        assert options.trajectory_return == "sum"
        assert options.limits == Limits(3, None, "drop_oldest")
        assert options.trajectory_keys == TrajectoryKeys(
            ("collector", "traj_ids"), ("next", "done"), "step_count", group="seed"
        )
        assert make_options(2, traj_key=None).trajectory_keys.count is None

    def test_unknown_keyword(self):
        with pytest.raises(TypeError, match=r"unexpected keyword arguments \['gama'\]"):
            make_options(2, gama=0.9)

    def test_selection_runs_only_where_it_can_differ(self):
        assert not make_options(2, trajectory_return="sum").selects
        assert make_options(2, trajectory_return="sum", candidate_group_size=3).selects
        assert not make_options(2).selects  # per-step mode: torchrl never selects


class TestSettings:
    def test_every_setting_is_read_and_replaced_by_name(self):
        options = make_options(2, "seed")
        for name in SETTINGS:
            changed = with_setting(options, name, "new")
            assert read_setting(changed, name) == "new", name
            assert read_setting(options, name) != "new", name  # a new record

    def test_the_transform_has_an_attribute_for_each(self):
        t = MCAdvantage(2, prompt_key="seed")
        for name in SETTINGS:
            assert getattr(t, name) == read_setting(t._options, name), name


class TestRecords:
    """The extras beyond torchrl's arguments, grouped into records; the flat keywords still
    accepted, with the same result."""

    @pytest.mark.parametrize(
        "record, flat",
        [
            (
                dict(limits=Limits(max_groups=4, max_age=3, min_group_size=1)),
                dict(max_pending_groups=4, max_pending_age=3, min_group_size=1),
            ),
            (dict(staleness=Staleness(max_lag=2)), dict(max_policy_lag=2)),
            (
                dict(anchor_key="state", step_groups=StepGroups(step_weight=0.5, gamma=0.9)),
                dict(anchor_key="state", step_reward_weight=0.5, step_reward_gamma=0.9),
            ),
            (
                dict(reward_to_go=RewardToGo(0.9, baseline="time_step")),
                dict(reward_to_go_gamma=0.9, reward_to_go_baseline="time_step"),
            ),
            (
                dict(estimator=RewardToGo(0.9, "time_step", group=GroupRelative(epsilon=0.1))),
                dict(reward_to_go_gamma=0.9, reward_to_go_baseline="time_step", epsilon=0.1),
            ),
            (
                dict(estimator=StepGroups(step_weight=0.5, anchor_key="state")),
                dict(anchor_key="state", step_reward_weight=0.5),
            ),
            (
                dict(traj_key=TrajectoryIds("dialog", step_count_key=None)),
                dict(traj_key="dialog", step_count_key=None),
            ),
        ],
    )
    def test_a_record_is_its_flat_keywords(self, record, flat):
        def options(**kw):  # a selector is an object of its own each time: leave it out
            return make_options(2, **kw)._replace(selection=None)

        assert options(**record) == options(**flat) != options()
        transform = MCAdvantage(grpo_size=2, **record)
        for name, value in flat.items():  # the transform's attributes, where it has one
            assert name not in SETTINGS or getattr(transform, name) == value

    def test_defaults_are_written_once_in_the_records(self):
        assert make_options(2).limits == Limits()
        assert make_options(2).staleness == Staleness()
        steps = make_options(2, anchor_key="state").estimator
        assert steps == StepGroups(anchor_key="state")
        assert steps == StepGroups(1.0, 1.0, 0.95, anchor_key="state")  # ROLL's
        assert KEYWORDS["on_overflow"] == Limits().on_overflow
        assert KEYWORDS["reward_to_go_baseline"] == RewardToGo(0.9).baseline

    def test_a_record_with_its_flat_keywords_or_of_another_kind(self):
        with pytest.raises(ValueError, match="pass the record or its flat keywords"):
            MCAdvantage(grpo_size=2, limits=Limits(max_groups=4), max_pending_groups=4)
        with pytest.raises(TypeError, match="limits must be a Limits"):
            MCAdvantage(grpo_size=2, limits=Staleness())
        with pytest.raises(ValueError, match="need anchor_key"):
            MCAdvantage(grpo_size=2, step_groups=StepGroups())  # GiGPO's weights need anchors
        with pytest.raises(TypeError, match="unexpected keyword arguments"):
            MCAdvantage(grpo_size=2, max_pending_group=4)

"""Tests of torchrl_grpo/mcadvantage/estimators.py: the estimator one object, the flat keywords
of earlier versions deprecated with the same numbers, a user's own estimator."""

import dataclasses
import warnings

import pytest
import torch
from helpers import released, trajectory
from torchrl.data import LazyTensorStorage, ReplayBuffer

from torchrl_grpo import MCAdvantage, group_relative_advantage
from torchrl_grpo.mcadvantage import (
    ESTIMATORS,
    Distillation,
    Estimator,
    GroupRelative,
    Limits,
    RewardToGo,
    Staleness,
    StepGroups,
    TrajectoryIds,
)
from torchrl_grpo.mcadvantage.options import DEPRECATED


def _batch(seed=0, groups=3, size=3):
    """Trajectories of 1 to 3 steps, two reward entries, anchors, ``groups`` groups of
    ``size``, interleaved."""
    g = torch.Generator().manual_seed(seed)
    trajs = []
    for i in range(groups * size):
        n = int(torch.randint(1, 4, (1,), generator=g))
        rewards = torch.randint(0, 4, (n,), generator=g).float().tolist()
        fmt = torch.rand(n, 1, generator=g)
        obs = torch.randint(0, 2, (n,), generator=g)
        trajs.append(trajectory(i % groups, rewards, next_format=fmt, obs=obs))
    return torch.cat(trajs)


def _advantages(batch, size=3, **kwargs):
    """uid -> advantage of everything ``MCAdvantage(size, **kwargs)`` releases."""
    return released(MCAdvantage(size, prompt_key="seed", **kwargs).inv(batch))


#: Each flat keyword of earlier versions (with the others it needs) and its estimator form.
FLAT_AND_OBJECT = [
    (dict(baseline="leave_one_out"), dict(estimator=GroupRelative(baseline="leave_one_out"))),
    (dict(scale_rewards="none"), dict(estimator=GroupRelative(scale_rewards="none"))),
    (dict(scale_rewards="none"), dict(estimator="dr_grpo")),
    (dict(baseline="leave_one_out", scale_rewards="none"), dict(estimator="rloo")),
    (dict(scale_rewards="none", whiten=True), dict(estimator="reinforce_pp_baseline")),
    (dict(baseline="pass_at_k"), dict(estimator="pass_at_k")),
    (dict(epsilon=2.0), dict(estimator=GroupRelative(epsilon=2.0))),
    (dict(whiten=True), dict(estimator=GroupRelative(whiten=True))),
    (dict(std_threshold=0.1), dict(estimator=GroupRelative(std_threshold=0.1))),
    (dict(step_norm=True), dict(estimator=GroupRelative(step_norm=True))),
    (
        dict(reward_weights={("next", "reward"): 1.0, ("next", "format"): 0.5}),
        dict(
            estimator=GroupRelative(reward_weights={("next", "reward"): 1, ("next", "format"): 0.5})
        ),
    ),
    (dict(reward_to_go_gamma=0.9), dict(estimator=RewardToGo(0.9))),
    (
        dict(reward_to_go_gamma=0.9, reward_to_go_baseline="time_step"),
        dict(estimator=RewardToGo(0.9, "time_step")),
    ),
    (
        dict(reward_to_go=RewardToGo(0.5, "step_group")),
        dict(estimator=RewardToGo(0.5, "step_group")),
    ),
    (dict(anchor_key="obs"), dict(estimator=StepGroups(anchor_key="obs"))),
    (
        dict(anchor_key="obs", step_groups=StepGroups(0.5, 2.0, 0.9)),
        dict(estimator=StepGroups(0.5, 2.0, 0.9, anchor_key="obs")),
    ),
    (
        dict(anchor_key="obs", episode_reward_weight=0.5, step_reward_weight=2.0),
        dict(estimator=StepGroups(episode_weight=0.5, step_weight=2.0, anchor_key="obs")),
    ),
    (
        dict(anchor_key="obs", step_reward_gamma=0.5, scale_rewards="batch"),
        dict(
            estimator=StepGroups(
                gamma=0.5, anchor_key="obs", group=GroupRelative(scale_rewards="batch")
            )
        ),
    ),
]


#: ... per step and with a return mode (a reward-to-go is a per-step mode only).
CASES = [
    (flat, new, mode)
    for flat, new in FLAT_AND_OBJECT
    for mode in (None, "sum")
    if mode is None or not isinstance(new["estimator"], RewardToGo)
]


class TestFlatKeywords:
    @pytest.mark.parametrize("flat, new, mode", CASES)
    def test_same_numbers_and_a_warning_naming_the_replacement(self, flat, new, mode):
        batch = _batch()
        with pytest.warns(DeprecationWarning) as record:
            want = _advantages(batch, trajectory_return=mode, **flat)
        message = str(record[0].message)
        for name in flat:
            assert f"{name}= -> {DEPRECATED[name][0]}={DEPRECATED[name][1]}" in message
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # the new form warns about nothing
            got = _advantages(batch, trajectory_return=mode, **new)
        assert want.keys() == got.keys() and want
        for uid in want:
            assert torch.equal(got[uid], want[uid]), uid

    def test_the_message_says_exactly_what_to_write(self):
        with pytest.warns(DeprecationWarning) as record:
            t = MCAdvantage(2, reward_to_go_gamma=0.9, scale_rewards="batch", max_pending_age=4)
        message = str(record[0].message)
        estimator = "RewardToGo(gamma=0.9, group=GroupRelative(scale_rewards='batch'))"
        assert f"estimator={estimator}" in message
        assert "limits=Limits(max_groups=None, max_age=4," in message
        assert repr(t.estimator) == estimator
        assert eval(estimator) == t.estimator  # what it says to write is the same object

    @pytest.mark.parametrize(
        "flat, record",
        [
            (dict(max_pending_groups=3), dict(limits=Limits(max_groups=3))),
            (dict(on_overflow="raise"), dict(limits=Limits(on_overflow="raise"))),
            (
                dict(max_pending_age=2, min_group_size=1),
                dict(limits=Limits(None, 2, "drop_oldest", 1)),
            ),
            (dict(max_policy_lag=1), dict(staleness=Staleness(max_lag=1))),
            (dict(consumer_version=3), dict(staleness=Staleness(consumer_version=3))),
            (dict(step_count_key=None), dict(traj_key=TrajectoryIds(step_count_key=None))),
            (dict(distillation=Distillation(alpha=0.0)), dict(estimator=Distillation(alpha=0.0))),
        ],
    )
    def test_the_records_flat_keywords_warn_too(self, flat, record):
        with pytest.warns(DeprecationWarning, match="deprecated") as caught:
            old = MCAdvantage(2, **flat)
        name = next(iter(flat))
        assert DEPRECATED[name][1] in str(caught[0].message)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            new = MCAdvantage(2, **record)
        assert old._options._replace(selection=None) == new._options._replace(selection=None)

    def test_every_flat_keyword_has_a_replacement(self):
        import inspect

        from torchrl_grpo.mcadvantage.options import KEYWORDS

        named = set(inspect.signature(MCAdvantage).parameters) - {"flat"}
        assert len(named) == 11 + 5  # torchrl's, and the estimator, traj_key, limits...
        assert set(KEYWORDS) - named == set(DEPRECATED)

    def test_an_estimator_with_a_flat_keyword_it_replaces_is_refused(self):
        with pytest.raises(ValueError, match=r"estimator=GroupRelative\(\) and baseline="):
            MCAdvantage(2, estimator=GroupRelative(), baseline="mean")
        with pytest.raises(ValueError, match=r"estimator=RewardToGo\(gamma=0.9\) and anchor_key"):
            MCAdvantage(2, estimator=RewardToGo(0.9), anchor_key="obs")
        with pytest.raises(ValueError, match="estimator=.* and distillation="):
            MCAdvantage(2, estimator="rloo", distillation=Distillation())
        with pytest.raises(ValueError, match="traj_key=TrajectoryIds.* and step_count_key="):
            MCAdvantage(2, traj_key=TrajectoryIds(), step_count_key=None)


class TestObjects:
    def test_an_unknown_name_lists_the_known_ones(self):
        with pytest.raises(ValueError, match=r"Unknown estimator 'grop'.*'dr_grpo', 'grpo'"):
            MCAdvantage(2, estimator="grop")
        with pytest.raises(TypeError, match="estimator must be an Estimator"):
            MCAdvantage(2, estimator=lambda x: x)

    def test_names_are_their_objects(self):
        for name, estimator in ESTIMATORS.items():
            assert MCAdvantage(2, estimator=name).estimator == estimator

    def test_settings_read_on_the_estimator(self):
        t = MCAdvantage(2, estimator=RewardToGo(0.9, group=GroupRelative(epsilon=0.1)))
        assert (t.estimator.gamma, t.estimator.group.epsilon) == (0.9, 0.1)
        assert MCAdvantage(2).estimator == GroupRelative() == ESTIMATORS["grpo"]
        grpo = MCAdvantage(2).estimator
        assert grpo.group is grpo  # it normalizes with its own settings
        steps = MCAdvantage(2, estimator=StepGroups(anchor_key="obs"))
        assert steps.in_keys[-1] == "obs"
        teacher = Distillation(teacher_key="t", log_prob_key="lp")
        assert MCAdvantage(2, estimator=teacher).in_keys[-2:] == ["lp", "t"]

    @pytest.mark.parametrize(
        "estimator, error, words",
        [
            (StepGroups(), ValueError, "StepGroups needs anchor_key"),
            (RewardToGo(), ValueError, "RewardToGo needs gamma"),
            (RewardToGo(1.5), ValueError, r"must be in \[0, 1\]"),
            (GroupRelative(baseline="median"), ValueError, "baseline must be one of"),
            (StepGroups(gamma=2.0, anchor_key="obs"), ValueError, r"in \[0, 1\]"),
            (Distillation(group=Distillation()), TypeError, "not a Distillation"),
            (Distillation(alpha=0.0, beta=0.0), ValueError, "uses neither"),
        ],
    )
    def test_bad_settings_raise_at_construction(self, estimator, error, words):
        with pytest.raises(error, match=words):
            MCAdvantage(2, estimator=estimator)

    def test_reward_to_go_with_a_return_mode_is_refused(self):
        with pytest.raises(ValueError, match="requires trajectory_return=None"):
            MCAdvantage(2, "seed", trajectory_return="sum", estimator=RewardToGo(0.9))

    def test_repr_shows_what_differs_from_the_defaults(self):
        assert repr(GroupRelative()) == "GroupRelative()"
        assert repr(StepGroups(anchor_key="s", step_weight=0.5)) == (
            "StepGroups(step_weight=0.5, anchor_key='s')"
        )
        d = Distillation(alpha=0.0, group=RewardToGo(0.5))
        assert repr(d) == "Distillation(alpha=0.0, group=RewardToGo(gamma=0.5))"
        assert dataclasses.replace(d, beta=2.0).beta == 2.0

    def test_the_estimator_survives_a_checkpoint_and_a_pickle(self):
        import pickle

        t = MCAdvantage(3, prompt_key="seed", estimator=RewardToGo(0.5, "time_step"))
        trajs = [trajectory(i % 2, [float(i), 1.0, float(i % 3)]) for i in range(6)]
        assert not released(t.inv(torch.cat(trajs[:3])))  # both groups pending
        state = t.state_dict()
        u = MCAdvantage(3, prompt_key="seed", estimator=RewardToGo(0.5, "time_step"))
        u.load_state_dict(state)
        rest = torch.cat(trajs[3:])
        got, want = released(u.inv(rest)), released(t.inv(rest))
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in got)
        assert pickle.loads(pickle.dumps(t._options)).estimator == t.estimator


class MinusGroupMean(Estimator):
    """A user's own: each sample minus its group's mean (GRPO with no scale)."""

    def advantages(self, samples, group_index, num_groups):
        sums = samples.new_zeros(num_groups).index_add_(0, group_index, samples)
        counts = samples.new_zeros(num_groups).index_add_(0, group_index, torch.ones_like(samples))
        return samples - (sums / counts)[group_index]


class TestUsersOwn:
    @pytest.mark.parametrize("mode", [None, "sum"])
    def test_in_a_replay_buffer(self, mode):
        batch = _batch(seed=1)
        rb = ReplayBuffer(storage=LazyTensorStorage(100))
        rb.append_transform(
            MCAdvantage(3, "seed", trajectory_return=mode, estimator=MinusGroupMean())
        )
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            rb.extend(batch)
        got = released(rb[:])
        want = _advantages(batch, trajectory_return=mode, estimator="dr_grpo")
        assert got.keys() == want.keys() and len(got) == batch.shape[0]
        for uid in want:
            torch.testing.assert_close(got[uid], want[uid])

    def test_samples_and_groups_as_documented(self):
        seen = {}

        class Recorder(Estimator):
            def advantages(self, samples, group_index, num_groups):
                seen.update(samples=samples, index=group_index, groups=num_groups)
                return torch.zeros_like(samples)

        t = MCAdvantage(2, "seed", trajectory_return="sum", estimator=Recorder())
        t.inv(torch.cat([trajectory(0, [1.0, 2.0]), trajectory(0, [4.0])]))
        assert seen["samples"].tolist() == [3.0, 4.0] and seen["samples"].dtype == torch.float64
        assert seen["index"].tolist() == [0, 0] and seen["groups"] == 1
        t = MCAdvantage(2, "seed", estimator=Recorder())  # per step: every reward element
        t.inv(torch.cat([trajectory(0, [1.0, 2.0]), trajectory(1, [4.0]), trajectory(0, [5.0])]))
        assert seen["samples"].tolist() == [1.0, 2.0, 5.0]
        assert seen["index"].tolist() == [0, 0, 0]

    def test_a_wrong_shape_is_named(self):
        class Wrong(Estimator):
            def advantages(self, samples, group_index, num_groups):
                return samples[:1]

        t = MCAdvantage(2, "seed", trajectory_return="sum", estimator=Wrong())
        with pytest.raises(ValueError, match=r"Wrong.advantages returned .*\(2,\)"):
            t.inv(torch.cat([trajectory(0, [1.0]), trajectory(0, [4.0])]))
        assert t.queued_trajectories == 0 and t.get_stats()["written_groups"] == 0

    def test_without_advantages_it_says_so(self):
        t = MCAdvantage(2, "seed", trajectory_return="sum", estimator=Estimator())
        with pytest.raises(NotImplementedError, match="must define advantages"):
            t.inv(torch.cat([trajectory(0, [1.0]), trajectory(0, [4.0])]))

    def test_as_the_group_of_a_distillation(self):
        """A user's estimator as the group of a Distillation gives A_group; nothing reads the
        group-relative settings it does not have."""
        own = MinusGroupMean()
        t = MCAdvantage(2, estimator=Distillation(beta=0.5, group=own))
        assert t.estimator.group is own and t.estimator.beta == 0.5
        assert t._options.group_filter.std_threshold is None


def test_group_relative_is_the_math_function():
    batch = _batch(seed=2)
    got = _advantages(batch, estimator=GroupRelative(baseline="leave_one_out"))
    assert got  # every group released, advantages per reward element
    rewards = torch.cat([v.reshape(-1) for v in got.values()])
    assert rewards.shape[0] == batch.shape[0]
    x = torch.tensor([1.0, 2.0, 4.0])
    want = group_relative_advantage(
        x, torch.zeros(3, dtype=torch.long), 1, baseline="leave_one_out"
    )
    t = MCAdvantage(3, "seed", estimator=GroupRelative(baseline="leave_one_out"))
    out = t.inv(torch.cat([trajectory(0, [1.0]), trajectory(0, [2.0]), trajectory(0, [4.0])]))
    torch.testing.assert_close(out["advantage"].reshape(-1).double(), want, rtol=1e-6, atol=1e-6)

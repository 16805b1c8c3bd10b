"""On-policy distillation on insertion (torchrl_grpo/mcadvantage/distillation.py): the per-token
advantages ``MCAdvantage(estimator=...)`` writes equal the peers' own formulas, transcribed in
test/helpers/distillation_peers.py, on ragged and padded rows, dialogs of one turn and of three:

* Trinity-RFT's ``OnPolicyDistillAdvantage`` / ``MultiTurnOpdAdvantage`` (``kl_coef = beta``,
  ``alpha = 0``), and their metrics;
* Tinker's ``incorporate_kl_penalty`` with and without ``kl_discount_factor`` (``gamma``), alone
  (``alpha = 0``) or added to its group-centred advantage (``alpha = 1``,
  ``scale_rewards="none"``), on its datums (a dialog that extends itself is one sequence);
* NeMo-RL's ``opd`` estimator (``beta = 1``, ``alpha = 0``), and its metrics.

Then the bad inputs, each refused with the cause named and the transform unchanged.
"""

import dataclasses
import math

import pytest
import torch
from helpers.distillation import (
    dialogs,
    padded_responses,
    response_advantages,
    rows,
    tinker_transitions,
)
from helpers.distillation_peers import (
    nemo_opd_advantage,
    tinker_compute_advantages,
    tinker_incorporate_kl_penalty,
    tinker_trajectory_to_data,
    trinity_multi_turn_opd,
    trinity_on_policy_distill,
)
from tensordict import TensorDict, lazy_stack

from torchrl_grpo import MCAdvantage
from torchrl_grpo.mcadvantage import Distillation, GroupRelative

SIZE, GROUPS = 3, 2
LAYOUTS = pytest.mark.parametrize("padded", [False, True], ids=["ragged", "padded"])
TURNS = pytest.mark.parametrize("turns", [1, 3])


def distilled(ds, *, padded, **kw):
    """``(advantages of every response, stats)`` of one insertion of the dialogs ``ds``."""
    transform = MCAdvantage(SIZE, prompt_key="group", **kw)
    out = transform.inv(rows(ds, SIZE, padded=padded))
    return response_advantages(out, ds), transform.get_stats()


def pure(beta=1.0, gamma=0.0):
    return {"rewards_key": None, "estimator": Distillation(alpha=0.0, beta=beta, gamma=gamma)}


def close(got, want, atol=1e-6):
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g.double(), w.double(), atol=atol, rtol=0)


class TestTrinity:
    @LAYOUTS
    @TURNS
    def test_advantages_and_metrics(self, padded, turns):
        ds = dialogs(GROUPS, SIZE, turns, seed=turns)
        got, stats = distilled(ds, padded=padded, **pure(beta=0.7))
        batch = padded_responses(ds)
        out, metrics = (trinity_multi_turn_opd if turns > 1 else trinity_on_policy_distill)(
            batch, kl_coef=0.7
        )
        mask = batch["response_mask"]
        close(got, [a[m] for a, m in zip(out["advantages"], mask, strict=True)])
        assert stats["distill_kl_sequence_mean"] == pytest.approx(metrics["kl/mean"], abs=1e-6)
        assert stats["distill_kl_sequence_std"] == pytest.approx(metrics["kl/std"], abs=1e-6)
        if turns > 1:  # Trinity-RFT's trajectory spread divides by n, this package's by n - 1
            n = GROUPS * SIZE
            assert stats["distill_kl_trajectory_mean"] == pytest.approx(
                metrics["kl/trajectory_mean"], abs=1e-6
            )
            assert stats["distill_kl_trajectory_std"] * math.sqrt((n - 1) / n) == pytest.approx(
                metrics["kl/trajectory_std"], abs=1e-6
            )


class TestNeMo:
    @LAYOUTS
    @TURNS
    def test_advantages_and_metrics(self, padded, turns):
        ds = dialogs(GROUPS, SIZE, turns, seed=10 + turns)
        got, stats = distilled(ds, padded=padded, **pure())
        batch = padded_responses(ds)
        mask = batch["response_mask"]
        adv, metrics = nemo_opd_advantage(
            batch["teacher_logprobs"], batch["old_log_probs"], mask.float()
        )
        close(got, [a[m] for a, m in zip(adv, mask, strict=True)])
        gap = metrics["on_policy_distillation/teacher_student_logprob_gap_mean"]
        assert -stats["distill_kl_token_mean"] == pytest.approx(gap, abs=1e-6)
        std = metrics["on_policy_distillation/adv_std"]
        assert stats["distill_kl_token_std"] == pytest.approx(std, abs=1e-6)


def tinker(ds, *, alpha, beta, gamma):
    """Tinker's advantages of every response token, and its metrics: each dialog one datum
    (every turn extends it), with its group-centred advantage times ``alpha``."""
    totals = [sum(t.reward for t in dialog) for dialog in ds]
    centred = tinker_compute_advantages([totals[g * SIZE : (g + 1) * SIZE] for g in range(GROUPS)])
    data, teachers = [], []
    for d, dialog in enumerate(ds):
        transitions, teacher = tinker_transitions(dialog)
        [datum] = tinker_trajectory_to_data(
            transitions, alpha * float(centred[d // SIZE][d % SIZE])
        )
        data.append(datum)
        teachers.append(teacher)
    metrics = tinker_incorporate_kl_penalty(data, teachers, [0] * len(data), beta, gamma)
    want = []
    for datum, dialog in zip(data, ds, strict=True):
        for turn in dialog:
            start = len(turn.prompt) - 1  # entry t of a datum is about token t + 1
            want.append(datum["advantages"][start : start + len(turn.response)])
    return want, metrics


class TestTinker:
    @LAYOUTS
    @TURNS
    @pytest.mark.parametrize("gamma", [0.0, 0.9])
    @pytest.mark.parametrize("alpha", [0.0, 1.0])
    def test_incorporate_kl_penalty(self, padded, turns, gamma, alpha):
        ds = dialogs(GROUPS, SIZE, turns, seed=20 + turns)
        # Tinker centres the group's rewards, and divides by nothing
        centred = GroupRelative(scale_rewards="none")
        distillation = Distillation(alpha=alpha, beta=0.8, gamma=gamma, group=centred)
        got, stats = distilled(ds, padded=padded, trajectory_return="sum", estimator=distillation)
        want, metrics = tinker(ds, alpha=alpha, beta=0.8, gamma=gamma)
        close(got, want, atol=1e-5)
        assert stats["distill_kl_token_mean"] == pytest.approx(metrics["teacher_kl"], abs=1e-6)

    def test_a_turn_that_does_not_extend_the_dialog_ends_the_discount(self):
        """Tinker starts a new sequence where an observation does not extend the last one, and
        this package's discounted sum stops there too (a prompt shorter than the turn before)."""
        ds = dialogs(GROUPS, SIZE, 3, seed=5)
        ds = [d[:2] + [d[2]._replace(prompt=[1, 2])] for d in ds]  # a fresh context at turn 3
        got, _ = distilled(ds, padded=False, **pure(beta=0.5, gamma=0.7))
        want = []
        for dialog in ds:
            transitions, _ = tinker_transitions(dialog)
            datums = tinker_trajectory_to_data(transitions, 0.0)
            assert len(datums) == 2
            teachers = []
            for datum, turns in zip(datums, (dialog[:2], dialog[2:]), strict=True):
                values = [0.0] * len(datum["tokens"])
                for t in turns:
                    values[len(t.prompt) : len(t.prompt) + len(t.response)] = t.teacher
                teachers.append([None, *values[1:]])
            tinker_incorporate_kl_penalty(datums, teachers, [0, 0], 0.5, 0.7)
            for datum, turns in zip(datums, (dialog[:2], dialog[2:]), strict=True):
                for t in turns:
                    start = len(t.prompt) - 1
                    want.append(datum["advantages"][start : start + len(t.response)])
        close(got, want, atol=1e-5)


class TestEstimator:
    def test_pure_distillation_needs_no_reward(self):
        ds = dialogs(4, 1, 1, seed=3)  # each dialog its own group of one
        data = rows(ds, 1, padded=False).exclude(("next", "reward"))
        transform = MCAdvantage(1, prompt_key="group", **pure(beta=2.0))
        got = response_advantages(transform.inv(data), ds)
        want = [-2.0 * (torch.tensor(t.student) - torch.tensor(t.teacher)) for d in ds for t in d]
        close(got, want)

    def test_alpha_adds_the_group_advantage_of_each_turn(self):
        """Per-turn rewards (``trajectory_return=None``): each turn's own GRPO advantage."""
        ds = dialogs(GROUPS, SIZE, 3, seed=8)
        kw = dict(prompt_key="group")
        plain = MCAdvantage(SIZE, **kw).inv(rows(ds, SIZE, padded=False))
        group = [float(a.reshape(-1)[0]) for a in plain.get("advantage", as_list=True)]
        got, _ = distilled(ds, padded=False, estimator=Distillation(alpha=1.5, beta=0.5))
        turns = [t for d in ds for t in d]
        want = [
            1.5 * g - 0.5 * (torch.tensor(t.student) - torch.tensor(t.teacher))
            for g, t in zip(group, turns, strict=True)
        ]
        close(got, want)

    def test_the_advantage_has_the_tokens_shape_and_is_zero_off_the_response(self):
        ds = dialogs(GROUPS, SIZE, 1, seed=4)
        out = MCAdvantage(SIZE, prompt_key="group", **pure()).inv(rows(ds, SIZE, padded=True))
        assert out["advantage"].shape == out["tokens", "full"].shape
        start = out["tokens", "prompt"].shape[-1]
        off = ~out["masks", "all_attention_mask"] | (
            torch.arange(out["advantage"].shape[-1]) < start
        )
        assert (out["advantage"][off] == 0).all()

    def test_a_token_batch_without_prompts(self):
        """``prompt_tokens_key=None``: every token a response token (a policy without
        prompts), the record's keys naming the batch's own entries."""
        g = torch.Generator().manual_seed(0)
        lp, teacher = -torch.rand(4, 5, generator=g), -torch.rand(4, 5, generator=g)
        mask = torch.arange(5) < torch.tensor([[5], [3], [1], [4]])
        data = TensorDict(
            group=torch.zeros(4, dtype=torch.long),
            tokens=torch.randint(7, (4, 5), generator=g),
            lp=lp,
            teacher=teacher,
            mask=mask,
            next=TensorDict(reward=torch.rand(4, 1), done=torch.ones(4, 1, dtype=torch.bool)),
            batch_size=[4],
        )
        keys = dict(tokens_key="tokens", prompt_tokens_key=None, log_prob_key="lp")
        distillation = Distillation(alpha=0.0, beta=2.0, teacher_key="teacher", mask_key="mask")
        out = MCAdvantage(
            4, prompt_key="group", estimator=dataclasses.replace(distillation, **keys)
        )
        got = out.inv(data)["advantage"]
        torch.testing.assert_close(got, torch.where(mask, -2.0 * (lp - teacher), 0.0))

    def test_groups_completed_across_insertions_give_the_same_advantages(self):
        ds = dialogs(GROUPS, SIZE, 3, seed=6)
        data = rows(ds, SIZE, padded=False)
        whole, _ = distilled(ds, padded=False, estimator=Distillation(beta=0.3, gamma=0.5))
        transform = MCAdvantage(
            SIZE, prompt_key="group", estimator=Distillation(beta=0.3, gamma=0.5)
        )
        turns = [t for d in ds for t in d]
        cut = 3 * 4  # four dialogs of three turns first: one group complete, one pending
        first = transform.inv(lazy_stack(list(data.unbind(0))[:cut]))
        second = transform.inv(lazy_stack(list(data.unbind(0))[cut:]))
        n = first.shape[0]
        got = response_advantages(first, [[t] for t in turns[:n]])
        got += response_advantages(second, [[t] for t in turns[n:]])
        close(got, whole)


class TestBaseline:
    """``Distillation(baseline=True)``: each token's reverse KL less its group's mean over the
    group's response tokens, with or without the group's advantage, however the group arrives."""

    @LAYOUTS
    @pytest.mark.parametrize("alpha", [0.0, 1.0])
    def test_the_group_mean_is_taken_out(self, padded, alpha):
        ds = dialogs(GROUPS, SIZE, 3, seed=11)
        kw = pure(beta=0.7) if alpha == 0.0 else {}
        plain, _ = distilled(
            ds,
            padded=padded,
            estimator=Distillation(alpha, 0.7),
            **{k: v for k, v in kw.items() if k != "estimator"},
        )
        got, _ = distilled(
            ds,
            padded=padded,
            estimator=Distillation(alpha, 0.7, baseline=True),
            **{k: v for k, v in kw.items() if k != "estimator"},
        )
        turns = [(d // SIZE, t) for d, dialog in enumerate(ds) for t in dialog]
        for group in range(GROUPS):
            d = torch.cat(
                [torch.tensor(t.student) - torch.tensor(t.teacher) for g, t in turns if g == group]
            ).double()
            for (g, _), p, c in zip(turns, plain, got, strict=True):
                if g == group:  # plain - beta * (d - mean) = plain + beta * mean
                    close([c], [p.double() + 0.7 * d.mean()])

    @LAYOUTS
    def test_position_takes_out_the_groups_mean_at_each_response_position(self, padded):
        """``baseline="position"``: ``D_t`` less the mean of ``D`` over the group's turns'
        tokens at ``t``'s index in its own response (the same turn index or not)."""
        ds = dialogs(GROUPS, SIZE, 3, seed=13)
        plain, _ = distilled(ds, padded=padded, estimator=Distillation(1.0, 0.7))
        got, _ = distilled(ds, padded=padded, estimator=Distillation(1.0, 0.7, baseline="position"))
        grouped, _ = distilled(ds, padded=padded, estimator=Distillation(1.0, 0.7, baseline=True))
        turns = [(d // SIZE, t) for d, dialog in enumerate(ds) for t in dialog]
        at = {}  # (group, position in the response): the reverse KL of the tokens there
        for g, t in turns:
            for k, d in enumerate(torch.tensor(t.student) - torch.tensor(t.teacher)):
                at.setdefault((g, k), []).append(d.double())
        for (g, t), p, c in zip(turns, plain, got, strict=True):
            mean = torch.stack([torch.stack(at[g, k]).mean() for k in range(len(t.student))])
            close([c], [p.double() + 0.7 * mean])
        assert any(not torch.allclose(a, b) for a, b in zip(got, grouped, strict=True))

    def test_groups_completed_across_insertions_give_the_same_advantages(self):
        ds = dialogs(GROUPS, SIZE, 3, seed=12)
        distillation = Distillation(beta=0.3, gamma=0.5, baseline=True)
        whole, _ = distilled(ds, padded=False, estimator=distillation)
        transform = MCAdvantage(SIZE, prompt_key="group", estimator=distillation)
        data, turns = rows(ds, SIZE, padded=False), [t for d in ds for t in d]
        first = transform.inv(lazy_stack(list(data.unbind(0))[:12]))  # one group complete
        second = transform.inv(lazy_stack(list(data.unbind(0))[12:]))
        n = first.shape[0]
        got = response_advantages(first, [[t] for t in turns[:n]])
        got += response_advantages(second, [[t] for t in turns[n:]])
        close(got, whole)


def test_a_checkpoint_keeps_the_pending_turns():
    """Pending turns saved with ``state_dict()`` and loaded elsewhere give the same advantages:
    the teacher's log-probs wait with them."""
    ds = dialogs(GROUPS, SIZE, 2, seed=12)
    steps = list(rows(ds, SIZE, padded=False).unbind(0))
    distillation = Distillation(beta=0.5, gamma=0.5)
    first = MCAdvantage(SIZE, prompt_key="group", estimator=distillation)
    first.inv(lazy_stack(steps[:8]))  # one group released, a dialog of the other pending
    second = MCAdvantage(SIZE, prompt_key="group", estimator=distillation)
    second.load_state_dict(first.state_dict())
    want = first.inv(lazy_stack(steps[8:])).get("advantage", as_list=True)
    got = second.inv(lazy_stack(steps[8:])).get("advantage", as_list=True)
    close(got, want, atol=0)
    assert second.get_stats()["distill_kl_token_mean"] == first.get_stats()["distill_kl_token_mean"]


class TestBadInput:
    def transform(self, **kw):
        return MCAdvantage(SIZE, prompt_key="group", estimator=Distillation(**kw))

    def check_unchanged(self, transform, ds):
        """The refused insertion changed nothing: the next one gives a fresh transform's."""
        want, _ = distilled(ds, padded=False, estimator=transform.estimator)
        got = response_advantages(transform.inv(rows(ds, SIZE, padded=False)), ds)
        close(got, want)

    def test_a_batch_the_teacher_did_not_score_is_refused(self):
        ds = dialogs(GROUPS, SIZE, 1, seed=1)
        transform = self.transform()
        data = rows(ds, SIZE, padded=False).exclude(("next", "teacher_log_probs"))
        with pytest.raises(KeyError, match=r"teacher_log_probs.*TeacherLogProbs.*A_t = 0"):
            transform.inv(data)
        self.check_unchanged(transform, ds)

    def test_log_probs_of_another_length_are_refused_naming_the_step(self):
        ds = dialogs(GROUPS, SIZE, 1, seed=2)
        steps = list(rows(ds, SIZE, padded=False).unbind(0))
        short = steps[4].get(("next", "teacher_log_probs", "full"))[:-1]
        steps[4].set(("next", "teacher_log_probs", "full"), short)
        transform = self.transform()
        with pytest.raises(ValueError, match=r"step 4 has \d+ teacher's log-probs"):
            transform.inv(lazy_stack(steps))
        self.check_unchanged(transform, ds)

    @pytest.mark.parametrize("value", [float("nan"), float("-inf")])
    def test_a_non_finite_response_log_prob_is_refused_naming_the_step(self, value):
        ds = dialogs(GROUPS, SIZE, 1, seed=3)
        steps = list(rows(ds, SIZE, padded=False).unbind(0))
        prompt = len(ds[2][0].prompt)
        steps[2].get(("next", "teacher_log_probs", "full"))[prompt] = value
        transform = self.transform()
        with pytest.raises(ValueError, match=r"response token 0 of step 2 is"):
            transform.inv(lazy_stack(steps))
        self.check_unchanged(transform, ds)

    def test_non_finite_log_probs_on_padding_are_not_read(self):
        ds = dialogs(GROUPS, SIZE, 1, seed=3)
        data = rows(ds, SIZE, padded=True)
        want, _ = distilled(ds, padded=True, **pure())
        pads = ~data["masks", "all_attention_mask"]
        data["next", "teacher_log_probs", "full"][pads] = float("nan")
        out = MCAdvantage(SIZE, prompt_key="group", **pure()).inv(data)
        close(response_advantages(out, ds), want)

    def test_several_reward_elements_per_turn_are_refused_with_alpha(self):
        ds = dialogs(GROUPS, SIZE, 1, seed=1)
        steps = list(rows(ds, SIZE, padded=False).unbind(0))
        for step in steps:
            step.set(("next", "reward"), torch.zeros(1, 2))
        with pytest.raises(ValueError, match="one reward element per step"):
            self.transform().inv(lazy_stack(steps))

    @pytest.mark.parametrize(
        "kw, match",
        [
            (dict(beta=-0.1), "beta must be finite and at least 0"),
            (dict(beta=float("nan")), "beta must be finite"),
            (dict(alpha=float("inf")), "alpha must be finite"),
            (dict(alpha=0.0, beta=0.0), r"alpha=0, beta=0\) uses neither"),
            (dict(gamma=1.5), r"gamma must be a number in \[0, 1\]"),
            (dict(baseline="token"), r"baseline must be False, True .* got 'token'"),
        ],
    )
    def test_bad_settings(self, kw, match):
        with pytest.raises(ValueError, match=match):
            self.transform(**kw)

    def test_no_reward_only_without_the_group_advantage(self):
        with pytest.raises(ValueError, match=r"rewards_key=None reads no reward.*alpha=0"):
            MCAdvantage(2, rewards_key=None, distillation=Distillation(alpha=1.0))
        with pytest.raises(ValueError, match="pure distillation"):
            MCAdvantage(2, rewards_key=None)
        with pytest.raises(TypeError, match="must be a Distillation"):
            MCAdvantage(2, distillation={"beta": 1.0})


def test_without_distillation_nothing_changes():
    """The same rows without ``distillation=``: torchrl's per-turn ``[1, 1]`` advantage."""
    ds = dialogs(GROUPS, SIZE, 1, seed=9)
    out = MCAdvantage(SIZE, prompt_key="group").inv(rows(ds, SIZE, padded=False))
    assert all(a.shape == (1, 1) for a in out.get("advantage", as_list=True))

"""Step-wise GRPO on an agent's turns: the estimators of torchrl_grpo.advantages and
mcadvantage/release.py on ragged steps (token sequences of different lengths per turn).

* broadcast (Trinity-RFT's ``step_wise_grpo``, rLLM's ``broadcast``): ``trajectory_return="last"``;
* rLLM's ``per_step``: each turn's discounted return compared with the same turn of the group's
  other dialogs, each (group, turn) a GRPO group (``reward_to_go_baseline="step_group"``);
* the discounted per-turn return with a time-step baseline and a pooled std, and ``step_norm``.

Each is checked against a reference written out here, on dialogs of one to three turns.
"""

import random

import pytest
import torch
from tensordict import TensorDict, lazy_stack

from torchrl_grpo import MCAdvantage, group_relative_advantage
from torchrl_grpo.mcadvantage import GroupRelative, RewardToGo


def dialogs(lengths, rewards, tasks, seed=0):
    """Turns of dialogs, one after the other, as a lazy stack of ragged steps: dialog ``d`` has
    ``lengths[d]`` turns with rewards ``rewards[d]`` and task ``tasks[d]``; each turn carries a
    token sequence of its own length, a ``[1, 1]`` reward and a ``[1]`` done flag."""
    rng = random.Random(seed)
    steps = []
    for d, (n, rs, task) in enumerate(zip(lengths, rewards, tasks, strict=True)):
        for t in range(n):
            steps.append(
                TensorDict(
                    tokens=torch.arange(rng.randint(2, 9)),
                    task=torch.tensor(task),
                    dialog=torch.tensor(d),
                    turn=torch.tensor(t),
                    next=TensorDict(
                        reward=torch.tensor([[float(rs[t])]]), done=torch.tensor([t == n - 1])
                    ),
                )
            )
    return lazy_stack(steps)


def advantages(out) -> dict[tuple[int, int], float]:
    """``{(dialog, turn): advantage}`` of a released lazy stack."""
    return {
        (int(step["dialog"]), int(step["turn"])): float(step["advantage"].reshape(-1)[0])
        for step in out.unbind(0)
    }


def grpo(values: list[float]) -> list[float]:
    """GRPO's advantage of one group: torchrl's Bessel std, floor 1e-6; a group of one gets 0."""
    x = torch.tensor(values, dtype=torch.float64)
    if len(values) == 1:
        return [0.0]
    return ((x - x.mean()) / x.std().clamp_min(1e-6)).tolist()


def random_dialogs(seed, groups=3, size=4, turns=3):
    rng = random.Random(seed)
    lengths = [rng.randint(1, turns) for _ in range(groups * size)]
    rewards = [[rng.choice([0.0, 0.5, 1.0]) for _ in range(n)] for n in lengths]
    tasks = [g for g in range(groups) for _ in range(size)]
    return lengths, rewards, tasks


class TestCellScale:
    def test_by_hand(self):
        """Each (group, time step) cell is its own group: mean and Bessel std of the cell."""
        x = torch.tensor([1.0, 2.0, 3.0, 0.0, 1.0])  # runs of 3 and 2 steps, one group
        adv = group_relative_advantage(
            x,
            torch.tensor([0, 0]),
            lengths=torch.tensor([3, 2]),
            by_time_step=True,
            time_step_scale="cell",
        )
        # t=0: {1, 0} -> +-0.7071; t=1: {2, 1} -> +-0.7071; t=2: {3} alone -> 0
        assert adv.tolist() == pytest.approx([0.7071, 0.7071, 0.0, -0.7071, -0.7071], abs=1e-4)

    def test_an_unknown_scale_raises(self):
        with pytest.raises(ValueError, match="time_step_scale must be 'pooled' or 'cell'"):
            group_relative_advantage(
                torch.ones(2),
                torch.tensor([0]),
                lengths=torch.tensor([2]),
                by_time_step=True,
                time_step_scale="turn",
            )


class TestOnTurns:
    @pytest.mark.parametrize("seed", range(6))
    def test_broadcast(self, seed):
        """The last turn's reward, group-relative, on every turn of the dialog."""
        lengths, rewards, tasks = random_dialogs(seed)
        out = MCAdvantage(4, prompt_key="task", trajectory_return="last").inv(
            dialogs(lengths, rewards, tasks, seed)
        )
        got = advantages(out)
        for g in set(tasks):
            members = [d for d, t in enumerate(tasks) if t == g]
            for d, a in zip(members, grpo([rewards[d][-1] for d in members]), strict=True):
                for t in range(lengths[d]):
                    assert got[d, t] == pytest.approx(a, abs=1e-6)

    @pytest.mark.parametrize("gamma", [0.0, 0.5, 1.0])
    @pytest.mark.parametrize("seed", range(6))
    def test_per_step(self, seed, gamma):
        """rLLM's per_step: the discounted return of each turn, GRPO within (task, turn)."""
        lengths, rewards, tasks = random_dialogs(seed)
        transform = MCAdvantage(4, prompt_key="task", estimator=RewardToGo(gamma, "step_group"))
        got = advantages(transform.inv(dialogs(lengths, rewards, tasks, seed)))
        returns = {}
        for d, rs in enumerate(rewards):
            g = 0.0
            for t in reversed(range(len(rs))):
                g = rs[t] + gamma * g
                returns[d, t] = g
        for task in set(tasks):
            for t in range(max(lengths)):
                cell = [d for d, k in enumerate(tasks) if k == task and lengths[d] > t]
                if not cell:
                    continue
                for d, a in zip(cell, grpo([returns[d, t] for d in cell]), strict=True):
                    assert got[d, t] == pytest.approx(a, abs=1e-6), (d, t)

    @pytest.mark.parametrize("baseline", ["group", "time_step", "step_group"])
    def test_ragged_turns_equal_dense_steps(self, baseline):
        """The discounted per-turn return on ragged turns gives what the same rewards give on
        dense steps: the token sequences change nothing."""
        lengths, rewards, tasks = random_dialogs(7)
        kw = dict(prompt_key="task", estimator=RewardToGo(0.9, baseline=baseline))
        ragged = advantages(MCAdvantage(4, **kw).inv(dialogs(lengths, rewards, tasks)))
        dense = dialogs(lengths, rewards, tasks).exclude("tokens").contiguous()
        assert advantages(MCAdvantage(4, **kw).inv(dense)) == pytest.approx(ragged, abs=1e-12)

    def test_step_norm_divides_by_the_turns(self):
        lengths, rewards, tasks = random_dialogs(3)
        data = dialogs(lengths, rewards, tasks)
        plain = advantages(MCAdvantage(4, prompt_key="task", trajectory_return="last").inv(data))
        normed = MCAdvantage(
            4, prompt_key="task", trajectory_return="last", estimator=GroupRelative(step_norm=True)
        )
        got = advantages(normed.inv(dialogs(lengths, rewards, tasks)))
        for (d, t), a in plain.items():
            assert got[d, t] == pytest.approx(a / lengths[d], abs=1e-6)


class TestSingleTurn:
    @pytest.mark.parametrize("seed", range(4))
    def test_every_step_wise_estimator_is_plain_grpo(self, seed):
        """On dialogs of one turn, broadcast, per_step (any discount) and the time-step baseline
        give plain GRPO's advantages."""
        rng = random.Random(seed)
        tasks = [g for g in range(3) for _ in range(4)]
        rewards = [[rng.choice([0.0, 1.0, 2.0])] for _ in tasks]
        lengths = [1] * len(tasks)
        want = advantages(
            MCAdvantage(4, prompt_key="task", trajectory_return="sum").inv(
                dialogs(lengths, rewards, tasks)
            )
        )
        for kw in (
            {"trajectory_return": "last"},
            {"estimator": RewardToGo(0.7, "step_group")},
            {"estimator": RewardToGo(1.0, "time_step")},
            {"estimator": RewardToGo(0.0)},
        ):
            got = MCAdvantage(4, prompt_key="task", **kw).inv(dialogs(lengths, rewards, tasks))
            assert advantages(got) == pytest.approx(want, abs=1e-9), kw

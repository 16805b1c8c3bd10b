"""examples/pendulum_grpo.py (docs/your_own_task.rst, Pendulum), on a budget of one batch.

64 sub-envs play 200 steps each: at 12,800 environment steps the first 64 episodes end together,
MCAdvantage releases their 8 groups and the script trains on them once. The tests read what
reached the loss and the RESULT line.
"""

import re
from pathlib import Path

import pytest
import torch
from helpers.examples import load_example

ROOT = Path(__file__).resolve().parents[1]
RESULT = re.compile(
    r"^RESULT solved=(true|false) wall_s=\d+\.\d\d env_steps=(\d+) return=(-?\d+\.\d)$", re.M
)
ONE_BATCH = ["--max-env-steps", "12800"]


@pytest.fixture(scope="module")
def pendulum():
    path = ROOT / "examples" / "pendulum_grpo.py"
    return load_example(path, "pendulum_grpo")


def run(pendulum, monkeypatch, capsys, argv):
    """main(argv), the batches that reached the loss, and the RESULT line's fields."""
    trained = []
    original = pendulum.train

    def train(buffer, loss_fn, optimizer):
        trained.append(buffer[:].clone())
        original(buffer, loss_fn, optimizer)

    monkeypatch.setattr(pendulum, "train", train)
    result = pendulum.main(argv)
    match = RESULT.search(capsys.readouterr().out)
    assert match is not None, "no well-formed RESULT line"
    return result, trained, match


def test_groups_reach_the_loss(pendulum, monkeypatch, capsys):
    """One training batch of 8 complete groups: 8 episodes of 200 steps per seed, one start per
    seed, and time-step advantages that sum to 0 over a group at every time step."""
    result, trained, match = run(pendulum, monkeypatch, capsys, ONE_BATCH)
    assert result["env_steps"] == int(match[2]) == 12800
    assert match[1] == str(result["solved"]).lower()
    assert -3300.0 <= result["return"] <= 0.0  # greedy, 100 fresh starts (-16.3 a step at most)
    assert -3300.0 <= result["train_return"] <= -300.0  # one batch of an untrained policy
    assert len(trained) == 1
    batch = trained[0].reshape(64, 200)  # released trajectory by trajectory, each whole
    done = batch["next", "done"].squeeze(-1)
    assert done[:, -1].all() and not done[:, :-1].any()
    seeds = batch["reset_seed"]
    assert (seeds == seeds[:, :1]).all()  # one seed per episode
    order = seeds[:, 0].argsort(stable=True)
    grouped = batch[order].reshape(8, 8, 200)  # (group, episode, time step)
    group_seeds = grouped["reset_seed"][..., 0]
    assert (group_seeds == group_seeds[:, :1]).all() and group_seeds[:, 0].unique().numel() == 8
    first = grouped["observation"][:, :, 0]
    torch.testing.assert_close(first, first[:, :1].expand_as(first))  # same start per group
    advantage = grouped["advantage"].squeeze(-1)
    torch.testing.assert_close(advantage.sum(1), torch.zeros(8, 200), atol=1e-4, rtol=0)
    assert advantage.std() > 0.5  # normalized by the group's spread, not all zero


def test_solved_path_and_other_modes(pendulum, monkeypatch, capsys):
    """A reachable target stops the run at the first batch (greedy evaluation included); the
    episode-return mode writes one advantage per episode; the TanhNormal actor runs."""
    argv = ONE_BATCH + ["--target", "-5000", "--baseline", "episode", "--dist", "tanh"]
    result, trained, match = run(pendulum, monkeypatch, capsys, argv + ["--state-std"])
    assert result["solved"] is True and match[1] == "true"
    assert result["env_steps"] == 12800 and float(match[3]) == pytest.approx(result["return"], 0.1)
    advantage = trained[0].reshape(64, 200)["advantage"].squeeze(-1)
    assert (advantage == advantage[:, :1]).all()
    assert (trained[0]["action"].abs() <= 2.0).all()  # TanhNormal: inside [-2, 2]

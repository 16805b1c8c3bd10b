"""Tests of examples/cartpole_grpo.py: grouped episodes, and the whole demo on a tiny budget."""

from __future__ import annotations

import csv
import os
import re
import subprocess
import sys
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest
import torch
from helpers.examples import load_example
from tensordict import TensorDict
from torchrl.collectors import Collector
from torchrl.envs import ExplorationType, GymWrapper

from torchrl_grpo import evaluate
from torchrl_grpo.checkpoint import load_checkpoint

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "cartpole_grpo.py"
RESULT = re.compile(
    r"^RESULT solved=(true|false) wall_s=(\d+\.\d+) env_steps=(\d+) eval_return=(\d+\.\d+)$"
)


@pytest.fixture(scope="module")
def example():
    return load_example(EXAMPLE, "cartpole_grpo")


def greedy_returns_by_hand(actor, seeds) -> list[float]:
    """The slow reference: one gymnasium episode per seed, actions by argmax of the logits."""
    returns = []
    for seed in seeds:
        env = gym.make("CartPole-v1")
        obs, _ = env.reset(seed=seed)
        total, ended = 0.0, False
        while not ended:
            with torch.no_grad():
                logits = actor.module[0](TensorDict(observation=torch.as_tensor(obs)))["logits"]
            obs, reward, terminated, truncated, _ = env.step(int(logits.argmax()))
            total, ended = total + reward, terminated or truncated
        returns.append(total)
    return returns


class TestEnvironments:
    def test_collector_groups_share_their_reset_state(self, example):
        # 3 sub-envs, groups of 4: the collector refills sub-envs as episodes end
        env = example.make_env(3, range(11, 100), group_size=4)
        torch.manual_seed(0)
        collector = Collector(
            env,
            example.make_actor(hidden=8),
            frames_per_batch=30,
            total_frames=-1,
            trajs_per_batch=10,
            traj_format="cat",
            exploration_type=ExplorationType.RANDOM,
        )
        steps = next(iter(collector))
        collector.shutdown()

        done = steps["next", "done"].squeeze(-1)
        assert done[-1] and int(done.sum()) == 10  # flat, each episode ends with done
        ends = done.nonzero().squeeze(-1)
        starts = torch.cat([ends.new_zeros(1), ends[:-1] + 1])
        episode_seeds = steps["reset_seed"][starts]
        for start, end in zip(starts.tolist(), ends.tolist()):  # one seed per episode
            assert (steps["reset_seed"][start : end + 1] == steps["reset_seed"][start]).all()
        counts = torch.bincount(episode_seeds - 11)
        assert counts.max() <= 4 and (episode_seeds >= 11).all()
        for seed in episode_seeds.unique().tolist():  # each starts where gymnasium puts it
            expected = torch.as_tensor(gym.make("CartPole-v1").reset(seed=seed)[0])
            first_obs = steps["observation"][starts[episode_seeds == seed]]
            torch.testing.assert_close(first_obs, expected.expand_as(first_obs))

    def test_evaluate_matches_gymnasium_by_hand(self, example):
        torch.manual_seed(0)
        actor = example.make_actor(hidden=8)
        with torch.no_grad():  # lean on the pole's angular velocity: episodes of varied length
            actor.module[0].module[-1].weight[:, 3] += torch.tensor([-3.0, 3.0])
        env = example.EvalEpisodes(5, range(40, 50))
        first = example.evaluate(env, actor)
        second = example.evaluate(env, actor)  # the next 5 fresh seeds
        env.close()
        by_hand = greedy_returns_by_hand(actor, range(40, 50))
        assert len(set(by_hand)) > 2  # the episodes differ, so the mean tests the bookkeeping
        assert first == pytest.approx(sum(by_hand[:5]) / 5)
        assert second == pytest.approx(sum(by_hand[5:]) / 5)

    def test_evaluate_matches_torchrl_grpo_evaluate(self, example):
        """The demo's own loop plays the episodes that torchrl_grpo.evaluate plays through
        torchrl (the actor's mode, each episode to its end), 10x faster."""
        torch.manual_seed(0)
        actor = example.make_actor(hidden=8)
        with torch.no_grad():
            actor.module[0].module[-1].weight[:, 3] += torch.tensor([-3.0, 3.0])
        episodes = example.EvalEpisodes(5, range(40, 45))
        demo = example.episode_returns(episodes, actor)
        episodes.close()
        env = GymWrapper(example.CartPoles(5), categorical_action_encoding=True)
        played = evaluate(env, actor, 5, reset_kwargs={"seed": list(range(40, 45))})
        assert len(set(demo.tolist())) > 2
        assert played.returns.tolist() == demo.tolist()


class TestCartPoles:
    """The demo's numpy-vectorized CartPole: CartPole-v1's episodes, torchrl's resets."""

    def test_same_episodes_as_gymnasium(self, example):
        """Seeded sub-envs start, step, end and truncate as ``gym.make("CartPole-v1")``."""
        seeds = [3, 17, 40]
        env = example.CartPoles(3)
        obs, _ = env.reset(seed=seeds)
        singles = [gym.make("CartPole-v1") for _ in seeds]
        firsts = [g.reset(seed=s)[0] for g, s in zip(singles, seeds)]
        torch.testing.assert_close(torch.as_tensor(obs), torch.as_tensor(np.stack(firsts)))
        rng = torch.Generator().manual_seed(0)
        running = [True] * 3
        for _ in range(200):
            action = torch.randint(0, 2, (3,), generator=rng).numpy()
            obs, reward, terminated, truncated, _ = env.step(action)
            for i, single in enumerate(singles):
                if not running[i]:
                    continue
                o, r, te, tr, _ = single.step(int(action[i]))
                torch.testing.assert_close(torch.as_tensor(obs[i]), torch.as_tensor(o))
                assert (reward[i], terminated[i], truncated[i]) == (r, te, tr)
                running[i] = not (te or tr)
        assert not any(running)  # random actions end every episode within 200 steps

    def test_partial_reset_and_no_autoreset(self, example):
        env = example.CartPoles(2)
        env.reset(seed=[1, 2])
        for _ in range(60):  # long enough for both to fall; they are not restarted
            obs, *_ = env.step(torch.zeros(2, dtype=torch.long).numpy())
        mask = torch.tensor([True, False]).numpy()
        after, _ = env.reset(seed=[5, None], options={"reset_mask": mask})
        assert torch.equal(torch.as_tensor(after[1]), torch.as_tensor(obs[1]))  # untouched
        start = gym.make("CartPole-v1").reset(seed=5)[0]
        torch.testing.assert_close(torch.as_tensor(after[0]), torch.as_tensor(start))
        assert env.steps.tolist()[0] == 0 and env.steps.tolist()[1] == 60


class TestGreedyReturn:
    """The stopping rule: 20 episodes screen, 100 more confirm with a lower confidence bound."""

    @pytest.fixture
    def played(self, example, monkeypatch):
        played = []

        def fake_returns(env, actor):  # the "env" is the list of returns it would play
            played.append(env)
            return torch.tensor(env, dtype=torch.float32)

        monkeypatch.setattr(example, "episode_returns", fake_returns)
        return played

    def test_below_the_target_needs_no_confirmation(self, example, played):
        screen, confirm = [474.0] * 20, [500.0] * 100
        assert example.greedy_return(None, screen, confirm, 475.0) == (474.0, False)
        assert played == [screen]  # the confirmation episodes were not played

    def test_confirmed_by_the_lower_bound(self, example, played):
        screen = [500.0] * 20
        steady = [490.0, 480.0] * 50  # mean 485, std 5.03: 485 - 2 * 0.503 >= 475
        assert example.greedy_return(None, screen, steady, 475.0) == (485.0, True)
        shaky = [500.0] * 90 + [270.0] * 10  # mean 477, std 69.3: 477 - 2 * 6.93 < 475
        mean, solved = example.greedy_return(None, screen, shaky, 475.0)
        assert mean == pytest.approx(477.0) and not solved
        assert played == [screen, steady, screen, shaky]

    def test_without_confirmation_the_screen_decides(self, example, played):
        assert example.greedy_return(None, [475.0] * 20, None, 475.0) == (475.0, True)


def pending_seeds(transform_state: dict) -> set:
    """The ids of the groups pending in a buffer's saved transform state (``transform.t``)."""
    from torchrl.data import LazyTensorStorage, ReplayBuffer

    from torchrl_grpo import MCAdvantage

    advantage = MCAdvantage(4, prompt_key="reset_seed", reward_to_go_gamma=0.99)
    rb = ReplayBuffer(storage=LazyTensorStorage(10)).append_transform(advantage)
    rb.transform.load_state_dict(transform_state)
    return set(advantage.queues)


class TestCartPoleDemo:
    def test_tiny_budget_run(self, example, tmp_path):
        # one small batch (8 episodes: 2 seeds x 4, on 8 sub-envs), then the step budget stops it
        cmd = [sys.executable, str(EXAMPLE), "--layout", "episodes"]
        cmd += ["--groups", "2", "--group-size", "4"]
        cmd += ["--num-envs", "8", "--frames-per-batch", "64", "--eval-episodes", "4"]
        cmd += ["--confirm-episodes", "8"]
        cmd += ["--max-env-steps", "1", "--output-dir", str(tmp_path), "--no-progress"]
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        }
        proc = subprocess.run(
            cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        # quiet: no torchrl INFO line, no warning (the progress bar is off here)
        assert "[torchrl][INFO]" not in proc.stdout + proc.stderr
        assert "Warning" not in proc.stderr, proc.stderr[-3000:]

        last = proc.stdout.strip().splitlines()[-1]
        match = RESULT.match(last)
        assert match, f"no RESULT line at the end of stdout: {last!r}"
        solved, wall_s, env_steps, eval_return = match.groups()
        env_steps = int(env_steps)
        # every poll steps the 8 sub-envs 8 times; 8 episodes end within 500 steps of each sub-env
        assert env_steps % 64 == 0 and 64 <= env_steps <= 8 * 500 + 64
        assert 0.0 < float(eval_return) <= 500.0
        assert 0.0 < float(wall_s) < 300.0
        assert solved == "false" or float(eval_return) >= 475.0  # solved: confirmed at 475

        (run_dir,) = tmp_path.glob("seed0-*")  # a fresh folder per run
        assert f"outputs: {run_dir}" in proc.stdout
        assert all(any(p.iterdir()) for p in run_dir.rglob("*") if p.is_dir())  # no empty folder
        assert (run_dir / "returns.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert set(torch.load(run_dir / "policy.pt")) == set(example.make_actor(64).state_dict())
        with open(run_dir / "scalars" / "train" / "return.csv") as f:
            rows = list(csv.reader(f))
        assert len(rows) == 1 and int(rows[0][0]) == env_steps  # one batch, logged at its steps
        # the batch's 8 episodes: each at least 8 steps, all of them among the steps played
        assert 8.0 <= float(rows[0][1]) <= env_steps / 8
        with open(run_dir / "scalars" / "eval" / "return.csv") as f:
            assert f"{float(next(csv.reader(f))[1]):.1f}" == eval_return  # as RESULT rounds it
        assert (run_dir / "scalars" / "train" / "loss_objective.csv").exists()

    def test_resume_goes_on_from_the_checkpoint(self, example, tmp_path):
        """N batches, a checkpoint, a fresh main() resuming it: the counters, curves and logs go
        on, every group pending at the checkpoint is released, a resume with nothing more to do
        leaves the policy exactly as saved, and settings that shape the data are refused."""
        small = ["--num-envs", "16", "--groups", "4", "--group-size", "4"]
        small += ["--frames-per-batch", "256", "--minibatch-size", "256", "--eval-episodes", "4"]
        small += ["--confirm-episodes", "0", "--time-budget", "1e9", "--target-return", "1e9"]
        small += ["--logger", "csv", "--no-progress"]

        def run(out, *args):
            example.main([*small, "--output-dir", str(tmp_path / out), *args])
            (run_dir,) = (tmp_path / out).glob("seed0-*")
            return run_dir

        def state(run_dir):
            saved = load_checkpoint(run_dir / "checkpoint", weights_only=False)
            assert saved.stamp == saved.values["state"]["progress"]["iterations"]
            return saved.values["state"]

        first = run("first", "--max-iterations", "2", "--checkpoint-every", "1")
        saved = state(first)
        assert saved["progress"]["iterations"] == 2
        assert sorted(p.name for p in first.iterdir() if "checkpoint" in p.name) == ["checkpoint"]
        second = run("second", "--max-iterations", "4", "--resume", str(first))
        state = state(second)
        progress = state["progress"]
        assert progress["iterations"] == 4 and len(progress["evals"]) == 4
        assert progress["env_steps"] > saved["progress"]["env_steps"]
        assert progress["history"][:2] == saved["progress"]["history"]
        with open(second / "scalars" / "train" / "return.csv") as f:  # the logger's steps go on
            steps = [int(row[0]) for row in csv.reader(f)]
        assert len(steps) == 2 and steps[0] > saved["progress"]["env_steps"]
        # each group pending at the checkpoint was released after the resume, or still has an
        # episode being played (its seed replayed, an episode of up to 500 steps)
        pending = pending_seeds(torch.load(first / "checkpoint" / "buffer" / "transform.t"))
        waiting = pending_seeds(torch.load(second / "checkpoint" / "buffer" / "transform.t"))
        playing = state["env"]["_extra_state"]
        assert pending and pending - waiting  # some released since
        assert pending & waiting <= set(playing["running"]) | set(playing["replays"])

        same = run("same", "--max-iterations", "2", "--resume", str(first))
        policy, resumed = torch.load(first / "policy.pt"), torch.load(same / "policy.pt")
        assert all(torch.equal(policy[k], resumed[k]) for k in policy)  # nothing trained: exact

        with pytest.raises(SystemExit, match="--group-size 4"):
            example.main([*small, "--group-size", "8", "--resume", str(first)])
        (first / "checkpoint" / "state.pt").write_bytes(b"")  # truncated: refused, named
        with pytest.raises(SystemExit, match=r"piece 'state' cannot be read .*state.pt: 0 bytes"):
            example.main([*small, "--resume", str(first)])

    def test_zero_epochs_plays_and_logs_without_a_loss(self, example, tmp_path):
        # issue 13: --epochs 0 died with a NameError when logging the loss it never computed
        result = example.main(
            ["--layout", "episodes", "--epochs", "0", "--groups", "2", "--group-size", "4"]
            + ["--num-envs", "8"]
            + ["--frames-per-batch", "64", "--eval-episodes", "4", "--max-env-steps", "1"]
            + ["--output-dir", str(tmp_path), "--no-progress"]
        )
        assert result["env_steps"] >= 64 and 0.0 < result["eval_return"] <= 500.0
        (run_dir,) = tmp_path.glob("seed0-*")
        scalars = run_dir / "scalars"
        assert (scalars / "train" / "return.csv").exists()
        assert (scalars / "eval" / "return.csv").exists()
        assert not (scalars / "train" / "loss_objective.csv").exists()  # nothing was optimized

    def test_on_device(self, example, tmp_path, device):
        """--device: policy, env outputs, buffer and loss on ``device``; the saved policy on the
        CPU (loads anywhere without map_location)."""
        result = example.main(
            ["--device", str(device), "--layout", "episodes", "--groups", "2", "--group-size", "4"]
            + ["--num-envs", "8"]
            + ["--frames-per-batch", "64", "--eval-episodes", "4", "--max-env-steps", "1"]
            + ["--confirm-episodes", "0", "--output-dir", str(tmp_path), "--no-progress"]
        )
        assert result["env_steps"] >= 64 and 0.0 < result["eval_return"] <= 500.0
        (run_dir,) = tmp_path.glob("seed0-*")
        saved = torch.load(run_dir / "policy.pt", weights_only=True)
        assert {v.device.type for v in saved.values()} == {"cpu"}
        assert (run_dir / "scalars" / "train" / "loss_objective.csv").exists()  # optimized

    def test_stream_layout_joins_episodes_across_batches(self, example, tmp_path):
        """--layout stream: batches of 8 steps of each of 8 sub-envs, so every episode longer
        than 8 steps crosses batches; MCAdvantage joins them, and training waits for 2 whole
        groups of 4."""
        result = example.main(
            ["--layout", "stream", "--frames-per-batch", "64", "--num-envs", "8"]
            + ["--groups", "2", "--group-size", "4"]
            + ["--eval-episodes", "4", "--confirm-episodes", "0"]
            + ["--max-env-steps", "640", "--output-dir", str(tmp_path), "--no-progress"]
        )
        env_steps = result["env_steps"]
        assert env_steps % 64 == 0 and 640 <= env_steps < 640 + 64  # whole batches, then stop
        (run_dir,) = tmp_path.glob("seed0-*")
        with open(run_dir / "scalars" / "train" / "return.csv") as f:
            trained = [(int(steps), float(ret)) for steps, ret in csv.reader(f)]
        with open(run_dir / "scalars" / "eval" / "return.csv") as f:
            evaluated = [int(steps) for steps, _ in csv.reader(f)]
        # a batch that did not complete a training batch of 2 groups neither trains nor
        # evaluates; one that did, does both
        assert 1 <= len(trained) < env_steps // 64 and [s for s, _ in trained] == evaluated
        assert all(s % 64 == 0 and s <= env_steps for s, _ in trained)
        # the released episodes are whole: their mean length (CartPole pays 1 a step) exceeds
        # the 8 steps of a sub-env a batch holds, so they were joined across batches
        assert sum(r for _, r in trained) / len(trained) > 8.0
        assert (run_dir / "scalars" / "train" / "loss_objective.csv").exists()

    def test_missing_logger_package_is_a_clear_error(self, example, tmp_path, monkeypatch):
        def no_tensorboard(*args, **kwargs):
            raise ImportError("torch.utils.tensorboard could not be imported")

        monkeypatch.setattr(example, "get_logger", no_tensorboard)
        with pytest.raises(SystemExit, match=r"--logger tensorboard needs .*\[tensorboard\]"):
            example.main(["--logger", "tensorboard", "--output-dir", str(tmp_path)])

    def test_help_documents_every_setting(self, example, capsys):
        with pytest.raises(SystemExit):
            example.parse_args(["--help"])
        text = capsys.readouterr().out
        for flag in ("--seed", "--group-size", "--groups", "--epochs", "--lr", "--time-budget"):
            assert re.search(rf"{flag} \S+\s+\w", text), f"{flag} is not documented"
        assert "--output-dir" in text and "--logger" in text


class TestAcrobot:
    """examples/acrobot_grpo.py, the recipe of docs/your_own_task.rst."""

    @pytest.fixture(scope="class")
    def acrobot(self):
        path = ROOT / "examples" / "acrobot_grpo.py"
        return load_example(path, "acrobot_grpo")

    def test_trains_on_released_groups(self, acrobot):
        """A budget that lets one training batch of 64 episodes complete: it trains on them and
        reports their mean return (Acrobot: minus the episode's length, at most 500)."""
        result = acrobot.main(["--max-env-steps", "40000"])
        assert 32 * 32 <= result["env_steps"] <= 40000 + 32 * 32
        assert -500.0 <= result["return"] < 0.0  # trained at least once (nan before)
        assert result["solved"] is (result["return"] >= -100.0)
        assert -500.0 <= result["eval_return"] < 0.0  # 100 greedy episodes, each to its end

    def test_reward_to_go_mode(self, acrobot):
        result = acrobot.main(["--max-env-steps", "40000", "--reward-to-go", "0.99"])
        assert -500.0 <= result["return"] < 0.0

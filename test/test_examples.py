"""Tests of examples/cartpole_grpo.py: grouped episodes, and the whole demo on a tiny budget."""

from __future__ import annotations

import csv
import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import gymnasium as gym
import pytest
import torch
from torchrl.envs import ExplorationType, set_exploration_type

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "cartpole_grpo.py"
RESULT = re.compile(
    r"^RESULT solved=(true|false) wall_s=(\d+\.\d+) env_steps=(\d+) eval_return=(\d+\.\d+)$"
)


@pytest.fixture(scope="module")
def example():
    spec = importlib.util.spec_from_file_location("cartpole_grpo", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class TestPlayEpisodes:
    def test_groups_share_their_reset_state(self, example):
        # 7 episodes on 3 sub-envs: the seed queue refills sub-envs as episodes end
        seeds = [11, 11, 11, 11, 29, 29, 29]
        env = example.make_env(3)
        torch.manual_seed(0)
        actor = example.make_actor(hidden=8)
        with set_exploration_type(ExplorationType.RANDOM):
            steps = example.play_episodes(env, actor, seeds)
        env.close()

        done = steps["next", "done"].squeeze(-1)
        assert done[-1] and int(done.sum()) == len(seeds)  # flat, each episode ends with done
        ends = done.nonzero().squeeze(-1)
        starts = torch.cat([ends.new_zeros(1), ends[:-1] + 1])
        episode_seeds = steps["seed"][starts]
        assert sorted(episode_seeds.tolist()) == sorted(seeds)
        for start, end in zip(starts.tolist(), ends.tolist()):  # one seed per episode
            assert (steps["seed"][start : end + 1] == steps["seed"][start]).all()
        for seed in set(seeds):  # every episode of a seed starts where gymnasium's reset puts it
            expected = torch.as_tensor(gym.make("CartPole-v1").reset(seed=seed)[0])
            first_obs = steps["observation"][starts[episode_seeds == seed]]
            torch.testing.assert_close(first_obs, expected.expand_as(first_obs))
        lengths = ends - starts + 1
        assert torch.equal(steps["next", "reward"].sum().long(), lengths.sum())


class TestCartPoleDemo:
    def test_tiny_budget_run(self, example, tmp_path):
        # one small batch (2 seeds x 4 episodes on 8 sub-envs), then the step budget stops it
        cmd = [sys.executable, str(EXAMPLE), "--groups", "2", "--group-size", "4"]
        cmd += ["--num-envs", "8", "--eval-episodes", "4", "--max-env-steps", "1"]
        cmd += ["--output-dir", str(tmp_path), "--no-progress"]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr[-3000:]

        last = proc.stdout.strip().splitlines()[-1]
        match = RESULT.match(last)
        assert match, f"no RESULT line at the end of stdout: {last!r}"
        solved, wall_s, env_steps, eval_return = match.groups()
        env_steps = int(env_steps)
        assert 8 * 8 <= env_steps <= 8 * 500  # 8 episodes, each 8 to 500 steps long
        assert 0.0 < float(eval_return) <= 500.0
        assert 0.0 < float(wall_s) < 300.0
        assert (solved == "true") == (float(eval_return) >= 475.0)

        (run_dir,) = tmp_path.glob("seed0-*")  # a fresh folder per run
        assert f"outputs: {run_dir}" in proc.stdout
        assert (run_dir / "returns.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert set(torch.load(run_dir / "policy.pt")) == set(example.make_actor(64).state_dict())
        with open(run_dir / "scalars" / "train" / "return.csv") as f:
            rows = list(csv.reader(f))
        assert len(rows) == 1 and int(rows[0][0]) == env_steps  # one batch, logged at its steps
        assert float(rows[0][1]) == pytest.approx(env_steps / 8)  # mean return = steps / episodes
        with open(run_dir / "scalars" / "eval" / "return.csv") as f:
            assert float(next(csv.reader(f))[1]) == pytest.approx(float(eval_return), abs=0.05)

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

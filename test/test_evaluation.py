"""Tests of torchrl_grpo.evaluation: every episode played to its own end, counted once.

The envs (``helpers.envs``) are MountainCar reduced to its bookkeeping: sub-env ``b`` plays
episodes of ``LENGTHS[b][k]`` steps, each step paying ``1 + action`` and the goal 10 more, so
every return and length below is written out by hand. The greedy actor plays 0.5 throughout:
an episode of ``L`` steps returns ``1.5 L + 10``.
"""

from __future__ import annotations

import sys
import types

import gymnasium as gym
import pytest
import torch
from helpers.envs import (
    Countdown,
    batched_countdown,
    countdown_return,
    gaussian_actor,
    vector_countdown,
)
from tensordict.nn import TensorDictModule
from torchrl.envs import ExplorationType, GymEnv, GymWrapper, TransformedEnv, set_exploration_type

from torchrl_grpo import Evaluation, SameStartGroups, evaluate

# sub-env 0 plays episodes of 2 then 4 steps, sub-env 1 of 5 then 6, sub-env 2 of 3 then 1
LENGTHS = [[2, 4], [5, 6], [3, 1]]
# Seven episodes, in the order they start: the first three at step 0; then sub-env 0's second
# at step 2 (4 steps), sub-env 2's second at 3 (1 step), its third at 4 (3 steps), sub-env 1's
# second at 5 (6 steps). At step 6 sub-env 0 starts an eighth, not counted; the last ends at 11.
SEVEN = [2, 5, 3, 4, 1, 3, 6]


def returns_of(lengths, action=0.5) -> torch.Tensor:
    return torch.tensor([countdown_return(n, action) for n in lengths], dtype=torch.float64)


def assert_episodes(result: Evaluation, lengths):
    assert result.lengths.tolist() == lengths
    torch.testing.assert_close(result.returns, returns_of(lengths))
    assert result.terminated.all() and not result.truncated.any()  # all reached the goal


class TestMountainCarLike:
    """A vector env without auto-reset (the recipe of docs/your_own_task.rst), sub-envs that
    end at different steps: torchrl's rollout misreads it, evaluate does not."""

    def test_rollout_stops_every_episode_at_the_first_goal(self):
        env = vector_countdown([[2], [5], [3]])
        with torch.no_grad(), set_exploration_type(ExplorationType.DETERMINISTIC):
            steps = env.rollout(100, gaussian_actor())
        assert steps.shape == (3, 2)  # stopped when sub-env 0 reached its goal
        ended = steps["next", "done"].any(1).squeeze(-1)
        returns = steps["next", "reward"].sum(1).squeeze(-1)
        assert ended.tolist() == [True, False, False]  # "33% success"
        assert returns.tolist() == [13.0, 3.0, 3.0]  # mean 6.33, where the truth is 15
        with pytest.raises(AssertionError):  # break_when_all_done: gymnasium's own assert
            env.rollout(100, gaussian_actor(), break_when_any_done=False, break_when_all_done=True)

    def test_evaluate_plays_each_to_its_end(self):
        result = evaluate(vector_countdown([[2], [5], [3]]), gaussian_actor(), 3)
        assert_episodes(result, [2, 5, 3])
        assert result.mean_return == pytest.approx(15.0)  # (13 + 17.5 + 14.5) / 3
        assert result.success_rate() == 1.0 and result.seeds is None

    def test_more_episodes_than_sub_envs(self):
        assert_episodes(evaluate(vector_countdown(LENGTHS), gaussian_actor(), 7), SEVEN)

    def test_fewer_episodes_than_sub_envs(self):
        # sub-env 2's first episode is not one of the two: its 3 steps are never counted
        assert_episodes(evaluate(vector_countdown(LENGTHS), gaussian_actor(), 2), [2, 5])

    def test_simultaneous_ends_start_in_index_order(self):
        # sub-envs 0 and 2 end together at step 2 with one episode left to count: sub-env 0's
        # (2 steps) counts, sub-env 2's (9 steps) does not
        env = vector_countdown([[2, 2], [5], [2, 9]])
        assert_episodes(evaluate(env, gaussian_actor(), 4), [2, 5, 2, 2])

    def test_max_steps_cuts_an_episode(self):
        # sub-env 0's episodes of 5 steps are cut at 3 (truncated, no goal bonus); sub-env 1
        # plays its 2-step episodes; the four in start order: cut, goal, goal, cut
        result = evaluate(vector_countdown([[5], [2]]), gaussian_actor(), 4, max_steps=3)
        assert result.lengths.tolist() == [3, 2, 2, 3]
        assert result.truncated.tolist() == [True, False, False, True]
        assert result.terminated.tolist() == [False, True, True, False]
        assert result.returns.tolist() == [4.5, 13.0, 13.0, 4.5]
        assert result.success_rate() == 0.5 and result.success_rate(min_return=5.0) == 0.5


class TestBatches:
    def test_vector_env_that_resets_itself(self):
        env = vector_countdown(LENGTHS, autoreset=True)  # SAME_STEP: VecGymEnvTransform
        # torchrl played a few steps to read the env's info specs: seed 0 restarts every
        # sub-env from its first episode
        result = evaluate(env, gaussian_actor(), 7, reset_kwargs={"seed": [0, 0, 0]})
        assert_episodes(result, SEVEN)
        with pytest.raises(ValueError, match="restarts its sub-envs itself"):
            evaluate(env, gaussian_actor(), 7, max_steps=3)

    def test_serial_env(self):
        assert_episodes(evaluate(batched_countdown(LENGTHS), gaussian_actor(), 7), SEVEN)

    def test_parallel_env(self):
        # two worker processes: sub-env 0's second episode (4 steps) starts at step 2, sub-env
        # 1's (6 steps) at 5; sub-env 0's third, at 6, is not counted
        env = batched_countdown(LENGTHS[:2], parallel=True)
        result = evaluate(env, gaussian_actor(), 4)
        env.close()
        assert_episodes(result, [2, 5, 4, 6])

    def test_single_env(self):
        env = GymWrapper(Countdown([2, 4, 3]))  # batch size (): the episodes one after another
        assert_episodes(evaluate(env, gaussian_actor(), 4), [2, 4, 3, 2])

    def test_gym_env_with_num_envs(self):
        """torchrl's ``GymEnv(..., num_envs=2)`` (an auto-resetting async vector env): the two
        seeded episodes are the ones gymnasium plays from those seeds, one by one."""
        push = TensorDictModule(  # follow the pole's angular velocity: episodes of 176 and 192
            lambda obs: (obs[..., 3] > 0).long(), ["observation"], ["action"]
        )
        env = GymEnv("CartPole-v1", num_envs=2, categorical_action_encoding=True)
        result = evaluate(env, push, 2, reset_kwargs={"seed": 7})  # sub-env i: seed 7 + i
        env.close()
        by_hand = []
        for seed in (7, 8):
            single, steps, ended = gym.make("CartPole-v1"), 0, False
            obs, _ = single.reset(seed=seed)
            while not ended:
                obs, _, terminated, truncated, _ = single.step(int(obs[3] > 0))
                steps, ended = steps + 1, terminated or truncated
            by_hand.append(steps)
        assert result.lengths.tolist() == by_hand == [176, 192]
        assert result.returns.tolist() == [float(n) for n in by_hand]  # 1 a step


class TestSameStartGroups:
    def test_seeds_of_the_counted_episodes(self):
        # every sub-env reads its episode's length from its seed: episode of seed s lasts
        # TABLE[s]; the counted episodes take the first seeds, in order, whatever ends first
        table = [2, 5, 3, 1, 4, 2, 6, 3, 2, 2, 2, 2, 2, 2]
        base = vector_countdown([table] * 3)
        env = TransformedEnv(base, SameStartGroups(1))
        result = evaluate(env, gaussian_actor(), 6)
        assert result.seeds.tolist() == [0, 1, 2, 3, 4, 5]
        assert_episodes(result, table[:6])

    def test_groups(self):
        table = [2, 5, 3, 1, 4, 2, 6, 3] + [2] * 8
        env = TransformedEnv(vector_countdown([table] * 3), SameStartGroups(2))
        result = evaluate(env, gaussian_actor(), 5)
        assert result.seeds.tolist() == [0, 0, 1, 1, 2]
        assert_episodes(result, [2, 2, 5, 5, 3])


class TestExploration:
    def test_greedy_and_sampled(self):
        def play(exploration_type):
            torch.manual_seed(0)
            env = vector_countdown(LENGTHS)  # fresh: its episodes numbered from 0 again
            return evaluate(env, gaussian_actor(), 7, exploration_type=exploration_type)

        greedy = play(ExplorationType.DETERMINISTIC)  # the Gaussian's mean, 0.5, every step
        sampled, again = play(ExplorationType.RANDOM), play(ExplorationType.RANDOM)
        assert_episodes(greedy, SEVEN)
        assert sampled.lengths.tolist() == SEVEN  # the lengths do not depend on the actions
        assert (sampled.returns != greedy.returns).all()
        torch.testing.assert_close(sampled.returns, again.returns)
        # 33 steps of N(0.5, 0.3): the sum is within 3 standard deviations of the greedy one
        assert abs(sampled.returns.sum() - greedy.returns.sum()) < 3 * 0.3 * 33**0.5

    def test_random_actions(self):
        result = evaluate(vector_countdown(LENGTHS), None, 7)
        assert result.lengths.tolist() == SEVEN

    def test_progress_bar(self, capsys):
        result = evaluate(vector_countdown(LENGTHS), gaussian_actor(), 7, progress=True)
        assert_episodes(result, SEVEN)
        assert "7/7" in capsys.readouterr().err


class TestEvaluation:
    def test_statistics(self):
        result = evaluate(vector_countdown(LENGTHS), gaussian_actor(), 7)
        expected = returns_of(SEVEN)
        assert result.num_episodes == 7
        assert result.mean_return == pytest.approx(float(expected.mean()))
        assert result.std_return == pytest.approx(float(expected.std()))  # Bessel's
        assert result.mean_length == pytest.approx(24 / 7)
        assert result.success_rate(min_return=15.0) == pytest.approx(3 / 7)  # 17.5, 15.5, 19
        one = evaluate(vector_countdown(LENGTHS), gaussian_actor(), 1)
        assert one.std_return != one.std_return  # nan: no spread from one episode


class TestErrors:
    @pytest.mark.parametrize("count", [0, -1, True, 2.5, "3"])
    def test_num_episodes(self, count):
        with pytest.raises(ValueError, match=f"num_episodes must be an integer.*{count!r}"):
            evaluate(vector_countdown(LENGTHS), gaussian_actor(), count)

    @pytest.mark.parametrize("limit", [0, -3, float("inf"), True])
    def test_max_steps_that_never_ends(self, limit):
        with pytest.raises(ValueError, match=f"max_steps must be.*{limit!r}.*never end"):
            evaluate(vector_countdown(LENGTHS), gaussian_actor(), 3, max_steps=limit)

    def test_policy_without_the_action(self):
        policy = TensorDictModule(lambda obs: obs, ["observation"], ["move"])
        with pytest.raises(KeyError, match=r"no action \['action'\].*'move'"):
            evaluate(vector_countdown(LENGTHS), policy, 3)

    def test_policy_that_is_not_a_tensordict_module(self):
        def policy(td):  # returns the action, not the tensordict
            return td["observation"] * 0

        with pytest.raises(TypeError, match="must read and return a TensorDict.*got Tensor"):
            evaluate(vector_countdown(LENGTHS), policy, 3)

    def test_env_without_done_keys(self):
        env = types.SimpleNamespace(done_keys=[], full_done_spec={}, batch_size=torch.Size([]))
        with pytest.raises(ValueError, match="evaluate needs an env with done keys"):
            evaluate(env, gaussian_actor(), 3)

    def test_exploration_type(self):
        with pytest.raises(ValueError, match="exploration_type must be.*'random'"):
            evaluate(vector_countdown(LENGTHS), gaussian_actor(), 3, exploration_type="random")

    def test_progress_without_tqdm(self, monkeypatch):
        monkeypatch.setitem(sys.modules, "tqdm", None)  # import tqdm raises ImportError
        with pytest.raises(ImportError, match="pip install tqdm"):
            evaluate(vector_countdown(LENGTHS), gaussian_actor(), 3, progress=True)

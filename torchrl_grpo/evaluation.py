"""Evaluation that counts every episode: a policy's return over N whole episodes of a torchrl env.

torchrl's ``env.rollout(max_steps, policy)`` stops a batched env at the first ``done`` of any
sub-env (``break_when_any_done=True``, its default): on a batch whose episodes end at different
steps, every other episode is cut there, its return partial and its goal never reached. A
MountainCarContinuous policy whose 20 episodes all reach the goal, with a mean return of 95.5,
reads 5% success and a mean return of 0.8 that way (``docs/your_own_task.rst``, "Evaluating a
policy"). ``break_when_all_done=True`` skips the steps of the finished sub-envs with a
``"_step"`` mask, which torchrl's ``SerialEnv`` and ``ParallelEnv`` honour and a gymnasium vector
env behind ``GymWrapper`` does not (gymnasium asserts that a finished sub-env was reset).
:func:`evaluate` plays each episode to its own end instead, on any torchrl env, and returns each
episode's return and length (:class:`Evaluation`).

Decisions, in one place:

* **Which episodes count.** The first ``num_episodes`` episodes *started*: at the first reset,
  sub-envs ``0 .. num_episodes - 1`` (in index order, flattened over the batch); then each time a
  counted episode ends, the episode its sub-env starts next counts while fewer than
  ``num_episodes`` have started (sub-envs that end together served in index order). Whether an
  episode counts is decided when it starts, never by when it ends, so short episodes are not
  favoured (counting the first N to *end* would be), and the evaluation waits until every
  counted episode has ended.
* **Finished sub-envs are reset, as torchrl does.** Every step is
  ``env.step_and_maybe_reset``: a sub-env whose episode ended starts a new one (torchrl's
  partial reset with ``"_reset"``, or the vector env's own auto-reset); once ``num_episodes``
  have started, those new episodes are played but not counted. A sub-env is never stepped past
  its ``done`` (a gymnasium vector env without auto-reset refuses it). Under
  :class:`~torchrl_grpo.SameStartGroups`, the uncounted episodes take seeds from its queue too;
  the counted ones take the first ``num_episodes`` seeds after the first reset, in order, and
  :attr:`Evaluation.seeds` names them.
* **Ends.** An episode ends when any of the env's done keys is set for its sub-env (a
  terminal state, or a time limit: gymnasium's ``truncated``, torchrl's ``StepCounter``), or
  when it has played ``max_steps`` steps: the helper then records it as truncated and resets
  its sub-env itself (``env.maybe_reset`` with that sub-env's ``done`` set). An env that
  restarts its sub-envs itself (a gymnasium vector env with auto-reset, torchrl's
  ``VecGymEnvTransform``) cannot reset one whose episode has not ended: ``max_steps`` is refused
  there, before any step; give that env its own time limit.
* **Returns** are summed in float64, over every reward key and every entry of a sub-env's
  reward (a team's, for several agents). The greedy policy is
  ``ExplorationType.DETERMINISTIC`` (a distribution's mode, or its deterministic sample),
  the sampled one ``ExplorationType.RANDOM``; both run under ``torch.no_grad()``.
* **The env is reset first** (a whole reset, given ``reset_kwargs``) and left as the last step
  leaves it (its finished sub-envs reset). The call returns once every counted episode has
  ended: an env without a time limit whose policy never reaches a terminal state needs
  ``max_steps``.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass

import torch
from tensordict import NestedKey, TensorDictBase
from tensordict.nn import InteractionType
from torchrl.envs import EnvBase, ExplorationType, set_exploration_type

from torchrl_grpo.envs import _resets_itself  # one test of envs that restart their sub-envs

__all__ = ["Evaluation", "evaluate"]


@dataclass(frozen=True, eq=False)
class Evaluation:
    """The episodes of one :func:`evaluate` call, in the order they started.

    Attributes:
        returns: each episode's return (undiscounted sum of its rewards), float64, ``(N,)``.
        lengths: each episode's number of steps, int64, ``(N,)``.
        terminated: whether it ended in a terminal state (the env's ``terminated``; where the
            env has none, any ``done`` that is not a truncation), bool, ``(N,)``.
        truncated: whether it was cut by a time limit (the env's ``truncated``, or
            ``max_steps``), bool, ``(N,)``. An env may set both on the same step.
        seeds: the value of ``seed_key`` at the start of each episode (the reset seed
            :class:`~torchrl_grpo.SameStartGroups` writes), int64, ``(N,)``; ``None`` if the
            env writes no such key.
    """

    returns: torch.Tensor
    lengths: torch.Tensor
    terminated: torch.Tensor
    truncated: torch.Tensor
    seeds: torch.Tensor | None = None

    @property
    def num_episodes(self) -> int:
        """N, the number of episodes."""
        return len(self.returns)

    @property
    def mean_return(self) -> float:
        """The mean of :attr:`returns`."""
        return float(self.returns.mean())

    @property
    def std_return(self) -> float:
        """The standard deviation of :attr:`returns`, with Bessel's correction (``nan`` for one
        episode)."""
        return float(self.returns.std()) if self.num_episodes > 1 else float("nan")

    @property
    def mean_length(self) -> float:
        """The mean of :attr:`lengths`."""
        return float(self.lengths.double().mean())

    def success_rate(self, min_return: float | None = None) -> float:
        """The fraction of episodes that succeeded.

        Args:
            min_return: the return that counts as a success (gymnasium's threshold of the task,
                e.g. 90 for ``MountainCarContinuous-v0``). ``None`` (the default) counts the
                episodes that reached a terminal state instead (:attr:`terminated`), which is
                success where the episode ends at a goal (MountainCar), and failure where it
                ends by falling (CartPole).

        Returns:
            A float in ``[0, 1]``.
        """
        hit = self.terminated if min_return is None else self.returns >= min_return
        return float(hit.double().mean())


def evaluate(
    env: EnvBase,
    policy: Callable[[TensorDictBase], TensorDictBase] | None,
    num_episodes: int,
    *,
    exploration_type: InteractionType = ExplorationType.DETERMINISTIC,
    max_steps: int | None = None,
    reset_kwargs: dict | None = None,
    seed_key: NestedKey = "reset_seed",
    progress: bool = False,
) -> Evaluation:
    """Play ``num_episodes`` whole episodes of ``policy`` on ``env``; their returns and lengths.

    Any torchrl env: a single env, a batch (``SerialEnv``, ``ParallelEnv``, ``GymEnv(...,
    num_envs=n)``, a gymnasium vector env behind ``GymWrapper``, with or without auto-reset),
    :class:`~torchrl_grpo.SameStartGroups` on top. Each sub-env plays until its own episode
    ends, then starts the next; the first ``num_episodes`` episodes started are the ones
    counted, and the call returns when all of them have ended. The module docstring lists the
    decisions.

    Args:
        env: the torchrl env. It is reset first.
        policy: a callable that reads the env's tensordict and writes the action (a
            ``TensorDictModule``, a torchrl actor); ``None`` plays random actions.
        num_episodes: N, the episodes to count; an integer of at least 1. It may be smaller or
            larger than the batch (a sub-env then plays several).
        exploration_type: torchrl's exploration type under which the policy acts:
            ``ExplorationType.DETERMINISTIC`` (the default, the greedy policy) or
            ``ExplorationType.RANDOM`` (sampled actions), or ``MODE``, ``MEAN``...
        max_steps: the most steps an episode may play; one that reaches it ends there,
            truncated. ``None`` (the default) leaves the ends to the env, which must end every
            episode (a time limit) for the call to return.
        reset_kwargs: keyword arguments of the first, whole reset, passed to the env's own
            reset: gymnasium's ``seed`` (an int; a list, one per sub-env, for a gymnasium
            vector env), or ``list_of_kwargs`` for ``SerialEnv``/``ParallelEnv``. The resets
            that follow are not given them (use :class:`~torchrl_grpo.SameStartGroups` to
            seed every episode).
        seed_key: the key whose value at each episode's start :attr:`Evaluation.seeds` holds.
            Defaults to ``"reset_seed"``, :class:`~torchrl_grpo.SameStartGroups`' key.
        progress: show a tqdm progress bar of the episodes ended (needs ``tqdm``).

    Returns:
        Evaluation: the counted episodes' returns, lengths, ends and seeds, in start order.

    Raises:
        ValueError: ``num_episodes`` or ``max_steps`` not a positive integer, an env without
            done keys or reward keys, ``max_steps`` on an env that resets itself, an
            ``exploration_type`` that is not one.
        KeyError: the policy's output lacks an action key of the env.
        TypeError: the policy returns something else than a TensorDict.
        ImportError: ``progress=True`` without tqdm installed.

    Examples:
        Two sub-envs whose episodes end at different steps: ``env.rollout`` stops both at the
        first ``done``; :func:`evaluate` plays each to its end (Pendulum runs 200 steps, so a
        ``StepCounter`` of 3 and 5 steps stands in for a task's goal).

        >>> import torch
        >>> from torchrl.envs import GymEnv, SerialEnv, StepCounter, TransformedEnv
        >>> from torchrl_grpo import SameStartGroups, evaluate
        >>> def pendulum(limit):
        ...     return TransformedEnv(GymEnv("Pendulum-v1"), StepCounter(limit))
        >>> env = TransformedEnv(
        ...     SerialEnv(2, [lambda: pendulum(3), lambda: pendulum(5)]), SameStartGroups(1)
        ... )
        >>> env.rollout(100)["next", "done"].shape  # torchrl's default: both cut at step 3
        torch.Size([2, 3, 1])
        >>> env.transform.rewind()
        >>> result = evaluate(env, None, num_episodes=4)  # random actions
        >>> result.lengths, result.seeds  # sub-env 0 ends first and starts seed 2
        (tensor([3, 5, 3, 5]), tensor([0, 1, 2, 3]))
        >>> result.truncated.all().item(), result.returns.dtype
        (True, torch.float64)
    """
    num_episodes = _check_count(num_episodes)
    max_steps = _check_max_steps(max_steps, env)
    if not isinstance(exploration_type, InteractionType):
        raise ValueError(
            f"exploration_type must be a torchrl ExplorationType (DETERMINISTIC, RANDOM, ...), "
            f"got {exploration_type!r}."
        )
    keys = _EnvKeys(env)
    bar = _progress_bar(num_episodes) if progress else None
    act = env.rand_action if policy is None else _checked(policy, keys.actions)
    try:
        with torch.no_grad(), set_exploration_type(exploration_type):
            tally = _Tally(num_episodes, env, seed_key)
            _play(env, act, keys, tally, max_steps, bar, reset_kwargs or {})
    finally:
        if bar is not None:
            bar.close()
    return tally.result()


def _play(env, act, keys, tally, max_steps, bar, reset_kwargs) -> None:
    """The evaluation loop: act, step (and reset the finished sub-envs), count."""
    td = env.reset(**reset_kwargs)
    tally.start(torch.ones(tally.num_envs, dtype=torch.bool), td)
    while tally.ended < tally.num_episodes:
        td = act(td)
        td, td_next = env.step_and_maybe_reset(td)
        before = tally.ended
        reward, done = keys.reward_and_done(td.get("next"), tally.num_envs)
        tally.add(reward)
        if bool(done.any()):  # ended (counted or not), and already reset by the env
            tally.end(done, *keys.ends(td.get("next"), done, tally.num_envs))
            tally.start(done, td_next)
        if max_steps is not None:
            cut = tally.reached(max_steps)
            if bool(cut.any()):
                tally.end(cut, torch.zeros_like(cut), cut)
                td_next = env.maybe_reset(keys.mark_done(td_next, cut))
                tally.start(cut, td_next)
        if bar is not None:
            bar.update(tally.ended - before)
        td = td_next


class _Tally:
    """Which counted episode each sub-env plays, the running sums, and the ended episodes."""

    def __init__(self, num_episodes: int, env: EnvBase, seed_key: NestedKey):
        self.num_episodes, self.num_envs = num_episodes, env.batch_size.numel()
        self.seed_key = seed_key
        self.episode = torch.full((self.num_envs,), -1, dtype=torch.long)  # -1: not counted
        self.counting = torch.zeros(self.num_envs, dtype=torch.bool)  # episode >= 0
        self.started = self.ended = 0
        self.running_return = torch.zeros(self.num_envs, dtype=torch.float64)
        self.running_length = torch.zeros(self.num_envs, dtype=torch.long)
        self.returns = torch.zeros(num_episodes, dtype=torch.float64)
        self.lengths = torch.zeros(num_episodes, dtype=torch.long)
        self.terminated = torch.zeros(num_episodes, dtype=torch.bool)
        self.truncated = torch.zeros(num_episodes, dtype=torch.bool)
        self.seeds: torch.Tensor | None = torch.full((num_episodes,), -1, dtype=torch.long)

    def start(self, mask: torch.Tensor, td: TensorDictBase) -> None:
        """Sub-envs of ``mask`` start an episode: counted, in index order, while fewer than
        ``num_episodes`` have started."""
        if not bool(mask.any()):
            return
        self.episode[mask] = -1
        self.running_return[mask] = 0.0
        self.running_length[mask] = 0
        chosen = mask.nonzero().squeeze(-1)[: self.num_episodes - self.started]
        counted = torch.arange(self.started, self.started + len(chosen))
        self.episode[chosen] = counted
        self.counting = self.episode >= 0
        self.started += len(chosen)
        seeds = td.get(self.seed_key, None) if self.seeds is not None else None
        if seeds is None:
            self.seeds = None  # the env writes no seeds: none reported
        else:
            self.seeds[counted] = seeds.reshape(self.num_envs, -1)[chosen, 0].long().cpu()

    def add(self, reward: torch.Tensor) -> None:
        """Add one step, of reward ``reward`` ``(num_envs,)``, to the counted episodes."""
        self.running_return += torch.where(self.counting, reward, 0.0)
        self.running_length += self.counting

    def reached(self, max_steps: int) -> torch.Tensor:
        """The counted episodes still running that have played ``max_steps`` steps."""
        return self.counting & (self.running_length >= max_steps)

    def end(self, done, terminated, truncated) -> None:
        """Record the counted episodes among the sub-envs of ``done``, which ended."""
        ended = done & self.counting
        index = self.episode[ended]
        self.returns[index] = self.running_return[ended]
        self.lengths[index] = self.running_length[ended]
        self.terminated[index] = terminated[ended]
        self.truncated[index] = truncated[ended]
        self.episode[ended] = -1
        self.counting &= ~ended
        self.ended += len(index)

    def result(self) -> Evaluation:
        return Evaluation(self.returns, self.lengths, self.terminated, self.truncated, self.seeds)


class _EnvKeys:
    """The env's reward, done and action keys, and how one step's values are read per sub-env."""

    def __init__(self, env: EnvBase):
        self.done = list(env.done_keys)
        if not self.done:
            raise ValueError(
                f"evaluate needs an env with done keys to know where episodes end; "
                f"{type(env).__name__} has none (full_done_spec: {env.full_done_spec})."
            )
        self.rewards = list(env.reward_keys)
        if not self.rewards:
            raise ValueError(
                f"evaluate needs an env with a reward key; {type(env).__name__} has none."
            )
        self.terminated = [k for k in self.done if _last(k) == "terminated"]
        self.truncated = [k for k in self.done if _last(k) == "truncated"]
        self.actions = list(env.action_keys)

    def reward_and_done(self, next_td: TensorDictBase, num_envs: int):
        """The reward (float64) and whether the episode ended, of each sub-env: ``(num_envs,)``."""
        reward = 0.0
        for key in self.rewards:
            reward = reward + next_td.get(key).reshape(num_envs, -1).double().sum(-1)
        return reward.cpu(), _any(next_td, self.done, num_envs)

    def ends(self, next_td: TensorDictBase, done: torch.Tensor, num_envs: int):
        """``(terminated, truncated)`` of each sub-env, ``(num_envs,)``: a ``done`` without
        either counts as terminated where the env has no terminated key, else as truncated."""
        truncated = _any(next_td, self.truncated, num_envs)
        if not self.terminated:
            return done & ~truncated, truncated
        terminated = _any(next_td, self.terminated, num_envs)
        return terminated, truncated | (done & ~terminated)

    def mark_done(self, td: TensorDictBase, mask: torch.Tensor) -> TensorDictBase:
        """``td`` with every done key set on the sub-envs of ``mask`` (truncated, not
        terminated), so that ``env.maybe_reset`` resets them."""
        for key in self.done:
            if _last(key) == "terminated":
                continue
            value = td.get(key)
            flag = mask.to(value.device).reshape(*td.batch_size, *[1] * (value.ndim - td.ndim))
            td.set(key, value | flag)
        return td


def _any(td: TensorDictBase, keys: list, num_envs: int) -> torch.Tensor:
    flag = torch.zeros(num_envs, dtype=torch.bool)
    for key in keys:
        flag = flag | td.get(key).reshape(num_envs, -1).any(-1).cpu()
    return flag


def _last(key: NestedKey) -> str:
    return key if isinstance(key, str) else key[-1]


def _checked(policy, action_keys):
    """``policy``, called the torchrl way (its output merged into the input), whose first
    output is checked for the env's action keys."""
    checked = False

    def act(td: TensorDictBase) -> TensorDictBase:
        nonlocal checked
        out = policy(td)
        if not isinstance(out, TensorDictBase):
            raise TypeError(
                f"the policy must read and return a TensorDict (a TensorDictModule, a torchrl "
                f"actor), got {type(out).__name__} from {type(policy).__name__}."
            )
        if out is not td:
            td.update(out)
        if not checked:
            missing = [k for k in action_keys if k not in td.keys(True, True)]
            if missing:
                raise KeyError(
                    f"the policy's output has no action {missing}: the env reads its action "
                    f"from {action_keys}, and the policy wrote {sorted(map(str, out.keys(True)))}."
                )
            checked = True
        return td

    return act


def _check_count(num_episodes) -> int:
    try:
        value = operator.index(num_episodes)
    except TypeError:
        raise ValueError(f"num_episodes must be an integer, got {num_episodes!r}.") from None
    if isinstance(num_episodes, bool) or value < 1:
        raise ValueError(f"num_episodes must be an integer of at least 1, got {num_episodes!r}.")
    return value


def _check_max_steps(max_steps, env: EnvBase) -> int | None:
    if max_steps is None:
        return None
    try:
        value = operator.index(max_steps)
    except TypeError:
        value = None
    if value is None or isinstance(max_steps, bool) or value < 1:
        raise ValueError(
            f"max_steps must be None (the env ends its episodes) or an integer of at least 1, "
            f"got {max_steps!r}: an episode would never end."
        )
    if _resets_itself(env):
        raise ValueError(
            f"max_steps={max_steps} cannot cut an episode of an env that restarts its sub-envs "
            "itself (a gymnasium vector env with auto-reset, torchrl's VecGymEnvTransform): it "
            "resets only the sub-envs that are done. Give the env its own time limit "
            "(gymnasium's max_episode_steps, torchrl's StepCounter) and pass max_steps=None."
        )
    return value


def _progress_bar(total: int):
    try:
        from tqdm import tqdm
    except ImportError as error:
        raise ImportError(
            "evaluate(progress=True) needs tqdm: pip install tqdm (or torchrl_grpo[examples])."
        ) from error
    return tqdm(total=total, unit=" episodes")

"""``MCAdvantage``: a replay-buffer transform that writes group-relative advantages on insertion.

The torchrl-facing class: its arguments, its state (local, or shared between processes), the
statistics, checkpoints and the view of the pending groups. One insertion goes through four
private modules, each one step of the path in ``ARCHITECTURE.md``:

* :mod:`torchrl_grpo._reading`: the input read and checked, split into trajectories;
* :mod:`torchrl_grpo._grouping`: which trajectories form complete groups (and evictions);
* :mod:`torchrl_grpo._release`: the advantages written on the released groups, the statistics;
* :mod:`torchrl_grpo._pending`: the store of what is held back.
"""

from __future__ import annotations

import math
import numbers
import operator
import os
import warnings
from collections.abc import Iterator, Mapping, MutableMapping

import torch
from tensordict import LazyStackedTensorDict, NestedKey, TensorDictBase
from torchrl import torchrl_logger
from torchrl.envs.transforms import Transform
from torchrl.objectives.llm import MCAdvantageSelector

from torchrl_grpo import _pending, _shared
from torchrl_grpo._compat import calling_replay_buffer
from torchrl_grpo._grouping import Limits, Selection, evict, find_rounds, select_candidates
from torchrl_grpo._pending import Pending, Returns, evolve
from torchrl_grpo._reading import Keys, read_insertion
from torchrl_grpo._release import (
    STAT_NAMES,
    Estimator,
    GroupFilter,
    Released,
    StepGroups,
    count,
    fresh_stats,
    release,
    torchrl_returns,
    trajectory_returns,
)
from torchrl_grpo._shared import owned
from torchrl_grpo._tails import ENDED, GIVEN_UP, TrajectoryKeys, join
from torchrl_grpo._tails import drop as drop_tails
from torchrl_grpo.advantages import BASELINES, RETURN_REDUCTIONS, SCALES
from torchrl_grpo.checkpoint import allow_empty_dumps

__all__ = ["MCAdvantage", "MCAdvantageSelector"]

_NOTHING_RELEASED = Released(out=None, written=0, selected=0)


def _integer(name: str, value) -> int:
    """``value`` as an ``int``; anything else, a float or a bool included, is a ``TypeError``."""
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an integer, got {value!r} (bool).")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(
            f"{name} must be an integer, got {value!r} ({type(value).__name__})."
        ) from None


def _reward_weights(
    rewards_key: NestedKey, reward_weights: Mapping[NestedKey, float] | None
) -> tuple[tuple[NestedKey, float], ...]:
    """``reward_weights`` checked, as ``((key, weight), ...)``; ``()`` for one reward."""
    if reward_weights is None:
        return ()
    if not isinstance(reward_weights, Mapping) or not reward_weights:
        raise ValueError(
            f"reward_weights must be a non-empty mapping {{reward key: weight}}, got "
            f"{reward_weights!r}."
        )
    weights = tuple((key, float(weight)) for key, weight in reward_weights.items())
    if not all(math.isfinite(weight) for _, weight in weights):
        raise ValueError(f"reward_weights must be finite, got {reward_weights!r}.")
    if rewards_key != ("next", "reward") and rewards_key not in dict(weights):
        raise ValueError(
            f"rewards_key={rewards_key!r} is not a key of reward_weights ({list(dict(weights))}): "
            "with several rewards, name them all in reward_weights."
        )
    return weights


def _step_groups(
    anchor_key: NestedKey | None,
    episode_weight: float | None,
    step_weight: float | None,
    gamma: float | None,
) -> StepGroups | None:
    """GiGPO's settings checked, with ROLL's defaults; ``None`` without ``anchor_key``."""
    given = {
        "episode_reward_weight": episode_weight,
        "step_reward_weight": step_weight,
        "step_reward_gamma": gamma,
    }
    if anchor_key is None:
        named = [name for name, value in given.items() if value is not None]
        if named:
            raise ValueError(
                f"{', '.join(named)} weigh GiGPO's step-level groups, which need anchor_key (the "
                "key of each step's anchor state)."
            )
        return None
    groups = StepGroups(
        episode_weight=1.0 if episode_weight is None else float(episode_weight),
        step_weight=1.0 if step_weight is None else float(step_weight),
        gamma=0.95 if gamma is None else float(gamma),
    )
    for name, value in zip(("episode_reward_weight", "step_reward_weight"), groups[:2]):
        if not math.isfinite(value):
            raise ValueError(f"{name} must be finite, got {value}.")
    if not 0.0 <= groups.gamma <= 1.0:
        raise ValueError(f"step_reward_gamma must be in [0, 1], got {gamma}.")
    return groups


def _reward_to_go_gamma(
    gamma: float | None, trajectory_return: str | None, anchor_key: NestedKey | None
) -> float | None:
    """``reward_to_go_gamma`` checked, as a float; ``None`` when off."""
    if gamma is None:
        return None
    if isinstance(gamma, bool) or not isinstance(gamma, numbers.Real):
        raise TypeError(
            f"reward_to_go_gamma must be a real number in [0, 1] or None, got {gamma!r} "
            f"({type(gamma).__name__})."
        )
    if not 0.0 <= gamma <= 1.0:
        raise ValueError(f"reward_to_go_gamma must be in [0, 1], got {gamma}.")
    if trajectory_return is not None:
        raise ValueError(
            "reward_to_go_gamma makes each step's sample its discounted reward-to-go, a per-step "
            "mode: it requires trajectory_return=None, got "
            f"trajectory_return={trajectory_return!r}."
        )
    if anchor_key is not None:
        raise ValueError(
            "reward_to_go_gamma cannot be combined with anchor_key: GiGPO's step level already "
            "compares discounted returns (step_reward_gamma), over the raw rewards."
        )
    return float(gamma)


def _setting(record: str, field: str, doc: str) -> property:
    """An argument kept in one of the transform's records, readable and settable by name."""

    def get(self):
        return getattr(getattr(self, record), field)

    def set(self, value) -> None:
        new = getattr(self, record)._replace(**{field: value})
        setattr(self, record, new)
        if self.__dict__.get("_owner") is not None:  # shared: the owner's copy inserts with it
            self._set_record(record, new)

    return property(get, set, doc=doc)


class MCAdvantage(Transform):
    """Group-relative Monte-Carlo advantages, written when a replay buffer is extended.

    A drop-in for :class:`torchrl.objectives.llm.MCAdvantage` (torchrl 0.14.1): the same
    arguments, defaults, validation errors, statistics and numbers, computed in a few tensor passes
    per insertion instead of a Python loop over trajectories. Append it to a
    :class:`~torchrl.data.ReplayBuffer`; every ``extend``/``add`` then

    1. flattens the input and splits it into trajectories at the done flags (each row of a
       ``[B, T]`` input must end with done), or, when the steps carry a trajectory id
       (``traj_key``, torchrl's ``("collector", "traj_ids")``), by id: a trajectory whose last
       step in the insertion is not done is held and joined with its continuation in later
       insertions, so that a collector's batches cut every ``frames_per_batch`` steps can be
       inserted as they come;
    2. reads each trajectory's group id at its first step: a string (the prompt) or a tensor
       (e.g. an environment seed), compared by value;
    3. queues trajectories by group id; when a group holds ``grpo_size`` trajectories it writes
       their ``advantage`` and releases them to storage, each trajectory in the order it arrived
       (an insertion released whole goes to storage as it came, without a copy). Groups still
       short of ``grpo_size`` stay pending (``None`` is returned if nothing completes).

    Advantages follow :func:`~torchrl_grpo.advantages.group_relative_advantage`. With
    ``trajectory_return=None`` (torchrl's default) every reward element of every step of the group
    is one sample; otherwise each trajectory is reduced to one return and its advantage is
    broadcast to all its steps.

    What is held back is in :attr:`queues` (a live view: clearing it drops it), in
    ``state_dict()``, and in the statistics of :meth:`get_stats`. Appended to a buffer, the
    transform lets ``rb.dumps`` save the storage while nothing is stored yet.

    Args:
        grpo_size: trajectories per group (an integer, as every size below).
        prompt_key: key of the group id. Defaults to ``"query"``.
        rewards_key: key of the rewards. Defaults to ``("next", "reward")``.
        advantage_key: key written with the advantages. Defaults to ``"advantage"``.
        done_key: key of the done flags. Defaults to ``("next", "done")``.
        verbose: log each released group.

    Keyword Args:
        trajectory_return: ``None`` (per-step normalization), or how a trajectory's rewards become
            its return: ``"sum"``, ``"max"``, ``"mean"`` (torchrl) or ``"last"`` (step-wise GRPO:
            the final reward is broadcast to every step).
        reward_to_go_gamma: ``None`` (default), or a discount ``gamma`` in ``[0, 1]`` that makes,
            with ``trajectory_return=None``, each step's sample its discounted reward-to-go
            instead of its reward: ``G_t = r_t + gamma * G_{t+1}`` with ``G_T = r_T`` at the
            trajectory's last step, i.e. ``G_t = sum over k >= t of gamma**(k - t) * r_k``
            (REINFORCE's reward-to-go, torchrl's ``reward2go``; see
            :func:`~torchrl_grpo.advantages.discounted_returns`). It is computed at release, on
            whole trajectories (joined across insertions with ``traj_key``), so a collector's
            ``frames_per_batch`` batches can be inserted as they come. A reward of several
            elements per step is discounted element by element (as ``reward2go`` does with
            trailing dimensions). ``0`` gives the rewards themselves, ``1`` the undiscounted sum
            to the end. Requires ``trajectory_return=None``; not with ``anchor_key`` (GiGPO
            discounts its step level with ``step_reward_gamma``), nor with ragged steps.
        keep_return_bounds: exclusive ``(low, high)`` bounds on a group's mean return; a group
            outside them is dropped (DAPO dynamic sampling), decided as torchrl decides it.
            Requires ``trajectory_return``.
        candidate_group_size: trajectories to collect before giving up on a group (oversampling).
            Defaults to ``grpo_size``; larger values require ``trajectory_return``.
        candidate_selection_min_size: candidates needed before the first selection attempt.
        candidate_selector: an :class:`MCAdvantageSelector` choosing ``grpo_size`` candidates.
        scale_rewards: ``"group"`` (default: per-group std), ``"batch"`` (std over every sample
            released by the same insertion, mean still per group) or ``"none"`` (Dr. GRPO).
        baseline: ``"mean"`` (default), ``"leave_one_out"`` (RLOO) or ``"pass_at_k"`` (GRPO
            pass@k, verl ``grpo_passk``: a group's unique best sample gets its gap to the
            runner-up, every other sample ``0``).
        std_threshold: groups whose sample std is at or below it are dropped and counted in
            ``dropped_groups`` (Trinity-RFT). ``None`` (default) keeps every group.
        step_norm: divide each trajectory's advantages by its number of steps.
        epsilon: floor of the std (``clamp_min``). Defaults to ``1e-6``, as torchrl.
        whiten: after the baseline and the scale, whiten the advantages over every sample
            released by the same insertion: subtract their mean, divide by their std
            (REINFORCE++-baseline with ``scale_rewards="none"``). ``None`` (default): on with
            ``reward_weights`` (GDPO's batch normalization, as TRL), off otherwise.
        reward_weights: ``{reward key: weight}``, several rewards (GDPO, TRL's
            ``multi_objective_aggregation="normalize_then_sum"``): each is normalized within its
            group by ``baseline`` and ``scale_rewards``, then the weighted sum is taken (and
            whitened, see ``whiten``). Its keys replace ``rewards_key`` (the first one gives the
            advantage its shape); the group filters, candidate selection and statistics see the
            weighted sum of the rewards. ``None`` (default): the one reward under ``rewards_key``.
        anchor_key: key of each step's anchor state (a tensor compared by value: an id, a grid
            cell, an observation; or a string), for GiGPO's step-level groups: the steps of a
            released group with equal anchors form a step group, and each step's advantage
            becomes ``episode_reward_weight * A_group + step_reward_weight * A_step``, where
            ``A_step`` normalizes the step's discounted return (``step_reward_gamma``) within its
            step group by ``baseline`` and ``scale_rewards``. ``None`` (default): no step groups.
        episode_reward_weight: weight of the group-level advantage with ``anchor_key``
            (default ``1.0``, ROLL's).
        step_reward_weight: weight of the step-level advantage (default ``1.0``, ROLL's).
        step_reward_gamma: discount of the step-level returns (default ``0.95``, ROLL's).
        max_pending_groups: most incomplete groups held at once. ``None`` (default): no limit.
        max_pending_age: a group still incomplete this many insertions after its first
            trajectory arrived is given up. ``None`` (default): no limit.
        on_overflow: what happens past a limit: ``"drop_oldest"`` (default) evicts the groups that
            started first, counts them in ``evicted_groups`` / ``evicted_trajectories`` and warns;
            ``"raise"`` rejects the insertion with a ``RuntimeError``, changing nothing.
        traj_key: key of the trajectory id of every step. When the input has it, trajectories
            may cross insertions: the unfinished ones are held (:attr:`held_trajectories`) and
            completed by later insertions, with the same advantages as inserting each whole
            trajectory when its last step arrives (in the order of the last steps in the
            row-major flattened input). Ids must be unique across everything written through the
            transform (torchrl's collectors, multi-worker ones included, guarantee it); an id
            that comes back after its trajectory ended raises ``ValueError``. A held trajectory
            older than ``max_pending_age`` insertions is given up, and the steps of its id that
            arrive later are left out (``evicted_steps``). Negative ids (torchrl's frames a
            preemptive collector did not fill) are not data. Defaults to
            ``("collector", "traj_ids")``; ``None`` always splits at the done flags (torchrl's
            behaviour).
        step_count_key: key of a step counter (torchrl's ``StepCounter`` writes
            ``"step_count"``), read with ``traj_key`` when the input has it: a trajectory must
            start at 0 and count up by one across insertions, so that a continuation whose
            earlier part is missing raises ``ValueError``. ``None``: not checked.

    Raises:
        ValueError: for inconsistent arguments (same conditions as torchrl), and for the added
            keywords: empty or non-finite ``reward_weights``, a ``rewards_key`` they leave out,
            step-level weights without ``anchor_key``, a ``step_reward_gamma`` or a
            ``reward_to_go_gamma`` outside ``[0, 1]``, ``reward_to_go_gamma`` with a
            ``trajectory_return`` or an ``anchor_key``.
        TypeError: for a size that is not an integer (``2.7``, ``True``), and a
            ``reward_to_go_gamma`` that is not a real number.

    Examples:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> from torchrl.data import LazyTensorStorage, ReplayBuffer
        >>> from torchrl_grpo import MCAdvantage
        >>> rb = ReplayBuffer(storage=LazyTensorStorage(100), batch_size=4)
        >>> _ = rb.append_transform(MCAdvantage(grpo_size=2, prompt_key="seed", trajectory_return="sum"))
        >>> steps = TensorDict(  # two trajectories of seed 7, with returns 1 and 3
        ...     seed=torch.tensor([7, 7, 7, 7]),
        ...     next=TensorDict(
        ...         reward=torch.tensor([[0.0], [1.0], [1.0], [2.0]]),
        ...         done=torch.tensor([[False], [True], [False], [True]]),
        ...         batch_size=[4],
        ...     ),
        ...     batch_size=[4],
        ... )
        >>> _ = rb.extend(steps)
        >>> rb[:]["advantage"].squeeze(-1)
        tensor([-0.7071, -0.7071,  0.7071,  0.7071])
    """

    requires_shared_write_state = True

    def __init__(
        self,
        grpo_size: int,
        prompt_key: NestedKey = "query",
        rewards_key: NestedKey = ("next", "reward"),
        advantage_key: NestedKey = "advantage",
        done_key: NestedKey = ("next", "done"),
        verbose: bool = False,
        *,
        trajectory_return: str | None = None,
        reward_to_go_gamma: float | None = None,
        keep_return_bounds: tuple[float, float] | None = None,
        candidate_group_size: int | None = None,
        candidate_selection_min_size: int | None = None,
        candidate_selector: MCAdvantageSelector | None = None,
        scale_rewards: str = "group",
        baseline: str = "mean",
        std_threshold: float | None = None,
        step_norm: bool = False,
        epsilon: float = 1e-6,
        whiten: bool | None = None,
        reward_weights: Mapping[NestedKey, float] | None = None,
        anchor_key: NestedKey | None = None,
        episode_reward_weight: float | None = None,
        step_reward_weight: float | None = None,
        step_reward_gamma: float | None = None,
        max_pending_groups: int | None = None,
        max_pending_age: int | None = None,
        on_overflow: str = "drop_oldest",
        traj_key: NestedKey | None = ("collector", "traj_ids"),
        step_count_key: NestedKey | None = "step_count",
    ):
        super().__init__()
        grpo_size = _integer("grpo_size", grpo_size)
        candidate_group_size = (
            grpo_size
            if candidate_group_size is None
            else _integer("candidate_group_size", candidate_group_size)
        )
        min_size = (
            grpo_size
            if candidate_selection_min_size is None
            else _integer("candidate_selection_min_size", candidate_selection_min_size)
        )
        if max_pending_groups is not None:
            max_pending_groups = _integer("max_pending_groups", max_pending_groups)
        if max_pending_age is not None:
            max_pending_age = _integer("max_pending_age", max_pending_age)
        if grpo_size < 1:
            raise ValueError(f"grpo_size must be at least 1, got {grpo_size}.")
        if trajectory_return is not None and trajectory_return not in RETURN_REDUCTIONS:
            raise ValueError(
                f"trajectory_return must be one of {sorted(RETURN_REDUCTIONS)} or None, "
                f"got {trajectory_return!r}."
            )
        if trajectory_return is not None and grpo_size < 2:
            raise ValueError(
                "trajectory_return requires grpo_size >= 2: a group-relative return needs at "
                f"least two trajectories, got grpo_size={grpo_size}."
            )
        if candidate_group_size < grpo_size:
            raise ValueError(
                "candidate_group_size must be greater than or equal to grpo_size, got "
                f"candidate_group_size={candidate_group_size} and grpo_size={grpo_size}."
            )
        if candidate_group_size > grpo_size and trajectory_return is None:
            raise ValueError(
                "candidate_group_size > grpo_size requires trajectory_return: candidates are "
                "selected by their return."
            )
        if min_size < grpo_size:
            raise ValueError(
                "candidate_selection_min_size must be greater than or equal to grpo_size, got "
                f"candidate_selection_min_size={min_size} and grpo_size={grpo_size}."
            )
        if min_size > candidate_group_size:
            raise ValueError(
                "candidate_selection_min_size must be less than or equal to candidate_group_size, "
                f"got candidate_selection_min_size={min_size} and "
                f"candidate_group_size={candidate_group_size}."
            )
        if keep_return_bounds is not None:
            if trajectory_return is None:
                raise ValueError(
                    "keep_return_bounds (dynamic sampling) filters on trajectory returns: set "
                    "trajectory_return to 'sum', 'max', 'mean' or 'last'."
                )
            if len(keep_return_bounds) != 2 or not keep_return_bounds[0] < keep_return_bounds[1]:
                raise ValueError(
                    f"keep_return_bounds must be an increasing (low, high) pair, got {keep_return_bounds}."
                )
            keep_return_bounds = (float(keep_return_bounds[0]), float(keep_return_bounds[1]))
        if scale_rewards not in SCALES:
            raise ValueError(
                f"scale_rewards must be one of {sorted(SCALES)}, got {scale_rewards!r}."
            )
        if baseline not in BASELINES:
            raise ValueError(f"baseline must be one of {sorted(BASELINES)}, got {baseline!r}.")
        if std_threshold is not None and std_threshold < 0:
            raise ValueError(f"std_threshold must be non-negative, got {std_threshold}.")
        if not epsilon > 0:
            raise ValueError(f"epsilon must be positive, got {epsilon}.")
        for name, limit in (
            ("max_pending_groups", max_pending_groups),
            ("max_pending_age", max_pending_age),
        ):
            if limit is not None and limit < 1:
                raise ValueError(f"{name} must be at least 1 or None, got {limit}.")
        if on_overflow not in ("drop_oldest", "raise"):
            raise ValueError(f"on_overflow must be 'drop_oldest' or 'raise', got {on_overflow!r}.")
        weights = _reward_weights(rewards_key, reward_weights)
        if weights:  # the first reward key gives the advantage its shape
            rewards_key = weights[0][0]
        step_groups = _step_groups(
            anchor_key, episode_reward_weight, step_reward_weight, step_reward_gamma
        )
        reward_to_go_gamma = _reward_to_go_gamma(reward_to_go_gamma, trajectory_return, anchor_key)

        self.in_keys = [prompt_key, *([key for key, _ in weights] or [rewards_key]), done_key]
        if anchor_key is not None:
            self.in_keys.append(anchor_key)
        self.out_keys = [advantage_key]
        self.grpo_size = grpo_size
        self.verbose = verbose
        # The arguments, grouped by the step that reads them (each also an attribute below).
        self._keys = Keys(
            group=prompt_key,
            reward=rewards_key,
            done=done_key,
            advantage=advantage_key,
            reward_weights=weights,
            anchor=anchor_key,
        )
        self._estimator = Estimator(
            trajectory_return=trajectory_return,
            baseline=baseline,
            scale_rewards=scale_rewards,
            epsilon=float(epsilon),
            step_norm=step_norm,
            whiten=bool(weights) if whiten is None else bool(whiten),
            step_groups=step_groups,
            reward_to_go_gamma=reward_to_go_gamma,
        )
        self._filter = GroupFilter(
            keep_return_bounds=keep_return_bounds, std_threshold=std_threshold
        )
        self._selection = Selection(
            candidate_group_size=candidate_group_size,
            min_size=min_size,
            selector=MCAdvantageSelector() if candidate_selector is None else candidate_selector,
        )
        self._limits = Limits(
            max_groups=max_pending_groups, max_age=max_pending_age, on_overflow=on_overflow
        )
        self._trajectory_keys = TrajectoryKeys(
            traj=traj_key, done=done_key, count=step_count_key if traj_key is not None else None
        )
        self._state = Pending(stats=fresh_stats())
        self._owner = None  # the owner process's handle once share_memory_() ran (_shared.py)
        self._lock = _NoLock()
        self._buffer_searched = False  # looked for the buffer writing through this transform
        self.register_load_state_dict_pre_hook(_read_earlier_checkpoints)

    prompt_key = _setting("_keys", "group", "Key of the group id.")
    rewards_key = _setting("_keys", "reward", "Key of the rewards.")
    done_key = _setting("_keys", "done", "Key of the done flags.")
    advantage_key = _setting("_keys", "advantage", "Key written with the advantages.")
    trajectory_return = _setting("_estimator", "trajectory_return", "How a return is reduced.")
    baseline = _setting("_estimator", "baseline", "``mean``, ``leave_one_out``, ``pass_at_k``.")
    scale_rewards = _setting("_estimator", "scale_rewards", "``group``, ``batch`` or ``none``.")
    epsilon = _setting("_estimator", "epsilon", "Floor of the scale.")
    step_norm = _setting("_estimator", "step_norm", "Divide by each trajectory's steps.")
    whiten = _setting("_estimator", "whiten", "Whiten over the released samples.")
    reward_to_go_gamma = _setting(
        "_estimator", "reward_to_go_gamma", "Discount of the per-step reward-to-go (``None``: off)."
    )
    anchor_key = _setting("_keys", "anchor", "Key of each step's anchor state (GiGPO).")

    @property
    def reward_weights(self) -> dict | None:
        """``{reward key: weight}`` (GDPO), or ``None`` for the one reward under ``rewards_key``."""
        return dict(self._keys.reward_weights) or None

    @property
    def step_groups(self) -> StepGroups | None:
        """GiGPO's ``episode_weight``, ``step_weight`` and ``gamma``; ``None`` without anchors."""
        return self._estimator.step_groups

    keep_return_bounds = _setting("_filter", "keep_return_bounds", "Dynamic sampling bounds.")
    std_threshold = _setting("_filter", "std_threshold", "Groups with a std at or below go.")
    candidate_group_size = _setting("_selection", "candidate_group_size", "Candidates per group.")
    candidate_selection_min_size = _setting("_selection", "min_size", "Candidates to try with.")
    candidate_selector = _setting("_selection", "selector", "Picks among candidates.")
    max_pending_groups = _setting("_limits", "max_groups", "Most incomplete groups held.")
    max_pending_age = _setting("_limits", "max_age", "Most insertions a group may wait.")
    on_overflow = _setting("_limits", "on_overflow", "``drop_oldest`` or ``raise``.")
    traj_key = _setting("_trajectory_keys", "traj", "Key of the trajectory ids.")
    step_count_key = _setting("_trajectory_keys", "count", "Key of the step counter.")

    # --- state: local, or in an owner process (torchrl_grpo/_shared.py) ---------------------

    @owned
    def _load(self) -> Pending:
        return self._state

    @owned
    def _store(self, state: Pending) -> None:
        # a plain attribute: skip nn.Module.__setattr__'s bookkeeping on the hot path
        object.__setattr__(self, "_state", state)

    def _commit(self, state: Pending, marks: list) -> None:
        """Make ``state`` (an insertion's outcome) the state, and record the trajectory ids it
        ended or gave up."""
        for ids, status in marks:
            state.tails.registry.mark(ids, status)
        self._store(state)

    @owned
    def _set_record(self, record: str, value) -> None:
        setattr(self, record, value)

    @property
    def is_shared(self) -> bool:
        """Whether the pending groups and statistics are shared between processes."""
        return self._owner is not None

    def share_memory_(self) -> MCAdvantage:
        """Share the pending groups and statistics with every process the transform goes to.

        Called by :meth:`torchrl.data.ReplayBuffer.share` (``ReplayBuffer(shared=True)``), so that
        trajectories of one group written by different processes complete one group. The state
        moves to an owner process (started once per process that shares, as torchrl's manager
        is), which every copy of the transform calls: an insertion sends its steps and gets back
        what it releases, whatever is pending. A writer killed in the middle of an insertion
        blocks no other, and its insertion is wholly in the state or wholly out (see
        ``docs/transform.rst``, "Many writers"). As in torchrl, setting
        ``TORCHRL_MC_ADVANTAGE_LOCAL_QUEUES=1`` keeps the state process-local.

        Settings are sent along; change ``grpo_size`` and ``verbose`` before sharing (the other
        settings may also be changed after).

        Returns:
            ``self``.

        Raises:
            TypeError: the transform cannot be pickled to its owner (a ``candidate_selector``
                whose class is defined inside a function).

        Examples:
            >>> from torchrl_grpo import MCAdvantage
            >>> t = MCAdvantage(grpo_size=2, prompt_key="seed").share_memory_()
            >>> t.is_shared, t.queued_trajectories
            (True, 0)
        """
        if self.is_shared or os.environ.get("TORCHRL_MC_ADVANTAGE_LOCAL_QUEUES") == "1":
            return self
        owner = _shared.share(self)
        object.__setattr__(self, "_owner", owner)
        object.__setattr__(self, "_state", None)  # the owner's now
        _shared.finalize_with(self, owner)
        return self

    # --- checkpoints: the pending groups and counters travel in state_dict() ----------------------

    @owned
    def get_extra_state(self) -> dict:
        """What ``state_dict()`` holds under ``"_extra_state"``: every pending trajectory, the
        group ids, returns, counters and insertion clock, as tensors and plain Python values (so
        that ``torch.load(..., weights_only=True)`` reads it)."""
        with self._lock:
            return {"pending": _pending.to_plain(self._load()), "grpo_size": self.grpo_size}

    @owned
    def set_extra_state(self, state: dict) -> None:
        """Restore what :meth:`get_extra_state` saved (``load_state_dict()`` calls it).

        Raises:
            RuntimeError: the checkpoint holds groups of another ``grpo_size``.
        """
        if state["grpo_size"] != self.grpo_size:
            raise RuntimeError(
                f"MCAdvantage: the checkpoint holds groups of grpo_size={state['grpo_size']}, "
                f"this transform has grpo_size={self.grpo_size}."
            )
        stats = fresh_stats()
        stats.update(state["pending"]["stats"])
        with self._lock:
            self._store(evolve(_pending.from_plain(state["pending"]), stats=stats))

    def set_container(self, container) -> None:
        """torchrl's hook when the transform is appended; also lets the buffer's storage be saved
        while still empty (see :mod:`torchrl_grpo.checkpoint`)."""
        super().set_container(container)
        self._buffer_searched = self._find_buffer()  # not found: look again at the next insertion

    def _find_buffer(self) -> bool:
        """Let the storage of the buffer calling into this transform be saved while empty."""
        buffer = calling_replay_buffer(self)
        if buffer is not None:
            allow_empty_dumps(buffer)
        return buffer is not None

    # --- torchrl's statistics API --------------------------------------------------------------

    @owned
    def reset_stats(self) -> None:
        """Reset the counters of write decisions (pending groups are kept)."""
        with self._lock:
            self._store(evolve(self._load(), stats=fresh_stats()))

    @owned
    def clear_queues(self) -> None:
        """Forget every pending trajectory, held unfinished ones included (statistics are kept).

        The ids of the held trajectories are given up: their steps that arrive later are left
        out (counted in ``evicted_steps``), rather than taken for new trajectories.
        """
        with self._lock:
            state = self._load()
            tails = state.tails
            if tails.num_tails:
                tails.registry.mark(tails.ids, GIVEN_UP)
            self._store(Pending(stats=state.stats, tails=type(tails)(registry=tails.registry)))

    @owned
    def get_stats(self) -> dict[str, float | int]:
        """A snapshot of the counters and of the pending queues' sizes.

        Returns:
            A dict with every name of torchrl's ``MCAdvantage.get_stats()``.

        Examples:
            >>> from torchrl_grpo import MCAdvantage
            >>> MCAdvantage(grpo_size=4).get_stats()["queued_trajectories"]
            0
        """
        with self._lock:
            state = self._load()
            stats = dict(state.stats)
            counts = _pending.group_counts(state)
            stats.update(
                queued_groups=len(counts),
                queued_trajectories=state.num_pending,
                max_queued_trajectories_per_group=max(counts, default=0),
                held_trajectories=state.tails.num_tails,
                held_steps=state.tails.num_steps,
            )
            return stats

    @property
    @owned
    def held_trajectories(self) -> int:
        """Number of trajectories whose first steps arrived but not their last (``traj_key``)."""
        with self._lock:
            return self._load().tails.num_tails

    @property
    @owned
    def queued_groups(self) -> int:
        """Number of incomplete groups held back."""
        with self._lock:
            return len(_pending.group_counts(self._load()))

    @property
    @owned
    def queued_trajectories(self) -> int:
        """Number of trajectories held back in incomplete groups."""
        with self._lock:
            return self._load().num_pending

    @property
    @owned
    def max_queued_trajectories_per_group(self) -> int:
        """Largest number of trajectories held back for one group."""
        with self._lock:
            return max(_pending.group_counts(self._load()), default=0)

    @property
    def queues(self) -> PendingGroups:
        """The pending groups, a live mapping ``group id -> trajectories`` (see
        :class:`PendingGroups`): ``queues.clear()`` and ``del queues[group]`` drop pending
        trajectories, as with torchrl's queues."""
        return PendingGroups(self)

    # --- the transform ---------------------------------------------------------------------------

    def forward(self, tensordict: TensorDictBase) -> TensorDictBase:
        """Identity: advantages are written on insertion (:meth:`inv`), not on sampling."""
        return tensordict

    def _inv_call(self, tensordict: TensorDictBase) -> TensorDictBase | None:
        if not self._buffer_searched:  # once: the buffer writing through us, if any
            self._find_buffer()
            object.__setattr__(self, "_buffer_searched", True)
        if self._owner is not None:  # shared: the owner inserts, and commits what we took
            return self._owner.insert(tensordict)
        with self._lock:
            out, state, marks = self._insert(self._state, tensordict)
            self._commit(state, marks)  # the insertion went through
        return out

    def _insert(self, state: Pending, tensordict: TensorDictBase):
        """One insertion against ``state``: read it, find the complete groups, release them, hold
        the rest, apply the limits. Returns the steps to store (or ``None``), the next state, and
        the trajectory ids to mark as ended or given up once it is stored.

        Everything that can be wrong with the input raises before a new state exists, so a
        rejected call leaves the transform exactly as it was.
        """
        marks = []
        dense = self._streams(state, tensordict)
        if dense is not None:
            keys = self._trajectory_keys._replace(done=self._keys.done)
            joined = join(state.tails, dense, keys, state.insertions)
            marks.append((joined.ended, ENDED))
            if joined.dropped_steps:
                stats = dict(state.stats)
                stats["evicted_steps"] += joined.dropped_steps
                state = evolve(state, stats=stats)
            state = evolve(state, tails=joined.tails)
            tensordict = joined.complete
            if tensordict is None:  # nothing completes: only the tails changed
                new = evolve(state, insertions=state.insertions + 1)
                return None, *self._evict(new, marks)
        batch = read_insertion(tensordict, self._keys, state)
        if batch is None:  # no step
            return None, *self._evict(evolve(state, insertions=state.insertions + 1), marks)
        if batch.ragged and self._estimator.reward_to_go_gamma is not None:
            raise ValueError(
                "MCAdvantage: reward_to_go_gamma discounts each reward element along the steps "
                f"of its trajectory, which needs as many elements under {self._keys.reward!r} "
                "at every step; this insertion's steps are ragged (a lazy stack)."
            )
        estimator, selects = self._estimator, self._selects
        incoming = Returns(
            trajectory_returns(batch, estimator.trajectory_return),
            torchrl_returns(batch.rewards, batch.reward_lengths, estimator.trajectory_return)
            if selects or self._filter.keep_return_bounds is not None
            else None,
        )
        if selects:
            returns = _pending.concat(_pending.returns_of(state), incoming)  # pending ++ incoming
            rounds = select_candidates(
                state, batch, self._selection, self.grpo_size, returns, self._filter
            )
        else:
            rounds = find_rounds(state, batch, self.grpo_size)
        released = _NOTHING_RELEASED
        if rounds.num_rounds:
            released = release(
                state,
                batch,
                rounds,
                _pending.concat(_pending.returns_of(state), incoming),
                estimator=estimator,
                group_filter=self._filter,
                keys=self._keys,
            )
        stats = count(
            state.stats,
            batch,
            incoming.value,
            rounds,
            released,
            trajectory_return=estimator.trajectory_return,
            group_size=self.grpo_size,
        )
        new = _pending.remaining(state, batch, rounds.consumed, incoming)
        new = evolve(new, stats=stats, insertions=state.insertions + 1)
        if self.verbose:
            dropped = rounds.num_rounds - released.written + rounds.given_up
            torchrl_logger.info(
                f"MCAdvantage: {batch.num_trajectories} trajectories in, {released.written} "
                f"groups written, {dropped} dropped, {new.num_pending} trajectories pending."
            )
        return released.out, *self._evict(new, marks)

    def _streams(self, state: Pending, tensordict: TensorDictBase) -> TensorDictBase | None:
        """The insertion as dense steps if it is read by trajectory id (``traj_key``), else
        ``None`` (split at the done flags)."""
        key = self._trajectory_keys.traj
        if key is None or key not in tensordict.keys(include_nested=True):
            return None
        if isinstance(tensordict, LazyStackedTensorDict):
            try:
                return tensordict.contiguous()
            except RuntimeError:  # ragged steps (token sequences): complete trajectories only
                if state.tails.num_tails:
                    raise NotImplementedError(
                        "MCAdvantage: trajectories that cross insertions need dense steps; this "
                        "insertion is a ragged lazy stack while unfinished trajectories are held."
                    ) from None
                return None
        return tensordict

    @property
    def _selects(self) -> bool:
        """Whether candidate selection runs (see :meth:`Selection.runs`)."""
        return self._selection.runs(self.grpo_size, self._estimator.trajectory_return)

    def _evict(self, state: Pending, marks: list) -> tuple[Pending, list]:
        """``max_pending_groups`` / ``max_pending_age``: count and warn about evicted groups and
        held trajectories; returns the state and the ids to mark."""
        if not self._limits.active:
            return state, marks
        eviction = evict(state, self._limits)
        groups, trajectories = eviction.groups, eviction.trajectories
        state = eviction.state
        tails, steps = state.tails, 0
        if self._limits.max_age is not None and tails.num_tails:
            old = state.insertions - 1 - tails.meta[:, 1] >= self._limits.max_age  # (H,)
            if bool(old.any()):
                if self._limits.on_overflow == "raise":
                    raise RuntimeError(
                        f"MCAdvantage: {int(old.sum())} unfinished trajectories are older than "
                        f"max_pending_age={self.max_pending_age}; the insertion was rejected and "
                        "nothing changed."
                    )
                steps = tails.num_steps
                tails, gone = drop_tails(tails, ~old)
                steps -= tails.num_steps
                trajectories += gone.shape[0]
                marks = [*marks, (gone, GIVEN_UP)]
                state = evolve(state, tails=tails)
        if not groups and not steps:
            return state, marks
        unfinished = f" and {trajectories - eviction.trajectories} unfinished trajectories" if steps else ""  # fmt: skip
        warnings.warn(
            f"MCAdvantage: {groups} incomplete group(s) ({eviction.trajectories} trajectories)"
            f"{unfinished} exceed max_pending_groups={self.max_pending_groups} / "
            f"max_pending_age={self.max_pending_age}; the oldest were dropped (see "
            "evicted_groups).",
            RuntimeWarning,
            stacklevel=5,
        )
        stats = dict(state.stats)
        stats["evicted_groups"] += groups
        stats["evicted_trajectories"] += trajectories
        stats["evicted_steps"] += steps
        return evolve(state, stats=stats), marks


class PendingGroups(MutableMapping):
    """The pending groups of an :class:`MCAdvantage`, by group id: a live view of its state.

    What torchrl's ``MCAdvantage.queues`` is used for works on it, under the transform's lock:
    ``len``, iteration (group ids, in order of first arrival), ``group in queues``,
    ``queues[group]`` (the group's trajectory TensorDicts in arrival order, as a tuple), and
    dropping pending trajectories with ``queues.clear()``, ``del queues[group]`` or
    ``queues.pop(group)`` (statistics are kept, as in torchrl). Trajectories are added by
    inserting them (``rb.extend``): setting an item raises ``TypeError``, and so does changing
    the tuple of a group.

    Group ids are as in torchrl: the prompt string, a Python number for a one-element tensor id,
    a tuple for a larger one.

    Examples:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> from torchrl_grpo import MCAdvantage
        >>> t = MCAdvantage(grpo_size=2, prompt_key="seed")
        >>> for seed in (3, 5):
        ...     _ = t.inv(TensorDict(seed=torch.tensor([seed]), next=TensorDict(
        ...         reward=torch.ones(1, 1), done=torch.ones(1, 1, dtype=torch.bool),
        ...         batch_size=[1]), batch_size=[1]))
        >>> list(t.queues), len(t.queues[5])
        ([3, 5], 1)
        >>> del t.queues[3]
        >>> t.queued_groups
        1
        >>> t.queues.clear()
        >>> t.queued_trajectories
        0
    """

    def __init__(self, transform: MCAdvantage):
        self._transform = transform

    def __getitem__(self, group) -> tuple[TensorDictBase, ...]:
        return _group_trajectories(self._transform, group)

    def __contains__(self, group) -> bool:
        return bool(_group_positions(self._transform, group))

    def __iter__(self) -> Iterator:
        return iter(dict.fromkeys(_group_ids(self._transform)))

    def __len__(self) -> int:
        return self._transform.queued_groups

    def __delitem__(self, group) -> None:
        _drop_group(self._transform, group)

    def __setitem__(self, group, trajectories) -> None:
        raise TypeError(
            "MCAdvantage.queues is filled by inserting trajectories (rb.extend / transform.inv); "
            "it can be read, and emptied with clear(), del or pop()."
        )

    def pop(self, group, *default):
        """Remove a group and return its trajectories (``default`` if it is not pending)."""
        return _pop_group(self._transform, group, *default)

    def clear(self) -> None:
        """Drop every pending trajectory (as :meth:`MCAdvantage.clear_queues`)."""
        self._transform.clear_queues()

    def __repr__(self) -> str:
        sizes: dict = {}
        for key in _group_ids(self._transform):
            sizes[key] = sizes.get(key, 0) + 1
        return f"PendingGroups({sizes})"


# What PendingGroups does to the state: functions of the transform, run by its owner when shared.


@owned
def _group_ids(transform: MCAdvantage) -> list:
    """The group id of every pending trajectory, in arrival order."""
    with transform._lock:
        state = transform._load()
        return _pending.python_keys(state.keys) if state.num_pending else []


@owned
def _group_positions(transform: MCAdvantage, group) -> list[int]:
    return [j for j, key in enumerate(_group_ids(transform)) if key == group]


@owned
def _group_trajectories(transform: MCAdvantage, group) -> tuple[TensorDictBase, ...]:
    with transform._lock:
        positions = _group_positions(transform, group)
        if not positions:
            raise KeyError(group)
        state = transform._load()
        return tuple(_pending.trajectory(state, None, j) for j in positions)


@owned
def _drop_group(transform: MCAdvantage, group) -> None:
    with transform._lock:
        positions = _group_positions(transform, group)
        if not positions:
            raise KeyError(group)
        state = transform._load()
        keep = torch.ones(state.num_pending, dtype=torch.bool)
        keep[positions] = False
        transform._store(_pending.drop(state, keep))


@owned
def _pop_group(transform: MCAdvantage, group, *default):
    with transform._lock:
        if not _group_positions(transform, group):
            if default:
                return default[0]
            raise KeyError(group)
        trajectories = _group_trajectories(transform, group)
        _drop_group(transform, group)
        return trajectories


@owned
def _get_stat(transform: MCAdvantage, name: str):
    with transform._lock:
        return transform._load().stats[name]


@owned
def _set_stat(transform: MCAdvantage, name: str, value) -> None:
    with transform._lock:
        state = transform._load()
        transform._store(evolve(state, stats={**state.stats, name: value}))


def _stat_property(name: str) -> property:
    return property(
        lambda self: _get_stat(self, name),
        lambda self, value: _set_stat(self, name, value),
        doc=f"torchrl's ``{name}`` counter (see :meth:`get_stats`).",
    )


for _name in STAT_NAMES:
    setattr(MCAdvantage, _name, _stat_property(_name))
del _name


def _read_earlier_checkpoints(module, state_dict, prefix, *args) -> None:
    """Checkpoints of torchrl_grpo 0.1.0 before its extra state: ``pending`` and ``grpo_size``
    entries, moved to ``_extra_state`` before ``load_state_dict`` reads it."""
    if prefix + "pending" in state_dict and prefix + "_extra_state" not in state_dict:
        state_dict[prefix + "_extra_state"] = {
            "pending": state_dict.pop(prefix + "pending"),
            "grpo_size": state_dict.pop(prefix + "grpo_size", module.grpo_size),
        }


class _NoLock:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

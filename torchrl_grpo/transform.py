"""``MCAdvantage``: a replay-buffer transform that writes group-relative advantages on insertion.

Plumbing only: this module splits the incoming steps into trajectories, matches them with the
pending ones by group id, decides which groups are complete, and calls the math in
:mod:`torchrl_grpo.advantages`. See ``ARCHITECTURE.md`` for the data path.
"""

from __future__ import annotations

import functools
import math
import multiprocessing as mp
import os
import warnings

import torch
from tensordict import LazyStackedTensorDict, NestedKey, TensorDict, TensorDictBase, lazy_stack
from tensordict.base import _is_leaf_nontensor
from torch import Tensor
from torchrl._utils import logger as torchrl_logger
from torchrl.envs.transforms.transforms import Transform
from torchrl.objectives.llm import MCAdvantageSelector

from torchrl_grpo import _estimators, _pending
from torchrl_grpo._pending import Insertion, Pending, append, as_list, evolve, gather
from torchrl_grpo.advantages import (
    BASELINES,
    RETURN_REDUCTIONS,
    SCALES,
    Segments,
    group_mean,
    group_relative_advantage,
    group_std,
    multi_reward_advantage,
)

__all__ = ["MCAdvantage", "MCAdvantageSelector"]

STAT_NAMES = (
    "completed_trajectories",
    "completed_decisions",
    "trajectory_return_sum",
    "trajectory_return_max",
    "successful_trajectories",
    "completed_groups",
    "written_groups",
    "dropped_groups",
    "rescued_groups",
    "selected_trajectories",
    "unselected_trajectories",
    # beyond torchrl: groups given up on by the memory limits (``max_pending_*``)
    "evicted_groups",
    "evicted_trajectories",
)


def _fresh_stats() -> dict:
    stats = dict.fromkeys(STAT_NAMES, 0)
    stats["trajectory_return_sum"] = 0.0
    stats["trajectory_return_max"] = float("-inf")
    return stats


def _materialize(tensordict: TensorDictBase) -> TensorDictBase | None:
    """A lazy stack as one contiguous TensorDict, or ``None`` if its steps are ragged."""
    if not isinstance(tensordict, LazyStackedTensorDict):
        return tensordict
    try:
        concrete = tensordict.contiguous()
    except RuntimeError:
        return None
    # contiguous() may silently drop stacked non-tensor entries; keep the lazy form then.
    lazy_keys = set(tensordict.keys(True, True, is_leaf=_is_leaf_nontensor))
    if lazy_keys - set(concrete.keys(True, True, is_leaf=_is_leaf_nontensor)):
        return None
    return concrete


class MCAdvantage(Transform):
    """Group-relative Monte-Carlo advantages, written when a replay buffer is extended.

    A drop-in for :class:`torchrl.objectives.llm.MCAdvantage` (torchrl 0.14.1): the same
    arguments, defaults, validation errors, statistics and numbers, computed in a few tensor passes
    per insertion instead of a Python loop over trajectories. Append it to a
    :class:`~torchrl.data.ReplayBuffer`; every ``extend``/``add`` then

    1. flattens the input and splits it into trajectories at the done flags (each row of a
       ``[B, T]`` input must end with done);
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

    Args:
        grpo_size: trajectories per group.
        prompt_key: key of the group id. Defaults to ``"query"``.
        rewards_key: key of the rewards. Defaults to ``("next", "reward")``.
        advantage_key: key written with the advantages. Defaults to ``"advantage"``.
        done_key: key of the done flags. Defaults to ``("next", "done")``.
        verbose: log each released group.

    Keyword Args:
        trajectory_return: ``None`` (per-step normalization), or how a trajectory's rewards become
            its return: ``"sum"``, ``"max"``, ``"mean"`` (torchrl) or ``"last"`` (step-wise GRPO:
            the final reward is broadcast to every step).
        keep_return_bounds: exclusive ``(low, high)`` bounds on a group's mean return; a group
            outside them is dropped (DAPO dynamic sampling). Requires ``trajectory_return``.
        candidate_group_size: trajectories to collect before giving up on a group (oversampling).
            Defaults to ``grpo_size``; larger values require ``trajectory_return``.
        candidate_selection_min_size: candidates needed before the first selection attempt.
        candidate_selector: an :class:`MCAdvantageSelector` choosing ``grpo_size`` candidates.
        scale_rewards: ``"group"`` (default: per-group std), ``"batch"`` (std over every sample
            released by the same insertion, mean still per group) or ``"none"`` (Dr. GRPO).
        baseline: ``"mean"`` (default), ``"leave_one_out"`` (RLOO) or ``"pass_at_k"`` (GRPO
            pass@k, verl ``grpo_passk``: a group's unique best sample gets its gap to the
            runner-up, every other sample ``0``).
        whiten: after the baseline and the scale, whiten the advantages over every sample
            released by the same insertion: subtract their mean, divide by their std
            (REINFORCE++-baseline with ``scale_rewards="none"``). ``None`` (default): on with
            ``reward_weights`` (GDPO's batch normalization, as TRL), off otherwise.
        reward_weights: ``{reward key: weight}``, several rewards (GDPO, TRL's
            ``multi_objective_aggregation="normalize_then_sum"``): each is normalized within its
            group by ``baseline`` and ``scale_rewards``, then the weighted sum is taken (and
            whitened, see ``whiten``). Its keys replace ``rewards_key``; the group filters,
            candidate selection and statistics see the weighted sum of the rewards. ``None``
            (default): the one reward under ``rewards_key``.
        anchor_key: key of each step's anchor state (an observation tensor compared by value, a
            hash, or a string), for GiGPO's step-level groups: the steps of a released group with
            equal anchors form a step group, and the advantage of each step becomes
            ``episode_reward_weight * A_episode + step_reward_weight * A_step``, where ``A_step``
            normalizes the step's discounted return (``step_reward_gamma``) within its step
            group by ``baseline`` and ``scale_rewards``. ``None`` (default): no step groups.
        episode_reward_weight: weight of the group-level advantage with ``anchor_key``
            (default ``1.0``, ROLL's).
        step_reward_weight: weight of the step-level advantage (default ``1.0``, ROLL's).
        step_reward_gamma: discount of the step-level returns (default ``0.95``, ROLL's).
        std_threshold: groups whose sample std is at or below it are dropped and counted in
            ``dropped_groups`` (Trinity-RFT). ``None`` (default) keeps every group.
        step_norm: divide each trajectory's advantages by its number of steps.
        epsilon: floor of the std (``clamp_min``). Defaults to ``1e-6``, as torchrl.
        max_pending_groups: most incomplete groups held at once. ``None`` (default): no limit.
        max_pending_age: a group still incomplete this many insertions after its first
            trajectory arrived is given up. ``None`` (default): no limit.
        on_overflow: what happens past a limit: ``"drop_oldest"`` (default) evicts the groups that
            started first, counts them in ``evicted_groups`` / ``evicted_trajectories`` and warns;
            ``"raise"`` rejects the insertion with a ``RuntimeError``, changing nothing.

    Raises:
        ValueError: for inconsistent arguments (same conditions as torchrl).

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
        reward_weights: dict[NestedKey, float] | None = None,
        anchor_key: NestedKey | None = None,
        episode_reward_weight: float | None = None,
        step_reward_weight: float | None = None,
        step_reward_gamma: float | None = None,
        max_pending_groups: int | None = None,
        max_pending_age: int | None = None,
        on_overflow: str = "drop_oldest",
    ):
        super().__init__()
        if int(grpo_size) < 1:
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
        candidate_group_size = (
            grpo_size if candidate_group_size is None else int(candidate_group_size)
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
        min_size = (
            grpo_size if candidate_selection_min_size is None else int(candidate_selection_min_size)
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
            if limit is not None and int(limit) < 1:
                raise ValueError(f"{name} must be at least 1 or None, got {limit}.")
        if on_overflow not in ("drop_oldest", "raise"):
            raise ValueError(f"on_overflow must be 'drop_oldest' or 'raise', got {on_overflow!r}.")
        estimators = _estimators.settings(
            rewards_key,
            reward_weights,
            whiten,
            anchor_key,
            episode_reward_weight,
            step_reward_weight,
            step_reward_gamma,
        )
        if estimators.reward_weights:  # the first reward key gives the advantage its shape
            rewards_key = estimators.reward_keys[0]

        self.in_keys = [prompt_key, *(estimators.reward_keys or [rewards_key]), done_key]
        if anchor_key is not None:
            self.in_keys.append(anchor_key)
        self.out_keys = [advantage_key]
        self.prompt_key = prompt_key
        self.rewards_key = rewards_key
        self.advantage_key = advantage_key
        self.done_key = done_key
        self.grpo_size = int(grpo_size)
        self.verbose = verbose
        self.trajectory_return = trajectory_return
        self.keep_return_bounds = keep_return_bounds
        self.candidate_group_size = candidate_group_size
        self.candidate_selection_min_size = min_size
        self.candidate_selector = (
            MCAdvantageSelector() if candidate_selector is None else candidate_selector
        )
        self.scale_rewards = scale_rewards
        self.baseline = baseline
        self.std_threshold = std_threshold
        self.step_norm = step_norm
        self.epsilon = float(epsilon)
        self.max_pending_groups = max_pending_groups
        self.max_pending_age = max_pending_age
        self.on_overflow = on_overflow
        self.estimators = estimators
        self._state = Pending(stats=_fresh_stats())
        self._shared = None  # a manager Namespace holding the Pending once share_memory_() ran
        self._lock = _NoLock()
        self._manager = None

    # --- state: local, or behind a multiprocessing manager ------------------------------------

    def _load(self) -> Pending:
        return self._shared.state if self._shared is not None else self._state

    def _store(self, state: Pending) -> None:
        if self._shared is not None:
            self._shared.state = state
        else:  # a plain attribute: skip nn.Module.__setattr__'s bookkeeping on the hot path
            object.__setattr__(self, "_state", state)

    @property
    def is_shared(self) -> bool:
        """Whether the pending groups and statistics live in multiprocessing-shared state."""
        return self._shared is not None

    def share_memory_(self) -> MCAdvantage:
        """Move the pending groups and statistics behind a multiprocessing manager.

        Called by :meth:`torchrl.data.ReplayBuffer.share`, so that trajectories of one group
        written by different processes complete one group. As in torchrl, setting
        ``TORCHRL_MC_ADVANTAGE_LOCAL_QUEUES=1`` keeps the state process-local.

        Returns:
            ``self``.
        """
        if self.is_shared or os.environ.get("TORCHRL_MC_ADVANTAGE_LOCAL_QUEUES") == "1":
            return self
        self._manager = mp.Manager()
        self._shared = self._manager.Namespace()
        self._shared.state = self._state
        self._lock = self._manager.RLock()
        return self

    def __getstate__(self):
        state = super().__getstate__()
        state["_manager"] = None
        return state

    # --- checkpoints: the pending groups and counters travel in state_dict() ----------------------

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        with self._lock:
            destination[prefix + "pending"] = _pending.to_plain(self._load())
        destination[prefix + "grpo_size"] = self.grpo_size

    def _load_from_state_dict(
        self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
    ):
        plain = state_dict.get(prefix + "pending")
        if plain is None:
            if strict:
                missing_keys.append(prefix + "pending")
            return
        saved_size = state_dict.get(prefix + "grpo_size", self.grpo_size)
        if saved_size != self.grpo_size:
            error_msgs.append(
                f"MCAdvantage: the checkpoint holds groups of grpo_size={saved_size}, this "
                f"transform has grpo_size={self.grpo_size}."
            )
            return
        stats = _fresh_stats()
        stats.update(plain["stats"])
        with self._lock:
            self._store(evolve(_pending.from_plain(plain), stats=stats))

    # --- torchrl's statistics API --------------------------------------------------------------

    def reset_stats(self) -> None:
        """Reset the counters of write decisions (pending groups are kept)."""
        with self._lock:
            self._store(evolve(self._load(), stats=_fresh_stats()))

    def clear_queues(self) -> None:
        """Forget every pending trajectory (statistics are kept)."""
        with self._lock:
            self._store(Pending(stats=self._load().stats))

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
            )
            return stats

    @property
    def queued_groups(self) -> int:
        """Number of incomplete groups held back."""
        return len(_pending.group_counts(self._load()))

    @property
    def queued_trajectories(self) -> int:
        """Number of trajectories held back in incomplete groups."""
        return self._load().num_pending

    @property
    def max_queued_trajectories_per_group(self) -> int:
        """Largest number of trajectories held back for one group."""
        return max(_pending.group_counts(self._load()), default=0)

    @property
    def queues(self) -> dict:
        """A snapshot of the pending groups, mapping each group id to its trajectory TensorDicts.

        Group ids are as in torchrl: the prompt string, a Python number for a one-element tensor
        id, or a tuple for a larger one. The dict is rebuilt at each access; mutate the pending
        state with :meth:`clear_queues` only.
        """
        state = self._load()
        out: dict = {}
        if state.num_pending == 0:
            return out
        for j, key in enumerate(_pending.python_keys(state.keys)):
            out.setdefault(key, []).append(self._trajectory(state, None, j))
        return out

    # --- the transform ---------------------------------------------------------------------------

    def forward(self, tensordict: TensorDictBase) -> TensorDictBase:
        """Identity: advantages are written on insertion (:meth:`inv`), not on sampling."""
        return tensordict

    def _inv_call(self, tensordict: TensorDictBase) -> TensorDictBase | None:
        with self._lock:
            state = self._load()
            one = self._read_one(tensordict, state)
            if one is not None:
                out, new_state = self._insert_one(one, state)
            else:
                out, new_state = self._insert(tensordict, state)
            new_state = evolve(new_state, insertions=state.insertions + 1)
            if self.max_pending_groups is not None or self.max_pending_age is not None:
                new_state = self._bound(new_state)
            self._store(new_state)
        return out

    def _bound(self, state: Pending) -> Pending:
        """Apply ``max_pending_groups`` / ``max_pending_age`` to the state after an insertion."""
        if state.num_pending == 0:
            return state
        codes, _ = self._group_codes(None, state.keys)  # (Q,)
        num = int(codes.max()) + 1
        first = torch.full((num,), state.insertions, dtype=torch.long)
        first = first.scatter_reduce(0, codes, state.arrival, reduce="amin")  # (G,) oldest
        evict = torch.zeros(num, dtype=torch.bool)
        if self.max_pending_age is not None:
            evict |= state.insertions - 1 - first >= self.max_pending_age
        if self.max_pending_groups is not None:
            excess = int((~evict).sum()) - self.max_pending_groups
            if excess > 0:  # the groups that started first go, ties by arrival of their ids
                order = torch.argsort(first.masked_fill(evict, -1), stable=True)
                evict[order[: int(evict.sum()) + excess]] = True
        if not evict.any():
            return state
        gone = evict[codes]  # (Q,)
        message = (
            f"MCAdvantage: {int(evict.sum())} incomplete group(s) ({int(gone.sum())} "
            f"trajectories) exceed max_pending_groups={self.max_pending_groups} / "
            f"max_pending_age={self.max_pending_age}"
        )
        if self.on_overflow == "raise":
            raise RuntimeError(message + "; the insertion was rejected and nothing changed.")
        warnings.warn(
            message + "; the oldest were dropped (see evicted_groups).",
            RuntimeWarning,
            stacklevel=4,
        )
        stats = dict(state.stats)
        stats["evicted_groups"] += int(evict.sum())
        stats["evicted_trajectories"] += int(gone.sum())
        return evolve(_pending.drop(state, ~gone), stats=stats)

    def _insert(
        self, tensordict: TensorDictBase, state: Pending
    ) -> tuple[TensorDictBase | None, Pending]:
        """Process one insertion against ``state``; returns the output and the next state.

        Everything that can be wrong with the input raises here before a new state exists, so a
        rejected call leaves the transform exactly as it was.
        """
        batch = self._read_batch(tensordict, state)
        if batch is None:
            return None, state
        num_pending = state.num_pending
        codes, order = self._group_codes(state.keys, batch.keys)  # (Q + n,), (Q + n,)
        batch_returns = self._returns(batch)  # (n,)
        returns = torch.cat([state.returns, batch_returns]) if num_pending else batch_returns

        counts = torch.bincount(codes)  # trajectories per group, pending included
        fewest, most = (int(c) for c in torch.aminmax(counts))
        extra = {"dropped_groups": 0}
        num_events = None
        if not self._needs_selection() and most < self.grpo_size:
            members = member_event = torch.zeros(0, dtype=torch.long)  # nothing can complete
            consumed = torch.zeros(codes.numel(), dtype=torch.bool)
        elif not self._needs_selection() and fewest == most == self.grpo_size:
            # every group present is exactly complete: all of it is released, one round a group
            members, member_event = torch.arange(codes.numel()), codes
            consumed = torch.ones(codes.numel(), dtype=torch.bool)
            num_events = counts.numel()
        elif self._needs_selection():
            members, member_event, consumed, extra = self._select_candidates(
                codes, returns, num_pending, state, batch
            )
        else:
            members, member_event, consumed = self._complete_rounds(codes, order, counts)
        return self._finish(
            state, batch, members, member_event, consumed, extra, returns, batch_returns, num_events
        )

    def _finish(
        self,
        state,
        batch,
        members,
        member_event,
        consumed,
        extra,
        returns,
        batch_returns,
        num_events=None,
    ):
        """Write the released groups' advantages, count everything, and build the next state.

        ``num_events`` (released groups) is ``int(member_event.max()) + 1`` when not given.
        """
        n = batch.lengths.numel()
        q = state.num_pending
        lengths = torch.cat([state.lengths, batch.lengths]) if q else batch.lengths  # (Q + n,)
        if num_events is None:
            num_events = int(member_event.max()) + 1 if member_event.numel() else 0

        out, keep_event, adv_written = None, torch.zeros(0, dtype=torch.bool), 0
        if num_events:
            out, keep_event = self._write_advantages(
                state, batch, members, member_event, num_events, lengths, returns
            )
            adv_written = int(keep_event.sum()) if self._filtering() else num_events

        # --- the next state: statistics, then the pending trajectories that were not consumed ---
        stats = self._count_arrivals(dict(state.stats), batch, batch_returns)
        if self.trajectory_return is not None:
            stats["selected_trajectories"] += adv_written * self.grpo_size
        stats["completed_groups"] += num_events + extra["dropped_groups"]
        stats["written_groups"] += adv_written
        stats["dropped_groups"] += num_events - adv_written + extra["dropped_groups"]
        for name in ("rescued_groups", "unselected_trajectories"):
            stats[name] += extra.get(name, 0)
        new_state = _pending.remaining(state, batch, consumed, returns, stats)
        if self.verbose:
            torchrl_logger.info(
                f"MCAdvantage: {n} trajectories in, {adv_written} groups written, "
                f"{num_events - adv_written + extra['dropped_groups']} dropped, "
                f"{new_state.num_pending} trajectories pending."
            )
        return out, new_state

    # --- step 1-2: read and check the input -------------------------------------------------------

    def _get(self, tensordict: TensorDictBase, key: NestedKey, role: str):
        value = tensordict.get(key, None)
        if value is None:
            raise KeyError(
                f"MCAdvantage: the {role} key {key!r} is missing from the input "
                f"(keys: {sorted(map(str, tensordict.keys(True, True)))})."
            )
        return value

    def _read_batch(self, tensordict: TensorDictBase, state: Pending) -> Insertion | None:
        if tensordict.ndim == 0:
            tensordict = tensordict.unsqueeze(0)
        if tensordict.numel() == 0:
            return None
        concrete = _materialize(tensordict)
        ragged = state.ragged or concrete is None
        tensordict = tensordict if concrete is None else concrete
        done = self._get(tensordict, self.done_key, "done")
        self._get(tensordict, self.prompt_key, "group id")  # existence check before any work
        if not isinstance(done, Tensor) or done.numel() != tensordict.numel():
            raise ValueError(
                f"MCAdvantage: the done key {self.done_key!r} must hold one flag per step, got "
                f"shape {tuple(done.shape)} for a batch of {tuple(tensordict.batch_size)}."
            )
        row_ends = done.reshape(-1, tensordict.shape[-1])[:, -1]  # (rows,)
        if not (bool(row_ends[0]) if row_ends.numel() == 1 else bool(row_ends.all())):
            row = int((~row_ends.bool()).nonzero()[0])
            raise RuntimeError(
                "MCAdvantage: expected complete trajectories, but the input's last step "
                f"(row {row} of batch {tuple(tensordict.batch_size)}) has {self.done_key!r}=False."
            )
        done = done.reshape(-1).bool()  # (N,)
        if tensordict.ndim > 1:
            tensordict = (
                lazy_stack(list(tensordict.reshape(-1).unbind(0)))
                if ragged
                else tensordict.reshape(-1)
            )
        data = list(tensordict.unbind(0)) if ragged else tensordict

        ends = done.nonzero().squeeze(1)  # (n,)
        lengths = torch.diff(ends, prepend=ends.new_full((1,), -1))
        starts = ends - lengths + 1

        if self.estimators.reward_weights:  # several rewards: their weighted sum is "the reward"
            elements, per_step = _estimators.weighted_elements(
                lambda key: self._reward_elements(tensordict, data, ragged, key),
                self.estimators.reward_weights,
            )
        else:
            elements, per_step = self._reward_elements(tensordict, data, ragged)
        if self.estimators.anchor_key is not None:
            _estimators.check_anchors(tensordict, data, self.estimators.anchor_key, done.numel())
        if not _all_finite(elements):
            bad = ~torch.isfinite(elements)
            first = int(bad.nonzero()[0])
            step = (
                first // per_step
                if isinstance(per_step, int)
                else int(torch.searchsorted(torch.cumsum(per_step, 0), first, right=True))
            )
            raise ValueError(
                f"MCAdvantage: {int(bad.sum())} non-finite reward value(s) under "
                f"{self.rewards_key!r}, the first at step {step} (value {float(elements[bad][0])})."
            )
        keys = self._read_keys(tensordict, data, starts, ragged, state)
        shortest, longest = (int(v) for v in torch.aminmax(lengths))
        width = shortest if shortest == longest else 0
        if isinstance(per_step, int):
            element_lengths = lengths if per_step == 1 else lengths * per_step
            element_width = width * per_step
        else:  # elements per trajectory: differences of the running count at trajectory ends
            element_lengths = torch.diff(torch.cumsum(per_step, 0)[ends], prepend=ends.new_zeros(1))
            element_width = None
        return Insertion(
            data,
            starts,
            lengths,
            keys,
            elements,
            element_lengths,
            done.numel(),
            width,
            element_width,
        )

    def _reward_elements(
        self, tensordict, data, ragged: bool, key: NestedKey | None = None
    ) -> tuple[Tensor, int | Tensor]:
        """Every reward element, flat, and the elements per step (an int, or one per step)."""
        num_steps = tensordict.shape[0]
        key = self.rewards_key if key is None else key
        if ragged:
            rewards = [self._get(step, key, "reward") for step in data]
            counts = torch.tensor([r.numel() for r in rewards])
            values = torch.cat([r.reshape(-1) for r in rewards]) if rewards else torch.zeros(0)
        else:
            reward = self._get(tensordict, key, "reward")
            if not isinstance(reward, Tensor) or reward.shape[:1] != (num_steps,):
                raise ValueError(
                    f"MCAdvantage: the reward under {key!r} must be a tensor with one "
                    f"entry per step ({num_steps}), got {type(reward).__name__} of shape "
                    f"{tuple(getattr(reward, 'shape', ()))}."
                )
            per_step = math.prod(reward.shape[1:])
            if per_step == 0 and num_steps:
                counts = torch.zeros(num_steps, dtype=torch.long)  # reported below
            else:
                return reward.reshape(-1), per_step
        if (counts == 0).any():
            step = int((counts == 0).nonzero()[0])
            raise ValueError(f"MCAdvantage: the reward under {key!r} is empty at step {step}.")
        return values, counts

    def _read_keys(self, tensordict, data, starts: Tensor, ragged: bool, state: Pending):
        if ragged:
            raw = [data[i].get(self.prompt_key) for i in starts.tolist()]
            raw = [v if isinstance(v, Tensor) else getattr(v, "data", v) for v in raw]
            keys = torch.stack(raw) if raw and isinstance(raw[0], Tensor) else raw
        else:
            value = tensordict.get(self.prompt_key)
            if isinstance(value, Tensor):
                keys = value.index_select(0, starts)
            elif hasattr(value, "tolist"):  # NonTensorStack / NonTensorData: prompts
                values = value.tolist()
                values = values if isinstance(values, list) else [values] * tensordict.shape[0]
                keys = [values[i] for i in starts.tolist()]
            else:
                keys = [value] * starts.numel()
        if isinstance(keys, Tensor):
            keys = keys.reshape(starts.numel(), -1)
            if isinstance(state.keys, list):
                raise TypeError(
                    f"MCAdvantage: group ids under {self.prompt_key!r} are tensors, but the pending "
                    "groups are keyed by strings; use one kind of group id per transform."
                )
            if (
                isinstance(state.keys, Tensor)
                and state.num_pending
                and state.keys.shape[1] != keys.shape[1]
            ):
                raise ValueError(
                    f"MCAdvantage: group ids under {self.prompt_key!r} have {keys.shape[1]} values "
                    f"per trajectory, but the pending ones have {state.keys.shape[1]}."
                )
            return keys
        for key in keys:
            if not isinstance(key, str):
                raise TypeError(
                    f"MCAdvantage: the group id under {self.prompt_key!r} must be a string or a "
                    f"tensor, got {type(key).__name__}: {key!r:.80}."
                )
        if isinstance(state.keys, Tensor) and state.num_pending:
            raise TypeError(
                f"MCAdvantage: group ids under {self.prompt_key!r} are strings, but the pending "
                "groups are keyed by tensors; use one kind of group id per transform."
            )
        return keys

    # --- step 3-4: group ids, and which groups are complete --------------------------------------

    @staticmethod
    def _group_codes(
        pending: Tensor | list | None, incoming: Tensor | list
    ) -> tuple[Tensor, Tensor | None]:
        """A dense integer code per trajectory (pending first), equal iff the group ids are.

        Also returns the stable order of the trajectories by code (grouped, in arrival order
        within a group) when finding the codes sorted anyway, else ``None``.
        """
        if isinstance(incoming, list):
            table: dict = {}
            codes = torch.tensor(
                [table.setdefault(k, len(table)) for k in as_list(pending) + incoming],
                dtype=torch.long,
            )
            return codes, None
        keys = (
            incoming
            if pending is None or pending.numel() == 0
            else torch.cat(
                [pending, incoming.to(torch.promote_types(pending.dtype, incoming.dtype))]
            )
        )
        if keys.shape[1] > 1:
            return torch.unique(keys, dim=0, return_inverse=True)[1], None
        keys = keys.reshape(-1)
        if not keys.is_floating_point() and keys.dtype != torch.bool and keys.numel():
            low, high = int(keys.min()), int(keys.max())
            if high - low <= 4 * keys.numel() + 1024:  # compact ids (seeds, indices): no sort
                shifted = keys - low
                present = torch.zeros(high - low + 1, dtype=torch.bool).index_fill_(
                    0, shifted, True
                )
                return (torch.cumsum(present, 0) - 1).index_select(0, shifted), None
        sorted_keys, order = torch.sort(keys, stable=True)
        starts_group = torch.ones_like(sorted_keys, dtype=torch.bool)
        torch.ne(sorted_keys[1:], sorted_keys[:-1], out=starts_group[1:])
        codes = torch.empty_like(order)
        codes[order] = torch.cumsum(starts_group, 0) - 1
        return codes, order

    def _needs_selection(self) -> bool:
        # With as many candidates as the group size, torchrl's selector keeps them all in order
        # (or rejects them by keep_return_bounds, which the vectorized path applies as a filter).
        return (
            self.candidate_group_size > self.grpo_size
            or type(self.candidate_selector) is not MCAdvantageSelector
        )

    def _complete_rounds(
        self, codes: Tensor, order: Tensor | None, counts: Tensor
    ) -> tuple[Tensor, Tensor, Tensor]:
        """Every complete round of ``grpo_size`` trajectories of one group.

        A group's trajectories, in arrival order, form rounds of ``grpo_size``; every full round
        is released. Returns ``members`` (released trajectories, in arrival order),
        ``member_event`` (the round of each member) and the ``consumed`` mask over all
        trajectories.
        """
        size = self.grpo_size
        if order is None:  # by group, arrival order within a group
            order = torch.argsort(codes, stable=True)
        first = torch.cumsum(counts, 0) - counts
        rank = torch.empty_like(codes)
        rank[order] = torch.arange(codes.numel()) - first[codes[order]]
        consumed = rank < (counts // size * size)[codes]
        members = consumed.nonzero().squeeze(-1)
        # Rounds numbered by (group, round); members of a round share group and rank // size.
        round_start = torch.cumsum(counts // size, 0) - counts // size
        return members, round_start[codes[members]] + rank[members] // size, consumed

    def _select_candidates(self, codes, returns, num_pending, state, batch):
        """torchrl's oversampled candidate groups: try the selector at each arrival."""
        size, selector = self.grpo_size, self.candidate_selector
        queues: dict[int, list[int]] = {}
        for j, code in enumerate(codes[:num_pending].tolist()):
            queues.setdefault(code, []).append(j)
        consumed = torch.zeros(codes.numel(), dtype=torch.bool)
        events: list[tuple[int, list[int]]] = []
        extra = dict.fromkeys(("dropped_groups", "rescued_groups", "unselected_trajectories"), 0)
        ret = returns.tolist()
        for j in range(num_pending, codes.numel()):
            queue = queues.setdefault(int(codes[j]), [])
            queue.append(j)
            if len(queue) < self.candidate_selection_min_size:
                continue
            candidates = TensorDict({"return": returns[queue].float()}, [len(queue)])
            if any(k != "return" for k in selector.in_keys):
                candidates["trajectories"] = lazy_stack(
                    [self._trajectory(state, batch, i) for i in queue]
                )
            picked = selector.select(
                candidates.select(*selector.in_keys, strict=True),
                group_size=size,
                keep_return_bounds=self.keep_return_bounds,
            )
            if picked is not None and self._passes_filters([ret[queue[i]] for i in picked]):
                if len(queue) > size:
                    first = [ret[i] for i in queue[:size]]
                    extra["rescued_groups"] += int(not self._passes_filters(first))
                    extra["unselected_trajectories"] += len(queue) - size
                events.append((j, [queue[i] for i in picked]))
            elif len(queue) == self.candidate_group_size:
                extra["dropped_groups"] += 1
            else:
                continue
            consumed[queue] = True
            queue.clear()
        members = torch.tensor([m for _, group in events for m in group], dtype=torch.long)
        member_event = torch.arange(len(events)).repeat_interleave(size)
        members, order = torch.sort(members)  # released in arrival order, as the fast path
        return members, member_event[order], consumed, extra

    def _passes_filters(self, group_returns: list[float]) -> bool:
        x = torch.tensor(group_returns, dtype=torch.float64)
        keep = self._keep_groups(x, torch.zeros(len(group_returns), dtype=torch.long), 1)
        return bool(keep[0])

    def _filtering(self) -> bool:
        """Whether a released group can be dropped (``keep_return_bounds``, ``std_threshold``)."""
        return self.keep_return_bounds is not None or self.std_threshold is not None

    def _keep_groups(self, x: Tensor, group_index: Tensor, num_groups: int, runs=None) -> Tensor:
        """Dynamic sampling (``keep_return_bounds``) and ``std_threshold``, per group."""
        keep = torch.ones(num_groups, dtype=torch.bool)
        if not self._filtering():
            return keep
        mean, _ = group_mean(x, group_index, num_groups, lengths=runs)
        if self.keep_return_bounds is not None:
            low, high = self.keep_return_bounds
            keep &= (mean > low) & (mean < high)
        if self.std_threshold is not None:
            std = group_std(x, group_index, num_groups, mean=mean, lengths=runs)
            keep &= std > self.std_threshold
        return keep

    # --- step 5-6: advantages for the released groups ---------------------------------------------

    def _returns(self, batch: Insertion) -> Tensor:
        n = batch.lengths.numel()
        if self.trajectory_return is None:
            return torch.zeros(n, dtype=torch.float64)
        reduction = RETURN_REDUCTIONS[self.trajectory_return]
        return reduction(batch.elements.double(), self._trajectories(batch))

    @staticmethod
    def _trajectories(batch: Insertion) -> Segments:
        """The insertion's reward elements as one run per trajectory."""
        return Segments(None, lengths=batch.element_lengths, width=batch.element_width)

    def _write_advantages(self, state, batch, members, member_event, num_events, lengths, returns):
        """Gather the released trajectories' steps, write their advantages, drop filtered groups.

        Released trajectory ``m`` is a contiguous run of ``steps[m]`` steps (``elems[m]`` reward
        elements) of the output, so every per-step value is a per-run value repeated
        (:class:`~torchrl_grpo.advantages.Segments`), never gathered by a per-step index.
        """
        everything = state.num_pending == 0 and members.numel() == batch.lengths.numel()
        steps = batch.lengths if everything else lengths[members]  # (M,) steps of each released

        def by_steps() -> Segments:  # each released trajectory as a run of its steps
            return Segments(None, lengths=steps, width=batch.width if everything else None)

        def by_elems() -> Segments:  # ... and as a run of its reward elements
            return Segments(None, lengths=elems)

        out = gather(state, batch, members)  # (S,) steps, or a list of S step copies
        reward = self._released_rewards(out)  # list of per-step tensors (ragged) or one tensor
        if isinstance(reward, list):
            counts = torch.tensor([r.numel() for r in reward])  # (S,)
            values = torch.cat([r.reshape(-1) for r in reward])
            dtype = reward[0].dtype
            ends = torch.cumsum(steps, 0) - 1
            elems = torch.diff(torch.cumsum(counts, 0)[ends], prepend=ends.new_zeros(1))  # (M,)
        else:
            values, dtype = reward.reshape(-1), reward.dtype
            per_step = math.prod(reward.shape[1:])
            elems = steps if per_step == 1 else steps * per_step  # (M,)

        est, ragged = self.estimators, isinstance(reward, list)
        per_key = None
        if est.reward_weights:  # GDPO: each reward's elements, and their weighted sum
            per_key = [_estimators.released_elements(out, key).double() for key in est.reward_keys]
            values = sum(w * v for (_, w), v in zip(est.reward_weights, per_key))  # (E,)
        if self.trajectory_return is None:  # every reward element is a sample; runs: members
            x, runs = values, elems
        else:  # every trajectory's return is a sample
            x, runs = (returns if everything else returns[members]), None
            if per_key is not None:  # each reward's returns
                reduce = RETURN_REDUCTIONS[self.trajectory_return]
                per_key = [reduce(v, by_elems()) for v in per_key]  # K x (M,)
        keep_event = self._keep_groups(x, member_event, num_events, runs)
        kw = dict(baseline=self.baseline, scale_rewards=self.scale_rewards, epsilon=self.epsilon)
        if per_key is None:
            adv = group_relative_advantage(
                x, member_event, num_events, whiten=est.whiten, lengths=runs, **kw
            )
        else:
            weights = torch.tensor([w for _, w in est.reward_weights], dtype=torch.float64)
            adv = multi_reward_advantage(
                torch.stack(per_key, 1), member_event, num_events, weights=weights,
                whiten=est.whiten, lengths=runs, **kw,
            )  # fmt: skip
        # adv is per trajectory (a return mode) or per reward element; GiGPO makes it per step.
        per_step_adv = est.anchor_key is not None and self.trajectory_return is not None
        if est.anchor_key is not None:  # GiGPO: each step's advantage within its step group
            per_elem = counts if ragged else per_step  # elements of each step
            if ragged:
                step_rewards = Segments(None, lengths=counts).sum(values.double())  # (S,)
            elif per_step > 1:
                step_rewards = values.double().view(-1, per_step).sum(1)  # (S,)
            else:
                step_rewards = values  # (S,)
            trajectories = by_steps()
            term = _estimators.step_term(
                step_rewards,
                steps,
                trajectories.expand(member_event),
                _estimators.released_anchors(out, est.anchor_key),
                est,
                width=trajectories.width,
                num_rounds=num_events,
                **kw,
            )  # (S,)
            if per_step_adv:
                adv = by_steps().expand(adv)  # (S,)
            elif ragged or per_step > 1:
                term = term.repeat_interleave(per_elem)  # (E,)
            if est.episode_reward_weight != 1.0:
                adv = est.episode_reward_weight * adv
            adv = adv.add(term, alpha=est.step_reward_weight)
        if self.step_norm:  # per trajectory: on its return, its steps or its elements
            norm = steps.to(adv.dtype)  # (M,)
            if per_step_adv:
                norm = by_steps().expand(norm)
            elif self.trajectory_return is None:
                norm = by_elems().expand(norm)
            adv = adv / norm
        adv = adv.to(dtype if dtype.is_floating_point else torch.get_default_dtype())
        if per_step_adv and ragged:
            adv = adv.repeat_interleave(counts)  # each step's advantage on its elements
        elif self.trajectory_return is not None and ragged:
            adv = by_elems().expand(adv)  # each trajectory's advantage on its elements
        elif self.trajectory_return is not None:  # on its steps, then on the reward's shape
            adv = adv if per_step_adv else by_steps().expand(adv)
            adv = adv.reshape(-1, *[1] * (reward.ndim - 1)).expand(reward.shape)

        if isinstance(out, list):
            for step, a in zip(out, adv.split(counts.tolist())):
                step.set(self.advantage_key, a.reshape(step.get(self.rewards_key).shape))
        else:
            out.set(self.advantage_key, adv.reshape(reward.shape))
        if not self._filtering() or keep_event.all():
            return (lazy_stack(out) if isinstance(out, list) else out), keep_event
        keep_step = by_steps().expand(keep_event[member_event])  # (S,)
        if isinstance(out, list):
            out = [step for step, k in zip(out, keep_step.tolist()) if k]
            return (lazy_stack(out) if out else None), keep_event
        return (out[keep_step] if keep_step.any() else None), keep_event

    def _released_rewards(self, out):
        if isinstance(out, list):
            return [step.get(self.rewards_key) for step in out]
        return out.get(self.rewards_key)

    @staticmethod
    def _trajectory(state: Pending, batch: Insertion | None, j: int) -> TensorDictBase:
        out = gather(state, batch, torch.tensor([j]))
        return lazy_stack(out) if isinstance(out, list) else out

    def _read_one(self, tensordict: TensorDictBase, state: Pending) -> Insertion | None:
        """Fast reading of the most frequent call: one dense trajectory (tensor or string id).

        Returns ``None`` whenever the input is anything else (several trajectories, ragged data,
        candidate selection, or any defect), leaving it to :meth:`_read_batch`, which also owns
        every error message.
        """
        if (
            state.ragged
            or tensordict.ndim != 1
            or isinstance(tensordict, LazyStackedTensorDict)
            or self._needs_selection()
            or self.estimators.reward_weights  # several rewards: read by _read_batch
        ):
            return None
        num_steps = tensordict.shape[0]
        done = tensordict.get(self.done_key, None)
        if not (isinstance(done, Tensor) and done.numel() == num_steps > 0):
            return None
        done = done.reshape(-1)
        if not done[-1] or int(done.sum()) != 1:  # no end, or several trajectories
            return None
        if self.estimators.anchor_key is not None:
            anchor = tensordict.get(self.estimators.anchor_key, None)
            if not (isinstance(anchor, Tensor) and anchor.shape[:1] == (num_steps,)):
                return None
        reward = tensordict.get(self.rewards_key, None)
        key = tensordict.get(self.prompt_key, None)
        if not (
            isinstance(reward, Tensor)
            and reward.shape[:1] == (num_steps,)
            and reward.numel() > 0
            and _all_finite(reward)
        ):
            return None
        if isinstance(key, Tensor):
            key = key[:1].reshape(1, -1)
            if isinstance(state.keys, list) or (
                state.num_pending and state.keys.shape[1] != key.shape[1]
            ):
                return None
        else:
            key = key.tolist() if hasattr(key, "tolist") else key
            key = key[0] if isinstance(key, list) and key else key
            if not isinstance(key, str) or isinstance(state.keys, Tensor) and state.num_pending:
                return None
            key = [key]
        values = reward.reshape(-1)
        lengths = _one_length(num_steps)
        element_lengths = lengths if values.numel() == num_steps else _one_length(values.numel())
        return Insertion(
            tensordict,
            _ZERO,
            lengths,
            key,
            values,
            element_lengths,
            num_steps,
            num_steps,
            values.numel(),
        )

    def _insert_one(
        self, batch: Insertion, state: Pending
    ) -> tuple[TensorDictBase | None, Pending]:
        """:meth:`_insert` for one trajectory: its group completes, or it waits; no sorting."""
        if isinstance(batch.keys, list):  # prompts: compared in Python
            same = [k == batch.keys[0] for k in as_list(state.keys)]
            count = sum(same)
        elif state.num_pending:
            equal = state.keys == batch.keys  # (Q, k)
            same = equal[:, 0] if equal.shape[1] == 1 else equal.all(1)  # (Q,)
            count = int(same.sum())
        else:
            same, count = [], 0
        batch_returns = self._returns(batch)  # (1,)
        if count + 1 < self.grpo_size:  # it waits: queue it, no copy, nothing else
            stats = self._count_arrivals(dict(state.stats), batch, batch_returns)
            return None, append(
                state, batch.data, batch.starts, batch.lengths, batch.keys, batch_returns, stats
            )
        same = torch.as_tensor(same, dtype=torch.bool)  # (Q,) the pending ones held < G
        returns = torch.cat([state.returns, batch_returns])  # (Q + 1,)
        consumed = torch.cat([same, torch.ones(1, dtype=torch.bool)])
        members = consumed.nonzero().squeeze(-1)
        member_event = torch.zeros_like(members)
        extra = {"dropped_groups": 0}
        return self._finish(
            state, batch, members, member_event, consumed, extra, returns, batch_returns
        )

    def _count_arrivals(self, stats: dict, batch: Insertion, returns: Tensor) -> dict:
        """torchrl's per-arrival counters (return statistics only with ``trajectory_return``).

        torchrl sums a trajectory's rewards for these whatever ``trajectory_return`` is.
        """
        stats["completed_trajectories"] += batch.lengths.numel()
        stats["completed_decisions"] += batch.num_steps
        if self.trajectory_return is not None:
            sums = (
                returns
                if self.trajectory_return == "sum"
                else self._trajectories(batch).sum(batch.elements.double())
            )  # (n,)
            stats["trajectory_return_sum"] += float(sums.sum())
            stats["trajectory_return_max"] = max(stats["trajectory_return_max"], float(sums.max()))
            stats["successful_trajectories"] += int((sums > 0).sum())
        return stats


def _stat_property(name: str) -> property:
    def get(self):
        return self._load().stats[name]

    def set(self, value) -> None:
        with self._lock:
            state = self._load()
            self._store(evolve(state, stats={**state.stats, name: value}))

    return property(get, set, doc=f"torchrl's ``{name}`` counter (see :meth:`get_stats`).")


for _name in STAT_NAMES:
    setattr(MCAdvantage, _name, _stat_property(_name))
del _name


_ZERO = torch.zeros(1, dtype=torch.long)  # the start of a lone trajectory (never written to)


@functools.lru_cache(maxsize=4096)
def _one_length(n: int) -> Tensor:
    """``torch.tensor([n])``, made once per length (never written to): a lone trajectory's."""
    return torch.tensor([n])


def _all_finite(x: Tensor) -> bool:
    """Whether every value is finite; one reduction when it is (a NaN or inf makes the sum so)."""
    return math.isfinite(x.sum().item()) or bool(torch.isfinite(x).all())


class _NoLock:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

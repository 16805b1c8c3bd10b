"""Releasing complete groups: their returns, the group filters, the advantages written on their
steps, and the statistics of an insertion.

The math is :func:`~torchrl_grpo.advantages.group_relative_advantage` (with several rewards,
:func:`~torchrl_grpo.advantages.multi_reward_advantage`; with step groups,
:func:`~torchrl_grpo.advantages.step_level_advantage`); this module fetches their inputs from the
released trajectories and writes their output back, as the loss module does.
"""

from __future__ import annotations

import functools
import math
from typing import TYPE_CHECKING, NamedTuple

import torch
from tensordict import TensorDictBase, lazy_stack
from torch import Tensor

from torchrl_grpo import _pending
from torchrl_grpo._pending import Returns
from torchrl_grpo.advantages import (
    RETURN_REDUCTIONS,
    Segments,
    anchor_step_groups,
    discounted_returns,
    group_relative_advantage,
    group_std,
    multi_reward_advantage,
    step_level_advantage,
)

if TYPE_CHECKING:
    from torchrl_grpo._grouping import Rounds
    from torchrl_grpo._pending import Pending
    from torchrl_grpo._reading import Insertion, Keys

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
    # beyond torchrl: steps of unfinished trajectories given up (``traj_key``), held or arriving
    "evicted_steps",
)


def fresh_stats() -> dict:
    """Every counter at its start value (torchrl's, plus the eviction counters)."""
    stats = dict.fromkeys(STAT_NAMES, 0)
    stats["trajectory_return_sum"] = 0.0
    stats["trajectory_return_max"] = float("-inf")
    return stats


class StepGroups(NamedTuple):
    """GiGPO's step-level groups (``MCAdvantage``'s ``anchor_key`` and its weights)."""

    episode_weight: float  # on the group-level advantage
    step_weight: float  # on the step-level advantage
    gamma: float  # discount of the step-level returns


class Estimator(NamedTuple):
    """How a released group's rewards become advantages (see ``MCAdvantage``'s arguments)."""

    trajectory_return: str | None  # None: every reward element is a sample
    baseline: str
    scale_rewards: str
    epsilon: float
    step_norm: bool
    # beyond torchrl: whitening over the released samples, GiGPO's step groups (None: none),
    # and the discount of each step's reward-to-go as its sample (None: the reward itself)
    whiten: bool = False
    step_groups: StepGroups | None = None
    reward_to_go_gamma: float | None = None


class GroupFilter(NamedTuple):
    """Which complete groups are written: dynamic sampling and the std threshold.

    ``keep_return_bounds`` is decided as torchrl 0.14.1 decides it, in two tests on the returns
    as torchrl computes them (in the reward's dtype, see :func:`torchrl_returns`):

    1. *selection*: ``MCAdvantageSelector`` takes the group if the mean of its returns as Python
       floats, summed left to right, lies strictly inside the bounds;
    2. *keeping*: the selected group is then dropped unless ``float(returns.mean())``, the mean in
       the reward's dtype, lies strictly inside them too.

    torchrl counts a group in ``selected_trajectories`` after the first test. ``std_threshold``
    (not in torchrl) is part of selection: a group whose float64 std of the advantage's samples
    is at or below it is neither selected nor written.
    """

    keep_return_bounds: tuple[float, float] | None
    std_threshold: float | None

    @property
    def active(self) -> bool:
        return self.keep_return_bounds is not None or self.std_threshold is not None

    def apply(
        self,
        x: Tensor,
        group_index: Tensor,
        num_groups: int,
        *,
        runs: Tensor | None = None,
        torchrl_returns: Tensor | None = None,
    ) -> tuple[Tensor, Tensor]:
        """Per group, whether it is selected, and whether it is written.

        Args:
            x: the advantage's samples, ``(S,)``; with ``runs``, contiguous runs of one group.
            group_index: the group of each sample (of each run with ``runs``).
            num_groups: ``G``.
            runs: samples per run, or ``None``.
            torchrl_returns: ``(G, size)`` the returns of each group as torchrl computes them, in
                the order torchrl sees them; needed with ``keep_return_bounds``.

        Returns:
            ``(selected, kept)``, each ``(G,)`` bool; ``kept`` implies ``selected``.
        """
        selected = torch.ones(num_groups, dtype=torch.bool)
        kept = selected
        if self.std_threshold is not None:
            selected = group_std(x, group_index, num_groups, lengths=runs) > self.std_threshold
            kept = selected
        if self.keep_return_bounds is not None:
            python_mean, dtype_mean = _means(torchrl_returns)
            selected = selected & _inside(python_mean, self.keep_return_bounds)
            kept = selected & _inside(dtype_mean, self.keep_return_bounds)
        return selected, kept

    def selects(self, returns: Tensor, torchrl_returns: Tensor) -> bool:
        """Whether one group passes selection (see the class); ``(size,)`` returns each."""
        if self.std_threshold is not None:
            zeros = torch.zeros(returns.shape[0], dtype=torch.long)
            if not bool(group_std(returns, zeros, 1) > self.std_threshold):
                return False
        if self.keep_return_bounds is None:
            return True
        low, high = self.keep_return_bounds
        values = torchrl_returns.tolist()
        return low < sum(values) / len(values) < high

    def keeps_selected(self, torchrl_returns: Tensor) -> bool:
        """Whether a selected group is written: its mean in the reward's dtype in the bounds."""
        if self.keep_return_bounds is None:
            return True
        return bool(_inside(_means(torchrl_returns[None])[1], self.keep_return_bounds))


def _means(returns: Tensor) -> tuple[Tensor, Tensor]:
    """The two means torchrl compares with the bounds, for ``(G, size)`` returns, as float64.

    ``sum(values) / size`` over Python floats, left to right, is a float64 running sum
    (``cumsum``); ``float(returns.mean())`` in the reward's dtype is a row mean (a row of a
    ``(G, size)`` tensor rounds as the row alone does).
    """
    python_mean = torch.cumsum(returns.double(), 1)[:, -1] / returns.shape[1]
    dtype_mean = (returns if returns.is_floating_point() else returns.double()).mean(1)
    return python_mean, dtype_mean.double()


def _inside(mean: Tensor, bounds: tuple[float, float]) -> Tensor:
    low, high = bounds  # compared as Python floats compare: in float64
    return (low < mean) & (mean < high)


# --- returns ------------------------------------------------------------------------------------

_NO_RETURN = torch.zeros(1, dtype=torch.float64)  # a lone trajectory's unused return (read-only)


def trajectory_returns(batch: Insertion, trajectory_return: str | None) -> Tensor:
    """Each incoming trajectory's return in float64, ``(n,)`` (zeros without a return mode)."""
    n = batch.num_trajectories
    if trajectory_return is None:
        return _NO_RETURN if n == 1 else torch.zeros(n, dtype=torch.float64)
    reduction = RETURN_REDUCTIONS[trajectory_return]
    runs = Segments(None, lengths=batch.reward_lengths, width=batch.reward_width)
    return reduction(batch.rewards.double(), runs)


def torchrl_returns(rewards: Tensor, lengths: Tensor, trajectory_return: str) -> Tensor:
    """Returns as torchrl computes them: ``reward.sum()`` (``.max()``, ``.mean()``) of each
    trajectory's reward tensor, in its dtype, so that they round as torchrl's do.

    A reduction over the rows of a ``(n, L)`` tensor rounds as the same reduction over each row
    alone, so trajectories are reduced a length at a time (one pass per distinct length).

    Args:
        rewards: ``(E,)`` every reward element, trajectory after trajectory.
        lengths: ``(n,)`` reward elements of each trajectory.
        trajectory_return: ``"sum"``, ``"max"``, ``"mean"`` or ``"last"``.

    Returns:
        ``(n,)`` in the reward's dtype (the default float dtype for integer rewards).
    """
    if not rewards.is_floating_point():
        rewards = rewards.to(torch.get_default_dtype())
    if trajectory_return == "last":
        return rewards[torch.cumsum(lengths, 0) - 1]

    def reduce(rows: Tensor) -> Tensor:  # (m, L) -> (m,)
        if trajectory_return == "sum":
            return rows.sum(1)
        return rows.amax(1) if trajectory_return == "max" else rows.mean(1)

    shortest, longest = (int(v) for v in torch.aminmax(lengths))
    if shortest == longest:
        return reduce(rewards.view(-1, shortest))
    out = torch.empty(lengths.shape[0], dtype=rewards.dtype)
    starts = torch.cumsum(lengths, 0) - lengths
    for length in torch.unique(lengths).tolist():
        which = (lengths == length).nonzero().squeeze(1)  # trajectories of this length
        rows = rewards[_pending.ranges(starts[which], lengths[which])].view(-1, length)
        out[which] = reduce(rows)
    return out


# --- release ------------------------------------------------------------------------------------


class Released(NamedTuple):
    out: TensorDictBase | None  # the steps to store, advantages written (None: nothing)
    written: int  # released groups that passed the filters
    selected: int  # released groups that passed selection (see GroupFilter); 0 for rounds
    # chosen by candidate selection, which counts its own


def release(
    state: Pending,
    batch: Insertion,
    rounds: Rounds,
    returns: Returns,
    *,
    estimator: Estimator,
    group_filter: GroupFilter,
    keys: Keys,
) -> Released:
    """Gather the released trajectories' steps, write their advantages, drop filtered groups.

    Released trajectory ``m`` is a contiguous run of ``steps[m]`` steps (``elems[m]`` reward
    elements) of the output, so every per-step value is a per-run value repeated
    (:class:`~torchrl_grpo.advantages.Segments`), never gathered by a per-step index.

    Args:
        state: the pending trajectories before the insertion.
        batch: the insertion.
        rounds: the released groups (at least one).
        returns: ``(Q + n,)`` the returns of pending ++ incoming.
        estimator: the advantage's options.
        group_filter: which released groups are written.
        keys: the reward and advantage keys.
    """
    members, member_round, num_rounds = rounds.members, rounds.member_round, rounds.num_rounds
    q = state.num_pending
    everything = q == 0 and members.shape[0] == batch.num_trajectories
    if everything:
        steps, released_returns = batch.lengths, returns
    else:
        lengths = torch.cat([state.lengths, batch.lengths]) if q else batch.lengths  # (Q + n,)
        steps, released_returns = lengths[members], returns.take(members)  # (M,)

    def by_steps() -> Segments:  # each released trajectory as a run of its steps
        return Segments(None, lengths=steps, width=batch.width if everything else None)

    def by_elems() -> Segments:  # ... and as a run of its reward elements
        return Segments(None, lengths=elems)

    out = _pending.gather(state, batch, members)  # (S,) steps, or a list of S step copies
    reward = (
        [step.get(keys.reward) for step in out] if isinstance(out, list) else out.get(keys.reward)
    )  # per-step tensors (ragged), or one tensor
    if isinstance(reward, list):
        counts = torch.tensor([r.numel() for r in reward])  # (S,)
        values = torch.cat([r.reshape(-1).cpu() for r in reward])  # computed on the CPU
        dtype = reward[0].dtype
        ends = torch.cumsum(steps, 0) - 1
        elems = torch.diff(torch.cumsum(counts, 0)[ends], prepend=ends.new_zeros(1))  # (M,)
    else:
        values, dtype = reward.reshape(-1).cpu(), reward.dtype  # computed on the CPU
        per_step = math.prod(reward.shape[1:])
        elems = steps if per_step == 1 else steps * per_step  # (M,)

    ragged = isinstance(reward, list)
    gamma = estimator.reward_to_go_gamma
    if gamma is not None:  # each element becomes its discounted sum to its trajectory's end
        # (dense steps only: the transform rejects ragged ones with a reward-to-go)
        to_go = functools.partial(
            _rewards_to_go, steps=steps, per_step=per_step, gamma=gamma,
            width=batch.width if everything else None,
        )  # fmt: skip
    per_key = None
    if keys.reward_weights:  # GDPO: each reward's elements, and their weighted sum
        per_key = [_released_elements(out, key).double() for key, _ in keys.reward_weights]
        if gamma is not None:
            per_key = [to_go(v) for v in per_key]
        values = sum(w * v for (_, w), v in zip(keys.reward_weights, per_key))  # (E,)
    elif gamma is not None:
        values = to_go(values)  # (E,) float64
    if estimator.trajectory_return is None:  # every reward element is a sample; runs: members
        x, runs = values, elems
    else:  # every trajectory's return is a sample
        x, runs = released_returns.value, None
        if per_key is not None:  # each reward's returns
            reduce = RETURN_REDUCTIONS[estimator.trajectory_return]
            per_key = [reduce(v, by_elems()) for v in per_key]  # K x (M,)
    keep, selected = None, 0 if rounds.filtered else num_rounds
    if group_filter.active and not rounds.filtered:
        selection, keep = group_filter.apply(
            x,
            member_round,
            num_rounds,
            runs=runs,
            torchrl_returns=_by_round(released_returns.torchrl, member_round, num_rounds),
        )
        selected = int(selection.sum())
    kw = dict(
        baseline=estimator.baseline,
        scale_rewards=estimator.scale_rewards,
        epsilon=estimator.epsilon,
    )
    if per_key is None:
        adv = group_relative_advantage(
            x, member_round, num_rounds, whiten=estimator.whiten, lengths=runs, **kw
        )
    else:
        adv = multi_reward_advantage(
            torch.stack(per_key, 1),
            member_round,
            num_rounds,
            weights=torch.tensor([w for _, w in keys.reward_weights], dtype=torch.float64),
            whiten=estimator.whiten,
            lengths=runs,
            **kw,
        )
    # adv is per trajectory (a return mode) or per reward element; step groups make it per step.
    groups = estimator.step_groups
    per_step_adv = groups is not None and estimator.trajectory_return is not None
    if groups is not None:  # GiGPO: plus each step's advantage within its step group
        if ragged:
            step_rewards = Segments(None, lengths=counts).sum(values.double())  # (S,)
        elif per_step > 1:
            step_rewards = values.double().view(-1, per_step).sum(1)  # (S,)
        else:
            step_rewards = values  # (S,)
        trajectories = by_steps()
        step_round = trajectories.expand(member_round)  # (S,)
        anchors = _released_anchors(out, keys.anchor)  # (S, ...)
        step_group, num_step_groups = anchor_step_groups(step_round, anchors, num_rounds)
        term = step_level_advantage(
            step_rewards,
            steps,
            step_group,
            num_step_groups,
            gamma=groups.gamma,
            width=trajectories.width,
            **kw,
        )  # (S,)
        if per_step_adv:
            adv = trajectories.expand(adv)  # (S,)
        elif ragged or per_step > 1:
            term = term.repeat_interleave(counts if ragged else per_step)  # (E,)
        if groups.episode_weight != 1.0:
            adv = groups.episode_weight * adv
        adv = adv.add(term, alpha=groups.step_weight)
    if estimator.step_norm:  # per trajectory: on its return, its steps or its elements
        norm = steps.to(adv.dtype)  # (M,)
        if per_step_adv:
            norm = by_steps().expand(norm)
        elif estimator.trajectory_return is None:
            norm = by_elems().expand(norm)
        adv = adv / norm
    adv = adv.to(dtype if dtype.is_floating_point else torch.get_default_dtype())
    if per_step_adv and ragged:
        adv = adv.repeat_interleave(counts)  # each step's advantage on its elements
    elif estimator.trajectory_return is not None and ragged:
        adv = by_elems().expand(adv)  # each trajectory's advantage on its elements
    elif estimator.trajectory_return is not None:  # on its steps, then on the reward's shape
        adv = adv if per_step_adv else by_steps().expand(adv)
        adv = adv.reshape(-1, *[1] * (reward.ndim - 1)).expand(reward.shape)

    if isinstance(out, list):
        for step, a in zip(out, adv.split(counts.tolist())):
            r = step.get(keys.reward)
            step.set(keys.advantage, a.to(r.device).reshape(r.shape))
    else:  # on the reward's device (the CPU's values, copied once)
        out.set(keys.advantage, adv.to(reward.device).reshape(reward.shape))
    if keep is None or bool(keep.all()):
        return Released(lazy_stack(out) if isinstance(out, list) else out, num_rounds, selected)
    written = int(keep.sum())
    keep_step = by_steps().expand(keep[member_round])  # (S,)
    if isinstance(out, list):
        out = [step for step, k in zip(out, keep_step.tolist()) if k]
        return Released(lazy_stack(out) if out else None, written, selected)
    return Released(out[keep_step] if written else None, written, selected)


def _rewards_to_go(
    values: Tensor, *, steps: Tensor, per_step: int, gamma: float, width: int | None
) -> Tensor:
    """Each reward element's discounted sum to the end of its trajectory, float64 ``(E,)``.

    ``values`` holds ``per_step`` elements for each step, the released trajectories one after
    the other (``steps`` each); element ``j`` of a step is discounted along element ``j`` of the
    later steps of its trajectory, as torchrl's ``reward2go`` treats trailing dimensions.
    """
    if per_step == 1:
        return discounted_returns(values, steps, gamma, width=width)
    columns = values.view(-1, per_step).T.reshape(-1)  # (k * S,): element j of every step, ...
    to_go = discounted_returns(columns, steps.repeat(per_step), gamma, width=width)
    return to_go.view(per_step, -1).T.reshape(-1)


def _released_elements(out: TensorDictBase | list, key) -> Tensor:
    """One reward's elements over the released steps, flat, in order."""
    if isinstance(out, list):
        return torch.cat([step.get(key).reshape(-1).cpu() for step in out])
    return out.get(key).reshape(-1).cpu()


def _released_anchors(out: TensorDictBase | list, key) -> Tensor:
    """The released steps' anchor states as a tensor ``(S, ...)`` compared by value.

    Strings, and tensors whose shape differs from step to step (ragged token ids), become one
    integer code per distinct value through a dictionary: a Python loop over the steps, which only
    such anchors need (pass a tensor, or a hash, to stay vectorized).
    """
    if isinstance(out, list):
        values = [getattr(v, "data", v) for v in (step.get(key) for step in out)]
    else:
        value = out.get(key)
        if isinstance(value, Tensor):
            return value.cpu()
        values = value.tolist() if hasattr(value, "tolist") else value
        values = values if isinstance(values, list) else [values] * out.shape[0]
    if values and all(isinstance(v, Tensor) for v in values):
        if len({tuple(v.shape) for v in values}) == 1:
            return torch.stack([v.cpu() for v in values])
        values = [(str(v.dtype), tuple(v.shape), *v.reshape(-1).tolist()) for v in values]
    table: dict = {}
    return torch.tensor([table.setdefault(v, len(table)) for v in values], dtype=torch.long)


def _by_round(values: Tensor | None, member_round: Tensor, num_rounds: int) -> Tensor | None:
    """``(M,)`` values of released trajectories as ``(R, size)``, each round in arrival order."""
    if values is None:
        return None
    if num_rounds > 1:
        values = values[torch.argsort(member_round, stable=True)]
    return values.view(num_rounds, -1)


# --- statistics ---------------------------------------------------------------------------------


def count(
    stats: dict,
    batch: Insertion,
    returns: Tensor,
    rounds: Rounds,
    released: Released,
    *,
    trajectory_return: str | None,
    group_size: int,
) -> dict:
    """The statistics after an insertion (a new dict).

    Args:
        stats: before the insertion.
        batch: the insertion.
        returns: ``(n,)`` the incoming trajectories' float64 returns.
        rounds: the groups it completed.
        released: how many of them were selected and written.
        trajectory_return: the return mode (``None``: per-step samples).
        group_size: ``grpo_size``.
    """
    stats = dict(stats)
    stats["completed_trajectories"] += batch.num_trajectories
    stats["completed_decisions"] += batch.num_steps
    if trajectory_return is not None:  # torchrl sums the rewards, whatever the return mode
        if trajectory_return == "sum":
            sums = returns
        else:
            runs = Segments(None, lengths=batch.reward_lengths, width=batch.reward_width)
            sums = runs.sum(batch.rewards.double())  # (n,)
        if sums.shape[0] == 1:  # one value: read once
            total = most = sums.item()
            successful = int(total > 0)
        else:
            total, most = float(sums.sum()), float(sums.max())
            successful = int((sums > 0).sum())
        stats["trajectory_return_sum"] += total
        stats["trajectory_return_max"] = max(stats["trajectory_return_max"], most)
        stats["successful_trajectories"] += successful
        stats["selected_trajectories"] += (rounds.selected + released.selected) * group_size
    dropped = rounds.num_rounds - released.written + rounds.given_up
    stats["completed_groups"] += rounds.num_rounds + rounds.given_up
    stats["written_groups"] += released.written
    stats["dropped_groups"] += dropped
    stats["rescued_groups"] += rounds.rescued
    stats["unselected_trajectories"] += rounds.unselected
    return stats

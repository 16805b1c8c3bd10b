"""Releasing complete groups: their steps gathered, the group filters, the advantages written.

How the advantages are computed is the estimator's (``options.estimator``, an object of
:mod:`~torchrl_grpo.mcadvantage.estimators`): this module gathers the released trajectories,
hands their samples to its methods and keeps what the filters keep; it names no estimator.

Released trajectory ``m`` is a contiguous run of ``steps[m]`` steps (``elems[m]`` reward
elements) of the output, so every per-step value is a per-run value repeated
(:class:`~torchrl_grpo.advantages.Segments`), never gathered by a per-step index.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from torchrl_grpo.advantages import RETURN_REDUCTIONS
from torchrl_grpo.mcadvantage import filters
from torchrl_grpo.mcadvantage import returns as returns_
from torchrl_grpo.mcadvantage.host import read_ints
from torchrl_grpo.mcadvantage.pending import gather
from torchrl_grpo.mcadvantage.records import (
    Insertion,
    Pending,
    Released,
    ReleasedGroups,
    Returns,
    Rounds,
    Samples,
)
from torchrl_grpo.mcadvantage.steps import Steps
from torchrl_grpo.mcadvantage.store import LENGTH

if TYPE_CHECKING:
    from torchrl_grpo.mcadvantage.options import Options

__all__ = ["release"]


def release(
    pending: Pending, batch: Insertion, rounds: Rounds, returns: Returns, options: Options
) -> Released:
    """Gather the released trajectories' steps, write their advantages, drop filtered groups.

    Args:
        pending: the pending trajectories before the insertion.
        batch: the insertion.
        rounds: the released groups (at least one).
        returns: ``(Q + n,)`` the returns of pending ++ incoming.
        options: the estimator, the group filters and the keys.
    """
    estimator = options.estimator
    members, member_round, num_rounds = rounds.members, rounds.member_round, rounds.num_rounds
    q = pending.num_pending
    everything = q == 0 and members.shape[0] == batch.num_trajectories
    if everything:
        steps, released = batch.lengths, returns
    else:
        lengths = batch.lengths
        if q:
            lengths = torch.cat([pending.spans[:, LENGTH], lengths])  # (Q + n,)
        steps, released = lengths[members], returns_.take(returns, members)  # (M,)
    out = gather(pending, batch, members, rounds.sizes)  # (S,) steps (copies when ragged)
    width = batch.width if everything else getattr(rounds.sizes, "width", None)
    samples = _samples(out, steps, width, options, getattr(rounds.sizes, "longest", None))
    if options.trajectory_return is None:  # every reward element is a sample; runs: members
        x, runs = samples.values, samples.elems
    else:  # every trajectory's return is a sample
        x, runs = released.value, None
        if samples.per_key is not None:  # each reward's returns
            reduce = RETURN_REDUCTIONS[options.trajectory_return]
            by_elems = samples.by_elems()
            samples = samples._replace(per_key=[reduce(v, by_elems) for v in samples.per_key])
    selection, keep = None, None
    if options.group_filter.active and not rounds.filtered:
        selection, keep = filters.filter_groups(
            options.group_filter,
            x,
            member_round,
            num_rounds,
            runs=runs,
            torchrl_returns=_by_round(released.torchrl, member_round, num_rounds),
            by_time_step=estimator.compares_time_steps,  # between trajectories
            width=None if runs is None else samples.elems_width,
        )
    groups = ReleasedGroups(x, runs, member_round, num_rounds, samples, out, options.keys)
    adv = estimator.group_advantage(groups)
    adv = _on_elements(adv, samples, options)
    metrics = estimator.write(groups, adv)
    selected = 0 if rounds.filtered else num_rounds  # with filters: read with what they keep
    released = _written(out, selection, keep, samples, member_round, num_rounds, selected)
    return released._replace(metrics=metrics)


def _samples(out: Steps, steps: Tensor, width, options: Options, longest=None) -> Samples:
    """The released steps' reward elements (weighted with several rewards, as the estimator
    compares them: discounted to go by :class:`RewardToGo`) and how they split into
    trajectories and steps."""
    keys, estimator = options.keys, options.estimator
    values, elements = out.reward_elements(keys.reward)  # computed on the CPU
    elems = elements.per_run(steps)  # (M,)
    samples = Samples(values, values.dtype, steps, elems, elements, width, None, len(out))
    if keys.reward_weights:  # GDPO: each reward's elements, and their weighted sum
        per_key = [out.reward_elements(key)[0].double() for key, _ in keys.reward_weights]
        per_key = [estimator.sample_values(v, samples, longest) for v in per_key]
        values = sum(w * v for (_, w), v in zip(keys.reward_weights, per_key))  # (E,)
        return samples._replace(values=values, per_key=per_key)
    return samples._replace(values=estimator.sample_values(values, samples, longest))


def _on_elements(adv: Tensor, samples: Samples, options: Options) -> Tensor:
    """The advantage divided by each trajectory's length with ``step_norm``, in the reward's
    dtype, on every reward element ``(E,)``: from per trajectory (a return mode), per step (step
    groups in a return mode: one per step, more than the trajectories) or per element."""
    group = options.estimator.group
    per_trajectory = options.trajectory_return is not None
    per_step_adv = per_trajectory and adv.shape[0] != samples.steps.shape[0]
    if (
        group is not None and group.step_norm
    ):  # per trajectory: on its return, its steps or its elements
        norm = samples.steps.to(adv.dtype)  # (M,)
        if per_step_adv:
            norm = samples.by_steps().expand(norm)
        elif not per_trajectory:
            norm = samples.by_elems().expand(norm)
        adv = adv / norm
    dtype = samples.dtype
    adv = adv.to(dtype if dtype.is_floating_point else torch.get_default_dtype())
    if not per_trajectory:
        return adv
    adv = adv if per_step_adv else samples.by_steps().expand(adv)  # (S,)
    return samples.elements.spread(adv)  # (E,)


def _written(out: Steps, selection, keep, samples: Samples, member_round, num_rounds, selected):
    """What storage receives: every released step, or those of the groups the filters keep
    (their counts read at once)."""
    if keep is None:
        return Released(out.output(), num_rounds, selected)
    keep_step = samples.by_steps().expand(keep[member_round])  # (S,)
    selected, written, steps = read_ints(selection.sum(), keep.sum(), keep_step.sum())
    if written == num_rounds:
        return Released(out.output(), num_rounds, selected)
    if not written:
        return Released(None, 0, selected)
    kept = out.take(torch.nonzero_static(keep_step, size=steps).squeeze(1))
    return Released(kept.output(), written, selected)


def _by_round(values: Tensor | None, member_round: Tensor, num_rounds: int) -> Tensor | None:
    """``(M,)`` values of released trajectories as ``(R, size)``, each round in arrival order."""
    if values is None:
        return None
    if num_rounds > 1:
        values = values[torch.argsort(member_round, stable=True)]
    return values.view(num_rounds, -1)

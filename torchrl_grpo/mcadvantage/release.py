"""Releasing complete groups: their steps gathered, the group filters, the advantages written.

The math is :func:`~torchrl_grpo.advantages.group_relative_advantage` (with several rewards,
:func:`~torchrl_grpo.advantages.multi_reward_advantage`; with step groups,
:func:`~torchrl_grpo.advantages.step_level_advantage`); this module fetches their inputs from the
released trajectories and writes their output back, as the loss module does.

Released trajectory ``m`` is a contiguous run of ``steps[m]`` steps (``elems[m]`` reward
elements) of the output, so every per-step value is a per-run value repeated
(:class:`~torchrl_grpo.advantages.Segments`), never gathered by a per-step index.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

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
from torchrl_grpo.mcadvantage import distillation, filters
from torchrl_grpo.mcadvantage import returns as returns_
from torchrl_grpo.mcadvantage.host import read_ints
from torchrl_grpo.mcadvantage.options import Options
from torchrl_grpo.mcadvantage.pending import gather
from torchrl_grpo.mcadvantage.records import Insertion, Pending, Released, Returns, Rounds
from torchrl_grpo.mcadvantage.steps import Elements, Steps, Uniform
from torchrl_grpo.mcadvantage.store import LENGTH

__all__ = ["release", "released_anchors"]


class _Samples(NamedTuple):
    """The released trajectories' rewards, as the advantage reads them."""

    values: Tensor  # (E,) every reward element (float64 once weighted or discounted)
    dtype: torch.dtype  # the reward's, which the advantage is written in
    steps: Tensor  # (M,) steps of each released trajectory
    elems: Tensor  # (M,) reward elements of each
    elements: Elements  # how the reward elements lie on the steps
    width: int | None  # the steps of every trajectory when known to be equal (0: they differ)
    per_key: list | None  # with several rewards, each one's elements (or returns): K x (E,)
    num_steps: int  # S

    @property
    def elems_width(self) -> int | None:  # the reward elements of every trajectory, if equal
        return None if self.width is None else self.elements.run_width(self.width)

    def by_steps(self) -> Segments:  # each released trajectory as a run of its steps
        return Segments(None, lengths=self.steps, width=self.width, total=self.num_steps)

    def by_elems(self) -> Segments:  # ... and as a run of its reward elements
        total = self.values.shape[0]
        return Segments(None, lengths=self.elems, width=self.elems_width, total=total)


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
    if estimator.trajectory_return is None:  # every reward element is a sample; runs: members
        x, runs = samples.values, samples.elems
    else:  # every trajectory's return is a sample
        x, runs = released.value, None
        if samples.per_key is not None:  # each reward's returns
            reduce = RETURN_REDUCTIONS[estimator.trajectory_return]
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
            by_time_step=estimator.reward_to_go_gamma is not None,  # between trajectories
            width=None if runs is None else samples.elems_width,
        )
    width = None if runs is None else samples.elems_width
    adv = _group_advantage(x, runs, width, samples.per_key, member_round, num_rounds, options)
    if estimator.reward_to_go_gamma is not None and estimator.reward_to_go_baseline == "group":
        adv = _identical_to_zero(adv, samples, member_round, num_rounds)
    if estimator.step_groups is not None:
        adv = _with_step_groups(adv, samples, out, member_round, num_rounds, options)
    adv = _on_elements(adv, samples, options)
    metrics = _write(out, adv, samples, options, (member_round, num_rounds))
    selected = 0 if rounds.filtered else num_rounds  # with filters: read with what they keep
    released = _written(out, selection, keep, samples, member_round, num_rounds, selected)
    return released._replace(metrics=metrics)


def _write(out: Steps, adv: Tensor, samples: _Samples, options: Options, groups) -> dict | None:
    """Write the advantage of every reward element ``adv`` ``(E,)`` on the released steps, in
    the reward's shape and device; with distillation, every token's (in the tokens' shape),
    and return its statistics."""
    keys, distill = options.keys, options.distillation
    if distill is None:
        out.write(keys.advantage, adv, keys.reward)  # on the reward's device, in its shape
        return None
    per_step = None if distill.alpha == 0.0 else _per_step(adv, samples.elements)
    tokens, metrics = distillation.token_advantages(distill, out, per_step, samples.steps, groups)
    out.write(keys.advantage, tokens, distill.tokens_key)
    return metrics


def _per_step(adv: Tensor, elements: Elements) -> Tensor:
    """Each step's advantage ``(S,)`` from its reward elements' (the first: a return mode spreads
    one value on them, and per-step samples have one, checked on insertion)."""
    if isinstance(elements, Uniform):
        return adv if elements.per_step == 1 else adv.view(-1, elements.per_step)[:, 0]
    return adv[torch.cumsum(elements.counts, 0) - elements.counts]


def _samples(out: Steps, steps: Tensor, width, options: Options, longest=None) -> _Samples:
    """The released steps' reward elements (weighted with several rewards, discounted to go
    with ``reward_to_go_gamma``) and how they split into trajectories and steps."""
    keys, gamma = options.keys, options.estimator.reward_to_go_gamma
    values, elements = out.reward_elements(keys.reward)  # computed on the CPU
    dtype = values.dtype
    elems = elements.per_run(steps)  # (M,)

    def to_go(v: Tensor) -> Tensor:  # (dense steps only: ragged ones are rejected on reading)
        per_step = elements.per_step
        return _rewards_to_go(
            v, steps=steps, per_step=per_step, gamma=gamma, width=width, longest=longest
        )

    per_key = None
    if keys.reward_weights:  # GDPO: each reward's elements, and their weighted sum
        per_key = [out.reward_elements(key)[0].double() for key, _ in keys.reward_weights]
        if gamma is not None:
            per_key = [to_go(v) for v in per_key]
        values = sum(w * v for (_, w), v in zip(keys.reward_weights, per_key))  # (E,)
    elif gamma is not None:
        values = to_go(values)  # (E,) float64
    return _Samples(values, dtype, steps, elems, elements, width, per_key, len(out))


def _group_advantage(x, runs, width, per_key, member_round, num_rounds: int, options: Options):
    """The group-level advantage of every sample: per trajectory (a return mode) or per reward
    element (``runs``: elements per trajectory, ``width`` of each when equal)."""
    estimator = options.estimator
    kw = dict(
        width=width,
        baseline=estimator.baseline,
        scale_rewards=estimator.scale_rewards,
        epsilon=estimator.epsilon,
        whiten=estimator.whiten,
        lengths=runs,
        by_time_step=estimator.reward_to_go_baseline != "group",
        time_step_scale="cell" if estimator.reward_to_go_baseline == "step_group" else "pooled",
    )
    if per_key is None:
        return group_relative_advantage(x, member_round, num_rounds, **kw)
    weights = [w for _, w in options.keys.reward_weights]
    return multi_reward_advantage(
        torch.stack(per_key, 1),
        member_round,
        num_rounds,
        weights=torch.tensor(weights, dtype=torch.float64),
        **kw,
    )


def _identical_to_zero(adv: Tensor, samples: _Samples, member_round, num_rounds: int) -> Tensor:
    """Rewards-to-go over the group's steps: zero the advantages of a group whose trajectories
    have, reward by reward, the same samples at every time step (identical episodes), which the
    constant baseline would otherwise rank by time step. The group's trajectories then differ in
    nothing, and the other modes give them ``0`` too."""
    runs, width = samples.elems, samples.elems_width
    values = samples.per_key or [samples.values]
    spread = sum(
        group_std(v, member_round, num_rounds, lengths=runs, by_time_step=True, width=width)
        for v in values
    )
    same = spread == 0  # (rounds,) exact: equal samples have deviations of exactly 0
    return adv.masked_fill(samples.by_elems().expand(same[member_round]), 0.0)


def _with_step_groups(adv, samples: _Samples, out: Steps, member_round, num_rounds, options):
    """GiGPO: the group-level advantage weighted, plus each step's advantage within its step
    group (steps of one group with the same anchor state); per step in a return mode, per
    reward element otherwise."""
    estimator = options.estimator
    groups = estimator.step_groups
    step_rewards = samples.elements.step_sums(samples.values)  # (S,)
    trajectories = samples.by_steps()
    step_round = trajectories.expand(member_round)  # (S,)
    anchors = released_anchors(out, options.keys.anchor)  # (S, ...)
    step_group, num_step_groups = anchor_step_groups(step_round, anchors, num_rounds)
    term = step_level_advantage(
        step_rewards,
        samples.steps,
        step_group,
        num_step_groups,
        gamma=groups.gamma,
        baseline=estimator.baseline,
        scale_rewards=estimator.scale_rewards,
        epsilon=estimator.epsilon,
        width=trajectories.width,
    )  # (S,)
    if estimator.trajectory_return is not None:
        adv = trajectories.expand(adv)  # (S,)
    else:
        term = samples.elements.spread(term)  # (E,)
    if groups.episode_weight != 1.0:
        adv = groups.episode_weight * adv
    return adv.add(term, alpha=groups.step_weight)


def _on_elements(adv: Tensor, samples: _Samples, options: Options) -> Tensor:
    """The advantage divided by each trajectory's length with ``step_norm``, in the reward's
    dtype, on every reward element ``(E,)``: from per trajectory (a return mode), per step (step
    groups in a return mode) or per element."""
    estimator = options.estimator
    per_trajectory = estimator.trajectory_return is not None
    per_step_adv = per_trajectory and estimator.step_groups is not None
    if estimator.step_norm:  # per trajectory: on its return, its steps or its elements
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


def _written(out: Steps, selection, keep, samples: _Samples, member_round, num_rounds, selected):
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


def _rewards_to_go(
    values: Tensor, *, steps: Tensor, per_step: int, gamma: float, width: int | None, longest=None
) -> Tensor:
    """Each reward element's discounted sum to the end of its trajectory, float64 ``(E,)``.

    ``values`` holds ``per_step`` elements for each step, the released trajectories one after
    the other (``steps`` each); element ``j`` of a step is discounted along element ``j`` of the
    later steps of its trajectory, as torchrl's ``reward2go`` treats trailing dimensions.
    """
    longest = None if width is None else longest  # (read with the released sizes)
    if per_step == 1:
        return discounted_returns(values, steps, gamma, width=width, longest=longest)
    columns = values.view(-1, per_step).T.reshape(-1)  # (k * S,): element j of every step, ...
    steps = steps.repeat(per_step)
    to_go = discounted_returns(columns, steps, gamma, width=width, longest=longest)
    return to_go.view(per_step, -1).T.reshape(-1)


def released_anchors(out: Steps, key) -> Tensor:
    """The released steps' anchor states as a tensor ``(S, ...)`` compared by value.

    Strings, and tensors whose shape differs from step to step (ragged token ids), become one
    integer code per distinct value through a dictionary: a Python loop over the steps, which only
    such anchors need (pass a tensor, or a hash, to stay vectorized).
    """
    values = out.entries(key, "anchor")
    if isinstance(values, Tensor):
        return values.cpu()
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

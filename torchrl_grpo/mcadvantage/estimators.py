"""How a released group's rewards become advantages: one object, ``MCAdvantage(estimator=...)``.

An estimator holds every setting of the computation and does it when a group is released:
:class:`GroupRelative` (GRPO and its baselines, scales, whitening, GDPO's several rewards),
:class:`RewardToGo` (each step's discounted reward-to-go as its sample), :class:`StepGroups`
(GiGPO's anchor-state step groups) and :class:`Distillation` (a teacher's per-token reverse KL);
the last three hold the :class:`GroupRelative` they normalize with as ``group``. A user's own
estimator subclasses :class:`Estimator` and overrides :meth:`Estimator.advantages`.

The math is :mod:`torchrl_grpo.advantages` (plain functions on tensors); each class fetches its
inputs from the released groups (:class:`~torchrl_grpo.mcadvantage.records.ReleasedGroups`)
and hands its output back to :mod:`~torchrl_grpo.mcadvantage.release`. The settings are
checked once, by :func:`~torchrl_grpo.mcadvantage.options.make_options`. A name of
:data:`ESTIMATORS` (``MCAdvantage(estimator="rloo")``) stands for its object.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import KW_ONLY, dataclass, field

import torch
from tensordict import NestedKey
from torch import Tensor

from torchrl_grpo.advantages import (
    anchor_step_groups,
    discounted_returns,
    group_relative_advantage,
    group_std,
    multi_reward_advantage,
    step_level_advantage,
)
from torchrl_grpo.mcadvantage import distillation as distillation_
from torchrl_grpo.mcadvantage.records import Insertion, ReleasedGroups, Samples
from torchrl_grpo.mcadvantage.steps import Elements, Steps, Uniform

__all__ = [
    "ESTIMATORS",
    "Distillation",
    "Estimator",
    "GroupRelative",
    "RewardToGo",
    "StepGroups",
    "lookup_estimator",
]


class Estimator:
    """The base of every estimator: a user's own overrides :meth:`advantages`, and nothing else.

    :meth:`advantages` gets the samples of the released groups, float64: one per trajectory
    (its return) with ``trajectory_return``, else every reward element of every step; and the
    group of each sample. What it returns is written as ``advantage`` (with a return mode,
    spread on the trajectory's steps). The other methods are the transform's hooks; the
    built-in estimators override them, and their defaults serve a user's own.

    Examples:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> from torchrl.data import LazyTensorStorage, ReplayBuffer
        >>> from torchrl_grpo import MCAdvantage
        >>> from torchrl_grpo.mcadvantage import Estimator
        >>> class MinusGroupMax(Estimator):  # each return minus the best of its group
        ...     def advantages(self, samples, group_index, num_groups):
        ...         best = samples.new_full((num_groups,), float("-inf"))
        ...         best = best.scatter_reduce(0, group_index, samples, "amax")
        ...         return samples - best[group_index]
        >>> rb = ReplayBuffer(storage=LazyTensorStorage(8))
        >>> _ = rb.append_transform(MCAdvantage(
        ...     2, prompt_key="seed", trajectory_return="sum", estimator=MinusGroupMax()))
        >>> _ = rb.extend(TensorDict(
        ...     seed=torch.tensor([7, 7, 7]),
        ...     next=TensorDict(reward=torch.tensor([[1.0], [1.0], [3.0]]),
        ...                     done=torch.tensor([[False], [True], [True]]), batch_size=[3]),
        ...     batch_size=[3]))
        >>> rb[:]["advantage"].squeeze(-1)
        tensor([-1., -1.,  0.])
    """

    #: The group-relative settings the estimator normalizes with (``None``: a user's own).
    group: GroupRelative | None = None
    #: Whether the group filters compare the samples time step by time step (reward-to-go).
    compares_time_steps = False

    def advantages(self, samples: Tensor, group_index: Tensor, num_groups: int) -> Tensor:
        """The advantage of every sample.

        Args:
            samples: ``(S,)`` float64: the released trajectories' returns (with a
                ``trajectory_return``), or every reward element of their steps, trajectory after
                trajectory, each group's trajectories in the order they arrived.
            group_index: ``(S,)`` the group of each sample, in ``[0, num_groups)``.
            num_groups: the groups released.

        Returns:
            ``(S,)`` the advantages (cast to the reward's dtype when written).
        """
        raise NotImplementedError(f"{type(self).__name__} must define advantages(...).")

    # --- the transform's hooks ----------------------------------------------------------------

    def in_keys(self) -> list:
        """The entries read beyond the group id, the rewards and the done flags."""
        return []

    def check_insertion(self, batch: Insertion, reward_key, trajectory_return) -> None:
        """Refuse an insertion the release could not compute on (before anything waits)."""

    def sample_values(self, values: Tensor, samples: Samples, longest=None) -> Tensor:
        """A reward's elements ``(E,)`` as the samples this estimator compares."""
        return values

    def group_advantage(self, groups: ReleasedGroups) -> Tensor:
        """The advantage of every sample of the released groups: per trajectory (a return mode,
        ``groups.runs`` ``None``) or per reward element; ``(S,)`` per step for step groups."""
        index = groups.member_round
        if groups.runs is not None:
            index = groups.samples.by_elems().expand(index)
        adv = self.advantages(groups.x.double(), index, groups.num_rounds)
        if not isinstance(adv, Tensor) or adv.shape != groups.x.shape:
            raise ValueError(
                f"{type(self).__name__}.advantages returned "
                f"{getattr(adv, 'shape', type(adv).__name__)}, not one advantage per sample "
                f"{tuple(groups.x.shape)}."
            )
        return adv

    def write(self, groups: ReleasedGroups, adv: Tensor) -> dict | None:
        """Write every reward element's advantage ``adv`` ``(E,)`` on the released steps (in the
        reward's shape and device); return statistics for ``get_stats()``, or ``None``."""
        keys = groups.keys
        groups.steps.write(keys.advantage, adv, keys.reward)
        return None

    def __repr__(self) -> str:
        """The class and the settings that differ from their defaults (what to write)."""
        if not dataclasses.is_dataclass(self):
            return f"{type(self).__name__}()"
        given = [
            f"{f.name}={getattr(self, f.name)!r}"
            for f in dataclasses.fields(self)
            if f.repr and getattr(self, f.name) != _default(f)
        ]
        return f"{type(self).__name__}({', '.join(given)})"


def _default(f: dataclasses.Field):
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


@dataclass(frozen=True, repr=False)
class GroupRelative(Estimator):
    r"""GRPO's group-relative advantage, :math:`A_i = (x_i - b_g) / \max(s_g, \epsilon)`
    (:func:`~torchrl_grpo.advantages.group_relative_advantage`; with ``reward_weights``,
    :func:`~torchrl_grpo.advantages.multi_reward_advantage`).

    Args:
        baseline: ``"mean"`` (default), ``"leave_one_out"`` (RLOO) or ``"pass_at_k"`` (verl's
            ``grpo_passk``): a name of :data:`~torchrl_grpo.advantages.BASELINES`.
        scale_rewards: ``"group"`` (default: per-group std), ``"batch"`` (over the insertion's
            released samples) or ``"none"`` (Dr. GRPO): :data:`~torchrl_grpo.advantages.SCALES`.
        epsilon: floor of the std (``clamp_min``), ``1e-6`` as torchrl.
        whiten: whiten the advantages over the insertion's released samples (REINFORCE++-
            baseline with ``scale_rewards="none"``); ``None``: on with ``reward_weights``.
        std_threshold: groups whose std is at or below it are dropped (``dropped_groups``,
            Trinity-RFT); ``None`` keeps every group.
        step_norm: divide each trajectory's advantages by its number of steps.
        reward_weights: ``{reward key: weight}`` (GDPO, TRL's ``normalize_then_sum``): each
            reward normalized in its group, then the weighted sum (whitened, see ``whiten``); its
            keys replace ``rewards_key``. ``None``: the one reward under ``rewards_key``.

    Examples:
        >>> from torchrl_grpo.mcadvantage import GroupRelative
        >>> GroupRelative(scale_rewards="none")  # Dr. GRPO: the settings not at their default
        GroupRelative(scale_rewards='none')
    """

    baseline: str = "mean"
    scale_rewards: str = "group"
    epsilon: float = 1e-6
    whiten: bool | None = None
    std_threshold: float | None = None
    step_norm: bool = False
    reward_weights: Mapping[NestedKey, float] | None = None

    @property
    def group(self) -> GroupRelative:  # it normalizes with its own settings
        return self

    def group_advantage(self, groups: ReleasedGroups) -> Tensor:
        return self.relative(groups)

    def relative(self, groups: ReleasedGroups, by_time_step=False, scale="pooled") -> Tensor:
        """The advantage with these settings; ``by_time_step``: compared at each time step
        (``scale``: the std ``"pooled"`` over time steps, or per ``"cell"``)."""
        samples, runs = groups.samples, groups.runs
        whiten = bool(self.reward_weights) if self.whiten is None else self.whiten  # GDPO's
        kw = dict(
            width=None if runs is None else samples.elems_width,
            baseline=self.baseline,
            scale_rewards=self.scale_rewards,
            epsilon=self.epsilon,
            whiten=whiten,
            lengths=runs,
            by_time_step=by_time_step,
            time_step_scale=scale,
        )
        if samples.per_key is None:
            return group_relative_advantage(groups.x, groups.member_round, groups.num_rounds, **kw)
        weights = torch.tensor([w for _, w in groups.keys.reward_weights], dtype=torch.float64)
        values = torch.stack(samples.per_key, 1)
        return multi_reward_advantage(
            values, groups.member_round, groups.num_rounds, weights=weights, **kw
        )


_GRPO = GroupRelative()


@dataclass(frozen=True, repr=False)
class RewardToGo(Estimator):
    """Each step's discounted reward-to-go ``G_t = r_t + gamma * G_{t+1}`` as its sample
    (REINFORCE's reward-to-go, torchrl's ``reward2go``;
    :func:`~torchrl_grpo.advantages.discounted_returns`), computed at release on whole
    trajectories; with ``trajectory_return=None`` only.

    Args:
        gamma: the discount, in ``[0, 1]`` (``0``: the rewards, ``1``: the sum to the end).
        baseline: what each reward-to-go is compared with: ``"group"`` (default: the mean over
            every step of the group; a group of identical episodes gets ``0``), ``"time_step"``
            (the group's mean at the same time step, the std pooled over time steps) or
            ``"step_group"`` (each (group, time step) a GRPO group of its own, rLLM's
            ``per_step``).
        group: the baselines, scale, epsilon and filters it normalizes with.

    Examples:
        >>> from torchrl_grpo.mcadvantage import GroupRelative, RewardToGo
        >>> RewardToGo(0.95, baseline="time_step", group=GroupRelative(scale_rewards="batch"))
        RewardToGo(gamma=0.95, baseline='time_step', group=GroupRelative(scale_rewards='batch'))
    """

    gamma: float | None = None
    baseline: str = "group"
    _: KW_ONLY
    group: GroupRelative = _GRPO

    @property
    def compares_time_steps(self) -> bool:  # the filters compare trajectories step by step
        return True

    def check_insertion(self, batch: Insertion, reward_key, trajectory_return) -> None:
        """Ragged steps (an agent's turns) take a reward-to-go when every step has as many
        reward elements (torchrl's ``[1, 1]`` per turn)."""
        if not batch.steps.ragged:
            return
        per_step = batch.reward_lengths.double() / batch.lengths.double()
        if not bool((per_step == per_step[0]).all()) or float(per_step[0]) % 1:
            raise ValueError(
                "MCAdvantage: RewardToGo's gamma discounts each reward element along the steps "
                f"of its trajectory, which needs as many elements under {reward_key!r} "
                "at every step; this insertion's steps have rewards of different sizes."
            )

    def sample_values(self, values: Tensor, samples: Samples, longest=None) -> Tensor:
        return rewards_to_go(values, samples, self.gamma, longest)

    def group_advantage(self, groups: ReleasedGroups) -> Tensor:
        by_time_step = self.baseline != "group"
        scale = "cell" if self.baseline == "step_group" else "pooled"
        adv = self.group.relative(groups, by_time_step=by_time_step, scale=scale)
        if self.baseline == "group":
            adv = _identical_to_zero(adv, groups)
        return adv


@dataclass(frozen=True, repr=False)
class StepGroups(Estimator):
    """GiGPO's step-level groups (Feng et al., 2025): the steps of a released group with equal
    anchor states form a step group, and each step's advantage is ``episode_weight * A_group +
    step_weight * A_step``, ``A_step`` its discounted return (``gamma``) normalized in its step
    group (:func:`~torchrl_grpo.advantages.step_level_advantage`). The defaults are ROLL's.

    Args:
        episode_weight: weight of the group-level advantage.
        step_weight: weight of the step-level advantage.
        gamma: discount of the step-level returns, in ``[0, 1]``.
        anchor_key: key of each step's anchor state (a tensor compared by value, or a string).
        group: the settings both levels normalize with.

    Examples:
        >>> from torchrl_grpo.mcadvantage import StepGroups
        >>> StepGroups(anchor_key="cell", step_weight=0.5)
        StepGroups(step_weight=0.5, anchor_key='cell')
    """

    episode_weight: float = 1.0
    step_weight: float = 1.0
    gamma: float = 0.95
    _: KW_ONLY
    anchor_key: NestedKey | None = None
    group: GroupRelative = _GRPO

    def in_keys(self) -> list:
        return [self.anchor_key]

    def group_advantage(self, groups: ReleasedGroups) -> Tensor:
        return _with_step_groups(self, self.group.relative(groups), groups)


@dataclass(frozen=True, repr=False)
class Distillation(Estimator):
    """On-policy distillation: on the response tokens of each released turn ``A_t = alpha *
    A_group - beta * D_t``, ``D_t`` the student's reverse KL to the teacher from token ``t`` on,
    discounted by ``gamma``, less a baseline if ``baseline`` is set: ``True`` or ``"group"``,
    the mean of ``D`` over the group's response tokens; ``"position"``, the mean over the
    group's tokens at the same position of their response (``D_t - mean_group,position(D)``,
    the first tokens of a group's responses share their context)
    (:mod:`torchrl_grpo.advantages.distillation`; how the rows are read:
    :mod:`torchrl_grpo.mcadvantage.distillation`). ``A_group`` is ``group``'s.

    Examples:
        >>> from torchrl_grpo.mcadvantage import Distillation
        >>> d = Distillation(alpha=0.0)  # pure distillation, Tinker's and Trinity-RFT's beta
        >>> d.beta, d.gamma, d.teacher_key
        (1.0, 0.0, ('next', 'teacher_log_probs', 'full'))
    """

    alpha: float = 1.0  # weight of the group-relative advantage (0: no reward needed)
    beta: float = 1.0  # weight of the reverse KL (Tinker's kl_penalty_coef, Trinity's kl_coef)
    gamma: float = 0.0  # discount of the future reverse KL (Tinker's kl_discount_factor)
    # the teacher's log-probs of every token of ("tokens", "full"), as torchrl's RetrieveLogProb
    # writes them (TeacherLogProbs' default; torchrl's DistillationLoss reads this key too)
    teacher_key: NestedKey = ("next", "teacher_log_probs", "full")
    # the sampling policy's (pi_old), as RetrieveLogProb writes them; the loss's sample_log_prob
    log_prob_key: NestedKey = ("next", "log_probs", "full")
    tokens_key: NestedKey = ("tokens", "full")  # each row's tokens: the advantage's shape
    # the response: the tokens after the prompt (None: every token, a policy without prompts)
    prompt_tokens_key: NestedKey | None = ("tokens", "prompt")
    mask_key: NestedKey | None = ("masks", "all_attention_mask")  # real tokens, where present
    # subtract from D_t a mean of it (group_mean_baseline): True or "group", over the group's
    # response tokens; "position", over the group's tokens at t's position in their response;
    # False: the peers' form (Tinker, Trinity-RFT, NeMo-RL)
    baseline: bool | str = False
    _: KW_ONLY
    group: Estimator = field(default=_GRPO)  # A_group: GroupRelative, RewardToGo or StepGroups

    @property
    def compares_time_steps(self) -> bool:
        return self.group.compares_time_steps

    def in_keys(self) -> list:
        return [*self.group.in_keys(), self.log_prob_key, self.teacher_key]

    def check_insertion(self, batch: Insertion, reward_key, trajectory_return) -> None:
        per_step = self.alpha != 0.0 and trajectory_return is None
        distillation_.check_insertion(self, batch, per_step=per_step, reward_key=reward_key)
        self.group.check_insertion(batch, reward_key, trajectory_return)

    def sample_values(self, values: Tensor, samples: Samples, longest=None) -> Tensor:
        return self.group.sample_values(values, samples, longest)

    def group_advantage(self, groups: ReleasedGroups) -> Tensor:
        return self.group.group_advantage(groups)

    def write(self, groups: ReleasedGroups, adv: Tensor) -> dict | None:
        """Every token's advantage, in the tokens' shape, and its statistics."""
        samples, steps = groups.samples, groups.steps
        per_step = None if self.alpha == 0.0 else _per_step(adv, samples.elements)
        members = (groups.member_round, groups.num_rounds)  # for baseline=True
        tokens, metrics = distillation_.token_advantages(
            self, steps, per_step, samples.steps, members
        )
        steps.write(groups.keys.advantage, tokens, self.tokens_key)
        return metrics


#: The estimators known by name: ``MCAdvantage(estimator="rloo")``. One line registers one.
ESTIMATORS: dict[str, Estimator] = {
    "grpo": GroupRelative(),
    "dr_grpo": GroupRelative(scale_rewards="none"),
    "rloo": GroupRelative(baseline="leave_one_out", scale_rewards="none"),
    "reinforce_pp_baseline": GroupRelative(scale_rewards="none", whiten=True),
    "pass_at_k": GroupRelative(baseline="pass_at_k"),
}


def lookup_estimator(value) -> Estimator:
    """``value`` as an estimator: an :class:`Estimator`, or a name of :data:`ESTIMATORS`.

    Raises:
        ValueError: an unknown name (the known ones listed).
        TypeError: anything else.
    """
    if isinstance(value, str):
        if value not in ESTIMATORS:
            raise ValueError(
                f"Unknown estimator {value!r}: the known names are {sorted(ESTIMATORS)} "
                "(torchrl_grpo.mcadvantage.ESTIMATORS), or pass an Estimator object."
            )
        return ESTIMATORS[value]
    if not isinstance(value, Estimator):
        raise TypeError(
            "estimator must be an Estimator (torchrl_grpo.mcadvantage: GroupRelative, RewardToGo, "
            f"StepGroups, Distillation, or a subclass of Estimator) or a name, got {value!r}."
        )
    return value


# --- the release's math, fetched from the released groups -----------------------------------


def rewards_to_go(values: Tensor, samples: Samples, gamma: float, longest=None) -> Tensor:
    """Each reward element's discounted sum to the end of its trajectory, float64 ``(E,)``.

    ``values`` holds ``per_step`` elements for each step, the released trajectories one after
    the other; element ``j`` of a step is discounted along element ``j`` of the later steps of
    its trajectory, as torchrl's ``reward2go`` treats trailing dimensions. (Dense steps only:
    ragged ones are rejected on insertion.)
    """
    steps, width, per_step = samples.steps, samples.width, samples.elements.per_step
    longest = None if width is None else longest  # (read with the released sizes)
    if per_step == 1:
        return discounted_returns(values, steps, gamma, width=width, longest=longest)
    columns = values.view(-1, per_step).T.reshape(-1)  # (k * S,): element j of every step, ...
    steps = steps.repeat(per_step)
    to_go = discounted_returns(columns, steps, gamma, width=width, longest=longest)
    return to_go.view(per_step, -1).T.reshape(-1)


def _identical_to_zero(adv: Tensor, groups: ReleasedGroups) -> Tensor:
    """Rewards-to-go over the group's steps: zero the advantages of a group whose trajectories
    have, reward by reward, the same samples at every time step (identical episodes), which the
    constant baseline would otherwise rank by time step. The group's trajectories then differ in
    nothing, and the other modes give them ``0`` too."""
    samples, member_round, num_rounds = groups.samples, groups.member_round, groups.num_rounds
    runs, width = samples.elems, samples.elems_width
    values = samples.per_key or [samples.values]
    spread = sum(
        group_std(v, member_round, num_rounds, lengths=runs, by_time_step=True, width=width)
        for v in values
    )
    same = spread == 0  # (rounds,) exact: equal samples have deviations of exactly 0
    return adv.masked_fill(samples.by_elems().expand(same[member_round]), 0.0)


def _with_step_groups(step_groups: StepGroups, adv: Tensor, groups: ReleasedGroups) -> Tensor:
    """GiGPO: the group-level advantage weighted, plus each step's advantage within its step
    group (steps of one group with the same anchor state); per step in a return mode, per
    reward element otherwise."""
    samples, group = groups.samples, step_groups.group
    step_rewards = samples.elements.step_sums(samples.values)  # (S,)
    trajectories = samples.by_steps()
    step_round = trajectories.expand(groups.member_round)  # (S,)
    anchors = released_anchors(groups.steps, step_groups.anchor_key)  # (S, ...)
    step_group, num_step_groups = anchor_step_groups(step_round, anchors, groups.num_rounds)
    term = step_level_advantage(
        step_rewards,
        samples.steps,
        step_group,
        num_step_groups,
        gamma=step_groups.gamma,
        baseline=group.baseline,
        scale_rewards=group.scale_rewards,
        epsilon=group.epsilon,
        width=trajectories.width,
    )  # (S,)
    if groups.runs is None:  # a return mode: the trajectory's advantage on each of its steps
        adv = trajectories.expand(adv)  # (S,)
    else:
        term = samples.elements.spread(term)  # (E,)
    if step_groups.episode_weight != 1.0:
        adv = step_groups.episode_weight * adv
    return adv.add(term, alpha=step_groups.step_weight)


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


def _per_step(adv: Tensor, elements: Elements) -> Tensor:
    """Each step's advantage ``(S,)`` from its reward elements' (the first: a return mode spreads
    one value on them, and per-step samples have one, checked on insertion)."""
    if isinstance(elements, Uniform):
        return adv if elements.per_step == 1 else adv.view(-1, elements.per_step)[:, 0]
    return adv[torch.cumsum(elements.counts, 0) - elements.counts]

"""Step-level groups for multi-step tasks (GiGPO): discounted returns, the anchor states that
group steps across trajectories, and the step-level advantage."""

from __future__ import annotations

import torch
from torch import Tensor

from torchrl_grpo._segments import dense_codes, discounted_suffix_sum
from torchrl_grpo.advantages.group_relative import group_relative_advantage
from torchrl_grpo.advantages.returns import _check_index, _check_samples


def discounted_returns(
    rewards: Tensor,
    lengths: Tensor,
    gamma: float,
    *,
    width: int | None = None,
    longest: int | None = None,
) -> Tensor:
    r"""The discounted return from each step to the end of its trajectory.

    :math:`G_t = \sum_{k=t}^{T_i} \gamma^{k-t} r_k` for every step :math:`t` of trajectory
    :math:`i` (GiGPO, Feng et al., 2025, arXiv:2505.10978, Eq. 5), computed for every trajectory at
    once in ``ceil(log2(longest))`` vectorized passes, with no Python loop over steps or
    trajectories.

    Args:
        rewards: per-step rewards, shape ``(N,)``, trajectory after trajectory, in time order.
        lengths: steps per trajectory, shape ``(n,)``, summing to ``N``.
        gamma: the discount, in ``[0, 1]``.
        width: the length every trajectory has, if they all have one (``0``: they differ); found
            from ``lengths`` when ``None``.
        longest: with ``width=0``, the longest trajectory's length when the caller read it
            (``lengths`` are then trusted to sum to the rewards' number); else read here.

    Returns:
        The returns, shape ``(N,)``, float64.

    Raises:
        ValueError: for mismatched shapes or a ``gamma`` outside ``[0, 1]``.

    Examples:
        >>> import torch
        >>> discounted_returns(torch.tensor([0.0, 0.0, 1.0, 2.0]), torch.tensor([3, 1]), 0.5)
        tensor([0.2500, 0.5000, 1.0000, 2.0000], dtype=torch.float64)
    """
    _check_samples("rewards", rewards)
    if lengths.ndim != 1:
        raise ValueError(f"lengths must be (n,), got shape {tuple(lengths.shape)}.")
    if not 0.0 <= gamma <= 1.0:
        raise ValueError(f"gamma must be in [0, 1], got {gamma}.")
    if width is None and lengths.numel():
        shortest, longest = (int(v) for v in torch.aminmax(lengths))
        width = shortest if shortest == longest else 0
    if width:  # every trajectory as long: the sum is known
        total = width * lengths.numel()
    elif longest is not None:  # read by the caller, with the lengths
        total = rewards.numel()
    elif lengths.numel():  # the sum and the longest, read at once
        total, longest = torch.stack([lengths.sum(), lengths.max()]).tolist()
    else:
        total = 0
    if total != rewards.numel():
        raise ValueError(f"lengths sum to {total} steps, but rewards has {rewards.numel()}.")
    return discounted_suffix_sum(
        rewards.double(), lengths, float(gamma), width=width or 0, longest=longest
    )


def anchor_step_groups(
    group_index: Tensor, anchor: Tensor, num_groups: int | None = None
) -> tuple[Tensor, int]:
    r"""GiGPO's step groups: the steps of one group whose anchor states are equal.

    Two steps share a step group when they belong to the same (episode-level) group and their
    anchor states are equal in every entry (GiGPO, Feng et al., 2025, arXiv:2505.10978, Eq. 6:
    :math:`G^S(\tilde s) = \{(a_t^{(i)}, G_t^{(i)}) \mid s_t^{(i)} = \tilde s\}`), whichever
    trajectory and time step they come from. Equality is exact (``-0.0`` equals ``0.0``; a ``nan``
    equals only the same ``nan``); pass a hash or an id to compare anything else (text
    observations: a code per distinct string).

    Cost: integer states whose entries span a compact range (a state index, a cell of a grid)
    are numbered with the group in mixed radix and coded through a table of that range, with no
    sort; anything else (float vectors, 64-bit hashes) is hashed with the group to one integer
    per step and coded with one sort, and the result is checked against the states themselves (a
    hash collision falls back to an exact row-wise comparison: the grouping is exact either
    way).

    Args:
        group_index: group of each step, shape ``(N,)``, integer, values in ``[0, G)``.
        anchor: anchor state of each step, shape ``(N,)`` or ``(N, ...)``: the observation the
            step acted on, or a hash of it.
        num_groups: ``G``; defaults to ``group_index.max() + 1``.

    Returns:
        ``(step_group, num_step_groups)``: a dense code per step, shape ``(N,)`` int64, equal
        iff group and anchor are, and the number of codes.

    Raises:
        ValueError: if ``anchor`` has not one entry per step.

    Examples:
        >>> import torch
        >>> group = torch.tensor([0, 0, 0, 1, 1])
        >>> obs = torch.tensor([[0, 1], [2, 2], [0, 1], [0, 1], [0, 1]])
        >>> anchor_step_groups(group, obs)
        (tensor([0, 1, 0, 2, 2]), 3)
    """
    _check_samples("group_index", group_index)
    if anchor.shape[:1] != group_index.shape:
        raise ValueError(
            f"anchor must have one entry per step, {group_index.numel()}, got shape "
            f"{tuple(anchor.shape)}."
        )
    n = group_index.numel()
    if n == 0:
        return group_index.long(), 0
    group = group_index.long()
    rows = anchor.reshape(n, -1)  # (N, d)
    if not (rows.is_floating_point() or rows.is_complex()):  # ids, or cells of a grid
        low, high = (v.tolist() for v in torch.aminmax(rows.long(), dim=0))  # each entry's range
        widths = [top - bottom + 1 for bottom, top in zip(low, high)]  # Python ints: no overflow
        span = int(group.max()) + 1 if num_groups is None else int(num_groups)
        for width in widths:
            span *= width
        if span <= 4 * n + 1024:  # (group, state) numbered in mixed radix: a small table
            key = group
            for column, lowest, width in zip(rows.long().unbind(1), low, widths):
                key = column.add(key, alpha=width)  # key * width + column
                if lowest:
                    key = key.sub_(lowest)
            return dense_codes(key, span=span)
    bits = _state_bits(rows)  # (N, d) int64, equal iff the states are
    key = group
    for column in bits.unbind(1):  # a few columns: one pass each
        key = key * 1099511628211 + column  # wraps around: a hash, checked below
    codes, num = dense_codes(key)
    first = torch.full((num,), n, dtype=torch.long, device=codes.device).scatter_reduce(
        0, codes, torch.arange(n, device=codes.device), reduce="amin"
    )[codes]  # (N,) the first step of each step's code
    if bool((group[first] == group).all()) and bool((bits[first] == bits).all()):
        return codes, num
    exact = torch.unique(torch.cat([group[:, None], bits], 1), dim=0, return_inverse=True)[1]
    return exact, int(exact.max()) + 1


def _state_bits(rows: Tensor) -> Tensor:
    """``(N, d)`` states as int64 bit patterns, equal iff the values are (``-0.0`` as ``0.0``)."""
    if rows.is_complex():
        rows = torch.view_as_real(rows).reshape(rows.shape[0], -1)
    if not rows.is_floating_point():
        return rows.long()
    as_int = {2: torch.int16, 4: torch.int32, 8: torch.int64}[rows.element_size()]
    return (rows + 0.0).view(as_int).long()  # + 0.0 turns -0.0 into 0.0


def step_level_advantage(
    rewards: Tensor,
    lengths: Tensor,
    step_group: Tensor,
    num_step_groups: int | None = None,
    *,
    gamma: float = 0.95,
    baseline: str = "mean",
    scale_rewards: str = "group",
    epsilon: float = 1e-6,
    width: int | None = None,
) -> Tensor:
    r"""GiGPO's step-level advantage: each step's discounted return against its step group.

    :math:`A^S_t = (G_t - \mu_{\tilde s}) / \max(\sigma_{\tilde s}, \epsilon)` where :math:`G_t` is
    the discounted return from step :math:`t` (:func:`discounted_returns`) and :math:`\mu, \sigma`
    are taken over the steps of its step group :math:`\tilde s` (:func:`anchor_step_groups`) (Feng
    et al., 2025, *Group-in-Group Policy Optimization for LLM Agent Training*, arXiv:2505.10978,
    Eq. 7; ROLL and verl-agent: :math:`\gamma = 0.95`). A step group of one step gets ``0``.
    ``scale_rewards="group"`` is verl-agent's ``mode="mean_std_norm"``, ``"none"`` its
    ``"mean_norm"``.

    Args:
        rewards: per-step rewards, shape ``(N,)``, trajectory after trajectory, in time order.
        lengths: steps per trajectory, shape ``(n,)``.
        step_group: step group of each step, shape ``(N,)``.
        num_step_groups: number of step groups; defaults to ``step_group.max() + 1``.
        gamma: the discount of the returns.
        baseline: a key of :data:`BASELINES`.
        scale_rewards: a key of :data:`SCALES`.
        epsilon: floor of the scale.
        width: the length of every trajectory if they all have one (``0``: they differ); found
            from ``lengths`` when ``None``.

    Returns:
        Step-level advantages, shape ``(N,)``, float64.

    Examples:
        >>> import torch
        >>> r = torch.tensor([0.0, 1.0, 0.0, 0.0])  # two trajectories of two steps
        >>> same_start = torch.tensor([0, 1, 0, 2])  # their first steps share a state
        >>> step_level_advantage(
        ...     r, torch.tensor([2, 2]), same_start, gamma=0.5, scale_rewards="none")
        tensor([ 0.2500,  0.0000, -0.2500,  0.0000], dtype=torch.float64)
    """
    returns = discounted_returns(rewards, lengths, gamma, width=width)  # (N,)
    return group_relative_advantage(
        returns,
        step_group,
        num_step_groups,
        baseline=baseline,
        scale_rewards=scale_rewards,
        epsilon=epsilon,
    )


def gigpo_advantage(
    returns: Tensor,
    group_index: Tensor,
    step_rewards: Tensor,
    lengths: Tensor,
    anchor: Tensor,
    *,
    gamma: float = 0.95,
    episode_weight: float = 1.0,
    step_weight: float = 1.0,
    baseline: str = "mean",
    scale_rewards: str = "group",
    epsilon: float = 1e-6,
) -> Tensor:
    r"""GiGPO: the episode-level group advantage plus the step-level one, weighted, per step.

    :math:`A_t = w_E\, A^E(\tau_i) + w_S\, A^S_t` for step :math:`t` of trajectory :math:`i`, where
    :math:`A^E` is GRPO's advantage of the trajectory's return within its group
    (:func:`group_relative_advantage`) and :math:`A^S` the step-level advantage of its discounted
    return within its step group (:func:`step_level_advantage`) (Feng et al., 2025,
    *Group-in-Group Policy Optimization for LLM Agent Training*, arXiv:2505.10978, Eq. 8).
    Defaults: ROLL's ``episode_reward_weight=1.0``, ``step_reward_weight=1.0``,
    ``step_reward_gamma=0.95`` (verl-agent: ``step_advantage_w=1.0``, ``gamma=0.95``). With
    ``step_weight=0`` and ``episode_weight=1`` this is GRPO's advantage, given to every step.

    Args:
        returns: each trajectory's return, shape ``(n,)``.
        group_index: group of each trajectory, shape ``(n,)``.
        step_rewards: per-step rewards, shape ``(N,)``, trajectory after trajectory, in order.
        lengths: steps per trajectory, shape ``(n,)``, summing to ``N``.
        anchor: anchor state of each step, shape ``(N,)`` or ``(N, ...)``, compared by value.
        gamma: the discount of the step-level returns.
        episode_weight: :math:`w_E`.
        step_weight: :math:`w_S`.
        baseline: a key of :data:`BASELINES`, for both levels.
        scale_rewards: a key of :data:`SCALES`, for both levels.
        epsilon: floor of the scales.

    Returns:
        Per-step advantages, shape ``(N,)``, float64.

    Raises:
        ValueError: for mismatched shapes.

    Examples:
        >>> import torch
        >>> r = torch.tensor([0.0, 1.0, 0.0, 0.0])  # trajectory 0 succeeds, trajectory 1 fails
        >>> obs = torch.tensor([7, 8, 7, 9])  # both start from state 7
        >>> gigpo_advantage(torch.tensor([1.0, 0.0]), torch.tensor([0, 0]), r,
        ...                 torch.tensor([2, 2]), obs, gamma=0.5, scale_rewards="none")
        tensor([ 0.7500,  0.5000, -0.7500, -0.5000], dtype=torch.float64)
    """
    _check_samples("returns", returns)
    _check_index(returns, group_index, None)
    if lengths.shape != returns.shape:
        raise ValueError(
            f"lengths must have one entry per trajectory, {tuple(returns.shape)}, got "
            f"{tuple(lengths.shape)}."
        )
    kw = dict(baseline=baseline, scale_rewards=scale_rewards, epsilon=epsilon)
    episode = group_relative_advantage(returns, group_index, **kw)  # (n,)
    step_group, num = anchor_step_groups(group_index.repeat_interleave(lengths), anchor)
    step = step_level_advantage(step_rewards, lengths, step_group, num, gamma=gamma, **kw)  # (N,)
    return episode_weight * episode.repeat_interleave(lengths) + step_weight * step

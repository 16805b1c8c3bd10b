"""The estimators beyond GRPO's mean and std: batch whitening, REINFORCE++-baseline, pass@k and
GDPO's several rewards."""

from __future__ import annotations

import torch
from torch import Tensor

from torchrl_grpo._segments import Segments
from torchrl_grpo.advantages.group_relative import (
    _advantage,
    _check_names,
    _time_steps,
    group_relative_advantage,
)
from torchrl_grpo.advantages.returns import _check_index, batch_whiten


def reinforce_pp_baseline_advantage(
    x: Tensor,
    group_index: Tensor,
    num_groups: int | None = None,
    *,
    weights: Tensor | None = None,
    epsilon: float = 1e-6,
    lengths: Tensor | None = None,
) -> Tensor:
    r"""REINFORCE++-baseline: subtract the group mean, then whiten over the whole batch.

    :math:`A_i = (c_i - m) / \max(s, \epsilon)` with :math:`c_i = x_i - \mu_g` and :math:`m, s`
    the mean and std of the centred values :math:`c` over every sample passed in (Hu, 2025,
    *REINFORCE++*, arXiv:2501.03262; OpenRLHF ``advantage_estimator="reinforce_baseline"``,
    verl ``reinforce_plus_plus_baseline``). The group mean removes the prompt's difficulty; the
    batch std, unlike GRPO's group std, does not inflate the advantages of groups whose answers
    barely differ.

    Unlike ``scale_rewards="batch"`` (the std of the raw samples, between-group spread included),
    the std here is that of the centred values. Equal to ``group_relative_advantage(x,
    group_index, scale_rewards="none", whiten=True)``.

    Args:
        x: samples, shape ``(S,)``: trajectory returns, or reward elements.
        group_index: group of each sample, shape ``(S,)`` (or per run with ``lengths``).
        num_groups: number of groups; defaults to ``group_index.max() + 1``.
        weights: how many times each sample counts in the whitening (verl and OpenRLHF: its
            tokens), shape ``(S,)``; ``None``: once.
        epsilon: floor of the batch std.
        lengths: samples per run, as in :func:`group_relative_advantage`.

    Returns:
        Advantages, shape ``(S,)``, float64.

    Examples:
        >>> import torch
        >>> x = torch.tensor([0.0, 2.0, 5.0, 5.0, 9.0, 11.0])
        >>> g = torch.tensor([0, 0, 1, 1, 2, 2])
        >>> reinforce_pp_baseline_advantage(x, g)  # centred: -1, 1, 0, 0, -1, 1
        tensor([-1.1180,  1.1180,  0.0000,  0.0000, -1.1180,  1.1180], dtype=torch.float64)
    """
    adv = group_relative_advantage(
        x, group_index, num_groups, scale_rewards="none", epsilon=epsilon, lengths=lengths
    )
    return batch_whiten(adv, weights=weights, epsilon=epsilon)


def pass_at_k_advantage(
    x: Tensor,
    group_index: Tensor,
    num_groups: int | None = None,
    *,
    scale_rewards: str = "group",
    epsilon: float = 1e-6,
    lengths: Tensor | None = None,
) -> Tensor:
    r"""GRPO pass@k: only the best sample of a group gets an advantage, the gap to the runner-up.

    :math:`A_i = \left(\max_{j\in g} x_j - \max_{j\in g,\, j\ne i} x_j\right) / \max(s_g,
    \epsilon)`: for the group's best sample the best minus the second best, for every other
    sample ``0``. It is the leave-one-out estimator of the gradient of the group's maximum, the
    pass@k objective for ``k`` the group size (Tang et al., 2025, *Optimizing Language Models for
    Inference Time Objectives using Reinforcement Learning*, arXiv:2503.19595; verl
    ``adv_estimator="grpo_passk"``, ``compute_grpo_passk_outcome_advantage``).

    Defaults are verl's: the gap is divided by the group std (``norm_adv_by_std_in_grpo=True``;
    ``scale_rewards="none"`` for ``False``). Ties: when several samples share the best value,
    every sample of the group gets ``0`` (verl gives ``r_max - r_second_max = 0`` to the one
    ``topk`` picks: the same numbers). A group of one sample gets ``0`` (verl raises).

    Args:
        x: samples, shape ``(S,)``: trajectory returns.
        group_index: group of each sample, shape ``(S,)`` (or per run with ``lengths``).
        num_groups: number of groups; defaults to ``group_index.max() + 1``.
        scale_rewards: a key of :data:`SCALES`: ``"group"`` (verl's default) or ``"none"``.
        epsilon: floor of the scale (verl adds ``1e-6`` to the std instead).
        lengths: samples per run, as in :func:`group_relative_advantage`.

    Returns:
        Advantages, shape ``(S,)``, float64; at most one non-zero entry per group.

    Examples:
        >>> import torch
        >>> x = torch.tensor([0.0, 3.0, 1.0, 2.0, 2.0, 0.0])
        >>> g = torch.tensor([0, 0, 0, 1, 1, 1])
        >>> pass_at_k_advantage(x, g, scale_rewards="none")  # best 3, runner-up 1; a tie at 2
        tensor([0., 2., 0., 0., 0., 0.], dtype=torch.float64)
    """
    return group_relative_advantage(
        x,
        group_index,
        num_groups,
        baseline="pass_at_k",
        scale_rewards=scale_rewards,
        epsilon=epsilon,
        lengths=lengths,
    )


def multi_reward_advantage(
    x: Tensor,
    group_index: Tensor,
    num_groups: int | None = None,
    *,
    weights: Tensor | None = None,
    baseline: str = "mean",
    scale_rewards: str = "group",
    whiten: bool = True,
    epsilon: float = 1e-6,
    lengths: Tensor | None = None,
    by_time_step: bool = False,
    time_step_scale: str = "pooled",
    width: int | None = None,
) -> Tensor:
    r"""GDPO: each reward normalized within its group, then summed with weights, then whitened.

    :math:`A_i = \mathrm{whiten}\big(\sum_k w_k \hat A^{(k)}_i\big)` with
    :math:`\hat A^{(k)}_i = (x_{ik} - \mu^{(k)}_g) / \max(\sigma^{(k)}_g, \epsilon)`, GRPO's
    advantage of reward ``k`` alone, and the whitening over every sample passed in
    (:func:`batch_whiten`). GDPO (Liu et al., 2026, *Group reward-Decoupled Normalization Policy
    Optimization*, arXiv:2601.05242; TRL ``multi_objective_aggregation="normalize_then_sum"``):
    normalizing the sum instead (GRPO's, TRL's ``"sum_then_normalize"``) lets distinct reward
    combinations collapse to the same advantage and a high-variance reward drown the others.
    TRL's defaults: weights ``1``, group std, the batch whitening always applied.

    ``baseline`` and ``scale_rewards`` set each reward's normalization, as in
    :func:`group_relative_advantage` (TRL: ``"mean"``, ``"group"``). With one reward of weight
    ``1`` and ``whiten=False`` this is :func:`group_relative_advantage`.

    Args:
        x: rewards, shape ``(S, K)``: ``K`` rewards of each sample.
        group_index: group of each sample, shape ``(S,)`` (or per run with ``lengths``).
        num_groups: number of groups; defaults to ``group_index.max() + 1``.
        weights: weight of each reward, shape ``(K,)``; ``None``: all ``1``.
        baseline: a key of :data:`BASELINES`, for each reward.
        scale_rewards: a key of :data:`SCALES`, for each reward.
        whiten: whiten the weighted sum over all ``S`` samples (GDPO's batch normalization).
        epsilon: floor of every std (TRL adds ``1e-4`` to it instead).
        lengths: samples per run, shape ``(R,)``, as in :func:`group_relative_advantage`.
        by_time_step: each reward's baseline at each time step, as in
            :func:`group_relative_advantage` (needs ``lengths``).
        time_step_scale: with ``by_time_step``, as in :func:`group_relative_advantage`.
        width: with ``lengths``, as in :func:`group_relative_advantage`.

    Returns:
        Advantages, shape ``(S,)``, float64.

    Raises:
        ValueError: if ``x`` is not ``(S, K)`` or ``weights`` not ``(K,)``.

    Examples:
        >>> import torch
        >>> x = torch.tensor([[1.0, 0.0], [0.0, 0.0], [1.0, 3.0], [0.0, 3.0]])  # correct, format
        >>> g = torch.tensor([0, 0, 1, 1])
        >>> multi_reward_advantage(x, g, weights=torch.tensor([1.0, 0.5]), whiten=False)
        tensor([ 0.7071, -0.7071,  0.7071, -0.7071], dtype=torch.float64)
    """
    if x.ndim != 2:
        raise ValueError(f"x must be (S, K), one column per reward, got shape {tuple(x.shape)}.")
    num_rewards = x.shape[1]
    weights = torch.ones(num_rewards, device=x.device) if weights is None else weights
    if weights.shape != (num_rewards,):
        raise ValueError(
            f"weights must have one entry per reward, shape ({num_rewards},), got "
            f"{tuple(weights.shape)}."
        )
    _check_names(baseline, scale_rewards, time_step_scale)
    _check_index(x[:, 0], group_index, lengths)
    seg = Segments(group_index, num_groups, lengths, width=width, total=x.shape[0])
    steps = _time_steps(seg, time_step_scale) if by_time_step else None
    w = weights.double().tolist()
    x = x.double()
    adv = sum(  # a loop over the K rewards, each a pass over the samples
        w[k]
        * _advantage(seg.view(x[:, k].contiguous()), seg, baseline, scale_rewards, epsilon, steps)
        for k in range(num_rewards)
    )
    if not torch.is_tensor(adv):  # K = 0
        adv = x.new_zeros(x.shape[0])
    return batch_whiten(adv, epsilon=epsilon) if whiten else adv

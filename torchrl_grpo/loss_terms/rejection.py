"""Rejection of the tokens and sequences on which the trainer and the inference engine disagree,
and the diagnostics around it: verl's ``rollout_rs`` modes (:data:`REJECTION_MODES`, chained by
:func:`rejection_mask`), verl's perplexity metrics (:func:`perplexity_metrics`), verl's DPPO
``pg_clipfrac_lower`` (:func:`dppo_truncation_fraction`) and TRL's ``vespo/phi_seq_mean``
(:func:`vespo_phi_sequence_mean`).

Sources, transcribed in ``test/loss_terms/test_rejection.py``: verl 0.9.0
(verl's ``trainer.ppo.rollout_corr_helper`` and ``core_algos.py``, unchanged on the
``release/v0.9.0`` branch and on ``main`` up to 2026-08-22) and TRL's ``grpo_trainer.py``
(``main`` of 2026-07-24). One decision departs from both, the package's: a sequence with no real
token is not a sequence, so it is never rejected and no mean over sequences counts it (verl and
TRL average over every row, an empty one with a perplexity, ratio and ``phi`` of 1)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from torchrl_grpo.loss_terms._shapes import check_same_shape
from torchrl_grpo.loss_terms.aggregations import masked_mean
from torchrl_grpo.loss_terms.objectives import MAX_LOG_RATIO, VESPO_K, VESPO_LAMBDA, vespo_loss
from torchrl_grpo.loss_terms.ratios import sequence_sum_log_ratio

# --- the per-token divergences, of d = log pi_old - log pi_inference clamped to [-20, 20] -----


def _k1(d: torch.Tensor) -> torch.Tensor:
    return -d  # log pi_inference - log pi_old: verl's k1 is the log of the inverse ratio


def _k2(d: torch.Tensor) -> torch.Tensor:
    return 0.5 * d**2


def _k3(d: torch.Tensor) -> torch.Tensor:
    return d.exp() - 1.0 - d


# --- how a mode reduces them: per token (B, T) or per sequence (B, 1), 0 for an empty row -----


def _per_token(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return x


def _sequence_sum(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return torch.where(mask, x, 0.0).sum(-1, keepdim=True)


def _sequence_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return _sequence_sum(x, mask) / mask.sum(-1, keepdim=True).clamp_min(1)


def _sequence_max(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    # only for the k2 and k3 divergences, which are >= 0: the 0 of padding never wins
    return torch.where(mask, x, 0.0).amax(-1, keepdim=True)


@dataclass(frozen=True)
class RejectionMode:
    r"""One of verl's ``rollout_rs`` modes: a per-token divergence, its reduction and its bound.

    .. math:: d_t = \operatorname{clip}\Big(\log\frac{\pi_{old}(o_t)}{\pi_{inference}(o_t)},
        -20, 20\Big), \qquad k_1 = -d_t, \quad k_2 = \tfrac{1}{2} d_t^2, \quad
        k_3 = e^{d_t} - 1 - d_t

    .. math:: S = \operatorname{reduce}_t\, k(d_t), \qquad
        \text{keep} = \begin{cases} \log \ell \le S \le \log h & k_1 \\ S \le h &
        k_2, k_3 \end{cases}

    verl's ``compute_rollout_rejection_mask`` (``rollout_corr_helper.py``, 0.9.0): the
    statistic is per token (``token_*``: a token is rejected alone) or the sum, mean or maximum
    over a sequence's real tokens (``seq_sum_*``, ``seq_mean_*``, ``seq_max_*``: the whole
    sequence is rejected). The ``k1`` modes keep a two-sided band ``[low, high]`` on
    ``e^S``, a ratio of the *inference engine over the trainer* (verl's ``k1 = -log r``): with
    ``[0.5, 1.5]``, a token is kept when ``pi_old / pi_inference`` is in ``[1/1.5, 2]``. A
    ``k1`` band given by its upper bound alone has ``low = 1 / high``. The ``k2`` and ``k3``
    modes take an upper bound ``high`` only, and no ``low``. verl has no default threshold
    (``rollout_rs_threshold: null``; its presets: ``seq_sum_k1`` ``0.5_2.0``, ``seq_mean_k1``
    ``0.999_1.001``, ``seq_mean_k3`` ``0.01``). No gradient.

    Args:
        divergence (Callable): ``k(d)``, elementwise.
        reduce (Callable): ``(k (B, T), mask) -> (B, T)`` per token or ``(B, 1)`` per sequence.
        two_sided (bool): a ``[low, high]`` band on ``e^S`` (``k1``); else ``S <= high``.

    Call arguments:
        log_weight (torch.Tensor): ``log pi_old - log pi_inference`` per token, ``(B, T)``.
        mask (torch.Tensor): boolean ``(B, T)``, ``True`` on real tokens.
        low (float or None): the lower ratio bound of a ``k1`` mode, ``None`` otherwise.
        high (float): the upper bound, ``> 0``.

    Returns:
        torch.Tensor: boolean ``(B, T)``, ``True`` on the real tokens kept.

    Raises:
        ValueError: a bound not positive, ``low > high``, or a ``low`` for a ``k2``/``k3`` mode.

    Examples:
        >>> import math, torch
        >>> log_w = torch.tensor([[0.0, math.log(3.0)], [0.1, -0.1]])
        >>> mask = torch.ones(2, 2, dtype=torch.bool)
        >>> REJECTION_MODES["token_k1"](log_w, mask, None, 2.0)  # pi_inference / pi_old = 1/3
        tensor([[ True, False],
                [ True,  True]])
        >>> REJECTION_MODES["seq_max_k3"](log_w, mask, None, 0.5)  # 3 - 1 - log 3 = 0.901
        tensor([[False, False],
                [ True,  True]])
    """

    divergence: Callable[[torch.Tensor], torch.Tensor]
    reduce: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    two_sided: bool

    def __call__(
        self, log_weight: torch.Tensor, mask: torch.Tensor, low: float | None, high: float
    ) -> torch.Tensor:
        check_same_shape(log_weight=log_weight, mask=mask)
        low, high = self._bounds(low, high)
        with torch.no_grad():
            # float32 at least (e^20 overflows float16)
            d = log_weight.to(torch.promote_types(log_weight.dtype, torch.float32))
            stat = self.reduce(self.divergence(d.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)), mask)
            if self.two_sided:
                keep = (stat >= math.log(low)) & (stat <= math.log(high))
            else:
                keep = stat <= high
            return mask & keep

    def _bounds(self, low: float | None, high: float) -> tuple[float | None, float]:
        # verl's _parse_rollout_rs_thresholds: its checks, and the reciprocal lower bound of k1
        if not high > 0:
            raise ValueError(f"the upper bound must be positive, got high={high}.")
        if not self.two_sided:
            if low is not None:
                raise ValueError(f"a k2/k3 mode takes an upper bound only, got low={low}.")
            return None, float(high)
        low = 1.0 / high if low is None else low
        if not 0 < low <= high:
            raise ValueError(f"a k1 band needs 0 < low <= high, got low={low}, high={high}.")
        return float(low), float(high)


#: verl's rejection modes by their ``rollout_rs`` name (every one verl 0.9.0 accepts; there is
#: no ``seq_max_k1``). Each maps ``(log_weight, mask, low, high)`` to the boolean ``(B, T)``
#: real tokens kept (:class:`RejectionMode`); :func:`rejection_mask` chains them.
REJECTION_MODES: dict[str, RejectionMode] = {
    "token_k1": RejectionMode(_k1, _per_token, two_sided=True),
    "token_k2": RejectionMode(_k2, _per_token, two_sided=False),
    "token_k3": RejectionMode(_k3, _per_token, two_sided=False),
    "seq_sum_k1": RejectionMode(_k1, _sequence_sum, two_sided=True),
    "seq_sum_k2": RejectionMode(_k2, _sequence_sum, two_sided=False),
    "seq_sum_k3": RejectionMode(_k3, _sequence_sum, two_sided=False),
    "seq_mean_k1": RejectionMode(_k1, _sequence_mean, two_sided=True),
    "seq_mean_k2": RejectionMode(_k2, _sequence_mean, two_sided=False),
    "seq_mean_k3": RejectionMode(_k3, _sequence_mean, two_sided=False),
    "seq_max_k2": RejectionMode(_k2, _sequence_max, two_sided=False),
    "seq_max_k3": RejectionMode(_k3, _sequence_max, two_sided=False),
}

#: a threshold entry as verl writes one: ``2.0`` or ``"2.0"`` (an upper bound), ``"0.5_2.0"``
#: (a ``k1`` band ``low_high``)
Threshold = float | str


def _mode_names(modes: str | Sequence[str]) -> list[str]:
    # verl's comma-separated rollout_rs (or a list of names): stripped, duplicates dropped
    names = modes.split(",") if isinstance(modes, str) else list(modes)
    names = list(dict.fromkeys(name.strip() for name in names if name.strip()))
    unknown = [name for name in names if name not in REJECTION_MODES]
    if not names or unknown:
        raise ValueError(
            f"rejection modes {modes!r}: {f'unknown {unknown}' if unknown else 'none given'}; "
            f"choose among {sorted(REJECTION_MODES)}."
        )
    return names


def _threshold_bounds(entry: Threshold) -> tuple[float | None, float]:
    # one threshold entry: "low_high" -> (low, high); a number -> (None, high)
    if isinstance(entry, str) and "_" in entry:
        low, high = entry.split("_", 1)
        return float(low), float(high)
    return None, float(entry)


def rejection_mask(
    log_weight: torch.Tensor,
    mask: torch.Tensor,
    modes: str | Sequence[str],
    thresholds: Threshold | Sequence[Threshold],
) -> torch.Tensor:
    r"""verl's chained rejection: a token stays only if every listed mode keeps it.

    .. math:: M_{i,t} = m_{i,t} \prod_{j} \text{keep}_j(i, t)

    verl's ``compute_rollout_rejection_mask`` (``rollout_corr_helper.py``, 0.9.0) with
    ``rollout_rs="token_k1,seq_max_k2"``: the modes (:data:`REJECTION_MODES`) are read from
    the comma-separated string (or a list), duplicates dropped, and their keep masks multiplied.
    ``thresholds`` is verl's ``rollout_rs_threshold``: one entry shared by every mode, or one per
    mode (a comma-separated string or a list); an entry is an upper bound (``2.0``) or, for a
    ``k1`` mode, a band ``"low_high"`` (``"0.5_2.0"``). verl writes the result over its
    ``response_mask``: rejected tokens leave both the sum and the count of the token mean (its
    engines count ``batch_num_tokens`` from that mask); in its ``bypass_mode`` loss the mask is
    applied inside the loss, after the count, so rejected tokens stay in the denominator there.

    Args:
        log_weight (torch.Tensor): ``log pi_old - log pi_inference`` per token, ``(B, T)``.
        mask (torch.Tensor): boolean ``(B, T)``, ``True`` on real tokens.
        modes (str or Sequence[str]): e.g. ``"token_k1,seq_max_k2"``.
        thresholds (float, str or Sequence): e.g. ``"0.4_1.8,3.0"`` or ``[2.0, 0.1]``.

    Returns:
        torch.Tensor: boolean ``(B, T)``, ``True`` on the real tokens that stay.

    Raises:
        ValueError: an unknown or empty mode list, a number of thresholds other than one or one
            per mode, or a bound a mode refuses (:class:`RejectionMode`).

    Examples:
        >>> import math, torch
        >>> log_w = torch.tensor([[0.0, 0.1, 1.0], [0.2, 0.3, 0.0]])
        >>> mask = torch.tensor([[True, True, True], [True, True, False]])
        >>> rejection_mask(log_w, mask, "token_k1", 2.0)  # e^-1 < 1/2: the third token
        tensor([[ True,  True, False],
                [ True,  True, False]])
        >>> rejection_mask(log_w, mask, "token_k1,seq_sum_k1", "0.5_2.0,0.6_1.5")  # e^-1.1, e^-0.5
        tensor([[False, False, False],
                [ True,  True, False]])
    """
    names = _mode_names(modes)
    if isinstance(thresholds, str):
        thresholds = [part for part in thresholds.split(",") if part.strip()]
    entries = list(thresholds) if isinstance(thresholds, Sequence) else [thresholds]
    if len(entries) not in (1, len(names)):
        raise ValueError(
            f"{len(entries)} thresholds {thresholds!r} for the {len(names)} modes {names}: give "
            "one shared by all or one per mode."
        )
    entries = entries * len(names) if len(entries) == 1 else entries
    keep = mask.clone()
    for name, entry in zip(names, entries, strict=True):
        keep &= REJECTION_MODES[name](log_weight, mask, *_threshold_bounds(entry))
    return keep


def perplexity_metrics(
    log_prob: torch.Tensor, inference_log_prob: torch.Tensor, mask: torch.Tensor
) -> dict[str, torch.Tensor]:
    r"""The trainer's and the inference engine's perplexities, per sequence then averaged.

    .. math:: \bar\ell_i = \frac{1}{|o_i|} \sum_{t \in o_i} \log \pi(o_t), \qquad
        \text{ppl} = \frac{1}{G} \sum_i e^{-\bar\ell_i}, \qquad
        \Delta_i = \bar\ell^{\,inference}_i - \bar\ell^{\,train}_i, \qquad
        \text{ppl\_ratio} = \frac{1}{G} \sum_i e^{\Delta_i}

    verl's ``compute_offpolicy_metrics`` (``rollout_corr_helper.py``, 0.9.0; its
    ``rollout_corr/`` metrics): each sequence's mean log-probability over its real tokens, then
    means over the ``G`` sequences holding one. ``training_ppl`` and ``rollout_ppl`` are means of
    per-sequence perplexities (not the perplexity of the batch), ``*_log_ppl`` the means of
    ``-ell_i``; ``log_ppl_diff`` is the mean of ``Delta_i = log(ppl_train_i / ppl_inference_i)``
    (positive: the trainer finds the tokens less likely), with its mean absolute value, its
    maximum and minimum; ``ppl_ratio`` the mean of the per-sequence ratios ``e^{Delta_i}``, not
    ``e^{log_ppl_diff}``. No clamp, as verl. Detached.

    Args:
        log_prob (torch.Tensor): the trainer's ``log pi`` per token (verl's ``old_log_prob``,
            or the current one in its actor), ``(B, T)``.
        inference_log_prob (torch.Tensor): the inference engine's, ``(B, T)``.
        mask (torch.Tensor): boolean ``(B, T)``, ``True`` on real tokens (at least one).

    Returns:
        dict[str, torch.Tensor]: scalars ``training_ppl``, ``training_log_ppl``,
        ``rollout_ppl``, ``rollout_log_ppl``, ``log_ppl_diff``, ``log_ppl_abs_diff``,
        ``log_ppl_diff_max``, ``log_ppl_diff_min`` and ``ppl_ratio``.

    Examples:
        >>> import math, torch
        >>> train = torch.tensor([[-1.0, -3.0], [-2.0, 0.0]])
        >>> infer = torch.tensor([[-1.0, -1.0], [-2.0, 0.0]])
        >>> stats = perplexity_metrics(train, infer, torch.tensor([[True, True], [True, False]]))
        >>> stats["training_log_ppl"], stats["rollout_log_ppl"]  # (2 + 2) / 2, (1 + 2) / 2
        (tensor(2.), tensor(1.5000))
        >>> stats["log_ppl_diff"], stats["ppl_ratio"]  # (1 + 0) / 2, (e + 1) / 2
        (tensor(0.5000), tensor(1.8591))
    """
    check_same_shape(log_prob=log_prob, inference_log_prob=inference_log_prob, mask=mask)
    with torch.no_grad():  # one pass over both: a few operations whatever the batch
        dtype = torch.promote_types(log_prob.dtype, torch.float32)
        both = torch.stack([log_prob, inference_log_prob]).to(dtype)  # (2, B, T)
        count = mask.sum(-1)  # (B,)
        nonempty = count > 0
        means = torch.where(mask, both, 0.0).sum(-1) / count.clamp_min(1)  # (2, B)
        diff = means[1] - means[0]  # (B,)
        per_row = torch.stack(
            [-means[0], -means[1], diff, diff.abs(), diff.exp(), *(-means).exp()]
        )  # (7, B)
        averaged = torch.where(nonempty, per_row, 0.0).sum(-1) / nonempty.sum()
        names = ("training_log_ppl", "rollout_log_ppl", "log_ppl_diff", "log_ppl_abs_diff")
        out = dict(zip((*names, "ppl_ratio", "training_ppl", "rollout_ppl"), averaged))
        out["log_ppl_diff_max"] = torch.where(nonempty, diff, -math.inf).amax()
        out["log_ppl_diff_min"] = torch.where(nonempty, diff, math.inf).amin()
        return out


def dppo_truncation_fraction(
    log_ratio: torch.Tensor, keep: torch.Tensor, mask: torch.Tensor, ratio_cap: float | torch.Tensor
) -> torch.Tensor:
    r"""verl's DPPO ``pg_clipfrac_lower``: the share of tokens whose ratio the cap truncates.

    .. math:: \frac{1}{N} \sum_{i,t} m_{i,t}\, M_{i,t}\, \big[r_{i,t} > C\big], \qquad
        r_{i,t} = e^{\operatorname{clip}(\log \pi_\theta(o_t) - \log \pi_{old}(o_t), -20, 20)}

    verl's ``compute_policy_loss_dppo_tv`` / ``_dppo_kl`` (``core_algos.py``, 0.9.0) weigh each
    token inside the trust region ``M`` (:func:`dppo_tv_mask`, :func:`dppo_kl_mask`) by the
    truncated ratio ``min(r, C)`` (``clip_ratio_c``; ``3.0`` by verl's actor default, ``10^4`` in
    its DPPO recipe), in place of a dual clip, and report under ``pg_clipfrac_lower`` the share of
    the ``N`` real tokens that are inside the trust region and truncated,
    ``(ratio > clip_ratio_c) * valid_mask``; not the tokens masked below the trust region
    (their share, with those above, is ``pg_clipfrac``). No gradient.

    Args:
        log_ratio (torch.Tensor): ``log pi_theta - log pi_old`` per token, ``(B, T)``.
        keep (torch.Tensor): boolean ``(B, T)``, the trust region's tokens ``M``.
        mask (torch.Tensor): boolean ``(B, T)``, ``True`` on real tokens (at least one).
        ratio_cap (float or torch.Tensor): ``C``, verl's ``clip_ratio_c``.

    Returns:
        torch.Tensor: a scalar in ``[0, 1]``.

    Examples:
        >>> import math, torch
        >>> log_r = torch.tensor([[0.0, math.log(4.0), math.log(5.0), 9.0]])
        >>> keep = torch.tensor([[True, True, False, True]])
        >>> mask = torch.tensor([[True, True, True, False]])
        >>> dppo_truncation_fraction(log_r, keep, mask, 3.0)  # the ratio 4 only, of 3 tokens
        tensor(0.3333)
    """
    check_same_shape(log_ratio=log_ratio, keep=keep, mask=mask)
    with torch.no_grad():
        ratio = log_ratio.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO).exp()  # (B, T)
        return masked_mean((keep & (ratio > ratio_cap)).to(ratio.dtype), mask)


def vespo_phi_sequence_mean(
    log_ratio: torch.Tensor,
    advantage: torch.Tensor,
    mask: torch.Tensor,
    k_pos: float = VESPO_K[0],
    lambda_pos: float = VESPO_LAMBDA[0],
    k_neg: float = VESPO_K[1],
    lambda_neg: float = VESPO_LAMBDA[1],
) -> torch.Tensor:
    r"""TRL's ``vespo/phi_seq_mean``: the mean over sequences of VESPO's kernel of their weight.

    .. math:: \frac{1}{G} \sum_i \phi(W_i), \qquad \phi(W) = W^k e^{\lambda (1 - W)}, \qquad
        \log W_i = \operatorname{clip}\Big(\sum_{t \in o_i}
        \operatorname{clip}(\log r_{i,t}, -20, 20),\ \log 10^{-8},\ 20\Big)

    TRL's ``GRPOTrainer`` (``grpo_trainer.py``, ``get_gamma_weights`` and its metric,
    ``main`` of 2026-07): the factor :func:`vespo_loss` puts on each sequence's gradient,
    ``(k, lambda)`` picked by the sign of its advantage (``A >= 0``: ``k_pos``, ``lambda_pos``;
    TRL's defaults ``(2, 3)`` and ``(3, 2)``), ``lambda`` floored at ``1e-4``, a non-finite
    ``phi`` 0, then averaged over the ``G`` sequences holding a real token (TRL: over every
    row). 1 on-policy; it shows how much of the batch's gradient the kernel lets through. With
    TRL's vLLM correction the weight also holds ``pi_old / pi_inference``: add its log to
    ``log_ratio``. No gradient.

    Args:
        log_ratio (torch.Tensor): ``log pi_theta - log pi_old`` per token, ``(B, T)``.
        advantage (torch.Tensor): ``A``, one per sequence, ``(B, 1)``.
        mask (torch.Tensor): boolean ``(B, T)``, ``True`` on real tokens (at least one).
        k_pos, lambda_pos (float): the kernel for ``A >= 0``. Default to ``2.0``, ``3.0``.
        k_neg, lambda_neg (float): the kernel for ``A < 0``. Default to ``3.0``, ``2.0``.

    Returns:
        torch.Tensor: a scalar.

    Raises:
        ValueError: ``advantage`` is not ``(B, 1)``.

    Examples:
        >>> import math, torch
        >>> log_r = torch.tensor([[0.0, 0.0], [math.log(2.0), 0.0], [0.5, 0.5]])
        >>> adv = torch.tensor([[1.0], [1.0], [-1.0]])  # W = 1, 2, e^0.5
        >>> mask = torch.tensor([[True, True], [True, True], [True, False]])
        >>> vespo_phi_sequence_mean(log_r, adv, mask)  # (1 + 4 e^-3 + e^(1.5 + 2 - 2 e^0.5)) / 3
        tensor(0.8079)
    """
    check_same_shape(log_ratio=log_ratio, mask=mask)
    if advantage.shape != (*mask.shape[:-1], 1):
        raise ValueError(
            f"advantage has shape {tuple(advantage.shape)}: VESPO's metric needs one advantage "
            f"per sequence, {(*mask.shape[:-1], 1)}."
        )
    with torch.no_grad():
        log_w = sequence_sum_log_ratio(log_ratio, mask)[..., :1]  # (B, 1)
        sign = torch.where(advantage >= 0, 1.0, -1.0).to(log_w.dtype)  # (B, 1)
        # vespo_loss is -phi(W) A log pi: with A = +-1 and log pi = -A, it is phi(W) itself
        phi = vespo_loss(log_w, sign, -sign, k_pos, lambda_pos, k_neg, lambda_neg)  # (B, 1)
        return masked_mean(phi.squeeze(-1), mask.any(-1))

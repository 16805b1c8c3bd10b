"""The published variants as presets: GRPOLoss with a paper's defaults, one table each.

A preset is a :class:`~torchrl_grpo.GRPOLoss` whose keyword defaults are its class's
``defaults``; the keywords a caller gives win (a caller's ``corrections`` and ``penalties`` join
the preset's, replacing those of the same slot), and every other GRPOLoss keyword is taken.
The variants among the defaults are objects of :mod:`torchrl_grpo.loss.variants`.
A new preset is a subclass of :class:`_Preset` with its docstring and its ``defaults``.

The presets' examples share one set-up, :data:`EXAMPLE_SETUP` (run before each of them by the
doctest runners: ``conftest.py`` for pytest, ``docs/conf.py`` for Sphinx): ``example_policy``,
a token policy over 5 tokens from 3 hidden features, and ``example_batch``, two on-policy
sequences of 4 tokens with the advantages ``+1`` and ``-1``.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, ClassVar

from torchrl_grpo.loss.grpo import GRPOLoss
from torchrl_grpo.loss.output import CISPOLossOutput, DAPOLossOutput
from torchrl_grpo.loss.variants import CISPO, SAPO, VESPO, TrustRegion

__all__ = [
    "EXAMPLE_SETUP",
    "DAPO",
    "CISPOLoss",
    "DAPOLoss",
    "DPPOLoss",
    "DrGRPOLoss",
    "GSPOLoss",
    "LUSPOLoss",
    "SAPOLoss",
    "VESPOLoss",
]


#: The set-up of the presets' examples: a token policy and an on-policy batch.
EXAMPLE_SETUP = """
import torch
from tensordict import TensorDict
from tensordict.nn import TensorDictModule
from torchrl.modules import ProbabilisticActor

net = TensorDictModule(torch.nn.Linear(3, 5), ["hidden"], ["logits"])
example_policy = ProbabilisticActor(net, in_keys=["logits"], out_keys=["tokens"],
    distribution_class=torch.distributions.Categorical, return_log_prob=True)
hidden = TensorDict(hidden=torch.randn(2, 4, 3), batch_size=[2])
example_batch = example_policy(hidden).detach()
example_batch["advantage"] = torch.tensor([1.0, -1.0])
"""


class _PresetSignature:
    """``inspect.signature(Preset)``, which the docs show: GRPOLoss's keywords with the
    preset's defaults (its ``required`` ones without a default). On the class only: an instance
    keeps the call signature of any GRPOLoss."""

    def __get__(self, instance: Any, owner: type[_Preset]) -> inspect.Signature:
        if instance is not None:
            raise AttributeError("__signature__")
        signature = inspect.signature(GRPOLoss)
        parameters = []
        for parameter in signature.parameters.values():
            if parameter.name in owner.required:
                parameter = parameter.replace(default=inspect.Parameter.empty)
            elif parameter.name in owner.defaults:
                parameter = parameter.replace(default=owner.defaults[parameter.name])
            parameters.append(parameter)
        return signature.replace(parameters=parameters)


class _Preset(GRPOLoss):
    """A GRPOLoss whose keyword defaults are the class's ``defaults``."""

    #: The preset's keyword defaults, merged under the caller's keywords.
    defaults: ClassVar[Mapping[str, Any]] = MappingProxyType({})
    #: The keywords the preset has no default for, that the caller must give.
    required: ClassVar[tuple[str, ...]] = ()
    __signature__ = _PresetSignature()

    def __init__(self, actor_network=None, *critic, **kwargs):
        for name in self.required:
            if name not in kwargs:
                raise TypeError(
                    f"{type(self).__name__}.__init__() missing 1 required keyword-only "
                    f"argument: {name!r}"
                )
        merged = {**self.defaults, **kwargs}
        for name in ("corrections", "penalties"):  # the caller's replace the preset's, by slot
            if name in kwargs and name in self.defaults:
                given = tuple(kwargs[name] or ())
                slots = {variant.slot for variant in given}
                kept = tuple(v for v in self.defaults[name] if v.slot not in slots)
                merged[name] = (*kept, *given)
        super().__init__(actor_network, *critic, **merged)


class DAPOLoss(_Preset):
    """GRPOLoss with DAPO's defaults: clip-higher and a global token mean, no KL.

    DAPO (Yu et al., 2025, "DAPO: An Open-Source LLM Reinforcement Learning System at Scale",
    arXiv:2503.14476) decouples the clip band, ``[1 - 0.2, 1 + 0.28]`` (Eq. 10), so that
    low-probability tokens can grow, averages the loss over all tokens of the batch (its
    token-level policy-gradient loss, ``"token_mean"``) and drops the KL penalty. Its dynamic
    sampling and overlong shaping act on the data, not on the loss. No dual clip, as in the
    paper: verl's recipes run DAPO with its default ``clip_ratio_c=3.0``, so pass
    ``objective=Clip(clip_ratio_c=3.0)`` to reproduce their numbers (see "Coming from verl or
    TRL" in the migration guide).

    .. math:: L = \\frac{1}{\\sum_i |o_i|} \\sum_{i,t} -\\min\\big(r_{i,t} A_i,\\
        \\operatorname{clip}(r_{i,t}, 0.8, 1.28) A_i\\big)

    Args:
        actor_network (ProbabilisticTensorDictSequential): the policy.

    Keyword Args:
        clip_epsilon: defaults to ``(0.2, 0.28)``.
        aggregation: defaults to ``"token_mean"``.
        entropy_coeff: defaults to ``0.0`` (the entropy is still reported).
        **kwargs: any other :class:`GRPOLoss` keyword.

    Examples:
        >>> loss = DAPOLoss(example_policy)
        >>> loss.clip_epsilon_low, loss.clip_epsilon_high
        (tensor(0.2000), tensor(0.2800))
    """

    defaults = MappingProxyType(
        {"clip_epsilon": (0.2, 0.28), "aggregation": "token_mean", "entropy_coeff": 0.0}
    )
    output_type = DAPOLossOutput


class DAPO(GRPOLoss):
    """torchrl's ``DAPO``, under its name: :class:`GRPOLoss` with GRPOLoss's defaults, whose
    output is a :class:`~torchrl_grpo.loss.output.DAPOLossOutput`.

    torchrl's ``DAPO`` takes the clip-higher band as an argument and sets no default of DAPO's
    paper; so does this one, so that ``from torchrl_grpo.loss import DAPO`` changes no number
    of a torchrl script. :class:`DAPOLoss` is the preset with the paper's defaults.

    Examples:
        >>> loss = DAPO(example_policy, clip_epsilon=(0.2, 0.28))
        >>> loss.output_type.__name__, loss.clip_epsilon_high
        ('DAPOLossOutput', tensor(0.2800))
    """

    output_type = DAPOLossOutput


class DrGRPOLoss(_Preset):
    """GRPOLoss with Dr. GRPO's defaults: token sums divided by a constant length, no KL.

    Dr. GRPO (Liu et al., 2025, "Understanding R1-Zero-Like Training: A Critical Perspective",
    arXiv:2503.20783) removes GRPO's two biases: the division by the response length ``|o_i|``
    in the loss -- replaced here by the constant generation budget ``max_length`` -- and the
    division by the reward standard deviation in the advantage (an advantage-side setting).

    .. math:: L = \\frac{1}{G} \\sum_{i=1}^{G} \\frac{1}{L_{\\max}} \\sum_{t=1}^{|o_i|}
        -\\min\\big(r_{i,t} A_i,\\ \\operatorname{clip}(r_{i,t}, 0.8, 1.2) A_i\\big)

    Args:
        actor_network (ProbabilisticTensorDictSequential): the policy.

    Keyword Args:
        max_length (int): ``L_max``, the maximum number of generated tokens. Required.
        clip_epsilon: defaults to ``0.2``.
        aggregation: defaults to ``"seq_mean_token_sum_norm"``.
        entropy_coeff: defaults to ``0.0``.
        **kwargs: any other :class:`GRPOLoss` keyword.

    Examples:
        >>> loss = DrGRPOLoss(example_policy, max_length=1024)
    """

    defaults = MappingProxyType(
        {"clip_epsilon": 0.2, "aggregation": "seq_mean_token_sum_norm", "entropy_coeff": 0.0}
    )
    required = ("max_length",)


class GSPOLoss(_Preset):
    """GRPOLoss with GSPO's defaults: a sequence-level ratio and a very narrow clip band.

    GSPO (Zheng et al., 2025, "Group Sequence Policy Optimization", arXiv:2507.18071) clips the
    length-normalised sequence ratio ``s_i`` instead of each token's, with the band
    ``[1 - 3e-4, 1 + 4e-4]`` (Sec. 5.1), averages over sequences and uses no KL penalty.

    .. math:: L = \\frac{1}{G} \\sum_{i=1}^{G} -\\min\\big(s_i A_i,\\
        \\operatorname{clip}(s_i, 1 - 3\\cdot 10^{-4}, 1 + 4\\cdot 10^{-4}) A_i\\big), \\quad
        s_i = \\exp\\Big(\\frac{1}{|o_i|} \\sum_t \\log r_{i,t}\\Big)

    Args:
        actor_network (ProbabilisticTensorDictSequential): the policy.

    Keyword Args:
        clip_epsilon: defaults to ``(3e-4, 4e-4)``.
        ratio_level: defaults to ``"sequence"``.
        aggregation: defaults to ``"seq_mean_token_mean"``.
        entropy_coeff: defaults to ``0.0``.
        **kwargs: any other :class:`GRPOLoss` keyword.

    Examples:
        >>> loss = GSPOLoss(example_policy)
    """

    defaults = MappingProxyType(
        {
            "clip_epsilon": (3e-4, 4e-4),
            "ratio_level": "sequence",
            "aggregation": "seq_mean_token_mean",
            "entropy_coeff": 0.0,
        }
    )


class CISPOLoss(_Preset):
    """GRPOLoss with CISPO's objective: a clipped, stop-gradient importance weight.

    CISPO (MiniMax, 2025, "MiniMax-M1", arXiv:2506.13585) keeps every token's gradient
    and only bounds its importance weight:

    .. math:: L = -\\frac{1}{\\sum_i |o_i|} \\sum_{i,t}
        \\operatorname{sg}\\big[\\operatorname{clip}(r_{i,t}, 1-\\varepsilon_{low},
        1+\\varepsilon_{high})\\big] A_i \\log \\pi_\\theta(o_{i,t})

    MiniMax-M1 imposes no lower bound (``eps_low = 1``) and tunes only the upper one, without
    publishing its value; the default cap of the weight at ``4`` (``eps_high = 3``) follows
    ScaleRL (Khatri et al., 2025, arXiv:2510.13786), which found CISPO insensitive to it in
    ``{4, 5, 8}``. Unlike torchrl 0.14.1's ``CISPOLoss``, the weight carries no gradient, so
    tokens outside the band still learn.

    Args:
        actor_network (ProbabilisticTensorDictSequential): the policy.

    Keyword Args:
        clip_epsilon: defaults to ``(1.0, 3.0)``: the weight is clipped to ``[0, 4]``.
        objective: defaults to ``CISPO()``.
        aggregation: defaults to ``"token_mean"``.
        entropy_coeff: defaults to ``0.0``.
        **kwargs: any other :class:`GRPOLoss` keyword.

    Examples:
        >>> loss = CISPOLoss(example_policy)
        >>> loss.clip_bounds[0]  # no lower bound
        tensor(-inf)
    """

    defaults = MappingProxyType(
        {
            "clip_epsilon": (1.0, 3.0),
            "objective": CISPO(),
            "aggregation": "token_mean",
            "entropy_coeff": 0.0,
        }
    )
    output_type = CISPOLossOutput


class SAPOLoss(_Preset):
    """GRPOLoss with SAPO's objective: a soft, temperature-controlled gate instead of the clip.

    SAPO (Gao et al., 2025, "Soft Adaptive Policy Optimization", arXiv:2511.20347) replaces the
    hard clip of the ratio by a sigmoid gate whose temperature depends on the advantage's sign
    (:func:`~torchrl_grpo.loss_terms.sapo_loss`), and keeps GRPO's sequence-level averaging:

    .. math:: L = -\\frac{1}{G} \\sum_{i=1}^{G} \\frac{1}{|o_i|} \\sum_{t=1}^{|o_i|}
        \\frac{4}{\\tau_{i,t}}\\, \\sigma\\big(\\tau_{i,t} (r_{i,t} - 1)\\big) A_{i,t}, \\qquad
        \\tau_{i,t} = \\tau_{pos} \\text{ if } A_{i,t} > 0 \\text{ else } \\tau_{neg}

    with ``tau_pos = 1.0`` and ``tau_neg = 1.05`` (the paper's and TRL's defaults). Tokens far
    off-policy get a smoothly vanishing gradient rather than none past a bound; on-policy the
    gradient is GRPO's. ``clip_epsilon`` only sets the reported clip fractions.

    Args:
        actor_network (ProbabilisticTensorDictSequential or LLMWrapperBase): the policy.

    Keyword Args:
        objective: defaults to ``SAPO(temperature_pos=1.0, temperature_neg=1.05)``:
            ``tau_pos`` and ``tau_neg``.
        aggregation: defaults to ``"seq_mean_token_mean"``.
        entropy_coeff: defaults to ``0.0``.
        **kwargs: any other :class:`GRPOLoss` keyword.

    Examples:
        >>> out = SAPOLoss(example_policy)(example_batch)  # on-policy: -(4 / tau) sigma(0) A
        >>> round(out.loss_objective.item(), 4)  # (-2 / 1.0 + 2 / 1.05) / 2
        -0.0476
    """

    defaults = MappingProxyType(
        {
            "objective": SAPO(),
            "aggregation": "seq_mean_token_mean",
            "entropy_coeff": 0.0,
        }
    )


class DPPOLoss(_Preset):
    """GRPOLoss with DPPO's trust region: bound each token's probability, not its ratio.

    DPPO ("Rethinking the Trust Region in LLM RL", arXiv:2602.04879) drops PPO's clip of the
    ratio and instead zeroes the tokens whose probability has already moved past a bound in
    the direction of their advantage (:func:`~torchrl_grpo.loss_terms.dppo_tv_mask`, or the
    binary-KL form :func:`~torchrl_grpo.loss_terms.dppo_kl_mask`); the kept tokens get the
    truncated importance-weighted policy gradient, as verl's ``dppo_tv`` / ``dppo_kl``:

    .. math:: L = -\\frac{1}{\\sum_i |o_i|} \\sum_{i,t} M_{i,t}\\,
        \\operatorname{sg}\\big[\\min(r_{i,t}, C)\\big] A_i \\log \\pi_\\theta(o_{i,t})

    That is :func:`~torchrl_grpo.loss_terms.cispo_loss` with no lower bound and the cap ``C``:
    verl's DPPO recipe runs ``C = 10^4`` (``clip_ratio_c``; in effect no cap) with the bound
    ``0.15`` (total variation) or ``0.05`` (binary KL) on both sides. The masked share is
    ``trust_region_masked_fraction``; the share of kept tokens whose ratio exceeds the cap,
    ``trust_region_capped_fraction`` (verl's ``pg_clipfrac_lower``). The aggregation is verl's
    default token mean; its recipe uses Dr. GRPO's (``aggregation="seq_mean_token_sum_norm",
    max_length=L``).

    Args:
        actor_network (ProbabilisticTensorDictSequential or LLMWrapperBase): the policy.

    Keyword Args:
        objective: defaults to ``CISPO()``.
        corrections: defaults to ``(TrustRegion("dppo_tv"),)``, the bounds ``(delta_low,
            delta_high) = (0.15, 0.15)``; ``[TrustRegion("dppo_kl")]`` for the KL form (bounds
            ``0.05``), ``TrustRegion(mode, bounds)`` for others. A caller's corrections join
            it; a ``TrustRegion`` among them replaces it.
        clip_epsilon: defaults to ``(1.0, 9999.0)``: the weight is capped at ``C = 10^4``.
        aggregation: defaults to ``"token_mean"``.
        entropy_coeff: defaults to ``0.0``.
        **kwargs: any other :class:`GRPOLoss` keyword.

    Examples:
        >>> from torchrl_grpo.loss.variants import TrustRegion
        >>> loss = DPPOLoss(example_policy, corrections=[TrustRegion("dppo_kl")])
        >>> out = loss(example_batch)
        >>> out.trust_region_masked_fraction  # on-policy: no token has moved
        tensor(0.)
    """

    defaults = MappingProxyType(
        {
            "objective": CISPO(),
            "corrections": (TrustRegion("dppo_tv"),),
            "clip_epsilon": (1.0, 9999.0),
            "aggregation": "token_mean",
            "entropy_coeff": 0.0,
        }
    )


class VESPOLoss(_Preset):
    """GRPOLoss with VESPO's objective: a smooth kernel on the sequence importance weight.

    VESPO (arXiv:2602.10693; TRL's ``loss_type="vespo"``) weighs each sequence's REINFORCE
    gradient by ``phi(W) = W^k e^{lambda (1 - W)}`` of its importance weight ``W``, the product
    of its token ratios, with the gradient of the weight stopped
    (:func:`~torchrl_grpo.loss_terms.vespo_loss`), in place of any clip:

    .. math:: L = -\\frac{1}{\\sum_i |o_i|} \\sum_{i,t} \\operatorname{sg}\\big[\\phi(W_i)\\big]
        A_i \\log \\pi_\\theta(o_{i,t}), \\qquad W_i = \\prod_t r_{i,t}

    with ``(k, lambda) = (2, 3)`` for ``A >= 0`` and ``(3, 2)`` for ``A < 0`` (TRL's
    ``vespo_k_pos`` ... defaults) and TRL's normalisation, the token mean over the batch.
    ``clip_epsilon`` only sets the reported clip fractions (of ``W``). With an
    ``InferenceCorrection``, TRL folds the sampler's weight into ``W``; here it multiplies
    the loss, as for every objective. ``vespo_phi_seq_mean`` reports TRL's
    ``vespo/phi_seq_mean``, the mean over sequences of ``phi(W)``.

    Args:
        actor_network (ProbabilisticTensorDictSequential or LLMWrapperBase): the policy.

    Keyword Args:
        objective: defaults to ``VESPO(k=(2.0, 3.0), lambda_=(3.0, 2.0))``: ``k`` and
            ``lambda``, each ``(for A >= 0, for A < 0)``.
        ratio_level: defaults to ``"sequence_sum"`` (``W``, the product of the token ratios).
        aggregation: defaults to ``"token_mean"``.
        entropy_coeff: defaults to ``0.0``.
        **kwargs: any other :class:`GRPOLoss` keyword.

    Examples:
        >>> out = VESPOLoss(example_policy)(example_batch)  # on-policy W = 1, phi = 1
        >>> # REINFORCE's gradient
        >>> out.mean_ratio
        tensor(1.)
    """

    defaults = MappingProxyType(
        {
            "objective": VESPO(),
            "ratio_level": "sequence_sum",
            "aggregation": "token_mean",
            "entropy_coeff": 0.0,
        }
    )


class LUSPOLoss(_Preset):
    """GRPOLoss with LUSPO's defaults: GSPO's sequence loss scaled by the sequence's length.

    LUSPO (arXiv:2602.05261; TRL's ``loss_type="luspo"``) multiplies GSPO's per-sequence loss
    by the number of tokens of the sequence, so that long responses are not under-weighted by
    the sequence mean:

    .. math:: L = \\frac{1}{G} \\sum_{i=1}^{G} |o_i|\\, \\Big(-\\min\\big(s_i A_i,\\
        \\operatorname{clip}(s_i, 1-\\varepsilon_{low}, 1+\\varepsilon_{high}) A_i\\big)\\Big)

    GSPO's sequence ratio ``s_i`` (:func:`~torchrl_grpo.loss_terms.sequence_log_ratio`) is
    the same on every token of the sequence, so this is the ``"seq_mean_token_sum"``
    aggregation of GSPO's per-token loss: no new term. The band ``(2e-3, 2.5e-3)`` is TRL's
    LUSPO recipe. TRL divides by every row of the batch; here rows with no real token are not
    counted (as every aggregation here).

    Args:
        actor_network (ProbabilisticTensorDictSequential or LLMWrapperBase): the policy.

    Keyword Args:
        clip_epsilon: defaults to ``(2e-3, 2.5e-3)``.
        ratio_level: defaults to ``"sequence"``.
        aggregation: defaults to ``"seq_mean_token_sum"``.
        entropy_coeff: defaults to ``0.0``.
        **kwargs: any other :class:`GRPOLoss` keyword.

    Examples:
        >>> loss = LUSPOLoss(example_policy)
    """

    defaults = MappingProxyType(
        {
            "clip_epsilon": (2e-3, 2.5e-3),
            "ratio_level": "sequence",
            "aggregation": "seq_mean_token_sum",
            "entropy_coeff": 0.0,
        }
    )

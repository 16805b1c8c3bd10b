"""What :class:`~torchrl_grpo.GRPOLoss` returns: the loss terms and the metrics, as a
tensordict ``TensorClass`` read like ClipPPOLoss's TensorDict output."""

from __future__ import annotations

import dataclasses
import functools

import torch
from tensordict import TensorClass, TensorDictBase

#: What ClipPPOLoss returns with a critic, and GRPOLossOutput never holds.
CRITIC_ENTRIES = ("loss_critic", "value_clip_fraction", "explained_variance")


class LLMLossOutput(TensorClass["nocast"]):
    # tensordict's TensorClass replaces the class docstring: it is set again below.

    loss_objective: torch.Tensor
    clip_fraction: torch.Tensor
    clip_fraction_low: torch.Tensor
    clip_fraction_high: torch.Tensor
    kl_approx: torch.Tensor
    ESS: torch.Tensor
    entropy: torch.Tensor | None = None
    loss_entropy: torch.Tensor | None = None
    kl_to_ref: torch.Tensor | None = None
    loss_kl_to_ref: torch.Tensor | None = None
    kl_to_inference: torch.Tensor | None = None
    loss_kl_to_inference: torch.Tensor | None = None
    inference_masked_fraction: torch.Tensor | None = None
    off_policy_masked_fraction: torch.Tensor | None = None
    behaviour_masked_fraction: torch.Tensor | None = None
    truncated_fraction: torch.Tensor | None = None
    # after the fields of earlier versions, so that a positional construction keeps its meaning
    max_ratio: torch.Tensor | None = None
    mean_ratio: torch.Tensor | None = None
    composite_entropy: TensorDictBase | None = None
    normalization_count: torch.Tensor | None = None  # inside GRPOLoss.summed()
    entropy_coeff: torch.Tensor | None = None
    trust_region_masked_fraction: torch.Tensor | None = None
    inference_vetoed_fraction: torch.Tensor | None = None
    inference_chi2_token: torch.Tensor | None = None
    inference_chi2_sequence: torch.Tensor | None = None
    inference_seq_max_k3_mean: torch.Tensor | None = None
    inference_seq_max_k3_max: torch.Tensor | None = None
    inference_rollout_ppl: torch.Tensor | None = None
    inference_training_ppl: torch.Tensor | None = None
    inference_log_ppl_diff: torch.Tensor | None = None
    inference_ppl_ratio: torch.Tensor | None = None
    inference_rejected_fraction: torch.Tensor | None = None
    trust_region_capped_fraction: torch.Tensor | None = None
    vespo_phi_seq_mean: torch.Tensor | None = None

    def __getitem__(self, index):
        # out["loss_objective"], as a ClipPPOLoss TensorDict output is read
        if isinstance(index, str) or (
            isinstance(index, tuple) and index and all(isinstance(i, str) for i in index)
        ):
            value = self.get(index, None)
            if value is None and index in CRITIC_ENTRIES:  # PPO code reading a critic's term
                raise KeyError(
                    f"{index!r}: GRPO has no critic, so no {index}; the advantage comes with "
                    "the batch (torchrl_grpo.MCAdvantage). The loss to minimise is the sum of the "
                    "loss_* entries, out.total_loss()."
                )
            if value is None:
                raise KeyError(f"{index!r} is not set in this {type(self).__name__}.")
            return value
        return super().__getitem__(index)

    def total_loss(self) -> torch.Tensor:
        """The sum of the ``loss_*`` terms: what torchrl's trainers minimise."""
        return sum(value for key, value in self.items() if key.startswith("loss_"))

    def mean(self, *args, reduce: bool | None = None, **kwargs):
        # torchrl's GRPO recipe backpropagates ``loss.mean(reduce=True)``; on a TensorDict that
        # is the mean of every field, metrics included, which divides the gradient by the number
        # of fields. Here it is the total loss, whatever metrics are reported.
        if reduce and not args and not kwargs:
            return self.total_loss()
        return super().mean(*args, reduce=reduce, **kwargs)


class GRPOLossOutput(LLMLossOutput):
    # TensorClass gives each class its own indexing and reductions: keep LLMLossOutput's
    __getitem__ = LLMLossOutput.__getitem__
    mean = LLMLossOutput.mean


class DAPOLossOutput(GRPOLossOutput):
    __getitem__ = LLMLossOutput.__getitem__
    mean = LLMLossOutput.mean


class CISPOLossOutput(GRPOLossOutput):
    __getitem__ = LLMLossOutput.__getitem__
    mean = LLMLossOutput.mean


@functools.cache
def output_with(base: type[LLMLossOutput], names: tuple[str, ...]) -> type[LLMLossOutput]:
    """``base`` with an entry (``None`` by default) for each of ``names`` it lacks: the output
    of a loss holding a variant whose metrics no built-in output names. ``base`` itself when
    it has them all.

    Examples:
        >>> cls = output_with(GRPOLossOutput, ("my_fraction",))
        >>> issubclass(cls, GRPOLossOutput), cls.__name__
        (True, 'GRPOLossOutput')
        >>> output_with(GRPOLossOutput, ("ESS",)) is GRPOLossOutput
        True
    """
    fields = {field.name for field in dataclasses.fields(base)}  # TensorClass.fields(): deprecated
    extra = [name for name in names if name not in fields]
    if not extra:
        return base
    namespace = {
        "__annotations__": dict.fromkeys(extra, "torch.Tensor | None"),
        **dict.fromkeys(extra),
        "__module__": base.__module__,
        "__qualname__": base.__qualname__,
        "__getitem__": LLMLossOutput.__getitem__,
        "mean": LLMLossOutput.mean,
    }
    return type(base.__name__, (base,), namespace)


LLMLossOutput.__doc__ = """The loss terms and metrics of :class:`GRPOLoss` and its presets
    (torchrl's ``LLMLossOutput``, the base of the classes below): see :class:`GRPOLossOutput`."""
DAPOLossOutput.__doc__ = """What :class:`DAPOLoss` returns (torchrl's ``DAPOLossOutput``): a
    :class:`GRPOLossOutput`, under the name torchrl gives DAPO's output."""
CISPOLossOutput.__doc__ = """What :class:`CISPOLoss` returns (torchrl's ``CISPOLossOutput``): a
    :class:`GRPOLossOutput`, under the name torchrl gives CISPO's output."""
GRPOLossOutput.__doc__ = """What :class:`GRPOLoss` returns: the terms to sum and the metrics to log.

    Every ``loss_*`` field is a differentiable scalar (or, with ``reduction="none"``, a per-token
    tensor of the policy's log-prob shape holding zeros on padding); the others are detached
    scalars computed over real tokens only. Optional terms are ``None`` when not configured.

    It is read like ClipPPOLoss's TensorDict output and like torchrl's ``GRPOLossOutput``:
    ``out.loss_objective``, ``out["loss_objective"]``, ``out.items()`` (torchrl's ``Trainer``,
    ``GRPOTrainer`` and PPO trainer sum the ``loss*`` entries). :meth:`total_loss` is that sum.
    Every entry of ClipPPOLoss's output that means something without a critic is here, under
    the same name; a critic's (``loss_critic``, ``value_clip_fraction``,
    ``explained_variance``) never is: ``out["loss_critic"]``, as torchrl's PPO tutorial reads
    it, raises ``KeyError`` saying GRPO has no critic (``out.loss_critic`` raises
    ``AttributeError``).
    ``out.mean(reduce=True)``, which torchrl's GRPO recipe backpropagates, is :meth:`total_loss`
    too: the mean over fields would divide the gradient by the number of fields, metrics
    included, so adding a metric would rescale training.

    Attributes:
        loss_objective: the aggregated surrogate loss.
        clip_fraction: share of real tokens whose ratio is outside the clip band.
        clip_fraction_low: share below ``1 - eps_low``.
        clip_fraction_high: share above ``1 + eps_high``.
        kl_approx: ``mean(log pi_old - log pi_theta)``, as :class:`~torchrl.objectives.ClipPPOLoss`.
        ESS: normalised effective sample size of the importance weights, in ``(0, 1]``.
        max_ratio: the largest importance ratio of a real token, as ClipPPOLoss's (with
            ``Decoupled``, the ratio to the proximal policy, as ``ESS``).
        mean_ratio: the mean importance ratio over the real tokens.
        entropy: mean per-token entropy of the policy (``None`` without ``entropy_bonus``).
        loss_entropy: ``-entropy_coeff`` times the aggregated entropy.
        entropy_coeff: the entropy coefficient this call applied, with ``EntropyTarget``
            (the adaptive coefficient, or 0 while the entropy last measured is above the
            target).
        kl_to_ref: mean KL estimate to the reference policy (``None`` without
            ``KLToReference``).
        loss_kl_to_ref: ``KLToReference``'s coefficient times the aggregated estimate.
        kl_to_inference: mean KL estimate to the sampling policy (with ``KLToInference``).
        loss_kl_to_inference: ``KLToInference``'s coefficient times the aggregated estimate.
        inference_masked_fraction: share of real tokens the correction against the inference
            engine leaves out (weight 0: outside the band in the ``*_mask`` modes; 0 in the
            truncating ones). With ``InferenceCorrection`` or ``TIS``.
        off_policy_masked_fraction: share of real tokens dropped by off-policy sequence masking
            (with ``OffPolicyMask``).
        behaviour_masked_fraction: share of real tokens whose decoupled-PPO behaviour weight
            exceeds its cap (with ``Decoupled``; 0 without a cap).
        truncated_fraction: share of the sequences flagged truncated, which leave the loss
            (with ``TruncatedCompletions``).
        trust_region_masked_fraction: share of real tokens outside DPPO's trust region, zeroed
            in the objective (with ``TrustRegion``; verl's ``pg_clipfrac`` there).
        inference_vetoed_fraction: share of the sequences vetoed, which leave the loss (with
            ``InferenceVeto``).
        inference_chi2_token, inference_chi2_sequence: chi-square divergence of the importance
            weights ``pi_old / pi_inference``, per token and per sequence; and
        inference_seq_max_k3_mean, inference_seq_max_k3_max: the mean and the largest, over
            the sequences, of their worst token's k3 mismatch
            (:func:`~torchrl_grpo.loss_terms.inference_mismatch`). Whenever the loss reads
            ``inference_log_prob`` (0 where ``sample_log_prob`` stands in for it); beside them
        inference_rollout_ppl, inference_training_ppl, inference_log_ppl_diff,
        inference_ppl_ratio: verl's perplexities of the sampler and of the trainer (its
            ``pi_old``), their log difference and ratio, per sequence then averaged
            (:func:`~torchrl_grpo.loss_terms.perplexity_metrics`).
        inference_rejected_fraction: share of real tokens verl's rejection modes leave out
            (with :class:`~torchrl_grpo.loss.variants.Rejection`).
        trust_region_capped_fraction: share of real tokens inside DPPO's trust region whose
            ratio exceeds the weight's cap ``1 + eps_high`` (verl's DPPO ``pg_clipfrac_lower``).
        vespo_phi_seq_mean: the mean over sequences of VESPO's kernel of their weight (TRL's
            ``vespo/phi_seq_mean``).
        normalization_count: inside :meth:`GRPOLoss.summed`, what the sums divide by.
        composite_entropy: a multi-head policy's entropy per head and per element of the batch
            (padding included), detached, as ClipPPOLoss reports it; ``None`` for one head.

    Examples:
        >>> import torch
        >>> out = GRPOLossOutput(
        ...     loss_objective=torch.tensor(0.5), clip_fraction=torch.tensor(0.0),
        ...     clip_fraction_low=torch.tensor(0.0), clip_fraction_high=torch.tensor(0.0),
        ...     kl_approx=torch.tensor(0.0), ESS=torch.tensor(1.0),
        ...     loss_entropy=torch.tensor(-0.25), entropy=torch.tensor(2.5), batch_size=[])
        >>> out["loss_objective"], out.kl_to_ref
        (tensor(0.5000), None)
        >>> out.total_loss()  # loss_objective + loss_entropy
        tensor(0.2500)
        >>> out.mean(reduce=True)  # the same, not the mean of the seven fields
        tensor(0.2500)
    """

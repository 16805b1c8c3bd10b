"""GRPOLoss: the torchrl-facing loss module. Its keys, its wiring, and one call::

    forward(batch) = read (inputs.py) -> terms (loss_terms) -> output (output.py)

The settings are checked and resolved by :func:`~torchrl_grpo.loss.options.loss_options` before
anything is built; the batch is read into aligned ``(B, T)`` tensors by the functions of
:mod:`torchrl_grpo.loss.inputs`; the per-token math is :mod:`torchrl_grpo.loss_terms`.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from tensordict import TensorDictBase
from tensordict.nn import ProbabilisticTensorDictSequential, TensorDictModuleBase
from tensordict.utils import NestedKey
from torchrl.modules.llm import LLMWrapperBase
from torchrl.objectives import ClipPPOLoss

from torchrl_grpo.loss.inputs import (
    LLM_KEYS,
    Inputs,
    ReadPlan,
    llm_masked_dist,
    read_actor,
    read_llm,
    read_stored,
    tokenizer_end_tokens,
)
from torchrl_grpo.loss.options import (
    CLIP_EPSILON_BUFFERS,
    COEFFICIENTS,
    UNUSED_KEYS,
    LossOptions,
    check_scheduled,
    loss_options,
)
from torchrl_grpo.loss.output import GRPOLossOutput, output_with
from torchrl_grpo.loss.variants import (
    BUILTIN_VARIANTS,
    Exclusion,
    Factor,
    Objective,
    Penalty,
    Step,
    Variant,
    builtin_ranges,
)
from torchrl_grpo.loss.variants.flat import FlatAttributes
from torchrl_grpo.loss_terms import (
    RatioLevel,
    aggregation_sum,
    clip_fractions,
    effective_sample_size,
    inference_mismatch,
    masked_mean,
    perplexity_metrics,
)

__all__ = ["GRPOLoss"]

#: Names in ``locals()`` at the top of ``GRPOLoss.__init__`` that are not its settings.
_NOT_SETTINGS = ("self", "__class__", "actor_network", "critic", "replaced")
#: The entries a variant reads that the loss reads its own way (the reference's padding, the
#: sampler's fallback, the truncation rule, the finite checks), in the order of its in-keys;
#: any other entry a variant reads is read as it is stored (``step.x.entries``).
_READS = ("ref_log_prob", "inference_log_prob", "proximal_log_prob", "truncated")
#: The ranges of the package's own variants' schedulable values: a loss's before it is wired.
_BUILTIN_RANGES = builtin_ranges()
#: The statistics of :func:`~torchrl_grpo.loss_terms.inference_mismatch`, reported as
#: ``inference_<name>`` whenever the loss reads inference log-probs.
_MISMATCH_STATS = ("chi2_token", "chi2_sequence", "seq_max_k3_mean", "seq_max_k3_max")
#: verl's perplexities of :func:`~torchrl_grpo.loss_terms.perplexity_metrics`, reported beside
#: them (as ``inference_rollout_ppl``...).
_PERPLEXITIES = ("rollout_ppl", "training_ppl", "log_ppl_diff", "ppl_ratio")


class GRPOLoss(FlatAttributes, ClipPPOLoss):
    """GRPO loss: :class:`~torchrl.objectives.ClipPPOLoss` with no critic, over real tokens.

    With the defaults, the loss is ClipPPOLoss's clipped surrogate (Schulman et al., 2017) on a
    precomputed advantage -- the group-relative advantage of GRPO (Shao et al., 2024) -- averaged
    over the real tokens of the batch:

    .. math::

        L = \\frac{1}{\\sum_i |o_i|} \\sum_i \\sum_{t} -\\min\\big(r_{i,t} A_{i,t},\\
            \\operatorname{clip}(r_{i,t}, 1-\\varepsilon_{low}, 1+\\varepsilon_{high}) A_{i,t}\\big)
            \\;-\\; c_H\\, \\bar{H} \\;+\\; \\beta_{ref}\\, \\overline{KL}_{ref}

    where ``r = pi_theta / pi_old``. Every published variant is an object of
    :mod:`torchrl_grpo.loss.variants` the loss composes (``objective=``, ``corrections=``,
    ``penalties=``), whose math is the pure functions of :mod:`torchrl_grpo.loss_terms`; each
    term of the output is returned separately (:class:`GRPOLossOutput`), to be summed by the
    caller. The policy is a torchrl probabilistic actor (classic control ``[N]``, tokens
    ``[B, T]`` with a ``mask``, several heads) or a torchrl LLM wrapper (torchrl's LLM layout
    and ``masking_strategy``, as :class:`torchrl.objectives.llm.GRPOLoss`). Padding never enters
    the loss, the metrics or the gradient. The reference -- inputs and shapes, every variant
    with its paper, the flat keywords of earlier versions, degenerate cases -- is
    ``docs/loss.rst``.

    Keys (``set_keys``): ClipPPOLoss's ``advantage``, ``action`` and ``sample_log_prob`` (the
    policy the ratio is taken against; for an LLM wrapper torchrl's ``("tokens", "full")`` and
    ``("log_probs", "full")``), ``mask`` (real tokens; absent: every entry), and the entries the
    variants read: ``ref_log_prob`` (``KLToReference``; ``ref_log_probs`` is accepted),
    ``inference_log_prob`` (the sampler's: corrections, the veto and rejection, the KL to
    inference, OPSM), ``proximal_log_prob`` (``Decoupled``) and ``truncated``
    (``TruncatedCompletions``).

    Args:
        actor_network (ProbabilisticTensorDictSequential or LLMWrapperBase): the policy
            (``actor=``, ClipPPOLoss's other name for it, is accepted too). ``None``, as
            torchrl's GRPOLoss allows: a loss for its aggregation (``_aggregate_loss_value``),
            whose forward raises a ``RuntimeError`` saying it has no policy.
        *critic: nothing: GRPO has no critic (``TypeError`` saying where the advantage comes
            from).

    Keyword Args:
        clip_epsilon (float or tuple of float): ``eps`` or ``(eps_low, eps_high)``;
            ``eps_low = 1`` means no lower bound. Defaults to ``0.2``.
        entropy_bonus (bool), samples_mc_entropy (int), entropy_coeff (float): ClipPPOLoss's
            (``entropy_coeff`` defaults to ``0.01``).
        objective (Objective, str or callable): the surrogate: :class:`~torchrl_grpo.loss.
            variants.Clip` (``"clip"``, the default), ``CISPO``, ``SAPO``, ``VESPO``, a name of
            :data:`~torchrl_grpo.loss_terms.OBJECTIVES` or a callable.
        ratio_level (str or callable): ``"token"`` (default), ``"sequence"`` (GSPO) or
            ``"sequence_sum"`` (VESPO), or ``(log_ratio, mask) -> log_ratio``.
        aggregation (str or callable): a key of :data:`~torchrl_grpo.loss_terms.AGGREGATIONS`
            (torchrl's names accepted) or ``(loss, mask) -> scalar``. Defaults to
            ``"token_mean"``.
        max_length (int, optional): ``L_max`` of ``"seq_mean_token_sum_norm"`` (Dr. GRPO).
        corrections (sequence of Variant): tokens left out, zeroed or weighted (``KLMask``,
            ``TruncatedCompletions``, ``InferenceVeto``, ``Rejection``, ``Decoupled``,
            ``InferenceCorrection``, ``TIS``, ``OffPolicyMask``, ``TrustRegion``,
            ``TopEntropy``).
        penalties (sequence of Variant): ``KLToReference``, ``KLToInference``,
            ``EntropyTarget``.
        kl_to_ref_coeff, kl_to_inference_coeff, kl_mask_threshold (float, optional): torchrl's
            keywords, the same as ``KLToReference(c)``, ``KLToInference(c)``, ``KLMask(t)``.
        masking_strategy (str, optional): for LLM wrappers: ``"sft"`` (default), ``"rlhf"`` or
            ``"generic"``.
        ref_log_prob_padding_side (str), ref_log_prob_padding_value (float): of ragged
            reference log-probs, as torchrl. Default to ``"left"`` and ``0.0``.
        reduction (str, optional): ``"mean"`` (the aggregation) or ``"none"`` (per-token
            terms).
        functional (bool, optional): as ClipPPOLoss; ``False`` for LLM wrappers by default.
        device (torch.device, optional): of the buffers.
        **flat: the flat variant keywords of earlier versions (``tis_cap=``,
            ``decoupled=``...), mapped onto the objects with a ``DeprecationWarning``.

    Raises:
        ValueError: a setting out of its range or that does not fit the others (named, with
            the value), before anything is built; the same range when a scheduler sets a value.
        TypeError: a ClipPPOLoss or torchrl ``GRPOLoss`` argument that has no meaning here
            (the message names what replaces it), a critic, something that is not a variant in
            ``corrections`` / ``penalties``.

    Examples:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> from tensordict.nn import TensorDictModule
        >>> from torchrl.modules import ProbabilisticActor
        >>> from torchrl_grpo.loss.variants import TIS
        >>> _ = torch.manual_seed(0)
        >>> net = TensorDictModule(torch.nn.Linear(4, 2), ["observation"], ["logits"])
        >>> actor = ProbabilisticActor(net, in_keys=["logits"],
        ...     distribution_class=torch.distributions.Categorical, return_log_prob=True)
        >>> batch = actor(TensorDict({"observation": torch.randn(8, 4)}, [8])).detach()
        >>> batch["advantage"] = torch.randn(8, 1)
        >>> batch["inference_log_prob"] = batch["action_log_prob"]
        >>> loss = GRPOLoss(actor, clip_epsilon=0.2, corrections=[TIS(2.0)])
        >>> out = loss(batch)
        >>> out.total_loss().backward()
        >>> out.ESS, out.clip_fraction  # fresh samples: every ratio is 1
        (tensor(1.), tensor(0.))
        >>> loss.tis_cap = 1.5  # schedulable, as torchrl's clip_epsilon
    """

    @dataclass
    class _AcceptedKeys(ClipPPOLoss._AcceptedKeys):
        """Tensordict keys of :class:`GRPOLoss`, changed with ``set_keys(name=key)``.

        On top of ClipPPOLoss's keys (``advantage``, ``action``, ``sample_log_prob``...):

        Attributes:
            mask (NestedKey): boolean mask of real tokens, shaped like the log-prob. Optional:
                absent means every entry is real. Defaults to ``"mask"``.
            ref_log_prob (NestedKey): reference-policy log-probs of the sampled tokens, read
                with ``KLToReference``. Defaults to ``"ref_log_prob"``.
            inference_log_prob (NestedKey): sampler (inference engine) log-probs, read by
                ``InferenceCorrection`` / ``TIS``, ``InferenceVeto``, ``Rejection``,
                ``KLToInference`` and ``OffPolicyMask``. Defaults to ``"inference_log_prob"``.
            proximal_log_prob (NestedKey): log-probs of the proximal policy of decoupled PPO,
                read only with ``Decoupled``. Defaults to ``"proximal_log_prob"``.
            truncated (NestedKey): per-sequence boolean, ``True`` for a truncated completion,
                read only with ``TruncatedCompletions``. Defaults to ``"truncated"``.

        A variant of one's own reads any other entry under the key it names in its ``reads``.
        """

        mask: NestedKey = "mask"
        ref_log_prob: NestedKey = "ref_log_prob"
        inference_log_prob: NestedKey = "inference_log_prob"
        proximal_log_prob: NestedKey = "proximal_log_prob"
        truncated: NestedKey = "truncated"

    default_keys = _AcceptedKeys
    tensor_keys: _AcceptedKeys
    _schedulable_buffers = frozenset(COEFFICIENTS)
    #: What :meth:`forward` returns (a preset may name a subclass, as torchrl's do).
    output_type: type[GRPOLossOutput] = GRPOLossOutput

    def __init__(
        self,
        actor_network: ProbabilisticTensorDictSequential | LLMWrapperBase | None = None,
        *critic,
        clip_epsilon: float | tuple[float, float] = 0.2,
        entropy_bonus: bool = True,
        samples_mc_entropy: int = 1,
        entropy_coeff: float | None = None,
        objective: str | Callable | Objective = "clip",
        ratio_level: str | RatioLevel = "token",
        aggregation: str | Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = "token_mean",
        max_length: int | None = None,
        corrections: Sequence[Variant] = (),
        penalties: Sequence[Variant] = (),
        kl_to_ref_coeff: float | None = None,
        kl_to_inference_coeff: float | None = None,
        kl_mask_threshold: float | None = None,
        masking_strategy: str | None = None,
        ref_log_prob_padding_side: str = "left",
        ref_log_prob_padding_value: float = 0.0,
        reduction: str | None = None,
        functional: bool | None = None,
        device: torch.device | None = None,
        **replaced,
    ):
        settings = dict(locals())  # the keyword-only arguments above, by name
        for name in _NOT_SETTINGS:
            settings.pop(name, None)
        options = loss_options(actor_network, settings, replaced, critic)
        self._build(options)

    def _build(self, options: LossOptions) -> None:
        """ClipPPOLoss built with the options it takes, then the rest wired in."""
        actor = options.actor_network
        if actor is None:  # built as torchrl's is, for its aggregation helpers: no forward
            actor = _NoPolicy(type(self).__name__)
        super().__init__(
            actor,
            None,
            clip_epsilon=options.clip_epsilon,
            entropy_bonus=options.entropy_bonus,
            samples_mc_entropy=options.samples_mc_entropy,
            entropy_coeff=options.entropy_coeff,
            reduction=options.reduction,
            functional=options.functional,
            device=options.device,
        )
        self._wire(options)

    def _wire(self, options: LossOptions) -> None:
        """Set the variants and register their schedulable values as buffers."""
        if options.no_lower_bound:
            self.clip_epsilon_low.fill_(1.0)
        self.is_llm = options.is_llm
        self.masking_strategy = options.masking_strategy
        self.ref_log_prob_padding_side = options.ref_log_prob_padding_side
        self.ref_log_prob_padding_value = options.ref_log_prob_padding_value
        self.objective = options.objective
        self.variants = options.variants
        self._ranges = options.ranges  # the schedulable values' ranges, the variants held's
        self._stages = None
        self._ratio_level = options.ratio_level
        self._aggregate = options.aggregate
        self._summed = False  # inside summed(): the aggregation's sums, not its means
        device = self.entropy_coeff.device
        for name, value in options.coefficients.items():
            self.register_coeff_buffer(name, value, device=device)
        self.adaptive_entropy = None  # the entropy bonus's controller, with an EntropyTarget
        modules = {}
        for variant in self.variants:  # their state, saved with the loss's state_dict
            for name, module in variant.modules(device).items():
                setattr(self, name, module)
                modules[name] = module
        self._variant_modules = tuple(modules)
        if self.is_llm:  # torchrl's LLM layout (torchrl.objectives.llm.GRPOLoss's keys)
            self.set_keys(**LLM_KEYS)
        self._in_keys = None
        self._out_keys = None
        self._wired = True  # from now on, a variant left off stays off (see __setattr__)

    def _staged(self, stage: type[Variant]) -> tuple[Variant, ...]:
        """The variants held of one stage (``Exclusion``...), in the order given."""
        if self.__dict__.get("_stages") is None:  # once: a call asks three times
            self._stages = {
                base: tuple(v for v in self.variants if isinstance(v, base))
                for base in (Exclusion, Factor, Penalty)
            }
        return self._stages[stage]

    def _composed(self) -> tuple[Variant, ...]:
        """The objective and the variants held (none while ClipPPOLoss's ``__init__`` runs)."""
        if not self.__dict__.get("_wired"):
            return ()
        return (self.objective, *self.variants)

    def _step(self, x: Inputs, ratio_base: torch.Tensor) -> Step:
        """The call's :class:`~torchrl_grpo.loss.variants.Step`: the batch, and the variants'
        schedulable values and state as they are now."""
        buffers = self._buffers  # a value no variant held has is None, not a buffer
        values = {name: buffers.get(name) for name in self._ranges}
        modules = {name: getattr(self, name) for name in self._variant_modules}
        return Step(x, ratio_base, values=values, modules=modules, loss_mask=x.mask)

    @property
    def clip_bounds(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(log(1 - eps_low), log(1 + eps_high))``, read from the schedulable buffers."""
        buffers = dict(self.named_buffers(recurse=False))
        low = buffers.get("clip_epsilon_low", buffers.get("clip_epsilon"))
        high = buffers.get("clip_epsilon_high", buffers.get("clip_epsilon"))
        return (-low).log1p(), high.log1p()

    # --- keys -----------------------------------------------------------------------------

    def __setattr__(self, name: str, value) -> None:
        # a scheduler's new value (``loss.clip_epsilon = 0.1``) is checked as at construction,
        # against the ranges of the variants this loss holds (and of the package's own)
        ranges = self.__dict__.get("_ranges", _BUILTIN_RANGES)
        number = isinstance(value, (int, float))
        if number and (name in CLIP_EPSILON_BUFFERS or name in ranges):
            check_scheduled(name, value, ranges)
        # a variant left off at construction is not a buffer: setting it would skip every
        # check of loss_options (an objective it cannot go with...) and the read plan's keys
        if name in ranges and value is not None and self.__dict__.get("_wired"):
            buffer = self._buffers.get(name)
            if buffer is None:
                raise ValueError(_off_message(name, type(self).__name__))
            if number:  # in place, keeping the buffer's device and dtype (torchrl's way)
                buffer.copy_(torch.as_tensor(value, dtype=buffer.dtype, device=buffer.device))
                return
        super().__setattr__(name, value)

    def set_keys(self, **kwargs) -> None:
        """Change tensordict keys, as ClipPPOLoss's ``set_keys``.

        ``ref_log_probs`` (torchrl's ``GRPOLoss`` name) is accepted for ``ref_log_prob``.

        Raises:
            ValueError: for a key of ClipPPOLoss that nothing here reads (``value``,
                ``value_target``: there is no critic; ``reward``, ``done``, ``terminated``: no
                value estimator), before any key changes; or an unknown key (torchrl's).
        """
        for name in kwargs:
            if name in UNUSED_KEYS:
                raise ValueError(
                    f"{type(self).__name__} reads no {name!r} key: {UNUSED_KEYS[name]}."
                )
        if "ref_log_probs" in kwargs:
            kwargs["ref_log_prob"] = kwargs.pop("ref_log_probs")
        return super().set_keys(**kwargs)

    def _set_in_keys(self):
        # ClipPPOLoss's __init__ calls this before the variants are set
        tk = self.tensor_keys
        keys = [*self.actor_network.in_keys]
        for key in (tk.action, tk.sample_log_prob):  # a list for a multi-head policy
            keys.extend(key if isinstance(key, list) else [key])
        keys += [tk.advantage, tk.mask]
        # what the variants read (not the entries sample_log_prob may stand in for)
        reads = {r for v in self._composed() if not v.fallback for r in v.reads}
        keys += [getattr(tk, name) for name in _READS if name in reads]
        keys += [key for _, key, _ in self._entries()]
        self._in_keys = list(dict.fromkeys(keys))

    def _entries(self) -> tuple[tuple, ...]:
        """``(name, key, why)`` of each entry a variant reads beyond :data:`_READS`: a name of
        the loss's keys is read under its key (``set_keys``), any other under itself."""
        fields = self.tensor_keys.__dataclass_fields__
        entries = {}
        for variant in self._composed():
            for name in variant.reads:
                if name not in _READS and name not in entries:
                    key = getattr(self.tensor_keys, name) if name in fields else name
                    entries[name] = (name, key, f"read by {type(variant).__name__}")
        return tuple(entries.values())

    @property
    def out_keys(self):
        if self._out_keys is None:
            self._out_keys = _output_keys(self)
        return self._out_keys

    @out_keys.setter
    def out_keys(self, values):
        self._out_keys = values

    def make_value_estimator(self, value_type=None, **hyperparams):
        """GRPO has no critic: the advantage comes with the batch (e.g. from ``MCAdvantage``).

        Raises:
            NotImplementedError: always.
        """
        raise NotImplementedError(
            f"{type(self).__name__} has no critic and no value estimator (GAE, TD(lambda)...): "
            f"the advantage comes with the batch, under {self.tensor_keys.advantage!r}; "
            "torchrl_grpo.MCAdvantage writes it in the replay buffer."
        )

    # --- exact normalization across micro-batches and ranks --------------------------------------

    @contextlib.contextmanager
    def summed(self):
        """Inside, the loss terms are the aggregation's *sums*, and each output has their count.

        With gradient accumulation (``K`` micro-batches) or data parallelism (``R`` ranks), the
        mean of per-micro-batch means is not the whole batch's mean: a token of a short
        micro-batch weighs more (TRL issues 3021 and 5619). Inside ``summed()``, every loss
        term is ``S`` of :func:`~torchrl_grpo.loss_terms.aggregation_sum` (the aggregation
        is ``S / N``) and the output's ``normalization_count`` is ``N``; add up the counts of
        every micro-batch (and ``all_reduce`` them across ranks), then divide the gradients by
        the total with :meth:`normalize_gradients`: they are the whole batch's gradients, for
        every built-in aggregation. The metrics stay per-call means.

        Raises:
            ValueError: with a callable ``aggregation`` (its sum is unknown) or
                ``reduction="none"``.

        Examples:
            >>> import torch
            >>> from tensordict import TensorDict
            >>> from tensordict.nn import TensorDictModule
            >>> from torchrl.modules import ProbabilisticActor
            >>> from torchrl_grpo import GRPOLoss
            >>> net = TensorDictModule(torch.nn.Linear(3, 5), ["hidden"], ["logits"])
            >>> policy = ProbabilisticActor(net, in_keys=["logits"], out_keys=["action"],
            ...     distribution_class=torch.distributions.Categorical, return_log_prob=True)
            >>> batch = TensorDict(hidden=torch.randn(8, 3), advantage=torch.randn(8),
            ...     action=torch.randint(5, (8,)), action_log_prob=-torch.rand(8),
            ...     batch_size=[8])
            >>> loss = GRPOLoss(policy, entropy_coeff=0.0)
            >>> count = 0
            >>> with loss.summed():
            ...     for micro_batch in batch.split(3):  # 3 + 3 + 2 steps
            ...         out = loss(micro_batch)
            ...         out.total_loss().backward()
            ...         count += out.normalization_count
            >>> loss.normalize_gradients(policy.parameters(), count)
            >>> accumulated = net.module.weight.grad.clone()
            >>> net.zero_grad()
            >>> loss(batch).total_loss().backward()  # the whole batch at once
            >>> torch.allclose(accumulated, net.module.weight.grad, atol=1e-7)
            True
        """
        # raises now, not at the first call, for an aggregation whose sum is unknown
        aggregation_sum(self._aggregate, torch.zeros(1, 1), torch.ones(1, 1, dtype=torch.bool))
        if self.reduction == "none":
            raise ValueError("summed() sums the aggregation; reduction='none' has none.")
        self._summed = True
        try:
            yield self
        finally:
            self._summed = False

    @staticmethod
    def normalize_gradients(parameters, count, *, ranks: int = 1) -> None:
        """Divide the accumulated gradients of :meth:`summed` calls by the batch's count.

        Args:
            parameters: the parameters whose ``.grad`` to scale (``model.parameters()``).
            count (int or torch.Tensor): the sum of the ``normalization_count`` of every
                micro-batch of every rank (``torch.distributed.all_reduce`` them first).
            ranks (int, optional): how many ranks average their gradients: with
                ``DistributedDataParallel`` (which divides the summed gradients by the world
                size), the world size, so that the sum of every rank's is kept. Defaults to 1.

        Raises:
            ValueError: if ``count`` is not positive (no real token in the whole batch).
        """
        count = float(count)
        if count <= 0:
            raise ValueError(
                f"normalize_gradients: count must be positive, got {count}: no token of the "
                "whole step is in the loss (every one padding, or left out by the KL mask, "
                "truncation or the veto)."
            )
        for parameter in parameters:
            if parameter.grad is not None:
                parameter.grad.mul_(ranks / count)

    # --- forward: read -> terms -> output ---------------------------------------------------------

    def forward(self, tensordict: TensorDictBase) -> GRPOLossOutput:
        """Compute the loss terms and metrics of a batch.

        Args:
            tensordict (TensorDictBase): the batch; see the class docstring for the entries.

        Returns:
            GRPOLossOutput: the ``loss_*`` terms to sum and the metrics.

        Raises:
            KeyError: a required entry is missing (the key is named).
            RuntimeError: a stored log-prob or advantage requires grad.
            ValueError: an entry's shape does not match the policy's log-prob, a stored entry
                (the advantage, the sampling, reference, inference or proximal log-probs) is
                not finite on a real token (its key is named; padding may hold anything), or
                the batch has no real token.
        """
        tensordict = tensordict.copy()  # the policy writes into it; leave the input as is
        plan = self._read_plan()
        stored = read_stored(tensordict, plan)  # before the policy writes into the batch
        dist = self._distribution(tensordict)
        read = read_llm if self.is_llm else read_actor
        inputs = read(tensordict, dist, stored, plan)
        out = self._terms(inputs)
        if torch.compiler.is_compiling():
            tensordict.clear_refs_for_compile_()
        # a variant of the user's may report entries no built-in output names
        return output_with(self.output_type, tuple(out))(**out, batch_size=[])

    # --- read: what this call reads, and the policy's distribution over the batch -------------

    def _read_plan(self) -> ReadPlan:
        """What this call reads from its batch: the keys, and the entries its variants need."""
        readers = [v for v in self._composed() if "inference_log_prob" in v.reads]
        reads = {name for v in self._composed() for name in v.reads}
        end_tokens = ()  # TRL's rule for an LLM wrapper's batch without a truncated entry
        tokenizer = getattr(self.actor_network, "tokenizer", None) if self.is_llm else None
        if self.is_llm and "truncated" in reads:
            end_tokens = tokenizer_end_tokens(tokenizer)
        return ReadPlan(
            owner=type(self).__name__,
            keys=self.tensor_keys,
            loss_mask_key=self.loss_mask_key,
            padded=self.is_llm,
            masking_strategy=self.masking_strategy,
            ref_padding=(self.ref_log_prob_padding_side, self.ref_log_prob_padding_value),
            ref="ref_log_prob" in reads,
            inference=f"for {type(readers[0]).__name__}" if readers else None,
            inference_fallback=bool(readers) and all(v.fallback for v in readers),
            proximal="proximal_log_prob" in reads,
            truncated="truncated" in reads,
            end_tokens=end_tokens,
            pad_token_id=getattr(tokenizer, "pad_token_id", None),
            pad_output=bool(getattr(self.actor_network, "pad_output", True)),
            entropy=bool(self.entropy_bonus) or any(v.entropy for v in self._composed()),
            samples_mc_entropy=self.samples_mc_entropy,
            entries=self._entries(),
        )

    def _distribution(self, tensordict: TensorDictBase):
        """The policy's distribution over the batch, computed with the loss's parameters."""
        with self._policy_params():
            if self.is_llm:
                return llm_masked_dist(self.actor_network, tensordict, self.masking_strategy)
            return self.actor_network.get_dist(tensordict)

    def _policy_params(self):
        """The context in which the policy runs with the loss's parameters."""
        if self.functional:
            return self.actor_network_params.to_module(
                self.actor_network, preserve_module_state=False
            )
        return contextlib.nullcontext()

    # --- terms: the math of loss_terms on the lined-up batch ------------------------------------

    def _terms(self, x: Inputs) -> dict[str, torch.Tensor]:
        """The loss terms and metrics of a lined-up batch: the variants' stages in order."""
        mask, lp = x.mask, x.log_prob
        # the policy the ratio and its clip are taken against: the proximal one (decoupled PPO)
        # or the one that sampled the data
        ratio_base = x.old_log_prob if x.proximal_log_prob is None else x.proximal_log_prob
        step = self._step(x, ratio_base)
        out = {}
        excluded = False
        for variant in self._staged(Exclusion):  # out of the terms and the denominator
            keep, metrics = variant.exclude(step)
            step.loss_mask = step.loss_mask & keep
            out.update(metrics)
            excluded = True
        # nothing excluded: the mask holds a real token (the read checked it), no host read
        reduce = functools.partial(
            self._reduce, loss_mask=step.loss_mask, shape=x.shape, nonempty=not excluded
        )
        log_clip_low, log_clip_high = step.log_clip_bounds = self.clip_bounds
        log_ratio = self._ratio_level(lp - ratio_base, mask)  # (B, T)
        per_token = self.objective.loss(step, log_ratio)
        out.update(self.objective.report(step))
        per_token = self._factors(per_token, step, out)
        clip_fraction, clip_low, clip_high = clip_fractions(
            log_ratio, mask, log_clip_low, log_clip_high
        )
        out.update(
            loss_objective=reduce(per_token),
            clip_fraction=clip_fraction,
            clip_fraction_low=clip_low,
            clip_fraction_high=clip_high,
            kl_approx=masked_mean(ratio_base - lp, mask).detach(),
            **_ratio_metrics(log_ratio, mask),
        )
        if x.inference_log_prob is not None:  # how far the sampler is from the trainer
            stats = inference_mismatch(x.old_log_prob - x.inference_log_prob, mask)
            ppl = perplexity_metrics(x.old_log_prob, x.inference_log_prob, mask)
            stats.update({name: ppl[name] for name in _PERPLEXITIES})
            out.update({f"inference_{name}": value for name, value in stats.items()})
        if self._summed:  # what the sums are to be divided by, over the whole batch
            count = aggregation_sum(self._aggregate, lp.detach(), step.loss_mask)[1]
            out["normalization_count"] = count
        return {**out, **self._regularisers(step, reduce)}

    def _factors(self, per_token: torch.Tensor, step: Step, out: dict) -> torch.Tensor:
        """The per-token objective times the :class:`Factor` variants' weights, zero where one
        drops the token (it stays in the aggregation's denominator). With none held, the
        objective as it is: the default loss runs no extra operation."""
        weight = keep = None
        for variant in self._staged(Factor):
            w, k, metrics = variant.factor(step)
            out.update(metrics)
            if w is not None:
                weight = w if weight is None else weight * w
            if k is not None:
                keep = k if keep is None else keep & k
        if weight is not None:
            per_token = per_token * weight
        if keep is not None:
            per_token = torch.where(keep, per_token, 0.0)
        return per_token

    def _reduce(
        self, per_token, loss_mask: torch.Tensor, shape: torch.Size, nonempty: bool = False
    ) -> torch.Tensor:
        """``(B, T)`` -> a scalar by the aggregation, or the per-token tensor (``"none"``);
        ``nonempty``: ``loss_mask`` is known to hold a real token (not read again)."""
        if self.reduction == "none":
            return torch.where(loss_mask, per_token, 0.0).reshape(shape)
        if not nonempty and not loss_mask.any():  # every token excluded: no gradient
            return (per_token * 0.0).sum()
        if self._summed:
            return aggregation_sum(self._aggregate, per_token, loss_mask)[0]
        return self._aggregate(per_token, loss_mask)

    def _aggregate_loss_value(
        self, value: torch.Tensor, mask: torch.Tensor, tensordict: TensorDictBase | None = None
    ) -> torch.Tensor:
        """torchrl's aggregation helper, under its name (torchrl's own tests call it): a
        per-token ``value`` ``[..., T, 1]`` (or ``[..., T]``) over ``mask`` ``[..., T]``, by this
        loss's aggregation (``reduction="none"``: zero off the mask, in ``value``'s shape)."""
        per_token = value.squeeze(-1) if value.dim() == mask.dim() + 1 else value
        return self._reduce(per_token, mask, value.shape)

    def _regularisers(self, step: Step, reduce: Callable) -> dict[str, torch.Tensor]:
        """The entropy bonus (its coefficient steered by the penalties'
        :meth:`~torchrl_grpo.loss.variants.Penalty.coefficient`, reported when one changes it:
        :class:`~torchrl_grpo.loss.variants.EntropyTarget`) and the penalties' terms."""
        x, out = step.x, {}
        penalties = self._staged(Penalty)
        if self.entropy_bonus:
            out["entropy"] = masked_mean(x.entropy, x.mask).detach()
            coeff = self.entropy_coeff
            for variant in penalties:
                coeff = variant.coefficient(step, coeff)
            if coeff is not self.entropy_coeff:
                out["entropy_coeff"] = coeff
            out["loss_entropy"] = -coeff * reduce(x.entropy)
            if x.head_entropy is not None:  # a multi-head policy's, as ClipPPOLoss reports it
                out["composite_entropy"] = x.head_entropy.detach()
        for variant in penalties:
            out.update(variant.terms(step, reduce))
        return out

    def update_entropy_coeff(self) -> float:
        """Move the adaptive entropy coefficient once, toward the target (call once per step).

        The entropy of the tokens seen since the last update (every call in training mode,
        micro-batches included) decides: the coefficient goes up by the step when it is at or
        below the :class:`~torchrl_grpo.loss.variants.EntropyTarget`'s ``target``, down
        otherwise, within its ``bounds``
        (:func:`~torchrl_grpo.loss_terms.adaptive_entropy_coeff`); the next calls apply it
        while that entropy stays at or below the target. With several ranks, sum the window
        first: ``torch.distributed.all_reduce(loss.adaptive_entropy.window)``. The window, the
        last entropy and the coefficient are buffers, saved with the loss's ``state_dict``
        (:class:`~torchrl_grpo.loss.entropy.AdaptiveEntropy`).

        Returns:
            float: the new coefficient (also in ``loss.entropy_coeff``).

        Raises:
            RuntimeError: without an ``EntropyTarget``, or with no token seen since the last
                update.
        """
        if self.adaptive_entropy is None:
            raise RuntimeError(
                "update_entropy_coeff needs GRPOLoss(..., penalties=[EntropyTarget(target)]), "
                "the adaptive entropy coefficient."
            )
        coeff = self.adaptive_entropy.update(float(self.entropy_coeff))
        self.entropy_coeff.fill_(coeff)
        return coeff


class _NoPolicy(TensorDictModuleBase):
    """The policy of a loss built without one (``actor_network=None``, as torchrl's GRPOLoss
    allows for its aggregation helpers): anything that needs the policy says so."""

    in_keys: list = []
    out_keys: list = []

    def __init__(self, owner: str):
        super().__init__()
        self.owner = owner

    def forward(self, tensordict: TensorDictBase):
        raise RuntimeError(
            f"{self.owner} was built without a policy (actor_network=None): it aggregates "
            f"values but cannot compute a loss; pass the policy: {self.owner}(actor_network, ...)."
        )

    get_dist = forward


def _off_message(name: str, owner: str) -> str:
    """Why ``loss.<name> = value`` is refused: the variant it belongs to was not held."""
    held_by = [cls.__name__ for cls in BUILTIN_VARIANTS if name in cls.ranges]
    variant = f"a {' or '.join(held_by)}" if held_by else "the variant it belongs to"
    return (
        f"{name} was off (None) when the loss was built: build the {owner} with {variant} "
        "(objective=, corrections= or penalties=) to schedule it."
    )


def _output_keys(loss: GRPOLoss) -> list[str]:
    """The entries ``loss``'s output holds with its variants (its ``out_keys``)."""
    keys = [
        "loss_objective",
        "clip_fraction",
        "clip_fraction_low",
        "clip_fraction_high",
        "kl_approx",
        "ESS",
        "max_ratio",
        "mean_ratio",
    ]
    if loss.entropy_bonus:
        keys += ["entropy", "loss_entropy"]
    if loss._read_plan().inference is not None:
        keys += [f"inference_{name}" for name in (*_MISMATCH_STATS, *_PERPLEXITIES)]
    for variant in (loss.objective, *loss.variants):
        keys += [key for key in variant.metrics() if key not in keys]
    return keys


def _ratio_metrics(log_ratio: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """ClipPPOLoss's diagnostics of the importance ratios ``(B, T)``, over the real tokens: the
    normalised ESS, the largest ratio and the mean one (detached)."""
    with torch.no_grad():
        ratio = log_ratio.exp()  # (B, T); at least one real token, every ratio > 0
        return {
            "ESS": effective_sample_size(log_ratio, mask),
            "max_ratio": torch.where(mask, ratio, 0.0).amax(),
            "mean_ratio": masked_mean(ratio, mask),
        }

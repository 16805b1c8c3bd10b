"""Group-relative advantage estimators: pure functions on tensors.

Nothing here knows about TensorDicts, queues or keys. Samples (trajectory returns, or the reward
elements of every step) arrive as a flat tensor ``x`` of shape ``(S,)`` together with an integer
``group_index`` of shape ``(S,)`` naming the group of each sample, or, when the samples come in
contiguous runs that each belong to one group (a trajectory's reward elements), with the runs'
``lengths`` and one group per run (:class:`Segments`). Every reduction is a segment reduction, so
a whole batch of groups is one pass.

The package, one concern a module: ``returns`` (trajectory returns, group means, batch
whitening), ``group_relative`` (GRPO's advantage, its baselines and scales, the group std),
``estimators`` (REINFORCE++-baseline, pass@k, GDPO), ``step_groups`` (GiGPO) and
``distillation`` (on-policy distillation: a teacher's per-token reverse KL as the advantage).
Every public name is imported here: import them from ``torchrl_grpo.advantages``.

Degenerate cases, decided once for the whole package:

* Standard deviations use Bessel's correction (``n - 1``), as ``torch.std`` and torchrl do.
* A group with a single sample has no spread: its standard deviation is taken as ``0`` (torchrl
  computes ``nan`` there) and its advantage is therefore ``0``.
* The scale is floored at ``epsilon`` (default ``1e-6``, torchrl's ``clamp_min``), never added to
  it, so a constant-reward group gets exactly zero advantages and never ``nan``.
* Arithmetic is done in float64 whatever the reward dtype (float16 and bfloat16 included), so very
  large or very small rewards neither overflow nor underflow the variance; callers cast back.

And for the estimators beyond GRPO's mean and std:

* **Whitening** over a batch (REINFORCE++-baseline, GDPO's last step) follows the same rules: the
  batch std has Bessel's correction, a batch of one sample has std ``0``, and the std is floored at
  ``epsilon``; so a batch whose centred values are all equal whitens to exactly zero. verl and
  OpenRLHF add ``1e-8`` to the variance and TRL ``1e-4`` to the std instead: the results agree to
  about that constant over the std.
* **Pass@k** needs a runner-up: a group of one sample gets ``0`` (verl raises), and a tie for the
  best gives every member ``0``: the best minus the best of the others is then ``0`` for each of
  the tied samples, as in verl, where ``topk`` picks one of them and gives it ``r_max -
  r_second_max = 0``.
* **Several rewards** (GDPO) are normalized one at a time by the rules above; a reward that is
  constant within a group contributes ``0`` to that group, never ``nan``.
* **Step groups** (GiGPO) of one step have no peer: their step-level advantage is ``0``, as in
  verl-agent and ROLL.
* **Distillation**'s per-token reverse KL is Schulman's k1, never clamped; a sequence without a
  real token sums to ``0``, and its metrics follow the rules above (Bessel, ``0`` for one sample).
"""

from torchrl_grpo._segments import Segments
from torchrl_grpo.advantages.distillation import (
    distillation_advantage,
    distillation_metrics,
    future_reverse_kl,
    group_mean_baseline,
    token_reverse_kl,
)
from torchrl_grpo.advantages.estimators import (
    multi_reward_advantage,
    pass_at_k_advantage,
    reinforce_pp_baseline_advantage,
)
from torchrl_grpo.advantages.group_relative import (
    BASELINES,
    SCALES,
    Scale,
    group_relative_advantage,
    group_std,
)
from torchrl_grpo.advantages.returns import (
    RETURN_REDUCTIONS,
    batch_whiten,
    group_mean,
    trajectory_returns,
)
from torchrl_grpo.advantages.step_groups import (
    anchor_step_groups,
    discounted_returns,
    gigpo_advantage,
    step_level_advantage,
)

__all__ = [
    "BASELINES",
    "RETURN_REDUCTIONS",
    "SCALES",
    "Scale",
    "Segments",
    "anchor_step_groups",
    "batch_whiten",
    "discounted_returns",
    "distillation_advantage",
    "distillation_metrics",
    "group_mean_baseline",
    "future_reverse_kl",
    "gigpo_advantage",
    "group_mean",
    "group_relative_advantage",
    "group_std",
    "multi_reward_advantage",
    "pass_at_k_advantage",
    "reinforce_pp_baseline_advantage",
    "step_level_advantage",
    "token_reverse_kl",
    "trajectory_returns",
]

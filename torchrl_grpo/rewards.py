"""Reward shaping for GRPO: DAPO's soft overlong penalty, a pure function and a torchrl transform.

DAPO (Yu et al., 2025, "DAPO: An Open-Source LLM Reinforcement Learning System at Scale",
arXiv:2503.14476, Sec. 3.4, Eq. 13) punishes responses that run into the generation budget with
a penalty that grows linearly over the last ``L_cache`` tokens, instead of the hard -1 of a
truncated answer, which is noise for a response whose reasoning was right:

.. math::

    R_{length}(y) = \\begin{cases}
        0, & |y| \\le L_{max} - L_{cache} \\\\
        \\dfrac{(L_{max} - L_{cache}) - |y|}{L_{cache}},
            & L_{max} - L_{cache} < |y| \\le L_{max} \\\\
        -1, & L_{max} < |y|
    \\end{cases}

added to the task reward. DAPO uses ``L_max = 20480`` and ``L_cache = 4096`` (16384 tokens
expected, 4096 of soft buffer). verl's and AReaL's implementations scale it by an
``overlong_penalty_factor`` (``penalty_factor`` here, ``1.0`` by default: the paper's).

:func:`overlong_penalty` is the math; :class:`OverlongPenalty` adds it to the reward of a batch,
either as an environment transform (after the transform that writes the reward) or as a
replay-buffer transform, before :class:`~torchrl_grpo.MCAdvantage` computes the advantages.
"""

from __future__ import annotations

import torch
from tensordict import LazyStackedTensorDict, TensorDictBase
from tensordict.utils import NestedKey
from torchrl.envs import Transform

__all__ = ["OverlongPenalty", "overlong_penalty"]


def overlong_penalty(
    length: torch.Tensor, max_length: int, cache_length: int, penalty_factor: float = 1.0
) -> torch.Tensor:
    """DAPO's soft overlong punishment (Eq. 13), times ``penalty_factor``.

    Args:
        length (torch.Tensor): response lengths ``|y|`` in tokens, any shape.
        max_length (int): ``L_max``, the generation budget.
        cache_length (int): ``L_cache``, the soft buffer at its end (``0 < L_cache <= L_max``).
        penalty_factor (float): scale of the penalty. Defaults to ``1.0`` (the paper's).

    Returns:
        torch.Tensor: the penalty, ``<= 0``, float, the shape of ``length``.

    Raises:
        ValueError: if ``cache_length`` is not in ``(0, max_length]``.

    Examples:
        >>> import torch
        >>> overlong_penalty(torch.tensor([10, 16, 18, 20, 25]), max_length=20, cache_length=4)
        tensor([ 0.0000,  0.0000, -0.5000, -1.0000, -1.0000])
    """
    if not 0 < cache_length <= max_length:
        raise ValueError(
            f"cache_length must be in (0, max_length={max_length}], got {cache_length}."
        )
    expected = max_length - cache_length  # L_max - L_cache
    length = torch.as_tensor(length)
    penalty = ((expected - length) / cache_length).clamp(-1.0, 0.0)  # 0 .. -1 over the buffer
    return penalty_factor * penalty


class OverlongPenalty(Transform):
    """Adds DAPO's soft overlong penalty to the reward (a torchrl ``Transform``).

    The response length is the number of tokens of ``response_key`` (torchrl's LLM layout:
    ``("tokens", "response")``, ragged lazy stacks included), or the integers under
    ``length_key`` when given. The penalty :func:`overlong_penalty` is added to ``reward_key``.

    Two places to put it, never both (the penalty would be added twice):

    * **an environment transform** on an LLM environment, appended *after* the transform that
      writes the reward: at each step it reads the response from the step's input and adds the
      penalty to the ``reward`` of the step's output (``_step``);
    * **a replay-buffer transform**: ``rb.extend`` calls every transform's inverse, *last
      appended first* (torchrl's ``Compose`` runs inverses in reverse), so append it *after*
      :class:`~torchrl_grpo.MCAdvantage` for the penalty to be in the reward the advantages
      are computed from. It then reads ``("next", reward_key)``. Sampling leaves data as is.

    Args:
        max_length (int): ``L_max``, the generation budget (DAPO: 20480).
        cache_length (int): ``L_cache``, the soft buffer (DAPO: 4096).

    Keyword Args:
        penalty_factor (float): scale of the penalty. Defaults to ``1.0``.
        response_key (NestedKey): the response tokens. Defaults to ``("tokens", "response")``.
        length_key (NestedKey, optional): per-sequence lengths to read instead of counting
            ``response_key``'s tokens (for padded dense responses, count the real tokens and
            store them here). Defaults to ``None``.
        reward_key (NestedKey): the reward, in the step's output (``("next", reward_key)`` in a
            replay-buffer batch). Defaults to ``"reward"``.

    Examples:
        As a replay-buffer transform, before the advantages (appended after
        :class:`~torchrl_grpo.MCAdvantage`):

        >>> import torch
        >>> from tensordict import TensorDict, lazy_stack
        >>> from torchrl.data import LazyStackStorage, ReplayBuffer
        >>> from torchrl_grpo import MCAdvantage, OverlongPenalty
        >>> steps = [TensorDict({
        ...     "prompt": torch.tensor(0), "tokens": TensorDict(response=torch.zeros(n)),
        ...     "next": TensorDict(
        ...         reward=torch.ones(1, 1), done=torch.ones(1, 1, dtype=torch.bool))})
        ...     for n in (10, 18)]
        >>> rb = ReplayBuffer(storage=LazyStackStorage(10))
        >>> _ = rb.append_transform(MCAdvantage(grpo_size=2, prompt_key="prompt"))
        >>> _ = rb.append_transform(OverlongPenalty(max_length=20, cache_length=4))
        >>> _ = rb.extend(lazy_stack(steps))
        >>> rb[:]["next", "reward"].flatten().tolist()  # 1 + 0, 1 - (18 - 16) / 4
        [1.0, 0.5]
        >>> rb[:]["advantage"].flatten().tolist()
        [0.7071067690849304, -0.7071067690849304]
    """

    def __init__(
        self,
        max_length: int,
        cache_length: int,
        *,
        penalty_factor: float = 1.0,
        response_key: NestedKey = ("tokens", "response"),
        length_key: NestedKey | None = None,
        reward_key: NestedKey = "reward",
    ):
        overlong_penalty(torch.zeros(()), max_length, cache_length)  # validates the lengths
        super().__init__(in_keys=[], out_keys=[])
        self.max_length = int(max_length)
        self.cache_length = int(cache_length)
        self.penalty_factor = float(penalty_factor)
        self.response_key = response_key
        self.length_key = length_key
        self.reward_key = reward_key

    def _lengths(self, tensordict: TensorDictBase) -> torch.Tensor:
        """Response lengths, shaped like the batch."""
        batch_size = tensordict.batch_size
        if self.length_key is not None:
            return tensordict.get(self.length_key).reshape(batch_size)
        if isinstance(tensordict, LazyStackedTensorDict) and tensordict.batch_dims:
            responses = tensordict.get(self.response_key, as_list=True)  # ragged
            return torch.tensor([r.shape[-1] for r in responses]).reshape(batch_size)
        response = tensordict.get(self.response_key)  # dense: batch_size + (T,)
        return torch.full(batch_size, response.shape[-1])

    def _add_penalty(self, lengths: torch.Tensor, holder: TensorDictBase, key) -> None:
        reward = holder.get(key)
        penalty = overlong_penalty(lengths, self.max_length, self.cache_length, self.penalty_factor)
        penalty = penalty.to(reward.dtype).to(reward.device)
        extra = reward.ndim - penalty.ndim  # trailing reward dims, e.g. [B, 1, 1]
        holder.set(key, reward + penalty.reshape(penalty.shape + (1,) * extra))

    def _step(self, tensordict: TensorDictBase, next_tensordict: TensorDictBase):
        # environment: the response is in the step's input, the reward in its output
        self._add_penalty(self._lengths(tensordict), next_tensordict, self.reward_key)
        return next_tensordict

    def _inv_call(self, tensordict: TensorDictBase) -> TensorDictBase:
        if self.parent is not None:  # in an environment: the step's input; see _step
            return tensordict
        # replay buffer: a batch of steps, each with its ("next", reward)
        key = (
            "next",
            *((self.reward_key,) if isinstance(self.reward_key, str) else self.reward_key),
        )
        self._add_penalty(self._lengths(tensordict), tensordict, key)
        return tensordict

    def forward(self, tensordict: TensorDictBase) -> TensorDictBase:
        """Identity: the penalty is added when data is written (``extend``) or stepped."""
        return tensordict

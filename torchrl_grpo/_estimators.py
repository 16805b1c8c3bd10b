"""The inputs of the estimators beyond one reward, for ``MCAdvantage``: plumbing, no math.

GDPO reads several reward keys and GiGPO an anchor state per step. This module reads and checks
them (at insertion, so that a bad input raises before any state changes), fetches them from the
released steps, and turns them into the tensors that :mod:`torchrl_grpo.advantages` takes.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import NamedTuple

import torch
from tensordict import NestedKey, TensorDictBase
from torch import Tensor

from torchrl_grpo.advantages import anchor_step_groups, step_level_advantage

DEFAULT_REWARDS_KEY = ("next", "reward")


class Estimators(NamedTuple):
    """``MCAdvantage``'s keywords for the estimators beyond torchrl's (see its docstring)."""

    reward_weights: tuple[tuple[NestedKey, float], ...]  # (): the one reward key
    whiten: bool
    anchor_key: NestedKey | None  # None: no step-level groups
    episode_reward_weight: float
    step_reward_weight: float
    step_reward_gamma: float

    @property
    def reward_keys(self) -> list[NestedKey]:
        return [key for key, _ in self.reward_weights]


def settings(
    rewards_key: NestedKey,
    reward_weights: Mapping[NestedKey, float] | None,
    whiten: bool | None,
    anchor_key: NestedKey | None,
    episode_reward_weight: float | None,
    step_reward_weight: float | None,
    step_reward_gamma: float | None,
) -> Estimators:
    """Check the keywords and fill in their defaults.

    Raises:
        ValueError: for an empty or non-finite ``reward_weights``, a ``rewards_key`` that
            ``reward_weights`` leaves out, step-level weights without ``anchor_key``, or a
            ``step_reward_gamma`` outside ``[0, 1]``.
    """
    weights: tuple[tuple[NestedKey, float], ...] = ()
    if reward_weights is not None:
        if not isinstance(reward_weights, Mapping) or not reward_weights:
            raise ValueError(
                "reward_weights must be a non-empty mapping {reward key: weight}, got "
                f"{reward_weights!r}."
            )
        weights = tuple((key, float(w)) for key, w in reward_weights.items())
        bad = [key for key, w in weights if not math.isfinite(w)]
        if bad:
            raise ValueError(f"reward_weights must be finite, got {reward_weights!r}.")
        if rewards_key != DEFAULT_REWARDS_KEY and rewards_key not in dict(weights):
            raise ValueError(
                f"rewards_key={rewards_key!r} is not a key of reward_weights "
                f"({list(dict(weights))}): with several rewards, name them all in reward_weights."
            )
    step_settings = {
        "episode_reward_weight": episode_reward_weight,
        "step_reward_weight": step_reward_weight,
        "step_reward_gamma": step_reward_gamma,
    }
    if anchor_key is None:
        given = [name for name, value in step_settings.items() if value is not None]
        if given:
            raise ValueError(
                f"{', '.join(given)} weigh GiGPO's step-level groups, which need anchor_key (the "
                "key of each step's anchor state)."
            )
    gamma = 0.95 if step_reward_gamma is None else float(step_reward_gamma)
    if not 0.0 <= gamma <= 1.0:
        raise ValueError(f"step_reward_gamma must be in [0, 1], got {step_reward_gamma}.")
    for name in ("episode_reward_weight", "step_reward_weight"):
        value = step_settings[name]
        if value is not None and not math.isfinite(float(value)):
            raise ValueError(f"{name} must be finite, got {value}.")
    return Estimators(
        reward_weights=weights,
        whiten=bool(weights) if whiten is None else bool(whiten),
        anchor_key=anchor_key,
        episode_reward_weight=1.0
        if episode_reward_weight is None
        else float(episode_reward_weight),
        step_reward_weight=1.0 if step_reward_weight is None else float(step_reward_weight),
        step_reward_gamma=gamma,
    )


# --- at insertion: read and check ----------------------------------------------------------------


def weighted_elements(
    read: Callable[[NestedKey], tuple[Tensor, int | Tensor]],
    weights: tuple[tuple[NestedKey, float], ...],
) -> tuple[Tensor, int | Tensor]:
    """The weighted sum of the reward keys' elements, float64, and the elements per step.

    ``read(key)`` returns one key's flat elements and its elements per step (and raises for a
    missing, empty or misshapen reward). Every key must have as many elements at every step, and
    every element must be finite (the error names the key).
    """
    total, first_key, first_per_step, read_values = None, None, None, []
    for key, weight in weights:
        values, per_step = read(key)
        if first_key is None:
            first_key, first_per_step = key, per_step
        elif not _same_counts(per_step, first_per_step):
            raise ValueError(
                f"MCAdvantage: the rewards under {key!r} and {first_key!r} must have as many "
                "elements at every step."
            )
        term = values.double() * weight
        total = term if total is None else total.add_(term)
        read_values.append((key, values))
    if not math.isfinite(total.sum().item()):  # a nan or inf under some key (or an overflow)
        for key, values in read_values:
            bad = ~torch.isfinite(values)
            if bool(bad.any()):
                raise ValueError(
                    f"MCAdvantage: {int(bad.sum())} non-finite reward value(s) under {key!r}."
                )
    return total, first_per_step


def _same_counts(a: int | Tensor, b: int | Tensor) -> bool:
    if isinstance(a, int) and isinstance(b, int):
        return a == b
    return bool(torch.equal(torch.as_tensor(a).expand_as(torch.as_tensor(b)), torch.as_tensor(b)))


def check_anchors(tensordict: TensorDictBase, data, key: NestedKey, num_steps: int) -> None:
    """Raise unless every step has an anchor state under ``key``: a tensor with one entry per
    step, or a string per step (``data`` is a list of step TensorDicts for ragged input)."""
    if isinstance(data, list):
        for i, step in enumerate(data):
            value = step.get(key, None)
            if value is None:
                raise KeyError(f"MCAdvantage: the anchor key {key!r} is missing at step {i}.")
            _check_one_anchor(value, key)
        return
    value = tensordict.get(key, None)
    if value is None:
        raise KeyError(
            f"MCAdvantage: the anchor key {key!r} is missing from the input "
            f"(keys: {sorted(map(str, tensordict.keys(True, True)))})."
        )
    if isinstance(value, Tensor):
        if value.shape[:1] != (num_steps,):
            raise ValueError(
                f"MCAdvantage: the anchor under {key!r} must have one entry per step "
                f"({num_steps}), got shape {tuple(value.shape)}."
            )
        return
    values = value.tolist() if hasattr(value, "tolist") else value
    values = values if isinstance(values, list) else [values] * num_steps
    for v in values:
        _check_one_anchor(v, key)


def _check_one_anchor(value, key: NestedKey) -> None:
    value = getattr(value, "data", value)  # NonTensorData
    if not isinstance(value, (Tensor, str)):
        raise TypeError(
            f"MCAdvantage: the anchor state under {key!r} must be a tensor or a string, got "
            f"{type(value).__name__}: {value!r:.80}."
        )


# --- at release: fetch from the released steps ---------------------------------------------------


def released_elements(out: TensorDictBase | list, key: NestedKey) -> Tensor:
    """One reward key's elements over the released steps, flat, in order."""
    if isinstance(out, list):
        return torch.cat([step.get(key).reshape(-1) for step in out])
    return out.get(key).reshape(-1)


def released_anchors(out: TensorDictBase | list, key: NestedKey) -> Tensor:
    """The released steps' anchor states as a tensor ``(N, ...)`` compared by value.

    Strings, and tensors whose shape differs from step to step (ragged token ids), become one
    integer code per distinct value through a dictionary: a Python loop over the steps, which only
    such anchors need (pass a tensor, or a hash, to stay vectorized).
    """
    if isinstance(out, list):
        values = [getattr(v, "data", v) for v in (step.get(key) for step in out)]
    else:
        value = out.get(key)
        if isinstance(value, Tensor):
            return value
        values = value.tolist() if hasattr(value, "tolist") else value
        values = values if isinstance(values, list) else [values] * out.shape[0]
    if values and all(isinstance(v, Tensor) for v in values):
        shapes = {tuple(v.shape) for v in values}
        if len(shapes) == 1:
            return torch.stack(values)
        values = [(str(v.dtype), tuple(v.shape), *v.reshape(-1).tolist()) for v in values]
    table: dict = {}
    return torch.tensor([table.setdefault(v, len(table)) for v in values], dtype=torch.long)


def step_term(
    step_rewards: Tensor,
    steps: Tensor,
    step_round: Tensor,
    anchors: Tensor,
    estimators: Estimators,
    *,
    baseline: str,
    scale_rewards: str,
    epsilon: float,
    width: int | None = None,
    num_rounds: int | None = None,
) -> Tensor:
    """GiGPO's step-level advantage of every released step, ``(N,)`` float64.

    Args:
        step_rewards: ``(N,)`` each released step's reward (its elements summed; weighted over
            the reward keys).
        steps: ``(M,)`` steps of each released trajectory, in order.
        step_round: ``(N,)`` the released group of each step.
        anchors: ``(N, ...)`` each step's anchor state.
        width: the steps of every released trajectory if they all have as many (``0``: not).
        num_rounds: the number of released groups (found from ``step_round`` when ``None``).
    """
    step_group, num = anchor_step_groups(step_round, anchors, num_rounds)
    return step_level_advantage(
        step_rewards,
        steps,
        step_group,
        num,
        gamma=estimators.step_reward_gamma,
        baseline=baseline,
        scale_rewards=scale_rewards,
        epsilon=epsilon,
        width=width,
    )

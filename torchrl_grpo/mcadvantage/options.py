"""The transform's settings: checked once, kept in one frozen record, :class:`Options`.

:func:`make_options` takes ``MCAdvantage``'s arguments (torchrl's, with their defaults, and the
keywords beyond them), raises on anything invalid before a transform exists, and groups the rest
by the step of an insertion that reads it: the keys, the trajectory ids, the estimator, the group
filters, candidate selection and the memory limits. :data:`SETTINGS` names the attribute of the
transform that reads and changes each one (:func:`with_setting`).
"""

from __future__ import annotations

import math
import numbers
import operator
from collections.abc import Mapping
from typing import NamedTuple

from tensordict import NestedKey
from torchrl.objectives.llm import MCAdvantageSelector

from torchrl_grpo.advantages import BASELINES, RETURN_REDUCTIONS, SCALES
from torchrl_grpo.advantages.distillation import check_weights

__all__ = [
    "KEYWORDS",
    "RECORDS",
    "SETTINGS",
    "Distillation",
    "Estimator",
    "GroupFilter",
    "Keys",
    "Limits",
    "Options",
    "RewardToGo",
    "Selection",
    "Staleness",
    "StepGroups",
    "TrajectoryKeys",
    "make_options",
    "with_setting",
]


class Keys(NamedTuple):
    """What the transform reads from an insertion, and what it writes."""

    group: NestedKey  # the group id: a prompt string, or a tensor compared by value
    reward: NestedKey | None  # None: no reward read (pure distillation), zeros stand for it
    done: NestedKey
    advantage: NestedKey  # written on the released steps
    # beyond torchrl: several rewards and their weights (GDPO; () reads ``reward`` alone), and
    # each step's anchor state (GiGPO's step groups; None: none)
    reward_weights: tuple[tuple[NestedKey, float], ...] = ()
    anchor: NestedKey | None = None
    # beyond torchrl: the policy version of each step (torchrl's PolicyVersion), read when there
    version: NestedKey | None = "policy_version"


class TrajectoryKeys(NamedTuple):
    """What joins trajectories that cross insertions (``None`` ``traj``: nothing does)."""

    traj: NestedKey | None  # the trajectory id
    done: NestedKey
    count: NestedKey | None  # a step counter (0 at a trajectory's first step), if any
    group: NestedKey | None = None  # the group id, read to name the groups a restart strands


class StepGroups(NamedTuple):
    """GiGPO's step-level groups: the weights and discount of ``MCAdvantage(anchor_key=...,
    step_groups=StepGroups(...))``; the defaults are ROLL's.

    Examples:
        >>> from torchrl_grpo.mcadvantage import StepGroups
        >>> StepGroups(step_weight=0.5)
        StepGroups(episode_weight=1.0, step_weight=0.5, gamma=0.95)
    """

    episode_weight: float = 1.0  # on the group-level advantage (episode_reward_weight)
    step_weight: float = 1.0  # on the step-level advantage (step_reward_weight)
    gamma: float = 0.95  # discount of the step-level returns (step_reward_gamma)


class RewardToGo(NamedTuple):
    """Each step's discounted reward-to-go as its sample: ``MCAdvantage(reward_to_go=
    RewardToGo(gamma, baseline))`` (the flat ``reward_to_go_gamma`` /
    ``reward_to_go_baseline``).

    Examples:
        >>> from torchrl_grpo.mcadvantage import RewardToGo
        >>> RewardToGo(0.95, baseline="time_step")
        RewardToGo(gamma=0.95, baseline='time_step')
    """

    gamma: float | None = None  # None: the reward itself
    baseline: str = "group"  # "group", "time_step" or "step_group"


class Estimator(NamedTuple):
    """How a released group's rewards become advantages."""

    trajectory_return: str | None  # None: every reward element is a sample
    baseline: str
    scale_rewards: str
    epsilon: float
    step_norm: bool
    # beyond torchrl: whitening over the released samples, GiGPO's step groups (None: none),
    # and the discount of each step's reward-to-go as its sample (None: the reward itself)
    whiten: bool = False
    step_groups: StepGroups | None = None
    reward_to_go_gamma: float | None = None
    # with reward_to_go_gamma: "group" (the mean over every step of the group) or "time_step"
    reward_to_go_baseline: str = "group"


class GroupFilter(NamedTuple):
    """Which complete groups are written (see :mod:`~torchrl_grpo.mcadvantage.filters`)."""

    keep_return_bounds: tuple[float, float] | None  # DAPO's dynamic sampling, as torchrl
    std_threshold: float | None  # beyond torchrl: drop groups whose std is at or below it

    @property
    def active(self) -> bool:
        return self.keep_return_bounds is not None or self.std_threshold is not None


class Selection(NamedTuple):
    """torchrl's oversampling: collect candidates, let a selector pick a group among them."""

    candidate_group_size: int
    min_size: int  # candidates needed before the first attempt
    selector: MCAdvantageSelector


class Limits(NamedTuple):
    """Bounds on what is held back (``None``: no bound): ``MCAdvantage(limits=Limits(...))``
    (the flat ``max_pending_groups``, ``max_pending_age``, ``on_overflow``,
    ``min_group_size``).

    Examples:
        >>> from torchrl_grpo.mcadvantage import Limits
        >>> Limits(max_age=8, min_group_size=6)
        Limits(max_groups=None, max_age=8, on_overflow='drop_oldest', min_group_size=6)
    """

    max_groups: int | None = None
    max_age: int | None = None  # in insertions
    on_overflow: str = "drop_oldest"  # or "raise"
    # beyond torchrl: a group past max_age holding at least this many trajectories is released
    # as it is (runs that failed or timed out left it short) instead of given up
    min_group_size: int | None = None


class Staleness(NamedTuple):
    """How old the data may be, in policy versions (:mod:`~torchrl_grpo.mcadvantage.staleness`):
    ``MCAdvantage(staleness=Staleness(...))`` (the flat ``max_policy_lag``,
    ``consumer_version``).

    Examples:
        >>> from torchrl_grpo.mcadvantage import Staleness
        >>> Staleness(max_lag=1)
        Staleness(max_lag=1, consumer_version=None)
    """

    max_lag: int | None = None  # a trajectory more versions behind the reference is dropped
    consumer_version: int | None = None  # the trainer's reference; None: the newest version read


class Distillation(NamedTuple):
    """On-policy distillation: ``MCAdvantage(distillation=Distillation(...))`` writes on the
    response tokens of each released turn ``A_t = alpha * A_group - beta * D_t``, ``D_t`` the
    student's reverse KL to the teacher from token ``t`` on, discounted by ``gamma`` (with
    ``baseline=True``, less its group's mean: ``D_t - mean_group(D)``)
    (:mod:`torchrl_grpo.advantages.distillation`; how the rows are read:
    :mod:`torchrl_grpo.mcadvantage.distillation`).

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
    # subtract from D_t its group's mean over the response tokens (group_mean_baseline): a
    # centred teacher's term; False: the peers' form (Tinker, Trinity-RFT, NeMo-RL)
    baseline: bool = False


class Options(NamedTuple):
    """Every setting of one transform, checked."""

    grpo_size: int
    verbose: bool
    keys: Keys
    trajectory_keys: TrajectoryKeys
    estimator: Estimator
    group_filter: GroupFilter
    selection: Selection
    limits: Limits
    staleness: Staleness = Staleness()
    distillation: Distillation | None = None  # None: the group's advantage per reward element

    @property
    def selects(self) -> bool:
        """Whether candidate selection can differ from taking each group's first arrivals.

        torchrl consults the selector only with a ``trajectory_return``; and with as many
        candidates as the group size, its own selector keeps them all, in order, or rejects them
        by ``keep_return_bounds`` (a filter applied when the group is released instead).
        """
        selection = self.selection
        return self.estimator.trajectory_return is not None and (
            selection.candidate_group_size > self.grpo_size
            or type(selection.selector) is not MCAdvantageSelector
        )


#: The transform's attribute for each setting: ``name -> (record, field)`` of :class:`Options`
#: (``record`` ``None``: a field of ``Options`` itself).
SETTINGS = {
    "grpo_size": (None, "grpo_size"),
    "verbose": (None, "verbose"),
    "prompt_key": ("keys", "group"),
    "rewards_key": ("keys", "reward"),
    "done_key": ("keys", "done"),
    "advantage_key": ("keys", "advantage"),
    "anchor_key": ("keys", "anchor"),
    "trajectory_return": ("estimator", "trajectory_return"),
    "baseline": ("estimator", "baseline"),
    "scale_rewards": ("estimator", "scale_rewards"),
    "epsilon": ("estimator", "epsilon"),
    "step_norm": ("estimator", "step_norm"),
    "whiten": ("estimator", "whiten"),
    "reward_to_go_gamma": ("estimator", "reward_to_go_gamma"),
    "reward_to_go_baseline": ("estimator", "reward_to_go_baseline"),
    "keep_return_bounds": ("group_filter", "keep_return_bounds"),
    "std_threshold": ("group_filter", "std_threshold"),
    "candidate_group_size": ("selection", "candidate_group_size"),
    "candidate_selection_min_size": ("selection", "min_size"),
    "candidate_selector": ("selection", "selector"),
    "max_pending_groups": ("limits", "max_groups"),
    "max_pending_age": ("limits", "max_age"),
    "on_overflow": ("limits", "on_overflow"),
    "min_group_size": ("limits", "min_group_size"),
    "traj_key": ("trajectory_keys", "traj"),
    "step_count_key": ("trajectory_keys", "count"),
    "policy_version_key": ("keys", "version"),
    "max_policy_lag": ("staleness", "max_lag"),
    "consumer_version": ("staleness", "consumer_version"),
}


def read_setting(options: Options, name: str):
    """The value of setting ``name`` (a key of :data:`SETTINGS`)."""
    record, field = SETTINGS[name]
    return getattr(options if record is None else getattr(options, record), field)


def with_setting(options: Options, name: str, value) -> Options:
    """``options`` with setting ``name`` set to ``value``, as torchrl sets an attribute: no check
    beyond those each step makes when it reads the setting."""
    record, field = SETTINGS[name]
    if record is None:
        return options._replace(**{field: value})
    return options._replace(**{record: getattr(options, record)._replace(**{field: value})})


def make_options(
    grpo_size,
    prompt_key: NestedKey = "query",
    rewards_key: NestedKey = ("next", "reward"),
    advantage_key: NestedKey = "advantage",
    done_key: NestedKey = ("next", "done"),
    verbose: bool = False,
    **keywords,
) -> Options:
    """``MCAdvantage``'s arguments, checked and grouped (the keyword arguments are those of
    :class:`~torchrl_grpo.MCAdvantage`, with its defaults).

    Raises:
        TypeError: a size that is not an integer, a ``reward_to_go_gamma`` that is not a number.
        ValueError: any other invalid value or combination; the message names the argument.
    """
    unknown = sorted(set(keywords) - set(KEYWORDS))
    if unknown:
        raise TypeError(f"MCAdvantage got unexpected keyword arguments {unknown}.")
    kw = _expand_records({**KEYWORDS, **keywords}, keywords)
    grpo_size, selection = _sizes(grpo_size, kw)
    trajectory_return = _trajectory_return(kw["trajectory_return"], grpo_size, selection)
    weights = _reward_weights(rewards_key, kw["reward_weights"])
    keys = Keys(
        group=prompt_key,
        reward=weights[0][0] if weights else rewards_key,  # the first gives the advantage's shape
        done=done_key,
        advantage=advantage_key,
        reward_weights=weights,
        anchor=kw["anchor_key"],
        version=kw["policy_version_key"],
    )
    traj_key = kw["traj_key"]
    return Options(
        grpo_size=grpo_size,
        verbose=verbose,
        keys=keys,
        trajectory_keys=TrajectoryKeys(
            traj=traj_key,
            done=done_key,
            count=kw["step_count_key"] if traj_key is not None else None,
            group=prompt_key,
        ),
        estimator=_estimator(kw, trajectory_return, bool(weights)),
        group_filter=_group_filter(kw, trajectory_return),
        selection=selection,
        limits=_limits(kw, grpo_size, selection),
        staleness=_staleness(kw),
        distillation=_distillation(kw["distillation"], rewards_key),
    )


#: The records that group MCAdvantage's settings beyond torchrl's, their keyword, and the flat
#: keyword of each field (the form of earlier versions, still accepted).
RECORDS: dict[str, tuple[type, dict[str, str]]] = {
    "reward_to_go": (
        RewardToGo,
        {"gamma": "reward_to_go_gamma", "baseline": "reward_to_go_baseline"},
    ),
    "step_groups": (
        StepGroups,
        {
            "episode_weight": "episode_reward_weight",
            "step_weight": "step_reward_weight",
            "gamma": "step_reward_gamma",
        },
    ),
    "limits": (
        Limits,
        {
            "max_groups": "max_pending_groups",
            "max_age": "max_pending_age",
            "on_overflow": "on_overflow",
            "min_group_size": "min_group_size",
        },
    ),
    "staleness": (Staleness, {"max_lag": "max_policy_lag", "consumer_version": "consumer_version"}),
}


def _flat_defaults() -> dict:
    """The flat keywords' defaults, each its record's (written once, there); GiGPO's weights
    default to ``None``, "not given", so that they are refused without ``anchor_key``."""
    defaults = {}
    for record, fields in RECORDS.values():
        for field, flat in fields.items():
            defaults[flat] = None if record is StepGroups else record._field_defaults[field]
    return defaults


#: ``MCAdvantage``'s keyword-only arguments and their defaults: torchrl's, the package's own,
#: the records (``None``: given by their flat keywords) and the flat keywords of the records.
KEYWORDS = {
    "trajectory_return": None,
    "keep_return_bounds": None,
    "candidate_group_size": None,
    "candidate_selection_min_size": None,
    "candidate_selector": None,
    "scale_rewards": "group",
    "baseline": "mean",
    "std_threshold": None,
    "step_norm": False,
    "epsilon": 1e-6,
    "whiten": None,
    "reward_weights": None,
    "anchor_key": None,
    "traj_key": ("collector", "traj_ids"),
    "step_count_key": "step_count",
    "policy_version_key": "policy_version",
    "distillation": None,
    **dict.fromkeys(RECORDS),
    **_flat_defaults(),
}


def _expand_records(kw: dict, given: dict) -> dict:
    """``kw`` with each record given spread onto its flat keywords; a record given with one of
    its flat keywords raises."""
    for name, (record, fields) in RECORDS.items():
        value = kw.get(name)
        if value is None:
            continue
        if not isinstance(value, record):
            raise TypeError(
                f"{name} must be a {record.__name__} (torchrl_grpo.mcadvantage), got {value!r}."
            )
        both = [flat for flat in fields.values() if flat in given]
        if both:
            raise ValueError(
                f"MCAdvantage got {name}={value!r} and {', '.join(both)}: pass the record or "
                "its flat keywords, not both."
            )
        for field, flat in fields.items():
            kw[flat] = getattr(value, field)
    return kw


def _distillation(value, rewards_key) -> Distillation | None:
    """``distillation`` checked: a :class:`Distillation` whose weights are finite, ``beta`` and
    ``alpha`` at least ``0`` and not both ``0``, ``gamma`` in ``[0, 1]``; ``rewards_key=None``
    (no reward read) only with ``alpha = 0``."""
    if value is None:
        if rewards_key is None:
            raise ValueError(
                "rewards_key=None reads no reward: it is for pure distillation, "
                "distillation=Distillation(alpha=0.0, ...)."
            )
        return None
    if not isinstance(value, Distillation):
        raise TypeError(
            f"distillation must be a Distillation (torchrl_grpo.mcadvantage), got {value!r}."
        )
    check_weights(value.alpha, value.beta)
    if value.alpha == 0.0 and value.beta == 0.0:
        raise ValueError(
            "Distillation(alpha=0, beta=0) uses neither the reward nor the teacher's log-probs: "
            "drop distillation=, or give the teacher a weight beta > 0."
        )
    gamma = value.gamma
    if isinstance(gamma, bool) or not isinstance(gamma, numbers.Real) or not 0 <= gamma <= 1:
        raise ValueError(f"Distillation's gamma must be a number in [0, 1], got {gamma!r}.")
    if rewards_key is None and value.alpha != 0.0:
        raise ValueError(
            f"rewards_key=None reads no reward, but Distillation(alpha={value.alpha}) weighs the "
            "group's advantage of the reward: give rewards_key, or alpha=0.0."
        )
    return value._replace(alpha=float(value.alpha), beta=float(value.beta), gamma=float(gamma))


def _integer(name: str, value) -> int:
    """``value`` as an ``int``; anything else, a float or a bool included, is a ``TypeError``."""
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an integer, got {value!r} (bool).")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(
            f"{name} must be an integer, got {value!r} ({type(value).__name__})."
        ) from None


def _sizes(grpo_size, kw: dict) -> tuple[int, Selection]:
    """The group size and the candidates' sizes, checked against each other."""
    grpo_size = _integer("grpo_size", grpo_size)
    candidates, min_size = kw["candidate_group_size"], kw["candidate_selection_min_size"]
    candidates = grpo_size if candidates is None else _integer("candidate_group_size", candidates)
    min_size = grpo_size if min_size is None else _integer("candidate_selection_min_size", min_size)
    if grpo_size < 1:
        raise ValueError(f"grpo_size must be at least 1, got {grpo_size}.")
    if candidates < grpo_size:
        raise ValueError(
            "candidate_group_size must be greater than or equal to grpo_size, got "
            f"candidate_group_size={candidates} and grpo_size={grpo_size}."
        )
    if min_size < grpo_size:
        raise ValueError(
            "candidate_selection_min_size must be greater than or equal to grpo_size, got "
            f"candidate_selection_min_size={min_size} and grpo_size={grpo_size}."
        )
    if min_size > candidates:
        raise ValueError(
            "candidate_selection_min_size must be less than or equal to candidate_group_size, "
            f"got candidate_selection_min_size={min_size} and "
            f"candidate_group_size={candidates}."
        )
    selector = kw["candidate_selector"]
    selector = MCAdvantageSelector() if selector is None else selector
    return grpo_size, Selection(candidates, min_size, selector)


def _trajectory_return(mode: str | None, grpo_size: int, selection: Selection) -> str | None:
    if mode is not None and mode not in RETURN_REDUCTIONS:
        raise ValueError(
            f"trajectory_return must be one of {sorted(RETURN_REDUCTIONS)} or None, got {mode!r}."
        )
    if mode is not None and grpo_size < 2:
        raise ValueError(
            "trajectory_return requires grpo_size >= 2: a group-relative return needs at "
            f"least two trajectories, got grpo_size={grpo_size}."
        )
    if selection.candidate_group_size > grpo_size and mode is None:
        raise ValueError(
            "candidate_group_size > grpo_size requires trajectory_return: candidates are "
            "selected by their return."
        )
    return mode


def _estimator(kw: dict, trajectory_return: str | None, several_rewards: bool) -> Estimator:
    if kw["scale_rewards"] not in SCALES:
        raise ValueError(
            f"scale_rewards must be one of {sorted(SCALES)}, got {kw['scale_rewards']!r}."
        )
    if kw["baseline"] not in BASELINES:
        raise ValueError(f"baseline must be one of {sorted(BASELINES)}, got {kw['baseline']!r}.")
    if not kw["epsilon"] > 0:
        raise ValueError(f"epsilon must be positive, got {kw['epsilon']}.")
    whiten = kw["whiten"]
    return Estimator(
        trajectory_return=trajectory_return,
        baseline=kw["baseline"],
        scale_rewards=kw["scale_rewards"],
        epsilon=float(kw["epsilon"]),
        step_norm=kw["step_norm"],
        whiten=several_rewards if whiten is None else bool(whiten),
        step_groups=_step_groups(kw),
        reward_to_go_gamma=_reward_to_go_gamma(kw, trajectory_return),
        reward_to_go_baseline=_reward_to_go_baseline(kw),
    )


def _group_filter(kw: dict, trajectory_return: str | None) -> GroupFilter:
    bounds, threshold = kw["keep_return_bounds"], kw["std_threshold"]
    if bounds is not None:
        if trajectory_return is None:
            raise ValueError(
                "keep_return_bounds (dynamic sampling) filters on trajectory returns: set "
                "trajectory_return to 'sum', 'max', 'mean' or 'last'."
            )
        if len(bounds) != 2 or not bounds[0] < bounds[1]:
            raise ValueError(
                f"keep_return_bounds must be an increasing (low, high) pair, got {bounds}."
            )
        bounds = (float(bounds[0]), float(bounds[1]))
    if threshold is not None and threshold < 0:
        raise ValueError(f"std_threshold must be non-negative, got {threshold}.")
    return GroupFilter(keep_return_bounds=bounds, std_threshold=threshold)


def _limits(kw: dict, grpo_size: int, selection: Selection) -> Limits:
    limits = {}
    for name in ("max_pending_groups", "max_pending_age"):
        limit = kw[name]
        if limit is not None:
            limit = _integer(name, limit)
            if limit < 1:
                raise ValueError(f"{name} must be at least 1 or None, got {limit}.")
        limits[name] = limit
    if kw["on_overflow"] not in ("drop_oldest", "raise"):
        raise ValueError(
            f"on_overflow must be 'drop_oldest' or 'raise', got {kw['on_overflow']!r}."
        )
    min_size = kw["min_group_size"]
    if min_size is not None:
        min_size = _integer("min_group_size", min_size)
        if not 1 <= min_size <= grpo_size:
            raise ValueError(
                f"min_group_size must be between 1 and grpo_size={grpo_size}, got {min_size}."
            )
        if limits["max_pending_age"] is None:
            raise ValueError(
                "min_group_size releases the groups still short after max_pending_age "
                "insertions: set max_pending_age too."
            )
        if selection.candidate_group_size > grpo_size:
            raise ValueError(
                "min_group_size cannot be combined with candidate_group_size > grpo_size: a "
                "short group has no candidates to select among."
            )
    return Limits(
        limits["max_pending_groups"], limits["max_pending_age"], kw["on_overflow"], min_size
    )


def _staleness(kw: dict) -> Staleness:
    """``max_policy_lag`` (a non-negative integer) and ``consumer_version`` (an integer)."""
    max_lag, consumer = kw["max_policy_lag"], kw["consumer_version"]
    if max_lag is not None:
        max_lag = _integer("max_policy_lag", max_lag)
        if max_lag < 0:
            raise ValueError(f"max_policy_lag must be at least 0 or None, got {max_lag}.")
        if kw["policy_version_key"] is None:
            raise ValueError(
                "max_policy_lag bounds the lag of each trajectory's policy version: it needs "
                "policy_version_key (torchrl's PolicyVersion writes 'policy_version')."
            )
    if consumer is not None:
        consumer = _integer("consumer_version", consumer)
    return Staleness(max_lag, consumer)


def _reward_weights(
    rewards_key: NestedKey, reward_weights: Mapping[NestedKey, float] | None
) -> tuple[tuple[NestedKey, float], ...]:
    """``reward_weights`` checked, as ``((key, weight), ...)``; ``()`` for one reward."""
    if reward_weights is None:
        return ()
    if not isinstance(reward_weights, Mapping) or not reward_weights:
        raise ValueError(
            f"reward_weights must be a non-empty mapping {{reward key: weight}}, got "
            f"{reward_weights!r}."
        )
    weights = tuple((key, float(weight)) for key, weight in reward_weights.items())
    if not all(math.isfinite(weight) for _, weight in weights):
        raise ValueError(f"reward_weights must be finite, got {reward_weights!r}.")
    if rewards_key != ("next", "reward") and rewards_key not in dict(weights):
        raise ValueError(
            f"rewards_key={rewards_key!r} is not a key of reward_weights ({list(dict(weights))}): "
            "with several rewards, name them all in reward_weights."
        )
    return weights


def _step_groups(kw: dict) -> StepGroups | None:
    """GiGPO's settings checked, with ROLL's defaults; ``None`` without ``anchor_key``."""
    given = {
        name: kw[name]
        for name in ("episode_reward_weight", "step_reward_weight", "step_reward_gamma")
    }
    if kw["anchor_key"] is None:
        named = [name for name, value in given.items() if value is not None]
        if named:
            raise ValueError(
                f"{', '.join(named)} weigh GiGPO's step-level groups, which need anchor_key (the "
                "key of each step's anchor state)."
            )
        return None
    default = StepGroups()  # ROLL's, where not given
    groups = StepGroups(
        *(float(d if v is None else v) for v, d in zip(given.values(), default, strict=True))
    )
    for name, value in zip(("episode_reward_weight", "step_reward_weight"), groups[:2]):
        if not math.isfinite(value):
            raise ValueError(f"{name} must be finite, got {value}.")
    if not 0.0 <= groups.gamma <= 1.0:
        raise ValueError(f"step_reward_gamma must be in [0, 1], got {groups.gamma}.")
    return groups


REWARD_TO_GO_BASELINES = ("group", "time_step", "step_group")


def _reward_to_go_baseline(kw: dict) -> str:
    """``reward_to_go_baseline`` checked: one of :data:`REWARD_TO_GO_BASELINES`, and only
    chosen with ``reward_to_go_gamma``."""
    value = kw["reward_to_go_baseline"]
    if value not in REWARD_TO_GO_BASELINES:
        raise ValueError(
            f"reward_to_go_baseline must be one of {list(REWARD_TO_GO_BASELINES)}, got {value!r}."
        )
    if value != "group" and kw["reward_to_go_gamma"] is None:
        raise ValueError(
            f"reward_to_go_baseline={value!r} compares rewards-to-go: it needs reward_to_go_gamma."
        )
    scale = kw["scale_rewards"]
    if value == "time_step" and getattr(SCALES[scale], "pooled", None) is None:
        raise ValueError(
            f"scale_rewards={scale!r} has no form pooled over time steps (a Scale of SCALES "
            "with pooled=...): reward_to_go_baseline='time_step' cannot use it."
        )
    return value


def _reward_to_go_gamma(kw: dict, trajectory_return: str | None) -> float | None:
    """``reward_to_go_gamma`` checked, as a float; ``None`` when off."""
    gamma = kw["reward_to_go_gamma"]
    if gamma is None:
        return None
    if isinstance(gamma, bool) or not isinstance(gamma, numbers.Real):
        raise TypeError(
            f"reward_to_go_gamma must be a real number in [0, 1] or None, got {gamma!r} "
            f"({type(gamma).__name__})."
        )
    if not 0.0 <= gamma <= 1.0:
        raise ValueError(f"reward_to_go_gamma must be in [0, 1], got {gamma}.")
    if trajectory_return is not None:
        raise ValueError(
            "reward_to_go_gamma makes each step's sample its discounted reward-to-go, a per-step "
            "mode: it requires trajectory_return=None, got "
            f"trajectory_return={trajectory_return!r}."
        )
    if kw["anchor_key"] is not None:
        raise ValueError(
            "reward_to_go_gamma cannot be combined with anchor_key: GiGPO's step level already "
            "compares discounted returns (step_reward_gamma), over the raw rewards."
        )
    return float(gamma)

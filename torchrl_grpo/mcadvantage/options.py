"""The transform's settings: checked once, kept in one frozen record, :class:`Options`.

:func:`make_options` takes ``MCAdvantage``'s arguments (torchrl's, with their defaults, and the
keywords beyond them), raises on anything invalid before a transform exists, and groups the rest
by the step of an insertion that reads it: the keys, the trajectory ids, the estimator (an object
of :mod:`~torchrl_grpo.mcadvantage.estimators`), the group filters, candidate selection and the
memory limits. :data:`SETTINGS` names the attribute of the transform that reads and changes each
one (:func:`with_setting`). The flat keywords of earlier versions are accepted here as they were;
:data:`DEPRECATED` names what replaces each (the transform warns with it).
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import operator
from collections.abc import Mapping
from dataclasses import dataclass
from typing import NamedTuple

from tensordict import NestedKey
from torchrl.objectives.llm import MCAdvantageSelector

from torchrl_grpo.advantages import BASELINES, RETURN_REDUCTIONS, SCALES
from torchrl_grpo.advantages.distillation import check_weights
from torchrl_grpo.mcadvantage.estimators import (
    Distillation,
    Estimator,
    GroupRelative,
    RewardToGo,
    StepGroups,
    lookup_estimator,
)

__all__ = [
    "DEPRECATED",
    "KEYWORDS",
    "RECORDS",
    "SETTINGS",
    "GroupFilter",
    "Keys",
    "Limits",
    "Options",
    "Selection",
    "Staleness",
    "TrajectoryIds",
    "TrajectoryKeys",
    "deprecated_forms",
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


@dataclass(frozen=True)
class TrajectoryIds:
    """The keys that join trajectories across insertions, ``MCAdvantage(traj_key=
    TrajectoryIds(...))`` (the flat ``step_count_key``): ``traj_key=key`` is
    ``TrajectoryIds(key)``.

    Examples:
        >>> from torchrl_grpo.mcadvantage import TrajectoryIds
        >>> TrajectoryIds("dialog_id", step_count_key=None)
        TrajectoryIds(key='dialog_id', step_count_key=None)
    """

    key: NestedKey = ("collector", "traj_ids")  # the trajectory id of every step
    # a step counter (torchrl's StepCounter: 0 at a trajectory's first step), read where present
    step_count_key: NestedKey | None = "step_count"


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


class Options(NamedTuple):
    """Every setting of one transform, checked."""

    grpo_size: int
    verbose: bool
    keys: Keys
    trajectory_keys: TrajectoryKeys
    trajectory_return: str | None  # None: every reward element is a sample
    estimator: Estimator  # how the samples become advantages (mcadvantage.estimators)
    group_filter: GroupFilter
    selection: Selection
    limits: Limits
    staleness: Staleness = Staleness()

    @property
    def selects(self) -> bool:
        """Whether candidate selection can differ from taking each group's first arrivals.

        torchrl consults the selector only with a ``trajectory_return``; and with as many
        candidates as the group size, its own selector keeps them all, in order, or rejects them
        by ``keep_return_bounds`` (a filter applied when the group is released instead).
        """
        selection = self.selection
        return self.trajectory_return is not None and (
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
    "trajectory_return": (None, "trajectory_return"),
    "keep_return_bounds": ("group_filter", "keep_return_bounds"),
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
        TypeError: a size that is not an integer, a ``RewardToGo`` gamma that is not a number.
        ValueError: any other invalid value or combination; the message names the argument.
    """
    unknown = sorted(set(keywords) - set(KEYWORDS))
    if unknown:
        raise TypeError(f"MCAdvantage got unexpected keyword arguments {unknown}.")
    kw = _expand_records({**KEYWORDS, **keywords}, keywords)
    kw[GIVEN] = frozenset(keywords)  # which settings came as flat keywords, for the messages
    own = _spread_estimator(kw, keywords)  # a user's own estimator, else None
    grpo_size, selection = _sizes(grpo_size, kw)
    trajectory_return = _trajectory_return(kw["trajectory_return"], grpo_size, selection)
    weights = _reward_weights(rewards_key, kw["reward_weights"], _named(kw, "reward_weights"))
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
        trajectory_return=trajectory_return,
        estimator=_estimator(kw, trajectory_return, weights, rewards_key, own),
        group_filter=_group_filter(kw, trajectory_return),
        selection=selection,
        limits=_limits(kw, grpo_size, selection),
        staleness=_staleness(kw),
    )


#: GroupRelative's fields, each once a flat keyword of the transform.
GROUP_FIELDS = (
    "baseline",
    "scale_rewards",
    "epsilon",
    "whiten",
    "std_threshold",
    "step_norm",
    "reward_weights",
)

#: The flat keywords of earlier versions, each with the slot and form that replace it (the
#: transform's ``DeprecationWarning`` names them, with the exact value to write).
DEPRECATED: dict[str, tuple[str, str]] = {
    **{name: ("estimator", f"GroupRelative({name}=...)") for name in GROUP_FIELDS},
    "reward_to_go": ("estimator", "RewardToGo(gamma, baseline=...)"),
    "reward_to_go_gamma": ("estimator", "RewardToGo(gamma)"),
    "reward_to_go_baseline": ("estimator", "RewardToGo(gamma, baseline=...)"),
    "anchor_key": ("estimator", "StepGroups(anchor_key=...)"),
    "step_groups": ("estimator", "StepGroups(..., anchor_key=...)"),
    "episode_reward_weight": ("estimator", "StepGroups(episode_weight=..., anchor_key=...)"),
    "step_reward_weight": ("estimator", "StepGroups(step_weight=..., anchor_key=...)"),
    "step_reward_gamma": ("estimator", "StepGroups(gamma=..., anchor_key=...)"),
    "distillation": ("estimator", "Distillation(..., group=GroupRelative(...))"),
    "max_pending_groups": ("limits", "Limits(max_groups=...)"),
    "max_pending_age": ("limits", "Limits(max_age=...)"),
    "on_overflow": ("limits", "Limits(on_overflow=...)"),
    "min_group_size": ("limits", "Limits(min_group_size=...)"),
    "max_policy_lag": ("staleness", "Staleness(max_lag=...)"),
    "consumer_version": ("staleness", "Staleness(consumer_version=...)"),
    "step_count_key": ("traj_key", "TrajectoryIds(key, step_count_key=...)"),
}


def deprecated_forms(given, options: Options) -> str | None:
    """What to write instead of the flat keywords ``given`` (``None``: none was given): each
    keyword, the form replacing it, and the whole argument with these settings."""
    names = [name for name in given if name in DEPRECATED]
    if not names:
        return None
    slots = dict.fromkeys(DEPRECATED[name][0] for name in names)
    values = {
        "estimator": options.estimator,
        "limits": options.limits,
        "staleness": options.staleness,
        "traj_key": TrajectoryIds(options.trajectory_keys.traj, options.trajectory_keys.count),
    }
    forms = "; ".join(f"{name}= -> {DEPRECATED[name][0]}={DEPRECATED[name][1]}" for name in names)
    write = ", ".join(f"{slot}={values[slot]!r}" for slot in slots)
    return (
        f"MCAdvantage's flat keywords are deprecated (they keep working): {forms} (classes of "
        f"torchrl_grpo.mcadvantage). For these settings, write: {write}."
    )


def _spread_estimator(kw: dict, given: dict) -> Estimator | None:
    """``kw`` with the ``estimator`` given (an object or a name) spread onto the flat keywords
    it replaces, which are then checked as they were; a flat keyword given with it raises.
    Returns a user's own estimator (kept as given), else ``None``."""
    if kw["estimator"] is None:
        return None
    estimator = lookup_estimator(kw["estimator"])
    both = [name for name in given if DEPRECATED.get(name, ("",))[0] == "estimator"]
    if both:
        raise ValueError(
            f"MCAdvantage got estimator={estimator!r} and {', '.join(f'{n}=' for n in both)}: "
            "the estimator holds these settings; write them in it, not beside it."
        )
    if isinstance(estimator, Distillation):
        kw["distillation"], estimator = estimator, estimator.group
    if isinstance(estimator, RewardToGo):
        if estimator.gamma is None:
            raise ValueError("RewardToGo needs gamma, the discount in [0, 1] (0: the rewards).")
        kw.update(reward_to_go_gamma=estimator.gamma, reward_to_go_baseline=estimator.baseline)
    elif isinstance(estimator, StepGroups):
        kw.update(
            anchor_key=estimator.anchor_key,
            episode_reward_weight=estimator.episode_weight,
            step_reward_weight=estimator.step_weight,
            step_reward_gamma=estimator.gamma,
        )
        if estimator.anchor_key is None:
            raise ValueError("StepGroups needs anchor_key: the key of each step's anchor state.")
    if isinstance(estimator, Distillation):
        raise TypeError("Distillation's group is the estimator of A_group, not a Distillation.")
    group = estimator.group
    if group is None:
        return estimator
    for name in ("baseline", "scale_rewards", "epsilon", "whiten", "std_threshold", "step_norm"):
        kw[name] = getattr(group, name)
    kw["reward_weights"] = group.reward_weights
    return None


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
            defaults[flat] = None if record is StepGroups else _field_default(record, field)
    return defaults


def _field_default(record: type, field: str):
    """The default of ``field`` of a record (a named tuple or a dataclass)."""
    if dataclasses.is_dataclass(record):
        return {f.name: f.default for f in dataclasses.fields(record)}[field]
    return record._field_defaults[field]


def _possessive(name: str) -> str:
    return f"{name}'" if name.endswith("s") else f"{name}'s"


#: Each flat keyword's field in the object that holds it, as messages name the setting.
FIELDS: dict[str, str] = {
    **{name: f"GroupRelative's {name}" for name in GROUP_FIELDS},
    "anchor_key": "StepGroups' anchor_key",
    **{
        flat: f"{_possessive(record.__name__)} {field}"
        for record, fields in RECORDS.values()
        for field, flat in fields.items()
    },
}

#: The key of ``kw`` holding the names of the keywords given (not a keyword).
GIVEN = object()


def _named(kw: dict, flat: str) -> str:
    """The setting of the flat keyword ``flat`` as messages name it: its object's field, and
    the flat keyword where the value was given by it."""
    if flat in kw.get(GIVEN, ()):
        return f"{FIELDS[flat]} (given as {flat}=)"
    return FIELDS[flat]


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
    "estimator": None,
    **dict.fromkeys(RECORDS),
    **_flat_defaults(),
}


def _expand_records(kw: dict, given: dict) -> dict:
    """``kw`` with each record given spread onto its flat keywords; a record given with one of
    its flat keywords raises."""
    if isinstance(kw["traj_key"], TrajectoryIds):
        ids = kw["traj_key"]
        if "step_count_key" in given:
            raise ValueError(
                f"MCAdvantage got traj_key={ids!r} and step_count_key=: pass the record or "
                "its flat keywords, not both."
            )
        kw["traj_key"], kw["step_count_key"] = ids.key, ids.step_count_key
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
        if record is StepGroups and value.anchor_key is not None and "anchor_key" not in given:
            kw["anchor_key"] = value.anchor_key
    return kw


#: What ``Distillation(baseline=...)`` takes beside ``False`` and ``True`` (``"group"``).
DISTILLATION_BASELINES = frozenset({"group", "position"})


def _distillation(value, rewards_key) -> Distillation | None:
    """``distillation`` checked: a :class:`Distillation` whose weights are finite, ``beta`` and
    ``alpha`` at least ``0`` and not both ``0``, ``gamma`` in ``[0, 1]``, ``baseline`` a bool or
    one of :data:`DISTILLATION_BASELINES`; ``rewards_key=None`` (no reward read) only with
    ``alpha = 0``."""
    if value is None:
        if rewards_key is None:
            raise ValueError(
                "rewards_key=None reads no reward: it is for pure distillation, "
                "estimator=Distillation(alpha=0.0, ...)."
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
            "use another estimator, or give the teacher a weight beta > 0."
        )
    gamma = value.gamma
    if isinstance(gamma, bool) or not isinstance(gamma, numbers.Real) or not 0 <= gamma <= 1:
        raise ValueError(f"Distillation's gamma must be a number in [0, 1], got {gamma!r}.")
    if not isinstance(value.baseline, bool) and value.baseline not in DISTILLATION_BASELINES:
        raise ValueError(
            'Distillation\'s baseline must be False, True ("group") or one of '
            f"{sorted(DISTILLATION_BASELINES)}, got {value.baseline!r}."
        )
    if rewards_key is None and value.alpha != 0.0:
        raise ValueError(
            f"rewards_key=None reads no reward, but Distillation(alpha={value.alpha}) weighs the "
            "group's advantage of the reward: give rewards_key, or alpha=0.0."
        )
    return dataclasses.replace(
        value, alpha=float(value.alpha), beta=float(value.beta), gamma=float(gamma)
    )


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


def _estimator(kw: dict, trajectory_return, weights, rewards_key, own) -> Estimator:
    """The estimator, checked, built from the (flat) settings: a :class:`GroupRelative`, in a
    :class:`RewardToGo` or a :class:`StepGroups` where theirs are given, in a
    :class:`Distillation` with a teacher; ``own``, a user's estimator, in place of the first."""
    if kw["scale_rewards"] not in SCALES:
        raise ValueError(
            f"{_named(kw, 'scale_rewards')} must be one of {sorted(SCALES)}, "
            f"got {kw['scale_rewards']!r}."
        )
    if kw["baseline"] not in BASELINES:
        raise ValueError(
            f"{_named(kw, 'baseline')} must be one of {sorted(BASELINES)}, got {kw['baseline']!r}."
        )
    if not kw["epsilon"] > 0:
        raise ValueError(f"{_named(kw, 'epsilon')} must be positive, got {kw['epsilon']}.")
    whiten = kw["whiten"]
    group = GroupRelative(
        baseline=kw["baseline"],
        scale_rewards=kw["scale_rewards"],
        epsilon=float(kw["epsilon"]),
        whiten=None if whiten is None else bool(whiten),
        std_threshold=kw["std_threshold"],
        step_norm=kw["step_norm"],
        reward_weights=dict(weights) or None,
    )
    estimator = group if own is None else own
    step_groups = _step_groups(kw)
    gamma = _reward_to_go_gamma(kw, trajectory_return)
    baseline = _reward_to_go_baseline(kw)
    if gamma is not None:
        estimator = RewardToGo(gamma, baseline, group=group)
    if step_groups is not None:
        estimator = dataclasses.replace(step_groups, anchor_key=kw["anchor_key"], group=group)
    distillation = _distillation(kw["distillation"], rewards_key)
    if distillation is not None:
        estimator = dataclasses.replace(distillation, group=estimator)
    return estimator


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
        raise ValueError(f"{_named(kw, 'std_threshold')} must be non-negative, got {threshold}.")
    return GroupFilter(keep_return_bounds=bounds, std_threshold=threshold)


def _limits(kw: dict, grpo_size: int, selection: Selection) -> Limits:
    limits = {}
    for name in ("max_pending_groups", "max_pending_age"):
        limit = kw[name]
        if limit is not None:
            limit = _integer(_named(kw, name), limit)
            if limit < 1:
                raise ValueError(f"{_named(kw, name)} must be at least 1 or None, got {limit}.")
        limits[name] = limit
    if kw["on_overflow"] not in ("drop_oldest", "raise"):
        raise ValueError(
            f"{_named(kw, 'on_overflow')} must be 'drop_oldest' or 'raise', "
            f"got {kw['on_overflow']!r}."
        )
    min_size = kw["min_group_size"]
    if min_size is not None:
        name = _named(kw, "min_group_size")
        min_size = _integer(name, min_size)
        if not 1 <= min_size <= grpo_size:
            raise ValueError(f"{name} must be between 1 and grpo_size={grpo_size}, got {min_size}.")
        if limits["max_pending_age"] is None:
            raise ValueError(
                f"{name} releases the groups still short after max_age insertions: set "
                f"{FIELDS['max_pending_age']} too."
            )
        if selection.candidate_group_size > grpo_size:
            raise ValueError(
                f"{name} cannot be combined with candidate_group_size > grpo_size: a "
                "short group has no candidates to select among."
            )
    return Limits(
        limits["max_pending_groups"], limits["max_pending_age"], kw["on_overflow"], min_size
    )


def _staleness(kw: dict) -> Staleness:
    """``max_policy_lag`` (a non-negative integer) and ``consumer_version`` (an integer)."""
    max_lag, consumer = kw["max_policy_lag"], kw["consumer_version"]
    if max_lag is not None:
        name = _named(kw, "max_policy_lag")
        max_lag = _integer(name, max_lag)
        if max_lag < 0:
            raise ValueError(f"{name} must be at least 0 or None, got {max_lag}.")
        if kw["policy_version_key"] is None:
            raise ValueError(
                f"{name} bounds the lag of each trajectory's policy version: it needs "
                "policy_version_key (torchrl's PolicyVersion writes 'policy_version')."
            )
    if consumer is not None:
        consumer = _integer(_named(kw, "consumer_version"), consumer)
    return Staleness(max_lag, consumer)


def _reward_weights(
    rewards_key: NestedKey, reward_weights: Mapping[NestedKey, float] | None, name: str
) -> tuple[tuple[NestedKey, float], ...]:
    """``reward_weights`` (named ``name`` in messages) checked, as ``((key, weight), ...)``;
    ``()`` for one reward."""
    if reward_weights is None:
        return ()
    if not isinstance(reward_weights, Mapping) or not reward_weights:
        raise ValueError(
            f"{name} must be a non-empty mapping {{reward key: weight}}, got {reward_weights!r}."
        )
    weights = tuple((key, float(weight)) for key, weight in reward_weights.items())
    if not all(math.isfinite(weight) for _, weight in weights):
        raise ValueError(f"{name} must be finite, got {reward_weights!r}.")
    if rewards_key != ("next", "reward") and rewards_key not in dict(weights):
        raise ValueError(
            f"rewards_key={rewards_key!r} is not a key of {name} ({list(dict(weights))}): "
            "with several rewards, name them all there."
        )
    return weights


def _step_groups(kw: dict) -> StepGroups | None:
    """GiGPO's settings checked, with ROLL's defaults; ``None`` without ``anchor_key``."""
    given = {
        name: kw[name]
        for name in ("episode_reward_weight", "step_reward_weight", "step_reward_gamma")
    }
    if kw["anchor_key"] is None:
        named = [_named(kw, name) for name, value in given.items() if value is not None]
        if named:
            raise ValueError(
                f"{', '.join(named)} weigh GiGPO's step-level groups, which need anchor_key "
                "(StepGroups' anchor_key, the key of each step's anchor state)."
            )
        return None
    defaults = StepGroups()  # ROLL's, where not given
    values = [
        float(getattr(defaults, field) if value is None else value)
        for field, value in zip(("episode_weight", "step_weight", "gamma"), given.values())
    ]
    for name, value in zip(("episode_reward_weight", "step_reward_weight"), values[:2]):
        if not math.isfinite(value):
            raise ValueError(f"{_named(kw, name)} must be finite, got {value}.")
    if not 0.0 <= values[2] <= 1.0:
        raise ValueError(
            f"{_named(kw, 'step_reward_gamma')} must be in [0, 1], got {values[2]}: the "
            "discount of the step-level returns."
        )
    return StepGroups(*values)


REWARD_TO_GO_BASELINES = ("group", "time_step", "step_group")


def _reward_to_go_baseline(kw: dict) -> str:
    """``reward_to_go_baseline`` checked: one of :data:`REWARD_TO_GO_BASELINES`, and only
    chosen with ``reward_to_go_gamma``."""
    value, name = kw["reward_to_go_baseline"], _named(kw, "reward_to_go_baseline")
    if value not in REWARD_TO_GO_BASELINES:
        raise ValueError(f"{name} must be one of {list(REWARD_TO_GO_BASELINES)}, got {value!r}.")
    if value != "group" and kw["reward_to_go_gamma"] is None:
        raise ValueError(
            f"{name}, {value!r}, compares rewards-to-go: it needs RewardToGo's gamma "
            "(write RewardToGo(gamma, baseline=...))."
        )
    scale = kw["scale_rewards"]
    if value == "time_step" and getattr(SCALES[scale], "pooled", None) is None:
        raise ValueError(
            f"{_named(kw, 'scale_rewards')}, {scale!r}, has no form pooled over time steps (a "
            f"Scale of SCALES with pooled=...): {name} 'time_step' cannot use it."
        )
    return value


def _reward_to_go_gamma(kw: dict, trajectory_return: str | None) -> float | None:
    """``reward_to_go_gamma`` checked, as a float; ``None`` when off."""
    gamma, name = kw["reward_to_go_gamma"], _named(kw, "reward_to_go_gamma")
    if gamma is None:
        return None
    if isinstance(gamma, bool) or not isinstance(gamma, numbers.Real):
        raise TypeError(
            f"{name} must be a real number in [0, 1], got {gamma!r} ({type(gamma).__name__}): "
            "the discount."
        )
    if not 0.0 <= gamma <= 1.0:
        raise ValueError(f"{name} must be in [0, 1], got {gamma}: the discount.")
    if trajectory_return is not None:
        raise ValueError(
            f"{name} makes each step's sample its discounted reward-to-go, a per-step mode: "
            f"it requires trajectory_return=None, got trajectory_return={trajectory_return!r} "
            "(RewardToGo is a per-step estimator)."
        )
    if kw["anchor_key"] is not None:
        raise ValueError(
            f"{name} cannot be combined with {_named(kw, 'anchor_key')}: GiGPO's step level "
            "already compares discounted returns (StepGroups' gamma), over the raw rewards."
        )
    return float(gamma)

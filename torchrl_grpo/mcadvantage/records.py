"""The records an insertion passes from step to step, and the state it leaves: data only.

Every step module reads and builds these records and none defines one, so no step imports
another to know its record's shape. Records are immutable: an insertion builds a new
:class:`State` and the transform takes it only once the insertion went through (a rejected one
changes nothing). The settings are in :mod:`~torchrl_grpo.mcadvantage.options`.

Span tables (see :mod:`~torchrl_grpo.mcadvantage.store`) start with the columns ``CHUNK``,
``OFFSET``, ``LENGTH``; the fourth is named here for each table.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import torch
from torch import Tensor

from torchrl_grpo._segments import Segments
from torchrl_grpo.mcadvantage.store import Chunks

if TYPE_CHECKING:
    from tensordict import TensorDictBase

    from torchrl_grpo.mcadvantage.ids import GroupIds
    from torchrl_grpo.mcadvantage.registry import IdRegistry
    from torchrl_grpo.mcadvantage.steps import Elements, Steps

__all__ = [
    "LAST_COUNT",
    "NOTHING_RELEASED",
    "NO_VERSION",
    "QUEUED_AT",
    "STARTED_AT",
    "TAIL_ID",
    "TRAJ",
    "VERSION",
    "Insertion",
    "Joined",
    "Outcome",
    "Pending",
    "Released",
    "ReleasedGroups",
    "Returns",
    "Rounds",
    "Samples",
    "Sizes",
    "State",
    "Tails",
]

QUEUED_AT = 3  # ``Pending.spans``: the insertion that queued the trajectory (its age's start)
VERSION = 4  # ``Pending.spans``: the policy version that sampled it (``NO_VERSION``: unknown)
#: The policy version of a trajectory whose batch carried none.
NO_VERSION = torch.iinfo(torch.long).min
TRAJ = 3  # ``Tails.pieces``: the trajectory id of the piece
TAIL_ID, STARTED_AT, LAST_COUNT = range(3)  # the columns of ``Tails.meta``

# Empty tables, shared: a state's tensors are never written in place.
_NO_SPANS = torch.zeros(0, 4, dtype=torch.long)
_NO_PENDING_SPANS = torch.zeros(0, 5, dtype=torch.long)
_NO_META = torch.zeros(0, 3, dtype=torch.long)
_NO_VALUES = torch.zeros(0, dtype=torch.float64)


class Returns(NamedTuple):
    """The returns of some trajectories, in the two precisions the transform uses."""

    value: Tensor  # (n,) float64: what the advantage is computed from
    torchrl: Tensor | None  # (n,) reward dtype, reduced as torchrl does; None: not needed


class Insertion(NamedTuple):
    """One insertion, read and checked, split into trajectories (tensors 1-D, on the CPU)."""

    steps: Steps  # (N,) the steps, trajectory after trajectory
    starts: Tensor  # (n,) first step of each trajectory
    lengths: Tensor  # (n,) steps of each trajectory
    width: int  # the steps of every trajectory when all have as many, else 0
    group_ids: GroupIds  # (n,) one per trajectory, read at its first step
    rewards: Tensor  # (E,) every reward element, trajectory after trajectory (with several
    # rewards, their weighted sum in float64)
    reward_lengths: Tensor  # (n,) reward elements of each trajectory
    reward_width: int | None  # the same for reward elements; None: not known (found on use)
    num_steps: int  # N
    num_trajectories: int  # n
    versions: Tensor | None = None  # (n,) int64 policy version at each first step; None: none
    id_range: tuple | None = None  # (low, high, held): bounds of the integer group ids read
    # with the input, those of the pending ids ``held`` (a GroupIds, or None) included
    newest: int | None = None  # the largest of ``versions``, where read with the input


class Sizes(NamedTuple):
    """The sizes of what released rounds take and leave, read on the host with the rounds, so
    that gathering them and keeping the rest pending read nothing more."""

    pending: int  # released trajectories that were pending (they come first)
    incoming: int  # released trajectories that came with the insertion
    pending_steps: int  # the steps of the first
    incoming_steps: int  # the steps of the second
    width: int  # the steps of every released trajectory when all have as many, else 0
    taken: list | None  # steps taken from each chunk of the pending store; None: none pending
    left: list | None  # the pending spans left in each chunk
    left_steps: int  # the pending steps left (before the insertion's own are queued)
    longest: int | None = None  # the steps of the longest released trajectory


class Rounds(NamedTuple):
    """The complete groups an insertion releases ("rounds" of ``grpo_size`` trajectories).

    Trajectories are numbered pending first (``0 .. Q-1``, in arrival order), then incoming
    (``Q .. Q+n-1``).
    """

    members: Tensor  # (M,) released trajectories, increasing
    member_round: Tensor  # (M,) the released group of each member, in [0, num_rounds)
    num_rounds: int
    consumed: Tensor | None  # (Q + n,) bool: leave the pending store; None: none does
    given_up: int = 0  # candidate groups full without an accepted subset (torchrl: dropped)
    rescued: int = 0  # accepted only thanks to oversampling (torchrl's rescued_groups)
    unselected: int = 0  # candidates of selected groups left out (torchrl's counter)
    selected: int = 0  # groups the candidate selection selected (each attempt, as torchrl)
    filtered: bool = False  # the group filters were applied when the rounds were chosen
    sizes: Sizes | None = None  # read with the rounds; None: found where needed
    also: list | None = None  # the values of the caller's tensors read with them (find_rounds)


class Samples(NamedTuple):
    """The released trajectories' rewards, as the estimator reads them."""

    values: Tensor  # (E,) every reward element (float64 once weighted or discounted)
    dtype: torch.dtype  # the reward's, which the advantage is written in
    steps: Tensor  # (M,) steps of each released trajectory
    elems: Tensor  # (M,) reward elements of each
    elements: Elements  # how the reward elements lie on the steps
    width: int | None  # the steps of every trajectory when known to be equal (0: they differ)
    per_key: list | None  # with several rewards, each one's elements (or returns): K x (E,)
    num_steps: int  # S

    @property
    def elems_width(self) -> int | None:  # the reward elements of every trajectory, if equal
        return None if self.width is None else self.elements.run_width(self.width)

    def by_steps(self) -> Segments:  # each released trajectory as a run of its steps
        return Segments(None, lengths=self.steps, width=self.width, total=self.num_steps)

    def by_elems(self) -> Segments:  # ... and as a run of its reward elements
        total = self.values.shape[0]
        return Segments(None, lengths=self.elems, width=self.elems_width, total=total)


class ReleasedGroups(NamedTuple):
    """What an estimator reads of the groups a release writes (see
    :mod:`~torchrl_grpo.mcadvantage.estimators`)."""

    x: Tensor  # the samples: (M,) returns in a return mode, else (E,) every reward element
    runs: Tensor | None  # (M,) samples of each trajectory; None: one each (a return mode)
    member_round: Tensor  # (M,) the released group of each trajectory
    num_rounds: int
    samples: Samples  # the rewards' elements and how they lie on steps and trajectories
    steps: Steps  # the released steps (anchor states, tokens)
    keys: object  # the transform's Keys (mcadvantage.options)


class Released(NamedTuple):
    """What the released groups give storage."""

    out: TensorDictBase | None  # the steps to store, advantages written (None: nothing)
    written: int  # released groups that passed the filters
    selected: int  # released groups that passed selection; 0 for rounds chosen by candidate
    # selection, which counts its own
    metrics: dict | None = None  # the released turns' distillation statistics (0-d tensors)


#: What an insertion that completes no group releases.
NOTHING_RELEASED = Released(out=None, written=0, selected=0)


class Pending(NamedTuple):
    """The trajectories of incomplete groups, held in arrival order.

    Trajectory ``j`` is span ``spans[j]`` of ``chunks`` (its columns ``CHUNK``, ``OFFSET``,
    ``LENGTH``, ``QUEUED_AT``, ``VERSION``), has group id ``ids[j]`` and returns ``returns[j]``.
    """

    chunks: Chunks = Chunks()
    spans: Tensor = _NO_PENDING_SPANS  # (Q, 5)
    ids: GroupIds | None = None  # None: no id was ever held (any kind may come)
    returns: Returns = Returns(_NO_VALUES, None)  # torchrl's only with selection or bounds
    ragged: bool = False  # ragged steps were seen: steps are read as ragged from then on

    @property
    def num_pending(self) -> int:
        return self.spans.shape[0]


class Tails(NamedTuple):
    """What arrived of the trajectories that have not ended yet (``traj_key``).

    Tail ``h`` (trajectory ``meta[h, TAIL_ID]``) is the concatenation of its pieces in arrival
    order; piece ``p`` is span ``pieces[p]`` of ``chunks`` (columns ``CHUNK``, ``OFFSET``,
    ``LENGTH``, ``TRAJ``). ``meta`` is sorted by id; its columns are ``TAIL_ID``, ``STARTED_AT``
    (the insertion of the tail's first step) and ``LAST_COUNT`` (its last step count, ``-1``
    without a step counter).
    """

    chunks: Chunks = Chunks()
    pieces: Tensor = _NO_SPANS  # (P, 4), in arrival order
    meta: Tensor = _NO_META  # (H, 3)
    registry: IdRegistry | None = None  # which ids ended or were given up (shared, monotonic)

    @property
    def num_tails(self) -> int:
        return self.meta.shape[0]


class State(NamedTuple):
    """Everything one transform holds between insertions."""

    pending: Pending
    tails: Tails
    stats: dict  # the counters (see torchrl_grpo.mcadvantage.stats)
    insertions: int  # insertions that went through: the clock of the ages
    newest_version: int | None = None  # the newest policy version read so far (None: none)


class Joined(NamedTuple):
    """An insertion split by trajectory id and joined with the held tails."""

    complete: TensorDictBase | None  # (M,) steps of the completed trajectories, or None
    tails: Tails  # the tails held after the insertion
    ended: Tensor  # (c,) ids of the completed trajectories (to mark once committed)
    dropped_steps: int  # steps given up: arriving for given-up ids, or held for restarted ids
    dropped_tails: int = 0  # held tails given up because their id started again at step 0
    restarted: Tensor | None = None  # ids that ended before and started again (running again)
    stranded: int = 0  # groups of the held tails given up by a restart (they lost a member)
    top: int | None = None  # one more than the largest of ``ended``, where read (else None)


class Outcome(NamedTuple):
    """One insertion's result, applied only when it is committed."""

    out: TensorDictBase | None  # the steps to store, or None
    state: State  # the next state
    marks: tuple  # ((ids, status), ...) to mark in the tails' id registry on commit
    tops: tuple = ()  # one more than the largest id of each of the first marks, where read

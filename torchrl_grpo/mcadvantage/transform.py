"""``MCAdvantage``: the replay-buffer transform, as torchrl sees it.

The class turns its arguments into one checked :class:`~torchrl_grpo.mcadvantage.options.Options`
record, keeps its state in a :class:`~torchrl_grpo.mcadvantage.replica.Replica` (in this process,
or in an owner process once shared), and hands every insertion to it: the order of an insertion
is :func:`~torchrl_grpo.mcadvantage.insert.insert`. The rest is torchrl's surface: the settings
and counters as attributes, the statistics, the pending groups (:attr:`MCAdvantage.queues`) and
checkpoints.
"""

from __future__ import annotations

import os
import warnings

from tensordict import NestedKey, TensorDictBase
from torchrl.envs.transforms import Transform
from torchrl.objectives.llm import MCAdvantageSelector

from torchrl_grpo._compat import calling_replay_buffer
from torchrl_grpo.checkpoint import allow_empty_dumps
from torchrl_grpo.mcadvantage import shared
from torchrl_grpo.mcadvantage.buffer import check_release
from torchrl_grpo.mcadvantage.estimators import Distillation, Estimator
from torchrl_grpo.mcadvantage.options import (
    Limits,
    Options,
    Staleness,
    TrajectoryIds,
    deprecated_forms,
    make_options,
    read_setting,
    with_setting,
)
from torchrl_grpo.mcadvantage.queues import PendingGroups
from torchrl_grpo.mcadvantage.replica import Replica
from torchrl_grpo.mcadvantage.state_io import upgrade_state_dict

__all__ = ["MCAdvantage", "MCAdvantageSelector", "PendingGroups"]


class _Named(property):
    """A property that knows the name it is given in the class body."""

    def __set_name__(self, owner, name: str) -> None:
        self.name = name


class Setting(_Named):
    """A setting of the transform, read from its :class:`Options` and changed by replacing them
    (in the owner process too, once shared): no check beyond those of the step that reads it,
    as torchrl's attributes."""

    def __init__(self, doc: str):
        super().__init__(self._get, self._set, doc=doc)

    def _get(self, transform: MCAdvantage):
        return read_setting(transform._options, self.name)

    def _set(self, transform: MCAdvantage, value) -> None:
        transform._set_options(with_setting(transform._options, self.name, value))


class Statistic(_Named):
    """One of torchrl's counters (see :meth:`MCAdvantage.get_stats`), readable and settable."""

    def __init__(self, doc: str):
        super().__init__(self._get, self._set, doc=doc)

    def _get(self, transform: MCAdvantage):
        return transform._replica.counter(self.name)

    def _set(self, transform: MCAdvantage, value) -> None:
        transform._replica.set_counter(self.name, value)


class Size(_Named):
    """A size of what the transform holds (see :meth:`MCAdvantage.get_stats`), read-only."""

    def __init__(self, doc: str):
        super().__init__(self._get, doc=doc)

    def _get(self, transform: MCAdvantage):
        return transform._replica.stats()[self.name]


class MCAdvantage(Transform):
    """Group-relative Monte-Carlo advantages, written when a replay buffer is extended.

    A drop-in for :class:`torchrl.objectives.llm.MCAdvantage` (torchrl 0.14.1): the same
    arguments, defaults, validation errors, statistics and numbers, computed in a few tensor passes
    per insertion instead of a Python loop over trajectories. Append it to a
    :class:`~torchrl.data.ReplayBuffer`; every ``extend``/``add`` then

    1. flattens the input and splits it into trajectories at the done flags (each row of a
       ``[B, T]`` input must end with done), or, when the steps carry a trajectory id
       (``traj_key``, torchrl's ``("collector", "traj_ids")``), by id: a trajectory whose last
       step in the insertion is not done is held and joined with its continuation in later
       insertions, so that a collector's batches cut every ``frames_per_batch`` steps can be
       inserted as they come;
    2. reads each trajectory's group id at its first step: a string (the prompt) or a tensor
       (e.g. an environment seed), compared by value;
    3. queues trajectories by group id; when a group holds ``grpo_size`` trajectories it writes
       their ``advantage`` and releases them to storage, each trajectory in the order it arrived
       (an insertion released whole goes to storage as it came, without a copy). Groups still
       short of ``grpo_size`` stay pending (``None`` is returned if nothing completes).

    Advantages are the ``estimator``'s: by default GRPO's
    (:func:`~torchrl_grpo.advantages.group_relative_advantage`, as torchrl). With
    ``trajectory_return=None`` (torchrl's default) every reward element of every step of the group
    is one sample; otherwise each trajectory is reduced to one return and its advantage is
    broadcast to all its steps.

    What is held back is in :attr:`queues` (a live view: clearing it drops it), in
    ``state_dict()``, and in the statistics of :meth:`get_stats`. Appended to a buffer, the
    transform lets ``rb.dumps`` save the storage while nothing is stored yet.

    Args:
        grpo_size: trajectories per group (an integer, as every size below).
        prompt_key: key of the group id. Defaults to ``"query"``.
        rewards_key: key of the rewards. Defaults to ``("next", "reward")``.
        advantage_key: key written with the advantages. Defaults to ``"advantage"``.
        done_key: key of the done flags. Defaults to ``("next", "done")``.
        verbose: log each released group.

    Keyword Args:
        trajectory_return: ``None`` (per-step normalization), or how a trajectory's rewards become
            its return: ``"sum"``, ``"max"``, ``"mean"`` (torchrl) or ``"last"`` (step-wise GRPO:
            the final reward is broadcast to every step; Trinity-RFT's ``step_wise_grpo``,
            rLLM's ``broadcast``: an agent's turns are the steps of its dialog).
        keep_return_bounds: exclusive ``(low, high)`` bounds on a group's mean return; a group
            outside them is dropped (DAPO dynamic sampling), decided as torchrl decides it.
            Requires ``trajectory_return``.
        candidate_group_size: trajectories to collect before giving up on a group (oversampling).
            Defaults to ``grpo_size``; larger values require ``trajectory_return``.
        candidate_selection_min_size: candidates needed before the first selection attempt.
        candidate_selector: an :class:`MCAdvantageSelector` choosing ``grpo_size`` candidates.
        estimator (Estimator or str, optional): how a released group's samples become
            advantages, one object of :mod:`~torchrl_grpo.mcadvantage.estimators` holding all
            its settings (readable as ``transform.estimator.<setting>``), or a name of
            :data:`~torchrl_grpo.mcadvantage.ESTIMATORS` (``"grpo"``, ``"dr_grpo"``,
            ``"rloo"``, ``"reinforce_pp_baseline"``, ``"pass_at_k"``):

            - :class:`~torchrl_grpo.mcadvantage.GroupRelative` (default, torchrl's numbers):
              ``baseline`` (``"mean"``, ``"leave_one_out"``, ``"pass_at_k"``), ``scale_rewards``
              (``"group"``, ``"batch"``, ``"none"``), ``epsilon``, ``whiten``,
              ``std_threshold`` (groups at or below it dropped and counted in
              ``dropped_groups``; with a reward-to-go, the spread between trajectories at each
              time step), ``step_norm`` and GDPO's ``reward_weights`` (their keys replace
              ``rewards_key``; the filters, selection and statistics see the weighted sum);
            - :class:`~torchrl_grpo.mcadvantage.RewardToGo` ``(gamma, baseline, group=...)``:
              each step's discounted reward-to-go as its sample, compared with the group's mean
              (``"group"``), the mean at the same time step (``"time_step"``) or per (group,
              time step) (``"step_group"``); with ``trajectory_return=None``, computed at
              release on whole trajectories; ragged steps take it when every step has as many
              reward elements;
            - :class:`~torchrl_grpo.mcadvantage.StepGroups` ``(episode_weight, step_weight,
              gamma, anchor_key=..., group=...)``: GiGPO's step-level groups of equal anchor
              states, ``episode_weight * A_group + step_weight * A_step``;
            - :class:`~torchrl_grpo.mcadvantage.Distillation` ``(alpha, beta, gamma, ...,
              group=...)``: a teacher's per-token reverse KL, ``alpha * A_group - beta * D_t``
              on the response tokens (``rewards_key=None`` with ``alpha=0``: no reward read);
            - a subclass of :class:`~torchrl_grpo.mcadvantage.Estimator` overriding
              ``advantages(samples, group_index, num_groups)``: a user's own.

            The flat keywords of earlier versions (``baseline=``, ``scale_rewards=``,
            ``epsilon=``, ``whiten=``, ``std_threshold=``, ``step_norm=``, ``reward_weights=``,
            ``reward_to_go=``, ``reward_to_go_gamma=``, ``anchor_key=``, ``step_groups=``,
            ``distillation=``...) still work, with a ``DeprecationWarning`` that says what to
            write; given with an ``estimator``, they are refused.
        limits (Limits, optional): bounds on what is held back (the flat
            ``max_pending_groups``, ``max_pending_age``, ``on_overflow`` and ``min_group_size``
            are deprecated):

            max_groups (``max_pending_groups``): most incomplete groups held at once. ``None``
                (default): no limit.
            max_age (``max_pending_age``): a group still incomplete this many insertions after its
                first trajectory arrived is given up. ``None`` (default): no limit.
            on_overflow: what happens past a limit: ``"drop_oldest"`` (default) evicts the groups
                that started first, counts them in ``evicted_groups`` / ``evicted_trajectories`` and
                warns; ``"raise"`` rejects the insertion with a ``RuntimeError``, changing nothing.
                The storage's size is such a limit: a release larger than the buffer's storage
                overwrites its own first steps by default (torchrl's ring buffer; said once), and is
                refused with a ``ValueError`` under ``"raise"``, the trajectories still pending.
            min_group_size: with ``max_age``, a group still short of ``grpo_size`` when it reaches
                that age is released with the trajectories it holds if they are at least
                ``min_group_size`` (the runs that failed or timed out never come: Trinity-RFT takes
                such groups), its advantages computed over them as over any group (a group of one
                gets ``0``, where Trinity-RFT and verl give it its raw return); shorter, it is given
                up as before. It is released by the first insertion that brings a complete
                trajectory once it is that old, and counted in ``short_groups``. ``None`` (default):
                groups are released full only.
        traj_key (NestedKey or TrajectoryIds): key of the trajectory id of every step
            (``TrajectoryIds(key, step_count_key=...)`` names the step counter too). When the input
            has it, trajectories may cross insertions: the unfinished ones are held
            (:attr:`held_trajectories`) and completed by later insertions, with the same advantages
            as inserting each whole trajectory when its last step arrives (in the order of the last
            steps in the row-major flattened input). Ids must be unique across everything written
            through the transform (torchrl's collectors, multi-worker ones included, guarantee it);
            an id that comes back after its trajectory ended raises ``ValueError``. A held
            trajectory older than ``max_pending_age`` insertions is given up, and the steps of its
            id that arrive later are left out (``evicted_steps``). Negative ids (torchrl's frames a
            preemptive collector did not fill) are not data. Defaults to ``("collector",
            "traj_ids")``; ``None`` always splits at the done flags (torchrl's behaviour).
            ``step_count_key`` (of ``TrajectoryIds``; the flat ``step_count_key`` is
            deprecated): key of a step counter (torchrl's ``StepCounter`` writes
            ``"step_count"``), read with ``traj_key`` when the input has it: a trajectory must
            start at 0 and count up by one across insertions, so that a continuation whose
            earlier part is missing raises ``ValueError``. ``None``: not checked.
        policy_version_key: key of each step's policy version, an integer (torchrl's
            ``PolicyVersion`` transform, or a collector's ``track_policy_version``, writes
            ``"policy_version"``), read at each trajectory's first step when the input has it.
            A trajectory's *lag* is ``reference - version``, the reference being
            :attr:`consumer_version` when set, else the newest version read so far. Each
            insertion that completes groups reports their lags (``policy_lag_min``,
            ``policy_lag_max``, ``policy_lag_mean``) and the largest spread of versions inside
            one of them (``policy_version_spread``) in :meth:`get_stats`.

        staleness (Staleness, optional): how old the data may be, in policy versions (the flat
            ``max_policy_lag`` and ``consumer_version`` are deprecated):

            max_lag (``max_policy_lag``): with an integer ``K``, the trajectories (pending or
                arriving) that lag by more than ``K`` versions are dropped at each insertion and
                counted in ``stale_trajectories``, so that a group completes only with recent
                trajectories; the key must then be in every insertion. ``None`` (default): no bound.
            consumer_version: the reference version (the trainer's, as torchrl's
                ``StalenessAwareSampler.consumer_version``): set it after each weight update
                (``transform.consumer_version = version``). ``None`` (default): the newest version
                read.

    Raises:
        ValueError: for inconsistent arguments (same conditions as torchrl), and for the added
            ones: empty or non-finite ``reward_weights``, a ``rewards_key`` they leave out,
            ``StepGroups`` without ``anchor_key``, a discount outside ``[0, 1]``,
            ``RewardToGo`` with a ``trajectory_return``, an unknown estimator name (the known
            ones listed), an estimator given with a flat keyword it replaces, or a record with
            one of its flat keywords (both named).
        TypeError: for a size that is not an integer (``2.7``, ``True``), a discount that is
            not a real number, an estimator or record of the wrong kind.

    Examples:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> from torchrl.data import LazyTensorStorage, ReplayBuffer
        >>> from torchrl_grpo import MCAdvantage
        >>> rb = ReplayBuffer(storage=LazyTensorStorage(100), batch_size=4)
        >>> transform = MCAdvantage(grpo_size=2, prompt_key="seed", trajectory_return="sum")
        >>> _ = rb.append_transform(transform)
        >>> steps = TensorDict(  # two trajectories of seed 7, with returns 1 and 3
        ...     seed=torch.tensor([7, 7, 7, 7]),
        ...     next=TensorDict(
        ...         reward=torch.tensor([[0.0], [1.0], [1.0], [2.0]]),
        ...         done=torch.tensor([[False], [True], [False], [True]]),
        ...         batch_size=[4],
        ...     ),
        ...     batch_size=[4],
        ... )
        >>> _ = rb.extend(steps)
        >>> rb[:]["advantage"].squeeze(-1)
        tensor([-0.7071, -0.7071,  0.7071,  0.7071])
    """

    requires_shared_write_state = True

    def __init__(
        self,
        grpo_size: int,
        prompt_key: NestedKey = "query",
        rewards_key: NestedKey = ("next", "reward"),
        advantage_key: NestedKey = "advantage",
        done_key: NestedKey = ("next", "done"),
        verbose: bool = False,
        *,
        trajectory_return: str | None = None,
        keep_return_bounds: tuple[float, float] | None = None,
        candidate_group_size: int | None = None,
        candidate_selection_min_size: int | None = None,
        candidate_selector: MCAdvantageSelector | None = None,
        estimator: Estimator | str | None = None,
        traj_key: NestedKey | TrajectoryIds | None = ("collector", "traj_ids"),
        limits: Limits | None = None,
        staleness: Staleness | None = None,
        policy_version_key: NestedKey | None = "policy_version",
        **flat,
    ):
        super().__init__()
        options = make_options(
            grpo_size,
            prompt_key,
            rewards_key,
            advantage_key,
            done_key,
            verbose,
            trajectory_return=trajectory_return,
            keep_return_bounds=keep_return_bounds,
            candidate_group_size=candidate_group_size,
            candidate_selection_min_size=candidate_selection_min_size,
            candidate_selector=candidate_selector,
            estimator=estimator,
            traj_key=traj_key,
            limits=limits,
            staleness=staleness,
            policy_version_key=policy_version_key,
            **flat,  # the flat keywords of earlier versions (checked by make_options)
        )
        message = deprecated_forms(flat, options)
        if message is not None:
            warnings.warn(message, DeprecationWarning, stacklevel=2)
        keys = options.keys
        rewards = [k for k, _ in keys.reward_weights] or [keys.reward]
        self.in_keys = [prompt_key, *(key for key in rewards if key is not None), done_key]
        self.in_keys += options.estimator.in_keys()
        self.out_keys = [advantage_key]
        self._options = options
        self._replica = Replica(options)  # replaced by the owner's handle once shared
        self._buffer_searched = False  # looked for the buffer writing through this transform
        self._warned_overwrite = False  # said that releases overwrite stored steps
        self.register_load_state_dict_pre_hook(_read_earlier_checkpoints)

    # --- the settings (see the arguments) -------------------------------------------------------

    grpo_size = Setting("Trajectories per group.")
    verbose = Setting("Log each insertion.")
    prompt_key = Setting("Key of the group id.")
    rewards_key = Setting("Key of the rewards.")
    done_key = Setting("Key of the done flags.")
    advantage_key = Setting("Key written with the advantages.")
    trajectory_return = Setting("How a return is reduced.")
    keep_return_bounds = Setting("Dynamic sampling bounds.")
    candidate_group_size = Setting("Candidates per group.")
    candidate_selection_min_size = Setting("Candidates to try with.")
    candidate_selector = Setting("Picks among candidates.")
    max_pending_groups = Setting("Most incomplete groups held.")
    max_pending_age = Setting("Most insertions a group may wait.")
    on_overflow = Setting("``drop_oldest`` or ``raise``.")
    min_group_size = Setting("Fewest trajectories a group past its age is released with.")
    traj_key = Setting("Key of the trajectory ids.")
    step_count_key = Setting("Key of the step counter.")
    policy_version_key = Setting("Key of each step's policy version.")
    max_policy_lag = Setting("Most versions a trajectory may lag (``None``: no bound).")
    consumer_version = Setting("The version lags are measured from (``None``: the newest read).")

    @property
    def estimator(self) -> Estimator:
        """How advantages are computed, with every setting of it (``estimator.group.epsilon``,
        ``estimator.gamma``...): the object given, checked, or the one the flat keywords of
        earlier versions built."""
        return self._options.estimator

    @property
    def distillation(self) -> Distillation | None:
        """The estimator when it is a :class:`~torchrl_grpo.mcadvantage.Distillation` (its
        weights and keys), else ``None``: what ``distillation=`` used to hold."""
        estimator = self._options.estimator
        return estimator if isinstance(estimator, Distillation) else None

    def _set_options(self, options: Options) -> None:
        self._options = options
        self._replica.set_options(options)

    # --- torchrl's counters ----------------------------------------------------------------------

    completed_trajectories = Statistic("Trajectories inserted whole (or completed by their tail).")
    completed_decisions = Statistic("Their steps.")
    trajectory_return_sum = Statistic("Sum of their summed rewards (with a return mode).")
    trajectory_return_max = Statistic("Largest summed reward (with a return mode).")
    successful_trajectories = Statistic("Trajectories whose summed reward is positive.")
    completed_groups = Statistic("Groups complete (written or dropped).")
    written_groups = Statistic("Groups written to storage.")
    dropped_groups = Statistic("Groups dropped by the filters or given up by selection.")
    rescued_groups = Statistic("Groups accepted only thanks to oversampling.")
    selected_trajectories = Statistic("Trajectories of the groups that passed selection.")
    unselected_trajectories = Statistic("Candidates of selected groups left out.")
    evicted_groups = Statistic("Incomplete groups given up by the memory limits.")
    evicted_trajectories = Statistic("Their trajectories, and unfinished ones given up.")
    evicted_steps = Statistic("Steps of unfinished trajectories given up, held or arriving.")
    stale_trajectories = Statistic("Trajectories dropped for lagging past ``max_policy_lag``.")

    # --- where the state lives ---------------------------------------------------------------

    @property
    def is_shared(self) -> bool:
        """Whether the pending groups and statistics are shared between processes."""
        return not isinstance(self._replica, Replica)

    def share_memory_(self) -> MCAdvantage:
        """Share the pending groups and statistics with every process the transform goes to.

        Called by :meth:`torchrl.data.ReplayBuffer.share` (``ReplayBuffer(shared=True)``), so that
        trajectories of one group written by different processes complete one group. The state
        moves to an owner process (started once per process that shares, as torchrl's manager
        is), which every copy of the transform calls: an insertion sends its steps and gets back
        what it releases, whatever is pending. A writer killed in the middle of an insertion
        blocks no other, and its insertion is wholly in the state or wholly out (see
        ``docs/transform.rst``, "Many writers"). As in torchrl, setting
        ``TORCHRL_MC_ADVANTAGE_LOCAL_QUEUES=1`` keeps the state process-local.

        The settings go along, and a setting changed later reaches the owner.

        Returns:
            ``self``.

        Raises:
            TypeError: the transform cannot be pickled to its owner (a ``candidate_selector``
                whose class is defined inside a function).

        Examples:
            >>> from torchrl_grpo import MCAdvantage
            >>> t = MCAdvantage(grpo_size=2, prompt_key="seed").share_memory_()
            >>> t.is_shared, t.queued_trajectories
            (True, 0)
        """
        if self.is_shared or os.environ.get("TORCHRL_MC_ADVANTAGE_LOCAL_QUEUES") == "1":
            return self
        owner = shared.share(self._replica)
        self._replica = owner
        shared.finalize_with(self, owner)
        return self

    # --- checkpoints: the pending groups and counters travel in state_dict() --------------------

    def get_extra_state(self) -> dict:
        """What ``state_dict()`` holds under ``"_extra_state"``: every pending trajectory, the
        group ids, returns, counters and insertion clock, as tensors and plain Python values (so
        that ``torch.load(..., weights_only=True)`` reads it)."""
        return self._replica.to_plain()

    def set_extra_state(self, state: dict) -> None:
        """Restore what :meth:`get_extra_state` saved (``load_state_dict()`` calls it).

        Raises:
            RuntimeError: the checkpoint holds groups of another ``grpo_size``.
        """
        self._replica.load_plain(state)

    def set_container(self, container) -> None:
        """torchrl's hook when the transform is appended; also lets the buffer's storage be saved
        while still empty (see :mod:`torchrl_grpo.checkpoint`)."""
        super().set_container(container)
        self._buffer_searched = self._find_buffer()  # not found: look again at the next insertion

    def _find_buffer(self) -> bool:
        """Let the storage of the buffer calling into this transform be saved while empty."""
        buffer = calling_replay_buffer(self)
        if buffer is not None:
            allow_empty_dumps(buffer)
        return buffer is not None

    # --- torchrl's statistics API ----------------------------------------------------------------

    def reset_stats(self) -> None:
        """Reset the counters of write decisions (pending groups are kept)."""
        self._replica.reset_stats()

    def clear_queues(self) -> None:
        """Forget every pending trajectory, held unfinished ones included (statistics are kept).

        The ids of the held trajectories are given up: their steps that arrive later are left
        out (counted in ``evicted_steps``), rather than taken for new trajectories; the ids that
        ended are remembered (see :meth:`forget_trajectory_ids` after a restart).
        """
        self._replica.clear()

    def forget_trajectory_ids(self) -> None:
        """Forget which trajectory ids have ended, and give up the unfinished trajectories held
        (counted in ``evicted_trajectories`` / ``evicted_steps``); pending groups are kept.

        For a restart whose collector numbers its trajectories from 0 again, when the steps have
        no step counter: call it once the checkpoint is loaded. With a step counter (torchrl's
        ``StepCounter``) nothing is needed: a trajectory that starts at step 0 is a new one,
        whatever its id did before.

        Examples:
            >>> from torchrl_grpo import MCAdvantage
            >>> t = MCAdvantage(grpo_size=2, prompt_key="seed")
            >>> t.forget_trajectory_ids()
            >>> t.held_trajectories
            0
        """
        self._replica.forget_trajectory_ids()

    def get_stats(self) -> dict[str, float | int]:
        """A snapshot of the counters and of the pending queues' sizes.

        Returns:
            A dict with every name of torchrl's ``MCAdvantage.get_stats()``, and
            ``held_trajectories`` / ``held_steps`` (unfinished trajectories, ``traj_key``).

        Examples:
            >>> from torchrl_grpo import MCAdvantage
            >>> MCAdvantage(grpo_size=4).get_stats()["queued_trajectories"]
            0
        """
        return self._replica.stats()

    held_trajectories = Size("Trajectories whose first steps arrived but not their last.")
    queued_groups = Size("Incomplete groups held back.")
    queued_trajectories = Size("Trajectories held back in incomplete groups.")
    max_queued_trajectories_per_group = Size("Most trajectories held back for one group.")

    @property
    def queues(self) -> PendingGroups:
        """The pending groups, a live mapping ``group id -> trajectories`` (see
        :class:`~torchrl_grpo.mcadvantage.PendingGroups`): ``queues.clear()`` and
        ``del queues[group]`` drop pending trajectories, as with torchrl's queues."""
        return PendingGroups(lambda: self._replica)

    # --- the transform ---------------------------------------------------------------------------

    def forward(self, tensordict: TensorDictBase) -> TensorDictBase:
        """Identity: advantages are written on insertion (:meth:`inv`), not on sampling."""
        return tensordict

    def _inv_call(self, tensordict: TensorDictBase) -> TensorDictBase | None:
        if not self._buffer_searched:  # once: the buffer writing through us, if any
            self._find_buffer()
            self._buffer_searched = True
        return self._replica.insert(tensordict, check=self._check_release)

    def _check_release(self, out: TensorDictBase) -> None:
        """Refuse a release the calling buffer cannot store as steps (see
        :mod:`~torchrl_grpo.mcadvantage.buffer`)."""
        warned = self._warned_overwrite
        if check_release(self, out, warned=warned) != warned:
            self._warned_overwrite = True


def _read_earlier_checkpoints(module: MCAdvantage, state_dict, prefix, *args) -> None:
    """``load_state_dict``'s pre-hook: checkpoints written before the state was extra state."""
    upgrade_state_dict(state_dict, prefix, module.grpo_size)

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
from collections.abc import Mapping

from tensordict import NestedKey, TensorDictBase
from torchrl.envs.transforms import Transform
from torchrl.objectives.llm import MCAdvantageSelector

from torchrl_grpo._compat import calling_replay_buffer
from torchrl_grpo.checkpoint import allow_empty_dumps
from torchrl_grpo.mcadvantage import shared
from torchrl_grpo.mcadvantage.buffer import check_release
from torchrl_grpo.mcadvantage.options import (
    KEYWORDS,
    Distillation,
    Limits,
    Options,
    RewardToGo,
    Staleness,
    StepGroups,
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

    Advantages follow :func:`~torchrl_grpo.advantages.group_relative_advantage`. With
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
        reward_to_go (RewardToGo, optional): each step's discounted reward-to-go as its
            sample (the flat ``reward_to_go_gamma`` and ``reward_to_go_baseline`` are accepted
            too):

            gamma: ``None`` (default), or a discount ``gamma`` in ``[0, 1]`` that makes, with
                ``trajectory_return=None``, each step's sample its discounted reward-to-go instead
                of its reward: ``G_t = r_t + gamma * G_{t+1}`` with ``G_T = r_T`` at the
                trajectory's last step, i.e. ``G_t = sum over k >= t of gamma**(k - t) * r_k``
                (REINFORCE's reward-to-go, torchrl's ``reward2go``; see
                :func:`~torchrl_grpo.advantages.discounted_returns`). It is computed at release, on
                whole trajectories (joined across insertions with ``traj_key``), so a collector's
                ``frames_per_batch`` batches can be inserted as they come. A reward of several
                elements per step is discounted element by element (as ``reward2go`` does with
                trailing dimensions). ``0`` gives the rewards themselves, ``1`` the undiscounted sum
                to the end. Requires ``trajectory_return=None``; not with ``anchor_key`` (GiGPO
                discounts its step level with ``step_reward_gamma``). Ragged steps (an agent's
                turns, token sequences of different lengths) take it when every step has as many
                reward elements (torchrl's ``[1, 1]`` per turn). A group whose trajectories have
                equal rewards-to-go at every time step (identical episodes) gets advantages of
                exactly ``0``, as in the other modes.
            baseline: with ``gamma``, what each step's reward-to-go is compared with: ``"group"``
                (default), the mean over every step of the group's trajectories (a constant
                baseline: the steps that led to a fall get negative advantages even within one
                trajectory), or ``"time_step"``, the mean over the group's trajectories at the same
                time step (a time-dependent baseline; the scale is the pooled std of those
                deviations; see :func:`~torchrl_grpo.advantages.group_relative_advantage` with
                ``by_time_step``), or ``"step_group"``, each (group, time step) a GRPO group of its
                own, mean and std (rLLM's ``stepwise_advantage.mode="per_step"``: the turns of an
                agent's dialogs compared turn index by turn index; a turn only one dialog reached
                gets ``0``, where rLLM, through verl, gives it its raw return).
        keep_return_bounds: exclusive ``(low, high)`` bounds on a group's mean return; a group
            outside them is dropped (DAPO dynamic sampling), decided as torchrl decides it.
            Requires ``trajectory_return``.
        candidate_group_size: trajectories to collect before giving up on a group (oversampling).
            Defaults to ``grpo_size``; larger values require ``trajectory_return``.
        candidate_selection_min_size: candidates needed before the first selection attempt.
        candidate_selector: an :class:`MCAdvantageSelector` choosing ``grpo_size`` candidates.
        scale_rewards: ``"group"`` (default: per-group std), ``"batch"`` (std over every sample
            released by the same insertion, mean still per group) or ``"none"`` (Dr. GRPO).
        baseline: ``"mean"`` (default), ``"leave_one_out"`` (RLOO) or ``"pass_at_k"`` (GRPO
            pass@k, verl ``grpo_passk``: a group's unique best sample gets its gap to the
            runner-up, every other sample ``0``).
        std_threshold: groups whose sample std is at or below it are dropped and counted in
            ``dropped_groups`` (Trinity-RFT). ``None`` (default) keeps every group. With
            ``reward_to_go_gamma``, the std is the spread between the group's trajectories at
            each time step, so ``0`` drops groups of identical episodes.
        step_norm: divide each trajectory's advantages by its number of steps.
        epsilon: floor of the std (``clamp_min``). Defaults to ``1e-6``, as torchrl.
        whiten: after the baseline and the scale, whiten the advantages over every sample
            released by the same insertion: subtract their mean, divide by their std
            (REINFORCE++-baseline with ``scale_rewards="none"``). ``None`` (default): on with
            ``reward_weights`` (GDPO's batch normalization, as TRL), off otherwise.
        reward_weights: ``{reward key: weight}``, several rewards (GDPO, TRL's
            ``multi_objective_aggregation="normalize_then_sum"``): each is normalized within its
            group by ``baseline`` and ``scale_rewards``, then the weighted sum is taken (and
            whitened, see ``whiten``). Its keys replace ``rewards_key`` (the first one gives the
            advantage its shape); the group filters, candidate selection and statistics see the
            weighted sum of the rewards. ``None`` (default): the one reward under ``rewards_key``.
        anchor_key: key of each step's anchor state (a tensor compared by value: an id, a grid
            cell, an observation; or a string), for GiGPO's step-level groups: the steps of a
            released group with equal anchors form a step group, and each step's advantage
            becomes ``episode_reward_weight * A_group + step_reward_weight * A_step``, where
            ``A_step`` normalizes the step's discounted return (``step_reward_gamma``) within its
            step group by ``baseline`` and ``scale_rewards``. ``None`` (default): no step groups.
        step_groups (StepGroups, optional): with ``anchor_key``, the weights and discount of
            GiGPO's step level (ROLL's defaults; the flat ``episode_reward_weight``,
            ``step_reward_weight`` and ``step_reward_gamma`` are accepted too):

            episode_weight (``episode_reward_weight``): weight of the group-level advantage with
                ``anchor_key`` (default ``1.0``, ROLL's).
            step_weight (``step_reward_weight``): weight of the step-level advantage (default
                ``1.0``, ROLL's).
            gamma (``step_reward_gamma``): discount of the step-level returns (default ``0.95``,
                ROLL's).
        limits (Limits, optional): bounds on what is held back (the flat
            ``max_pending_groups``, ``max_pending_age``, ``on_overflow`` and ``min_group_size``
            are accepted too):

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
        traj_key: key of the trajectory id of every step. When the input has it, trajectories
            may cross insertions: the unfinished ones are held (:attr:`held_trajectories`) and
            completed by later insertions, with the same advantages as inserting each whole
            trajectory when its last step arrives (in the order of the last steps in the
            row-major flattened input). Ids must be unique across everything written through the
            transform (torchrl's collectors, multi-worker ones included, guarantee it); an id
            that comes back after its trajectory ended raises ``ValueError``. A held trajectory
            older than ``max_pending_age`` insertions is given up, and the steps of its id that
            arrive later are left out (``evicted_steps``). Negative ids (torchrl's frames a
            preemptive collector did not fill) are not data. Defaults to
            ``("collector", "traj_ids")``; ``None`` always splits at the done flags (torchrl's
            behaviour).
        step_count_key: key of a step counter (torchrl's ``StepCounter`` writes
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
            ``max_policy_lag`` and ``consumer_version`` are accepted too):

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
            keywords: empty or non-finite ``reward_weights``, a ``rewards_key`` they leave out,
            step-level weights without ``anchor_key``, a ``step_reward_gamma`` or a
            ``reward_to_go_gamma`` outside ``[0, 1]``, ``reward_to_go_gamma`` with a
            ``trajectory_return`` or an ``anchor_key``.
        TypeError: for a size that is not an integer (``2.7``, ``True``), a
            ``reward_to_go_gamma`` that is not a real number, a record of the wrong kind; and
            a record given with one of its flat keywords (``ValueError``).

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
        scale_rewards: str = "group",
        baseline: str = "mean",
        std_threshold: float | None = None,
        step_norm: bool = False,
        epsilon: float = 1e-6,
        whiten: bool | None = None,
        reward_weights: Mapping[NestedKey, float] | None = None,
        reward_to_go: RewardToGo | None = None,
        anchor_key: NestedKey | None = None,
        step_groups: StepGroups | None = None,
        limits: Limits | None = None,
        staleness: Staleness | None = None,
        distillation: Distillation | None = None,
        traj_key: NestedKey | None = ("collector", "traj_ids"),
        step_count_key: NestedKey | None = "step_count",
        policy_version_key: NestedKey | None = "policy_version",
        **flat,
    ):
        super().__init__()
        arguments = {name: value for name, value in locals().items() if name in _KEYWORDS}
        arguments.update(flat)  # the records' flat keywords (checked by make_options)
        options = make_options(
            grpo_size, prompt_key, rewards_key, advantage_key, done_key, verbose, **arguments
        )
        keys = options.keys
        rewards = [k for k, _ in keys.reward_weights] or [keys.reward]
        self.in_keys = [prompt_key, *(key for key in rewards if key is not None), done_key]
        self.in_keys += [anchor_key] if anchor_key is not None else []
        if distillation is not None:
            self.in_keys += [distillation.log_prob_key, distillation.teacher_key]
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
    anchor_key = Setting("Key of each step's anchor state (GiGPO).")
    trajectory_return = Setting("How a return is reduced.")
    reward_to_go_gamma = Setting("Discount of the per-step reward-to-go (``None``: off).")
    reward_to_go_baseline = Setting("``group``, ``time_step`` or ``step_group``.")
    baseline = Setting("``mean``, ``leave_one_out``, ``pass_at_k``.")
    scale_rewards = Setting("``group``, ``batch`` or ``none``.")
    epsilon = Setting("Floor of the scale.")
    step_norm = Setting("Divide by each trajectory's steps.")
    whiten = Setting("Whiten over the released samples.")
    keep_return_bounds = Setting("Dynamic sampling bounds.")
    std_threshold = Setting("Groups with a std at or below go.")
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
    def reward_weights(self) -> dict | None:
        """``{reward key: weight}`` (GDPO), or ``None`` for the one reward under ``rewards_key``."""
        return dict(self._options.keys.reward_weights) or None

    @property
    def distillation(self) -> Distillation | None:
        """On-policy distillation's weights and keys; ``None`` without a teacher."""
        return self._options.distillation

    @property
    def step_groups(self) -> StepGroups | None:
        """GiGPO's ``episode_weight``, ``step_weight`` and ``gamma``; ``None`` without anchors."""
        return self._options.estimator.step_groups

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


_KEYWORDS = frozenset(KEYWORDS)


def _read_earlier_checkpoints(module: MCAdvantage, state_dict, prefix, *args) -> None:
    """``load_state_dict``'s pre-hook: checkpoints written before the state was extra state."""
    upgrade_state_dict(state_dict, prefix, module.grpo_size)

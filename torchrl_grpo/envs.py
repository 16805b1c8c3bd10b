"""Environment transforms for GRPO on control tasks: groups of episodes that share their start.

GRPO's baseline for an episode is the mean return of its group. That mean stands in for a critic's
value of the starting state only if the episodes of a group start from the same state. A gymnasium
``reset(seed=s)`` draws the initial state from ``s``, so ``G`` episodes reset with one seed form a
group. :class:`SameStartGroups` is a torchrl env transform that does this under any torchrl
collector: it hands out reset seeds, each ``group_size`` times, and stamps every step with the
seed of its episode, the group id that :class:`~torchrl_grpo.MCAdvantage` reads.

Decisions, in one place:

* **A queue of seeds per transform.** Every (sub-)environment that resets takes the next seed of
  the queue ``seeds[0]`` x G, ``seeds[1]`` x G, ...; sub-environments reset in the same call are
  served in index order. So every seed is *started* exactly G times by one transform, whatever the
  batch size, the episode lengths or which sub-environments reset together, and the G episodes of
  a seed run at about the same time on neighbouring sub-environments.
* **Several transforms (collector workers, sub-envs of a ParallelEnv) need disjoint seeds.** The
  transforms of different processes share no state, so nothing counts seeds across them; each is
  given its own stream, e.g. ``seeds=range(worker, 2**31, num_workers)``. With disjoint streams
  every seed is still started exactly G times in total. Two transforms given overlapping seeds
  would each start a shared seed G times: this cannot be detected inside one process and is the
  caller's to avoid (the collector example below shows the worker index travelling through
  ``create_env_kwargs``).
* **The end of a run.** When collection stops, each transform's last group may have been started
  fewer than G times, and episodes still running never finish. Their groups never complete:
  :class:`~torchrl_grpo.MCAdvantage` holds them pending (``max_pending_*`` bound that) and writes
  no advantage for them. Counted as *started*, no seed is ever played more than G times.
* **How the seed reaches the environment.** torchrl gives a transform no way to add keyword
  arguments to the base env's reset, so after the base env has reset the selected
  sub-environments, this transform resets the same ones again through its parent with
  ``seed=...`` (the pattern of torchrl's ``NoopResetEnv``, which also acts through its parent).
  The first, unseeded reset is wasted work (about a third of a CartPole collector's time per
  step with an untrained policy, whose short episodes reset often; less once episodes are long:
  ``benchmarks/cartpole_seeds.py``); place the transform first, right on the base
  env, so that no other transform runs twice per reset. Supported parents: a gymnasium env behind
  ``GymEnv``/``GymWrapper``, a gymnasium vector env with ``autoreset_mode=DISABLED`` behind one
  ``GymWrapper`` (one seed per sub-env), and ``SerialEnv``/``ParallelEnv`` of single gymnasium
  envs (``list_of_kwargs``, one entry per worker). Anything else raises a ``TypeError`` rather
  than be reset unseeded.
* **Vector envs that reset themselves.** A gymnasium vector env in ``SAME_STEP`` mode (torchrl
  wraps it in ``VecGymEnvTransform``, as it does ``GymEnv(..., num_envs=N)``) restarts a finished
  sub-env by itself, from an unseeded state: a partial reset there cannot be seeded and raises.
  Full resets (``env.reset()``, the start of ``env.rollout``) are seeded, which is enough for an
  evaluation rollout with ``break_when_all_done=True``. Under a collector, which resets sub-envs
  one by one, such an env raises at the collector's first reset, before any training.
* **A reset that is never played gives its seed back.** A sub-env reset again before it took a
  step (a policy built lazily with ``policy(env.reset())``, then a collector that resets) is
  reset with the seed it already had: a seed is used up by an episode that steps. Episodes that
  did step outside the collector (``check_env_specs``, ``ObservationNorm.init_stats``) used up
  their seeds, and their steps never reach the buffer, so those groups never complete: call
  :meth:`SameStartGroups.rewind` after them, before the collector starts.
* **The group id is an observation.** ``out_key`` is declared in the observation spec (int64,
  one per sub-env, no trailing dim), written at reset and copied to ``("next", out_key)`` at
  every step, so it survives ``step_mdp``, collectors' buffers and ``ParallelEnv`` pipes. The
  number of episodes started is a buffer, saved by ``state_dict()``.
"""

from __future__ import annotations

import operator
import warnings
from collections import Counter
from collections.abc import Mapping, Sequence

import torch
from tensordict import NestedKey, TensorDictBase
from torchrl.data import Composite, Unbounded
from torchrl.envs import GymWrapper, ParallelEnv, SerialEnv, TransformedEnv
from torchrl.envs.transforms import Transform, VecGymEnvTransform

from torchrl_grpo import _compat

__all__ = ["SameStartGroups"]

DEFAULT_SEEDS = range(2**31)


class SameStartGroups(Transform):
    """Reset each (sub-)environment from a seed, every seed ``group_size`` times; stamp the seed.

    Every reset takes the next seed of the queue ``seeds[0]``, ..., ``seeds[0]`` (``group_size``
    times), ``seeds[1]``, ...; the sub-environments reset together are served in index order.
    Each step carries its episode's seed under ``out_key``: pass that key to
    :class:`~torchrl_grpo.MCAdvantage` as ``prompt_key`` and the G episodes of a seed form a
    group. It works under ``env.rollout`` and every torchrl collector; with several collector
    workers, give each worker its own seeds (below). The module docstring lists the decisions
    (partial resets, the end of a run, the double reset).

    Args:
        group_size: G, the episodes started from each seed; an integer of at least 1.
        seeds: the reset seeds, in the order they are used: a ``range`` or a sequence of distinct
            non-negative integers. Defaults to ``range(2**31)``. Several transforms that feed one
            buffer need disjoint seeds, e.g. ``range(worker, 2**31, num_workers)``.
        out_key: the key of the group id written on every step. Defaults to ``"reset_seed"``.

    Raises:
        ValueError: ``group_size`` or ``seeds`` invalid (at construction), the seeds exhausted,
            or a partial reset that cannot be seeded (a vector env that resets itself).
        TypeError: a parent env whose reset takes no seed.
        KeyError: a step whose input lacks ``out_key`` (a tensordict not from ``reset``).

    Examples:
        >>> import torch
        >>> from torchrl.envs import GymEnv, SerialEnv, TransformedEnv
        >>> from torchrl_grpo import SameStartGroups
        >>> env = TransformedEnv(
        ...     SerialEnv(3, lambda: GymEnv("CartPole-v1")), SameStartGroups(group_size=2)
        ... )
        >>> td = env.reset()
        >>> td["reset_seed"]  # sub-envs 0 and 1 play seed 0, sub-env 2 the first episode of seed 1
        tensor([0, 0, 1])
        >>> torch.equal(td["observation"][0], td["observation"][1])  # one start per group
        True
        >>> steps = env.rollout(5, auto_reset=False, tensordict=td)
        >>> steps["reset_seed"][:, 0], steps["next", "reset_seed"][:, -1]
        (tensor([0, 0, 1]), tensor([0, 0, 1]))
        >>> env.transform.episodes_started
        3

        With several collector workers, give each worker's env its own seeds
        (``test/test_envs.py`` runs this layout)::

            def make_env(worker, num_workers=2):
                seeds = range(worker, 2**31, num_workers)
                return TransformedEnv(GymEnv("CartPole-v1"), SameStartGroups(4, seeds))

            collector = MultiSyncCollector(
                [make_env, make_env], policy, frames_per_batch=400, total_frames=-1,
                create_env_kwargs=[{"worker": 0}, {"worker": 1}])
    """

    def __init__(
        self,
        group_size: int,
        seeds: Sequence[int] = DEFAULT_SEEDS,
        out_key: NestedKey = "reset_seed",
    ):
        super().__init__(in_keys=[], out_keys=[out_key])
        self._group_size = _check_group_size(group_size)
        self._seeds = _check_seeds(seeds)
        self.out_key = out_key
        self.register_buffer("_episodes_started", torch.zeros((), dtype=torch.long))
        self._unplayed = None  # (batch,) the seed each sub-env was reset with, -1 once it stepped
        self._running = None  # (batch,) the seed of each sub-env's episode, -1 before any reset
        self._restored_running: list[int] = []  # the running seeds a checkpoint held
        self._replays: list[int] = []  # seeds to start again before the queue goes on (resume)
        self._parent_checked = False

    # --- what a user reads ------------------------------------------------------------------

    @property
    def group_size(self) -> int:
        """G: how many episodes start from each seed."""
        return self._group_size

    @property
    def seeds(self) -> Sequence[int]:
        """The reset seeds, in the order they are used."""
        return self._seeds

    @property
    def episodes_started(self) -> int:
        """How many episodes this transform has seeded so far (a reset that is reset again
        before its first step counts once)."""
        return int(self._episodes_started)

    def rewind(self) -> None:
        """Start the seed queue again from its first seed, as if no episode had started.

        Call it after running the env outside the collector that feeds the buffer
        (``check_env_specs``, ``ObservationNorm.init_stats``, a trial rollout): those episodes
        used seeds whose steps never reach the buffer, so their groups could never complete.

        Examples:
            >>> from torchrl.envs import GymEnv, TransformedEnv
            >>> from torchrl_grpo import SameStartGroups
            >>> env = TransformedEnv(GymEnv("CartPole-v1"), SameStartGroups(4))
            >>> _ = env.rollout(3)  # a trial rollout: seed 0 played once, outside any collector
            >>> env.transform.rewind()
            >>> int(env.reset()["reset_seed"]), env.transform.episodes_started
            (0, 1)
        """
        self._episodes_started.zero_()
        self._unplayed = None
        self._running, self._restored_running = None, []
        self._replays = []

    # --- resuming from a checkpoint ---------------------------------------------------------

    @property
    def running_seeds(self) -> list[int]:
        """The seed of each (sub-)environment's current episode, in index order (none before the
        first reset): the episodes a checkpoint taken now cannot hold, since they are still
        being played."""
        if self._running is None:  # none yet, or a checkpoint's, restored
            return list(self._restored_running)
        return [s for s in self._running.reshape(-1).tolist() if s >= 0]

    @property
    def replays(self) -> list[int]:
        """The seeds queued by :meth:`resume` (or :meth:`replay`) and not yet started again."""
        return list(self._replays)

    def replay(self, seeds: Mapping[int, int]) -> None:
        """Start each seed ``seeds[s]`` more times before the queue goes on (in the order given).

        Raises:
            ValueError: a seed not among :attr:`seeds`, or a count below 0.

        Examples:
            >>> from torchrl_grpo import SameStartGroups
            >>> transform = SameStartGroups(2, seeds=range(10))
            >>> transform.replay({7: 1, 3: 2})
            >>> transform.replays
            [7, 3, 3]
        """
        extra = []
        for seed, count in seeds.items():
            if count < 0 or self._rank(seed) is None:
                raise ValueError(
                    f"{type(self).__name__}.replay: seed {seed!r} x {count!r} is not a "
                    f"non-negative count of one of {self.seeds!r}."
                )
            extra += [int(seed)] * int(count)
        self._replays += extra

    def resume(self, pending) -> dict[int, int]:
        """After a checkpoint is loaded: play again every episode the checkpoint could not hold.

        The episodes running at the checkpoint (:attr:`running_seeds`) and those that ended but
        never reached the buffer (held by a collector's ``trajs_per_batch``) are lost with the
        collector. For every seed that was running or whose group is pending, this queues the
        episodes it started that the buffer does not hold: each such group gets its ``G``
        episodes. Also forgets what ran: the next reset starts from the queue.

        A buffer that holds more episodes of a seed than this transform started (the buffer
        saved after the env state: a torn checkpoint) is refused, naming the seeds, before
        anything changes.

        A group can also have left the transform short of ``G`` (released short with
        ``min_group_size``, evicted by a limit, stale trajectories dropped): a running seed whose
        group is not pending is then ambiguous (its group may be gone, or none of its episodes
        had reached the buffer), and it is not played again, with one warning naming those
        seeds, so that no seed is started for a second group. Given a mapping, groups are taken
        to have left the transform complete only.

        Args:
            pending: the transform's pending groups, ``{group id: number of trajectories
                held}``, or the :class:`~torchrl_grpo.MCAdvantage` itself, whose unfinished
                trajectories (the running episodes' first steps) are then given up
                (:meth:`~torchrl_grpo.MCAdvantage.forget_trajectory_ids`).

        Returns:
            ``{seed: episodes queued again}``, the groups completed by the replays.

        Raises:
            ValueError: a pending group holds more episodes than its seed was started (the
                seeds named); nothing changed.

        Examples:
            >>> from torchrl.envs import GymEnv, TransformedEnv
            >>> from torchrl_grpo import SameStartGroups
            >>> env = TransformedEnv(GymEnv("CartPole-v1"), SameStartGroups(4))
            >>> _ = env.rollout(3, break_when_any_done=False)  # one episode of seed 0 running
            >>> state = env.transform.state_dict()  # ... a checkpoint; a fresh process:
            >>> fresh = TransformedEnv(GymEnv("CartPole-v1"), SameStartGroups(4))
            >>> _ = fresh.transform.load_state_dict(state)
            >>> fresh.transform.resume({})  # nothing of seed 0 reached the buffer
            {0: 1}
            >>> int(fresh.reset()["reset_seed"]), fresh.transform.episodes_started
            (0, 1)
        """
        short, advantage = False, None  # whether a group may have left the transform short
        if hasattr(pending, "forget_trajectory_ids"):  # an MCAdvantage
            stats = pending.get_stats()
            short = any(stats[k] for k in ("evicted_groups", "short_groups", "stale_trajectories"))
            advantage = pending
            pending = {group: len(held) for group, held in pending.queues.items()}
        self._check_started(pending)  # before anything changes
        if advantage is not None:
            advantage.forget_trajectory_ids()
        queued, running = Counter(self._replays), Counter(self.running_seeds)
        replays, ambiguous = {}, []
        for seed in dict.fromkeys([*running, *pending]):  # in order, each once
            rank = self._rank(seed)
            if rank is None:  # a pending group of another id: not this transform's
                continue
            missing = self._started(rank) - pending.get(seed, 0) - queued[seed]
            if short and seed not in pending:  # its group may be gone: never a second one
                ambiguous.append(seed)
                continue
            if missing > 0:
                replays[int(seed)] = missing
        if ambiguous:
            warnings.warn(
                f"{type(self).__name__}.resume: groups left the transform short of group_size "
                "before the checkpoint (released short, evicted or stale), so the running seeds "
                f"{ambiguous}, whose groups are not pending, are not played again (their group "
                "may be gone; a replay could start a second one): their episodes are lost.",
                RuntimeWarning,
                stacklevel=2,
            )
        self._running, self._restored_running, self._unplayed = None, [], None
        self.replay(replays)
        return replays

    def _check_started(self, pending: Mapping) -> None:
        """Refuse a buffer holding more episodes of a seed than this transform started: the
        buffer and the env state were saved at different times (a torn checkpoint)."""
        extra = {}
        for seed, held in pending.items():
            rank = self._rank(seed)
            if rank is not None and held > self._started(rank):
                extra[int(seed)] = (int(held), self._started(rank))
        if extra:
            named = ", ".join(f"seed {s}: {h} held, {n} started" for s, (h, n) in extra.items())
            raise ValueError(
                f"{type(self).__name__}.resume: the buffer holds episodes this transform never "
                f"started ({named}; {self.episodes_started} episodes started in all): the "
                "buffer and the env transform's state come from different saves (a torn "
                "checkpoint); nothing was changed. Load a buffer and a state saved together "
                "(torchrl_grpo.checkpoint.save_checkpoint stamps and checks them)."
            )

    def _rank(self, seed) -> int | None:
        """The position of ``seed`` in :attr:`seeds`, ``None`` if it is not there."""
        try:
            return self.seeds.index(seed)
        except (ValueError, TypeError):
            return None

    def _started(self, rank: int) -> int:
        """Episodes the queue started from the seed of ``rank`` (replays not counted)."""
        whole, part = divmod(self.episodes_started, self.group_size)
        return self.group_size if rank < whole else part if rank == whole else 0

    def get_extra_state(self) -> dict:
        """What ``state_dict()`` holds beside the count: the running seeds and the replays."""
        return {"running": self.running_seeds, "replays": list(self._replays)}

    def set_extra_state(self, state: dict) -> None:
        self._restored_running = [int(s) for s in state.get("running", [])]
        self._running = None  # the restored seeds are not this env's sub-envs
        self._replays = [int(s) for s in state.get("replays", [])]
        self._unplayed = None

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        missing = args[2] if len(args) > 2 else kwargs.get("missing_keys")
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        extra = prefix + "_extra_state"
        if missing is not None and extra in missing:  # a checkpoint from before resume()
            missing.remove(extra)

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(group_size={self.group_size}, seeds={self.seeds!r}, "
            f"out_key={self.out_key!r})"
        )

    # --- the seed queue ---------------------------------------------------------------------

    def _next_seeds(self, count: int) -> torch.Tensor:
        """The seeds of the next ``count`` episodes, shape ``(count,)``: the replays first, then
        the queue; both stay put."""
        replayed = torch.tensor(self._replays[:count], dtype=torch.long)
        if count == len(replayed):
            return replayed
        return torch.cat([replayed, self._queued_seeds(count - len(replayed))])

    def _queued_seeds(self, count: int) -> torch.Tensor:
        """The next ``count`` seeds of the queue, shape ``(count,)``; the queue stays put."""
        first = self.episodes_started
        ranks = range(first // self.group_size, (first + count - 1) // self.group_size + 1)
        if ranks.stop > len(self.seeds):
            raise ValueError(
                f"{type(self).__name__} ran out of seeds: {count} more episode(s) after "
                f"{first} started need seed number {ranks.stop - 1} (counting from 0) of "
                f"{self.seeds!r}, which has {len(self.seeds)}; pass more seeds."
            )
        group_seeds = torch.tensor([self.seeds[r] for r in ranks], dtype=torch.long)
        episode_rank = torch.arange(first, first + count) // self.group_size - ranks.start
        return group_seeds[episode_rank]

    # --- env hooks --------------------------------------------------------------------------

    def _reset(
        self, tensordict: TensorDictBase, tensordict_reset: TensorDictBase
    ) -> TensorDictBase:
        parent = self.parent
        if parent is None:
            raise RuntimeError(f"{type(self).__name__} must be appended to an environment.")
        if list(parent.reset_keys) != ["_reset"]:
            raise ValueError(
                f"{type(self).__name__} supports envs with the single reset key '_reset', got "
                f"reset keys {parent.reset_keys}."
            )
        batch = parent.batch_size
        reset = tensordict.get("_reset", None)
        if reset is None:
            mask = torch.ones(batch, dtype=torch.bool)
        else:
            mask = reset.reshape(*batch, -1).any(-1) if batch else reset.any()
            mask = mask.cpu()  # the seed queue is on the CPU whatever the env's device
        full = bool(mask.all())
        self._check_parent(parent, full)
        if not bool(mask.any()):
            return tensordict_reset
        seeds, new = self._seeds_for(mask)
        kwargs = _seed_kwargs(parent, mask, seeds)
        tensordict_reset = parent.reset(None if full else tensordict.select("_reset"), **kwargs)
        replayed = min(new, len(self._replays))  # only once the seeded reset went through:
        del self._replays[:replayed]
        self._episodes_started += new - replayed  # the replays first, then the queue
        self._unplayed = self._per_env(self._unplayed, batch)
        self._unplayed[mask] = seeds
        self._running = self._per_env(self._running, batch)
        self._running[mask] = seeds
        if self._restored_running:  # a checkpoint loaded, resume() not called
            _warn_not_resumed(self, self._restored_running)
        self._restored_running = []  # this env's own episodes now
        seed = torch.full(batch, -1, dtype=torch.long, device=tensordict_reset.device)
        seed[mask.to(seed.device)] = seeds.to(seed.device)
        return tensordict_reset.set(self.out_key, seed)

    def _check_parent(self, parent, full: bool) -> None:
        """A vector env that resets itself cannot seed a partial reset: an error then, and
        already at the first reset a collector makes (it will reset sub-envs one by one)."""
        check = not full
        if not self._parent_checked:
            self._parent_checked = True
            check = check or _compat.inside_collector()
        if check and _resets_itself(parent):
            raise ValueError(
                f"{type(self).__name__} cannot seed a partial reset of {parent.base_env}, and a "
                "collector resets its sub-envs one by one: this vector env restarts finished "
                "sub-envs by itself, from unseeded states (torchrl wraps it in "
                "VecGymEnvTransform). Build the gymnasium vector env with "
                "autoreset_mode=gymnasium.vector.AutoresetMode.DISABLED, or only reset it whole "
                "(an evaluation rollout)."
            )

    def _seeds_for(self, mask: torch.Tensor) -> tuple[torch.Tensor, int]:
        """The seeds of the sub-envs of ``mask``, in index order: the one it was last reset
        with if it has not stepped since, else the next of the queue; and how many are new."""
        unplayed = None if self._unplayed is None else self._unplayed[mask]
        if unplayed is None or not bool((unplayed >= 0).any()):
            count = int(mask.sum())
            return self._next_seeds(count), count
        fresh = unplayed < 0
        seeds = unplayed.clone()
        seeds[fresh] = self._next_seeds(int(fresh.sum()))
        return seeds, int(fresh.sum())

    @staticmethod
    def _per_env(seeds: torch.Tensor | None, batch: torch.Size) -> torch.Tensor:
        """``seeds`` if it holds one seed per sub-env of ``batch``, else ``-1`` for each."""
        if seeds is None or seeds.shape != batch:
            return torch.full(batch, -1, dtype=torch.long)
        return seeds

    def _reset_on_native_autoreset(
        self, tensordict: TensorDictBase, tensordict_reset: TensorDictBase
    ) -> TensorDictBase:
        raise ValueError(
            f"{type(self).__name__} cannot seed an env that resets itself inside step "
            "(native auto-reset); use an env whose finished sub-envs torchrl resets."
        )

    def _step(self, tensordict: TensorDictBase, next_tensordict: TensorDictBase) -> TensorDictBase:
        self._unplayed = None  # every sub-env stepped: its seed is used up
        seed = tensordict.get(self.out_key, None)
        if seed is None:
            raise KeyError(
                f"{type(self).__name__}: the step's input has no {self.out_key!r}: step the "
                "tensordict that env.reset() returned (or the previous step's, after step_mdp), "
                "as collectors and env.rollout do."
            )
        done = next_tensordict.get("done", None)
        batch = self.parent.batch_size if self.parent is not None else None
        if done is not None and self._running is not None and self._running.shape == batch:
            ended = done.reshape(*batch, -1).any(-1) if batch else done.any()  # runs no more
            self._running = self._running.masked_fill(ended.cpu(), -1)
        return next_tensordict.set(self.out_key, seed.clone())

    def transform_observation_spec(self, observation_spec: Composite) -> Composite:
        observation_spec[self.out_key] = Unbounded(
            shape=observation_spec.shape, dtype=torch.long, device=observation_spec.device
        )
        return observation_spec

    def forward(self, tensordict: TensorDictBase) -> TensorDictBase:
        raise RuntimeError(
            f"{type(self).__name__} resets environments: append it to an env "
            "(TransformedEnv(env, SameStartGroups(...))), not to a replay buffer or a module."
        )


# --- helpers ------------------------------------------------------------------------------------


def _warn_not_resumed(transform: SameStartGroups, seeds: list[int]) -> None:
    """The first reset after a checkpoint was loaded without :meth:`SameStartGroups.resume`:
    the episodes that were running are lost, and their groups can no longer complete."""
    warnings.warn(
        f"{type(transform).__name__}: a checkpoint was loaded and the env reset without "
        f"{type(transform).__name__}.resume(advantage): the episodes of seeds "
        f"{sorted(set(seeds))}, running at the checkpoint, will never be played, so their "
        "groups can no longer complete (they stay pending in MCAdvantage: see "
        "queued_groups). Call env.transform.resume(advantage) after loading the checkpoint, "
        "before the collector starts: it plays them again.",
        RuntimeWarning,
        stacklevel=3,
    )


def _check_group_size(group_size) -> int:
    try:
        value = operator.index(group_size)  # 2.7 and "4" are refused, not rounded
    except TypeError:
        raise ValueError(f"group_size must be an integer, got {group_size!r}.") from None
    if isinstance(group_size, bool) or value < 1:
        raise ValueError(f"group_size must be an integer of at least 1, got {group_size!r}.")
    return value


def _check_seeds(seeds) -> Sequence[int]:
    if isinstance(seeds, torch.Tensor):
        seeds = seeds.tolist()
    if isinstance(seeds, range):
        if len(seeds) == 0 or min(seeds[0], seeds[-1]) < 0:
            raise ValueError(f"seeds must be non-empty and non-negative, got {seeds!r}.")
        return seeds
    if not isinstance(seeds, Sequence) or isinstance(seeds, (str, bytes)):
        raise ValueError(f"seeds must be a range or a sequence of integers, got {seeds!r}.")
    values = []
    for i, seed in enumerate(seeds):
        try:
            value = operator.index(seed)
        except TypeError:
            raise ValueError(f"seeds[{i}] must be an integer, got {seed!r}.") from None
        if isinstance(seed, bool) or value < 0:
            raise ValueError(f"seeds[{i}] must be a non-negative integer, got {seed!r}.")
        values.append(value)
    if not values:
        raise ValueError("seeds must not be empty.")
    if len(set(values)) != len(values):
        twice = sorted({v for v in values if values.count(v) > 1})
        raise ValueError(
            f"seeds must be distinct (a repeated seed would be played more than group_size "
            f"times), got {twice} more than once."
        )
    return tuple(values)


def _base(env):
    while isinstance(env, TransformedEnv):
        env = env.base_env
    return env


def _resets_itself(env) -> bool:
    """Whether ``env`` (or a transform in it) restarts finished sub-envs by itself."""
    while isinstance(env, TransformedEnv):
        transforms = getattr(env.transform, "transforms", [env.transform])
        if any(isinstance(t, VecGymEnvTransform) for t in transforms):
            return True
        env = env.base_env
    return False


def _seed_kwargs(env, mask: torch.Tensor, seeds: torch.Tensor) -> dict:
    """The keyword arguments of ``env.reset`` that seed the sub-envs selected by ``mask``.

    Args:
        env: the parent env, of batch size ``B`` (possibly ``()``).
        mask: which sub-envs reset, shape ``B``.
        seeds: their seeds, shape ``(mask.sum(),)``, in index order.
    """
    base = _base(env)
    per_env = torch.full(mask.shape, -1, dtype=torch.long)
    per_env[mask] = seeds
    if isinstance(base, (SerialEnv, ParallelEnv)):  # one kwargs dict per worker
        workers = per_env.reshape(base.num_workers, -1)
        sub_batched = len(env.batch_size) > 1
        return {"list_of_kwargs": [{"seed": _gym_seed(row, sub_batched)} for row in workers]}
    if isinstance(base, GymWrapper):
        return {"seed": _gym_seed(per_env.reshape(-1), len(env.batch_size) > 0)}
    raise TypeError(
        f"SameStartGroups needs an env whose reset takes a gymnasium seed (GymEnv, GymWrapper, "
        f"or SerialEnv/ParallelEnv of those), got {type(base).__name__}."
    )


def _gym_seed(seeds: torch.Tensor, batched: bool):
    """gymnasium's ``seed=``: an int for one env, a list (``None``: not reset) for a vector env."""
    values = [s if s >= 0 else None for s in seeds.tolist()]
    return values if batched else values[0]

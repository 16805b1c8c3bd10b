"""Where a transform's settings and state live, and every operation on them.

A :class:`Replica` holds one transform's :class:`~torchrl_grpo.mcadvantage.options.Options` and
:class:`~torchrl_grpo.mcadvantage.records.State`, and runs every operation on them under one
lock: insertions (:func:`~torchrl_grpo.mcadvantage.insert.insert`), the counters, the view of
the pending groups, checkpoints. It is in the transform's own process, or, once the transform is
shared, in the owner process (:mod:`~torchrl_grpo.mcadvantage.shared`), whose handle offers the
same operations (:data:`OPERATIONS`) to every copy of the transform.
"""

from __future__ import annotations

import torch
from tensordict import TensorDictBase

from torchrl_grpo.mcadvantage import pending as pending_
from torchrl_grpo.mcadvantage import state_io
from torchrl_grpo.mcadvantage.insert import commit, insert
from torchrl_grpo.mcadvantage.options import Options
from torchrl_grpo.mcadvantage.records import TAIL_ID, Outcome, Pending, State, Tails
from torchrl_grpo.mcadvantage.registry import GIVEN_UP
from torchrl_grpo.mcadvantage.stats import fresh_stats, plain, snapshot
from torchrl_grpo.mcadvantage.store import LENGTH

__all__ = ["OPERATIONS", "NoLock", "Replica", "fresh_state"]

#: The operations a shared transform's copies ask of its owner process, by name.
OPERATIONS = frozenset(
    {
        "stats",
        "counter",
        "set_counter",
        "reset_stats",
        "clear",
        "forget_trajectory_ids",
        "group_ids",
        "trajectories",
        "drop_group",
        "pop_group",
        "to_plain",
        "load_plain",
        "set_options",
    }
)


def fresh_state() -> State:
    """The state of a transform that holds nothing and has counted nothing."""
    return State(pending=Pending(), tails=Tails(), stats=fresh_stats(), insertions=0)


class NoLock:
    """The lock of a transform used by one process: none."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class Replica:
    """One transform's settings and state, and the operations on them, each under ``lock``.

    Args:
        options: the settings.
        state: the state (default: a fresh one).
        lock: held by every operation (default: none; the owner process shares one between the
            transforms it holds).
    """

    def __init__(self, options: Options, state: State | None = None, lock=None):
        self.options = options
        self.state = fresh_state() if state is None else state
        self.lock = NoLock() if lock is None else lock

    # --- insertions ------------------------------------------------------------------------

    def insert(self, tensordict: TensorDictBase, check=None) -> TensorDictBase | None:
        """Insert ``tensordict`` and commit: the steps to store, or ``None``. ``check(steps)``,
        if given, sees the steps to store before the commit, and may refuse them by raising."""
        with self.lock:
            outcome = insert(self.options, self.state, tensordict)
            if check is not None and outcome.out is not None:
                check(outcome.out)
            self.commit(outcome)
        return outcome.out

    def attempt(self, tensordict: TensorDictBase) -> Outcome:
        """Insert ``tensordict`` without committing (the owner commits once the writer has
        taken the released steps)."""
        return insert(self.options, self.state, tensordict)

    def commit(self, outcome: Outcome) -> None:
        """Make ``outcome``'s state the state."""
        self.state = commit(outcome.state, outcome.marks, outcome.tops)

    # --- counters ----------------------------------------------------------------------------

    def stats(self) -> dict:
        """The counters and the sizes of what is held (``get_stats()``)."""
        with self.lock:
            return snapshot(self.state)

    def counter(self, name: str):
        with self.lock:
            return plain({name: self.state.stats[name]})[name]

    def set_counter(self, name: str, value) -> None:
        with self.lock:
            self.state = self.state._replace(stats={**self.state.stats, name: value})

    def reset_stats(self) -> None:
        with self.lock:
            self.state = self.state._replace(stats=fresh_stats())

    # --- what is held ------------------------------------------------------------------------

    def clear(self) -> None:
        """Forget every pending trajectory and held tail (the counters are kept); the held
        tails' ids are given up, so that their later steps are left out."""
        with self.lock:
            tails = self.state.tails
            if tails.num_tails:
                tails.registry.mark(tails.meta[:, TAIL_ID], GIVEN_UP)
            self.state = self.state._replace(
                pending=Pending(), tails=Tails(registry=tails.registry), insertions=0
            )

    def forget_trajectory_ids(self) -> None:
        """Forget which trajectory ids ended, and give up the held tails (counted in
        ``evicted_*``): the ids that come next start new trajectories."""
        with self.lock:
            state = self.state
            tails, stats = state.tails, dict(state.stats)
            stats["evicted_trajectories"] += tails.num_tails
            stats["evicted_steps"] += int(tails.pieces[:, LENGTH].sum())
            self.state = state._replace(tails=Tails(), stats=stats)

    def group_ids(self) -> list:
        """The group id of every pending trajectory, in arrival order, as torchrl keys them."""
        with self.lock:
            pending = self.state.pending
            return pending.ids.python() if pending.num_pending else []

    def trajectories(self, group) -> tuple[TensorDictBase, ...]:
        """The pending trajectories of ``group``, in arrival order.

        Raises:
            KeyError: no trajectory of ``group`` is pending.
        """
        with self.lock:
            positions = self._positions(group)
            return tuple(pending_.trajectory(self.state.pending, None, j) for j in positions)

    def drop_group(self, group) -> None:
        """Forget the pending trajectories of ``group``.

        Raises:
            KeyError: no trajectory of ``group`` is pending.
        """
        with self.lock:
            keep = torch.ones(self.state.pending.num_pending, dtype=torch.bool)
            keep[self._positions(group)] = False
            self.state = self.state._replace(pending=pending_.drop(self.state.pending, keep))

    def pop_group(self, group, *default):
        """Forget the pending trajectories of ``group`` and return them (``default`` if none
        is pending)."""
        with self.lock:
            if default and group not in self.group_ids():
                return default[0]
            trajectories = self.trajectories(group)
            self.drop_group(group)
            return trajectories

    def _positions(self, group) -> list[int]:
        positions = [j for j, key in enumerate(self.group_ids()) if key == group]
        if not positions:
            raise KeyError(group)
        return positions

    # --- settings and checkpoints ------------------------------------------------------------

    def set_options(self, options: Options) -> None:
        with self.lock:
            self.options = options

    def to_plain(self) -> dict:
        """What ``state_dict()`` holds under ``"_extra_state"``."""
        with self.lock:
            return {"pending": state_io.to_plain(self.state), "grpo_size": self.options.grpo_size}

    def load_plain(self, plain: dict) -> None:
        """Restore what :meth:`to_plain` saved.

        Raises:
            RuntimeError: the checkpoint holds groups of another ``grpo_size``.
        """
        grpo_size = self.options.grpo_size
        if plain["grpo_size"] != grpo_size:
            raise RuntimeError(
                f"MCAdvantage: the checkpoint holds groups of grpo_size={plain['grpo_size']}, "
                f"this transform has grpo_size={grpo_size}."
            )
        with self.lock:
            self.state = state_io.from_plain(plain["pending"])

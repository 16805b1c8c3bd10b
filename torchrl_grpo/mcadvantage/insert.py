"""One insertion, in order: :func:`insert` is the whole path of a batch through the transform.

Both the transform (:class:`~torchrl_grpo.mcadvantage.replica.Replica`, in its own process) and
the owner process of a shared transform run it. It is a function of the settings, the state and
the input: it returns the steps to store, the next state and the trajectory ids to mark, and
changes nothing; the caller makes the next state the state (:func:`commit`) once the insertion
went through. Everything that can be wrong with the input raises before a next state exists.
"""

from __future__ import annotations

import itertools

from tensordict import TensorDictBase
from torchrl import torchrl_logger

from torchrl_grpo.mcadvantage import (
    groups,
    limits,
    pending,
    read,
    release,
    returns,
    staleness,
    tails,
)
from torchrl_grpo.mcadvantage import stats as stats_
from torchrl_grpo.mcadvantage.options import Options
from torchrl_grpo.mcadvantage.records import NOTHING_RELEASED, Outcome, State
from torchrl_grpo.mcadvantage.registry import ENDED, RUNNING

__all__ = ["commit", "insert"]


def insert(options: Options, state: State, tensordict: TensorDictBase) -> Outcome:
    """Insert ``tensordict`` (what ``rb.extend`` / ``rb.add`` received) into ``state``.

    1. Trajectories that cross insertions are joined with the held tails (``traj_key``); the
       unfinished ones are held.
    2. The complete trajectories are read and checked: steps, bounds, rewards, group ids and
       policy versions; with ``max_policy_lag``, the stale ones (pending or incoming) go.
    3. Their returns are computed (float64, and torchrl's where its rules compare them).
    4. The groups now complete are found: rounds of ``grpo_size``, or candidate selection.
    5. Their advantages are written and the groups the filters keep are released.
    6. The counters are updated, and what no group released stays pending.
    7. The memory limits give up what waited too long.

    Raises:
        KeyError, ValueError, TypeError, RuntimeError, NotImplementedError: a bad input, or a
            limit with ``on_overflow="raise"``; the state is then as it was.
    """
    clock = state.insertions + 1
    tensordict = read.drop_padding(tensordict)  # a collector's split_trajs padding is not data
    state, marks, tops, complete = _join_tails(options, state, tensordict)  # 1.
    batch = None
    if complete is not None:  # 2.
        required = options.staleness.max_lag is not None
        batch = read.read_insertion(complete, options.keys, state.pending, required)
    state, batch = staleness.drop_stale(options, state, batch)
    if batch is None:  # nothing completes, no step, or only stale trajectories
        return _finish(options, None, state._replace(insertions=clock), marks, tops)
    # what the estimator cannot compute on is refused before any wait (a step the teacher
    # did not score, rewards a reward-to-go cannot discount)
    options.estimator.check_insertion(batch, options.keys.reward, options.trajectory_return)
    trajectory_return, group_filter = options.trajectory_return, options.group_filter  # 3.
    exact = options.selects or group_filter.keep_return_bounds is not None
    incoming = returns.insertion_returns(batch, trajectory_return, exact=exact)
    all_returns = None  # pending's then incoming's: where a group is chosen by them or released
    if options.selects:  # 4.
        all_returns = returns.concat(state.pending.returns, incoming)
        rounds = groups.select_candidates(
            state.pending, batch, options.selection, options.grpo_size, all_returns, group_filter
        )
    else:
        bounds = options.limits
        short = None
        if bounds.min_group_size is not None:  # groups short past Limits.max_age: released
            short = (bounds.min_group_size, bounds.max_age, clock)
        tally = stats_.tally(batch, incoming.value, trajectory_return)  # read with
        rounds = groups.find_rounds(state.pending, batch, options.grpo_size, short, tally)
    released = NOTHING_RELEASED  # 5.
    if rounds.num_rounds:
        all_returns = (
            returns.concat(state.pending.returns, incoming) if all_returns is None else all_returns
        )
        released = release.release(state.pending, batch, rounds, all_returns, options)
    stats = stats_.count(  # 6.
        state.stats,
        batch,
        incoming.value,
        rounds,
        released,
        trajectory_return=trajectory_return,
        group_size=options.grpo_size,
        tallied=rounds.also,
    )
    if rounds.num_rounds and trajectory_return is not None:
        stats = stats_.group_stats(stats, all_returns.value, rounds, options.grpo_size)
    if released.metrics:
        stats = {**stats, **released.metrics}
    reference = staleness.reference(options, state.newest_version)
    stats = staleness.lag_stats(stats, state.pending, batch, rounds, reference)
    held = pending.remaining(
        state.pending, batch, rounds.consumed, incoming, state.insertions, rounds.sizes
    )
    if options.verbose:
        _log(batch.num_trajectories, rounds, released, held.num_pending, stats)
    state = State(held, state.tails, stats, clock, state.newest_version)
    return _finish(options, released.out, state, marks, tops)


def commit(state: State, marks: tuple, tops: tuple = ()) -> State:
    """Record in the tails' id registry the trajectory ids an insertion ended or gave up, and
    return its state, now the transform's. ``tops``: one more than the largest id of each of
    the first marks, where the insertion read it."""
    for (ids, status), top in itertools.zip_longest(marks, tops):
        state.tails.registry.mark(ids, status, top)
    return state


def _join_tails(options: Options, state: State, tensordict: TensorDictBase):
    """``(state, marks, tops, complete)``: with trajectory ids, the state with the next tails,
    the ids that end to mark (with one more than the largest, where read), and the complete
    trajectories (or ``None``); else the input as is."""
    dense = tails.streamed(state.tails, tensordict, options.trajectory_keys)
    if dense is None:
        return state, (), (), tensordict
    checks = read.arrival_checks(dense, options.keys)  # a NaN refused now, not held
    joined = tails.join(state.tails, dense, options.trajectory_keys, state.insertions, checks)
    stats = state.stats
    if joined.dropped_steps:  # steps of given-up trajectories, left out
        stats = {
            **stats,
            "evicted_steps": stats["evicted_steps"] + joined.dropped_steps,
            "evicted_trajectories": stats["evicted_trajectories"] + joined.dropped_tails,
            "stranded_groups": stats["stranded_groups"] + joined.stranded,
        }
    state = state._replace(tails=joined.tails, stats=stats)
    marks, tops = ((joined.ended, ENDED),), (joined.top,)
    if joined.restarted is not None and joined.restarted.numel():  # before their end, if any
        marks, tops = ((joined.restarted, RUNNING), *marks), ()
    return state, marks, tops, joined.complete


def _finish(options: Options, out, state: State, marks: tuple, tops: tuple) -> Outcome:
    state, marks = limits.apply_limits(options.limits, state, marks)  # 7.
    limits.warn_if_stuck(options.grpo_size, state)
    return Outcome(out, state, marks, tops)


def _log(trajectories: int, rounds, released, pending: int, stats: dict) -> None:
    dropped = rounds.num_rounds - released.written + rounds.given_up
    torchrl_logger.info(
        f"MCAdvantage: {trajectories} trajectories in, {released.written} groups written, "
        f"{dropped} dropped, {pending} trajectories pending, "
        f"{stats['stale_trajectories']} stale so far."
    )

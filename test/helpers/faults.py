"""The fault suite's loop (``test/faults``): a small GRPO run that a test kills and resumes.

:func:`run` is the loop the examples run, cut to what a fault can break: CartPole episodes on a
gymnasium vector env, seeded in groups of :data:`GROUP` by ``SameStartGroups``, joined and
grouped by ``MCAdvantage`` in a ``ReplayBuffer``; "training" on a batch records which groups it
released (the *ledger*: ``{seed: episodes}`` per batch) and empties the buffer, and every batch
ends with a checkpoint (``torchrl_grpo.checkpoint.save_checkpoint``: the buffer, the env
transform's state, the ledger). A run stops once every seed below :data:`SEEDS_TRAINED` was
trained. The policy pushes the cart toward the centre, a function of the observation: the
episodes of a seed are the same in every process.

A fault is a plan ``{"at": name, "batch": b, "write": k}``: the process kills itself with
``SIGKILL`` at the point ``name`` of batch ``b`` (``"collected"``, ``"extended"``, ``"trained"``)
or, with ``"at": "save"``, after the ``k``-th write of that batch's save (through the package's
private seam ``torchrl_grpo.checkpoint._after_write``), or halfway through writing its state
file (``"write": "half"``). :func:`drive` runs plans in forked children of one process (the
imports paid once): each killed run, then its resume, and reports the ledgers as JSON::

    python test/helpers/faults.py <work folder> <plans.json>
"""

from __future__ import annotations

import functools
import io
import json
import os
import signal
import sys
import traceback
from collections import Counter
from pathlib import Path

GROUP = 3  # G: episodes per seed (4 sub-envs: a group is often split over resets)
ENVS = 4  # sub-environments
FRAMES = 48  # steps per collector batch (12 per sub-env): episodes cross batches
SEEDS_TRAINED = 5  # a run stops once seeds 0..4 are trained
MAX_BATCHES = 80  # a run that loses a group never covers them: it stops here
#: The writes of one save after the first: its two pieces, the manifest, the swap's renames and
#: the removal of the previous checkpoint (the first save has nothing to move aside).
SAVE_WRITES = ("piece buffer", "piece state", "manifest", "moved aside", "in place", "removed")


def _kill() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _arm(plan: dict | None, batch: int) -> None:
    """Before batch ``batch``'s save: kill after its ``plan["write"]``-th write, or halfway
    through writing its state file."""
    from torchrl_grpo import checkpoint

    if plan is None or plan["at"] != "save" or plan["batch"] != batch:
        checkpoint._after_write = None
        return
    if plan["write"] == "half":
        real = checkpoint.torch.save

        def half_save(obj, file, *args, **kwargs):
            if not (hasattr(file, "write") and str(file.name).endswith("state.pt")):
                return real(obj, file, *args, **kwargs)
            data = io.BytesIO()
            real(obj, data, *args, **kwargs)
            file.write(data.getvalue()[: len(data.getvalue()) // 2])
            file.flush()
            _kill()

        checkpoint.torch.save = half_save
        return
    writes = []

    def after(what: str) -> None:
        writes.append(what)
        if writes[-1] == plan["write"]:
            _kill()

    checkpoint._after_write = after


def _fault(plan: dict | None, at: str, batch: int) -> None:
    if plan is not None and plan["at"] == at and plan["batch"] == batch:
        _kill()


def _build():
    import gymnasium as gym
    import torch
    from tensordict.nn import TensorDictModule
    from torchrl.data import LazyTensorStorage, ReplayBuffer
    from torchrl.envs import GymWrapper, TransformedEnv

    from torchrl_grpo import MCAdvantage, SameStartGroups

    vector = gym.vector.SyncVectorEnv(
        [lambda: gym.make("CartPole-v1")] * ENVS,
        autoreset_mode=gym.vector.AutoresetMode.DISABLED,
    )
    env = GymWrapper(vector, categorical_action_encoding=True)
    env = TransformedEnv(env, SameStartGroups(GROUP, seeds=range(10_000)))
    advantage = MCAdvantage(GROUP, prompt_key="reset_seed", trajectory_return="sum")
    rb = ReplayBuffer(storage=LazyTensorStorage(20_000)).append_transform(advantage)
    policy = TensorDictModule(  # toward the centre: a function of the state
        lambda obs: (obs[..., 0] < 0).long(), in_keys=["observation"], out_keys=["action"]
    )
    torch.set_num_threads(1)
    return env, advantage, rb, policy


def trained_episodes(rb) -> dict[int, int]:
    """``{seed: episodes}`` of the whole episodes in the buffer's storage."""
    stored = rb[:]
    ended = stored["next", "done"].reshape(-1)
    return dict(Counter(stored["reset_seed"].reshape(-1)[ended].tolist()))


def merged(ledger: list[dict]) -> dict[int, int]:
    """The episodes trained per seed over a ledger's batches."""
    total = Counter()
    for batch in ledger:
        total.update({int(seed): n for seed, n in batch.items()})
    return dict(total)


def run(folder: Path, plan: dict | None = None) -> list[dict]:
    """The loop from the checkpoint in ``folder`` (from scratch without one); its ledger."""
    from torchrl.collectors import Collector

    from torchrl_grpo import checkpoint

    env, advantage, rb, policy = _build()
    ledger, batch = [], 0
    if checkpoint.find_checkpoint(folder) is not None:
        saved = checkpoint.load_checkpoint(folder)
        rb.loads(saved.values["buffer"])
        env.transform.load_state_dict(saved.values["state"]["env"])
        env.transform.resume(advantage)
        ledger, batch = saved.values["state"]["ledger"], saved.stamp
    collector = Collector(
        env, policy, frames_per_batch=FRAMES, total_frames=-1, auto_register_policy_transforms=False
    )
    for data in collector:
        batch += 1
        _fault(plan, "collected", batch)
        rb.extend(data)
        _fault(plan, "extended", batch)
        if len(rb):
            ledger.append(trained_episodes(rb))
            rb.empty()
        _fault(plan, "trained", batch)
        _arm(plan, batch)
        state = {"env": env.transform.state_dict(), "ledger": ledger}
        checkpoint.save_checkpoint(folder, {"buffer": rb, "state": state}, stamp=batch)
        done = merged(ledger)
        if all(seed in done for seed in range(SEEDS_TRAINED)) or batch >= MAX_BATCHES:
            break
    collector.shutdown()
    return ledger


def _child(target) -> int:
    """``target()`` in a forked child; the child's pid."""
    pid = os.fork()
    if pid == 0:  # the child: never returns
        code = 1
        try:
            target()
            code = 0
        except BaseException:  # noqa: BLE001 - said on stderr, the exit code tells the parent
            traceback.print_exc()
        finally:
            os._exit(code)
    return pid


def drive(work: Path, plans: list[dict | None]) -> list[dict]:
    """Each plan in forked children: the run killed by its fault, then a resume to the end.
    Returns, per plan, how the first child ended, the checkpoint's stamp after it, and the
    ledger of the resume (a plan ``None``: the uninterrupted run's)."""
    results = []
    for i, plan in enumerate(plans):
        folder, out = work / f"run{i}" / "checkpoint", work / f"ledger{i}.json"
        first = 0
        if plan is not None:
            _, status = os.waitpid(_child(functools.partial(run, folder, plan)), 0)
            first = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
        found = _find(folder)
        stamp = None if found is None else json.loads((found / "checkpoint.json").read_text())
        _, status = os.waitpid(_child(functools.partial(_resume, folder, out)), 0)
        resumed = json.loads(out.read_text()) if out.exists() else None
        results.append(
            {
                "plan": plan,
                "killed": first,
                "found": None if found is None else found.name,
                "stamp": None if stamp is None else stamp["stamp"],
                "resumed_exit": os.WEXITSTATUS(status) if os.WIFEXITED(status) else -1,
                "ledger": resumed,
            }
        )
    return results


def _resume(folder: Path, out: Path) -> None:
    out.write_text(json.dumps(run(folder)))


def _find(folder: Path) -> Path | None:
    from torchrl_grpo import checkpoint

    return checkpoint.find_checkpoint(folder)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # the children fork from an idle process
    work, plans = Path(sys.argv[1]), json.loads(Path(sys.argv[2]).read_text())
    import logging

    import torchrl.collectors  # noqa: F401 - imported once, before the forks

    import torchrl_grpo  # noqa: F401

    logging.getLogger("torchrl").setLevel(logging.WARNING)  # its INFO lines go to stdout
    print(json.dumps(drive(work, plans)))

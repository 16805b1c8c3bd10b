"""What the transform checks of the replay buffer it releases into, before an insertion commits.

A released group must reach storage as the steps it is: ``rb.add`` stores one element, so a
group of several steps released through it would be stored as one element of shape ``[G]``: that
is refused before the insertion commits, so that nothing is lost (the trajectories stay pending,
and the same steps can be inserted again with ``rb.extend``). A release that overwrites older
steps of a full storage is a FIFO buffer working as designed, but an unsampled group overwritten
is lost for training: it is said once per transform. A release larger than the whole storage
overwrites its own first steps; torchrl's ``MCAdvantage`` lets the ring buffer do it, and so does
this one by default (``on_overflow="drop_oldest"``), saying so once; with ``on_overflow="raise"``
it is refused before the insertion commits, the trajectories still pending.
"""

from __future__ import annotations

from tensordict import TensorDictBase
from torchrl.data import ReplayBuffer

from torchrl_grpo import _compat
from torchrl_grpo.mcadvantage.warn import warn

__all__ = ["check_release"]


def check_release(transform, out: TensorDictBase, *, warned: bool) -> bool:
    """Refuse ``out`` (the steps an insertion of ``transform`` releases) if the buffer calling it
    cannot store them as steps; warn, unless ``warned``, if they overwrite stored steps.

    Returns:
        Whether the overwrite warning has been given (``warned``, or now).

    Raises:
        ValueError: ``rb.add`` releases several steps, or (``on_overflow="raise"``) the
            release is larger than the storage; the insertion is then not committed.
    """
    buffer, method = _compat.buffer_call(transform)
    if buffer is None:  # transform.inv called directly: nothing to check against
        return warned
    steps = out.numel()
    if method == "add" and steps > 1:
        raise ValueError(
            f"MCAdvantage: this rb.add completes a group and releases {steps} steps, but add() "
            "stores one element: use rb.extend (rb.extend(step.unsqueeze(0)) for a single step). "
            "Nothing was inserted; the steps of the group are still pending."
        )
    return _check_capacity(buffer, steps, warned, strict=transform.on_overflow == "raise")


def _check_capacity(buffer: ReplayBuffer, steps: int, warned: bool, strict: bool) -> bool:
    storage = buffer.storage
    capacity = getattr(storage, "max_size", None)
    if capacity is None:
        return warned
    if steps > capacity and strict:
        raise ValueError(
            f"MCAdvantage: this insertion releases {steps} steps, more than the storage holds "
            f"(max_size={capacity}): its last steps would overwrite its first. Give the storage "
            f"room for at least {steps} steps. Nothing was inserted; the trajectories are still "
            "pending (on_overflow='raise')."
        )
    if steps > capacity:
        if not warned:
            warn(
                f"MCAdvantage: this insertion releases {steps} steps, more than the storage "
                f"holds (max_size={capacity}): the ring buffer keeps the last {capacity}, the "
                f"first {steps - capacity} released steps and every stored one are overwritten "
                "(torchrl's behaviour). Give the storage room for a release, or pass "
                "limits=Limits(on_overflow='raise') to refuse it with nothing lost. Said once per "
                "transform."
            )
        return True
    held = len(storage)
    if not warned and held + steps > capacity:
        warn(
            f"MCAdvantage: releasing {steps} steps into a storage holding {held} of "
            f"max_size={capacity}: the oldest {held + steps - capacity} stored steps are "
            "overwritten, sampled or not. Size the storage for what one training step uses, or "
            "empty it after each (rb.empty()). Said once per transform."
        )
        return True
    return warned

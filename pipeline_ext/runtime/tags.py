"""Message identity between pipeline ranks: one tag per (step, direction, stage, microbatch).

[Note: message tags]
This module is the one place a message's identity is encoded and decoded.
Bits 0-19 name the message within a step, ``(microbatch * num_stages +
sending_stage) * 2 + direction`` (0: activation, 1: gradient), the same on
sender and receiver. Skip connections (``pipeline_ext.skip``) have their own
lane, bit 19 set: ``((microbatch * num_stages + from_stage) * num_stages +
to_stage) * 2 + direction``, from and to being the stashing and the popping
stage whatever the direction. Bits 20-29 carry the step number modulo 1024. Bit 30 marks a
layout message (the C++ channel's ``LAYOUT_TAG_BIT``), and ``2**31 - 1`` is the step
agreement's tag.

The step number comes from the caller (in a multi-process pipeline, the process
group's count: ``comm/identity.GroupSteps``, [Note: step numbering]); in one process it is 0.
"""
from __future__ import annotations

from typing import Optional

from pipeline_ext.schedules import Action, ActionKind

__all__ = ["STEP_SHIFT", "STEPS", "SKIP_LANE", "message_tag", "step_bits", "skip_tag", "message_of", "split_microbatch",
           "describe_tag", "check_tag_space"]

STEP_SHIFT = 20
STEPS = 1 << 10  # step numbers wrap around after this many steps
_IN_STEP = (1 << STEP_SHIFT) - 1
SKIP_LANE = 1 << (STEP_SHIFT - 1)  # skip messages' bit within a step


def check_tag_space(num_stages: int, n_microbatches: int, skips: bool = False) -> None:
    """Every message of a step must fit the 19 bits a tag gives each lane (20 with the skip lane)."""
    need = 2 * num_stages * n_microbatches * (num_stages if skips else 1)
    if need > SKIP_LANE:
        per_mb = 2 * num_stages * (num_stages if skips else 1)
        raise ValueError(
            f"{num_stages} stages x {n_microbatches} microbatches need more than the 2^{STEP_SHIFT - 1} message tags "
            f"a step has{' for its skip connections' if skips else ''}; use fewer microbatches "
            f"(at most {SKIP_LANE // per_mb})"
        )


def message_tag(action: Action, num_stages: int, step: int = 0) -> int:
    """The tag of the message a SEND_*/RECV_* action moves in step ``step``.

    A SEND_F of stage s and the RECV_F of stage s+1 carry the same message, so
    both are keyed by the sending stage.
    """
    kind = action.kind
    if kind in (ActionKind.SEND_F, ActionKind.RECV_F):
        sender, direction = (action.stage if kind == ActionKind.SEND_F else action.stage - 1), 0
    else:
        sender, direction = (action.stage if kind == ActionKind.SEND_B else action.stage + 1), 1
    return step_bits(step) | ((action.microbatch * num_stages + sender) * 2 + direction)


def step_bits(step: int) -> int:
    """The step's part of a tag: ``message_tag(a, n, step) == step_bits(step) | message_tag(a, n)``."""
    return (step % STEPS) << STEP_SHIFT


def skip_tag(src: int, dst: int, microbatch: int, gradient: bool, num_stages: int, step: int = 0) -> int:
    """The tag of microbatch ``microbatch``'s skip message between stashing stage ``src`` and popping stage ``dst``."""
    rest = ((microbatch * num_stages + src) * num_stages + dst) * 2 + int(gradient)
    return step_bits(step) | SKIP_LANE | rest


def message_of(tag: int) -> int:
    """The message within its step (the tag without the step bits): what layouts are cached by."""
    return tag & _IN_STEP


def split_microbatch(message: int, num_stages: int) -> tuple[int, int]:
    """``(microbatch, the message without it)`` for a message (``message_of``) of a pipeline of ``num_stages``.

    A message's layout follows from its microbatch's inputs, not from where
    the microbatch sits in the step: layouts are cached per microbatch
    signature under the second part (``comm/comm_plan.py``), so a microbatch
    seen before has known layouts wherever it comes in a later step.
    """
    rest = message & _IN_STEP
    if rest & SKIP_LANE:
        per_mb = 2 * num_stages * num_stages
        rest &= SKIP_LANE - 1
        return rest // per_mb, SKIP_LANE | (rest % per_mb)
    per_mb = 2 * num_stages
    return rest // per_mb, rest % per_mb


def describe_tag(tag: int, num_stages: Optional[int]) -> str:
    """Names the message behind a tag (inverts ``message_tag``)."""
    if not num_stages:
        return f"tag {tag}"
    step, rest = tag >> STEP_SHIFT, tag & _IN_STEP
    if rest & SKIP_LANE:
        rest &= SKIP_LANE - 1
        direction, rest = rest % 2, rest // 2
        dst, rest = rest % num_stages, rest // num_stages
        src, mb = rest % num_stages, rest // num_stages
        what = (f"skips of stage {src} for stage {dst}" if direction == 0
                else f"gradient of the skips of stage {src}, from stage {dst}")
        return f"{what}, microbatch {mb} (tag {tag}, step {step} mod {STEPS})"
    direction, rest = rest % 2, rest // 2
    sender, mb = rest % num_stages, rest // num_stages
    what = (f"activation of stage {sender} for stage {sender + 1}" if direction == 0
            else f"gradient of stage {sender} for stage {sender - 1}")
    return f"{what}, microbatch {mb} (tag {tag}, step {step} mod {STEPS})"

"""Learning-rate schedules: lr(step) as a pure function of the step, so a resumed run gets
exactly the rate the uninterrupted run had (nothing to checkpoint), and the UI can draw it.

No torch here: the planner, the UI and the loop share it.
"""
from __future__ import annotations

import math
from typing import Literal

from workbench.errors import ConfigError

LrSchedule = Literal["constant", "cosine", "linear", "wsd"]
WSD_DECAY_FRACTION = 0.2  # warmup-stable-decay: the last 20% of the steps decay (Hu et al., 2024, MiniCPM)


def lr_at(step: int, *, lr: float, steps: int, schedule: str = "constant", warmup_steps: int = 0,
          min_lr: float = 0.0) -> float:
    """The learning rate of optimizer step `step` (1-based).

    Warmup rises linearly to `lr` at step `warmup_steps`; then constant stays at `lr`, cosine
    and linear decay to `min_lr` at the last step, and wsd holds `lr` until the last 20% of
    the steps and decays linearly to `min_lr` over them.
    """
    if warmup_steps > 0 and step <= warmup_steps:
        return lr * step / warmup_steps
    if schedule == "constant":
        return lr
    if schedule == "wsd":
        decay = max(1, round(WSD_DECAY_FRACTION * steps))
        start = max(warmup_steps, steps - decay)
        if step <= start:
            return lr
        return lr + (min_lr - lr) * (step - start) / max(1, steps - start)
    progress = (step - warmup_steps) / max(1, steps - warmup_steps)  # (0, 1]
    if schedule == "cosine":
        return min_lr + (lr - min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))
    return lr + (min_lr - lr) * progress  # linear


def lr_curve(train) -> list[float]:
    """lr of every step 1..steps for a spec's `train` section."""
    return [lr_for(train, k) for k in range(1, train.steps + 1)]


def lr_for(train, step: int) -> float:
    return lr_at(step, lr=train.lr, steps=train.steps, schedule=train.schedule, warmup_steps=train.warmup_steps,
                 min_lr=train.min_lr)


def check_schedule(train) -> None:
    """ConfigError for a schedule that cannot do what it says."""
    if train.warmup_steps >= train.steps:
        raise ConfigError(f"train.warmup_steps({train.warmup_steps}) must be below train.steps({train.steps}): the "
                          f"warmup would never reach lr. Use e.g. warmup_steps={max(0, train.steps // 10)}.")
    if train.min_lr > train.lr:
        raise ConfigError(f"train.min_lr({train.min_lr:g}) is above train.lr({train.lr:g}); a schedule decays from lr "
                          f"to min_lr. Use min_lr <= {train.lr:g} (e.g. {train.lr / 10:g}).")

"""Whether a criterion fits a task: one trial forward on one sample at start-up, before anything trains.

A criterion reads the task's samples (``sample["target"]``, ``net_input`` keys) and calls the
model with its own arguments (``masked_tokens=...``). A criterion made for another task fails
on the first sample with whatever error that mismatch raises; this turns it into one line
naming both, instead of a traceback from deep inside the first update.
"""

from __future__ import annotations

from typing import Any

import torch

from hetfair.errors import ConfigError, first_line

MISMATCH_ERRORS = (TypeError, KeyError, AttributeError, IndexError, ValueError, RuntimeError)
"""What a criterion given samples or a model it was not made for raises (bad keyword, missing key, shapes)."""


def check_criterion_fits(model: torch.nn.Module, criterion: torch.nn.Module, sample: dict[str, Any],
                         names: dict[str, str]) -> None:
    """Run ``criterion(model, sample)`` once, leaving no trace; a mismatch becomes a :class:`ConfigError`.

    ``names`` holds the run's ``criterion``, ``task`` and ``arch`` for the message. The model runs
    in eval mode without gradients, and the random generators are restored: the trial changes
    neither parameters, batch-norm statistics nor the run's random numbers.
    """
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            criterion(model, sample)
    except MISMATCH_ERRORS as exc:
        raise ConfigError(
            f"criterion {names['criterion']} does not fit task {names['task']} (model {names['arch']}): "
            f"{type(exc).__name__}: {first_line(exc)}; choose a criterion made for this task "
            f"(--debug shows the traceback)") from exc
    finally:
        model.train(was_training)

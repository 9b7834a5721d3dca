"""Load a trained model outside training (notebooks, inference, export): ``hetfair.load_model``."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch
from torch import nn

from hetfair.checkpoint import load_checkpoint, model_weights, stored_config
from hetfair.criteria import HetfairCriterion
from hetfair.errors import CheckpointError, ComponentNotKnownError, first_line
from hetfair.plugins import import_user_dir
from hetfair.tasks import TASK_REGISTRY, Task
from hetfair.utils import state_dict_mismatch


@dataclass
class LoadedModel:
    """A checkpoint's model (in eval mode, on ``device``) with the task and options it was trained with."""

    model: nn.Module
    task: Task
    options: argparse.Namespace

    def build_criterion(self) -> HetfairCriterion:
        """The training criterion, e.g. to compute the training loss on new data."""
        return self.task.build_criterion(self.options)


def load_model(path: str | Path, user_dir: Optional[str | Path] = None, overrides: Optional[dict[str, Any]] = None,
               device: str | torch.device = "cpu") -> LoadedModel:
    """Load the model of checkpoint ``path`` as it was trained, in eval mode.

    Args:
        path: a checkpoint written by ``hetfair-train``.
        user_dir: the plugin directory the model's task comes from, if it is a ``--user-dir``
            plugin. Only this directory is imported; a checkpoint never picks code to run.
        overrides: options to change, e.g. ``{"data": "/new/place/of/the/data"}``.
        device: where the model goes.
    """
    path = Path(path)
    state = load_checkpoint(path)
    options = argparse.Namespace(**{**stored_config(state), **{k: v for k, v in (overrides or {}).items()
                                                                if v is not None}})
    if user_dir is not None:
        import_user_dir(user_dir)
        options.user_dir = str(Path(user_dir).resolve())
    task = _setup_task(options, path)
    model = task.build_model(options)
    try:
        model.load_state_dict(model_weights(state))
    except RuntimeError as exc:
        detail = state_dict_mismatch(model.state_dict(), model_weights(state)) or first_line(exc)
        raise CheckpointError(f"checkpoint {path} does not fit the model it names: {detail}") from exc
    return LoadedModel(model.to(device).eval(), task, options)


def _setup_task(options: argparse.Namespace, path: Path) -> Task:
    try:
        task_class = TASK_REGISTRY.get(options.task)
    except ComponentNotKnownError:
        stored = getattr(options, "user_dir", None)
        if stored:
            raise CheckpointError(f"checkpoint {path} was trained with the task '{options.task}' of --user-dir "
                                  f"{stored}; pass that directory (--user-dir / user_dir=) to load it") from None
        raise
    return task_class.setup_task(options)

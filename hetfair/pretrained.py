"""Load a trained model outside training (notebooks, inference, export): ``hetfair.load_model``."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

import torch
from torch import nn

from hetfair.checkpoint.layout import load_checkpoint, model_weights, stored_config
from hetfair.criteria import HetfairCriterion
from hetfair.errors import (
    CheckpointError,
    ComponentNotKnownError,
    ConfigError,
    HetfairError,
    UserDirNeededError,
    first_line,
)
from hetfair.models import MODEL_REGISTRY
from hetfair.models.model import WEIGHTS_FROM_CHECKPOINT
from hetfair.options import stored_options
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
               device: str | torch.device = "cpu", task_argv: Sequence[str] = ()) -> LoadedModel:
    """Load the model of checkpoint ``path`` as it was trained, in eval mode.

    Args:
        path: a checkpoint written by ``hetfair-train``.
        user_dir: the plugin directory the model's task comes from, if it is a ``--user-dir``
            plugin. Only this directory is imported; a checkpoint never picks code to run.
        overrides: options to change, e.g. ``{"data": "/new/place/of/the/data"}``.
        device: where the model goes.
        task_argv: the task's flags that say where to connect (its ``network_options``, e.g.
            ``["--mnist-mirror", URL]``); the checkpoint's values of those are never used.
    """
    path = Path(path)
    state = load_checkpoint(path)
    options = _options(path, state, user_dir, overrides or {}, task_argv)
    for name in getattr(MODEL_REGISTRY.get(options.model), "init_source_options", ()):
        setattr(options, name, None)  # the checkpoint's weights replace the source's; it need not exist any more
    task, model = _build(path, argparse.Namespace(**vars(options), **{WEIGHTS_FROM_CHECKPOINT: True}))
    try:
        model.load_state_dict(model_weights(state))
    except RuntimeError as exc:
        detail = state_dict_mismatch(model.state_dict(), model_weights(state)) or first_line(exc)
        raise CheckpointError(f"checkpoint {path} does not fit the model it names: {detail}") from exc
    return LoadedModel(model.to(device).eval(), task, options)


def _options(path: Path, state: dict[str, Any], user_dir: Optional[str | Path], overrides: dict[str, Any],
             task_argv: Sequence[str]) -> argparse.Namespace:
    """The stored options with ``overrides`` applied; the stored ``user_dir`` is replaced by ``user_dir``
    and the task's network options by the command line's (or their defaults)."""
    config = stored_config(state)
    trained_with = config.get("user_dir")
    config.update(user_dir=str(Path(user_dir).resolve()) if user_dir else None)
    if config["user_dir"]:
        import_user_dir(config["user_dir"])
    try:
        task = TASK_REGISTRY.get(config["task"])
        for name in task.network_options:
            config.pop(name, None)  # a checkpoint never chooses where the program connects
        config.update({key: value for key, value in overrides.items() if value is not None})
        config.update(_network_flags(task, task_argv))
        return stored_options(config)
    except ComponentNotKnownError as exc:
        if trained_with and not config["user_dir"]:
            raise UserDirNeededError(str(path), trained_with, str(exc).split(";")[0]) from exc
        raise


def _network_flags(task: type[Task], task_argv: Sequence[str]) -> dict[str, Any]:
    """The values of ``task``'s network options given in ``task_argv``; any other flag is refused."""
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    task.add_args(parser)
    given, unknown = parser.parse_known_args(task_argv)
    defaults = parser.parse_args([])
    refused = unknown + ["--" + name.replace("_", "-") for name in vars(given)
                         if name not in task.network_options and getattr(given, name) != getattr(defaults, name)]
    if refused:
        takes = ", ".join("--" + name.replace("_", "-") for name in task.network_options) or "none"
        raise ConfigError(f"unrecognized arguments: {' '.join(refused)}; of its task's flags, the command takes only "
                          f"those that say where to connect ({takes})")
    return {name: getattr(given, name) for name in task.network_options if getattr(given, name) is not None}


def _build(path: Path, options: argparse.Namespace) -> tuple[Task, nn.Module]:
    """Task and model as the stored options say; options that do not fit are one error."""
    try:
        task = TASK_REGISTRY.get(options.task).setup_task(options)
        return task, task.build_model(options)
    except HetfairError:
        raise
    except (AttributeError, KeyError, TypeError, ValueError, IndexError) as exc:
        raise CheckpointError(
            f"checkpoint {path}: its options (task '{options.task}', arch '{getattr(options, 'arch', None)}') do "
            f"not build a model: {type(exc).__name__}: {first_line(exc)}"
        ) from exc

"""Metrics of a saved checkpoint on one split (``hetfair-validate``), computed as training validates.

A checkpoint is data, never code: its stored ``--user-dir`` is not imported. Only the plugin
directory given on the command line is; when the checkpoint's components are unknown without
the directory it was trained with, the error names that directory.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch

from hetfair.checkpoint import load_checkpoint, model_weights, stored_config
from hetfair.distributed.context import DistributedContext
from hetfair.errors import CheckpointError, ComponentNotKnownError, HetfairError, first_line
from hetfair.options import stored_options
from hetfair.plugins import import_user_dir
from hetfair.tasks import TASK_REGISTRY, Task
from hetfair.validation import Validator


def checkpoint_options(path: Path, state: dict[str, Any], overrides: dict[str, Any]) -> argparse.Namespace:
    """The training options stored in the checkpoint, with the command line's ``overrides`` applied."""
    config = stored_config(state)
    trained_with = config.get("user_dir")
    given = {key: value for key, value in overrides.items() if value is not None}
    config.update(given, user_dir=given.get("user_dir"))
    if config["user_dir"]:
        import_user_dir(config["user_dir"])
    try:
        return stored_options(config)
    except ComponentNotKnownError as exc:
        if trained_with and not config["user_dir"]:
            raise CheckpointError(
                f"checkpoint {path} was trained with --user-dir {trained_with}, which is not imported from a "
                f"checkpoint ({str(exc).split(';')[0]}); pass --user-dir {trained_with}"
            ) from exc
        raise


def evaluate_checkpoint(path: Path, subset: str, overrides: dict[str, Any]) -> dict[str, float]:
    """Load the model of ``path`` and return the criterion's metrics on ``subset`` (one process)."""
    state = load_checkpoint(path)
    args = checkpoint_options(path, state, overrides)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.cpu else "cpu")
    task, model, criterion = _build(path, args)
    try:
        model.load_state_dict(model_weights(state))
    except RuntimeError as exc:
        raise CheckpointError(f"checkpoint {path} does not fit the model it names: {first_line(exc)}") from exc
    context = DistributedContext(rank=0, world_size=1, local_rank=0, device=device)
    batch_size = args.max_sentences_valid or args.max_sentences or 32
    validator = Validator(task, model.to(device), criterion.to(device), context, [batch_size], args.num_workers)
    return validator.metrics(subset)


def _build(path: Path, args: argparse.Namespace) -> tuple[Task, torch.nn.Module, torch.nn.Module]:
    """Task, model and criterion as the stored options say; options that do not fit are one error."""
    try:
        task = TASK_REGISTRY.get(args.task).setup_task(args)
        return task, task.build_model(args), task.build_criterion(args)
    except HetfairError:
        raise
    except (AttributeError, KeyError, TypeError, ValueError, IndexError) as exc:
        raise CheckpointError(
            f"checkpoint {path}: its options (task '{args.task}', arch '{args.arch}') do not build a model: "
            f"{type(exc).__name__}: {first_line(exc)}"
        ) from exc

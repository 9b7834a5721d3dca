"""Metrics of a saved checkpoint on one split (``hetfair-validate``), computed as training validates."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch

from hetfair.checkpoint import load_checkpoint, model_weights, stored_config
from hetfair.distributed.context import DistributedContext
from hetfair.errors import CheckpointError, first_line
from hetfair.plugins import import_user_dir
from hetfair.tasks import TASK_REGISTRY
from hetfair.utils import state_dict_mismatch
from hetfair.validation import Validator


def config_from_checkpoint(state: dict[str, Any], overrides: dict[str, Any]) -> argparse.Namespace:
    """The training options stored in the checkpoint, with ``overrides`` applied."""
    config = stored_config(state)
    config.update({key: value for key, value in overrides.items() if value is not None})
    return argparse.Namespace(**config)


def evaluate_checkpoint(path: Path, subset: str, overrides: dict[str, Any]) -> dict[str, float]:
    """Load the model of ``path`` and return the criterion's metrics on ``subset`` (one process)."""
    state = load_checkpoint(path)
    args = config_from_checkpoint(state, overrides)
    if args.user_dir:
        import_user_dir(args.user_dir)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.cpu else "cpu")
    task = TASK_REGISTRY.get(args.task).setup_task(args)
    model = task.build_model(args)
    try:
        model.load_state_dict(model_weights(state))
    except RuntimeError as exc:
        detail = state_dict_mismatch(model.state_dict(), model_weights(state)) or first_line(exc)
        raise CheckpointError(f"checkpoint {path} does not fit the model it names: {detail}") from exc
    criterion = task.build_criterion(args)
    context = DistributedContext(rank=0, world_size=1, local_rank=0, device=device)
    batch_size = args.max_sentences_valid or args.max_sentences or 32
    validator = Validator(task, model.to(device), criterion.to(device), context, [batch_size], args.num_workers)
    return validator.metrics(subset)

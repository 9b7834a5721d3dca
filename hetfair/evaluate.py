"""Metrics of a saved checkpoint on one split (``hetfair-validate``)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader

from hetfair.checkpoint import load_checkpoint
from hetfair.criteria.criterion import HetfairCriterion
from hetfair.errors import CheckpointError, first_line
from hetfair.plugins import import_user_dir
from hetfair.tasks import TASK_REGISTRY
from hetfair.utils import move_to_device


def config_from_checkpoint(state: dict[str, Any], overrides: dict[str, Any]) -> argparse.Namespace:
    """The training options stored in the checkpoint, with ``overrides`` applied."""
    config = dict(state.get("config") or {})
    if "task" not in config:
        raise CheckpointError("checkpoint holds no training options; was it written by hetfair-train?")
    config.update({key: value for key, value in overrides.items() if value is not None})
    return argparse.Namespace(**config)


def evaluate_checkpoint(path: Path, subset: str, overrides: dict[str, Any]) -> dict[str, float]:
    """Load the model of ``path`` and return the criterion's metrics on ``subset``."""
    state = load_checkpoint(path)
    args = config_from_checkpoint(state, overrides)
    if args.user_dir:
        import_user_dir(args.user_dir)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.cpu else "cpu")
    task = TASK_REGISTRY.get(args.task).setup_task(args)
    model = task.build_model(args)
    try:
        model.load_state_dict(state["trainer"]["model"])
    except RuntimeError as exc:
        raise CheckpointError(f"checkpoint {path} does not fit the model it names: {first_line(exc)}") from exc
    criterion = task.build_criterion(args)
    return evaluate(task.dataset(subset), task.collater, model.to(device), criterion.to(device), args, device)


@torch.no_grad()
def evaluate(dataset: Any, collater: Any, model: torch.nn.Module, criterion: HetfairCriterion,
             args: argparse.Namespace, device: torch.device) -> dict[str, float]:
    """Sum the criterion's logs over ``dataset`` and reduce them to metrics."""
    model.eval()
    criterion.eval()
    batch_size = args.max_sentences_valid or args.max_sentences or 32
    loader = DataLoader(dataset, batch_size=batch_size, shuffle=False, collate_fn=collater,
                        num_workers=args.num_workers)
    totals: dict[str, float] = {}
    for sample in loader:
        _, sample_size, logs = criterion(model, move_to_device(sample, device))
        for key, value in logs.items():
            if isinstance(value, (int, float)) and key != "sample_size":
                totals[key] = totals.get(key, 0.0) + float(value)
        totals["sample_size"] = totals.get("sample_size", 0.0) + float(sample_size)
    return criterion.reduce_metrics(totals)

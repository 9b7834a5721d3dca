"""Metrics of a saved checkpoint on one split (``hetfair-validate``), computed as training validates.

A checkpoint is data, never code: its stored ``--user-dir`` is not imported, and its task's
network options (a download mirror) are not used: the command line's are. Only the plugin
directory given on the command line is; when the checkpoint's components are unknown without
the directory it was trained with, the error names that directory.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional, Sequence

import torch

from hetfair.distributed.context import DistributedContext
from hetfair.pretrained import load_model
from hetfair.validation import Validator


def evaluate_checkpoint(path: Path, subset: str, overrides: dict[str, Any], user_dir: Optional[str] = None,
                        task_argv: Sequence[str] = ()) -> dict[str, float]:
    """Load the model of ``path`` (as :func:`hetfair.load_model`) and return its metrics on ``subset``."""
    loaded = load_model(path, user_dir=user_dir, overrides=overrides, task_argv=task_argv)
    options = loaded.options
    device = torch.device("cuda" if torch.cuda.is_available() and not options.cpu else "cpu")
    context = DistributedContext(rank=0, world_size=1, local_rank=0, device=device)
    batch_size = options.max_sentences_valid or options.max_sentences or 32
    validator = Validator(loaded.task, loaded.model.to(device), loaded.build_criterion().to(device), context,
                          [batch_size], options.num_workers)
    return validator.metrics(subset)


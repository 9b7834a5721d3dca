"""Metrics of a saved checkpoint on one split (``hetfair-validate``), computed as training validates.

A checkpoint is data, never code: its stored ``--user-dir`` is not imported, and its task's
network options (a download mirror) are not used: the command line's are. Only the plugin
directory given on the command line is; when the checkpoint's components are unknown without
the directory it was trained with, the error names that directory.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator, Optional, Sequence

import torch

from hetfair.parallel.context import DistributedContext
from hetfair.pretrained import load_model
from hetfair.run.validation import Validator


def evaluate_checkpoint(path: Path, subsets: Sequence[str], overrides: dict[str, Any],
                        user_dir: Optional[str] = None, task_argv: Sequence[str] = ()) -> Iterator[tuple[str, dict[str, float]]]:
    """Load the model of ``path`` once (as :func:`hetfair.load_model`); yield ``(subset, metrics)`` for each of
    ``subsets`` in turn, each as soon as it is computed."""
    loaded = load_model(path, user_dir=user_dir, overrides=overrides, task_argv=task_argv)
    options = loaded.options
    device = torch.device("cuda" if torch.cuda.is_available() and not options.cpu else "cpu")
    context = DistributedContext(rank=0, world_size=1, local_rank=0, device=device)
    batch_size = options.max_sentences_valid or options.max_sentences or 32
    validator = Validator(loaded.task, loaded.model.to(device), loaded.build_criterion().to(device), context,
                          [batch_size], options.num_workers)
    for subset in subsets:
        yield subset, validator.metrics(subset)

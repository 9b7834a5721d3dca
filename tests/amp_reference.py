"""Plain-PyTorch fp32 references for the mixed-precision tests, and how far a run is from one.

The references train the same model from the same seed on the same global
batches as hetfair (each epoch a ``default_rng([seed, epoch])`` permutation cut
into consecutive batches) with a plain loop: mean loss, ``backward``, SGD step.
Data come from the tasks themselves (hetfair's MNIST normalisation and BERT
masking are not what these tests check).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
import torch.nn.functional as F

from hetfair.options import parse_train_args
from hetfair.plugins import import_user_dir
from hetfair.tasks import TASK_REGISTRY

PLUGIN_DIR = Path(__file__).resolve().parents[1] / "plugins"
Params = dict[str, torch.Tensor]
BatchLoss = Callable[[Any, torch.nn.Module, np.ndarray], torch.Tensor]
"""(task, model, indices of a global batch) -> the batch's mean loss."""


def change_error(actual: Params, expected: Params, initial: Params) -> float:
    """``|| (actual - initial) - (expected - initial) || / || expected - initial ||`` over all parameters.

    How far a run's total parameter change is from the reference's, relative to its size.
    """
    assert actual.keys() == expected.keys() == initial.keys()
    diff = torch.cat([(actual[k].double() - expected[k].double()).flatten() for k in expected])
    moved = torch.cat([(expected[k].double() - initial[k].double()).flatten() for k in expected])
    return float(diff.norm() / moved.norm())


def plain_sgd(args: argparse.Namespace, updates: int, update_size: int, batch_loss: BatchLoss,
              precision: str = "fp32", loss_scale: float = 2.0**7) -> tuple[Params, Params]:
    """(initial, final) parameters of ``updates`` plain SGD steps on the task of ``args``.

    ``precision`` bf16/fp16 runs the forward pass and loss under ``torch.autocast``; fp16 also
    scales the loss with ``torch.amp.GradScaler`` (starting at ``loss_scale``).
    """
    torch.manual_seed(args.seed)
    task = TASK_REGISTRY.get(args.task).setup_task(args)
    dataset = task.dataset("train")
    model = task.build_model(args).train()
    initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    dtype = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    scaler = torch.amp.GradScaler("cpu", init_scale=loss_scale, enabled=precision == "fp16")
    done, epoch = 0, 1
    while done < updates:
        task.begin_epoch(epoch)
        order = np.random.default_rng([args.seed, epoch]).permutation(len(dataset))
        for start in range(0, len(order), update_size):
            if done == updates:
                break
            optimizer.zero_grad()
            with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
                loss = batch_loss(task, model, order[start:start + update_size])
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            done += 1
        epoch += 1
    return initial, {k: v.detach().clone() for k, v in model.state_dict().items()}


def mnist_loss(task: Any, model: torch.nn.Module, indices: np.ndarray) -> torch.Tensor:
    dataset = task.dataset("train")
    x = dataset.images[torch.as_tensor(indices)]
    y = torch.as_tensor(dataset.labels[indices])
    return F.cross_entropy(model(x).float(), y)


def bert_loss(task: Any, model: torch.nn.Module, indices: np.ndarray) -> torch.Tensor:
    dataset = task.dataset("train")
    sample = task.collater([dataset[int(i)] for i in indices])
    target = sample["target"]
    masked = target != -100
    logits = model(**sample["net_input"], masked_tokens=masked)["mlm_logits"]
    return F.cross_entropy(logits.float(), target[masked])  # mean over the masked tokens of the global batch


def mnist_reference(flags: list[str], updates: int, update_size: int, precision: str = "fp32") -> tuple[Params, Params]:
    """:func:`plain_sgd` on the MNIST plugin's task with hetfair-train ``flags``."""
    import_user_dir(PLUGIN_DIR)
    args = parse_train_args(["--user-dir", str(PLUGIN_DIR), "--task", "mnist", "--max-sentences", "1", *flags])
    return plain_sgd(args, updates, update_size, mnist_loss, precision)


def bert_reference(flags: list[str], updates: int, update_size: int, precision: str = "fp32") -> tuple[Params, Params]:
    """:func:`plain_sgd` on the ``bert`` task (masked LM only) with hetfair-train ``flags``."""
    args = parse_train_args(["--task", "bert", "--max-sentences", "1", *flags])
    return plain_sgd(args, updates, update_size, bert_loss, precision)

"""A tiny deterministic task + model for trainer tests (a --user-dir package)."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from hetfair import register_criterion, register_model, register_model_architecture, register_task
from hetfair.criteria import HetfairCriterion
from hetfair.launch import preemption
from hetfair.models import HetfairModel
from hetfair.tasks import Task

_SHARED = str(Path(__file__).resolve().parents[2] / "benchmarks")  # toydata.py, shared with simcluster
if _SHARED not in sys.path:
    sys.path.append(_SHARED)

from toydata import Blobs, blobs_mlp, blobs_split  # noqa: E402


@register_task("toy")
class ToyTask(Task):
    option_defaults = {"arch": "toy_mlp", "criterion": "cross_entropy", "max_sentences": 16}

    @staticmethod
    def add_args(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--toy-train-size", type=int, default=200)
        parser.add_argument("--toy-held-split", metavar="SPLIT",
                            help="loading SPLIT waits while --toy-pause-file exists (a test holds an evaluation there)")

    def load_dataset(self, split: str) -> Blobs:
        pause_file = getattr(self.args, "toy_pause_file", None)  # the model's flag
        if split == self.args.toy_held_split and pause_file:
            while Path(pause_file).exists():
                time.sleep(0.02)
        return blobs_split(split, self.args.toy_train_size)


@register_model("toy_mlp")
class ToyMLP(HetfairModel):
    def __init__(self, hidden: int, step_seconds: float = 0.0, pause_file: str | None = None,
                 units: bool = False) -> None:
        super().__init__()
        self.net = blobs_mlp(hidden)
        self.units = units
        self.step_seconds = step_seconds
        self.pause_file = Path(pause_file) if pause_file else None

    @staticmethod
    def add_args(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--toy-hidden", type=int, default=16)
        parser.add_argument("--toy-step-seconds", type=float, default=0.0,
                            help="sleep this long in every training forward (time for a test to act mid-run)")
        parser.add_argument("--toy-pause-file", metavar="PATH",
                            help="while PATH exists, every training forward waits (a test holds training there), "
                                 "until the run is asked to save and stop")
        parser.add_argument("--toy-units", action="store_true", help="each Linear layer is a sharding unit")

    @classmethod
    def build_model(cls, args: argparse.Namespace, task: Task) -> "ToyMLP":
        return cls(args.toy_hidden, args.toy_step_seconds, args.toy_pause_file, args.toy_units)

    def sharding_units(self) -> list[torch.nn.Module]:
        return [self.net[0], self.net[2]] if self.units else []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training and self.step_seconds:  # Python-level branches: --compile traces no sleep
            time.sleep(self.step_seconds)
        if self.training and self.pause_file is not None:
            while self.pause_file.exists() and preemption.requested_by() is None:  # a preempted run saves now
                time.sleep(0.02)
        return self.net(x)


@register_model("toy_deep")
class ToyDeepMLP(HetfairModel):
    """``Linear(8, W) - Tanh - (Linear(W, W) - Tanh) x depth - Linear(W, 3)``, each Linear a sharding unit: its
    size is ``12 W + depth W^2`` parameters (and as many biases), for the memory tests."""

    def __init__(self, width: int, depth: int) -> None:
        super().__init__()
        layers: list[torch.nn.Module] = [torch.nn.Linear(8, width), torch.nn.Tanh()]
        for _ in range(depth):
            layers += [torch.nn.Linear(width, width), torch.nn.Tanh()]
        self.net = torch.nn.Sequential(*layers, torch.nn.Linear(width, 3))

    @staticmethod
    def add_args(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--toy-width", type=int, default=64)
        parser.add_argument("--toy-depth", type=int, default=2)

    @classmethod
    def build_model(cls, args: argparse.Namespace, task: Task) -> "ToyDeepMLP":
        return cls(args.toy_width, args.toy_depth)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def sharding_units(self) -> list[torch.nn.Module]:
        return [module for module in self.net if isinstance(module, torch.nn.Linear)]


@register_model_architecture("toy_mlp", "toy_mlp_wide")
def toy_mlp_wide() -> dict:
    return {"toy_hidden": 64}


@register_criterion("toy_loss_only")
class LossOnlyCriterion(HetfairCriterion):
    """Cross-entropy that logs its loss and nothing else (the batch's counts are the collater's)."""

    def forward(self, model: torch.nn.Module, sample: dict) -> tuple[torch.Tensor, int, dict[str, float]]:
        loss = F.cross_entropy(model(**sample["net_input"]), sample["target"], reduction="sum")
        return loss, len(sample["target"]), {"loss": float(loss.detach())}


from toy_plugin import strategy  # noqa: E402,F401  (registers the toy_allreduce strategy)

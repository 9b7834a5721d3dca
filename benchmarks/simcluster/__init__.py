"""A simulated heterogeneous cluster on one machine: for benchmarks and tests, not library code.

``--user-dir benchmarks/simcluster --task sim`` trains a small MLP on synthetic
blobs. Its training forward pass sleeps ``--sim-step-ms + n * --sim-sample-ms / speed``
for a batch of ``n`` samples, where ``speed`` is this rank's entry of
``--sim-speeds`` (the rank comes from torch.distributed). Sleeping instead of
computing makes processes of speeds 1:1:2:4 behave as such even on 2 shared CPU
cores. ``--sim-change-at N --sim-speeds-after ...`` switches to other speeds after
N training forward calls (one per update with ``--update-freq 1``, after the two
of ``--auto-balance``'s start-up probe), so a rank can slow down mid-run.
``--sim-layers N`` adds N hidden ``Linear(hidden, hidden)`` layers, each a
sharding unit of its own (a model that sharding shrinks, for the automatic plan's tests).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from hetfair import register_model, register_task
from hetfair.errors import ConfigError
from hetfair.models import HetfairModel
from hetfair.tasks import Task

_SHARED = str(Path(__file__).resolve().parents[1])  # benchmarks/: toydata.py, shared with the tests' toy plugin
if _SHARED not in sys.path:
    sys.path.append(_SHARED)

from toydata import Blobs, blobs_mlp, blobs_split  # noqa: E402


def speed_list(text: str) -> list[float]:
    """``"1,1,2,4"`` -> ``[1.0, 1.0, 2.0, 4.0]`` (positive numbers)."""
    try:
        speeds = [float(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got '{text}'") from None
    if any(speed <= 0 for speed in speeds):
        raise argparse.ArgumentTypeError(f"speeds must be positive, got '{text}'")
    return speeds


@register_task("sim")
class SimTask(Task):
    option_defaults = {"arch": "sim_mlp", "criterion": "cross_entropy", "max_sentences": 16}

    @staticmethod
    def add_args(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--sim-train-size", type=int, default=2000, help="training samples")

    def load_dataset(self, split: str) -> Blobs:
        return blobs_split(split, self.args.sim_train_size)


class SimulatedSpeed:
    """How long this rank's forward pass of ``n`` samples takes, before and after ``change_at``."""

    def __init__(self, args: argparse.Namespace, rank: int) -> None:
        for flag, speeds in (("--sim-speeds", args.sim_speeds), ("--sim-speeds-after", args.sim_speeds_after)):
            if speeds is not None and rank >= len(speeds):
                raise ConfigError(f"{flag} gives {len(speeds)} speeds but this is rank {rank}")
        self.speed = args.sim_speeds[rank]
        self.speed_after = args.sim_speeds_after[rank] if args.sim_speeds_after else self.speed
        self.change_at = args.sim_change_at
        self.sample_seconds = args.sim_sample_ms / 1000.0
        self.step_seconds = args.sim_step_ms / 1000.0
        self.calls = 0

    def delay(self, samples: int) -> float:
        """Seconds to sleep for one training forward call of ``samples`` samples."""
        self.calls += 1
        speed = self.speed_after if self.change_at and self.calls > self.change_at else self.speed
        return self.step_seconds + samples * self.sample_seconds / speed


@register_model("sim_mlp")
class SimMLP(HetfairModel):
    """``Linear(8, hidden) - Tanh - Linear(hidden, 3)`` on a device of simulated speed, with ``layers`` more
    ``Linear(hidden, hidden) - Tanh`` after the first."""

    def __init__(self, hidden: int, device_speed: SimulatedSpeed, layers: int = 0) -> None:
        super().__init__()
        self.net = blobs_mlp(hidden)
        for index in range(layers):
            self.net.insert(2 + 2 * index, nn.Linear(hidden, hidden))
            self.net.insert(3 + 2 * index, nn.Tanh())
        self.device_speed = device_speed

    def sharding_units(self) -> list[nn.Module]:
        return [module for module in self.net[2:-1] if isinstance(module, nn.Linear)]

    @staticmethod
    def add_args(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--sim-hidden", type=int, default=16, help="hidden units")
        parser.add_argument("--sim-layers", type=int, default=0, help="more Linear(hidden, hidden) layers")
        parser.add_argument("--sim-speeds", type=speed_list, default=[1.0], metavar="S0,S1,...",
                            help="relative speed of each rank")
        parser.add_argument("--sim-sample-ms", type=float, default=5.0, help="milliseconds per sample at speed 1")
        parser.add_argument("--sim-step-ms", type=float, default=0.0, help="fixed milliseconds per forward call")
        parser.add_argument("--sim-change-at", type=int, default=0, metavar="N",
                            help="switch to --sim-speeds-after after N training forward calls (0: never)")
        parser.add_argument("--sim-speeds-after", type=speed_list, metavar="S0,S1,...",
                            help="speeds after --sim-change-at")

    @classmethod
    def build_model(cls, args: argparse.Namespace, task: Task) -> "SimMLP":
        rank = dist.get_rank() if dist.is_initialized() else 0
        return cls(args.sim_hidden, SimulatedSpeed(args, rank), args.sim_layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            time.sleep(self.device_speed.delay(len(x)))
        return self.net(x)

"""A comm hook as a plugin writes one: DDP's exact all-reduce done by hand (sum, then divide by the world size),
with a cost it declares by a flag of its own, for the advice and ``--ddp-comm-hook auto``."""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torch.distributed as dist

from hetfair import register_comm_hook
from hetfair.parallel import CommHook


@register_comm_hook("toy_mean")
class SumThenDivide(CommHook):
    """The mean over ranks of each bucket, exact; ``--toy-sent-fraction`` is what it claims to send."""

    lossy = False

    @staticmethod
    def add_args(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--toy-sent-fraction", type=float, default=1.0, metavar="F",
                            help="bytes per update this hook claims to send, relative to the gradient's")
        parser.add_argument("--toy-hook-log", metavar="PATH", help="append a line per bucket communicated")

    def communicate(self, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        if self.options["--toy-hook-log"]:
            with Path(f"{self.options['--toy-hook-log']}.{self.context.rank}").open("a") as log:
                log.write(f"bucket {bucket.index()}\n")
        summed = dist.all_reduce(bucket.buffer(), async_op=True).get_future()
        return summed.then(lambda future: future.value()[0].div_(self.context.world_size))

    def sent_fraction(self) -> float:
        return self.options["--toy-sent-fraction"]

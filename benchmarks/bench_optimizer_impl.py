"""Optimizer step time of torch's three implementations (for-loop, foreach, fused), and their difference.

For each model (the MNIST plugin's MLP and CNN, ``bert_mini``) and optimizer
(Adam, AdamW with weight decay, SGD with momentum), three copies of the same
parameters and gradients step alternately; the table shows the median step time
of each implementation relative to the for-loop (torch's choice on CPU) and the
largest parameter difference from the for-loop after all steps.

    .venv/bin/python benchmarks/bench_optimizer_impl.py [--threads 1] [--steps 30]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Iterator

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import Samples, machine_note, plain_model, print_table  # noqa: E402

IMPLEMENTATIONS = {"for-loop": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}
OPTIMIZERS = ((torch.optim.Adam, {}), (torch.optim.AdamW, {"weight_decay": 0.01}),
              (torch.optim.SGD, {"momentum": 0.9}))


def models() -> Iterator[tuple[str, torch.nn.Module]]:
    from hetfair.bert.model import BertConfig, BertModel

    yield "mnist_mlp", plain_model("mnist_mlp")
    yield "mnist_cnn", plain_model("mnist_cnn")
    yield "bert_mini", BertModel(BertConfig(vocab_size=8000, hidden_size=256, num_hidden_layers=4,
                                            num_attention_heads=4, intermediate_size=1024))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--steps", type=int, default=30, help="alternating steps per implementation (5 warm-up)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    rows = []
    for model_name, model in models():
        params = [p.detach() for p in model.parameters()]
        grads = [torch.randn_like(p) * 1e-3 for p in params]
        for torch_class, settings in OPTIMIZERS:
            copies, optimizers, times = {}, {}, {}
            for name, kwargs in IMPLEMENTATIONS.items():
                copies[name] = [torch.nn.Parameter(p.clone()) for p in params]
                for copy, grad in zip(copies[name], grads):
                    copy.grad = grad.clone()
                optimizers[name] = torch_class(copies[name], lr=1e-3, **settings, **kwargs)
                times[name] = Samples()
            for step in range(args.steps + 5):
                for name, optimizer in optimizers.items():
                    started = time.perf_counter()
                    optimizer.step()
                    if step >= 5:
                        times[name].add(time.perf_counter() - started)
            loop = times["for-loop"].median
            for name in IMPLEMENTATIONS:
                difference = max(float((a - b).detach().abs().max()) for a, b in zip(copies[name], copies["for-loop"]))
                rows.append([model_name, torch_class.__name__, name, f"{times[name].median * 1e3:.3f}",
                             f"{times[name].median / loop:.2f}", f"{difference:.1e}"])
    print_table(f"optimizer step, {args.threads} thread(s), median of {args.steps} alternating steps",
                ["model", "optimizer", "implementation", "ms/step", "vs for-loop", "max |param - for-loop's|"],
                rows)
    print(f"\n{machine_note()}")


if __name__ == "__main__":
    main()

"""The cost model against a published table: HetSeq's BERT-base step times on 1, 2, 4 and 8 nodes of 4 GPUs.

Source: HetSeq's README, "Performance table" (https://github.com/yifding/hetseq, README.md; Ding, Botzer,
Weninger, HetSeq, AAAI/IAAI 2021, arXiv:2009.14783): "Running BERT on nodes with 4 GPUs each", average time
per step 2.60 s, 2.69 s, 2.794 and 3.126 on 1, 2, 4 and 8 nodes. The run it describes, from the same repository:

- ``--max-sentences 32 --update-freq 4`` on every GPU (docs/source/examples.rst and
  STORE_RUN_FILE/Train_bert/node2gpu4/*.sh): a step is 4 micro-batches of 32 samples per GPU, phase-one
  samples of 128 tokens (``--data .../test_128``);
- fp32 (``--fp16`` is commented out in hetseq/options.py; the README lists "fp16 support" as a future patch);
- ``--ddp-backend c10d`` (PyTorch DDP, the only choice), ``--bucket-cap-mb 25``, with ``no_sync`` on all
  micro-batches but the last (hetseq/controller.py), so the gradients' all-reduce overlaps only the last
  micro-batch's backward; Adam;
- the GPUs: the two-node job's scripts queue on ``gpu@qa-xp-004`` and ``gpu@qa-xp-008``, Notre Dame CRC nodes of
  4 NVIDIA TITAN Xp (the only BERT scripts in the repository). The README does not name the GPUs of the 4- and
  8-node rows, nor the network; this script assumes the same TITAN Xp nodes throughout.

How the cost model is used, with no factor of its own: the model is hetfair's ``bert_base`` with HetSeq's
vocabulary (30,522 tokens) and NSP head, its parameters counted exactly (on the meta device). A step is
:func:`hetfair.parallel.cost_model.replicated` of 4 micro-batches of 32 on each of the ``W = 4 N`` ranks
(``Job.accumulation``: the all-reduce, one ring over every GPU in 25 MB buckets, overlaps only the last
micro-batch's backward). Calibrated on the 1- and 2-node rows only:

1. the seconds per sample on a TITAN Xp (its compute efficiency) from the 1-node row;
2. the network's bandwidth from the 2-node row, its latency held at 50 us (hetfair's default for a network
   given without one): an Ethernet or InfiniBand hop under NCCL's socket transport costs tens of microseconds
   whatever the fabric, while the bandwidth NCCL reaches over sockets varies by an order of magnitude with
   the NIC and the host, so the latency is the parameter the hardware pins down and the bandwidth the one
   to fit. (Fitting the latency instead, with the bandwidth of a 10 GbE link, has no solution: 10 GbE
   alone takes 0.62 s per all-reduce at 2 nodes, more than the 0.09 s overhead plus the 0.43 s of backward
   that hides it.)

Then the 4- and 8-node rows are predicted. Runs in about a second, with no network and no GPU:
``python benchmarks/bench_published.py``.
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from hetfair.bert.config import BertConfig  # noqa: E402
from hetfair.cluster.description import DEFAULT_INTRA_NODE, Link  # noqa: E402
from hetfair.models import MODEL_REGISTRY, resolve_arch  # noqa: E402
from hetfair.parallel.cost_model import Job, ModelCost, Rank, replicated  # noqa: E402

# -- the published table and the run it describes ------------------------------------------------------------
HETSEQ_SOURCE = "HetSeq README.md, 'Performance table' (github.com/yifding/hetseq; arXiv:2009.14783)"
HETSEQ_STEP_SECONDS = {1: 2.60, 2: 2.69, 4: 2.794, 8: 3.126}
"""Average seconds per step by nodes (4 GPUs each), as published."""
CALIBRATION_NODES = (1, 2)
PREDICTED_NODES = (4, 8)
GPUS_PER_NODE = 4
MICRO_BATCH = 32  # --max-sentences 32
UPDATE_FREQ = 4  # --update-freq 4
HETSEQ_VOCAB = 30522  # uncased_L-12_H-768_A-12/vocab.txt
ADAM_STATE_RATIO = 2.0

# NVIDIA TITAN Xp: 3,840 CUDA cores at 1,582 MHz boost = 12.15 TFLOP/s fp32; 547.7 GB/s; 12 GB (NVIDIA's
# TITAN Xp specifications, https://www.nvidia.com/en-us/titan/titan-xp/).
TITAN_XP_FP32 = 12.15e12
TITAN_XP_MEMORY_BANDWIDTH = 547.7e9
TITAN_XP_MEMORY = 12 * 2**30
NETWORK_LATENCY = 50e-6  # held, not fitted (see the module docstring)

STEP_GOAL = 0.05  # predicted step times within 5%
OVERHEAD_GOAL = 0.25  # predicted overheads over one node within 25%


@dataclass(frozen=True)
class Calibration:
    """The fitted physical parameters: a TITAN Xp's seconds per sample and the network link."""

    seconds_per_sample: float
    network: Link
    flops_per_sample: float

    @property
    def efficiency(self) -> float:
        """The fraction of a TITAN Xp's fp32 peak the fitted speed is."""
        return self.flops_per_sample / self.seconds_per_sample / TITAN_XP_FP32


def bert_base_cost(sequence: int = 128, masked: int = 20) -> ModelCost:
    """hetfair's ``bert_base`` with HetSeq's vocabulary and NSP head: parameters counted exactly and the FLOPs of
    one sample (``sequence`` tokens, ``masked`` of them predicted: NVIDIA's phase-one max_predictions_per_seq),
    both on the meta device (no memory, no weights)."""
    name, defaults = resolve_arch("bert_base")
    model_class = MODEL_REGISTRY.get(name)
    sizes = {key: value for key, value in defaults.items() if key in BertConfig.__dataclass_fields__}
    with torch.device("meta"):
        model = model_class(BertConfig(vocab_size=HETSEQ_VOCAB, **sizes), nsp=True)
    parameters = sum(p.numel() for p in model.parameters())  # the tied embedding once
    layer_bytes = 4 * sum(p.numel() for p in model.layers[0].parameters())
    return ModelCost(parameters=parameters, flops_per_sample=_flops_per_sample(model, sequence, masked),
                     activation_bytes=0, optimizer_ratio=ADAM_STATE_RATIO, units=len(model.layers) + 1,
                     largest_unit_bytes=layer_bytes)


def _flops_per_sample(model: torch.nn.Module, sequence: int, masked: int) -> float:
    """Forward and backward FLOPs of one sample (torch's FlopCounterMode on meta tensors)."""
    from torch.utils.flop_counter import FlopCounterMode

    ids = torch.zeros(1, sequence, dtype=torch.long, device="meta")
    counter = FlopCounterMode(display=False)
    with counter:
        output = _masked_forward(model, ids, masked)
        output.sum().backward()
    return float(counter.get_total_flops())


def _masked_forward(model: torch.nn.Module, ids: torch.Tensor, masked: int) -> torch.Tensor:
    """The model's forward with the LM head on ``masked`` positions (meta tensors cannot take a boolean mask)."""
    from hetfair.bert.model import encode

    hidden = encode(model.embeddings, model.layers, ids, None, None)
    scores = model.lm_head(hidden[:, :masked].reshape(-1, hidden.shape[-1]))
    nsp = model.nsp_head(torch.tanh(model.pooler(hidden[:, 0])))
    return scores.sum() + nsp.sum()


def hetseq_job(cost: ModelCost, nodes: int, seconds_per_sample: float, network: Link) -> Job:
    """One HetSeq step: ``UPDATE_FREQ`` micro-batches of 32 samples on each of the ``4 nodes`` TITAN Xps."""
    ranks = tuple(Rank(node, seconds_per_sample, TITAN_XP_MEMORY, TITAN_XP_MEMORY_BANDWIDTH, MICRO_BATCH * UPDATE_FREQ)
                  for node in range(nodes) for _gpu in range(GPUS_PER_NODE))
    return Job(cost, ranks, (DEFAULT_INTRA_NODE,) * nodes, network, overlaps=True, accumulation=UPDATE_FREQ)


def step_seconds(cost: ModelCost, nodes: int, seconds_per_sample: float, network: Link) -> float:
    """One HetSeq step as the cost model's :func:`replicated` predicts it: all micro-batches but the last under
    ``no_sync``, DDP's all-reduce overlapping the last one's backward."""
    return replicated(hetseq_job(cost, nodes, seconds_per_sample, network)).seconds


def calibrate(cost: ModelCost) -> Calibration:
    """The seconds per sample from the 1-node row, then the network bandwidth from the 2-node row."""
    first, second = CALIBRATION_NODES
    network = Link(1e9, NETWORK_LATENCY)  # one node never crosses it
    speed = _solve(lambda s: step_seconds(cost, first, s, network) - HETSEQ_STEP_SECONDS[first], 1e-4, 1.0)
    log_bandwidth = _solve(lambda b: step_seconds(cost, second, speed, Link(math.exp(b), NETWORK_LATENCY))
                           - HETSEQ_STEP_SECONDS[second], math.log(1e7), math.log(1e12))
    return Calibration(speed, Link(math.exp(log_bandwidth), NETWORK_LATENCY), cost.flops_per_sample)


def _solve(f: Callable[[float], float], low: float, high: float) -> float:
    """The root of ``f`` between ``low`` and ``high`` (``f`` monotonic, of opposite signs there), by bisection."""
    if (f(low) > 0) == (f(high) > 0):
        raise ValueError("the calibration has no solution in range: the published row cannot be fitted")
    for _ in range(200):
        middle = (low + high) / 2
        if (f(middle) > 0) == (f(low) > 0):
            low = middle
        else:
            high = middle
    return (low + high) / 2


@dataclass(frozen=True)
class Row:
    setting: str
    published: float
    predicted: float
    fitted: bool

    @property
    def error(self) -> float:
        return self.predicted / self.published - 1


def hetseq_rows(cost: ModelCost, calibration: Calibration) -> list[Row]:
    """Step times on every row, then the overhead over one node on the predicted rows."""
    predicted = {n: step_seconds(cost, n, calibration.seconds_per_sample, calibration.network)
                 for n in HETSEQ_STEP_SECONDS}
    rows = [Row(f"{n} node{'s' if n > 1 else ''} ({n * GPUS_PER_NODE} GPUs): step", HETSEQ_STEP_SECONDS[n],
                predicted[n], n in CALIBRATION_NODES) for n in HETSEQ_STEP_SECONDS]
    for n in PREDICTED_NODES:
        rows.append(Row(f"{n} nodes ({n * GPUS_PER_NODE} GPUs): overhead over 1 node",
                        HETSEQ_STEP_SECONDS[n] - HETSEQ_STEP_SECONDS[1], predicted[n] - predicted[1], False))
    return rows


def goals_met(rows: Sequence[Row]) -> tuple[bool, bool]:
    """(every predicted step within :data:`STEP_GOAL`, every predicted overhead within :data:`OVERHEAD_GOAL`)."""
    steps = [row for row in rows if not row.fitted and "overhead" not in row.setting]
    overheads = [row for row in rows if "overhead" in row.setting]
    return (all(abs(row.error) <= STEP_GOAL for row in steps),
            all(abs(row.error) <= OVERHEAD_GOAL for row in overheads))


def format_table(rows: Sequence[Row]) -> list[str]:
    """A Markdown table: setting, published, predicted, error."""
    lines = ["| setting | published | predicted | error |", "|---|---|---|---|"]
    for row in rows:
        error = "fitted" if row.fitted else f"{row.error:+.1%}"
        lines.append(f"| {row.setting} | {row.published:.3f} s | {row.predicted:.3f} s | {error} |")
    return lines


def report(cost: ModelCost, calibration: Calibration) -> list[str]:
    rows = hetseq_rows(cost, calibration)
    steps_ok, overheads_ok = goals_met(rows)
    return [
        f"HetSeq BERT-base, {HETSEQ_SOURCE}",
        f"model: hetfair bert_base + NSP, vocab {HETSEQ_VOCAB}: {cost.parameters:,} parameters, "
        f"{cost.flops_per_sample / 1e9:.1f} GFLOP per sample (128 tokens, 20 predicted)",
        f"fitted on 1 node: {calibration.seconds_per_sample * 1e3:.2f} ms per sample on a TITAN Xp "
        f"(efficiency {calibration.efficiency:.2f} of its fp32 peak)",
        f"fitted on 2 nodes: network {calibration.network.bandwidth * 8 / 1e9:.1f} Gbit/s "
        f"(latency held at {calibration.network.latency * 1e6:.0f} us)",
        "",
        *format_table(rows),
        "",
        f"HetSeq goals: step times within {STEP_GOAL:.0%}: {'met' if steps_ok else 'NOT met'}; "
        f"overheads within {OVERHEAD_GOAL:.0%}: {'met' if overheads_ok else 'NOT met'}",
    ]


def main(argv: Sequence[str] | None = None) -> int:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args(argv)
    cost = bert_base_cost()
    print("\n".join(report(cost, calibrate(cost))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

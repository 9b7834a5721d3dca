"""Will it scale? The lab cluster of examples/clusters/lab.toml grown to 8, 16, 32 and 64 nodes, predicted.

The lab's three node types (4 x RTX 3090, 2 x V100 16GB, 2 x A100 80GB) repeat round-robin, so every size
keeps their mix, on the lab's 10 GbE network (50 us). Two models, each built from hetfair's registries as
``hetfair-train --arch`` builds it and measured once on this machine's CPU
(:func:`hetfair.plan.model_cost.measure_model_cost`, Adam):

- ``bert_base`` (the BERT family, masked LM without NSP, 30,522-token vocabulary), samples of 128 tokens;
- ``gpt2_small`` (the language-modelling family, GPT-2's 50,257-token vocabulary), samples of 512 tokens
  (half GPT-2's context; the FLOPs per token differ from 1,024 tokens' only by the attention's share),
  counted on the meta device: the same FLOPs and activations as on the CPU, without computing them (BERT's
  masked LM picks its masked positions by their values, which the meta device does not have).

The global batch is 32 samples per device (256 on 8 nodes of the mix, whose 8 nodes hold 22 devices: 704).
For each size: the fastest mode :func:`hetfair.plan.cluster_plan.predict_all` finds (lossy ones included),
the fastest exact one, and plain DDP (``c10d`` without a comm hook), each with its samples per second,
scaling efficiency (the rate over every device's rate training alone) and what dominates its update.
``python benchmarks/project_cluster.py`` runs in well under a minute on a CPU.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from hetfair.bert.masking import IGNORE_INDEX  # noqa: E402
from hetfair.cluster.description import Cluster, Node, load_cluster  # noqa: E402
from hetfair.criteria import CRITERION_REGISTRY  # noqa: E402
from hetfair.models import MODEL_REGISTRY, resolve_arch  # noqa: E402
from hetfair.parallel.cost_model import ModelCost  # noqa: E402
from hetfair.plan.cluster_plan import Prediction, predict_all  # noqa: E402
from hetfair.plan.model_cost import measure_model_cost  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
LAB = ROOT / "examples" / "clusters" / "lab.toml"
SIZES = (8, 16, 32, 64)
SAMPLES_PER_DEVICE = 32
BERT_TOKENS, BERT_VOCAB, MASK_SHARE = 128, 30522, 0.15
GPT_TOKENS, GPT_VOCAB = 512, 50257


# -- the cluster --------------------------------------------------------------------------------------------
def scaled_lab(nodes: int, lab: Cluster | None = None) -> Cluster:
    """``nodes`` nodes of the lab's node types, round-robin, on the lab's network."""
    lab = lab or load_cluster(LAB)
    types = lab.nodes
    grown = tuple(Node(f"{types[i % len(types)].name}-{i // len(types) + 1}", types[i % len(types)].devices,
                       types[i % len(types)].link, types[i % len(types)].uplink) for i in range(nodes))
    return Cluster(grown, lab.network)


# -- the models ---------------------------------------------------------------------------------------------
def _build(arch: str, task: Any, **flags: Any) -> torch.nn.Module:
    """``--arch arch`` as hetfair-train builds it: the model's flag defaults, the arch's preset, then ``flags``."""
    name, preset = resolve_arch(arch)
    model_class = MODEL_REGISTRY.get(name)
    parser = argparse.ArgumentParser()
    model_class.add_args(parser)
    args = parser.parse_args([])
    vars(args).update(preset, **flags)
    return model_class.build_model(args, task)


def _optimizer(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.Adam(params)


def bert_base_cost() -> ModelCost:
    """``bert_base`` (masked LM, no NSP) on 128-token samples with 15% of the tokens predicted."""
    task = SimpleNamespace(vocab=range(BERT_VOCAB), max_positions=lambda: BERT_TOKENS)
    model = _build("bert_base", task, nsp=False)
    criterion = CRITERION_REGISTRY.get("masked_lm")(task)
    masked = int(BERT_TOKENS * MASK_SHARE)

    def batch_of(n: int) -> dict[str, Any]:
        ids = torch.randint(5, BERT_VOCAB, (n, BERT_TOKENS))
        target = torch.full_like(ids, IGNORE_INDEX)
        target[:, 1:1 + masked] = ids[:, 1:1 + masked]
        return {"net_input": {"input_ids": ids, "token_type_ids": torch.zeros_like(ids),
                              "attention_mask": torch.ones_like(ids, dtype=torch.bool)},
                "target": target, "nsentences": n, "ntokens": n * BERT_TOKENS}

    return measure_model_cost(model, criterion, batch_of, model.sharding_units(), _optimizer)


def gpt2_small_cost() -> ModelCost:
    """``gpt2_small`` on 512-token samples (next-token loss on every position)."""
    task = SimpleNamespace(vocab_size=GPT_VOCAB, max_positions=lambda: GPT_TOKENS, pad_index=1)
    with torch.device("meta"):
        model = _build("gpt2_small", task)
    criterion = CRITERION_REGISTRY.get("lm_cross_entropy")(task)

    def batch_of(n: int) -> dict[str, Any]:
        # made on the meta device: its input and target share one storage, as on the CPU
        tokens = torch.randint(5, GPT_VOCAB, (n, GPT_TOKENS + 1), device="meta")
        return {"net_input": {"src_tokens": tokens[:, :-1]}, "target": tokens[:, 1:], "nsentences": n,
                "ntokens": n * GPT_TOKENS}

    return measure_model_cost(model, criterion, batch_of, model.sharding_units(), _optimizer)


MODELS: dict[str, Callable[[], ModelCost]] = {
    f"bert_base ({BERT_TOKENS} tokens)": bert_base_cost,
    f"gpt2_small ({GPT_TOKENS} tokens)": gpt2_small_cost,
}


# -- the projection -----------------------------------------------------------------------------------------
def is_plain_ddp(p: Prediction) -> bool:
    return (p.backend == "c10d" and p.config.ddp_comm_hook in (None, "none")
            and p.config.zero_sharding in (None, "none"))


def why(p: Prediction) -> str:
    """What dominates the update: compute, or the communication the compute does not hide (which one)."""
    compute, shown = p.cost.compute, p.cost.exposed
    if p.backend in ("diloco", "localsgd"):
        what = "round exchange"
    elif p.backend == "c10d":
        what = "all-reduce"
    else:
        what = "all-gathers"
    lead = "compute" if compute >= shown else what
    return f"{lead} ({_ms(compute)} compute, {_ms(shown)} {what} shown)"


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:,.0f} ms"


def pick(predictions: Sequence[Prediction]) -> dict[str, Prediction]:
    """The fastest that fits, the fastest exact one, and the fastest plain DDP."""
    fitting = [p for p in predictions if p.fits]
    return {"best": fitting[0], "best exact": next(p for p in fitting if not p.lossy),
            "plain DDP": next(p for p in fitting if is_plain_ddp(p))}


def projection_rows(cost: ModelCost, sizes: Sequence[int] = SIZES) -> list[tuple[str, ...]]:
    lab = load_cluster(LAB)
    rows = []
    for nodes in sizes:
        cluster = scaled_lab(nodes, lab)
        batch = SAMPLES_PER_DEVICE * cluster.world_size
        for role, p in pick(predict_all(cluster, cost, batch)).items():
            rows.append((str(nodes), str(cluster.world_size), role, p.label(), p.split,
                         f"{p.samples_per_second:,.0f}", f"{p.efficiency:.2f}", why(p)))
    return rows


HEADER = ("nodes", "GPUs", "role", "mode", "split", "samples/s", "efficiency", "why")


def format_table(rows: Sequence[Sequence[str]]) -> list[str]:
    """A Markdown table of :data:`HEADER` columns."""
    lines = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    return lines + ["| " + " | ".join(row) + " |" for row in rows]


def main(argv: Sequence[str] | None = None) -> int:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args(argv)
    torch.manual_seed(0)
    for name, measure in MODELS.items():
        cost = measure()
        print(f"{name}: {cost.parameters:,} parameters, {cost.flops_per_sample / 1e9:.1f} GFLOP per sample; "
              f"global batch {SAMPLES_PER_DEVICE} per GPU; lab nodes round-robin on 10 GbE")
        print("")
        print("\n".join(format_table(projection_rows(cost))))
        print("")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

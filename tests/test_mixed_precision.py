"""Mixed precision on real gloo processes: tracking fp32, split-independence, mixed jobs, one loss scale.

Tolerances are on :func:`amp_reference.change_error`, the distance between a run's
total parameter change and a plain-PyTorch fp32 reference's, relative to its size
(over 16 MNIST or 4 BERT updates). Measured on 2 CPU cores (AVX2) and stated
here with margin: bf16 tracks fp32 within 1.0% (MNIST MLP) and 0.6% (bert_tiny),
fp16 within 0.4% and 0.08%; splitting the global batch 2+6+24 over three
processes moves a bf16 run by 0.4% and an fp16 run by 0.06%, the rounding of
each rank's low-precision gradient (fp32 runs agree to 1e-6). A plain fp32 run
with twice the batch is 6.5% (MNIST) and 197% (BERT) away from the reference.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import numpy as np
import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import overflow_worker
from amp_reference import PLUGIN_DIR, Params, bert_reference, change_error, mnist_reference
from bert_helpers import make_data_dir
from helpers import TOY_PLUGIN, final_parameters, free_port, run_nodes
from hetfair.checkpoint.layout import load_checkpoint
from hetfair.parallel.context import DistributedContext
from hetfair.logging.meters import IntervalStats
from hetfair.options import parse_train_args
from hetfair.plugins import import_user_dir
from hetfair.precision.mixed import LossScaleConfig, LossScaler, autocast
from hetfair.tasks import TASK_REGISTRY
from hetfair.run.wiring import build_trainer
from hetfair_cli.train import main as train_main
from hetfair.launch.supervisor import run_workers
from test_mnist_plugin import write_idx

MNIST_FLAGS = ["--arch", "mnist_mlp", "--optimizer", "sgd", "--lr", "0.05", "--lr-scheduler", "fixed", "--seed", "3",
               "--max-epoch", "0", "--valid-size", "0"]  # all 256 images train: eight full batches an epoch
MNIST_UPDATES = 16  # two epochs of 256 images in global batches of 32
BERT_FLAGS = ["--arch", "bert_tiny", "--hidden-dropout-prob", "0", "--attention-probs-dropout-prob", "0",
              "--tokens-per-sample", "64", "--optimizer", "sgd", "--lr", "0.5", "--lr-scheduler", "fixed", "--seed", "3"]
BERT_UPDATES = 4
GLOBAL_BATCH = 32
SPLIT = ["--distributed-world-size", "3", "--max-sentences", "2,6,24"]  # one command, three processes
TRACKING = {"bf16": 0.025, "fp16": 0.012}  # MNIST; bert_tiny below
BERT_TRACKING = {"bf16": 0.02, "fp16": 0.004}
Reference = Callable[[int, int, str], tuple[Params, Params]]
"""(updates, global batch size, precision) -> (initial, final) parameters of a plain loop."""


class Experiment:
    """One task's hetfair-train runs (each run once, its final parameters kept by name) and plain references."""

    def __init__(self, workdir: Path, train_args: list[str], updates: int, reference: Reference) -> None:
        self.workdir = workdir
        self.train_args = train_args
        self.updates = updates
        self._reference = reference
        self._runs: dict[str, Params] = {}
        self._references: dict[tuple[str, int], tuple[Params, Params]] = {}

    def params(self, name: str, *nodes: list[str]) -> Params:
        """Run one command per node (each list: that node's own flags) unless ``name`` already ran."""
        if name not in self._runs:
            save_dir = self.workdir / name
            common = [*self.train_args, "--max-update", str(self.updates), "--save-dir", str(save_dir),
                      "--no-epoch-checkpoints", "--disable-validation", "--log-format", "none",
                      "--distributed-timeout", "120"]
            for result in run_nodes([common + node for node in nodes], cwd=self.workdir, timeout=600):
                assert result.returncode == 0, result.stderr
            self._runs[name] = final_parameters(save_dir)
        return self._runs[name]

    def reference(self, precision: str = "fp32", update_size: int = GLOBAL_BATCH) -> tuple[Params, Params]:
        """(initial, final) parameters of the plain-PyTorch loop in ``precision``."""
        key = (precision, update_size)
        if key not in self._references:
            self._references[key] = self._reference(self.updates, update_size, precision)
        return self._references[key]

    def error(self, actual: Params, precision: str = "fp32") -> float:
        initial, expected = self.reference(precision)
        return change_error(actual, expected, initial)


def write_mnist_like(directory: Path, n_train: int = 256, n_test: int = 16) -> Path:
    """MNIST-format images that can be learnt: a fixed pattern per class plus noise."""
    rng = np.random.default_rng(0)
    templates = rng.uniform(0, 255, (10, 28, 28))
    for prefix, n in (("train", n_train), ("t10k", n_test)):
        labels = rng.integers(0, 10, n).astype(np.uint8)
        images = np.clip(templates[labels] + rng.normal(0, 60, (n, 28, 28)), 0, 255).astype(np.uint8)
        write_idx(directory / f"{prefix}-images-idx3-ubyte.gz", images)
        write_idx(directory / f"{prefix}-labels-idx1-ubyte.gz", labels)
    return directory


@pytest.fixture(scope="module")
def mnist(tmp_path_factory: pytest.TempPathFactory) -> Experiment:
    workdir = tmp_path_factory.mktemp("amp_mnist")
    flags = ["--data", str(write_mnist_like(workdir)), *MNIST_FLAGS]
    return Experiment(workdir, ["--user-dir", str(PLUGIN_DIR), "--task", "mnist", *flags], MNIST_UPDATES,
                      lambda updates, size, precision: mnist_reference(flags, updates, size, precision))


@pytest.fixture(scope="module")
def bert(tmp_path_factory: pytest.TempPathFactory) -> Experiment:
    workdir = tmp_path_factory.mktemp("amp_bert")
    data, _, _ = make_data_dir(workdir, n_docs=120, splits=("train",))
    flags = ["--data", str(data), *BERT_FLAGS]
    return Experiment(workdir, ["--task", "bert", *flags], BERT_UPDATES,
                      lambda updates, size, precision: bert_reference(flags, updates, size, precision))


def one_process(precision: str) -> list[str]:
    return ["--max-sentences", str(GLOBAL_BATCH), "--precision", precision]


# -- the built-in models under autocast --------------------------------------------------


def bert_sample(vocab: int = 50) -> dict:
    """A padded batch of 3 with 4 masked tokens and NSP labels."""
    generator = torch.Generator().manual_seed(0)
    lengths = torch.tensor([12, 7, 3])
    attention_mask = torch.arange(12) < lengths[:, None]
    input_ids = torch.randint(5, vocab, (3, 12), generator=generator) * attention_mask
    target = torch.full((3, 12), -100)
    target[0, 1], target[0, 5], target[1, 2], target[2, 1] = 7, 8, 9, 10
    return {"net_input": {"input_ids": input_ids, "token_type_ids": torch.zeros_like(input_ids),
                          "attention_mask": attention_mask},
            "target": target, "nsentence_labels": torch.tensor([0, 1, 0]), "nsentences": 3, "ntokens": 22}


def mnist_sample() -> dict:
    generator = torch.Generator().manual_seed(0)
    return {"net_input": {"x": torch.randn(4, 1, 28, 28, generator=generator)}, "target": torch.tensor([0, 3, 9, 1]),
            "nsentences": 4, "ntokens": 4}


def builtin_models() -> dict[str, tuple[torch.nn.Module, torch.nn.Module, dict]]:
    """name -> (model, criterion, sample) for BERT (NSP, padding, LM head at masked positions) and MNIST."""
    import_user_dir(PLUGIN_DIR)
    from hetfair.bert.criterion import MaskedLmCriterion
    from hetfair.bert.model import BertConfig, BertModel
    from hetfair.criteria.cross_entropy import CrossEntropyCriterion
    from plugins.mnist_models import MnistCNN, MnistMLP

    bert = BertModel(BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                intermediate_size=32, max_position_embeddings=24), nsp=True)
    return {"bert": (bert, MaskedLmCriterion(None), bert_sample()),
            "mnist_cnn": (MnistCNN(8, 16, 32, 0.1), CrossEntropyCriterion(None), mnist_sample()),
            "mnist_mlp": (MnistMLP(32, 0.1), CrossEntropyCriterion(None), mnist_sample())}


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
@pytest.mark.parametrize("name", ["bert", "mnist_cnn", "mnist_mlp"])
def test_builtin_models_train_under_autocast_with_fp32_loss_and_gradients(name: str, precision: str) -> None:
    model, criterion, sample = builtin_models()[name]
    with autocast(precision, torch.device("cpu")):
        loss, sample_size, logs = criterion(model.train(), sample)
    loss.backward()
    assert loss.dtype == torch.float32 and torch.isfinite(loss) and sample_size == 4
    assert all(p.grad is not None and p.grad.dtype == torch.float32 and torch.isfinite(p.grad).all()
               for p in model.parameters())
    assert all(isinstance(value, float) for value in logs.values())


# -- tracking fp32 -------------------------------------------------------------------


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_low_precision_tracks_fp32_on_mnist(mnist: Experiment, precision: str) -> None:
    assert mnist.error(mnist.params(precision, one_process(precision))) < TRACKING[precision]


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_one_process_is_plain_autocast_with_one_loss_scale(mnist: Experiment, precision: str) -> None:
    """Against torch.autocast (+ torch.amp.GradScaler for fp16), hetfair's update is the same to fp32 rounding.

    32 samples: hetfair's summed loss is the plain mean times 2**5, which scales every
    low-precision gradient exactly, so nothing but fp32 rounding separates the two.
    """
    assert mnist.error(mnist.params(precision, one_process(precision)), precision) < 1e-5


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_low_precision_tracks_fp32_on_bert_tiny(bert: Experiment, precision: str) -> None:
    assert bert.error(bert.params(precision, one_process(precision))) < BERT_TRACKING[precision]


@pytest.mark.parametrize("experiment,tolerances", [("mnist", TRACKING), ("bert", BERT_TRACKING)])
def test_tolerances_are_tighter_than_a_wrong_batch(request: pytest.FixtureRequest, experiment: str,
                                                  tolerances: dict[str, float]) -> None:
    """Guards the tolerances above: a plain fp32 run with twice the batch is farther off than any of them."""
    runs: Experiment = request.getfixturevalue(experiment)
    _, doubled = runs.reference(update_size=2 * GLOBAL_BATCH)
    assert runs.error(doubled) > 2 * max(tolerances.values())


# -- split-independence and mixed jobs -------------------------------------------------


def test_bf16_update_does_not_depend_on_the_split(mnist: Experiment) -> None:
    initial, _ = mnist.reference()
    split = mnist.params("bf16_split", [*SPLIT, "--bf16"])
    assert change_error(split, mnist.params("bf16", one_process("bf16")), initial) < 0.015


def test_fp16_bert_update_does_not_depend_on_the_split(bert: Experiment) -> None:
    initial, _ = bert.reference()
    split = bert.params("fp16_split", [*SPLIT, "--fp16"])
    assert change_error(split, bert.params("fp16", one_process("fp16")), initial) < 0.004


def test_a_job_of_fp32_bf16_and_fp16_ranks_tracks_fp32(mnist: Experiment) -> None:
    """Node A starts two processes (fp32 with 2 samples, bf16 with 6), node B one (fp16, 24 samples)."""
    init = f"tcp://127.0.0.1:{free_port()}"
    job = ["--distributed-world-size", "3", "--distributed-init-method", init]
    node_a = [*job, "--distributed-rank", "0", "--distributed-gpus", "2", "--max-sentences", "2,6",
              "--precision", "fp32,bf16"]
    node_b = [*job, "--distributed-rank", "2", "--distributed-gpus", "1", "--max-sentences", "24", "--fp16"]
    assert mnist.error(mnist.params("mixed", node_a, node_b)) < TRACKING["bf16"]
    scale = load_checkpoint(mnist.workdir / "mixed" / "checkpoint_last.pt")["loss_scale"]
    assert scale == {"scale": 128.0, "clean_updates": MNIST_UPDATES}  # fp16 on rank 2: the job scales its loss


# -- one loss scale: overflow, logging, the minimum, resume -------------------------------


def test_an_overflow_on_one_rank_makes_every_rank_skip_that_update(tmp_path: Path) -> None:
    init = f"tcp://127.0.0.1:{free_port()}"
    run_workers(len(overflow_worker.PRECISIONS), 0, overflow_worker.run_rank, (init, str(tmp_path)))
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(len(overflow_worker.PRECISIONS))]
    poisoned = overflow_worker.POISONED_STEP
    for records in ranks:
        assert [r["skipped"] for r in records] == [step == poisoned for step in range(overflow_worker.STEPS)]
        # window 2: doubled after two clean updates, halved by the overflow, doubled two clean updates later
        assert [r["loss_scale"] for r in records] == [128.0, 256.0, 128.0, 128.0, 256.0]
        assert [r["num_updates"] for r in records] == [1, 2, 2, 3, 4]
        before, skipped, after = records[poisoned - 1], records[poisoned], records[poisoned + 1]
        for name in before["params"]:
            assert torch.equal(skipped["params"][name], before["params"][name])
            assert not torch.equal(after["params"][name], before["params"][name])  # training goes on
        for index, state in before["optimizer"]["state"].items():
            assert torch.equal(skipped["optimizer"]["state"][index]["momentum_buffer"], state["momentum_buffer"])
    for name, value in ranks[0][-1]["params"].items():
        assert torch.equal(ranks[1][-1]["params"][name], value)


def test_loss_scaling_leaves_an_fp32_update_bit_for_bit_the_same() -> None:
    """An fp32 rank in a job with an fp16 rank scales its loss by S = 2**k: exact, so nothing changes."""
    args = parse_train_args(["--user-dir", str(TOY_PLUGIN), "--task", "toy", "--optimizer", "sgd", "--lr", "0.5"])
    task = TASK_REGISTRY.get("toy").setup_task(args)
    data = task.dataset("train")
    batches = [task.collater([data[i] for i in range(start, start + 16)]) for start in range(0, 64, 16)]
    context = DistributedContext(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    params = []
    for scaler in (None, LossScaler(LossScaleConfig(init_scale=2.0**10, scale_window=2))):
        torch.manual_seed(0)
        trainer = build_trainer(args, task.build_model(args), task.build_criterion(args), context, batches[0],
                                scaler)
        for batch in batches:
            trainer.train_step([batch])
        params.append(trainer.model.state_dict())
    assert scaler.scale == 2.0**12  # it grew twice: the scale changed along the way
    for name, value in params[0].items():
        assert torch.equal(params[1][name], value)


def toy_fp16(save_dir: Path, *extra: str) -> list[str]:
    """The toy task in fp16 with a first loss scale of 2**18, so the first updates overflow."""
    return ["--user-dir", str(TOY_PLUGIN), "--task", "toy", "--save-dir", str(save_dir), "--optimizer", "sgd",
            "--lr", "0.5", "--fp16", "--fp16-init-scale", str(2**18), "--fp16-scale-window", "3",
            "--disable-validation", *extra]


def test_overflows_are_skipped_logged_and_not_counted_as_updates(tmp_path: Path, capsys) -> None:
    logdir = tmp_path / "tb"
    assert train_main(toy_fp16(tmp_path / "ckpt", "--max-update", "6", "--log-interval", "1", "--log-format", "json",
                               "--tensorboard-logdir", str(logdir))) == 0
    records = [json.loads(line) for line in capsys.readouterr().err.splitlines() if line.startswith("{")]
    inner = [r for r in records if r["phase"] == "train_inner"]
    assert [r["num_updates"] for r in inner] == [1, 2, 3, 4, 5, 6]  # skipped updates have no number of their own
    skipped = sum(r["skipped"] for r in inner)
    assert skipped >= 1 and inner[-1]["loss_scale"] < 2**18
    assert inner[0]["loss_scale"] == 2**18 / 2 ** inner[0]["skipped"]  # each overflow halved the scale
    state = load_checkpoint(tmp_path / "ckpt" / "checkpoint_last.pt")
    assert state["trainer"]["num_updates"] == 6 and state["loss_scale"]["scale"] == inner[-1]["loss_scale"]
    assert state["position"]["samples_done"] == 16 * (6 + skipped)  # the data moved on through skipped updates
    events = EventAccumulator(str(logdir / "train_inner"))
    events.Reload()
    assert [e.value for e in events.Scalars("loss_scale")] == [r["loss_scale"] for r in inner]
    assert sum(e.value for e in events.Scalars("skipped")) == skipped


def test_reaching_min_loss_scale_stops_with_one_line(tmp_path: Path, capsys) -> None:
    code = train_main(toy_fp16(tmp_path / "ckpt", "--fp16-init-scale", "1e30", "--min-loss-scale", "1e29",
                               "--log-format", "none", "--max-epoch", "1"))
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1
    assert err.startswith("hetfair-train: error: gradients overflow even at loss scale 1.25e+29, and halving it "
                          "would take it to or below --min-loss-scale 1e+29;")


def test_resume_restores_the_loss_scale_exactly(tmp_path: Path) -> None:
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    assert train_main(toy_fp16(full, "--max-update", "12", "--log-format", "none")) == 0
    assert train_main(toy_fp16(resumed, "--max-update", "5", "--log-format", "none")) == 0
    midway = load_checkpoint(resumed / "checkpoint_last.pt")["loss_scale"]
    assert midway["scale"] < 2**18  # it overflowed, so the saved scale is not where a fresh run starts
    assert train_main(toy_fp16(resumed, "--max-update", "12", "--log-format", "none")) == 0
    expected, actual = load_checkpoint(full / "checkpoint_last.pt"), load_checkpoint(resumed / "checkpoint_last.pt")
    assert actual["loss_scale"] == expected["loss_scale"]
    assert actual["epoch_stats"]["skipped"] == expected["epoch_stats"]["skipped"]
    for name, value in expected["trainer"]["model"].items():
        assert torch.equal(actual["trainer"]["model"][name], value)


def test_precision_may_change_on_resume(tmp_path: Path) -> None:
    save_dir = tmp_path / "ckpt"
    assert train_main(toy_fp16(save_dir, "--max-update", "4", "--log-format", "none")) == 0
    bf16 = [arg if arg != "--fp16" else "--bf16" for arg in toy_fp16(save_dir, "--max-update", "6",
                                                                      "--log-format", "none")]
    assert train_main(bf16) == 0
    state = load_checkpoint(save_dir / "checkpoint_last.pt")
    assert state["trainer"]["num_updates"] == 6 and "loss_scale" not in state  # no fp16 rank: no scale to keep
    assert train_main(toy_fp16(save_dir, "--max-update", "8", "--fp16-init-scale", "64", "--log-format", "none")) == 0
    state = load_checkpoint(save_dir / "checkpoint_last.pt")
    assert state["trainer"]["num_updates"] == 8 and state["loss_scale"] == {"scale": 64.0, "clean_updates": 2}


def test_epoch_stats_saved_before_loss_scaling_still_load() -> None:
    stats = IntervalStats(lambda totals: {})
    old = {key: value for key, value in stats.state_dict().items() if key not in ("skipped", "loss_scale")}
    stats.load_state_dict(old)
    assert (stats.skipped, stats.loss_scale, stats.metrics()) == (0, None, {})

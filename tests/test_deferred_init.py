"""The deferred build: the same initial values as a plain build, one tensor at a time, and sharded ranks that
never hold the whole model (built or restored).

The reference is always a plain build of the same model after the same ``torch.manual_seed``.
"""

from __future__ import annotations

import ctypes
import json
import logging
from pathlib import Path
from typing import Callable, Iterator

import pytest
import torch
from torch import nn

import deferred_worker
from bert_helpers import make_data_dir
from helpers import free_port, node_commands, run_nodes
from lm_model_helpers import lm_train_args, make_lm_data
from toy_reference import toy_train_args
from hetfair.bert.config import BertConfig
from hetfair.bert.model import BertModel, bert_tiny
from hetfair.bert.tokenizer import read_vocab_file
from hetfair.checkpoint.layout import FORMAT_VERSION, TRAINER
from hetfair.classification.bert_classifier import BertClassifier
from hetfair.lm.config import LMConfig
from hetfair.lm.model import TransformerLM, gpt_tiny
from hetfair.memory.peak import current_bytes, peak_bytes, reset_peak
from hetfair.models.deferred_init import build_deferred, full_value
from hetfair.options import parse_train_args
from hetfair.tasks import TASK_REGISTRY
from hetfair.launch.supervisor import run_workers

MiB = 2**20
CPU = torch.device("cpu")


class Assorted(nn.Module):
    """What torch's own modules and nn.init do beyond Linear: buffers, padding rows, trunc_normal_ (a no-op on
    meta tensors), random factories, ``.data`` views, a slice initialised on its own, and load_state_dict from
    tensors made in the build (meta) and outside it (CPU)."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.BatchNorm1d(40)
        self.embed = nn.Embedding(20, 30, padding_idx=1)
        self.conv = nn.Conv2d(2, 3, 3)
        self.table = nn.Parameter(torch.empty(30, 20))
        nn.init.trunc_normal_(self.table, std=0.02)
        self.noise = nn.Parameter(torch.randn(5, 7))
        self.noise.data[0].uniform_(-1, 1)
        self.loaded = nn.Linear(3, 2)
        self.loaded.load_state_dict({"weight": torch.arange(6.0).view(2, 3), "bias": torch.ones(2, device="cpu")})
        self.register_buffer("steps", torch.tensor([3, 4]))


BUILDS: dict[str, Callable[[], nn.Module]] = {
    "example_mlp": lambda: pytest.importorskip(  # the plugin of plugins/hetfair_plugin_example
        "hetfair_plugin_example.model", reason="pip install -e plugins/hetfair_plugin_example").ExampleMLP(5, 32, 2),
    "bert_tiny": lambda: BertModel(BertConfig(vocab_size=300, **bert_tiny()), nsp=True),
    "bert_classifier": lambda: BertClassifier(BertConfig(vocab_size=300, **bert_tiny()), num_classes=3),
    "gpt_tiny_learned": lambda: TransformerLM(LMConfig(vocab_size=300, max_positions=32, positions="learned",
                                                       **_lm(gpt_tiny()))),
    "gpt_tiny_rotary": lambda: TransformerLM(LMConfig(vocab_size=300, max_positions=32, positions="rotary",
                                                      **_lm(gpt_tiny()))),
    "assorted": Assorted,
}


def _lm(arch: dict[str, int]) -> dict[str, int]:
    return {"embed_dim": arch["decoder_embed_dim"], "layers": arch["decoder_layers"],
            "attention_heads": arch["decoder_attention_heads"], "ffn_embed_dim": arch["decoder_ffn_embed_dim"]}


@pytest.mark.parametrize("name", BUILDS)
def test_a_deferred_build_replays_the_plain_build_exactly(name):
    build = BUILDS[name]
    torch.manual_seed(7)
    plain = build()
    plain_rng, plain_next = torch.random.get_rng_state(), torch.rand(4)
    torch.manual_seed(7)
    deferred = build_deferred(build)
    deferred_rng, deferred_next = torch.random.get_rng_state(), torch.rand(4)

    expected, actual = plain.state_dict(keep_vars=True), deferred.state_dict(keep_vars=True)
    assert list(actual) == list(expected)
    assert all(tensor.is_meta for tensor in actual.values())  # nothing materialised by the build
    for key, tensor in expected.items():
        value = full_value(actual[key])
        assert value.device == CPU and torch.equal(value, tensor.detach()), key
    # the generator ends where the plain build leaves it, so what draws next draws the same
    assert torch.equal(deferred_rng, plain_rng) and torch.equal(deferred_next, plain_next)


def test_tied_weights_stay_one_tensor():
    model = build_deferred(BUILDS["bert_tiny"])
    assert model.lm_head.weight is model.embeddings.word.weight


class Computed(nn.Module):
    """A parameter computed from another tensor's values: not replayable."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Parameter(torch.randn(4, 3))
        self.second = nn.Parameter(self.first.detach() * 2)


def test_what_cannot_be_replayed_builds_whole_with_one_line(caplog):
    torch.manual_seed(3)
    plain = Computed()
    torch.manual_seed(3)
    with caplog.at_level(logging.INFO, logger="hetfair.models.deferred_init"):
        model = build_deferred(Computed)
    lines = [record.getMessage() for record in caplog.records]
    assert len(lines) == 1 and lines[0].startswith("memory | the model builds whole: second ")
    assert not model.second.is_meta
    assert torch.equal(model.first, plain.first) and torch.equal(model.second, plain.second)
    assert torch.equal(full_value(model.second), plain.second.detach())


M_MMAP_THRESHOLD = -3
"""mallopt's parameter number (glibc's malloc.h)."""


def big_mlp() -> nn.Module:
    return deferred_worker.big_model()  # 144 MiB of fp32 parameters, nine weights of 16 MiB


@pytest.fixture
def tensors_in_their_own_pages() -> Iterator[None]:
    """glibc serves allocations of 1 MiB and more from mappings of their own, returned when freed, so the
    resident set follows the live tensors. Left to itself, glibc raises its mmap threshold to the size of
    each mapping freed (up to 32 MiB): the 16 MiB weights then come from the heap, whose free holes stay
    resident, and the peak depended on what the test process had done before (measured: 77.5 MiB in a
    fresh process, 88 MiB in one CI run, against 52-53.5 MiB with the threshold pinned)."""
    libc = ctypes.CDLL("libc.so.6")
    assert libc.mallopt(M_MMAP_THRESHOLD, 1 << 20) == 1
    try:
        yield
    finally:
        libc.mallopt(M_MMAP_THRESHOLD, 32 << 20)  # where glibc's own threshold would have grown to


def test_materialising_one_tensor_at_a_time_never_holds_the_model(tensors_in_their_own_pages):
    """A quarter of each weight kept (a rank's shard of four): the peak is that quarter, plus one full weight
    being replayed and the scratch tensor the build advances the generator with, plus slack."""
    full_value(next(build_deferred(lambda: nn.Linear(64, 64)).parameters()))  # pages in the code it runs
    reset_peak(CPU)
    start = current_bytes(CPU)
    torch.manual_seed(1)
    model = build_deferred(big_mlp)
    shards = []
    for param in model.parameters():
        full = full_value(param)
        shards.append(full[: full.shape[0] // 4].clone())
        del full
    grown = peak_bytes(CPU) - start
    model_bytes = sum(param.numel() * param.element_size() for param in model.parameters())
    kept = sum(shard.numel() * shard.element_size() for shard in shards)
    one_tensor = 16 * MiB
    slack = 16 * MiB  # allocator and interpreter noise
    assert model_bytes == 144 * MiB
    assert grown < kept + 2 * one_tensor + slack, f"peak grew {grown / MiB:.1f} MiB"
    assert kept + 2 * one_tensor + slack < 0.6 * model_bytes  # the bound is well under the whole model


def test_a_fully_sharded_rank_builds_and_restores_its_shards_only(tmp_path):
    """Two FSDP2 ranks: building (deferred) and restoring a checkpoint (memory-mapped) each grow a rank's
    resident memory by its half of the 144 MiB model plus at most one full weight (16 MiB) and slack, never by
    the model; the shards equal the plain build's and the checkpoint's halves."""
    torch.manual_seed(1)
    plain = big_mlp()
    saved = {name: torch.randn_like(param) for name, param in plain.state_dict().items()}
    checkpoint = tmp_path / "checkpoint.pt"
    torch.save({"format_version": FORMAT_VERSION, TRAINER: {"model": saved}}, checkpoint)
    run_workers(deferred_worker.WORLD_SIZE, 0, deferred_worker.run_rank,
                (f"tcp://127.0.0.1:{free_port()}", str(checkpoint), str(tmp_path)))
    half, one_tensor, slack = 72 * MiB, 16 * MiB, 24 * MiB
    for rank in range(deferred_worker.WORLD_SIZE):
        grown = json.loads(Path(tmp_path, f"rank{rank}.json").read_text())
        assert grown["built"] < half + 2 * one_tensor + slack, grown
        assert grown["restored"] < half + one_tensor + slack, grown
        shards = torch.load(tmp_path / f"rank{rank}.pt")
        for name, full in plain.state_dict().items():
            rows = full.shape[0] // deferred_worker.WORLD_SIZE
            assert torch.equal(shards["initial"][name], full[rank * rows:(rank + 1) * rows]), name
            assert torch.equal(shards["restored"][name], saved[name][rank * rows:(rank + 1) * rows]), name


def _same_build(build: Callable[[], nn.Module]) -> None:
    """``build`` deferred gives a plain build's values (both after the same seed)."""
    torch.manual_seed(5)
    expected = build().state_dict()
    torch.manual_seed(5)
    deferred = build_deferred(build)
    actual = deferred.state_dict(keep_vars=True)
    assert list(actual) == list(expected) and all(tensor.is_meta for tensor in actual.values())
    for key, tensor in expected.items():
        assert torch.equal(full_value(actual[key]), tensor), key


@pytest.mark.parametrize("safe", [True, False], ids=["safetensors", "pytorch_model.bin"])
def test_bert_from_a_transformers_directory_builds_deferred(tmp_path, safe):
    """--init-from-hf reads a memory-mapped directory: the deferred model copies its tensors only when
    materialised; the NSP head it lacks starts from the plain build's random values."""
    transformers = pytest.importorskip("transformers")
    data_dir, vocab, _ = make_data_dir(tmp_path, n_docs=20, splits=("train",))
    config = transformers.BertConfig(vocab_size=len(read_vocab_file(str(vocab))), hidden_size=32,
                                     num_hidden_layers=2, num_attention_heads=2, intermediate_size=64)
    directory = tmp_path / "hf"
    transformers.BertForMaskedLM(config).save_pretrained(directory, safe_serialization=safe)
    (directory / "vocab.txt").write_text(vocab.read_text(encoding="utf-8"), encoding="utf-8")
    args = parse_train_args(["--task", "bert", "--data", str(data_dir), "--init-from-hf", str(directory), "--nsp",
                             "--max-sentences", "4"])
    task = TASK_REGISTRY.get("bert").setup_task(args)
    _same_build(lambda: task.build_model(args))


def test_a_language_model_from_a_transformers_directory_builds_deferred(tmp_path):
    """transformers loads the directory on the CPU inside the deferred build (real_tensors); the copies into the
    model are recorded."""
    transformers = pytest.importorskip("transformers")
    data = make_lm_data(tmp_path)
    args = parse_train_args(lm_train_args(data, tmp_path / "ckpt", "--init-from-hf", str(tmp_path / "hf")))
    task = TASK_REGISTRY.get(args.task).setup_task(args)
    config = transformers.GPT2Config(vocab_size=task.vocab_size, n_positions=32, n_embd=32, n_layer=2, n_head=4,
                                     tie_word_embeddings=True)
    transformers.GPT2LMHeadModel(config).save_pretrained(tmp_path / "hf")
    _same_build(lambda: task.build_model(args))


def test_a_fully_sharded_run_checks_its_criterion_on_the_sharded_model(tmp_path):
    """The deferred model has no values before sharding: the trial forward runs after it, on every rank, and a
    criterion made for another task is still one error line on each."""
    init = f"tcp://127.0.0.1:{free_port()}"
    commands = node_commands(toy_train_args(tmp_path / "ckpt", None, ("--criterion", "masked_lm")), [4, 4], init,
                             "--ddp-backend", "fully_sharded")
    for rank, result in enumerate(run_nodes(commands, cwd=tmp_path)):
        assert result.returncode != 0
        assert result.stderr.startswith(f"hetfair-train: error: [rank {rank}] criterion masked_lm does not fit task "
                                        f"toy (model toy_mlp): TypeError: "), result.stderr
        assert len(result.stderr.splitlines()) == 1

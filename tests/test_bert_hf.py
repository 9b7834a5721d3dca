"""Hugging Face interop: hetfair BERT -> hetfair-export -> transformers, and a transformers BERT -> hetfair.

The reference is ``transformers`` itself: its models, built and saved locally (no download), must
give the same logits as hetfair's on the same inputs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

import hetfair  # noqa: E402
from bert_helpers import make_data_dir, write_bert_config  # noqa: E402
from hetfair.bert.tokenizer import read_vocab_file  # noqa: E402
from hetfair.options import parse_train_args  # noqa: E402
from hetfair.tasks import TASK_REGISTRY  # noqa: E402
from hetfair_cli.export import main as export_main  # noqa: E402
from hetfair_cli.train import main as train_main  # noqa: E402


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    tmp = tmp_path_factory.mktemp("hf")
    data_dir, vocab, _ = make_data_dir(tmp, n_docs=40, splits=("train", "valid"))
    return data_dir, vocab, write_bert_config(tmp / "c.json")


def train_tiny(tmp_path: Path, data: tuple[Path, Path, Path], *extra: str) -> Path:
    data_dir, _, config = data
    save_dir = tmp_path / "ckpt"
    assert train_main(["--task", "bert", "--data", str(data_dir), "--config_file", str(config), "--max-update", "2",
                       "--max-sentences", "4", "--save-dir", str(save_dir), "--log-format", "none",
                       "--disable-validation", *extra]) == 0
    return save_dir / "checkpoint_last.pt"


def inputs(vocab_size: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(5, vocab_size, (3, 11), generator=generator)
    token_type_ids = (torch.arange(11) > 5).long().expand(3, 11)
    attention_mask = torch.ones(3, 11, dtype=torch.long)
    attention_mask[1, 8:] = 0  # one padded row
    return {"input_ids": input_ids, "token_type_ids": token_type_ids, "attention_mask": attention_mask}


def test_export_loads_in_transformers_with_the_same_logits(tmp_path, data, capsys):
    checkpoint = train_tiny(tmp_path, data, "--nsp")
    out = tmp_path / "hf"
    assert export_main(["--path", str(checkpoint), "--to", "hf", str(out)]) == 0
    assert "BertForPreTraining" in capsys.readouterr().err

    ours = hetfair.load_model(checkpoint).model
    assert not ours.training
    theirs, info = transformers.BertForPreTraining.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    theirs.eval()
    batch = inputs(ours.config.vocab_size)
    with torch.no_grad():
        expected = theirs(**batch)
        actual = ours(batch["input_ids"], batch["token_type_ids"], batch["attention_mask"].bool())
    real = batch["attention_mask"].bool()
    torch.testing.assert_close(actual["mlm_logits"][real], expected.prediction_logits[real], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(actual["nsp_logits"], expected.seq_relationship_logits, atol=1e-5, rtol=1e-5)

    masked_lm, info = transformers.BertForMaskedLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["mismatched_keys"]
    with torch.no_grad():
        torch.testing.assert_close(masked_lm.eval()(**batch).logits[real], expected.prediction_logits[real],
                                   atol=1e-5, rtol=1e-5)
    assert read_vocab_file(str(out / "vocab.txt")) == read_vocab_file(str(data[1]))


def test_a_model_without_nsp_exports_for_masked_lm_and_says_so(tmp_path, data, capsys):
    checkpoint = train_tiny(tmp_path, data)
    out = tmp_path / "hf"
    out.mkdir()
    (out / "config.json").write_text("{}")  # an earlier export's: --force writes over it
    assert export_main(["--path", str(checkpoint), "--to", "hf", str(out), "--force"]) == 0
    assert "trained without --nsp" in capsys.readouterr().err.splitlines()[-1]
    assert json.loads((out / "config.json").read_text())["architectures"] == ["BertForMaskedLM"]
    _, info = transformers.BertForMaskedLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]


def test_the_export_message_holds_a_command_that_loads_the_model(tmp_path, data, capsys):
    checkpoint = train_tiny(tmp_path, data)
    out = tmp_path / "a dir with 'quotes'"
    assert export_main(["--path", str(checkpoint), "--to", "hf", str(out)]) == 0
    wrote, command, note = capsys.readouterr().err.strip().splitlines()
    assert wrote.startswith(f"wrote {out}") and note.startswith("note: ") and command.startswith("python -c ")
    venv = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
            "HF_HUB_OFFLINE": "1"}
    result = subprocess.run(["bash", "-c", command], env=venv, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr


def hf_tiny(vocab: Path) -> "transformers.BertForPreTraining":
    tokens = read_vocab_file(str(vocab))
    config = transformers.BertConfig(vocab_size=len(tokens), hidden_size=32, num_hidden_layers=2,
                                     num_attention_heads=2, intermediate_size=64, max_position_embeddings=128)
    torch.manual_seed(0)
    return transformers.BertForPreTraining(config).eval()


@pytest.mark.parametrize("safe", [True, False], ids=["safetensors", "pytorch_model.bin"])
def test_import_from_a_transformers_directory_gives_its_logits(tmp_path, data, safe):
    data_dir, vocab, _ = data
    reference = hf_tiny(vocab)
    directory = tmp_path / "hf_model"
    reference.save_pretrained(directory, safe_serialization=safe)
    (directory / "vocab.txt").write_text(vocab.read_text(encoding="utf-8"), encoding="utf-8")

    args = parse_train_args(["--task", "bert", "--data", str(data_dir), "--init-from-hf", str(directory), "--nsp",
                             "--max-sentences", "4"])
    task = TASK_REGISTRY.get("bert").setup_task(args)
    ours = task.build_model(args).eval()
    assert args.hidden_size == 32 and args.num_hidden_layers == 2  # the config sized the model
    batch = inputs(ours.config.vocab_size)
    real = batch["attention_mask"].bool()
    with torch.no_grad():
        expected = reference(**batch)
        actual = ours(batch["input_ids"], batch["token_type_ids"], real)
    torch.testing.assert_close(actual["mlm_logits"][real], expected.prediction_logits[real], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(actual["nsp_logits"], expected.seq_relationship_logits, atol=1e-5, rtol=1e-5)


def test_training_starts_from_a_transformers_directory(tmp_path, data):
    data_dir, vocab, _ = data
    directory = tmp_path / "hf_model"
    hf_tiny(vocab).save_pretrained(directory)
    checkpoint = tmp_path / "ckpt" / "checkpoint_last.pt"
    assert train_main(["--task", "bert", "--data", str(data_dir), "--init-from-hf", str(directory),
                       "--max-update", "1", "--max-sentences", "4", "--save-dir", str(checkpoint.parent),
                       "--log-format", "none", "--disable-validation"]) == 0
    loaded = hetfair.load_model(checkpoint)
    assert loaded.options.hidden_size == 32 and loaded.model.config.intermediate_size == 64


FRESH = {"mlm": "the MLM head (cls.predictions.transform.*, cls.predictions.bias) starts from random weights",
         "pooler": "the pooler (bert.pooler.dense.*) starts from random weights",
         "nsp": "the next-sentence head (cls.seq_relationship.*) starts from random weights"}


@pytest.mark.parametrize("source, fresh", [("BertModel", {"mlm", "nsp"}), ("BertForMaskedLM", {"pooler", "nsp"}),
                                           ("BertForPreTraining", set())])
def test_init_from_hf_names_the_loaded_shape_and_every_head_that_starts_fresh(tmp_path, data, capsys, source, fresh):
    data_dir, vocab, _ = data
    directory = tmp_path / "hf_model"
    getattr(transformers, source)(hf_tiny(vocab).config).save_pretrained(directory)
    capsys.readouterr()
    assert train_main(["--task", "bert", "--data", str(data_dir), "--init-from-hf", str(directory), "--nsp",
                       "--max-update", "1", "--max-sentences", "4", "--no-save", "--disable-validation",
                       "--log-format", "simple"]) == 0
    lines = capsys.readouterr().err.splitlines()
    vocab_size = len(read_vocab_file(str(vocab)))
    assert f"init | --init-from-hf {directory}: a {source} of 2 layers, hidden 32, 2 heads, intermediate 64, " \
           f"vocab {vocab_size}" in lines
    said = {part for part, message in FRESH.items() if any(message in line for line in lines)}
    assert said == fresh, lines
    setup = next(line for line in lines if line.startswith("setup | model"))
    assert f"(init-from-hf {directory})" in setup and "arch" not in setup


@pytest.mark.parametrize("case, message", [
    ("no_config", "is not a Hugging Face BERT directory"),
    ("relative_positions", "position_embedding_type='relative_key'"),
    ("other_vocabulary", "has another vocabulary"),
    ("not_bert", "not BERT"),
])
def test_bad_transformers_directories_are_one_line(tmp_path, data, capsys, case, message):
    data_dir, vocab, _ = data
    directory = tmp_path / "hf_model"
    hf_tiny(vocab).save_pretrained(directory)
    config = json.loads((directory / "config.json").read_text())
    if case == "no_config":
        (directory / "config.json").unlink()
    elif case == "relative_positions":
        config["position_embedding_type"] = "relative_key"
    elif case == "other_vocabulary":
        config["vocab_size"] += 1
    elif case == "not_bert":
        config["model_type"] = "roberta"
    if case != "no_config":
        (directory / "config.json").write_text(json.dumps(config))
    capsys.readouterr()  # transformers' own progress output while saving
    code = train_main(["--task", "bert", "--data", str(data_dir), "--init-from-hf", str(directory),
                       "--max-update", "1", "--max-sentences", "4", "--save-dir", str(tmp_path / "c"),
                       "--log-format", "none"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and message in err[0], err


def test_export_refuses_a_model_that_is_not_bert(tmp_path, capsys):
    from helpers import TOY_PLUGIN

    assert train_main(["--user-dir", str(TOY_PLUGIN), "--task", "toy", "--max-update", "1", "--max-sentences", "8",
                       "--save-dir", str(tmp_path), "--log-format", "none"]) == 0
    code = export_main(["--path", str(tmp_path / "checkpoint_last.pt"), "--to", "hf", str(tmp_path / "out"),
                        "--user-dir", str(TOY_PLUGIN)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "which does not export to Hugging Face" in err[0]

"""``--arch hf_encoder``: any transformers encoder, its sharding units, its dropout switch, export and errors.

The references are transformers' own classes: the layer lists are the models' documented
attributes, exported folders are loaded with ``AutoModelForSequenceClassification``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import pytest
import torch
import transformers
from torch import nn

from hetfair.errors import ConfigError
from hetfair.hf_encoder.model import HfEncoderModel
from hetfair.hf_encoder.units import layer_units
from hetfair_cli.export import main as export_main
from hetfair_cli.train import main as train_main
from hetfair_cli.validate import main as validate_main
from classification_data import make_labelled_dir
from helpers import REPO_ROOT, TOY_PLUGIN, subprocess_env
from hf_encoder_helpers import save_tiny_encoder, tiny_config

LAYER_LISTS = {  # where each family keeps its encoder layers
    "bert": lambda model: model.bert.encoder.layer,
    "distilbert": lambda model: model.distilbert.transformer.layer,
    "roberta": lambda model: model.roberta.encoder.layer,
}
SENTENCES = ["The hacker wrote code.", "A kludge is a clever hack that works, sort of.", "Foo!"]


class ClassesTask:
    """What the model asks of a task: the number of classes, their names, the longest input."""

    def __init__(self, num_classes: int = 2) -> None:
        self.num_classes = num_classes
        self.label_names = [f"label-{index}" for index in range(num_classes)]
        self.args = argparse.Namespace(task="sentence_classification")

    def max_positions(self) -> int:
        return 32


def build(directory, dropout: float | None = None, num_classes: int = 2) -> HfEncoderModel:
    args = argparse.Namespace(hf_model=str(directory), hf_dropout=dropout)
    return HfEncoderModel.build_model(args, ClassesTask(num_classes))


def encode(directory, texts: list[str]) -> dict[str, torch.Tensor]:
    return dict(transformers.AutoTokenizer.from_pretrained(directory)(texts, padding=True, return_tensors="pt"))


@pytest.mark.parametrize("family", list(LAYER_LISTS))
def test_the_sharding_units_are_the_families_own_encoder_layers(family):
    hf_model = transformers.AutoModelForSequenceClassification.from_config(tiny_config(family, num_labels=2))
    units = HfEncoderModel(hf_model, "unused").sharding_units()
    assert len(units) == 3 and all(a is b for a, b in zip(units, LAYER_LISTS[family](hf_model)))


def test_lists_of_mixed_classes_or_tied_or_parameterless_blocks_are_not_units():
    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embedding = nn.Linear(4, 4)
            self.blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))
            self.mixed = nn.ModuleList([nn.Linear(4, 4), nn.LayerNorm(4), nn.Linear(4, 4), nn.Linear(4, 4)])
            self.activations = nn.ModuleList(nn.ReLU() for _ in range(5))
            self.tied = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))
            self.tied[1].weight = self.embedding.weight

    model = Model()
    assert layer_units(model) == list(model.blocks)


@pytest.mark.parametrize("family", ["bert", "distilbert"])
def test_hf_dropout_zero_switches_off_every_dropout(tmp_path, family):
    directory = save_tiny_encoder(tmp_path / family, family, head=True)
    inputs = encode(directory, SENTENCES)
    noisy = build(directory).train()
    torch.manual_seed(0)
    assert not torch.equal(noisy(**inputs), noisy(**inputs)), "the config's own dropout is on in training"
    model = build(directory, dropout=0.0).train()
    torch.testing.assert_close(model(**inputs), model.eval()(**inputs), rtol=0, atol=0)


@pytest.mark.parametrize("family", ["bert", "distilbert"])
def test_the_export_loads_as_auto_classes_with_equal_logits(tmp_path, family):
    model = build(save_tiny_encoder(tmp_path / "source", family, head=True), num_classes=3).eval()  # a 2-class head
    with torch.no_grad():
        for param in model.parameters():  # stands for training: no weight keeps its initial value
            param.add_(torch.randn_like(param) * 0.1)
    out = tmp_path / "exported"
    message = model.export_hf(str(out), ClassesTask(3))
    loaded = transformers.AutoModelForSequenceClassification.from_pretrained(out, local_files_only=True).eval()
    inputs = encode(out, SENTENCES)
    with torch.no_grad():
        torch.testing.assert_close(loaded(**inputs).logits, model(**inputs), rtol=0, atol=1e-6)
    assert loaded.config.id2label == {0: "label-0", 1: "label-1", 2: "label-2"} and "AutoTokenizer" in message
    assert inputs["input_ids"].tolist() == encode(tmp_path / "source", SENTENCES)["input_ids"].tolist()


def test_hetfair_train_flags_that_cannot_build_the_model_are_one_line(tmp_path, capsys):
    common = ["--user-dir", str(TOY_PLUGIN), "--task", "toy", "--arch", "hf_encoder", "--max-update", "1",
              "--log-format", "none", "--save-dir", str(tmp_path / "ckpt")]
    directory = save_tiny_encoder(tmp_path / "bert")
    capsys.readouterr()
    for flags, message in ((), "needs --hf-model DIR"), (["--hf-model", str(tmp_path / "nothing")], "is not a "
                           "directory"), (["--hf-model", str(directory)], "--task toy defines no num_classes"):
        code = train_main([*common, *flags])
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and len(err) == 1 and message in err[0], err


@pytest.mark.parametrize("make, flags, message", [
    (lambda path: path, {}, "cannot read its config.json"),
    (save_tiny_encoder, {"dropout": 1.5}, "--hf-dropout 1.5 is not a probability"),
])
def test_folders_and_values_transformers_cannot_use_are_one_line(tmp_path, make, flags, message):
    directory = make(tmp_path)
    with pytest.raises(ConfigError, match=message) as error:
        build(directory, **flags)
    assert "\n" not in str(error.value)


def test_without_transformers_the_arch_is_one_line(tmp_path):
    """hetfair-train runs with ``import transformers`` failing, as on an install without the hf extra."""
    argv = ["--user-dir", str(TOY_PLUGIN), "--task", "toy", "--arch", "hf_encoder", "--hf-model", str(tmp_path),
            "--max-update", "1", "--save-dir", str(tmp_path / "ckpt")]
    program = ("import sys; sys.modules['transformers'] = None\n"  # None in sys.modules makes the import fail
               "from hetfair_cli.train import main\n"
               f"raise SystemExit(main({json.dumps(argv)}))")
    result = subprocess.run([sys.executable, "-c", program], cwd=REPO_ROOT, env=subprocess_env(),
                            capture_output=True, text=True, timeout=120)
    err = result.stderr.strip().splitlines()
    assert result.returncode == 2 and err == ["hetfair-train: error: --arch hf_encoder needs the transformers "
                                              "package, which is not installed: pip install 'hetfair[hf]'"], err


def test_validate_and_export_take_the_trained_head_without_transformers_missing_report(tmp_path, capfd, caplog):
    """A bare encoder folder: training builds a new head and transformers says so, rightly; hetfair-validate and
    hetfair-export replace every weight with the checkpoint's, so they print no load report; a weight the
    checkpoint lacks is still one error naming it."""
    directory = save_tiny_encoder(tmp_path / "bert")
    save_dir = tmp_path / "ckpt"
    assert train_main(["--task", "sentence_classification", "--num-classes", "2", "--data",
                       str(make_labelled_dir(tmp_path / "data")), "--arch", "hf_encoder", "--hf-model", str(directory),
                       "--max-positions", "32", "--max-sentences", "32", "--max-update", "1", "--max-epoch", "0",
                       "--lr-scheduler", "fixed", "--log-format", "none", "--no-epoch-checkpoints", "--save-dir",
                       str(save_dir)]) == 0
    assert "classifier.weight | MISSING" in caplog.text  # transformers' logger (stderr outside pytest)
    caplog.clear()
    checkpoint = save_dir / "checkpoint_last.pt"
    assert validate_main(["--path", str(checkpoint)]) == 0
    assert export_main(["--path", str(checkpoint), "--to", "hf", str(tmp_path / "exported")]) == 0
    loaded = capfd.readouterr().err + caplog.text
    assert "MISSING" not in loaded and "LOAD REPORT" not in loaded, loaded
    exported = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path / "exported")
    trained = torch.load(checkpoint, weights_only=True)["trainer"]["model"]
    torch.testing.assert_close(exported.classifier.weight, trained["hf_model.classifier.weight"], rtol=0, atol=0)
    state = torch.load(checkpoint, weights_only=True)
    del state["trainer"]["model"]["hf_model.classifier.weight"]
    torch.save(state, tmp_path / "headless.pt")
    capfd.readouterr()
    assert validate_main(["--path", str(tmp_path / "headless.pt")]) != 0
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "hf_model.classifier.weight" in err[0], err

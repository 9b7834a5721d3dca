"""hetfair-validate treats a checkpoint as data: it imports only the plugins the command line names.

Stored options hold absolute paths, so a checkpoint validates from any directory; a checkpoint
whose options do not build its model, or a file that is no checkpoint, is one error line.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import TOY_PLUGIN, LoopbackListener, subprocess_env
from test_mnist_plugin import PLUGIN_DIR, write_mnist_dir
from hetfair import load_model
from hetfair.checkpoint.layout import atomic_save, load_checkpoint
from hetfair_cli.train import main as train_main
from hetfair_cli.validate import main as validate_main


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A toy checkpoint trained from its own directory with relative paths."""
    workdir = tmp_path_factory.mktemp("train")
    cwd = os.getcwd()
    os.chdir(workdir)
    try:
        user_dir = os.path.relpath(TOY_PLUGIN, workdir)
        assert train_main(["--user-dir", user_dir, "--task", "toy", "--save-dir", "ckpt", "--max-update", "3",
                           "--tensorboard-logdir", "tb", "--log-format", "none", "--no-epoch-checkpoints"]) == 0
    finally:
        os.chdir(cwd)
    return workdir / "ckpt" / "checkpoint_last.pt"


def validate(path: Path, *extra: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hetfair_cli.validate", "--path", str(path), "--json", *extra],
                          cwd=cwd, env=subprocess_env(), capture_output=True, text=True, timeout=300)


def with_config(source: Path, target: Path, **changes: object) -> Path:
    state = load_checkpoint(source)
    state["config"].update(changes)
    atomic_save(state, target)
    return target


def test_stored_paths_are_absolute(trained):
    config = load_checkpoint(trained)["config"]
    assert config["user_dir"] == str(TOY_PLUGIN)
    assert config["save_dir"] == str(trained.parent)
    assert config["tensorboard_logdir"] == str(trained.parent.parent / "tb")


def test_a_user_dir_named_in_the_checkpoint_is_never_imported(trained, tmp_path):
    plugin = tmp_path / "untrusted_plugin"
    plugin.mkdir()
    marker = tmp_path / "imported"
    (plugin / "__init__.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    checkpoint = with_config(trained, tmp_path / "c.pt", user_dir=str(plugin))
    result = validate(checkpoint, cwd=tmp_path)
    assert not marker.exists()
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == [
        f"hetfair-validate: error: checkpoint {checkpoint} was trained with --user-dir {plugin}, which is not "
        f"imported from a checkpoint (unknown task 'toy'); rerun with it, if you trust that code: "
        f"hetfair-validate --user-dir untrusted_plugin --path {checkpoint} --json"]


def test_validate_from_another_directory_prints_the_command_that_works(trained, tmp_path):
    result = validate(trained, cwd=tmp_path)
    assert result.returncode == 2
    [line] = result.stderr.strip().splitlines()
    rerun = f"hetfair-validate --user-dir {TOY_PLUGIN} --path {trained} --json"
    assert line.endswith(f"rerun with it, if you trust that code: {rerun}")
    program, *arguments = shlex.split(rerun)  # the console script, as the user would run it
    result = subprocess.run([str(Path(sys.executable).parent / program), *arguments], cwd=tmp_path,
                            env=subprocess_env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert '"subset": "valid"' in result.stdout


def test_hetfair_export_prints_its_own_command_with_the_user_dir(trained, tmp_path):
    result = subprocess.run([sys.executable, "-m", "hetfair_cli.export", "--path", str(trained), "--to", "hf", "out"],
                            cwd=tmp_path, env=subprocess_env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 2
    assert result.stderr.rstrip().endswith(
        f"rerun with it, if you trust that code: hetfair-export --user-dir {TOY_PLUGIN} --path {trained} --to hf out")


def test_the_command_printed_for_a_stored_user_dir_is_shell_quoted(trained, tmp_path):
    plugin = tmp_path / "plugins; touch pwned"  # a checkpoint is data: its strings may be anything
    checkpoint = with_config(trained, tmp_path / "c.pt", user_dir=str(plugin))
    result = validate(checkpoint, cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.rstrip().endswith(
        f"hetfair-validate --user-dir 'plugins; touch pwned' --path {checkpoint} --json")


@pytest.mark.parametrize("changes, message", [
    ({"arch": "bert_mini"}, "do not build a model"),
    ({"arch": "toy_mlp_wide", "toy_hidden": 64}, "does not fit the model it names"),
    ({"arch": "no_such_arch"}, "unknown arch 'no_such_arch'"),
    ({"task": "no_such_task"}, "unknown task 'no_such_task'"),
])
def test_options_that_do_not_build_the_model_are_one_line(trained, tmp_path, capsys, changes, message):
    checkpoint = with_config(trained, tmp_path / "c.pt", **changes)
    assert validate_main(["--path", str(checkpoint), "--user-dir", str(TOY_PLUGIN)]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert message in err


@pytest.mark.parametrize("content", [b"", b"hello world\n", b"PK\x03\x04 truncated zip", bytes(range(256))])
def test_a_file_that_is_no_checkpoint_is_one_line(tmp_path, capsys, content):
    bad = tmp_path / "bad.pt"
    bad.write_bytes(content)
    assert validate_main(["--path", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.strip().splitlines() == [f"hetfair-validate: error: {bad} is not a hetfair checkpoint: not a "
                                        f"torch.save archive (corrupt, truncated or another kind of file)"]


@pytest.mark.parametrize("flags, message", [
    (["--max-sentences", "0"], "--max-sentences must be at least 1, got 0"),
    (["--num-workers", "-1"], "--num-workers must be at least 0, got -1"),
])
def test_bad_validate_options_are_one_line(trained, capsys, flags, message):
    assert validate_main(["--path", str(trained), "--user-dir", str(TOY_PLUGIN), *flags]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [f"hetfair-validate: error: {message}"]


def test_a_mirror_named_in_the_checkpoint_is_never_contacted_only_the_command_lines(tmp_path):
    (tmp_path / "data").mkdir()
    data = write_mnist_dir(tmp_path / "data")
    assert train_main(["--user-dir", str(PLUGIN_DIR), "--task", "mnist", "--data", str(data), "--max-update", "1",
                       "--save-dir", str(tmp_path / "c"), "--mnist-cache-dir", str(tmp_path / "cache"),
                       "--log-format", "none", "--no-epoch-checkpoints"]) == 0
    stored, given = LoopbackListener(close_each=True), LoopbackListener(close_each=True)
    checkpoint = with_config(tmp_path / "c" / "checkpoint_last.pt", tmp_path / "m.pt", data=None,
                             mnist_mirror=[stored.url])  # validated without --data: the files are downloaded
    assert load_model(checkpoint, user_dir=PLUGIN_DIR).options.mnist_mirror is None  # the task's own mirrors
    result = validate(checkpoint, "--user-dir", str(PLUGIN_DIR), "--mnist-mirror", given.url, cwd=tmp_path)
    assert stored.accepted == 0
    assert given.accepted > 0
    assert result.returncode == 2
    last = result.stderr.strip().splitlines()[-1]
    assert given.url in last and stored.url not in last, result.stderr
    result = validate(checkpoint, "--user-dir", str(PLUGIN_DIR), "--valid-size", "2", cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "hetfair-validate: error: unrecognized arguments: --valid-size; of its task's flags, the command takes only "
        "those that say where to connect (--mnist-mirror)"]

"""``hetfair-train`` options: HetSeq flag names, defaults from task and arch, unknown names."""

from __future__ import annotations

import os
import textwrap
import uuid
from typing import ClassVar

import pytest

import hetfair
from hetfair import errors
from hetfair.options import parse_train_args, plain_config
from hetfair.tasks import Task
from hetfair_cli.train import main

PACKAGE = "hetfair_clitest_plugins"
PLUGIN_CODE = """
    import hetfair
    from hetfair.models import HetfairModel
    from hetfair.tasks import Task

    @hetfair.register_task("clitest_task")
    class CliTestTask(Task):
        option_defaults = {"arch": "clitest_tiny", "max_sentences": 7, "lr": 0.25}

        @staticmethod
        def add_args(parser):
            parser.add_argument("--clitest-size", type=int, default=3, help="task flag")

    @hetfair.register_task("clitest_bare_task")
    class BareTask(Task):
        pass

    @hetfair.register_model("clitest_model")
    class CliTestModel(HetfairModel):
        @staticmethod
        def add_args(parser):
            parser.add_argument("--clitest-hidden", type=int, default=16, help="model flag")
            parser.add_argument("--clitest-layers", type=int, default=2, help="model flag")

    @hetfair.register_model_architecture("clitest_model", "clitest_tiny")
    def clitest_tiny():
        return {"clitest_hidden": 4}
"""


@pytest.fixture(scope="module")
def user_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    package = tmp_path_factory.mktemp("cli") / PACKAGE
    package.mkdir()
    (package / "__init__.py").write_text(textwrap.dedent(PLUGIN_CODE))
    return str(package)


def parse(user_dir: str, *argv: str, task: str = "clitest_task"):
    return parse_train_args(["--user-dir", user_dir, "--task", task, *argv])


def run_main(capsys: pytest.CaptureFixture, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


HETSEQ_FLAGS = [
    ("--max-sentences", "8", "max_sentences", 8),
    ("--max-tokens", "512", "max_tokens", 512),
    ("--update-freq", "4", "update_freq", 4),
    ("--max-update", "1000", "max_update", 1000),
    ("--max-epoch", "3", "max_epoch", 3),
    ("--valid-subset", "valid,test", "valid_subset", "valid,test"),
    ("--num-workers", "2", "num_workers", 2),
    ("--lr", "0.0005", "lr", 0.0005),
    ("--weight-decay", "0.01", "weight_decay", 0.01),
    ("--clip-norm", "1.5", "clip_norm", 1.5),
    ("--warmup-updates", "10", "warmup_updates", 10),
    ("--total-num-update", "100", "total_num_update", 100),
    ("--seed", "42", "seed", 42),
    ("--save-dir", "ckpts", "save_dir", os.path.abspath("ckpts")),  # paths are stored absolute
    ("--restore-file", "checkpoint_best.pt", "restore_file", "checkpoint_best.pt"),
    ("--no-save", None, "no_save", True),
    ("--log-interval", "5", "log_interval", 5),
    ("--log-format", "json", "log_format", "json"),
    ("--tensorboard-logdir", "tb", "tensorboard_logdir", os.path.abspath("tb")),
    ("--fast-stat-sync", None, "fast_stat_sync", True),
    ("--cpu", None, "cpu", True),
    ("--distributed-world-size", "4", "distributed_world_size", 4),
    ("--distributed-init-method", "tcp://10.0.0.1:12345", "distributed_init_method", "tcp://10.0.0.1:12345"),
    ("--distributed-gpus", "2", "distributed_gpus", 2),
    ("--distributed-rank", "2", "distributed_rank", 2),
    ("--device-id", "1", "device_id", 1),
    ("--distributed-backend", "gloo", "distributed_backend", "gloo"),
]


def test_hetseq_flag_names_parse_together(user_dir):
    argv = ["--lr-scheduler", "polynomial_decay"]
    for flag, value, _, _ in HETSEQ_FLAGS:
        argv += [flag] if value is None else [flag, value]
    args = parse(user_dir, *argv)
    for flag, _, dest, expected in HETSEQ_FLAGS:
        assert getattr(args, dest) == expected, flag


@pytest.mark.parametrize("alias", ["--batch-size", "--max-sentences"])
def test_batch_size_is_an_alias_of_max_sentences(user_dir, alias):
    assert parse(user_dir, alias, "13").max_sentences == 13


@pytest.mark.parametrize("scheduler", ["polynomial_decay", "cosine"])
def test_total_num_update_is_declared_by_decaying_schedulers(user_dir, scheduler):
    args = parse(user_dir, "--lr-scheduler", scheduler, "--total-num-update", "50")
    assert args.total_num_update == 50


def test_total_num_update_is_rejected_for_fixed_schedule(user_dir, capsys):
    with pytest.raises(SystemExit) as caught:
        parse(user_dir, "--lr-scheduler", "fixed", "--total-num-update", "50")
    assert caught.value.code == 2
    assert "--total-num-update" in capsys.readouterr().err


def test_flag_abbreviations_are_refused(user_dir, capsys):
    with pytest.raises(SystemExit):
        parse(user_dir, "--max-sent", "3")
    assert "unrecognized arguments: --max-sent" in capsys.readouterr().err


def test_task_option_defaults_apply(user_dir):
    args = parse(user_dir)
    assert (args.arch, args.model, args.max_sentences, args.lr) == ("clitest_tiny", "clitest_model", 7, 0.25)


def test_explicit_flags_beat_task_option_defaults(user_dir):
    args = parse(user_dir, "--batch-size", "3", "--lr", "0.5")
    assert (args.max_sentences, args.lr) == (3, 0.5)


def test_arch_defaults_apply_to_model_flags(user_dir):
    args = parse(user_dir)
    assert (args.clitest_hidden, args.clitest_layers) == (4, 2)


def test_explicit_flags_beat_arch_defaults(user_dir):
    assert parse(user_dir, "--clitest-hidden", "9").clitest_hidden == 9


def test_model_name_as_arch_uses_model_defaults(user_dir):
    args = parse(user_dir, "--arch", "clitest_model")
    assert (args.model, args.clitest_hidden) == ("clitest_model", 16)


def test_component_flags_show_in_help(user_dir, capsys):
    with pytest.raises(SystemExit) as caught:
        main(["--user-dir", user_dir, "--task", "clitest_task", "--optimizer", "sgd", "--help"])
    assert caught.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--clitest-size", "--clitest-hidden", "--momentum", "--max-sentences", "--batch-size"):
        assert flag in out


@pytest.mark.parametrize(
    "flag, kind, known",
    [
        ("--task", "task", ["clitest_task", "clitest_bare_task"]),
        ("--arch", "arch", ["clitest_tiny", "clitest_model"]),
        ("--criterion", "criterion", ["cross_entropy"]),
        ("--optimizer", "optimizer", ["adam", "adamw", "sgd"]),
        ("--lr-scheduler", "lr_scheduler", ["fixed", "polynomial_decay", "inverse_sqrt", "cosine"]),
    ],
)
def test_unknown_component_is_one_line_listing_known_names(user_dir, capsys, flag, kind, known):
    argv = ["--user-dir", user_dir, flag, "no_such_thing"]
    if flag != "--task":
        argv += ["--task", "clitest_task"]
    code, _, err = run_main(capsys, *argv)
    assert code == 2
    assert err.count("\n") == 1
    assert f"unknown {kind} 'no_such_thing'" in err
    listed = err.split("known", 1)[1]
    for name in known:
        assert name in listed


def test_arch_of_unknown_model_lists_known_models(user_dir, capsys):
    arch = f"orphan_arch_{uuid.uuid4().hex[:8]}"

    @hetfair.register_model_architecture("clitest_missing_model", arch)
    def orphan() -> dict:
        return {}

    code, _, err = run_main(capsys, "--user-dir", user_dir, "--task", "clitest_task", "--arch", arch)
    assert code == 2
    assert "unknown model 'clitest_missing_model'" in err
    assert "clitest_model" in err.split("known", 1)[1]


def test_missing_task_lists_known_tasks(user_dir, capsys):
    with pytest.raises(SystemExit) as caught:
        main(["--user-dir", user_dir, "--max-sentences", "2"])
    assert caught.value.code == 2
    err = capsys.readouterr().err
    assert "--task is required" in err
    assert "clitest_task" in err


def test_list_plugins_shows_where_each_name_comes_from(user_dir, capsys):
    code, out, _ = run_main(capsys, "--user-dir", user_dir, "--list-plugins")
    assert code == 0
    rows = {tuple(line.split(None, 1)) for line in out.splitlines() if line.startswith("  ")}
    assert ("clitest_task", f"user code ({PACKAGE}.CliTestTask)") in rows
    assert ("clitest_tiny", f"user code ({PACKAGE}.clitest_tiny), model clitest_model") in rows
    assert ("cross_entropy", "built-in (hetfair.criteria.cross_entropy.CrossEntropyCriterion)") in rows
    assert ("adam", "built-in (hetfair.optim.adam.Adam)") in rows


def test_task_without_default_arch_asks_for_one(user_dir):
    with pytest.raises(errors.ConfigError, match="task 'clitest_bare_task' has no default --arch"):
        parse(user_dir, "--max-sentences", "2", task="clitest_bare_task")


def test_a_batch_size_is_required(user_dir):
    with pytest.raises(errors.ConfigError, match="give a batch size"):
        parse(user_dir, "--arch", "clitest_model", task="clitest_bare_task")


@pytest.mark.parametrize("flag", ["--max-sentences", "--update-freq", "--distributed-world-size"])
def test_counts_below_one_are_refused(user_dir, flag):
    with pytest.raises(errors.ConfigError, match=f"{flag} must be at least 1, got 0"):
        parse(user_dir, flag, "0")


def test_option_defaults_for_unknown_options_are_a_config_error(user_dir):
    name = f"clitest_typo_task_{uuid.uuid4().hex[:8]}"

    @hetfair.register_task(name)
    class TypoTask(Task):
        option_defaults: ClassVar[dict] = {"arch": "clitest_model", "max_sentnces": 8}

    with pytest.raises(errors.ConfigError, match=rf"task '{name}' \[user code \({__name__}.*TypoTask\)\] sets "
                                                 "defaults for unknown options: max_sentnces"):
        parse(user_dir, task=name)


@pytest.mark.parametrize(
    "defaults, problem",
    [
        ({"lr": [1e-3]}, "the default of --lr to [0.001], but --lr takes a number, not a list"),
        ({"max_sentences": 8.5}, "--max-sentences to 8.5, but --max-sentences takes an integer, not a float"),
        ({"max_sentences": True}, "--max-sentences takes an integer, not a bool"),
        ({"max_sentences": "many"}, "the default of --max-sentences to 'many', but --max-sentences takes an integer"),
        ({"cpu": "yes"}, "the default of --cpu to 'yes', but --cpu is a switch: give True or False"),
        ({"log_format": "fancy"}, "--log-format takes one of: tqdm, simple, json, none"),
        ({"valid_subset": ["valid"]}, "--valid-subset takes text, not a list"),
    ],
)
def test_option_defaults_of_the_wrong_type_name_the_plugin(user_dir, capsys, defaults, problem):
    name = f"clitest_typed_task_{uuid.uuid4().hex[:8]}"

    @hetfair.register_task(name)
    class WronglyTypedTask(Task):
        option_defaults: ClassVar[dict] = {"arch": "clitest_model", **defaults}

    code, _, err = run_main(capsys, "--user-dir", user_dir, "--task", name, "--no-save")
    assert code == 2 and err.count("\n") == 1
    assert err.startswith(f"hetfair-train: error: task '{name}' "
                          f"[user code ({__name__}.{WronglyTypedTask.__qualname__})] sets the default of ")
    assert problem in err


def test_option_defaults_of_convertible_or_compatible_types_are_accepted(user_dir):
    name = f"clitest_loose_task_{uuid.uuid4().hex[:8]}"

    @hetfair.register_task(name)
    class LooseTask(Task):
        option_defaults: ClassVar[dict] = {"arch": "clitest_model", "lr": 1, "max_sentences": "8", "cpu": True}

    args = parse(user_dir, task=name)
    assert (args.lr, args.max_sentences, args.cpu) == (1, 8, True)


def test_architecture_defaults_of_the_wrong_type_name_the_architecture(user_dir, capsys):
    arch = f"clitest_bad_arch_{uuid.uuid4().hex[:8]}"

    @hetfair.register_model_architecture("clitest_model", arch)
    def bad_arch() -> dict:
        return {"clitest_hidden": "wide"}

    code, _, err = run_main(capsys, "--user-dir", user_dir, "--task", "clitest_task", "--arch", arch)
    assert code == 2
    assert f"architecture '{arch}' [user code ({__name__}." in err
    assert "sets the default of --clitest-hidden to 'wide', but --clitest-hidden takes an integer" in err


def test_help_shows_the_defaults_in_force(user_dir, capsys):
    with pytest.raises(SystemExit):
        main(["--user-dir", user_dir, "--task", "clitest_task", "--help"])
    out = " ".join(capsys.readouterr().out.split())  # undo line wrapping
    assert "--lr LR peak learning rate (default: 0.25)" in out  # the task's default, not the core one
    assert "--clitest-hidden CLITEST_HIDDEN model flag (default: 4)" in out  # the architecture's
    assert "--max-epoch N stop after N epochs (0: no limit; --max-epoch or --max-update must set one) (default: 0)" in out
    assert "--cpu train on CPU even when a GPU is present --log-interval" in out  # a switch: no default shown
    assert "(default: None)" not in out


def test_validate_help_is_plain_text_with_defaults(capsys):
    from hetfair_cli.validate import main as validate_main

    with pytest.raises(SystemExit) as caught:
        validate_main(["--help"])
    assert caught.value.code == 0
    out = capsys.readouterr().out
    assert "``" not in out and ":class:" not in out
    assert "(default: valid)" in " ".join(out.split())


def test_plain_config_holds_only_plain_data(user_dir):
    config = plain_config(parse(user_dir, "--cpu"))
    assert config["clitest_hidden"] == 4 and config["cpu"] is True and config["model"] == "clitest_model"
    assert all(value is None or isinstance(value, (bool, int, float, str, list)) for value in config.values())


def test_every_numeric_core_option_declares_its_bounds():
    """Bounds live next to each option (checked after parsing, plugin defaults included), not in a table."""
    from hetfair.launch.per_process import PerProcessValues
    from hetfair.options import Bounds, build_parser

    numeric = [action for action in build_parser()._actions
               if action.type in (int, float) or isinstance(action.type, PerProcessValues)]
    undeclared = [action.option_strings[0] for action in numeric
                  if not isinstance(getattr(action, "bounds", None), Bounds)]
    assert numeric and not undeclared, f"numeric options without bounds: {undeclared}"

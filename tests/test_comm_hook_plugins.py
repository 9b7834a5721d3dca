"""Comm hooks are components: a plugin adds one (here through an entry point, ``tests/toy_comm_hook.py``) and
``--ddp-comm-hook``, its flags, ``--list-plugins``, the ``comm |`` advice and training take it like a built-in.

The toy hook is DDP's exact all-reduce done by hand, so on real gloo ranks it must give the plain PyTorch update.
"""

from __future__ import annotations

import importlib
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from helpers import TESTS_DIR, final_parameters, free_port, leave_group, node_commands, run_nodes, run_train
from hetfair.parallel import COMM_HOOK_REGISTRY, ParallelConfig
from hetfair.parallel.comm_advice import HookCost, LinkMeasurement, advise
from hetfair.parallel.gradient_comm import GradientComm
from hetfair.parallel.context import DistributedContext
from hetfair_cli.train import main as train_main
from toy_plugin import ToyMLP
from toy_reference import assert_same, reference_parameters, toy_train_args

ENTRY_POINT = "toy_mean = toy_comm_hook:SumThenDivide"


@pytest.fixture
def hook_site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An installed-looking distribution whose ``hetfair.comm_hooks`` entry point is the toy hook, on the
    ``PYTHONPATH`` of every command a test starts."""
    site = tmp_path / "site"
    info = site / "hetfair_toy_hook-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: hetfair-toy-hook\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(f"[hetfair.comm_hooks]\n{ENTRY_POINT}\n")
    shutil.copy(TESTS_DIR / "toy_comm_hook.py", site)
    monkeypatch.setenv("PYTHONPATH", str(site))
    return site


def run(*argv: str, cwd: Path) -> subprocess.CompletedProcess:
    return run_train(argv, cwd, timeout=120)


def test_an_installed_hook_is_listed_and_owns_its_flags(hook_site, tmp_path):
    listing = run("--list-plugins", cwd=tmp_path)
    assert listing.returncode == 0, listing.stderr
    hooks = listing.stdout.split("comm hooks:\n")[1].splitlines()
    assert f"  toy_mean  distribution 'hetfair-toy-hook' 1.0 (entry point {ENTRY_POINT})" in hooks

    toy = [*toy_train_args(tmp_path / "ckpt", 1), "--max-sentences", "8", "--dry-run"]
    assert run(*toy, "--ddp-comm-hook", "toy_mean", "--toy-sent-fraction", "0.5", cwd=tmp_path).returncode == 0
    refused = run(*toy, "--ddp-comm-hook", "bf16", "--toy-sent-fraction", "0.5", cwd=tmp_path)
    assert refused.returncode == 2
    assert refused.stderr == ("hetfair-train: error: --toy-sent-fraction needs --ddp-comm-hook toy_mean or auto "
                              "(this command has --ddp-comm-hook bf16)\n")


def test_an_unknown_hook_is_one_line_naming_the_known_ones(tmp_path, capsys):
    code = train_main([*toy_train_args(tmp_path / "ckpt", 1), "--max-sentences", "8", "--ddp-comm-hook", "ring"])
    assert code == 2
    line = capsys.readouterr().err.strip()
    assert line.startswith("hetfair-train: error: unknown --ddp-comm-hook 'ring'; known comm hooks: ")
    assert {"none", "fp16", "bf16", "powersgd", "auto"} <= set(line.split(": ")[-1].split(", "))


def test_a_plugin_hook_trains_two_uneven_ranks_to_the_plain_update(hook_site, tmp_path):
    log = tmp_path / "buckets"
    common = toy_train_args(tmp_path / "ckpt", 2, ("--log-format", "simple"))
    commands = node_commands(common, [8, 24], f"tcp://127.0.0.1:{free_port()}", "--ddp-comm-hook", "toy_mean",
                             "--toy-hook-log", str(log))
    results = run_nodes(commands, cwd=tmp_path)
    for result in results:
        assert result.returncode == 0, result.stderr
    assert_same(final_parameters(tmp_path / "ckpt"), reference_parameters(update_size=64))
    for rank in (0, 1):  # the hook did the all-reduce on every rank, every update
        assert len(Path(f"{log}.{rank}").read_text().splitlines()) >= 8
    [line] = [line for line in results[0].stderr.splitlines() if line.startswith("comm | ")]
    assert line.endswith("the exact all-reduce (none) fits; this run uses toy_mean")  # exact: not named lossy


@pytest.fixture
def toy_hook_registered(monkeypatch: pytest.MonkeyPatch):
    """The toy hook registered in this process (as importing a plugin does), for this test only."""
    monkeypatch.setattr(COMM_HOOK_REGISTRY, "_entries", dict(COMM_HOOK_REGISTRY._entries))
    monkeypatch.syspath_prepend(str(TESTS_DIR))
    importlib.reload(importlib.import_module("toy_comm_hook"))


@pytest.fixture
def one_rank_group(tmp_path: Path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'init'}", rank=0, world_size=1)
    yield DistributedContext(0, 1, 0, torch.device("cpu"))
    leave_group()


def test_the_advice_weighs_a_plugin_hook_by_its_declared_cost(toy_hook_registered, one_rank_group):
    def costs(fraction: float) -> tuple[HookCost, ...]:
        config = ParallelConfig(ddp_comm_hook="auto", comm_options=(("--toy-sent-fraction", fraction),))
        return GradientComm(DistributedDataParallel(ToyMLP(hidden=16)), config, one_rank_group).hook_costs()

    declared = {cost.name: cost for cost in costs(0.01)}
    assert declared["toy_mean"] == HookCost("toy_mean", 0.01, lossy=False, advised=True)
    assert declared["bf16"].sent == declared["fp16"].sent == 0.5
    # PowerSGD at rank 1 on Linear(8, 16) and Linear(16, 3): P and Q of both weights (24 and 19 numbers), the
    # biases whole (16 and 3), of 195 numbers
    assert declared["powersgd"].sent == pytest.approx(62 / 195)

    def advice(fraction: float):  # a slow link between two nodes: the all-reduce takes the compute's time
        return advise(LinkMeasurement(1_000_000, 0.1, 2, costs(fraction), 250_000, 2), 0.1, "auto")

    cheap = advice(0.01)
    assert cheap.chosen == "toy_mean"
    assert cheap.line().endswith("bandwidth-bound: auto switches on toy_mean, all-reduce ~1 ms")
    assert advice(1.0).chosen == "powersgd"  # what it claims to send decides, not its name

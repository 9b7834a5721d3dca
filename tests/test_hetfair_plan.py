"""``hetfair-plan``: the model's costs counted by hand, the ranked table, one-line errors, and the printed
per-node commands run as typed on two test hosts."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from helpers import REPO_ROOT, TOY_PLUGIN, rank_flags, subprocess_env
from hetfair.cluster.description import load_cluster
from hetfair.parallel.cost_model import ModelCost
from hetfair.plan.cluster_plan import node_commands, predict_all
from hetfair.plan.model_cost import measure_model_cost
from hetfair_cli.plan import main as plan_main
from multi_host import node_env, start_on
from netns import SUBNET

CLUSTERS = REPO_ROOT / "examples" / "clusters"
TOY = ["--user-dir", str(TOY_PLUGIN), "--task", "toy", "--toy-train-size", "64", "--optimizer", "sgd", "--lr", "0.1",
       "--max-update", "3", "--log-format", "none", "--disable-validation", "--distributed-timeout", "60"]


class SquaredOutput(nn.Module):
    """A criterion whose loss is the sum of the squared outputs (``pow`` saves its input: 5 values a sample)."""

    def forward(self, model: nn.Module, batch: dict) -> tuple[torch.Tensor, int, dict]:
        out = model(batch["x"])
        return (out ** 2).sum(), len(batch["x"]), {}


def test_the_model_cost_is_counted_as_by_hand() -> None:
    """Linear(10, 20), ReLU, Linear(20, 5): forward 2*10*20 + 2*20*5 = 600 FLOPs a sample, backward 800 (both weight
    gradients, the second layer's input gradient; none for the data); saved: the input (10 floats), the ReLU's
    output (20, saved once though both the ReLU and the second layer keep it) and the output (5): 140 bytes."""
    model = nn.Sequential(nn.Linear(10, 20), nn.ReLU(), nn.Linear(20, 5))
    cost = measure_model_cost(model, SquaredOutput(), lambda n: {"x": torch.randn(n, 10)}, [model[0]],
                              lambda params: torch.optim.Adam(params))
    assert (cost.parameters, cost.flops_per_sample, cost.activation_bytes) == (325, 1400.0, 140)
    assert (cost.optimizer_ratio, cost.units, cost.largest_unit_bytes) == (2.0, 2, 4 * 220)
    sent = {hook.name: hook.sent for hook in cost.hooks}
    # PowerSGD at rank 2 compresses the 20x10 weight to (20 + 10) * 2 values; the 5x20 one would send 50 of 100,
    # short of torch's 2x minimum rate, so it goes whole, as do the biases: (60 + 20 + 100 + 5) / 325
    assert sent == {"none": 1.0, "bf16": 0.5, "fp16": 0.5, "powersgd": pytest.approx(185 / 325)}
    assert all(p.grad is None for p in model.parameters())


class LoggedSquaredOutput(SquaredOutput):
    """:class:`SquaredOutput` that logs its loss's value, as hetfair's criteria do."""

    def forward(self, model: nn.Module, batch: dict) -> tuple[torch.Tensor, int, dict]:
        loss, size, _logs = super().forward(model, batch)
        return loss, size, {"loss": float(loss.detach())}


def test_on_the_meta_device_the_model_cost_is_counted_as_by_hand_without_values() -> None:
    """The same counts on the meta device, where every storage's address is 0 and a logged loss has no value
    (what benchmarks/project_cluster.py counts gpt2_small on)."""
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(10, 20), nn.ReLU(), nn.Linear(20, 5))
    cost = measure_model_cost(model, LoggedSquaredOutput(), lambda n: {"x": torch.randn(n, 10)}, [model[0]],
                              lambda params: torch.optim.Adam(params))
    assert (cost.parameters, cost.flops_per_sample, cost.activation_bytes) == (325, 1400.0, 140)
    assert all(p.grad is None for p in model.parameters())


MODEL = ModelCost(parameters=25_000_000, flops_per_sample=6 * 25e6 * 128, activation_bytes=20_000_000,
                  optimizer_ratio=2.0, units=8, largest_unit_bytes=12_000_000)


def test_on_a_slow_network_the_outer_loop_leads_and_on_one_node_ddp_does(tmp_path: Path) -> None:
    lab = predict_all(load_cluster(CLUSTERS / "lab.toml"), MODEL, 256)
    assert lab[0].backend == "diloco" and lab[0].lossy  # 10 GbE against 100 MB of gradients on fast GPUs
    exact = [p for p in lab if not p.lossy]
    assert exact[0].backend == "c10d" and exact[0].split == "by speed"
    one_node = tmp_path / "one.toml"
    one_node.write_text('[[node]]\nname = "box"\ndevices = [{kind = "A100-80GB", count = 4}]\n')
    ranked = predict_all(load_cluster(one_node), MODEL, 256)
    assert ranked[0].mode_flags() == "--ddp-backend c10d"  # NVLink-less PCIe still carries 100 MB in ~15 ms
    assert {p.backend for p in ranked} == {"c10d", "fully_sharded"}  # no outer loop or hybrid on one node


def test_a_mode_whose_state_does_not_fit_is_ranked_last_and_marked(tmp_path: Path) -> None:
    small = tmp_path / "small.toml"
    small.write_text('[network]\nbandwidth = "10Gbit/s"\n'
                     '[[node]]\ndevices = [{kind = "measured", memory = "400M", fp32 = "10T"}]\n'
                     '[[node]]\ndevices = [{kind = "measured", memory = "400M", fp32 = "10T"}]\n')
    # 400M is 419 MB: replicated Adam state takes 400 MB, and a sample 20 MB more; sharded, 224 MB
    ranked = predict_all(load_cluster(small), MODEL, 8)
    unfit = {p.mode_flags() for p in ranked if not p.fits}
    assert "--ddp-backend c10d" in unfit and "--ddp-backend fully_sharded" not in unfit
    assert ranked[0].fits and not ranked[-1].fits


def test_each_node_command_takes_its_devices_shares_and_precisions() -> None:
    cluster = load_cluster(CLUSTERS / "lab.toml")
    best = predict_all(cluster, MODEL, 256)[0]
    commands = node_commands(best, cluster, "--task masked_lm")
    assert len(commands) == 3
    sizes = [int(size) for command in commands for size in re.search(r"--max-sentences (\S+)", command)[1].split(",")]
    assert sum(sizes) * 1 == 256 and sizes == list(best.job.ranks[r].batch for r in range(8))
    assert "--precision fp16,fp16" in commands[1]  # the V100s have no bf16
    assert all(f"--distributed-rank {first}" in command for first, command in zip((0, 4, 6), commands))


def test_hetfair_plan_prints_the_ranked_table_and_a_command_per_node(capsys) -> None:
    code = plan_main(["--cluster", str(CLUSTERS / "two_cpu_nodes.toml"), *TOY, "--global-batch-size", "32"])
    out = capsys.readouterr().out
    assert code == 0
    assert re.search(r"^plan \| 2 devices on 2 nodes, global batch 32, \d[\d,]* parameters", out, re.M)
    assert re.search(r"^plan \| 1 +\| --ddp-backend ", out, re.M)
    assert len(re.findall(r"^hetfair-train .*--distributed-rank [01]$", out, re.M)) in (2, 4)


@pytest.mark.parametrize("text, words", [
    ('[[node]]\ndevices = [{kind = "GTX9090"}]\n',
     r'node 1 \("node1"\) device 1: unknown device kind .GTX9090.: the catalogue knows GTX1080Ti, .*; for another '
     r'device give measured numbers'),
    ('[network]\nbandwidth = "-1Gbit/s"\n[[node]]\ndevices = [{kind = "T4"}]\n[[node]]\ndevices = [{kind = "T4"}]\n',
     r"network: bandwidth: .*-1Gbit/s"),
    ('[[node]]\nname = "empty"\ndevices = []\n', r'node 1 \("empty"\): devices must be a non-empty list'),
])
def test_a_bad_cluster_file_is_one_line(tmp_path: Path, capsys, text: str, words: str) -> None:
    path = tmp_path / "cluster.toml"
    path.write_text(text)
    assert plan_main(["--cluster", str(path), *TOY, "--global-batch-size", "8"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and re.match(rf"hetfair-plan: error: {re.escape(str(path))}: {words}", err), err


def test_the_batch_to_weigh_is_asked_for_in_one_line(capsys) -> None:
    assert plan_main(["--cluster", str(CLUSTERS / "two_cpu_nodes.toml"), *TOY, "--max-sentences", "auto"]) == 2
    assert capsys.readouterr().err == ("hetfair-plan: error: hetfair-plan needs the batch to weigh: give "
                                       "--global-batch-size N (samples per update over the whole cluster)\n")


def test_the_printed_commands_run_as_typed_on_two_hosts(make_network, tmp_path: Path, capsys) -> None:
    """Both suggestions (the fastest, and the fastest exact one) train on hosts named as the cluster file names
    its nodes."""
    names = "".join(f"{SUBNET}.{index + 1} cpu{index}\n" for index in range(2))
    network = make_network(2, etc={"hosts": f"127.0.0.1 localhost\n{names}", "resolv.conf": ""})
    assert plan_main(["--cluster", str(CLUSTERS / "two_cpu_nodes.toml"), *TOY, "--global-batch-size", "32",
                      "--save-dir", "ckpt"]) == 0
    commands = re.findall(r"^hetfair-train (.*)$", capsys.readouterr().out, re.M)
    assert len(commands) in (2, 4)
    for pair in (commands[:2], commands[2:]):
        procs = [start_on(network, index, shlex.split(command), tmp_path, node_env())
                 for index, command in enumerate(pair)]
        results = [(proc.communicate(timeout=240)[1], proc.returncode) for proc in procs]
        assert [code for _err, code in results] == [0, 0], results
        assert (tmp_path / "ckpt" / "checkpoint_last.pt").is_file()
        (tmp_path / "ckpt" / "checkpoint_last.pt").unlink()


def test_auto_backend_ranks_its_candidates_on_measured_devices() -> None:
    """--ddp-backend auto's ranking: a 20 MB model (one DDP bucket, which only arrives at the end of the backward)
    computing 320 ms an update over 1 Gbit/s. On GPUs FSDP2's per-unit gathers hide behind the compute while DDP's one
    bucket cannot (0.16 s shown against ~20 ms); on CPUs nothing overlaps, and the all-reduce's fewer bytes win."""
    from hetfair.cluster.description import Link
    from hetfair.plan.predicted import measured_cluster, predict_candidates

    fact = {"memory": 4e10, "precision": "fp32", "seconds_per_sample": 0.01, "step_overhead": 0.0,
            "flops_per_sample": 1e9, "batch": 32}
    model = ModelCost(5_000_000, 1e9, 1_000_000, 2.0, 12, 2_000_000)
    for device, first in (("cuda", "fully_sharded"), ("cpu", "c10d")):
        cluster = measured_cluster([{**fact, "node": node, "device": device} for node in "ab"], Link(1.25e8, 5e-5))
        ranked = predict_candidates(cluster, model, [32, 32], ["c10d", "fully_sharded"], None)
        assert [p.backend for p in ranked][0] == first and all(p.fits for p in ranked)


def test_a_longer_step_measured_no_longer_counts_all_per_sample() -> None:
    """Steps of 8 and 16 samples timed 0.10 and 0.18 s: 10 ms per sample beyond 20 ms per update. On a loaded
    machine the 16-sample step once came out no longer than the 8-sample one; clamping their difference made the
    device look millions of times faster, the plan gave it the whole batch and the other device none, and
    hetfair-plan --cluster measure divided by that device's zero seconds (a fresh-clone CI run)."""
    from hetfair.plan.measure import split_step_costs

    assert split_step_costs(0.10, 0.18, 8, 16) == pytest.approx((0.01, 0.02))
    assert split_step_costs(0.10, 0.09, 8, 16) == pytest.approx((0.09 / 16, 0.0))


def test_a_device_the_split_leaves_without_samples_plans_without_dividing_by_zero() -> None:
    """Two measured CPUs, one 1,000 times faster: the split by speed gives the slow one no sample of 32, and its
    own rate counts nothing in the sum of the devices alone."""
    from hetfair.cluster.description import Link
    from hetfair.plan.predicted import measured_cluster

    fact = {"memory": 4e10, "precision": "fp32", "step_overhead": 0.0, "flops_per_sample": 1e9, "batch": 32,
            "device": "cpu"}
    cluster = measured_cluster([{**fact, "node": "a", "seconds_per_sample": 1e-5},
                                {**fact, "node": "b", "seconds_per_sample": 1e-2}], Link(1.25e8, 5e-5))
    model = ModelCost(5_000_000, 1e9, 1_000_000, 2.0, 12, 2_000_000)
    by_speed = [p for p in predict_all(cluster, model, 32) if p.split == "by speed"]
    assert by_speed and all([rank.batch for rank in p.job.ranks] == [32, 0] for p in by_speed)
    assert by_speed[0].alone == pytest.approx(1e5)  # the fast device's 32 samples in 32 x 10 us


def test_the_will_it_scale_commands_run_as_typed_and_print_what_the_page_shows(tmp_path: Path) -> None:
    """docs/will-it-scale.md's two hetfair-plan blocks, run by bash in a checkout (the repository's examples and
    this test's virtual environment as .venv): the first prints exactly the page's table and commands (every number
    follows from the model, the catalogue and the file), the second plans for this machine as one measured node."""
    if not (Path(sys.prefix) / "bin" / "activate").is_file():
        pytest.skip(f"the blocks activate .venv, and the tests run outside a virtual environment ({sys.prefix})")
    (tmp_path / ".venv").symlink_to(sys.prefix)
    (tmp_path / "examples").symlink_to(REPO_ROOT / "examples")
    page = (REPO_ROOT / "docs" / "will-it-scale.md").read_text()
    blocks = {block.split("\n", 1)[0]: block.split("```")[0] for block in page.split("```bash\n")[1:]}
    lab = blocks["# plan a GPT for the lab cluster of examples/clusters/lab.toml"]
    shown = next(block for block in page.split("```\n") if block.startswith("plan | 8 devices"))
    printed = _bash(lab, tmp_path)
    assert printed.split("\n", 1)[1] == shown  # after hetfair-preprocess's own line
    measured = _bash(blocks["# plan for this machine's own devices, timed on the model"], tmp_path)
    assert re.match(r"plan \| 1 device on 1 node, global batch 64, 3,704,320 parameters", measured)
    assert re.search(r"^plan \| 1 \| --ddp-backend c10d +\| by speed \|", measured, re.M)


def _bash(block: str, cwd: Path) -> str:
    env = {name: value for name, value in subprocess_env().items() if name != "VIRTUAL_ENV"}
    result = subprocess.run(["bash", "-e", "-c", block], cwd=cwd, env=env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def test_measure_times_each_device_and_the_link_between_two_hosts(make_network, tmp_path: Path) -> None:
    """``--cluster measure`` as a job of one process on each of two hosts joined at 20 Mbit/s: the plan's
    network is the link timed by one all-reduce (of 1 MiB: 0.42 s at 20 Mbit/s), which tbf shapes within a few
    percent of its rate; 35% allows for TCP's and gloo's framing and the timing of one collective on a loaded
    machine, and still tells 20 Mbit/s from the 10 or 40 a wrong ring factor or unit would give."""
    network = make_network(2)
    for index in range(2):
        network.shape(index, "20mbit")
    init = f"tcp://{network.hosts[0].address}:29500"
    args = ["--cluster", "measure", *TOY, "--global-batch-size", "32"]
    procs = [start_forked_plan(network, rank, [*args, *rank_flags(rank, 2, init)], tmp_path) for rank in range(2)]
    outputs = [proc.communicate(timeout=240) for proc in procs]
    # each rank's whole stderr, untruncated: which rank failed first shows only there
    assert [proc.returncode for proc in procs] == [0, 0], "\n".join(
        f"--- rank {rank} exited {proc.returncode}:\n{err}" for rank, (proc, (_out, err)) in enumerate(zip(procs, outputs)))
    printed = outputs[0][0]
    assert re.match(r"plan \| 2 devices on 2 nodes, global batch 32", printed), printed
    bandwidth = float(re.search(r"^plan \| links: between nodes ([\d.]+) Gbit/s, ", printed, re.M)[1])
    assert 0.65 * 0.02 < bandwidth < 1.35 * 0.02, printed
    assert outputs[1][0] == ""  # only the master prints the plan


def start_forked_plan(network, index: int, args: list[str], cwd: Path) -> subprocess.Popen:
    """``hetfair-plan args`` on host ``index`` of ``network``."""
    command = network.hosts[index].command(str(Path(sys.executable).with_name("hetfair-plan")), *args)
    return subprocess.Popen(command, cwd=cwd, env=node_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)

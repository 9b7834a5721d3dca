"""``benchmarks/gpu_check.py``, the script for a lent GPU: its CPU dry run, its cases and the commands they run,
how a case is judged, and its refusal without CUDA."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers import REPO_ROOT, subprocess_env
from hetfair.live.recovery import check_live_options
from hetfair.memory.sizes import parse_size
from hetfair.options import parse_train_args
from hetfair.run.training import check_before_start
from hetfair_cli.lighthouse import build_parser as lighthouse_parser

sys.path.insert(0, str(REPO_ROOT / "benchmarks"))
import gpu_check  # noqa: E402
import gpu_modes  # noqa: E402
from gpu_modes import LiveCase, Machine, TrainCase  # noqa: E402

SCRIPT = REPO_ROOT / "benchmarks" / "gpu_check.py"
IN_PROCESS = ["collectives", "offload", "bert-fp32", "bert-bf16", "bert-fp16", "probe"]
MODES = {"c10d", "comm-fp16", "comm-bf16", "comm-powersgd", "hybrid_sharded", "localsgd", "diloco",
         "uneven+offload", "plan-auto", "live", "live-nccl"}
MACHINES = [Machine(0), Machine(1), Machine(1, nccl_shares_gpu=True), Machine(2), Machine(4)]


def run_script(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *argv], capture_output=True, text=True,
                          env=subprocess_env(), timeout=600, check=False)


def test_dry_run_checks_collectives_trains_in_every_precision_probes_and_runs_a_mode() -> None:
    # every check in this process, one mode as a command (two gloo ranks), and the NCCL one skipped on CPU
    result = run_script("--dry-run", "--only", ",".join([*IN_PROCESS, "comm-powersgd", "live-nccl"]))
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert "collectives | gloo initialised for 1 process; all_reduce ok" in lines
    assert any(line.startswith("uneven | offload 0: 2 AdamW updates equal the whole model's") for line in lines)
    rows = {line.split()[0]: line.split() for line in lines if line.split() and line.split()[0] in
            ("fp32", "bf16", "fp16")}
    assert set(rows) == {"fp32", "bf16", "fp16"}
    for precision, fields in rows.items():
        seq_s, first_loss, last_loss, skipped = float(fields[1]), float(fields[3]), float(fields[5]), int(fields[6])
        assert seq_s > 0 and 0 < first_loss < 10 and 0 < last_loss < 10 and skipped == 0, precision
        assert parse_size(fields[7]) > 0, precision  # the peak memory
    assert rows["fp32"][-2:] == ["seq/s", "(TF32)"] and rows["fp16"][-3] == "580"
    [probe] = [line for line in lines if line.startswith("oom probe | ")]  # the plan's probe met its limit, then trained
    assert " did not, under a budget 16M above the process's memory" in probe and "nothing left allocated" in probe

    # the one table at the end: a row per check, in the order they ran
    [summary] = [index for index, line in enumerate(lines) if re.fullmatch(r"gpu_check \| \d+ passed, .* s", line)]
    assert re.fullmatch(r"gpu_check \| 7 passed, 0 failed, 1 skipped in \d+ s", lines[summary])
    table = [[cell.strip() for cell in line.strip("|").split("|")] for line in lines[summary + 1:]
             if line.startswith("|")]
    assert table[0] == ["mode", "backend", "result", "key number", "seconds"] and set(table[1][0]) == {"-"}
    assert [row[0] for row in table[2:]] == [*IN_PROCESS, "comm-powersgd", "live-nccl"]
    results = {row[0]: row[1:] for row in table[2:]}
    assert results["collectives"][:3] == ["gloo", "pass", "gloo"]
    assert results["bert-fp16"][1:2] == ["pass"] and results["bert-fp16"][2].endswith(" seq/s")
    backend, outcome, key, seconds = results["comm-powersgd"]
    assert (backend, outcome) == ("gloo", "pass") and key.startswith("valid loss ") and float(seconds) > 0
    assert key.endswith("(no c10d run to compare)")
    assert results["live-nccl"][:2] == ["nccl", "skip"] and lines[-1] == "skip | live-nccl: NCCL needs a GPU"


def test_every_mode_has_a_case_and_only_names_a_known_check(capsys) -> None:
    assert {case.name for case in gpu_modes.cases()} == MODES
    assert gpu_modes.cases()[0].name == gpu_modes.BASELINE  # the reference runs first
    with pytest.raises(SystemExit) as stopped:
        gpu_check.main(["--only", "c10d,nonsense"])
    assert stopped.value.code == 2
    assert "--only: no check named nonsense; the checks: collectives, " in capsys.readouterr().err


@pytest.mark.parametrize("machine", MACHINES, ids=lambda m: f"{m.gpus}gpu{'-nccl-shares' * m.nccl_shares_gpu}")
def test_every_command_is_one_hetfair_train_takes(machine: Machine, tmp_path: Path) -> None:
    for case in gpu_modes.cases():
        commands = case.commands(machine, tmp_path)
        assert len(commands) == (case.ranks if isinstance(case, LiveCase) else 1)
        for command in commands:
            assert command[:3] == [sys.executable, "-m", "hetfair_cli.train"], case.name
            args = parse_train_args(command[3:])  # the option checks hetfair-train makes before it starts
            check_before_start(args)
            assert args.distributed_world_size == case.ranks and args.cpu == (not machine.cuda), case.name
            if isinstance(case, LiveCase):
                check_live_options(args)
                assert lighthouse_parser().parse_args(case.lighthouse_command()[3:]).port == 0


def argv_of(name: str, machine: Machine, workdir: Path) -> list[str]:
    [case] = [case for case in gpu_modes.cases() if case.name == name]
    return case.commands(machine, workdir)[0]


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_ranks_share_one_gpu_on_nccl_only_where_it_lets_them(tmp_path: Path) -> None:
    one, shared, four = Machine(1), Machine(1, nccl_shares_gpu=True), Machine(4)
    pair = argv_of("comm-powersgd", one, tmp_path)
    assert (flag(pair, "--device-id"), flag(pair, "--distributed-backend")) == ("0,0", "gloo")
    assert flag(argv_of("comm-powersgd", shared, tmp_path), "--distributed-backend") == "nccl"
    hybrid = argv_of("hybrid_sharded", four, tmp_path)
    assert (flag(hybrid, "--device-id"), flag(hybrid, "--distributed-backend")) == ("0,1,2,3", "nccl")
    assert flag(argv_of("hybrid_sharded", Machine(2), tmp_path), "--distributed-backend") == "gloo"
    [live_nccl] = [case for case in gpu_modes.cases() if case.name == "live-nccl"]
    assert flag(live_nccl.commands(one, tmp_path)[0], "--distributed-backend") == "nccl"
    [live] = [case for case in gpu_modes.cases() if case.name == "live"]
    assert [flag(command, "--device-id") for command in live.commands(Machine(2), tmp_path)] == ["0", "1"]


def test_offload_and_device_budgets_go_only_to_a_cuda_run(tmp_path: Path) -> None:
    cuda, cpu = argv_of("uneven+offload", Machine(1), tmp_path), argv_of("uneven+offload", Machine(0), tmp_path)
    assert flag(cuda, "--offload") == "1,0" and "--offload" not in cpu
    assert flag(cuda, "--shard-fractions") == flag(cpu, "--shard-fractions") == "1,3"
    auto = argv_of("plan-auto", Machine(1), tmp_path)
    assert [flag(auto, f) for f in ("--max-sentences", "--precision", "--ddp-backend")] == ["auto"] * 3
    assert flag(auto, "--memory-budget") == "1G,2G" and flag(argv_of("plan-auto", Machine(0), tmp_path),
                                                                   "--memory-budget") == "420M,560M"


def finished(valid_loss: float, *lines: str, code: int = 0, updates: int = gpu_modes.UPDATES) -> \
        subprocess.CompletedProcess:
    """What a hetfair-train run of ``updates`` updates prints, ending with ``valid_loss``."""
    records = [f'{{"phase": "train_inner", "num_updates": {n}, "loss": 1.0}}' for n in range(1, updates + 1)]
    out = "\n".join([*records, f'{{"phase": "valid", "num_updates": {updates}, "loss": {valid_loss}}}', *lines])
    return subprocess.CompletedProcess([], code, out, "")


def judged(case: TrainCase, done: subprocess.CompletedProcess, baseline: float | None) -> gpu_modes.Outcome:
    outcome = gpu_modes.Outcome(case.name, "gloo", False, "-", 0.0)
    case._judge(done, Machine(0), baseline, outcome)
    return outcome


def test_a_case_passes_within_its_tolerance_of_the_reference_and_says_why_it_fails() -> None:
    case = TrainCase("comm-x", "a hook", 2, (), evidence=(r"uses x",), tolerance=0.01)
    inside = judged(case, finished(0.504, "this run uses x"), baseline=0.5)
    assert inside.passed and inside.key == "valid loss 0.50400 (+8.0e-03 vs c10d)" and inside.loss == 0.504
    outside = judged(case, finished(0.51, "this run uses x"), baseline=0.5)
    assert outside.passed is False and outside.detail == "+2.0e-02 from c10d's 0.50000, more than 1e-02"
    unseen = judged(case, finished(0.5), baseline=0.5)
    assert unseen.passed is False and unseen.detail == "the output lacks 'uses x'"
    short = judged(case, finished(0.5, "this run uses x", updates=3), baseline=0.5)
    assert short.passed is False and short.detail.startswith("3 training losses of 12")
    diverged = judged(case, finished(float("nan"), "this run uses x"), baseline=0.5)
    assert diverged.passed is False
    failed = judged(case, finished(0.5, "hetfair-train: error: --offload needs a CUDA device", code=2), 0.5)
    assert failed.passed is False and failed.detail == "exit 2: hetfair-train: error: --offload needs a CUDA device"
    alone = judged(case, finished(0.5, "this run uses x"), baseline=None)
    assert alone.passed and alone.key == "valid loss 0.50000 (no c10d run to compare)"
    planned = TrainCase("plan-x", "a plan", 2, (), key=r"plan \| 0 .*\| (probed: .*)$")
    assert judged(planned, finished(0.5, "plan | 0 | cpu | fp32 | probed: 134 fit, 136 did not"), None).key == \
        "probed: 134 fit, 136 did not"


def test_list_prints_every_check_and_each_command_without_running_one(capsys) -> None:
    assert gpu_check.main(["--list", "--dry-run"]) == 0
    lines = capsys.readouterr().out.splitlines()
    names = [line.split(" | ")[0] for line in lines[1:] if not line.startswith(" ")]
    assert names == [*IN_PROCESS, *(case.name for case in gpu_modes.cases())]
    commands = [line for line in lines if line.startswith("    ")]
    assert len(commands) == sum(case.ranks if isinstance(case, LiveCase) else 1 for case in gpu_modes.cases())
    assert all(" -m hetfair_cli.train " in command and " --cpu" in command for command in commands)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is visible: the script would run for real")
def test_without_cuda_it_stops_with_one_line() -> None:
    result = run_script()
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.count("\n") == 1 and result.stderr.startswith("gpu_check: error: no CUDA device is visible")

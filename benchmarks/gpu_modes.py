"""hetfair-train's modes as users run them, each a short run on the lent GPU (the part of ``gpu_check.py``
that starts commands).

Every case but live recovery trains the simulated cluster's MLP (``benchmarks/simcluster``: 8 inputs,
two hidden layers of 128 as sharding units, 3 classes; no data to download) for 12 SGD updates of the same
32 samples each and reads the validation loss at the end. The replicated run (``c10d``) is the reference:
an exact mode (hybrid sharding, uneven shards with offload) must end within 1e-4 of its loss (relative),
a lossy one within its tolerance: fp16 1e-3, bf16 3e-3, powersgd and localsgd 1e-2, diloco 0.15
(docs/outer-loop.md's bound against DDP). Measured on CPU (gloo): fp16 4e-6, bf16 1.1e-5, powersgd
9.7e-4, localsgd 2e-8, diloco -2.9e-2, hybrid 2e-8, uneven 0; a run at twice the learning rate (what a
hook that sums instead of averaging would do) ends 2.6e-1 away. The whole ``--dry-run`` took 584 s on
2 shared CPU cores (load 13).

Where the ranks run: a job of N processes uses NCCL where each process has a GPU of its own, or where NCCL
lets two processes share one (``nccl_shares_gpu``, tried first: NCCL 2.12 and later refuse that, "Duplicate
GPU detected"); otherwise its processes share GPU 0 over gloo, which reduces CUDA tensors too. One process
(the plan's probe, the one-rank live job) always runs on NCCL. ``--dry-run`` runs every case on CPU over gloo
(``--offload`` needs CUDA: the uneven case runs without it there).
"""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Protocol, Sequence

SIMCLUSTER = Path(__file__).resolve().parent / "simcluster"
UPDATES = 12
GLOBAL_BATCH = 32
EXACT = 1e-4
CASE_SECONDS = 240.0
"""The longest any one case may take (a start on a loaded machine included) before it fails."""
BASELINE = "c10d"
TRAIN = [sys.executable, "-m", "hetfair_cli.train"]
LIGHTHOUSE = [sys.executable, "-m", "hetfair_cli.lighthouse"]
PREEMPTED = 75


@dataclass(frozen=True)
class Machine:
    """Where the cases run: ``gpus`` CUDA devices (0: the CPU dry run), and whether NCCL lets two processes
    share one."""

    gpus: int
    nccl_shares_gpu: bool = False

    @property
    def cuda(self) -> bool:
        return self.gpus > 0

    def backend(self, ranks: int) -> str:
        if not self.cuda:
            return "gloo"
        return "nccl" if ranks == 1 or self.gpus >= ranks or self.nccl_shares_gpu else "gloo"

    def device_flags(self, ranks: int, first: int = 0) -> list[str]:
        """Each of ``ranks`` processes (from process ``first`` on) its GPU, round robin, and the backend."""
        if not self.cuda:
            return ["--cpu"]
        ids = ",".join(str((first + index) % self.gpus) for index in range(ranks))
        return ["--device-id", ids, "--distributed-backend", self.backend(ranks)]


@dataclass
class Outcome:
    """One row of the table."""

    mode: str
    backend: str
    passed: Optional[bool]
    """``None``: skipped (not for this machine)."""
    key: str
    seconds: float
    loss: Optional[float] = None
    detail: str = ""
    """Why it failed (one line), or what was skipped."""

    @property
    def result(self) -> str:
        return "skip" if self.passed is None else "pass" if self.passed else "fail"


class ModeCase(Protocol):
    """A mode as commands: a :class:`TrainCase` or a :class:`LiveCase`."""

    name: str
    what: str
    ranks: int

    def backend(self, machine: Machine) -> str: ...

    def commands(self, machine: Machine, workdir: Path) -> list[list[str]]: ...

    def run(self, machine: Machine, workdir: Path, baseline: Optional[float]) -> Outcome: ...


def sim_flags(ranks: int, *, train_size: int = 512, hidden: int = 128, layers: int = 2,
              updates: int = UPDATES) -> list[str]:
    """The simulated cluster's task and model, SGD, JSON logs of every update, the validation at the end."""
    return ["--user-dir", str(SIMCLUSTER), "--task", "sim", "--sim-train-size", str(train_size),
            "--sim-hidden", str(hidden), "--sim-layers", str(layers), "--sim-sample-ms", "0",
            "--sim-speeds", ",".join(["1"] * ranks), "--optimizer", "sgd", "--lr", "0.1", "--seed", "1",
            "--max-update", str(updates), "--log-format", "json", "--log-interval", "1",
            "--distributed-world-size", str(ranks)]


@dataclass(frozen=True)
class TrainCase:
    """One ``hetfair-train`` command of ``ranks`` processes; it passes when it exits 0, prints every
    ``evidence`` pattern, and (``tolerance``) ends within that relative distance of the c10d run's loss."""

    name: str
    what: str
    ranks: int
    flags: tuple[str, ...]
    evidence: tuple[str, ...] = ()
    tolerance: Optional[float] = None
    cuda_flags: tuple[str, ...] = ()
    """Flags only a CUDA run takes (``--offload``)."""
    cpu_flags: tuple[str, ...] = ()
    cuda_evidence: tuple[str, ...] = ()
    cpu_evidence: tuple[str, ...] = ()
    sim: dict[str, int] = field(default_factory=dict)
    key: Optional[str] = None
    """A pattern whose first group is the key number (default: the validation loss)."""

    def backend(self, machine: Machine) -> str:
        return machine.backend(self.ranks)

    def commands(self, machine: Machine, workdir: Path) -> list[list[str]]:
        extra = self.cuda_flags if machine.cuda else self.cpu_flags
        return [[*TRAIN, *sim_flags(self.ranks, **self.sim), *machine.device_flags(self.ranks), *self.flags, *extra,
                 "--save-dir", str(workdir / self.name), "--no-save"]]

    def run(self, machine: Machine, workdir: Path, baseline: Optional[float]) -> Outcome:
        start = time.perf_counter()
        outcome = Outcome(self.name, self.backend(machine), False, "-", 0.0)
        try:
            done = subprocess.run(self.commands(machine, workdir)[0], capture_output=True, text=True,
                                  env=child_env(), timeout=CASE_SECONDS, check=False)
        except subprocess.TimeoutExpired:
            outcome.detail = f"no end within {CASE_SECONDS:.0f} s"
        else:
            self._judge(done, machine, baseline, outcome)
        outcome.seconds = time.perf_counter() - start
        return outcome

    def _judge(self, done: subprocess.CompletedProcess, machine: Machine, baseline: Optional[float],
               outcome: Outcome) -> None:
        text = done.stdout + done.stderr
        if done.returncode != 0:
            outcome.detail = f"exit {done.returncode}: {last_error(text)}"
            return
        records = json_records(text)
        losses = [r["loss"] for r in records if r.get("phase") == "train_inner"]
        valid = [r["loss"] for r in records if r.get("phase") == "valid"]
        missing = [pattern for pattern in (*self.evidence, *(self.cuda_evidence if machine.cuda else
                                                               self.cpu_evidence)) if not re.search(pattern, text)]
        if len(losses) != UPDATES or not valid or not all(map(math.isfinite, [*losses, *valid])):
            outcome.detail = f"{len(losses)} training losses of {UPDATES}, validation {valid}: {losses[-3:]}"
            return
        outcome.loss = valid[-1]
        found = re.search(self.key, text, re.MULTILINE) if self.key else None
        outcome.key = found.group(1) if found else f"valid loss {outcome.loss:.5f}"
        if missing:
            outcome.detail = f"the output lacks {missing[0]!r}"
            return
        if self.tolerance is not None and baseline is not None:
            gap = (outcome.loss - baseline) / baseline
            outcome.key += f" ({gap:+.1e} vs {BASELINE})"
            if abs(gap) > self.tolerance:
                outcome.detail = f"{gap:+.1e} from {BASELINE}'s {baseline:.5f}, more than {self.tolerance:.0e}"
                return
        elif self.tolerance is not None:
            outcome.key += f" (no {BASELINE} run to compare)"
        outcome.passed = True


@dataclass(frozen=True)
class LiveCase:
    """``--fault-tolerance live`` with a lighthouse: ``ranks`` commands; with two, rank 1 is killed after update
    3, rank 0 trains on alone, a replacement joins, and SIGTERM ends both (exit 75, a checkpoint); with one, it
    starts, trains and ends by itself (exit 0)."""

    name: str
    what: str
    ranks: int
    cuda_only: bool = False
    """NCCL's case: skipped on CPU."""

    def backend(self, machine: Machine) -> str:
        return "nccl" if self.cuda_only else machine.backend(self.ranks)

    def lighthouse_command(self) -> list[str]:
        return [*LIGHTHOUSE, "--port", "0"]

    def commands(self, machine: Machine, workdir: Path, port: int = 29400) -> list[list[str]]:
        """Each rank's command (the replacement's is the lost rank's)."""
        flags = sim_flags(self.ranks, train_size=100_000, updates=UPDATES if self.ranks == 1 else 100_000)
        return [[*TRAIN, *flags, "--sim-step-ms", "20", "--max-sentences", str(GLOBAL_BATCH // self.ranks),
                 "--fault-tolerance", "live", "--live-timeout", "10",
                 "--distributed-init-method", f"tcp://127.0.0.1:{port}", "--save-dir", str(workdir / self.name),
                 *self._device_flags(machine, index)]
                for index in range(self.ranks)]

    def _device_flags(self, machine: Machine, index: int) -> list[str]:
        """One process of the job: its GPU (round robin) and the job's backend."""
        if not machine.cuda:
            return ["--cpu"]
        return ["--device-id", str(index % machine.gpus), "--distributed-backend", self.backend(machine)]

    def run(self, machine: Machine, workdir: Path, baseline: Optional[float]) -> Outcome:
        start = time.perf_counter()
        outcome = Outcome(self.name, self.backend(machine), None, "-", 0.0)
        if self.cuda_only and not machine.cuda:
            outcome.detail = "NCCL needs a GPU"
            return outcome
        processes: list[Stream] = []
        try:
            lighthouse = Stream(self.lighthouse_command())
            processes.append(lighthouse)
            port = int(lighthouse.wait_for(r"listening on port (\d+)")[1].group(1))
            commands = self.commands(machine, workdir, port)
            outcome.key = (self._lose_and_rejoin if self.ranks == 2 else self._start_and_end)(commands, processes)
            outcome.passed = True
        except CaseFailed as exc:
            outcome.passed, outcome.detail = False, str(exc)
        finally:
            for process in processes:
                process.stop()
        outcome.seconds = time.perf_counter() - start
        return outcome

    def _start_and_end(self, commands: list[list[str]], processes: list["Stream"]) -> str:
        rank = Stream(commands[0])
        processes.append(rank)
        rank.wait_for(r"live \| round 1: rank 0 of 1")
        code = rank.wait_exit()
        if code != 0:
            raise CaseFailed(f"exit {code}: {last_error(rank.text())}")
        return f"{sum(1 for r in json_records(rank.text()) if r.get('phase') == 'train_inner')} updates, exit 0"

    def _lose_and_rejoin(self, commands: list[list[str]], processes: list["Stream"]) -> str:
        ranks = [Stream(command) for command in commands]
        processes.extend(ranks)
        order = {int(stream.wait_for(r"live \| round 1: rank (\d) of 2")[1].group(1)): stream for stream in ranks}
        master, lost = order[0], order[1]
        master.wait_for(r'"phase": "train_inner".*"num_updates": 3,')
        lost.kill()
        killed = time.perf_counter()
        seen, _ = master.wait_for(r"live \| round 2: rank 0 of 1 \(1 of 2 kept\)")
        master.wait_for(r'"phase": "train_inner"', after=seen)
        recovered = time.perf_counter() - killed
        replacement = Stream(commands[ranks.index(lost)])
        processes.append(replacement)
        replacement.wait_for(r"live \| round 3: rank 1 of 2 \(1 of 1 kept\) from update \d+, state of rank 0")
        rejoined = time.perf_counter() - killed
        seen, _ = master.wait_for(r"live \| round 3: rank 0 of 2")
        for _ in range(2):
            seen, _ = master.wait_for(r'"phase": "train_inner"', after=seen)
        for stream in (master, replacement):
            stream.signal(signal.SIGTERM)
        codes = [stream.wait_exit() for stream in (master, replacement)]
        if codes != [PREEMPTED, PREEMPTED]:
            raise CaseFailed(f"SIGTERM ended the ranks with {codes}, not {PREEMPTED}: {last_error(master.text())}")
        return f"trained on {recovered:.1f} s after the kill; rejoined after {rejoined:.1f} s"


class CaseFailed(Exception):
    """A step of a case did not happen."""


class Stream:
    """A running command whose output lines a thread collects, to wait for one that matches."""

    def __init__(self, command: list[str]) -> None:
        self.proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env=child_env())
        self.lines: list[str] = []
        self._changed = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            with self._changed:
                self.lines.append(line.rstrip("\n"))
                self._changed.notify_all()
        with self._changed:
            self._changed.notify_all()

    def wait_for(self, pattern: str, after: int = -1) -> tuple[int, re.Match]:
        """The first line after line ``after`` that matches ``pattern``: its index and the match."""
        regex, deadline = re.compile(pattern), time.monotonic() + CASE_SECONDS
        with self._changed:
            while True:
                for index in range(after + 1, len(self.lines)):
                    found = regex.search(self.lines[index])
                    if found:
                        return index, found
                if self.proc.poll() is not None and not self._changed.wait(1.0):
                    raise CaseFailed(f"ended ({self.proc.returncode}) before {pattern!r}: {last_error(self.text())}")
                if time.monotonic() > deadline:
                    raise CaseFailed(f"no {pattern!r} within {CASE_SECONDS:.0f} s: {last_error(self.text())}")
                self._changed.wait(1.0)

    def text(self) -> str:
        with self._changed:
            return "\n".join(self.lines)

    def kill(self) -> None:
        self.proc.kill()

    def signal(self, signum: int) -> None:
        os.kill(self.proc.pid, signum)

    def wait_exit(self) -> int:
        try:
            return self.proc.wait(timeout=CASE_SECONDS)
        except subprocess.TimeoutExpired:
            raise CaseFailed(f"still running {CASE_SECONDS:.0f} s later: {last_error(self.text())}") from None

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONUNBUFFERED"] = "1"
    env.setdefault("OMP_NUM_THREADS", "2")
    return env


def json_records(text: str) -> list[dict]:
    records = []
    for line in text.splitlines():
        if line.startswith("{"):
            try:
                records.append(json.loads(line))
            except ValueError:
                pass
    return records


def last_error(text: str) -> str:
    """The command's error line, else its last line."""
    lines = [line for line in text.splitlines() if line.strip()]
    errors = [line for line in lines if "error:" in line]
    return (errors or lines or ["(no output)"])[-1][:300]


def cases() -> list[ModeCase]:
    """Every mode, in the order they run (the c10d reference first)."""
    two = ("--max-sentences", str(GLOBAL_BATCH // 2))
    return [
        TrainCase(BASELINE, "replicated DDP, the exact all-reduce: the reference loss", 2, two,
                  evidence=(r"comm \| \S+ MB of gradients per update",)),
        TrainCase("comm-fp16", "--ddp-comm-hook fp16: gradients all-reduced in fp16", 2,
                  (*two, "--ddp-comm-hook", "fp16"), evidence=(r"this run uses fp16",), tolerance=1e-3),
        TrainCase("comm-bf16", "--ddp-comm-hook bf16: gradients all-reduced in bf16", 2,
                  (*two, "--ddp-comm-hook", "bf16"), evidence=(r"this run uses bf16",), tolerance=3e-3),
        TrainCase("comm-powersgd", "--ddp-comm-hook powersgd, rank 2, from update 3", 2,
                  (*two, "--ddp-comm-hook", "powersgd", "--powersgd-rank", "2", "--powersgd-start-update", "3"),
                  evidence=(r"this run uses powersgd",), tolerance=1e-2),
        TrainCase("hybrid_sharded", "--ddp-backend hybrid_sharded: 2 nodes of 2 ranks (--shard-group-size 2)", 4,
                  ("--max-sentences", str(GLOBAL_BATCH // 4), "--ddp-backend", "hybrid_sharded",
                   "--shard-group-size", "2"), evidence=(r'"nodes": 2', r'"ranks_per_node": 2'), tolerance=EXACT),
        TrainCase("localsgd", "--ddp-backend localsgd --outer-interval 4", 2,
                  (*two, "--ddp-backend", "localsgd", "--outer-interval", "4"), tolerance=1e-2),
        TrainCase("diloco", "--ddp-backend diloco --outer-interval 4 --outer-momentum 0.5", 2,
                  (*two, "--ddp-backend", "diloco", "--outer-interval", "4", "--outer-momentum", "0.5"),
                  tolerance=0.15),
        TrainCase("uneven+offload", "fully_sharded --shard-fractions 1,3 --offload 1,0 (CPU: without --offload)", 2,
                  (*two, "--ddp-backend", "fully_sharded", "--shard-fractions", "1,3"),
                  cuda_flags=("--offload", "1,0"), evidence=(r"rank0_parameters\W+\d+",), tolerance=EXACT),
        TrainCase("plan-auto", "--max-sentences auto --precision auto --ddp-backend auto: the probe on the device", 2,
                  ("--max-sentences", "auto", "--precision", "auto", "--ddp-backend", "auto",
                   "--global-batch-size", "256", "--lr", "0.01"),
                  evidence=(r"plan \| 0 .*\| probed: ", r"plan \| --ddp-backend (c10d|fully_sharded): "),
                  cuda_flags=("--memory-budget", "1G,2G"), cpu_flags=("--memory-budget", "420M,560M"),
                  cuda_evidence=(r"plan \| 0 +\| (?!cpu)[^|]+\|.*\| (bf16|fp16) ",),
                  cpu_evidence=(r"plan \| 0 +\| cpu .*\| fp32 ",),
                  sim={"train_size": 4096, "hidden": 65536, "layers": 0}, key=r"plan \| 0 .*\| (probed: .*)$"),
        LiveCase("live", "--fault-tolerance live, a lighthouse, 2 ranks: rank 1 killed, a replacement joins", 2),
        LiveCase("live-nccl", "--fault-tolerance live on NCCL, one rank: starts and ends (on one GPU 'live' may "
                 "run on gloo)", 1, cuda_only=True),
    ]


NCCL_PAIR = """
import datetime, sys, torch, torch.distributed as dist
torch.cuda.set_device(0)
dist.init_process_group("nccl", init_method="tcp://127.0.0.1:" + sys.argv[2], rank=int(sys.argv[1]), world_size=2,
                        timeout=datetime.timedelta(seconds=30))
tensor = torch.ones(1, device="cuda")
dist.all_reduce(tensor)
assert tensor.item() == 2.0, tensor
dist.destroy_process_group()
"""


def nccl_pair_on_one_gpu(port: int) -> Outcome:
    """Whether two NCCL processes on GPU 0 can all-reduce (NCCL 2.12+ refuses: "Duplicate GPU detected")."""
    start = time.perf_counter()
    procs = [subprocess.Popen([sys.executable, "-c", NCCL_PAIR, str(rank), str(port)], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, env=child_env()) for rank in range(2)]
    outputs = []
    for proc in procs:
        try:
            outputs.append(proc.communicate(timeout=90)[0])
        except subprocess.TimeoutExpired:
            proc.kill()
            outputs.append(proc.communicate()[0] + "\n(no end within 90 s)")
    shares = all(proc.returncode == 0 for proc in procs)
    why = "" if shares else next((last_error(text) for proc, text in zip(procs, outputs) if proc.returncode), "")
    key = "yes: multi-rank cases share GPU 0 on NCCL" if shares else "no: multi-rank cases share GPU 0 on gloo"
    return Outcome("nccl-2-on-1-gpu", "nccl", True, key, time.perf_counter() - start, detail=why)


def run_cases(selected: Sequence[ModeCase], machine: Machine, workdir: Path) -> list[Outcome]:
    """Run ``selected`` in order, each line as it ends; the c10d run's loss is the others' reference."""
    outcomes: list[Outcome] = []
    baseline: Optional[float] = None
    for case in selected:
        outcome = case.run(machine, workdir, baseline)
        if case.name == BASELINE and outcome.passed:
            baseline = outcome.loss
        print(f"{outcome.mode} | {outcome.result} | {outcome.backend} | {outcome.key} | {outcome.seconds:.1f} s"
              + (f" | {outcome.detail}" if outcome.detail else ""), flush=True)
        outcomes.append(outcome)
    return outcomes

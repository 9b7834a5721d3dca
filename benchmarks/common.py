"""Shared pieces of the benchmark scripts: data, plain-PyTorch baselines, clocks, tables.

The benchmarks compare hetfair with the plainest PyTorch loop that trains the
same model on the same data with the same batch size. They are meant for a
shared, noisy machine, so every measurement is repeated with the contenders
alternating, and reported as the median with its spread (min..max).

Subprocess runs (``hetfair-train`` and the plain workers) are clocked from
outside: each prints one JSON line every ``--log-interval`` updates, and the
parent notes when each line arrives and how much CPU time the process tree has
used by then. The per-update time is taken between the first line (the end of
the warm-up) and the last, so start-up, data loading and warm-up are excluded.
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

REPO_ROOT = Path(__file__).resolve().parent.parent
PLUGIN_DIR = REPO_ROOT / "plugins"
DEFAULT_DATA = Path("/usr/share/datasets/fashion-mnist")
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")

# Architectures of the MNIST plugin, as plain constructor arguments (the
# hetfair side gets the same shapes from --arch and the plugin's defaults).
PLAIN_MODELS: dict[str, dict[str, Any]] = {
    "mnist_cnn": {"conv1_channels": 32, "conv2_channels": 64, "fc_dim": 128, "dropout": 0.0},
    "mnist_cnn_small": {"conv1_channels": 16, "conv2_channels": 32, "fc_dim": 64, "dropout": 0.0},
    "mnist_mlp": {"hidden_dim": 256, "dropout": 0.0},
    # the peers' Fashion-MNIST CNN: two convolutions and dropout before the classifier
    "mnist_cnn_dropout": {"conv1_channels": 32, "conv2_channels": 64, "fc_dim": 128, "dropout": 0.5},
}


def arch_flags(model: str) -> list[str]:
    """``hetfair-train`` flags that build :data:`PLAIN_MODELS` ``[model]`` from the MNIST plugin."""
    if model == "mnist_cnn_dropout":
        return ["--arch", "mnist_cnn", "--dropout", "0.5"]
    return ["--arch", model]


# -- data and model of the plain baselines ---------------------------------------------
def import_plugin() -> Any:
    """The MNIST plugin package (``plugins/``), imported the way ``--user-dir`` does."""
    from hetfair.plugins import import_user_dir

    import_user_dir(str(PLUGIN_DIR))
    return sys.modules[PLUGIN_DIR.name]


def plain_dataset(data_dir: Path) -> Any:
    """Fashion-MNIST train images as the plugin serves them (standardised float tensors)."""
    plugin = import_plugin()
    images, labels = plugin.mnist_data.load_pair(Path(data_dir), "train")
    return plugin.mnist_data.ImageClassificationDataset(images, labels, *plugin.mnist_data.pixel_stats(images))


def data_subset(data_dir: Path, train_size: int | None, into: Path) -> Path:
    """``data_dir``, or a copy in ``into`` whose train files hold only the first ``train_size`` images.

    A smaller train set only shortens start-up (reading and converting the images
    in every process); the timed updates are the same.
    """
    if not train_size:
        return Path(data_dir)
    plugin = import_plugin()
    images, labels = plugin.mnist_data.load_pair(Path(data_dir), "train")
    if train_size >= len(images):
        return Path(data_dir)
    into.mkdir(parents=True, exist_ok=True)
    for name, array in (("train-images-idx3-ubyte", images[:train_size]), ("train-labels-idx1-ubyte", labels[:train_size])):
        header = bytes([0, 0, 0x08, array.ndim]) + b"".join(int(d).to_bytes(4, "big") for d in array.shape)
        (into / name).write_bytes(header + array.tobytes())
    for kind in ("images", "labels"):
        source = plugin.mnist_data.find_idx_file(Path(data_dir), "t10k", kind)
        link = into / source.name
        if not link.exists():
            link.symlink_to(source.resolve())
    return into


def plain_model(arch: str) -> Any:
    """The plugin's model class built directly, without hetfair's options or registries."""
    plugin = import_plugin()
    classes = {"mnist_cnn": plugin.mnist_models.MnistCNN, "mnist_cnn_small": plugin.mnist_models.MnistCNN,
               "mnist_mlp": plugin.mnist_models.MnistMLP, "mnist_cnn_dropout": plugin.mnist_models.MnistCNN}
    return classes[arch](**PLAIN_MODELS[arch])


# -- statistics and tables ---------------------------------------------------------------
@dataclass
class Samples:
    """Repeated measurements of one quantity."""

    values: list[float] = field(default_factory=list)

    def add(self, value: float) -> None:
        self.values.append(value)

    @property
    def median(self) -> float:
        return statistics.median(self.values) if self.values else float("nan")

    def spread(self, fmt: str = "{:.2f}", scale: float = 1.0) -> str:
        """``min..max`` of the values times ``scale``."""
        if not self.values:
            return "-"
        return f"{fmt.format(min(self.values) * scale)}..{fmt.format(max(self.values) * scale)}"


def ratio(a: float, b: float) -> float:
    return a / b if b else float("nan")


def print_table(title: str, header: Sequence[str], rows: Iterable[Sequence[Any]], notes: Sequence[str] = ()) -> None:
    rows = [[str(cell) for cell in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)]
    line = "  ".join("-" * w for w in widths)
    print(f"\n{title}")
    print("  ".join(h.rjust(w) if i else h.ljust(w) for i, (h, w) in enumerate(zip(header, widths))))
    print(line)
    for row in rows:
        print("  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))))
    for note in notes:
        print(f"  {note}")
    sys.stdout.flush()


def machine_note() -> str:
    import torch

    load = os.getloadavg()
    return (f"torch {torch.__version__}, {os.cpu_count()} CPUs, load average {load[0]:.1f}/{load[1]:.1f}/{load[2]:.1f}, "
            f"python {sys.version.split()[0]}")


# -- clocking subprocesses ------------------------------------------------------------
def _children() -> dict[int, list[int]]:
    tree: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        tree.setdefault(ppid, []).append(int(entry))
    return tree


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def descendants(pid: int) -> list[int]:
    """Every live process below ``pid`` (children, their children, ...), found through /proc."""
    tree = _children()
    found, todo = [], [pid]
    while todo:
        for child in tree.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def rank_pids(root: int) -> list[int]:
    """The hetfair rank processes below ``root``, in rank order (a worker names itself ``hetfair-rank<N>``)."""
    from hetfair.launch.supervisor import RANK_PROCESS_PREFIX

    ranks = {}
    for pid in descendants(root):
        try:
            name = Path(f"/proc/{pid}/comm").read_text().strip()
        except OSError:
            continue
        rank = name.removeprefix(RANK_PROCESS_PREFIX)
        if rank != name and rank.isdigit():
            ranks[int(rank)] = pid
    return [ranks[rank] for rank in sorted(ranks)]


def tree_cpu_seconds(root: int) -> float:
    """User + system CPU seconds used so far by ``root`` and all its live descendants."""
    tree = _children()
    total, stack = 0.0, [root]
    while stack:
        pid = stack.pop()
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / CLOCK_TICKS  # utime, stime
        stack.extend(tree.get(pid, []))
    return total


@dataclass
class ClockedRun:
    """Per-update times of one subprocess run, between its first and last progress line."""

    wall_per_update: float  # seconds, clocked by the parent
    cpu_per_update: float  # CPU seconds of the whole process tree
    self_reported_per_update: float  # from the run's own "ups" (intervals after the first)
    updates: int
    total_wall: float
    records: list[dict[str, Any]] = field(default_factory=list)
    """Every progress record, the first (the end of the warm-up) included."""


def clocked_run(command: Sequence[str], env: dict[str, str], timeout: float, expected_updates: int | None = None,
                cwd: Path | None = None) -> ClockedRun:
    """Run ``command``; time it between the first and last JSON ``train_inner`` line it prints.

    ``expected_updates``: the update count of the last line (checked, so that a run
    that stopped early, e.g. at an epoch limit, is not reported).
    """
    started = time.perf_counter()
    proc = subprocess.Popen(list(command), env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, bufsize=1)
    marks: list[tuple[float, float, dict[str, Any]]] = []
    output: list[str] = []
    assert proc.stdout is not None
    deadline = started + timeout
    for line in proc.stdout:
        now = time.perf_counter()
        output.append(line)
        record = _progress_record(line)
        if record is not None:
            marks.append((now, tree_cpu_seconds(proc.pid), record))
        if now > deadline:
            proc.kill()
            break
    code = proc.wait()
    total_wall = time.perf_counter() - started
    if code != 0 or len(marks) < 2:
        tail = "".join(output[-30:])
        raise RuntimeError(f"command failed (exit {code}, {len(marks)} progress lines): {' '.join(command)}\n{tail}")
    (t0, c0, r0), (t1, c1, r1) = marks[0], marks[-1]
    if expected_updates is not None and int(r1["num_updates"]) != expected_updates:
        raise RuntimeError(f"run stopped at update {r1['num_updates']}, expected {expected_updates}: {' '.join(command)}")
    updates = int(r1["num_updates"]) - int(r0["num_updates"])
    steady = [record for _, _, record in marks[1:]]  # the first interval holds the warm-up
    self_reported = statistics.mean(1.0 / float(r["ups"]) for r in steady)
    return ClockedRun((t1 - t0) / updates, (c1 - c0) / updates, self_reported, updates, total_wall,
                      [record for _, _, record in marks])


def _progress_record(line: str) -> dict[str, Any] | None:
    line = line.strip()
    if not line.startswith("{"):
        return None
    try:
        record = json.loads(line)
    except json.JSONDecodeError:
        return None
    return record if record.get("phase") == "train_inner" else None


def progress_line(num_updates: int, seconds: float, updates: int, **metrics: float) -> str:
    """The JSON line a plain worker prints, shaped like hetfair's ``--log-format json`` lines (``metrics``
    such as ``loss`` included)."""
    return json.dumps({"phase": "train_inner", "num_updates": num_updates, "ups": updates / max(seconds, 1e-9),
                       **metrics})


def subprocess_env(threads: int, pythonpath: str | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = str(threads)
    env["PYTHONUNBUFFERED"] = "1"
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    return env


@dataclass(frozen=True)
class SourceTree:
    """A hetfair source tree whose ``hetfair-train`` a benchmark runs (this one, or a copy with a fix).

    Its processes start in ``root`` with ``root`` first on PYTHONPATH, so that
    ``python -m hetfair_cli.train`` (which puts the working directory first on
    ``sys.path``) and ``--user-dir root/plugins`` both resolve inside the tree.
    """

    label: str
    root: Path

    @property
    def plugin_dir(self) -> Path:
        return self.root / "plugins"

    def env(self, threads: int) -> dict[str, str]:
        existing = os.environ.get("PYTHONPATH") if self.root == REPO_ROOT else None
        return subprocess_env(threads, os.pathsep.join([str(self.root), *([existing] if existing else [])]))

    def tag(self, name: str) -> str:
        return f"{name}[{self.label}]" if self.label else name


def source_trees(also: Sequence[str], prog: str) -> list[SourceTree]:
    """This tree, then one per ``LABEL=PATH`` of ``--also-tree``."""
    trees = [SourceTree("", REPO_ROOT)]
    for spec in also:
        label, _, path = spec.partition("=")
        root = Path(path).resolve()
        if not label or not (root / "hetfair" / "__init__.py").is_file() or not (root / "plugins").is_dir():
            raise SystemExit(f"{prog}: --also-tree {spec}: expected LABEL=PATH of a hetfair source tree with plugins/")
        trees.append(SourceTree(label, root))
    return trees

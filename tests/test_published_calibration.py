"""docs/will-it-scale.md's commands run as typed and print the page's tables; the HetSeq calibration fits its rows."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from collections import Counter

import pytest

from helpers import REPO_ROOT

sys.path.insert(0, str(REPO_ROOT))

from benchmarks import bench_published, project_cluster  # noqa: E402

PAGE = REPO_ROOT / "docs" / "will-it-scale.md"
VENV_PYTHON = REPO_ROOT / ".venv" / "bin" / "python"
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.MULTILINE | re.DOTALL)


def page_sections() -> dict[str, str]:
    """The page's ``## `` sections by heading."""
    parts = re.split(r"^## (.+)$", PAGE.read_text(encoding="utf-8"), flags=re.MULTILINE)
    return dict(zip(parts[1::2], parts[2::2]))


def commands(section: str) -> list[str]:
    return [line for language, body in FENCE.findall(section) if language == "bash"
            for line in body.splitlines() if line.strip()]


def table_lines(text: str) -> list[str]:
    """Every Markdown table line outside fenced blocks (or of a plain output: every line that starts with ``|``)."""
    return [line.rstrip() for line in FENCE.sub("", text).splitlines() if line.startswith("|")]


def run_as_typed(command: str) -> subprocess.Popen:
    """``command`` as the page shows it, with the checkout's own Python for ``python``, from the repository root."""
    words = shlex.split(command)
    assert words[0] == "python", f"the page's command must start with python: {command}"
    python = str(VENV_PYTHON) if VENV_PYTHON.exists() else sys.executable
    return subprocess.Popen([python, *words[1:]], cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


@pytest.fixture(scope="module")
def outputs() -> dict[str, tuple[str, str]]:
    """Each section's one command and its output; the commands run side by side."""
    sections = {heading: commands(body) for heading, body in page_sections().items()
                if commands(body) and commands(body)[0].startswith("python benchmarks/")}  # hetfair-plan's: elsewhere
    assert all(len(shown) == 1 for shown in sections.values()), sections
    running = {heading: (shown[0], run_as_typed(shown[0])) for heading, shown in sections.items()}
    results = {}
    for heading, (command, process) in running.items():
        out, err = process.communicate(timeout=300)
        assert process.returncode == 0, f"{command} failed:\n{err}"
        results[heading] = (command, out)
    return results


def test_the_page_shows_both_commands(outputs):
    assert [command for command, _ in outputs.values()] == [
        "python benchmarks/bench_published.py", "python benchmarks/project_cluster.py"]


@pytest.mark.parametrize("heading", ["Against published tables", "A mixed lab cluster, projected"])
def test_each_sections_tables_are_what_its_command_prints(outputs, heading):
    """The page cannot drift: its tables, line for line, are its command's output tables."""
    _command, out = outputs[heading]
    shown = table_lines(page_sections()[heading])
    assert shown, f"no table under '## {heading}'"
    assert shown == table_lines(out)


def test_the_published_sections_quoted_output_lines_are_printed(outputs):
    """The ```text block under the published tables quotes the command's own lines (calibration, verdicts)."""
    _command, out = outputs["Against published tables"]
    quoted = [body for language, body in FENCE.findall(page_sections()["Against published tables"])
              if language == "text"]
    assert quoted
    printed = set(out.splitlines())
    assert [line for line in quoted[0].splitlines() if line and line not in printed] == []


@pytest.fixture(scope="module")
def hetseq():
    cost = bench_published.bert_base_cost()
    return cost, bench_published.calibrate(cost)


@pytest.mark.parametrize("nodes", bench_published.CALIBRATION_NODES)
def test_the_calibrated_model_reproduces_the_rows_it_was_fitted_on(hetseq, nodes):
    cost, calibration = hetseq
    predicted = bench_published.step_seconds(cost, nodes, calibration.seconds_per_sample, calibration.network)
    assert predicted == pytest.approx(bench_published.HETSEQ_STEP_SECONDS[nodes], rel=0.005)


def test_the_fitted_parameters_are_physical(hetseq):
    """A fraction of the TITAN Xp's peak, and a network between 1 and 100 Gbit/s at the held latency."""
    cost, calibration = hetseq
    assert 0.05 < calibration.efficiency < 1
    assert 1e9 / 8 < calibration.network.bandwidth < 100e9 / 8
    assert calibration.network.latency == bench_published.NETWORK_LATENCY
    assert cost.parameters == pytest.approx(110e6, rel=0.01)  # BERT-base's published 110M


def test_only_the_first_two_rows_are_fitted_and_the_verdicts_follow_the_errors(hetseq):
    cost, calibration = hetseq
    rows = bench_published.hetseq_rows(cost, calibration)
    assert [row.fitted for row in rows] == [True, True, False, False, False, False]
    steps = [abs(row.error) <= bench_published.STEP_GOAL for row in rows[2:4]]
    overheads = [abs(row.error) <= bench_published.OVERHEAD_GOAL for row in rows[4:]]
    assert bench_published.goals_met(rows) == (all(steps), all(overheads))


def test_predicted_steps_grow_with_the_ring(hetseq):
    cost, calibration = hetseq
    steps = [bench_published.step_seconds(cost, n, calibration.seconds_per_sample, calibration.network)
             for n in (1, 2, 4, 8, 16)]
    assert steps == sorted(steps)


def test_the_scaled_lab_keeps_the_node_mix():
    cluster = project_cluster.scaled_lab(64)
    kinds = Counter(node.devices[0].kind for node in cluster.nodes)
    assert kinds == {"RTX3090": 22, "V100-16GB": 21, "A100-80GB": 21}
    assert cluster.world_size == 22 * 4 + 21 * 2 + 21 * 2
    assert len({node.name for node in cluster.nodes}) == 64

"""Ranks leave without running the interpreter's shutdown while torch's threads are alive.

torch keeps the gloo process group, its worker and transport threads (and rank 0's store
thread) alive after ``destroy_process_group`` once DDP used it. Interpreter finalization and
C++ static destructors running next to those threads is what killed a rank now and then with
SIGABRT ("terminate called without an active exception"), issue 12 item 7; the stress script
``benchmarks/stress_teardown.py`` counts such aborts. This test pins the precondition: a
worker's exit handlers (which run at the start of finalization) never run with those threads
alive.
"""

from __future__ import annotations

import json
import re
import subprocess
import textwrap

from helpers import TESTS_DIR, subprocess_env, train_command

PROBE = """
    import atexit, json, os, sys
    sys.path.insert(0, {tests!r})
    import toy_plugin  # noqa: F401 - registers the toy task

    def record_threads():
        names = [open(f"/proc/self/task/{{t}}/comm").read().strip() for t in os.listdir("/proc/self/task")]
        with open(os.path.join({out!r}, f"{{os.getpid()}}.json"), "w") as f:
            json.dump(names, f)

    atexit.register(record_threads)

    import gc, torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel
    destroy = dist.destroy_process_group

    def destroy_and_count_ddp(*args, **kwargs):
        alive = sum(isinstance(o, DistributedDataParallel) for o in gc.get_objects())
        with open(os.path.join({ddp_out!r}, f"{{os.getpid()}}.json"), "w") as f:
            json.dump(alive, f)
        destroy(*args, **kwargs)

    dist.destroy_process_group = destroy_and_count_ddp
"""


def test_no_rank_shuts_python_down_next_to_live_gloo_threads(tmp_path):
    probe = tmp_path / "exit_probe"
    probe.mkdir()
    out = tmp_path / "threads"
    out.mkdir()
    ddp_out = tmp_path / "ddp"
    ddp_out.mkdir()
    (probe / "__init__.py").write_text(textwrap.dedent(PROBE.format(tests=str(TESTS_DIR), out=str(out),
                                                                    ddp_out=str(ddp_out))))
    args = ["--user-dir", str(probe), "--task", "toy", "--max-update", "3", "--max-sentences", "8",
            "--save-dir", str(tmp_path / "ckpt"), "--log-format", "none", "--distributed-world-size", "2"]
    result = subprocess.run(train_command(*args), cwd=tmp_path, env=subprocess_env(), capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    at_exit = [json.loads(path.read_text()) for path in out.iterdir()]
    launcher = [names for names in at_exit if not any(n.startswith(("gloo", "pt_gloo")) for n in names)]
    assert len(launcher) == len(at_exit) <= 1, at_exit  # only the launcher (no process group) shuts down
    # a DDP reducer alive once the group is destroyed would be its last owner, whose C++ destructor joins
    # gloo's threads holding the GIL a thread freeing a finished work needs: a hang now and then
    assert [json.loads(path.read_text()) for path in ddp_out.iterdir()] == [0, 0]


def test_tests_start_their_ranks_through_the_worker_launcher_not_mp_spawn():
    """A rank started by ``torch.multiprocessing.spawn`` returns into the interpreter's shutdown next to live
    gloo threads: now and then it ended with SIGABRT after its test had passed (a CI failure of
    test_overlapped_stats). Tests run rank functions with :func:`hetfair.launch.supervisor.run_workers`, which
    leaves with ``os._exit`` like every hetfair worker."""
    spawn = re.compile(r"\b(mp|multiprocessing)\.(spawn|start_processes)\(")
    offenders = [path.name for path in TESTS_DIR.rglob("*.py")
                 if path.name != "test_teardown.py" and spawn.search(path.read_text())]
    assert not offenders, offenders

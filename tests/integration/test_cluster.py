"""A cluster simulated on the CPU (``cluster_sim``): two trainer processes that find each other through
``HYBRID_LM_*`` or SLURM variables, each with its own simulated devices; a stand-in ``scontrol``; other
"hosts" through ``HYBRID_LM_HOSTNAME``; the generated SLURM scripts run by hand.

Every set-up mistake and a failed or dead peer end every process with one line; a signal on any process
stops all of them (SIGUSR1 requeues the job once); a SLURM array task requeued, killed before its first
checkpoint, or moved to another node resumes and ends bitwise equal to an uninterrupted run. Time
limits here only detect a hang; they are not what is tested.
"""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from cluster_sim import (base_env, fake_slurm_bin, free_port, hooked, hooked_python, last_line, slurm_env, text,
                         trainer, wait_all, wait_for_step)
from conftest import TINY
from resume_check import compare_runs, write_gin

HANG = 240  # seconds before a process counts as hung


def _gin(d, steps, *extra):
    params = [p for p in TINY if "log_every" not in p] + [f"TrainConfig.steps = {steps}", "TrainConfig.log_every = 1",
                                                         *extra]
    return write_gin(d / "run.gin", params)


def _lines(path):
    return [x for x in text(path).splitlines() if x.strip() and not x.startswith("[Gloo]")]


def _pair(tmp_path, args, envs, hooks=(None, None), names=("p0", "p1")):
    procs = []
    for env, hook, name in zip(envs, hooks, names):
        procs.append(hooked(args, env, tmp_path / f"{name}.out", hook))
    return procs


def _explicit(port, pid, devices=1, **extra):
    return base_env(devices, HYBRID_LM_COORDINATOR=f"127.0.0.1:{port}", HYBRID_LM_NUM_PROCESSES=2,
                    HYBRID_LM_PROCESS_ID=pid, **extra)


# ----------------------------------------------------------------------------- start-up and device layouts

DEVICES = r"""
import sys, jax
from jax._src import xla_bridge as xb  # jax_cuda_visible_devices: the GPUs this process asks CUDA for
from hybrid_lm.train import distributed
launch = distributed.maybe_initialize()
print("DEVICES", jax.process_index(), jax.local_device_count(), jax.device_count(),
      xb.CUDA_VISIBLE_DEVICES.value, launch.local_device_ids, flush=True)
"""


def test_a_fresh_checkout_trains_two_slurm_processes_on_every_device(tmp_path):
    """Two SLURM tasks, one per "node" (--ntasks-per-node=1, 2 devices each): each drives both of its
    devices (4 in all). The data dir is empty, as in a fresh checkout: process 0 prepares the corpus once,
    the other waits for it (before, the loser failed on the prepare lock, then hung 300 s)."""
    port = free_port()
    gin = _gin(tmp_path, 4)
    envs = [base_env(2, HYBRID_LM_DATA_DIR=tmp_path / "data", JAX_COORDINATOR_PORT=port,
                     **slurm_env(900, ntasks=2, procid=i, localid=0, nodeid=i, tasks_per_node="1(x2)", gpus="0,1"))
            for i in range(2)]
    code = ("import sys, jax\nfrom jax._src import xla_bridge as xb\nfrom hybrid_lm.cli import main\nrc = main(sys.argv[1:])\n"
            "print('DEVICES', jax.process_index(), jax.local_device_count(), jax.device_count(), "
            "xb.CUDA_VISIBLE_DEVICES.value, flush=True)\nsys.exit(rc)\n")
    procs = [subprocess.Popen([sys.executable, "-c", code, "train", str(gin), "--workdir", str(tmp_path / "run")],
                              env=env, stdout=open(tmp_path / f"p{i}.out", "w"), stderr=subprocess.STDOUT)
             for i, env in enumerate(envs)]
    assert wait_all(procs, HANG) == [0, 0], text(tmp_path / "p0.out")[-3000:] + text(tmp_path / "p1.out")[-3000:]
    for i in range(2):
        assert f"DEVICES {i} 2 4 all" in text(tmp_path / f"p{i}.out")
    assert (tmp_path / "run" / "checkpoints" / "4").is_dir()
    assert sorted(p.name for p in (tmp_path / "data").iterdir() if not p.name.startswith(".")) == ["embedded"]


@pytest.mark.parametrize("layout,gpus,per_task,expect", [
    ("bound", ("0", "1"), 1, ("all", "all")),  # --gpus-per-task=1: each task sees only its own GPU
    ("shared", ("0,1", "0,1"), None, ("0", "1")),  # two unbound tasks on one node: one GPU each by SLURM_LOCALID
])
def test_two_tasks_on_one_node_get_their_own_gpus(tmp_path, layout, gpus, per_task, expect):
    port = free_port()
    envs = [base_env(1, JAX_COORDINATOR_PORT=port, **slurm_env(901, ntasks=2, procid=i, localid=i, tasks_per_node="2",
                                                               gpus=gpus[i], gpus_per_task=per_task))
            for i in range(2)]
    procs = [subprocess.Popen([sys.executable, "-c", DEVICES], env=env,
                              stdout=open(tmp_path / f"p{i}.out", "w"), stderr=subprocess.STDOUT)
             for i, env in enumerate(envs)]
    assert wait_all(procs, HANG) == [0, 0], text(tmp_path / "p0.out") + text(tmp_path / "p1.out")
    for i in range(2):
        ids = "None" if expect[i] == "all" else f"({expect[i]},)"
        assert f"DEVICES {i} 1 2 {expect[i]} {ids}" in text(tmp_path / f"p{i}.out")


# ----------------------------------------------------------------------------- set-up mistakes

def _alone(tmp_path, name, env, timeout=HANG):
    p = trainer(["train", str(_gin(tmp_path, 8)), "--workdir", str(tmp_path / "run")], env, tmp_path / f"{name}.out")
    (rc,) = wait_all([p], timeout)
    return rc, _lines(tmp_path / f"{name}.out")


@pytest.mark.parametrize("case", ["only_process_0", "only_process_1", "id_out_of_range", "count_unset",
                                  "port_in_use", "both_id_0"])
def test_a_setup_mistake_ends_every_process_in_one_line(tmp_path, case):
    """(Before: silent for 300 s, then C++ aborts, tracebacks or a segfault.) The limit for a missing
    process is HYBRID_LM_INIT_TIMEOUT_S (60 s by default; 4 s here)."""
    import socket

    port = free_port()
    quick = {"HYBRID_LM_INIT_TIMEOUT_S": 4}
    if case == "only_process_0":
        rc, lines = _alone(tmp_path, "p0", _explicit(port, 0, **quick))
        assert lines == [f"error: process 0 of 2: not all 2 processes joined at the coordinator 127.0.0.1:{port} within "
                         "4 s (HYBRID_LM_INIT_TIMEOUT_S): start 2 processes with ids 0..1 (HYBRID_LM_NUM_PROCESSES / "
                         "HYBRID_LM_PROCESS_ID), each reaching that address"]
    elif case == "only_process_1":
        rc, lines = _alone(tmp_path, "p1", _explicit(port, 1, **quick))
        assert len(lines) == 1 and lines[0].startswith(
            f"error: process 1 of 2: nothing answers at the coordinator 127.0.0.1:{port} after 4 s"), lines
    elif case == "id_out_of_range":
        rc, lines = _alone(tmp_path, "p2", _explicit(port, 2))
        assert lines == ["config error: HYBRID_LM_PROCESS_ID=2 is out of range for HYBRID_LM_NUM_PROCESSES=2: "
                         "process ids are 0..1"]
    elif case == "count_unset":
        env = _explicit(port, 1)
        del env["HYBRID_LM_NUM_PROCESSES"]
        rc, lines = _alone(tmp_path, "p1", env)
        assert len(lines) == 1 and lines[0].startswith("config error: HYBRID_LM_COORDINATOR and HYBRID_LM_PROCESS_ID "
                                                       "are set but HYBRID_LM_NUM_PROCESSES is not"), lines
    elif case == "port_in_use":
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))
            s.listen()
            rc, lines = _alone(tmp_path, "p0", _explicit(port, 0))
        assert len(lines) == 1 and lines[0].startswith(f"config error: the coordinator port {port} on ") \
            and "is already in use (HYBRID_LM_COORDINATOR=127.0.0.1:" in lines[0], lines
    else:  # both_id_0: the second finds the first's port taken; the first waits for a process 1 in vain
        first = trainer(["train", str(_gin(tmp_path, 8)), "--workdir", str(tmp_path / "run")],
                        _explicit(port, 0, **quick), tmp_path / "first.out")
        time.sleep(3)
        rc, lines = _alone(tmp_path, "second", _explicit(port, 0, **quick))
        assert len(lines) == 1 and f"the coordinator port {port} on " in lines[0], lines
        assert wait_all([first], HANG) == [2]
        assert len(_lines(tmp_path / "first.out")) == 1 and "not all 2 processes joined" in last_line(tmp_path / "first.out")
    assert rc == 2
    assert not (tmp_path / "run").exists()


# ----------------------------------------------------------------------------- a process fails

def test_an_error_on_one_process_ends_the_other_in_one_line(tmp_path):
    """A second job on a busy workdir: its process 0 refuses, and its process 1 (waiting at a barrier)
    stops at once naming process 0's error (before: a raw Gloo traceback)."""
    from hybrid_lm.lock import WorkdirLock

    port = free_port()
    (tmp_path / "run").mkdir()
    lock = WorkdirLock(tmp_path / "run").acquire()
    try:
        procs = _pair(tmp_path, ["train", str(_gin(tmp_path, 8)), "--workdir", str(tmp_path / "run")],
                      [_explicit(port, 0), _explicit(port, 1)])
        assert wait_all(procs, HANG) == [2, 2]
    finally:
        lock.release()
    (p0,), (p1,) = _lines(tmp_path / "p0.out"), _lines(tmp_path / "p1.out")
    assert p0.startswith("error: ") and "is in use by another trainer" in p0, p0
    assert p1.startswith("error: process 0 of 2 failed: ") and "is in use by another trainer" in p1 \
        and p1.endswith("stopping process 1 too. Nothing saved is lost: rerun the same command on every process to "
                        "resume from the newest checkpoint"), p1


def test_a_dead_peer_ends_the_other_process_in_one_line_and_the_rerun_resumes(tmp_path):
    port = free_port()
    args = ["train", str(_gin(tmp_path, 16)), "--workdir", str(tmp_path / "run")]
    procs = _pair(tmp_path, args, [_explicit(port, 0), _explicit(port, 1)])
    wait_for_step(tmp_path / "run", 7, procs)  # checkpoint at 5 (TINY: every 5 steps)
    procs[1].kill()
    assert wait_all(procs, HANG)[0] == 2
    assert last_line(tmp_path / "p0.out") == (
        "error: process 1 of 2 stopped without a message (killed, out of memory, or its host failed); stopping "
        f"process 0 of 2 too. Nothing saved is lost: rerun the same command on every process to resume from "
        f"{tmp_path / 'run'}'s newest checkpoint")
    assert not (tmp_path / "run" / ".lock").exists()
    port = free_port()
    procs = _pair(tmp_path, args, [_explicit(port, 0), _explicit(port, 1)], names=("q0", "q1"))
    assert wait_all(procs, HANG) == [0, 0], text(tmp_path / "q0.out")[-3000:]
    assert "resumed from step" in text(tmp_path / "q0.out")


def test_when_process_0_dies_the_other_ends_at_once_in_one_line(tmp_path):
    """Process 0 hosts JAX's coordination service: when it dies, XLA aborts the others from C++; their
    stderr relay (hybrid_lm/train/coordinator_loss.py) replaces XLA's fatal message with one line."""
    port = free_port()
    procs = _pair(tmp_path, ["train", str(_gin(tmp_path, 16)), "--workdir", str(tmp_path / "run")],
                  [_explicit(port, 0), _explicit(port, 1)])
    wait_for_step(tmp_path / "run", 3, procs)
    procs[0].kill()
    assert wait_all(procs, 60)[1] != 0
    deadline = time.monotonic() + 10  # the relay writes its line as the process aborts
    while "error: lost process 0" not in text(tmp_path / "p1.out") and time.monotonic() < deadline:
        time.sleep(0.1)
    out = text(tmp_path / "p1.out")
    assert "leader task" not in out and "Check failure stack trace" not in out, out[-3000:]
    assert last_line(tmp_path / "p1.out") == (
        f"error: lost process 0 of 2 (the coordinator, 127.0.0.1:{port}): it stopped (killed, out of memory, or its "
        "host failed) or its network did; stopping process 1 of 2 too. Nothing saved is lost: rerun the same command "
        "on every process to resume from the newest checkpoint")


# ----------------------------------------------------------------------------- signals on one process

def test_sigterm_during_start_up_on_one_process_stops_both(tmp_path):
    """(Before: JAX's own SIGTERM notifier swallowed it and every step trained.)"""
    port = free_port()
    procs = _pair(tmp_path, ["train", str(_gin(tmp_path, 16)), "--workdir", str(tmp_path / "run")],
                  [_explicit(port, 0), _explicit(port, 1)],
                  hooks=(None, {"where": "restore", "signals": [signal.SIGTERM]}))
    assert wait_all(procs, HANG) == [0, 0], text(tmp_path / "p0.out")[-2000:] + text(tmp_path / "p1.out")[-2000:]
    for name in ("p0", "p1"):
        assert last_line(tmp_path / f"{name}.out").startswith("SIGTERM before training started: nothing new to save")
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_usr1_on_a_non_zero_process_saves_both_and_requeues_the_array_task_once(tmp_path):
    """(Before: process 1's SIGUSR1 saved and stopped the run but nobody requeued it.) The stand-in
    scontrol then sends SIGTERM to both processes, as a requeue of a running job does."""
    port = free_port()
    bin_dir, calls = fake_slurm_bin(tmp_path / "bin")
    pids = tmp_path / "pids"
    envs = [base_env(1, JAX_COORDINATOR_PORT=port, PATH=f"{bin_dir}:{os.environ['PATH']}", FAKE_SCONTROL_LOG=calls,
                     FAKE_SLURM_PIDS=pids, **slurm_env(700, array_task=0, ntasks=2, procid=i, localid=i,
                                                      tasks_per_node="2"))
            for i in range(2)]
    procs = _pair(tmp_path, ["train", str(_gin(tmp_path, 16)), "--workdir", str(tmp_path / "run")], envs,
                  hooks=(None, {"where": "row", "at": 3, "signals": [signal.SIGUSR1]}))
    pids.write_text("".join(f"{p.pid}\n" for p in procs))
    assert wait_all(procs, HANG) == [0, 0], text(tmp_path / "p0.out")[-2000:] + text(tmp_path / "p1.out")[-2000:]
    assert calls.read_text() == "requeue 700_0\n"
    p0, p1 = last_line(tmp_path / "p0.out"), last_line(tmp_path / "p1.out")
    assert p0.startswith("SIGUSR1: saved a checkpoint at step ") and p0.endswith("; requeued SLURM job 700_0"), p0
    assert p1 == p0.rsplit("; requeued", 1)[0]
    step = int(p0.split("at step ")[1].split()[0])
    assert (tmp_path / "run" / "checkpoints" / str(step)).is_dir() and not (tmp_path / "run" / ".lock").exists()


# ----------------------------------------------------------------------------- a SLURM array task, by hand

def test_an_array_task_killed_requeued_and_moved_resumes_bitwise(tmp_path):
    """The phase-1 script of the tiny sweep, run by hand as SLURM would run array task 0 four times:
    killed before its first checkpoint on node1 (its lock left behind); rerun on node2, which takes the
    lock over, archives the rows and trains from step 0, and gets SIGUSR1 between two segments; rerun on
    node3, SIGUSR1 during a segment; rerun to the end. Each SIGUSR1 requeues only task 0 of the array.
    The stable run ends bitwise equal to the same task run without interruption."""
    from hybrid_lm.scaling import launch as L
    from hybrid_lm.scaling.sweep import expand, load_spec
    from hybrid_lm.config import CONFIGS_DIR

    spec = load_spec(CONFIGS_DIR / "sweeps" / "tiny_cpu.toml")
    bin_dir, calls = fake_slurm_bin(tmp_path / "bin")
    python = hooked_python(tmp_path / "python")
    outs = []

    def task(root, hook=None, restart=0, host="node1"):
        env = base_env(1, PATH=f"{bin_dir}:{os.environ['PATH']}", FAKE_SCONTROL_LOG=calls, HYBRID_LM_HOSTNAME=host,
                       **slurm_env(800, array_task=0, restart=restart))
        if hook:
            env["HOOK"] = json.dumps(hook)
        r = subprocess.run(["bash", str(root / "slurm" / "phase1.sbatch")], env=env, capture_output=True, text=True,
                           timeout=HANG)
        outs.append(r.stdout + r.stderr)
        return r.returncode

    for root in (tmp_path / "straight", tmp_path / "root"):
        L.write_slurm(expand(spec, root=root), only="t1-swa8", submit=False, python=str(python))
    stable = (tmp_path / "root" / "slurm" / "phase1.txt").read_text().split()[0]
    assert "-stable-" in stable
    assert task(tmp_path / "straight") == 0

    run = tmp_path / "root" / stable
    assert task(tmp_path / "root", {"where": "row", "at": 3, "signals": [signal.SIGKILL]}) == -signal.SIGKILL
    assert (run / ".lock").exists() and not any((run / "checkpoints").glob("[0-9]*"))
    assert task(tmp_path / "root", {"where": "seed", "signals": [signal.SIGUSR1]}, restart=1, host="node2") == 3
    assert "taking over the stale lock" in outs[-1] and "which SLURM ended before this run" in outs[-1]
    assert "no checkpoint was committed before the run" in outs[-1]
    assert "requeued SLURM job 800_0" in outs[-1]
    assert task(tmp_path / "root", {"where": "row", "at": 10, "signals": [signal.SIGUSR1]}, restart=2,
                host="node3") == 3
    assert "requeued SLURM job 800_0" in outs[-1]
    assert task(tmp_path / "root", restart=3, host="node3") == 0
    assert calls.read_text() == "requeue 800_0\nrequeue 800_0\n"
    assert all(f"task 800_0: {stable} on " in out for out in outs)
    cmp = compare_runs(tmp_path / "straight" / stable, run)
    assert cmp["loss_equal"] and cmp["state_equal"], cmp


def test_the_sweep_worker_reports_a_failed_job_in_one_line(tmp_path, capsys):
    """(Before: the worker caught only SweepError; any other error printed a traceback.)"""
    from hybrid_lm.config import CONFIGS_DIR
    from hybrid_lm.scaling import launch as L
    from hybrid_lm.scaling.sweep import expand, load_spec, write_manifest
    from hybrid_lm.lock import WorkdirLock

    plan = expand(load_spec(CONFIGS_DIR / "sweeps" / "tiny_cpu.toml"), root=tmp_path)
    write_manifest(plan)
    job = next(j for j in plan.jobs if j.kind == "stable")
    lock = WorkdirLock(tmp_path / job.name).acquire()  # another trainer holds the run
    try:
        rc = L.main(["--root", str(tmp_path), "--job", job.name])
    finally:
        lock.release()
    err = capsys.readouterr().err.strip()
    assert rc == 1 and err.startswith(f"error: job {job.name}: ") and "in use by another trainer" in err, err
    assert "\n" not in err

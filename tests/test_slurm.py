"""SLURM and multi-process start-up without training: which devices each process drives in each layout
(against JAX 0.11's own SLURM detection), the set-up mistakes named in one line, the requeue target, the
workdir lock across nodes, and the generated sweep scripts run by hand with a stand-in scontrol."""

import json
import os
import subprocess
import time
from pathlib import Path

import pytest

from cluster_sim import fake_slurm_bin, slurm_env
from hybrid_lm.errors import ConfigError, WorkdirError
from hybrid_lm.train import distributed as D
from hybrid_lm import signals
from hybrid_lm.lock import WorkdirLock

REPO = Path(__file__).resolve().parents[1]


def _jax_slurm_detection(env, monkeypatch):
    """What ``jax.distributed.initialize()`` would use on its own: JAX's SLURM cluster detection."""
    from jax._src.clusters import ClusterEnv

    for k in [k for k in os.environ if k.startswith("SLURM_") or k == "CUDA_VISIBLE_DEVICES"]:
        monkeypatch.delenv(k)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    return ClusterEnv.auto_detect_unset_distributed_params(None, None, None, None, None, None)


def test_one_process_per_node_drives_every_gpu_of_its_node(monkeypatch):
    """--ntasks-per-node=1 --gpus-per-node=8 on 2 nodes: JAX alone gives the process [SLURM_LOCALID] = GPU 0
    only; here it drives all 8."""
    env = slurm_env(900, ntasks=2, procid=1, localid=0, nodeid=1, tasks_per_node="1(x2)",
                    nodelist="gpu[001-002]", gpus="0,1,2,3,4,5,6,7")
    assert _jax_slurm_detection(env, monkeypatch) == ("gpu001:62340", 2, 1, [0])
    launch = D.resolve(env)
    assert (launch.coordinator, launch.num_processes, launch.process_id) == ("gpu001:62340", 2, 1)
    assert launch.local_device_ids is None and "every GPU" in launch.layout


@pytest.mark.parametrize("per_task", [1, 2])
def test_one_process_per_gpu_bound_by_slurm_drives_its_own_gpus(monkeypatch, per_task):
    """--ntasks-per-node=8/per_task --gpus-per-task=per_task: SLURM leaves each task only its own GPUs
    (ordinals from 0), JAX alone asks for ordinal SLURM_LOCALID (CUDA_ERROR_INVALID_DEVICE on a GPU)."""
    mine = ",".join(str(3 * per_task + i) for i in range(per_task))  # task 3's GPUs, as SLURM names them
    env = slurm_env(900, ntasks=8 // per_task, procid=3, localid=3, tasks_per_node=str(8 // per_task),
                    gpus=mine, gpus_per_task=per_task)
    assert _jax_slurm_detection(env, monkeypatch)[3] == [3]
    launch = D.resolve(env)
    assert launch.local_device_ids is None and "bound" in launch.layout


def test_unbound_processes_share_the_nodes_gpus_by_local_id():
    env = slurm_env(900, ntasks=16, procid=11, localid=3, nodeid=1, tasks_per_node="8(x2)", gpus="0,1,2,3,4,5,6,7")
    assert D.resolve(env).local_device_ids == (3,)
    env = slurm_env(900, ntasks=4, procid=3, localid=1, nodeid=1, tasks_per_node="2(x2)", gpus="0,1,2,3,4,5,6,7")
    assert D.resolve(env).local_device_ids == (4, 5, 6, 7)
    with pytest.raises(ConfigError, match=r"3 tasks on this node share 8 visible GPUs \(CUDA_VISIBLE_DEVICES="):
        D.resolve(slurm_env(900, ntasks=3, procid=1, localid=1, tasks_per_node="3", gpus="0,1,2,3,4,5,6,7"))
    env = slurm_env(900, ntasks=2, procid=1, localid=1, tasks_per_node="2", gpus="0,1")
    env["HYBRID_LM_LOCAL_DEVICE_IDS"] = "0,1"
    assert D.resolve(env).local_device_ids == (0, 1)


@pytest.mark.parametrize("nodes", ["node001", "node001,host2", "node[001-0015],host2", "node[001,007-015],host2"])
def test_the_coordinator_is_the_one_jax_picks(monkeypatch, nodes):
    env = slurm_env(123457, ntasks=2, nodelist=nodes)
    assert D.resolve(env).coordinator == _jax_slurm_detection(env, monkeypatch)[0] == "node001:62017"
    env["JAX_COORDINATOR_PORT"] = "12345"
    assert D.resolve(env).coordinator == "node001:12345"


def test_single_task_and_batch_shell_are_not_multi_process():
    assert D.resolve({}) is None
    assert D.resolve(slurm_env(5, ntasks=1)) is None
    with pytest.raises(ConfigError, match=r"SLURM_NTASKS=4 but this process is not a task of a job step .*srun"):
        D.resolve(slurm_env(5, ntasks=4, step=False))  # python run by the batch script of --ntasks=4


@pytest.mark.parametrize("env,match", [
    ({"HYBRID_LM_COORDINATOR": "h:1", "HYBRID_LM_PROCESS_ID": "1"},
     r"^HYBRID_LM_COORDINATOR and HYBRID_LM_PROCESS_ID are set but HYBRID_LM_NUM_PROCESSES is not"),
    ({"HYBRID_LM_COORDINATOR": "h:1", "HYBRID_LM_NUM_PROCESSES": "2", "HYBRID_LM_PROCESS_ID": "2"},
     r"^HYBRID_LM_PROCESS_ID=2 is out of range for HYBRID_LM_NUM_PROCESSES=2: process ids are 0..1"),
    ({"HYBRID_LM_COORDINATOR": "h", "HYBRID_LM_NUM_PROCESSES": "2", "HYBRID_LM_PROCESS_ID": "0"},
     r"^HYBRID_LM_COORDINATOR='h' must be host:port"),
    ({"HYBRID_LM_COORDINATOR": "h:1", "HYBRID_LM_NUM_PROCESSES": "two", "HYBRID_LM_PROCESS_ID": "0"},
     r"^HYBRID_LM_NUM_PROCESSES='two' is not an integer"),
    ({"HYBRID_LM_COORDINATOR": "h:1", "HYBRID_LM_NUM_PROCESSES": "2", "HYBRID_LM_PROCESS_ID": "0",
      "HYBRID_LM_LOCAL_DEVICE_IDS": "0,x"}, r"^HYBRID_LM_LOCAL_DEVICE_IDS='0,x' is not a comma-separated list"),
])
def test_setup_mistakes_name_the_variable(env, match):
    with pytest.raises(ConfigError, match=match) as e:
        D.resolve(env)
    assert "\n" not in str(e.value)


def test_process_0_checks_the_coordinator_host_and_port():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        launch = D.Launch(f"127.0.0.1:{port}", 2, 0, None, "HYBRID_LM_*", "")
        with pytest.raises(ConfigError, match=f"the coordinator port {port} on .* is already in use"):
            D.check_coordinator(launch)
    D.check_coordinator(launch)  # free again
    with pytest.raises(ConfigError, match="names 192.0.2.1, which is not this machine"):
        D.check_coordinator(D.Launch("192.0.2.1:1234", 2, 0, None, "HYBRID_LM_*", ""))


def test_the_requeue_names_the_array_task_only(tmp_path, monkeypatch):
    assert signals.slurm_job(slurm_env(700, array_task=0)) == "700_0"  # SLURM_JOB_ID == SLURM_ARRAY_JOB_ID here
    assert signals.slurm_job(slurm_env(700, array_task=3)) == "700_3"
    assert signals.slurm_job(slurm_env(700)) == "700"
    assert signals.slurm_job({}) is None
    bin_dir, calls = fake_slurm_bin(tmp_path)
    pids = tmp_path / "pids"
    pids.write_text("")  # nobody to signal
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_SCONTROL_LOG", str(calls))
    monkeypatch.setenv("FAKE_SLURM_PIDS", str(pids))
    for k, v in slurm_env(700, array_task=3).items():
        monkeypatch.setenv(k, v)
    assert signals.requeue() == "requeued SLURM job 700_3" and calls.read_text() == "requeue 700_3\n"
    (bin_dir / "scontrol").write_text("#!/bin/bash\necho 'Requested operation is presently disabled' >&2\nexit 1\n")
    assert signals.requeue() == ("could not requeue SLURM job 700_3: scontrol exited 1 (Requested operation is "
                                 "presently disabled)")


def _lock_record(path, **fields):
    path.write_text(json.dumps({"host": "node1", "pid": 4242, "started": time.time(), "started_utc": "then",
                                "token": "x", **fields}))


def test_a_requeued_task_takes_over_its_own_lock_on_another_node(tmp_path, monkeypatch, caplog):
    """The lock of this array task's earlier run (lower SLURM_RESTART_COUNT) is stale wherever it was taken;
    another task's, or this run's own, is not."""
    for k, v in slurm_env(700, array_task=3, restart=1).items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("HYBRID_LM_HOSTNAME", "node2")
    _lock_record(tmp_path / ".lock", slurm_job="700_2", slurm_restart=0)  # another task of the array
    with pytest.raises(WorkdirError, match=r"in use by another trainer \(host node1 pid 4242, SLURM job 700_2 since"):
        WorkdirLock(tmp_path).acquire()
    _lock_record(tmp_path / ".lock", slurm_job="700_3", slurm_restart=1)  # this very run (restart 1) elsewhere
    with pytest.raises(WorkdirError, match="in use by another trainer"):
        WorkdirLock(tmp_path).acquire()
    _lock_record(tmp_path / ".lock", slurm_job="700_3", slurm_restart=0)  # its run before the requeue
    lock = WorkdirLock(tmp_path).acquire()
    assert "it was taken by run 0 of SLURM job 700_3, which SLURM ended before this run" in caplog.text
    assert json.loads((tmp_path / ".lock").read_text())["host"] == "node2"
    lock.release()
    monkeypatch.setenv("SLURM_JOB_START_TIME", str(int(time.time())))  # without a restart count
    monkeypatch.setenv("SLURM_RESTART_COUNT", "0")
    _lock_record(tmp_path / ".lock", slurm_job="700_3", slurm_restart=0, started=time.time() - 600)
    WorkdirLock(tmp_path).acquire().release()
    assert not (tmp_path / ".lock").exists()


# ----------------------------------------------------------------------------- the generated scripts, by hand

STUB_PYTHON = """#!/bin/bash
echo "worker $*"
"""


def _plan(root, only=None):
    from hybrid_lm.scaling.sweep import expand, load_spec

    return expand(load_spec(REPO / "configs" / "sweeps" / "tiny_cpu.toml"), root=root)


def _run_script(script: Path, task: int, env_extra=None) -> str:
    env = {**os.environ, **slurm_env(800, array_task=task), **(env_extra or {})}
    r = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return r.stdout


def test_submitted_scripts_keep_their_runs_when_regenerated(tmp_path):
    """sbatch keeps the script it was given; every task's run name is in that script, so regenerating the
    scripts (another --only: other lists, other indices) leaves submitted tasks running their own runs.
    Logs are appended (a requeued task keeps every segment's lines); each branch array waits for its own
    stable run's task."""
    from hybrid_lm.scaling import launch as L

    stub = tmp_path / "python"
    stub.write_text(STUB_PYTHON)
    stub.chmod(0o755)
    spool = tmp_path / "spool"  # what SLURM stored at submission
    spool.mkdir()
    plan = _plan(tmp_path / "root")
    L.write_slurm(plan, submit=False, python=str(stub))
    sd = tmp_path / "root" / "slurm"
    for f in sd.glob("*.sbatch"):
        (spool / f.name).write_text(f.read_text())
    phase1 = (sd / "phase1.txt").read_text().split()
    branches0 = [j.name for j in plan.jobs if j.kind == "branch" and j.branch_from["run"] == phase1[0]]
    script = (spool / "phase1.sbatch").read_text()
    assert "#SBATCH --open-mode=append" in script and "#SBATCH --output=" in script and "%A_%a.out" in script
    submit = (sd / "submit.sh").read_text()
    assert "sbatch --parsable --dependency=afterany:${P1}_0 branches-0.sbatch" in submit
    # regenerate for other jobs: the lists and the scripts change
    L.write_slurm(plan, only="t2-", submit=False, python=str(stub))
    assert (sd / "phase1.txt").read_text().split() != phase1
    for task, name in enumerate(phase1):
        out = _run_script(spool / "phase1.sbatch", task)
        assert f"task 800_{task}: {name} on " in out and out.rstrip().endswith(f"--job {name}")
    out = _run_script(spool / "branches-0.sbatch", 1, {"SLURM_RESTART_COUNT": "2"})
    assert "(restart 2)" in out and out.rstrip().endswith(f"--job {branches0[1]}")


@pytest.mark.parametrize("key, value", [
    ("partition", "gpu\ntouch /tmp/injected"), ("account", "acct;id"), ("qos", "$(id)"), ("time", "1:00 --wrap=id"),
    ("mem", "`id`"), ("gpus_per_task", "1\nid"), ("cpus_per_task", "four"), ("max_parallel", "2\nid"),
    ("signal_seconds", "120\nid"), ("sbatch", ["--constraint=h100\ntouch /tmp/injected"]), ("sbatch", "--exclusive"),
    ("setup", "source .venv/bin/activate"), ("python", "python\nid"),
])
def test_an_injected_slurm_field_is_refused_before_any_script_is_written(tmp_path, key, value):
    """Every value interpolated into a generated sbatch script is checked (``setup`` lines are verbatim by
    design, but must be a list of lines): a newline, a shell character or a space is one line naming the key."""
    import dataclasses

    from hybrid_lm.scaling import launch as L
    from hybrid_lm.scaling.sweep import SweepError

    plan = _plan(tmp_path / "root")
    plan = dataclasses.replace(plan, spec=dataclasses.replace(plan.spec, slurm={key: value}))
    with pytest.raises(SweepError, match=f"slurm.{key}") as e:
        L.write_slurm(plan, submit=False)
    assert "\n" not in str(e.value)
    assert not (tmp_path / "root" / "slurm").exists() and not (tmp_path / "root" / "sweep.json").exists()


def test_valid_slurm_fields_become_their_sbatch_lines(tmp_path):
    import dataclasses

    from hybrid_lm.scaling import launch as L

    slurm = {"partition": "gpu,gpu-long", "account": "proj_x-1", "qos": "high", "time": "1-12:00:00", "mem": "64G",
             "gpus_per_task": "h100:1", "cpus_per_task": 8, "max_parallel": 2, "signal_seconds": 300,
             "sbatch": ["--constraint=h100|h200", "--exclusive"], "setup": ["module load cuda/12 && echo 'set up'"]}
    plan = _plan(tmp_path / "root")
    plan = dataclasses.replace(plan, spec=dataclasses.replace(plan.spec, slurm=slurm))
    L.write_slurm(plan, submit=False, python="/opt/py 3/bin/python")
    script = (tmp_path / "root" / "slurm" / "phase1.sbatch").read_text()
    for line in ("#SBATCH --partition=gpu,gpu-long", "#SBATCH --account=proj_x-1", "#SBATCH --qos=high",
                 "#SBATCH --time=1-12:00:00", "#SBATCH --mem=64G", "#SBATCH --gpus-per-task=h100:1",
                 "#SBATCH --cpus-per-task=8", "#SBATCH --signal=B:USR1@300", "#SBATCH --constraint=h100|h200",
                 "#SBATCH --exclusive", "module load cuda/12 && echo 'set up'", "exec '/opt/py 3/bin/python' -m"):
        assert line in script.splitlines() or script.count(line) == 1, line
    assert "%2" in script

"""Multi-process start-up, the layout of processes over GPUs, and what happens when a process fails.

Where the processes come from (``docs/CLUSTERS.md``):

- ``HYBRID_LM_COORDINATOR=host:port``, ``HYBRID_LM_NUM_PROCESSES``, ``HYBRID_LM_PROCESS_ID`` (all three, or
  none; ``HYBRID_LM_LOCAL_DEVICE_IDS=0,1`` optionally picks this process's GPUs), else
- SLURM: a job step started by ``srun`` with more than one task (``SLURM_NTASKS``, ``SLURM_PROCID``,
  ``SLURM_LOCALID``, ``SLURM_STEP_NODELIST``; the coordinator is JAX's choice, the first node of the step
  on port ``61440 + SLURM_JOB_ID % 4096``, or ``JAX_COORDINATOR_PORT``). Each process drives the GPUs it is
  given: one process per node drives every GPU it sees; one process per GPU bound with
  ``--gpus-per-task`` / ``--gpu-bind`` drives its one visible GPU; several unbound processes on a node
  split the node's visible GPUs evenly by ``SLURM_LOCALID`` (:func:`slurm_local_devices`).

Every setup mistake ends the process in one line naming the variable or the port. Process 0 checks that
the coordinator address is its own host and that the port is free before starting the service; every
process gives up after ``HYBRID_LM_INIT_TIMEOUT_S`` (default 60) when not all processes join, saying
whether the coordinator could be reached.

During the run each process publishes a pulse and, when it fails, a one-line message in JAX's
key-value store; a thread in every process watches them, so a failure on one process (an error, or a
process that died: no pulse for ``HYBRID_LM_PEER_TIMEOUT_S``, default 30 s, or a collective that broke)
ends every process within seconds, each with one line naming the process that failed. Those exits skip
JAX's shutdown barrier (which would wait minutes for the processes that are gone, then abort).
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import logging
import os
import re
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass

import jax
from jax._src import distributed as jd
from jax.experimental import multihost_utils

from hybrid_lm.errors import ConfigError, DataError, WorkdirError
from hybrid_lm.train import coordinator_loss
from hybrid_lm import signals
from hybrid_lm.signals import PreemptionFlag  # noqa: F401  (the flag's old home)

log = logging.getLogger(__name__)

_KV = "hybrid_lm"
PULSE_S = 0.5


class ClusterError(RuntimeError):
    """A multi-process set-up mistake or a failed process, in one line."""


def init_timeout_s() -> float:
    return float(os.environ.get("HYBRID_LM_INIT_TIMEOUT_S", "60"))


def peer_timeout_s() -> float:
    return float(os.environ.get("HYBRID_LM_PEER_TIMEOUT_S", "30"))


# ----------------------------------------------------------------------------- where the processes come from

@dataclass(frozen=True)
class Launch:
    """One process's place in a multi-process run."""
    coordinator: str  # host:port of process 0's coordination service
    num_processes: int
    process_id: int
    local_device_ids: tuple[int, ...] | None  # None: every device this process sees
    source: str  # "HYBRID_LM_*" or "SLURM"
    layout: str  # how this process's devices were chosen, in words

    @property
    def who(self) -> str:
        return f"process {self.process_id} of {self.num_processes}"


_EXPLICIT = ("HYBRID_LM_COORDINATOR", "HYBRID_LM_NUM_PROCESSES", "HYBRID_LM_PROCESS_ID")


def _int(env, name: str, low: int = 0) -> int:
    raw = env.get(name)
    try:
        value = int(str(raw).strip())
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not an integer") from None
    if value < low:
        raise ConfigError(f"{name}={value} must be >= {low}")
    return value


def _device_list(env, name: str) -> tuple[int, ...]:
    raw = env.get(name, "")
    try:
        ids = tuple(int(x) for x in raw.split(",") if x.strip() != "")
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not a comma-separated list of device ordinals") from None
    if not ids or min(ids) < 0 or len(set(ids)) != len(ids):
        raise ConfigError(f"{name}={raw!r} must list distinct device ordinals >= 0")
    return ids


def resolve(env=None) -> Launch | None:
    """This process's :class:`Launch` from the environment, or None for a single-process run. Raises
    ``ConfigError`` naming the variable for a set-up mistake."""
    env = os.environ if env is None else env
    given = [n for n in _EXPLICIT if env.get(n, "").strip()]
    if given:
        return _explicit(env, given)
    if env.get("SLURM_JOB_ID"):
        return _slurm(env)
    return None


def _explicit(env, given: list[str]) -> Launch:
    missing = [n for n in _EXPLICIT if n not in given]
    if missing:
        raise ConfigError(f"{' and '.join(given)} {'is' if len(given) == 1 else 'are'} set but {' and '.join(missing)} "
                          f"{'is' if len(missing) == 1 else 'are'} not: a multi-process run needs all of "
                          f"{', '.join(_EXPLICIT)} (or none of them for one process)")
    coord = env["HYBRID_LM_COORDINATOR"].strip()
    host, _, port = coord.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"HYBRID_LM_COORDINATOR={coord!r} must be host:port (e.g. node001:12345)")
    n = _int(env, "HYBRID_LM_NUM_PROCESSES", low=1)
    pid = _int(env, "HYBRID_LM_PROCESS_ID")
    if pid >= n:
        raise ConfigError(f"HYBRID_LM_PROCESS_ID={pid} is out of range for HYBRID_LM_NUM_PROCESSES={n}: process ids "
                          f"are 0..{n - 1}")
    ids, layout = None, "every device this process sees"
    if env.get("HYBRID_LM_LOCAL_DEVICE_IDS", "").strip():
        ids = _device_list(env, "HYBRID_LM_LOCAL_DEVICE_IDS")
        layout = f"devices {','.join(map(str, ids))} (HYBRID_LM_LOCAL_DEVICE_IDS)"
    return Launch(coord, n, pid, ids, "HYBRID_LM_*", layout)


def _slurm(env) -> Launch | None:
    n = _int(env, "SLURM_NTASKS", low=1) if env.get("SLURM_NTASKS") else 1
    if n == 1:
        return None
    if not env.get("SLURM_STEP_NODELIST") or not env.get("SLURM_STEP_ID"):
        raise ConfigError(f"SLURM_NTASKS={n} but this process is not a task of a job step (SLURM_STEP_ID / "
                          "SLURM_STEP_NODELIST unset): start the processes with `srun ... hybrid-lm train ...`, "
                          "or ask for --ntasks=1 to train in one process")
    for name in ("SLURM_PROCID", "SLURM_LOCALID"):
        if not env.get(name, "").strip():
            raise ConfigError(f"SLURM_NTASKS={n} but {name} is unset: start the processes with srun")
    pid = _int(env, "SLURM_PROCID")
    if pid >= n:
        raise ConfigError(f"SLURM_PROCID={pid} is out of range for SLURM_NTASKS={n}")
    ids, layout = slurm_local_devices(env)
    return Launch(slurm_coordinator(env), n, pid, ids, "SLURM", layout)


def slurm_coordinator(env) -> str:
    """The coordinator JAX's own SLURM detection picks (``jax/_src/clusters/slurm_cluster.py``): the first
    host of ``SLURM_STEP_NODELIST`` (``node[001-004],gpu7`` -> ``node001``), port ``JAX_COORDINATOR_PORT`` or
    ``61440 + SLURM_JOB_ID % 4096``; computed from the mapping ``env`` (JAX reads ``os.environ``)."""
    port = env.get("JAX_COORDINATOR_PORT") or str(int(env["SLURM_JOB_ID"]) % 2 ** 12 + (65535 - 2 ** 12 + 1))
    nodes = env["SLURM_STEP_NODELIST"]
    m = re.match(r"([^,\[]*)(?:\[([^,\-\]]*))?", nodes)
    return f"{m.group(1)}{m.group(2) or ''}:{port}"


def tasks_on_node(env) -> int | None:
    """How many tasks of this step run on this node: ``SLURM_STEP_TASKS_PER_NODE`` (e.g. ``4(x2),1``) at
    ``SLURM_NODEID``, else ``SLURM_NTASKS_PER_NODE``; None when unknown."""
    spec = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE")
    node = env.get("SLURM_NODEID")
    if spec and node is not None and node.strip().isdigit():
        counts = []
        for part in spec.split(","):
            m = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
            if not m:
                counts = []
                break
            counts += [int(m.group(1))] * int(m.group(2) or 1)
        if int(node) < len(counts):
            return counts[int(node)]
    per_node = env.get("SLURM_NTASKS_PER_NODE", "").strip()
    return int(per_node) if per_node.isdigit() else None


def slurm_local_devices(env) -> tuple[tuple[int, ...] | None, str]:
    """``(local device ids or None for all visible, the layout in words)`` of a SLURM task.

    JAX's own SLURM detection gives each process the one device ``[SLURM_LOCALID]``: one process per
    node then drives one GPU of eight, and a task bound to its GPU (``--gpus-per-task=1``, whose only
    visible device is ordinal 0) asks for an ordinal it does not have. Here: one task on the node ->
    every visible GPU; a task whose visible GPUs are its own (one visible GPU, or exactly
    ``SLURM_GPUS_PER_TASK``) -> all of them; several tasks sharing the node's visible GPUs -> an even
    share by ``SLURM_LOCALID``; ``HYBRID_LM_LOCAL_DEVICE_IDS`` overrides."""
    if env.get("HYBRID_LM_LOCAL_DEVICE_IDS", "").strip():
        ids = _device_list(env, "HYBRID_LM_LOCAL_DEVICE_IDS")
        return ids, f"devices {','.join(map(str, ids))} (HYBRID_LM_LOCAL_DEVICE_IDS)"
    local = _int(env, "SLURM_LOCALID")
    tasks = tasks_on_node(env)
    raw = env.get("CUDA_VISIBLE_DEVICES")
    visible = [x for x in raw.split(",") if x.strip()] if raw is not None else None
    if tasks == 1:
        return None, "one task on this node: every GPU it sees"
    per_task = env.get("SLURM_GPUS_PER_TASK", "").strip()
    if visible is not None and (len(visible) == 1 or (per_task.isdigit() and len(visible) == int(per_task))):
        return None, f"a task bound to its GPU(s) (CUDA_VISIBLE_DEVICES={raw}): all of them"
    if visible is not None and tasks:
        if len(visible) % tasks:
            raise ConfigError(f"{tasks} tasks on this node share {len(visible)} visible GPUs (CUDA_VISIBLE_DEVICES={raw}), "
                              "which do not split evenly: use --gpus-per-task (each task bound to its GPUs), "
                              "--ntasks-per-node=1, or set HYBRID_LM_LOCAL_DEVICE_IDS")
        k = len(visible) // tasks
        if local >= tasks:
            raise ConfigError(f"SLURM_LOCALID={local} is out of range for {tasks} tasks on this node")
        ids = tuple(range(local * k, local * k + k))
        return ids, f"{tasks} tasks sharing {len(visible)} visible GPUs: ordinals {','.join(map(str, ids))} by SLURM_LOCALID"
    if visible is None and (tasks or 0) > 1 and jax.config.jax_platforms not in ("cpu",) \
            and os.environ.get("JAX_PLATFORMS") != "cpu":
        return (local,), f"device {local} (SLURM_LOCALID; CUDA_VISIBLE_DEVICES is unset)"
    return None, "every device this process sees"


# ----------------------------------------------------------------------------- start-up

class _State:
    lock = threading.Lock()
    launch: Launch | None = None
    watchdog: _Watchdog | None = None
    failing: bool = False  # this process failed or saw a peer fail: it leaves without JAX's shutdown barrier
    dead: set = set()  # processes found dead: no acknowledgement to wait for
    exiting: bool = False


_STATE = _State()


def launch() -> Launch | None:
    return _STATE.launch


def check_coordinator(launch: Launch) -> None:
    """Process 0 hosts the coordinator: its host must be this machine and its port free (JAX segfaults
    on a port in use)."""
    host, _, port = launch.coordinator.rpartition(":")
    var = "HYBRID_LM_COORDINATOR" if launch.source != "SLURM" else "the first node of SLURM_STEP_NODELIST"
    try:
        infos = socket.getaddrinfo(host.strip("[]"), None, proto=socket.IPPROTO_TCP)
    except socket.gaierror as e:
        raise ConfigError(f"the coordinator host {host!r} ({var}) does not resolve: {e.strerror}") from None
    local = False
    for family, _, _, _, addr in infos:
        with contextlib.closing(socket.socket(family, socket.SOCK_STREAM)) as s:
            try:
                s.bind((addr[0], 0))
                local = True
                break
            except OSError:
                continue
    if not local:
        raise ConfigError(f"process 0 runs the coordinator, but {var} names {host}, which is not this machine "
                          f"({socket.gethostname()}): start process 0 on {host}, or point the coordinator at this host")
    port_var = "HYBRID_LM_COORDINATOR" if launch.source != "SLURM" else "JAX_COORDINATOR_PORT"
    for family, addr in ((socket.AF_INET6, "::"), (socket.AF_INET, "0.0.0.0")):
        try:
            s = socket.socket(family, socket.SOCK_STREAM)
        except OSError:
            continue
        with contextlib.closing(s):
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((addr, int(port)))
            except OSError as e:
                if e.errno == errno.EADDRINUSE:
                    raise ConfigError(
                        f"the coordinator port {port} on {socket.gethostname()} is already in use ({port_var}={port if launch.source == 'SLURM' else launch.coordinator}): "
                        "another job's coordinator, or a second process with process id 0; pick another port") from None
                continue
            return


def maybe_initialize(flag: PreemptionFlag | None = None) -> Launch | None:
    """Start ``jax.distributed`` when the environment asks for several processes (see the module
    docstring); None for a single process. Set-up mistakes raise ``ConfigError`` before anything
    starts; a start-up that does not complete ends this process in one line (``HYBRID_LM_INIT_TIMEOUT_S``).
    A stop signal while waiting ends it at once: nothing was trained, nothing is lost."""
    if _STATE.launch is not None or jax.distributed.is_initialized():
        return _STATE.launch
    launch = resolve()
    if launch is None:
        return None
    if launch.process_id == 0:
        check_coordinator(launch)
    jax.config.update("jax_enable_preemption_service", False)  # SIGTERM is ours (signals.py), not JAX's notifier
    if jax.config.jax_platforms in (None, "", "cpu") or os.environ.get("JAX_PLATFORMS") == "cpu":
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if launch.process_id != 0:  # XLA aborts this process when process 0 dies: one line instead (coordinator_loss)
        restore = coordinator_loss.install(launch.process_id, launch.num_processes, launch.coordinator)
        if restore is not None:
            signals.on_abrupt_exit(restore)
            _after_jax_clean_up(restore)
    timeout = init_timeout_s()
    box: dict = {}

    def connect():
        try:
            jax.distributed.initialize(
                coordinator_address=launch.coordinator, num_processes=launch.num_processes,
                process_id=launch.process_id, cluster_detection_method="deactivate",
                local_device_ids=list(launch.local_device_ids) if launch.local_device_ids is not None else None,
                initialization_timeout=int(timeout) + 120,  # ours ends first, in one line (JAX's aborts)
                heartbeat_timeout_seconds=int(max(100, 3 * peer_timeout_s())))
        except BaseException as e:  # noqa: BLE001 - reported below
            box["error"] = e

    t0 = time.monotonic()
    thread = threading.Thread(target=connect, name="hybrid_lm distributed start-up", daemon=True)
    thread.start()
    said = False
    while thread.is_alive():
        thread.join(0.2)
        waited = time.monotonic() - t0
        if flag is not None and flag.signal and thread.is_alive():  # nothing trained yet: stop at once
            _stopped_while_joining(launch, flag)
        if not said and waited > 10 and thread.is_alive():
            print(f"{launch.who}: waiting for all {launch.num_processes} processes to join at {launch.coordinator} "
                  f"(gives up after {timeout:g} s, HYBRID_LM_INIT_TIMEOUT_S)", file=sys.stderr, flush=True)
            said = True
        if waited > timeout and thread.is_alive():
            signals.exit_now(f"error: {_join_timeout(launch, timeout)}", 2)
    if "error" in box:
        e = box["error"]
        signals.exit_now(f"error: {launch.who} could not start the multi-process run at {launch.coordinator}: "
                         f"{_first_line(e)}", 2)
    _STATE.launch = launch
    _STATE.watchdog = _Watchdog(launch)
    _STATE.watchdog.start()
    signals.on_abrupt_exit(_publish_abrupt_exit)
    atexit.register(_at_exit)  # after JAX's own atexit: runs before it
    return launch


def _after_jax_clean_up(fn) -> None:
    """Run ``fn`` at exit after JAX's own atexit clean-up (whose distributed shutdown is a barrier that
    can still lose process 0): atexit runs last-registered first, so JAX's is registered again after it."""
    try:
        from jax._src.api import clean_up  # JAX-private: another JAX layout falls back
    except ImportError:  # another JAX layout: at least at exit
        atexit.register(fn)
        return
    atexit.unregister(clean_up)
    atexit.register(fn)
    atexit.register(clean_up)


def _join_timeout(launch: Launch, timeout: float) -> str:
    host, _, port = launch.coordinator.rpartition(":")
    n = launch.num_processes
    ids = ("HYBRID_LM_NUM_PROCESSES / HYBRID_LM_PROCESS_ID" if launch.source != "SLURM"
           else "SLURM_NTASKS / SLURM_PROCID")
    if launch.process_id != 0:
        try:
            with socket.create_connection((host.strip("[]"), int(port)), timeout=3):
                pass
        except OSError as e:
            return (f"{launch.who}: nothing answers at the coordinator {launch.coordinator} after {timeout:g} s "
                    f"({e.strerror or e}): process 0 did not start there (its host and port come from "
                    f"{'HYBRID_LM_COORDINATOR' if launch.source != 'SLURM' else 'SLURM_STEP_NODELIST / JAX_COORDINATOR_PORT'})")
    return (f"{launch.who}: not all {n} processes joined at the coordinator {launch.coordinator} within {timeout:g} s "
            f"(HYBRID_LM_INIT_TIMEOUT_S): start {n} processes with ids 0..{n - 1} ({ids}), each reaching that address")


def _stopped_while_joining(launch: Launch, flag: PreemptionFlag) -> None:
    line = (f"{flag.name} while {launch.who} waited for the other processes to join: stopped before training "
            "(nothing to save); run the same command to resume")
    if flag.signal == signal.SIGUSR1 and launch.process_id == 0:
        line += f"; {signals.requeue()}"
    signals.exit_now(line, 0)


def _first_line(e: BaseException) -> str:
    text = str(e).strip() or type(e).__name__
    return " ".join(text.splitlines()[0].split())[:400]


# ----------------------------------------------------------------------------- one process fails

def _client():
    return jd.global_state.client


class _Watchdog(threading.Thread):
    """Publishes this process's pulse and watches the others': a failure message or a pulse that stops
    ends this process too, in one line."""

    def __init__(self, launch: Launch):
        super().__init__(name="hybrid_lm peers", daemon=True)
        self.launch = launch
        self.stop = threading.Event()

    def run(self) -> None:
        me, n = self.launch.process_id, self.launch.num_processes
        client, beat = _client(), 0
        seen: dict[int, tuple[str | None, float]] = {i: (None, time.monotonic()) for i in range(n) if i != me}
        while not self.stop.wait(PULSE_S):
            try:
                client.key_value_set(f"{_KV}/alive/{me}", str(beat), allow_overwrite=True)
                beat += 1
                state = _read_state(client)
            except Exception as e:  # noqa: BLE001 - the coordinator is gone
                if self.stop.is_set() or _STATE.exiting:
                    return
                if me != 0:
                    _leave_for_peer(self.launch, 0, f"the coordinator at {self.launch.coordinator} stopped answering "
                                                    f"({_first_line(e)})")
                continue
            if self.stop.is_set() or _STATE.exiting:
                return
            if _STATE.failing:  # this process is reporting its own failure: keep the pulse, nothing else
                continue
            culprit = _failed_peer(state, me)
            if culprit is not None:
                _leave_for_peer(self.launch, *culprit)
            now = time.monotonic()
            for i, (last, since) in seen.items():
                if i in state["done"]:
                    continue
                beat_i = state["alive"].get(i)
                if beat_i != last:
                    seen[i] = (beat_i, now)
                elif now - since > peer_timeout_s():
                    _STATE.dead.add(i)
                    _leave_for_peer(self.launch, i, f"stopped responding {now - since:.0f} s ago (no pulse within "
                                                    "HYBRID_LM_PEER_TIMEOUT_S): killed, out of memory, or its host failed")


def _read_state(client) -> dict:
    state = {"alive": {}, "failed": {}, "done": set(), "ack": set()}
    for key, value in client.key_value_dir_get(f"{_KV}/"):
        parts = key.strip("/").split("/")
        if len(parts) < 2 or not parts[-1].isdigit():
            continue
        kind, i = parts[-2], int(parts[-1])
        if kind in ("alive", "failed"):
            state[kind][i] = value
        elif kind in ("done", "ack"):
            state[kind].add(i)
    return state


def _failed_peer(state: dict, me: int):
    """``(process, what)`` of another process that published a failure: one that failed first rather
    than one that stopped because of it."""
    others = {i: m for i, m in state["failed"].items() if i != me}
    if not others:
        return None
    first = [i for i in sorted(others) if not others[i].startswith("stopped: ")]
    i = first[0] if first else min(others)
    return i, f"failed: {others[i]}"


def _leave_for_peer(launch: Launch, peer: int, what: str) -> None:
    """Another process failed: say so in one line and end this one (from the watchdog thread)."""
    with _STATE.lock:
        if _STATE.exiting or _STATE.failing:
            return
        _STATE.exiting = _STATE.failing = True
    line = (f"error: process {peer} of {launch.num_processes} {what}; stopping process {launch.process_id} too. "
            "Nothing saved is lost: rerun the same command on every process to resume from the newest checkpoint")
    with contextlib.suppress(Exception):
        _client().key_value_set(f"{_KV}/ack/{launch.process_id}", "1", allow_overwrite=True)
    _wait_for_acks(launch)
    signals.exit_now(line, 2)


def _wait_for_acks(launch: Launch, limit: float = 5.0) -> None:
    """Process 0 hosts the key-value store: it stays until every other live process has read the
    failure (bounded), so that each says which process failed rather than that the coordinator vanished."""
    if launch.process_id != 0:
        return
    t0 = time.monotonic()
    while time.monotonic() - t0 < limit:
        try:
            st = _read_state(_client())
        except Exception:  # noqa: BLE001
            return
        waiting = set(range(1, launch.num_processes)) - st["ack"] - set(st["failed"]) - st["done"] - _STATE.dead
        if not waiting:
            return
        time.sleep(0.1)


def _publish_abrupt_exit() -> None:
    """Before this process ends abruptly (a second Ctrl-C): tell the others."""
    launch = _STATE.launch
    if launch is None or _STATE.failing:
        return
    _STATE.failing = _STATE.exiting = True
    with contextlib.suppress(Exception):
        _client().key_value_set(f"{_KV}/failed/{launch.process_id}", "interrupted (a second Ctrl-C)",
                                allow_overwrite=True)
    _wait_for_acks(launch, 3.0)


_OWN_ERRORS = (ConfigError, DataError, WorkdirError, ImportError, OSError, KeyboardInterrupt, SystemExit)
_TRANSPORT = re.compile(r"gloo|nccl|DEADLINE_EXCEEDED|UNAVAILABLE|connection (reset|closed|refused)|socket closed|"
                        r"heartbeat|coordination service", re.IGNORECASE)


def _own(e: BaseException) -> bool:
    """A failure of this process itself (a mistake, a full disk), not a broken collective: a collective
    whose peer died can surface wrapped in another error (a checkpoint save that gathers)."""
    chain, seen = [], e
    while seen is not None and len(chain) < 5:
        chain.append(seen)
        seen = seen.__cause__ or seen.__context__
    return isinstance(e, _OWN_ERRORS) and not any(_TRANSPORT.search(str(x)) for x in chain)


def failed(e: BaseException, resume: str = "") -> BaseException:
    """This process's run raised ``e``. In a multi-process run: when another process failed or died
    first (``e`` is then a broken collective), the :class:`ClusterError` naming it; otherwise ``e``,
    published so the other processes stop within seconds. ``resume``: where a rerun resumes."""
    launch = _STATE.launch
    if launch is None:
        return e
    with _STATE.lock:
        leaving = _STATE.exiting  # the watchdog is ending this process for a failed peer: let it
        _STATE.failing = True
    if leaving:
        threading.Event().wait(30)
        return e
    culprit = None if _own(e) else _find_culprit(launch)
    if culprit is not None:
        peer, what = culprit
        with contextlib.suppress(Exception):
            _client().key_value_set(f"{_KV}/failed/{launch.process_id}", f"stopped: process {peer} {what}",
                                    allow_overwrite=True)
        return ClusterError(f"process {peer} of {launch.num_processes} {what}; stopping {launch.who} too. Nothing saved "
                            f"is lost: rerun the same command on every process to resume{resume}")
    with contextlib.suppress(Exception):
        _client().key_value_set(f"{_KV}/failed/{launch.process_id}", _first_line(e), allow_overwrite=True)
    return e


def _find_culprit(launch: Launch, window: float = 3.0):
    """``(process, what)`` of another process that failed (published) or died (no pulse over ``window``
    seconds), else None."""
    me, t0 = launch.process_id, time.monotonic()
    first = None
    while True:
        try:
            st = _read_state(_client())
        except Exception:  # noqa: BLE001
            return (0, f"(the coordinator at {launch.coordinator}) is gone: killed, out of memory, or its host failed") \
                if me != 0 else None
        peer = _failed_peer(st, me)
        if peer is not None:
            return peer
        if first is None:
            first = dict(st["alive"])
        elif time.monotonic() - t0 >= window:
            dead = [i for i in range(launch.num_processes)
                    if i != me and i not in st["done"] and st["alive"].get(i) == first.get(i)]
            _STATE.dead.update(dead)
            return (dead[0], "stopped without a message (killed, out of memory, or its host failed)") if dead else None
        time.sleep(0.1)


def leave_if_failing(code: int) -> None:
    """After a failed multi-process run has reported its error: end the process now (JAX's shutdown
    barrier would wait for the processes that stopped, then abort)."""
    launch = _STATE.launch
    if launch is None or not _STATE.failing:
        return
    _STATE.exiting = True
    if _STATE.watchdog is not None:
        _STATE.watchdog.stop.set()
    _wait_for_acks(launch, 3.0)
    signals.exit_now(None, code)


def _at_exit() -> None:
    launch = _STATE.launch
    if launch is None:
        return
    if _STATE.failing:  # an uncaught error: leave without JAX's shutdown barrier
        leave_if_failing(1)
        return
    _STATE.exiting = True
    if _STATE.watchdog is not None:
        _STATE.watchdog.stop.set()
        _STATE.watchdog.join(timeout=2)
    with contextlib.suppress(Exception):  # finished: the others stop watching this process's pulse
        _client().key_value_set(f"{_KV}/done/{launch.process_id}", "1", allow_overwrite=True)


# ----------------------------------------------------------------------------- helpers for the trainer

def main_first(fn, name: str):
    """``fn()`` on process 0, then on the others (the embedded corpus is prepared once, by process 0)."""
    if jax.process_count() == 1:
        return fn()

    if jax.process_index() == 0:
        out = fn()
        multihost_utils.sync_global_devices(name)
        return out
    multihost_utils.sync_global_devices(name)
    return fn()

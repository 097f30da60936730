"""Exact-resume verification: a run killed from outside and resumed must equal an uninterrupted run,
bitwise, in its loss curve and its final parameters. Test tooling (not part of the package), used by
tests and ``experiments/resume_stress.py`` (both put ``tests/`` on ``sys.path``). Run directly:
``python tests/resume_check.py STRAIGHT_RUN RESUMED_RUN``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from hybrid_lm.run.metrics import read_metrics


def write_gin(path: Path, params: list[str]) -> Path:
    path.write_text("\n".join(params) + "\n")
    return path


def train_subprocess(gin_file: Path, workdir: Path, *, kill_at: int | None = None, sig: int = signal.SIGKILL,
                     timeout: float = 600, env: dict | None = None, extra_args: tuple = ()) -> dict:
    """Run ``hybrid-lm train`` in a child; with ``kill_at``, send ``sig`` once step ``kill_at`` is logged."""
    cmd = [sys.executable, "-m", "hybrid_lm.cli", "train", str(gin_file), "--workdir", str(workdir), *extra_args]
    env = dict(os.environ if env is None else env)
    env.setdefault("JAX_PLATFORMS", "cpu")
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    killed_at = None
    deadline = time.time() + timeout
    metrics = Path(workdir) / "metrics.jsonl"
    try:
        while kill_at is not None and proc.poll() is None and time.time() < deadline:
            if metrics.exists():
                rows = read_metrics(metrics, "train")
                if rows and rows[-1]["step"] >= kill_at:
                    killed_at = rows[-1]["step"]
                    proc.send_signal(sig)
                    break
            time.sleep(0.02)
        out, _ = proc.communicate(timeout=max(1.0, deadline - time.time()))
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        raise RuntimeError(f"training subprocess timed out:\n{out[-3000:]}") from None
    return {"returncode": proc.returncode, "killed_at": killed_at, "output": out}


def make_unwritable(d: Path):
    """Make directory ``d`` refuse new entries: chmod, or (as root, who ignores modes) chattr +i.
    Returns the undo function, or None when neither blocks writes here."""
    probe = Path(d) / ".probe"
    d.chmod(0o555)
    try:
        probe.mkdir()
    except PermissionError:
        return lambda: d.chmod(0o755)
    probe.rmdir()
    d.chmod(0o755)
    if subprocess.run(["chattr", "+i", str(d)], capture_output=True).returncode == 0:
        try:
            probe.mkdir()
        except PermissionError:
            return lambda: subprocess.run(["chattr", "-i", str(d)], check=True)
        probe.rmdir()
        subprocess.run(["chattr", "-i", str(d)], check=True)
    return None


def final_state(workdir: Path) -> dict[str, np.ndarray]:
    """Flattened arrays of the newest checkpoint's state (params, optimizer state, step)."""
    import jax
    import orbax.checkpoint as ocp

    mgr = ocp.CheckpointManager(Path(workdir).resolve() / "checkpoints", item_names=("state", "meta"))
    try:
        step = mgr.latest_step()
        restored = mgr.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore()))
    finally:
        mgr.close()
    return {jax.tree_util.keystr(p): np.asarray(x) for p, x in jax.tree_util.tree_leaves_with_path(restored.state)}


def compare_runs(straight: Path, resumed: Path) -> dict:
    """Bitwise comparison of loss curves (last row per step) and final states."""
    a = {r["step"]: r for r in read_metrics(Path(straight) / "metrics.jsonl", "train")}
    b = {r["step"]: r for r in read_metrics(Path(resumed) / "metrics.jsonl", "train")}
    loss_diff = [s for s in sorted(set(a) | set(b))
                 if s not in a or s not in b or a[s]["loss"] != b[s]["loss"] or a[s]["grad_norm"] != b[s]["grad_norm"]]
    sa, sb = final_state(straight), final_state(resumed)
    param_diff = [k for k in sorted(set(sa) | set(sb))
                  if k not in sa or k not in sb or sa[k].dtype != sb[k].dtype or not np.array_equal(sa[k], sb[k])]
    return {"steps": len(a), "loss_equal": not loss_diff, "first_loss_diff": loss_diff[:3],
            "state_equal": not param_diff, "state_diff": param_diff[:3], "state_leaves": len(sa)}


def main() -> None:  # pragma: no cover - convenience for a quick manual check
    print(json.dumps(compare_runs(Path(sys.argv[1]), Path(sys.argv[2])), indent=2))


if __name__ == "__main__":
    main()

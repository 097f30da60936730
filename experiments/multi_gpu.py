#!/usr/bin/env python
"""Multi-GPU training on one host: data parallel and FSDP against a one-GPU baseline, plus restore.

Trains the same model on the same data (S5 1:1 full+SWA-128 at T=16K by default) three ways:

* ``single``: one GPU (``CUDA_VISIBLE_DEVICES=0``), gradient accumulation over N micro-batches so the
  global batch matches;
* ``dp``: pure data parallelism over all N GPUs (``MeshConfig.data = N``);
* ``fsdp``: parameters and optimizer state sharded over all N GPUs (``MeshConfig.fsdp = N``);

then restores the final checkpoint of the ``dp`` run (else the ``fsdp`` run), saved on N GPUs, on 1 GPU
and on N/2 GPUs and continues ``--extra`` steps, against the same continuation on N GPUs.

Reports per run: median tokens/s per GPU and MFU over the steps after ``--skip`` (compile and warm
up excluded), scaling efficiency = (tokens/s per GPU on N) / (tokens/s on one GPU), and the largest
loss difference against the one-GPU run on the same steps. Writes JSON after every run (a run cut
short still leaves the finished ones).

    python experiments/multi_gpu.py --steps 50 --per-gpu-batch 2 --out $OUT/multi_gpu.json

Each run is a ``hybrid-lm train`` subprocess (``python -m hybrid_lm.cli``); set
``JAX_COMPILATION_CACHE_DIR`` to share compiled steps between the runs of one shape.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def gpu_count() -> int:
    out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, check=True).stdout
    return sum(1 for line in out.splitlines() if line.startswith("GPU "))


def read_rows(workdir: Path, kind: str = "train") -> list[dict]:
    from hybrid_lm.files import read_jsonl

    return [r for r in read_jsonl(workdir / "metrics.jsonl") if r.get("kind") == kind]  # a torn line: skipped


def launch(name: str, workdir: Path, gpus: list[int], params: list[str], args, log_dir: Path) -> dict:
    cmd = [sys.executable, "-m", "hybrid_lm.cli", "train", *args.config, "--workdir", str(workdir), "--force"]
    for p in params:
        cmd += ["--gin_param", p]
    env = dict(os.environ, CUDA_VISIBLE_DEVICES=",".join(map(str, gpus)))
    if args.smoke:  # CPU devices stand in for the GPUs
        env.update(JAX_PLATFORMS="cpu", XLA_FLAGS=f"--xla_force_host_platform_device_count={len(gpus)}")
    print(f"\n== {name}: {len(gpus)} GPU(s) {gpus}\n   {' '.join(cmd)}", flush=True)
    t0 = time.time()
    log = log_dir / f"{name}.log"
    with open(log, "w") as f:
        proc = subprocess.run(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT)
    wall = time.time() - t0
    tail = log.read_text()[-3000:]
    if proc.returncode:
        print(tail)
    print(f"   exit {proc.returncode} after {wall:.0f} s", flush=True)
    return {"name": name, "gpus": len(gpus), "params": params, "returncode": proc.returncode,
            "wall_s": round(wall, 1), "log_tail": tail if proc.returncode else ""}


def summarize(rows: list[dict], n_gpus: int, skip: int) -> dict:
    timed = [r for r in rows if r["step"] > skip]
    if not timed:
        return {}
    tps = statistics.median(r["tokens_per_sec"] for r in timed)
    out = {"steps_timed": len(timed), "tokens_per_sec": tps, "tokens_per_sec_per_gpu": tps / n_gpus,
           "step_time_s": statistics.median(r["step_time"] for r in timed)}
    if all("mfu" in r for r in timed):
        out["mfu"] = statistics.median(r["mfu"] for r in timed)
    return out


def loss_diff(a: list[dict], b: list[dict]) -> dict:
    la = {r["step"]: r["loss"] for r in a}
    lb = {r["step"]: r["loss"] for r in b}
    common = sorted(set(la) & set(lb))
    if not common:
        return {}
    d = [abs(la[s] - lb[s]) for s in common]
    rel = [abs(la[s] - lb[s]) / abs(lb[s]) for s in common]
    return {"steps": len(common), "max_abs": max(d), "max_rel": max(rel), "final_a": la[common[-1]],
            "final_b": lb[common[-1]]}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", nargs="+", default=["configs/scale/s5.gin"])
    p.add_argument("--param", action="append", default=[], help="extra gin bindings for every run")
    p.add_argument("--window", type=int, default=128)
    p.add_argument("--seq-len", type=int, default=16384)
    p.add_argument("--per-gpu-batch", type=int, default=2)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--extra", type=int, default=5, help="steps after the cross-topology restore")
    p.add_argument("--skip", type=int, default=5, help="steps excluded from throughput medians")
    p.add_argument("--runs", default="single,dp,fsdp,restore")
    p.add_argument("--workroot", default="/tmp/multi_gpu_runs")
    p.add_argument("--out", default="multi_gpu.json")
    p.add_argument("--smoke", type=int, default=0, metavar="N",
                   help="CPU check of this script with N simulated devices (use a tiny --config)")
    args = p.parse_args()

    n = args.smoke or gpu_count()
    if n < 2:
        sys.exit(f"needs >= 2 GPUs, found {n}")
    gb = args.per_gpu_batch * n
    root = Path(args.workroot)
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    common = [f"DataConfig.seq_len = {args.seq_len}", f"TrainConfig.global_batch = {gb}",
              f"TrainConfig.steps = {args.steps}", "TrainConfig.log_every = 1",
              f"TrainConfig.eval_every = {args.steps}", "TrainConfig.progress = False",
              f"efficient/MixerConfig.window = {args.window}", "OptimConfig.warmup_steps = 10",
              f"CheckpointConfig.every_steps = {args.steps}", "CheckpointConfig.async_save = False",
              *args.param]
    meshes = {"single": ["MeshConfig.data = 1", f"TrainConfig.microbatches = {n}"],
              "dp": [f"MeshConfig.data = {n}", "MeshConfig.fsdp = 1"],
              "fsdp": ["MeshConfig.data = 1", f"MeshConfig.fsdp = {n}"]}
    all_gpus = list(range(n))
    res = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "command": " ".join(sys.argv), "gpus": n, "config": args.config, "common_params": common,
           "runs": {}, "restore": {}}

    def dump():
        out.write_text(json.dumps(res, indent=1))

    runs = args.runs.split(",")
    for name in ("single", "dp", "fsdp"):
        if name not in runs:
            continue
        gpus = [0] if name == "single" else all_gpus
        info = launch(name, root / name, gpus, common + meshes[name], args, out.parent)
        rows = read_rows(root / name)
        info.update(summarize(rows, len(gpus), args.skip), losses=[r["loss"] for r in rows])
        evals = read_rows(root / name, "eval")
        info["final_eval_loss"] = evals[-1]["loss"] if evals else None
        res["runs"][name] = info
        dump()

    base = res["runs"].get("single", {})
    for name in ("dp", "fsdp"):
        r = res["runs"].get(name)
        if r and base.get("tokens_per_sec_per_gpu") and r.get("tokens_per_sec_per_gpu"):
            r["scaling_efficiency"] = r["tokens_per_sec_per_gpu"] / base["tokens_per_sec_per_gpu"]
        if r:
            r["loss_vs_single"] = loss_diff(read_rows(root / name), read_rows(root / "single"))
    dump()

    source = next((r for r in ("dp", "fsdp") if res["runs"].get(r, {}).get("returncode") == 0), None)
    if "restore" in runs and source is None:
        print("restore skipped: neither the dp nor the fsdp run finished")
    if "restore" in runs and source is not None:
        longer = [x for x in common if not x.startswith("TrainConfig.steps")] + [
            f"TrainConfig.steps = {args.steps + args.extra}"]
        res["restore_source"] = source
        targets = {f"{source}_continued": (all_gpus, meshes[source])}
        for k in sorted({1, n // 2}):
            targets[f"restore_{k}gpu"] = (list(range(k)), [f"MeshConfig.data = {k}", "MeshConfig.fsdp = 1",
                                                            f"TrainConfig.microbatches = {n // k}"])
        for name, (gpus, mesh) in targets.items():
            wd = root / name
            shutil.copytree(root / source, wd)
            info = launch(name, wd, gpus, longer + mesh, args, out.parent)
            rows = [r for r in read_rows(wd) if r["step"] > args.steps]
            info["losses_after_restore"] = {r["step"]: r["loss"] for r in rows}
            res["restore"][name] = info
            dump()
        ref = res["restore"][f"{source}_continued"]["losses_after_restore"]
        for name, info in res["restore"].items():
            got = info["losses_after_restore"]
            common_steps = sorted(set(got) & set(ref))
            info["max_abs_loss_diff_vs_n_gpus"] = max((abs(got[s] - ref[s]) for s in common_steps), default=None)
            info["resumed_steps"] = len(got)
        dump()

    print("\n| run | GPUs | tokens/s | tokens/s/GPU | MFU | scaling eff. | max |Δloss| vs 1 GPU |")
    print("|---|---|---|---|---|---|---|")
    for name, r in res["runs"].items():
        f = lambda k, fmt: fmt.format(r[k]) if r.get(k) is not None else "—"
        ld = r.get("loss_vs_single", {}).get("max_abs")
        print(f"| {name} | {r['gpus']} | {f('tokens_per_sec', '{:,.0f}')} | {f('tokens_per_sec_per_gpu', '{:,.0f}')} | "
              f"{f('mfu', '{:.1%}')} | {f('scaling_efficiency', '{:.3f}')} | {'—' if ld is None else f'{ld:.4f}'} |")
    for name, info in res["restore"].items():
        print(f"restore {name}: exit {info['returncode']}, {info.get('resumed_steps')} steps after step "
              f"{args.steps}, max |Δloss| vs N-GPU continuation {info.get('max_abs_loss_diff_vs_n_gpus')}")
    dump()


if __name__ == "__main__":
    main()

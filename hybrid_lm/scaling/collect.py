"""Collect run directories into one scaling table (CSV / JSONL) that ``hybrid-lm fit`` reads directly.

Inputs: sweep roots (directories holding ``sweep.json``: their runs, stable runs excluded unless
asked), run directories (holding ``metrics.jsonl``), or any directory searched recursively for them.

One row per run (its last evaluation); with ``intermediate=True`` also one row per earlier
evaluation (``final = 0``), so fits can use intermediate checkpoints with the bootstrap clustered by
``run_id``. Columns, in order (docs/SCALING.md):

* ``run_id, arch, scale, N, D``: N as the sweep defined it (non-embedding parameters by default),
  D = tokens seen at that row;
* ``final`` (1 on the row of a finished run's final evaluation), ``status`` (finished | partial),
  ``step``, ``phase`` (``stable`` for rows at or before a WSD branch point, else ``decay``/``-``);
* ``loss`` (validation cross-entropy, nats/token), ``bpb``, ``loss_train`` (the last logged training
  loss), ``loss_at_25/50/75`` (validation loss at the evaluation nearest 25/50/75% of the run),
  ``loss_stable`` (branches: the validation loss at the branch point, before the decay);
* every other metric found: rows of ``metrics.jsonl`` whose ``kind`` is neither ``train`` nor
  ``eval`` (e.g. ``{"kind": "longppl", "step": 1000, "longppl": 5.3}``) and flat JSON files
  ``<run>/eval/*.json``, as ``<kind>`` (when the field is named like the kind) or ``<kind>_<field>``;
  any positive column whose name contains ``longppl`` also gets ``log_<name>``;
* bookkeeping: ``seed, kind, budget, steps, tokens_per_step, N_non_embedding, N_total, C`` (training
  FLOPs of D tokens: FLOPs/token from model/accounting.py x D), ``flops_per_token``, ``run_dir``.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from hybrid_lm.scaling.table import write_table

_STD_EVAL = {"kind", "step", "tokens", "loss", "bpb", "order0_entropy_bits", "eval_windows", "copied_from"}


def find_run_dirs(paths: list[str | Path], include_stable: bool = False) -> list[Path]:
    out: list[Path] = []
    for p in map(Path, paths):
        if not p.exists():
            raise FileNotFoundError(f"{p} does not exist")
        if (p / "sweep.json").exists():
            man = json.loads((p / "sweep.json").read_text())
            for j in man["jobs"]:
                if j["kind"] == "stable" and not include_stable:
                    continue
                d = p / j["name"]
                if (d / "metrics.jsonl").exists():
                    out.append(d)
        elif (p / "metrics.jsonl").exists():
            out.append(p)
        else:
            for m in sorted(p.rglob("metrics.jsonl")):
                meta = m.parent / "sweep_run.json"
                if meta.exists() and not include_stable and json.loads(meta.read_text()).get("kind") == "stable":
                    continue
                out.append(m.parent)
    seen, uniq = set(), []
    for d in out:
        r = d.resolve()
        if r not in seen:
            seen.add(r)
            uniq.append(d)
    return uniq


def _arch_label(cfg: dict) -> str:
    m = cfg["model"]
    types = m["layer_pattern"].upper()
    if set(types) == {"F"}:
        return "full"
    e = m["efficient"]
    label = str(e["kind"]) + (str(e["window"]) if e.get("window") else "")
    if m["layer_pattern"] not in ("1:1", "FE"):
        label += f"_{m['layer_pattern'].replace(':', 'to')}"
    return label


def _run_meta(d: Path) -> dict:
    """The sweep's metadata for this run, or one derived from config.json (counts need JAX)."""
    meta_path = d / "sweep_run.json"
    if meta_path.exists():
        return json.loads(meta_path.read_text())
    cfg_path = d / "config.json"
    if not cfg_path.exists():
        raise FileNotFoundError(f"{d} has neither sweep_run.json nor config.json")
    cfg_d = json.loads(cfg_path.read_text())
    from hybrid_lm.config import config_from_dict
    from hybrid_lm.model.accounting import count_params, flops_per_token

    cfg = config_from_dict({k: v for k, v in cfg_d.items() if k != "run_id"})
    counts = count_params(cfg.model)
    m = cfg.model
    return {"name": d.name, "kind": "run", "arch": _arch_label(cfg_d), "scale": f"d{m.d_model}L{m.n_layers}",
            "seed": cfg.train.seed, "budget": None, "steps": cfg.train.steps,
            "tokens_per_step": cfg.train.global_batch * cfg.data.seq_len, "N": counts["non_embedding"],
            "N_non_embedding": counts["non_embedding"], "N_total": counts["total"],
            "flops_per_token": float(flops_per_token(m, cfg.data.seq_len)["train"]), "branch_from": None}


def _extra_metrics(d: Path, rows: list[dict]) -> dict:
    out: dict = {}
    last: dict[str, dict] = {}
    for r in rows:
        k = r.get("kind")
        if k in ("train", "eval") or k is None:
            continue
        if k not in last or r.get("step", 0) >= last[k].get("step", 0):
            last[k] = r
    sources = list(last.items())
    ev = d / "eval"
    if ev.is_dir():
        for f in sorted(ev.glob("*.json")):
            try:
                obj = json.loads(f.read_text())
            except json.JSONDecodeError:
                continue
            if isinstance(obj, dict):
                sources.append((f.stem, obj))
    for kind, obj in sources:
        for field, v in obj.items():
            if field in ("kind", "step", "tokens") or isinstance(v, bool) or not isinstance(v, (int, float)):
                continue
            col = kind if field == kind else f"{kind}_{field}"
            out[col] = v
    for col, v in list(out.items()):
        if "longppl" in col.lower() and not col.startswith("log_") and isinstance(v, (int, float)) and v > 0:
            out.setdefault(f"log_{col}", math.log(v))
    return out


def collect_run(d: Path, intermediate: bool = False) -> list[dict]:
    from hybrid_lm.train.metrics import read_metrics

    d = Path(d)
    meta = _run_meta(d)
    rows = read_metrics(d / "metrics.jsonl")
    evals = [r for r in rows if r.get("kind") == "eval" and isinstance(r.get("loss"), (int, float))]
    trains = [r for r in rows if r.get("kind") == "train"]
    if not evals:
        return []
    tps = meta["tokens_per_step"]
    steps = meta["steps"]
    finished = (d / "sweep_done.json").exists() or (meta.get("kind") == "run" and evals[-1]["step"] >= steps)
    bstep = (meta.get("branch_from") or {}).get("step")
    fpt = meta.get("flops_per_token")
    loss_stable = next((r["loss"] for r in reversed(evals) if bstep is not None and r["step"] == bstep), None)

    def loss_near(frac):
        target = frac * steps
        cand = [r for r in evals if r["step"] > 0]
        if not cand:
            return None
        return min(cand, key=lambda r: (abs(r["step"] - target), r["step"]))["loss"]

    extra = _extra_metrics(d, rows)
    out = []
    chosen = [r for r in evals if r["step"] > 0] if intermediate else evals[-1:]
    for r in chosen:
        is_last = r is evals[-1]
        D = int(r["step"]) * tps
        tr = [t for t in trains if t["step"] <= r["step"]]
        row = {
            "run_id": meta["name"], "arch": meta["arch"], "scale": meta["scale"], "N": meta["N"], "D": D,
            # a stable WSD run never decayed: its rows are never a fit's final rows
            "final": int(is_last and finished and meta.get("kind") != "stable"),
            "status": "finished" if finished else "partial",
            "step": int(r["step"]),
            "phase": "stable" if meta.get("kind") == "stable" else (
                "-" if bstep is None else ("stable" if r["step"] <= bstep else "decay")),
            "loss": r["loss"], "bpb": r.get("bpb"), "loss_train": tr[-1]["loss"] if tr else None,
            # summaries of the whole run: on its last row only
            "loss_at_25": loss_near(0.25) if is_last else None, "loss_at_50": loss_near(0.5) if is_last else None,
            "loss_at_75": loss_near(0.75) if is_last else None, "loss_stable": loss_stable if is_last else None,
        }
        row.update({k: (v if is_last else None) for k, v in extra.items()})
        row.update({"seed": meta.get("seed"), "kind": meta.get("kind"), "budget": meta.get("budget"),
                    "steps": steps, "tokens_per_step": tps, "N_non_embedding": meta.get("N_non_embedding"),
                    "N_total": meta.get("N_total"), "C": fpt * D if fpt else None, "flops_per_token": fpt,
                    "run_dir": str(d)})
        out.append(row)
    return out


def collect(paths: list[str | Path], out: str | Path | None = None, intermediate: bool = False,
            include_stable: bool = False, progress: bool = True) -> tuple[list[dict], dict]:
    """Rows for every run under ``paths``; writes ``out`` (.csv or .jsonl) and returns (rows, stats)."""
    from tqdm.auto import tqdm

    dirs = find_run_dirs(paths, include_stable=include_stable)
    rows, empty = [], []
    for d in tqdm(dirs, desc="collect", disable=not progress, leave=False):
        r = collect_run(d, intermediate=intermediate)
        if not r:
            empty.append(str(d))
        rows.extend(r)
    rows.sort(key=lambda r: (str(r["arch"]), float(r["N"]), str(r["run_id"]), int(r["step"])))
    # every row carries every column (metrics first, bookkeeping last), so CSV columns are stable
    book = ["seed", "kind", "budget", "steps", "tokens_per_step", "N_non_embedding", "N_total", "C",
            "flops_per_token", "run_dir"]
    cols = [c for c in dict.fromkeys(k for r in rows for k in r) if c not in book] + book
    rows = [{c: r.get(c) for c in cols} for r in rows]
    stats = {"run_dirs": len(dirs), "rows": len(rows), "finished": sum(r["final"] for r in rows),
             "partial": sorted({r["run_id"] for r in rows if r["status"] == "partial"}), "no_eval": empty}
    if out is not None:
        write_table(rows, out)
        if Path(out).suffix == ".csv":
            write_table(rows, Path(out).with_suffix(".jsonl"))
    return rows, stats

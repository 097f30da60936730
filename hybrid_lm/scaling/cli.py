"""``hybrid-lm sweep | collect | fit | report`` (registered by :func:`add_scaling_commands`)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from hybrid_lm.run.directory import find_run_dirs
from hybrid_lm.scaling import launch as L
from hybrid_lm.scaling.collect import collect
from hybrid_lm.scaling.fit import FitError, get_form, parse_bound_args, parse_range
from hybrid_lm.scaling.fit_table import describe_dropped, fit_table
from hybrid_lm.scaling.report import write_report
from hybrid_lm.scaling.sweep import (SweepError, expand, format_passes, format_plan, load_spec, next_steps,
                                     passes_warning, summarize)
from hybrid_lm.scaling.table import read_table


def cmd_sweep(args) -> int:
    spec = load_spec(args.spec)
    if args.max_minutes is not None and (args.launch != "local" or args.dry_run):
        raise SweepError("--max-minutes applies to --launch local (a SLURM job has its own time limit)")
    changes = {}
    if args.branch is not None:
        changes["branch"] = args.branch
    if args.param_match is not None:
        changes["param_match"] = args.param_match
    if args.mfu is not None:
        changes["mfu"] = args.mfu
    if changes:
        spec = dataclasses.replace(spec, **changes)
        if spec.param_match and spec.reference_arch not in spec.archs:
            print(f"error: parameter matching needs the reference arch {spec.reference_arch!r} in the spec",
                  file=sys.stderr)
            return 2
    if args.job:
        root = Path(args.root or spec.root or Path("runs") / "sweeps" / spec.name)
        return L.main(["--root", str(root), "--job", args.job])
    plan = expand(spec, root=args.root, extra_params=args.gin_param, progress=True)
    if args.dry_run or not args.launch:
        view = plan
        if args.only:  # show the selection; the manifest of a launch always lists every job
            view = dataclasses.replace(plan, jobs=L.select_jobs(plan.jobs, args.only))
            view.summary = summarize(view)
        if args.json:
            print(json.dumps(view.manifest(), indent=1, default=str))
            warning = passes_warning(view.jobs)
            if warning:  # stdout stays JSON
                print(warning, file=sys.stderr)
        else:
            print(format_plan(view))
            if view is not plan:
                print(f"(--only: {len(view.jobs)} of {len(plan.jobs)} jobs; a selected stable run still trains to its "
                      "largest branch point, so the saving of a selection can be negative)")
            if view.root.exists():
                states = {}
                for j in view.jobs:
                    st = L.job_state(plan.root, j)
                    states[st] = states.get(st, 0) + 1
                print(f"state under {plan.root}: " + ", ".join(f"{v} {k}" for k, v in sorted(states.items())))
            if not args.dry_run:
                print("\n(nothing launched: add --launch local or --launch slurm)")
        return 0
    selected = L.select_jobs(plan.jobs, args.only)
    warning = passes_warning(selected)
    print("\n".join(format_passes(selected) + ([warning] if warning else [])), flush=True)
    if args.launch == "local":
        gpus = None
        if args.gpus == "auto":
            gpus = L.detect_gpus()
        elif args.gpus not in (None, "none"):
            gpus = [g.strip() for g in args.gpus.split(",") if g.strip()]
        deadline = {} if args.max_minutes is None else {"max_minutes": args.max_minutes}
        summary = L.launch_local(plan, gpus=gpus, only=args.only, **deadline)
        print(f"\nsweep {spec.name}: {summary['jobs']} jobs, {summary['skipped']} already done, "
              f"{summary['launched']} launched, {len(summary['done'])} finished now, "
              f"{len(summary['failed'])} failed, {len(summary['blocked'])} blocked")
        for name, why in summary["failed"].items():
            print(f"  failed {name}: {why}")
        for name in summary["blocked"]:
            print(f"  blocked {name}: its stable run did not seed it")
        if summary["preempted"]:
            if summary.get("deadline"):
                left = summary["jobs"] - summary["skipped"] - len(summary["done"]) - len(summary["failed"])
                job = summary["preempted"].get("job")
                print(f"stopped at --max-minutes {args.max_minutes:g}" + (f" (during {job}, saved)" if job else "")
                      + f": {left} job(s) left; run the same command to continue")
            else:
                print(f"preempted during {summary['preempted'].get('job')}: run the same command to resume")
            return 0
        print("next:")
        for line in next_steps(plan, L.select_jobs(plan.jobs, args.only) if args.only else plan.jobs):
            print(f"  {line}")
        return 1 if summary["failed"] or summary["blocked"] else 0
    out = L.write_slurm(plan, only=args.only, submit=not args.no_submit)
    print(f"wrote {', '.join(out['scripts']) or 'no job scripts (every job is done)'}; submit with {out['submit_sh']}")
    print(f"phase 1 (stable + independent runs): {out['phase1']} tasks; phase 2 (branches): {out['phase2']} tasks")
    if out.get("submitted"):
        print(out.get("sbatch_output", ""))
    elif out.get("note"):
        print(out["note"])
    return 0


def cmd_collect(args) -> int:
    missing = [p for p in args.paths if not Path(p).exists()]
    if missing:
        print(f"error: {missing[0]} does not exist", file=sys.stderr)
        return 2
    if not find_run_dirs(args.paths, include_stable=args.include_stable):
        print(f"error: no run dirs under {', '.join(args.paths)} (a run dir holds metrics.jsonl; a sweep root "
              "sweep.json); nothing written", file=sys.stderr)
        return 2
    out = args.out
    if out is None:
        if len(args.paths) == 1 and (Path(args.paths[0]) / "sweep.json").exists():
            out = str(Path(args.paths[0]) / "table.csv")
        else:
            print("error: give --out TABLE.csv (or .jsonl) when collecting anything but one sweep root",
                  file=sys.stderr)
            return 2
    rows, stats = collect(args.paths, out, intermediate=args.intermediate, include_stable=args.include_stable,
                          labels=args.label)
    print(f"{stats['run_dirs']} run dirs -> {stats['rows']} rows ({stats['finished']} finished runs) -> {out}")
    ev = stats["eval_rows"]
    if ev["read"] or ev["bad_lines"]:
        print(f"eval.jsonl: {ev['read']} rows, {ev['superseded']} superseded by a later row of the same task, "
              f"settings and step; {ev['unplaced']} at steps without a table row"
              + (" (add --intermediate for earlier steps)" if ev["unplaced"] and not args.intermediate else "")
              + (f"; {ev['bad_lines']} unreadable lines skipped" if ev["bad_lines"] else ""))
        print(f"evaluation columns: {', '.join(stats['eval_columns'])}")
    archs = sorted({r['arch'] for r in rows})
    if archs:
        print(f"archs: {', '.join(archs)}")
    if stats["partial"]:
        print(f"partial runs (final = 0): {', '.join(stats['partial'])}")
    if stats["no_eval"]:
        print(f"no evaluation yet: {', '.join(stats['no_eval'])}")
    return 0


def cmd_fit(args) -> int:
    rows = read_table(args.table)
    form = get_form(args.form).name
    out = Path(args.out) if args.out else Path(args.table).parent / f"fit-{args.metric}-{form}"
    k = args.flops_per_nd if args.flops_per_nd == "auto" else float(args.flops_per_nd)
    compute = [float(x) for x in args.compute.split(",")] if args.compute else None
    doc = fit_table(rows, metric=args.metric, form=form, out_dir=out, archs=args.arch, which=args.rows,
                    bounds=parse_bound_args(args.bound), n_boot=args.bootstrap, seed=args.seed, holdout=args.holdout,
                    flops_per_nd=k, compute_at=compute, multistart=args.multistart, loso=args.loso,
                    table_path=str(args.table), plots=not args.no_plots,
                    exponent_range=parse_range(args.exponent_range))
    note = describe_dropped(doc["dropped_rows"], args.metric, len(rows))
    if note:
        print(note)
    if doc["undecayed_rows_used"]:
        print(f"{doc['undecayed_rows_used']} rows from before a WSD decay (never decayed) are in the fit, as "
              f"--rows {args.rows} asks; they bias L(N, D) upwards")
    print(f"\n{form} fit of log({args.metric}); {args.bootstrap} bootstrap resamples; results in {out}/fit.json")
    for line in fit_table_lines(doc["fits"]):
        print(line)
    for a, e in doc["fits"].items():
        g = e["guardrails"]
        if g["reasons"]:
            print(f"\n{a}: NOT VALID (compute_optimal.valid = false, not ranked by `report`):")
            for r in g["reasons"]:
                print(f"  - {r}")
        for w in g["warnings"]:
            print(f"{a}: warning: {w}")
    return 0


def fit_table_lines(fits: dict) -> list[str]:
    """The fits as a table whose columns are as wide as their widest cell and two spaces apart, so that
    no two values run together whatever their size or sign (alpha and beta with their bootstrap SE)."""
    def pm(value, ci, name):
        c = ci.get(name)
        return f"{value:.4f}" + (f" ±{c['se']:.3g}" if c else "")

    head = ["arch", "pts", "E", "A", "B", "alpha", "beta", "a=N* exp", "hold-out RMSE"]
    rows = []
    for a, e in fits.items():
        p, ci = e["params"], (e.get("ci") or {}).get("params", {})
        ho = e["holdout"]
        rows.append([a, str(e["n_points"]), "–" if p["E"] is None else f"{p['E']:.4g}", f"{p['A']:.4g}",
                     f"{p['B']:.4g}", pm(p["alpha"], ci, "alpha"), pm(p["beta"], ci, "beta"),
                     f"{e['compute_optimal'].get('N_opt_exponent', float('nan')):.3f}",
                     f"{ho['holdout']['rmse_log']:.4f}" if "holdout" in ho else "skipped"])
    widths = [max(len(r[i]) for r in [head] + rows) for i in range(len(head))]
    return ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))).rstrip()
            for r in [head] + rows]


def cmd_report(args) -> int:
    path = write_report(args.fit, args.out, args.sweep)
    print(f"wrote {path}")
    return 0


def _wrap(fn):
    def run(args):
        try:
            return fn(args)
        except (FitError, FileNotFoundError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    return run


def add_scaling_commands(sub) -> None:
    """Register ``sweep``, ``collect``, ``fit`` and ``report`` on an argparse sub-parser set."""
    p = sub.add_parser("sweep", help="expand a sweep spec; --dry-run, --launch local|slurm (idempotent)",
                       description="Expand a sweep spec (configs/sweeps/*.toml) into runs and launch them. "
                                   "Finished runs are skipped, partial runs resume. See docs/SCALING.md.")
    p.add_argument("spec", help="sweep spec (.toml or .json), e.g. configs/sweeps/rethinking.toml")
    p.add_argument("--dry-run", action="store_true", help="list runs: N, D, steps, FLOPs, H200 GPU-hours, saving")
    p.add_argument("--launch", choices=("local", "slurm"), help="local: in sequence or one per GPU; slurm: job arrays")
    p.add_argument("--root", default=None, help="sweep directory (default: the spec's root or runs/sweeps/<name>)")
    p.add_argument("--gpus", default=None,
                   help="local launch: 'auto' (CUDA_VISIBLE_DEVICES or nvidia-smi), 'none', or a list '0,1,2,3'; "
                        "more than one runs one job per GPU in subprocesses")
    p.add_argument("--only", default=None,
                   help="regex on run ids (the stable runs that matched branches need are added)")
    p.add_argument("--gin_param", "--gin-param", action="append", default=[], metavar="K=V",
                   help="extra gin binding for every run, e.g. \"DataConfig.source = 'tokens'\" (repeatable)")
    p.add_argument("--json", action="store_true", help="with --dry-run: print the plan as JSON")
    p.add_argument("--no-submit", action="store_true", help="slurm: write the scripts, do not call sbatch")
    p.add_argument("--job", default=None, help="run one job of an already planned sweep (what workers call)")
    p.add_argument("--max-minutes", dest="max_minutes", type=float, default=None, metavar="M",
                   help="local launch: after M minutes stop as SIGTERM would (the running job saves after its "
                        "current step, no new job starts); the same command then continues. Leave room for the "
                        "save and the process's exit within an outer time limit")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--branch", dest="branch", action="store_true", default=None, help="force WSD branching on")
    g.add_argument("--no-branch", dest="branch", action="store_false", help="independent runs (no WSD branching)")
    g2 = p.add_mutually_exclusive_group()
    g2.add_argument("--param-match", dest="param_match", action="store_true", default=None,
                    help="adjust d_ff so every hybrid has the reference arch's N")
    g2.add_argument("--no-param-match", dest="param_match", action="store_false")
    p.add_argument("--mfu", type=float, default=None, help="MFU for GPU-hour estimates (default: the spec's, 0.385)")
    p.set_defaults(fn=_wrap(cmd_sweep))

    p = sub.add_parser("collect", help="run dirs / sweep roots -> one table (CSV + JSONL) for `fit`")
    p.add_argument("paths", nargs="+", help="sweep roots, run dirs, or directories to search")
    p.add_argument("--out", default=None, help="table path, .csv (a .jsonl twin is written) or .jsonl; "
                                                "default <sweep root>/table.csv")
    p.add_argument("--intermediate", action="store_true", help="also one row per earlier evaluation (final = 0)")
    p.add_argument("--include-stable", action="store_true", help="include WSD stable runs (never decayed)")
    p.add_argument("--label", action="append", default=[], metavar="REGEX=LABEL",
                   help="arch label for the runs whose id matches REGEX (repeatable; the first match wins); "
                        "default: the sweep's arch name, else one derived from config.json")
    p.set_defaults(fn=_wrap(cmd_collect))

    p = sub.add_parser("fit", help="fit L(N, D) per architecture: fit.json, fit.png, frontier.png")
    p.add_argument("table", help="table from `collect` (.csv or .jsonl); needs N, D and the metric column")
    p.add_argument("--form", default="with-E", help="with-E (E + A/N^alpha + B/D^beta) or no-E (A/N^alpha + B/D^beta)")
    p.add_argument("--metric", default="loss",
                   help="metric column to fit in log space (default loss; e.g. log_longppl)")
    p.add_argument("--out", default=None, help="output directory (default <table dir>/fit-<metric>-<form>)")
    p.add_argument("--arch", action="append", default=None, help="fit only these archs (repeatable)")
    p.add_argument("--rows", choices=("final", "all", "intermediate"), default="final",
                   help="final: one row per finished run (default); all: every converged row (a final row or the "
                        "end of a decay); intermediate: every row, un-decayed WSD rows included (biased)")
    p.add_argument("--bound", action="append", default=[], metavar="NAME=LO:HI",
                   help="parameter bound, e.g. alpha=0.2:0.3 or beta=0: (E, A, B, alpha, beta; repeatable)")
    p.add_argument("--bootstrap", type=int, default=1000, help="bootstrap resamples, by run (0: none)")
    p.add_argument("--seed", type=int, default=0, help="bootstrap seed")
    p.add_argument("--holdout", default="largest", help="largest (the largest N), none, or N>VALUE / N>=VALUE")
    p.add_argument("--flops-per-nd", default="auto",
                   help="k in C = k N D for compute-optimal N*, D*: a number, or auto (median C/(N D) of the "
                        "table's C column, else 6)")
    p.add_argument("--compute", default=None,
                   help="comma-separated C values for N*(C), D*(C) (default: the data's range, x10, x100)")
    p.add_argument("--multistart", choices=("lm", "lbfgsb"), default="lm",
                   help="lm: vectorised grid refinement + L-BFGS-B from the best (fast); lbfgsb: L-BFGS-B from every "
                        "grid point (Epoch's literal procedure, slow)")
    p.add_argument("--loso", action="store_true", help="also leave-one-size-out validation")
    p.add_argument("--exponent-range", default="0.05:1.5", metavar="LO:HI",
                   help="plausible alpha and beta; a fit outside is marked not valid (default 0.05:1.5)")
    p.add_argument("--no-plots", action="store_true")
    p.set_defaults(fn=_wrap(cmd_fit))


    p = sub.add_parser("report", help="markdown report: sweep state + fits per architecture side by side")
    p.add_argument("fit", help="fit.json or the directory holding it")
    p.add_argument("--sweep", default=None, help="sweep root, to add the sweep's state and cost")
    p.add_argument("--out", default=None, help="report path (default <fit dir>/report.md)")
    p.set_defaults(fn=_wrap(cmd_report))


def main(argv=None) -> int:
    """Stand-alone entry (``python -m hybrid_lm.scaling.cli``); ``hybrid-lm`` registers the same commands."""
    ap = argparse.ArgumentParser(prog="hybrid-lm (scaling)")
    sub = ap.add_subparsers(dest="cmd", required=True)
    add_scaling_commands(sub)
    args = ap.parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())

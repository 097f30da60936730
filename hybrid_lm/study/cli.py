"""``hybrid-lm claims ROOT``: a launched study's evaluations recorded, then its claims judged.

    hybrid-lm claims runs/study [--part N] [--max-minutes M]    # evaluate (part N's arms), judge, write
    hybrid-lm claims docs/results/study --no-eval               # judge the rows there are (no GPU)
    hybrid-lm claims runs/study --next-part                     # the first GPU part not yet complete

The claims file is ``configs/sweeps/<study>.claims.toml`` for the sweep named in ROOT/sweep.json, or
``--claims-file``. Writes ``ROOT/claims.json``, ``ROOT/claims.md``, ``ROOT/plots/study_loss.png`` and
``ROOT/plots/noise.png`` (``--out`` elsewhere).
"""

from __future__ import annotations

from pathlib import Path

from hybrid_lm.config import CONFIGS_DIR
from hybrid_lm.errors import ConfigError, WorkdirError
from hybrid_lm.files import atomic_write_json, atomic_write_text
from hybrid_lm.scaling.launch import DONE
from hybrid_lm.scaling.sweep import read_manifest
from hybrid_lm.study import evaluations as E
from hybrid_lm.study import report as R
from hybrid_lm.study.evaluations import is_done, plan
from hybrid_lm.study.runs import require_runs, study_runs
from hybrid_lm.study.spec import load_claims


def claims_file_for(root: Path) -> Path:
    name = read_manifest(root)["name"]
    return CONFIGS_DIR / "sweeps" / f"{name}.claims.toml"


def load_study(root: Path, claims_file: str | Path | None = None):
    """``(spec, runs at the claims' budget, every finished run)`` of the study under ``root``."""
    man = read_manifest(root)
    arms: dict[str, list] = {}
    for j in man["jobs"]:
        arms.setdefault(j["arch"], [])
        if j["seed"] not in arms[j["arch"]]:
            arms[j["arch"]].append(j["seed"])
    path = Path(claims_file) if claims_file else claims_file_for(root)
    if not path.exists():
        raise ConfigError(f"{root}: no claims file {path} for the sweep {man['name']!r}: write one beside the sweep "
                          "file (configs/sweeps/study.claims.toml shows the form) or pass --claims-file")
    spec = load_claims(path, arms)
    runs_all = study_runs(root)
    require_runs(root, runs_all)
    runs = [r for r in runs_all if r.budget == spec.budget]
    seq = {r.seq_len for r in runs}
    if len(seq) > 1:
        raise ConfigError(f"{root}: runs trained at several lengths {sorted(seq)}; the claims compare one T")
    return spec, runs, runs_all


def next_part(root: Path, claims_file=None) -> int:
    """The first GPU part whose runs are not all trained with their evaluations recorded (0: none left)."""
    if not (Path(root) / "sweep.json").exists():
        return 1
    man = read_manifest(root)
    try:
        spec, runs, _ = load_study(root, claims_file)
    except WorkdirError:  # nothing trained yet
        return 1
    evals = plan(spec, runs, root)
    for i in range(1, len(spec.parts) + 1):
        jobs = [j for j in man["jobs"] if spec.in_part(i, j["arch"], j["seed"]) and j["kind"] != "stable"]
        if not all((root / j["name"] / DONE).exists() for j in jobs):
            return i
        if not all(is_done(e) for e in evals if spec.in_part(i, e.run.arch, e.run.seed)):
            return i
    return 0


def part_jobs(root: Path, n: int, claims_file=None) -> str:
    """A regex of part ``n``'s job names (``<scale>-<arch>-<stable|dn...>-seed<k>-<hash>``), for
    ``hybrid-lm sweep --only``."""
    spec = load_claims(Path(claims_file) if claims_file else claims_file_for(root))
    if not 1 <= n <= len(spec.parts):
        raise ConfigError(f"--part-jobs {n}: the study has parts 1 to {len(spec.parts)}")
    alts = [f"{arm}-[^-]+-seed[0-9]+" if seeds is None else f"{arm}-[^-]+-seed({'|'.join(map(str, seeds))})"
            for arm, seeds in spec.parts[n - 1]]
    return f"^[^-]+-({'|'.join(alts)})-[0-9a-f]{{8}}$"


def run_claims(root, claims_file=None, *, part: int | None = None, evaluate: bool = True,
               max_minutes: float | None = None, out=None, printer=print) -> dict:
    """Plan, evaluate (``part``'s arms only, when given; runs whose checkpoints are here), judge, write."""
    root = Path(root)
    if max_minutes is not None and not max_minutes > 0:
        raise ConfigError(f"--max-minutes {max_minutes:g}: must be > 0")
    spec, runs, runs_all = load_study(root, claims_file)
    if part is not None and not 1 <= part <= len(spec.parts):
        raise ConfigError(f"--part {part}: the study has parts 1 to {len(spec.parts)}")
    evals = E.plan(spec, runs, root)
    stats = {"done": 0, "skipped": 0, "left": 0, "failed": {}}
    if evaluate:
        mine = [e for e in evals if e.run.checkpoints and (part is None or spec.in_part(part, e.run.arch, e.run.seed))]
        for name, m in spec.metrics.items():  # next_line tasks are built from the store before they are used
            if m.task == E.NEXT_LINE and any(e.metric == name for e in mine):
                why = E.build_next_line(root, runs, m.eval)
                if why:
                    printer(f"{name}: no next_line task: {why}")
                    mine = [e for e in mine if e.metric != name]
                    stats["failed"][name] = why
        got = E.run_evaluations(mine, max_minutes, printer)
        stats.update(done=got["done"], skipped=got["skipped"], failed={**stats["failed"], **got["failed"]})
    stats["left"] = sum(not E.is_done(e) for e in evals)
    if not evaluate:
        stats["skipped"] = len(evals) - stats["left"]
    doc = R.document(spec, root, runs, runs_all, evals, stats)
    out = Path(out) if out is not None else root
    out.mkdir(parents=True, exist_ok=True)
    command = f"hybrid-lm claims {root}" + ("" if out == root else f" --out {out}")
    atomic_write_json(out / "claims.json", doc, indent=1, default=str)
    atomic_write_text(out / "claims.md", R.format_markdown(doc, command))
    for draw, name in ((lambda: R.plot_study(doc, runs, out / "plots" / "study_loss.png"), "study_loss.png"),
                       (lambda: R.plot_noise(doc, out / "plots" / "noise.png"), "noise.png")):
        try:
            draw()
        except (OSError, ValueError) as e:  # the verdicts are written; a figure that fails says so
            printer(f"plots/{name} not drawn: {' '.join(str(e).split())}")
    doc["out"] = str(out)
    return doc


def cmd_claims(args) -> int:
    root = Path(args.root)
    if args.next_part:
        print(next_part(root, args.claims_file))
        return 0
    if args.part_jobs is not None:
        print(part_jobs(root, args.part_jobs, args.claims_file))
        return 0
    doc = run_claims(root, args.claims_file, part=args.part, evaluate=not args.no_eval,
                     max_minutes=args.max_minutes, out=args.out)
    ev = doc["evaluation_stats"]
    print(f"evaluations: {ev['done']} run now, {ev['skipped']} already recorded, {ev['left']} not recorded, "
          f"{len(ev['failed'])} failed")
    for k, why in ev["failed"].items():
        print(f"  failed {k}: {why}")
    for name, c in doc["claims"].items():
        print(f"{name}: {c['verdict']}  ({c['title']})")
        for p in c["parts"]:
            extra = f"  d = {p['d']:+.4f} ± {p['se']:.4f}" if "d" in p else f"  {p.get('why', '')}"
            print(f"    {p['part']}: {p['verdict']}{extra}")
    print(f"wrote {Path(doc['out']) / 'claims.json'} and {Path(doc['out']) / 'claims.md'}")
    return 1 if ev["failed"] else 0


def add_claims_command(sub) -> None:
    p = sub.add_parser("claims", help="a study: record the evaluations its claims need, judge them (docs/RESULTS.md)",
                       description="Record the evaluations a study's metrics need on its runs (rows in each run's "
                                   "eval.jsonl, skipped when recorded), judge each claim part's difference of arm "
                                   "means against its standard error (seeds and val set), write ROOT/claims.json, "
                                   "ROOT/claims.md and ROOT/plots/. The claims file: "
                                   "configs/sweeps/<study>.claims.toml. Idempotent.")
    p.add_argument("root", help="the study's sweep root (configs/sweeps/study.toml: runs/study), or a copy of its "
                                "results files (docs/results/study) with --no-eval")
    p.add_argument("--claims-file", dest="claims_file", default=None, metavar="FILE",
                   help="the claims file (default configs/sweeps/<study>.claims.toml)")
    p.add_argument("--part", type=int, default=None, metavar="N", help="evaluate only the arms of GPU part N")
    p.add_argument("--next-part", dest="next_part", action="store_true",
                   help="print the first GPU part not yet trained and evaluated (0: the study is complete) and stop")
    p.add_argument("--part-jobs", dest="part_jobs", type=int, default=None, metavar="N",
                   help="print a regex of part N's job names for `hybrid-lm sweep --only` and stop")
    p.add_argument("--out", default=None, metavar="DIR", help="where claims.json, claims.md and plots/ go (default ROOT)")
    p.add_argument("--max-minutes", dest="max_minutes", type=float, default=None, metavar="M",
                   help="start no evaluation after M minutes (the verdicts so far are written)")
    p.add_argument("--no-eval", dest="no_eval", action="store_true", help="run no evaluation: judge the rows there are")
    p.set_defaults(fn=cmd_claims)



"""Sweep specs -> runs: scale x D/N x arch x seed, deterministic run ids, WSD branching, cost estimates.

A spec is a TOML (or JSON) file, ``configs/sweeps/*.toml``; docs/SCALING.md documents every key.
Each (scale, arch) resolves to gin files + bindings, applied in this order: the spec's ``gin``, the
scale's ``gin``, the arch's ``gin``, the spec's ``params``, the scale's ``params``, the arch's
``params``, extra ``--gin_param`` bindings from the command line, then the bindings the sweep computes
(``ModelConfig.d_ff`` when parameter matching, ``TrainConfig.seed``, ``TrainConfig.steps``,
``OptimConfig.decay_fraction``).

**Budgets.** ``budgets`` are D/N ratios (tokens per parameter, N = non-embedding parameters by
default, as in the Rethinking paper). A run trains ``steps = round(ratio N / tokens_per_step)``
steps (at least one); its D is exactly ``steps * tokens_per_step``.

**WSD branching** (``[wsd] branch = true``). A warmup-stable-decay run that decays over the last
fraction ``f`` of its steps is, up to the start of its decay, the same computation for every length:
warmup, then a constant learning rate, on the same step-indexed data. So one *stable* run per
(scale, arch, seed) trains at constant LR (``decay_fraction = 0``) and a *branch* per budget starts
from the stable run's checkpoint at ``s_b = steps - round(f * steps)`` and trains only the decay
phase. The branch is a run directory whose ``checkpoints/`` is seeded with a copy (hard links) of
the stable checkpoint at ``s_b``; the trainer then resumes it as if it had trained those steps
itself. Cost: ``max_b s_b + sum_b (steps_b - s_b)`` steps instead of ``sum_b steps_b``.

**Run ids** are ``<scale>-<arch>-dn<ratio>-seed<k>-<hash8>`` (``-stable-`` for stable runs); the hash
covers the experiment-defining config (``run_id(Config)``), the run length, the run kind and the
branch point, so a changed spec or gin file gives new ids and never reuses a run directory.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import tomllib
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tqdm.auto import tqdm

from hybrid_lm.config import CONFIGS_DIR, decay_steps
from hybrid_lm.data.corpus import train_split_tokens
from hybrid_lm.errors import ConfigError
from hybrid_lm.files import atomic_write_json
from hybrid_lm.experiment import load_config, run_id
from hybrid_lm.model.accounting import count_params, flops_per_token
from hybrid_lm.progress import bar_disabled
from hybrid_lm.scaling.fit import FORMS
from hybrid_lm.scaling.guardrails import design_verdict, runs_for_bootstrap

SCHEMA = "hybrid_lm.sweep/1"
MFU_H200_MEASURED = 0.385  # measured on one H200: 375M GPT, T=16K, bf16, 38.3% / 39.0% MFU (docs/SOURCES.md)
PEAK_FLOPS = 989e12  # H200 dense bf16, the MFU denominator used by the trainer
# more passes over the training data than this gets a warning: repeated tokens start to be worth less
# than fresh ones (Muennighoff et al. 2023, "Scaling Data-Constrained Language Models": up to ~4 epochs
# are about as good as unique data)
PASSES_WARN = 4

_TOP_KEYS = {"name", "description", "root", "gin", "params", "seeds", "budgets", "n_definition", "mfu",
             "peak_flops", "wsd", "param_match", "scales", "archs", "slurm", "equal_tokens"}
_SCALE_KEYS = {"gin", "params", "budgets", "seeds", "description"}
_ARCH_KEYS = {"gin", "params", "mfu", "param_match", "description", "seeds", "budgets"}
_WSD_KEYS = {"branch", "decay_fraction"}
_PM_KEYS = {"enabled", "reference", "d_ff_multiple"}
_SLURM_KEYS = {"partition", "account", "qos", "time", "gpus_per_task", "cpus_per_task", "mem", "max_parallel",
               "setup", "sbatch", "python", "signal_seconds"}


class SweepError(ConfigError):
    """A sweep spec that cannot be expanded; the message names the key, scale or arch."""


# ----------------------------------------------------------------------------- spec

@dataclass
class Spec:
    name: str
    path: str | None
    raw: dict
    gin: list
    params: list
    seeds: list
    budgets: list
    scales: dict  # name -> {"gin": [...], "params": [...], "budgets": [...] | None}
    archs: dict  # name -> {"gin", "params", "mfu": float | None, "param_match": bool, "seeds": [...] | None, "budgets": [...] | None}
    n_definition: str = "non_embedding"
    mfu: float = MFU_H200_MEASURED
    peak_flops: float = PEAK_FLOPS
    branch: bool = True
    decay_fraction: float | None = None
    param_match: bool = False
    reference_arch: str = "full"
    d_ff_multiple: int = 1
    slurm: dict = field(default_factory=dict)
    root: str | None = None
    # every arch at a scale trains the tokens of the reference arch (param_match.reference) at each budget:
    # steps from the reference's N, so architectures of different N see equal D
    equal_tokens: bool = False

    def digest(self) -> str:
        return hashlib.sha256(json.dumps(self.raw, sort_keys=True).encode()).hexdigest()[:12]


def _check_keys(d: dict, allowed: set, where: str) -> None:
    unknown = set(d) - allowed
    if unknown:
        raise SweepError(f"{where}: unknown key(s) {sorted(unknown)}; allowed: {sorted(allowed)}")


def _str_list(v, where: str) -> list[str]:
    if v is None:
        return []
    if isinstance(v, str):
        return [v]
    if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
        raise SweepError(f"{where} must be a list of strings")
    return list(v)


def _num_list(v, where: str, positive: bool = True) -> list:
    if not isinstance(v, list) or not v or not all(isinstance(x, (int, float)) for x in v):
        raise SweepError(f"{where} must be a non-empty list of numbers")
    if positive and any(x <= 0 for x in v):
        raise SweepError(f"{where}: every value must be > 0")
    return list(v)


def _int_list(v) -> bool:
    return isinstance(v, list) and bool(v) and all(isinstance(x, int) and not isinstance(x, bool) for x in v)


def load_spec(path: str | Path) -> Spec:
    """Read and validate a sweep spec (``.toml`` or ``.json``)."""
    p = Path(path)
    if not p.exists():
        cand = CONFIGS_DIR / "sweeps" / p.name
        if p.parent == Path(".") and cand.exists():
            p = cand
        else:
            raise SweepError(f"sweep spec {path} not found")
    if p.suffix not in (".toml", ".json"):
        gin = " (a .gin file is a model config: `hybrid-lm train` / `info` take it)" if p.suffix == ".gin" else ""
        raise SweepError(f"{p}: a sweep spec is a .toml file (see configs/sweeps/, e.g. tiny_cpu.toml) or its "
                         f".json equivalent{gin}")
    fmt = "TOML" if p.suffix == ".toml" else "JSON"
    try:
        raw = tomllib.loads(p.read_text()) if fmt == "TOML" else json.loads(p.read_text())
    except (tomllib.TOMLDecodeError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise SweepError(f"{p}: cannot parse as {fmt} ({e}); sweep specs: see configs/sweeps/") from None
    return spec_from_dict(raw, str(p))


def run_seeds(spec: Spec, scale: str, arch: str) -> list:
    """The seeds of one (scale, arch) cell: the arch's own, else the scale's, else the top-level list (the
    precedence of budgets)."""
    return spec.archs[arch].get("seeds") or spec.scales[scale].get("seeds") or spec.seeds


def spec_from_dict(raw: dict, path: str | None = None) -> Spec:
    where = path or "spec"
    _check_keys(raw, _TOP_KEYS, where)
    if not isinstance(raw.get("name"), str) or not re.fullmatch(r"[A-Za-z0-9_.-]+", raw["name"]):
        raise SweepError(f"{where}: 'name' is required (letters, digits, _ . -)")
    scales_raw, archs_raw = raw.get("scales"), raw.get("archs")
    if not isinstance(scales_raw, dict) or not scales_raw:
        raise SweepError(f"{where}: [scales.<name>] tables are required (at least one)")
    if not isinstance(archs_raw, dict) or not archs_raw:
        raise SweepError(f"{where}: [archs.<name>] tables are required (at least one)")
    scales = {}
    for s, d in scales_raw.items():
        _check_keys(d, _SCALE_KEYS, f"{where}: scales.{s}")
        if "seeds" in d and not _int_list(d["seeds"]):
            raise SweepError(f"{where}: scales.{s}.seeds must be a non-empty list of integers")
        scales[s] = {"gin": _str_list(d.get("gin"), f"scales.{s}.gin"),
                     "params": _str_list(d.get("params"), f"scales.{s}.params"),
                     "budgets": _num_list(d["budgets"], f"scales.{s}.budgets") if "budgets" in d else None,
                     "seeds": list(d["seeds"]) if "seeds" in d else None}
    wsd = raw.get("wsd", {})
    _check_keys(wsd, _WSD_KEYS, f"{where}: wsd")
    pm = raw.get("param_match", {})
    _check_keys(pm, _PM_KEYS, f"{where}: param_match")
    reference = pm.get("reference", "full")
    archs = {}
    for a, d in archs_raw.items():
        _check_keys(d, _ARCH_KEYS, f"{where}: archs.{a}")
        mfu = d.get("mfu")
        if mfu is not None and not 0 < mfu <= 1:
            raise SweepError(f"archs.{a}.mfu={mfu} must be in (0, 1]")
        arch_seeds = d.get("seeds")
        if arch_seeds is not None and not _int_list(arch_seeds):
            raise SweepError(f"{where}: archs.{a}.seeds must be a non-empty list of integers")
        archs[a] = {"gin": _str_list(d.get("gin"), f"archs.{a}.gin"),
                    "params": _str_list(d.get("params"), f"archs.{a}.params"), "mfu": mfu,
                    "param_match": bool(d.get("param_match", a != reference)),
                    "seeds": list(arch_seeds) if arch_seeds is not None else None,
                    "budgets": _num_list(d["budgets"], f"{where}: archs.{a}.budgets") if "budgets" in d else None}
    slurm = raw.get("slurm", {})
    _check_keys(slurm, _SLURM_KEYS, f"{where}: slurm")
    n_def = raw.get("n_definition", "non_embedding")
    if n_def not in ("non_embedding", "total"):
        raise SweepError(f"{where}: n_definition={n_def!r}: choose non_embedding or total")
    df = wsd.get("decay_fraction")
    if df is not None and not 0 < df < 1:
        raise SweepError(f"{where}: wsd.decay_fraction={df} must be in (0, 1)")
    seeds = raw.get("seeds", [0])
    if not _int_list(seeds):
        raise SweepError(f"{where}: seeds must be a non-empty list of integers")
    equal_tokens = raw.get("equal_tokens", False)
    if not isinstance(equal_tokens, bool):
        raise SweepError(f"{where}: equal_tokens={equal_tokens!r} must be true or false")
    mfu = raw.get("mfu", MFU_H200_MEASURED)
    if not 0 < mfu <= 1:
        raise SweepError(f"{where}: mfu={mfu} must be in (0, 1]")
    spec = Spec(
        name=raw["name"], path=path, raw=raw, gin=_str_list(raw.get("gin"), "gin"),
        params=_str_list(raw.get("params"), "params"), seeds=seeds,
        budgets=_num_list(raw.get("budgets"), f"{where}: budgets") if "budgets" in raw else [],
        scales=scales, archs=archs, n_definition=n_def, mfu=mfu, peak_flops=raw.get("peak_flops", PEAK_FLOPS),
        branch=bool(wsd.get("branch", True)), decay_fraction=df, param_match=bool(pm.get("enabled", False)),
        reference_arch=reference, d_ff_multiple=int(pm.get("d_ff_multiple", 1)), slurm=slurm,
        root=raw.get("root"), equal_tokens=equal_tokens)
    for s, d in scales.items():
        if not (d["budgets"] or spec.budgets):
            raise SweepError(f"{where}: no budgets for scale {s} (set top-level 'budgets' or scales.{s}.budgets)")
    if (spec.param_match or spec.equal_tokens) and reference not in archs:
        what = "param_match" if spec.param_match else "equal_tokens"
        raise SweepError(f"{where}: {what} needs the reference arch param_match.reference={reference!r}, which is "
                         f"not one of the archs {sorted(archs)}")
    if spec.d_ff_multiple < 1:
        raise SweepError(f"{where}: param_match.d_ff_multiple must be >= 1")
    return spec


# ----------------------------------------------------------------------------- jobs

@dataclass
class Job:
    name: str  # run id = directory name under the sweep root
    kind: str  # independent | stable | branch
    scale: str
    arch: str
    seed: int
    budget: float | None  # target D/N (None for stable runs)
    gin_files: list
    gin_params: list
    config_run_id: str
    steps: int
    tokens_per_step: int
    N: int  # parameters used for D/N (n_definition)
    N_non_embedding: int
    N_total: int
    D: int  # tokens seen at the end of the run
    flops_per_token: float  # training FLOPs per token (3 x forward, from model/accounting.py)
    train_flops: float  # FLOPs of all D tokens (what an independent run costs)
    trained_flops: float  # FLOPs this job itself trains (a branch: its decay phase only)
    gpu_hours: float  # of trained_flops at the spec's MFU
    mfu: float
    decay_fraction: float
    d_ff: int
    branch_from: dict | None = None  # {"run": stable name, "step": s_b}
    branch_points: list | None = None  # stable: the s_b of its branches, ascending
    branches: list | None = None  # stable: names of its branch runs
    param_match: dict | None = None
    # {"stores": [[path, weight, training-split tokens or None]], "long_min_tokens": n} (data/corpus.py)
    train_data: dict | None = None
    passes: float | None = None  # D / training-split tokens (a mixture: its most repeated store); None: unknown

    def to_dict(self) -> dict:
        return asdict(self)

    @staticmethod
    def from_dict(d: dict) -> "Job":
        return Job(**d)


@dataclass
class Plan:
    spec: Spec
    root: Path
    jobs: list  # Job, launch order: per (scale, arch, seed) the stable run, then its branches
    extra_params: list
    summary: dict

    def job(self, name: str) -> Job:
        for j in self.jobs:
            if j.name == name:
                return j
        raise SweepError(f"no job {name!r} in sweep {self.spec.name}")

    def manifest(self) -> dict:
        return {"schema": SCHEMA, "name": self.spec.name, "spec_path": self.spec.path, "spec": self.spec.raw,
                "spec_digest": self.spec.digest(), "extra_params": self.extra_params,
                "jobs": [j.to_dict() for j in self.jobs], "summary": self.summary}


def _slug(s: str) -> str:
    return re.sub(r"[^a-z0-9_.]+", "_", s.lower()).strip("_")


def _fmt_ratio(r: float) -> str:
    return f"{r:g}"


def run_name(scale: str, arch: str, budget: float | None, seed: int, digest_src: dict) -> str:
    h = hashlib.sha256(json.dumps(digest_src, sort_keys=True).encode()).hexdigest()[:8]
    mid = "stable" if budget is None else f"dn{_fmt_ratio(budget)}"
    return f"{_slug(scale)}-{_slug(arch)}-{mid}-seed{seed}-{h}"


def _resolve_gin(name: str, where: str) -> str:
    """A gin file given relative to configs/ (or a path); a clear error naming the arch/scale if absent."""
    p = Path(name)
    if p.exists():
        return str(p)
    if (CONFIGS_DIR / name).exists():
        return name
    raise SweepError(f"{where} needs gin file {name!r}, which does not exist (looked in {CONFIGS_DIR} and the "
                     f"current directory). Add configs/{name} or remove the arch/scale from the spec.")


def _steps_for(ratio: float, n: int, tps: int) -> int:
    return max(1, int(round(ratio * n / tps)))


def decay_start(steps: int, decay_fraction: float) -> int:
    """First step of the decay phase, as the trainer computes it (``config.wsd_bounds``)."""
    return steps - decay_steps(decay_fraction, steps)


def passes_over(D: int, stores: list) -> float | None:
    """Passes a run of ``D`` tokens makes over its training data: each store of a mixture gets its
    weight's share of ``D``, and the most repeated store counts; None when a store's size is unknown."""
    if not stores or any(t is None or t <= 0 for _, _, t in stores):
        return None
    total = sum(w for _, w, _ in stores)
    return max(D * w / total / t for _, w, t in stores)


def expand(spec: Spec, root: str | Path | None = None, extra_params: list[str] | None = None,
           progress: bool = False) -> Plan:
    """Resolve every (scale, arch) config, match parameters if asked, and lay out the jobs."""

    extra = list(extra_params or [])
    root = Path(root or spec.root or Path("runs") / "sweeps" / spec.name)
    resolved: dict[tuple, dict] = {}
    pairs = [(s, a) for s in spec.scales for a in spec.archs]
    for s, a in tqdm(pairs, desc="resolve configs", disable=bar_disabled(progress), leave=False):
        sd, ad = spec.scales[s], spec.archs[a]
        files = ([_resolve_gin(g, f"sweep {spec.name}: the spec") for g in spec.gin]
                 + [_resolve_gin(g, f"sweep {spec.name}: scale {s!r}") for g in sd["gin"]]
                 + [_resolve_gin(g, f"sweep {spec.name}: arch {a!r}") for g in ad["gin"]])
        params = spec.params + sd["params"] + ad["params"] + extra
        try:
            cfg = load_config(files, params)
            counts = count_params(cfg.model)  # builds the abstract model: mixers check their sizes here
        except ConfigError as e:
            if getattr(e, "binding", None) is not None:
                raise SweepError(_binding_place(spec, s, a, len(extra), e)) from None
            raise SweepError(f"sweep {spec.name}: scale {s!r} x arch {a!r}: {e}") from None
        resolved[(s, a)] = {"files": files, "params": params, "cfg": cfg, "counts": counts}

    def n_of(counts):
        return counts["non_embedding"] if spec.n_definition == "non_embedding" else counts["total"]

    # parameter matching: adjust d_ff so that N equals the reference arch's N at the same scale
    if spec.param_match:
        for s, a in tqdm(pairs, desc="match parameters", disable=bar_disabled(progress), leave=False):
            if a == spec.reference_arch or not spec.archs[a]["param_match"]:
                continue
            r = resolved[(s, a)]
            target = n_of(resolved[(s, spec.reference_arch)]["counts"])
            d_ff, n_new, counts = match_d_ff(r["files"], r["params"], target, r["cfg"].model.d_ff,
                                             spec.d_ff_multiple, n_of)
            before, d_ff_before = n_of(r["counts"]), r["cfg"].model.d_ff
            if d_ff != d_ff_before:
                r["params"] = r["params"] + [f"ModelConfig.d_ff = {d_ff}"]
                r["cfg"] = load_config(r["files"], r["params"])
                r["counts"] = counts
            r["param_match"] = {"reference": spec.reference_arch, "target_N": target, "N_before": before,
                                "N_after": n_of(r["counts"]), "d_ff_before": d_ff_before, "d_ff": d_ff,
                                "rel_diff": (n_of(r["counts"]) - target) / target}

    sizes: dict[tuple, list] = {}  # training-split sizes per data config (manifests, no data read)
    jobs: list[Job] = []
    for s, a in pairs:
        r = resolved[(s, a)]
        cfg, counts = r["cfg"], r["counts"]
        N = n_of(counts)
        # equal_tokens: the steps of each budget come from the reference arch's N (its D), not this arch's
        N_steps = n_of(resolved[(s, spec.reference_arch)]["counts"]) if spec.equal_tokens else N
        d = cfg.data
        key = (d.source, d.path, d.tokenizer, d.mixture)
        if key not in sizes:
            sizes[key] = [list(x) for x in train_split_tokens(d)]
        train_data = {"stores": sizes[key], "long_min_tokens": d.long_min_tokens}
        tps = cfg.train.global_batch * cfg.data.seq_len
        fpt = float(flops_per_token(cfg.model, cfg.data.seq_len)["train"])
        mfu = spec.archs[a]["mfu"] or spec.mfu
        f = spec.decay_fraction if spec.decay_fraction is not None else cfg.optim.decay_fraction
        if spec.branch and not 0 < f < 1:
            raise SweepError(f"sweep {spec.name}: scale {s!r} x arch {a!r}: WSD branching needs a decay fraction "
                             f"in (0, 1), the recipe has {f}; set [wsd] decay_fraction")
        budgets = spec.archs[a]["budgets"] or spec.scales[s]["budgets"] or spec.budgets

        def hours(flops, mfu=mfu):
            return flops / (mfu * spec.peak_flops) / 3600.0

        for seed in run_seeds(spec, s, a):
            base_params = r["params"] + [f"TrainConfig.seed = {seed}"]
            cfg_id = None
            group: list[Job] = []
            for ratio in sorted(set(budgets)):
                steps = _steps_for(ratio, N_steps, tps)
                params = base_params + [f"TrainConfig.steps = {steps}", f"OptimConfig.decay_fraction = {f}"]
                cfg_id = cfg_id or _config_id(r["files"], params)
                kind = "branch" if spec.branch else "independent"
                sb = decay_start(steps, f) if spec.branch else None
                name = run_name(s, a, ratio, seed, {"config": cfg_id, "steps": steps, "kind": kind, "branch_at": sb,
                                                    "decay_fraction": f})
                D = steps * tps
                trained = (steps - sb) * tps * fpt if spec.branch else D * fpt
                group.append(Job(
                    name=name, kind=kind, scale=s, arch=a, seed=seed, budget=ratio, gin_files=r["files"],
                    gin_params=params, config_run_id=cfg_id, steps=steps, tokens_per_step=tps, N=N,
                    N_non_embedding=counts["non_embedding"], N_total=counts["total"], D=D, flops_per_token=fpt,
                    train_flops=D * fpt, trained_flops=trained, gpu_hours=hours(trained), mfu=mfu,
                    decay_fraction=f, d_ff=cfg.model.d_ff,
                    branch_from={"run": None, "step": sb} if spec.branch else None,
                    param_match=r.get("param_match"), train_data=train_data, passes=passes_over(D, sizes[key])))
            if spec.branch:
                points = sorted({j.branch_from["step"] for j in group})
                st_steps = points[-1]
                st_params = base_params + [f"TrainConfig.steps = {st_steps}", "OptimConfig.decay_fraction = 0.0"]
                st_id = _config_id(r["files"], st_params)
                st_name = run_name(s, a, None, seed, {"config": st_id, "kind": "stable", "points": points})
                stable = Job(
                    name=st_name, kind="stable", scale=s, arch=a, seed=seed, budget=None, gin_files=r["files"],
                    gin_params=st_params, config_run_id=st_id, steps=st_steps, tokens_per_step=tps, N=N,
                    N_non_embedding=counts["non_embedding"], N_total=counts["total"], D=st_steps * tps,
                    flops_per_token=fpt, train_flops=st_steps * tps * fpt, trained_flops=st_steps * tps * fpt,
                    gpu_hours=hours(st_steps * tps * fpt), mfu=mfu, decay_fraction=0.0, d_ff=cfg.model.d_ff,
                    branch_points=points, branches=[j.name for j in group], param_match=r.get("param_match"),
                    train_data=train_data, passes=passes_over(st_steps * tps, sizes[key]))
                for j in group:
                    j.branch_from["run"] = st_name
                jobs.append(stable)
            jobs.extend(group)
    plan = Plan(spec=spec, root=root, jobs=jobs, extra_params=extra, summary={})
    plan.summary = summarize(plan)
    return plan


def _binding_place(spec: Spec, scale: str, arch: str, n_extra: int, e: ConfigError) -> str:
    """A bad binding named by where it was written: the spec file and its key (``params``,
    ``scales.<s>.params``, ``archs.<a>.params``), or ``--gin_param``, in the order expand merges them."""
    keys = ([("params", i) for i in range(len(spec.params))]
            + [(f"scales.{scale}.params", i) for i in range(len(spec.scales[scale]["params"]))]
            + [(f"archs.{arch}.params", i) for i in range(len(spec.archs[arch]["params"]))]
            + [("--gin_param", i) for i in range(n_extra)])
    key, i = keys[e.binding]
    where = (f"--gin_param {e.binding_text!r}" if key == "--gin_param"
             else f"{spec.path or 'the spec'}, {key}, item {i + 1} {e.binding_text!r}")
    return f"sweep {spec.name}: {where}: {e.reason}"


def _config_id(files, params) -> str:
    return run_id(load_config(files, params))


def match_d_ff(files, params, target: int, d_ff0: int, multiple: int, n_of) -> tuple[int, int, dict]:
    """The d_ff (a multiple of ``multiple``) whose N is closest to ``target``; N is affine in d_ff."""
    cache: dict[int, dict] = {}

    def counts(d):
        if d not in cache:
            cache[d] = count_params(load_config(files, params + [f"ModelConfig.d_ff = {d}"]).model)
        return cache[d]

    d0 = max(multiple, (d_ff0 // multiple) * multiple)
    n0, n1 = n_of(counts(d0)), n_of(counts(d0 + multiple))
    slope = (n1 - n0) / multiple
    if slope <= 0:
        raise SweepError("parameter matching: N does not grow with d_ff for this config")
    est = d0 + (target - n0) / slope
    best = None
    for cand in {max(multiple, int(math.floor(est / multiple)) * multiple + k * multiple) for k in (-1, 0, 1, 2)}:
        n = n_of(counts(cand))
        if best is None or abs(n - target) < abs(best[1] - target):
            best = (cand, n)
    d, n = best
    if d <= multiple and n > target:
        raise SweepError(f"parameter matching: even d_ff={d} gives N={n:,} > target {target:,}; the efficient "
                         "mixer alone has more parameters than the reference layer budget")
    return d, n, counts(d)


def summarize(plan: Plan) -> dict:
    """FLOPs and GPU-hours: as planned (branched or not) and as independent runs; the saving."""
    jobs = plan.jobs
    budget_jobs = [j for j in jobs if j.kind != "stable"]
    indep_flops = sum(j.train_flops for j in budget_jobs)
    indep_hours = sum(j.train_flops / (j.mfu * plan.spec.peak_flops) / 3600 for j in budget_jobs)
    planned_flops = sum(j.trained_flops for j in jobs)
    planned_hours = sum(j.gpu_hours for j in jobs)
    # what branching would cost if the plan is independent (always shown)
    if plan.spec.branch:
        br_flops, br_hours = planned_flops, planned_hours
    else:
        br_flops = br_hours = 0.0
        groups: dict[tuple, list] = {}
        for j in budget_jobs:
            groups.setdefault((j.scale, j.arch, j.seed), []).append(j)
        f_override = plan.spec.decay_fraction
        for g in groups.values():
            f = f_override if f_override is not None else g[0].decay_fraction
            sbs = [decay_start(j.steps, f) for j in g]
            per_step = g[0].tokens_per_step * g[0].flops_per_token
            fl = (max(sbs) + sum(j.steps - sb for j, sb in zip(g, sbs))) * per_step
            br_flops += fl
            br_hours += fl / (g[0].mfu * plan.spec.peak_flops) / 3600
    per_scale: dict[str, dict] = {}
    for j in jobs:
        d = per_scale.setdefault(j.scale, {"runs": 0, "flops": 0.0, "gpu_hours": 0.0})
        d["runs"] += 1
        d["flops"] += j.trained_flops
        d["gpu_hours"] += j.gpu_hours
    return {
        "jobs": len(jobs), "budget_runs": len(budget_jobs), "stable_runs": sum(j.kind == "stable" for j in jobs),
        "branching": plan.spec.branch, "planned_flops": planned_flops, "planned_gpu_hours": planned_hours,
        "independent_flops": indep_flops, "independent_gpu_hours": indep_hours,
        "branched_flops": br_flops, "branched_gpu_hours": br_hours,
        "branching_saving": 1.0 - br_flops / indep_flops if indep_flops else 0.0,
        "per_scale": per_scale, "mfu": plan.spec.mfu, "peak_flops": plan.spec.peak_flops,
    }


def format_plan(plan: Plan) -> str:
    """The ``--dry-run`` table."""
    lines = []
    sp = plan.spec
    per_cell = {len(run_seeds(sp, s, a)) for s in sp.scales for a in sp.archs}
    seeds = sorted({x for s in sp.scales for a in sp.archs for x in run_seeds(sp, s, a)})
    lines.append(f"sweep {sp.name}: {len(sp.scales)} scales x {len(sp.archs)} archs x {len(seeds)} seed(s)"
                 + (f" (some cells {min(per_cell)})" if len(per_cell) > 1 else "")
                 + f"; root {plan.root}")
    if sp.equal_tokens:
        lines.append(f"equal tokens: every arch trains the D of {sp.reference_arch!r} at each budget (D/N is the "
                     "reference's; each arch's own D/N is D / its N)")
    lines.append(f"N = {sp.n_definition.replace('_', '-')} parameters; GPU-hours on one H200 at "
                 f"{sp.mfu:.1%} MFU of {sp.peak_flops / 1e12:.0f} TFLOP/s (measured anchor; per-arch overrides "
                 f"in the spec); FLOPs = 3 x forward incl. attention and LM head")
    if sp.branch:
        lines.append("WSD branching: one constant-LR stable run per (scale, arch, seed); each budget decays from "
                     "its checkpoint ('from' = branch step); FLOPs / GPU-h count only what each job trains")
    lines.append("passes = D / the training split's tokens (a branch's D includes its stable phase; ? = size "
                 "unknown)")
    hdr = (f"{'run':<44}{'kind':<12}{'N':>9}{'N_tot':>9}{'D/N':>7}{'D':>10}{'passes':>9}{'steps':>8}{'from':>8}"
           f"{'FLOPs':>11}{'GPU-h':>9}")
    lines.append(hdr)
    lines.append("-" * len(hdr))
    for j in plan.jobs:
        frm = str(j.branch_from["step"]) if j.branch_from else ""
        pm = ""
        if j.param_match and j.kind != "stable":
            pm = f"  d_ff {j.d_ff} (N {100 * j.param_match['rel_diff']:+.3f}% vs {j.param_match['reference']})"
        lines.append(f"{j.name:<44}{j.kind:<12}{_h(j.N):>9}{_h(j.N_total):>9}"
                     f"{'' if j.budget is None else _fmt_ratio(j.budget):>7}{_h(j.D):>10}{_passes(j.passes):>9}"
                     f"{j.steps:>8}{frm:>8}"
                     f"{j.trained_flops:>11.3g}{_hours(j.gpu_hours):>9}{pm}")
    s = plan.summary
    lines.append("")
    lines.append(f"{'scale':<10}{'jobs':>6}{'FLOPs':>12}{'GPU-h':>10}")
    for sc, d in s["per_scale"].items():
        lines.append(f"{sc:<10}{d['runs']:>6}{d['flops']:>12.3g}{_hours(d['gpu_hours']):>10}")
    lines.append("")
    lines.append(f"total: {s['jobs']} jobs ({s['budget_runs']} budget runs, {s['stable_runs']} stable); "
                 f"{s['planned_flops']:.3g} FLOPs, {_hours(s['planned_gpu_hours'])} H200 GPU-hours as planned")
    lines.append(f"independent runs: {s['independent_flops']:.3g} FLOPs, {_hours(s['independent_gpu_hours'])} GPU-h;  "
                 f"WSD branching: {s['branched_flops']:.3g} FLOPs, {_hours(s['branched_gpu_hours'])} GPU-h;  "
                 f"saving {s['branching_saving']:.1%}")
    lines += data_lines(plan.jobs)
    warning = passes_warning(plan.jobs)
    return "\n".join(lines + ([warning] if warning else []))


def _passes(p: float | None) -> str:
    if p is None:
        return "?"
    return f"{p:,.0f}" if p >= 100 else f"{p:.3g}"


def data_lines(jobs: list) -> list[str]:
    """The training data the jobs' passes are counted against, one line per distinct data."""
    lines, seen = [], set()
    for j in jobs:
        td = j.train_data
        key = json.dumps(td, sort_keys=True)
        if not td or key in seen:
            continue
        seen.add(key)
        parts = []
        for path, w, t in td["stores"]:
            size = (f"{t:,} training-split tokens" if t is not None else
                    "size unknown (no prepared store there yet: `hybrid-lm data prepare --out` it first)")
            parts.append(path + (f" (weight {w:g})" if len(td["stores"]) > 1 else "") + f": {size}")
        line = "training data: " + "; ".join(parts)
        if len(td["stores"]) > 1:
            line += "; passes count the most repeated store"
        if td.get("long_min_tokens"):
            line += (f"; long/short mixing at {td['long_min_tokens']:,} tokens: passes are averages over the split, "
                     "its smaller part repeats more often")
        lines.append(line)
    return lines


def passes_warning(jobs: list) -> str | None:
    """One line when a job passes over its training data more than :data:`PASSES_WARN` times."""
    over = [j for j in jobs if j.passes is not None and j.passes > PASSES_WARN]
    if not over:
        return None
    worst = max(over, key=lambda j: j.passes)
    return (f"warning: {len(over)} of {len(jobs)} jobs pass over their training data more than {PASSES_WARN} times "
            f"(up to {_passes(worst.passes)}: {worst.name}); prepare a larger store (`hybrid-lm data prepare ... "
            "--out DIR`) and plan on it: --gin_param \"DataConfig.source = 'tokens'\" "
            "--gin_param \"DataConfig.path = 'DIR'\"")


def format_passes(jobs: list) -> list[str]:
    """Per job, D and the passes over its training data (what a launch prints before it starts)."""
    lines = [f"{'run':<44}{'D':>10}{'passes':>10}   (D / the training split's tokens; ? = size unknown)"]
    lines += [f"{j.name:<44}{_h(j.D):>10}{_passes(j.passes):>10}" for j in jobs]
    return lines + data_lines(jobs)


def next_steps(plan: Plan, jobs: list | None = None) -> list[str]:
    """The commands that turn the finished ``jobs`` (default: the plan's) into a table, fits and a
    report, with a fit form the design can identify, judged as ``fit`` will judge it before seeing a loss
    (:func:`hybrid_lm.scaling.guardrails.design_verdict`): with-E (5 parameters) where the design leaves it a
    degree of freedom and a run bootstrap that determines it (about 9 runs at distinct (N, D)), else no-E
    (4; about 7 runs), else no-E without the bootstrap (``--bootstrap 0``: too few runs to resample, no
    CIs); with exactly 4 points no-E is fitted but marked not valid. Returns shell lines; a line starting
    with '#' explains instead of running."""
    root = plan.root
    jobs = [j for j in (jobs if jobs is not None else plan.jobs) if j.kind != "stable"]
    by_arch: dict[str, list] = {}
    for j in jobs:
        by_arch.setdefault(j.arch, []).append(j)

    def verdict(form: str, n_boot: int = 1000) -> list[str] | None:
        """fit's design reasons over every arch (None: some arch cannot be fitted in this form)."""
        out: list[str] = []
        for js in by_arch.values():
            v = design_verdict([j.N for j in js], [j.D for j in js], [j.name for j in js], form, n_boot=n_boot)
            if v is None:
                return None
            out += [r for r in v if r not in out]
        return out

    fewest = min((len({(j.N, j.D) for j in js}) for js in by_arch.values()), default=0)
    runs = min((len(js) for js in by_arch.values()), default=0)
    lines = [f"hybrid-lm collect {root}"]
    with_e, no_e = len(FORMS["with-E"].theta), len(FORMS["no-E"].theta)
    v_with, v_no = (verdict("with-E"), verdict("no-E")) if by_arch else (None, None)
    if v_with == []:
        form = ""
    elif v_no == []:
        form = " --form no-E"
        why = v_with[0] if v_with else f"too few for its {with_e} parameters"
        lines.append(f"# {fewest} distinct (N, D) points from {runs} runs per arch: with-E would not be valid "
                     f"({why}), so no-E")
    elif v_no is not None and verdict("no-E", n_boot=0) == []:
        form = " --form no-E --bootstrap 0"
        lines.append(f"# no-E without a bootstrap (no CIs): a bootstrap over {runs} runs per arch marks every form not "
                     f"valid ({v_no[0]}). About {runs_for_bootstrap('no-E')} runs per arch at distinct (N, D) give "
                     f"no-E CIs, {runs_for_bootstrap('with-E')} with-E")
    elif v_no is not None:
        form = " --form no-E"
        lines.append(f"# {fewest} distinct (N, D) points per arch: too few for with-E ({with_e} parameters), so no-E"
                     + ("; with exactly 4 no degree of freedom is left and the fit is marked not valid"
                        if fewest == no_e else ""))
    elif fewest >= no_e:  # enough points, but all at one model size or one token count
        one = "model size" if any(len({j.N for j in js}) < 2 for js in by_arch.values()) else "token count"
        return lines + [f"# {fewest} distinct (N, D) points per arch, but at one {one}: no L(N, D) form can be "
                        f"fitted; add {'scales' if one == 'model size' else 'budgets'} to the spec"]
    else:
        return lines + [f"# {fewest} distinct (N, D) points per arch: too few for any L(N, D) form (no-E needs "
                        f"{no_e}); add budgets or scales to the spec"]
    lines.append(f"hybrid-lm fit {root / 'table.csv'}{form} --out {root / 'fit'}")
    lines.append(f"hybrid-lm report {root / 'fit'} --sweep {root}")
    return lines


def _hours(x: float) -> str:
    return f"{x:,.1f}" if x >= 0.1 else f"{x:.2g}"


def _h(x: float) -> str:
    for unit, div in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(x) >= div:
            return f"{x / div:.3g}{unit}"
    return f"{x:g}"


# ----------------------------------------------------------------------------- manifest

def write_manifest(plan: Plan) -> Path:
    """Write ``sweep.json``; refuse (``SweepError``) when the root's manifest lists a launched job that
    this plan no longer has: the sweep now resolves to other runs (other data, parameters or gin
    files), so its old runs must not be marked done or described by a manifest that never launched
    them. Jobs may be added (more seeds, budgets, archs)."""
    plan.root.mkdir(parents=True, exist_ok=True)
    path = plan.root / "sweep.json"
    if path.exists():
        check_relaunch(plan, json.loads(path.read_text()))
    return atomic_write_json(path, plan.manifest(), indent=1, default=str)


def check_relaunch(plan: Plan, old: dict) -> None:
    new = {j.name for j in plan.jobs}
    gone = [j for j in old.get("jobs", []) if j["name"] not in new and (plan.root / j["name"]).exists()]
    if not gone:
        return
    by_key = {(j.scale, j.arch, j.seed, j.budget): j for j in plan.jobs}
    j = gone[0]
    now = by_key.get((j["scale"], j["arch"], j["seed"], j["budget"]))
    why = (f"run {j['name']} was config {j['config_run_id']}, the same (scale, arch, seed, budget) now resolves to "
           f"config {now.config_run_id}" if now else f"run {j['name']} ({j['scale']}, {j['arch']}) is not in the sweep now")
    raise SweepError(f"{plan.root} holds {len(gone)} launched run(s) of this sweep that it no longer resolves to "
                     f"({why}: the data, parameters or gin files changed). Launch it into another --root; "
                     f"the old runs and sweep.json are left as they are")


def read_manifest(root: str | Path) -> dict:
    path = Path(root) / "sweep.json"
    if not path.exists():
        raise SweepError(f"{root} holds no sweep.json: launch the sweep first (hybrid-lm sweep SPEC --launch ...)")
    return json.loads(path.read_text())


def manifest_jobs(root: str | Path) -> list[Job]:
    return [Job.from_dict(d) for d in read_manifest(root)["jobs"]]

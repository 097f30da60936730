"""The claims file (``configs/sweeps/<study>.claims.toml``): what a study measures and what it claims.

Top-level keys: ``sweep`` (the sweep file, relative to the claims file), ``budget`` (the D/N the claims
compare), ``k`` (standard errors a difference must clear), ``margin`` (nats a ``close`` part allows),
``parts`` (the study's GPU parts: lists of arms or ``"arm:seeds"``, in order), ``[metrics.<name>]`` and ``[claims.<name>]``.

A metric is one number per run: ``loss`` is the trainer's final eval; any other has an ``eval`` table,
the evaluation that records it (``task`` = ``loss``, ``next_line``, ``longppl`` or ``ruler``, with its settings), and
``arms`` (a list of arms or ``"arm:seeds"``, or ``"all"``) it is recorded on. A claim has a ``title`` and either ``parts`` (each
``{part, statement, d, predict[, margin]}``: ``d`` a sum of ``arm.metric`` terms, ``predict`` ``greater``
or ``close``), ``untested`` (the reason this study cannot test it) or ``report`` (a metric reported per arm,
no direction claimed). Every error is one line naming the file and the key.
"""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from hybrid_lm.errors import ConfigError

TASKS = ("loss", "next_line", "longppl", "ruler")
PREDICTS = ("greater", "close")
_TOP = {"sweep", "budget", "k", "margin", "parts", "metrics", "claims"}
_METRIC = {"what", "eval", "arms"}
_EVAL = {"loss": {"task", "swaps", "seq_len"},
         "next_line": {"task", "swaps", "prefill_only", "items", "context"},
         "longppl": {"task", "evaluator", "trunc_len", "window", "docs"},
         "ruler": {"task", "tasks", "samples", "length"}}
_CLAIM = {"title", "parts", "untested", "report"}
_PART = {"part", "statement", "d", "predict", "margin"}
_TERM = re.compile(r"\s*([+-])?\s*([A-Za-z0-9_]+)\.([A-Za-z0-9_]+)\s*")
TRAIN_METRIC = "loss"


@dataclass(frozen=True)
class Metric:
    name: str
    what: str
    eval: dict | None = None  # None: the trainer's final eval (``loss``)
    arms: tuple | str = "all"  # ((arm, seeds or None), ...) it is recorded on, or "all" (every run)

    def on(self, arm: str, seed: int | None = None) -> bool:
        """Recorded on ``arm`` (its seed ``seed``; None: any of its seeds)."""
        return self.arms == "all" or any(a == arm and (seed is None or seeds is None or seed in seeds)
                                         for a, seeds in self.arms)

    @property
    def task(self) -> str:
        return "loss" if self.eval is None else self.eval["task"]


@dataclass(frozen=True)
class Part:
    claim: str
    part: str
    statement: str
    terms: tuple  # ((coefficient, arm, metric), ...)
    predict: str
    margin: float
    d: str  # the expression as written

    @property
    def arms(self) -> tuple:
        return tuple(dict.fromkeys(a for _, a, _ in self.terms))

    @property
    def metrics(self) -> tuple:
        return tuple(dict.fromkeys(m for _, _, m in self.terms))


@dataclass(frozen=True)
class Claim:
    name: str
    title: str
    parts: tuple = ()
    untested: str | None = None
    report: str | None = None  # a metric reported per arm


@dataclass(frozen=True)
class ClaimsSpec:
    path: Path
    sweep: Path
    budget: float
    k: float
    margin: float
    parts: tuple  # (((arm, seeds or None), ...), ...): the study's GPU parts (None: every seed of the arm)
    metrics: dict = field(default_factory=dict)  # name -> Metric
    claims: dict = field(default_factory=dict)  # name -> Claim
    text: str = ""  # the file as read (claims.json keeps it)

    @property
    def arms(self) -> tuple:
        return tuple(dict.fromkeys(a for p in self.parts for a, _ in p))

    def in_part(self, n: int, arm: str, seed: int) -> bool:
        """Whether GPU part ``n`` (1-based) trains ``arm``'s seed ``seed``."""
        return any(a == arm and (seeds is None or seed in seeds) for a, seeds in self.parts[n - 1])

    def parts_of(self, arm: str) -> list[int]:
        return [i for i, p in enumerate(self.parts, 1) if any(a == arm for a, _ in p)]


def parse_d(expr: str, where: str) -> tuple:
    """``"a.loss - b.loss"`` -> ``((1.0, "a", "loss"), (-1.0, "b", "loss"))``."""
    if not isinstance(expr, str) or not expr.strip():
        raise ConfigError(f"{where}: d must be a sum of arm.metric terms, e.g. 'sa128.loss - swa128.loss'")
    terms, pos = [], 0
    while pos < len(expr):
        m = _TERM.match(expr, pos)
        if m is None or (terms and m.group(1) is None) or m.end() == pos:
            raise ConfigError(f"{where}: d = {expr!r}: cannot read it from {expr[pos:]!r} (a sum of arm.metric "
                              "terms joined by + or -)")
        terms.append((-1.0 if m.group(1) == "-" else 1.0, m.group(2), m.group(3)))
        pos = m.end()
    return tuple(terms)


def _keys(d, allowed: set, where: str) -> None:
    if not isinstance(d, dict):
        raise ConfigError(f"{where}: expected a table, got {type(d).__name__}")
    bad = sorted(set(d) - allowed)
    if bad:
        raise ConfigError(f"{where}: unknown key {bad[0]!r} (allowed: {', '.join(sorted(allowed))})")


def _number(v, where: str, *, positive: bool = True) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (positive and not v > 0):
        raise ConfigError(f"{where} = {v!r}: must be a number{' > 0' if positive else ''}")
    return float(v)


def _metric(name: str, d: dict, where: str) -> Metric:
    _keys(d, _METRIC, where)
    what = d.get("what")
    if not isinstance(what, str) or not what:
        raise ConfigError(f"{where}.what: say what the number is")
    ev = d.get("eval")
    if name == TRAIN_METRIC:
        if ev is not None or "arms" in d:
            raise ConfigError(f"{where}: 'loss' is the trainer's final eval of every arm: it takes no eval or arms")
        return Metric(name, what)
    if ev is None:
        raise ConfigError(f"{where}: a metric other than 'loss' needs an eval table (task = one of {', '.join(TASKS)})")
    if not isinstance(ev, dict) or ev.get("task") not in TASKS:
        raise ConfigError(f"{where}.eval: task must be one of {', '.join(TASKS)}")
    _keys(ev, _EVAL[ev["task"]], f"{where}.eval")
    swaps = ev.get("swaps", [])
    if not isinstance(swaps, list) or not all(isinstance(s, str) for s in swaps):
        raise ConfigError(f"{where}.eval.swaps: a list of swap strings (hybrid-lm eval --swap)")
    if "tasks" in ev and not (isinstance(ev["tasks"], list) and ev["tasks"] and all(isinstance(t, str) for t in ev["tasks"])):
        raise ConfigError(f"{where}.eval.tasks: a list of RULER task names")
    for key in ("seq_len", "items", "context", "trunc_len", "window", "docs", "samples", "length"):
        if key in ev and (isinstance(ev[key], bool) or not isinstance(ev[key], int) or ev[key] < 1):
            raise ConfigError(f"{where}.eval.{key} = {ev[key]!r}: must be an integer >= 1")
    if ev["task"] == "ruler":
        from hybrid_lm.eval.ruler_items import LL_TASKS, TASKS as RULER_TASKS  # scipy, numpy: only a RULER metric needs them
        for t in ev.get("tasks", ()):  # none named: every task runs, and those with distractors are scored
            if t not in RULER_TASKS:
                raise ConfigError(f"{where}.eval.tasks: unknown RULER task {t!r} (one of {', '.join(RULER_TASKS)})")
            if t not in LL_TASKS:
                raise ConfigError(f"{where}.eval.tasks: {t}'s items have no distractors, so the metric (the gold "
                                  f"answer above every distractor) has no value; use one of {', '.join(sorted(LL_TASKS))}")
    if ev["task"] == "longppl":
        parse_member(ev.get("evaluator", "full"), f"{where}.eval.evaluator")
    if ev.get("prefill_only") and not swaps:
        raise ConfigError(f"{where}.eval: prefill_only needs swaps (what the context is prefilled with)")
    arms = d.get("arms")
    if arms != "all" and not (isinstance(arms, list) and arms and all(isinstance(a, str) for a in arms)):
        raise ConfigError(f"{where}.arms: a list of arms (or 'arm:seeds') or \"all\"")
    return Metric(name, what, dict(ev), "all" if arms == "all" else
                  tuple(parse_member(a, f"{where}.arms") for a in arms))


def parse_member(text, where: str) -> tuple:
    """A part's member: ``"arm"`` (every seed) or ``"arm:3"`` / ``"arm:0,1,2"`` (those seeds)."""
    m = re.fullmatch(r"([A-Za-z0-9_]+)(?::(\d+(?:,\d+)*))?", text) if isinstance(text, str) else None
    if m is None:
        raise ConfigError(f"{where}: {text!r}: a part member is an arm, or an arm and its seeds as 'arm:0,1'")
    return m.group(1), (tuple(int(x) for x in m.group(2).split(",")) if m.group(2) else None)


def _check_parts(parts: tuple, arms, where: str) -> None:
    """Every arm of the sweep in the parts; an arm in several parts names disjoint seeds in each, and together
    they are its seeds (``arms``: the sweep's arms, or a mapping arm -> its seeds)."""
    by_arm: dict[str, list] = {}
    for p in parts:
        for arm, seeds in p:
            by_arm.setdefault(arm, []).append(seeds)
    for arm, lists in by_arm.items():
        if len(lists) > 1 and any(x is None for x in lists):
            raise ConfigError(f"{where}: parts: arm {arm!r} is in two parts: name its seeds in each ('{arm}:0,1')")
        flat = [s for x in lists if x for s in x]
        if len(set(flat)) < len(flat):
            raise ConfigError(f"{where}: parts: a seed of {arm!r} is in two parts")
        if isinstance(arms, dict) and arm in arms and flat and not set(arms[arm]) <= set(flat):
            raise ConfigError(f"{where}: parts: {arm!r} seed {min(set(arms[arm]) - set(flat))} of the sweep is in no "
                              f"part (the parts name {sorted(flat)})")
    if arms is not None and set(by_arm) != set(arms):
        miss, extra = sorted(set(arms) - set(by_arm)), sorted(set(by_arm) - set(arms))
        raise ConfigError(f"{where}: parts must hold the sweep's arms exactly: "
                          + (f"missing {', '.join(miss)}" if miss else f"not in the sweep: {', '.join(extra)}"))


def load_claims(path: str | Path, arms=None) -> ClaimsSpec:
    """The claims file at ``path``; ``arms`` (the sweep's arms, or a mapping arm -> seeds, when known) must be
    exactly the parts' arms."""
    p = Path(path)
    try:
        text = p.read_text()
        raw = tomllib.loads(text)
    except OSError as e:
        raise ConfigError(f"claims file {p}: cannot read it ({e.strerror or e})") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"claims file {p}: not TOML ({' '.join(str(e).split())})") from None
    w = f"claims file {p}"
    _keys(raw, _TOP, w)
    if not isinstance(raw.get("sweep"), str):
        raise ConfigError(f"{w}: sweep = the sweep file beside it, e.g. 'study.toml'")
    parts = raw.get("parts")
    if not (isinstance(parts, list) and parts and all(isinstance(x, list) and x for x in parts)):
        raise ConfigError(f"{w}: parts = a list of lists of arms (the study's GPU parts)")
    parts = tuple(tuple(parse_member(a, f"{w}: parts") for a in x) for x in parts)
    _check_parts(parts, arms, w)
    flat = [a for x in parts for a, _ in x]
    metrics_raw = raw.get("metrics", {})
    _keys(metrics_raw, set(metrics_raw), f"{w}: metrics")
    metrics = {n: _metric(n, d, f"{w}: metrics.{n}") for n, d in metrics_raw.items()}
    if TRAIN_METRIC not in metrics:
        raise ConfigError(f"{w}: [metrics.loss] is required (the trainer's final eval)")
    for m in metrics.values():
        unknown = [a for a, _ in (() if m.arms == "all" else m.arms) if a not in flat]
        if unknown:
            raise ConfigError(f"{w}: metrics.{m.name}.arms: {unknown[0]!r} is in no part")
    margin = _number(raw.get("margin", 0.02), f"{w}: margin")
    claims = {}
    for name, c in (raw.get("claims") or {}).items():
        cw = f"{w}: claims.{name}"
        _keys(c, _CLAIM, cw)
        if not isinstance(c.get("title"), str):
            raise ConfigError(f"{cw}: title is required")
        kinds = [k for k in ("parts", "untested", "report") if k in c]
        if len(kinds) != 1:
            raise ConfigError(f"{cw}: give exactly one of parts, untested, report")
        if "untested" in c:
            claims[name] = Claim(name, c["title"], untested=str(c["untested"]))
            continue
        if "report" in c:
            if c["report"] not in metrics:
                raise ConfigError(f"{cw}.report: no metric {c['report']!r}")
            claims[name] = Claim(name, c["title"], report=c["report"])
            continue
        if not isinstance(c["parts"], list) or not c["parts"]:
            raise ConfigError(f"{cw}.parts: a list of parts")
        out = []
        for i, pd in enumerate(c["parts"], 1):
            pw = f"{cw}.parts[{i}]"
            _keys(pd, _PART, pw)
            for key in ("part", "statement", "d", "predict"):
                if not isinstance(pd.get(key), str):
                    raise ConfigError(f"{pw}: {key} is required")
            if pd["predict"] not in PREDICTS:
                raise ConfigError(f"{pw}.predict = {pd['predict']!r}: choose {' or '.join(PREDICTS)}")
            terms = parse_d(pd["d"], f"{pw}.d")
            for _, arm, metric in terms:
                if arm not in flat:
                    raise ConfigError(f"{pw}.d: arm {arm!r} is in no part")
                if metric not in metrics:
                    raise ConfigError(f"{pw}.d: no metric {metric!r} (define [metrics.{metric}])")
                if not metrics[metric].on(arm):
                    raise ConfigError(f"{pw}.d: metric {metric!r} is not recorded on {arm!r} (its arms)")
            out.append(Part(name, pd["part"], pd["statement"], terms, pd["predict"],
                            _number(pd.get("margin", margin), f"{pw}.margin"), pd["d"]))
        claims[name] = Claim(name, c["title"], tuple(out))
    return ClaimsSpec(path=p, sweep=(p.parent / raw["sweep"]), budget=_number(raw.get("budget"), f"{w}: budget"),
                      k=_number(raw.get("k", 2.0), f"{w}: k"), margin=margin,
                      parts=parts, metrics=metrics, claims=claims, text=text)

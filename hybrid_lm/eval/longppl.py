"""LongPPL (Fang et al., ICLR 2025; PKU-ML/LongPPL at 1decd2a): perplexity on the tokens that need long
context.

An *evaluator* model marks the key tokens of each document (``longppl/longppl.py`` find_key_token):
token i is key iff

    NLL_short(i) - NLL_full(i) > alpha    (long context lowers its loss by more than alpha nats)
    NLL_full(i) < -beta                   (and the evaluator predicts it well with the full context)

NLL_full comes from one pass over the whole document; NLL_short from passes over windows
``[s, s + K + W)`` for ``s = 0, W, 2W, ...`` while ``s < T - K``, each scoring its targets
``[s + K, s + K + W)``, which so see K to K + W - 1 tokens of context. The first K tokens are never
key. The evaluated model's LongPPL is ``exp(mean NLL_full over the key tokens)``; over documents,
the key-token-weighted mean (``exp(sum NLL / sum n_key)``), and PPL the token-weighted mean of the
documents' log perplexities (``perplexity/perplexity.py``). Defaults are the paper's: K = 4096,
W = 1024, alpha = 2, beta = -2.

Documents (``inputs="documents"``, default; ``perplexity/run_ppl.sh``: 50 GovReport documents of at
least 16,384 tokens, cut at 32,767): the first ``docs`` (50) whole documents of the val split of
``data`` (a prepared token store) or of the run's own store that hold at least ``min_tokens``
(16,384, at most the length) tokens, each cut to ``length`` (32,767, at most the run's seq_len + 1)
and, above ``min_tokens``, down to a whole number of windows W past it (so documents share a few
shapes). ``inputs="windows"``: the run's fixed validation windows, which cross document boundaries.

Evaluator (``evaluator``): the official protocol fixes one strong model; here the default is the
run's newest checkpoint (``newest``: the same key tokens for every checkpoint of the run), a run
directory names another (a stronger run of the same tokenizer), and ``self`` lets each checkpoint
judge itself: then every key token has NLL < -beta, so LongPPL < e^2 ~ 7.39 by construction, and a
model that uses little context shows up as *fewer* key tokens. The evaluator's key masks are cached
in its run directory (``longppl_keys/``, keyed by its checkpoint, the documents and the rule), so
every checkpoint compared against one evaluator is scored on the same tokens. Key tokens are
positions in the run's tokenisation, so evaluator and evaluated model must share the tokenizer
(checked).
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import math
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from hybrid_lm.data.store import TokenStore
from hybrid_lm.errors import ConfigError, DataError
from hybrid_lm.experiment import run_id
from hybrid_lm.files import atomic_write
from hybrid_lm.model.registry import MixerContext
from hybrid_lm.ops.attention import default_positions
from hybrid_lm.progress import bar_disabled
from hybrid_lm.run.directory import checkpoint_steps, load_run_config
from hybrid_lm.run.restore import RestoredRun
from hybrid_lm.run.swap import swapped_config
from hybrid_lm.step import ModelFns

DOCS = 50  # run_ppl.sh: --samples 50
MIN_TOKENS = 16384  # run_ppl.sh: --dataset-min-tokens 16384
MAX_TOKENS = 32767  # perplexity.py: x[0:max_length - 1], --max-length 32768
INPUTS = ("documents", "windows")


@dataclasses.dataclass(frozen=True)
class KeyTokenRule:
    trunc_len: int = 4096  # K: the short context
    window: int = 1024  # W: targets scored per short-context pass
    alpha: float = 2.0
    beta: float = -2.0

    def validate(self, length: int) -> None:
        if self.trunc_len < 1 or self.window < 1:
            raise ValueError(f"trunc_len ({self.trunc_len}) and window ({self.window}) must be >= 1")
        if length <= self.trunc_len + 1:
            raise ValueError(f"documents of {length} tokens leave no token beyond the short context "
                             f"trunc_len={self.trunc_len}: use longer documents or a smaller trunc_len")


def nll_per_token(forward, tokens):
    """``[B, n - 1]`` fp32 NLL of ``tokens[:, 1:]`` given their prefixes; ``forward(inputs [B, m])``
    returns logits ``[B, m, vocab]``."""
    logits = forward(tokens[:, :-1]).astype(jnp.float32)
    target = jnp.take_along_axis(logits, tokens[:, 1:, None], axis=-1)[..., 0]
    return jax.nn.logsumexp(logits, axis=-1) - target


def short_context_nll(nll_fn, tokens, rule: KeyTokenRule) -> np.ndarray:
    """``[B, T]`` NLL of each token given only its last K .. K + W - 1 tokens (NaN for the first K + 1
    positions, which no window scores). ``nll_fn(tokens [B, n]) -> [B, n - 1]`` as
    :func:`nll_per_token`."""
    B, T = tokens.shape
    K, W = rule.trunc_len, rule.window
    out = np.full((B, T), np.nan, np.float32)
    for s in range(0, T - K, W):
        e = min(s + K + W, T)
        nll = np.asarray(nll_fn(tokens[:, s:e]))  # positions s + 1 .. e - 1
        lo = max(s + K, 1)
        out[:, lo:e] = nll[:, lo - s - 1:]
    return out


def key_tokens(nll_fn, tokens, rule: KeyTokenRule = KeyTokenRule()):
    """``(key [B, T] bool, nll_full [B, T])`` by the evaluator behind ``nll_fn``; position 0 (no
    prediction) and the first K positions are never key."""
    rule.validate(tokens.shape[1])
    full = np.concatenate([np.full((tokens.shape[0], 1), np.nan, np.float32),
                           np.asarray(nll_fn(tokens), np.float32)], axis=1)
    short = short_context_nll(nll_fn, tokens, rule)
    with np.errstate(invalid="ignore"):
        key = (short - full > rule.alpha) & (full < -rule.beta)
    key[:, :rule.trunc_len] = False
    return key, full


def longppl(nll_full, key) -> dict:
    """LongPPL, PPL and counts of one evaluated model over documents: ``nll_full`` (per document the
    NLL of each token, NaN at position 0) and the evaluator's ``key`` masks, as lists of per-document
    arrays or ``[B, T]`` arrays (a row per document). perplexity.py's corpus means: LongPPL weights each
    document by its key tokens (``exp(sum NLL / sum n_key)``), PPL by its tokens (``n_token``, the
    first, unscored one included)."""
    docs = [np.asarray(x, np.float64) for x in nll_full]
    keys = [np.asarray(k, bool) for k in key]
    n_key = int(sum(k.sum() for k in keys))
    key_sum = float(sum(d[k].sum() for d, k in zip(docs, keys)))
    sizes = np.array([d.size for d in docs], np.float64)
    doc_nll = np.array([np.nanmean(d) for d in docs])
    mean_all = float((sizes * doc_nll).sum() / sizes.sum())
    n_token = int(sizes.sum())
    return {"longppl": math.exp(key_sum / n_key) if n_key else None, "key_nll": key_sum / n_key if n_key else None,
            "ppl": math.exp(mean_all), "nll": mean_all, "n_key": n_key, "n_token": n_token,
            "n_scored": int(sum(np.isfinite(d).sum() for d in docs)),
            "key_rate": n_key / n_token if n_token else 0.0}


# ----------------------------------------------------------------------------- runs

def _nll_fn(evaluator, cfg=None):
    """Per-token NLL of a :class:`~hybrid_lm.run.restore.RestoredRun` (with ``cfg``'s model: a
    swapped config of the same parameters), eval mode."""
    cfg = cfg or evaluator.cfg
    fns = evaluator.fns if cfg.model == evaluator.cfg.model else ModelFns(cfg)

    def forward(params, tokens):
        def logits(x):
            B, n = x.shape
            ctx = MixerContext(positions=default_positions(B, n),
                               attention_impl=cfg.model.attention_impl, seed=cfg.train.seed, train=False)
            return fns.model(params)(x, ctx)
        return nll_per_token(logits, tokens)

    compiled = jax.jit(forward)

    def nll(tokens):
        with jax.set_mesh(evaluator.mesh):
            return compiled(evaluator.params, jnp.asarray(tokens, jnp.int32))
    return nll


def val_documents(store_path, tok, *, min_tokens: int, max_tokens: int, count: int | None,
                  seed: int | None = None, what: str = "--data") -> tuple[list[np.ndarray], dict]:
    """Whole documents of a prepared token store's val split (prepared with ``tok``, checked): those
    whose content (the stored tokens less the trailing separator) holds at least ``min_tokens``
    tokens, each cut to its first ``max_tokens``; the first ``count`` (None: all) in store order, or
    with ``seed`` ``count`` drawn by it (kept in store order). Returns ``(documents, info)``, info
    ``{"store", "available", "longest"}``. Raises DataError when none qualifies (naming the longest)."""
    store = TokenStore(store_path)
    if store.tokenizer.get("fingerprint") != tok.fingerprint:
        raise DataError(f"{what} {store_path} was prepared with another tokenizer than the run's: prepare it "
                        "with the run's tokenizer")
    val = store.split("val")
    content = val.doc_lengths - len(tok.separator)  # a stored document ends with its separator
    ok = np.flatnonzero(content >= min_tokens)
    longest = int(content.max()) if content.size else 0
    if ok.size == 0:
        raise DataError(f"{what} {store_path}: no val document has {min_tokens} tokens (longest {longest})")
    if count is not None and ok.size > count:
        ok = ok[:count] if seed is None else np.sort(np.random.default_rng(seed).choice(ok, count, replace=False))
    docs = [np.asarray(val.read(int(val.doc_starts[i]), int(min(content[i], max_tokens))), np.int32) for i in ok]
    return docs, {"store": str(store.path), "available": int(np.sum(content >= min_tokens)), "longest": longest}


def store_documents(store_path, length: int, docs: int, tokenizer_fingerprint: str) -> np.ndarray:
    """``[docs, length]``: the first ``length`` tokens of the first ``docs`` val documents of at least
    ``length`` tokens (their trailing separator counted) of a prepared store, in store order."""
    store = TokenStore(store_path)
    if store.tokenizer.get("fingerprint") != tokenizer_fingerprint:
        raise DataError(f"--data {store_path} was prepared with another tokenizer than the run's: prepare it "
                        "with the run's tokenizer")
    val = store.split("val")
    long = np.flatnonzero(val.doc_lengths >= length)
    if long.size == 0:
        raise DataError(f"--data {store_path}: no val document has {length} tokens (longest "
                        f"{int(val.doc_lengths.max()) if val.n_docs else 0})")
    return np.stack([val.read(int(val.doc_starts[i]), length) for i in long[:docs]]).astype(np.int32)


def check_evaluator_tokenizer(judge_cfg, run_cfg) -> None:
    """Raise ValueError unless the evaluator and the run tokenise alike (key tokens are positions)."""
    if judge_cfg.data.tokenizer != run_cfg.data.tokenizer:
        raise ValueError(f"the evaluator tokenises with {judge_cfg.data.tokenizer!r}, the run with "
                         f"{run_cfg.data.tokenizer!r}: key tokens are positions, so they must agree")


def resolve_evaluator(run, evaluator=None, evaluator_step: int | None = None) -> tuple:
    """``(run directory, step, label)`` of the evaluator of ``run``'s checkpoint: ``None`` / ``"newest"``
    the run's newest checkpoint, ``"self"`` the checkpoint itself, else a run directory (its
    ``evaluator_step``, default its newest)."""

    if evaluator in (None, "newest"):
        if evaluator_step is not None:
            return Path(run.workdir), int(evaluator_step), f"step {evaluator_step}"
        return Path(run.workdir), max(checkpoint_steps(run.workdir, missing_ok=True) or [run.step]), "newest"
    if evaluator == "self":
        return Path(run.workdir), run.step, "self"
    if evaluator_step is not None:  # its keys may be cached without its checkpoints (a copy of its results)
        return Path(evaluator), int(evaluator_step), str(evaluator)
    steps = checkpoint_steps(evaluator, missing_ok=True)
    if not steps:
        raise FileNotFoundError(f"--evaluator {evaluator}: the run has no checkpoint")
    return Path(evaluator), int(evaluator_step) if evaluator_step is not None else max(steps), str(evaluator)


def run_documents(run, *, length: int | None, docs: int | None, rule: KeyTokenRule, data=None,
                  inputs: str = "documents", min_tokens: int | None = None) -> tuple[list[np.ndarray], dict]:
    """The documents LongPPL reads (the module doc) and what describes them."""
    if inputs not in INPUTS:
        raise ConfigError(f"longppl: inputs={inputs!r}; choose one of {', '.join(INPUTS)}")
    if inputs == "windows":
        n = length or run.cfg.data.seq_len + 1
        rule.validate(n)
        rows = run.streams(swapped_config(run.cfg, seq_len=n - 1, eval_windows=docs or 8)).eval_tokens
        return [np.asarray(r, np.int32) for r in rows], {"documents": "run val windows", "length": n}
    n = length or min(MAX_TOKENS, run.cfg.data.seq_len + 1)
    lo = min(MIN_TOKENS, n) if min_tokens is None else min_tokens
    if lo > n:
        raise ConfigError(f"longppl: min_tokens={lo} exceeds the length {n}")
    rule.validate(lo)
    store = data if data is not None else run.streams().store.path
    try:
        found, info = val_documents(store, run.tokenizer, min_tokens=lo, max_tokens=n, count=docs or DOCS,
                                    what="--data" if data is not None else "longppl: the run's store")
    except DataError as e:
        raise DataError(f"{e}: give a shorter --longppl-length (or --longppl-min-tokens), a store of longer "
                        "documents with --data, or --longppl-inputs windows") from None
    out = []
    for d in found:  # above min_tokens, a whole number of windows past it: a few shapes
        keep = len(d) if len(d) <= lo else lo + (len(d) - lo) // rule.window * rule.window
        out.append(d[:keep])
    if len(out) < (docs or DOCS):
        logging.getLogger(__name__).warning("longppl: %d documents of >= %d tokens in %s, fewer than the %d asked",
                                            len(out), lo, info["store"], docs or DOCS)
    return out, {"documents": "store val documents", "length": n, "min_tokens": lo, "store": info["store"],
                 "lengths": [len(d) for d in out]}


def longppl_of_run(run, cfg=None, *, evaluator=None, evaluator_step: int | None = None, length: int | None = None,
                   docs: int | None = None, rule: KeyTokenRule = KeyTokenRule(), data=None,
                   progress: bool = True, inputs: str = "documents", min_tokens: int | None = None) -> dict:
    """LongPPL of a restored checkpoint (``run``, with ``cfg``'s model: default the run's, or a swapped
    config) on its documents (:func:`run_documents`; ``data``: a prepared token store). Key tokens are
    marked by ``evaluator`` (:func:`resolve_evaluator`; default the run's newest checkpoint)."""


    t0 = time.time()
    judge_dir, judge_step, label = resolve_evaluator(run, evaluator, evaluator_step)
    is_self = judge_dir.resolve() == run.workdir.resolve() and judge_step == run.step
    judge_cfg = run.cfg if judge_dir.resolve() == run.workdir.resolve() else load_run_config(judge_dir)
    check_evaluator_tokenizer(judge_cfg, run.cfg)
    documents, what = run_documents(run, length=length, docs=docs, rule=rule, data=data, inputs=inputs,
                                    min_tokens=min_tokens)
    cache = _key_cache_path(judge_dir, run_id(judge_cfg), judge_step, documents, rule)
    cached = _load_keys(cache, [len(d) for d in documents])
    evaluated = cfg is not None and cfg.model != run.cfg.model
    nll_run = _nll_fn(run, cfg)
    nll_judge = None
    if cached is None and not (is_self and not evaluated):  # the evaluator marks keys with its own model
        nll_judge = _nll_fn(run if is_self else RestoredRun(judge_dir, step=judge_step))
    keys, fulls = [], []
    for i, doc in enumerate(tqdm(documents, desc="longppl", unit="doc", disable=bar_disabled(progress))):
        if cached is not None:  # the evaluator's keys of these documents, computed before
            key = cached[i]
        else:
            key, full = key_tokens(nll_judge or nll_run, doc[None], rule)
            key = key[0]
        if cached is not None or nll_judge is not None:  # the evaluated model's own NLL
            full = np.concatenate([np.full((1, 1), np.nan, np.float32), np.asarray(nll_run(doc[None]))], 1)
        keys.append(key)
        fulls.append(np.asarray(full).reshape(-1))
    if cached is None and jax.process_index() == 0:
        _save_keys(cache, keys)
    return {"kind": "longppl", "time": time.strftime("%Y-%m-%dT%H:%M:%S"), "checkpoint_step": run.step,
            "run_id": run_id(run.cfg), "evaluator": label, "evaluator_dir": str(judge_dir),
            "evaluator_step": judge_step, "self_evaluator": is_self, "length": what["length"],
            "min_tokens": what.get("min_tokens"), "doc_lengths": what.get("lengths"), "docs": len(documents),
            "data": None if data is None else str(data), "store": what.get("store"), "inputs": inputs,
            "documents": what["documents"], **dataclasses.asdict(rule), **longppl(fulls, keys),
            "keys_cached": cached is not None, "key_cache": str(cache), "wall_s": round(time.time() - t0, 3)}


def evaluate_longppl(workdir, *, evaluator=None, length: int | None = None, docs: int | None = None,
                     rule: KeyTokenRule = KeyTokenRule(), step: int | None = None,
                     evaluator_step: int | None = None, record: bool = True, progress: bool = True,
                     data=None, inputs: str = "documents", min_tokens: int | None = None) -> dict:
    """LongPPL of ``workdir``'s checkpoint (:func:`longppl_of_run`); appends a ``kind: longppl`` row to
    ``workdir/eval.jsonl``."""
    run = RestoredRun(workdir, step=step)
    row = longppl_of_run(run, evaluator=evaluator, evaluator_step=evaluator_step, length=length, docs=docs,
                         rule=rule, data=data, progress=progress, inputs=inputs, min_tokens=min_tokens)
    if record:
        run.record(row)
    return row


# ----------------------------------------------------------------------------- key-token cache
# Keys depend only on the evaluator checkpoint, the documents and the rule: computed once and kept in
# the evaluator's run directory, every evaluated checkpoint is scored on the same tokens, and the
# evaluator's passes (one full + T/W short ones per document) run once.

def _key_cache_path(judge_dir, judge_run_id: str, judge_step: int, documents, rule: KeyTokenRule):
    h = hashlib.sha256()
    for d in documents:
        h.update(np.int64(len(d)).tobytes())
        h.update(np.ascontiguousarray(d, np.int64).tobytes())
    h.update(repr((judge_run_id, judge_step, dataclasses.astuple(rule))).encode())
    return Path(judge_dir) / "longppl_keys" / f"{h.hexdigest()[:20]}.npz"


def _load_keys(path, lengths: list[int]):
    """The cached key masks (one per document), or None (absent or unreadable: recomputed)."""
    if not path.exists():
        return None
    try:
        with np.load(path) as z:
            flat, sizes = z["keys"], z["lengths"]
    except (OSError, ValueError, KeyError) as e:
        logging.getLogger(__name__).warning("unreadable key cache %s (%s); recomputing", path, e)
        return None
    if flat.dtype != bool or list(sizes) != list(lengths) or flat.size != sum(lengths):
        return None
    return np.split(flat, np.cumsum(sizes)[:-1])


def _save_keys(path, keys) -> None:
    """Written atomically: a crash never leaves a torn cache."""
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, lambda fh: np.savez(fh, keys=np.concatenate(keys).astype(bool),
                                           lengths=np.array([len(k) for k in keys], np.int64)))

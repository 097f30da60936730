"""LongPPL (Fang et al., ICLR 2025; PKU-ML/LongPPL): perplexity on the tokens that need long context.

An *evaluator* model marks the key tokens of each document: token i is key iff

    NLL_short(i) - NLL_full(i) > alpha    (long context lowers its loss by more than alpha nats)
    NLL_full(i) < -beta                   (and the evaluator predicts it well with the full context)

NLL_full comes from one pass over the whole document; NLL_short from passes over windows
``[s, s + K + W)`` for ``s = 0, W, 2W, ...`` while ``s < T - K``, each scoring its targets
``[s + K, s + K + W)``, which so see K to K + W - 1 tokens of context. The first K tokens are never
key. The evaluated model's LongPPL is ``exp(mean NLL_full over the key tokens)``; over documents,
the key-token-weighted mean (``exp(sum NLL / sum n_key)``). Defaults are the paper's: K = 4096,
W = 1024, alpha = 2, beta = -2. The evaluator's key masks are cached in its run directory
(``longppl_keys/``, keyed by its checkpoint, the documents and the rule), so every checkpoint
compared against one evaluator is scored on the same tokens.

With the evaluated model as its own evaluator ("self-LongPPL") every key token has NLL < -beta, so
LongPPL < e^2 ~ 7.39 by construction, and a model that uses little context shows up as *fewer* key
tokens: report the key-token rate with it, and prefer a fixed evaluator to compare checkpoints.
Key tokens are positions in our (byte-level) tokenisation, so evaluator and evaluated model must
share the tokenizer (checked).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from hybrid_lm.experiment import run_id


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
    """LongPPL, PPL and counts of one evaluated model: ``nll_full [B, T]`` (NaN at position 0) and the
    evaluator's ``key [B, T]``; every document weighted by its key tokens (PKU-ML's corpus mean)."""
    nll_full, key = np.asarray(nll_full, np.float64), np.asarray(key, bool)
    scored = np.isfinite(nll_full)
    n_key, n_token = int(key.sum()), int(scored.sum())
    mean_key = float(nll_full[key].mean()) if n_key else float("nan")
    mean_all = float(nll_full[scored].mean())
    return {"longppl": math.exp(mean_key) if n_key else None, "key_nll": mean_key if n_key else None,
            "ppl": math.exp(mean_all), "nll": mean_all, "n_key": n_key, "n_token": n_token,
            "key_rate": n_key / n_token if n_token else 0.0}


# ----------------------------------------------------------------------------- runs

def _nll_fn(evaluator, cfg=None):
    """Per-token NLL of a :class:`~hybrid_lm.eval.restore.RestoredRun` (with ``cfg``'s model: a
    swapped config of the same parameters), eval mode."""
    from hybrid_lm.model.registry import MixerContext
    from hybrid_lm.ops.attention import default_positions
    from hybrid_lm.train.step import ModelFns

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


def store_documents(store_path, length: int, docs: int, tokenizer_fingerprint: str) -> np.ndarray:
    """``[docs, length]``: the first ``length`` tokens of the first ``docs`` documents of at least
    ``length`` tokens in a prepared store's val split (real documents, e.g. held-out long reports or
    books), in store order."""
    from hybrid_lm.data.store import TokenStore
    from hybrid_lm.errors import DataError

    store = TokenStore(store_path)
    if store.tokenizer.get("fingerprint") != tokenizer_fingerprint:
        raise DataError(f"--data {store_path} was prepared with another tokenizer than the run's: prepare it "
                        "with the run's tokenizer")
    val = store.split("val")
    lengths, starts = val.doc_lengths, val.doc_starts
    # a document's stored length counts its trailing separator token
    long = np.flatnonzero(lengths >= length)
    if long.size == 0:
        raise DataError(f"--data {store_path}: no val document has {length} tokens (longest "
                        f"{int(lengths.max()) if lengths.size else 0}); give a shorter --longppl-length or a "
                        "store of longer documents")
    if long.size < docs:
        import logging
        logging.getLogger(__name__).warning("--data %s: %d val documents of >= %d tokens, fewer than the %d asked",
                                            store_path, long.size, length, docs)
    return np.stack([val.read(int(starts[i]), length) for i in long[:docs]]).astype(np.int32)


def check_evaluator_tokenizer(judge_cfg, run_cfg) -> None:
    """Raise ValueError unless the evaluator and the run tokenise alike (key tokens are positions)."""
    if judge_cfg.data.tokenizer != run_cfg.data.tokenizer:
        raise ValueError(f"the evaluator tokenises with {judge_cfg.data.tokenizer!r}, the run with "
                         f"{run_cfg.data.tokenizer!r}: key tokens are positions, so they must agree")


def longppl_of_run(run, cfg=None, *, evaluator=None, evaluator_step: int | None = None, length: int | None = None,
                   docs: int | None = None, rule: KeyTokenRule = KeyTokenRule(), data=None,
                   progress: bool = True) -> dict:
    """LongPPL of a restored checkpoint (``run``, with ``cfg``'s model: default the run's, or a swapped
    config) on ``docs`` documents of ``length`` tokens: the run's fixed validation windows, or with
    ``data`` (a prepared token store) real documents of its val split (:func:`store_documents`). Key
    tokens are marked by ``evaluator`` (a run directory; default the run itself, "self-LongPPL")."""
    import time
    from pathlib import Path

    from tqdm import tqdm

    from hybrid_lm.eval.restore import RestoredRun
    from hybrid_lm.eval.swap import swapped_config
    from hybrid_lm.progress import bar_disabled

    t0 = time.time()
    is_self = evaluator is None or Path(evaluator).resolve() == Path(run.workdir).resolve()
    judge = run if is_self else RestoredRun(evaluator, step=evaluator_step)
    check_evaluator_tokenizer(judge.cfg, run.cfg)
    n = length or run.cfg.data.seq_len + 1
    rule.validate(n)
    if data is not None:
        documents = store_documents(data, n, 8 if docs is None else docs, run.tokenizer.fingerprint)
    else:
        documents = run.streams(swapped_config(run.cfg, seq_len=n - 1, eval_windows=docs)).eval_tokens
    cache = _key_cache_path(judge, documents, rule)
    cached = _load_keys(cache, len(documents), n)
    evaluated = cfg is not None and cfg.model != run.cfg.model
    nll_run = _nll_fn(run, cfg)
    # the evaluator marks keys with its own (unswapped) model
    nll_judge = None if is_self and not evaluated else _nll_fn(judge)
    keys, fulls = [], []
    for i, doc in enumerate(tqdm(documents, desc="longppl", unit="doc", disable=bar_disabled(progress))):
        if cached is not None:  # the evaluator's keys of these documents, computed before
            key = cached[i:i + 1]
        else:
            key, full = key_tokens(nll_judge or nll_run, doc[None], rule)
        if cached is not None or nll_judge is not None:  # the evaluated model's own NLL
            full = np.concatenate([np.full((1, 1), np.nan, np.float32), np.asarray(nll_run(doc[None]))], 1)
        keys.append(key)
        fulls.append(full)
    keys = np.concatenate(keys)
    if cached is None and jax.process_index() == 0:
        _save_keys(cache, keys)
    return {"kind": "longppl", "time": time.strftime("%Y-%m-%dT%H:%M:%S"), "checkpoint_step": run.step,
            "run_id": run_id(run.cfg), "evaluator": "self" if is_self else str(evaluator),
            "evaluator_step": judge.step, "self_evaluator": is_self, "length": n, "docs": len(documents),
            "data": None if data is None else str(data), "documents": "store val documents" if data is not None
            else "run val windows", **dataclasses.asdict(rule), **longppl(np.concatenate(fulls), keys),
            "keys_cached": cached is not None, "key_cache": str(cache), "wall_s": round(time.time() - t0, 3)}


def evaluate_longppl(workdir, *, evaluator=None, length: int | None = None, docs: int | None = None,
                     rule: KeyTokenRule = KeyTokenRule(), step: int | None = None,
                     evaluator_step: int | None = None, record: bool = True, progress: bool = True,
                     data=None) -> dict:
    """LongPPL of ``workdir``'s checkpoint (:func:`longppl_of_run`); appends a ``kind: longppl`` row to
    ``workdir/eval.jsonl``."""
    from hybrid_lm.eval.restore import RestoredRun

    run = RestoredRun(workdir, step=step)
    row = longppl_of_run(run, evaluator=evaluator, evaluator_step=evaluator_step, length=length, docs=docs,
                         rule=rule, data=data, progress=progress)
    if record:
        run.record(row)
    return row


# ----------------------------------------------------------------------------- key-token cache
# Keys depend only on the evaluator checkpoint, the documents and the rule: computed once and kept in
# the evaluator's run directory, every evaluated checkpoint is scored on the same tokens, and the
# evaluator's passes (one full + T/W short ones per document) run once.

def _key_cache_path(judge, documents, rule: KeyTokenRule):
    import hashlib
    h = hashlib.sha256()
    h.update(np.ascontiguousarray(documents, np.int64).tobytes())
    h.update(repr((run_id(judge.cfg), judge.step, dataclasses.astuple(rule))).encode())
    return judge.workdir / "longppl_keys" / f"{h.hexdigest()[:20]}.npy"


def _load_keys(path, docs: int, length: int):
    """The cached ``[docs, length]`` key mask, or None (absent or unreadable: recomputed)."""
    import logging
    if not path.exists():
        return None
    try:
        keys = np.load(path)
    except (OSError, ValueError) as e:
        logging.getLogger(__name__).warning("unreadable key cache %s (%s); recomputing", path, e)
        return None
    return keys if keys.shape == (docs, length) and keys.dtype == bool else None


def _save_keys(path, keys) -> None:
    """Written atomically: a crash never leaves a torn cache."""
    from hybrid_lm.files import atomic_write
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, lambda fh: np.save(fh, keys))

"""RULER-offline on a restored checkpoint: the request's checks, the batched greedy generation and answer
log-likelihoods over ``eval/ruler_items.py``'s items, and RULER's scoring (``scripts/eval/evaluate.py``)."""

from __future__ import annotations

import logging
import re
import time

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from hybrid_lm.backends import recorded_backends
from hybrid_lm.errors import ConfigError
from hybrid_lm.eval.generate import generate
from hybrid_lm.eval.prefill_swap import split_answer_nll_fn
from hybrid_lm.eval.ruler_items import (DEFAULT_LENGTHS, HAYSTACK_TASKS, HAYSTACKS, N_DISTRACTORS, TASKS,
                                        TOKENS_TO_GENERATE, Item, TooShort, encode, family, haystack_for,
                                        load_items, task_haystack)
from hybrid_lm.experiment import run_id
from hybrid_lm.model.registry import MixerContext
from hybrid_lm.ops.attention import default_positions
from hybrid_lm.progress import bar_disabled
from hybrid_lm.run.directory import checkpoint_meta
from hybrid_lm.run.swap import describe
from hybrid_lm.sharding import put_batch
from hybrid_lm.step import ModelFns

log = logging.getLogger(__name__)


# ----------------------------------------------------------------------------- scoring (pure)

def postprocess_pred(text: str) -> str:
    """scripts/eval/evaluate.py postprocess_pred: stripped, control characters turned into newlines."""
    text = text.strip()
    return re.sub(r"[\x00-\x1f]", "\n", text).strip()


def stop_ids(tok) -> tuple[int, ...]:
    """Where generation stops: the tokenizer's document separator (its EOS; ``\n\n`` for bytes),
    which ends every document the model was trained on (RULER: generation stops at EOS)."""
    return tuple(int(x) for x in tok.separator)


def continuation(tok, ids, task: str) -> str:
    """The text RULER scores from greedy tokens ``ids``: the first ``TOKENS_TO_GENERATE`` of the
    task's family, up to the first stop (:func:`stop_ids`), decoded and post-processed. Decoding a
    fixed number of tokens and cutting there gives what stopping there gives (greedy is causal)."""
    ids = [int(x) for x in np.asarray(ids).reshape(-1)[:TOKENS_TO_GENERATE[family(task)]]]
    stop = list(stop_ids(tok))
    for i in range(len(ids) - len(stop) + 1):
        if stop and ids[i:i + len(stop)] == stop:
            ids = ids[:i]
            break
    return postprocess_pred(tok.decode(ids))


def string_match_all(continuation: str, answers) -> float:
    """Fraction of ``answers`` that occur in ``continuation``, case-insensitively (RULER's metric)."""
    text = continuation.lower()
    return sum(a.lower() in text for a in answers) / len(answers)


def answer_scores(gold_nll: np.ndarray, distractor_nll=()) -> dict:
    """``{"nll", "win"}`` of one item: the gold answer's mean NLL per token (``gold_nll``: NLL of
    each of its tokens) and whether its log-likelihood (the sum) is above every distractor's (None
    without distractors)."""
    gold_nll = np.asarray(gold_nll, np.float64)
    sums = [float(np.sum(d)) for d in distractor_nll]
    win = None if not sums else bool(float(gold_nll.sum()) < min(sums))
    return {"nll": float(gold_nll.mean()), "win": win}


def summarize(items: list[Item], exact: list[float] | None, scores: list[dict]) -> dict:
    """A (task, length)'s scores over its items: exact match (None without generation), mean answer
    NLL, and the gold-beats-distractors rate with its chance level (None without distractors)."""
    wins = [s["win"] for s in scores if s["win"] is not None]
    n_d = len(items[0].distractors)
    return {"exact_match": None if exact is None else float(np.mean(exact)),
            "answer_nll": float(np.mean([s["nll"] for s in scores])),
            "ll_accuracy": float(np.mean(wins)) if wins else None,
            "ll_chance": 1.0 / (1 + n_d) if n_d else None, "distractors": n_d,
            "per_item": {"depth": [list(it.depths) for it in items], "exact": exact,
                         "nll": [round(s["nll"], 5) for s in scores], "win": [s["win"] for s in scores]}}


# ----------------------------------------------------------------------------- the model side


def parse_lengths(text: str, flag: str = "--lengths") -> list[int]:
    """"4K,8192,16k" -> [4096, 8192, 16384]; errors name ``flag``, the option the text came from
    (``hybrid-lm ruler --lengths``, ``hybrid-lm eval --ruler-lengths``)."""
    out = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        m = re.fullmatch(r"(\d+)([kK]?)", part)
        if not m or int(m.group(1)) == 0:
            raise ConfigError(f"{flag}: {part!r} is not a positive length in tokens (e.g. 4096 or 4K)")
        out.append(int(m.group(1)) * (1024 if m.group(2) else 1))
    if not out:
        raise ConfigError(f"{flag}: give at least one length")
    return out


def check_request(cfg, tasks=None, lengths=None, haystack: str | None = None, allow_longer: bool = False,
                  samples: int = 1, lengths_flag: str = "--lengths") -> tuple[list[str], list[int]]:
    """The tasks and lengths to run for the run config ``cfg``, checked before anything is restored:
    known tasks and haystack, lengths up to the run's seq_len unless ``allow_longer`` (default: RULER's
    4K..32K that fit, else the seq_len). ``lengths_flag``: the option the lengths came from, for errors."""
    tasks = list(dict.fromkeys(tasks or TASKS))
    unknown = [t for t in tasks if t not in TASKS]
    if unknown:
        raise ConfigError(f"unknown RULER task(s) {', '.join(map(repr, unknown))}; tasks: {', '.join(TASKS)}")
    if haystack is not None and haystack not in HAYSTACKS:
        raise ConfigError(f"--haystack {haystack!r}: choose one of {', '.join(HAYSTACKS)}")
    if samples < 1:
        raise ConfigError(f"--samples {samples}: need at least 1")
    seq_len = cfg.data.seq_len
    if lengths is None:
        lengths = [n for n in DEFAULT_LENGTHS if n <= seq_len] or [seq_len]
    lengths = sorted(set(int(n) for n in lengths))
    too_long = [n for n in lengths if n > seq_len]
    if too_long and not allow_longer:
        raise ConfigError(f"length(s) {', '.join(map(str, too_long))} exceed the run's seq_len {seq_len}: use "
                          f"shorter {lengths_flag}, or --allow-longer to evaluate beyond the trained length")
    return tasks, lengths


def decode_unavailable(model) -> str | None:
    """Why ``model`` cannot generate token by token (a mixer without a decode path), or None."""
    for i, block in enumerate(model.blocks):
        try:
            block.check_decode(i)
        except NotImplementedError as e:
            return str(e).split(";")[0]
    return None


def tokens_seen(run) -> int:
    """Tokens the restored checkpoint was trained on: its saved metadata, else step x batch x seq_len."""
    try:
        return int(checkpoint_meta(run.workdir, run.step)["tokens_seen"])
    except (OSError, ValueError, KeyError, TypeError):
        return run.step * run.cfg.train.global_batch * run.cfg.data.seq_len


def _answer_nll_fn(fns, cfg, span: int):
    """Jitted ``(params, tokens [B, L], example_ids [B]) -> [B, span]``: NLL of the last ``span`` tokens
    given their prefixes, eval mode; logits only for those positions. ``example_ids``: SA's permutation
    per row (the gold and the distractors of one item share their item's)."""

    def nll(params, tokens, example_ids=None):
        B, L = tokens.shape
        ctx = MixerContext(positions=default_positions(B, L), attention_impl=cfg.model.attention_impl,
                           seed=cfg.train.seed, example_ids=example_ids, train=False)
        model = fns.model(params)
        h = model(tokens, ctx, features=True)[:, L - span - 1:L - 1]
        logits = (h @ model.head_matrix().astype(h.dtype)).astype(jnp.float32)
        target = tokens[:, L - span:]
        return jax.nn.logsumexp(logits, -1) - jnp.take_along_axis(logits, target[..., None], -1)[..., 0]
    return jax.jit(nll)


def _batches(rows: np.ndarray, per: int):
    """``rows`` in batches of exactly ``per`` (the last one padded by repeating its first row), with
    how many rows of each are real."""
    for i in range(0, len(rows), per):
        part = rows[i:i + per]
        n = len(part)
        if n < per:
            part = np.concatenate([part, np.repeat(part[:1], per - n, axis=0)])
        yield part, n


def batch_rows(run, length: int, n_rows: int, batch_size: int | None = None) -> int:
    """Rows per forward pass at ``length``: ``batch_size``, else the trainer's tokens per step at this
    length, at most the rows there are; a multiple of the batch shards."""
    shards = run.n_batch_shards
    per = batch_size or max(1, run.cfg.train.global_batch * run.cfg.data.seq_len // length)
    per = min(per, n_rows)
    return max(shards, -(-per // shards) * shards)


def evaluate_ruler(run, *, tasks=None, lengths=None, samples: int = 8, haystack: str | None = None, seed: int = 0,
                   allow_longer: bool = False, batch_size: int | None = None, cfg=None, cache_root=None,
                   progress: bool = True, lengths_flag: str = "--lengths",
                   answer_cfg=None, generate_answers: bool = True) -> tuple[list[dict], list[dict]]:
    """RULER on ``run`` (a :class:`~hybrid_lm.run.restore.RestoredRun`) with the model of ``cfg``
    (default the run's; a swapped config of the same parameters works): ``(rows, skipped)``, a row
    per (task, length) evaluated (``kind: ruler``, ``task: ruler/<name>``, scores, settings) and a
    ``{task, length, reason}`` per pair too short to generate (``lengths_flag``: the option the lengths
    came from, named by errors). Nothing is recorded here.

    Scores: ``exact_match``, RULER's ``string_match_all`` on the greedy continuation cut at the task's
    ``tokens_to_generate`` (128 / 30 / 120 / 50) and at the first EOS (:func:`continuation`), from
    ``eval/generate.py``'s cached decoding; ``answer_nll``, the mean NLL per token of the gold answer
    under teacher forcing (one forward pass, every mixer, SA included); ``ll_accuracy``, the fraction of
    items where the gold answer's log-likelihood beats every distractor's (tasks with distractors;
    chance 1 / (1 + count)). Mixers without a decode path (attention_sink) get the log-likelihood scores
    only; sa and sa_swa decode as their option ``decode`` says (docs/STOCHASTIC_ATTENTION.md §9).

    ``answer_cfg`` (``--swap-prefill-only``): the prompt is prefilled by ``cfg``'s model and the gold
    answer and distractors are scored by ``answer_cfg``'s (the run's own layers) over it
    (``eval/prefill_swap.py``); greedy generation is not run under it (``exact_match`` null).
    ``generate_answers=False`` (``--ruler-no-generation``): the log-likelihood scores only, no greedy
    generation (``exact_match`` null)."""

    cfg = cfg or run.cfg
    tasks, lengths = check_request(cfg, tasks, lengths, haystack, allow_longer, samples, lengths_flag)
    t_all = time.time()
    tok = run.tokenizer
    hays = {t: haystack_for(task_haystack(t, haystack), tok, run) for t in tasks if t in HAYSTACK_TASKS}
    fns = run.fns if cfg is run.cfg else ModelFns(cfg)
    model = fns.model(run.params)
    no_decode = decode_unavailable(model)
    if not generate_answers and no_decode is None:
        no_decode = "not asked (--ruler-no-generation)"
    if answer_cfg is not None:
        no_decode = ("--swap-prefill-only: the answer is scored over the swapped prompt's cache; greedy generation "
                     "under it is not built")
        answer_fns = run.fns if answer_cfg is run.cfg else ModelFns(answer_cfg)
    impl = cfg.model.attention_impl
    common = {"kind": "ruler", "step": run.step, "checkpoint_step": run.step, "tokens_seen": tokens_seen(run),
              "run_id": run_id(run.cfg), "seed": seed, "samples": samples,
              "trained_seq_len": run.cfg.data.seq_len,
              "generation": "greedy, stopped at EOS or the task's budget" if no_decode is None else
              f"unavailable ({no_decode}): log-likelihood scores only",
              **({"answer_scoring": "prefill with the swap, answer with the run's own layers over its cache"}
                 if answer_cfg is not None else {}),
              "layer_types": "".join(cfg.model.layer_types()), "mixers": describe(cfg.model),
              "attention_impl": impl, "devices": int(run.mesh.devices.size)}
    rows, skipped = [], []
    recorded_backends(clear=True)
    for length in lengths:
        sets = {}
        for task in tasks:
            try:
                sets[task] = load_items(task, length, seed, samples, tok, hays.get(task), cache_root)
            except TooShort as e:
                skipped.append({"task": task, "length": length, "reason": str(e)})
        if not sets:
            continue
        span = max(items[0].gen_tokens for items, _ in sets.values())
        if answer_cfg is None:
            nll_fn = _answer_nll_fn(fns, cfg, span)
        else:
            nll_fn = split_answer_nll_fn(answer_fns, fns, answer_cfg, cfg, span)
        for task, (items, path) in sets.items():
            t0 = time.time()
            exact, scores = _score_items(run, model, nll_fn, items, task, length, span, samples=samples,
                                         batch_size=batch_size, decode=no_decode is None, impl=impl,
                                         progress=progress)
            G = items[0].gen_tokens
            rows.append({**common, "task": f"ruler/{task}", "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
                         "length": length, "prompt_tokens": length - G, "gen_tokens": G,
                         "haystack": hays[task].name if task in hays else None,
                         "max_new_tokens": TOKENS_TO_GENERATE[family(task)],
                         **summarize(items, exact, scores), "items_cache": str(path),
                         "wall_s": round(time.time() - t0, 3)})
    backends = recorded_backends()
    for r in rows:
        r["attention_backends"] = backends
    log.info("ruler: %d rows in %.1f s", len(rows), time.time() - t_all)
    return rows, skipped


def _score_items(run, model, nll_fn, items: list[Item], task: str, length: int, span: int, *, samples: int,
                 batch_size: int | None, decode: bool, impl: str, progress: bool):
    """One (task, length): ``(exact, scores)``, RULER's exact match of each item's greedy continuation
    (with ``decode``; else None) and each item's :func:`answer_scores` from the NLL of its gold answer
    and distractors (``nll_fn``, built for answers of ``span`` tokens)."""
    tok = run.tokenizer
    G = items[0].gen_tokens
    P = length - G
    conts = [[encode(tok, it.gold)] + [encode(tok, d) for d in it.distractors] for it in items]
    flat = [(i, j) for i, c in enumerate(conts) for j in range(len(c))]
    seqs = np.zeros((len(flat), length), np.int32)
    for r, (i, j) in enumerate(flat):
        seqs[r, :P] = items[i].ids
        seqs[r, P:P + len(conts[i][j])] = conts[i][j]
    # one batch shape per length (tasks have 0 to N_DISTRACTORS distractors): one compile each
    per_ll = batch_rows(run, length, samples * (1 + N_DISTRACTORS), batch_size)
    per_gen = batch_rows(run, length, samples, batch_size)
    n_gen = -(-len(items) // per_gen) if decode else 0
    bar = tqdm(total=n_gen + -(-len(flat) // per_ll), desc=f"ruler {task} {length}", unit="batch",
               disable=bar_disabled(progress), leave=False)
    exact = None
    with jax.set_mesh(run.mesh):
        if decode:
            exact = []
            prompts = np.stack([it.ids for it in items])
            for part, n in _batches(prompts, per_gen):
                out = np.asarray(generate(model, put_batch(part, run.batch_shard), G, attention_impl=impl))
                base = len(exact)
                exact += [string_match_all(continuation(tok, out[k], task), items[base + k].answers)
                          for k in range(n)]
                bar.update()
        nll = []
        item_of_row = np.asarray([[i] for i, _ in flat], np.int32)  # SA: one permutation per item
        for (part, n), (ids, _) in zip(_batches(seqs, per_ll), _batches(item_of_row, per_ll)):
            nll.append(np.asarray(nll_fn(run.params, put_batch(part, run.batch_shard),
                                         put_batch(ids, run.batch_shard)[:, 0]))[:n])
            bar.update()
    bar.close()
    nll = np.concatenate(nll)[:, span - G:]  # position k: answer token k
    per_item = [[] for _ in items]
    for r, (i, j) in enumerate(flat):
        per_item[i].append(nll[r, :len(conts[i][j])])
    return exact, [answer_scores(p[0], p[1:]) for p in per_item]


__all__ = ["answer_scores", "batch_rows", "check_request", "continuation", "decode_unavailable", "evaluate_ruler",
           "parse_lengths", "postprocess_pred", "stop_ids", "string_match_all", "summarize", "tokens_seen"]

"""The compiled model calls of the lm-eval adapter (``eval/lm_eval_model.py``): log-likelihoods of padded
batches, prefill-only scoring and greedy generation on the decode cache, one compile per bucket length."""

from __future__ import annotations

import zlib

import jax
import jax.numpy as jnp
import numpy as np

from hybrid_lm.errors import ConfigError
from hybrid_lm.eval.prefill_swap import split_answer_nll_fn
from hybrid_lm.eval.ruler import decode_unavailable
from hybrid_lm.model.registry import MixerContext
from hybrid_lm.ops.attention import default_positions
from hybrid_lm.sharding import put_batch
from hybrid_lm.step import ModelFns

DECODE_CHUNK = 16  # decode steps per call between the host-side stop checks


def length_buckets(max_length: int, smallest: int = 16) -> list[int]:
    """Padded lengths: ``smallest`` and every power of two and 1.5 x power of two above it below
    ``max_length``, then ``max_length`` itself."""
    out, k = set(), 1
    while k < max_length:
        out.update(b for b in (k, 3 * k // 2) if smallest <= b < max_length)
        k *= 2
    return sorted(out | {max_length})


def prefill_buckets(max_length: int) -> list[int]:
    """Prefill lengths of a generation batch (at most its shortest prompt): 1, 2, 4, 8, then the
    :func:`length_buckets`."""
    return sorted({1, 2, 4, 8} | set(length_buckets(max_length)))


def bucket_up(n: int, buckets: list[int]) -> int:
    return next(b for b in buckets if b >= n)


def bucket_down(n: int, buckets: list[int]) -> int:
    return max(b for b in buckets if b <= n)


def request_id(tokens) -> int:
    """A request's example id for per-example randomness (SA permutations): a hash of its tokens, so
    its score does not depend on the other requests of the batch."""
    return zlib.crc32(np.asarray(tokens, np.int64).tobytes()) & 0x7FFFFFFF


class ModelCalls:
    """``cfg``'s model on ``run``'s parameters, called on batches of token rows; with ``answer_cfg`` (the
    run's own layers), continuations are scored over the swapped model's prefill. Rows per call:
    ``batch_size``, else the trainer's tokens per step at each padded length (at most ``max_batch_size``)."""

    def __init__(self, run, cfg, *, vocab: int, max_length: int, batch_size: int | None = None,
                 max_batch_size: int | None = None, answer_cfg=None):
        self.run, self.cfg, self.answer_cfg = run, cfg, answer_cfg
        self.vocab, self.max_length = vocab, max_length
        self.batch_size, self.max_batch_size = batch_size, max_batch_size
        self.fns = run.fns if cfg.model == run.cfg.model else ModelFns(cfg)
        self.answer_fns = None
        if answer_cfg is not None:
            self.answer_fns = run.fns if answer_cfg.model == run.cfg.model else ModelFns(answer_cfg)
        self.no_decode = decode_unavailable(self.fns.model(run.params))  # why it cannot generate, or None
        self.buckets = length_buckets(max_length)
        self.compiled: set[tuple] = set()  # (function, shape) pairs traced so far: the compile count
        self._jitted = {}

    def rows(self, length: int, n_requests: int) -> int:
        """Rows per call at ``length``, a multiple of the batch shards: batch_size, else the trainer's
        tokens per step at this length, at most max_batch_size and no more than the requests there
        are (rounded up to a power of two: few shapes)."""
        per = self.batch_size
        if per is None:
            per = max(1, self.run.cfg.train.global_batch * self.run.cfg.data.seq_len // length)
            per = min(per, self.max_batch_size or per, 1 << max(0, n_requests - 1).bit_length())
        shards = self.run.n_batch_shards
        return -(-per // shards) * shards

    def _fn(self, kind: str, shape: tuple, build):
        """The jitted function ``kind`` (built once by ``build``), its call shape counted in ``compiled``."""
        self.compiled.add((kind, shape))
        if kind not in self._jitted:
            self._jitted[kind] = build()
        return self._jitted[kind]

    def _put(self, a: np.ndarray):
        return put_batch(np.ascontiguousarray(a), self.run.batch_shard)

    # -- scoring

    def _build_score(self):
        fns, cfg, vocab = self.fns, self.cfg, self.vocab

        def score(params, tokens, targets, example_ids):
            B, L = tokens.shape
            ctx = MixerContext(positions=default_positions(B, L), attention_impl=cfg.model.attention_impl,
                               seed=cfg.train.seed, example_ids=example_ids[:, 0], train=False)
            logits = fns.model(params)(tokens, ctx)  # fp32 [B, L, V]
            logp = jnp.take_along_axis(logits, targets[..., None], -1)[..., 0] - jax.nn.logsumexp(logits, -1)
            greedy = jnp.argmax(logits[..., :vocab], -1) == targets  # ids the tokenizer cannot decode never win
            return logp, greedy
        return jax.jit(score)

    def _build_split_score(self, span: int):
        return split_answer_nll_fn(self.answer_fns, self.fns, self.answer_cfg, self.cfg, span, vocab=self.vocab)

    def loglikelihoods(self, rows: list, bar) -> list:
        """``[(logprob, is_greedy)]`` of rows ``(tokens, n_cont)``, longest first: each right-padded to the
        bucket of its length (exact: the mixers are causal), :meth:`rows` of them per call, the sum of the
        last ``n_cont`` log-probs and whether each of those tokens is the argmax."""
        res, i = [], 0
        with jax.set_mesh(self.run.mesh):
            while i < len(rows):
                L = bucket_up(len(rows[i][0]) - 1, self.buckets)
                R = self.rows(L, len(rows))
                part = rows[i:i + R]
                tokens = np.zeros((R, L), np.int32)
                targets = np.zeros((R, L), np.int32)
                ids = np.zeros((R, 1), np.int32)
                for r, (full, _) in enumerate(part):
                    tokens[r, :len(full) - 1] = full[:-1]
                    targets[r, :len(full) - 1] = full[1:]
                    ids[r, 0] = request_id(full)
                fn = self._fn("score", (R, L), self._build_score)
                logp, greedy = fn(self.run.params, self._put(tokens), self._put(targets), self._put(ids))
                logp, greedy = np.asarray(logp, np.float64), np.asarray(greedy)
                for r, (full, n_cont) in enumerate(part):
                    end = len(full) - 1
                    res.append((float(logp[r, end - n_cont:end].sum()), bool(greedy[r, end - n_cont:end].all())))
                bar.update(len(part))
                i += len(part)
        return res

    def prefill_only_loglikelihoods(self, rows: list, bar) -> list:
        """``swap_prefill_only``: rows ``(tokens, n_cont)`` grouped by their exact context length (the
        swapped prefill sees the context alone: SA's permutation is drawn over exactly it), continuations
        right-padded to a bucket (exact: the answer is causal). One compile per (context, bucket)."""
        res: list = [None] * len(rows)
        groups: dict = {}
        for i, (full, n_cont) in enumerate(rows):
            groups.setdefault((len(full) - n_cont, bucket_up(n_cont, self.buckets)), []).append(i)
        with jax.set_mesh(self.run.mesh):
            for (P, span), idx in sorted(groups.items()):
                if P < 1:
                    raise ConfigError("swap_prefill_only: a request without context (nothing to prefill)")
                R = self.rows(P + span, len(idx))
                for k in range(0, len(idx), R):
                    part = idx[k:k + R]
                    tokens = np.zeros((R, P + span), np.int32)
                    ids = np.zeros((R, 1), np.int32)
                    for r, i in enumerate(part):
                        tokens[r, :len(rows[i][0])] = rows[i][0]
                        ids[r, 0] = request_id(rows[i][0][:P])  # the choices of one context: one SA permutation
                    fn = self._fn(f"split{span}", (R, P + span), lambda: self._build_split_score(span))
                    nll, greedy = fn(self.run.params, self._put(tokens), self._put(ids)[:, 0])
                    nll, greedy = np.asarray(nll, np.float64), np.asarray(greedy)
                    for r, i in enumerate(part):
                        n = rows[i][1]
                        res[i] = (-float(nll[r, :n].sum()), bool(greedy[r, :n].all()))
                    bar.update(len(part))
        return res

    # -- generation

    def _build_prefill(self):
        fns, impl, vocab = self.fns, self.cfg.model.attention_impl, self.vocab

        def prefill(params, head, *, max_len):
            logits, cache = fns.model(params).prefill(head, max_len, impl)
            return jnp.argmax(logits[:, -1, :vocab], -1).astype(jnp.int32), cache
        return jax.jit(prefill, static_argnames="max_len")

    def _build_chunk(self):
        fns, vocab = self.fns, self.vocab

        def chunk(params, cache, buf, lengths, pick, p):
            """DECODE_CHUNK steps from position ``p``: each row's token at p is its prompt's while p is
            inside the prompt, else the greedy pick; it is written to ``buf`` and decoded."""
            model = fns.model(params)

            def body(carry, _):
                buf, cache, pick, p = carry
                prompt_tok = jax.lax.dynamic_slice_in_dim(buf, p, 1, axis=1)[:, 0]
                tok = jnp.where(p >= lengths[:, 0], pick, prompt_tok)
                buf = jax.lax.dynamic_update_slice_in_dim(buf, tok[:, None], p, axis=1)
                logits, cache = model.decode_step(tok, cache)
                return (buf, cache, jnp.argmax(logits[:, :vocab], -1).astype(jnp.int32), p + 1), None

            (buf, cache, pick, p), _ = jax.lax.scan(body, (buf, cache, pick, p), None, length=DECODE_CHUNK)
            return buf, cache, pick, p
        return jax.jit(chunk)

    def generate(self, prompts: list[list[int]], budget: int, rows: int, stopped) -> list[np.ndarray]:
        """Greedy continuations of ``prompts`` (one batch of ``rows``; the spare rows repeat the first): each
        prompt's generated ids, at most ``budget``, decoded :data:`DECODE_CHUNK` steps at a time until
        ``stopped(ids)`` holds for every prompt. The batch is prefilled up to a bucket length at most its
        shortest prompt; each row is fed its own prompt tokens until they run out, then its greedy picks."""
        with jax.set_mesh(self.run.mesh):
            n = len(prompts)
            prompts = prompts + [prompts[0]] * (rows - n)
            lengths = np.array([len(p) for p in prompts], np.int32)
            total = bucket_up(int(lengths.max()) + budget, self.buckets) + DECODE_CHUNK
            head = bucket_down(int(lengths.min()), prefill_buckets(self.max_length))
            buf = np.zeros((rows, total), np.int32)
            for r, p in enumerate(prompts):
                buf[r, :len(p)] = p
            prefill = self._fn("prefill", (rows, head, total), self._build_prefill)
            chunk = self._fn("decode", (rows, total), self._build_chunk)
            pick, cache = prefill(self.run.params, self._put(buf[:, :head]), max_len=total)
            buf_dev, lengths_dev, p_dev = self._put(buf), self._put(lengths[:, None]), jnp.int32(head)
            p, done, host = head, np.zeros(n, bool), buf
            while not done.all():
                buf_dev, cache, pick, p_dev = chunk(self.run.params, cache, buf_dev, lengths_dev, pick, p_dev)
                p += DECODE_CHUNK
                host = np.asarray(buf_dev)
                for r in np.flatnonzero(~done):
                    L = lengths[r]
                    done[r] = p > L and stopped(host[r, L:min(p, L + budget)])
            return [host[r, lengths[r]:min(p, lengths[r] + budget)] for r in range(n)]

"""``next_line``: a local multiple-choice task for lm-eval, built from a prepared store's val split.

Each item is a place in a val document (one per document, unless there are fewer documents than
items): a context of exactly ``context_tokens`` tokens of it that ends at the end
of a line, and as choices that line's successor (the gold) and ``choices - 1`` lines of *other* val
documents (distractors), each written after a line break. A line qualifies with 8 to ``max_line_chars``
(default 120) characters that are not all blank; the context must end with a character that is not blank, since lm-eval moves a
context's trailing whitespace into the continuation. The context re-encodes to exactly
``context_tokens`` tokens (an item whose does not is skipped), so every item has the same context
length: under ``--swap-prefill-only`` the swapped prefill compiles once.

Code predicts its next line from nearby lines (indentation, the statement begun) and from far ones
(names defined pages earlier), which is what a window of W keys, or SA's W random keys, keeps or loses:
the one-GPU study's C2(c) compares the two on this task (``docs/RESULTS.md``).

Writes ``OUT/next_line.jsonl`` (``context``, ``choices``, ``label``, ``doc``) and ``OUT/next_line.yaml``
(lm-eval's ``multiple_choice`` with ``acc`` and ``acc_norm``; its data file by absolute path, so the
folder is rebuilt rather than moved) and ``OUT/next_line.json`` (the settings, the store's fingerprint
and the counts). Run it with::

    hybrid-lm eval RUN --tasks lm_eval --lm-eval-include OUT --lm-eval-tasks next_line [--swap ... --swap-prefill-only]
"""

from __future__ import annotations

import inspect
import json
from pathlib import Path

import numpy as np

from hybrid_lm.data.store import TokenStore
from hybrid_lm.data.tokenizer import load_tokenizer
from hybrid_lm.errors import ConfigError, DataError
from hybrid_lm.eval.longppl import val_documents
from hybrid_lm.files import atomic_write_json, atomic_write_text

NAME = "next_line"
MIN_CHARS, MAX_CHARS = 8, 120
ROUNDS = 8  # items per document at most
SCHEMA = "hybrid_lm.next_line/1"

YAML = """task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{context}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: label
target_delimiter: ""
metric_list:
  - metric: acc
  - metric: acc_norm
"""


def _line_ok(line: str, max_chars: int = MAX_CHARS) -> bool:
    return MIN_CHARS <= len(line) <= max_chars and line.strip() != "" and "\r" not in line


def _item(tok, text: str, rng, context_tokens: int, used: set, max_chars: int):
    """``(line start, context, gold line)`` from one document's text, or None: a line start not in
    ``used`` with at least ``context_tokens`` tokens before it, drawn by ``rng`` among up to 16
    qualifying ones."""
    starts = [i + 1 for i, ch in enumerate(text) if ch == "\n" and i + 1 not in used]
    rng.shuffle(starts)
    tried = 0
    for s in starts:
        end = text.find("\n", s)
        line = text[s:end if end >= 0 else len(text)]
        prev = text[:s - 1]  # the context ends before the line break, on a non-blank character
        if not _line_ok(line, max_chars) or not prev or prev[-1].isspace():
            continue
        tried += 1
        if tried > 16:
            return None
        window = prev[-16 * context_tokens:]  # far more characters than C tokens take
        ids = np.asarray(tok.encode(window))
        if len(ids) <= context_tokens:  # a document's start is no context cut: it needs more before it
            continue
        context = tok.decode(ids[-context_tokens:])
        if context and prev.endswith(context) and len(tok.encode(context)) == context_tokens:
            return s, context, line
    return None


def build_next_line_task(store_path, tokenizer: str, out, *, items: int = 200, context_tokens: int = 2048,
                         choices: int = 4, seed: int = 0, max_line_chars: int = MAX_CHARS,
                         max_continuation_tokens: int | None = None) -> dict:
    """Write the task to ``out`` (see the module doc); returns the settings and counts. DataError when the
    store's val split gives fewer than ``items`` items. ``max_continuation_tokens``: every choice (its line
    break included) at most this many tokens, so that context and choice fit a model's length."""
    for name, v, low in (("items", items, 1), ("context_tokens", context_tokens, 1), ("choices", choices, 2),
                         ("max_line_chars", max_line_chars, MIN_CHARS)):
        if not isinstance(v, int) or v < low:
            raise ConfigError(f"next_line: --{name.replace('_', '-')} {v}: must be an integer >= {low}")
    tok = load_tokenizer(tokenizer)
    docs, info = val_documents(store_path, tok, min_tokens=context_tokens + 8, max_tokens=1 << 40, count=None,
                               what="--store")
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(docs))
    texts = [tok.decode(d) for d in docs]
    pool = [(k, ln) for k, t in enumerate(texts) for ln in t.split("\n") if _line_ok(ln, max_line_chars)]
    if max_continuation_tokens is not None:  # every choice must fit after the context
        sizes = tok.encode_batch(["\n" + ln for _, ln in pool]) if pool else []
        pool = [x for x, ids in zip(pool, sizes) if len(ids) <= max_continuation_tokens]

    def fits(line: str) -> bool:
        return max_continuation_tokens is None or len(tok.encode("\n" + line)) <= max_continuation_tokens

    made, used = [], {k: set() for k in range(len(docs))}
    # one item per document, in a seeded order; more rounds (other lines of the same documents) only when
    # the split has fewer documents than items
    candidates = (int(k) for _ in range(ROUNDS) for k in order)
    for k in candidates:
        if len(made) == items:
            break
        got = _item(tok, texts[k], rng, context_tokens, used[k], max_line_chars)
        if got is None:
            continue
        start, context, gold = got
        used[k].add(start)
        if not fits(gold):
            continue
        others = [ln for j, ln in (pool[i] for i in rng.permutation(len(pool))[:64]) if j != k and ln != gold]
        others = list(dict.fromkeys(others))[:choices - 1]
        if len(others) < choices - 1:
            continue
        label = int(rng.integers(choices))
        options = others[:label] + [gold] + others[label:]
        made.append({"context": context, "choices": ["\n" + o for o in options], "label": label, "doc": int(k)})
    if len(made) < items:
        raise DataError(f"next_line: the val split of {store_path} gave {len(made)} items of {items} ({len(docs)} "
                        f"documents of at least {context_tokens + 8} tokens): lower --items or --context-tokens, or "
                        "prepare a store with more long val documents")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    data = out / f"{NAME}.jsonl"
    atomic_write_text(data, "".join(json.dumps(m) + "\n" for m in made))
    atomic_write_text(out / f"{NAME}.yaml", YAML.format(name=NAME, data=json.dumps(str(data.resolve()))))

    meta = {"schema": SCHEMA, "items": items, "context_tokens": context_tokens, "choices": choices, "seed": seed,
            "max_line_chars": max_line_chars, "max_continuation_tokens": max_continuation_tokens,
            "store": str(Path(store_path)), "store_fingerprint": TokenStore(store_path).fingerprint,
            "tokenizer": tokenizer, "tokenizer_fingerprint": tok.fingerprint,
            "documents": len(docs), "line_pool": len(pool)}
    atomic_write_json(out / f"{NAME}.json", meta, indent=1)
    return meta


def ensure_next_line_task(store_path, tokenizer: str, out, **settings) -> dict:
    """The task in ``out``, built unless ``out/next_line.json`` records these settings and this store."""
    meta_path = Path(out) / f"{NAME}.json"
    if meta_path.exists() and (Path(out) / f"{NAME}.jsonl").exists():
        meta = json.loads(meta_path.read_text())
        defaults = {k: v.default for k, v in inspect.signature(build_next_line_task).parameters.items()
                    if v.kind is v.KEYWORD_ONLY}
        want = {**defaults, **settings}
        if all(meta.get(k) == v for k, v in want.items()) and \
                meta.get("store_fingerprint") == TokenStore(store_path).fingerprint:
            return meta
    return build_next_line_task(store_path, tokenizer, out, **settings)

"""``hybrid-lm data prepare|inspect|verify|train-tokenizer|python-corpus``."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
from tqdm import tqdm

from hybrid_lm.data.corpus import default_dir, embedded_dir
from hybrid_lm.data.prepare import DEFAULT_SHARD_TOKENS, PrepareSettings, prepare
from hybrid_lm.data.pycorpus import DEFAULT_PACKAGES, JSONL, build_python_corpus, format_corpus
from hybrid_lm.data.sources import add_source_args, open_source, spec_from_args
from hybrid_lm.data.stats import format_stats
from hybrid_lm.data.store import TokenStore
from hybrid_lm.data.tokenizer import load_tokenizer, train_bpe
from hybrid_lm.errors import DataError
from hybrid_lm.eval.next_line import NAME, build_next_line_task
from hybrid_lm.progress import bar_disabled


def _default_out(spec, tokenizer: str) -> Path:
    return embedded_dir(tokenizer) if spec.kind == "embedded" else default_dir("tokens")


def cmd_prepare(args) -> int:
    spec = spec_from_args(args)
    out = Path(args.out) if args.out else _default_out(spec, args.tokenizer)
    settings = PrepareSettings(tokenizer=args.tokenizer, val_every=args.val_every,
                               shard_tokens=args.shard_tokens or DEFAULT_SHARD_TOKENS,
                               max_document_bytes=int(args.max_document_mb * (1 << 20)))
    res = prepare(spec, out, settings, workers=args.workers, overwrite=args.overwrite, progress=not args.no_progress)
    if res.skipped:
        print(f"{out} is up to date (same source, tokenizer and settings): nothing to do")
    else:
        print(f"prepared {out}")
    print("\n".join(format_stats(res.stats)))
    source = "embedded" if spec.kind == "embedded" else "tokens"
    print(f"\ntrain on it with:  --gin_param \"DataConfig.source='{source}'\" --gin_param \"DataConfig.path='{out}'\""
          f" --gin_param \"DataConfig.tokenizer='{args.tokenizer}'\""
          f" --gin_param \"ModelConfig.vocab_size={res.stats['tokenizer']['vocab_size']}\"")
    return 0


def cmd_inspect(args) -> int:

    store = TokenStore(args.store)
    stats = store.stats()
    if args.json:
        print(json.dumps(stats, indent=2))
        return 0
    print("\n".join(format_stats(stats)) if stats else f"{store.path}: no stats.json")
    tok = _store_tokenizer(store)
    view = store.split(args.split)
    n = args.windows
    if n and view.n_tokens > args.seq_len:
        print(f"\n{n} windows of {args.seq_len} tokens from the {args.split} split (evenly spaced):")
        for start in np.linspace(0, view.n_tokens - args.seq_len, n).astype(np.int64):
            ids = view.read(int(start), args.seq_len)
            text = tok.decode(ids) if tok is not None else " ".join(map(str, ids[:64]))
            print(f"--- tokens [{start:,}, {start + args.seq_len:,})\n{text}")
    return 0


def _store_tokenizer(store):
    """The store's tokenizer if it can be loaded here and matches the manifest's fingerprint."""
    spec = store.tokenizer.get("spec", "byte")
    try:
        tok = load_tokenizer(spec)
    except Exception as e:  # noqa: BLE001 - inspect still shows the ids
        print(f"(tokenizer {spec!r} cannot be loaded here: {e}; showing ids)")
        return None
    if tok.fingerprint != store.tokenizer.get("fingerprint"):
        print(f"(tokenizer {spec!r} changed since the store was prepared; showing ids)")
        return None
    return tok


def cmd_verify(args) -> int:
    store = TokenStore(args.store)
    counts = store.verify(progress=not args.no_progress)
    print(f"{store.path}: OK   fingerprint {store.fingerprint[:16]}   "
          + "   ".join(f"{k} {v['documents']:,} documents / {v['tokens']:,} tokens" for k, v in counts.items()))
    return 0


def cmd_train_tokenizer(args) -> int:

    spec = spec_from_args(args)
    source = open_source(spec)
    out = Path(args.out)
    if (out / "tokenizer.json").exists() and not args.overwrite:
        raise DataError(f"{out / 'tokenizer.json'} exists: choose another --out or pass --overwrite")

    def texts():
        bar = tqdm(desc="train-tokenizer", unit=" docs", disable=bar_disabled(not args.no_progress))
        for i, doc in enumerate(source.iter_documents()):
            if args.max_docs and i >= args.max_docs:
                break
            bar.update(1)
            yield doc.text
        bar.close()

    path = train_bpe(texts(), args.vocab, out, min_frequency=args.min_frequency)
    tok = load_tokenizer(str(path))
    print(f"wrote {path}: byte-level BPE, {tok.vocab_size:,} ids (asked {args.vocab:,}), eos {tok.eos_id}, "
          f"pad {tok.pad_id}, fingerprint {tok.fingerprint[:16]}")
    print(f"use it with:  --gin_param \"DataConfig.tokenizer='{path}'\" --gin_param "
          f"\"ModelConfig.vocab_size={tok.vocab_size}\"")
    return 0


def cmd_python_corpus(args) -> int:
    packages = DEFAULT_PACKAGES if args.package is None else tuple(p for p in args.package if p != "none")
    meta = build_python_corpus(args.out, packages=packages, roots=args.root, stdlib=not args.no_stdlib,
                               progress=not args.no_progress)
    print("\n".join(format_corpus(meta, args.out)))
    print(f"\nnext:  hybrid-lm data train-tokenizer --source text --path {Path(args.out) / JSONL} --vocab 32768 "
          f"--out TOKENIZER_DIR\n       hybrid-lm data prepare --source text --path {Path(args.out) / JSONL} "
          "--tokenizer TOKENIZER_DIR/tokenizer.json --out STORE")
    return 0


def cmd_next_line_task(args) -> int:
    meta = build_next_line_task(args.store, args.tokenizer, args.out, items=args.items,
                                context_tokens=args.context_tokens, choices=args.choices, seed=args.seed,
                                max_line_chars=args.max_line_chars)
    print(f"wrote {Path(args.out) / NAME}.jsonl and .yaml: {meta['items']} items, contexts of {meta['context_tokens']} "
          f"tokens, {meta['choices']} choices, from {meta['documents']} val documents of {args.store}")
    print(f"run:  hybrid-lm eval RUN --tasks lm_eval --lm-eval-include {args.out} --lm-eval-tasks {NAME}"
          "  [--swap full=sa:128 --swap-prefill-only]")
    return 0


def add_data_commands(sub) -> None:
    p = sub.add_parser("data", help="prepare, inspect and verify token stores; train a tokenizer")
    dsub = p.add_subparsers(dest="data_cmd", required=True)

    q = dsub.add_parser("prepare", help="turn a document source into a token store (default: the embedded corpus)")
    add_source_args(q)
    q.add_argument("--tokenizer", default="byte", help="'byte', or a local tokenizer.json / SentencePiece .model")
    q.add_argument("--out", default=None, help="the store directory (default: where DataConfig.source looks: "
                   "data_cache/embedded[-<tokenizer>] or data_cache/tokens)")
    q.add_argument("--workers", type=int, default=max(1, min(8, (os.cpu_count() or 2) - 1)),
                   help="encoder processes (default: cores - 1, at most 8)")
    q.add_argument("--val-every", type=int, default=10, help="every N-th document goes to the val split")
    q.add_argument("--shard-tokens", type=int, default=None, help="tokens per shard (default 2^25)")
    from hybrid_lm.data.sources import MAX_DOCUMENT_BYTES
    q.add_argument("--max-document-mb", type=float, default=MAX_DOCUMENT_BYTES / (1 << 20), metavar="MiB",
                   help="skip, with a warning, a document longer than this (default %(default)g MiB: one document "
                        "is encoded whole, at about 16 bytes of memory per byte)")
    q.add_argument("--overwrite", action="store_true", help="replace a store prepared with other settings")
    q.add_argument("--no-progress", action="store_true")
    q.set_defaults(fn=cmd_prepare)

    q = dsub.add_parser("inspect", help="print a store's stats and a few decoded windows")
    q.add_argument("store")
    q.add_argument("--split", default="val", choices=("train", "val"))
    q.add_argument("--windows", type=int, default=3)
    q.add_argument("--seq-len", type=int, default=64)
    q.add_argument("--json", action="store_true", help="print stats.json instead")
    q.set_defaults(fn=cmd_inspect)

    q = dsub.add_parser("verify", help="check a store's shards against the manifest: sizes, hashes, ids, index")
    q.add_argument("store")
    q.add_argument("--no-progress", action="store_true")
    q.set_defaults(fn=cmd_verify)

    q = dsub.add_parser("train-tokenizer", help="train a byte-level BPE tokenizer (offline) on a source")
    add_source_args(q)
    q.add_argument("--vocab", type=int, required=True, help="vocabulary size, special tokens included")
    q.add_argument("--out", required=True, help="directory for tokenizer.json")
    q.add_argument("--min-frequency", type=int, default=2)
    q.add_argument("--max-docs", type=int, default=0, help="train on the first N documents (0: all)")
    q.add_argument("--overwrite", action="store_true")
    q.add_argument("--no-progress", action="store_true")
    q.set_defaults(fn=cmd_train_tokenizer)

    q = dsub.add_parser("python-corpus",
                        help="JSON lines of the Python sources on this machine (stdlib, torch, transformers, sympy)",
                        description="One document per .py file of the running Python's standard library, of the "
                                    "installed packages named by --package (default torch, transformers, sympy) and "
                                    "of every --root, in a fixed order, written to OUT/python.jsonl with "
                                    "OUT/corpus.json (file count, bytes, sha256 fingerprint). The one-GPU study's "
                                    "corpus (docs/RESULTS.md). A rerun that finds the same files writes nothing.")
    q.add_argument("--out", required=True, help="folder for python.jsonl and corpus.json")
    q.add_argument("--package", action="append", default=None, metavar="NAME",
                   help="an installed package whose .py files to add (repeatable; default: torch, transformers, "
                        "sympy; 'none' for no package); one that is not installed is listed as missing")
    q.add_argument("--root", action="append", default=[], metavar="DIR", help="another folder of .py files (repeatable)")
    q.add_argument("--no-stdlib", dest="no_stdlib", action="store_true", help="leave out the standard library")
    q.add_argument("--no-progress", action="store_true")
    q.set_defaults(fn=cmd_python_corpus)

    q = dsub.add_parser("next-line-task",
                        help="a local lm-eval multiple-choice task from a store's val split: a document's next line",
                        description="Each item: a context of exactly --context-tokens tokens of a val document "
                                    "ending at a line's end, the next line as the gold choice and lines of other "
                                    "val documents as distractors. Writes OUT/next_line.{jsonl,yaml,json} for "
                                    "`hybrid-lm eval RUN --tasks lm_eval --lm-eval-include OUT --lm-eval-tasks "
                                    "next_line` (hybrid_lm/eval/next_line.py).")
    q.add_argument("--store", required=True, help="a prepared token store (its val split)")
    q.add_argument("--tokenizer", required=True, help="the store's tokenizer (tokenizer.json, .model, or 'byte')")
    q.add_argument("--out", required=True, help="the task folder (--lm-eval-include)")
    q.add_argument("--items", type=int, default=200)
    q.add_argument("--context-tokens", dest="context_tokens", type=int, default=2048)
    q.add_argument("--choices", type=int, default=4, help="the gold line and choices - 1 distractors")
    q.add_argument("--max-line-chars", dest="max_line_chars", type=int, default=120,
                   help="longest line taken as a choice (a choice must fit the model's length after the context)")
    q.add_argument("--seed", type=int, default=0)
    q.set_defaults(fn=cmd_next_line_task)

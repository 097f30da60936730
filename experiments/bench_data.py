"""The data path on the host: ``data prepare`` against plain ``tokenizers`` on the same documents, and the
step-indexed loader against the fastest train step it must feed.

    python experiments/bench_data.py            # 40 MB of JSONL, 16K windows: a few minutes on 2 cores
    python experiments/bench_data.py --quick    # a smoke run

1. **prepare**: the corpus is the embedded essays repeated to ``--corpus-mb`` MB of JSONL, with a BPE tokenizer
   trained on the essays (``--vocab``). The anchor is ``Tokenizer.encode_batch`` of the HF ``tokenizers``
   library over the same texts in a fresh process with one Rayon thread per worker, timed in the same run.
   ``prepare`` is timed end to end (reading, encoding, writing shards, hashes, stats) at 1 and 2 workers.
2. **loader**: ``DataStreams.batch(step)`` for ``--seq-len`` windows and ``--batch`` rows, with and without
   document ids, against the fastest consumer: S1 at T = 16K on 8 H200s, about 5.2M tokens/s for the host
   (``--consumer-tps``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402
from harness import load_config  # noqa: E402

BENCH = "data"
ANCHOR = """
import json, os, sys, time
from tokenizers import Tokenizer
tok = Tokenizer.from_file(sys.argv[1])
texts = [json.loads(l)["text"] for l in open(sys.argv[2])]
t0 = time.perf_counter()
n = sum(len(e.ids) for e in tok.encode_batch(texts))
print(json.dumps({"tokens": n, "seconds": time.perf_counter() - t0}))
"""


def build_corpus(directory: Path, mb: float) -> Path:
    from hybrid_lm.data.sources import embedded_documents

    essays = [t for _, t in embedded_documents()]
    texts, size, i = [], 0, 0
    while size < mb * 1e6:
        t = essays[i % len(essays)] + f"\n(copy {i // len(essays)})"
        texts.append(t)
        size += len(t.encode())
        i += 1
    path = directory / "corpus.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return path


def anchor_encode(tok_path: Path, corpus: Path, threads: int) -> dict:
    """Plain ``tokenizers`` encode_batch in a fresh process limited to ``threads`` Rayon threads."""
    env = {**os.environ, "RAYON_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "true" if threads > 1 else "false"}
    out = subprocess.run([sys.executable, "-c", ANCHOR, str(tok_path), str(corpus)], env=env, capture_output=True,
                         text=True, check=True)
    r = json.loads(out.stdout)
    return {"tokens": r["tokens"], "seconds": r["seconds"], "tokens_per_sec": r["tokens"] / r["seconds"]}


def bench_prepare(tok_path: Path, corpus: Path, work: Path, workers: int) -> dict:
    from hybrid_lm.data.prepare import PrepareSettings, prepare
    from hybrid_lm.data.sources import SourceSpec

    out = work / f"store_w{workers}"
    t0 = time.perf_counter()
    res = prepare(SourceSpec(kind="text", paths=(str(corpus),)), out, PrepareSettings(tokenizer=str(tok_path)),
                  workers=workers, progress=False)
    seconds = time.perf_counter() - t0
    tokens = res.stats["tokens"]
    return {"part": "prepare", "workers": workers, "tokens": tokens, "seconds": seconds,
            "tokens_per_sec": tokens / seconds, "fingerprint": res.manifest["fingerprint"], "store": str(out)}


def bench_loader(store: Path, tok_path: Path, vocab: int, seq_len: int, batch: int, steps: int,
                 doc_mask: bool) -> dict:
    from hybrid_lm.data.pipeline import DataStreams

    cfg = load_config([], ["DataConfig.source='tokens'", f"DataConfig.path='{store}'",
                           f"DataConfig.tokenizer='{tok_path}'", f"ModelConfig.vocab_size={vocab}",
                           f"DataConfig.seq_len={seq_len}", f"TrainConfig.global_batch={batch}",
                           "DataConfig.eval_windows=1", f"DataConfig.document_mask={doc_mask}"])
    data = DataStreams(cfg)
    data.batch(0)
    t0 = time.perf_counter()
    for s in range(1, steps + 1):
        data.batch(s)
    seconds = time.perf_counter() - t0
    return {"part": "loader", "seq_len": seq_len, "batch": batch, "document_mask": doc_mask, "steps": steps,
            "seconds": seconds, "tokens_per_sec": steps * batch * seq_len / seconds}


def main(argv=None) -> dict:
    ap = harness.parser(BENCH, __doc__)
    ap.add_argument("--corpus-mb", type=float, default=40.0)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--seq-len", type=int, default=16384)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--consumer-tps", type=float, default=5.2e6, help="tokens/s of the fastest consumer")
    args = ap.parse_args(argv)
    if args.quick:
        args.corpus_mb, args.vocab, args.seq_len, args.steps = 0.5, 512, 1024, 5
    from hybrid_lm.data.sources import embedded_documents
    from hybrid_lm.data.tokenizer import train_bpe

    t_start = time.time()
    rows = []
    with tempfile.TemporaryDirectory() as d:
        work = Path(d)
        tok_path = train_bpe((t for _, t in embedded_documents()), args.vocab, work / "tok")
        corpus = build_corpus(work, args.corpus_mb)
        for w in (1, 2):
            anchor = anchor_encode(tok_path, corpus, w)
            row = bench_prepare(tok_path, corpus, work, w)
            row.update(anchor_tokens_per_sec=anchor["tokens_per_sec"],
                       vs_anchor=row["tokens_per_sec"] / anchor["tokens_per_sec"])
            rows.append(row)
        if rows[0]["fingerprint"] != rows[1]["fingerprint"]:
            raise SystemExit("the worker count changed the store: prepare is not deterministic")
        for m in (False, True):
            row = bench_loader(Path(rows[0]["store"]), tok_path, args.vocab, args.seq_len, args.batch, args.steps, m)
            row["vs_anchor"] = row["tokens_per_sec"] / args.consumer_tps
            rows.append(row)
    for r in rows:
        r.pop("store", None)
    harness.print_table(["prepare workers", "tokens", "s", "tokens/s", "anchor tokens/s", "vs anchor"],
                        [[r["workers"], f"{r['tokens']:,}", f"{r['seconds']:.2f}", f"{r['tokens_per_sec']:,.0f}",
                          f"{r['anchor_tokens_per_sec']:,.0f}", f"{r['vs_anchor']:.2f}"]
                         for r in rows if r["part"] == "prepare"])
    harness.print_table(["loader seq_len", "batch", "doc ids", "tokens/s", "vs consumer"],
                        [[r["seq_len"], r["batch"], r["document_mask"], f"{r['tokens_per_sec']:,.0f}",
                          f"{r['vs_anchor']:.2f}"] for r in rows if r["part"] == "loader"])
    path = harness.write_result(BENCH, args.out, argv, rows, started=t_start, cpu_count=os.cpu_count(),
                                corpus_mb=args.corpus_mb,
                                anchor={"prepare": "tokenizers encode_batch, same texts, one thread per worker",
                                        "loader": f"the fastest consumer, {args.consumer_tps:.3g} tokens/s"})
    print(f"wrote {path}")
    return {"rows": rows}


if __name__ == "__main__":
    main()

#!/usr/bin/env python
"""Data-path throughput on the CPU (issue 14, item 7): ``data prepare`` against plain ``tokenizers``
``encode_batch`` on the same documents, and the step-indexed loader on packed windows.

    python experiments/bench_data.py --out experiments/results/bench_data.json
    python experiments/bench_data.py --quick          # a smaller corpus, for a smoke run

1. Prepare: the corpus is the embedded essays repeated to ``--corpus-mb`` MB of JSONL, with a BPE
   tokenizer trained on the essays (``--vocab``). The anchor is ``Tokenizer.encode_batch`` of the
   HF ``tokenizers`` library over the same texts in one process with one Rayon thread per worker
   (``TOKENIZERS_PARALLELISM``/``RAYON_NUM_THREADS``), timed in the same run. ``prepare`` is timed
   end to end (reading, encoding, writing shards, hashes, stats) at 1 and 2 workers. Target: >= 0.8x
   the anchor's tokens/s per worker.
2. Loader: ``DataStreams.batch(step)`` for ``--seq-len`` windows (16K by default) and
   ``--batch`` rows, with and without document ids, against the fastest consumer: S1 at T=16K on
   8 H200s, about 5.2M tokens/s for the host (``--consumer-tps``). Target: >= 2x.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def build_corpus(directory: Path, mb: float) -> tuple[Path, list[str]]:
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
    return path, texts


ANCHOR = """
import json, os, sys, time
from tokenizers import Tokenizer
tok = Tokenizer.from_file(sys.argv[1])
texts = [json.loads(l)["text"] for l in open(sys.argv[2])]
t0 = time.perf_counter()
n = sum(len(e.ids) for e in tok.encode_batch(texts))
print(json.dumps({"tokens": n, "seconds": time.perf_counter() - t0}))
"""


def anchor_encode(tok_path: Path, corpus: Path, threads: int) -> dict:
    """Plain ``tokenizers`` encode_batch in a fresh process limited to ``threads`` Rayon threads."""
    env = {**os.environ, "RAYON_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "true" if threads > 1 else "false"}
    out = subprocess.run([sys.executable, "-c", ANCHOR, str(tok_path), str(corpus)], env=env, capture_output=True,
                         text=True, check=True)
    return json.loads(out.stdout)


def bench_prepare(tok_path: Path, corpus: Path, work: Path, workers: int) -> dict:
    from hybrid_lm.data.prepare import PrepareSettings, prepare
    from hybrid_lm.data.sources import SourceSpec

    out = work / f"store_w{workers}"
    t0 = time.perf_counter()
    res = prepare(SourceSpec(kind="text", paths=(str(corpus),)), out, PrepareSettings(tokenizer=str(tok_path)),
                  workers=workers, progress=False)
    seconds = time.perf_counter() - t0
    tokens = res.stats["tokens"]
    return {"workers": workers, "tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds,
            "fingerprint": res.manifest["fingerprint"], "store": str(out)}


def bench_loader(store: Path, tok_path: Path, seq_len: int, batch: int, steps: int, doc_mask: bool) -> dict:
    from hybrid_lm.config import load_config
    from hybrid_lm.data.pipeline import DataStreams

    cfg = load_config([], [f"DataConfig.source='tokens'", f"DataConfig.path='{store}'",
                           f"DataConfig.tokenizer='{tok_path}'", "ModelConfig.vocab_size=4096",
                           f"DataConfig.seq_len={seq_len}", f"TrainConfig.global_batch={batch}",
                           "DataConfig.eval_windows=1", f"DataConfig.document_mask={doc_mask}"])
    data = DataStreams(cfg)
    data.batch(0)
    t0 = time.perf_counter()
    for s in range(1, steps + 1):
        data.batch(s)
    seconds = time.perf_counter() - t0
    tokens = steps * batch * seq_len
    return {"seq_len": seq_len, "batch": batch, "document_mask": doc_mask, "steps": steps, "seconds": seconds,
            "tokens_per_s": tokens / seconds}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--corpus-mb", type=float, default=40.0)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--seq-len", type=int, default=16384)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--consumer-tps", type=float, default=5.2e6, help="tokens/s of the fastest consumer")
    ap.add_argument("--quick", action="store_true", help="4 MB corpus, 2K windows: a smoke run")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.quick:
        args.corpus_mb, args.seq_len, args.steps = 4.0, 2048, 10

    from hybrid_lm.data.sources import embedded_documents
    from hybrid_lm.data.tokenizer import train_bpe

    res: dict = {"cpu_count": os.cpu_count(), "corpus_mb": args.corpus_mb}
    with tempfile.TemporaryDirectory() as d:
        work = Path(d)
        tok_path = train_bpe((t for _, t in embedded_documents()), args.vocab, work / "tok")
        corpus, _ = build_corpus(work, args.corpus_mb)
        rows = []
        for w in (1, 2):
            anchor = anchor_encode(tok_path, corpus, w)
            ours = bench_prepare(tok_path, corpus, work, w)
            ratio = ours["tokens_per_s"] / (anchor["tokens"] / anchor["seconds"])
            rows.append({**ours, "anchor_tokens_per_s": anchor["tokens"] / anchor["seconds"], "vs_anchor": ratio})
        assert rows[0]["fingerprint"] == rows[1]["fingerprint"], "the worker count changed the store"
        res["prepare"] = rows
        loads = [bench_loader(Path(rows[0]["store"]), tok_path, args.seq_len, args.batch, args.steps, m)
                 for m in (False, True)]
        for r in loads:
            r["vs_consumer"] = r["tokens_per_s"] / args.consumer_tps
        res["loader"] = loads

    print(f"{'prepare':<10}{'workers':>8}{'tokens':>14}{'s':>8}{'tokens/s':>14}{'anchor tok/s':>14}{'vs anchor':>11}")
    for r in res["prepare"]:
        print(f"{'':<10}{r['workers']:>8}{r['tokens']:>14,}{r['seconds']:>8.2f}{r['tokens_per_s']:>14,.0f}"
              f"{r['anchor_tokens_per_s']:>14,.0f}{r['vs_anchor']:>11.2f}")
    print(f"\n{'loader':<10}{'seq_len':>8}{'batch':>7}{'doc ids':>9}{'tokens/s':>16}{'vs consumer':>13}")
    for r in res["loader"]:
        print(f"{'':<10}{r['seq_len']:>8}{r['batch']:>7}{str(r['document_mask']):>9}{r['tokens_per_s']:>16,.0f}"
              f"{r['vs_consumer']:>13.2f}")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

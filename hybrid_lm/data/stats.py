"""A token store's statistics: ``stats.json`` and ``doc_lengths.png`` (written by ``data prepare``,
printed by ``data inspect``)."""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from hybrid_lm.data import store as st
from hybrid_lm.files import atomic_write_json


def _entropy(counts: np.ndarray) -> float:
    """Order-0 (unigram) entropy in bits per token of a count vector."""
    p = counts[counts > 0] / max(counts.sum(), 1)
    return float(-(p * np.log2(p)).sum())


def _split_counts(view: st.SplitView, vocab: int) -> np.ndarray:
    counts = np.zeros(vocab, np.int64)
    for part in view.iter_chunks():
        counts += np.bincount(part, minlength=vocab)[:vocab]
    return counts


def length_histogram(lengths: np.ndarray, bins: int = 40) -> dict:
    """Log-spaced histogram of document lengths in tokens."""
    hi = max(int(lengths.max(initial=1)), 2)
    edges = np.unique(np.round(np.logspace(0, math.log10(hi + 1), bins + 1)).astype(np.int64))
    counts, _ = np.histogram(lengths, bins=edges)
    return {"edges": edges.tolist(), "counts": counts.tolist()}


def write_stats(store: st.TokenStore, tok, source_stats, no_tokens: int, seconds: float, name: str) -> dict:
    """Compute, write (``stats.json``, ``doc_lengths.png``) and return the store's statistics."""
    vocab = int(store.tokenizer["vocab_size"])
    token_bytes = np.asarray(tok.token_bytes, dtype=np.int64)
    splits, all_lengths = {}, []
    for split in st.SPLITS:
        view = store.split(split)
        recs = store.manifest["splits"][split]["shards"]
        text_bytes = sum(r["text_bytes"] for r in recs)
        lengths = view.doc_lengths
        all_lengths.append(lengths)
        counts = _split_counts(view, vocab)
        h0 = _entropy(counts)
        decoded_bytes = int(counts @ token_bytes[: counts.size])
        splits[split] = {
            "documents": view.n_docs, "tokens": view.n_tokens, "text_bytes": text_bytes,
            "bytes_per_token": text_bytes / max(view.n_tokens, 1),
            "order0_entropy_bits_per_token": h0,
            "order0_entropy_bits_per_byte": h0 * view.n_tokens / max(decoded_bytes, 1),
            # bytes the tokens decode to (separators included: EOS has none, byte-level "\n\n" two)
            "decoded_bytes": decoded_bytes,
        }
    lengths = np.concatenate(all_lengths)
    src = dataclasses.asdict(source_stats) if dataclasses.is_dataclass(source_stats) else dict(source_stats or {})
    skipped = {k: v for k, v in src.items() if isinstance(v, int) and k != "documents" and "replaced" not in k}
    skipped["no_tokens"] = no_tokens
    q = np.percentile(lengths, [50, 90, 99]) if lengths.size else [0, 0, 0]
    stats = {
        "store": name, "fingerprint": store.fingerprint, "dtype": store.dtype.name,
        "tokenizer": store.tokenizer, "splits": splits,
        "documents": int(lengths.size), "tokens": int(lengths.sum()),
        "bytes_per_token": sum(s["text_bytes"] for s in splits.values()) / max(int(lengths.sum()), 1),
        "skipped": skipped,
        "replaced": {k: v for k, v in src.items() if "replaced" in k},
        "source_counts": src,
        "doc_length_tokens": {"min": int(lengths.min()) if lengths.size else 0, "p50": float(q[0]), "p90": float(q[1]),
                              "p99": float(q[2]), "max": int(lengths.max(initial=0)),
                              "mean": float(lengths.mean()) if lengths.size else 0.0},
        "histogram": length_histogram(lengths),
        "seconds": seconds, "tokens_per_second": int(lengths.sum()) / max(seconds, 1e-9),
    }
    atomic_write_json(store.path / "stats.json", stats, indent=2)
    plot_lengths(stats, store.path / "doc_lengths.png")
    return stats


def plot_lengths(stats: dict, path) -> None:
    import matplotlib  # plots only (a slow import)
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # plots only (a slow import)

    h = stats["histogram"]
    edges, counts = np.asarray(h["edges"]), np.asarray(h["counts"])
    fig, ax = plt.subplots(figsize=(7, 4))
    if counts.size:
        ax.bar(edges[:-1], counts, width=np.diff(edges), align="edge", color="#4c72b0", edgecolor="white", lw=0.3)
    ax.set_xscale("log")
    d = stats["doc_length_tokens"]
    for k, ls in (("p50", "--"), ("p90", ":")):
        ax.axvline(max(d[k], 1), color="k", ls=ls, lw=1, label=f"{k} {d[k]:,.0f}")
    ax.set_xlabel("document length (tokens, separator included)")
    ax.set_ylabel("documents")
    ax.set_title(f"{stats['store']}: {stats['documents']:,} documents, {stats['tokens']:,} tokens")
    ax.legend(frameon=False)
    fig.tight_layout()
    tmp = path.with_name(path.name + ".tmp.png")
    fig.savefig(tmp, dpi=120)
    plt.close(fig)
    tmp.replace(path)


def format_stats(stats: dict) -> list[str]:
    """Lines for the terminal."""
    lines = [f"store {stats['store']}   fingerprint {stats['fingerprint'][:16]}   dtype {stats['dtype']}   "
             f"tokenizer {stats['tokenizer'].get('kind')} ({stats['tokenizer'].get('vocab_size'):,} ids)"]
    lines.append(f"{'split':<8}{'documents':>12}{'tokens':>16}{'bytes/token':>13}{'order-0 bits/byte':>19}")
    for name, s in stats["splits"].items():
        lines.append(f"{name:<8}{s['documents']:>12,}{s['tokens']:>16,}{s['bytes_per_token']:>13.3f}"
                     f"{s['order0_entropy_bits_per_byte']:>19.3f}")
    d = stats["doc_length_tokens"]
    lines.append(f"document length (tokens): min {d['min']:,}  p50 {d['p50']:,.0f}  p90 {d['p90']:,.0f}  "
                 f"p99 {d['p99']:,.0f}  max {d['max']:,}")
    skipped = {k: v for k, v in stats["skipped"].items() if v}
    lines.append("skipped: " + (", ".join(f"{k} {v:,}" for k, v in skipped.items()) if skipped else "none"))
    replaced = {k: v for k, v in stats.get("replaced", {}).items() if v}
    if replaced:
        lines.append("kept with replacements: " + ", ".join(f"{k} {v:,}" for k, v in replaced.items()))
    lines.append(f"prepared in {stats['seconds']:.1f} s ({stats['tokens_per_second']:,.0f} tokens/s)")
    return lines

"""``hybrid-lm data prepare|inspect|verify|train-tokenizer``."""

from __future__ import annotations

import json
from pathlib import Path


def cmd_prepare(args) -> int:
    from hybrid_lm.data.corpus import default_dir, prepare_embedded, prepare_text_files

    if args.text:
        out = Path(args.out) if args.out else default_dir("text")
        meta = prepare_text_files(args.text, out, args.tokenizer)
    else:
        out = Path(args.out) if args.out else default_dir("embedded")
        meta = prepare_embedded(out, args.tokenizer)
    print(f"prepared {out}:")
    print(json.dumps(meta, indent=2))
    return 0


def add_data_commands(sub) -> None:
    p = sub.add_parser("data", help="prepare, inspect and verify token stores; train a tokenizer")
    dsub = p.add_subparsers(dest="data_cmd", required=True)
    q = dsub.add_parser("prepare", help="build train/val token files (default: the embedded corpus)")
    q.add_argument("--text", nargs="*", help="plain-text or JSONL files instead of the embedded corpus")
    q.add_argument("--out", default=None)
    q.add_argument("--tokenizer", default="byte")
    q.set_defaults(fn=cmd_prepare)

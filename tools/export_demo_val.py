"""Write the demo model's validation split as text: models/demo-hf/val.txt.

    .venv-ref/bin/python tools/export_demo_val.py [--seed 1234] [--val-frac 0.03]

The documents are the ones tools/train_demo.py held out (same corpus, same seeded split),
separated by <|endoftext|> and ended with it; the tokenizer adds the leading one, so encoding
the file gives exactly the token stream the training script's evaluation scored, and
`moeshard perplexity models/demo-hf --text models/demo-hf/val.txt` measures the same thing as
the training log's final validation perplexity. The corpus is the Python 3.11 documentation
(Debian package python3.11-doc, PSF licence, redistributable).
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import train_demo  # noqa: E402  (the training script's own corpus and split code)

EOT = "<|endoftext|>"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--val-frac", type=float, default=0.03)
    ap.add_argument("--doc-root", default=None)
    ap.add_argument(
        "--out",
        default=os.path.join(os.path.dirname(__file__), "..", "models", "demo-hf", "val.txt"),
    )
    args = ap.parse_args()
    docs = train_demo.load_docs(train_demo.find_corpus(args.doc_root))
    _, val = train_demo.split_docs(docs, args.val_frac, args.seed)
    # the tokenizer starts every text with <|endoftext|> itself (its post-processor)
    text = EOT.join(t for _, t in val) + EOT
    tmp = args.out + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, args.out)
    print(f"wrote {args.out}: {len(val)} documents, {len(text)} characters")


if __name__ == "__main__":
    main()

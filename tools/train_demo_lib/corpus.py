"""The training corpus: the Python 3.11 documentation shipped by Debian (python3.11-doc),
main-body HTML converted to plain text, and its deterministic document-level split."""

# the corpus metadata's licence string is one long literal (as in train_demo.py)
# ruff: noqa: E501

from __future__ import annotations

import glob
import hashlib
import os
import re
import subprocess
import sys
from html.parser import HTMLParser

DOC_GLOBS = ["/usr/share/doc/python3.11/html", "/usr/share/doc/python3.*/html"]
SKIP_RE = re.compile(
    r"^(genindex.*|py-modindex|search|download|contents|index|copyright|license|bugs|about)\.html$"
    r"|^whatsnew/changelog\.html$"
    r"|^_"
)
BLOCK_TAGS = {
    "p",
    "div",
    "section",
    "h1",
    "h2",
    "h3",
    "h4",
    "h5",
    "h6",
    "li",
    "ul",
    "ol",
    "dl",
    "dt",
    "dd",
    "table",
    "tr",
    "pre",
    "blockquote",
    "br",
    "hr",
    "figure",
    "caption",
}
SKIP_TAGS = {"script", "style", "head", "title"}


class _MainText(HTMLParser):
    """Collect the text of Sphinx's <div class="body" role="main"> only."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.out: list[str] = []
        self.div_depth = 0  # depth of <div> nesting inside the main body
        self.in_main = False
        self.done = False
        self.skip = 0  # inside script/style/headerlink
        self.pre = 0

    def handle_starttag(self, tag, attrs):
        if self.done:
            return
        a = dict(attrs)
        if not self.in_main:
            if tag == "div" and a.get("role") == "main":
                self.in_main = True
                self.div_depth = 1
            return
        if tag == "div":
            self.div_depth += 1
        if tag in SKIP_TAGS or (tag == "a" and "headerlink" in (a.get("class") or "")):
            self.skip += 1
            self._skip_tag = tag
        if tag == "pre":
            self.pre += 1
        if tag in BLOCK_TAGS:
            self.out.append("\n")

    def handle_endtag(self, tag):
        if self.done or not self.in_main:
            return
        if tag in SKIP_TAGS or (tag == "a" and self.skip):
            if self.skip:
                self.skip -= 1
            return
        if tag == "pre" and self.pre:
            self.pre -= 1
        if tag in BLOCK_TAGS:
            self.out.append("\n")
        if tag == "div":
            self.div_depth -= 1
            if self.div_depth == 0:
                self.in_main = False
                self.done = True

    def handle_data(self, data):
        if self.done or not self.in_main or self.skip:
            return
        if self.pre:
            self.out.append(data)
        else:
            self.out.append(re.sub(r"\s+", " ", data))

    def text(self) -> str:
        t = "".join(self.out).replace("\u00b6", "")
        lines = [ln.rstrip() for ln in t.split("\n")]
        # strip leading single spaces produced by whitespace collapsing (not inside code)
        lines = [ln[1:] if ln.startswith(" ") and not ln.startswith("  ") else ln for ln in lines]
        t = "\n".join(lines)
        t = re.sub(r"\n{3,}", "\n\n", t)
        return t.strip() + "\n"


def html_to_text(path: str) -> str:
    with open(path, encoding="utf-8", errors="replace") as f:
        raw = f.read()
    p = _MainText()
    p.feed(raw)
    p.close()
    return p.text()


def find_corpus(doc_root: str | None):
    roots = [doc_root] if doc_root else []
    for g in DOC_GLOBS:
        roots += sorted(glob.glob(g))
    for r in roots:
        if r and os.path.isfile(os.path.join(r, "library", "functions.html")):
            return os.path.realpath(r)
    sys.exit(
        "corpus not found: install it with `apt-get update && apt-get install -y python3.11-doc`"
    )


def corpus_meta(root: str) -> dict:
    meta = {
        "path": root,
        "package": None,
        "version": None,
        "licence": "PSF-2.0 (Python Software Foundation License Version 2; redistributable). Code examples in "
        "the docs are dual-licensed PSF-2.0 / 0BSD (Zero-Clause BSD) since Python 3.8.6.",
    }
    try:
        owner = subprocess.run(
            ["dpkg-query", "-S", os.path.join(root, "library", "functions.html")],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        pkg = owner.split(":")[0].strip()
        ver = subprocess.run(
            ["dpkg-query", "-W", "-f=${Version}", pkg], capture_output=True, text=True, check=True
        ).stdout.strip()
        meta["package"], meta["version"] = pkg, ver
        meta["source"] = f"Debian package {pkg} {ver}"
        cp = f"/usr/share/doc/{pkg}/copyright"
        if os.path.exists(cp):
            txt = open(cp, encoding="utf-8", errors="replace").read()
            meta["copyright_file"] = cp
            meta["licence_check_psf_text_in_copyright"] = (
                "PYTHON SOFTWARE FOUNDATION LICENSE VERSION 2" in txt
            )
    except Exception as e:  # pragma: no cover - non-Debian host
        meta["source"] = f"unknown package ({e})"
    return meta


def load_docs(root: str) -> list[tuple[str, str]]:
    files = []
    for dp, dns, fns in os.walk(root):
        dns.sort()
        for fn in fns:
            if fn.endswith(".html"):
                rel = os.path.relpath(os.path.join(dp, fn), root)
                if not SKIP_RE.search(rel) and not rel.startswith("_"):
                    files.append(rel)
    files.sort()
    docs = []
    for rel in files:
        t = html_to_text(os.path.join(root, rel))
        if len(t) > 200:
            docs.append((rel, t))
    return docs


def split_docs(docs, val_frac: float, seed: int):
    """Deterministic document-level split: order docs by sha1(seed:path), take docs into
    validation until val_frac of total characters is reached."""
    total = sum(len(t) for _, t in docs)
    order = sorted(docs, key=lambda d: hashlib.sha1(f"{seed}:{d[0]}".encode()).hexdigest())
    val, vc = [], 0
    for rel, t in order:
        if vc >= val_frac * total:
            break
        if len(t) > 0.02 * total:  # keep single huge pages out of validation
            continue
        val.append(rel)
        vc += len(t)
    vs = set(val)
    train = [(r, t) for r, t in docs if r not in vs]
    valid = [(r, t) for r, t in docs if r in vs]
    return train, valid

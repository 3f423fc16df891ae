"""Text <-> token ids for a model directory: Hugging Face `tokenizer.json`, or the tiktoken
files Kimi models publish (`tiktoken.model` and the special tokens in `tokenizer_config.json`).

Both give the same two calls, `encode(text) -> ids` and `decode(ids) -> text` (special
tokens written as their text).  `load` picks by the files present; a directory with neither
has no tokenizer (generation then takes `--prompt-ids`).

Kimi's tiktoken tokenizer (`tokenization_kimi.py` in Kimi K2's and K3's releases):
  * `tiktoken.model`: the byte-level BPE ranks, one ``base64(token) rank`` per line;
  * the special tokens follow them: ids ``n_base .. n_base + 255``, named by
    `tokenizer_config.json`'s ``added_tokens_decoder`` where it lists them and
    ``<|reserved_token_{id}|>`` elsewhere (K3: 163,584 + 256 = its 163,840 vocabulary);
  * text is split by `KIMI_PATTERN` (runs of Han characters kept apart from other letters)
    before BPE, and special tokens written in the text are encoded as themselves.
"""

from __future__ import annotations

import base64
import binascii
import json
from pathlib import Path

from moeshard.moe.errors import StoreError

TIKTOKEN_FILE = "tiktoken.model"
TOKENIZER_FILES = f"tokenizer.json or {TIKTOKEN_FILE}"
KIMI_RESERVED = 256  # special-token ids after the BPE ranks
# Kimi's pre-tokenizer: Han runs; words with an optional contraction (cased-letter runs split
# the way cl100k does, Han excluded by class intersection); 1-3 digits; punctuation runs;
# newlines; other whitespace.
KIMI_PATTERN = "|".join(
    [
        r"[\p{Han}]+",
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"
        r"[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"
        r"[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
        r"\p{N}{1,3}",
        r" ?[^\s\p{L}\p{N}]+[\r\n]*",
        r"\s*[\r\n]+",
        r"\s+(?!\S)",
        r"\s+",
    ]
)
# tiktoken panics on very long runs without a split; cut such runs (as Kimi's code does).
MAX_RUN = 25_000


class HFTokenizer:
    """`tokenizer.json` through the `tokenizers` library."""

    def __init__(self, path: Path):
        from tokenizers import Tokenizer

        try:
            self._tok = Tokenizer.from_file(str(path))
        except Exception as exc:  # the tokenizers library raises its own bare Exception
            raise StoreError(f"{path}: not a tokenizer file: {exc}") from None

    def encode(self, text: str) -> list[int]:
        # encode_batch, not encode: the same ids, but it lets go of the interpreter lock while
        # it works (a 3.9 MB prompt held it 2.06 s through encode, 52 ms through this), so
        # `serve` tokenizing on a worker thread does not stall its event loop
        return self._tok.encode_batch([text])[0].ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=False)


class KimiTiktoken:
    """Kimi's `tiktoken.model` + `tokenizer_config.json` (see the module docstring)."""

    def __init__(self, directory: Path):
        import tiktoken

        path = directory / TIKTOKEN_FILE
        ranks = read_ranks(path)
        n_base = len(ranks)
        named = _added_tokens(directory / "tokenizer_config.json")
        stray = sorted(i for i in named if not n_base <= i < n_base + KIMI_RESERVED)
        if stray:
            raise StoreError(
                f"{directory / 'tokenizer_config.json'}: added token id {stray[0]} is outside "
                f"the special range {n_base}..{n_base + KIMI_RESERVED - 1} after {path.name}"
            )
        self.special = {
            named.get(i, f"<|reserved_token_{i}|>"): i
            for i in range(n_base, n_base + KIMI_RESERVED)
        }
        self._enc = tiktoken.Encoding(
            name=f"kimi:{path}",
            pat_str=KIMI_PATTERN,
            mergeable_ranks=ranks,
            special_tokens=self.special,
        )
        self.vocab_size = n_base + KIMI_RESERVED

    def encode(self, text: str) -> list[int]:
        ids: list[int] = []
        for piece in _runs_at_most(text, MAX_RUN):
            ids += self._enc.encode(piece, allowed_special="all")
        return ids

    def decode(self, ids: list[int]) -> str:
        return self._enc.decode(ids)


def read_ranks(path: Path) -> dict[bytes, int]:
    """A tiktoken BPE file: ``base64(token) rank`` per line, ranks 0..n-1.  (Read here, not
    with tiktoken's loader, which caches files by path and would miss a replaced file.)"""
    try:
        lines = path.read_bytes().splitlines()
    except OSError as exc:
        raise StoreError(f"{path}: unreadable ({exc.strerror})") from None
    ranks: dict[bytes, int] = {}
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            token, rank = line.split()
            ranks[base64.b64decode(token, validate=True)] = int(rank)
        except (ValueError, binascii.Error):
            raise StoreError(
                f"{path}: not a tiktoken BPE file (line {number} is not 'base64 rank')"
            ) from None
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise StoreError(f"{path}: not a tiktoken BPE file (ranks are not 0..{len(ranks) - 1})")
    return ranks


def _added_tokens(config_path: Path) -> dict[int, str]:
    """id -> text of `added_tokens_decoder` in tokenizer_config.json ({} without one)."""
    if not config_path.exists():
        return {}
    try:
        config = json.loads(config_path.read_text())
        decoder = config.get("added_tokens_decoder") or {}
        return {int(i): str(t["content"]) for i, t in decoder.items()}
    except (OSError, ValueError, TypeError, KeyError, AttributeError) as exc:
        raise StoreError(f"{config_path}: unreadable added_tokens_decoder ({exc})") from None


def _runs_at_most(text: str, limit: int):
    """text cut so that no piece has a run of more than `limit` whitespace or non-whitespace
    characters (the cuts fall inside such runs only)."""
    start, run, space = 0, 0, None
    for i, ch in enumerate(text):
        is_space = ch.isspace()
        run = run + 1 if is_space == space else 1
        space = is_space
        if run > limit:
            yield text[start:i]
            start, run = i, 1
    if start < len(text):
        yield text[start:]


TextTokenizer = HFTokenizer | KimiTiktoken


def load(directory: Path) -> TextTokenizer | None:
    """The tokenizer of a model or checkpoint directory, or None if it has none."""
    if (directory / "tokenizer.json").exists():
        return HFTokenizer(directory / "tokenizer.json")
    if (directory / TIKTOKEN_FILE).exists():
        return KimiTiktoken(directory)
    return None


class IncrementalText:
    """Generated ids in, text out as it becomes final, without decoding everything again for
    each token (which made a long answer cost quadratic time).

    Each new token decodes a short window: ids from the previous read point (a character
    boundary) on, against the window without the new ids. The difference is the new text;
    it is held back while it ends in a partial UTF-8 character (U+FFFD). Decoding the window
    with the token before it keeps tokenizers that drop a leading space at the start of a
    decode (SentencePiece) giving the same text as one decode of everything
    (tests/test_tokenizer.py checks that on random ids)."""

    def __init__(self, decode):
        self.decode = decode  # ids -> str
        self.ids: list[int] = []
        self.text = ""  # the final text so far
        self._prefix = 0  # the window starts here: the read point before the last
        self._read = 0  # text is final up to this id

    def push(self, token: int) -> str:
        """Add a token; returns the text that became final with it (often all of its own)."""
        self.ids.append(token)
        before = self.decode(self.ids[self._prefix : self._read])
        now = self.decode(self.ids[self._prefix :])
        if len(now) <= len(before) or now.endswith("\ufffd"):
            return ""  # a character still arriving (or nothing printable yet)
        delta = now[len(before) :]
        self._prefix, self._read = self._read, len(self.ids)
        self.text += delta
        return delta

    def flush(self) -> str:
        """At the end: whatever is still held back (a character that never completed)."""
        before = self.decode(self.ids[self._prefix : self._read])
        delta = self.decode(self.ids[self._prefix :])[len(before) :]
        self._prefix = self._read = len(self.ids)
        self.text += delta
        return delta

"""Kimi's tiktoken tokenizer (`moeshard.coordinator.tokenizer.KimiTiktoken`) against a plain
reference.

The reference splits text with the `regex` package (another engine than tiktoken's Rust one,
so the pattern's class intersections must mean the same in both) and runs byte-pair merging
written out here: repeatedly merge the adjacent pair whose concatenation has the lowest rank.
Special tokens written in the text become their ids, as in Kimi's `allowed_special="all"`.
"""

from __future__ import annotations

import base64
import json
import shutil

import pytest
import regex
from helpers import ROOT

from moeshard.coordinator import tokenizer
from moeshard.moe.convert.converter import convert
from moeshard.moe.errors import StoreError

MERGES = [b"th", b"he", b"the", b" the", b"in", b"ing", b" thing", b"ll", b"'ll", b"is", b" is"]
HAN = ["中", "文", "中文", "世界"]  # UTF-8 byte strings of Han characters, merged
TEXT = "\u4e2d\u6587"  # 中文


def vocabulary() -> dict[bytes, int]:
    ranks = {bytes([b]): b for b in range(256)}
    han = [h.encode() for h in HAN]
    pieces = [h[:2] for h in han] + han  # partial UTF-8 sequences merge first
    for token in MERGES + pieces:
        ranks.setdefault(token, len(ranks))
    return ranks


def write_tokenizer(directory, ranks, added=None) -> None:
    lines = [f"{base64.b64encode(t).decode()} {r}" for t, r in ranks.items()]
    (directory / tokenizer.TIKTOKEN_FILE).write_text("\n".join(lines) + "\n")
    n = len(ranks)
    added = added if added is not None else {n: "[BOS]", n + 1: "[EOS]", n + 4: "<|im_end|>"}
    decoder = {str(i): {"content": t, "special": True} for i, t in added.items()}
    config = {"added_tokens_decoder": decoder, "bos_token": "[BOS]", "eos_token": "[EOS]"}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))


def bpe(piece: bytes, ranks: dict[bytes, int]) -> list[int]:
    """A pre-token that is itself in the vocabulary is that token (tiktoken's rule, even where
    merging could not reach it, as for b" thing" here); else merge the lowest-ranked pair."""
    if piece in ranks:
        return [ranks[piece]]
    parts = [bytes([b]) for b in piece]
    while len(parts) > 1:
        pairs = [(ranks.get(parts[i] + parts[i + 1]), i) for i in range(len(parts) - 1)]
        best = (
            min((r, i) for r, i in pairs if r is not None)
            if any(r is not None for r, _ in pairs)
            else None
        )
        if best is None:
            break
        i = best[1]
        parts[i : i + 2] = [parts[i] + parts[i + 1]]
    return [ranks[p] for p in parts]


def reference(text: str, ranks: dict[bytes, int], special: dict[str, int]) -> list[int]:
    pattern = regex.compile(tokenizer.KIMI_PATTERN, flags=regex.V1)
    split = regex.compile("(" + "|".join(regex.escape(s) for s in special) + ")")
    ids: list[int] = []
    for chunk in split.split(text):
        if chunk in special:
            ids.append(special[chunk])
            continue
        for piece in pattern.findall(chunk):
            ids += bpe(piece.encode(), ranks)
    return ids


SAMPLES = [
    "the thing is, they'll do it",
    "THE Thing's",
    TEXT + "\u4e16\u754c and " + TEXT + "123456 !!\n\n  x",
    "bring the ring<|im_end|>[EOS] then",
    "tabs\tand   spaces   \n",
    "",
]


def test_kimi_tiktoken_matches_the_reference(tmp_path):
    ranks = vocabulary()
    write_tokenizer(tmp_path, ranks)
    tok = tokenizer.load(tmp_path)
    assert isinstance(tok, tokenizer.KimiTiktoken)
    n = len(ranks)
    assert tok.vocab_size == n + 256
    assert tok.special["[BOS]"] == n and tok.special["<|im_end|>"] == n + 4
    assert tok.special[f"<|reserved_token_{n + 2}|>"] == n + 2  # gaps are reserved names
    for text in SAMPLES + [f"x<|reserved_token_{n + 9}|>y"]:
        want = reference(text, ranks, tok.special)
        assert tok.encode(text) == want, text
        assert tok.decode(want) == text
    han = tok.encode(TEXT)
    assert han == [ranks[TEXT.encode()]]  # a Han run stays one pre-token


def test_long_runs_are_cut_and_round_trip(tmp_path):
    write_tokenizer(tmp_path, vocabulary())
    tok = tokenizer.load(tmp_path)
    text = "the" * 10_000 + " " * 30_000 + "x"
    assert tok.decode(tok.encode(text)) == text


def test_bad_tokenizer_files_are_named(tmp_path):
    ranks = vocabulary()
    write_tokenizer(tmp_path, ranks, added={len(ranks) + 300: "<|far|>"})
    with pytest.raises(StoreError, match="added token id .* outside the special range"):
        tokenizer.load(tmp_path)
    (tmp_path / tokenizer.TIKTOKEN_FILE).write_text("not base64 at all\n")
    with pytest.raises(StoreError, match="not a tiktoken BPE file"):
        tokenizer.load(tmp_path)
    (tmp_path / tokenizer.TIKTOKEN_FILE).unlink()
    assert tokenizer.load(tmp_path) is None


def test_convert_carries_the_tiktoken_files(tmp_path):
    src = tmp_path / "ckpt"
    shutil.copytree(ROOT / "tests" / "fixtures" / "qwen3_moe", src)
    (src / "tokenizer.json").unlink()
    write_tokenizer(src, vocabulary())
    convert(src, tmp_path / "m", expert_format="f32", progress=False)
    tok = tokenizer.load(tmp_path / "m")
    assert isinstance(tok, tokenizer.KimiTiktoken)
    assert tok.encode("the thing") == reference("the thing", vocabulary(), tok.special)


def _incremental_tokenizers(tmp_path_factory=None):
    import tempfile
    from pathlib import Path

    kimi_dir = Path(tempfile.mkdtemp(prefix="kimi-tok-"))
    write_tokenizer(kimi_dir, vocabulary())
    return {
        "demo": tokenizer.load(ROOT / "models" / "demo-hf"),
        "qwen fixture": tokenizer.load(ROOT / "tests" / "fixtures" / "qwen3_moe"),
        "kimi tiktoken": tokenizer.load(kimi_dir),  # partial UTF-8 pieces of Han characters
    }


INCREMENTAL = _incremental_tokenizers()


@pytest.mark.parametrize("name", sorted(INCREMENTAL))
def test_incremental_text_equals_one_decode_of_everything(name):
    """`IncrementalText` (a short window decoded per token) gives, pushed token by token and
    flushed, exactly one decode of all the ids; nothing it gives out is taken back, and no
    delta ends in half a character. Random ids, including pieces of multi-byte characters."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    tok = INCREMENTAL[name]
    vocab = tok.vocab_size if hasattr(tok, "vocab_size") else tok._tok.get_vocab_size()
    # ids that are pieces of UTF-8 characters come up often
    pieces = [i for i in range(min(vocab, 4096)) if "\ufffd" in tok.decode([i])][:64]
    ids = st.one_of(st.integers(0, vocab - 1), st.sampled_from(pieces or [0]))

    @settings(max_examples=150, deadline=None, derandomize=True)
    @given(st.lists(ids, max_size=40))
    def check(seq):
        text = tokenizer.IncrementalText(tok.decode)
        deltas = [text.push(t) for t in seq]
        assert all(not d.endswith("\ufffd") for d in deltas)
        assert "".join(deltas) + text.flush() == tok.decode(seq)

    check()

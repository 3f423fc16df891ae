"""The fixtures' shared tokenizer: byte-level BPE trained on a small built-in corpus."""

from __future__ import annotations

import codecs
import sys

VOCAB = 384
EOS_TOKEN = "<|endoftext|>"

CORPUS = """\
The quick brown fox jumps over the lazy dog. A small model can still learn a few words.
Once upon a time there was a little town by the sea. Every morning the fishermen went out
in their boats, and every evening they came back with the catch of the day. The children
ran along the beach and the old men sat on the wall and talked about the weather.
The function returns the value of the key when the key is found in the table, and it
returns nothing when the key is missing. The server sends the request to the worker and
the worker sends the answer back to the server. Mixture of experts models route each
token to a few experts, and the router decides which experts see which tokens.
It was a bright cold day in April, and the clocks were striking thirteen. The river ran
under the bridge and the birds sang in the trees. She opened the window and looked out at
the garden, where the flowers were red and yellow and white.
"""


def corpus_lines() -> list[str]:
    import contextlib
    import io

    with contextlib.redirect_stdout(io.StringIO()):
        import this  # noqa: F401

    zen = codecs.decode(sys.modules["this"].s, "rot13")
    return [ln for ln in (CORPUS + zen).splitlines() if ln.strip()]


# ------------------------------------------------------------------------------------------------
# tokenizer


def build_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus_lines(), trainer)
    assert tok.get_vocab_size() <= VOCAB, tok.get_vocab_size()
    return tok

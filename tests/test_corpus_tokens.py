"""`corpus_tokens` encodes a long text a piece at a time (one encode of a 3.2 MB corpus held 280
MiB more, past a training run's plan in a cgroup), with the tokens of one encode."""

from __future__ import annotations

import numpy as np
from mlx_lm.utils import load_tokenizer

from engine.train import data
from engine.train.data import corpus_tokens

TEXT = "".join(
    f"Line {i}: the {i % 7} of a verse,\n"
    + ("\n" if i % 5 == 0 else "")
    + ("  indented\n" if i % 11 == 0 else "")
    for i in range(3000)
)


def test_pieces_give_the_tokens_of_one_encode(checkpoint_dir, monkeypatch):
    tokenizer = load_tokenizer(checkpoint_dir("qwen3_moe"))
    whole = np.array(tokenizer.encode(TEXT), dtype=np.int64)
    monkeypatch.setattr(data, "ENCODE_PIECE_CHARS", 500)  # dozens of pieces
    pieces = corpus_tokens(tokenizer, TEXT, len(whole) + 10)
    assert np.array_equal(pieces, whole)
    first = corpus_tokens(tokenizer, TEXT, 300)
    assert np.array_equal(first, whole[:300])  # stops once it has enough


def test_a_piece_ends_only_where_a_line_starts_with_text():
    text = "a\n\n  b\nc\n \nd"
    assert data._piece_end(text, 0) == len("a\n\n  b\n")
    assert data._piece_end(text, 8) == len("a\n\n  b\nc\n \n")
    assert data._piece_end(text, 100) == len(text)
    assert data._piece_end("no newline at all", 3) == len("no newline at all")

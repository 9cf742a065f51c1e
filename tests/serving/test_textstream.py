"""Incremental detokenisation (serving/protocol.py TextStream): pushing tokens in any chunking releases
exactly the text a full decode gives, never half a UTF-8 character, and stops at the first stop string."""
from __future__ import annotations

import random

import pytest

from tests import tiny_models
from serving.protocol import TextStream

TEXTS = ["plain ascii text, nothing special", "naïve café — ünïcödé ✓ 数学 😀 mixed", "😀😀 a 数 b", "x"]


@pytest.fixture(scope="module")
def tok():
    return tiny_models.make_tokenizer()     # byte-level: multi-byte characters span several tokens


def stream(tok, ids, stops, seed):
    rng = random.Random(seed)
    ts, out, i = TextStream(tok, stops), [], 0
    while i < len(ids):
        n = rng.randint(1, 4)
        piece = ts.push(ids[i: i + n])
        assert "\ufffd" not in piece          # never half a character
        out.append(piece)
        i += n
    out.append(ts.finish())
    return "".join(out), ts


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("seed", range(5))
def test_any_chunking_gives_the_full_decode(tok, text, seed):
    ids = tok(text)["input_ids"]
    got, ts = stream(tok, ids, [], seed)
    assert got == tok.decode(ids, skip_special_tokens=True) == text
    assert not ts.stopped


@pytest.mark.parametrize("seed", range(5))
def test_stop_strings_cut_at_the_first_occurrence(tok, seed):
    text = "first ✓ part STOP second 😀 END third"
    ids = tok(text)["input_ids"]
    got, ts = stream(tok, ids, ["END", "STOP"], seed)
    assert got == "first ✓ part " and ts.stopped
    got, ts = stream(tok, ids, ["😀"], seed)       # a stop string made of a multi-byte character
    assert got == "first ✓ part STOP second " and ts.stopped


def test_a_trailing_incomplete_character_is_flushed_at_the_end(tok):
    ids = tok("ok 😀")["input_ids"][:-1]          # the emoji's last byte never comes
    got, _ = stream(tok, ids, [], 0)
    assert got == tok.decode(ids, skip_special_tokens=True) and got.startswith("ok ")


def test_each_push_decodes_a_short_window(tok):
    """The cost of a push does not grow with the output: the decoded windows stay short."""
    lengths = []

    class Counting:
        def decode(self, ids, **kw):
            lengths.append(len(ids))
            return tok.decode(ids, **kw)

    ts = TextStream(Counting(), [])
    ids = tok("abcdefghij" * 50)["input_ids"]
    for t in ids:
        ts.push([t])
    assert ts.finish() == "" and ts.text == "abcdefghij" * 50
    assert max(lengths) <= 4

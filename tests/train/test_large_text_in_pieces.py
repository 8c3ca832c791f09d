"""A .txt file streamed in pieces (liger_models/text/pieces.py) packs into exactly the windows of the whole
text encoded as one string, for the byte-level tokenizers whose pre-tokenizer is known (GPT-2's regex, Llama 3's
tiktoken split, Qwen2's); other tokenizers encode the text whole.

The claim "merges never cross a blank line" holds for neither regex at every position of a blank-line run: GPT-2's
regex keeps "\\n\\n" before a word as two pre-tokens ("\\n", "\\n") but alone at a piece's end as one ("\\n\\n"),
Llama 3's keeps it as one; so where a run is cut is checked per run (test_naive_cuts_change_the_tokens).
"""

from __future__ import annotations

import random
import re

import numpy as np
import pytest
import torch
from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers, processors, trainers

from liger_models.convert import tiktoken_tokenizer as tt
from liger_models.text import documents, pieces as text_pieces
from liger_models.train.data import (Document, build_dataset, pack_arrays, read_special_tokens, tokenize_chunk,
                                     train_bpe_tokenizer)
from liger_models.text.pieces import KNOWN_PATTERNS, TextSplitter
from tests.helpers import shakespeare

QWEN2 = next(p for p, name in KNOWN_PATTERNS.items() if name == "Qwen2")


def _paragraphs(seed: int = 0) -> str:
    """Shakespeare with blank-line runs of 2-4 newlines, so that the tokenizers learn merges of newlines."""
    rng = random.Random(seed)
    return "".join(p + "\n" * rng.choice([2, 2, 3, 4]) for p in shakespeare(400_000).split("\n\n"))


def _training_chunks(text: str) -> list[str]:
    return [text[i:i + 5000] for i in range(0, len(text), 5000)]


def _split_bpe(pattern: str, text: str, vocab: int = 1200) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tokenizer.train_from_iterator(_training_chunks(text), trainers.BpeTrainer(
        vocab_size=vocab, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    return tokenizer


@pytest.fixture(scope="module")
def text() -> str:
    return _paragraphs()


@pytest.fixture(scope="module")
def gpt2(text) -> Tokenizer:
    """The demo's kind of tokenizer (GPT-2's byte-level regex), trained on text with blank-line runs."""
    return train_bpe_tokenizer(_training_chunks(text), vocab_size=1200)


@pytest.fixture(scope="module")
def llama3(text) -> Tokenizer:
    """A Llama 3 tokenizer.json as convert-native writes it from a tiktoken ranks file: Llama 3's split, BOS
    post-processor, 256 special tokens."""
    byte_of = {char: byte for byte, char in enumerate(tt.byte_to_unicode())}
    vocab = _split_bpe(tt.PAT_STR, text).get_vocab()
    ranks = {bytes(byte_of[c] for c in token): i for token, i in vocab.items()}
    return tt.build_tokenizer(ranks, tt.special_tokens(len(ranks), "3.1"))


@pytest.fixture(scope="module")
def qwen2(text) -> Tokenizer:
    """Qwen2's split and NFC normalizer, with RoBERTa-style tokens around each text (a prefix and a suffix)."""
    tokenizer = _split_bpe(QWEN2, text)
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.add_special_tokens(["<s>", "</s>"])
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>", special_tokens=[("<s>", tokenizer.token_to_id("<s>")),
                                              ("</s>", tokenizer.token_to_id("</s>"))])
    return tokenizer


@pytest.fixture(params=["gpt2", "llama3", "qwen2"])
def tokenizer(request) -> Tokenizer:
    return request.getfixturevalue(request.param)


def _whole_windows(path, tokenizer, seq_len: int):
    """The windows of the text encoded as one string: the path before pieces, kept as the reference."""
    special = read_special_tokens(tokenizer, None)
    ids, mask, lengths = tokenize_chunk([Document(path.read_text(encoding="utf-8-sig"))], tokenizer, special)
    return pack_arrays([ids], [mask], lengths, seq_len, special.pad_id)


def _assert_same(a, b) -> None:
    for name in ("input_ids", "labels", "position_ids"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name


def _pieces(tokenizer, path, monkeypatch, piece_chars: int) -> list[str]:
    monkeypatch.setattr(text_pieces, "PIECE_CHARS", piece_chars)
    return list(TextSplitter(tokenizer).pieces(path))


def test_pieces_pack_the_windows_of_the_whole_text(tokenizer, text, tmp_path, monkeypatch):
    path = tmp_path / "play.txt"
    path.write_text(text, encoding="utf-8")
    assert TextSplitter(tokenizer).reason is None
    pieces = _pieces(tokenizer, path, monkeypatch, 4096)
    assert "".join(pieces) == text and len(pieces) > 50
    dataset = build_dataset([path], tokenizer, read_special_tokens(tokenizer, None), 128)
    _assert_same(dataset, _whole_windows(path, tokenizer, 128))


def _awkward_text(rng: random.Random) -> str:
    """Lines and blank-line runs of every kind a cut must survive: indented lines, spaces and tabs on blank lines,
    CRLF and lone CR, punctuation before the blank lines (Llama 3's regex glues it to the newlines), digits,
    accents written decomposed (NFC composes them), emoji, special-token text, whitespace-only lines."""
    words = ["ROMEO:", "  indented", "\tTabbed", "What, ho!", "1234567", "naïve", "cafe\u0301", "🎉x", "'tis",
             "<|begin_of_text|>", "<s>", "end.", "...", "  ", "", "Ω", "—dash", "x" * 40]
    breaks = ["\n", "\n\n", "\n\n\n", "\r\n\r\n", "\n \n", "\n\t\n\n", "\r\r", "\n\n\n\n\n", " \n\n"]
    return "".join(rng.choice(words) + rng.choice(breaks) for _ in range(400))


@pytest.mark.parametrize("seed", range(6))
def test_awkward_texts_cut_anywhere_keep_their_tokens(tokenizer, tmp_path, monkeypatch, seed):
    path = tmp_path / "awkward.txt"
    path.write_bytes(_awkward_text(random.Random(seed)).encode("utf-8"))
    pieces = _pieces(tokenizer, path, monkeypatch, 1)  # a cut tried at every run of blank lines
    assert "".join(pieces) == path.read_text(encoding="utf-8") and len(pieces) > 20
    dataset = build_dataset([path], tokenizer, read_special_tokens(tokenizer, None), 16)
    _assert_same(dataset, _whole_windows(path, tokenizer, 16))


def _cut_at(text: str, offset: int) -> list[str]:
    cuts = [run.end() + offset for run in re.finditer(r"\n\n+(?=\S)", text)]
    bounds = [0, *cuts, len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:])]


@pytest.mark.parametrize("name, offset", [("gpt2", 0), ("llama3", -1)])
def test_naive_cuts_change_the_tokens(request, text, name, offset):
    """Cutting every run of blank lines at one fixed place changes the tokens of one of the two regexes (the
    end of the run for GPT-2's, before its last newline for Llama 3's), which is why each cut is checked."""
    tokenizer = request.getfixturevalue(name)
    whole = tokenizer.encode(text, add_special_tokens=False).ids
    pieces = tokenizer.encode_batch(_cut_at(text, offset), add_special_tokens=False)
    assert [i for e in pieces for i in e.ids] != whole
    assert tokenizer.token_to_id("ĊĊ") is not None  # the merge that tells the two apart


def _refused(tokenizer: Tokenizer) -> str:
    reason = TextSplitter(tokenizer).reason
    assert reason is not None
    return reason


def test_tokenizers_that_are_not_cut(gpt2):
    sentencepiece_style = Tokenizer(models.BPE())
    sentencepiece_style.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    assert "normalizer (Sequence)" in _refused(sentencepiece_style)
    assert "no pre-tokenizer" in _refused(Tokenizer(models.BPE()))
    other_regex = Tokenizer(models.BPE())
    other_regex.pre_tokenizer = pre_tokenizers.Split(Regex(r"\s+|\S+"), behavior="isolated")
    assert "not one of the known regex splits" in _refused(other_regex)
    prefixed = Tokenizer.from_str(gpt2.to_str())
    prefixed.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
    assert "not one of the known regex splits" in _refused(prefixed)
    stripping = Tokenizer.from_str(gpt2.to_str())
    from tokenizers import AddedToken
    stripping.add_special_tokens([AddedToken("<mask>", lstrip=True)])
    assert "'<mask>' strips spaces" in _refused(stripping)
    truncating = Tokenizer.from_str(gpt2.to_str())
    truncating.enable_truncation(512)
    assert "truncates" in _refused(truncating)


def test_a_refused_tokenizer_reads_the_text_whole(tmp_path, monkeypatch):
    tokenizer = Tokenizer(models.WordLevel({"[UNK]": 0}, unk_token="[UNK]"))  # no pre-tokenizer: one word
    path = tmp_path / "t.txt"
    path.write_bytes(b"\xef\xbb\xbfa\r\n\r\nb\n\nc")
    monkeypatch.setattr(text_pieces, "LARGE_TEXT_BYTES", 4)
    with pytest.warns(UserWarning, match=r"t\.txt: 0 MiB of text encoded as one piece \(the tokenizer cannot cut "
                                         r"it: it has no pre-tokenizer"):
        assert list(TextSplitter(tokenizer).pieces(path)) == ["a\n\nb\n\nc"]  # as read_text reads it


def test_pieces_read_as_read_text_reads(gpt2, tmp_path, monkeypatch):
    """A byte-order mark dropped, CRLF and lone CR read as LF, blocks joined at any character (a CRLF or a
    multi-byte character split between two reads)."""
    path = tmp_path / "crlf.txt"
    body = "".join(f"Line {i} é🎉\r\n\r\n" if i % 3 else f"Line {i}\r\r" for i in range(3000))
    path.write_bytes(b"\xef\xbb\xbf" + body.encode("utf-8"))
    monkeypatch.setattr(text_pieces, "_READ_CHARS", 997)
    pieces = _pieces(gpt2, path, monkeypatch, 500)
    assert "".join(pieces) == path.read_text(encoding="utf-8-sig") and len(pieces) > 20


def test_text_without_a_cut_is_one_piece_and_large_ones_are_reported(gpt2, tmp_path, monkeypatch):
    path = tmp_path / "one_paragraph.txt"
    path.write_text("word " * 2000 + "\n  indented\n\n  indented again\n", encoding="utf-8")
    monkeypatch.setattr(text_pieces, "LARGE_TEXT_BYTES", 5000)
    with pytest.warns(UserWarning, match="no blank line between two unindented lines"):
        pieces = _pieces(gpt2, path, monkeypatch, 100)
    assert pieces == [path.read_text(encoding="utf-8")]


def test_a_blank_text_is_no_document_and_pieces_are_one(gpt2, tmp_path, monkeypatch):
    special = read_special_tokens(gpt2, None)
    blank = tmp_path / "blank.txt"
    blank.write_text("\n\n  \n", encoding="utf-8")
    assert list(documents.iter_documents([blank], special, splitter=TextSplitter(gpt2))) == []
    path = tmp_path / "two.txt"
    path.write_text("First part.\n\nSecond part.\n\nThird part.", encoding="utf-8")
    monkeypatch.setattr(text_pieces, "PIECE_CHARS", 1)
    docs = list(documents.iter_documents([path], special, splitter=TextSplitter(gpt2)))
    assert [(d.first, d.last) for d in docs] == [(True, False), (False, False), (False, True)]
    dataset = build_dataset([path], gpt2, special, 8)
    starts = (dataset.position_ids.flatten() == 0).nonzero().flatten().tolist()
    assert all(s % 8 == 0 for s in starts[:-1])  # one document: positions restart only at windows (and padding)
    _assert_same(dataset, _whole_windows(path, gpt2, 8))


def test_lengths_of_pieces_add_up_to_their_document(gpt2, tmp_path, monkeypatch):
    """Two .txt files in pieces and a JSONL between them: documents start where each file starts."""
    special = read_special_tokens(gpt2, None)
    monkeypatch.setattr(text_pieces, "PIECE_CHARS", 1)
    a, b, c = tmp_path / "a.txt", tmp_path / "b.jsonl", tmp_path / "c.txt"
    a.write_text("One.\n\nTwo.\n\nThree.", encoding="utf-8")
    b.write_text('{"text": "Four."}\n', encoding="utf-8")
    c.write_text("Five.\n\nSix.", encoding="utf-8")
    dataset = build_dataset([a, b, c], gpt2, special, 64)
    whole = [tokenize_chunk([Document(t)], gpt2, special) for t in ("One.\n\nTwo.\n\nThree.", "Four.", "Five.\n\nSix.")]
    reference = pack_arrays([w[0] for w in whole], [w[1] for w in whole],
                            np.concatenate([w[2] for w in whole]), 64, special.pad_id)
    _assert_same(dataset, reference)

"""SentencePiece BPE tokenizer.model (Llama 1/2, Mistral) → HF tokenizer.json.

The truth is sentencepiece itself: a small BPE model with byte fallback is trained here on the bundled Shakespeare
with Llama 2's trainer options, and sentencepiece's own encode / decode must agree with the converted tokenizer.json
(which the converter builds without sentencepiece or protobuf).
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer

from liger_models.hub import load_tokenizer  # the fast tokenizer itself
from liger_models.cli import main
from liger_models.convert import sentencepiece_tokenizer as spt
from liger_models.convert.native import native_to_hf
from tests.convert.test_native import LLAMA2, MISTRAL, random_native, write_meta, write_mistral

spm = pytest.importorskip("sentencepiece")

SHAKESPEARE = Path(__file__).resolve().parents[2] / "liger_models" / "data" / "tiny_shakespeare.txt"
# A few non-ASCII lines in training so that some multi-byte characters are pieces; others stay byte fallback.
UNICODE_LINES = ["naïve café über straße façade", "привет мир, как дела?", "你好世界，今天天气很好。"]
# Llama 2's tokenizer.model settings (its trainer_spec / normalizer_spec), scaled down.
LLAMA_OPTIONS = dict(vocab_size=2000, byte_fallback=True, add_dummy_prefix=True, remove_extra_whitespaces=False,
                     split_digits=True, normalization_rule_name="identity", character_coverage=0.99995,
                     allow_whitespace_only_pieces=True, unk_id=0, bos_id=1, eos_id=2, pad_id=-1, num_threads=2,
                     minloglevel=2)
SAMPLES = [
    "First Citizen:\nBefore we proceed any further, hear me speak.",
    "", " ", "  ", "\n", "a", " leading space", "   three leading", "trailing   ", "many     inner   spaces",
    "tabs\tand\r\nCRLF\n\n\nnewline runs\n", "numbers 1 12 123 1234 12345678901 3.14159 -42 1,000,000",
    "naïve café — “quotes” 你好世界 привет", "not in the vocabulary: 🎉🎉 ∞ ✓ Ωμέγα \u00a0nbsp \u200b zw",
    "ROMEO:\nBut, soft! what light through yonder window breaks?", "x" * 40 + " " + "ab" * 30,
]


def train(path: Path, **options) -> Path:
    lines = SHAKESPEARE.read_text(encoding="utf-8").splitlines() + UNICODE_LINES * 20
    spm.SentencePieceTrainer.train(sentence_iterator=iter(lines), model_prefix=str(path.with_suffix("")),
                                   **{**LLAMA_OPTIONS, **options})
    return path.with_suffix(".model")


@pytest.fixture(scope="module")
def model_file(tmp_path_factory):
    return train(tmp_path_factory.mktemp("spm") / "bpe.model", model_type="bpe")


@pytest.fixture(scope="module")
def unigram_file(tmp_path_factory):
    return train(tmp_path_factory.mktemp("unigram") / "unigram.model", model_type="unigram")


@pytest.fixture(scope="module")
def reference(model_file):
    return spm.SentencePieceProcessor(model_file=str(model_file))


@pytest.fixture(scope="module")
def converted(model_file, tmp_path_factory):
    out = tmp_path_factory.mktemp("hf")
    spt.write_hf_tokenizer(model_file, out, model_max_length=4096)
    return out


@pytest.fixture(scope="module")
def hf(converted):
    return Tokenizer.from_file(str(converted / "tokenizer.json"))


# ---- reading the ModelProto ---------------------------------------------------------------------------------
def test_parsed_model_is_sentencepieces(model_file, reference):
    model = spt.read_model(model_file)
    assert len(model.pieces) == reference.get_piece_size() == 2000
    assert [p.text for p in model.pieces] == [reference.id_to_piece(i) for i in range(2000)]
    assert [p.score for p in model.pieces] == pytest.approx([reference.get_score(i) for i in range(2000)])
    types = {i: p.type for i, p in enumerate(model.pieces)}
    assert all((t == spt.CONTROL) == reference.is_control(i) and (t == spt.BYTE) == reference.is_byte(i)
               and (t == spt.UNKNOWN) == reference.is_unknown(i) for i, t in types.items())
    assert sum(t == spt.BYTE for t in types.values()) == 256
    assert (model.unk_id, model.bos_id, model.eos_id, model.pad_id) == \
        (reference.unk_id(), reference.bos_id(), reference.eos_id(), reference.pad_id()) == (0, 1, 2, -1)
    assert (model.model_type, model.byte_fallback, model.normalizer_name, model.precompiled_charsmap) == \
        (2, True, "identity", b"")
    assert model.add_dummy_prefix and not model.remove_extra_whitespaces and model.escape_whitespaces


def _varint(value: int) -> bytes:
    value &= (1 << 64) - 1
    out = bytearray()
    while True:
        out.append((value & 0x7F) | (0x80 if value > 0x7F else 0))
        value >>= 7
        if not value:
            return bytes(out)


def _len_field(number: int, payload: bytes) -> bytes:
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def test_wire_format_details():
    piece = _len_field(1, "▁a".encode()) + bytes([0x15]) + b"\x00\x00\x80\xbf" + bytes([0x18, 1])  # score -1.0
    trainer = (bytes([0x18, 1]) + bytes([0x18, 2])  # a repeated singular field: the last one wins
               + _varint(43 << 3) + _varint(-1)  # pad_id -1: a 10-byte varint
               + _varint(99 << 3 | 5) + b"\x00" * 4)  # an unknown fixed32 field is skipped
    model = spt.parse_model(_len_field(1, piece) + _len_field(2, trainer))
    assert model.pieces == [spt.Piece("▁a", -1.0, spt.NORMAL)] and model.model_type == 2 and model.pad_id == -1
    assert (model.bos_id, model.add_dummy_prefix, model.remove_extra_whitespaces) == (1, True, True)  # defaults
    for blob in (b"", b"\x0asentencepiece", _len_field(1, piece), b"\x0b\x0c", b"\xff" * 11, b"\x0a\x02\xff\xfe"):
        with pytest.raises(spt.NotSentencePiece):
            spt.parse_model(blob)


# ---- the conversion against sentencepiece -------------------------------------------------------------------
@pytest.mark.parametrize("text", SAMPLES, ids=range(len(SAMPLES)))
def test_ids_match_sentencepiece_and_decode_round_trips(hf, reference, text):
    expected = reference.encode(text)
    assert hf.encode(text, add_special_tokens=False).ids == expected
    assert hf.encode(text).ids == reference.encode(text, add_bos=True) == [1] + expected
    assert hf.decode(expected) == reference.decode(expected) == text


def test_byte_fallback_is_exercised(hf, reference):
    ids = reference.encode("🎉")
    assert [reference.id_to_piece(i) for i in ids] == ["▁", "<0xF0>", "<0x9F>", "<0x8E>", "<0x89>"]
    assert hf.encode("🎉", add_special_tokens=False).tokens == ["▁", "<0xF0>", "<0x9F>", "<0x8E>", "<0x89>"]


def test_ids_match_sentencepiece_on_all_of_shakespeare(hf, reference):
    lines = SHAKESPEARE.read_text(encoding="utf-8").splitlines(keepends=True)
    chunks = ["".join(lines[i:i + 20]) for i in range(0, len(lines), 20)]
    ours = [e.ids for e in hf.encode_batch(chunks, add_special_tokens=False)]
    assert ours == reference.encode(chunks)
    assert sum(map(len, ours)) < 0.45 * sum(map(len, chunks)), "the trained vocabulary barely merges"
    assert [hf.decode(ids) for ids in ours[:50]] == chunks[:50]


def test_control_tokens_in_text(hf, reference):
    # sentencepiece never reads "<s>" out of text; HF's Llama tokenizers do (special added tokens) unless told not.
    text = "<s>Hello</s> there"
    assert hf.encode(text, add_special_tokens=False).ids[0] == 1
    hf.encode_special_tokens = True
    try:
        assert hf.encode(text, add_special_tokens=False).ids == reference.encode(text)
    finally:
        hf.encode_special_tokens = False


def test_layout_of_tokenizer_json(converted):
    spec = json.loads((converted / "tokenizer.json").read_text(encoding="utf-8"))
    model = spec["model"]
    assert model["type"] == "BPE" and model["byte_fallback"] and model["fuse_unk"] and model["unk_token"] == "<unk>"
    assert model["vocab"]["<unk>"] == 0 and model["vocab"]["<0x00>"] == 3 and len(model["vocab"]) == 2000
    assert [n["type"] for n in spec["normalizer"]["normalizers"]] == ["Prepend", "Replace"]
    assert spec["pre_tokenizer"] is None
    assert [d["type"] for d in spec["decoder"]["decoders"]] == ["Replace", "ByteFallback", "Fuse", "Strip"]
    assert [(t["id"], t["content"], t["special"]) for t in spec["added_tokens"]] == \
        [(0, "<unk>", True), (1, "<s>", True), (2, "</s>", True)]
    assert spec["post_processor"]["single"][0] == {"SpecialToken": {"id": "<s>", "type_id": 0}}
    config = json.loads((converted / "tokenizer_config.json").read_text(encoding="utf-8"))
    assert {k: config[k] for k in ("bos_token", "eos_token", "unk_token", "legacy", "add_prefix_space")} == \
        {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "legacy": True, "add_prefix_space": True}
    assert "pad_token" not in config  # pad_id -1, as Llama 2


def test_transformers_loads_it(converted, reference):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(converted))
    assert (tokenizer.bos_token, tokenizer.eos_token, tokenizer.unk_token) == ("<s>", "</s>", "<unk>")
    for text in SAMPLES:
        ids = reference.encode(text, add_bos=True)
        assert tokenizer(text)["input_ids"] == ids
        assert tokenizer.decode(ids, skip_special_tokens=True) == text


def _retyped(data: bytes, texts: set[str], kind: int) -> bytes:
    """The ModelProto `data` with the pieces `texts` given the type `kind` (every top-level field is a message)."""
    out = b""
    for number, value in spt._fields(data):
        piece = spt._parse_piece(value) if number == 1 else None
        if piece is not None and piece.text in texts:
            value = (_len_field(1, piece.text.encode()) + _varint(2 << 3 | 5) + struct.pack("<f", piece.score)
                     + _varint(3 << 3) + _varint(kind))
        out += _len_field(number, value)
    return out


def test_user_defined_whitespace_pieces_without_dummy_prefix(tmp_path):
    # Gemma-like: no dummy prefix, "▁▁" user-defined while longer space runs are normal pieces. SentencePiece
    # matches user-defined pieces in the normalized text (spaces already "▁") and never merges them further.
    lines = SHAKESPEARE.read_text(encoding="utf-8").splitlines()[:3000] + ["a  b   c    d     e"] * 1000
    path = tmp_path / "ws.model"
    options = {**LLAMA_OPTIONS, "vocab_size": 1000, "add_dummy_prefix": False, "model_type": "bpe"}
    spm.SentencePieceTrainer.train(sentence_iterator=iter(lines), model_prefix=str(path.with_suffix("")), **options)
    path.write_bytes(_retyped(path.read_bytes(), {"▁▁"}, spt.USER_DEFINED))
    reference = spm.SentencePieceProcessor(model_file=str(path))
    assert reference.piece_to_id("▁▁▁") != reference.unk_id()
    tokenizer, _ = spt.convert_sentencepiece(path)
    for text in ("a  b", "a   b", "a    b", "x     y", "  ", "   "):
        assert tokenizer.encode(text, add_special_tokens=False).ids == reference.encode(text)


# ---- refusals -------------------------------------------------------------------------------------------------
def test_unigram_is_refused(unigram_file):
    assert spt.read_model(unigram_file).model_type == 1 and spt.is_sentencepiece_file(unigram_file)
    with pytest.raises(ValueError, match="is a SentencePiece Unigram model; only BPE models"):
        spt.convert_sentencepiece(unigram_file)


@pytest.mark.parametrize("options, message", [
    (dict(byte_fallback=False), "byte_fallback is off"),
    (dict(normalization_rule_name="nmt_nfkc"), "normalization table"),
    (dict(remove_extra_whitespaces=True), "remove_extra_whitespaces is on"),
], ids=["no-byte-fallback", "nfkc", "remove-extra-whitespaces"])
def test_other_bpe_models_are_refused(tmp_path, options, message):
    model_file = train(tmp_path / "other.model", model_type="bpe", **options)
    with pytest.raises(ValueError, match=message):
        spt.convert_sentencepiece(model_file)


def test_buildable_unused_pieces_are_refused(model_file):
    model = spt.read_model(model_file)
    spt.check_convertible(model)
    index = next(i for i, p in enumerate(model.pieces) if p.text == "▁the")
    model.pieces[index].type = spt.UNUSED
    with pytest.raises(ValueError, match="UNUSED pieces"):
        spt.check_convertible(model)


# ---- inside the native converter ------------------------------------------------------------------------------
def _with_vocab(params: dict, vocab: int) -> tuple[dict, dict]:
    params = {**params, "vocab_size": vocab if params["vocab_size"] > 0 else -1}
    w = random_native(params)
    w["tok_embeddings.weight"] = torch.randn(vocab, params["dim"])
    w["output.weight"] = torch.randn(vocab, params["dim"]) / params["dim"] ** 0.5
    return params, w


def _check_converted(out: Path, reference, names: list[str]) -> None:
    assert not any((out / name).exists() for name in names)  # the originals live under original/ only
    assert sorted(p.name for p in (out / "original").iterdir()) == sorted(names)
    config = json.loads((out / "config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"], config["vocab_size"]) == (1, 2, 2000)
    tok_config = json.loads((out / "tokenizer_config.json").read_text())
    assert tok_config["model_max_length"] == config["max_position_embeddings"]
    tokenizer = load_tokenizer(out)
    assert [tokenizer.encode(t).ids for t in SAMPLES] == [reference.encode(t, add_bos=True) for t in SAMPLES]


def test_native_llama2_converts_its_tokenizer(tmp_path, model_file, reference):
    params, w = _with_vocab(LLAMA2, 2000)
    src = write_meta(tmp_path / "native", params, w, shards=2, vocab_parallel=False)
    (src / "tokenizer.model").write_bytes(model_file.read_bytes())
    out = native_to_hf(src, tmp_path / "hf")
    _check_converted(out, reference, ["tokenizer.model"])
    assert (out / "original" / "tokenizer.model").read_bytes() == model_file.read_bytes()


def test_native_mistral_v3_through_the_cli(tmp_path, model_file, unigram_file, reference, capsys):
    params, w = _with_vocab(MISTRAL, 2000)
    src = write_mistral(tmp_path / "native", params, w)
    (src / "tokenizer.model.v3").write_bytes(model_file.read_bytes())
    # The highest version is converted; the other is only kept (it would be refused: a Unigram model).
    (src / "tokenizer.model").write_bytes(unigram_file.read_bytes())
    assert main(["convert-native", str(src), str(tmp_path / "hf")]) == 0
    capsys.readouterr()
    _check_converted(tmp_path / "hf", reference, ["tokenizer.model", "tokenizer.model.v3"])


def test_native_refuses_unigram_and_a_too_small_embedding(tmp_path, model_file, unigram_file):
    params, w = _with_vocab(MISTRAL, 1999)
    src = write_mistral(tmp_path / "native", params, w)
    (src / "tokenizer.model").write_bytes(model_file.read_bytes())
    with pytest.raises(ValueError, match="more than the model's vocabulary of 1999"):
        native_to_hf(src, tmp_path / "hf")
    (src / "tokenizer.model").write_bytes(unigram_file.read_bytes())
    with pytest.raises(ValueError, match="Unigram"):
        native_to_hf(src, tmp_path / "hf")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["native"]


def test_native_without_bos_or_eos_leaves_them_unset(tmp_path):
    """A SentencePiece model without BOS / EOS pieces (bos_id / eos_id -1) gives a config.json without those ids:
    the Llama 2 defaults (1, 2) would name pieces that are not BOS / EOS (here 1 is an ordinary piece)."""
    model_file = train(tmp_path / "nobos.model", model_type="bpe", bos_id=-1, eos_id=-1)
    reference = spm.SentencePieceProcessor(model_file=str(model_file))
    params, w = _with_vocab(LLAMA2, 2000)
    src = write_meta(tmp_path / "native", params, w, shards=1, vocab_parallel=False)
    (src / "tokenizer.model").write_bytes(model_file.read_bytes())
    out = native_to_hf(src, tmp_path / "hf")
    config = json.loads((out / "config.json").read_text())
    assert config["bos_token_id"] is None and config["eos_token_id"] is None
    tokenizer = load_tokenizer(out)
    assert [tokenizer.encode(t).ids for t in SAMPLES] == [reference.encode(t) for t in SAMPLES]

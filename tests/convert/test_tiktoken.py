"""Llama 3's tiktoken tokenizer.model → HF tokenizer.json.

The truth is tiktoken itself: a real (small) ranks file is made by training a byte-level BPE on the bundled
Shakespeare with `tokenizers` and writing it in tiktoken's format; tiktoken's own loader and Encoding, built with
Llama 3's pattern and special tokens, must give the same ids as the converted tokenizer.json. The trainer's merges
are a second, independent check of the merges recovered from the ranks.
"""

from __future__ import annotations

import base64
import json
from pathlib import Path

import pytest
import torch
from tokenizers import Regex, Tokenizer, models, pre_tokenizers, trainers

from liger_models import load_tokenizer
from liger_models.hub import load_tokenizer as load_fast_tokenizer
from liger_models.cli import main
from liger_models.convert import tiktoken_tokenizer as tt
from liger_models.convert.native import native_to_hf
from tests.convert.test_native import LLAMA31, random_native, write_meta

tiktoken = pytest.importorskip("tiktoken")

SHAKESPEARE = Path(__file__).resolve().parents[2] / "liger_models" / "data" / "tiny_shakespeare.txt"
# Some non-ASCII text in training, so that multi-byte characters get merges (and the byte alphabet is exercised).
UNICODE_LINES = ["naïve café über straße façade\n", "привет мир, как дела?\n", "你好世界，今天天气很好。\n",
                 "Ελληνικά γράμματα\n", "emoji 🎉🎉 ✓ → ∞\n"]
SAMPLES = [
    "First Citizen:\nBefore we proceed any further, hear me speak.",
    "  leading spaces and trailing   ", "tabs\tand\r\nCRLF\n\n\nnewline runs\n",
    "numbers 1 12 123 1234 12345678901 3.14159 -42 1,000,000",
    "contractions: I'll, you're, he's, we've, I'm, they'd, can't, DON'T, We'LL",
    "naïve café — “quotes” 你好世界 привет 🎉🎉🎉 \u00a0nbsp \u200b zero-width",
    "punctuation!!! ??? ... --- ;;; :::) (((]]] {}<>@#$%^&*_+=|\\/~`",
    "<|begin_of_text|>Hello<|eot_id|> there<|start_header_id|>user<|end_header_id|>\n\nhi<|python_tag|>",
    "<|reserved_special_token_17|><|end_of_text|>x <|not_special|>", "", " ", "\n", "a", "😀",
    "                                                                 many spaces",
]


# ---- a real ranks file, and tiktoken's Encoding of it ------------------------------------------------------
def train_ranks(vocab_size: int = 3000) -> tuple[Tokenizer, dict[bytes, int]]:
    """A byte-level BPE trained on Shakespeare with Llama 3's split, and its tokens' bytes → ids (= ranks: the
    trainer numbers the 256 bytes first, then each merged token in merge order, as tiktoken's ranks are)."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(tt.PAT_STR), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    lines = SHAKESPEARE.read_text(encoding="utf-8").splitlines(keepends=True)
    tokenizer.train_from_iterator(lines + UNICODE_LINES * 50, trainer=trainer)
    byte_of = {char: byte for byte, char in enumerate(tt.byte_to_unicode())}
    ranks = {bytes(byte_of[c] for c in token): i for token, i in tokenizer.get_vocab().items()}
    return tokenizer, ranks


def write_tiktoken_file(ranks: dict[bytes, int], path: Path) -> Path:
    lines = [f"{base64.b64encode(token).decode('ascii')} {rank}\n" for token, rank in
             sorted(ranks.items(), key=lambda item: item[1])]
    path.write_text("".join(lines), encoding="ascii")
    return path


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    tokenizer, ranks = train_ranks()
    return tokenizer, write_tiktoken_file(ranks, tmp_path_factory.mktemp("ranks") / "tokenizer.model")


@pytest.fixture(scope="module")
def ranks_file(trained):
    return trained[1]


@pytest.fixture(scope="module")
def reference(ranks_file):
    """tiktoken's own loader and Encoding (TIKTOKEN_CACHE_DIR="" keeps it from caching the file in /tmp)."""
    from tiktoken.load import load_tiktoken_bpe

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TIKTOKEN_CACHE_DIR", "")
        ranks = load_tiktoken_bpe(str(ranks_file))
    return tiktoken.Encoding("llama3-test", pat_str=tt.PAT_STR, mergeable_ranks=ranks,
                             special_tokens=tt.special_tokens(len(ranks), "3.1"))


@pytest.fixture(scope="module")
def converted(ranks_file, tmp_path_factory):
    out = tmp_path_factory.mktemp("hf")
    tt.write_hf_tokenizer(ranks_file, out, version="3.1", model_max_length=4096)
    return out


# ---- the conversion ---------------------------------------------------------------------------------------
def test_merges_and_vocab_are_the_trained_ones(trained):
    tokenizer, ranks_file = trained
    trained_model = json.loads(tokenizer.to_str())["model"]
    ranks = tt.read_ranks(ranks_file)
    merges, unreachable = tt.recover_merges(ranks)
    assert unreachable == []
    # Every split of a token is a merge; the trained ones are among them, in the trained order.
    trained_merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in trained_model["merges"]]
    assert [m for m in merges if m in set(trained_merges)] == trained_merges
    vocab = {tt.token_string(t) for t in ranks}
    assert len(set(merges)) == len(merges) and all(left + right in vocab for left, right in merges)
    assert {tt.token_string(t): r for t, r in ranks.items()} == trained_model["vocab"]
    assert any(len(t.decode("utf-8", "ignore")) < len(t) for t in ranks), "no multi-byte merges were trained"


@pytest.mark.parametrize("text", SAMPLES, ids=range(len(SAMPLES)))
def test_ids_match_tiktoken_and_decode_round_trips(converted, reference, text):
    hf = Tokenizer.from_file(str(converted / "tokenizer.json"))
    expected = reference.encode(text, allowed_special="all")
    assert hf.encode(text, add_special_tokens=False).ids == expected
    bos = reference.encode("<|begin_of_text|>", allowed_special="all")
    assert hf.encode(text).ids == bos + expected  # the post-processor prepends <|begin_of_text|>
    assert hf.decode(expected, skip_special_tokens=False) == text == reference.decode(expected)


def test_ids_match_tiktoken_on_all_of_shakespeare(converted, reference):
    hf = Tokenizer.from_file(str(converted / "tokenizer.json"))
    lines = SHAKESPEARE.read_text(encoding="utf-8").splitlines(keepends=True)
    chunks = ["".join(lines[i:i + 40]) for i in range(0, len(lines), 40)]
    ours = [e.ids for e in hf.encode_batch(chunks, add_special_tokens=False)]
    assert ours == reference.encode_batch(chunks, allowed_special="all")
    assert sum(map(len, ours)) < 0.4 * sum(map(len, chunks)), "the trained vocabulary barely merges"


def test_tokens_built_from_other_splits(tmp_path):
    # Llama 3's ranks join two BPE trainings, so a token can be built from a pair that no lower-ranked pieces make:
    # "AUSE" (257) has no split into lower-ranked tokens, yet in "CAUSE" tiktoken joins "A" + "USE" (258) into it,
    # as it joins any two adjacent pieces whose concatenation is a token. Every such split must be a merge.
    ranks = {bytes([b]): b for b in range(256)} | {b"US": 256, b"AUSE": 257, b"USE": 258}
    path = write_tiktoken_file(ranks, tmp_path / "tokenizer.model")
    reference = tiktoken.Encoding("splits", pat_str=tt.PAT_STR, mergeable_ranks=ranks, special_tokens={})
    tokenizer, _ = tt.convert_tiktoken(path)
    for text in ("CAUSE", " BECAUSE", "AUSE", "USE CAUSES"):
        assert tokenizer.encode(text, add_special_tokens=False).ids == reference.encode(text)
    assert tokenizer.encode("CAUSE", add_special_tokens=False).tokens == ["C", "AUSE"]


def test_layout_of_tokenizer_json(converted, ranks_file):
    spec = json.loads((converted / "tokenizer.json").read_text(encoding="utf-8"))
    n = len(tt.read_ranks(ranks_file))
    assert spec["model"]["type"] == "BPE" and spec["model"]["ignore_merges"] is True
    split, byte_level = spec["pre_tokenizer"]["pretokenizers"]
    assert split["type"] == "Split" and split["pattern"]["Regex"] == tt.PAT_STR and split["behavior"] == "Isolated"
    assert byte_level == {**byte_level, "type": "ByteLevel", "add_prefix_space": False, "use_regex": False}
    assert spec["decoder"]["type"] == "ByteLevel"
    added = {t["content"]: t for t in spec["added_tokens"]}
    assert len(added) == 256 and added["<|begin_of_text|>"]["id"] == n and added["<|eot_id|>"]["id"] == n + 9
    assert all(t["special"] and not t["normalized"] for t in added.values())


def test_byte_alphabet_is_bytelevels():
    assert set(tt.byte_to_unicode()) == set(pre_tokenizers.ByteLevel.alphabet()) and len(tt.byte_to_unicode()) == 256
    assert tt.token_string(b" hello\n") == "ĠhelloĊ"  # GPT-2's well-known spellings of space and newline


# ---- Meta's special tokens -----------------------------------------------------------------------------------
def test_special_token_lists():
    v31, v3 = tt.special_tokens(128000, "3.1"), tt.special_tokens(128000, "3")
    for table in (v31, v3):
        assert len(table) == 256 and sorted(table.values()) == list(range(128000, 128256))
        assert table["<|begin_of_text|>"] == 128000 and table["<|end_of_text|>"] == 128001
        assert table["<|start_header_id|>"] == 128006 and table["<|end_header_id|>"] == 128007
        assert table["<|eot_id|>"] == 128009 and table["<|reserved_special_token_0|>"] == 128002
    assert [v31[t] for t in ("<|finetune_right_pad_id|>", "<|reserved_special_token_2|>", "<|eom_id|>",
                             "<|python_tag|>", "<|reserved_special_token_3|>", "<|reserved_special_token_247|>")] \
        == [128004, 128005, 128008, 128010, 128011, 128255]
    assert [v3[f"<|reserved_special_token_{i}|>"] for i in (3, 4, 5, 250)] == [128005, 128008, 128010, 128255]
    with pytest.raises(ValueError, match="special-token list"):
        tt.special_tokens(10, "4")


# ---- loading the result -------------------------------------------------------------------------------------
def test_load_tokenizer_and_transformers_agree(converted, reference):
    from transformers import AutoTokenizer

    ours, hf = load_tokenizer(converted), AutoTokenizer.from_pretrained(str(converted))
    assert (hf.bos_token, hf.eos_token) == ("<|begin_of_text|>", "<|end_of_text|>")
    assert (ours.bos_token, ours.eos_token) == (hf.bos_token, hf.eos_token)
    assert (ours.bos_token_id, ours.eos_token_id) == (hf.bos_token_id, hf.eos_token_id)
    for text in SAMPLES:
        ids = ours.encode(text)
        assert hf(text)["input_ids"] == ids == ours(text)["input_ids"]
        assert hf.decode(ids[1:]) == ours.decode(ids[1:], skip_special_tokens=False) == text
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": " Who art thou? "}]
    prompt = hf.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert prompt == ("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
                      "<|start_header_id|>user<|end_header_id|>\n\nWho art thou?<|eot_id|>"
                      "<|start_header_id|>assistant<|end_header_id|>\n\n")
    assert ours.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == prompt
    assert ours.apply_chat_template(chat, add_generation_prompt=True, return_dict=False) == \
        hf.apply_chat_template(chat, add_generation_prompt=True, return_dict=False)
    assert ours.encode(prompt, add_special_tokens=False) == reference.encode(prompt, allowed_special="all")


# ---- reading and detecting ----------------------------------------------------------------------------------
def test_detection(tmp_path, ranks_file):
    assert tt.is_tiktoken_file(ranks_file)
    sentencepiece = tmp_path / "sp.model"
    sentencepiece.write_bytes(b"\x0a\x0b\x0a\x05<unk>\x15\x00\x00\x00\x00\x18\x02\n\x07\x0a\x03<s>")
    empty = tmp_path / "empty.model"
    empty.write_bytes(b"")
    assert not tt.is_tiktoken_file(sentencepiece) and not tt.is_tiktoken_file(empty)


@pytest.mark.parametrize("case", ["gap", "duplicate", "bad-line", "no-bytes"])
def test_bad_ranks_files_raise(tmp_path, case):
    lines = [f"{base64.b64encode(bytes([b])).decode()} {b}" for b in range(256)] + ["aGk= 256"]
    expect = {"gap": "without gaps", "duplicate": "twice", "bad-line": "not a tiktoken", "no-bytes": "single bytes"}
    if case == "gap":
        lines[-1] = "aGk= 300"
    elif case == "duplicate":
        lines.append("aGk= 257")
    elif case == "bad-line":
        lines.append("aGk=\t257")
    else:
        lines = [f"{base64.b64encode(b'ab').decode()} 0"]
    path = tmp_path / "tokenizer.model"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError, match=expect[case]):
        tt.read_ranks(path)


# ---- inside the native converter -----------------------------------------------------------------------------
def llama3_native(src: Path, ranks_file: Path | None, vocab: int, params: dict | None = None) -> Path:
    """A tiny native Llama 3 whose embedding has `vocab` rows, with `ranks_file` as its tokenizer.model."""
    params = {**(params or LLAMA31), "vocab_size": vocab}
    w = random_native(params)
    w["tok_embeddings.weight"] = torch.randn(vocab, params["dim"])
    w["output.weight"] = torch.randn(vocab, params["dim"]) / params["dim"] ** 0.5
    write_meta(src, params, w)
    if ranks_file is not None:
        (src / "tokenizer.model").write_bytes(ranks_file.read_bytes())
    return src


@pytest.mark.parametrize("version", ["3.1", "3"])
def test_native_llama3_converts_its_tokenizer(tmp_path, ranks_file, version):
    n = len(tt.read_ranks(ranks_file))
    params = LLAMA31 if version == "3.1" else {k: v for k, v in LLAMA31.items() if k != "use_scaled_rope"}
    out = native_to_hf(llama3_native(tmp_path / "native", ranks_file, n + 256, params), tmp_path / "hf")
    assert not (out / "tokenizer.model").exists()  # transformers must not take it for SentencePiece
    assert (out / "original" / "tokenizer.model").read_bytes() == ranks_file.read_bytes()
    cfg = json.loads((out / "config.json").read_text())
    assert (cfg["bos_token_id"], cfg["eos_token_id"]) == (n, n + 1)
    tok_cfg = json.loads((out / "tokenizer_config.json").read_text())
    assert tok_cfg["model_max_length"] == cfg["max_position_embeddings"] and tok_cfg["eos_token"] == "<|end_of_text|>"
    tokenizer = load_fast_tokenizer(out)
    fifth = "<|reserved_special_token_2|>" if version == "3.1" else "<|reserved_special_token_3|>"
    assert tokenizer.id_to_token(n + 5) == fifth and tokenizer.token_to_id("<|eot_id|>") == n + 9


def test_native_forced_list_and_cli(tmp_path, ranks_file, capsys):
    n = len(tt.read_ranks(ranks_file))
    src = llama3_native(tmp_path / "native", ranks_file, n + 256)
    assert main(["convert-native", str(src), str(tmp_path / "hf"), "--llama3-specials", "3"]) == 0
    assert load_tokenizer(tmp_path / "hf").id_to_token(n + 8) == "<|reserved_special_token_4|>"
    with pytest.raises(SystemExit):
        main(["convert-native", str(src), str(tmp_path / "hf2"), "--llama3-specials", "4"])
    capsys.readouterr()


def test_native_sentencepiece_file_is_copied_as_is(tmp_path):
    src = llama3_native(tmp_path / "native", None, 300)
    # A truncated ModelProto: neither format, so copied (a complete one is converted: test_sentencepiece.py).
    blob = b"\x0a\x0b\x0a\x05<unk>\x15\x00\x00\x00\x00\x18\x02 tokens 1"
    (src / "tokenizer.model").write_bytes(blob)
    out = native_to_hf(src, tmp_path / "hf")
    assert (out / "tokenizer.model").read_bytes() == blob
    assert not (out / "tokenizer.json").exists() and not (out / "original").exists()
    with pytest.raises(ValueError, match="no tiktoken tokenizer.model"):
        native_to_hf(src, tmp_path / "hf2", llama3_specials="3")
    assert not (tmp_path / "hf2").exists()


def test_native_tokenizer_larger_than_the_embedding_is_refused(tmp_path, ranks_file):
    n = len(tt.read_ranks(ranks_file))
    src = llama3_native(tmp_path / "native", ranks_file, n + 255)
    with pytest.raises(ValueError, match="more than the model's vocabulary"):
        native_to_hf(src, tmp_path / "hf")
    assert not (tmp_path / "hf").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["native"]

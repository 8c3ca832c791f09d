"""Data pipeline: packing with per-document positions, chat masking (assistant turns only), resumable batches."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer

from liger_models.modules import shift_labels
from liger_models.train.data import (BatchStream, Document, PackedDataset, build_dataset, check_has_targets,
                                     load_documents, pack_arrays, pack_documents, read_special_tokens,
                                     save_tokenizer, tokenize_document, train_bpe_tokenizer)

from tests.helpers import EOS, shakespeare

LLAMA3_LIKE = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
CHAT = [
    {"role": "system", "content": "Speak like a bard."},
    {"role": "user", "content": "Who goes there?"},
    {"role": "assistant", "content": "A friend, good sir."},
    {"role": "user", "content": "What news?"},
    {"role": "assistant", "content": "The king is dead; long live the king."},
]


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return train_bpe_tokenizer(shakespeare(30_000).splitlines(), vocab_size=300, eos_token=EOS)


def test_pack_positions_restart_per_document_and_window():
    docs = [([1, 2, 3, 4, 5], [True] * 5), ([6, 7], [False, True]), ([8, 9, 10, 11, 12, 13, 14], [True] * 7)]
    ds = pack_documents(docs, seq_len=4, pad_id=99)
    assert ds.input_ids.tolist() == [[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12], [13, 14, 99, 99]]
    assert ds.position_ids.tolist() == [[0, 1, 2, 3], [0, 0, 1, 0], [0, 1, 2, 3], [0, 1, 0, 1]]
    assert ds.labels.tolist() == [[1, 2, 3, 4], [5, -100, 7, 8], [9, 10, 11, 12], [13, 14, -100, -100]]
    # The causal shift never targets the next document's first token nor padding.
    shifted = shift_labels(ds.labels.long(), 1, ds.position_ids.long())
    assert shifted[1].tolist() == [-100, 7, -100, -100]
    assert shifted[3].tolist() == [14, -100, -100, -100]


def test_pack_rejects_bad_input():
    with pytest.raises(ValueError, match="seq_len"):
        pack_documents([([1, 2], [True, True])], seq_len=1)
    with pytest.raises(ValueError, match="no tokens"):
        pack_documents([([], [])], seq_len=8)


def test_pack_refuses_a_mask_of_another_length():
    """A loss mask one entry too long on one document and one too short on another used to pack without a word,
    every label after the first moved onto a neighbouring token."""
    n = int(torch.randint(3, 9, ()))
    a, b = torch.randint(0, 50, (n,)).tolist(), torch.randint(0, 50, (n,)).tolist()
    with pytest.raises(ValueError, match="document 0"):
        pack_documents([(a, [True] * (n + 1)), (b, [True] * (n - 1))], seq_len=4)
    with pytest.raises(ValueError, match="document 1"):
        pack_documents([(a, [True] * n), (b, [[True]] * n)], seq_len=4)
    ids, mask = np.array(a + b, dtype=np.int32), np.ones(2 * n - 1, dtype=bool)
    with pytest.raises(ValueError, match="loss-mask entries"):
        pack_arrays([ids], [mask], np.array([n, n]), seq_len=4)


def test_plain_text_documents_get_eos(tokenizer, tmp_path):
    special = read_special_tokens(tokenizer, None)
    assert special.eos_id is None  # no tokenizer_config.json: nothing known
    save_tokenizer(tokenizer, tmp_path, eos_token=EOS)
    special = read_special_tokens(tokenizer, tmp_path)
    assert special.eos_id == tokenizer.token_to_id(EOS) and special.eos_text == EOS
    ids, mask = tokenize_document(Document("To be, or not to be"), tokenizer, special)
    assert ids[-1] == special.eos_id and all(mask)
    assert tokenizer.decode(ids[:-1]) == "To be, or not to be"


def _loss_text(tokenizer, ids, mask) -> str:
    return tokenizer.decode([i for i, m in zip(ids, mask) if m], skip_special_tokens=False)


def test_chat_simple_template_masks_all_but_assistant(tokenizer, tmp_path):
    save_tokenizer(tokenizer, tmp_path, eos_token=EOS)
    special = read_special_tokens(tokenizer, tmp_path)
    data = tmp_path / "chat.jsonl"
    data.write_text(json.dumps({"messages": CHAT}) + "\n")
    [doc] = load_documents([data], special, "auto")  # no chat_template → the simple one
    assert doc.text.startswith("<|system|>\nSpeak like a bard.\n<|user|>\nWho goes there?\n<|assistant|>\n")
    ids, mask = tokenize_document(doc, tokenizer, special)
    assert _loss_text(tokenizer, ids, mask) == f"A friend, good sir.{EOS}The king is dead; long live the king.{EOS}"
    # Every masked-in token lies inside an assistant turn; the user's and system's words never have loss.
    assert "Who" not in _loss_text(tokenizer, ids, mask) and "bard" not in _loss_text(tokenizer, ids, mask)


@pytest.mark.parametrize("config_template", [None, "{{ 'stale' }}"])
def test_chat_template_read_from_the_files_transformers_saves(tokenizer, tmp_path, config_template):
    """transformers v5 saves the template as chat_template.jinja (not in tokenizer_config.json), and a template file
    wins over a tokenizer_config.json entry: we read what AutoTokenizer reads."""
    import transformers

    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(tokenizer.to_str()), eos_token=EOS)
    fast.chat_template = LLAMA3_LIKE
    fast.save_pretrained(tmp_path)
    assert (tmp_path / "chat_template.jinja").is_file()
    if config_template is not None:
        cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
        (tmp_path / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": config_template}))
    assert transformers.AutoTokenizer.from_pretrained(tmp_path).chat_template == LLAMA3_LIKE
    assert read_special_tokens(tokenizer, tmp_path).chat_template == LLAMA3_LIKE


def test_named_chat_template_files(tokenizer, tmp_path):
    (tmp_path / "additional_chat_templates").mkdir()
    (tmp_path / "additional_chat_templates" / "tool_use.jinja").write_text("{{ 'tools' }}")
    assert read_special_tokens(tokenizer, tmp_path).chat_template == "{{ 'tools' }}"  # no default: the first named
    (tmp_path / "chat_template.jinja").write_text(LLAMA3_LIKE)
    assert read_special_tokens(tokenizer, tmp_path).chat_template == LLAMA3_LIKE


def test_chat_model_template_via_jinja(tokenizer, tmp_path):
    tok = Tokenizer.from_str(tokenizer.to_str())
    tok.add_special_tokens(["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"])
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>", "chat_template": LLAMA3_LIKE}))
    special = read_special_tokens(tok, tmp_path)
    assert special.chat_template == LLAMA3_LIKE and special.bos_id == tok.token_to_id("<|begin_of_text|>")
    data = tmp_path / "chat.jsonl"
    data.write_text(json.dumps({"messages": CHAT}) + "\n" + json.dumps({"text": "plain line"}) + "\n")
    chat_doc, text_doc = load_documents([data], special, "auto")
    assert chat_doc.text.startswith("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n")
    ids, mask = tokenize_document(chat_doc, tok, special)
    assert ids.count(special.bos_id) == 1  # the template wrote BOS; encoding must not add a second
    assert _loss_text(tok, ids, mask) == "A friend, good sir.<|eot_id|>The king is dead; long live the king.<|eot_id|>"
    assert text_doc.spans is None
    # The simple template can be forced even when the model has one.
    [forced, _] = load_documents([data], special, "simple")
    assert forced.text.startswith("<|system|>")


def _model_template_special(tokenizer, tmp_path, template):
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": EOS, "chat_template": template}))
    return read_special_tokens(tokenizer, tmp_path)


def test_chat_template_environment_is_hfs(tokenizer, tmp_path, monkeypatch):
    # Loop controls, a tojson that keeps non-ASCII and '<' / '&' as json.dumps writes them, and a strftime_now that
    # does not depend on the day the data is built.
    template = ("{% for m in messages %}{% if loop.index > 2 %}{% break %}{% endif %}"
                "{{ m['role'] }}: {{ m['content'] | tojson }} {{ strftime_now('%d %b %Y') }}\n{% endfor %}")
    special = _model_template_special(tokenizer, tmp_path, template)
    data = tmp_path / "chat.jsonl"
    chat = [{"role": "user", "content": "a<b & café"}, {"role": "assistant", "content": "ok"},
            {"role": "user", "content": "never rendered"}]
    data.write_text(json.dumps({"messages": chat}) + "\n")
    [doc] = load_documents([data], special, "model")
    assert doc.text == 'user: "a<b & café" 26 Jul 2024\nassistant: "ok" 26 Jul 2024\n'

    import datetime as real_datetime

    class Tomorrow(real_datetime.datetime):
        @classmethod
        def now(cls, tz=None):
            return real_datetime.datetime(2031, 1, 2)

    monkeypatch.setattr(real_datetime, "datetime", Tomorrow)
    [again] = load_documents([data], special, "model")
    assert again.text == doc.text


def test_blank_documents_are_skipped(tokenizer, tmp_path):
    special = read_special_tokens(tokenizer, None)
    data = tmp_path / "docs.jsonl"
    data.write_text("\n".join(json.dumps({"text": t}) for t in ["", "  \n", "To be"]) + "\n")
    blank = tmp_path / "blank.txt"
    blank.write_text("\n\n")
    assert [d.text for d in load_documents([data, blank], special, "auto")] == ["To be"]


def test_load_tokenizer_switches_off_saved_truncation_and_padding(tokenizer, tmp_path):
    from liger_models.hub import load_tokenizer

    saved = Tokenizer.from_str(tokenizer.to_str())
    saved.enable_truncation(4)
    saved.enable_padding(length=64, pad_id=0, pad_token="<pad>")
    saved.save(str(tmp_path / "tokenizer.json"))
    text = shakespeare(400)
    full = tokenizer.encode(text).ids
    as_saved = Tokenizer.from_file(str(tmp_path / "tokenizer.json")).encode(text).ids
    assert len(full) > 64 and as_saved == full[:4] + [0] * 60  # cut at 4, padded to 64
    assert load_tokenizer(tmp_path).encode(text).ids == full


def test_chat_template_not_prefix_stable_is_rejected(tokenizer, tmp_path):
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    # Renders only the last message: earlier turns change when a turn is added.
    template = "{{ messages[-1]['content'] }}{% if add_generation_prompt %}>{% endif %}"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": EOS, "chat_template": template}))
    special = read_special_tokens(tokenizer, tmp_path)
    data = tmp_path / "chat.jsonl"
    data.write_text(json.dumps({"messages": CHAT}) + "\n")
    with pytest.raises(ValueError, match="prefix-stable"):
        load_documents([data], special, "model")


@pytest.mark.parametrize("line, match", [
    ("{not json", "invalid JSON"),
    ('{"messages": [{"role": "user", "content": "hi"}]}', "no assistant turn"),
    ('{"messages": [{"role": "user"}]}', "string 'role' and 'content'"),
    ('{"prompt": "x"}', "expected"),
])
def test_bad_jsonl_lines_name_the_problem(tokenizer, tmp_path, line, match):
    special = read_special_tokens(tokenizer, None)
    data = tmp_path / "bad.jsonl"
    data.write_text(line + "\n")
    with pytest.raises(ValueError, match=match) as info:
        load_documents([data], special)
    assert "bad.jsonl:1" in str(info.value) or match == "expected"


def test_missing_and_unsupported_files(tokenizer, tmp_path):
    special = read_special_tokens(tokenizer, None)
    with pytest.raises(FileNotFoundError):
        load_documents([tmp_path / "nope.txt"], special)
    (tmp_path / "x.csv").write_text("a,b")
    with pytest.raises(ValueError, match=".txt or .jsonl"):
        load_documents([tmp_path / "x.csv"], special)


def test_build_dataset_rejects_data_without_targets(tokenizer, tmp_path):
    special = read_special_tokens(tokenizer, None)
    data = tmp_path / "chat.jsonl"
    data.write_text(json.dumps({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": ""}]}))
    with pytest.raises(ValueError, match="no token to train on"):
        build_dataset([data], tokenizer, special, seq_len=16, chat_template="simple")


def test_labels_only_where_nothing_predicts_them_are_no_targets():
    ids = torch.arange(8).view(2, 4)
    positions = torch.tensor([[0, 1, 0, 1], [0, 1, 2, 3]])  # row 0 holds two documents
    starts_only = torch.full_like(ids, -100)
    starts_only[0, 0], starts_only[0, 2], starts_only[1, 0] = 1, 2, 3  # each labelled token starts its document
    with pytest.raises(ValueError, match="no token to train on"):
        check_has_targets(PackedDataset(ids, starts_only, positions))
    one_target = starts_only.clone()
    one_target[1, 3] = 4
    check_has_targets(PackedDataset(ids, one_target, positions))


def _stream_dataset(n: int = 11, seq_len: int = 5):
    ids = torch.arange(n * seq_len, dtype=torch.int32).view(n, seq_len)
    return pack_documents([(ids.flatten().tolist(), [True] * ids.numel())], seq_len)


def test_batch_stream_is_seeded_and_resumable():
    ds = _stream_dataset()
    a = BatchStream(ds, 3, seed=7)
    first = [a.next_batch()["input_ids"] for _ in range(9)]  # crosses two epoch boundaries (11 windows)
    # Each epoch is a permutation of all windows.
    seen = torch.cat([b[:, 0] for b in first])[:11]
    assert sorted(seen.tolist()) == [5 * i for i in range(11)]
    b = BatchStream(ds, 3, seed=7)
    for _ in range(4):
        b.next_batch()
    state = b.state_dict()
    c = BatchStream(ds, 3, seed=7)
    c.load_state_dict(state)
    assert all(torch.equal(c.next_batch()["input_ids"], first[i]) for i in range(4, 9))
    assert not torch.equal(BatchStream(ds, 3, seed=8).next_batch()["input_ids"], first[0])
    with pytest.raises(ValueError, match="windows"):
        BatchStream(_stream_dataset(n=12), 3).load_state_dict(state)


def test_batch_stream_ranks_split_the_global_batch():
    ds = _stream_dataset()
    single = BatchStream(ds, 4, seed=3)
    ranks = [BatchStream(ds, 2, seed=3, rank=r, world_size=2) for r in range(2)]
    for _ in range(5):
        whole = single.next_batch()["input_ids"]
        parts = torch.cat([s.next_batch()["input_ids"] for s in ranks])
        assert torch.equal(whole, parts)


GEMMA_LIKE = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
    "{% endif %}{% for m in messages %}{% set role = 'model' if m['role'] == 'assistant' else m['role'] %}"
    "<start_of_turn>{{ role }}\n{{ m['content'] | trim }}<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)


@pytest.mark.parametrize("template, chat, match", [
    # A model template that refuses a conversation (Gemma's has no system role) raises a jinja TemplateError.
    (GEMMA_LIKE, CHAT, "System role not supported"),
    # The simple template's own refusal of an unknown role.
    (None, [{"role": "tool", "content": "42"}, {"role": "assistant", "content": "ok"}], "unknown role 'tool'"),
])
def test_chat_template_refusals_name_the_line(tokenizer, tmp_path, template, chat, match):
    """A conversation the template refuses fails as a ValueError (the CLI's one clear line, not a traceback) that
    names the file and line, as every other bad JSONL line does."""
    ok = [{"role": "user", "content": "Who goes there?"}, {"role": "assistant", "content": "A friend."}]
    special = (_model_template_special(tokenizer, tmp_path, template) if template
               else read_special_tokens(tokenizer, None))
    data = tmp_path / "chat.jsonl"
    data.write_text(json.dumps({"messages": ok}) + "\n" + json.dumps({"messages": chat}) + "\n")
    with pytest.raises(ValueError, match=match) as info:
        load_documents([data], special, "model" if template else "simple")
    assert "chat.jsonl:2" in str(info.value)


# The per-document pipeline that batched tokenization replaced, kept as the reference it must match bit for bit.
def _reference_tokenize(doc, tokenizer, special):
    enc = tokenizer.encode(doc.text, add_special_tokens=not doc.template_bos)
    ids = list(enc.ids)
    if doc.spans is None:
        mask = [True] * len(ids)
        if special.eos_id is not None and (not ids or ids[-1] != special.eos_id):
            ids.append(special.eos_id)
            mask.append(True)
        return ids, mask
    mask = [not s and e > b and any(x <= b < y for x, y in doc.spans) for (b, e), s in
            zip(enc.offsets, enc.special_tokens_mask)]
    return ids, mask


def _reference_pack(tokenized, seq_len, pad_id):
    pieces = [(ids, mask) for ids, mask in tokenized if ids]
    ids = torch.cat([torch.tensor(i, dtype=torch.int64) for i, _ in pieces])
    has_loss = torch.cat([torch.tensor(m, dtype=torch.bool) for _, m in pieces])
    lengths = torch.tensor([len(i) for i, _ in pieces])
    doc_start = torch.zeros(len(ids), dtype=torch.bool)
    doc_start[torch.cumsum(lengths, 0)[:-1]] = True
    doc_start[0] = True
    n_windows = -(-len(ids) // seq_len)
    pad = n_windows * seq_len - len(ids)
    if pad:
        ids = torch.cat([ids, torch.full((pad,), pad_id, dtype=torch.int64)])
        has_loss = torch.cat([has_loss, torch.zeros(pad, dtype=torch.bool)])
        doc_start = torch.cat([doc_start, torch.tensor([True] + [False] * (pad - 1))])
    doc_start = doc_start.view(n_windows, seq_len).clone()
    doc_start[:, 0] = True
    idx = torch.arange(seq_len).expand(n_windows, seq_len)
    last_start = torch.cummax(torch.where(doc_start, idx, torch.zeros_like(idx)), dim=1).values
    ids = ids.view(n_windows, seq_len)
    labels = torch.where(has_loss.view(n_windows, seq_len), ids, torch.full_like(ids, -100))
    return ids.to(torch.int32), labels.to(torch.int32), (idx - last_start).to(torch.int32)


def _bos_tokenizer(tokenizer, tmp_path, template):
    """A Llama-3-like tokenizer: its post-processor adds BOS (offsets (0, 0)), and its chat template writes BOS."""
    from tokenizers import processors

    tok = Tokenizer.from_str(tokenizer.to_str())
    tok.add_special_tokens(["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"])
    tok.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A", special_tokens=[("<|begin_of_text|>", tok.token_to_id("<|begin_of_text|>"))])
    tok.save(str(tmp_path / "tokenizer.json"))
    config = {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>", "chat_template": template}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    return tok, read_special_tokens(tok, tmp_path)


@pytest.mark.parametrize("chat_template", ["model", "simple"])
@pytest.mark.parametrize("seq_len", [7, 64])
def test_batched_pipeline_is_bit_identical_to_per_document(tokenizer, tmp_path, monkeypatch, chat_template, seq_len):
    import liger_models.train.dataset as data_module

    tok, special = _bos_tokenizer(tokenizer, tmp_path, LLAMA3_LIKE)
    assert special.adds_bos
    (tmp_path / "plain.txt").write_text(shakespeare(3_000))
    rows = [{"text": shakespeare(400)}, {"text": "  "}, {"text": "Café — naïve «ünïcödé» 🎭"},
            {"messages": CHAT}, {"text": "x"}, {"messages": CHAT[1:3]}, {"text": shakespeare(50)}]
    (tmp_path / "mixed.jsonl").write_text("\n".join(json.dumps(r, ensure_ascii=False) for r in rows) + "\n\n")
    paths = [tmp_path / "plain.txt", tmp_path / "mixed.jsonl", tmp_path / "plain.txt"]
    docs = load_documents(paths, special, chat_template)
    assert any(d.template_bos for d in docs) == (chat_template == "model")
    expected = _reference_pack([_reference_tokenize(d, tok, special) for d in docs], seq_len, special.pad_id)
    for chunk_chars in (1, 500, 1 << 22):  # one document per encode_batch call, a few, all at once
        monkeypatch.setattr(data_module, "ENCODE_CHUNK_CHARS", chunk_chars)
        ds = build_dataset(paths, tok, special, seq_len, chat_template)
        for got, want in zip((ds.input_ids, ds.labels, ds.position_ids), expected):
            assert got.dtype == want.dtype == torch.int32 and torch.equal(got, want)


def test_tokenize_document_matches_reference_without_eos(tokenizer):
    special = read_special_tokens(tokenizer, None)  # no EOS known: nothing appended
    doc = Document(shakespeare(300))
    assert tokenize_document(doc, tokenizer, special) == _reference_tokenize(doc, tokenizer, special)


def test_utf8_bom_at_file_start_is_not_text(tokenizer, tmp_path):
    """Windows tools (Notepad, PowerShell) start UTF-8 files with a BOM: it is an encoding mark, not a character to
    train on (a .txt file trained the model to emit U+FEFF) nor a JSON error on line 1 of a .jsonl file."""
    special = read_special_tokens(tokenizer, None)
    (tmp_path / "bom.txt").write_bytes("\ufeffTo be".encode("utf-8"))
    (tmp_path / "bom.jsonl").write_bytes(("\ufeff" + json.dumps({"text": "or not"}) + "\n").encode("utf-8"))
    docs = load_documents([tmp_path / "bom.txt", tmp_path / "bom.jsonl"], special)
    assert [d.text for d in docs] == ["To be", "or not"]


@pytest.mark.parametrize("name", ["latin1.txt", "latin1.jsonl"])
def test_a_file_that_is_not_utf8_is_named(tokenizer, tmp_path, name):
    special = read_special_tokens(tokenizer, None)
    text = "Fair Verona, où nous plaçons notre scène"
    data = tmp_path / name
    data.write_bytes((json.dumps({"text": text}, ensure_ascii=False) if name.endswith("jsonl") else text)
                     .encode("latin-1"))
    with pytest.raises(ValueError, match=f"{name} is not UTF-8 text.*convert it to UTF-8"):
        load_documents([data], special)


def test_jsonl_text_rows_with_null_messages(tokenizer, tmp_path):
    """A mixed dataset exported by pandas / HF datasets writes every column on every row: a plain row carries
    "messages": null (and a chat row "text": null). Each row is what its non-null field says."""
    special = read_special_tokens(tokenizer, None)
    data = tmp_path / "mixed.jsonl"
    data.write_text(json.dumps({"text": "To be", "messages": None}) + "\n"
                    + json.dumps({"text": None, "messages": CHAT[1:3]}) + "\n")
    plain, chat = load_documents([data], special, "simple")
    assert plain.text == "To be" and plain.spans is None
    assert chat.text.startswith("<|user|>\nWho goes there?") and chat.spans


def test_batch_stream_load_state_dict_after_drawing():
    """Loading a state into a stream that already drew batches (under another seed) continues the saved run
    exactly: the cached epoch permutation of the old seed must not be reused."""
    ds = _stream_dataset()
    a = BatchStream(ds, 3, seed=7)
    a.next_batch()
    state, want = a.state_dict(), a.next_batch()["input_ids"]
    b = BatchStream(ds, 3, seed=8)
    b.next_batch()
    b.load_state_dict(state)
    assert torch.equal(b.next_batch()["input_ids"], want)


def test_chat_template_sees_tools_and_documents_as_hf_passes_them(tokenizer, tmp_path):
    """HF renders with tools=None and documents=None: a template testing ``tools is not none`` without an
    ``is defined`` guard must not render its tool-use preamble into every conversation (an undefined is not none)."""
    import transformers

    template = ("{% if tools is not none %}Environment: ipython\n{% endif %}{% if documents is defined %}docs\n"
                "{% endif %}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}")
    special = _model_template_special(tokenizer, tmp_path, template)
    data = tmp_path / "chat.jsonl"
    data.write_text(json.dumps({"messages": CHAT[1:3]}) + "\n")
    [doc] = load_documents([data], special, "model")
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(tokenizer.to_str()), eos_token=EOS)
    fast.chat_template = template
    assert doc.text == fast.apply_chat_template(CHAT[1:3], tokenize=False)


def test_chat_template_with_generation_tags(tokenizer, tmp_path):
    """HF's ``{% generation %}`` block (templates written for its assistant masks, e.g. TRL's training templates)
    compiles and renders its body as HF does; the loss still covers exactly the assistant turns."""
    import transformers

    template = ("{% for m in messages %}<|{{ m['role'] }}|>\n{% if m['role'] == 'assistant' %}{% generation %}"
                "{{ m['content'] }}" + EOS + "{% endgeneration %}{% else %}{{ m['content'] }}{% endif %}\n{% endfor %}"
                "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
    special = _model_template_special(tokenizer, tmp_path, template)
    data = tmp_path / "chat.jsonl"
    data.write_text(json.dumps({"messages": CHAT[1:]}) + "\n")
    [doc] = load_documents([data], special, "model")
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(tokenizer.to_str()), eos_token=EOS)
    fast.chat_template = template
    assert doc.text == fast.apply_chat_template(CHAT[1:], tokenize=False)
    ids, mask = tokenize_document(doc, tokenizer, special)
    assert _loss_text(tokenizer, ids, mask) == f"A friend, good sir.{EOS}The king is dead; long live the king.{EOS}"

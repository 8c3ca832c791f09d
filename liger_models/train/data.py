"""Training data: tokenizers, plain-text and chat JSONL documents, packing, and a resumable batch stream.

Documents
    ``.txt``    the whole file is one document; every token is trained on. It is read and encoded in pieces cut at
                blank lines where that provably gives the whole text's tokens (text_pieces.py).
    ``.jsonl``  one document per line: ``{"text": ...}`` (every token trained) or
                ``{"messages": [{"role": ..., "content": ...}, ...]}`` (chat: loss on assistant turns only).
    A blank text (a file or ``"text"`` of whitespace only) is skipped: with BOS/EOS added it would teach BOS → EOS.

Chat rendering
    ``template="model"`` renders the model's own chat template (found where transformers finds it:
    :func:`read_chat_template`) with jinja2 (the sandboxed environment HF uses: loop controls, ``{% generation %}``
    blocks, ``tools`` and ``documents`` None, a ``tojson`` that keeps non-ASCII text, ``raise_exception``;
    ``strftime_now`` renders the fixed CHAT_TEMPLATE_DATE, so the tokens never depend on the day they are built).
    Assistant spans are found by rendering growing prefixes of the conversation: the text between
    ``render(messages[:i], add_generation_prompt=True)`` and ``render(messages[:i+1])`` is turn i, so the loss
    covers the assistant's content plus the template's end-of-turn marker and nothing the user wrote. A template
    that rewrites earlier turns (not prefix-stable) is rejected with a clear error.
    ``template="simple"`` needs no jinja and is fully documented here::

        <|system|>\\n{content}\\n<|user|>\\n{content}\\n<|assistant|>\\n{content}{eos}\\n

    (role tags are plain text; ``{eos}`` is the tokenizer's end-of-sequence token when it has one). The loss covers
    each assistant ``{content}{eos}``. ``template="auto"`` picks "model" when jinja2 and a template exist.

Tokenizing
    Documents are streamed from the files and encoded a chunk at a time (about ENCODE_CHUNK_CHARS characters) with
    ``Tokenizer.encode_batch``, which runs on every core in Rust; each chunk becomes int32 ids and a bool loss mask
    (numpy), so no token passes through a Python list for long. The result is bit-identical to encoding documents
    one by one (tests/train/test_data.py keeps that reference). ``build_dataset(..., cache_dir=DIR)`` keeps the
    packed windows on disk (data_cache.py) and loads them when nothing they depend on changed; the training recipes
    cache under ``<output_dir>/.data_cache`` and, under torchrun, only rank 0 tokenizes.

    Measured 2026-11-30 on a 2-core CPU: tiny Shakespeare as 375k JSONL paragraphs, 19.9M tokens (the demo's 2048-token
    BPE), seq_len 1024 — one document at a time: 50 s, peak RSS +2.0 GB; batched: 17 s, +0.87 GB; cache hit
    (238 MB file, hashing the 63 MB corpus, checksum and memory-map): 0.2 s.

Packing
    Documents (BOS/EOS added the way the model's tokenizer does) are concatenated into one stream and cut into
    windows of ``seq_len`` tokens; a document may continue into the next window. ``position_ids`` restart at 0 at
    every document start and at every window start, which is how the models and the Medusa heads see boundaries
    (attention and every shifted label stop there). Labels are HF-aligned (= input ids, -100 where no loss); the
    last window is padded with ignored tokens.

Batches
    :class:`BatchStream` walks an endless sequence of epochs, each a seeded permutation of the windows. Its whole
    state is ``(seed, consumed)``: a resumed run draws exactly the batches the interrupted one would have drawn.
    With several ranks, global micro-batch j is windows ``[j·B·W, (j+1)·B·W)`` of that sequence and rank r takes
    the r-th slice of B, so W ranks × B equals one rank × (B·W) sample for sample.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator, Sequence

import numpy as np
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from liger_models.input_files import not_utf8, read_text, shorten
from liger_models.modules.loss import shift_labels
from liger_models.tokenizer import (CHAT_TEMPLATE_DATE, NO_TEMPLATE, SpecialTokens, jinja_renderer,
                                    read_chat_template, read_special_tokens)
from liger_models.train import data_cache
from liger_models.train.packing import (IGNORE_INDEX, PackedDataset, batch_to, check_has_targets,
                                           pack_arrays, pack_documents)
from liger_models.train.text_pieces import TextSplitter, added_ends

SIMPLE_ROLES = ("system", "user", "assistant")
# Packing lives in packing.py; its names stay importable from here, where the rest of the pipeline is.
__all__ = ["IGNORE_INDEX", "BatchStream", "Document", "PackedDataset", "SpecialTokens", "batch_to", "build_dataset",
           "chat_template_note", "check_has_targets", "iter_documents", "load_documents", "pack_arrays",
           "pack_documents", "read_chat_template", "read_special_tokens", "save_tokenizer", "tokenize_chunk",
           "tokenize_document", "train_bpe_tokenizer"]
# Text per encode_batch call (see _chunks): 1 MiB is as fast as 4 MiB on the measured corpus, with less memory.
ENCODE_CHUNK_CHARS = 1 << 20


# ----------------------------------------------------------------------------------------------------------------
# Tokenizers (reading a checkpoint's special tokens and chat template: liger_models/tokenizer.py)


def _training_renderer(template: str, special: SpecialTokens):
    """The model's template as training renders it: on the fixed CHAT_TEMPLATE_DATE, so a resumed or repeated run
    tokenizes its data exactly as the first did."""
    return jinja_renderer(template, {"bos_token": special.bos_text, "eos_token": special.eos_text},
                          date=CHAT_TEMPLATE_DATE, source=special.chat_template_file)


def train_bpe_tokenizer(texts: Iterable[str], vocab_size: int = 2048, eos_token: str = "<|endoftext|>") -> Tokenizer:
    """A byte-level BPE tokenizer (GPT-2 style, every byte representable) trained on ``texts``."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[eos_token],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return tokenizer


def save_tokenizer(tokenizer: Tokenizer, out_dir: str | os.PathLike, eos_token: str = "<|endoftext|>") -> None:
    """Write ``tokenizer.json`` and a minimal ``tokenizer_config.json`` naming the EOS token."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eos_token, "bos_token": None}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")


# ----------------------------------------------------------------------------------------------------------------
# Documents and chat rendering


@dataclass
class Document:
    """Text to train on; ``spans`` are the [start, end) character ranges with loss (None = all of it).

    ``template_bos``: the text already carries the BOS (a model chat template writes it), so encoding adds none.
    ``first`` / ``last``: False for a piece of a plain text that continues an earlier piece / is continued by a later
    one (text_pieces.py): a document starts at its first piece and gets its EOS after its last.
    """

    text: str
    spans: list[tuple[int, int]] | None = None
    template_bos: bool = False
    first: bool = True
    last: bool = True

    @property
    def whole(self) -> bool:
        return self.first and self.last


def _check_messages(messages, where: str) -> None:
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"{where}: 'messages' must be a non-empty list, got {shorten(messages)}")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise ValueError(f"{where}: message {i} needs string 'role' and 'content' fields, got {shorten(m)}")
    if not any(m["role"] == "assistant" for m in messages):
        raise ValueError(f"{where}: no assistant turn, so nothing to train on")


def render_simple(messages: Sequence[dict], special: SpecialTokens) -> Document:
    """The documented role-tagged template (module docstring); loss spans = assistant content + EOS."""
    parts, spans, pos = [], [], 0
    for m in messages:
        if m["role"] not in SIMPLE_ROLES:
            raise ValueError(f"simple chat template: unknown role {m['role']!r} (expected one of {SIMPLE_ROLES})")
        head = f"<|{m['role']}|>\n"
        body = m["content"] + (special.eos_text if m["role"] == "assistant" else "")
        if m["role"] == "assistant":
            spans.append((pos + len(head), pos + len(head) + len(body)))
        piece = head + body + "\n"
        parts.append(piece)
        pos += len(piece)
    return Document("".join(parts), spans)


def render_model_template(messages: Sequence[dict], special: SpecialTokens, renderer=None) -> Document:
    """Render with the model's jinja chat template; assistant spans from prefix renders (module docstring)."""
    render = renderer or _training_renderer(special.chat_template, special)
    full = render(messages, False)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before = render(messages[:i], True)
        upto = render(messages[: i + 1], False)
        if not (full.startswith(upto) and upto.startswith(before)):
            raise ValueError(
                "the model's chat template is not prefix-stable (it rewrites earlier turns), so assistant turns "
                "cannot be located; use --chat-template simple"
            )
        spans.append((len(before), len(upto)))
    return Document(full, spans, template_bos=bool(special.bos_text) and full.startswith(special.bos_text))


def _render_chat(messages: Sequence[dict], special: SpecialTokens, renderer, where: str) -> Document:
    """One conversation with the model's template (``renderer``) or the simple one (None); a conversation the
    template refuses is reported with its file and line."""
    try:
        if renderer is not None:
            return render_model_template(messages, special, renderer)
        return render_simple(messages, special)
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None


def _uses_model_template(chat_template: str, special: SpecialTokens) -> bool:
    """Whether ``chat_template`` (auto | model | simple) renders with the model's jinja template."""
    if chat_template not in ("auto", "model", "simple"):
        raise ValueError(f"chat_template must be auto|model|simple, got {chat_template!r}")
    use_model = chat_template == "model" or (chat_template == "auto" and special.chat_template is not None)
    if use_model and special.chat_template is None:
        raise ValueError(f"--chat-template model: the model has no chat_template ({NO_TEMPLATE})")
    return use_model


def chat_template_note(special: SpecialTokens, chat_template: str = "auto") -> str:
    """The line a command logs once at its start: which template chat conversations render with, the model's own
    (and the file it came from) or the built-in simple one (and why). Refuses what _uses_model_template refuses."""
    if _uses_model_template(chat_template, special):
        return f"[chat template] the model's own, from {special.chat_template_file or 'its tokenizer settings'}"
    if special.chat_template is None:
        why = f"the model has none: {NO_TEMPLATE}"
    else:
        why = f"--chat-template simple; the model's own, in {special.chat_template_file}, is not used"
    return f"[chat template] the built-in simple one ({why})"


def render_generation_prompt(messages: Sequence[dict], special: SpecialTokens,
                             chat_template: str = "auto") -> Document:
    """A conversation that ends where the assistant's reply starts, rendered as training renders chat documents
    (the same template choice), so a trained model is prompted in the format it learned: the model's template with
    ``add_generation_prompt``, or the simple template's turns followed by the ``<|assistant|>`` tag. No spans."""
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise ValueError(f"message {i} needs string 'role' and 'content' fields, got {m!r}")
    if _uses_model_template(chat_template, special):
        text = _training_renderer(special.chat_template, special)(messages, True)
        return Document(text, None, template_bos=bool(special.bos_text) and text.startswith(special.bos_text))
    opened = render_simple(list(messages) + [{"role": "assistant", "content": ""}], special).text
    return Document(opened[: opened.rindex("<|assistant|>\n") + len("<|assistant|>\n")], None)


def iter_documents(paths: Sequence[str | os.PathLike], special: SpecialTokens, chat_template: str = "auto",
                   splitter: TextSplitter | None = None) -> Iterator[Document]:
    """Read ``.txt`` / ``.jsonl`` files into documents one at a time (formats: module docstring), so a corpus is
    never held in memory as a whole; blank plain texts are left out (nothing to learn). ``splitter``: a plain
    text comes in pieces (``first`` / ``last``) that encode to its tokens (text_pieces.py), else whole."""
    use_model = _uses_model_template(chat_template, special)
    renderer = functools.cache(lambda: _training_renderer(special.chat_template, special))  # compiled once, if needed
    for raw in paths:
        path = Path(raw)
        if not path.is_file():
            raise FileNotFoundError(f"data file not found: {path}")
        if path.suffix not in (".txt", ".jsonl"):
            raise ValueError(f"unsupported data file {path}: expected .txt or .jsonl")
        if path.suffix == ".txt":
            yield from _text_documents(path, splitter)
            continue
        try:
            yield from _jsonl_documents(path, special, renderer if use_model else None)
        except UnicodeDecodeError:  # the bare error says neither which file, nor where, nor what to do
            raise not_utf8(path) from None


def _text_documents(path: Path, splitter: TextSplitter | None) -> Iterator[Document]:
    """A .txt file as one document, in pieces when ``splitter`` cuts it; nothing when it is blank."""
    pieces = splitter.pieces(path) if splitter is not None else iter([read_text(path)])
    text, after = next(pieces), next(pieces, None)
    if after is None:  # one piece: the whole text
        if text.strip():
            yield Document(text)
        return
    yield Document(text, last=False)  # a text with a cut is not blank: both sides of a cut hold words
    for piece in pieces:
        yield Document(after, first=False, last=False)
        after = piece
    yield Document(after, first=False)


def _jsonl_documents(path: Path, special: SpecialTokens, renderer) -> Iterator[Document]:
    """The documents of one .jsonl file (see :func:`iter_documents`); ``renderer()`` gives the model's chat
    template renderer, or renderer is None for the simple template."""
    # utf-8-sig: a BOM that Windows tools write at a file's start is an encoding mark, not text to train on.
    with path.open(encoding="utf-8-sig") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{where}: invalid JSON ({_json_problem(exc, line)})") from None
            # A null field is an absent one: a mixed dataset exported by pandas / HF datasets writes every
            # column on every row ({"text": ..., "messages": null}).
            if isinstance(row, dict) and row.get("messages") is not None:
                _check_messages(row["messages"], where)
                yield _render_chat(row["messages"], special, renderer and renderer(), where)
            elif isinstance(row, dict) and isinstance(row.get("text"), str):
                if row["text"].strip():
                    yield Document(row["text"])
            else:
                raise ValueError(f'{where}: expected {{"text": ...}} or {{"messages": [...]}}, got {shorten(row)}')


def _json_problem(exc: json.JSONDecodeError, line: str) -> str:
    # exc.msg alone is cut short ("Invalid control character at"); the place completes it.
    problem = exc.msg.removesuffix(" at")
    if exc.pos >= len(line.rstrip()):
        return f"{problem} at the end of the line: the row is cut short"
    return f"{problem} at column {exc.colno}"


def load_documents(paths: Sequence[str | os.PathLike], special: SpecialTokens,
                   chat_template: str = "auto") -> list[Document]:
    """All documents of ``paths`` as a list (see :func:`iter_documents`); raises when there are none."""
    docs = list(iter_documents(paths, special, chat_template))
    if not docs:
        raise ValueError(f"no documents in {[str(p) for p in paths]}")
    return docs


def _encode_batch(docs: Sequence[Document], tokenizer: Tokenizer) -> list:
    """Encodings of ``docs`` in order, computed in parallel by ``encode_batch``. Texts a chat template already
    opened with BOS, and pieces of a text, are encoded without the post-processor's special tokens (one batch per
    setting)."""
    encodings = [None] * len(docs)
    for adds_specials in (True, False):
        where = [i for i, d in enumerate(docs) if (d.whole and not d.template_bos) == adds_specials]
        if where:
            batch = tokenizer.encode_batch([docs[i].text for i in where], add_special_tokens=adds_specials)
            for i, enc in zip(where, batch):
                encodings[i] = enc
    return encodings


def _plain_tokens(enc, eos_id: int | None) -> tuple[np.ndarray, np.ndarray]:
    # Every token has loss; EOS closes the document unless the post-processor already put one there.
    ids = np.asarray(enc.ids, dtype=np.int32)
    if eos_id is not None and (ids.size == 0 or ids[-1] != eos_id):
        ids = np.append(ids, np.int32(eos_id))
    return ids, np.ones(ids.size, dtype=bool)


def _chat_tokens(enc, spans: list[tuple[int, int]]) -> tuple[np.ndarray, np.ndarray]:
    # A token has loss when its first character lies in an assistant span; tokens the post-processor added
    # (offsets (0, 0), special mask 1) never do.
    ids = np.asarray(enc.ids, dtype=np.int32)
    offsets = np.asarray(enc.offsets, dtype=np.int64).reshape(-1, 2)
    start, end = offsets[:, 0], offsets[:, 1]
    in_span = np.zeros(ids.size, dtype=bool)
    for a, b in spans:
        in_span |= (a <= start) & (start < b)
    added = np.asarray(enc.special_tokens_mask, dtype=bool)
    return ids, in_span & ~added & (end > start)


def _piece_tokens(enc, doc: Document, ends: tuple[list[int], list[int]],
                  eos_id: int | None) -> tuple[np.ndarray, np.ndarray]:
    # A piece of a plain text: the post-processor's tokens (``ends``: text_pieces.added_ends) go before the first
    # piece and after the last, and the last gets the EOS a whole text would (_plain_tokens).
    before, after = ends
    ids = np.asarray((before if doc.first else []) + enc.ids + (after if doc.last else []), dtype=np.int32)
    if doc.last and eos_id is not None and (ids.size == 0 or ids[-1] != eos_id):
        ids = np.append(ids, np.int32(eos_id))
    return ids, np.ones(ids.size, dtype=bool)


def tokenize_chunk(docs: Sequence[Document], tokenizer: Tokenizer,
                   special: SpecialTokens) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``docs`` tokenized and concatenated: int32 ids, a bool "has loss" mask, and each document's (or piece's)
    token count. EOS is appended to plain documents when the tokenizer has one."""
    ends = added_ends(tokenizer) if not all(doc.whole for doc in docs) else None
    per_doc = [_piece_tokens(enc, doc, ends, special.eos_id) if not doc.whole
               else _plain_tokens(enc, special.eos_id) if doc.spans is None else _chat_tokens(enc, doc.spans)
               for doc, enc in zip(docs, _encode_batch(docs, tokenizer))]
    lengths = np.array([ids.size for ids, _ in per_doc], dtype=np.int64)
    if not per_doc:
        return np.zeros(0, np.int32), np.zeros(0, bool), lengths
    return np.concatenate([i for i, _ in per_doc]), np.concatenate([m for _, m in per_doc]), lengths


def tokenize_document(doc: Document, tokenizer: Tokenizer, special: SpecialTokens) -> tuple[list[int], list[bool]]:
    """One document's token ids and "has loss" mask as lists (:func:`tokenize_chunk` of one)."""
    ids, mask, _ = tokenize_chunk([doc], tokenizer, special)
    return ids.tolist(), mask.tolist()


def _chunks(docs: Iterable[Document], max_chars: int) -> Iterator[list[Document]]:
    # Enough documents per encode_batch call to keep every core busy, few enough that the chunk's Encodings
    # (offsets, token strings: ~100 bytes a token in Rust) stay small.
    chunk, chars = [], 0
    for doc in docs:
        chunk.append(doc)
        chars += len(doc.text)
        if chars >= max_chars:
            yield chunk
            chunk, chars = [], 0
    if chunk:
        yield chunk


# ----------------------------------------------------------------------------------------------------------------
# Building a dataset


def _tokenize_and_pack(paths, tokenizer: Tokenizer, special: SpecialTokens, seq_len: int,
                       chat_template: str) -> PackedDataset:
    """Stream the documents, tokenize them a chunk at a time, pack once (module docstring, "Tokenizing")."""
    id_parts, mask_parts, length_parts, first_parts = [], [], [], []
    documents = iter_documents(paths, special, chat_template, TextSplitter(tokenizer))
    for chunk in _chunks(documents, ENCODE_CHUNK_CHARS):
        ids, mask, lengths = tokenize_chunk(chunk, tokenizer, special)
        id_parts.append(ids)
        mask_parts.append(mask)
        length_parts.append(lengths)
        first_parts.append(np.array([doc.first for doc in chunk], dtype=bool))
    if not length_parts:
        raise ValueError(f"no documents in {[str(p) for p in paths]}")
    # A text's pieces are one document: their token counts add up to its length.
    lengths = np.add.reduceat(np.concatenate(length_parts), np.flatnonzero(np.concatenate(first_parts)))
    dataset = pack_arrays(id_parts, mask_parts, lengths, seq_len, special.pad_id)
    check_has_targets(dataset)
    return dataset


def build_dataset(
    paths: Sequence[str | os.PathLike],
    tokenizer: Tokenizer,
    special: SpecialTokens,
    seq_len: int,
    chat_template: str = "auto",
    cache_dir: str | os.PathLike | None = None,
) -> PackedDataset:
    """Read, tokenize and pack ``paths`` into windows of ``seq_len`` tokens.

    ``cache_dir``: keep the packed windows there and, when the same data, tokenizer, template and ``seq_len`` come
    again, load them instead of tokenizing (data_cache.py: what the key covers, how files are checked)."""
    if cache_dir is None:
        return _tokenize_and_pack(paths, tokenizer, special, seq_len, chat_template)
    fields = {k: v for k, v in dataclasses.asdict(special).items() if k != "chat_template_file"}
    key = data_cache.dataset_key(paths, tokenizer.to_str(), fields, chat_template, seq_len)
    path = Path(cache_dir) / f"{key}.safetensors"
    tensors = data_cache.load(path, key)
    if tensors is not None:
        return PackedDataset(**tensors)
    dataset = _tokenize_and_pack(paths, tokenizer, special, seq_len, chat_template)
    data_cache.save(path, key, {"input_ids": dataset.input_ids, "labels": dataset.labels,
                                "position_ids": dataset.position_ids})
    return dataset


# ----------------------------------------------------------------------------------------------------------------
# Batches


def repeats_note(dataset: PackedDataset, sequences: int) -> str:
    """What a user is told when the data holds fewer windows than the ``sequences`` of one micro-batch (all ranks):
    every micro-batch then repeats windows, and one window (data shorter than --seq-len) is trained on alone. The run
    goes on: memorising a small text is a legitimate test of a setup, and a mistaken --seq-len is obvious from the
    numbers."""
    targets = int((shift_labels(dataset.labels, 1, dataset.position_ids, IGNORE_INDEX) != IGNORE_INDEX).sum())
    n, them = len(dataset), "it" if len(dataset) == 1 else "them"
    held = (f"fits in one sequence of --seq-len {dataset.seq_len}" if n == 1
            else f"fills {n} sequences of --seq-len {dataset.seq_len}")
    return (f"the training data {held} ({targets} tokens to predict), fewer than the {sequences} of one micro-batch: "
            f"every micro-batch repeats {them}, so the loss falls by memorising {them}; more data, a smaller --seq-len "
            "or a smaller --batch-size gives distinct sequences")


class BatchStream:
    """Deterministic, resumable micro-batches over endless seeded epochs (module docstring)."""

    def __init__(self, dataset: PackedDataset, batch_size: int, *, seed: int = 0, rank: int = 0, world_size: int = 1):
        if batch_size < 1:
            raise ValueError(f"batch_size must be ≥ 1, got {batch_size}")
        self.dataset, self.batch_size = dataset, batch_size
        self.seed, self.rank, self.world_size = seed, rank, world_size
        self.consumed = 0  # windows drawn so far by all ranks together
        self._epoch, self._perm = -1, None
        if rank == 0 and len(dataset) < batch_size * world_size:
            warnings.warn(repeats_note(dataset, batch_size * world_size), stacklevel=2)

    def _window(self, global_index: int) -> int:
        epoch, offset = divmod(global_index, len(self.dataset))
        if epoch != self._epoch:
            gen = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._epoch, self._perm = epoch, torch.randperm(len(self.dataset), generator=gen)
        return int(self._perm[offset])

    def next_batch(self) -> dict[str, torch.Tensor]:
        """This rank's next (B, T) micro-batch; advances the global position by B × world_size."""
        first = self.consumed + self.rank * self.batch_size
        indices = torch.tensor([self._window(first + i) for i in range(self.batch_size)])
        self.consumed += self.batch_size * self.world_size
        return self.dataset.batch(indices)

    @property
    def epoch(self) -> float:
        return self.consumed / len(self.dataset)

    def state_dict(self) -> dict:
        return {"seed": self.seed, "consumed": self.consumed, "num_windows": len(self.dataset)}

    def load_state_dict(self, state: dict) -> None:
        if state["num_windows"] != len(self.dataset):
            raise ValueError(
                f"resume: the checkpoint's data had {state['num_windows']} windows, this data has "
                f"{len(self.dataset)} (different data, tokenizer or --seq-len?)"
            )
        self.seed, self.consumed = state["seed"], state["consumed"]
        self._epoch, self._perm = -1, None  # the cached permutation may be another seed's

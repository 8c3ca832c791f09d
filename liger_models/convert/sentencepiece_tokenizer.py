"""SentencePiece BPE ``tokenizer.model`` (Llama 1/2, Mistral v0.1–v0.3) → HF ``tokenizer.json`` + config.

The file is a serialized ``ModelProto`` (sentencepiece_model.proto), read here with a small protobuf wire-format
reader so that neither ``sentencepiece`` nor ``protobuf`` is needed. The field numbers relied on (checked against
the descriptor shipped in sentencepiece's ``sentencepiece_model_pb2.py``):

- ModelProto: 1 ``pieces`` (repeated SentencePiece), 2 ``trainer_spec``, 3 ``normalizer_spec``;
- SentencePiece: 1 ``piece`` (string), 2 ``score`` (float), 3 ``type`` (1 NORMAL, 2 UNKNOWN, 3 CONTROL,
  4 USER_DEFINED, 5 UNUSED, 6 BYTE; default NORMAL);
- TrainerSpec: 3 ``model_type`` (1 UNIGRAM default, 2 BPE, 3 WORD, 4 CHAR), 24 ``treat_whitespace_as_suffix``,
  35 ``byte_fallback``, 40/41/42/43 ``unk_id``/``bos_id``/``eos_id``/``pad_id`` (defaults 0, 1, 2, -1);
- NormalizerSpec: 1 ``name``, 2 ``precompiled_charsmap``, 3 ``add_dummy_prefix``, 4 ``remove_extra_whitespaces``,
  5 ``escape_whitespaces`` (defaults true for 3-5).

What is built is the tokenizer transformers' LlamaConverter builds for these models (HF's published Llama 2 and
Mistral ``tokenizer.json`` have this layout): a BPE model whose ids are the piece indices, with byte fallback and
fused unknowns; merges recovered from the vocabulary (every split of a piece into two pieces, ordered by the merged
piece's score: SentencePiece's BPE merges the adjacent pair whose concatenation is the highest-scored piece); a
normalizer that prepends "▁" (add_dummy_prefix) and replaces " " by "▁"; a decoder that undoes it (Replace,
ByteFallback, Fuse, Strip one leading space); a post-processor that prepends BOS; control and unknown pieces as
special added tokens, user-defined pieces as plain added tokens. Unlike HF's extractor, control / unknown / byte /
unused pieces take part in no merge (SentencePiece's BPE never builds them from text).

The normalizer is the "legacy" Prepend + Replace pair, not a Metaspace pre-tokenizer: Metaspace does not prepend
"▁" to a text that already starts with a space, SentencePiece does (" a" → "▁▁a"). One consequence, shared with
HF's Llama 2 files: a text segment that follows an added token also gets a "▁" (SentencePiece never parses control
tokens out of text, so only user-defined pieces, which Llama 2 and Mistral do not have, could see the difference);
likewise, with the dummy prefix, a text that starts with a user-defined piece gets no "▁" before it, and a
user-defined piece containing "▁" only matches a literal "▁" (HF's normalizer runs per segment between added tokens,
so the prefix cannot be placed as SentencePiece does). Without the dummy prefix, user-defined pieces match exactly.
Only BPE models with byte fallback, no normalization table and Llama's whitespace settings (spaces kept as they
are, escaped as "▁" before the word) are converted; anything else is refused rather than converted into a tokenizer
that encodes differently. No chat template is written (Llama 2's and Mistral's differ and live outside the file).
Decoding gives SentencePiece's text for any ids that encode text; ids that no text encodes differ as in HF's files:
a run of byte pieces that is not valid UTF-8 becomes one U+FFFD per byte (tokenizers' ByteFallback decoder, which
no JSON decoder can change; SentencePiece replaces only the invalid bytes), and the unknown piece is skipped
(SentencePiece writes " ⁇ ").
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, processors

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
MODEL_TYPES = {1: "Unigram", 2: "BPE", 3: "word", 4: "char"}
SPACE = "▁"  # U+2581, SentencePiece's visible space


class NotSentencePiece(ValueError):
    """The bytes are not a serialized SentencePiece ModelProto (so a caller may treat the file as opaque)."""


# ---- protobuf wire format -----------------------------------------------------------------------------------
def _varint(data: bytes, pos: int) -> tuple[int, int]:
    """A base-128 varint at `pos` → (value, next position)."""
    value, shift = 0, 0
    while pos < len(data):
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, pos
        shift += 7
        if shift >= 70:  # 10 bytes is the longest legal varint (a negative int64)
            break
    raise NotSentencePiece("truncated or over-long varint")


def _fields(data: bytes) -> list[tuple[int, int | bytes]]:
    """Every (field number, value) of one message: ints for varint / fixed fields, bytes for length-delimited
    ones. Groups (wire types 3/4) never occur in sentencepiece_model.proto, so they mean "not this format"."""
    out, pos = [], 0
    while pos < len(data):
        key, pos = _varint(data, pos)
        number, wire = key >> 3, key & 7
        if number == 0:
            raise NotSentencePiece("field number 0")
        if wire == 0:
            value, pos = _varint(data, pos)
        elif wire == 2:
            size, pos = _varint(data, pos)
            if pos + size > len(data):
                raise NotSentencePiece("length-delimited field runs past the end")
            value, pos = data[pos:pos + size], pos + size
        elif wire in (1, 5):
            width = 8 if wire == 1 else 4
            if pos + width > len(data):
                raise NotSentencePiece("fixed-width field runs past the end")
            value, pos = int.from_bytes(data[pos:pos + width], "little"), pos + width
        else:
            raise NotSentencePiece(f"unsupported wire type {wire}")
        out.append((number, value))
    return out


def _int32(value: int) -> int:
    """A varint-encoded int32: negatives are sign-extended to 64 bits on the wire (pad_id = -1)."""
    value &= (1 << 64) - 1
    return value - (1 << 64) if value >= 1 << 63 else value


def _last(fields: list[tuple[int, int | bytes]], number: int, default, kind: type):
    """Protobuf's rule for a singular field: the last occurrence wins; `kind` checks the wire form."""
    values = [v for n, v in fields if n == number]
    if not values:
        return default
    if not isinstance(values[-1], kind):
        raise NotSentencePiece(f"field {number} has the wrong wire type")
    return values[-1]


# ---- the ModelProto -----------------------------------------------------------------------------------------
@dataclass
class Piece:
    text: str
    score: float
    type: int


@dataclass
class SentencePieceModel:
    pieces: list[Piece]
    model_type: int = 1
    byte_fallback: bool = False
    treat_whitespace_as_suffix: bool = False
    unk_id: int = 0
    bos_id: int = 1
    eos_id: int = 2
    pad_id: int = -1
    normalizer_name: str = ""
    precompiled_charsmap: bytes = b""
    add_dummy_prefix: bool = True
    remove_extra_whitespaces: bool = True
    escape_whitespaces: bool = True
    ids: dict[str, int] = field(default_factory=dict, repr=False)  # piece → id (first occurrence)

    def piece(self, index: int) -> str | None:
        return self.pieces[index].text if 0 <= index < len(self.pieces) else None


def _utf8(raw: bytes, what: str) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        raise NotSentencePiece(f"{what} is not UTF-8") from None


def _parse_piece(raw: bytes) -> Piece:
    fields = _fields(raw)
    text = _utf8(_last(fields, 1, b"", bytes), "a piece")
    score = struct.unpack("<f", _last(fields, 2, 0, int).to_bytes(4, "little"))[0]
    return Piece(text, score, _last(fields, 3, NORMAL, int))


def _apply_trainer_spec(model: SentencePieceModel, raw: bytes) -> None:
    fields = _fields(raw)
    model.model_type = _last(fields, 3, 1, int)
    model.treat_whitespace_as_suffix = bool(_last(fields, 24, 0, int))
    model.byte_fallback = bool(_last(fields, 35, 0, int))
    model.unk_id, model.bos_id, model.eos_id, model.pad_id = (
        _int32(_last(fields, number, default, int)) for number, default in ((40, 0), (41, 1), (42, 2), (43, -1)))


def _apply_normalizer_spec(model: SentencePieceModel, raw: bytes) -> None:
    fields = _fields(raw)
    model.normalizer_name = _utf8(_last(fields, 1, b"", bytes), "the normalizer name")
    model.precompiled_charsmap = _last(fields, 2, b"", bytes)
    model.add_dummy_prefix = bool(_last(fields, 3, 1, int))
    model.remove_extra_whitespaces = bool(_last(fields, 4, 1, int))
    model.escape_whitespaces = bool(_last(fields, 5, 1, int))


def parse_model(data: bytes) -> SentencePieceModel:
    """A serialized ModelProto → its pieces and the settings the conversion depends on. Raises NotSentencePiece
    for bytes that are not one (no pieces, no trainer spec, or broken wire format)."""
    fields = _fields(data)
    pieces = [_parse_piece(v) for n, v in fields if n == 1 and isinstance(v, bytes)]
    trainer = _last(fields, 2, None, bytes)
    if not pieces or trainer is None:
        raise NotSentencePiece("no pieces or no trainer_spec")
    model = SentencePieceModel(pieces)
    _apply_trainer_spec(model, trainer)
    _apply_normalizer_spec(model, _last(fields, 3, b"", bytes))
    for index, piece in enumerate(pieces):
        model.ids.setdefault(piece.text, index)
    return model


def read_model(path: str | Path) -> SentencePieceModel:
    return parse_model(Path(path).read_bytes())


def is_sentencepiece_file(path: str | Path) -> bool:
    """True when the file parses as a SentencePiece ModelProto (of any model type)."""
    try:
        read_model(path)
    except NotSentencePiece:
        return False
    return True


# ---- what can be converted ----------------------------------------------------------------------------------
def buildable_unused(model: SentencePieceModel) -> list[str]:
    """UNUSED pieces that two other pieces join into. SentencePiece's BPE builds those and then splits them back
    (so pieces built on top of them still form), which an HF BPE cannot express; an unused piece no merge reaches
    (Mistral's reserved control-like names) changes nothing."""
    buildable = {p.text for p in model.pieces if p.type in (NORMAL, USER_DEFINED, UNUSED)}
    return [p.text for p in model.pieces if p.type == UNUSED
            and any(p.text[:cut] in buildable and p.text[cut:] in buildable for cut in range(1, len(p.text)))]


def check_convertible(model: SentencePieceModel, name: str = "tokenizer.model") -> None:
    """Refuse a model whose HF equivalent would not be the Llama layout built here."""
    kind = MODEL_TYPES.get(model.model_type, f"unknown type {model.model_type}")
    if model.model_type != 2:
        raise ValueError(f"{name} is a SentencePiece {kind} model; only BPE models with byte fallback "
                         f"(Llama 1/2, Mistral) are converted")
    problems = []
    if not model.byte_fallback:
        problems.append("byte_fallback is off")
    if model.treat_whitespace_as_suffix:
        problems.append("treat_whitespace_as_suffix is on")
    if model.precompiled_charsmap:
        problems.append(f"it has a {model.normalizer_name or 'custom'} normalization table (not 'identity')")
    if model.remove_extra_whitespaces:
        problems.append("remove_extra_whitespaces is on")
    if not model.escape_whitespaces:
        problems.append("escape_whitespaces is off")
    if not 0 <= model.unk_id < len(model.pieces) or model.pieces[model.unk_id].type != UNKNOWN:
        problems.append(f"unk_id {model.unk_id} is not an UNKNOWN piece")
    unused = buildable_unused(model)
    if unused:
        problems.append(f"text can build its UNUSED pieces {unused[:5]}, which SentencePiece splits again")
    if problems:
        raise ValueError(f"{name} is a SentencePiece BPE model that is not Llama-like: {'; '.join(problems)}")


# ---- merges -------------------------------------------------------------------------------------------------
def _mergeable(piece: Piece) -> bool:
    # SentencePiece's BPE only merges into normal and user-defined pieces (its pieces_ map); control, unknown and
    # byte pieces are looked up by id alone, unused ones are split again.
    return piece.type in (NORMAL, USER_DEFINED)


def recover_merges(model: SentencePieceModel) -> list[tuple[str, str]]:
    """HF BPE merges: every split of a mergeable piece into two mergeable pieces, highest merged score first (ties:
    lower id first, then the split's position), which is the order in which SentencePiece would join them."""
    usable = {p.text: i for i, p in enumerate(model.pieces) if _mergeable(p) and model.ids[p.text] == i}
    found = []
    for text, index in usable.items():
        for cut in range(1, len(text)):
            left, right = text[:cut], text[cut:]
            if left in usable and right in usable:
                found.append((-model.pieces[index].score, index, cut, left, right))
    found.sort()
    return [(left, right) for *_, left, right in found]


# ---- the HF tokenizer ---------------------------------------------------------------------------------------
def _added_tokens(model: SentencePieceModel):
    """Control and unknown pieces as special tokens (never produced from text, skipped on decode), user-defined
    ones as plain added tokens (matched whole, as SentencePiece does), in id order."""
    # SentencePiece finds user-defined pieces in the normalized text (where "▁▁" is two spaces). Without a dummy
    # prefix the normalizer is Replace(" ", "▁") alone, which leaves the pieces' own text as is, so they can be
    # matched after it; with one, HF would prepend "▁" to their text too, so they are matched in the raw text.
    user_normalized = not model.add_dummy_prefix
    tokens = []
    for piece in model.pieces:
        if piece.type in (CONTROL, UNKNOWN, USER_DEFINED):
            user = piece.type == USER_DEFINED
            tokens.append(AddedToken(piece.text, special=not user, normalized=user and user_normalized,
                                     lstrip=False, rstrip=False, single_word=False))
    return tokens


def _normalizer(model: SentencePieceModel):
    steps = [normalizers.Prepend(SPACE)] if model.add_dummy_prefix else []
    return normalizers.Sequence(steps + [normalizers.Replace(" ", SPACE)])


def _decoder(model: SentencePieceModel):
    steps = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if model.add_dummy_prefix:  # SentencePiece drops the dummy prefix's space when decoding
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    return decoders.Sequence(steps)


def build_tokenizer(model: SentencePieceModel):
    """The `tokenizers.Tokenizer` equivalent to SentencePiece's encode of this (checked) BPE model."""
    vocab = dict(model.ids)
    if len(vocab) != len(model.pieces):
        raise ValueError(f"the SentencePiece model has {len(model.pieces) - len(vocab)} duplicate pieces")
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=recover_merges(model), unk_token=model.piece(model.unk_id),
                                     fuse_unk=True, byte_fallback=True, dropout=None))
    tokenizer.normalizer = _normalizer(model)
    tokenizer.pre_tokenizer = None
    tokenizer.decoder = _decoder(model)
    tokenizer.add_tokens(_added_tokens(model))
    bos = model.piece(model.bos_id)
    if bos is not None:  # SentencePiece's encode(add_bos=True); a pair gets a BOS before each sequence
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos}:1 $B:1", special_tokens=[(bos, model.bos_id)])
    return tokenizer


def tokenizer_config(model: SentencePieceModel, model_max_length: int) -> dict:
    """transformers' tokenizer_config.json. The class is the generic fast tokenizer so that tokenizer.json is used
    as written: transformers' LlamaTokenizer class rebuilds the pipeline with a Metaspace pre-tokenizer, which
    encodes a leading space differently from SentencePiece. legacy / add_prefix_space describe that pipeline."""
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "legacy": True,
              "add_prefix_space": model.add_dummy_prefix, "add_bos_token": model.piece(model.bos_id) is not None,
              "add_eos_token": False, "clean_up_tokenization_spaces": False,
              "model_input_names": ["input_ids", "attention_mask"], "model_max_length": model_max_length}
    for name, index in (("bos", model.bos_id), ("eos", model.eos_id), ("unk", model.unk_id), ("pad", model.pad_id)):
        if model.piece(index) is not None:
            config[f"{name}_token"] = model.piece(index)
    return config


def convert_sentencepiece(model_file: str | Path, *, vocab_size: int | None = None):
    """A SentencePiece ``tokenizer.model`` → (`tokenizers.Tokenizer`, the parsed model). `vocab_size` (the
    embedding rows), when given, must hold every id. Nothing is written."""
    model_file = Path(model_file)
    try:
        model = read_model(model_file)
    except NotSentencePiece as e:
        raise ValueError(f"{model_file} is not a SentencePiece model: {e}") from None
    check_convertible(model, model_file.name)
    if vocab_size is not None and len(model.pieces) > vocab_size:
        raise ValueError(f"{model_file} has {len(model.pieces)} pieces, more than the model's vocabulary of "
                         f"{vocab_size}")
    return build_tokenizer(model), model


def save_hf_tokenizer(tokenizer, model: SentencePieceModel, out_dir: str | Path, *,
                      model_max_length: int = 4096) -> None:
    """tokenizer.json + tokenizer_config.json into an existing directory."""
    out = Path(out_dir)
    tokenizer.save(str(out / "tokenizer.json"))
    text = json.dumps(tokenizer_config(model, model_max_length), indent=2, ensure_ascii=False) + "\n"
    (out / "tokenizer_config.json").write_text(text, encoding="utf-8")


def write_hf_tokenizer(model_file: str | Path, out_dir: str | Path, *, model_max_length: int = 4096,
                       vocab_size: int | None = None) -> SentencePieceModel:
    """Convert a SentencePiece ``tokenizer.model`` into `out_dir`; return the parsed model."""
    tokenizer, model = convert_sentencepiece(model_file, vocab_size=vocab_size)
    save_hf_tokenizer(tokenizer, model, out_dir, model_max_length=model_max_length)
    return model

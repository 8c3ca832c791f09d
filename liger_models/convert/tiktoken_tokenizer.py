"""Meta Llama 3's tiktoken ``tokenizer.model`` → Hugging Face ``tokenizer.json`` + ``tokenizer_config.json``.

Llama 3 / 3.1 / 3.2 / 3.3 ship the same ranks file in tiktoken's format: one line per token, the base64 of the
token's bytes, a space and its rank (0 … 127999). The rest of the tokenizer lives in Meta's code (llama3's and
llama-models' ``tokenizer.py``), and is restated here:

- the pre-tokenizer split regex ``PAT_STR`` (``pat_str`` there; the same for every Llama 3.x release);
- 256 special tokens numbered from ``len(ranks)`` on (128000 …), in one of two lists:
  ``"3"`` (Llama 3, April 2024: 128002-128005 ``<|reserved_special_token_0..3|>``, 128006/128007 the header
  tokens, 128008 ``<|reserved_special_token_4|>``, 128009 ``<|eot_id|>``, then ``_5`` … ``_250``) and
  ``"3.1"`` (Llama 3.1 release, also used by the published 3.2 / 3.3 tokenizers: 128004
  ``<|finetune_right_pad_id|>``, 128005 ``<|reserved_special_token_2|>``, 128008 ``<|eom_id|>``, 128009
  ``<|eot_id|>``, 128010 ``<|python_tag|>``, then ``_3`` … ``_247``). Later llama-models code renames 128005
  ``<|step_id|>``; the published Llama 3.1/3.2 HF tokenizers keep ``<|reserved_special_token_2|>``, as here.

The HF tokenizer is a byte-level BPE equivalent to tiktoken's: the vocabulary is each token's bytes in GPT-2's
byte-to-unicode alphabet with its rank as id; the merges are recovered from the ranks: tiktoken merges the adjacent
pair whose concatenation has the lowest rank, so every split of a multi-byte token into two tokens is a merge,
ordered by the token's rank (not only the split that BPE restricted to lower ranks finds: Llama 3's ranks join two
trainings, and inside a longer pre-token a token can be built from another split). ``ignore_merges`` mirrors
tiktoken taking a whole pre-token that is itself a token as is. Pre-tokenizer: Split with ``PAT_STR`` then ByteLevel
(no prefix space, no regex of its own); ByteLevel decoder; a post-processor that prepends ``<|begin_of_text|>``.

``tokenizer_config.json`` names bos ``<|begin_of_text|>`` and eos ``<|end_of_text|>`` (the base models' end of
document). Instruct models end a turn with ``<|eot_id|>`` (and 3.1+ a tool call with ``<|eom_id|>``): generation
should stop on those too. The chat template is Llama 3 Instruct's (headers + ``<|eot_id|>``); Llama 3.1's
template with tool calling and a dated system header is not reproduced.
"""

from __future__ import annotations

import base64
import binascii
import json
import re
from functools import lru_cache
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

PAT_STR = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
           r"|\s*[\r\n]+|\s+(?!\S)|\s+")
NUM_SPECIAL_TOKENS = 256
BOS, EOS, EOT = "<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"


def _reserved(first: int, last: int) -> list[str]:
    return [f"<|reserved_special_token_{i}|>" for i in range(first, last + 1)]


_NAMED = {
    "3": [BOS, EOS, *_reserved(0, 3), "<|start_header_id|>", "<|end_header_id|>", *_reserved(4, 4), EOT],
    "3.1": [BOS, EOS, *_reserved(0, 1), "<|finetune_right_pad_id|>", *_reserved(2, 2), "<|start_header_id|>",
            "<|end_header_id|>", "<|eom_id|>", EOT, "<|python_tag|>"],
}
# Each list is padded with numbered reserved tokens up to 256 entries, continuing its own numbering.
SPECIAL_TOKENS = {version: named + _reserved(next_index, next_index + NUM_SPECIAL_TOKENS - len(named) - 1)
                  for version, named, next_index in (("3", _NAMED["3"], 5), ("3.1", _NAMED["3.1"], 3))}

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    " + message['content'] | trim + '<|eot_id|>' %}"
    "{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
    "{{ content }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)

# A ranks line: base64 (standard alphabet, padded), one space, a decimal rank.
_RANKS_LINE = re.compile(rb"^[A-Za-z0-9+/]+={0,2} [0-9]+$")


# ---- reading the ranks file ---------------------------------------------------------------------------------
def is_tiktoken_file(path: str | Path) -> bool:
    """True for a tiktoken ranks file; False for anything else (a SentencePiece protobuf starts with a binary
    field tag, so its first line never looks like "base64 rank")."""
    with open(path, "rb") as f:
        first = f.readline(4096).rstrip(b"\r\n")
    return bool(_RANKS_LINE.match(first))


def _parse_line(line: bytes, number: int, path: Path) -> tuple[bytes, int]:
    if not _RANKS_LINE.match(line):
        raise ValueError(f"{path}:{number}: not a tiktoken ranks line (base64, space, rank): {line[:60]!r}")
    encoded, rank = line.split(b" ")
    try:
        return base64.b64decode(encoded, validate=True), int(rank)
    except binascii.Error as e:
        raise ValueError(f"{path}:{number}: bad base64 {encoded[:60]!r}: {e}") from None


def read_ranks(path: str | Path) -> dict[bytes, int]:
    """The token bytes → rank table, checked to be a numbering 0 … n-1 (ids of the HF vocabulary, with the special
    tokens numbered right after) with every single byte present (byte-level BPE must be able to spell anything)."""
    path = Path(path)
    ranks: dict[bytes, int] = {}
    with open(path, "rb") as f:
        for number, raw in enumerate(f, 1):
            line = raw.rstrip(b"\r\n")
            if not line:
                continue
            token, rank = _parse_line(line, number, path)
            if token in ranks:
                raise ValueError(f"{path}:{number}: token {token!r} appears twice")
            ranks[token] = rank
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise ValueError(f"{path}: ranks must number the {len(ranks)} tokens 0 … {len(ranks) - 1} without gaps")
    missing = [b for b in range(256) if bytes([b]) not in ranks]
    if missing:
        raise ValueError(f"{path}: single bytes {missing[:10]} have no token (not a byte-level BPE vocabulary)")
    return ranks


# ---- byte-level alphabet and merges -------------------------------------------------------------------------
@lru_cache(maxsize=1)
def byte_to_unicode() -> tuple[str, ...]:
    """GPT-2's byte → printable character table (the alphabet of HF's ByteLevel): printable Latin-1 bytes stand
    for themselves, the other 68 are shifted to U+0100 and up, in byte order."""
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)}
    table, shifted = {}, 0
    for byte in range(256):
        if byte in printable:
            table[byte] = chr(byte)
        else:
            table[byte] = chr(256 + shifted)
            shifted += 1
    return tuple(table[b] for b in range(256))


def token_string(token: bytes) -> str:
    """A token's bytes spelt in the byte-level alphabet (its HF vocabulary entry)."""
    table = byte_to_unicode()
    return "".join(table[b] for b in token)


def recover_merges(ranks: dict[bytes, int]) -> tuple[list[tuple[str, str]], list[bytes]]:
    """HF merges (byte-level strings): every split of a token into two tokens, in the order of the merged tokens'
    ranks (a token's splits by position), and the tokens that have no such split (kept in the vocabulary; reachable
    only as a whole pre-token). HF's BPE then joins the adjacent pair whose merged token ranks lowest, as tiktoken
    does; only two different splits of one token overlapping in a word (p+q = q+r) could tie-break differently."""
    merges, unreachable = [], []
    for token, rank in sorted(ranks.items(), key=lambda item: item[1]):
        if len(token) == 1:
            continue
        splits = [(token[:cut], token[cut:]) for cut in range(1, len(token))
                  if token[:cut] in ranks and token[cut:] in ranks]
        merges.extend((token_string(left), token_string(right)) for left, right in splits)
        if not splits:
            unreachable.append(token)
    return merges, unreachable


# ---- the HF tokenizer ---------------------------------------------------------------------------------------
def special_tokens(n_base: int, version: str) -> dict[str, int]:
    """Meta's special tokens for `version` ("3" or "3.1"), numbered from the end of the ranks."""
    if version not in SPECIAL_TOKENS:
        raise ValueError(f"unknown Llama 3 special-token list {version!r} (choose from {sorted(SPECIAL_TOKENS)})")
    return {token: n_base + i for i, token in enumerate(SPECIAL_TOKENS[version])}


def build_tokenizer(ranks: dict[bytes, int], specials: dict[str, int]):
    """The `tokenizers.Tokenizer` equivalent to tiktoken's Encoding(PAT_STR, ranks, specials)."""
    vocab = {token_string(token): rank for token, rank in ranks.items()}
    merges, _ = recover_merges(ranks)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=True, fuse_unk=False,
                                     byte_fallback=False))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PAT_STR), behavior="isolated", invert=False),
        # The split is done above; ByteLevel only maps bytes to its alphabet (no GPT-2 regex, no leading space).
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tokenizer.decoder = decoders.ByteLevel()
    # Specials match verbatim in any text (tiktoken's allowed_special="all"); never normalised or stripped.
    ordered = sorted(specials, key=specials.get)
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False, lstrip=False, rstrip=False,
                                             single_word=False) for t in ordered])
    wrong = [t for t in ordered if tokenizer.token_to_id(t) != specials[t]]
    if wrong:
        raise ValueError(f"special tokens got unexpected ids: {wrong[:5]} "
                         f"(vocabulary size {tokenizer.get_vocab_size()})")
    bos = specials[BOS]
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS}:1 $B:1", special_tokens=[(BOS, bos)])
    return tokenizer


def tokenizer_config(model_max_length: int) -> dict:
    """transformers' tokenizer_config.json: a fast tokenizer read from tokenizer.json, Llama 3's bos / eos."""
    return {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": BOS, "eos_token": EOS,
            # False: decode must give back the text (the cleanup would drop spaces before punctuation).
            "clean_up_tokenization_spaces": False, "model_input_names": ["input_ids", "attention_mask"],
            "model_max_length": model_max_length, "chat_template": CHAT_TEMPLATE}


def convert_tiktoken(model_file: str | Path, *, version: str = "3.1", vocab_size: int | None = None):
    """A tiktoken ``tokenizer.model`` → (`tokenizers.Tokenizer`, special token → id). `vocab_size` (the embedding
    rows), when given, must hold every id. Nothing is written, so a converter can fail before it writes."""
    ranks = read_ranks(model_file)
    specials = special_tokens(len(ranks), version)
    if vocab_size is not None and len(ranks) + len(specials) > vocab_size:
        raise ValueError(f"{model_file} has {len(ranks)} tokens + {len(specials)} special tokens, more than the "
                         f"model's vocabulary of {vocab_size}")
    return build_tokenizer(ranks, specials), specials


def save_hf_tokenizer(tokenizer, out_dir: str | Path, *, model_max_length: int = 131072) -> None:
    """tokenizer.json + tokenizer_config.json into an existing directory."""
    out = Path(out_dir)
    tokenizer.save(str(out / "tokenizer.json"))
    text = json.dumps(tokenizer_config(model_max_length), indent=2, ensure_ascii=False) + "\n"
    (out / "tokenizer_config.json").write_text(text, encoding="utf-8")


def write_hf_tokenizer(model_file: str | Path, out_dir: str | Path, *, version: str = "3.1",
                       model_max_length: int = 131072, vocab_size: int | None = None) -> dict[str, int]:
    """Convert a tiktoken ``tokenizer.model`` into `out_dir` (tokenizer.json + tokenizer_config.json); return the
    special tokens' ids."""
    tokenizer, specials = convert_tiktoken(model_file, version=version, vocab_size=vocab_size)
    save_hf_tokenizer(tokenizer, out_dir, model_max_length=model_max_length)
    return specials

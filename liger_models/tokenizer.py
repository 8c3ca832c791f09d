"""A checkpoint's tokenizer as transformers' users call it, and what the rest of the package reads from its files.

``load_tokenizer(dir)`` gives a :class:`Tokenizer`: the fast ``tokenizers.Tokenizer`` of ``tokenizer.json`` (as
``.backend``) behind HF's calling conventions — ``tokenizer(text)`` → ``{"input_ids", "attention_mask"}``,
``encode`` → a list of ids, ``decode`` / ``batch_decode``, ``apply_chat_template`` with the checkpoint's own jinja
template, the special tokens and their ids, ``len()``. Truncation and padding settings saved in tokenizer.json are
switched off (fine-tuned repos often save them; they would silently cut documents short), and batches are padded
only when asked (``padding=True``), on the side tokenizer_config.json names.

The special tokens (tokenizer_config.json, falling back to config.json's ids) and the chat template (found where
transformers finds it: :func:`read_chat_template`) are read here once for training, decoding and this wrapper.
"""

from __future__ import annotations

import datetime
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

import torch
from tokenizers import Tokenizer as FastTokenizer

from liger_models.hub import CHAT_TEMPLATE_DIR, CHAT_TEMPLATE_FILE, LEGACY_CHAT_TEMPLATE_FILE
from liger_models.hub import load_tokenizer as load_fast_tokenizer
from liger_models.input_files import read_json_object, read_text

# What a chat template's strftime_now() sees while training data is built: a fixed day (the one Llama 3.1's template
# itself falls back to), so a resumed or repeated run tokenizes its data exactly as the first did.
CHAT_TEMPLATE_DATE = datetime.datetime(2024, 7, 26)
NO_TEMPLATE = (f"no {CHAT_TEMPLATE_FILE}, {CHAT_TEMPLATE_DIR}/, tokenizer_config.json entry or "
               f"{LEGACY_CHAT_TEMPLATE_FILE}")
SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token")


@dataclass
class SpecialTokens:
    """The ids and texts of BOS/EOS (None when the tokenizer has none) and whether encoding adds BOS itself."""

    bos_id: int | None = None
    eos_id: int | None = None
    bos_text: str = ""
    eos_text: str = ""
    adds_bos: bool = False
    chat_template: str | None = None
    # Where chat_template was read from (a file of the checkpoint, for the commands' logs). Not part of the data
    # cache's key: the same template read from another file packs the same windows.
    chat_template_file: str | None = None

    @property
    def pad_id(self) -> int:
        return self.eos_id if self.eos_id is not None else 0


def _token_text(value) -> str | None:
    # tokenizer_config.json stores special tokens as a string or as an AddedToken dict {"content": ...}.
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def read_special_tokens(tokenizer: FastTokenizer | Tokenizer, model_dir: str | os.PathLike | None) -> SpecialTokens:
    """BOS/EOS from ``tokenizer_config.json`` (falling back to ``config.json``'s ids) and the chat template with the
    file it came from (:func:`read_chat_template`)."""
    tokenizer = getattr(tokenizer, "backend", tokenizer)  # a Tokenizer's fast tokenizer
    tok_cfg, model_cfg = {}, {}
    if model_dir is not None:
        tok_cfg = _json_file(Path(model_dir) / "tokenizer_config.json")
        model_cfg = _json_file(Path(model_dir) / "config.json")
    special = SpecialTokens()
    for kind in ("bos", "eos"):
        text = _token_text(tok_cfg.get(f"{kind}_token"))
        tid = tokenizer.token_to_id(text) if text else None
        if tid is None:
            cfg_id = model_cfg.get(f"{kind}_token_id")
            tid = cfg_id[0] if isinstance(cfg_id, list) and cfg_id else cfg_id
            text = tokenizer.id_to_token(tid) if isinstance(tid, int) else None
        if isinstance(tid, int):
            setattr(special, f"{kind}_id", tid)
            setattr(special, f"{kind}_text", text or "")
    probe = tokenizer.encode("a", add_special_tokens=True).ids
    special.adds_bos = special.bos_id is not None and bool(probe) and probe[0] == special.bos_id
    if model_dir is not None:
        special.chat_template, special.chat_template_file = read_chat_template(model_dir, tok_cfg)
    return special


def read_chat_template(model_dir: str | os.PathLike, tokenizer_config: dict | None = None):
    """(the model's chat template, the file it was read from), or (None, None), found as transformers' tokenizer
    finds it: template files (chat_template.jinja is "default", additional_chat_templates/<name>.jinja the named
    ones) win over tokenizer_config.json's "chat_template" (a string, or a list of named templates). Failing both,
    chat_template.json: the file older processors keep it in, which a tokenizer does not read, but where a
    checkpoint's only template may be. Of several named templates "default", else the first.
    ``tokenizer_config``: tokenizer_config.json's contents when the caller has read them already."""
    root = Path(model_dir)
    if tokenizer_config is None:
        tokenizer_config = _json_file(root / "tokenizer_config.json")
    for named in _template_places(root, tokenizer_config):
        if named:
            return named["default"] if "default" in named else next(iter(named.values()))
    return None, None


def _template_places(root: Path, tokenizer_config: dict) -> Iterator[dict[str, tuple[str, str]]]:
    """The templates of each place (read_chat_template), first to last, as {name: (template, where)}; a place is
    read only when the ones before it hold none."""
    yield _chat_template_files(root)
    yield _config_templates(tokenizer_config, "tokenizer_config.json")
    yield _config_templates(_json_file(root / LEGACY_CHAT_TEMPLATE_FILE), LEGACY_CHAT_TEMPLATE_FILE)


def _json_file(path: Path) -> dict:
    return read_json_object(path) if path.is_file() else {}


def _chat_template_files(root: Path) -> dict[str, tuple[str, str]]:
    """{name: (template, file)} of the templates saved as files, where transformers v5 writes them."""
    files = {path.stem: path for path in sorted((root / CHAT_TEMPLATE_DIR).glob("*.jinja"))}
    if (root / CHAT_TEMPLATE_FILE).is_file():
        files["default"] = root / CHAT_TEMPLATE_FILE
    return {name: (read_text(path, keep_bom=True), path.relative_to(root).as_posix()) for name, path in files.items()}


def _config_templates(config: dict, file: str) -> dict[str, tuple[str, str]]:
    """{name: (template, where)} of a JSON file's "chat_template": a string, or [{"name": ..., "template": ...}]."""
    template = config.get("chat_template") if isinstance(config, dict) else None
    if isinstance(template, str):
        return {"default": (template, file)}
    if not isinstance(template, list):
        return {}
    return {t["name"]: (t["template"], f"{file} (its {t['name']!r} template)") for t in template
            if isinstance(t, dict) and isinstance(t.get("name"), str) and isinstance(t.get("template"), str)}



def jinja_renderer(template: str, special_tokens: dict[str, str], date: datetime.datetime | None = None,
                   source: str | None = None):
    """A function (messages, add_generation_prompt, **extra) -> text rendering ``template`` in the sandboxed jinja2
    environment transformers uses (loop controls, ``{% generation %}`` blocks, ``raise_exception``, a ``tojson``
    that keeps non-ASCII text, ``strftime_now`` on ``date``, else today), with ``special_tokens`` ({"bos_token":
    ..., "eos_token": ...}) and ``tools`` / ``documents`` None unless given. ``source``: where the template was
    read from, named by a template that does not compile."""
    import jinja2  # a runtime dependency, imported when a model's own template is first rendered
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(jinja2.ext.Extension):
        # HF's {% generation %}...{% endgeneration %} marks assistant text for its own masks; the spans here come
        # from prefix renders, so the block only renders its body (as HF does), instead of failing to compile.
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def strftime_now(fmt):
        return (date or datetime.datetime.now()).strftime(fmt)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols", Generation])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=strftime_now)
    try:
        compiled = env.from_string(template)
    except jinja2.exceptions.TemplateError as exc:
        line = f"line {exc.lineno}: " if getattr(exc, "lineno", None) else ""
        raise ValueError(f"the model's chat template ({source or 'its tokenizer settings'}) does not compile: "
                         f"{line}{exc.message}") from None

    def render(messages, add_generation_prompt: bool, **extra) -> str:
        # A template refuses what it cannot render (Gemma's: a system turn) with raise_exception(): a data error,
        # so a ValueError the caller can place (file:line) and the CLI reports in one line.
        # tools / documents None as HF passes them: a template testing `tools is not none` sees no tools.
        context = {"tools": None, "documents": None, **special_tokens, **extra}
        try:
            return compiled.render(messages=list(messages), add_generation_prompt=add_generation_prompt, **context)
        except jinja2.exceptions.TemplateError as exc:
            raise ValueError(f"the model's chat template refused this conversation: {exc}") from None

    return render




def _clean_up_spaces(text: str) -> str:
    """transformers' clean_up_tokenization: the spaces its old word-level tokenizers put before punctuation and
    English contractions, removed (done only when tokenizer_config.json asks for it)."""
    for spaced, joined in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
                           (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):
        text = text.replace(spaced, joined)
    return text


class Tokenizer:
    """A checkpoint's fast tokenizer with transformers' calling conventions (see the module docstring).

    ``backend`` is the ``tokenizers.Tokenizer``; every other attribute of it (``token_to_id``, ``encode_batch``,
    ``get_vocab_size`` ...) is reachable through this object too, except ``encode`` / ``decode``, which follow
    transformers (ids in, ids out)."""

    def __init__(self, backend: FastTokenizer, model_dir: str | os.PathLike | None = None) -> None:
        self.backend = backend
        config = {} if model_dir is None else _json_file(Path(model_dir) / "tokenizer_config.json")
        self.special = read_special_tokens(backend, model_dir)
        self.chat_template = self.special.chat_template
        self.padding_side = config.get("padding_side", "right")
        self.truncation_side = config.get("truncation_side", "right")
        self.model_max_length = config.get("model_max_length")
        self.clean_up_tokenization_spaces = bool(config.get("clean_up_tokenization_spaces", False))
        self.special_tokens_map: dict[str, str] = {}
        for key in SPECIAL_TOKEN_KEYS:
            text = _token_text(config.get(key))
            if text is None and key in ("bos_token", "eos_token"):
                text = getattr(self.special, key.replace("_token", "_text")) or None
            if text is not None and backend.token_to_id(text) is not None:
                self.special_tokens_map[key] = text

    def __getattr__(self, name: str):
        if name == "backend":  # not set yet (unpickling): never recurse
            raise AttributeError(name)
        return getattr(self.backend, name)

    def __len__(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def __repr__(self) -> str:
        return f"Tokenizer(vocab={len(self)}, special={self.special_tokens_map}, chat_template={self.chat_template is not None})"

    # ---- special tokens, as transformers names them ----------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=False)

    def _special(self, key: str) -> str | None:
        return self.special_tokens_map.get(key)

    bos_token = property(lambda self: self._special("bos_token"))
    eos_token = property(lambda self: self._special("eos_token"))
    unk_token = property(lambda self: self._special("unk_token"))
    pad_token = property(lambda self: self._special("pad_token"))
    bos_token_id = property(lambda self: self.convert_tokens_to_ids(self.bos_token) if self.bos_token else None)
    eos_token_id = property(lambda self: self.convert_tokens_to_ids(self.eos_token) if self.eos_token else None)
    unk_token_id = property(lambda self: self.convert_tokens_to_ids(self.unk_token) if self.unk_token else None)
    pad_token_id = property(lambda self: self.convert_tokens_to_ids(self.pad_token) if self.pad_token else None)

    @property
    def all_special_ids(self) -> list[int]:
        return sorted({self.backend.token_to_id(t) for t in self.special_tokens_map.values()})

    def convert_tokens_to_ids(self, tokens: str | Sequence[str]):
        if isinstance(tokens, str):
            return self.backend.token_to_id(tokens)
        return [self.backend.token_to_id(t) for t in tokens]

    def convert_ids_to_tokens(self, ids: int | Sequence[int]):
        if isinstance(ids, int):
            return self.backend.id_to_token(ids)
        return [self.backend.id_to_token(i) for i in ids]

    def get_vocab(self) -> dict[str, int]:
        return self.backend.get_vocab(with_added_tokens=True)

    # ---- text <-> ids ----------------------------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = True, **kwargs) -> list[int]:
        """The ids of ``text`` (transformers' ``encode``: BOS and the like when the tokenizer adds them)."""
        return self(text, add_special_tokens=add_special_tokens, **kwargs)["input_ids"]

    def __call__(self, text: str | Sequence[str], add_special_tokens: bool = True, padding: bool | str = False,
                 truncation: bool | None = None, max_length: int | None = None, return_tensors: str | None = None,
                 return_attention_mask: bool = True) -> dict:
        """{"input_ids", "attention_mask"} for a text (lists) or a batch of texts (lists of lists), as transformers'
        tokenizer returns them; ``return_tensors="pt"`` gives (batch, length) int64 tensors (a single text: batch
        1); ``padding`` True / "longest" / "max_length"; ``truncation`` with ``max_length``."""
        single = isinstance(text, str)
        if not single and not (isinstance(text, (list, tuple)) and all(isinstance(t, str) for t in text)):
            raise TypeError(f"text must be a str or a list of str, got {type(text).__name__}")
        rows = [e.ids for e in self.backend.encode_batch([text] if single else list(text),
                                                           add_special_tokens=add_special_tokens)]
        if truncation and max_length is not None:
            rows = [r[:max_length] if self.truncation_side == "right" else r[-max_length:] for r in rows]
        elif truncation and max_length is None:
            raise ValueError("truncation=True needs max_length (the tokenizer applies no limit of its own here)")
        masks = [[1] * len(r) for r in rows]
        if padding:
            rows, masks = self._pad(rows, masks, padding, max_length)
        if return_tensors is not None:
            if return_tensors != "pt":
                raise ValueError(f"return_tensors={return_tensors!r}: only 'pt' (torch) is supported")
            if len({len(r) for r in rows}) > 1:
                raise ValueError("texts of different lengths cannot form one tensor: pass padding=True")
            rows, masks = torch.tensor(rows, dtype=torch.long), torch.tensor(masks, dtype=torch.long)
        elif single:
            rows, masks = rows[0], masks[0]
        out = {"input_ids": rows}
        if return_attention_mask:
            out["attention_mask"] = masks
        return out

    def _pad(self, rows, masks, padding, max_length):
        if padding not in (True, "longest", "max_length"):
            raise ValueError(f"padding must be True, 'longest' or 'max_length', got {padding!r}")
        if self.pad_token_id is None:
            raise ValueError("this tokenizer has no pad token (tokenizer_config.json pad_token): set "
                             "tokenizer.special_tokens_map['pad_token'] (e.g. to the eos token) before padding")
        if padding == "max_length":
            if max_length is None:
                raise ValueError("padding='max_length' needs max_length")
            width = max_length
        else:
            width = max(len(r) for r in rows)
        padded_rows, padded_masks = [], []
        for row, mask in zip(rows, masks):
            fill = width - len(row)
            if self.padding_side == "left":
                padded_rows.append([self.pad_token_id] * fill + row)
                padded_masks.append([0] * fill + mask)
            else:
                padded_rows.append(row + [self.pad_token_id] * fill)
                padded_masks.append(mask + [0] * fill)
        return padded_rows, padded_masks

    def decode(self, ids, skip_special_tokens: bool = False, clean_up_tokenization_spaces: bool | None = None) -> str:
        """Text of one sequence of ids (a list or a 1-D tensor)."""
        if hasattr(ids, "tolist"):
            ids = ids.tolist()
        if isinstance(ids, int):
            ids = [ids]
        text = self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)
        clean = self.clean_up_tokenization_spaces if clean_up_tokenization_spaces is None else clean_up_tokenization_spaces
        return _clean_up_spaces(text) if clean else text

    def batch_decode(self, sequences, **kwargs) -> list[str]:
        if hasattr(sequences, "tolist"):
            sequences = sequences.tolist()
        return [self.decode(ids, **kwargs) for ids in sequences]

    # ---- chat ------------------------------------------------------------------------------------------------
    def apply_chat_template(self, conversation, tools: list | None = None, documents: list | None = None,
                            chat_template: str | None = None, add_generation_prompt: bool = False,
                            continue_final_message: bool = False, tokenize: bool = True,
                            return_dict: bool = True, return_tensors: str | None = None, padding: bool | str = False,
                            truncation: bool = False, max_length: int | None = None, **kwargs):
        """The conversation(s) rendered with the checkpoint's chat template, as transformers v5 renders them (today's
        date for ``strftime_now``; extra keyword arguments reach the template, e.g. ``enable_thinking``): the text
        (``tokenize=False``), else its ids without added special tokens — a dict by default, a list with
        ``return_dict=False``."""
        template = chat_template or self.chat_template
        if template is None:
            raise ValueError(f"this tokenizer has no chat template ({NO_TEMPLATE}); pass chat_template=")
        if not conversation:
            raise ValueError("cannot apply a chat template to an empty conversation")
        batched = isinstance(conversation[0], (list, tuple))
        conversations = conversation if batched else [conversation]
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt do not go together: the first "
                             "continues the last message, the second opens a new assistant turn")
        source = self.special.chat_template_file if template == self.chat_template else "chat_template="
        render = jinja_renderer(template, self.special_tokens_map, source=source)
        texts = []
        for messages in conversations:
            text = render(messages, add_generation_prompt, tools=tools, documents=documents, **kwargs)
            if continue_final_message:
                text = _cut_after_final_message(text, messages[-1])
            texts.append(text)
        if not tokenize:
            return texts if batched else texts[0]
        out = self(texts if batched else texts[0], add_special_tokens=False, padding=padding, truncation=truncation,
                   max_length=max_length, return_tensors=return_tensors)
        return out if return_dict else out["input_ids"]


def _cut_after_final_message(text: str, message: dict) -> str:
    """The rendered text up to the end of the last message's content, so the model continues that message."""
    content = message.get("content")
    if not isinstance(content, str) or not content.strip():
        raise ValueError("continue_final_message needs a last message with text content")
    end = text.rfind(content.strip())
    if end < 0:
        raise ValueError("continue_final_message: the last message's content does not appear in the rendered text")
    return text[: end + len(content.strip())]


def load_tokenizer(path: str | os.PathLike) -> Tokenizer:
    """The tokenizer of a checkpoint directory (tokenizer.json + tokenizer_config.json + chat template files)."""
    return Tokenizer(load_fast_tokenizer(path), path)

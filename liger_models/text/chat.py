"""Chat conversations rendered into text, as training renders them and decoding prompts with them.

``template="model"`` renders the model's own chat template (found where transformers finds it:
:func:`~liger_models.tokenizer.read_chat_template`) with jinja2 (the sandboxed environment HF uses: loop controls,
``{% generation %}`` blocks, ``tools`` and ``documents`` None, a ``tojson`` that keeps non-ASCII text,
``raise_exception``; ``strftime_now`` renders the fixed CHAT_TEMPLATE_DATE, so the tokens never depend on the day
they are built). Assistant spans are found by rendering growing prefixes of the conversation: the text between
``render(messages[:i], add_generation_prompt=True)`` and ``render(messages[:i+1])`` is turn i, so the loss covers
the assistant's content plus the template's end-of-turn marker and nothing the user wrote. A template that rewrites
earlier turns (not prefix-stable) is rejected with a clear error.

``template="simple"`` needs no jinja and is fully documented here::

    <|system|>\\n{content}\\n<|user|>\\n{content}\\n<|assistant|>\\n{content}{eos}\\n

(role tags are plain text; ``{eos}`` is the tokenizer's end-of-sequence token when it has one). The loss covers
each assistant ``{content}{eos}``. ``template="auto"`` picks "model" when jinja2 and a template exist.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from liger_models.tokenizer import CHAT_TEMPLATE_DATE, NO_TEMPLATE, SpecialTokens, jinja_renderer

SIMPLE_ROLES = ("system", "user", "assistant")


def training_renderer(template: str, special: SpecialTokens):
    """The model's template as training renders it: on the fixed CHAT_TEMPLATE_DATE, so a resumed or repeated run
    tokenizes its data exactly as the first did."""
    return jinja_renderer(template, {"bos_token": special.bos_text, "eos_token": special.eos_text},
                          date=CHAT_TEMPLATE_DATE, source=special.chat_template_file)


@dataclass
class Document:
    """Text to train on; ``spans`` are the [start, end) character ranges with loss (None = all of it).

    ``template_bos``: the text already carries the BOS (a model chat template writes it), so encoding adds none.
    ``first`` / ``last``: False for a piece of a plain text that continues an earlier piece / is continued by a later
    one (pieces.py): a document starts at its first piece and gets its EOS after its last.
    """

    text: str
    spans: list[tuple[int, int]] | None = None
    template_bos: bool = False
    first: bool = True
    last: bool = True

    @property
    def whole(self) -> bool:
        return self.first and self.last


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
    render = renderer or training_renderer(special.chat_template, special)
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


def render_chat(messages: Sequence[dict], special: SpecialTokens, renderer, where: str) -> Document:
    """One conversation with the model's template (``renderer``) or the simple one (None); a conversation the
    template refuses is reported with its file and line."""
    try:
        if renderer is not None:
            return render_model_template(messages, special, renderer)
        return render_simple(messages, special)
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None


def uses_model_template(chat_template: str, special: SpecialTokens) -> bool:
    """Whether ``chat_template`` (auto | model | simple) renders with the model's jinja template."""
    if chat_template not in ("auto", "model", "simple"):
        raise ValueError(f"chat_template must be auto|model|simple, got {chat_template!r}")
    use_model = chat_template == "model" or (chat_template == "auto" and special.chat_template is not None)
    if use_model and special.chat_template is None:
        raise ValueError(f"--chat-template model: the model has no chat_template ({NO_TEMPLATE})")
    return use_model


def chat_template_note(special: SpecialTokens, chat_template: str = "auto") -> str:
    """The line a command logs once at its start: which template chat conversations render with, the model's own
    (and the file it came from) or the built-in simple one (and why). Refuses what uses_model_template refuses."""
    if uses_model_template(chat_template, special):
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
    if uses_model_template(chat_template, special):
        text = training_renderer(special.chat_template, special)(messages, True)
        return Document(text, None, template_bos=bool(special.bos_text) and text.startswith(special.bos_text))
    opened = render_simple(list(messages) + [{"role": "assistant", "content": ""}], special).text
    return Document(opened[: opened.rindex("<|assistant|>\n") + len("<|assistant|>\n")], None)

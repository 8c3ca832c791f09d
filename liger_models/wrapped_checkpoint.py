"""The text decoder inside a multimodal checkpoint, loaded as a causal LM and saved back whole.

Gemma 3's 4B, 12B and 27B repos (config.json ``model_type: gemma3``, Gemma3ForConditionalGeneration) hold a Gemma 3
text decoder (``text_config``) beside a SigLIP vision tower and a projector; Mistral Small 3.1 / 3.2's (``mistral3``,
Mistral3ForConditionalGeneration) a Mistral decoder beside a Pixtral tower. Loading one gives the family's own text
model (``gemma3_text``, ``mistral``); every tensor that is not the decoder's is kept, unchanged, in host memory, and
``save_pretrained`` / a merged LoRA export write the whole multimodal checkpoint back: the decoder under the names
it was read from, the other tensors as read, config.json as read with its ``text_config`` (and dtype) updated. So
transformers, vLLM and TGI load the result as the model the user started from, with the trained decoder. Training
here is text-only: images take no part, so the vision tower and projector are never changed.

Two layouts of the decoder's names, both read by transformers v5:
- what transformers' own ``save_pretrained`` writes and the Hub's repos hold: ``language_model.model.<name>`` and,
  untied, ``language_model.lm_head.<name>``;
- v5's module names: ``model.language_model.<name>`` and ``lm_head.<name>``.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch

# (the decoder's prefix, the head module) per layout; the decoder's own names are "model.<name>" and "lm_head[.<name>]".
LAYOUTS = {
    "saved": ("language_model.model.", "language_model.lm_head"),
    "modules": ("model.language_model.", "lm_head"),
}
# What the decoder's modules are called inside transformers' multimodal model (PEFT names adapter tensors after the
# live modules, so adapters for that model use these names), and a PEFT exclude_modules pattern that keeps adapters
# off the vision tower and projector, whose linears share the decoder's leaf names (q_proj, k_proj, v_proj).
MODULE_PREFIX = "model.language_model."
OTHER_PARTS = ("vision_tower", "multi_modal_projector")
NOT_DECODER = rf".*({'|'.join(OTHER_PARTS)}).*"
# config.json keys a text_config may leave to the top level (transformers reads them there for the whole model).
_INHERITED = ("dtype", "torch_dtype", "bos_token_id", "eos_token_id", "pad_token_id")
# Whether the head is tied is the top level's say in transformers 5, whatever text_config holds, and both multimodal
# configs here (Gemma3Config, Mistral3Config) default it to true. A checkpoint that stores a different head is
# loaded untied all the same (hub.py), as transformers does.
_TIE, _TIED_BY_DEFAULT = "tie_word_embeddings", True


@dataclass
class WrappedCheckpoint:
    """Where a text decoder sits in a multimodal checkpoint, and what else the checkpoint holds."""

    config: dict  # config.json as read (text_config included)
    layout: str  # a key of LAYOUTS
    carried: dict[str, torch.Tensor] = field(default_factory=dict, repr=False)  # every other tensor, as stored

    @classmethod
    def of(cls, raw: dict, stored_names, path) -> "WrappedCheckpoint":
        """The wrapper of checkpoint ``path`` (config.json ``raw``, tensor names ``stored_names``), or a clear error
        when it has no text_config or its decoder is in neither layout (or in both)."""
        if not isinstance(raw.get("text_config"), dict):
            raise ValueError(f"{str(path)!r}: config.json (model_type {raw.get('model_type')!r}) has no text_config "
                             "object, so the text decoder's shape is unknown")
        found = [name for name, (prefix, _) in LAYOUTS.items()
                 if any(s.startswith(prefix) for s in stored_names)]
        if len(found) != 1:
            where = " and ".join(LAYOUTS[n][0] + "*" for n in found) or "no tensor named " + " or ".join(
                p + "*" for p, _ in LAYOUTS.values())
            raise ValueError(f"{str(path)!r}: cannot tell where the text decoder's weights are ({where})")
        return cls(copy.deepcopy(raw), found[0])

    def text_config(self) -> dict:
        """text_config, with the keys it leaves to the top level (dtype, token ids) filled from there and the
        top level's tie_word_embeddings, as transformers applies them to the decoder."""
        text = dict(self.config["text_config"])
        for key in _INHERITED:
            if key not in text and key in self.config:
                text[key] = self.config[key]
        text[_TIE] = self.config.get(_TIE, _TIED_BY_DEFAULT)
        return text

    def internal_name(self, stored: str) -> str | None:
        """The decoder's name ("model.…", "lm_head.weight") of a stored tensor; None for the others (carried)."""
        return _from_layout(stored, self.layout)

    def split(self, stored: dict) -> tuple[dict, dict]:
        """(the decoder's entries under its own names, every other entry under its stored name) of a mapping from
        stored tensor names (to tensors, headers, ...)."""
        decoder, others = {}, {}
        for key, value in stored.items():
            name = self.internal_name(key)
            if name is None:
                others[key] = value
            else:
                decoder[name] = value
        return decoder, others

    def stored_name(self, name: str) -> str:
        prefix, head = LAYOUTS[self.layout]
        if name.startswith("lm_head."):
            return head + name[len("lm_head"):]
        if not name.startswith("model."):
            raise ValueError(f"{name!r} is not a decoder tensor name (model.* or lm_head.*)")
        return prefix + name[len("model."):]

    def stored_state(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The whole checkpoint's tensors: the decoder's ``state`` under the stored names, then the carried ones."""
        out = {self.stored_name(k): v for k, v in state.items()}
        clash = sorted(set(out) & set(self.carried))
        if clash:  # cannot happen for a wrapper built by `of`; a hand-made one is refused rather than overwritten
            raise ValueError(f"decoder tensors would overwrite carried ones: {clash[:5]}")
        return out | self.carried

    def config_json(self, text: dict, dtype: str, quantization: dict | None = None) -> dict:
        """config.json to write: the one read, with text_config = ``text`` (the decoder's ``to_hf()``, without the
        keys the original text_config left to the top level), the dtype keys set to ``dtype``, and
        ``quantization_config`` = ``quantization`` (None: none, for dense weights)."""
        out = copy.deepcopy(self.config)
        out.pop("quantization_config", None)
        if quantization is not None:
            out["quantization_config"] = quantization
        original = self.config["text_config"]
        text = {k: v for k, v in text.items() if k in original or k not in _INHERITED + (_TIE, "architectures")}
        if _TIE in original:  # the top level's decides (text_config): text_config's own stays as it was
            text[_TIE] = original[_TIE]
        out["text_config"] = text
        for d in (out, text):
            for key in ("dtype", "torch_dtype"):
                if key in d:
                    d[key] = dtype
        if "dtype" not in out and "torch_dtype" not in out:
            out["dtype"] = dtype
        return out


def module_name(name: str) -> str:
    """The multimodal model's module (or parameter) name of a decoder one: model.X → model.language_model.X."""
    return MODULE_PREFIX + name[len("model."):] if name.startswith("model.") else name


def decoder_name(name: str) -> str:
    """The decoder's own name of a multimodal model's module or tensor name in either layout (the names of a plain
    decoder pass through); a name in the vision tower or projector is refused: training here is text-only."""
    if set(name.split(".")) & set(OTHER_PARTS):
        raise ValueError(f"{name!r} is in the vision tower or projector of a multimodal model: only its text "
                         "decoder is loaded and trained here")
    return next((found for layout in LAYOUTS if (found := _from_layout(name, layout)) is not None), name)


def _from_layout(name: str, layout: str) -> str | None:
    """The decoder's own name of a module or tensor ``name`` in ``layout``; None for a name outside the decoder."""
    prefix, head = LAYOUTS[layout]
    if name.startswith(prefix):
        return "model." + name[len(prefix):]
    if name == head or name.startswith(head + "."):
        return "lm_head" + name[len(head):]
    return None

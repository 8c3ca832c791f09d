"""Medusa heads configuration and its `config.json` form (the fields Medusa, TGI and our loader read).

On disk (docs/medusa.md#checkpoint-formats, format B) the heads' `config.json` holds `base_model_name_or_path`,
`medusa_num_heads`, `medusa_num_layers` and `"version": "2"` exactly when the heads share the base `lm_head`; TGI
keys on `medusa_num_heads` and `base_model_name_or_path`, Medusa's own `MedusaConfig` accepts the rest as extra fields.
We also write `hidden_size` / `vocab_size` (mlc-llm's Medusa config requires them) and the loss settings under the
axolotl fork's names (`medusa_heads_coefficient`, `medusa_decay_coefficient`, `medusa_scheduler`).
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, fields
from typing import Any

SCHEDULERS = ("constant", "linear", "sine")


@dataclass
class MedusaConfig:
    """Shape and loss settings of K Medusa heads on top of a base causal LM.

    num_heads: K heads; head k (1-based) predicts the token k + 1 positions ahead of the base head's input.
    num_layers: ResBlocks per head (1 in every released checkpoint; TGI's shared-head path requires 1).
    share_lm_head: the heads project with the base model's (frozen) `lm_head` instead of their own copies.
    hidden_size / vocab_size: the base model's; `MedusaConfig.for_base` fills them in.
    heads_coefficient (λ0), decay_coefficient, scheduler: head k's loss weight is λ0 · decay^k · sched(step).
    base_loss_weight: w0 of the base CE term in stage 2; None means 1. Stage 1 always drops the term (w0 = 0): its
    base is frozen and runs without autograd, so the term would only cost a V×H pass.
    """

    num_heads: int = 5
    num_layers: int = 1
    share_lm_head: bool = False
    base_model_name_or_path: str = ""
    hidden_size: int = 0
    vocab_size: int = 0
    heads_coefficient: float = 0.2
    decay_coefficient: float = 0.8
    scheduler: str = "constant"
    base_loss_weight: float | None = None

    def __post_init__(self) -> None:
        if self.num_heads < 1:
            raise ValueError(f"num_heads must be >= 1, got {self.num_heads}")
        if self.num_layers < 0:
            raise ValueError(f"num_layers must be >= 0, got {self.num_layers}")
        if self.num_layers == 0 and self.share_lm_head:
            raise ValueError("share_lm_head with num_layers=0 leaves the heads nothing to train")
        check_scheduler(self.scheduler)
        # A NaN or infinite weight (e.g. from a hand-edited config.json) would make every loss NaN with no error; a
        # negative one would train a head to miss. The CLI refuses both; so does a config built any other way.
        for name in ("heads_coefficient", "decay_coefficient", "base_loss_weight"):
            value = getattr(self, name)
            if value is None and name == "base_loss_weight":
                continue
            if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0 <= value < math.inf:
                raise ValueError(f"MedusaConfig.{name} must be a finite number >= 0, got {value!r}")

    @classmethod
    def for_base(cls, base: Any, **overrides: Any) -> "MedusaConfig":
        """A config with the base model's hidden_size / vocab_size; other fields from `overrides`."""
        return cls(**{"hidden_size": base.config.hidden_size, "vocab_size": base.config.vocab_size, **overrides})

    def to_json_dict(self) -> dict[str, Any]:
        """The heads' `config.json` (format B: what Medusa's loader and TGI read)."""
        out: dict[str, Any] = {
            "base_model_name_or_path": self.base_model_name_or_path,
            "medusa_num_heads": self.num_heads,
            "medusa_num_layers": self.num_layers,
            "hidden_size": self.hidden_size,
            "vocab_size": self.vocab_size,
            "medusa_heads_coefficient": self.heads_coefficient,
            "medusa_decay_coefficient": self.decay_coefficient,
            "medusa_scheduler": self.scheduler,
        }
        if self.base_loss_weight is not None:
            out["medusa_base_loss_weight"] = self.base_loss_weight
        if self.share_lm_head:
            # Narsil's Medusa PR #97: "version 2" means the heads have no lm_head of their own.
            out["version"] = "2"
        return out

    @classmethod
    def from_json_dict(cls, d: dict[str, Any], **overrides: Any) -> "MedusaConfig":
        """Read a Medusa/TGI `config.json` (ours or upstream's; unknown fields are ignored)."""
        if "medusa_num_heads" not in d:
            raise ValueError("not a Medusa config: `medusa_num_heads` missing from config.json")
        kwargs: dict[str, Any] = {
            "num_heads": int(d["medusa_num_heads"]),
            "num_layers": int(d.get("medusa_num_layers", 1)),
            "share_lm_head": str(d.get("version", "1")) == "2",
            "base_model_name_or_path": d.get("base_model_name_or_path") or "",
            "hidden_size": int(d.get("hidden_size") or 0),
            "vocab_size": int(d.get("vocab_size") or 0),
        }
        for key, name in (("medusa_heads_coefficient", "heads_coefficient"),
                          ("medusa_decay_coefficient", "decay_coefficient"),
                          ("medusa_scheduler", "scheduler"), ("medusa_base_loss_weight", "base_loss_weight")):
            if d.get(key) is not None:
                kwargs[name] = d[key]
        known = {f.name for f in fields(cls)}
        unknown = set(overrides) - known
        if unknown:
            raise TypeError(f"unknown MedusaConfig fields: {sorted(unknown)}")
        kwargs.update(overrides)
        return cls(**kwargs)


def check_scheduler(name: str) -> None:
    """Raise a ValueError unless `name` is constant, linear, sine or sine_<r> with 0 < r <= 1."""
    if name in SCHEDULERS:
        return
    if name.startswith("sine_"):
        try:
            r = float(name[len("sine_"):])
        except ValueError:
            r = math.nan
        if 0.0 < r <= 1.0:
            return
    raise ValueError(f"unknown Medusa scheduler {name!r}: expected constant, linear, sine or sine_<r> with 0 < r <= 1")

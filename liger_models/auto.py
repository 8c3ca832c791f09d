"""AutoLigerForCausalLM: pick the family from config.json's ``model_type`` (never from a repository name)."""

from __future__ import annotations

from pathlib import Path

import torch

from .gemma import LigerGemmaForCausalLM
from .gemma2 import LigerGemma2ForCausalLM
from .gemma3 import LigerGemma3ForCausalLM
from .hub import config_model_type, read_config, snapshot
from .llama import LigerLlamaForCausalLM
from .mistral import LigerMistralForCausalLM
from .mixtral import LigerMixtralForCausalLM
from .modules.causal_lm import LigerForCausalLM
from .modules.config import LigerConfig
from .phi3 import LigerPhi3ForCausalLM
from .qwen2 import LigerQwen2ForCausalLM
from .qwen3 import LigerQwen3ForCausalLM
from .qwen3_moe import LigerQwen3MoeForCausalLM

MODEL_CLASSES: dict[str, type[LigerForCausalLM]] = {
    cls.config_class.model_type: cls
    for cls in (LigerLlamaForCausalLM, LigerMistralForCausalLM, LigerQwen2ForCausalLM, LigerGemmaForCausalLM,
                LigerPhi3ForCausalLM, LigerQwen3ForCausalLM, LigerGemma2ForCausalLM, LigerGemma3ForCausalLM,
                LigerMixtralForCausalLM, LigerQwen3MoeForCausalLM)
}
# Multimodal checkpoints whose text decoder is one of these families (loaded as it, saved back whole).
WRAPPED: dict[str, type[LigerForCausalLM]] = {
    wrapper: cls for cls in MODEL_CLASSES.values() for wrapper in cls.config_class.wrapped_in}


def model_class(model_type: str | None) -> type[LigerForCausalLM]:
    """The Liger class for a config.json ``model_type`` (a multimodal one: its text decoder's family), or a clear
    error listing the supported ones."""
    if model_type in WRAPPED:
        return WRAPPED[model_type]
    if model_type not in MODEL_CLASSES:
        raise ValueError(f"unsupported model_type {model_type!r}; supported: {', '.join(sorted(MODEL_CLASSES))} "
                         f"(and the text decoders of {', '.join(sorted(WRAPPED))})")
    return MODEL_CLASSES[model_type]


class AutoLigerForCausalLM:
    """Factory only: ``from_pretrained`` / ``from_hub`` / ``from_config`` return the family's model."""

    def __init__(self) -> None:
        raise TypeError("use AutoLigerForCausalLM.from_pretrained(path), .from_hub(repo_id) or .from_config(config)")

    @staticmethod
    def from_pretrained(path: str | Path, dtype: torch.dtype | str | None = None,
                        device: torch.device | str | int | None = None) -> LigerForCausalLM:
        model_type = config_model_type(read_config(path), path)
        return model_class(model_type).from_pretrained(path, dtype=dtype, device=device)

    @staticmethod
    def from_hub(repo_id: str, revision: str | None = None, cache_dir: str | Path | None = None,
                 local_files_only: bool = False, dtype: torch.dtype | str | None = None,
                 device: torch.device | str | int | None = None,
                 token: str | bool | None = None) -> LigerForCausalLM:
        """``from_pretrained`` on the Hub snapshot; ``token`` (else HF_TOKEN / the stored login) for gated repos."""
        path = snapshot(repo_id, revision=revision, cache_dir=cache_dir, local_files_only=local_files_only,
                        token=token)
        return AutoLigerForCausalLM.from_pretrained(path, dtype=dtype, device=device)

    @staticmethod
    def from_config(config: LigerConfig, *, dtype: torch.dtype | None = None,
                    device: torch.device | str | None = None) -> LigerForCausalLM:
        return model_class(config.model_type).from_config(config, dtype=dtype, device=device)

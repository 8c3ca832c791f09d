"""liger-models: natively fused Llama-family modeling files.

``AutoLigerForCausalLM.from_pretrained(path)`` loads any supported HF checkpoint by its config.json ``model_type``;
``Liger<Family>ForCausalLM`` and ``<Family>Config`` are the per-family classes; ``MODEL_CLASSES`` / ``model_class``
are the registry by ``model_type``.
"""

from .auto import MODEL_CLASSES, AutoLigerForCausalLM, model_class
from .gemma import GemmaConfig, LigerGemmaForCausalLM
from .gemma2 import Gemma2Config, LigerGemma2ForCausalLM
from .gemma3 import Gemma3TextConfig, LigerGemma3ForCausalLM
from .tokenizer import Tokenizer, load_tokenizer
from .kernels._dispatch import reference_mode
from .llama import LigerLlamaForCausalLM, LlamaConfig
from .mistral import LigerMistralForCausalLM, MistralConfig
from .mixtral import LigerMixtralForCausalLM, MixtralConfig
from .phi3 import LigerPhi3ForCausalLM, Phi3Config
from .qwen2 import LigerQwen2ForCausalLM, Qwen2Config
from .qwen3 import LigerQwen3ForCausalLM, Qwen3Config
from .qwen3_moe import LigerQwen3MoeForCausalLM, Qwen3MoeConfig

__version__ = "0.1.0"

__all__ = [
    "AutoLigerForCausalLM",
    "Gemma2Config",
    "Gemma3TextConfig",
    "GemmaConfig",
    "LigerGemma2ForCausalLM",
    "LigerGemma3ForCausalLM",
    "LigerGemmaForCausalLM",
    "LigerLlamaForCausalLM",
    "LigerMistralForCausalLM",
    "LigerMixtralForCausalLM",
    "LigerPhi3ForCausalLM",
    "LigerQwen2ForCausalLM",
    "LigerQwen3ForCausalLM",
    "LigerQwen3MoeForCausalLM",
    "LlamaConfig",
    "MODEL_CLASSES",
    "MistralConfig",
    "MixtralConfig",
    "Phi3Config",
    "Qwen2Config",
    "Qwen3Config",
    "Qwen3MoeConfig",
    "Tokenizer",
    "load_tokenizer",
    "model_class",
    "reference_mode",
]

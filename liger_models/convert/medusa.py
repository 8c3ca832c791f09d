"""Medusa heads between the Medusa/TGI layout and vLLM's: the conversion commands' names for
liger_models.medusa.vllm_format, which MedusaModel.from_pretrained reads directly."""

from liger_models.medusa.vllm_format import (VLLM_WEIGHTS_NAME, load_vllm, medusa_to_vllm_state_dict, save_vllm,
                                             vllm_config, vllm_to_medusa_state_dict)

__all__ = ["VLLM_WEIGHTS_NAME", "load_vllm", "medusa_to_vllm_state_dict", "save_vllm", "vllm_config",
           "vllm_to_medusa_state_dict"]

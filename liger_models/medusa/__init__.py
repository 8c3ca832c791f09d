"""Medusa heads (FasterDecoding/Medusa) as a first-class variant: heads, fused multi-head loss, stage 1 / stage 2
training wrapper, Medusa/TGI and vLLM checkpoints, and tree decoding."""

from liger_models.medusa.config import MedusaConfig
from liger_models.medusa.heads import MedusaHeads, ResBlock
from liger_models.medusa.loss import (MedusaOutput, medusa_head_weights, medusa_loss, medusa_target_counts,
                                      schedule_factor)
from liger_models.medusa.model import MedusaModel

__all__ = [
    "MedusaConfig",
    "MedusaHeads",
    "MedusaModel",
    "MedusaOutput",
    "ResBlock",
    "medusa_head_weights",
    "medusa_loss",
    "medusa_target_counts",
    "schedule_factor",
]

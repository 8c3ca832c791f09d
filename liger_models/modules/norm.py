"""The RMSNorm every norm of a family uses, built from the config's casting switch (Llama or Gemma numerics)."""

from __future__ import annotations

from liger_models.kernels.ops.rms_norm import RMSNorm

from .config import LigerConfig


def make_norm(config: LigerConfig, size: int | None = None) -> RMSNorm:
    """RMSNorm over ``size`` features (default hidden_size) with the family's casting and rms_norm_eps: Llama-style
    (normalise in fp32, cast, then × w) or Gemma-style ((1 + w) in fp32, one cast at the end)."""
    gemma = config.norm_casting == "gemma"
    return RMSNorm(config.hidden_size if size is None else size, config.rms_norm_eps, offset=1.0 if gemma else 0.0,
                   casting=config.norm_casting)

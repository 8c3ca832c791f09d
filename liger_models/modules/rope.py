"""Rotary position embedding tables: the six HF RoPE variants, as cos/sin in fp32 for the fused rope kernel.

inv_freq (fp32, length R/2 where R = int(head_dim * partial_rotary_factor), θ = rope_theta):
  default   1 / θ^(2i/R)
  linear    default / factor
  dynamic   default with θ' = θ · (factor·L/max_pos − (factor − 1))^(R/(R−2)), L = max(seq_len, max_pos)
  llama3    wavelen = 2π/inv; keep where wavelen < L0/high, divide by factor where wavelen > L0/low, blend between
  longrope  1 / (ext_i · θ^(2i/R)), ext = long_factor if seq_len > L0 else short_factor; cos and sin are ALWAYS
            multiplied by attention_factor (given, else sqrt(1 + ln(factor)/ln L0) with factor = max_pos/L0 when
            absent, 1 when factor ≤ 1)
  yarn      blend of 1/θ^(2i/R) (extrapolation) and 1/(factor·θ^(2i/R)) (interpolation) over a linear ramp between
            the dims that turn beta_fast (32) and beta_slow (1) times in original_max_position_embeddings; cos and
            sin are multiplied by attention_factor (given, else 0.1·ln(factor) + 1, or the mscale ratio)
seq_len = max(position_ids) + 1 of the current call; it is used on device (torch.where), so there is no host sync.
The tables follow HF v5 ``*RotaryEmbedding.forward``: freqs = pos[..., None] · inv_freq, emb = cat(freqs, freqs).
Unlike HF's dynamic variant this is stateless: the table depends only on the current call's positions, which is the
same thing during left-to-right generation. inv_freq is a plain attribute, never a buffer, so ``model.to(bf16)``
cannot round it (the angles must stay fp32) and a meta-device skeleton still has it.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from .config import LigerConfig


def _powers(theta: float | torch.Tensor, dim: int, device=None) -> torch.Tensor:
    """θ^(2i/R) in fp32, i = 0 … R/2 − 1 (HF's exact op order, so tables match bit for bit)."""
    return theta ** (torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim)


def _llama3_inv_freq(inv_freq: torch.Tensor, rope: dict) -> torch.Tensor:
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old_len = rope["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, smoothed, scaled)


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_attention_factor(rope: dict) -> float:
    """cos/sin multiplier of yarn (1.1386 for Qwen2.5's factor 4)."""
    if rope.get("attention_factor") is not None:
        return float(rope["attention_factor"])
    factor, mscale, mscale_all_dim = rope["factor"], rope.get("mscale"), rope.get("mscale_all_dim")
    if mscale and mscale_all_dim:  # DeepSeek-style configs give both; the ratio is what HF uses then
        return _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
    return _yarn_mscale(factor)


def _yarn_inv_freq(theta: float, dim: int, rope: dict) -> torch.Tensor:
    factor, original = rope["factor"], rope["original_max_position_embeddings"]

    def dim_of(rotations: float) -> float:  # the dim index whose wavelength fits `rotations` turns in `original`
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_of(rope.get("beta_fast") or 32), dim_of(rope.get("beta_slow") or 1)
    if rope.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # a zero-width ramp would divide by zero
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: extrapolate (high frequencies, unchanged); 0: interpolate (divided by factor)
    powers = _powers(theta, dim, "cpu")
    return 1.0 / (factor * powers) * (1 - keep) + 1.0 / powers * keep


def longrope_attention_factor(config: LigerConfig) -> float:
    """cos/sin multiplier of longrope (1.190238 for Phi-3-mini-128k)."""
    rope = config.rope_scaling
    if rope.get("attention_factor") is not None:
        return float(rope["attention_factor"])
    original = rope["original_max_position_embeddings"]
    factor = rope.get("factor") or config.max_position_embeddings / original
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))


class RotaryEmbedding(nn.Module):
    """Builds (cos, sin) of shape (B or 1, T, R) in fp32 for given position_ids; holds no parameters or buffers."""

    def __init__(self, config: LigerConfig, rope: tuple[float, dict | None] | None = None) -> None:
        """rope: (rope_theta, rope_scaling) of this table (``LigerConfig.layer_rope``), default the config's own."""
        super().__init__()
        theta, scaling = rope if rope is not None else (config.rope_theta, config.rope_scaling)
        self.dim = config.rotary_dim
        self.theta = theta
        self.max_positions = config.max_position_embeddings
        self.rope = dict(scaling or {"rope_type": "default"})
        self.rope_type = self.rope["rope_type"]
        self.attention_factor = 1.0
        if self.rope_type == "longrope":
            self.attention_factor = longrope_attention_factor(config)
        elif self.rope_type == "yarn":
            self.attention_factor = yarn_attention_factor(self.rope)
        # Built on the CPU explicitly: a meta-device skeleton (torch.device("meta") context) must still get real tables.
        inv_freq = 1.0 / _powers(self.theta, self.dim, "cpu")
        if self.rope_type == "linear":
            inv_freq = inv_freq / self.rope["factor"]
        elif self.rope_type == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, self.rope)
        elif self.rope_type == "yarn":
            inv_freq = _yarn_inv_freq(self.theta, self.dim, self.rope)
        elif self.rope_type == "longrope":
            base = _powers(self.theta, self.dim, "cpu")
            self._long = 1.0 / (torch.tensor(self.rope["long_factor"], dtype=torch.float32, device="cpu") * base)
            inv_freq = 1.0 / (torch.tensor(self.rope["short_factor"], dtype=torch.float32, device="cpu") * base)
        self._inv_freq = inv_freq
        self._on_device: dict = {}

    def _table(self, name: str, device: torch.device) -> torch.Tensor:
        key = (name, device)
        if key in self._on_device:
            return self._on_device[key]
        table = getattr(self, name).to(device)
        # A compiled forward must not fill the cache: dynamo guards on the key being absent, so the next call would
        # find it present and compile the whole model again. Traced, the copy is one small op of the graph.
        if not torch.compiler.is_compiling():
            self._on_device[key] = table
        return table

    def regime(self, seq_len: int) -> object:
        """A key that changes when the table for already-cached positions would change (longrope's switch)."""
        if self.rope_type == "longrope":
            return seq_len > self.rope["original_max_position_embeddings"]
        return None

    def table_key(self, seq_len: int) -> object:
        """What the cos/sin table of a call whose positions end at seq_len − 1 depends on: calls with equal keys
        rotate every position alike (longrope: which factors; dynamic NTK: the length past max_positions)."""
        if self.rope_type == "dynamic":
            return max(seq_len, self.max_positions)
        return self.regime(seq_len)

    def inv_freq(self, position_ids: torch.Tensor) -> torch.Tensor:
        """inv_freq for this call (R/2,) fp32, on position_ids' device."""
        device = position_ids.device
        inv_freq = self._table("_inv_freq", device)
        if self.rope_type == "longrope":
            seq_len = position_ids.max() + 1
            original = self.rope["original_max_position_embeddings"]
            inv_freq = torch.where(seq_len > original, self._table("_long", device), inv_freq)
        elif self.rope_type == "dynamic":
            factor = self.rope["factor"]
            seq_len = torch.clamp(position_ids.max() + 1, min=self.max_positions).float()
            theta = self.theta * ((factor * seq_len / self.max_positions) - (factor - 1)) ** (self.dim / (self.dim - 2))
            inv_freq = 1.0 / _powers(theta, self.dim, device)
        return inv_freq

    def forward(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = position_ids[..., None].float() * self.inv_freq(position_ids)  # (B, T, R/2)
        emb = torch.cat((freqs, freqs), dim=-1)  # (B, T, R)
        cos, sin = emb.cos(), emb.sin()
        if self.attention_factor != 1.0:
            cos, sin = cos * self.attention_factor, sin * self.attention_factor
        return cos, sin

"""Split-key decoding attention (liger_models/kernels/ops/decode_attention.py) against the float64 reference, under arbitrary masks.

q comes as the attention layer hands it over (a transposed view of the (B, T, H, D) projection output), k and v as
one layer's views of a static cache's (L, 2, B, Hkv, S, D) buffer; masks mix a visible prefix, a tree among the
new tokens and hidden tail slots (whole key tiles that the kernel must skip), per batch row or shared.
"""

import pytest
import torch
import torch.nn.functional as F

from liger_models.kernels.ops.decode_attention import decode_attention, decode_attention_reference
from tests.helpers import DEVICE, assert_matches


def _inputs(B, Hq, Hkv, T, S, D, dtype, device=DEVICE):
    q = torch.randn(B, T, Hq, D, device=device).to(dtype).transpose(1, 2)  # (B, Hq, T, D), strided
    cache = torch.randn(3, 2, B, Hkv, S, D, device=device).to(dtype)
    return q, cache[1, 0], cache[1, 1]


def _mask(B, T, S, past, mask_batch, device=DEVICE):
    """(mask_batch, 1, T, S): keys before `past` visible (some hidden at random, as padding), new tokens seeing
    a random subset of the earlier new ones and always themselves, slots from past + T on hidden."""
    mask = torch.zeros(mask_batch, 1, T, S, dtype=torch.bool, device=device)
    mask[..., :past] = torch.rand(mask_batch, 1, 1, past, device=device) > 0.2
    tree = torch.rand(mask_batch, 1, T, T, device=device) > 0.5
    tree = torch.tril(tree) | torch.eye(T, dtype=torch.bool, device=device)
    mask[..., past: past + T] = tree
    return mask


def _eager(q, k, v, mask, scale):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1])


def _check(B, Hq, Hkv, T, S, D, past, mask_batch, dtype, device=DEVICE):
    q, k, v = _inputs(B, Hq, Hkv, T, S, D, dtype, device)
    mask = _mask(B, T, S, past, mask_batch, device)
    scale = D ** -0.5
    out = decode_attention(q, k, v, mask, scale)
    ref = decode_attention_reference(q.double(), k.double(), v.double(), mask, scale)
    assert out.dtype == dtype and out.shape == (B, Hq, T, D)
    if dtype == torch.float64:
        assert (out - ref).abs().max().item() <= 1e-12
    else:
        assert_matches(out, ref, eager=_eager(q, k, v, mask, scale))


# (B, Hq, Hkv, T, S, D, past, mask_batch): a Medusa-like tree over a longer cache (GQA 4), one token, MHA with an odd
# head_dim, MQA with a 256-wide head, per-row masks, a cache shorter than one tile, and a tail of hidden tiles.
SHAPES = [(1, 8, 2, 9, 150, 32, 120, 1), (1, 4, 1, 1, 70, 16, 69, 1), (2, 3, 3, 5, 40, 24, 30, 2),
          (1, 4, 1, 7, 300, 256, 20, 1), (3, 4, 2, 3, 11, 16, 6, 3), (1, 2, 2, 4, 520, 64, 4, 1)]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_matches_reference(shape, dtype):
    _check(*shape, dtype)


def test_every_row_sees_only_its_keys():
    # A key the mask hides must not move the output even when its score is huge.
    q, k, v = _inputs(1, 4, 2, 3, 90, 16, torch.float32)
    mask = _mask(1, 3, 90, 70, 1)
    scale = 0.25
    hidden = ~mask[0, 0].any(0)  # keys no row sees
    k2, v2 = k.clone(), v.clone()
    k2[:, :, hidden], v2[:, :, hidden] = 1e4, float("nan")
    assert torch.equal(decode_attention(q, k, v, mask, scale), decode_attention(q, k2, v2, mask, scale))


def test_a_row_that_sees_no_key_is_zero():
    # SDPA gives such a row 0; the split kernel's merge must not turn it into NaN (0 / 0).
    q, k, v = _inputs(2, 4, 2, 3, 140, 8, torch.bfloat16)  # head_dim 8: below a 16-bit dot's minimum K
    mask = _mask(2, 3, 140, 100, 2)
    mask[1, 0, 2] = False
    out = decode_attention(q, k, v, mask, 0.3)
    ref = decode_attention_reference(q.double(), k.double(), v.double(), mask, 0.3)
    assert torch.equal(out[1, :, 2], torch.zeros_like(out[1, :, 2])) and not ref[1, :, 2].any()
    assert_matches(out, ref, eager=_eager(q, k, v, mask, 0.3))


def test_bad_shapes_raise():
    q, k, v = _inputs(1, 4, 3, 2, 10, 8, torch.float32)
    with pytest.raises(ValueError, match="does not fit"):
        decode_attention(q, k, v, torch.ones(1, 1, 2, 10, dtype=torch.bool), 1.0)
    q, k, v = _inputs(1, 4, 2, 2, 10, 8, torch.float32)
    with pytest.raises(ValueError, match="mask must be bool"):
        decode_attention(q, k, v, torch.ones(1, 1, 2, 9, dtype=torch.bool), 1.0)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(1, 32, 8, 45, 2173, 128, 2048, 1), (1, 32, 8, 64, 8300, 128, 8192, 1),
                                   (1, 8, 1, 45, 300, 256, 200, 1), (2, 32, 8, 45, 1100, 64, 1000, 2)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_reference_on_gpu(shape, dtype):
    # Llama-3-8B's and -1B's tree shapes, an 8K cache, Gemma's MQA with 256-wide heads.
    _check(*shape, dtype, device="cuda")

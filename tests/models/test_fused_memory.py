"""modules/fused.py: norm → projection and gated activation → down projection save less and compute the same.

Values and every gradient against a float64 PyTorch reference (runs the Triton kernels in the interpreter on CPU),
and the bytes one decoder layer saves for backward against the minimum the fusions promise.
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from liger_models.kernels.ops.gated_mlp import gated_mlp_reference
from liger_models.kernels.ops.rms_norm import RMSNorm, rms_norm_reference
from liger_models.llama.config import LlamaConfig
from liger_models.modules.attention import AttentionMask
from liger_models.modules.decoder import DecoderLayer
from liger_models.modules.fused import gated_down, norm_linear
from liger_models.modules.rope import RotaryEmbedding
from tests.helpers import INTERPRETER_ONLY, SavedBytes, assert_matches


def _grads64(fn, tensors):
    """fn's output and the gradients of sum(out · fixed random weights) w.r.t. ``tensors``, in float64."""
    leaves = [t.detach().double().requires_grad_() for t in tensors]
    out = fn(*leaves)
    outs = out if isinstance(out, tuple) else (out,)
    cotangents = [torch.randn_like(o) for o in outs]
    grads = torch.autograd.grad(outs, leaves, cotangents)
    return outs, cotangents, grads


@pytest.mark.parametrize("residual,bias,casting", [(True, False, "llama"), (False, True, "llama"),
                                                   (True, True, "gemma")])
def test_norm_linear_matches_reference(residual, bias, casting):
    hidden, rows, (B, T) = 48, (40, 24, 24), (2, 7)
    norm = RMSNorm(hidden, 1e-5, offset=1.0 if casting == "gemma" else 0.0, casting=casting)
    with torch.no_grad():
        norm.weight.normal_()
    linears = [nn.Linear(hidden, r, bias=bias) for r in rows]
    x = torch.randn(B, T, hidden)
    res = torch.randn(B, T, hidden) if residual else None
    params = [norm.weight] + [lin.weight for lin in linears] + ([lin.bias for lin in linears] if bias else [])
    inputs = [x] + ([res] if residual else []) + params

    def reference(*args):
        x64, rest = args[0], list(args[1:])
        r = x64 + rest.pop(0) if residual else x64
        w_norm, ws = rest[0], rest[1 : 1 + len(rows)]
        bs = rest[1 + len(rows):] if bias else [None] * len(rows)
        y = rms_norm_reference(r, w_norm, 1e-5, norm.offset, casting)
        out = torch.cat([F.linear(y, w, b) for w, b in zip(ws, bs)], -1)
        return (out, r) if residual else out

    refs, cotangents, ref_grads = _grads64(reference, inputs)
    leaves = [t.detach().clone().requires_grad_() for t in (x, res) if t is not None]
    out, stream = norm_linear(norm, leaves[0], leaves[1] if residual else None, linears)
    assert stream is leaves[0] or residual
    outs = (out, stream) if residual else (out,)
    for o, ref in zip(outs, refs):
        assert_matches(o, ref)
    torch.autograd.backward(outs, [c.float() for c in cotangents])
    for t, g in zip(leaves + params, ref_grads):
        assert_matches(t.grad, g, name="grad")


@pytest.mark.parametrize("activation,bias", [("silu", False), ("gelu_tanh", True), ("gelu", False)])
def test_gated_down_matches_reference(activation, bias):
    inter, hidden = 40, 24
    down = nn.Linear(inter, hidden, bias=bias)
    x = torch.randn(3, 5, 2 * inter)
    w_in = torch.randn(2 * inter, 2 * inter) / 8  # gate_up as an autograd intermediate, as in the model

    params = [down.weight] + ([down.bias] if bias else [])

    def reference(x64, w64, *p):
        gu = x64 @ w64
        return F.linear(gated_mlp_reference(gu[..., :inter], gu[..., inter:], activation), *p)

    (ref,), (cot,), ref_grads = _grads64(reference, [x, w_in] + params)
    xs, ws = x.clone().requires_grad_(), w_in.clone().requires_grad_()
    out = gated_down(xs @ ws, activation, down)
    assert out._base is None  # a decoder layer's output: FSDP2 warns on a view (an in-place op would drop its hook)
    assert_matches(out, ref)
    out.backward(cot.float())
    for t, g in zip([xs, ws] + params, ref_grads):
        assert_matches(t.grad, g, name="grad")


@INTERPRETER_ONLY
def test_decoder_layer_saves_only_the_minimum():
    """Per token: the two residual streams, q|k|v, the attention output, gate|up; plus per-row scalars."""
    cfg = LlamaConfig.tiny(hidden_size=64, intermediate_size=160, num_attention_heads=4, num_key_value_heads=2)
    layer, rotary = DecoderLayer(cfg, 0), RotaryEmbedding(cfg)
    B, T, H, I, D = 2, 16, cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    x, res = torch.randn(B, T, H, requires_grad=True), torch.randn(B, T, H, requires_grad=True)
    cos, sin = rotary(torch.arange(T)[None])
    with SavedBytes(exclude=layer.parameters()) as saved:
        out, stream = layer(x, res, cos, sin, AttentionMask(T, 0, None, x.device))
    per_row = 4 * (2 + cfg.num_attention_heads)  # two rstd + the attention logsumexp per head, fp32
    bound = B * T * (4 * (2 * H + (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * D
                          + cfg.num_attention_heads * D + 2 * I) + per_row) + cos.nbytes + sin.nbytes
    assert saved.total <= bound, f"saved {saved.total} bytes, minimum {bound}"
    (out + stream).sum().backward()  # the saved set is enough for a correct backward (values: tests above)
    assert x.grad is not None and res.grad is not None

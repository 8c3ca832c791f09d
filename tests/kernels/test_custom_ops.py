"""The kernels' torch.library custom ops (liger_models/kernels/_custom_ops.py): each passes torch.library.opcheck
(schema, fake tensors, autograd registration, AOT dispatch), and each public function compiled with
``fullgraph=True`` (no graph break) gives the eager results and gradients bit for bit, on Triton's interpreter.

Compiled here with the "aot_eager" backend: dynamo and AOTAutograd trace the ops (forward and backward graphs), and
the graphs run without code generation. Eager calls still go through the autograd.Functions (the op's dispatch
costs host time; docs/kernels.md#torchcompile).
"""

from __future__ import annotations

import pytest
import torch

from liger_models.kernels import gated_mlp as gated
from liger_models.kernels import rms_norm as norms
from liger_models.kernels import rope as ropes


def _compiled_equals_eager(fn, *inputs: torch.Tensor) -> None:
    """fn compiled without graph breaks gives eager's outputs and input gradients exactly (for one random
    cotangent per output)."""
    torch._dynamo.reset()
    leaves = [t for t in inputs if t.requires_grad]
    results = []
    for run in (fn, torch.compile(fn, fullgraph=True, backend="aot_eager")):
        outs = run(*inputs)
        outs = outs if isinstance(outs, tuple) else (outs,)
        if not results:
            cotangents = [torch.randn_like(o) for o in outs]
        grads = torch.autograd.grad(outs, leaves, cotangents)
        results.append(([o.detach() for o in outs], grads))
    (outs, grads), (c_outs, c_grads) = results
    for eager, compiled in zip(outs + list(grads), c_outs + list(c_grads)):
        assert torch.equal(compiled, eager)


# ---- RMSNorm ------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("gemma", [False, True])
def test_rms_norm_op_passes_opcheck(residual, gemma):
    x = torch.randn(3, 5, 40, requires_grad=True)
    res = torch.randn(3, 5, 40, requires_grad=True) if residual else None
    w = torch.randn(40, requires_grad=True)
    torch.library.opcheck(norms._rms_norm_op, (x, res, w, 1e-6, 1.0 if gemma else 0.0, gemma))
    rstd = torch.rand(15) + 0.5
    dres = torch.randn(3, 5, 40) if residual else None
    torch.library.opcheck(norms._rms_norm_backward_op, (torch.randn(3, 5, 40), x.detach(), w.detach(), rstd, dres,
                                                        0.0, gemma, True))


@pytest.mark.parametrize("casting", ["llama", "gemma"])
def test_compiled_rms_norms_equal_eager(casting):
    x = torch.randn(2, 7, 48).transpose(0, 1).requires_grad_()  # strided: the op copies to rows as the Function
    res = torch.randn(7, 2, 48, requires_grad=True)
    w = torch.randn(48, requires_grad=True)
    offset = 1.0 if casting == "gemma" else 0.0

    def fn(x, res, w):
        y, r = norms.add_rms_norm(x, res, w, offset=offset, casting=casting)
        return norms.rms_norm(y * r, w, 1e-5, offset=offset, casting=casting), r

    _compiled_equals_eager(fn, x, res, w)


def test_compiled_add_rms_norm_with_only_the_stream_used_equals_eager():
    """The last layer's r may be the only output used: the backward gets no dy (materialize_grads off)."""
    x, res, w = torch.randn(4, 32, requires_grad=True), torch.randn(4, 32, requires_grad=True), torch.randn(32)
    _compiled_equals_eager(lambda x, res, w: norms.add_rms_norm(x, res, w)[1] * 2, x, res, w)


def test_eager_rms_norm_calls_the_function_not_the_op():
    """Eager pays no custom-op dispatch (benchmarks/tools/custom_op_overhead.py)."""
    x, w = torch.randn(4, 32, requires_grad=True), torch.randn(32, requires_grad=True)
    assert type(norms.rms_norm(x, w).grad_fn).__name__ == "_RMSNormFunctionBackward"


def test_op_backward_refuses_double_backward():
    x, w = torch.randn(4, 32, requires_grad=True), torch.randn(32, requires_grad=True)
    y = norms._rms_norm_op(x, None, w, 1e-6, 0.0, False)[0]
    with pytest.raises(RuntimeError, match="double backward"):
        torch.autograd.grad(y.square().sum(), x, create_graph=True)


# ---- gated activations --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("activation", ["silu", "gelu_tanh", "gelu"])
def test_gated_ops_pass_opcheck(activation):
    gate, up = torch.randn(3, 4, 24, requires_grad=True), torch.randn(3, 4, 24, requires_grad=True)
    torch.library.opcheck(gated._gated_mlp_op, (gate, up, activation))
    torch.library.opcheck(gated._gated_mlp_packed_op, (torch.randn(3, 4, 48, requires_grad=True), activation))


@pytest.mark.parametrize("activation", ["silu", "gelu_tanh", "gelu"])
def test_compiled_gated_activations_equal_eager(activation):
    gate_up = torch.randn(2, 5, 64, requires_grad=True)
    gate, up = torch.randn(5, 2, 32).transpose(0, 1).requires_grad_(), torch.randn(2, 5, 32, requires_grad=True)

    def fn(gate_up, gate, up):
        # gate_up * 1: an autograd intermediate, whose memory the eager backward writes its gradient over
        return gated.gated_mlp_packed(gate_up * 1, activation), gated.gated_mlp(gate, up, activation)

    _compiled_equals_eager(fn, gate_up, gate, up)


# ---- RoPE ---------------------------------------------------------------------------------------------------------

def _tables(batch: int, seq: int, rot: int) -> tuple[torch.Tensor, torch.Tensor]:
    pos = torch.arange(seq, dtype=torch.float32)[None].expand(batch, seq) + torch.arange(batch)[:, None]
    freqs = pos[..., None] / 10000 ** (torch.arange(0, rot, 2) / rot)
    emb = torch.cat((freqs, freqs), -1)
    return emb.cos(), emb.sin()


def test_rope_ops_pass_opcheck():
    cos, sin = _tables(1, 5, 12)
    qkv = torch.randn(2, 5, 8 * 16, requires_grad=True)
    torch.library.opcheck(ropes._rope_packed_op, (qkv, cos, sin, 4, 2, 16))
    q, k = torch.randn(2, 5, 4, 16, requires_grad=True), torch.randn(2, 5, 2, 16, requires_grad=True)
    torch.library.opcheck(ropes._rope_op, (q, k, cos, sin))


@pytest.mark.parametrize("rot, batch_tables", [(16, 1), (12, 2)])  # full and partial rotary; shared / per-row
def test_compiled_rope_equals_eager(rot, batch_tables):
    cos, sin = _tables(batch_tables, 6, rot)
    qkv = torch.randn(2, 6, 8 * 16, requires_grad=True)

    def fn(qkv):
        q, k, v = ropes.rope_packed(qkv * 1, cos, sin, 4, 2, 16)
        q2, k2, _ = ropes._split_heads(qkv * 2, 4, 2, 16)
        q2, k2 = ropes.rope(q2, k2, cos, sin)
        return q.transpose(1, 2), k, v, q2, k2 * 3

    _compiled_equals_eager(fn, qkv)


def test_compiled_rope_keeps_rotating_in_place():
    """rope's contract (q and k hold the rotated values afterwards) holds under compile too, through a copy."""
    cos, sin = _tables(1, 4, 16)
    q, k = torch.randn(1, 4, 2, 16), torch.randn(1, 4, 1, 16)
    expected = ropes.rope_reference(q, k, cos, sin)

    def fn(q, k):
        ropes.rope(q, k, cos, sin)
        return q + 0, k + 0

    torch._dynamo.reset()
    for out, want in zip(torch.compile(fn, fullgraph=True, backend="aot_eager")(q, k), expected):
        torch.testing.assert_close(out, want, rtol=1e-6, atol=1e-6)

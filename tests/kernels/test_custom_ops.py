"""The kernels' torch.library custom ops (liger_models/kernels/_custom_ops.py): each passes torch.library.opcheck
(schema, fake tensors, autograd registration, AOT dispatch), and each public function compiled with
``fullgraph=True`` (no graph break) gives the eager results and gradients bit for bit (Triton's interpreter on the
CPU, the compiled kernels on a GPU).

Compiled here with the "aot_eager" backend: dynamo and AOTAutograd trace the ops (forward and backward graphs), and
the graphs run without code generation. Eager calls still go through the autograd.Functions (the op's dispatch
costs host time; docs/ecosystem.md#torchcompile).
"""

from __future__ import annotations

import pytest
import torch

from liger_models.kernels.ops import gated_mlp as gated
from liger_models.kernels.ops import rms_norm as norms
from liger_models.kernels.ops import rope as ropes
from tests.helpers import DEVICE


@pytest.fixture(autouse=True)
def _on_device():
    """Tensors on the GPU where there is one (compiled kernels), else on the CPU (the interpreter)."""
    with torch.device(DEVICE):
        yield


def _compiled_equals_eager(fn, *inputs: torch.Tensor, ulps: bool = False) -> None:
    """fn compiled without graph breaks gives eager's outputs and input gradients exactly (for one random
    cotangent per differentiable output); with ``ulps``, on a GPU, to fp32 rounding: the op runs another
    specialisation of the kernel, which the compiler may contract into FMAs differently."""
    torch._dynamo.reset()
    leaves = [t for t in inputs if t.requires_grad]
    results = []
    for run in (fn, torch.compile(fn, fullgraph=True, backend="aot_eager")):
        outs = run(*inputs)
        outs = outs if isinstance(outs, tuple) else (outs,)
        differentiable = [o for o in outs if o.requires_grad]
        if not results:
            cotangents = [torch.randn_like(o) for o in differentiable]
        grads = torch.autograd.grad(differentiable, leaves, cotangents)
        results.append(([o.detach() for o in outs], grads))
    (outs, grads), (c_outs, c_grads) = results
    for eager, compiled in zip(outs + list(grads), c_outs + list(c_grads)):
        if ulps and compiled.is_cuda:
            torch.testing.assert_close(compiled, eager, rtol=1e-6, atol=1e-6)
        else:
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

    _compiled_equals_eager(fn, qkv, ulps=True)  # the op rotates into fresh tensors (TO_DST), eager in place


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


# ---- norm → projection, gated → down (liger_models/modules/fused.py) ------------------------------------------------

def _projections(bias: bool) -> list[torch.nn.Linear]:
    from liger_models.modules.linear import pack_linears_

    linears = [torch.nn.Linear(32, 16, bias=bias), torch.nn.Linear(32, 8, bias=bias), torch.nn.Linear(32, 8, bias=bias)]
    pack_linears_(linears)  # q|k|v back to back: the op's implementation uses the aliasing view
    return linears


@pytest.mark.parametrize("bias", [False, True])
def test_fused_training_ops_pass_opcheck(bias):
    from liger_models.modules import fused

    linears = _projections(bias)
    weights, biases = [lin.weight for lin in linears], [lin.bias for lin in linears] if bias else []
    x, res, norm_w = (torch.randn(2, 3, 32, requires_grad=True), torch.randn(2, 3, 32, requires_grad=True),
                      torch.randn(32, requires_grad=True))
    torch.library.opcheck(fused._norm_linear_op, (x, res, norm_w, weights, biases, 1e-6, 0.0, False))
    torch.library.opcheck(fused._norm_linear_op, (x, None, norm_w, weights, biases, 1e-6, 1.0, True))
    down = torch.nn.Linear(12, 32, bias=bias)
    torch.library.opcheck(fused._gated_down_op, (torch.randn(2, 3, 24, requires_grad=True), down.weight, down.bias,
                                                 "silu"))


@pytest.mark.parametrize("bias", [False, True])
def test_compiled_fused_training_paths_equal_eager(bias):
    """norm_linear (with and without a residual) and gated_down, as a decoder layer chains them."""
    from liger_models.kernels.ops.rms_norm import RMSNorm
    from liger_models.modules.fused import gated_down, norm_linear

    linears, down, norm = _projections(bias), torch.nn.Linear(12, 32, bias=bias), RMSNorm(32)
    with torch.no_grad():
        norm.weight.add_(0.1 * torch.randn(32))
    x, res = torch.randn(2, 3, 32, requires_grad=True), torch.randn(2, 3, 32, requires_grad=True)
    params = [norm.weight, down.weight, *(p for lin in linears for p in lin.parameters())]

    def fn(x, res, *params):
        qkv, stream = norm_linear(norm, x, res, linears)
        qkv2, _ = norm_linear(norm, stream, None, linears)
        return gated_down(qkv[..., :24] * qkv2[..., 8:], "gelu_tanh", down), stream

    _compiled_equals_eager(fn, x, res, *params)


# ---- losses -------------------------------------------------------------------------------------------------------

_LOSS_OPTIONS = [
    {},
    {"reduction": "sum", "z_loss": 1e-3, "return_z_loss": True},
    {"reduction": "none", "weighted": True},
    {"weighted": True, "return_z_loss": True, "return_token_accuracy": True},
    {"label_smoothing": 0.1, "softcap": 5.0, "return_token_accuracy": True},
    {"normalizer": 7},
    {"normalizer": "tensor"},
    {"use_token_scaling": True, "return_predicted_tokens": True},
    {"reduction": "none", "weighted": True, "use_token_scaling": True, "softcap": 5.0, "z_loss": 1e-3,
     "return_z_loss": True, "return_predicted_tokens": True},
    # class weights with label smoothing: the kernel weighs its rows itself (no row-weights output)
    {"weighted": True, "label_smoothing": 0.1, "z_loss": 1e-3, "return_z_loss": True},
    {"reduction": "none", "weighted": True, "label_smoothing": 0.1, "use_token_scaling": True},
    {"reduction": "none", "weighted": True, "label_smoothing": 0.1},
]


def _loss_kwargs(options: dict, vocab: int) -> dict:
    kwargs = {k: v for k, v in options.items() if k not in ("weighted", "normalizer")}
    if options.get("weighted"):
        kwargs["class_weights"] = torch.rand(vocab) + 0.5
    if "normalizer" in options:
        kwargs["normalizer"] = torch.tensor(7.0) if options["normalizer"] == "tensor" else options["normalizer"]
    return kwargs


def _labels(shape: tuple, vocab: int) -> torch.Tensor:
    labels = torch.randint(0, vocab, shape)
    labels[0, 1] = -100
    return labels


def _loss_tensors(out) -> tuple:
    return tuple(t for t in out if t is not None) if isinstance(out, tuple) else out


def test_loss_ops_pass_opcheck():
    from liger_models.kernels.ops import cross_entropy as ce
    from liger_models.kernels.ops import fused_linear_cross_entropy as flce

    vocab, logits, weights = 40, torch.randn(2, 5, 40, requires_grad=True), torch.rand(40) + 0.5
    labels = _labels((2, 5), vocab)
    for reduction, class_weights, extras in (("mean", None, (False, False)), ("none", weights, (True, True)),
                                             ("sum", weights, (True, False))):
        torch.library.opcheck(ce._cross_entropy_op, (logits, labels, None, class_weights, -100, 0.0, 1e-3, None,
                                                     reduction, True, *extras))
        # token scaling and the predicted tokens, the schema's last two arguments
        torch.library.opcheck(ce._cross_entropy_op, (logits, labels, None, class_weights, -100, 0.0, 1e-3, 5.0,
                                                     reduction, True, *extras, True, True))
        # label smoothing (with class weights, the kernel weighs its rows: no row-weights output)
        torch.library.opcheck(ce._cross_entropy_op, (logits, labels, None, class_weights, -100, 0.1, 1e-3, None,
                                                     reduction, True, *extras))
    hidden, weight, bias = (torch.randn(2, 5, 16, requires_grad=True), torch.randn(vocab, 16, requires_grad=True),
                            torch.randn(vocab, requires_grad=True))
    for reduction, b, class_weights, rank in (("mean", None, None, False), ("none", bias, weights, True),
                                              ("sum", bias, None, True)):
        torch.library.opcheck(flce._fused_linear_cross_entropy_op, (
            hidden, weight, b, labels, torch.tensor(6.0) if reduction == "mean" else None, class_weights, -100, 0.0,
            1e-3, 5.0, reduction, 0.5, torch.float32, True, True, b is not None, rank, None, None, True, True))
    u, lw = torch.randn(2, 5, 3, requires_grad=True), torch.randn(vocab, 3, requires_grad=True)
    for reduction, b, need_u, need_lw in (("mean", bias, True, True), ("none", None, True, False),
                                          ("sum", None, False, True)):
        torch.library.opcheck(flce._fused_linear_cross_entropy_op, (
            hidden, weight, b, labels, None, weights if reduction == "none" else None, -100, 0.1, 1e-3, None,
            reduction, 1.0, torch.float32, True, False, b is not None, True, None, None, True, True, u, lw, need_u,
            need_lw))
        torch.library.opcheck(flce._fused_linear_cross_entropy_op, (
            hidden, weight, b, labels, None, weights if reduction == "sum" else None, -100, 0.0, 1e-3, 5.0,
            reduction, 1.0, torch.float32, True, True, b is not None, False, None, None, False, False, u, lw, need_u,
            need_lw, True, True))


@pytest.mark.parametrize("options", _LOSS_OPTIONS, ids=str)
def test_compiled_cross_entropy_equals_eager(options):
    from liger_models.kernels.ops.cross_entropy import cross_entropy

    vocab = 40
    logits, labels, kwargs = torch.randn(2, 5, vocab, requires_grad=True), _labels((2, 5), vocab), _loss_kwargs(
        options, vocab)
    # logits * 1: an autograd intermediate, which the eager call writes its gradient over
    _compiled_equals_eager(lambda x: _loss_tensors(cross_entropy(x * 1, labels, **kwargs)), logits)


@pytest.mark.parametrize("options", [*_LOSS_OPTIONS, {"bias": True, "reduction": "none", "return_target_rank": True},
                                     {"max_scratch_bytes": 200, "loss_scale": 0.5}], ids=str)
def test_compiled_fused_linear_cross_entropy_equals_eager(options):
    from liger_models.kernels.ops.fused_linear_cross_entropy import fused_linear_cross_entropy

    vocab, labels = 40, _labels((2, 5), 40)
    kwargs = _loss_kwargs({k: v for k, v in options.items() if k != "bias"}, vocab)
    hidden, weight = torch.randn(2, 5, 16, requires_grad=True), torch.randn(vocab, 16, requires_grad=True)
    bias = torch.randn(vocab, requires_grad=True) if options.get("bias") else None

    def fn(hidden, weight, *bias):
        return _loss_tensors(fused_linear_cross_entropy(hidden, weight, labels, *bias, **kwargs))

    _compiled_equals_eager(fn, hidden, weight, *([bias] if bias is not None else []))


@pytest.mark.parametrize("options", [{}, {"bias": True, "reduction": "none", "return_target_rank": True},
                                     {"weighted": True, "return_z_loss": True, "return_token_accuracy": True},
                                     {"max_scratch_bytes": 200, "reduction": "sum", "label_smoothing": 0.1},
                                     {"reduction": "none", "use_token_scaling": True, "return_predicted_tokens": True}],
                         ids=str)
def test_compiled_fused_linear_cross_entropy_with_low_rank_equals_eager(options):
    """The low-rank term (a LoRA adapter on the head: u = s·A·h, computed outside the op as a model does) through
    the custom op: gradients reach h, A and B, with W frozen."""
    from liger_models.kernels.ops.fused_linear_cross_entropy import fused_linear_cross_entropy

    vocab, labels = 40, _labels((2, 5), 40)
    kwargs = _loss_kwargs({k: v for k, v in options.items() if k != "bias"}, vocab)
    hidden, weight = torch.randn(2, 5, 16, requires_grad=True), torch.randn(vocab, 16)
    lora_a, lora_b = torch.randn(3, 16, requires_grad=True), torch.randn(vocab, 3, requires_grad=True)
    bias = torch.randn(vocab) if options.get("bias") else None

    def fn(hidden, lora_a, lora_b):
        u = torch.nn.functional.linear(hidden, lora_a * 0.5)
        return _loss_tensors(fused_linear_cross_entropy(hidden, weight, labels, bias, low_rank=(u, lora_b),
                                                        **kwargs))

    _compiled_equals_eager(fn, hidden, lora_a, lora_b)


@pytest.mark.parametrize("fused", [False, True])
def test_compiled_losses_raise_for_a_bad_label(fused):
    """The label check runs inside the op, at run time: the compiled call raises the eager call's ValueError."""
    from liger_models.kernels.ops.cross_entropy import cross_entropy
    from liger_models.kernels.ops.fused_linear_cross_entropy import fused_linear_cross_entropy

    labels = _labels((2, 5), 40)
    labels[1, 2] = 43
    hidden, weight = torch.randn(2, 5, 16, requires_grad=True), torch.randn(40, 16, requires_grad=True)

    def fn(hidden, weight):
        if fused:
            return fused_linear_cross_entropy(hidden, weight, labels)
        return cross_entropy(hidden @ weight.t(), labels)

    torch._dynamo.reset()
    with pytest.raises(ValueError, match="label 43 is outside the vocabulary"):
        torch.compile(fn, fullgraph=True, backend="aot_eager")(hidden, weight)


def test_compiled_linear_cross_entropy_refuses_a_weight_grad_consumer():
    from liger_models.kernels.ops.fused_linear_cross_entropy import consume_weight_grad, fused_linear_cross_entropy

    hidden, weight = torch.randn(2, 5, 16, requires_grad=True), torch.randn(40, 16, requires_grad=True)
    forget = consume_weight_grad(weight, lambda grad, node: None)
    try:
        torch._dynamo.reset()
        with pytest.raises(Exception, match="consume_weight_grad"):
            torch.compile(fused_linear_cross_entropy, fullgraph=True, backend="aot_eager")(hidden, weight,
                                                                                          _labels((2, 5), 40))
    finally:
        forget()


# ---- Soft-capped attention ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("masking", [dict(), dict(window=5, documents=True)])
def test_softcap_attention_op_passes_opcheck(masking):
    from liger_models.kernels.ops import softcap_attention as sca

    q = torch.randn(2, 4, 9, 16, requires_grad=True)
    k, v = (torch.randn(2, 2, 9, 16, requires_grad=True) for _ in range(2))
    docs = torch.tensor([[0] * 4 + [1] * 5, [0] * 9]) if masking.get("documents") else None
    torch.library.opcheck(sca._softcap_attention_op, (q, k, v, 0.25, 2.0, masking.get("window"), docs))


def test_compiled_softcap_attention_equals_eager():
    from liger_models.kernels.ops.softcap_attention import softcap_attention

    qkv = torch.randn(2, 11, 8 * 16, requires_grad=True)
    docs = torch.tensor([[0] * 5 + [1] * 6, [0] * 11])

    def fn(qkv):
        q, k, v = (x.view(2, 11, -1, 16).transpose(1, 2) for x in qkv.split([64, 32, 32], -1))
        return softcap_attention(q, k, v, 0.25, 2.0, 4, docs)

    _compiled_equals_eager(fn, qkv, ulps=True)


def test_layer_norm_is_one_graph_break_compiled_first_or_after_an_eager_call():
    """layer_norm is no custom op: compiled, it is one graph break (opaque_to_compile, which applies
    torch.compiler.disable at its first call), whether that first call is inside the compiled region or eager."""
    from liger_models.kernels.ops import layer_norm as ln

    x = torch.randn(5, 48, requires_grad=True)
    w, b = torch.randn(48, requires_grad=True), torch.randn(48, requires_grad=True)
    for first in ("compiled", "eager"):
        fn = ln.opaque_to_compile(ln.layer_norm.__wrapped__)

        def step(x, w, b, fn=fn):
            return fn(x * 2, w, b).sin()

        torch._dynamo.reset()
        runs = [torch.compile(step, backend="aot_eager"), step]
        outs = [run(x, w, b) for run in (runs if first == "compiled" else runs[::-1])]
        assert torch.equal(outs[0], outs[1]), first
        grads = torch.autograd.grad(outs[0].sum(), (x, w, b))
        assert all(g.isfinite().all() and g.abs().sum() > 0 for g in grads)
        torch._dynamo.reset()
        assert torch._dynamo.explain(step)(x, w, b).graph_break_count == 1, first

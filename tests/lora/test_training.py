"""LoRA training: dropout on the adapter input only (in every fused path, against float64 HF + PEFT under the masks
ours drew), activation checkpointing (also offloaded, also reentrant with a frozen embedding) bit-identical to the
plain run, and a loss curve that tracks HF + PEFT's."""

from __future__ import annotations

import pytest
import torch

from liger_models.lora import LoraSettings, add_lora, lora_modules, quantize_base_
from liger_models.modules import fused
from liger_models.modules.lora_linear import LoraLinear

from ..models.parity import max_rel
from ..helpers import CHUNKED_GRAD_REL
from .common import assert_matches_float64_peft, batch, pair, peft_float64, with_adapters

peft = pytest.importorskip("peft")


@pytest.mark.parametrize("path", ["kernel", "reference"])
def test_dropout_masks_the_adapter_input_only(path, request):
    """One adapted linear with dropout: output and gradients equal the float64 formula with the mask it drew. The
    kernel path keeps only a seed and draws the mask again in backward (kernels/ops/dropout.py); the PyTorch
    reference path stores the mask."""
    if path == "reference":
        request.getfixturevalue("reference_kernels")
    _check_dropout_layer("cpu", path)


@pytest.mark.gpu
def test_dropout_masks_the_adapter_input_only_on_the_gpu():
    torch.backends.cuda.matmul.allow_tf32 = False
    _check_dropout_layer("cuda", "kernel")


def _check_dropout_layer(device: str, path: str) -> None:
    lin = torch.nn.Linear(48, 40)
    lin.weight.requires_grad_(False)
    lin.bias.requires_grad_(False)
    layer = LoraLinear.from_linear(lin)
    layer.add_adapter(4, 8.0, dropout=0.3, init=False)
    layer.to(device).train()
    x = torch.randn(3, 5, 48, device=device, requires_grad=True)
    out = layer(x)
    (draw,) = out.grad_fn.draws
    assert (draw.stored is None) == (path == "kernel")
    mask = draw.mask()
    assert mask.shape == (15, 48) and 0.5 < mask.float().mean() < 0.9  # p = 0.3 of 720 draws
    g = torch.randn_like(out)
    out.backward(g)
    x64 = x.detach().double().requires_grad_(True)
    A = layer.lora_A.weight.detach().double().requires_grad_(True)
    B = layer.lora_B.weight.detach().double().requires_grad_(True)
    dropped = x64 * mask.view(x.shape) / 0.7
    ref = x64 @ lin.weight.double().t() + lin.bias.double() + layer.scaling * (dropped @ A.t()) @ B.t()
    ref.backward(g.double())
    for ours, exact in ((out, ref), (x.grad, x64.grad), (layer.lora_A.weight.grad, A.grad),
                        (layer.lora_B.weight.grad, B.grad)):
        assert (ours.double() - exact).abs().max() <= 1e-5 * exact.abs().max()
    layer.eval()
    with torch.no_grad():
        ref_eval = x64 @ lin.weight.double().t() + lin.bias.double() + layer.scaling * (x64 @ A.t()) @ B.t()
        assert (layer(x).double() - ref_eval).abs().max() <= 1e-5 * ref_eval.abs().max()


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_dropout_in_the_fused_paths_matches_float64_peft_under_the_drawn_masks(family, tmp_path):
    """Every adapter of every fused path (q|k|v and gate|up behind the norm, o alone, down behind the gated
    activation) with dropout on the seeded kernel path: one step's logits, loss and every adapter gradient against
    HF + PEFT in float64 whose dropout modules apply the very masks ours drew (read back from each call's seeds), so
    forward and backward must both use them; judged as every float64 comparison of this package is, where fp32
    cannot reach the fixed bounds on a random tiny model against HF + PEFT in fp32 under the same masks."""
    hf, ours, _ = pair(family, tmp_path)
    with_adapters(ours, family, "all-linear", dropout=0.3)
    truth = peft_float64(hf, ours, tmp_path / "float64")
    drawn = {}
    grads = assert_matches_float64_peft(ours, truth, drawn=drawn)
    assert len(drawn) == len(lora_modules(ours)) and len(grads) == 2 * len(drawn)
    assert all(d is not None and d.stored is None and d.p == 0.3 for d in drawn.values())


def test_sibling_adapters_draw_their_own_masks(tmp_path):
    _, ours, _ = pair("llama", tmp_path)
    with_adapters(ours, "llama", "attention", dropout=0.5)
    ours.train()
    seen = []
    original = fused._LoraNormLinear.apply

    def spy(*args):
        out = original(*args)
        seen.append((out[0] if isinstance(out, tuple) else out).grad_fn.draws)
        return out

    fused._LoraNormLinear.apply = spy
    try:
        ours(batch()[0])
    finally:
        fused._LoraNormLinear.apply = original
    q, k, v = (draw.mask() for draw in seen[0])
    assert not torch.equal(q, k) and not torch.equal(k, v)


@pytest.mark.parametrize("mode", ["non-reentrant", "offloaded", "reentrant", "qlora", "qlora-mlp-chunks"])
def test_checkpointing_gives_identical_adapter_gradients(mode, tmp_path):
    """With dropout on the adapters' input: the recompute draws the same masks (from the same seeds: checkpointing
    restores the RNG state), also with MLP chunks (5 of the 22 rows each, in both runs: each chunk draws its own
    masks), checkpointed inside the checkpointed layer."""
    _check_checkpointing(mode, tmp_path, "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["non-reentrant", "offloaded", "qlora-mlp-chunks"])
def test_checkpointing_gives_identical_adapter_gradients_on_the_gpu(mode, tmp_path):
    """The same on CUDA, the seeds drawn from the GPU's generator. The loss is bit for bit the same (the forward drew
    the same masks); the gradients were not bit for bit on CUDA (2026-12-07, one H100, all three modes: last-digit
    differences such as -3.4301e-04 against -3.4302e-04, the backward's sums there not in a fixed order), so they are
    held to 1e-5 of each tensor's largest value, where a mask drawn again differently moves them by tens of percent."""
    _check_checkpointing(mode, tmp_path, "cuda", bound=1e-5)


def _check_checkpointing(mode: str, tmp_path, device: str, bound: float = 0.0) -> None:
    _, ours, _ = pair("llama", tmp_path)
    ours.to(device)
    if mode.startswith("qlora"):
        quantize_base_(ours)
    with_adapters(ours, "llama", "all-linear", dropout=0.1)
    if mode == "qlora-mlp-chunks":
        ours.mlp_chunking_enable(5)
    ids, labels = (t.to(device) for t in batch())
    results = []
    for checkpointed in (False, True):
        if checkpointed:
            kwargs = {"use_reentrant": True} if mode == "reentrant" else None
            ours.activation_checkpointing_enable(kwargs, offload=mode == "offloaded")
        ours.train()
        ours.zero_grad(set_to_none=True)
        torch.manual_seed(0)  # the same dropout masks in both runs (checkpoint replays the RNG state)
        loss = ours(ids, labels=labels).loss
        loss.backward()
        results.append((loss.detach(), {n: p.grad for n, p in ours.named_parameters() if p.requires_grad}))
    (loss0, grads0), (loss1, grads1) = results
    assert torch.equal(loss0, loss1)
    assert len(grads0) == 2 * len(lora_modules(ours))
    for name, grad in grads0.items():
        assert grads1[name] is not None, name
        assert (grads1[name] - grad).abs().max() <= bound * grad.abs().max(), name


@pytest.mark.parametrize("rows", [None, {"embed_tokens": [5, 9], "lm_head": [5, 9, 11]}], ids=["lora", "token_rows"])
def test_loss_curve_tracks_hf_peft(tmp_path, rows):
    """10 AdamW steps from the same adapters (B = 0), with trainable-token rows of both tables too: ours (fused,
    Triton interpreter, fp32) against HF + PEFT (fp32, eager); the loss falls and the two curves agree step by step.
    (Parameters are not compared: Adam's normalised step turns fp32-level gradient differences of near-zero entries
    into O(lr) ones.)"""
    from liger_models.lora import save_adapter

    hf, ours, _ = pair("llama", tmp_path, tie_word_embeddings=False)
    # with the rows, q and v only: the adapters' fused paths are the all-linear run's
    add_lora(ours, LoraSettings(r=8, alpha=16, targets=["q_proj", "v_proj"] if rows else "all-linear",
                                trainable_token_indices=rows))
    save_adapter(ours, tmp_path / "adapter")
    ref = peft.PeftModel.from_pretrained(hf, tmp_path / "adapter", is_trainable=True)
    ids, labels = batch(rows=4, length=16)
    if rows:  # the rows' tokens in every row's input and targets
        ids[:, 2::5] = labels[:, 2::5] = torch.tensor([5, 9, 11, 5])[:, None]
    curves = []
    for model in (ours, ref):
        model.train()
        params = [p for p in model.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=1e-2)
        losses = []
        for _ in range(10):
            opt.zero_grad()
            loss = model(input_ids=ids, labels=labels).loss
            loss.backward()
            opt.step()
            losses.append(loss.item())
        curves.append(losses)
    ours_curve, ref_curve = curves
    assert ours_curve[-1] < 0.9 * ours_curve[0]
    for step, (a, b) in enumerate(zip(ours_curve, ref_curve)):
        assert abs(a - b) <= 1e-4 * abs(b), (step, a, b)


def test_mlp_chunks_give_the_unchunked_adapter_gradients(tmp_path):
    """Adapters on gate, up and down inside MLP chunks of 5 rows (checkpointed layers, no dropout): the loss and every
    adapter gradient as without chunks."""
    _, ours, _ = pair("llama", tmp_path)
    with_adapters(ours, "llama", "all-linear")
    ours.activation_checkpointing_enable()
    ours.train()
    ids, labels = batch()
    results = []
    for chunks in (None, 5):
        if chunks:
            ours.mlp_chunking_enable(chunks)
        ours.zero_grad(set_to_none=True)
        loss = ours(ids, labels=labels).loss
        loss.backward()
        results.append((loss.detach(), {n: p.grad.clone() for n, p in ours.named_parameters() if p.requires_grad}))
    (loss0, grads0), (loss1, grads1) = results
    torch.testing.assert_close(loss1, loss0, rtol=1e-6, atol=0)
    assert any("mlp" in n for n in grads0)
    for name, grad in grads0.items():  # up to the order of fp32 sums (CHUNKED_GRAD_REL's note)
        assert max_rel(grads1[name], grad) <= CHUNKED_GRAD_REL, (name, max_rel(grads1[name], grad))

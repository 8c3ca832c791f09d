"""Native LoRA on the GPU: the CUDA kernels' fused paths (q|k|v behind the norm, gate|up, gated → down, the CE
kernel behind an adapted lm_head) with adapters, DoRA, adapters on the tables and an NF4 base.

fp32 (TF32 off): logits, loss and every trained gradient against HF + PEFT in float64 on the CPU, the bounds of the
CPU tests. bf16: ours against the same float64 truth beside HF + PEFT in bf16 on the same GPU (``check_bf16``)."""

from __future__ import annotations

import pytest
import torch

from liger_models.lora import LoraSettings, add_lora, lora_modules, quantize_base_

from ..models.parity import causal_lm_loss, max_rel
from .common import batch, pair, peft_float64, peft_name, targets

peft = pytest.importorskip("peft")

pytestmark = pytest.mark.gpu


# kind "token_rows": trainable-token rows on both untied tables (lm_head's as the CE kernel's low-rank term)
TOKEN_ROWS = {"embed_tokens": [3, 5, 9], "lm_head": [4, 5]}


def _settings(family: str, kind: str) -> LoraSettings:
    chosen = (["q_proj", "v_proj", "embed_tokens", "lm_head"] if kind == "tables" else
              ["q_proj", "v_proj"] if kind == "token_rows" else targets(family, "all-linear"))
    return LoraSettings(r=4, alpha=8, targets=chosen, init=False, use_dora=kind == "dora",
                        trainable_token_indices=TOKEN_ROWS if kind == "token_rows" else None)


def _batch(kind: str):
    """batch(), with the trained tokens in the input and among the targets for kind "token_rows"."""
    ids, labels = batch()
    if kind == "token_rows":
        for i, token in enumerate(sorted({t for rows in TOKEN_ROWS.values() for t in rows})):
            ids[i % 2, 3 + 2 * i] = labels[i % 2, 3 + 2 * i] = token
    return ids, labels


def _adapted(family: str, kind: str, tmp_path):
    hf, ours, _ = pair(family, tmp_path, tie_word_embeddings=False)
    if kind.startswith("qlora"):
        quantize_base_(ours)
        with torch.no_grad():  # the truth runs on the dequantised base
            for name, m in ours.named_modules():
                if getattr(m, "quant", None) is not None:
                    hf.get_submodule(name).weight.copy_(m.base_weight(torch.float32))
    add_lora(ours, _settings(family, kind))
    with torch.no_grad():
        for m in lora_modules(ours).values():
            if getattr(m, "use_dora", False):
                m.lora_magnitude_vector.mul_(torch.empty_like(m.lora_magnitude_vector).uniform_(0.5, 1.5))
            if getattr(m, "token_adapter", None) is not None:
                # Off the frozen rows by twice the table's own scale. init=False's rows (randn, ~50x the table's)
                # made lm_head's two logits ~80x the others', and bf16's 2^-9 on those alone moved the loss by
                # 0.3% in ours and HF + PEFT alike: which of the two came closer was a coin toss per draw.
                original = m.token_adapter.trainable_tokens_original
                m.token_adapter.trainable_tokens_delta.copy_(original + 2 * original.std() * torch.randn_like(original))
    return hf, ours, peft_float64(hf, ours, tmp_path / "float64").train()


def _loss_and_grads(model, ids, labels, *, peft_model: bool):
    if peft_model:
        logits = model(input_ids=ids, use_cache=False).logits
        loss = causal_lm_loss(logits, labels)
    else:
        logits = model(ids).logits
        loss = model(ids, labels=labels).loss
    loss.backward()
    grads = {n: p.grad.double().cpu() for n, p in model.named_parameters() if p.requires_grad}
    return logits.double().cpu(), loss.double().cpu(), grads


def check_fp32(family: str, kind: str, tmp_path, device: str) -> None:
    """Ours in fp32 on ``device`` against float64 HF + PEFT on the CPU (CPU tests' bounds)."""
    _, ours, truth = _adapted(family, kind, tmp_path)
    ours = ours.to(device).train()
    if kind.endswith("chunks"):  # checkpointed layers whose MLPs run in checkpointed chunks of 5 of the 22 rows
        ours.activation_checkpointing_enable()
        ours.mlp_chunking_enable(5)
    ids, labels = _batch(kind)
    logits, loss, grads = _loss_and_grads(ours, ids.to(device), labels.to(device), peft_model=False)
    exact, ref, ref_grads = _loss_and_grads(truth, ids, labels, peft_model=True)
    assert (logits - exact).abs().max().item() <= 1e-4 * max(1.0, exact.abs().max().item())
    assert abs(loss.item() - ref.item()) <= 1e-5 * abs(ref.item())
    assert grads
    for name, grad in grads.items():
        assert max_rel(grad, ref_grads[peft_name(name)]) < 1e-4, name


def _pooled_error(grads: dict, exact: dict) -> float:
    """Relative L2 error over every trained gradient at once."""
    num = sum(((g - exact[n]).norm() ** 2).item() for n, g in grads.items())
    return (num / sum((exact[n].norm() ** 2).item() for n in grads)) ** 0.5


def check_bf16(family: str, kind: str, tmp_path, device: str, draws: int = 7) -> None:
    """Ours in bf16 on ``device`` against float64, beside HF + PEFT in bf16 on ``device``. On these tiny random
    models a bf16 gradient is 3-15% off in both (cancelling sums), and which of the two is closer changes from draw to
    draw: ours / theirs pooled 0.2-4.0 per draw, 0.85 on average per kind of tensor (CPU interpreter, 15 and 8
    draws). So the median over ``draws`` models of that ratio must stay within 2 (a systematic error fails every
    draw). The loss (ours: fp32 inside the fused kernels) must be as close as twice theirs or 1e-3."""
    ratios = []
    for draw in range(draws):
        hf, ours, truth = _adapted(family, kind, tmp_path / str(draw))
        peer = peft.PeftModel.from_pretrained(hf, tmp_path / str(draw) / "float64" / "adapter", is_trainable=True)
        ours = ours.to(device=device, dtype=torch.bfloat16).train()
        peer = peer.to(device=device, dtype=torch.bfloat16).train()
        ids, labels = _batch(kind)
        _, ref, ref_grads = _loss_and_grads(truth, ids, labels, peft_model=True)
        _, loss, grads = _loss_and_grads(ours, ids.to(device), labels.to(device), peft_model=False)
        _, peer_loss, peer_grads = _loss_and_grads(peer, ids.to(device), labels.to(device), peft_model=True)
        assert abs(loss.item() - ref.item()) <= max(2 * abs(peer_loss.item() - ref.item()), 1e-3 * abs(ref.item()))
        grads = {peft_name(n): g for n, g in grads.items()}
        assert set(grads) == set(peer_grads)
        ratios.append(_pooled_error(grads, ref_grads) / _pooled_error(peer_grads, ref_grads))
    assert sorted(ratios)[draws // 2] <= 2, ratios


@pytest.mark.parametrize("kind", ["lora", "dora", "tables", "qlora", "token_rows"])
@pytest.mark.parametrize("family", ["llama", "qwen2", "phi3", "gemma3"])
def test_native_lora_fp32_on_the_gpu(family, kind, tmp_path):
    if kind == "tables" and family == "phi3":
        pytest.skip("one tables case per embedding kind is enough: llama, qwen2 (plain), gemma3 (scaled)")
    if kind == "token_rows" and family in ("qwen2", "phi3"):
        pytest.skip("one token-rows case per embedding kind is enough: llama (plain), gemma3 (scaled)")
    torch.backends.cuda.matmul.allow_tf32 = False
    check_fp32(family, kind, tmp_path, "cuda")


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_qlora_in_checkpointed_mlp_chunks_fp32_on_the_gpu(family, tmp_path):
    """The fused kernels on (1, rows, H) chunks inside nested checkpoints (plain and sandwich layers)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    check_fp32(family, "qlora-chunks", tmp_path, "cuda")


@pytest.mark.parametrize("kind", ["lora", "dora", "token_rows"])
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_native_lora_bf16_on_the_gpu(family, kind, tmp_path):
    check_bf16(family, kind, tmp_path, "cuda")


def test_expert_adapters_in_grouped_mm_bf16_on_the_gpu():
    """The routed experts with adapters on both stacks in bf16 through torch's grouped GEMM (r = 16: the strides it
    needs), against the per-expert float64 loop: output and every gradient within bf16's bound, beside the same
    math in bf16 with the adapters merged into each expert's weights (what HF + PEFT's target_parameters runs)."""
    from liger_models.modules.moe import ExpertsLora, _use_grouped_mm, experts_forward
    from tests.helpers import assert_matches

    n, d, inter, e, k, r = 1024, 512, 256, 8, 2, 16
    device, dtype = torch.device("cuda"), torch.bfloat16
    x = torch.randn(n, d, device=device)
    weights = torch.softmax(torch.randn(n, k, device=device), -1)
    experts = torch.stack([torch.randperm(e)[:k] for _ in range(n)]).to(device)
    stacks = [torch.randn(e, 2 * inter, d, device=device) / d ** 0.5,
              torch.randn(e, d, inter, device=device) / inter ** 0.5]
    # PEFT's layout (A (E·r, in), B (out, r·E)), fp32 as add_lora keeps adapters
    factors = [torch.randn(e * r, d, device=device) / d ** 0.5, torch.randn(2 * inter, r * e, device=device) / r ** 0.5,
               torch.randn(e * r, inter, device=device) / inter ** 0.5, torch.randn(d, r * e, device=device) / r ** 0.5]
    grad = torch.randn(n, d, device=device)

    def run(values, dtype, merged=False):
        leaves = [t.detach().to(dtype).requires_grad_() for t in values]
        routed = experts.to(leaves[0].device)
        xx, ww, gu, dn, a1, b1, a2, b2 = leaves
        if merged:
            def delta(a, b):  # s·B_e·A_e of every expert from PEFT's layout
                return b.view(b.shape[0], r, e).permute(2, 0, 1) @ a.view(e, r, -1)
            out = experts_forward(xx, ww, routed, gu + 0.5 * delta(a1, b1), dn + 2.0 * delta(a2, b2), "silu",
                                  "padded")
        else:
            lora = ExpertsLora(a1, b1, 0.5, a2, b2, 2.0)
            assert dtype != torch.bfloat16 or _use_grouped_mm(xx, gu, dn)
            out = experts_forward(xx, ww, routed, gu, dn, "silu", "auto", lora)
        return out, torch.autograd.grad(out, leaves, grad.to(leaves[0].device, dtype))

    values = [x, weights, *stacks, *factors]
    ours, ours_grads = run(values, dtype)
    exact, exact_grads = run([v.cpu() for v in values], torch.float64)  # padded path, float64 on the CPU
    eager, eager_grads = run(values, dtype, merged=True)
    assert_matches(ours.cpu(), exact, eager=eager.cpu(), name="out")
    names = ("x", "weights", "gate_up", "down", "a1", "b1", "a2", "b2")
    for name, mine, truth, low in zip(names, ours_grads, exact_grads, eager_grads):
        assert_matches(mine.cpu(), truth, eager=low.cpu(), name=f"d {name}")


def test_nf4_bases_load_onto_the_gpu_without_the_dense_weights(tmp_path):
    """A bitsandbytes 4-bit checkpoint, and a dense one quantised as it loads (what --qlora and --qlora-base do in one
    process), reach the GPU without its ever holding the dense weights of the linears made NF4: the memory allocated
    while loading peaks under half their bf16 bytes (the NF4 codes and scales are ~28% of them), where loading the
    dense model first took them all."""
    from liger_models import LigerLlamaForCausalLM, LlamaConfig
    from liger_models.lora import load_causal_lm, save_bnb_4bit

    config = LlamaConfig.tiny(vocab_size=256, hidden_size=1024, intermediate_size=4096, num_hidden_layers=16,
                              num_attention_heads=16, num_key_value_heads=16, head_dim=64)
    model = LigerLlamaForCausalLM.from_config(config, dtype=torch.bfloat16)
    dense = sum(p.numel() * 2 for n, p in model.named_parameters() if ".layers." in n and n.endswith("proj.weight"))
    model.save_pretrained(tmp_path / "dense")
    save_bnb_4bit(model, tmp_path / "bnb")
    del model
    for source, quantise in (("bnb", False), ("dense", True)):
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated()
        loaded = load_causal_lm(tmp_path / source, device="cuda", quantise=quantise)
        peak = torch.cuda.max_memory_allocated() - start
        assert any(getattr(m, "quant", None) is not None for m in loaded.modules())
        assert peak < 0.5 * dense, (source, peak, dense)
        del loaded

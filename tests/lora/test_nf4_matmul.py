"""x · Wᵀ with W in NF4 decoded inside the K-loop (kernels/ops/nf4_matmul.py), the product of decoding steps on an
NF4 base: against the float64 product with the dequantised weight (rounded to x's dtype, as the dequantise-then-GEMM
path rounds it), into strided outputs, and inside the fused LoRA group of a model loaded from a bitsandbytes
checkpoint."""

from __future__ import annotations

import pytest
import torch

from liger_models.llama import LigerLlamaForCausalLM, LlamaConfig
from liger_models.kernels.ops import nf4, nf4_matmul as nm
from liger_models.lora import load_bnb_4bit, save_bnb_4bit
from liger_models.modules import lora_linear

# (N, K): one tile; rows straddling 64-value blocks (K = 200, 1000); more column steps than one split holds.
SHAPES = [(16, 64), (37, 1000), (96, 200), (70, 2048)]
# Per dtype: the product's error beyond the output's one rounding, relative to its largest magnitude (fp32 sums of
# up to 2048 terms in another order than float64's), and the rounding's relative size.
SUM_BOUND = {torch.float32: 2e-6, torch.bfloat16: 2e-6, torch.float16: 2e-6}
ROUNDING = {torch.float32: 0.0, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}


def _weight(shape, generator=None):
    w = torch.randn(shape, generator=generator) * 0.05
    codes, absmax = nf4.quantize_nf4(w)
    return codes, absmax


def _truth(x: torch.Tensor, codes, absmax, shape, bias=None) -> torch.Tensor:
    w = nf4.dequantize_nf4_reference(codes, absmax, shape, x.dtype).double()
    y = x.double() @ w.t()
    return y if bias is None else y + bias.double()


def _assert_close(ours: torch.Tensor, truth: torch.Tensor, dtype: torch.dtype, k: int = 2048) -> None:
    """Within the output's rounding plus SUM_BOUND, which grows as √k past 2048 summed terms (random-walk growth of
    the fp32 sums' rounding errors)."""
    err = (ours.double() - truth).abs()
    bound = ROUNDING[dtype] * truth.abs() + SUM_BOUND[dtype] * max(1.0, (k / 2048) ** 0.5) * truth.abs().max()
    assert bool((err <= bound).all()), f"worst excess {(err - bound).max().item():.3g}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("rows", [1, 5, 16])
def test_equals_the_product_with_the_dequantised_weight(shape, dtype, rows):
    codes, absmax = _weight(shape)
    x = torch.randn(rows, shape[1]).to(dtype)
    ours = nm.nf4_matmul(x, codes, absmax, shape)
    assert ours.dtype == dtype and ours.shape == (rows, shape[0])
    _assert_close(ours, _truth(x, codes, absmax, shape), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_strided_input_bias_and_output_rows_of_a_wider_poisoned_tensor(dtype, tune):
    shape = (37, 1000)
    codes, absmax = _weight(shape)
    bias = torch.randn(shape[0]).to(dtype)
    x = torch.randn(3, 2 * shape[1]).to(dtype)[:, ::2]  # column stride 2
    packed = torch.full((3, 5 + shape[0] + 4), float("nan"), dtype=dtype)
    rows = packed[:, 5:5 + shape[0]]
    tune(nm, programs_per_sm=64)  # several column splits
    nm.nf4_matmul(x, codes, absmax, shape, bias=bias, out=rows)
    assert torch.isnan(packed[:, :5]).all() and torch.isnan(packed[:, 5 + shape[0]:]).all()
    _assert_close(rows, _truth(x, codes, absmax, shape, bias), dtype)


@pytest.mark.parametrize("shape", [(70, 2048), (37, 1000)])
def test_splits_and_tiles_change_only_the_order_of_the_fp32_sums(shape, tune):
    """One split (the rounded result stored by the kernel) or many (fp32 partial sums), narrow or wide tiles: the
    same product."""
    codes, absmax = _weight(shape)
    x = torch.randn(4, shape[1]).to(torch.bfloat16)
    truth = _truth(x, codes, absmax, shape)
    for settings, one_split in ((dict(programs_per_sm=1, tile=1 << 16), True),
                                (dict(programs_per_sm=64, tile=512, min_block_n=4), False)):
        tune(nm, **settings)
        splits = nm.launch_plan(4, *shape, x.device)[2]
        assert splits == 1 if one_split else splits >= 4
        _assert_close(nm.nf4_matmul(x, codes, absmax, shape), truth, torch.bfloat16)


def test_what_it_does_not_take_is_refused_by_name():
    codes, absmax = _weight((8, 64))
    assert nm.rows_fit(torch.randn(16, 64), codes, (8, 64), max_rows=16)
    assert not nm.rows_fit(torch.randn(17, 64), codes, (8, 64), max_rows=64)  # past its register tile
    assert not nm.rows_fit(torch.randn(1, 63), codes, (8, 63), max_rows=16)  # odd row length: bytes straddle rows
    with pytest.raises(ValueError, match="1-16 rows of an even length"):
        nm.nf4_matmul(torch.randn(17, 64), codes, absmax, (8, 64))
    with pytest.raises(ValueError, match="needs 512 code bytes"):
        nm.nf4_matmul(torch.randn(1, 64), codes[:100], absmax, (16, 64))


def test_a_decoding_step_on_a_bitsandbytes_checkpoint_takes_it_and_matches_the_dequantised_path(tmp_path, tune):
    """A model loaded from a bitsandbytes 4-bit checkpoint, the kernel switched on for up to 16 rows: a few positions
    (one decoding step of a batch of three) run every NF4 projection through nf4_matmul; switched off, the
    dequantise-then-GEMM path; both give the logits of the dense model holding the dequantised weights."""
    tune(nm, max_rows=16)
    dense = LigerLlamaForCausalLM.from_config(LlamaConfig.tiny(), dtype=torch.float32)
    save_bnb_4bit(dense, tmp_path / "bnb")
    model = load_bnb_4bit(tmp_path / "bnb", dtype=torch.float32)
    calls = []
    original = nm.nf4_matmul

    def counting(*args, **kwargs):
        calls.append(args[3])
        return original(*args, **kwargs)

    ids = torch.randint(0, model.config.vocab_size, (3, 1))
    with torch.no_grad(), pytest.MonkeyPatch.context() as mp:
        mp.setattr(lora_linear, "nf4_matmul", counting)
        fused = model(ids).logits
        assert len(calls) == 7 * model.config.num_hidden_layers  # q, k, v, o, gate, up, down of every layer
        calls.clear()
        tune(nm, max_rows=0)
        unfused = model(ids).logits
        assert not calls
    with torch.no_grad():
        for name, m in model.named_modules():
            if getattr(m, "quant", None) is not None:
                dense.get_submodule(name).weight.copy_(m.base_weight(torch.float32))
        truth = dense(ids).logits
    for logits in (fused, unfused):
        assert (logits - truth).abs().max() <= 1e-5 * truth.abs().max()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 16])
def test_on_cuda_at_llama_widths(rows, dtype):
    """The compiled kernel at real widths (several column splits on a 132-SM GPU; fp32 without TF32)."""
    for shape in [(1024, 4096), (14336, 4096), (4096, 14336), (37, 1000)]:
        codes, absmax = _weight(shape)
        codes, absmax = codes.cuda(), absmax.cuda()
        x = torch.randn(rows, shape[1], device="cuda").to(dtype)
        ours = nm.nf4_matmul(x, codes, absmax, shape)
        _assert_close(ours.cpu(), _truth(x.cpu(), codes.cpu(), absmax.cpu(), shape), dtype, k=shape[1])

"""NF4 quantisation and dequantisation in bitsandbytes' layout: against the definition, and against bitsandbytes
bit for bit when it imports."""

from __future__ import annotations

import pytest
import torch

from liger_models.kernels.ops import nf4

from .bnb import import_bnb

SHAPES = [(64, 128), (96, 200), (3, 7), (5, 64 * 256 + 3)]  # straddling blocks, odd numel, >1 nested block


def _reference_codes(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The definition, element by element: after scaling by the fp32 reciprocal of the block absmax, the code index
    is the number of decision thresholds below the value, the thresholds being the midpoints between neighbouring
    codes as fp32 constants (bitsandbytes' ``x > 0.8614784181118011f`` tests); (per-element code index, absmax)."""
    flat = w.reshape(-1).float()
    table = torch.tensor(nf4.NF4_CODE, dtype=torch.float64)
    idx, absmax = [], []
    for start in range(0, flat.numel(), 64):
        block = flat[start : start + 64]
        m = block.abs().max()
        absmax.append(m)
        scaled = (block * (1.0 / m)).clamp(-1, 1)
        thresholds = ((table[1:] + table[:-1]) / 2).float()
        idx.append((scaled[:, None] > thresholds[None]).sum(1))
    return torch.cat(idx), torch.stack(absmax)


@pytest.mark.parametrize("shape", SHAPES[:3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_codes_and_dequantisation_follow_the_definition(shape, dtype):
    w = torch.randn(shape, dtype=torch.float32).mul(0.05).to(dtype)
    codes, absmax = nf4.quantize_nf4(w)
    ref_idx, ref_absmax = _reference_codes(w)
    assert codes.dtype == torch.uint8 and codes.shape == ((w.numel() + 1) // 2, 1)
    assert torch.equal(absmax, ref_absmax)
    c = codes.reshape(-1)
    idx = torch.stack([c >> 4, c & 15], -1).reshape(-1)[: w.numel()].long()  # even element in the high nibble
    assert torch.equal(idx, ref_idx)
    out = nf4.dequantize_nf4(codes, absmax, shape, dtype)
    table = torch.tensor(nf4.NF4_CODE)
    expected = (table[ref_idx] * ref_absmax.repeat_interleave(64)[: w.numel()]).view(shape).to(dtype)
    assert torch.equal(out, expected)
    # Every value is within half the widest code gap times its block's scale (plus the output's rounding).
    err = (out.float() - w.float()).abs().reshape(-1)
    half_gap = 0.5 * torch.tensor(nf4.NF4_CODE).diff().max()
    rounding = out.float().abs().reshape(-1) * (torch.finfo(dtype).eps / 2)
    assert (err <= half_gap * ref_absmax.repeat_interleave(64)[: w.numel()] * (1 + 1e-6) + rounding).all()


def test_ties_take_the_lower_code_and_zero_blocks_stay_zero():
    mid = (nf4.NF4_CODE[9] + nf4.NF4_CODE[10]) / 2
    w = torch.zeros(128)
    w[0], w[1] = 1.0, torch.tensor(mid, dtype=torch.float32)
    codes, absmax = nf4.quantize_nf4(w)
    assert codes[0, 0].item() == (15 << 4) | 9
    assert absmax[1].item() == 0 and torch.equal(nf4.dequantize_nf4(codes, absmax, (128,), torch.float32)[64:],
                                                 torch.zeros(64))


def test_double_quantisation_round_trips_the_scales():
    absmax = torch.rand(1000) * 0.1 + 0.01
    dq = nf4.double_quantize(absmax)
    assert dq["absmax"].dtype == torch.uint8 and dq["nested_absmax"].shape == (4,)
    back = nf4.dequantize_absmax(dq["absmax"], dq["nested_absmax"], dq["nested_quant_map"], dq["nested_offset"])
    # Each centred scale is within half the map's widest gap, times its 256-block's nested absmax.
    half_gap = 0.5 * nf4.dynamic_map().diff().max()
    bound = half_gap * dq["nested_absmax"].repeat_interleave(256)[: absmax.numel()]
    rounding = 4 * torch.finfo(torch.float32).eps * absmax.abs().max()  # the fp32 centring and re-adding
    assert ((back - absmax).abs() <= bound + rounding).all()
    assert nf4.dynamic_map().shape == (256,) and nf4.dynamic_map()[-1] == 1.0 and nf4.dynamic_map()[0] < 0


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_bit_identical_to_bitsandbytes(shape, dtype):
    bnb = import_bnb()
    if bnb is None:
        pytest.skip("bitsandbytes does not import here")
    F = bnb.functional
    w = (torch.randn(shape) * 0.02).to(dtype)
    q, state = F.quantize_4bit(w, blocksize=64, quant_type="nf4", compress_statistics=True)
    ours = nf4.bnb_tensors(w)
    packed = {("weight." + k if k != "weight" else k): v for k, v in state.as_dict(packed=True).items()}
    packed["weight"] = q
    assert set(ours) == set(packed)
    for key, value in packed.items():
        if key.endswith("bitsandbytes__nf4"):
            assert nf4.unpack_json(ours[key]) == nf4.unpack_json(value)
        elif key == "weight.absmax":
            _check_nested_codes(ours, packed, w)
        else:
            assert torch.equal(ours[key], value), key
    codes, absmax, _ = nf4.from_bnb_tensors({f"m.{k}": v for k, v in packed.items()}, "m")
    assert torch.equal(nf4.dequantize_nf4(codes, absmax, shape, dtype), F.dequantize_4bit(q, state))


def _check_nested_codes(ours, theirs, w):
    """The 8-bit codes of the centred block scales: ours are the nearest map value (bitsandbytes' CUDA kernel's
    rule). bitsandbytes' CPU backend finds them with an approximate search (BinSearch) that now and then returns
    another code (about 1 in 1000 here; one step away mostly, three once in CI): wherever the two differ, ours must
    be the nearest of the whole map (a tie keeps the lower code) and theirs no nearer."""
    mine, bnb_q = ours["weight.absmax"].long(), theirs["weight.absmax"].long()
    differ = mine != bnb_q
    if not differ.any():
        return
    _, absmax = nf4.quantize_nf4(w)
    centred = absmax - absmax.mean()
    normed = centred / ours["weight.nested_absmax"].repeat_interleave(256)[: centred.numel()]
    code = nf4.dynamic_map()
    d_mine, d_bnb = (code[mine] - normed).abs(), (code[bnb_q] - normed).abs()
    nearest = (code[None, :] - normed[differ][:, None]).abs().min(1).values
    assert torch.equal(d_mine[differ], nearest)
    assert (d_mine[differ] <= d_bnb[differ]).all()


def test_fp4_and_foreign_tables_are_refused():
    w = torch.randn(64, 64)
    tensors = {f"m.{k}": v for k, v in nf4.bnb_tensors(w).items()}
    tensors["m.weight.quant_state.bitsandbytes__fp4"] = tensors.pop("m.weight.quant_state.bitsandbytes__nf4")
    with pytest.raises(ValueError, match="FP4"):
        nf4.from_bnb_tensors(tensors, "m")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(1, 1), (3, 7), (37, 1000), (5, 64 * 256 + 3), (2, 3, 65)])
def test_triton_dequantisation_equals_the_reference_bit_for_bit(shape, dtype):
    """The one-pass Triton kernel (CUDA, or the interpreter here) against the PyTorch reference: the same bits in
    every output dtype (round to nearest even, the bf16 one done on the fp32 bits), odd sizes (a last byte with
    one weight, a last block short of 64), bitsandbytes' own quant_map as the table; a size mismatch is refused."""
    from liger_models.kernels._dispatch import use_triton

    w = torch.randn(shape) * torch.rand(()).add(0.01)
    codes, absmax = nf4.quantize_nf4(w)
    assert use_triton(codes)  # the kernel runs (CUDA or TRITON_INTERPRET=1), not the reference again
    out = nf4.dequantize_nf4(codes, absmax, shape, dtype)
    assert torch.equal(out, nf4.dequantize_nf4_reference(codes, absmax, shape, dtype))
    table = nf4.nf4_code() * (1 + 1e-3 * torch.randn(16))  # a foreign table is taken as given
    assert torch.equal(nf4.dequantize_nf4(codes, absmax, shape, dtype, table),
                       nf4.dequantize_nf4_reference(codes, absmax, shape, dtype, table))
    with pytest.raises(ValueError, match="code bytes"):
        nf4.dequantize_nf4(codes[:-1], absmax, (codes.numel() * 2,), dtype)


@pytest.mark.gpu
def test_triton_dequantisation_on_the_gpu_equals_reference_and_bitsandbytes():
    """At a Llama-3.1-8B MLP projection's size in bf16: the kernel's bits are the reference's and bitsandbytes'
    dequantize_4bit's (when it imports)."""
    shape = (14336, 4096)
    w = (torch.randn(shape, device="cuda") * 0.02).to(torch.bfloat16)
    codes, absmax = nf4.quantize_nf4(w)
    out = nf4.dequantize_nf4(codes, absmax, shape, torch.bfloat16)
    assert torch.equal(out, nf4.dequantize_nf4_reference(codes, absmax, shape, torch.bfloat16))
    bnb = import_bnb()
    if bnb is not None:
        q, state = bnb.functional.quantize_4bit(w, blocksize=64, quant_type="nf4", compress_statistics=True)
        codes, absmax, _ = nf4.from_bnb_tensors(
            {f"m.{k}" if k == "weight" else f"m.weight.{k}": v
             for k, v in {"weight": q, **state.as_dict(packed=True)}.items()}, "m")
        assert torch.equal(nf4.dequantize_nf4(codes, absmax, shape, torch.bfloat16),
                           bnb.functional.dequantize_4bit(q, state))

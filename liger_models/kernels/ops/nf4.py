"""NF4 4-bit weights in bitsandbytes' layout: quantisation, double quantisation of the block scales, dequantisation.

Layout (what bitsandbytes writes, so its checkpoints load byte for byte and ours load in it):
  * the weight [out, in] is flattened row-major into blocks of 64 values (a block may straddle rows);
  * each block is scaled by the fp32 reciprocal of its absmax and every value takes the nearest of the 16 NF4 codes
    (quantiles of N(0, 1), ``NF4_CODE``); a value exactly between two codes takes the lower one (the kernel's
    ``x > midpoint`` tests);
  * two codes per byte, the even element in the high nibble: uint8 [(n + 1) // 2, 1];
  * double quantisation: offset = mean(absmax); absmax − offset is quantised with bitsandbytes' signed 8-bit dynamic
    map in blocks of 256, giving uint8 codes plus one fp32 ``nested_absmax`` per 256 blocks.
Dequantisation: absmax = nested_map[q] · nested_absmax[b // 256] + offset (fp32), w = NF4_CODE[code] · absmax (fp32),
rounded once to the compute dtype.

``dequantize_nf4`` runs one Triton pass (codes and scales read once, the weight written once) on CUDA and under
Triton's interpreter, ``dequantize_nf4_reference`` the PyTorch ops elsewhere and in reference mode; both give the same
bits. A GEMM that decodes NF4 in its K-loop is done for a few rows (nf4_matmul.py: decoding steps), not for a
training step's thousands, which dequantise once per call and run one GEMM.
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .._dispatch import use_triton
from .._launch import cdiv, launch

BLOCK = 64  # values per absmax
NESTED_BLOCK = 256  # absmax values per nested absmax

NF4_CODE = (-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
            -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
            0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941, 0.7229568362236023,
            1.0)


def nf4_code(device=None) -> torch.Tensor:
    return torch.tensor(NF4_CODE, dtype=torch.float32, device=device)


def _nf4_thresholds(device=None) -> torch.Tensor:
    # The midpoints between neighbouring codes, computed in double and held as fp32 like the kernel's literals.
    code = torch.tensor(NF4_CODE, dtype=torch.float64)
    return ((code[1:] + code[:-1]) / 2).to(torch.float32).to(device)


def dynamic_map(device=None) -> torch.Tensor:
    """bitsandbytes' signed 8-bit dynamic map (256 sorted fp32 values): for exponents 10^-6 … 10^0 the midpoints
    of 2^i + 1 evenly spaced fractions in [0.1, 1], both signs, plus 0 and 1. Built in fp32 as bitsandbytes does."""
    data: list[float] = []
    for i in range(7):
        bounds = torch.linspace(0.1, 1, 2**i + 1)
        means = (bounds[:-1] + bounds[1:]) / 2.0
        data += (10 ** (-6 + i) * means).tolist()
        data += (-(10 ** (-6 + i)) * means).tolist()
    data += [0.0, 1.0]
    data.sort()
    return torch.tensor(data, dtype=torch.float32, device=device)


def _blocks(flat: torch.Tensor, block: int) -> torch.Tensor:
    pad = (-flat.numel()) % block
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    return flat.view(-1, block)


def quantize_nf4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes uint8 [(n + 1) // 2, 1], absmax fp32 [ceil(n / 64)]) of ``weight`` in bitsandbytes' NF4 layout."""
    flat = weight.detach().reshape(-1).to(torch.float32)
    n = flat.numel()
    blocks = _blocks(flat, BLOCK)
    absmax = blocks.abs().amax(1)
    # Multiplied by the fp32 reciprocal, as the kernel does (not divided): the codes then match bit for bit.
    inv = torch.where(absmax > 0, 1.0 / absmax, torch.zeros_like(absmax))
    scaled = (blocks * inv[:, None]).clamp(-1, 1).reshape(-1)[:n]
    idx = torch.bucketize(scaled, _nf4_thresholds(flat.device)).to(torch.uint8)  # x == midpoint -> lower code
    if n % 2:  # the unused last nibble holds the code of 0.0, as bitsandbytes pads
        idx = torch.cat([idx, idx.new_full((1,), 7)])
    pairs = idx.view(-1, 2)
    codes = (pairs[:, 0] << 4) | pairs[:, 1]
    return codes.view(-1, 1), absmax


def quantize_blockwise(values: torch.Tensor, block: int = NESTED_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """values (fp32, 1-D) → (uint8 indices into ``dynamic_map``, fp32 absmax per ``block``): bitsandbytes'
    8-bit blockwise quantisation, nearest map value."""
    n = values.numel()
    blocks = _blocks(values.to(torch.float32), block)
    absmax = blocks.abs().amax(1)
    normed = (blocks / absmax[:, None]).reshape(-1)[:n]  # divided, as bitsandbytes does here
    code = dynamic_map(values.device)
    # Nearest of the sorted map: compare the two neighbours found by binary search.
    hi = torch.searchsorted(code, normed).clamp(1, code.numel() - 1)
    lo = hi - 1
    pick_hi = (code[hi] - normed).abs() < (normed - code[lo]).abs()  # a tie keeps the lower value
    # An all-zero block (0/0) gets index 0, as bitsandbytes' search of NaN does; it dequantises to 0 either way.
    q = torch.where(pick_hi, hi, lo).masked_fill(torch.isnan(normed), 0)
    return q.to(torch.uint8), absmax


def double_quantize(absmax: torch.Tensor) -> dict[str, torch.Tensor | float]:
    """absmax (fp32) → {absmax (uint8), nested_absmax, nested_quant_map, nested_offset}."""
    offset = absmax.mean()
    q, nested = quantize_blockwise(absmax - offset)
    return {"absmax": q, "nested_absmax": nested, "nested_quant_map": dynamic_map(absmax.device),
            "nested_offset": float(offset.item())}


def dequantize_absmax(q: torch.Tensor, nested_absmax: torch.Tensor, nested_map: torch.Tensor,
                      offset: float) -> torch.Tensor:
    """The fp32 block scales of a double-quantised weight."""
    block = torch.arange(q.numel(), device=q.device) // NESTED_BLOCK
    return nested_map.to(torch.float32)[q.long().view(-1)] * nested_absmax.to(torch.float32)[block] + offset


def dequantize_nf4_reference(codes: torch.Tensor, absmax: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype,
                             code: torch.Tensor | None = None) -> torch.Tensor:
    """The weight of ``shape`` in ``dtype`` from codes (uint8, two per byte) and fp32 absmax per 64 values; fp32
    products rounded once. PyTorch ops: an int64 index and an fp32 copy of the whole weight on the way."""
    n = math.prod(shape)
    table = nf4_code(codes.device) if code is None else code.to(torch.float32)
    c = codes.reshape(-1)
    idx = torch.stack([c >> 4, c & 15], dim=-1).reshape(-1).long()
    values = table[idx]
    values = _blocks(values, BLOCK)[: absmax.numel()] * absmax.to(torch.float32)[:, None]
    return values.reshape(-1)[:n].view(shape).to(dtype)


@dataclass(frozen=True)
class Nf4Tuning:
    """Launch settings (liger_models/kernels/_tuning.py: ``tuned(module, field=value)`` overrides)."""

    # Bytes of codes per program (two weights each): a memory-bound pass reading 0.5 B and writing 2 B (bf16) per
    # weight; 1024 bytes → 2048 outputs, 8 per thread at 8 warps. Not tuned on a GPU yet.
    block_bytes: int = 1024
    num_warps: int = 8


TUNING = Nf4Tuning()


@triton.jit
def _dequantize_nf4_kernel(CODES, ABSMAX, TABLE, OUT, n_bytes, n_values, BLOCK_BYTES: tl.constexpr,
                           BF16_BITS: tl.constexpr):
    """Each program: BLOCK_BYTES bytes of codes → 2·BLOCK_BYTES weights, high nibble first, each the table's fp32
    value times its 64-value block's fp32 absmax, rounded once to OUT's dtype (the reference's arithmetic).
    BF16_BITS: OUT is the bf16 weight viewed as int16, and the rounding to nearest-even is done on the fp32 bits,
    so that Triton's CPU interpreter (whose bf16 cast truncates) gives torch's bits as the GPU does."""
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK_BYTES + tl.arange(0, BLOCK_BYTES)
    byte = tl.load(CODES + offs, mask=offs < n_bytes, other=0).to(tl.int32)
    scale = tl.load(ABSMAX + (2 * offs) // 64, mask=offs < n_bytes, other=0.0)  # both nibbles share a block
    high = tl.load(TABLE + (byte >> 4)) * scale
    low = tl.load(TABLE + (byte & 15)) * scale
    values = tl.interleave(high, low)
    out = pid.to(tl.int64) * (2 * BLOCK_BYTES) + tl.arange(0, 2 * BLOCK_BYTES)
    if BF16_BITS:
        bits = values.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        tl.store(OUT + out, bits.to(tl.uint16).to(tl.int16, bitcast=True), mask=out < n_values)
    else:
        tl.store(OUT + out, values.to(OUT.dtype.element_ty), mask=out < n_values)


@functools.lru_cache(maxsize=None)
def code_table(device: torch.device) -> torch.Tensor:
    """NF4_CODE on ``device``, made once: a new tensor per call would copy it from the host (a blocking copy) in
    every forward and backward of every NF4 linear."""
    return nf4_code(device)


def dequantize_nf4(codes: torch.Tensor, absmax: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype,
                   code: torch.Tensor | None = None) -> torch.Tensor:
    """dequantize_nf4_reference's result (bit for bit), on CUDA (or under Triton's interpreter) in one Triton pass
    that reads the codes and scales once and writes the weight once, with no int64 index or fp32 copy of the
    weight (those cost 12 bytes per weight in the reference, 0.8 GB transient for a 7B MLP projection)."""
    if not use_triton(codes, absmax) or torch.compiler.is_compiling():
        return dequantize_nf4_reference(codes, absmax, shape, dtype, code)
    n = math.prod(shape)
    if codes.numel() * 2 < n or absmax.numel() * BLOCK < n:
        raise ValueError(f"NF4 weight of shape {tuple(shape)} needs {(n + 1) // 2} code bytes and "
                         f"{-(-n // BLOCK)} block scales, got {codes.numel()} and {absmax.numel()}")
    table = code_table(codes.device) if code is None else code.to(device=codes.device, dtype=torch.float32)
    out = torch.empty(shape, dtype=dtype, device=codes.device)
    if n == 0:
        return out
    flat, scales = codes.reshape(-1), absmax.to(torch.float32).reshape(-1)
    n_bytes = (n + 1) // 2
    block = TUNING.block_bytes
    bf16 = dtype == torch.bfloat16
    target = out.view(torch.int16) if bf16 else out
    launch(_dequantize_nf4_kernel, (cdiv(n_bytes, block),), [flat, scales, table.contiguous(), target, n_bytes, n],
           dict(BLOCK_BYTES=block, BF16_BITS=bf16, num_warps=TUNING.num_warps))
    return out


# ---- bitsandbytes' serialised quant state -------------------------------------------------------------------------

QUANT_STATE_KEY = "quant_state.bitsandbytes__nf4"
_DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}


def pack_json(obj: dict) -> torch.Tensor:
    return torch.tensor(list(json.dumps(obj).encode()), dtype=torch.uint8)


def unpack_json(t: torch.Tensor) -> dict:
    return json.loads(bytes(t.to(torch.uint8).tolist()).decode())


def bnb_tensors(weight: torch.Tensor, double_quant: bool = True) -> dict[str, torch.Tensor]:
    """The tensors bitsandbytes saves for one NF4 linear, keyed by the suffix after the module name."""
    codes, absmax = quantize_nf4(weight)
    return bnb_tensors_of(codes, absmax, tuple(weight.shape), weight.dtype, double_quant)


def bnb_tensors_of(codes: torch.Tensor, absmax: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype,
                   double_quant: bool) -> dict[str, torch.Tensor]:
    """bnb_tensors of a weight already in NF4 (its codes and fp32 block scales)."""
    state = {"quant_type": "nf4", "blocksize": BLOCK, "dtype": _DTYPE_NAMES[dtype], "shape": list(shape)}
    out = {"weight": codes, "weight.quant_map": nf4_code()}
    if double_quant:
        dq = double_quantize(absmax)
        out.update({"weight.absmax": dq["absmax"], "weight.nested_absmax": dq["nested_absmax"],
                    "weight.nested_quant_map": dq["nested_quant_map"]})
        state.update({"nested_blocksize": NESTED_BLOCK, "nested_dtype": "float32",
                      "nested_offset": dq["nested_offset"]})
    else:
        out["weight.absmax"] = absmax
    out["weight." + QUANT_STATE_KEY] = pack_json(state)
    return out


def from_bnb_tensors(tensors: dict[str, torch.Tensor], name: str) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """(codes, fp32 absmax, state) of module ``name`` from a bitsandbytes 4-bit checkpoint's tensors; refuses what
    is not NF4 with a message naming the module."""
    key = f"{name}.weight.{QUANT_STATE_KEY}"
    if key not in tensors:
        fp4 = f"{name}.weight.quant_state.bitsandbytes__fp4"
        if fp4 in tensors:
            raise ValueError(f"{name}: bitsandbytes FP4 weights are not supported (only NF4)")
        raise ValueError(f"{name}: 4-bit weight without its quant state ({key} missing)")
    state = unpack_json(tensors[key])
    if state.get("quant_type") != "nf4" or state.get("blocksize") != BLOCK:
        raise ValueError(f"{name}: only NF4 with blocksize {BLOCK} is supported, got {state.get('quant_type')} "
                         f"blocksize {state.get('blocksize')}")
    absmax = tensors[f"{name}.weight.absmax"]
    if "nested_offset" in state:
        if state.get("nested_blocksize") != NESTED_BLOCK:
            raise ValueError(f"{name}: nested blocksize {state.get('nested_blocksize')} is not {NESTED_BLOCK}")
        absmax = dequantize_absmax(absmax, tensors[f"{name}.weight.nested_absmax"],
                                   tensors[f"{name}.weight.nested_quant_map"], state["nested_offset"])
    code = tensors.get(f"{name}.weight.quant_map")
    if code is not None and not torch.equal(code.to(torch.float32), nf4_code(code.device)):
        raise ValueError(f"{name}: quant_map is not the NF4 table")
    return tensors[f"{name}.weight"], absmax.to(torch.float32), state

"""What a Triton kernel compiles to on sm_90 (H100/H200), without a GPU: registers, spills, and the instruction mix
of every loop in the SASS.

Triton compiles for any target on a CPU-only machine and its wheel ships ptxas and cuobjdump, so register pressure
and issued instructions per element can be read before spending device time. It shows, for instance, that a plain
cross-entropy row loop issues ~38 instructions per logit (exp through the non-ftz ex2 with its denormal check, a
mask and a target test on every element), where ~16 suffice.

    python benchmarks/tools/sass_report.py ce [--vocab 128256] [--block 16384] [--warps 32] [--lanes] [--forward-only]
                                        [--split 2] [--maxnreg 32]
    python benchmarks/tools/sass_report.py norm-bwd [--cols 16384] [--block 16384] [--warps 32]

Launch arguments are specialised as on the GPU for 16-byte-aligned tensors and strides divisible by 16 (without
that, loads are not vectorised and the counts mean nothing).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import tempfile
from collections import Counter

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

TOOLS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
INSTRUCTION = re.compile(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")


def compile_sm90(kernel, signature: dict, constexprs: dict, aligned: set, num_warps: int, maxnreg: int | None = None):
    """Compile `kernel` for sm_90: signature maps every runtime argument to a Triton type ("*bf16", "i32", ...);
    arguments named in `aligned` are specialised as divisible by 16; maxnreg caps ptxas's registers per thread."""
    names = kernel.arg_names
    sig = {n: "constexpr" if n in constexprs else signature[n] for n in names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names) if n in aligned}
    src = ASTSource(fn=kernel, signature=sig, constexprs=constexprs, attrs=attrs)
    options = dict(num_warps=num_warps, **({} if maxnreg is None else dict(maxnreg=maxnreg)))
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


def report(compiled, label: str) -> None:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        usage = subprocess.run([os.path.join(TOOLS, "cuobjdump"), "--dump-resource-usage", f.name],
                               capture_output=True, text=True, check=True).stdout
        sass = subprocess.run([os.path.join(TOOLS, "cuobjdump"), "-sass", f.name],
                              capture_output=True, text=True, check=True).stdout
    regs, stack = re.search(r"REG:(\d+)", usage), re.search(r"STACK:(\d+)", usage)
    code = [(int(a, 16), text) for a, text in INSTRUCTION.findall(sass)]
    ops = [_opcode(text) for _, text in code]
    print(f"{label}: {regs.group(1) if regs else '?'} registers, stack {stack.group(1) if stack else '?'} B, "
          f"{len(code)} instructions, spills {ops.count('LDL')} loads / {ops.count('STL')} stores")
    index = {address: i for i, (address, _) in enumerate(code)}
    for i, (address, text) in enumerate(code):  # a backward branch closes a loop
        branch = re.search(r"BRA (0x[0-9a-f]+)", text)
        if branch and int(branch.group(1), 16) < address and int(branch.group(1), 16) in index:
            body = [_opcode(t) for _, t in code[index[int(branch.group(1), 16)]:i + 1]]
            mix = ", ".join(f"{op} {n}" for op, n in Counter(body).most_common(12))
            print(f"  loop {branch.group(1)}-{hex(address)}: {len(body)} instructions ({mix})")


def _opcode(text: str) -> str:
    return re.sub(r"^@!?U?P\w+\s+", "", text).split()[0].split(".")[0]


def cross_entropy(args) -> None:
    from liger_models.kernels.ops import _ce_core

    block = min(args.block, 1 << (args.vocab - 1).bit_length())
    signature = dict(LOGITS="*bf16", GRAD="*bf16", LABELS="*i64", LABEL_FLAG="*i64", LOSS="*fp32", LSE="*fp32",
                     Q="*fp32", RANK="*i32", SCALE="*fp32", PARTIAL="*fp32", COUNTERS="*i32",
                     stride_logits_row="i64", stride_grad_row="i64", stride_scale="i32",
                     ignore_index="i32", label_smoothing="fp32", z_loss="fp32", softcap="fp32")
    constexprs = dict(N_COLS=args.vocab, FORWARD=True, BACKWARD=not args.forward_only, WITH_RANK=False,
                      HAS_SOFTCAP=False, HAS_SMOOTHING=False, BLOCK_V=block, REVERSE=True,
                      LANE=8 if args.lanes else block,
                      EVICT_PASS1="evict_last", EVICT_PASS2="evict_first", KEEP_FROM=0, EVICT_HEAD="evict_first",
                      SPLIT=args.split, SEGMENT=-(-(args.vocab // block) // args.split) * block, PHASE=0,
                      PREFETCH_PASS2=not args.no_prefetch)
    aligned = {n for n, t in signature.items() if t.startswith("*")} | {"stride_logits_row", "stride_grad_row"}
    compiled = compile_sm90(_ce_core._ce_kernel, signature, constexprs, aligned, args.warps, args.maxnreg)
    per_thread = block // (32 * args.warps)
    report(compiled, f"cross-entropy row kernel, V={args.vocab}, block {block} over {args.warps} warps "
                     f"({per_thread} logits per thread per block), {'lane' if args.lanes else 'block'} sums, "
                     f"{args.split} program(s) per row, maxnreg {args.maxnreg}")


def norm_backward(args) -> None:
    from liger_models.kernels.ops import rms_norm

    signature = dict(DY="*bf16", X="*bf16", W="*bf16", RSTD="*fp32", DX="*bf16", DW_PART="*fp32", n_rows="i32",
                     n_cols="i32", stride_dy_row="i32", stride_x_row="i32", stride_dres_row="i32", offset="fp32")
    constexprs = dict(MEAN=None, DRES=None, C0=None, C1=None, DB_PART=None, CENTER=False, GEMMA=False,
                      HAS_DRES=False, COMPUTE_DW=True, COMPUTE_DB=False, SPLIT_N=args.block < args.cols,
                      BLOCK_M=1, BLOCK_N=args.block)
    if constexprs["SPLIT_N"]:
        signature.update(C1="*fp32")
        del constexprs["C1"]
    aligned = {n for n, t in signature.items() if t.startswith("*")} | {"n_cols", "stride_dy_row", "stride_x_row"}
    compiled = compile_sm90(rms_norm._norm_bwd_kernel, signature, constexprs, aligned, args.warps)
    report(compiled, f"RMSNorm backward, {args.cols} columns, block {args.block} over {args.warps} warps")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="kernel", required=True)
    ce = sub.add_parser("ce", help="the cross-entropy row kernel (fused forward + backward)")
    ce.add_argument("--vocab", type=int, default=128256)
    ce.add_argument("--block", type=int, default=16384)
    ce.add_argument("--warps", type=int, default=32)
    ce.add_argument("--forward-only", action="store_true")
    ce.add_argument("--lanes", action="store_true", help="per-thread partial sums in pass 1 (CE_LANE_SUMS)")
    ce.add_argument("--split", type=int, default=1, help="programs per row (CE_SPLIT_COLS)")
    ce.add_argument("--maxnreg", type=int, default=None, help="register cap (CE_MAX_REGISTERS)")
    ce.add_argument("--no-prefetch", action="store_true", help="split rows: no pass-2 block loaded before the meeting")
    nb = sub.add_parser("norm-bwd", help="the RMSNorm backward kernel (llama casting, dW, one row per tile)")
    nb.add_argument("--cols", type=int, default=16384)
    nb.add_argument("--block", type=int, default=16384)
    nb.add_argument("--warps", type=int, default=32)
    args = ap.parse_args()
    {"ce": cross_entropy, "norm-bwd": norm_backward}[args.kernel](args)


if __name__ == "__main__":
    main()

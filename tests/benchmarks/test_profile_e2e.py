"""tools/profile_e2e.py charges each GPU kernel to what it does, by name: the LoRA step's own kernels (the dropout
products, NF4 dequantisation) and the peers' (torch's dropout, bitsandbytes' dequantisation) land in their rows, not
under GEMM or "other", and an attention kernel whose template names dropout stays attention."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks" / "tools"))
import profile_e2e  # noqa: E402


@pytest.mark.parametrize("kernel, expected", [
    ("_dropped_matmul_kernel", "dropout"),
    ("_dropped_matmul_add_kernel", "dropout"),
    ("_dropped_matmul_t_kernel", "dropout"),
    ("void at::native::(anonymous namespace)::fused_dropout_kernel_vec<c10::BFloat16, float, unsigned int, 1, 4, bool>",
     "dropout"),
    ("_dequantize_nf4_kernel", "NF4 dequantisation"),
    ("_nf4_matmul_kernel", "NF4 dequantisation"),
    ("void kDequantizeBlockwise<__nv_bfloat16, 512, 64, 8, 2>(float*, unsigned char*, float*, __nv_bfloat16*, int, int)",
     "NF4 dequantisation"),
    ("void flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<Flash_bwd_kernel_traits<128, 64, 128, 8, 2, 4, 2, false, "
     "false, cutlass::bfloat16_t>, true, false, false, false, false, true, false, false>(flash::Flash_bwd_params)",
     "attention"),
    ("nvjet_tst_192x192_64x3_1x2_h_bz_coopB_TNT", "GEMM"),
])
def test_kernels_land_in_their_rows(kernel, expected):
    assert profile_e2e.category(kernel) == expected

# Source this at the start of a command on the GPU machine (bare image, no network):
#   . benchmarks/device_env.sh
# Installs carried wheels (.whl/: liger-kernel, cut-cross-entropy, peft, ...) into /tmp/site. The package is one
# importable tree (liger_models/ holds kernels/ and convert/), so the repository root on PYTHONPATH is all it needs.
# Sourced once per command: a child shell that sources it again (device_session.sh under device_lanes.sh) finds
# everything exported already and does nothing.
if [ -z "${LIGER_DEVICE_ENV:-}" ]; then
export PYTHONUNBUFFERED=1 LIGER_BENCH_PLOTS=0 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || echo "wheel install failed" >&2
fi
export PYTHONPATH=$PWD:/tmp/site${PYTHONPATH:+:$PYTHONPATH}
# Inductor's and Triton's caches inside the (git-ignored) tree: a machine kept warm keeps ignored files between calls,
# so a compile that one call could not finish is found cached by the next call on the same machine.
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-$PWD/.devcache/inductor}
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$PWD/.devcache/triton}
python3 - <<'PY'
import torch, triton
import liger_models.kernels, liger_models.convert  # noqa: F401 - fails loudly if the tree is not importable
print("torch", torch.__version__, "triton", triton.__version__, "gpu", torch.cuda.get_device_name())
PY
export LIGER_DEVICE_ENV=1
fi

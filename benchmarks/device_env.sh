# Source this at the start of a command on the GPU machine (bare image, no network):
#   . benchmarks/device_env.sh
# Installs carried wheels (.whl/: liger-kernel, cut-cross-entropy) into /tmp/site and makes the
# repository importable as liger_models (kernels/ -> liger_models.kernels, convert/ -> liger_models.convert)
# through a symlinked shim, since the image has no network for a build backend.
# Sourced once per command: a child shell that sources it again (device_session.sh under device_lanes.sh) finds
# everything exported already and does nothing.
if [ -z "${LIGER_DEVICE_ENV:-}" ]; then
export PYTHONUNBUFFERED=1 LIGER_BENCH_PLOTS=0 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || echo "wheel install failed" >&2
fi
# pytest puts the repository root first on sys.path, where liger_models/ has no kernels/ inside: an editable
# install adds the finder that maps liger_models.kernels -> kernels/ (setuptools is in the image; no network).
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >/tmp/editable.log 2>&1 \
  || { echo "editable install failed:" >&2; tail -5 /tmp/editable.log >&2; }
rm -rf /tmp/shim && mkdir -p /tmp/shim/liger_models
for f in liger_models/*; do ln -s "$PWD/$f" /tmp/shim/liger_models/; done
ln -s "$PWD/kernels" /tmp/shim/liger_models/kernels
ln -s "$PWD/convert" /tmp/shim/liger_models/convert
export PYTHONPATH=/tmp/shim:$PWD:/tmp/site${PYTHONPATH:+:$PYTHONPATH}
python3 - <<'PY'
import torch, triton
import liger_models.kernels, liger_models.convert  # noqa: F401 - fails loudly if the mapping is missing
print("torch", torch.__version__, "triton", triton.__version__, "gpu", torch.cuda.get_device_name())
PY
export LIGER_DEVICE_ENV=1
fi

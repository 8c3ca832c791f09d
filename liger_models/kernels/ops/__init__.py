"""One module per op, each in the same order: math and HF numerics in the docstring, ``<op>_reference`` in PyTorch,
``@triton.jit`` kernels, launchers, the autograd.Function, the functional op, then a thin ``nn.Module``. The modules
with a leading underscore are shared pieces of the loss and norm kernels. The functional ops and modules are exported
from ``liger_models.kernels``; import from here for an op's reference or its ``TUNING``."""

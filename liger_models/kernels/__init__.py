"""Triton kernels with forward and backward passes, each beside its PyTorch reference.

Installed as ``liger_models.kernels``. Every op follows one layout: math and HF numerics in the module
docstring, ``<op>_reference`` in PyTorch, ``@triton.jit`` kernels, launchers, the autograd.Function, the
functional API, then a thin ``nn.Module``. CUDA tensors run Triton; CPU tensors run the reference, or the
real kernel under ``TRITON_INTERPRET=1``.
"""

"""liger_kernel.transformers: only the loss modules and functional API of Liger's loss tests."""

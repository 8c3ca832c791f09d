"""A stand-in for Liger-Kernel's package, test-time only: the names Liger's loss tests import
(test/transformers/test_cross_entropy.py, test_fused_linear_cross_entropy.py), each implemented on liger_models'
kernels. The mapping and every refusal are in _ours.py; ../../run.py says how the tests are run against it.

Not the real liger_kernel: the harness checks that this package, not an installed one, is what the tests import.
"""

SHIM = True

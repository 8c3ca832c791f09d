import pytest

from liger_models.kernels import _dispatch


@pytest.fixture(autouse=True)
def reference_kernels(request, monkeypatch):
    """Run CPU kernels through their PyTorch references: the kernels have their own tests, and Triton's interpreter
    makes every tiny forward take ~1 s. Tests that request `interpreted_kernels` keep the interpreter.

    This patches the dispatch decision only; TRITON_INTERPRET itself must not change mid-session, because
    `triton.jit` reads it when a kernel module is first imported.
    """
    if "interpreted_kernels" not in request.fixturenames:
        monkeypatch.setattr(_dispatch, "interpreting", lambda: False)


@pytest.fixture
def interpreted_kernels():
    """Marker fixture: keep the real Triton kernels (interpreted on CPU, as tests/conftest.py sets up)."""

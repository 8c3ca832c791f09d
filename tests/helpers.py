"""Shared test helpers: poisoned outputs and the per-dtype tolerance protocol of the kernel tests
(docs/kernels.md#correctness-protocol); the tiny model and text the training and CLI tests run on."""

from __future__ import annotations

import importlib.resources
import weakref
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from liger_models import LigerLlamaForCausalLM, LlamaConfig
from liger_models.text.bpe import save_tokenizer, train_bpe_tokenizer

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# GPU tests that hold tens of GiB. `pytest -m gpu -n 4 --dist loadgroup` gives them all to one worker, so they run one
# at a time instead of four such tests together running the GPU out of memory.
BIG_MEMORY = pytest.mark.xdist_group("gpu_big_memory")
# Tests that run the Triton kernels on CPU tensors through Triton's interpreter (what CI checks). On a machine with a
# GPU tests/conftest.py leaves TRITON_INTERPRET off (triton reads it once, at import), so CPU tensors take the PyTorch
# reference path there and these tests' premise is gone: the same paths run compiled in the `pytest -m gpu` tests.
INTERPRETER_ONLY = pytest.mark.skipif(torch.cuda.is_available(), reason="Triton interpreter on CPU tensors: off on a "
                                      "machine with a GPU (the kernels run compiled in `pytest -m gpu`)")


def poison_(t: torch.Tensor) -> torch.Tensor:
    """Fill ``t`` with NaN (or the dtype's max for integers) so an element the kernel forgets to write fails."""
    if t.dtype.is_floating_point:
        return t.fill_(float("nan"))
    return t.fill_(torch.iinfo(t.dtype).max)


def rel_l2(out: torch.Tensor, ref: torch.Tensor, chunk: int = 1 << 24) -> float:
    """‖out − ref‖₂ / ‖ref‖₂ in float64 (NaN in ``out`` gives NaN, which fails every comparison).

    Summed over float64 chunks of ``chunk`` elements: whole float64 copies of a real-width expert gradient (a 7 GiB
    tensor for Mixtral's two layers) ran an 80 GiB GPU out of memory in the suite's parity tests."""
    out, ref = torch.broadcast_tensors(out.detach(), ref.detach())
    out, ref = out.reshape(-1), ref.reshape(-1)
    num = torch.zeros((), dtype=torch.float64, device=out.device)
    den = torch.zeros((), dtype=torch.float64, device=ref.device)
    for s in range(0, out.numel(), chunk):
        r = ref[s : s + chunk].double()
        num += (out[s : s + chunk].double() - r).square().sum()
        den += r.square().sum()
    denom = den.sqrt().item()
    return num.sqrt().item() / (denom if denom > 0 else 1.0)


def assert_matches(out: torch.Tensor, ref64: torch.Tensor, *, eager: torch.Tensor | None = None, name: str = "out",
                   scale_floor: float = 0.0, roundings: int = 1):
    """Check ``out`` against a float64 reference with the tolerances of docs/kernels.md#correctness-protocol.

    float32: max abs error ≤ 1e-5 × the reference's scale, max|ref| (at least ``scale_floor``: an output that is a
    cancellation of larger fp32 values, such as a loss near 0 from logits near 30, is only as accurate as those
    values' scale), or, when the eager fp32 result is given, no more than 2× its max error (a gradient through a
    whole model's attention backward, which fp32 arithmetic itself computes to only ~1e-5 of its scale).
    bf16/fp16: relative L2 error ≤ 1e-2 and, when the eager PyTorch result in the same low precision is given, no
    more than 2× its error, with a floor of ``roundings`` worst-case roundings to the dtype (half an ulp, 2⁻⁸
    relative in bf16): an output whose definition rounds an intermediate as well (the Llama-cast
    norms round x̂ to the input dtype before the weight, as HF does) may carry two. Where eager itself misses 1e-2
    (an ill-conditioned sum on these random inputs: one CI seed's linear-CE dh, eager and ours alike at 1.04e-2), the
    2× bound stands alone, never past 5e-2.
    """
    assert out.shape == ref64.shape, f"{name}: shape {tuple(out.shape)} != {tuple(ref64.shape)}"
    assert not torch.isnan(out).any(), f"{name}: NaN in output (unwritten element or overflow)"
    if out.dtype == torch.float32 or out.dtype == torch.float64:
        scale = max(scale_floor, ref64.abs().max().item() if ref64.numel() else 0.0)
        err = (out.double() - ref64.double()).abs().max().item() if out.numel() else 0.0
        bound = 1e-5 * scale
        if eager is not None:  # an output fp32 arithmetic itself cannot give to 1e-5: within 2x eager fp32's error
            bound = max(bound, 2 * (eager.double() - ref64.double()).abs().max().item())
        assert err <= bound, f"{name}: fp32 max abs err {err:.3e} > {bound:.3e}"
        return
    err = rel_l2(out, ref64)
    eager_err = None if eager is None else rel_l2(eager, ref64)
    cap = 1e-2 if eager_err is None else min(max(1e-2, 2 * eager_err), 5e-2)
    assert err <= cap, f"{name}: {out.dtype} rel L2 err {err:.3e} > {cap:.3e}"
    if eager is not None:
        # 2x eager's error, with a rounding floor so exact-ish eager results do not demand the impossible.
        bound = max(2 * eager_err, roundings * (4e-3 if out.dtype == torch.bfloat16 else 5e-4))
        assert err <= bound, f"{name}: {out.dtype} rel L2 err {err:.3e} > 2x eager's {eager_err:.3e}"


def assert_same_bits_every_run(run, inputs: dict, names: list[str], repeats: int = 3) -> None:
    """``run(**inputs)`` returns tensors (outputs, gradients, updated state), one per name in ``names``: run on fresh
    copies of the same inputs (in-place updates and ``.grad`` start over), it must give the same bits every time.
    No kernel of the package sums in a run-dependent order, so a difference is a race (docs/kernels.md); two NaNs in
    the same place agree."""

    def fresh() -> dict:
        return {k: x.detach().clone().requires_grad_(x.requires_grad) if isinstance(x, torch.Tensor) else x
                for k, x in inputs.items()}

    first = [t.detach().clone() for t in run(**fresh())]
    assert len(first) == len(names)
    for _ in range(repeats - 1):
        for name, a, b in zip(names, first, run(**fresh()), strict=True):
            differ = (a != b).sum().item()
            if a.is_floating_point():
                differ -= (torch.isnan(a) & torch.isnan(b)).sum().item()
            assert differ == 0, f"{name}: {differ} of {a.numel()} elements differ between runs"


EOS = "<|endoftext|>"


def shakespeare(chars: int) -> str:
    return importlib.resources.files("liger_models.data").joinpath("tiny_shakespeare.txt").read_text()[:chars]


def make_tiny_model_dir(path: Path, *, tie: bool = False, vocab: int = 320) -> Path:
    """A tiny random Llama (hidden 64, 2 layers, GQA) + tokenizer saved in HF format under ``path``."""
    tokenizer = train_bpe_tokenizer(shakespeare(60_000).splitlines(), vocab_size=vocab, eos_token=EOS)
    config = LlamaConfig.tiny(vocab_size=tokenizer.get_vocab_size(), bos_token_id=None,
                              eos_token_id=tokenizer.token_to_id(EOS), pad_token_id=None, tie_word_embeddings=tie)
    LigerLlamaForCausalLM.from_config(config).save_pretrained(path)
    save_tokenizer(tokenizer, path, eos_token=EOS)
    return path


class SavedBytes(torch.autograd.graph.saved_tensors_hooks):
    """Within it, the distinct storages autograd saves for backward, by data pointer, those of ``exclude`` (the
    parameters, typically) left out; ``total``: their bytes."""

    def __init__(self, exclude=()):
        self.excluded = {t.untyped_storage().data_ptr() for t in exclude}
        self.storages: dict[int, int] = {}
        super().__init__(self._pack, lambda t: t)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        key = t.untyped_storage().data_ptr()
        if key not in self.excluded:
            self.storages[key] = t.untyped_storage().nbytes()
        return t

    def __enter__(self) -> SavedBytes:
        super().__enter__()
        return self

    @property
    def total(self) -> int:
        return sum(self.storages.values())


class LiveBytes(TorchDispatchMode):
    """Within it, the bytes of the tensor storages that ops create and that are still alive, and the largest such
    total (``peak``): the memory a computation needs beyond what existed before, exact on the CPU (no caching
    allocator, no rounding). A storage counts from the op that made it (one that none of the op's arguments has:
    not a view, not an in-place result) until its last tensor is gone."""

    def __init__(self):
        super().__init__()
        self.alive: dict[int, int] = {}
        self.total = self.peak = 0

    def _freed(self, key: int):
        self.total -= self.alive.pop(key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        given = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            key = storage.data_ptr()
            if storage.nbytes() and key not in given and key not in self.alive:
                self.alive[key] = storage.nbytes()
                self.total += storage.nbytes()
                self.peak = max(self.peak, self.total)
                weakref.finalize(storage, self._freed, key)
        return out


# A weight's gradient over MLP chunks is its rows' sum formed chunk by chunk (and each chunk's GEMMs may block their
# sums differently), so it equals the unchunked one up to the order of fp32 sums: ~1e-6 of the tensor's largest
# element. Element by element a small entry of a large gradient can differ by more than 1e-5 of itself (one CI seed
# of tests/lora/test_training.py: -3.775e-4 against -3.774e-4, 8e-7 of that tensor's max), so the bound is on the
# tensor's scale; a chunk computed wrongly is off by its own size.
CHUNKED_GRAD_REL = 1e-5


def run_two_ranks(args: list[str], env: dict[str, str], timeout: float = 300) -> None:
    """``python -m torch.distributed.run --standalone --nproc-per-node 2 <args>`` (gloo on the CPU) to completion,
    failing with the end of its output. It runs in a session of its own, killed whole past ``timeout``: killing
    torchrun alone left its ranks running, one of them spinning on a core for the rest of the test run."""
    import os
    import signal
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", *args]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise AssertionError(f"torchrun did not finish in {timeout} s: {out[-3000:]}{err[-3000:]}") from None
    assert proc.returncode == 0, out[-3000:] + err[-3000:]

"""bench_moe.py times what a training step does: each run forms fresh gradients, never adding into .grad."""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import bench_moe  # noqa: E402

from liger_models import MixtralConfig  # noqa: E402
from liger_models.modules.moe import SparseMoeBlock  # noqa: E402


def test_each_run_returns_the_gradients_of_one_step_and_accumulates_nothing():
    block = SparseMoeBlock(MixtralConfig.tiny())
    with torch.no_grad():  # built empty, as bench_moe fills it
        for p in block.parameters():
            p.normal_(0.0, 0.02)
    x = torch.randn(1, 9, block.gate.in_features, requires_grad=True)
    dy = torch.randn_like(x)
    run = bench_moe.step(block, x, dy)
    first, second = run(), run()
    assert x.grad is None and all(p.grad is None for p in block.parameters())
    out = block(x)
    out.backward(dy)  # one plain step: what every run must equal
    expected = [x.grad, *(p.grad for p in block.parameters())]
    assert len(first) == len(expected) == 2 + len(list(block.experts.parameters()))
    for got_first, got_second, want in zip(first, second, expected):
        torch.testing.assert_close(got_first, want, rtol=0, atol=0)
        torch.testing.assert_close(got_second, want, rtol=0, atol=0)


def test_the_unfused_providers_switch_the_one_pass_kernels_off_and_leave_the_defaults(monkeypatch):
    # bench_moe's liger-models-unfused(-backward) switch the shipped one-pass kernels off for their runs only; their
    # gradients are the default layer's (the sums and row dots in another order: fp32 rounding apart).
    from liger_models.kernels.ops import gated_mlp, slot_sum

    block = SparseMoeBlock(MixtralConfig.tiny())
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0.0, 0.02)
    x = torch.randn(1, 9, block.gate.in_features, requires_grad=True)
    dy = torch.randn_like(x)
    seen = []
    original = gated_mlp.gated_backward_scaled

    def spy(*args, **kwargs):
        seen.append((gated_mlp.TUNING.fuse_scaled_backward, slot_sum.TUNING.fused))
        return original(*args, **kwargs)

    defaults = (gated_mlp.TUNING, slot_sum.TUNING)
    monkeypatch.setattr("liger_models.modules.moe.gated_backward_scaled", spy)
    shipped = bench_moe.step(block, x, dy)()
    unfused_backward = bench_moe._unfused(bench_moe.step(block, x, dy), sums=False)()
    unfused = bench_moe._unfused(bench_moe.step(block, x, dy))()
    assert seen == [(True, True), (False, True), (False, False)]
    assert (gated_mlp.TUNING, slot_sum.TUNING) == defaults
    for other in (unfused_backward, unfused):
        for a, b in zip(other, shipped):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)

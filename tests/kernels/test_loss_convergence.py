"""Training with the fused loss follows training with the reference loss (docs/kernels.md#correctness-protocol).

A tiny model (embedding → linear → tanh → fused linear-CE head) learns a fixed next-token rule (16 input tokens
mapped across a 67-token vocabulary) for a few dozen SGD-with-momentum steps, once with
`fused_linear_cross_entropy` (Triton kernel; several token chunks per step) and once with the eager reference, from
the same initial weights and batches.
fp32: the loss curves and final weights agree to fp32 precision.
bf16 (weights, activations and updates in bf16): the kernel tests' rule "no worse than 2× eager bf16's error",
applied to training and measured against an fp32 reference run, over BF16_RUNS independent runs (data and initial
weights) whose errors are summed. Final weights: within 2× the eager bf16 runs' relative L2 distance. Loss curve:
the largest per-step relative error within 3× eager's; the curve error is a handful of correlated samples of two
independent bf16 trajectories, so its ratio scatters more. Every run must actually learn.
"""

from __future__ import annotations

import torch
from torch import nn

import liger_models.kernels.ops.fused_linear_cross_entropy as flce_mod
from liger_models.kernels.ops.fused_linear_cross_entropy import (
    fused_linear_cross_entropy,
    fused_linear_cross_entropy_reference,
)
from tests.helpers import DEVICE, rel_l2

VOCAB, HIDDEN, TOKENS, STEPS = 67, 16, 8, 24
# Inputs come from a pool of 16 tokens (their labels spread over the vocabulary), so each one recurs ~12 times and
# the model learns the rule within the run. Drawn from all 67, most tokens of the last batches had been seen once or
# never: the reference's own "did it learn" ratio reached 0.79 of the first losses in 300 seeds and 0.84 in one CI
# run (seed 933595507); with the pool it stays under 0.34.
TOKEN_POOL = 16
# bf16: two bf16 trajectories drift apart chaotically, so one run's error is a random draw. The ratio of the fused
# run's error to eager bf16's scattered up to 2.7 (loss curve) and 1.95 (weights) over 120 single runs. Summed over
# 3 independent runs, it stays under 1.7 and 1.35 (40 groups), against the bounds of 3 and 2.
BF16_RUNS = 3


class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.proj = nn.Linear(HIDDEN, HIDDEN)
        self.head = nn.Parameter(torch.randn(VOCAB, HIDDEN) / HIDDEN**0.5)

    def forward(self, tokens, labels, loss_fn):
        hidden = torch.tanh(self.proj(self.embed(tokens)))  # (TOKENS, HIDDEN)
        return loss_fn(hidden, self.head, labels, label_smoothing=0.05, z_loss=1e-4)


def _train(model, batches, loss_fn):
    opt = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    losses = []
    for tokens, labels in batches:
        opt.zero_grad(set_to_none=True)
        loss = model(tokens, labels, loss_fn)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return torch.tensor(losses, dtype=torch.float64), [p.detach().clone() for p in model.parameters()]


def _task():
    """One run's data and initial weights: STEPS batches of the rule, one label per batch ignored."""
    batches = []
    for _ in range(STEPS):
        tokens = torch.randint(0, TOKEN_POOL, (TOKENS,), device=DEVICE)
        labels = (tokens * 5 + 3) % VOCAB  # a rule the model can learn
        labels[torch.randint(0, TOKENS, (1,))] = -100
        batches.append((tokens, labels))
    return batches, TinyLM().to(DEVICE).state_dict()


def _run(task, loss_fn, run_dtype):
    batches, init = task
    model = TinyLM().to(DEVICE)
    model.load_state_dict(init)
    losses, params = _train(model.to(run_dtype), batches, loss_fn)
    assert losses[-4:].mean() < 0.8 * losses[:4].mean(), f"{loss_fn.__name__} ({run_dtype}) did not learn"
    return losses, params


def _three_chunks_per_step(tune, dtype):
    tune(flce_mod, logits_budget_bytes=3 * VOCAB * dtype.itemsize)
    tune(flce_mod, grad_weight_as_scratch=False)


def test_fused_loss_trains_like_reference_fp32(tune):
    _three_chunks_per_step(tune, torch.float32)
    task = _task()
    ref_losses, ref_params = _run(task, fused_linear_cross_entropy_reference, torch.float32)
    losses, params = _run(task, fused_linear_cross_entropy, torch.float32)
    torch.testing.assert_close(losses, ref_losses, rtol=1e-5, atol=1e-5)
    for p, r in zip(params, ref_params):
        assert (p - r).abs().max().item() <= 1e-5 * max(1.0, r.abs().max().item())


def test_fused_loss_trains_like_reference_bf16(tune):
    _three_chunks_per_step(tune, torch.bfloat16)
    loss_err = eager_loss_err = 0.0
    n_params = len(list(TinyLM().parameters()))
    param_err, eager_param_err = [0.0] * n_params, [0.0] * n_params
    for _ in range(BF16_RUNS):
        task = _task()
        ref_losses, ref_params = _run(task, fused_linear_cross_entropy_reference, torch.float32)
        losses, params = _run(task, fused_linear_cross_entropy, torch.bfloat16)
        eager_losses, eager_params = _run(task, fused_linear_cross_entropy_reference, torch.bfloat16)
        loss_err += ((losses - ref_losses).abs() / ref_losses).max().item()
        eager_loss_err += ((eager_losses - ref_losses).abs() / ref_losses).max().item()
        for i, (p, e, r) in enumerate(zip(params, eager_params, ref_params)):
            param_err[i] += rel_l2(p, r.double())
            eager_param_err[i] += rel_l2(e, r.double())
    assert loss_err <= 3 * eager_loss_err + 1e-4, f"loss curves: {loss_err:.2e} vs eager bf16's {eager_loss_err:.2e}"
    for i, (err, eager_err) in enumerate(zip(param_err, eager_param_err)):
        assert err <= 2 * eager_err, f"parameter {i}: rel L2 {err:.2e} vs eager bf16's {eager_err:.2e}"

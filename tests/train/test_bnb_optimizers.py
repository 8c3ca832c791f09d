"""bitsandbytes' AdamW variants behind ``build_optimizer`` (train/bnb_optim.py): AdamW's math (fp32 moments exactly,
8-bit ones within their rounding), the state they keep, a step inside backward bit for bit, and the refusals."""

from __future__ import annotations

import sys

import pytest
import torch

from liger_models import AutoLigerForCausalLM
from liger_models.train.bnb_optim import BNB_OPTIMIZERS, check_optimizer, import_bitsandbytes
from liger_models.train.optim import build_optimizer, decay_param_groups, trained_embeddings
from liger_models.train.step_in_backward import OptimizerInBackward
from tests.lora.bnb import import_bnb

needs_bnb = pytest.mark.skipif(import_bnb() is None, reason="bitsandbytes does not import here")
LR = 1e-2


def _six_steps(make, w0, b0, grads):
    """A [96, 80] matrix (decayed, 7680 elements: 8-bit state) and an 80-vector (not decayed, under bitsandbytes'
    4096-element minimum for 8 bits) after six steps of the same gradients."""
    w, b = torch.nn.Parameter(w0.clone()), torch.nn.Parameter(b0.clone())
    opt = make([{"params": [w], "lr": LR, "weight_decay": 0.1}, {"params": [b], "lr": LR, "weight_decay": 0.0}])
    for gw, gb in grads:
        w.grad, b.grad = gw.clone(), gb.clone()
        opt.step()
    return opt, w.detach(), b.detach()


@needs_bnb
@pytest.mark.parametrize("name", sorted(BNB_OPTIMIZERS))
def test_adamw_math_and_state(name):
    """Against torch's fp32 AdamW with the same groups: fp32 moments (paged_adamw_32bit) equal to rounding; 8-bit
    ones within a few percent of one step's size on average (an element whose rounded moments differ most: about one
    step's, of the six), and not equal (the moments really are 8-bit); the small
    tensor keeps fp32 moments either way. The state is bitsandbytes': uint8 codes + block scales for 8 bits."""
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    w0, b0 = torch.randn(96, 80, generator=g), torch.randn(80, generator=g)
    grads = [(torch.randn(96, 80, generator=g) * (1 + 3 * torch.rand(96, 1, generator=g)),
              torch.randn(80, generator=g)) for _ in range(6)]
    _, w_ref, b_ref = _six_steps(lambda groups: torch.optim.AdamW(groups, betas=(0.9, 0.95), eps=1e-8), w0, b0, grads)
    opt, w, b = _six_steps(lambda groups: build_optimizer(name, groups, betas=(0.9, 0.95), eps=1e-8), w0, b0, grads)
    assert (w_ref - w0).abs().max() > 4 * LR  # the comparison below is about steps that moved the weights
    assert torch.allclose(b, b_ref, rtol=0, atol=1e-6)
    state = opt.state[opt.param_groups[0]["params"][0]]
    if name.endswith("8bit"):
        assert state["state1"].dtype == state["state2"].dtype == torch.uint8
        assert state["state1"].shape == w.shape and state["absmax1"].numel() == -(-w.numel() // 256)
        error = (w - w_ref).abs() / LR  # over 300 seeds at most 0.027 on average and 0.92 at one element
        assert 0 < error.mean() < 0.05 and error.max() < 1.5, (error.mean(), error.max())
    else:
        assert state["state1"].dtype == torch.float32
        assert torch.allclose(w, w_ref, rtol=0, atol=1e-6)


@needs_bnb
def test_embeddings_keep_32bit_moments_and_no_global_setting_leaks_in():
    """``embeddings`` stay 32-bit in an 8-bit optimizer (bitsandbytes' advice, HF Trainer's rule); a setting left in
    bitsandbytes' process-wide manager by someone else (HF Trainer registers its embeddings there, by position too)
    does not reach our optimizer, nor does ours reach it."""
    bnb = import_bnb()
    shared = bnb.optim.GlobalOptimManager.get_instance()
    left_over = {(0, 0): {"optim_bits": 32}, (0, 1): {"optim_bits": 32}}
    shared.index2config.update(left_over)
    try:
        embed, matrix = torch.nn.Parameter(torch.randn(512, 16)), torch.nn.Parameter(torch.randn(64, 128))
        opt = build_optimizer("adamw_8bit", [{"params": [matrix, embed], "lr": LR, "weight_decay": 0.0}],
                              embeddings=[embed])
        for p in (matrix, embed):
            p.grad = torch.randn_like(p)
        opt.step()
        assert opt.state[matrix]["state1"].dtype == torch.uint8
        assert opt.state[embed]["state1"].dtype == opt.state[embed]["state2"].dtype == torch.float32
        assert id(embed) not in shared.pid2config and shared.index2config == left_over
    finally:
        for key in left_over:
            shared.index2config.pop(key, None)


@needs_bnb
@pytest.mark.usefixtures("reference_path")
def test_step_inside_backward_is_bit_identical(tiny_model_dir):
    """--optimizer-in-backward with an 8-bit optimizer (32-bit embeddings): the same weights as a normal step, every
    step (the step inside backward sees one parameter at a time, at position (group, 0))."""
    normal, fused = (AutoLigerForCausalLM.from_pretrained(tiny_model_dir) for _ in range(2))
    opt_n, opt_f = (build_optimizer("adamw_8bit", decay_param_groups(m, lr=3e-3, weight_decay=0.1), betas=(0.9, 0.95),
                                    embeddings=trained_embeddings(m)) for m in (normal, fused))
    hooks = OptimizerInBackward(opt_f)
    vocab = normal.config.vocab_size
    for step in range(3):
        ids = torch.randint(0, vocab, (2, 12))
        normal(ids, labels=ids).loss.backward()
        opt_n.step()
        opt_n.zero_grad(set_to_none=True)
        fused(ids, labels=ids).loss.backward()
        assert all(p.grad is None for p in fused.parameters())
        for (name, pn), pf in zip(normal.named_parameters(), fused.parameters()):
            assert torch.equal(pn, pf), f"step {step}: {name} differs"
    hooks.remove()


def test_conflicts_are_named_before_anything_loads():
    with pytest.raises(ValueError, match="choose from adamw, adamw_8bit"):
        check_optimizer("sgd", distributed=False, cuda_graph=False)
    with pytest.raises(ValueError, match=r"FSDP2 .*DTensor.*--cuda-graph.*--adamw torch"):
        check_optimizer("adamw_8bit", distributed=True, cuda_graph=True, adamw="torch")
    check_optimizer("adamw", distributed=True, cuda_graph=True, adamw="torch")  # AdamW takes all of them
    with pytest.raises(ValueError, match="CUDA graph"):
        build_optimizer("paged_adamw_32bit", [{"params": [torch.nn.Parameter(torch.zeros(2))], "lr": 1.0}],
                        capturable=True)


def test_missing_bitsandbytes_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # `import bitsandbytes` raises ImportError
    with pytest.raises(ImportError, match="pip install bitsandbytes"):
        import_bitsandbytes()
    with pytest.raises(ValueError, match="--optimizer adamw_8bit: bitsandbytes does not import .*pip install"):
        check_optimizer("adamw_8bit", distributed=False, cuda_graph=False)
    with pytest.raises(ImportError, match="pip install bitsandbytes"):
        build_optimizer("adamw_8bit", [{"params": [torch.nn.Parameter(torch.zeros(2))], "lr": 1.0}])

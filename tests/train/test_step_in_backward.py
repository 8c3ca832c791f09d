"""The optimizer step inside backward: same weights as a normal step, bit for bit, with gradients freed early."""

from __future__ import annotations

import pytest
import torch

from liger_models import AutoLigerForCausalLM
from liger_models.train.optim import build_adamw, build_scheduler, decay_param_groups
from liger_models.train.step_in_backward import OptimizerInBackward
from tests.helpers import INTERPRETER_ONLY


def _pair(model_dir):
    a, b = AutoLigerForCausalLM.from_pretrained(model_dir), AutoLigerForCausalLM.from_pretrained(model_dir)
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert torch.equal(pa, pb)
    return a, b


def _optimizer(model):
    opt = build_adamw(decay_param_groups(model, lr=3e-3, weight_decay=0.1))
    return opt, build_scheduler(opt, warmup_steps=2, max_steps=6)


@pytest.mark.parametrize("path", ["reference", "triton"])
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_bit_identical_to_a_normal_step(path, tied, tiny_model_dir, tiny_tied_model_dir, monkeypatch):
    """AdamW with weight-decay groups and a warmup/cosine LR: every weight equal after every step (the tied
    embedding gets two accumulations per backward; on the Triton path the lm_head gradient is made in forward)."""
    if path == "reference":
        monkeypatch.setenv("TRITON_INTERPRET", "0")
    normal, fused = _pair(tiny_tied_model_dir if tied else tiny_model_dir)
    opt_n, sched_n = _optimizer(normal)
    opt_f, sched_f = _optimizer(fused)
    hooks = OptimizerInBackward(opt_f)
    live = []

    def count_live(_):
        live.append(sum(p.grad is not None for p in fused.parameters()))

    for p in fused.parameters():
        p.register_post_accumulate_grad_hook(count_live)
    vocab = normal.config.vocab_size
    for step in range(4):
        ids = torch.randint(0, vocab, (2, 12))
        normal(ids, labels=ids).loss.backward()
        opt_n.step()
        sched_n.step()
        opt_n.zero_grad(set_to_none=True)
        live.clear()
        fused(ids, labels=ids).loss.backward()
        sched_f.step()
        assert all(p.grad is None for p in fused.parameters()), "every gradient is consumed by the step"
        assert max(live) <= 2, f"gradients were not freed as they were used: {max(live)} alive at once"
        for (name, pn), pf in zip(normal.named_parameters(), fused.parameters()):
            assert torch.equal(pn, pf), f"step {step}: {name} differs"
    assert opt_f.state_dict()["state"].keys() == opt_n.state_dict()["state"].keys()
    hooks.remove()


def test_multiple_uses_are_one_update():
    """Two uses of one weight reach the hook as one summed gradient: SGD moves it by lr × the whole gradient."""
    lin = torch.nn.Linear(4, 4)
    ref = torch.nn.Linear(4, 4)
    ref.load_state_dict(lin.state_dict())
    OptimizerInBackward(torch.optim.SGD(lin.parameters(), lr=0.1))
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    x = torch.randn(3, 4)
    lin(lin(x)).square().sum().backward()
    ref(ref(x)).square().sum().backward()
    opt.step()
    assert torch.equal(lin.weight, ref.weight) and torch.equal(lin.bias, ref.bias)


def test_reentrant_checkpoint_raises():
    """A nested backward (reentrant checkpointing) delivers a second gradient after the update: refuse it."""
    from torch.utils.checkpoint import checkpoint

    lin = torch.nn.Linear(4, 4)
    OptimizerInBackward(torch.optim.SGD(lin.parameters(), lr=0.1))
    x = torch.randn(3, 4, requires_grad=True)
    with pytest.raises(RuntimeError, match="second gradient"):
        (checkpoint(lin, x, use_reentrant=True) + lin(x)).sum().backward()


class _FailingBackward(torch.autograd.Function):
    fail = True

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        if _FailingBackward.fail:
            raise RuntimeError("backward failed")
        return grad


def test_backward_that_raises_leaves_the_next_step_working():
    """A backward that raises after some parameters were stepped (an OOM the trainer skips) ends without its
    end-of-backward callback: those updates stay done, once, and the next step runs as a normal one would."""
    a, b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
    ref_a, ref_b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
    ref_a.load_state_dict(a.state_dict())
    ref_b.load_state_dict(b.state_dict())
    OptimizerInBackward(torch.optim.SGD([*a.parameters(), *b.parameters()], lr=0.1))
    ref_opt = torch.optim.SGD([*ref_a.parameters(), *ref_b.parameters()], lr=0.1)
    x = torch.randn(3, 4)
    _FailingBackward.fail = True
    with pytest.raises(RuntimeError, match="backward failed"):
        b(_FailingBackward.apply(a(x))).sum().backward()
    ref_b(ref_a(x)).sum().backward()
    ref_a.zero_grad(set_to_none=True)  # only b (after the failing op) got its gradient and step
    ref_opt.step()
    ref_opt.zero_grad(set_to_none=True)
    _FailingBackward.fail = False
    for _ in range(2):
        b(_FailingBackward.apply(a(x))).sum().backward()
        ref_b(ref_a(x)).sum().backward()
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
    for p, q in zip([*a.parameters(), *b.parameters()], [*ref_a.parameters(), *ref_b.parameters()]):
        assert torch.equal(p, q) and p.grad is None


def test_parameter_without_gradient_is_left_alone():
    a, b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
    opt = torch.optim.SGD([*a.parameters(), *b.parameters()], lr=0.1)
    OptimizerInBackward(opt)
    before = b.weight.detach().clone()
    for _ in range(2):
        a(torch.randn(2, 4)).sum().backward()
    assert torch.equal(b.weight, before) and a.weight.grad is None


def test_medusa_stage2_cli_same_run_and_resume(tiny_model_dir, text_file, tmp_path, monkeypatch):
    """`train-medusa --stage 2` (heads at 4× LR in their own groups) with --optimizer-in-backward: the same losses
    and checkpoint as the normal step; a run cut after its step-3 checkpoint resumes to the same end."""
    from safetensors.torch import load_file

    from liger_models.recipes import train_medusa
    from tests.train.test_trainer import _args, run_until_crash

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    extra = ("--stage", "2", "--num-heads", "2", "--grad-accum", "1", "--max-grad-norm", "0")
    normal = train_medusa(_args("train-medusa", tiny_model_dir, text_file, tmp_path / "normal", *extra))
    fused = train_medusa(_args("train-medusa", tiny_model_dir, text_file, tmp_path / "fused", *extra,
                               "--optimizer-in-backward"))
    assert [m["loss"] for m in normal.history] == [m["loss"] for m in fused.history]
    assert all(m["grad_norm"] is None for m in fused.history)

    run_until_crash(monkeypatch, lambda: train_medusa(_args("train-medusa", tiny_model_dir, text_file, tmp_path / "cut",
                                                            *extra, "--optimizer-in-backward")))
    resumed = train_medusa(_args("train-medusa", tiny_model_dir, text_file, tmp_path / "cut", *extra,
                                 "--optimizer-in-backward", "--resume", "auto"))
    assert [m["loss"] for m in resumed.history] == [m["loss"] for m in normal.history[3:]]
    for name in sorted(p.name for p in normal.checkpoint.glob("*.safetensors")):
        for other in (fused, resumed):
            a, b = load_file(normal.checkpoint / name), load_file(other.checkpoint / name)
            assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name


@pytest.mark.parametrize("flags, problem", [(("--grad-accum", "2", "--max-grad-norm", "0"), "gradient accumulation"),
                                            (("--grad-accum", "1"), "clipping")])
def test_incompatible_settings_are_refused(flags, problem, tiny_model_dir, text_file, tmp_path, monkeypatch):
    from liger_models.recipes import train_causal_lm
    from tests.train.test_trainer import _args

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match=problem):
        train_causal_lm(_args("train", tiny_model_dir, text_file, tmp_path / "x", *flags, "--optimizer-in-backward"))


# ---------------------------------------------------------------------------------------------------------------
# Weights stepped in the forward (linear-CE hands their gradient over as soon as it has it)


def _medusa_pair(model_dir, stage, scheduler="constant"):
    from liger_models.medusa import MedusaModel

    pair = []
    for _ in range(2):
        torch.manual_seed(0)
        model = MedusaModel.from_base(AutoLigerForCausalLM.from_pretrained(model_dir), stage=stage, num_heads=2,
                                      scheduler=scheduler)
        opt = build_adamw(model.param_groups(3e-3, 4.0, 0.1))
        pair.append((model, opt, build_scheduler(opt, warmup_steps=2, max_steps=6)))
    return pair


@INTERPRETER_ONLY
@pytest.mark.parametrize("stage, scheduler", [(1, "constant"), (2, "constant"), (2, "linear")])
def test_medusa_weights_stepped_in_the_forward_bit_identical(stage, scheduler, tiny_model_dir):
    """Triton path (interpreter): each head's lm_head copy (and in stage 2 the untied base lm_head) is updated
    inside the forward, its gradient never reaching backward; every weight equals a normal step's after every step
    (a linear schedule starts at weight 0: a zero gradient, still a step for AdamW's moments and weight decay)."""
    from liger_models.train.trainer import MedusaTask

    (normal, opt_n, sched_n), (fused, opt_f, sched_f) = _medusa_pair(tiny_model_dir, stage, scheduler)
    early = MedusaTask.loss_weights_used_once(fused)
    assert len(early) == (2 if stage == 1 else 3)
    hooks = OptimizerInBackward(opt_f, in_forward=early)
    vocab = normal.config.vocab_size
    for step in range(3):
        ids = torch.randint(0, vocab, (2, 12))
        normal(ids, labels=ids, step=step, max_steps=3).loss.backward()
        opt_n.step()
        sched_n.step()
        opt_n.zero_grad(set_to_none=True)
        before = [w.detach().clone() for w in early]
        loss = fused(ids, labels=ids, step=step, max_steps=3).loss
        assert all(not torch.equal(w, b) and w.grad is None for w, b in zip(early, before)), "not stepped in forward"
        loss.backward()
        sched_f.step()
        assert all(p.grad is None for p in fused.parameters())
        for (name, pn), pf in zip(normal.named_parameters(), fused.parameters()):
            assert torch.equal(pn, pf), f"step {step}: {name} differs"
    hooks.remove()


@INTERPRETER_ONLY
@pytest.mark.parametrize("tied, loss_factor, problem", [
    (True, 1, "second gradient in backward"),  # the embedding's gradient arrives after the tied weight's update
    (False, 2, "backpropagated with gradient 1"),  # the dW handed over in the forward missed the factor 2
])
def test_misuse_of_a_weight_stepped_in_the_forward_raises(tied, loss_factor, problem, tiny_model_dir,
                                                         tiny_tied_model_dir):
    model = AutoLigerForCausalLM.from_pretrained(tiny_tied_model_dir if tied else tiny_model_dir)
    opt, _ = _optimizer(model)
    OptimizerInBackward(opt, in_forward=[model.lm_head.weight])
    ids = torch.randint(0, model.config.vocab_size, (2, 12))
    with pytest.raises(RuntimeError, match=problem):
        (loss_factor * model(ids, labels=ids).loss).backward()


def test_in_forward_weights_must_be_in_the_optimizer(tiny_model_dir):
    model = AutoLigerForCausalLM.from_pretrained(tiny_model_dir)
    opt = build_adamw([{"params": [model.model.norm.weight], "lr": 1e-3}])
    with pytest.raises(ValueError, match="not in the optimizer"):
        OptimizerInBackward(opt, in_forward=[model.lm_head.weight])


def test_trainer_steps_head_weights_in_the_forward_on_the_kernel_path(tiny_model_dir, text_file, tmp_path):
    """`train-medusa --stage 2 --optimizer-in-backward` through the Triton kernels (interpreter): the trainer hands
    the heads' lm_heads and the untied base lm_head to linear-CE's forward consumer; losses and weights match the
    normal step's exactly."""
    from safetensors.torch import load_file

    from liger_models.recipes import train_medusa
    from tests.train.test_trainer import _args

    extra = ("--stage", "2", "--num-heads", "2", "--grad-accum", "1", "--max-grad-norm", "0", "--max-steps", "2")
    normal = train_medusa(_args("train-medusa", tiny_model_dir, text_file, tmp_path / "normal", *extra))
    fused = train_medusa(_args("train-medusa", tiny_model_dir, text_file, tmp_path / "fused", *extra,
                               "--optimizer-in-backward"))
    assert [m["loss"] for m in normal.history] == [m["loss"] for m in fused.history]
    for name in sorted(p.name for p in normal.checkpoint.glob("*.safetensors")):
        a, b = load_file(normal.checkpoint / name), load_file(fused.checkpoint / name)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name


@INTERPRETER_ONLY
def test_forward_whose_backward_never_ran_leaves_the_next_step_working(tiny_model_dir):
    """A forward that stepped the lm_head in the forward and then never reached backward (an OOM later in the
    forward that the loop skips, an exception before backward): that update stays done, once, and the next step runs
    as a normal one would, instead of raising 'second gradient' at every later step."""
    normal, fused = _pair(tiny_model_dir)
    opt_n, _ = _optimizer(normal)
    opt_f, _ = _optimizer(fused)
    OptimizerInBackward(opt_f, in_forward=[fused.lm_head.weight])
    vocab = normal.config.vocab_size
    first, second = torch.randint(0, vocab, (2, 2, 12))
    normal(first, labels=first).loss.backward()
    for p in normal.parameters():  # only the lm_head was stepped by the abandoned forward
        if p is not normal.lm_head.weight:
            p.grad = None
    opt_n.step()
    opt_n.zero_grad(set_to_none=True)
    normal(second, labels=second).loss.backward()
    opt_n.step()
    opt_n.zero_grad(set_to_none=True)
    abandoned = fused(first, labels=first).loss
    del abandoned
    fused(second, labels=second).loss.backward()
    for (name, pn), pf in zip(normal.named_parameters(), fused.parameters()):
        assert torch.equal(pn, pf) and pf.grad is None, name


@INTERPRETER_ONLY
def test_second_forward_while_the_first_loss_lives_raises_before_stepping(tiny_model_dir):
    """Two training forwards whose losses could be backpropagated together would step the lm_head twice for one
    backward: the second forward is refused while the first loss is alive, before it updates anything."""
    model = AutoLigerForCausalLM.from_pretrained(tiny_model_dir)
    opt, _ = _optimizer(model)
    OptimizerInBackward(opt, in_forward=[model.lm_head.weight])
    ids = torch.randint(0, model.config.vocab_size, (2, 2, 12))
    first = model(ids[0], labels=ids[0]).loss
    after_first = model.lm_head.weight.detach().clone()
    with pytest.raises(RuntimeError, match="second gradient"):
        model(ids[1], labels=ids[1])
    assert torch.equal(model.lm_head.weight, after_first)
    first.backward()  # the first step completes as usual

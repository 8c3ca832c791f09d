"""GraphedStep (liger_models/train/cuda_graph.py): a whole training step captured as a CUDA graph and replayed.

The contract checks run anywhere; capture and replay need a GPU (`pytest -m gpu`).
"""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from liger_models import AutoLigerForCausalLM
from liger_models.train.cuda_graph import GraphedStep


def _noop(batch):
    return None


def test_refuses_an_optimizer_that_reads_its_step_count_on_the_host():
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))])
    with pytest.raises(ValueError, match="capturable=True"):
        GraphedStep(_noop, opt)


def test_refuses_zero_warmup():
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], capturable=True)
    with pytest.raises(ValueError, match="warmup"):
        GraphedStep(_noop, opt, warmup=0)


def test_checks_labels_on_copy_in_and_wants_cuda_tensors():
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], capturable=True)
    graphed = GraphedStep(_noop, opt, label_keys={"labels": (10, -100)})
    with pytest.raises(ValueError, match="label 10 is outside the vocabulary"):
        graphed({"labels": torch.tensor([[1, -100, 10]])})
    with pytest.raises(ValueError, match="CUDA tensors"):
        graphed({"labels": torch.tensor([[1, -100, 9]])})
    assert graphed.calls == 0 and not graphed.captured


@pytest.mark.gpu
def test_replayed_steps_equal_eager_steps_bit_for_bit(tiny_tied_model_dir):
    """bf16, Triton kernels, fused capturable AdamW: 3 eager warm-up steps, a capture, then replays on new batches
    give the eager run's losses and weights exactly (SDPA's math backend: flash/cuDNN backwards use atomics)."""
    models = [AutoLigerForCausalLM.from_pretrained(tiny_tied_model_dir, dtype=torch.bfloat16, device="cuda")
              for _ in range(2)]
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3, weight_decay=0.1, fused=True, capturable=True)
            for m in models]

    def step_of(model, opt):
        def step(batch):
            with sdpa_kernel(SDPBackend.MATH):
                loss = model(batch["ids"], labels=batch["labels"]).loss
                loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return {"loss": loss.detach()}
        return step

    eager = step_of(models[0], opts[0])
    vocab = models[0].config.vocab_size
    graphed = GraphedStep(step_of(models[1], opts[1]), opts[1], warmup=3, label_keys={"labels": (vocab, -100)})
    for i in range(8):
        ids = torch.randint(0, vocab, (4, 64), device="cuda")
        labels = ids.clone()
        labels[:, : i + 1] = -100  # a different count of ignored targets each step
        want = eager({"ids": ids, "labels": labels})["loss"].item()
        got = graphed({"ids": ids, "labels": labels})["loss"].item()
        assert got == want, (i, got, want)
        assert graphed.captured == (i >= 3)
        for (name, a), b in zip(models[0].named_parameters(), models[1].parameters()):
            assert torch.equal(a, b), (i, name)
    bad = torch.full((4, 64), vocab, device="cuda")
    with pytest.raises(ValueError, match="outside the vocabulary"):
        graphed({"ids": ids, "labels": bad})
    with pytest.raises(ValueError, match="fixed shapes"):
        graphed({"ids": ids[:2], "labels": labels[:2]})


@pytest.mark.gpu
def test_graph_replays_a_changing_learning_rate(tiny_model_dir):
    """A tensor lr filled in place by an LR scheduler reaches the replayed fused AdamW step."""
    model = AutoLigerForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32, device="cuda")
    opt = torch.optim.AdamW(model.parameters(), lr=torch.tensor(1e-3, device="cuda"), fused=True, capturable=True)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.0 if s >= 5 else 1.0)
    ids = torch.randint(0, model.config.vocab_size, (2, 32), device="cuda")

    def step(batch):
        model(batch["ids"], labels=batch["ids"]).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    graphed = GraphedStep(step, opt, warmup=2)
    for _ in range(5):
        graphed({"ids": ids})
        sched.step()
    before = [p.detach().clone() for p in model.parameters()]
    graphed({"ids": ids})  # lr is 0 now and weight decay multiplies by 1 - lr·wd = 1: nothing may move
    assert graphed.captured
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


@pytest.mark.gpu
@pytest.mark.parametrize("stage", [1, 2])
def test_medusa_step_replays_bit_for_bit(tiny_tied_model_dir, stage):
    """Medusa (3 heads over shifted views, heads' lr × 4; stage 1 frozen base under no_grad) captures too."""
    from liger_models.medusa import MedusaModel

    def build():
        base = AutoLigerForCausalLM.from_pretrained(tiny_tied_model_dir, dtype=torch.bfloat16, device="cuda")
        torch.manual_seed(0)  # the heads' bias init
        model = MedusaModel.from_base(base, stage=stage, num_heads=3)
        return model, torch.optim.AdamW(model.param_groups(1e-3, 4.0), lr=1e-3, fused=True, capturable=True)

    (eager_model, eager_opt), (graph_model, graph_opt) = build(), build()

    def step_of(model, opt):
        def step(batch):
            with sdpa_kernel(SDPBackend.MATH):
                out = model(batch["ids"], labels=batch["ids"])
                out.loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return out.loss.detach(), out.head_top1.detach()
        return step

    vocab = eager_model.config.vocab_size
    eager = step_of(eager_model, eager_opt)
    graphed = GraphedStep(step_of(graph_model, graph_opt), graph_opt, warmup=2, label_keys={"ids": (vocab, -100)})
    for i in range(6):
        ids = torch.randint(0, vocab, (2, 48), device="cuda")
        (want, want_top1), (got, got_top1) = eager({"ids": ids}), graphed({"ids": ids})
        assert got.item() == want.item() and torch.equal(got_top1, want_top1), i
        for (name, a), b in zip(eager_model.named_parameters(), graph_model.parameters()):
            assert torch.equal(a, b), (i, name)
    assert graphed.captured

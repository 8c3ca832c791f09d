"""GraphedStep (liger_models/train/cuda_graph.py): a whole training step captured as a CUDA graph and replayed.

The contract checks run anywhere; capture and replay need a GPU (`pytest -m gpu`).
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from liger_models import AutoLigerForCausalLM
from liger_models.train.cuda_graph import GraphedStep


def _noop(batch):
    return None


def _step_of(model, opt, context=contextlib.nullcontext, **model_args):
    """step(batch): the model's loss on batch["ids"] (model_args: its keyword → the batch key holding it) under
    ``context``, backward, optimizer step; returns the model output."""
    def step(batch):
        with context():
            out = model(batch["ids"], **{arg: batch[key] for arg, key in model_args.items()})
            out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return out
    return step


def _math_sdpa():  # the flash/cuDNN backwards accumulate with atomics: run-to-run noise
    return sdpa_kernel(SDPBackend.MATH)


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

    eager = _step_of(models[0], opts[0], _math_sdpa, labels="labels")
    vocab = models[0].config.vocab_size
    graphed = GraphedStep(_step_of(models[1], opts[1], _math_sdpa, labels="labels"), opts[1], warmup=3,
                          label_keys={"labels": (vocab, -100)})
    for i in range(8):
        ids = torch.randint(0, vocab, (4, 64), device="cuda")
        labels = ids.clone()
        labels[:, : i + 1] = -100  # a different count of ignored targets each step
        want = eager({"ids": ids, "labels": labels}).loss.item()
        got = graphed({"ids": ids, "labels": labels}).loss.item()
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

    graphed = GraphedStep(_step_of(model, opt, labels="ids"), opt, warmup=2)
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

    vocab = eager_model.config.vocab_size
    eager = _step_of(eager_model, eager_opt, _math_sdpa, labels="ids")
    graphed = GraphedStep(_step_of(graph_model, graph_opt, _math_sdpa, labels="ids"), graph_opt, warmup=2,
                          label_keys={"ids": (vocab, -100)})
    for i in range(6):
        ids = torch.randint(0, vocab, (2, 48), device="cuda")
        want, got = eager({"ids": ids}), graphed({"ids": ids})
        assert got.loss.item() == want.loss.item() and torch.equal(got.head_top1, want.head_top1), i
        for (name, a), b in zip(eager_model.named_parameters(), graph_model.parameters()):
            assert torch.equal(a, b), (i, name)
    assert graphed.captured


# ---------------------------------------------------------------------------------------------------------------
# The trainer's --cuda-graph mode


@pytest.mark.parametrize("command, flags, problem", [
    ("train", ("--device", "cpu"), "a CPU device"),
    ("train", ("--device", "cpu", "--optimizer-in-backward", "--grad-accum", "1", "--max-grad-norm", "0"),
     "--optimizer-in-backward"),
    ("train", ("--activation-checkpointing",), "--activation-checkpointing"),
    ("train-medusa", ("--schedule", "linear"), "--schedule constant"),
])
def test_trainer_refuses_what_a_graph_cannot_replay(command, flags, problem, tiny_model_dir, text_file, tmp_path,
                                                   monkeypatch):
    from liger_models.recipes import train_causal_lm, train_medusa
    from tests.train.test_trainer import _args

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    run = train_causal_lm if command == "train" else train_medusa
    with pytest.raises(ValueError, match=problem):
        run(_args(command, tiny_model_dir, text_file, tmp_path / "x", *flags, "--cuda-graph"))
    assert not (tmp_path / "x" / "checkpoints").exists()


@pytest.mark.parametrize("schedule", ["linear", "sine_0.5"])
def test_trainer_itself_refuses_a_changing_heads_schedule(schedule, tiny_model_dir, tmp_path):
    """A Trainer built directly (not through run.py) must refuse it too: the graph would replay the heads' loss
    weights of the step it captured, for every later step."""
    from liger_models.medusa import MedusaModel
    from liger_models.train import distributed as D
    from liger_models.train.trainer import MedusaTask, TrainConfig, Trainer

    model = MedusaModel.from_base(AutoLigerForCausalLM.from_pretrained(tiny_model_dir), num_heads=2,
                                  scheduler=schedule)
    opt = torch.optim.AdamW(model.param_groups(1e-3), lr=1e-3)
    cfg = TrainConfig(output_dir=str(tmp_path), max_steps=2, cuda_graph=True)
    with pytest.raises(ValueError, match=f"schedule {schedule!r}"):
        Trainer(model, MedusaTask(2), None, opt, None, cfg, D.DistInfo(), export=lambda d, s, f: None)


def test_static_document_mask_takes_the_masked_path_with_the_same_result(tiny_model_dir, monkeypatch):
    """One document per row: normally no mask (plain causal attention); in the context the document mask, which
    must allow exactly the causal pairs, so the loss and gradients agree."""
    from liger_models.modules import static_document_mask
    from liger_models.modules.attention import document_ids

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    positions = torch.arange(12)[None].repeat(2, 1)
    assert document_ids(positions) is None
    with static_document_mask():
        assert torch.equal(document_ids(positions), torch.zeros(2, 12, dtype=torch.long))
    assert document_ids(positions) is None  # the context restores the default
    model = AutoLigerForCausalLM.from_pretrained(tiny_model_dir)
    ids = torch.randint(0, model.config.vocab_size, (2, 12))
    results = []
    for static in (False, True):
        model.zero_grad(set_to_none=True)
        with static_document_mask() if static else contextlib.nullcontext():
            loss = model(ids, labels=ids, position_ids=positions).loss
        loss.backward()
        results.append((loss.detach(), [p.grad.clone() for p in model.parameters()]))
    torch.testing.assert_close(results[1][0], results[0][0], rtol=1e-6, atol=0)
    for a, b in zip(results[1][1], results[0][1]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_checkpointed_optimizer_state_saves_a_tensor_lr_as_its_value(tiny_model_dir):
    from liger_models.train import distributed as D

    model = AutoLigerForCausalLM.from_pretrained(tiny_model_dir)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    opt.param_groups[0]["lr"] = torch.tensor(2.5e-4)  # what GraphedStep makes of a float lr at capture
    state = D.full_optimizer_state(model, opt)
    assert state["param_groups"][0]["lr"] == pytest.approx(2.5e-4) and isinstance(state["param_groups"][0]["lr"], float)
    assert isinstance(opt.param_groups[0]["lr"], torch.Tensor)  # the live optimizer keeps its tensor


def _gpu_args(command, model_dir, data, out, *extra):
    """test_train_gpu's bf16 CUDA run, 10 steps with a checkpoint at 5 and 3 LR warm-up steps."""
    from tests.train.test_train_gpu import _args

    return _args(command, model_dir, data, out, "--max-steps", "10", "--save-every", "5", "--warmup-steps", "3",
                 *extra)


@pytest.mark.gpu
def test_trainer_cuda_graph_follows_the_eager_run_and_resumes(tiny_model_dir, text_file, tmp_path):
    """Packed text, 2 micro-batches, clipping, warmup + cosine LR: the graphed run's losses, LRs and gradient norms
    follow the eager run's (bf16; the flash backward's atomics make both runs nondeterministic), and a graphed run
    resumed at step 5 continues like the uninterrupted one."""
    import shutil

    from liger_models.recipes import train_causal_lm

    eager = train_causal_lm(_gpu_args("train", tiny_model_dir, text_file, tmp_path / "eager"))
    graphed = train_causal_lm(_gpu_args("train", tiny_model_dir, text_file, tmp_path / "graph", "--cuda-graph"))
    for a, b in zip(eager.history, graphed.history):
        assert b["lr"] == pytest.approx(a["lr"], rel=1e-6)
        assert b["loss"] == pytest.approx(a["loss"], rel=2e-2)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=5e-2)
    assert graphed.history[-1]["loss"] < graphed.history[0]["loss"] - 0.3
    (tmp_path / "resumed" / "checkpoints").mkdir(parents=True)
    shutil.copytree(tmp_path / "graph" / "checkpoints" / "step_000005",
                    tmp_path / "resumed" / "checkpoints" / "step_000005")
    resumed = train_causal_lm(_gpu_args("train", tiny_model_dir, text_file, tmp_path / "resumed", "--cuda-graph",
                                        "--resume", "auto"))
    assert [m["step"] for m in resumed.history] == list(range(6, 11))
    for a, b in zip(graphed.history[5:], resumed.history):
        assert b["loss"] == pytest.approx(a["loss"], rel=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("stage", [1, 2])
def test_trainer_cuda_graph_medusa(stage, tiny_model_dir, text_file, tmp_path):
    from liger_models.recipes import train_medusa

    eager = train_medusa(_gpu_args("train-medusa", tiny_model_dir, text_file, tmp_path / "e", "--stage", str(stage),
                                   "--num-heads", "3"))
    graphed = train_medusa(_gpu_args("train-medusa", tiny_model_dir, text_file, tmp_path / "g", "--stage", str(stage),
                                     "--num-heads", "3", "--cuda-graph"))
    for a, b in zip(eager.history, graphed.history):
        assert b["loss"] == pytest.approx(a["loss"], rel=2e-2)
        assert b["head_top1"] == pytest.approx(a["head_top1"], abs=0.05)


@pytest.mark.gpu
def test_packed_documents_at_flex_length_capture(tiny_model_dir):
    """T ≥ FLEX_MIN_LEN with packed documents: the compiled flex_attention and its block mask (built inside the
    step) run under capture, and replays follow the eager steps."""
    from liger_models.modules import static_document_mask
    from liger_models.modules.attention import FLEX_MIN_LEN

    T = FLEX_MIN_LEN
    models = [AutoLigerForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32, device="cuda")
              for _ in range(2)]
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3, fused=True, capturable=True) for m in models]

    eager, graphed = (_step_of(models[0], opts[0], static_document_mask, labels="ids", position_ids="pos"),
                      GraphedStep(_step_of(models[1], opts[1], static_document_mask, labels="ids",
                                           position_ids="pos"), opts[1], warmup=2))
    vocab = models[0].config.vocab_size
    for i in range(5):
        cut = 100 + 50 * i  # a different document boundary every step
        pos = torch.cat([torch.arange(cut), torch.arange(T - cut)])[None].repeat(2, 1).cuda()
        batch = {"ids": torch.randint(0, vocab, (2, T), device="cuda"), "pos": pos}
        want, got = eager(batch).loss.item(), graphed(batch).loss.item()
        assert got == pytest.approx(want, rel=1e-4), i
    assert graphed.captured
    for a, b in zip(models[0].parameters(), models[1].parameters()):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5)

"""The training loop: global loss normaliser under gradient accumulation, exact resume, activation checkpointing."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from liger_models import AutoLigerForCausalLM
from liger_models.cli import build_parser
from liger_models.hub import load_tokenizer
from liger_models.medusa import MedusaModel
from liger_models.train import distributed as D
from liger_models.train.data import BatchStream, build_dataset, read_special_tokens
from liger_models.recipes import train_causal_lm, train_medusa
from liger_models.train.optim import warmup_cosine_factor
from liger_models.train.trainer import CausalLMTask, MedusaTask, TrainConfig, Trainer
from tests.helpers import INTERPRETER_ONLY

pytestmark = pytest.mark.usefixtures("reference_path")


def _chat_file(path: Path, n: int = 24) -> Path:
    """Conversations of very different lengths: every micro-batch has a different number of targets per head."""
    rng = random.Random(0)
    words = "the king queen my lord good sir thou art a villain hence away to be or not".split()
    with path.open("w") as f:
        for i in range(n):
            turns = [{"role": "user", "content": " ".join(rng.choices(words, k=rng.randint(2, 12)))},
                     {"role": "assistant", "content": " ".join(rng.choices(words, k=rng.randint(1, 30)))}]
            f.write(json.dumps({"messages": turns}) + "\n")
    return path


def _sgd_trainer(model, task, model_dir, data, batch_size, grad_accum, tmp_path):
    tokenizer = load_tokenizer(model_dir)
    special = read_special_tokens(tokenizer, model_dir)
    stream = BatchStream(build_dataset([data], tokenizer, special, seq_len=24, chat_template="simple"), batch_size,
                         seed=1)
    params = [p for p in model.parameters() if p.requires_grad]
    # Plain SGD with lr 1: the parameter change IS the gradient (Adam would hide a wrong loss scale).
    opt = torch.optim.SGD(params, lr=1.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    cfg = TrainConfig(output_dir=str(tmp_path), max_steps=1, grad_accum=grad_accum, max_grad_norm=0.0, quiet=True)
    return Trainer(model, task, stream, opt, sched, cfg, D.DistInfo(), export=lambda d, s, f: None)


def _build(kind: str, model_dir: Path):
    base = AutoLigerForCausalLM.from_pretrained(model_dir)
    if kind == "lm":
        return base, CausalLMTask()
    torch.manual_seed(0)  # the heads' ResBlock biases are randomly initialised
    medusa = MedusaModel.from_base(base, stage=2 if kind == "medusa2" else 1, num_heads=3)
    return medusa, MedusaTask(3)


@pytest.mark.parametrize("kind", ["lm", "medusa1", "medusa2"])
def test_grad_accumulation_equals_one_big_batch(kind, tiny_model_dir, tmp_path):
    data = _chat_file(tmp_path / "chat.jsonl")
    results = []
    for batch_size, accum in ((4, 1), (1, 4)):
        model, task = _build(kind, tiny_model_dir)
        before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
        trainer = _sgd_trainer(model, task, tiny_model_dir, data, batch_size, accum, tmp_path / f"{accum}")
        if accum > 1:  # the test only means something if micro-batches hold different numbers of targets
            probe = BatchStream(trainer.stream.dataset, 1, seed=1)
            counts = {tuple(task.counts(probe.next_batch()).tolist()) for _ in range(accum)}
            assert len(counts) > 1
        # The gradients as the optimizer sees them (not before − after: at lr 1 that difference rounds at the
        # weight's scale, ~6e-8 for a norm weight near 1, which made a CI run fail on a 1e-7 tolerance).
        grads = {}
        names = {p: n for n, p in model.named_parameters()}
        trainer.optimizer.register_step_pre_hook(
            lambda opt, *_: grads.update({names[p]: p.grad.clone() for g in opt.param_groups for p in g["params"]}))
        metrics = trainer.train_step()
        assert grads.keys() == before.keys()
        moved = {n: before[n] - p.detach() for n, p in model.named_parameters() if n in before}
        for n in grads:  # SGD at lr 1 did apply exactly these gradients
            torch.testing.assert_close(moved[n], grads[n], rtol=0, atol=2.5e-7 * max(1.0, before[n].abs().max()))
        results.append((metrics, grads))
    (m1, g1), (m4, g4) = results
    torch.testing.assert_close(m4["loss"], m1["loss"], rtol=1e-6, atol=0)
    if kind != "lm":
        torch.testing.assert_close(torch.tensor(m4["head_loss"]), torch.tensor(m1["head_loss"]), rtol=1e-6, atol=0)
        assert m4["head_top1"] == m1["head_top1"] and m4["head_top5"] == m1["head_top5"]
    assert g1.keys() == g4.keys() and len(g1) > 0
    for name in g1:
        assert g1[name].abs().max() > 0 or "heads" not in name, f"{name}: no gradient"
        torch.testing.assert_close(g4[name], g1[name], rtol=1e-5, atol=1e-7, msg=name)
    if kind == "medusa1":  # stage 1: the base is frozen, so nothing of it is in the optimizer
        assert all(name.startswith("heads.") for name in g1)


def _args(command: str, model_dir: Path, data: Path, out: Path, *extra: str):
    return build_parser().parse_args([
        command, "--model", str(model_dir), "--data", str(data), "--output-dir", str(out), "--seq-len", "32",
        "--batch-size", "2", "--grad-accum", "2", "--max-steps", "6", "--save-every", "3", "--lr", "3e-3",
        "--warmup-steps", "2", "--quiet", "--dtype", "fp32", *extra])


class _Interrupt(Exception):
    pass


def run_until_crash(monkeypatch, run, after_step: int = 4) -> None:
    """Run ``run()`` with a Trainer that raises at the start of the step after ``after_step``, as a killed job."""
    original = Trainer.train_step

    def crashing(self):
        if self.step == after_step:
            raise _Interrupt
        return original(self)

    monkeypatch.setattr(Trainer, "train_step", crashing)
    with pytest.raises(_Interrupt):
        run()
    monkeypatch.setattr(Trainer, "train_step", original)


@pytest.mark.parametrize("command, extra", [
    ("train", ()),
    ("train-medusa", ("--stage", "2", "--num-heads", "2", "--schedule", "linear")),
])
def test_resume_is_bit_identical(command, extra, tiny_model_dir, text_file, tmp_path, monkeypatch):
    recipe = train_causal_lm if command == "train" else train_medusa
    full = recipe(_args(command, tiny_model_dir, text_file, tmp_path / "full", *extra))
    assert [m["step"] for m in full.history] == [1, 2, 3, 4, 5, 6]

    # Crash during step 5: the step-3 checkpoint exists, step 4 was done but never saved.
    run_until_crash(monkeypatch, lambda: recipe(_args(command, tiny_model_dir, text_file, tmp_path / "cut", *extra)))
    torch.manual_seed(1234)  # a resumed process starts from different RNG state: the checkpoint must restore it
    resumed = recipe(_args(command, tiny_model_dir, text_file, tmp_path / "cut", *extra, "--resume", "auto"))

    assert [m["step"] for m in resumed.history] == [4, 5, 6]
    for a, b in zip(full.history[3:], resumed.history):
        assert a["loss"] == b["loss"] and a["grad_norm"] == b["grad_norm"], (a, b)
        assert a.get("head_loss") == b.get("head_loss")
    logged = [json.loads(line)["step"] for line in (tmp_path / "cut" / "metrics.jsonl").read_text().splitlines()]
    assert logged == [1, 2, 3, 4, 5, 6]  # the lost step 4 was dropped from the log and redone once
    files = sorted(p.name for p in full.checkpoint.glob("*.safetensors"))
    assert files
    for name in files:
        a, b = load_file(full.checkpoint / name), load_file(resumed.checkpoint / name)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name


def test_extending_a_finished_run_follows_the_longer_schedule(tiny_model_dir, text_file, tmp_path):
    """Resume a 3-step run with --max-steps 6: steps 4-6 use the 6-step schedule's learning rates (the first one
    too, not the rate the 3-step schedule ended on), like an uninterrupted 6-step run."""
    out = tmp_path / "run"
    train_causal_lm(_args("train", tiny_model_dir, text_file, out, "--max-steps", "3"))
    extended = train_causal_lm(_args("train", tiny_model_dir, text_file, out, "--resume", "auto"))
    full = train_causal_lm(_args("train", tiny_model_dir, text_file, tmp_path / "full"))
    assert [m["step"] for m in extended.history] == [4, 5, 6]
    assert [m["lr"] for m in extended.history] == [m["lr"] for m in full.history[3:]]
    assert extended.history[0]["lr"] == 3e-3 * warmup_cosine_factor(3, 2, 6)


@pytest.mark.parametrize("stage", ["1", "2"])
def test_resumed_medusa_run_takes_this_runs_loss_settings(stage, tiny_model_dir, text_file, tmp_path):
    """Resuming allowed to change them takes the loss settings of the command line in both stages (stage 2 used to
    keep the checkpoint's)."""
    out = tmp_path / "run"
    extra = ("--stage", stage, "--num-heads", "2")
    train_medusa(_args("train-medusa", tiny_model_dir, text_file, out, *extra, "--max-steps", "3"))
    resumed = train_medusa(_args("train-medusa", tiny_model_dir, text_file, out, *extra, "--resume", "auto",
                                 "--max-steps", "4", "--lambda0", "0.5", "--decay", "0.6",
                                 "--allow-changed-settings", "lambda0,decay"))
    saved = json.loads((resumed.checkpoint / "config.json").read_text())
    assert (saved["medusa_heads_coefficient"], saved["medusa_decay_coefficient"]) == (0.5, 0.6)


def test_activation_checkpointing_changes_nothing_but_memory(tiny_model_dir):
    ids = torch.randint(0, 300, (2, 16))
    grads = []
    for ac in (False, True):
        model = AutoLigerForCausalLM.from_pretrained(tiny_model_dir)
        if ac:
            assert D.apply_activation_checkpointing(model.model.layers) == 2
            assert D.apply_activation_checkpointing(model.model.layers) == 0  # idempotent
        model.train()
        loss = model(ids, labels=ids).loss
        loss.backward()
        grads.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
        assert set(model.state_dict()) == set(AutoLigerForCausalLM.from_pretrained(tiny_model_dir).state_dict())
    (l0, g0), (l1, g1) = grads
    assert torch.equal(l0, l1)
    for name in g0:
        torch.testing.assert_close(g1[name], g0[name], rtol=0, atol=0, msg=name)


def test_fused_adamw_takes_every_beta_torch_takes(monkeypatch):
    """torch's AdamW accepts 0 ≤ β < 1; the kernel's bias correction takes ln β, so β1 = 0 (no momentum, an
    RMSProp-like step) is not its case. FusedAdamW must leave that step to torch, not fail on the first step (on
    CUDA every run builds FusedAdamW; the Triton interpreter runs the same path on the CPU)."""
    from liger_models.train.optim import FusedAdamW

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    for betas in ((0.0, 0.95), (0.9, 0.0)):
        w = torch.nn.Parameter(torch.randn(5, 3, generator=torch.Generator().manual_seed(0)))
        ref = torch.nn.Parameter(w.detach().clone())
        ours = FusedAdamW([w], lr=1e-2, betas=betas, weight_decay=0.1)
        theirs = torch.optim.AdamW([ref], lr=1e-2, betas=betas, weight_decay=0.1, foreach=False)
        for _ in range(2):
            for p, opt in ((w, ours), (ref, theirs)):
                p.square().sum().backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
        torch.testing.assert_close(w, ref, rtol=1e-6, atol=1e-7, msg=str(betas))


@INTERPRETER_ONLY
def test_fused_adamw_keeps_its_flags_when_loading_torch_adamw_state(monkeypatch):
    """torch.optim.AdamW's default state (not fused, not capturable) loaded into FusedAdamW: torch would take the
    saved groups' fused / capturable flags, and with them leave the step count on the CPU (the kernel raises on a
    CUDA parameter) and make a capturable FusedAdamW refuse a CUDA graph. The optimizer keeps its own flags, and
    continues exactly as torch's AdamW does."""
    import copy

    from liger_models.train.cuda_graph import GraphedStep
    from liger_models.train.optim import FusedAdamW

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    w = torch.nn.Parameter(torch.randn(5, 3, generator=torch.Generator().manual_seed(0)))
    ref = torch.nn.Parameter(w.detach().clone())
    theirs = torch.optim.AdamW([ref], lr=1e-2, weight_decay=0.1, foreach=False)
    ref.square().sum().backward()
    theirs.step()
    theirs.zero_grad(set_to_none=True)
    w.data.copy_(ref.detach())
    ours = FusedAdamW([w], lr=1e-2, weight_decay=0.1, capturable=True)
    ours.load_state_dict(copy.deepcopy(theirs.state_dict()))  # as from a checkpoint: no tensor shared with theirs
    group = ours.param_groups[0]
    assert group["fused"] is True and group["capturable"] is True, group
    assert ours.state[w]["step"].device == w.device and ours.state[w]["step"].dtype == torch.float32
    GraphedStep(lambda batch: None, ours)  # still a capturable optimizer
    for p, opt in ((w, ours), (ref, theirs)):
        p.square().sum().backward()
        opt.step()
    torch.testing.assert_close(w, ref, rtol=1e-6, atol=1e-7)


class _Built(Exception):
    pass


@pytest.mark.parametrize("command, extra", [
    ("train", ()),
    ("train-medusa", ("--stage", "1", "--num-heads", "2")),
    ("train-medusa", ("--stage", "2", "--num-heads", "2")),
])
def test_weight_decay_is_on_matrices_only(command, extra, tiny_model_dir, text_file, tmp_path, monkeypatch):
    """--weight-decay is "AdamW weight decay on matrices": never on a bias or a norm weight (1-D), for the heads'
    ResBlock biases and the stage-2 base's norms as for the causal LM; each group keeps its learning rate."""
    import liger_models.recipes.training as run

    seen = []

    def capture(name, groups, **kwargs):
        seen.extend(groups)
        raise _Built

    monkeypatch.setattr(run, "build_optimizer", capture)
    recipe = train_causal_lm if command == "train" else train_medusa
    with pytest.raises(_Built):
        recipe(_args(command, tiny_model_dir, text_file, tmp_path / "x", *extra, "--weight-decay", "0.5"))
    assert any(p.dim() == 1 for g in seen for p in g["params"])  # the case the test is about is there
    for g in seen:
        for p in g["params"]:
            assert g["weight_decay"] == (0.5 if p.dim() >= 2 else 0.0), (g["name"], tuple(p.shape))
    if command == "train-medusa":  # the heads still train at 4× the base LR, biases included
        assert {g["lr"] for g in seen if g["name"].startswith("medusa_heads")} == {3e-3 * 4}


class _UserTurnsOnly:
    """A stream whose windows after the first ``labelled`` hold no target at all (a long user turn fills them)."""

    batch_size, epoch = 2, 0.0

    class dataset:
        seq_len = 12

    def __init__(self, labelled: int):
        self.labelled = labelled

    def next_batch(self) -> dict[str, torch.Tensor]:
        ids = torch.randint(0, 300, (self.batch_size, self.dataset.seq_len))
        positions = torch.arange(self.dataset.seq_len).expand_as(ids).contiguous()
        self.labelled -= 1
        return {"input_ids": ids, "labels": ids if self.labelled >= 0 else torch.full_like(ids, -100),
                "position_ids": positions}


@pytest.mark.parametrize("kind", ["lm", "medusa2"])
@pytest.mark.parametrize("path", ["reference", pytest.param("triton", marks=INTERPRETER_ONLY)])
def test_step_without_any_target_is_a_finite_zero_gradient_step(kind, path, tiny_model_dir, tmp_path, monkeypatch):
    """A global batch with no target: loss 0 (no 0/0), every weight and AdamW moment finite, and a normal AdamW
    step with a zero gradient (as HF's Trainer also steps): moments decay, momentum moves the weights."""
    from liger_models.train.optim import build_adamw, build_scheduler, decay_param_groups

    monkeypatch.setenv("TRITON_INTERPRET", "0" if path == "reference" else "1")
    model, task = _build(kind, tiny_model_dir)
    groups = decay_param_groups(model, 1e-3, 0.1) if kind == "lm" else model.param_groups(1e-3, 4.0, 0.1)
    opt = build_adamw(groups)
    cfg = TrainConfig(output_dir=str(tmp_path), max_steps=3, grad_accum=2, quiet=True)
    trainer = Trainer(model, task, _UserTurnsOnly(labelled=2), opt, build_scheduler(opt, 1, 3), cfg, D.DistInfo(),
                      export=lambda d, s, f: None)
    assert trainer.train_step()["targets"] > 0  # a real step first, so the moments are non-zero
    before = [p.detach().clone() for p in trainer.params]
    metrics = trainer.train_step()
    assert metrics["loss"] == 0.0 and metrics["targets"] == 0 and metrics["grad_norm"] == 0.0
    if kind != "lm":
        assert metrics["head_loss"] == [0.0] * 3 and metrics["head_top1"] == [0.0] * 3
    assert all(torch.isfinite(p).all() for p in model.parameters())
    for p in trainer.params:
        state = opt.state[p]
        assert float(state["step"]) == 2, "every parameter took both AdamW steps"
        assert all(torch.isfinite(state[k]).all() for k in ("exp_avg", "exp_avg_sq"))
    assert any(not torch.equal(p, b) for p, b in zip(trainer.params, before)), "the step was taken"

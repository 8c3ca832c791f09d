"""HF's training ecosystem drives our models as they are: transformers' Trainer and TRL's SFTTrainer train them with
no compute_loss of ours, PEFT wraps them with task_type="CAUSAL_LM", and each piece of the PreTrainedModel surface
those use behaves as HF's does on the same checkpoint.

Every comparison runs HF's own model (eager attention, float32) through the same loop on the same data and seed.
The training loops run on the PyTorch reference path (``loop`` fixture): they test the integration, and the Triton
interpreter would make them minutes long; the surface tests run the kernels.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import transformers

peft = pytest.importorskip("peft")
trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")

from tokenizers import Tokenizer, models, pre_tokenizers  # noqa: E402
from transformers.modeling_outputs import CausalLMOutputWithPast  # noqa: E402

from liger_models import AutoLigerForCausalLM  # noqa: E402
from liger_models.modules import CausalLMOutput, causal_lm  # noqa: E402
from liger_models.modules.generate import default_token_id  # noqa: E402
from tests.lora.bnb import import_bnb  # noqa: E402

from .parity import TINY_MOE, build_hf, max_rel, save_hf  # noqa: E402

transformers.logging.set_verbosity_error()
datasets.disable_progress_bars()
WORDS = "the cat dog sat ran on a mat log fast slow red big small".split()


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory) -> Path:
    return save_hf(build_hf(transformers.LlamaConfig), tmp_path_factory.mktemp("llama"))


@pytest.fixture(scope="module")
def bare_dir(llama_dir, tmp_path_factory) -> Path:
    """llama_dir without generation_config.json (HF's save_pretrained writes one; many checkpoints have none)."""
    directory = tmp_path_factory.mktemp("bare")
    for file in llama_dir.iterdir():
        if file.name != "generation_config.json":
            (directory / file.name).write_bytes(file.read_bytes())
    return directory


@pytest.fixture
def loop(monkeypatch):
    """The PyTorch reference path for the kernels (liger_models/kernels/_dispatch.py reads this at call time)."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")


def load_pair(directory: Path):
    """(ours, HF's) from one checkpoint, both float32."""
    ours = AutoLigerForCausalLM.from_pretrained(directory, dtype=torch.float32)
    hf = transformers.AutoModelForCausalLM.from_pretrained(directory, attn_implementation="eager",
                                                           dtype=torch.float32)
    return ours, hf


def assert_same_parameters(ours, hf, bound: float) -> None:
    theirs = dict(hf.named_parameters())
    for name, p in ours.named_parameters():
        assert max_rel(p.detach(), theirs[name].detach()) <= bound, name


def assert_same_losses(ours: list[float], hf: list[float], rel: float = 1e-5) -> None:
    assert len(ours) == len(hf) > 0
    for a, b in zip(ours, hf):
        assert abs(a - b) <= rel * abs(b), (ours, hf)


# ---- transformers.Trainer --------------------------------------------------------------------------------------
def token_rows(n: int = 8) -> list[dict]:
    """Rows of different lengths with a few ignored labels at the start, so each micro-batch holds a different
    number of targets and num_items_in_batch changes the result."""
    g = torch.Generator().manual_seed(1)
    rows = []
    for _ in range(n):
        ids = torch.randint(3, 128, (int(torch.randint(5, 14, (1,), generator=g)),), generator=g)
        labels = ids.clone()
        labels[: int(torch.randint(0, 4, (1,), generator=g))] = -100
        rows.append({"input_ids": ids, "labels": labels})
    return rows


def pad_batch(rows: list[dict]) -> dict:
    """Right padding: pad id 0, attention_mask 0 and label -100 there."""
    width = max(len(r["input_ids"]) for r in rows)
    batch = {"input_ids": torch.zeros(len(rows), width, dtype=torch.long),
             "labels": torch.full((len(rows), width), -100),
             "attention_mask": torch.zeros(len(rows), width, dtype=torch.long)}
    for i, r in enumerate(rows):
        n = len(r["input_ids"])
        batch["input_ids"][i, :n], batch["labels"][i, :n] = r["input_ids"], r["labels"]
        batch["attention_mask"][i, :n] = 1
    return batch


def run_trainer(model, out: Path, rows: list[dict], **overrides) -> list[float]:
    """Trainer's per-step training losses (micro-batches of 2, two of them per step)."""
    args = dict(output_dir=str(out), per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=4,
                learning_rate=0.5, optim="sgd", lr_scheduler_type="constant", logging_steps=1, report_to=[],
                save_strategy="no", use_cpu=True, seed=0, remove_unused_columns=False)
    trainer = transformers.Trainer(model=model, args=transformers.TrainingArguments(**{**args, **overrides}),
                                   train_dataset=rows, data_collator=pad_batch)
    trainer.train()
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def record_forward_kwargs(model) -> list[dict]:
    calls: list[dict] = []
    model.register_forward_pre_hook(lambda m, args, kwargs: calls.append(kwargs), with_kwargs=True)
    return calls


@torch.no_grad()
def mean_loss(model, rows: list[dict]) -> float:
    model.eval()
    batch = pad_batch(rows)
    return model(**batch).loss.item()


def test_trainer_trains_like_hf_step_by_step_with_gradient_accumulation(llama_dir, tmp_path, loop):
    """No compute_loss override: Trainer reads the loss as outputs[0] and passes num_items_in_batch (the targets of
    both accumulated micro-batches, labels[:, 1:] counted as for HF's ForCausalLM loss), which the model divides
    the summed loss by. Every step's loss and the trained weights equal HF's (SGD: Adam's normalisation would
    magnify float32 noise in near-zero gradients into the weights)."""
    ours, hf = load_pair(llama_dir)
    rows = token_rows()
    before = mean_loss(ours, rows)
    calls = record_forward_kwargs(ours)
    ours_losses = run_trainer(ours, tmp_path / "ours", rows)
    hf_losses = run_trainer(hf, tmp_path / "hf", rows)
    assert_same_losses(ours_losses, hf_losses)
    assert_same_parameters(ours, hf, 1e-5)
    targets = [int((c["labels"][:, 1:] != -100).sum()) for c in calls]
    assert len(calls) == 8
    for step in range(0, len(calls), 2):  # both micro-batches of a step are divided by the targets of both
        assert int(calls[step]["num_items_in_batch"]) == int(calls[step + 1]["num_items_in_batch"]) \
            == targets[step] + targets[step + 1]
    assert mean_loss(ours, rows) < before - 0.1


@pytest.mark.parametrize("optim", ["adamw_bnb_8bit", "paged_adamw_8bit"])
def test_trainer_with_bitsandbytes_8bit_optimizers_trains_like_hf(llama_dir, tmp_path, loop, optim):
    """The QLoRA recipe's usual optimizer through HF Trainer: bitsandbytes' 8-bit AdamW with Trainer's own 32-bit
    override for embedding modules (it finds ours as nn.Embedding), losses equal to HF's model under the same
    optimizer; the 8-bit state is really there."""
    bnb = import_bnb()
    if bnb is None:
        pytest.skip("bitsandbytes does not import here")
    shared_manager = bnb.optim.GlobalOptimManager.get_instance()
    shared_manager.initialize()  # Trainer registers its embedding overrides in this process-wide manager
    ours, hf = load_pair(llama_dir)
    rows = token_rows()
    before = mean_loss(ours, rows)
    states = {}
    for name, model in (("ours", ours), ("hf", hf)):
        args = dict(output_dir=str(tmp_path / name), per_device_train_batch_size=2, gradient_accumulation_steps=2,
                    max_steps=4, learning_rate=1e-2, optim=optim, lr_scheduler_type="constant", logging_steps=1,
                    report_to=[], save_strategy="no", use_cpu=True, seed=0, remove_unused_columns=False)
        trainer = transformers.Trainer(model=model, args=transformers.TrainingArguments(**args), train_dataset=rows,
                                       data_collator=pad_batch)
        trainer.train()
        states[name] = ([h["loss"] for h in trainer.state.log_history if "loss" in h], trainer.optimizer)
    # Adam normalises each gradient: fp32 noise between the two models' gradients moves a near-zero moment's
    # 8-bit code now and then, so the losses agree to 1e-4 rather than to fp32 rounding.
    assert_same_losses(states["ours"][0], states["hf"][0], rel=1e-4)
    assert mean_loss(ours, rows) < before - 0.1
    optimizer = states["ours"][1]
    embed = ours.model.embed_tokens.weight
    assert optimizer.state[embed]["state1"].dtype == torch.float32  # Trainer's override for embeddings
    large = [p for p in optimizer.state if p.numel() >= 4096 and p is not embed]  # bitsandbytes' 8-bit minimum
    assert large and all(optimizer.state[p]["state1"].dtype == torch.uint8 for p in large)
    shared_manager.initialize()  # leave no override behind for a later test's optimizer


def test_trainer_evaluate_gives_hfs_eval_loss(llama_dir, tmp_path, loop):
    ours, hf = load_pair(llama_dir)
    losses = []
    for model in (ours, hf):
        args = transformers.TrainingArguments(output_dir=str(tmp_path), per_device_eval_batch_size=2, report_to=[],
                                              use_cpu=True, remove_unused_columns=False)
        trainer = transformers.Trainer(model=model, args=args, eval_dataset=token_rows(), data_collator=pad_batch)
        losses.append(trainer.evaluate()["eval_loss"])
    assert_same_losses(losses[:1], losses[1:])


def test_trainer_compute_metrics_gets_hfs_logits_with_logits_with_loss(llama_dir, tmp_path, loop):
    """compute_metrics receives the logits of a labelled forward once ``logits_with_loss`` is set (HF's eval loop
    reads them from the same call that gives the loss), equal to HF's; without it the loss alone, as documented."""
    ours, hf = load_pair(llama_dir)
    seen: dict[str, list] = {}

    def metrics_of(name):
        def compute_metrics(pred):
            seen[name] = [pred.predictions, pred.label_ids]
            return {"n": float(len(pred.label_ids))}
        return compute_metrics

    for name, model in (("ours", ours), ("hf", hf)):
        ours.logits_with_loss = True
        args = transformers.TrainingArguments(output_dir=str(tmp_path / name), per_device_eval_batch_size=2,
                                              report_to=[], use_cpu=True, remove_unused_columns=False)
        trainer = transformers.Trainer(model=model, args=args, eval_dataset=token_rows(), data_collator=pad_batch,
                                       compute_metrics=metrics_of(name))
        trainer.evaluate()
    ours_logits, hf_logits = torch.as_tensor(seen["ours"][0]), torch.as_tensor(seen["hf"][0])
    assert ours_logits.shape == hf_logits.shape and ours_logits.shape[-1] == ours.config.vocab_size
    real = torch.as_tensor(seen["hf"][1]) != -100  # Trainer pads predictions with -100 across batches
    assert (ours_logits[real] - hf_logits[real]).abs().max() <= 1e-4
    ours.logits_with_loss = False
    out = ours(torch.randint(3, 128, (2, 7)), labels=torch.randint(3, 128, (2, 7)))
    assert out.logits is None and out.loss is not None


# ---- TRL's SFTTrainer ------------------------------------------------------------------------------------------
def word_tokenizer() -> transformers.PreTrainedTokenizerFast:
    """A word-level tokenizer over WORDS whose ids fit the tiny checkpoints' vocabulary of 128."""
    vocab = {"<pad>": 0, "<bos>": 1, "<eos>": 2, "<unk>": 3, **{w: i + 4 for i, w in enumerate(WORDS)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<pad>",
                                                bos_token="<bos>")


def text_dataset(n: int = 16) -> "datasets.Dataset":
    g = torch.Generator().manual_seed(3)
    lengths = torch.randint(3, 10, (n,), generator=g)
    texts = [" ".join(WORDS[int(i)] for i in torch.randint(0, len(WORDS), (int(k),), generator=g)) for k in lengths]
    return datasets.Dataset.from_dict({"text": texts})


def run_sft(model, out: Path, **overrides) -> list[dict]:
    """SFTTrainer's per-step logs (loss, mean_token_accuracy, entropy)."""
    args = dict(output_dir=str(out), per_device_train_batch_size=4, gradient_accumulation_steps=2, max_steps=3,
                learning_rate=0.3, optim="sgd", lr_scheduler_type="constant", logging_steps=1, report_to=[],
                save_strategy="no", use_cpu=True, seed=0, bf16=False)
    trainer = trl.SFTTrainer(model=model, args=trl.SFTConfig(**{**args, **overrides}), train_dataset=text_dataset(),
                             processing_class=word_tokenizer())
    trainer.train()
    return [h for h in trainer.state.log_history if "loss" in h]


def record_packing(monkeypatch) -> list[dict]:
    """The varlen packing arguments that reach the model (checked against position_ids there)."""
    seen: list[dict] = []
    check = causal_lm.check_packing
    monkeypatch.setattr(causal_lm, "check_packing", lambda packing, position_ids: (seen.append(packing),
                                                                                   check(packing, position_ids)))
    return seen


@pytest.mark.parametrize("padding_free", [False, True])
def test_sft_trainer_trains_like_hf_and_logs_token_accuracy(llama_dir, tmp_path, monkeypatch, loop, padding_free):
    """TRL's SFTTrainer patches forward with its own fused LM head: it runs ``model.base_model(...)`` for the last
    hidden states and projects them through ``get_output_embeddings().weight`` itself, so its loss, entropy and
    mean_token_accuracy never need our logits. With padding_free, its collator packs the batch into one row and
    sends flash-attention's varlen arguments beside position_ids; they describe the same documents and are taken.
    Everything logged and the trained weights equal HF's (float32: SFTConfig's default bf16 autocast is off)."""
    ours, hf = load_pair(llama_dir)
    packings = record_packing(monkeypatch)
    extra = dict(padding_free=True, max_length=None) if padding_free else {}
    ours_logs = run_sft(ours, tmp_path / "ours", **extra)
    hf_logs = run_sft(hf, tmp_path / "hf", **extra)
    for key in ("loss", "entropy", "mean_token_accuracy"):
        assert_same_losses([h[key] for h in ours_logs], [h[key] for h in hf_logs])
    assert ours_logs[-1]["loss"] < ours_logs[0]["loss"] and ours_logs[-1]["mean_token_accuracy"] > 0
    assert_same_parameters(ours, hf, 1e-5)
    assert len(packings) == (6 if padding_free else 0)  # 3 steps of 2 micro-batches
    assert all(set(p) == {"cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx"}
               for p in packings)


def test_sft_trainer_runs_with_its_default_bf16_autocast(llama_dir, tmp_path, loop):
    ours, _ = load_pair(llama_dir)
    logs = run_sft(ours, tmp_path, bf16=True, max_steps=2)
    assert all(torch.isfinite(torch.tensor(h["loss"])) for h in logs) and "mean_token_accuracy" in logs[0]


def test_sft_trainer_sets_the_pad_id_on_generation_config_without_losing_eos(bare_dir, tmp_path):
    """SFTTrainer writes model.generation_config.pad_token_id. The checkpoint has no generation_config.json, so
    HF's generation config holds config.json's token ids; ours reads them through and keeps them when written."""
    ours, _ = load_pair(bare_dir)
    assert ours.generation_config == {} and ours.generation_config.eos_token_id == ours.config.eos_token_id
    trl.SFTTrainer(model=ours, args=trl.SFTConfig(output_dir=str(tmp_path), report_to=[], use_cpu=True),
                   train_dataset=text_dataset(), processing_class=word_tokenizer())
    assert ours.generation_config["pad_token_id"] == 0
    assert default_token_id(ours, "eos_token_id") == ours.config.eos_token_id == 2


# ---- PEFT ------------------------------------------------------------------------------------------------------
def lora(init_lora_weights: bool = False) -> "peft.LoraConfig":
    return peft.LoraConfig(task_type="CAUSAL_LM", r=4, lora_alpha=8, lora_dropout=0.0,
                           init_lora_weights=init_lora_weights,
                           target_modules=["q_proj", "v_proj", "gate_proj", "down_proj"])


@pytest.mark.parametrize("reentrant", [False, True])
def test_peft_causal_lm_trains_under_trainer_like_hf(llama_dir, tmp_path, loop, reentrant):
    """get_peft_model(task_type="CAUSAL_LM") builds a PeftModelForCausalLM around ours; Trainer trains its adapters
    with activation checkpointing (reentrant checkpointing gets gradients to the adapters only because the frozen
    embeddings' output is made to require grad) exactly as HF + PEFT, and the base weights stay put."""
    ours, hf = load_pair(llama_dir)
    ours_peft = peft.get_peft_model(ours, lora())
    hf_peft = peft.get_peft_model(hf, lora())
    assert type(ours_peft) is peft.PeftModelForCausalLM
    hf_peft.load_state_dict({n: p for n, p in ours_peft.state_dict().items() if "lora_" in n}, strict=False)
    frozen = {n: p.detach().clone() for n, p in ours_peft.named_parameters() if not p.requires_grad}
    initial = {n: p.detach().clone() for n, p in ours_peft.named_parameters() if p.requires_grad}
    overrides = dict(activation_checkpointing=True, max_steps=2,
                     activation_checkpointing_kwargs={"use_reentrant": reentrant})
    ours_losses = run_trainer(ours_peft, tmp_path / "ours", token_rows(), **overrides)
    hf_losses = run_trainer(hf_peft, tmp_path / "hf", token_rows(), **overrides)
    assert_same_losses(ours_losses, hf_losses)
    assert ours.is_gradient_checkpointing and hf.is_gradient_checkpointing
    theirs = dict(hf_peft.named_parameters())
    adapters = {n: p for n, p in ours_peft.named_parameters() if p.requires_grad}
    assert adapters.keys() == initial.keys() and all(not torch.equal(p, initial[n]) for n, p in adapters.items())
    assert all(max_rel(p.detach(), theirs[n].detach()) < 1e-5 for n, p in adapters.items())
    assert all(torch.equal(p, frozen[n]) for n, p in ours_peft.named_parameters() if not p.requires_grad)


def test_sft_trainer_trains_a_peft_adapter_like_hf(llama_dir, tmp_path, loop):
    """SFTTrainer(peft_config=...) wraps ours in PEFT itself, with its default activation checkpointing: its fused LM
    head then runs through the adapters, as on HF's model."""
    ours, hf = load_pair(llama_dir)
    logs = []
    for model in (ours, hf):
        torch.manual_seed(0)  # the same random adapters on both (init_lora_weights=False)
        config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
        args = trl.SFTConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, max_steps=2, logging_steps=1,
                             learning_rate=1e-2, report_to=[], save_strategy="no", use_cpu=True, bf16=False, seed=0)
        trainer = trl.SFTTrainer(model=model, args=args, train_dataset=text_dataset(),
                                 processing_class=word_tokenizer(), peft_config=config)
        trainer.train()
        logs.append([h for h in trainer.state.log_history if "loss" in h])
    for key in ("loss", "mean_token_accuracy"):
        assert_same_losses([h[key] for h in logs[0]], [h[key] for h in logs[1]])


# ---- TRL's preference and online RL trainers ------------------------------------------------------------------
def words(generator: torch.Generator, n: int) -> str:
    return " ".join(WORDS[int(i)] for i in torch.randint(0, len(WORDS), (n,), generator=generator))


def assert_same_logs(ours: list[dict], hf: list[dict], keys: tuple[str, ...]) -> None:
    """Each step's logged values equal HF's to fp32 rounding (1e-5 relative, absolute below 1)."""
    assert len(ours) == len(hf) > 0
    for a, b in zip(ours, hf):
        for key in keys:
            assert abs(a[key] - b[key]) <= 1e-5 * max(1.0, abs(b[key])), (key, a[key], b[key])


@pytest.mark.parametrize("reference", ["loaded", "ours", "peft"])
def test_dpo_trainer_trains_like_hf(llama_dir, tmp_path, loop, reference):
    """TRL's DPOTrainer. Given no reference model it loads one with transformers from ``config._name_or_path`` and
    ``config._attn_implementation`` (the directory ours was loaded from; "sdpa"); or the reference is ours, passed
    in; or, with a PEFT adapter, the policy with its adapter disabled. Loss, rewards and log-probabilities equal HF's
    model under the same trainer, step by step."""
    g = torch.Generator().manual_seed(0)
    data = datasets.Dataset.from_dict({"prompt": [words(g, 4) for _ in range(8)],
                                       "chosen": [words(g, 3) for _ in range(8)],
                                       "rejected": [words(g, 3) for _ in range(8)]})
    ours, hf = load_pair(llama_dir)
    assert ours.config._name_or_path == str(llama_dir) and ours.config._attn_implementation == "sdpa"
    logs = []
    for policy, ref in ((ours, load_pair(llama_dir)[0]), (hf, load_pair(llama_dir)[1])):
        torch.manual_seed(0)  # the same random adapters on both
        args = trl.DPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=2, max_steps=3, logging_steps=1,
                             learning_rate=0.05, optim="sgd", lr_scheduler_type="constant", report_to=[],
                             save_strategy="no", use_cpu=True, bf16=False, seed=0)
        trainer = trl.DPOTrainer(model=policy, ref_model=ref if reference == "ours" else None, args=args,
                                 train_dataset=data, processing_class=word_tokenizer(),
                                 peft_config=lora() if reference == "peft" else None)
        if reference == "loaded":
            assert isinstance(trainer.ref_model, transformers.LlamaForCausalLM)
        trainer.train()
        logs.append([h for h in trainer.state.log_history if "loss" in h])
    assert_same_logs(*logs, ("loss", "rewards/chosen", "rewards/rejected", "logps/chosen", "logps/rejected"))
    assert any(h["rewards/chosen"] != 0 for h in logs[0])  # the policy moved away from the reference


def test_config_names_its_directory_and_attention_as_hf_does(llama_dir, tmp_path):
    """What TRL's trainers read to load a reference model: ``_name_or_path`` (the directory loaded from; "" for a
    model built from a config; never written into config.json) and ``_attn_implementation`` ("eager" where attention
    logits are soft-capped, which transformers' SDPA path would not do)."""
    from liger_models import Gemma2Config, LlamaConfig

    ours, _ = load_pair(llama_dir)
    assert ours.config._name_or_path == ours.config.name_or_path == str(llama_dir)
    ours.save_pretrained(tmp_path / "saved")
    assert "_name_or_path" not in (tmp_path / "saved" / "config.json").read_text()
    assert AutoLigerForCausalLM.from_pretrained(tmp_path / "saved").config._name_or_path == str(tmp_path / "saved")
    assert LlamaConfig.tiny()._name_or_path == ""
    assert Gemma2Config.tiny()._attn_implementation == "eager" and LlamaConfig.tiny()._attn_implementation == "sdpa"


@pytest.mark.parametrize("family", ["llama", "qwen3_moe"])
def test_accelerate_fsdp_wraps_each_decoder_layer_as_on_hf(tmp_path, family):
    """Accelerate's FSDP2 "transformer_based_wrap" (HF Trainer's fsdp="full_shard auto_wrap") finds the layer
    classes in ``_no_split_modules``: each decoder layer of ours becomes a unit, as each of HF's does; without the
    attribute nothing below the root was wrapped."""
    from accelerate.utils import FullyShardedDataParallelPlugin
    from accelerate.utils.fsdp_utils import fsdp2_prepare_auto_wrap_policy

    config = transformers.LlamaConfig if family == "llama" else transformers.Qwen3MoeConfig
    ours, hf = load_pair(save_hf(build_hf(config), tmp_path))
    wrapped = []
    for model in (ours, hf):
        plugin = FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy="transformer_based_wrap")
        policy = fsdp2_prepare_auto_wrap_policy(plugin, model)
        wrapped.append([name for name, module in model.named_modules() if policy(module)])
    assert wrapped[0] == wrapped[1] == [f"model.layers.{i}" for i in range(ours.config.num_hidden_layers)]


@pytest.mark.parametrize("family", list(TINY_MOE))
def test_trls_fused_lm_head_adds_the_load_balancing_loss_as_on_hf(family, tmp_path, loop):
    """TRL's fused LM head (its SFT, DPO, GRPO, KTO and RLOO trainers) asks the backbone for router logits when
    the config sets output_router_logits and adds HF's load-balancing loss itself: ours returns them as HF's
    backbone does (it refused the argument), and Mixtral's config answers num_experts as HF's does. Loss, aux loss,
    per-token log-probs and the router and expert gradients equal HF's model under the same head, padding included
    (fp32 bounds 5-10x the worst of 10 seeds: 1.9e-7 on the log-probs, 7.4e-7 on the gradients)."""
    from trl.trainer.utils import add_fused_lm_head

    config, sizes = TINY_MOE[family]
    ours, hf = load_pair(save_hf(build_hf(config, output_router_logits=True, router_aux_loss_coef=0.1, **sizes),
                                 tmp_path))
    ids = torch.randint(0, 128, (2, 9))
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    outs = []
    for model in (ours, hf):
        add_fused_lm_head(model)
        out = model(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True)
        out.loss.backward()
        outs.append((out, {n: p.grad for n, p in model.named_parameters() if "gate" in n or "experts" in n}))
    (a, grads_a), (b, grads_b) = outs
    assert b.aux_loss is not None and a.aux_loss.item() > 0
    assert abs(a.aux_loss.item() - b.aux_loss.item()) <= 1e-6 * b.aux_loss.item()
    assert abs(a.loss.item() - b.loss.item()) <= 1e-6 * b.loss.item()
    assert max_rel(a.log_probs, b.log_probs) <= 1e-6
    theirs = dict(hf.named_parameters())
    for name, grad in grads_a.items():
        assert name in theirs, name
        assert grad is not None and max_rel(grad, theirs[name].grad) <= 5e-6, name


def test_grpo_trainer_generates_and_trains_like_hf(llama_dir, tmp_path, loop):
    """TRL's GRPOTrainer samples completions through ``generate(..., generation_config=GenerationConfig(...))`` and
    loads a reference model for its KL term (beta > 0) as DPO does: the same seeded completions (equal rewards), and
    losses and KL equal to HF's model under the same trainer. Adam's eps is 1e-3: at its 1e-8 default a parameter
    whose gradient is fp32 rounding noise (~1e-7) still moves by about lr in the noise's direction, so ours and HF
    drifted apart by parameter and the second step's KL differed by 1.7e-4 relative (CI); with 1e-3 the step-2 KL
    (0.02-0.08 over ten seeds) agrees to 4e-8."""
    g = torch.Generator().manual_seed(0)
    data = datasets.Dataset.from_dict({"prompt": [words(g, 4) for _ in range(8)]})
    ours, hf = load_pair(llama_dir)
    logs = []
    for model in (ours, hf):
        args = trl.GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=4,
                              max_completion_length=6, max_steps=2, learning_rate=0.05, beta=0.1, logging_steps=1,
                              report_to=[], save_strategy="no", use_cpu=True, bf16=False, seed=0,
                              adam_epsilon=1e-3)
        trainer = trl.GRPOTrainer(model=model, reward_funcs=lambda completions, **_: [float(len(c))
                                                                                      for c in completions],
                                  args=args, train_dataset=data, processing_class=word_tokenizer())
        trainer.train()
        logs.append([h for h in trainer.state.log_history if "loss" in h])
    assert_same_logs(*logs, ("loss", "reward", "kl"))
    assert any(h["kl"] > 0 for h in logs[0])


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_peft_trainable_tokens_match_hf_on_tied_and_untied_heads(tmp_path, loop, tied):
    """PEFT's trainable_token_indices (new rows for added special tokens, a common chat-template fine-tune): on a tied
    model PEFT gives lm_head the same rows as the embedding, which it finds through ``_tied_weights_keys``; without
    it our head kept the old rows (logits 70 apart after a step's worth of change). Logits, loss and every gradient
    equal HF + PEFT's, and the saved adapter gives HF + PEFT the same logits."""
    ours, hf = load_pair(save_hf(build_hf(transformers.LlamaConfig, tie_word_embeddings=tied), tmp_path / "base"))
    ids = torch.randint(3, 128, (2, 9))
    ids[:, ::3] = torch.tensor([5, 6, 7])  # the trained tokens in the input and as targets
    results = []
    for model in (ours, hf):
        torch.manual_seed(0)  # the same adapters on both
        wrapped = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"],
                                                             trainable_token_indices=[5, 6, 7],
                                                             init_lora_weights=False))
        with torch.no_grad():
            for name, p in wrapped.named_parameters():
                if "trainable_tokens_delta" in name:
                    p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(1)))
        out = wrapped(input_ids=ids, labels=ids)
        out.loss.backward()
        grads = {n: p.grad for n, p in wrapped.named_parameters() if p.requires_grad}
        results.append((wrapped(input_ids=ids).logits.detach(), out.loss.detach(), grads, wrapped))
    (logits, loss, grads, wrapped), (hf_logits, hf_loss, hf_grads, _) = results
    assert max_rel(logits, hf_logits) < 1e-5 and max_rel(loss, hf_loss) < 1e-5
    assert grads.keys() == hf_grads.keys() and any("trainable_tokens" in n for n in grads)
    assert all(max_rel(g, hf_grads[n]) < 1e-4 for n, g in grads.items())
    wrapped.save_pretrained(tmp_path / "adapter")
    reloaded = peft.PeftModel.from_pretrained(load_pair(tmp_path / "base")[1], tmp_path / "adapter")
    assert max_rel(reloaded(input_ids=ids).logits.detach(), logits) < 1e-5


def test_peft_model_generates_and_calls_like_ours(llama_dir):
    ours, _ = load_pair(llama_dir)
    ids = torch.randint(3, 128, (2, 6))
    wrapped = peft.get_peft_model(copy.deepcopy(ours), lora(init_lora_weights=True))  # lora_B = 0: no change yet
    with torch.no_grad():
        assert torch.equal(wrapped.generate(input_ids=ids, max_new_tokens=4), ours.generate(ids, max_new_tokens=4))
        logits = wrapped(input_ids=ids, return_dict=True).logits
        torch.testing.assert_close(logits, ours(ids).logits)


# ---- the PreTrainedModel surface, method by method against HF ---------------------------------------------------
def test_outputs_index_like_hf_model_output():
    """Mapping view of ModelOutput: keys are the fields that are set, [0] the first of them."""
    loss, logits = torch.tensor(1.5), torch.randn(2, 3, 5)
    for fields in ({"loss": loss, "logits": logits}, {"logits": logits}, {"loss": loss}):
        ours = CausalLMOutput(**fields)
        theirs = CausalLMOutputWithPast(**fields)
        assert list(ours.keys()) == list(theirs.keys()) == list(ours) == list(theirs)
        assert ours[0] is theirs[0] and ours.to_tuple() == theirs.to_tuple() and ours[1:] == theirs[1:]
        assert [k for k, _ in ours.items()] == [k for k, _ in theirs.items()] and len(ours) == len(theirs)
        assert ("loss" in ours) == ("loss" in theirs) and ours.get("loss") is theirs.get("loss")
        for name in fields:
            assert ours[name] is theirs[name] is getattr(ours, name)
        missing = next(k for k in ("loss", "logits") if k not in fields) if len(fields) == 1 else None
        if missing:
            with pytest.raises(KeyError):
                theirs[missing]
            with pytest.raises(KeyError):
                ours[missing]


def test_outputs_keep_their_pytree_node_and_medusa_output_indexes_too():
    import torch.utils._pytree as pytree

    from liger_models.medusa.loss import MedusaOutput

    out = MedusaOutput(loss=torch.tensor(2.0), head_losses=torch.rand(3))
    leaves, spec = pytree.tree_flatten(out)
    assert any(leaf is out.loss for leaf in leaves)
    assert pytree.tree_unflatten(leaves, spec).head_losses is out.head_losses
    assert out[0] is out.loss and list(out.keys()) == ["loss", "head_losses"] and out[1] is out["head_losses"]


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("mean_resizing", [True, False])
def test_resize_token_embeddings_matches_hf(tmp_path, tied, mean_resizing):
    """Same seed, same new rows as HF (mean/covariance sampling or normal init), untied heads resized alike, the tie
    kept, config.vocab_size updated, and the logits after growing and after shrinking equal HF's."""
    directory = save_hf(build_hf(transformers.LlamaConfig, tie_word_embeddings=tied), tmp_path)
    ours, hf = load_pair(directory)
    ids = torch.randint(3, 128, (2, 7))
    for new_size, multiple in ((150, 16), (131, None), (100, None)):
        for model in (ours, hf):
            torch.manual_seed(7)
            embedding = model.resize_token_embeddings(new_size, pad_to_multiple_of=multiple,
                                                      mean_resizing=mean_resizing)
            assert embedding is model.get_input_embeddings()
        size = hf.config.vocab_size
        assert ours.config.vocab_size == size == ours.get_input_embeddings().num_embeddings
        assert ours.lm_head.weight.shape[0] == ours.lm_head.out_features == size
        assert (ours.lm_head.weight is ours.model.embed_tokens.weight) == tied
        assert torch.equal(ours.model.embed_tokens.weight, hf.model.embed_tokens.weight)
        assert torch.equal(ours.lm_head.weight, hf.lm_head.weight)
        with torch.no_grad():
            torch.testing.assert_close(ours(ids % size).logits, hf(ids % size).logits, rtol=1e-4, atol=1e-5)
    assert ours.resize_token_embeddings() is ours.get_input_embeddings()


@pytest.mark.parametrize("tied", [False, True])
def test_num_parameters_matches_hf(tmp_path, tied):
    ours, hf = load_pair(save_hf(build_hf(transformers.LlamaConfig, tie_word_embeddings=tied), tmp_path))
    for model in (ours, hf):
        model.model.layers[0].requires_grad_(False)
    for only_trainable in (False, True):
        for exclude_embeddings in (False, True):
            kw = dict(only_trainable=only_trainable, exclude_embeddings=exclude_embeddings)
            assert ours.num_parameters(**kw) == hf.num_parameters(**kw), kw


def loss_and_grads(model, ids: torch.Tensor) -> tuple[float, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("kwargs, every_n_layers, offload", [(None, 1, False), ({"use_reentrant": True}, 1, False),
                                                             (None, 2, False), (None, 1, True)])
def test_gradient_checkpointing_gives_the_same_loss_and_grads(llama_dir, kwargs, every_n_layers, offload):
    ours, hf = load_pair(llama_dir)
    ours.train()
    ids = torch.randint(3, 128, (2, 9))
    loss, grads = loss_and_grads(ours, ids)
    recomputed = []
    for layer in ours.model.layers:  # counted in forward itself: non-reentrant recomputation skips module hooks
        layer.forward = lambda *args, forward=layer.forward: (recomputed.append(1), forward(*args))[1]
    ours.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs, every_n_layers=every_n_layers,
                                       offload=offload)
    hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs, every_n_layers=every_n_layers)
    assert ours.is_gradient_checkpointing == hf.is_gradient_checkpointing is True
    checkpointed_loss, checkpointed = loss_and_grads(ours, ids)
    assert len(recomputed) == 2 + 2 // every_n_layers  # each checkpointed layer runs again in backward
    assert checkpointed_loss == loss and checkpointed.keys() == grads.keys()
    assert all(torch.allclose(checkpointed[n], g, rtol=1e-5, atol=1e-7) for n, g in grads.items())
    ours.gradient_checkpointing_disable()
    hf.gradient_checkpointing_disable()
    assert ours.is_gradient_checkpointing == hf.is_gradient_checkpointing is False


def test_enable_input_require_grads_like_hf(llama_dir):
    ours, hf = load_pair(llama_dir)
    ids = torch.randint(3, 128, (1, 5))
    seen = {}
    for name, model in (("ours", ours), ("hf", hf)):
        model.get_input_embeddings().requires_grad_(False)
        model.get_input_embeddings().register_forward_hook(lambda m, i, o, name=name: seen.update({name: o}))
        for enabled in (True, False):
            (model.enable_input_require_grads if enabled else model.disable_input_require_grads)()
            model(input_ids=ids)
            assert seen[name].requires_grad is enabled, (name, enabled)


def test_forward_takes_hf_arguments_and_refuses_what_it_would_ignore(llama_dir):
    ours, hf = load_pair(llama_dir)
    ids = torch.randint(3, 128, (2, 8))
    labels = ids.clone()
    labels[:, :3] = -100
    summed = ours(ids, labels=labels, normalizer=1.0).loss
    torch.testing.assert_close(ours(ids, labels=labels, num_items_in_batch=torch.tensor(7)).loss, summed / 7)
    assert ours(ids, labels=labels, return_dict=False)[0].item() == ours(ids, labels=labels).loss.item()
    none_given = dict(output_attentions=None, output_hidden_states=False, token_type_ids=None, cache_position=None)
    torch.testing.assert_close(ours(input_ids=ids, **none_given).logits, ours(ids).logits)
    with pytest.raises(ValueError, match="num_items_in_batch"):
        ours(ids, labels=labels, normalizer=3, num_items_in_batch=3)
    for key, error in (("output_attentions", ValueError), ("output_hidden_states", ValueError),
                       ("token_type_ids", TypeError), ("shift_labels", TypeError), ("use_flash", TypeError)):
        value = torch.zeros_like(ids) if key in ("token_type_ids", "shift_labels") else True
        with pytest.raises(error, match=key):
            ours(input_ids=ids, **{key: value})
    with pytest.raises(TypeError, match="KVCache"):
        ours(input_ids=ids, past_key_values=transformers.DynamicCache())
    position_ids = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4]])
    with pytest.raises(ValueError, match="cu_seq_lens_q"):
        ours(input_ids=ids[:1], position_ids=position_ids, cu_seq_lens_q=torch.tensor([0, 8], dtype=torch.int32))
    ours(input_ids=ids[:1], position_ids=position_ids, cu_seq_lens_q=torch.tensor([0, 3, 8], dtype=torch.int32),
         max_length_k=5)


@pytest.mark.parametrize("family", ["llama", "gemma"])
def test_inputs_embeds_as_hf_takes_them(tmp_path, family):
    """inputs_embeds = get_input_embeddings()(ids) gives what input_ids give, in ours and in HF (Gemma's √H
    scaling lives in HF's embedding module and after ours), with labels too."""
    config = {"llama": transformers.LlamaConfig, "gemma": transformers.GemmaConfig}[family]
    ours, hf = load_pair(save_hf(build_hf(config), tmp_path))
    ids = torch.randint(3, 128, (2, 8))
    with torch.no_grad():
        expected = hf(input_ids=ids).logits
        from_ids = ours(input_ids=ids).logits
        from_embeds = ours(inputs_embeds=ours.get_input_embeddings()(ids)).logits
        hf_from_embeds = hf(inputs_embeds=hf.get_input_embeddings()(ids)).logits
        loss = ours(inputs_embeds=ours.get_input_embeddings()(ids), labels=ids).loss
    assert torch.equal(from_embeds, from_ids)
    torch.testing.assert_close(from_embeds, hf_from_embeds, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(from_ids, expected, rtol=1e-4, atol=1e-5)
    assert loss.item() == pytest.approx(ours(ids, labels=ids).loss.item(), rel=1e-6)
    with pytest.raises(ValueError, match="not both"):
        ours(input_ids=ids, inputs_embeds=ours.get_input_embeddings()(ids))
    with pytest.raises(ValueError, match="hidden_size"):
        ours(inputs_embeds=torch.zeros(2, 8, 3))


def test_config_and_model_answer_what_peft_and_trainer_read(llama_dir):
    ours, hf = load_pair(llama_dir)
    config = ours.config
    assert config.to_dict()["model_type"] == hf.config.to_dict()["model_type"] == "llama"
    assert config.get_text_config() is config and config.use_return_dict is True
    assert config.get("vocab_size") == 128 and config.get("no_such_key", 5) == 5
    assert ours.device == hf.device and ours.dtype == hf.dtype == torch.float32
    assert ours.get_output_embeddings() is ours.lm_head and ours.get_input_embeddings() is ours.model.embed_tokens
    head = ours.lm_head
    ours.set_output_embeddings(torch.nn.Linear(64, 128, bias=False))
    ours.set_input_embeddings(torch.nn.Embedding(128, 64))
    assert ours.lm_head is not head and ours.get_input_embeddings() is ours.model.embed_tokens
    ours.add_model_tags("trl")
    ours.add_model_tags(["sft", "trl"])
    assert ours.model_tags == ["trl", "sft"]


def test_generation_config_is_a_dict_with_hfs_attribute_access(bare_dir, llama_dir, tmp_path):
    from_file = AutoLigerForCausalLM.from_pretrained(llama_dir).generation_config
    assert from_file["_from_model_config"] is True and from_file.eos_token_id == 2
    ours, _ = load_pair(bare_dir)
    assert isinstance(ours.generation_config, dict) and ours.generation_config.bos_token_id == 1
    assert default_token_id(ours, "pad_token_id") == 0 and getattr(ours.generation_config, "top_k", None) is None
    with pytest.raises(AttributeError, match="temperature"):
        ours.generation_config.temperature
    ours.generation_config.eos_token_id = [2, 5]
    assert ours.generation_config == {"bos_token_id": 1, "eos_token_id": [2, 5], "pad_token_id": 0}
    assert default_token_id(ours, "eos_token_id") == [2, 5] and default_token_id(ours, "pad_token_id") == 0
    ours.save_pretrained(tmp_path)
    reloaded = AutoLigerForCausalLM.from_pretrained(tmp_path)
    assert reloaded.generation_config == ours.generation_config and reloaded.generation_config.eos_token_id == [2, 5]
    assert copy.deepcopy(ours).generation_config.eos_token_id == [2, 5]


def test_prepare_inputs_for_generation_steps_like_one_forward(llama_dir):
    """Decoding step by step on prepare_inputs_for_generation's arguments (left padding: positions from the mask's
    cumulative sum) gives the logits of one forward over the whole sequence."""
    ours, _ = load_pair(llama_dir)
    ids = torch.randint(3, 128, (2, 7))
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        full = ours(input_ids=ids, attention_mask=mask, position_ids=positions).logits
        cache, steps = None, []
        for end in (4, 5, 6, 7):
            inputs = ours.prepare_inputs_for_generation(ids[:, :end], past_key_values=cache,
                                                        attention_mask=mask[:, :end])
            out = ours(**inputs)
            cache = out.past_key_values
            steps.append(out.logits)
    torch.testing.assert_close(torch.cat(steps, 1)[1], full[1], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(torch.cat(steps, 1)[0, 2:], full[0, 2:], rtol=1e-4, atol=1e-5)


def test_base_model_is_the_backbone_call_hf_makes(llama_dir):
    ours, hf = load_pair(llama_dir)
    ids = torch.randint(3, 128, (2, 6))
    mask = torch.ones_like(ids)
    mask[1, 4:] = 0
    with torch.no_grad():
        out = ours.base_model(input_ids=ids, attention_mask=mask, use_cache=False)
        theirs = hf.base_model(input_ids=ids, attention_mask=mask, use_cache=False)
    real = mask.bool()
    torch.testing.assert_close(out.last_hidden_state[real], theirs.last_hidden_state[real], rtol=1e-4, atol=1e-5)
    assert ours.base_model.embed_tokens is ours.model.embed_tokens and out[0] is out.last_hidden_state


@pytest.mark.parametrize("tied", [True, False])
def test_trainer_checkpoints_and_resumes_exactly(tmp_path, loop, tied):
    """Trainer's own checkpoints (it saves a model that is not a PreTrainedModel with safetensors' save_file, which
    refuses shared tensors: a tied head, packed weights): 4 steps straight equal 2 steps, a checkpoint, and a
    resumed run."""
    directory = save_hf(build_hf(transformers.LlamaConfig, tie_word_embeddings=tied), tmp_path / "base")

    def trained(out: Path, **overrides):
        model = AutoLigerForCausalLM.from_pretrained(directory, dtype=torch.float32)
        assert model.config.tie_word_embeddings == tied
        args = dict(output_dir=str(out), per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=4,
                    learning_rate=0.5, optim="sgd", lr_scheduler_type="constant", report_to=[], use_cpu=True,
                    seed=0, remove_unused_columns=False, save_strategy="steps", save_steps=2)
        trainer = transformers.Trainer(model=model, args=transformers.TrainingArguments(**{**args, **overrides}),
                                       train_dataset=token_rows(), data_collator=pad_batch)
        return trainer, model

    straight_trainer, straight = trained(tmp_path / "straight")
    straight_trainer.train()
    assert (tmp_path / "straight" / "checkpoint-2" / "model.safetensors").is_file()
    resumed_trainer, resumed = trained(tmp_path / "straight")  # the same folder: resume from its checkpoint-2
    resumed_trainer.train(resume_from_checkpoint=str(tmp_path / "straight" / "checkpoint-2"))
    for (name, a), b in zip(straight.named_parameters(), resumed.parameters()):
        assert torch.equal(a, b), name
    assert (resumed.lm_head.weight is resumed.model.embed_tokens.weight) == tied  # still tied after loading

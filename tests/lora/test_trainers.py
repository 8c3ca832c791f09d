"""Native adapters (``liger_models.lora``) under transformers' Trainer and TRL's trainers, with the real libraries.

TRL's trainers replace a model's forward with their fused LM head (``trl.trainer.utils.add_fused_lm_head``): it calls
``model.base_model`` and multiplies the hidden states by ``get_output_embeddings().weight`` itself. An adapter on
lm_head (LoRA, DoRA, trainable-token rows) lives outside that weight, so the head hands that caller its adapted
weight (``Backbone``). And TRL switches dropout off by setting every ``nn.Dropout``'s ``p`` to 0, which reaches the
adapters' input dropout only because an ``nn.Dropout`` holds its rate. The tests of those two fail without them;
the others hold docs/ecosystem.md's recipes for native adapters (DPO's reference, Trainer's checkpoints) to the real
libraries, and DPO on them to HF + PEFT.
"""

from __future__ import annotations

import pytest
import torch

trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")

from trl.trainer.utils import add_fused_lm_head, disable_dropout_in_model  # noqa: E402

from liger_models.lora import LoraSettings, add_lora, quantize_base_  # noqa: E402
from liger_models.modules.lora_linear import LoraLinear  # noqa: E402

from ..models.parity import max_rel  # noqa: E402
from .common import pair  # noqa: E402

HEADS = {
    "lora": dict(targets=["q_proj", "lm_head"]),
    "rslora": dict(targets=["v_proj", "lm_head"], use_rslora=True),
    "dora": dict(targets=["q_proj", "lm_head"], use_dora=True),
    "token-rows": dict(targets=["q_proj"], trainable_token_indices={"lm_head": [3, 5, 70]}),
    "tied-token-rows": dict(targets=["q_proj"], trainable_token_indices=[3, 5, 70]),
    "plain": dict(targets=["q_proj", "down_proj"]),
}


def _trainable_grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("head", list(HEADS))
def test_trls_fused_lm_head_computes_the_adapted_heads_loss_and_gradients(head, tmp_path, reference_kernels):
    """The loss and every trainable gradient of TRL's fused LM head on an adapted model equal the model's own
    labelled forward (one fp32 model, two computations of the same sums: 1e-6 relative on the loss, 5e-6 on the
    gradients, 5x the worst of 15 seeds; the adapted head's weight is formed once in fp32). Without the projected
    head TRL's loss was the base head's (0.7 apart on these weights) and lm_head's adapter got no gradient."""
    _, ours, _ = pair("llama", tmp_path, tie_word_embeddings=head == "tied-token-rows")
    add_lora(ours, LoraSettings(r=4, alpha=8, init=False, **HEADS[head]))
    ours.train()
    ids = torch.randint(0, ours.config.vocab_size, (3, 11))
    ids[:, ::4] = 5  # a trained token row among the inputs and the targets
    labels = ids.clone()
    labels[0, :4] = -100

    own = ours(input_ids=ids, labels=labels).loss
    own.backward()
    expected = _trainable_grads(ours)
    ours.zero_grad(set_to_none=True)

    add_fused_lm_head(ours)
    fused = ours(input_ids=ids, labels=labels, fused_lm_head=True)
    fused.loss.backward()
    got = _trainable_grads(ours)

    assert abs(fused.loss.item() - own.item()) <= 1e-6 * abs(own.item()), (fused.loss.item(), own.item())
    assert got.keys() == expected.keys()
    for name in expected:
        assert max_rel(got[name], expected[name]) <= 5e-6, name
    head_grads = [n for n in expected if n.startswith("lm_head.")]
    assert bool(head_grads) == (head not in ("plain", "tied-token-rows"))
    for name in head_grads:
        assert got[name].abs().max() > 0, name
    assert ours.get_output_embeddings() is ours.lm_head  # the projected head is handed over once


def test_an_adapted_heads_input_dropout_is_refused_in_trls_head_until_trl_turns_it_off(tmp_path, reference_kernels):
    """A per-token dropout mask has no single weight: TRL's fused head on a training lm_head adapter with dropout is
    refused with a message that says so; TRL's disable_dropout (its preference trainers' default) turns it off,
    and then the fused head computes the model's own loss."""
    _, ours, _ = pair("llama", tmp_path)
    add_lora(ours, LoraSettings(r=4, alpha=8, init=False, dropout=0.2, targets=["q_proj", "lm_head"]))
    ours.train()
    add_fused_lm_head(ours)
    ids = torch.randint(0, ours.config.vocab_size, (2, 9))
    with pytest.raises(ValueError, match=r"adapter has dropout 0.2 on its input, which no single weight computes"):
        ours(input_ids=ids, labels=ids, fused_lm_head=True)
    disable_dropout_in_model(ours)
    fused = ours(input_ids=ids, labels=ids, fused_lm_head=True).loss
    assert abs(fused.item() - ours(input_ids=ids, labels=ids).loss.item()) <= 2e-6 * fused.item()


def test_trls_disable_dropout_reaches_the_adapters_input_dropout(tmp_path, reference_kernels):
    """disable_dropout_in_model sets every nn.Dropout's p to 0: it now reaches every adapter's input dropout
    (a float attribute before, which kept dropping), so two training forwards agree exactly; setting a rate back
    restores it."""
    _, ours, _ = pair("llama", tmp_path)
    add_lora(ours, LoraSettings(r=4, alpha=8, init=False, dropout=0.3))
    ours.train()
    ids = torch.randint(0, ours.config.vocab_size, (2, 9))
    adapted = [m for m in ours.modules() if isinstance(m, LoraLinear) and m.has_adapter]
    assert adapted and all(m.lora_dropout == 0.3 for m in adapted)
    assert ours(input_ids=ids, labels=ids).loss.item() != ours(input_ids=ids, labels=ids).loss.item()
    disable_dropout_in_model(ours)
    assert all(m.lora_dropout == 0.0 for m in adapted)
    assert ours(input_ids=ids, labels=ids).loss.item() == ours(input_ids=ids, labels=ids).loss.item()
    adapted[0].lora_dropout = 0.1
    assert adapted[0].lora_dropout == 0.1 and "dropout" in dict(adapted[0].named_children())


def _preferences(n: int = 8) -> "datasets.Dataset":
    from ..models.test_ecosystem import words

    g = torch.Generator().manual_seed(0)
    return datasets.Dataset.from_dict({"prompt": [words(g, 4) for _ in range(n)],
                                       "chosen": [words(g, 3) for _ in range(n)],
                                       "rejected": [words(g, 3) for _ in range(n)]})


@pytest.mark.parametrize("qlora", [False, True], ids=["lora", "qlora"])
def test_dpo_with_native_adapters_takes_its_reference_from_the_policy_before_training(qlora, tmp_path,
                                                                                     reference_kernels):
    """docs/lora.md's DPO recipe for native adapters: ``precompute_ref_log_probs=True`` makes TRL score the
    reference with the policy itself before the first step, which with fresh adapters (B = 0) is the base the
    adapters train on, the NF4 base under QLoRA (a reference loaded from ``_name_or_path`` would be the dense
    checkpoint instead, and a second model). The first step's rewards are then exactly 0 and its loss log 2; the
    adapters (lm_head's included) train and the policy moves away from the reference."""
    from ..models.test_ecosystem import word_tokenizer

    _, ours, _ = pair("llama", tmp_path)
    if qlora:
        quantize_base_(ours)
    add_lora(ours, LoraSettings(r=4, alpha=8, targets=["q_proj", "v_proj", "down_proj", "lm_head"]))
    args = trl.DPOConfig(output_dir=str(tmp_path / "out"), per_device_train_batch_size=2, max_steps=3,
                         logging_steps=1, learning_rate=0.05, optim="sgd", lr_scheduler_type="constant",
                         report_to=[], save_strategy="no", use_cpu=True, bf16=False, seed=0,
                         precompute_ref_log_probs=True)
    trainer = trl.DPOTrainer(model=ours, args=args, train_dataset=_preferences(), processing_class=word_tokenizer())
    assert trainer.ref_model is None
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert logs[0]["rewards/chosen"] == 0.0 and logs[0]["rewards/rejected"] == 0.0
    assert abs(logs[0]["loss"] - 0.6931471805599453) <= 1e-6
    assert any(h["rewards/chosen"] != 0 for h in logs[1:])
    assert ours.lm_head.lora_B.weight.abs().max() > 0


@pytest.mark.parametrize("qlora", [False, True], ids=["lora", "qlora"])
def test_trainer_checkpoints_native_adapters_and_resumes_exactly(qlora, tmp_path, reference_kernels):
    """Trainer saves a model that is not a PreTrainedModel as its state dict: the adapters, norms and dense weights
    (an NF4 base's codes are no state of the run: the base is rebuilt from its checkpoint). 4 steps straight equal 2
    steps, a checkpoint and a resumed run, bit for bit, with the adapters' input dropout drawing masks throughout
    (Trainer restores the RNG states the masks are drawn from)."""
    import transformers

    from ..models.test_ecosystem import pad_batch, token_rows

    _, _, directory = pair("llama", tmp_path)

    def trained(out):
        from liger_models import AutoLigerForCausalLM

        model = AutoLigerForCausalLM.from_pretrained(directory, dtype=torch.float32)
        if qlora:
            quantize_base_(model)
        add_lora(model, LoraSettings(r=4, alpha=8, dropout=0.1, targets=["q_proj", "v_proj", "down_proj", "lm_head"]))
        args = transformers.TrainingArguments(
            output_dir=str(out), per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=4,
            learning_rate=0.05, lr_scheduler_type="constant", report_to=[], use_cpu=True, seed=0,
            remove_unused_columns=False, save_strategy="steps", save_steps=2)
        return transformers.Trainer(model=model, args=args, train_dataset=token_rows(), data_collator=pad_batch), model

    straight_trainer, straight = trained(tmp_path / "run")
    straight_trainer.train()
    assert (tmp_path / "run" / "checkpoint-2" / "model.safetensors").is_file()
    resumed_trainer, resumed = trained(tmp_path / "run")
    resumed_trainer.train(resume_from_checkpoint=str(tmp_path / "run" / "checkpoint-2"))
    trainable = [n for n, p in straight.named_parameters() if p.requires_grad]
    assert any("lm_head.lora_B" in n for n in trainable)
    for (name, a), b in zip(straight.named_parameters(), resumed.parameters()):
        assert torch.equal(a, b), name
    assert straight.lm_head.lora_B.weight.abs().max() > 0


def test_dpo_on_native_adapters_trains_as_hf_peft_does(tmp_path, reference_kernels):
    """The same adapters (ours, saved in PEFT's format and loaded trainable into HF + PEFT) under the same DPO run
    with the reference taken before training: loss, rewards and log-probabilities equal HF + PEFT's step by step
    (fp32, the ecosystem tests' 1e-5). Not on lm_head: TRL refuses a PEFT adapter there, for the reason the
    projected head exists (its fused head reads lm_head.weight); ours there is held to the model's own loss above."""
    import peft
    import transformers

    from liger_models.lora import save_adapter

    from ..models.test_ecosystem import assert_same_logs, word_tokenizer

    _, ours, directory = pair("llama", tmp_path)
    add_lora(ours, LoraSettings(r=4, alpha=8, targets=["q_proj", "v_proj", "down_proj"]))
    save_adapter(ours, tmp_path / "adapter")
    theirs = peft.PeftModel.from_pretrained(
        transformers.AutoModelForCausalLM.from_pretrained(directory, attn_implementation="eager",
                                                          dtype=torch.float32),
        str(tmp_path / "adapter"), is_trainable=True)
    logs = []
    for model in (ours, theirs):
        args = trl.DPOConfig(output_dir=str(tmp_path / "out"), per_device_train_batch_size=2, max_steps=3,
                             logging_steps=1, learning_rate=0.05, optim="sgd", lr_scheduler_type="constant",
                             report_to=[], save_strategy="no", use_cpu=True, bf16=False, seed=0,
                             precompute_ref_log_probs=True)
        trainer = trl.DPOTrainer(model=model, args=args, train_dataset=_preferences(),
                                 processing_class=word_tokenizer())
        trainer.train()
        logs.append([h for h in trainer.state.log_history if "loss" in h])
    assert_same_logs(*logs, ("loss", "rewards/chosen", "rewards/rejected", "logps/chosen", "logps/rejected"))
    assert any(h["rewards/chosen"] != 0 for h in logs[0])

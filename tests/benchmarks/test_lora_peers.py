"""The peers bench_lora.py measures ours against are built as their users build them: HF + PEFT and HF + PEFT +
bitsandbytes (QLoRA) on a tiny Llama on the CPU, each checked for what the benchmark claims of it.

A peer built wrong is a silently wrong number: bitsandbytes linears put in place by hand (not through
from_pretrained's quantization_config) lack the mark that makes PEFT's prepare_model_for_kbit_training turn on the
activation checkpointing it is asked for, and the QLoRA peer then ran out of memory at lengths where checkpointing
would have fitted. So the check here is on behaviour, the bytes a training step keeps for backward, not on a flag."""

import sys
from pathlib import Path

import pytest
import torch

from tests.helpers import SavedBytes
from tests.lora.bnb import import_bnb

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import bench_lora  # noqa: E402

bnb = import_bnb()
TINY = dict(model_type="llama", hidden_size=128, intermediate_size=256, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=97, tie_word_embeddings=False, rms_norm_eps=1e-5,
            max_position_embeddings=1024)
T = 256


def _saved_bytes_of_a_step(model) -> int:
    """Bytes autograd keeps for backward in one training step (what activation checkpointing removes), then the
    backward itself, so that a peer that cannot train fails here."""
    ids = torch.randint(0, TINY["vocab_size"], (1, T))
    with SavedBytes(exclude=model.parameters()) as saved:
        out = model(input_ids=ids, labels=ids)
    assert out.past_key_values is None  # a training step builds no KV cache (ours does not either)
    out.loss.backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
    return saved.total


@pytest.mark.parametrize("provider", ["hf_peft", pytest.param("hf_peft_bnb", marks=pytest.mark.skipif(
    bnb is None, reason="bitsandbytes does not import here"))])
def test_a_checkpointed_peer_keeps_a_fraction_of_the_activations(provider):
    torch.manual_seed(0)
    kept = {}
    for checkpointing in (False, True):
        model = bench_lora._build(provider, TINY, checkpointing, device="cpu")
        model.train()
        kept[checkpointing] = _saved_bytes_of_a_step(model)
    # without checkpointing each layer keeps ~20 tensors of T × hidden or more; with it only its input stays
    assert kept[True] < kept[False] / 4, kept


@pytest.mark.skipif(bnb is None, reason="bitsandbytes does not import here")
def test_the_qlora_peer_is_peft_s_recipe_on_nf4_linears():
    model = bench_lora._build("hf_peft_bnb", TINY, True, device="cpu")
    base = model.base_model.model.model
    adapted = [m.base_layer for m in base.layers.modules() if hasattr(m, "base_layer")]
    assert len(adapted) == 7 * TINY["num_hidden_layers"]
    assert all(isinstance(m, bnb.nn.Linear4bit) and m.weight.quant_type == "nf4" and m.weight.bnb_quantized
               for m in adapted)
    # prepare_model_for_kbit_training's fp32 copy of what is not 4-bit (norms, embeddings, lm_head), as users get it
    assert base.norm.weight.dtype == torch.float32 and base.embed_tokens.weight.dtype == torch.float32
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)


def test_a_peer_whose_checkpointing_did_not_take_is_refused(monkeypatch):
    import transformers

    monkeypatch.setattr(transformers.PreTrainedModel, "gradient_checkpointing_enable", lambda self, **kw: None)
    with pytest.raises(RuntimeError, match="activation checkpointing of the decoder layers"):
        bench_lora._build("hf_peft", TINY, True, device="cpu")


class _MatmulDtypes(torch.utils._python_dispatch.TorchDispatchMode):
    """The dtypes of every matrix product (and attention) dispatched while active, forward and backward."""

    OPS = ("mm", "addmm", "bmm", "baddbmm", "_scaled_dot_product")

    def __init__(self):
        super().__init__()
        self.seen = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name.startswith(self.OPS):
            self.seen.add((name, args[0].dtype))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("provider", ["hf_peft", pytest.param("hf_peft_bnb", marks=pytest.mark.skipif(
    bnb is None, reason="bitsandbytes does not import here"))])
def test_a_peer_s_step_multiplies_in_bf16_as_trainer_bf16_runs_it(provider):
    """prepare_model_for_kbit_training leaves the QLoRA peer's norms, embeddings and lm_head in fp32 (and PEFT its
    adapters): run bare, its residual stream, attention and logits are fp32 GEMMs, a third of the speed its users get
    under Trainer(bf16=True)'s autocast. bench_lora's step context is that autocast: every product in bf16."""
    model = bench_lora._build(provider, TINY, True, device="cpu")
    model.train()
    ids = torch.randint(0, TINY["vocab_size"], (1, 64))
    with _MatmulDtypes() as bare:
        model(input_ids=ids, labels=ids).loss.backward()
    if provider == "hf_peft_bnb":
        assert any(dtype == torch.float32 for _, dtype in bare.seen), bare.seen  # what the context is there for
    model.zero_grad(set_to_none=True)
    with _MatmulDtypes() as ran:
        with bench_lora.step_context(provider, torch):
            out = model(input_ids=ids, labels=ids)
        out.loss.backward()
    assert out.logits.dtype == torch.bfloat16
    assert ran.seen and {dtype for _, dtype in ran.seen} == {torch.bfloat16}, ran.seen
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


@pytest.mark.parametrize("provider", ["ours", "ours_qlora", "ours_offload", "ours_qlora_offload", "ours_qlora_chunks",
                                      "ours_dora", "ours_autocast"])
def test_our_providers_are_built_as_named(provider):
    """Each of our rows measures what its name says: an NF4 base exactly where it says qlora, checkpoints in host
    memory where it says offload, MLP chunks where it says chunks, DoRA where it says dora, LoRA on every decoder
    linear and nothing else trainable; and a training step runs."""
    from liger_models.lora import lora_modules
    from liger_models.modules.causal_lm import offloaded_checkpoint

    model = bench_lora._build(provider, TINY, True, device="cpu")
    adapted = lora_modules(model)
    assert len(adapted) == 7 * TINY["num_hidden_layers"]
    nf4 = [n for n, m in model.named_modules() if getattr(m, "quant", None) is not None]
    assert (len(nf4) == len(adapted)) if "qlora" in provider else not nf4
    assert all(m.use_dora == (provider == "ours_dora") for m in adapted.values())
    assert model.is_activation_checkpointing
    assert (model.model.checkpoint_fn.func is offloaded_checkpoint) == provider.endswith("_offload")
    assert {layer.mlp_chunk_tokens for layer in model.model.layers} == ({8192} if "chunks" in provider else {None})
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    model.train()
    ids = torch.randint(0, TINY["vocab_size"], (1, 32))
    model(ids, labels=ids).loss.backward()
    assert all(p.grad is not None for n, p in model.named_parameters() if p.requires_grad)


@pytest.mark.parametrize("provider", ["ours", "hf_peft"])
def test_dropout_reaches_every_adapter_of_both_sides(provider, monkeypatch):
    """--dropout (through the environment to the worker processes) is every adapter's lora_dropout, ours and PEFT's
    alike; without it, none."""
    for value in ("0.1", None):
        if value is None:
            monkeypatch.delenv("LIGER_BENCH_LORA_DROPOUT", raising=False)
        else:
            monkeypatch.setenv("LIGER_BENCH_LORA_DROPOUT", value)
        model = bench_lora._build(provider, TINY, False, device="cpu")
        if provider == "ours":
            from liger_models.lora import lora_modules

            rates = {m.lora_dropout for m in lora_modules(model).values()}
        else:
            rates = {m.lora_dropout["default"].p if hasattr(m.lora_dropout["default"], "p") else 0.0
                     for m in model.modules() if hasattr(m, "lora_dropout") and "default" in m.lora_dropout}
        assert rates == {float(value or 0)}, rates


def test_ours_under_autocast_is_our_step_under_trainer_bf16():
    """ours_autocast runs our step under bf16 autocast (what HF Trainer's and TRL's bf16=True give), the step our
    plain row runs: the same loss and adapter gradients bit for bit."""
    runs = []
    for provider in ("ours", "ours_autocast"):
        torch.manual_seed(0)
        model = bench_lora._build(provider, TINY, False, device="cpu")
        model.train()
        ids = torch.randint(0, TINY["vocab_size"], (1, 32), generator=torch.Generator().manual_seed(1))
        with bench_lora.step_context(provider, torch):
            loss = model(ids, labels=ids).loss
        loss.backward()
        runs.append((loss.detach(), [p.grad for p in model.parameters() if p.requires_grad]))
    assert isinstance(bench_lora.step_context("ours_autocast", torch), torch.autocast)
    assert torch.equal(runs[0][0], runs[1][0])
    assert all(torch.equal(a, b) for a, b in zip(runs[0][1], runs[1][1]))

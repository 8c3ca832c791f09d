"""torch.compile over our models: the fused kernels are torch.library custom ops (liger_models/kernels/_custom_ops.py),
so ``torch.compile(model, fullgraph=True)`` traces a whole training step (dynamo the forward, AOTAutograd the
backward) without a graph break, and the compiled step runs the same kernels as the eager one.

On the CPU the real Triton kernels run in the interpreter. Backend "aot_eager" (dynamo and AOTAutograd, no code
generation) gives the eager loss and gradients bit for bit; "inductor" generates C++ for the PyTorch ops between the
custom ops and fuses them, so its gradients agree to fp32 rounding. ``pytest -m gpu`` compiles a bf16 step with
inductor on CUDA (docs/ecosystem.md#torchcompile).
"""

from __future__ import annotations

import pytest
import torch
import transformers

from liger_models import AutoLigerForCausalLM
from liger_models.auto import MODEL_CLASSES
from liger_models.llama import LigerLlamaForCausalLM, LlamaConfig
from liger_models.train.optim import FusedAdamW

from .parity import build_hf, max_rel, save_hf


def _tiny_llama(layers: int = 2, **overrides) -> LigerLlamaForCausalLM:
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, **overrides)
    return LigerLlamaForCausalLM.from_config(config)


def _training_step(run, model, ids, **kwargs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(loss, gradients by parameter name) of one forward + backward of ``run`` (the model, or it compiled)."""
    model.zero_grad(set_to_none=True)
    loss = run(ids, labels=ids, **kwargs).loss
    loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}


FAMILY_CONFIGS = [
    (transformers.LlamaConfig, {}),
    (transformers.GemmaConfig, {"head_dim": 16, "hidden_activation": "gelu_pytorch_tanh"}),
    (transformers.Phi3Config, {"pad_token_id": 0}),
    (transformers.Gemma2Config, {"head_dim": 16, "sliding_window": 4, "attn_logit_softcapping": 0.5,
                                 "final_logit_softcapping": 0.3}),
    (transformers.Gemma3TextConfig, {"head_dim": 16, "sliding_window": 4, "sliding_window_pattern": 2}),
]


# "cpu reference": a CPU without Triton's interpreter, where every custom op runs its PyTorch reference, as for a
# user training on the CPU; Llama (SwiGLU) and Gemma (GeGLU) cover those ops (the others differ in attention, which
# is no custom op).
@pytest.mark.parametrize("config_cls, extra, kernels", [
    *((cls, extra, "interpreted") for cls, extra in FAMILY_CONFIGS),
    *((cls, extra, "cpu reference") for cls, extra in FAMILY_CONFIGS[:2]),
])
def test_compiled_model_equals_eager(config_cls, extra, kernels, tmp_path, monkeypatch):
    if kernels == "cpu reference":
        monkeypatch.setenv("TRITON_INTERPRET", "0")
    torch._dynamo.reset()
    model = AutoLigerForCausalLM.from_pretrained(save_hf(build_hf(config_cls, **extra), tmp_path / "hf"),
                                                 dtype=torch.float32)
    ids = torch.randint(3, model.config.vocab_size, (2, 12))
    positions = torch.cat([torch.arange(5), torch.arange(7)])[None].repeat(2, 1)  # two packed documents per row
    results = []
    for run in (model, torch.compile(model, fullgraph=True, backend="aot_eager")):
        loss, grads = _training_step(run, model, ids, position_ids=positions)
        with torch.no_grad():
            logits = run(ids, position_ids=positions).logits
        results.append((loss, logits, grads))
    (loss, logits, grads), (c_loss, c_logits, c_grads) = results
    assert torch.equal(c_loss, loss) and torch.equal(c_logits, logits)
    for name in grads:
        assert torch.equal(c_grads[name], grads[name]), name


@pytest.mark.parametrize("call", ["training", "packed documents", "inference"])
def test_dynamo_explain_finds_no_graph_break(call):
    """One graph for a labelled forward (the loss included; its backward is AOTAutograd's), for packed documents
    (position_ids restarting at 0) and for logits under no_grad."""
    torch._dynamo.reset()
    model = _tiny_llama()
    ids = torch.randint(3, 128, (2, 12))
    kwargs = {"labels": ids}
    if call == "packed documents":
        kwargs["position_ids"] = torch.cat([torch.arange(5), torch.arange(7)])[None].repeat(2, 1)
    with torch.set_grad_enabled(call != "inference"):
        explained = torch._dynamo.explain(model)(ids, **({} if call == "inference" else kwargs))
    assert explained.graph_break_count == 0, [b.reason for b in explained.break_reasons]
    assert explained.graph_count == 1


def test_inductor_training_step_on_cpu_matches_eager():
    """Inductor runs on the CPU with the kernels in the interpreter: the custom ops stay calls into this package,
    the PyTorch ops between them become generated C++ (embedding backward, SDPA's decomposition, the rotary
    tables), which rounds differently from eager's kernels."""
    torch._dynamo.reset()
    model = _tiny_llama(layers=1)
    ids = torch.randint(3, 128, (2, 12))
    loss, grads = _training_step(model, model, ids)
    c_loss, c_grads = _training_step(torch.compile(model, fullgraph=True, backend="inductor"), model, ids)
    assert max_rel(c_loss, loss) <= 1e-6
    for name in grads:
        assert max_rel(c_grads[name], grads[name]) <= 1e-5, name


def test_inductor_finds_the_custom_ops_registered_before_it_lowers_them(monkeypatch):
    """Inductor's implicit fallback for an op it has no lowering for formats the op's input IR into a log line,
    eagerly in torch 2.11 whatever the log level; our ops' IR is a chain of extern kernels printed as a tree, which
    grows ~10x per layer before the final norm and the loss (a 16-layer compile never ended). So the ops are
    registered as fallbacks first (_custom_ops._register_inductor_fallbacks): none is missing when lowering starts."""
    from torch._inductor import graph, lowering

    from liger_models.kernels import _custom_ops

    ops = [getattr(torch.ops.liger_models, name).default for name in _custom_ops._OP_NAMES]
    for op in ops:  # as in a fresh process: an earlier test's compile registered them
        monkeypatch.delitem(lowering.lowerings, op, raising=False)
    missing, run = [], graph.GraphLowering.run

    def run_checked(self, *args):
        missing.append([str(op) for op in ops if op not in lowering.lowerings])
        return run(self, *args)

    monkeypatch.setattr(graph.GraphLowering, "run", run_checked)
    torch._dynamo.reset()
    model = _tiny_llama(layers=1)
    ids = torch.randint(3, 128, (2, 12))
    # Lowered, not found in a cache. The config's own patch: monkeypatch's undo deletes a config module's entry.
    with torch._inductor.config.patch(force_disable_caches=True):
        _training_step(torch.compile(model, fullgraph=True, backend="inductor"), model, ids)
    assert missing == [[], []]  # the forward and the backward graph


@pytest.mark.gpu
def test_inductor_training_steps_on_cuda_match_eager():
    """A bf16 Llama trained for three steps with inductor (fullgraph) follows the eager run: the fused ops are the
    same kernels, inductor compiles everything between them."""
    torch._dynamo.reset()
    config = LlamaConfig(vocab_size=32000, hidden_size=512, intermediate_size=1536, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=1024)
    torch.manual_seed(0)
    eager = LigerLlamaForCausalLM.from_config(config, dtype=torch.bfloat16, device="cuda")
    compiled = LigerLlamaForCausalLM.from_config(config, dtype=torch.bfloat16, device="cuda")
    compiled.load_state_dict(eager.state_dict())
    run = torch.compile(compiled, fullgraph=True, backend="inductor")
    batches = [torch.randint(0, config.vocab_size, (4, 512), device="cuda") for _ in range(3)]
    optimizers = [torch.optim.SGD(m.parameters(), lr=1e-2) for m in (eager, compiled)]
    for ids in batches:
        e_loss, e_grads = _training_step(eager, eager, ids)
        c_loss, c_grads = _training_step(run, compiled, ids)
        assert abs(c_loss.item() - e_loss.item()) <= 1e-2 * abs(e_loss.item())
        for name in e_grads:
            diff = (c_grads[name].float() - e_grads[name].float()).norm()
            assert diff <= 2e-2 * e_grads[name].float().norm() + 1e-6, name
        for optimizer in optimizers:
            optimizer.step()
    explained = torch._dynamo.explain(compiled)(batches[0], labels=batches[0])
    assert explained.graph_break_count == 0, [b.reason for b in explained.break_reasons]


@pytest.mark.parametrize("model_type", ["llama", "gemma3_text", "qwen3_moe"])
def test_training_steps_compile_once(model_type):
    """Three training steps (forward, backward, optimizer step) of a compiled model compile one graph: no state the
    first call leaves behind (rotary tables cached per device, the optimizer's state) makes a later call recompile a
    whole model. One family per kind of state: one RoPE table, two (Gemma 3's local and global), routed experts."""
    torch._dynamo.reset()
    cls = MODEL_CLASSES[model_type]
    model = cls.from_config(cls.config_class.tiny())
    run = torch.compile(model, fullgraph=True, backend="aot_eager")
    optimizer = FusedAdamW(model.parameters(), lr=1e-3)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for _ in range(3):
            ids = torch.randint(3, model.config.vocab_size, (2, 12))
            run(ids, labels=ids).loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

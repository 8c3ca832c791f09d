"""Every standard way to save a module round-trips our models exactly, packed q|k|v and gate|up storage included.

The packed weights are views of one buffer per group; savers that look for shared storage (safetensors, accelerate)
must see independent tensors in ``state_dict()``, and loading must write into the packed buffer, not beside it.
"""

from __future__ import annotations

import pytest
import torch
import transformers

from liger_models import AutoLigerForCausalLM

from .parity import build_hf, save_hf


@pytest.fixture(params=["llama", "phi3"])
def checkpoint(request, tmp_path):
    config = {"llama": transformers.LlamaConfig, "phi3": transformers.Phi3Config}[request.param]
    return save_hf(build_hf(config, tie_word_embeddings=request.param == "llama"), tmp_path / request.param)


def _reference(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _zeroed(checkpoint):
    model = AutoLigerForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    return model


def _assert_restored(model, reference: dict[str, torch.Tensor]) -> None:
    state = model.state_dict()
    assert set(state) == set(reference)
    for name, value in reference.items():
        assert torch.equal(state[name], value), name
    # Still one GEMM per group: loading wrote into the packed buffer.
    attn = model.model.layers[0].self_attn
    if hasattr(attn, "k_proj"):
        q, k = attn.q_proj.weight, attn.k_proj.weight
        assert k.data_ptr() == q.data_ptr() + q.numel() * q.element_size()


def _trained(checkpoint):
    """Weights that differ from the checkpoint's, so a load that silently keeps the old ones is caught."""
    model = AutoLigerForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.01)
    return model


def test_state_dict_tensors_own_their_storage_and_parameters_stay_packed(checkpoint):
    model = AutoLigerForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    state = model.state_dict()
    storages = {}
    for name, t in state.items():
        storages.setdefault(t.untyped_storage().data_ptr(), set()).add(name)
    shared = [names for names in storages.values() if len(names) > 1 and names != {"model.embed_tokens.weight",
                                                                                  "lm_head.weight"}]
    assert not shared, shared
    attn = model.model.layers[0].self_attn
    live = model.state_dict(keep_vars=True)
    packed = attn.projections()[0].weight
    assert live[next(k for k in live if k.endswith("self_attn." + ("q_proj" if hasattr(attn, "q_proj") else
                                                                   "qkv_proj") + ".weight"))] is packed


def test_safetensors_save_model_load_model(checkpoint, tmp_path):
    from safetensors.torch import load_model, save_model

    model = _trained(checkpoint)
    reference = _reference(model)
    save_model(model, str(tmp_path / "m.safetensors"))
    restored = _zeroed(checkpoint)
    missing, unexpected = load_model(restored, str(tmp_path / "m.safetensors"))
    assert not missing and not unexpected
    _assert_restored(restored, reference)


def test_torch_save_state_dict(checkpoint, tmp_path):
    model = _trained(checkpoint)
    reference = _reference(model)
    torch.save(model.state_dict(), tmp_path / "sd.pt")
    restored = _zeroed(checkpoint)
    restored.load_state_dict(torch.load(tmp_path / "sd.pt", weights_only=True))
    _assert_restored(restored, reference)


def test_accelerate_save_state_load_state_and_save_model(checkpoint, tmp_path):
    accelerate = pytest.importorskip("accelerate")
    from safetensors.torch import load_file

    model = _trained(checkpoint)
    reference = _reference(model)
    accelerator = accelerate.Accelerator(cpu=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = accelerator.prepare(model, optimizer)
    accelerator.save_state(str(tmp_path / "state"))
    accelerator.save_model(model, str(tmp_path / "exported"))
    exported = load_file(str(tmp_path / "exported" / "model.safetensors"))
    tied = {"lm_head.weight"} if model.config.tie_word_embeddings else set()
    assert set(exported) | tied == set(reference)
    for name, value in exported.items():
        assert torch.equal(value, reference[name]), name
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    accelerator.load_state(str(tmp_path / "state"))
    _assert_restored(model, reference)


def test_torch_distributed_checkpoint(checkpoint, tmp_path):
    import torch.distributed.checkpoint as dcp

    model = _trained(checkpoint)
    reference = _reference(model)
    dcp.save(model.state_dict(), checkpoint_id=str(tmp_path / "dcp"))
    restored = _zeroed(checkpoint)
    state = restored.state_dict()
    dcp.load(state, checkpoint_id=str(tmp_path / "dcp"))
    restored.load_state_dict(state)
    _assert_restored(restored, reference)


def test_save_pretrained_then_transformers_loads_the_same_weights(checkpoint, tmp_path):
    model = _trained(checkpoint)
    reference = _reference(model)
    model.save_pretrained(tmp_path / "out")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32)
    hf_state = hf.state_dict()
    for name, value in reference.items():
        assert torch.equal(hf_state[name], value), name

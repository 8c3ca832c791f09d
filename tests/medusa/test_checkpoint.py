"""Checkpoint round trips, bit-exact: Medusa/TGI format B, upstream v0.1 variants, vLLM layout, stage-2 full save."""

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

import liger_models.medusa.checkpoint as ckpt
from liger_models.convert.medusa import load_vllm, save_vllm
from liger_models.medusa import MedusaModel
from tests.medusa._common import make_base

V, H = 37, 16


def _model(share, L, K=3, dtype=torch.float32, stage=1):
    model = MedusaModel.from_base(make_base(V, H, dtype), stage=stage, num_heads=K, num_layers=L, share_lm_head=share,
                                  base_model_name_or_path="org/base-model", scheduler="sine_0.5")
    for p in model.heads.parameters():
        p.data.normal_()
    return model


def _assert_same_heads(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert sa[k].dtype == sb[k].dtype and torch.equal(sa[k], sb[k]), k
    assert a.config == b.config


@pytest.mark.parametrize("share", [False, True])
@pytest.mark.parametrize("L", [1, 2])
def test_format_b_round_trip(tmp_path, share, L):
    model = _model(share, L, dtype=torch.bfloat16)
    model.save_pretrained(str(tmp_path))
    assert sorted(os.listdir(tmp_path)) == ["config.json", "medusa_lm_head.safetensors"]
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["base_model_name_or_path"] == "org/base-model"
    assert (cfg["medusa_num_heads"], cfg["medusa_num_layers"], cfg["hidden_size"], cfg["vocab_size"]) == (3, L, H, V)
    assert cfg.get("version") == ("2" if share else None)
    keys = set(load_file(tmp_path / "medusa_lm_head.safetensors"))
    assert keys == set(model.heads.state_dict())
    loaded = MedusaModel.from_pretrained(str(tmp_path), base=model.base)
    _assert_same_heads(model.heads, loaded.heads)
    assert loaded.stage == 1 and loaded.heads.weight(0).dtype == torch.bfloat16
    if share:
        assert loaded.heads.weight(0).data_ptr() == model.base.lm_head.weight.data_ptr()


def test_upstream_v01_pt_with_prefix_and_wrong_head_count(tmp_path):
    model = _model(False, 1, K=5)
    torch.save({f"medusa_head.{k}": v for k, v in model.heads.state_dict().items()}, tmp_path / "medusa_lm_head.pt")
    # The released Vicuna v1.3 configs say 2 heads for files holding 5, and carry no sizes.
    (tmp_path / "config.json").write_text(json.dumps(
        {"base_model_name_or_path": "lmsys/vicuna-7b-v1.3", "medusa_num_heads": 2, "medusa_num_layers": 1}))
    with pytest.warns(UserWarning, match="holds 5 heads"):
        loaded = MedusaModel.from_pretrained(str(tmp_path), base=model.base)
    assert loaded.config.num_heads == 5
    assert all(torch.equal(a, b) for a, b in zip(model.heads.state_dict().values(), loaded.heads.state_dict().values()))


def test_config_file_disagreement_raises(tmp_path):
    model = _model(False, 2)
    model.save_pretrained(str(tmp_path))
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "medusa_num_layers": 1}))
    with pytest.raises(ValueError, match="disagrees"):
        MedusaModel.from_pretrained(str(tmp_path), base=model.base)
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "version": "2"}))
    with pytest.raises(ValueError, match="disagrees"):
        MedusaModel.from_pretrained(str(tmp_path), base=model.base)


def test_shared_heads_need_the_base(tmp_path):
    model = _model(True, 1)
    model.save_pretrained(str(tmp_path))
    with pytest.raises(ValueError, match="pass the base"):
        ckpt.load_heads(str(tmp_path))


def test_failed_save_keeps_previous_checkpoint(tmp_path, monkeypatch):
    model = _model(False, 1)
    model.save_pretrained(str(tmp_path))
    before = {p: (tmp_path / p).read_bytes() for p in os.listdir(tmp_path)}

    def crash(data, path, metadata=None):
        with open(path, "wb") as f:
            f.write(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(ckpt, "save_file", crash)
    for p in model.heads.parameters():
        p.data.add_(1)
    with pytest.raises(OSError, match="disk full"):
        model.save_pretrained(str(tmp_path))
    assert {p: (tmp_path / p).read_bytes() for p in os.listdir(tmp_path)} == before  # no temp file left either


@pytest.mark.parametrize("share", [False, True])
@pytest.mark.parametrize("L", [1, 2])
def test_vllm_round_trip(tmp_path, share, L):
    model = _model(share, L, dtype=torch.bfloat16)
    save_vllm(model.heads, str(tmp_path))
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["model_type"] == "medusa" and cfg["architectures"] == ["MedusaModel"]
    assert (cfg["num_heads"], cfg["num_hidden_layers"], cfg["hidden_size"], cfg["vocab_size"]) == (3, L, H, V)
    assert cfg["medusa_fc_bias"] is True and cfg["original_lm_head"] is share
    sd = load_file(tmp_path / "model.safetensors")
    blocks = {f"blocks.{h}.layers.{l}.{p}" for h in range(3) for l in range(L) for p in ("weight", "bias")}
    heads = {"lm_heads.0.weight"} if share else {f"lm_heads.{h}.weight" for h in range(3)}
    assert set(sd) == blocks | heads
    assert torch.equal(sd["blocks.2.layers.0.bias"], model.heads[2][0].linear.bias)
    assert torch.equal(sd["lm_heads.0.weight"], model.heads.weight(0))
    loaded = MedusaModel.from_pretrained(str(tmp_path), base=model.base)
    _assert_same_heads(model.heads, loaded.heads)
    standalone = load_vllm(str(tmp_path))  # shared: a stand-in lm_head is built from lm_heads.0.weight
    assert torch.equal(standalone.weight(1), model.heads.weight(1))


def test_vllm_bias_free_checkpoint_loads(tmp_path):
    # vLLM's usual layout: no medusa_fc_bias, no ResBlock biases, head counts under the medusa_num_* names.
    K, L = 3, 2
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["MedusaModel"], "model_type": "medusa", "hidden_size": H, "vocab_size": V,
        "medusa_num_heads": K, "medusa_num_layers": L, "truncated_vocab_size": None}))
    blocks = {f"blocks.{h}.layers.{l}.weight": torch.randn(H, H) / H for h in range(K) for l in range(L)}
    lm_heads = {f"lm_heads.{h}.weight": torch.randn(V, H) for h in range(K)}
    from safetensors.torch import save_file
    save_file({**blocks, **lm_heads}, str(tmp_path / "model.safetensors"))
    heads = load_vllm(str(tmp_path))
    assert (heads.num_heads, heads.config.num_layers) == (K, L)
    x = torch.randn(4, H)
    got = heads.logits(x)
    for h in range(K):
        y = x.double()
        for l in range(L):  # what vLLM's bias-free ResBlock computes
            y = y + torch.nn.functional.silu(y @ blocks[f"blocks.{h}.layers.{l}.weight"].double().T)
        torch.testing.assert_close(got[h].double(), y @ lm_heads[f"lm_heads.{h}.weight"].double().T,
                                   rtol=1e-5, atol=1e-5)


def test_vllm_shared_head_must_match_base(tmp_path):
    model = _model(True, 1)
    save_vllm(model.heads, str(tmp_path))
    with pytest.raises(ValueError, match="differs"):
        load_vllm(str(tmp_path), make_base(V, H).lm_head)
    # The same lm_head in a lower precision (an fp32 export, a bf16 base) is accepted.
    bf16_head = torch.nn.Linear(H, V, bias=False, dtype=torch.bfloat16)
    bf16_head.weight.data.copy_(model.base.lm_head.weight.data)
    assert load_vllm(str(tmp_path), bf16_head).weight(0).data_ptr() == bf16_head.weight.data_ptr()


@pytest.mark.parametrize("share", [False, True])
def test_stage2_saves_full_base_in_hf_format(tmp_path, share):
    model = _model(share, 1, dtype=torch.bfloat16, stage=2)
    model.save_pretrained(str(tmp_path))
    files = set(os.listdir(tmp_path))
    weights = [f for f in files if f.endswith(".safetensors") and f != "medusa_lm_head.safetensors"]
    assert {"config.json", "medusa_lm_head.safetensors"} <= files and weights
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["model_type"] == "llama" and cfg["medusa_num_heads"] == 3 and cfg["medusa_num_layers"] == 1
    assert cfg["base_model_name_or_path"] == str(tmp_path) and cfg.get("version") == ("2" if share else None)
    loaded = MedusaModel.from_pretrained(str(tmp_path))  # base and heads both from the directory
    assert loaded.stage == 2 and loaded.config.base_model_name_or_path == str(tmp_path)
    model.heads.config.base_model_name_or_path = str(tmp_path)  # the trained base is the one saved here
    _assert_same_heads(model.heads, loaded.heads)
    a, b = model.base.state_dict(), loaded.base.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # transformers reads the same directory (the medusa_* fields ride along as extra config attributes).
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.bfloat16)
    assert torch.equal(hf.lm_head.weight, model.base.lm_head.weight)
    assert torch.equal(hf.model.layers[0].mlp.down_proj.weight, model.base.model.layers[0].mlp.down_proj.weight)


def test_stage2_save_on_a_base_from_a_stage2_checkpoint_keeps_no_stale_medusa_fields(tmp_path):
    """A base loaded from a stage-2 directory keeps that config's medusa_* / version fields (as extra config keys) and
    writes them back in its own config.json. New heads saved over it must leave only their own: a stale
    `"version": "2"` declared copied heads shared (the checkpoint no longer loaded, nor resumed), a stale
    `medusa_base_loss_weight` replaced the w0 these heads were trained with."""
    old = MedusaModel.from_base(make_base(V, H), stage=2, num_heads=3, share_lm_head=True, base_loss_weight=0.5)
    old.save_pretrained(str(tmp_path / "old"))
    base = MedusaModel.from_pretrained(str(tmp_path / "old")).base
    new = MedusaModel.from_base(base, stage=2, num_heads=2, share_lm_head=False)
    new.save_pretrained(str(tmp_path / "new"))
    cfg = json.loads((tmp_path / "new" / "config.json").read_text())
    assert "version" not in cfg and "medusa_base_loss_weight" not in cfg and cfg["medusa_num_heads"] == 2
    loaded = MedusaModel.from_pretrained(str(tmp_path / "new"))
    assert not loaded.config.share_lm_head and loaded.config.base_loss_weight is None
    new.heads.config.base_model_name_or_path = str(tmp_path / "new")
    _assert_same_heads(new.heads, loaded.heads)


def test_heads_only_dir_loads_base_from_base_model_name_or_path(tmp_path):
    model = _model(True, 1)
    model.base.save_pretrained(str(tmp_path / "base"))
    model.heads.config.base_model_name_or_path = str(tmp_path / "base")
    model.save_pretrained(str(tmp_path / "heads"))
    loaded = MedusaModel.from_pretrained(str(tmp_path / "heads"))
    _assert_same_heads(model.heads, loaded.heads)
    assert torch.equal(loaded.heads.weight(0), model.base.lm_head.weight)


@pytest.mark.parametrize("share,L,missing", [(False, 2, "medusa_num_layers"), (True, 2, "medusa_num_layers"),
                                             (True, 1, "version"), (False, 1, "version")])
def test_upstream_config_without_layers_or_version_follows_the_file(tmp_path, share, L, missing):
    """A config.json written by hand or by another tool may omit `medusa_num_layers` or `version`: the heads file
    then decides (as it does for the head count; TGI likewise picks V1/V2 by the keys it finds). Only a value that
    is present and contradicts the file is an error (test_config_file_disagreement_raises)."""
    model = _model(share, L)
    model.save_pretrained(str(tmp_path))
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg.pop(missing, None)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    loaded = MedusaModel.from_pretrained(str(tmp_path), base=model.base)
    assert (loaded.config.num_layers, loaded.config.share_lm_head) == (L, share)
    _assert_same_heads(model.heads, loaded.heads)


def test_upstream_pt_with_shared_resblocks_loads_as_independent_layers(tmp_path):
    """Upstream builds a head's layers as `[ResBlock(H)] * n` (one module n times), and torch.save
    keeps that aliasing: `{h}.0.linear.*` and `{h}.1.linear.*` are one tensor. Loaded as is, our layers would share
    storage (each optimizer step applied twice to one tensor, the layers tied forever) and safetensors would refuse
    to save them. Each layer must get its own copy, equal in value."""
    K, L = 2, 2
    sd = {}
    for h in range(K):
        block = {"linear.weight": torch.randn(H, H), "linear.bias": torch.randn(H)}
        for l in range(L):
            sd.update({f"{h}.{l}.{name}": t for name, t in block.items()})  # the same tensors under every layer
        sd[f"{h}.{L}.weight"] = torch.randn(V, H)
    torch.save(sd, tmp_path / "medusa_lm_head.pt")
    (tmp_path / "config.json").write_text(json.dumps(
        {"base_model_name_or_path": "lmsys/vicuna-7b-v1.3", "medusa_num_heads": K, "medusa_num_layers": L}))
    loaded = MedusaModel.from_pretrained(str(tmp_path), base=make_base(V, H))
    params = list(loaded.heads.parameters())
    storages = {p.untyped_storage().data_ptr() for p in params}
    assert len(storages) == len(params), "loaded layers share storage"
    for k, v in loaded.heads.state_dict().items():
        assert torch.equal(v, sd[k]), k
    loaded.save_pretrained(str(tmp_path / "out"))  # safetensors refuses aliased tensors
    again = MedusaModel.from_pretrained(str(tmp_path / "out"), base=loaded.base)
    _assert_same_heads(loaded.heads, again.heads)


def test_from_pretrained_takes_dtype_names_and_device_index(tmp_path):
    """dtype 'auto' (the base's), a dtype name, and device 0 as cuda:0 (never read as "not given"), as the causal-LM
    loaders take them."""
    base = make_base(V, H, torch.float32)
    MedusaModel.from_base(base, num_heads=2).save_pretrained(str(tmp_path))
    assert MedusaModel.from_pretrained(str(tmp_path), base=base, dtype="auto").heads[0][0].linear.weight.dtype == \
        torch.float32
    heads = MedusaModel.from_pretrained(str(tmp_path), base=base, dtype="bfloat16").heads
    assert {p.dtype for p in heads.parameters()} == {torch.bfloat16}
    with pytest.raises(ValueError, match="floating-point"):
        MedusaModel.from_pretrained(str(tmp_path), base=base, dtype="int64")
    if not torch.cuda.is_available():  # device 0 is cuda:0: on a CPU-only machine that must fail, not load on the CPU
        with pytest.raises((RuntimeError, AssertionError, AttributeError)):
            MedusaModel.from_pretrained(str(tmp_path), base=base, device=0)


@pytest.mark.parametrize("fc_bias", [None, False])
def test_vllm_biases_without_medusa_fc_bias_are_ignored_as_vllm_does(tmp_path, fc_bias):
    """vLLM builds its ResBlock Linears with a bias only when `medusa_fc_bias` is true and skips checkpoint keys that
    match no parameter: bias tensors stored without the flag (an older export, another converter) do not take part in
    what vLLM serves. load_vllm must read the file as vLLM does, with a warning, not load a different model."""
    model = _model(False, 1)
    save_vllm(model.heads, str(tmp_path))
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg.pop("medusa_fc_bias")
    if fc_bias is not None:
        cfg["medusa_fc_bias"] = fc_bias
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    sd = load_file(tmp_path / "model.safetensors")
    with pytest.warns(UserWarning, match="medusa_fc_bias"):
        heads = load_vllm(str(tmp_path))
    x = torch.randn(4, H)
    got = heads.logits(x)
    for h in range(3):  # vLLM's bias-free ResidualBlock
        y = x.double()
        y = y + torch.nn.functional.silu(y @ sd[f"blocks.{h}.layers.0.weight"].double().T)
        torch.testing.assert_close(got[h].double(), y @ sd[f"lm_heads.{h}.weight"].double().T, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
def test_vllm_standalone_shared_load_on_device_0(tmp_path):
    """load_vllm without a base builds a stand-in lm_head from lm_heads.0.weight; device 0 is cuda:0 for it too (it
    was read as "not given" and left on the CPU while the ResBlocks went to the GPU, so the heads could not run)."""
    model = _model(True, 1)
    save_vllm(model.heads, str(tmp_path))
    heads = load_vllm(str(tmp_path), device=0)
    assert {p.device for p in heads.parameters()} == {torch.device("cuda", 0)}
    assert heads.weight(0).device == torch.device("cuda", 0)
    x = torch.randn(4, H, device="cuda")
    ref = load_vllm(str(tmp_path)).logits(x.cpu())
    torch.testing.assert_close(heads.logits(x).cpu(), ref)


@pytest.mark.parametrize("stage", [1, 2])
def test_saved_files_are_readable_like_any_other_file(tmp_path, stage):
    """The atomic writes go through a temporary file; mkstemp makes it owner-only (0600), and the rename kept that
    mode: config.json and medusa_lm_head.safetensors (and a vLLM export) were unreadable to any other account (a TGI
    or vLLM server user, a teammate), while the base's files beside them followed the umask. Every file must get
    the mode a plain write gives."""
    old_umask = os.umask(0o022)
    try:
        model = _model(False, 1, stage=stage)
        model.save_pretrained(str(tmp_path / "b"))
        save_vllm(model.heads, str(tmp_path / "v"))
    finally:
        os.umask(old_umask)
    for path in ("b/config.json", "b/medusa_lm_head.safetensors", "v/config.json", "v/model.safetensors"):
        assert os.stat(tmp_path / path).st_mode & 0o777 == 0o644, path


@pytest.mark.parametrize("case", ["empty tensors", "no tensors", "1-D weight"])
def test_unusable_heads_file_raises_a_clear_error(tmp_path, case):
    """Heads saved from sharded parameters without gathering them hold empty tensors (Liger-Kernel issue #309, FSDP
    `use_orig_params`); a file can also hold no tensors at all or a mis-shaped one. Each gave an IndexError ('tuple
    index out of range') or "max() arg is an empty sequence" from deep inside the loader."""
    names = [f"{h}.{k}" for h in range(2) for k in ("0.linear.weight", "0.linear.bias", "1.weight")]
    shapes = {"0.linear.weight": (H, H), "0.linear.bias": (H,), "1.weight": (V, H)}
    sd = {n: torch.randn(shapes[n.split(".", 1)[1]]) for n in names}
    if case == "empty tensors":
        sd = {n: torch.empty(0) for n in names}
    elif case == "no tensors":
        sd = {}
    else:
        sd["1.0.linear.weight"] = torch.randn(H * H)
    save_file(sd, tmp_path / "medusa_lm_head.safetensors")
    (tmp_path / "config.json").write_text(json.dumps({"base_model_name_or_path": "x", "medusa_num_heads": 2}))
    with pytest.raises(ValueError, match="Medusa heads file"):
        MedusaModel.from_pretrained(str(tmp_path), base=make_base(V, H))


def test_heads_only_save_refuses_to_overwrite_a_models_config(tmp_path):
    """A stage-1 save (or a vLLM export) writes a heads-only config.json. Into a directory that holds a model (the
    base's own directory, a stage-2 checkpoint reloaded with stage=1), that replaced the model's config.json: the
    model there could no longer be loaded, nor these heads with it. The save must refuse and leave the directory as
    it was."""
    model = _model(False, 1, stage=2)
    model.save_pretrained(str(tmp_path))
    before = {p: (tmp_path / p).read_bytes() for p in os.listdir(tmp_path)}
    heads_only = MedusaModel.from_pretrained(str(tmp_path), stage=1)
    with pytest.raises(ValueError, match="holds a model"):
        heads_only.save_pretrained(str(tmp_path))
    with pytest.raises(ValueError, match="holds a model"):  # a vLLM export's config.json alike
        save_vllm(heads_only.heads, str(tmp_path))
    assert {p: (tmp_path / p).read_bytes() for p in os.listdir(tmp_path)} == before
    heads_only.save_pretrained(str(tmp_path / "heads"))  # a directory of its own, or one with heads, is fine
    heads_only.save_pretrained(str(tmp_path / "heads"))
    MedusaModel.from_pretrained(str(tmp_path))  # the stage-2 checkpoint still loads


def test_vllm_token_map_ignored_unless_the_vocabulary_is_truncated(tmp_path):
    """vLLM reads `token_map` only when truncated_vocab_size < vocab_size: a full-vocabulary export carrying one
    loads as vLLM serves it; truncated heads (a subset of the vocabulary mapped back) are refused by name."""
    model = _model(False, 1)
    save_vllm(model.heads, str(tmp_path))
    sd = load_file(tmp_path / "model.safetensors")
    save_file({**sd, "token_map": torch.arange(V)}, tmp_path / "model.safetensors")
    _assert_same_heads(load_vllm(str(tmp_path)), model.heads)
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "truncated_vocab_size": V - 5}))
    with pytest.raises(ValueError, match="truncated vocabulary"):
        load_vllm(str(tmp_path))

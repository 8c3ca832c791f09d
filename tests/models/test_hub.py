"""Checkpoint plumbing: Hub cache resolution offline, strict loading errors, atomic saves, configs, tokenizer."""

import json
import os

import huggingface_hub
import pytest
import transformers
import torch
from safetensors.torch import load_file, save_file

from liger_models import AutoLigerForCausalLM, GemmaConfig, LigerLlamaForCausalLM, LlamaConfig, MistralConfig, \
    Phi3Config, Qwen2Config, load_tokenizer
from liger_models import hub
from liger_models.auto import model_class

REVISION = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture
def checkpoint(tmp_path):
    """A tiny untied Llama saved by us, plus a tokenizer.json."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    model = LigerLlamaForCausalLM.from_config(LlamaConfig.tiny(num_hidden_layers=1))
    path = tmp_path / "ckpt"
    model.save_pretrained(path)
    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "hello": 1, "world": 2}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path / "tokenizer.json"))
    return model, path


def hub_cache(root, checkpoint_dir, repo="org/tiny"):
    """Lay out an HF hub cache on disk: models--org--name/{refs/main, snapshots/<rev>/...}."""
    repo_dir = root / f"models--{repo.replace('/', '--')}"
    snap = repo_dir / "snapshots" / REVISION
    snap.mkdir(parents=True)
    for f in checkpoint_dir.iterdir():
        (snap / f.name).write_bytes(f.read_bytes())
    (repo_dir / "refs").mkdir()
    (repo_dir / "refs" / "main").write_text(REVISION)
    return root


@pytest.mark.parametrize("how", ["local_files_only", "HF_HUB_OFFLINE", "revision"])
def test_from_hub_resolves_offline_cache(tmp_path, checkpoint, monkeypatch, how):
    model, path = checkpoint
    cache = hub_cache(tmp_path / "hub", path)
    kwargs = dict(cache_dir=cache, local_files_only=how != "HF_HUB_OFFLINE")
    if how == "HF_HUB_OFFLINE":  # the variable is read at import, so set the constant it became
        monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    if how == "revision":
        kwargs["revision"] = REVISION
    loaded = AutoLigerForCausalLM.from_hub("org/tiny", **kwargs)
    for name, tensor in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    snap = hub.snapshot("org/tiny", cache_dir=cache, local_files_only=True)
    assert load_tokenizer(snap).encode("hello world") == [1, 2]


def test_from_hub_errors(tmp_path, checkpoint):
    cache = hub_cache(tmp_path / "hub", checkpoint[1])
    with pytest.raises(FileNotFoundError, match="org/missing"):
        LigerLlamaForCausalLM.from_hub("org/missing", cache_dir=cache, local_files_only=True)
    with pytest.raises(ValueError, match="invalid Hub repo id"):
        LigerLlamaForCausalLM.from_hub("bad//repo id", cache_dir=cache, local_files_only=True)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        AutoLigerForCausalLM.from_pretrained(tmp_path / "nowhere")


def test_from_hub_unreachable_is_not_reported_as_offline(tmp_path, monkeypatch):
    # Downloads allowed but the Hub cannot be reached: the error says so (and why), not "downloads are disabled",
    # which sent users looking for an HF_HUB_OFFLINE they never set.
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", "http://127.0.0.1:9")  # nothing listens there
    with pytest.raises(FileNotFoundError, match="could not reach the Hub") as info:
        hub.snapshot("org/tiny", cache_dir=tmp_path / "empty")
    assert "downloads are disabled" not in str(info.value)
    assert "org/tiny" in str(info.value)
    # Offline on purpose: still told that downloads are disabled.
    with pytest.raises(FileNotFoundError, match="downloads are disabled"):
        hub.snapshot("org/tiny", cache_dir=tmp_path / "empty", local_files_only=True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(FileNotFoundError, match="downloads are disabled"):
        hub.snapshot("org/tiny", cache_dir=tmp_path / "empty")


def _rewrite(path, edit):
    tensors = load_file(str(path / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})


def test_strict_loading_errors(checkpoint):
    model, path = checkpoint
    _rewrite(path, lambda t: t.update({"model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(8)}))
    AutoLigerForCausalLM.from_pretrained(path)  # stale rotary buffers are skipped
    cases = [
        (lambda t: t.pop("model.layers.0.mlp.up_proj.weight"), r"missing tensors: \['model.layers.0.mlp.up_proj"),
        (lambda t: t.update({"model.norm.weight": torch.ones(3)}), r"model.norm.weight: checkpoint \(3,\)"),
        (lambda t: t.update({"model.extra.weight": torch.ones(3)}), r"unexpected tensors.*model.extra.weight"),
        (lambda t: t.pop("lm_head.weight"), "lm_head.weight is missing but tie_word_embeddings is false"),
    ]
    original = load_file(str(path / "model.safetensors"))
    for edit, message in cases:
        save_file(dict(original), str(path / "model.safetensors"), metadata={"format": "pt"})
        _rewrite(path, edit)
        with pytest.raises(ValueError, match=message):
            AutoLigerForCausalLM.from_pretrained(path)


def test_config_errors(checkpoint):
    _, path = checkpoint
    cfg = json.loads((path / "config.json").read_text())
    for change, message in [({"model_type": "gpt2"}, "unsupported model_type 'gpt2'"),
                            ({"rope_scaling": {"rope_type": "mrope", "factor": 2.0}}, "unsupported rope type 'mrope'"),
                            ({"rope_scaling": {"type": "llama3", "factor": 8.0}}, "needs rope_scaling\\['low_freq"),
                            ({"hidden_act": "relu"}, "unsupported activation 'relu'")]:
        (path / "config.json").write_text(json.dumps({**cfg, **change}))
        with pytest.raises(ValueError, match=message):
            AutoLigerForCausalLM.from_pretrained(path)
    (path / "config.json").write_text(json.dumps({**cfg, "model_type": "qwen2"}))
    with pytest.raises(ValueError, match="loads model_type 'llama'"):
        LigerLlamaForCausalLM.from_pretrained(path)
    (path / "model.safetensors").rename(path / "pytorch_model.bin")
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(FileNotFoundError, match="only safetensors"):
        AutoLigerForCausalLM.from_pretrained(path)


@pytest.mark.parametrize("cls, change, message", [
    (LlamaConfig, {"num_key_value_heads": 0}, "num_key_value_heads must be a positive integer"),
    (LlamaConfig, {"num_attention_heads": 0}, "num_attention_heads must be a positive integer"),
    (LlamaConfig, {"head_dim": 0}, "head_dim must be a positive integer"),
    (LlamaConfig, {"vocab_size": 0}, "vocab_size must be a positive integer"),
    (LlamaConfig, {"intermediate_size": 0}, "intermediate_size must be a positive integer"),
    (LlamaConfig, {"num_hidden_layers": -1}, "num_hidden_layers must be a non-negative integer"),
    (LlamaConfig, {"hidden_size": 66, "head_dim": None},
     "hidden_size \\(66\\) is not a multiple of num_attention_heads"),
    (MistralConfig, {"sliding_window": 0}, "sliding_window must be a positive integer or null"),
    (Qwen2Config, {"use_sliding_window": True, "max_window_layers": 0, "sliding_window": -4},
     "sliding_window must be a positive integer"),
    (LlamaConfig, {"rms_norm_eps": -1e-6}, "rms_norm_eps must be >= 0"),
    (LlamaConfig, {"rope_theta": 0.0}, "rope_theta must be > 0"),
    (Phi3Config, {"partial_rotary_factor": 1.5}, "partial_rotary_factor must be in \\(0, 1\\]"),
    (Phi3Config, {"partial_rotary_factor": 0.4375}, "rotary dimension 7 .* must be even"),
    (Qwen2Config, {"use_sliding_window": True, "layer_types": ["full_attention"]}, "layer_types has 1 entries"),
    (Qwen2Config, {"layer_types": ["full_attention", "local"]}, "unknown layer type 'local'"),
])
def test_bad_config_values_raise_clear_errors(cls, change, message):
    """Values that would crash later with an unrelated error (ZeroDivisionError, IndexError) or silently give NaN or
    wrong shapes are rejected when the config is built, naming the key."""
    with pytest.raises(ValueError, match=message):
        cls.tiny(**change)
    with pytest.raises(ValueError, match=message):  # and from a config.json
        cls.from_hf({**cls.tiny().to_hf(), **change})
    # A window key no layer uses is not checked, as HF ignores it there.
    assert LlamaConfig.tiny(sliding_window=0).layer_sliding_window(0) is None
    assert Qwen2Config.tiny(sliding_window=0).layer_sliding_window(1) is None


def test_save_is_atomic_and_keeps_other_files(checkpoint, monkeypatch):
    model, path = checkpoint
    model.save_pretrained(path, max_shard_size="20KB")  # over an unsharded save: old single file must go
    names = {p.name for p in path.iterdir()}
    assert "tokenizer.json" in names and "model.safetensors" not in names and "model.safetensors.index.json" in names
    before = {p.name: p.read_bytes() for p in path.iterdir()}

    def fail(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr("liger_models.hub.save_file", fail)
    with pytest.raises(OSError, match="disk full"):
        model.save_pretrained(path)
    assert {p.name: p.read_bytes() for p in path.iterdir()} == before
    assert [p.name for p in path.parent.iterdir() if p.name.startswith(".")] == []


def test_save_over_a_directory_keeps_everything_but_the_old_save(checkpoint, monkeypatch):
    model, path = checkpoint
    (path / "README.md").write_text("notes")
    (path / "checkpoint-100").mkdir()
    (path / "checkpoint-100" / "optimizer.pt").write_bytes(b"state")
    save_file({"w": torch.ones(2)}, str(path / "medusa_lm_head.safetensors"))
    theirs = {p.name for p in path.iterdir()} - {"model.safetensors", "config.json"}
    model.save_pretrained(path, max_shard_size="20KB")
    names = {p.name for p in path.iterdir()}
    assert theirs <= names and "model.safetensors" not in names  # the old single file went, the rest stayed
    assert (path / "checkpoint-100" / "optimizer.pt").read_bytes() == b"state"
    assert torch.equal(load_file(path / "medusa_lm_head.safetensors")["w"], torch.ones(2))
    before = {p.name for p in path.iterdir()}

    real_rename = os.rename

    def swap_fails(src, dst):  # the last step of the save: the new directory into place
        if str(src).endswith(".liger-tmp") and str(dst) == str(path):
            raise OSError("rename failed")
        return real_rename(src, dst)

    monkeypatch.setattr(os, "rename", swap_fails)
    with pytest.raises(OSError, match="rename failed"):
        model.save_pretrained(path)
    assert {p.name for p in path.iterdir()} == before  # everything back in place
    assert (path / "checkpoint-100" / "optimizer.pt").read_bytes() == b"state"
    assert [p.name for p in path.parent.iterdir() if p.name.startswith(".")] == []


def test_single_file_wins_over_an_index_like_hf(checkpoint):
    model, path = checkpoint
    model.save_pretrained(path, max_shard_size="20KB")
    other = LigerLlamaForCausalLM.from_config(LlamaConfig.tiny(num_hidden_layers=1))
    save_file({k: v.contiguous() for k, v in other.state_dict().items()}, str(path / "model.safetensors"))
    loaded = AutoLigerForCausalLM.from_pretrained(path)
    assert torch.equal(loaded.model.embed_tokens.weight, other.model.embed_tokens.weight)


def test_load_in_bf16_tied_head_stored_once(tmp_path):
    model = AutoLigerForCausalLM.from_config(GemmaConfig.tiny())
    model.save_pretrained(tmp_path)
    assert "lm_head.weight" not in load_file(str(tmp_path / "model.safetensors"))
    loaded = AutoLigerForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
    assert {p.dtype for p in loaded.parameters()} == {torch.bfloat16}
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    assert torch.equal(loaded.model.norm.weight, model.model.norm.weight.bfloat16())
    assert json.loads((tmp_path / "config.json").read_text())["architectures"] == ["GemmaForCausalLM"]


def test_hub_download_selects_the_hf_weights_only():
    # What snapshot_download fetches from a Mistral-style repo: the HF shards, index, configs and tokenizer files;
    # not the second copy of the weights that mistral-inference reads (consolidated.safetensors), nor .pth/.bin.
    from huggingface_hub.utils import filter_repo_objects

    repo = ["config.json", "consolidated.safetensors", "model-00001-of-00002.safetensors",
            "model-00002-of-00002.safetensors", "model.safetensors.index.json", "tokenizer.json",
            "tokenizer_config.json", "original/consolidated.00.pth", "pytorch_model.bin"]
    fetched = set(filter_repo_objects(repo, allow_patterns=hub.ALLOW_PATTERNS, ignore_patterns=hub.IGNORE_PATTERNS))
    assert fetched == {"config.json", "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
                       "model.safetensors.index.json", "tokenizer.json", "tokenizer_config.json"}


@pytest.mark.parametrize("size,expected", [(1000, 1000), ("1000000", 10**6), ("5GB", 5 * 10**9), ("500MB", 5 * 10**8),
                                           ("2GiB", 2 * 2**30), ("5Gb", 5 * 10**9 // 8), ("200kb", 200 * 1000 // 8)])
def test_parse_size_like_hf(size, expected):
    assert hub.parse_size(size) == expected


def test_config_parsing_styles():
    v5 = {"model_type": "llama", "dtype": "bfloat16", "custom_key": 7,
          "rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 5e5}}
    v4 = {"model_type": "llama", "torch_dtype": "bfloat16", "rope_theta": 5e5, "rope_scaling": {"type": "linear",
                                                                                                 "factor": 2.0}}
    a, b = LlamaConfig.from_hf(v5), LlamaConfig.from_hf(v4)
    assert (a.rope_theta, a.rope_scaling, a.dtype) == (b.rope_theta, b.rope_scaling, b.dtype) == (
        5e5, {"factor": 2.0, "rope_type": "linear"}, torch.bfloat16)
    out = a.to_hf()
    assert out["custom_key"] == 7 and out["dtype"] == "bfloat16" and out["rope_parameters"]["rope_theta"] == 5e5
    assert b.to_hf()["rope_scaling"]["rope_type"] == "linear" and "torch_dtype" in b.to_hf()
    qwen = Qwen2Config.from_hf({"model_type": "qwen2", "num_hidden_layers": 4, "use_sliding_window": True,
                                "sliding_window": 16, "max_window_layers": 2})
    assert [qwen.layer_sliding_window(i) for i in range(4)] == [None, None, 16, 16]
    windows = {cls.model_type: cls.from_hf({"model_type": cls.model_type, "sliding_window": 4}).layer_sliding_window(0)
               for cls in (LlamaConfig, GemmaConfig, MistralConfig, Phi3Config)}
    assert windows == {"llama": None, "gemma": None, "mistral": 4, "phi3": 4}  # as HF's families apply it
    assert Phi3Config().rms_norm_eps == 1e-5 and GemmaConfig().tie_word_embeddings
    with pytest.raises(ValueError, match="expects model_type 'gemma'"):
        GemmaConfig.from_hf({"model_type": "llama"})
    with pytest.raises(ValueError, match="unsupported model_type"):
        model_class("mamba")


# ---- loading: dtype, device, tied heads, clear errors ------------------------------------------------------------
def _set_config(path, **changes):
    cfg = json.loads((path / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    (path / "config.json").write_text(json.dumps(cfg))


def test_dtype_auto_names_and_checkpoint_default(checkpoint):
    model, path = checkpoint
    model.to(torch.bfloat16).save_pretrained(path)  # config.json says bfloat16
    dtypes = lambda m: {p.dtype for p in m.parameters()}  # noqa: E731
    assert dtypes(AutoLigerForCausalLM.from_pretrained(path, dtype="auto")) == {torch.bfloat16}  # HF's spelling
    assert dtypes(AutoLigerForCausalLM.from_pretrained(path, dtype="float16")) == {torch.float16}
    for bad in ("float33", torch.int8):
        with pytest.raises(ValueError, match="dtype"):
            AutoLigerForCausalLM.from_pretrained(path, dtype=bad)
    # v5's "dtype" beside a stale v4 "torch_dtype" (configs edited across versions): "dtype" wins, as in transformers.
    _set_config(path, dtype="float16", torch_dtype="float32")
    assert dtypes(AutoLigerForCausalLM.from_pretrained(path)) == {torch.float16}
    assert transformers.AutoConfig.from_pretrained(path).dtype == torch.float16
    _set_config(path, dtype="int8")  # a non-float config dtype: named, and dtype= still loads (a TypeError before)
    with pytest.raises(ValueError, match="not a floating-point type"):
        AutoLigerForCausalLM.from_pretrained(path)
    assert dtypes(AutoLigerForCausalLM.from_pretrained(path, dtype=torch.bfloat16)) == {torch.bfloat16}
    # No dtype in config.json: the checkpoint's own dtype (HF v5 "auto"), never a silent fp32 upcast.
    _set_config(path, dtype=None, torch_dtype=None)
    assert dtypes(AutoLigerForCausalLM.from_pretrained(path)) == {torch.bfloat16}


def test_device_index_is_not_read_as_cpu(checkpoint):
    _, path = checkpoint
    config = LlamaConfig.tiny(num_hidden_layers=1)
    if torch.cuda.is_available():
        assert AutoLigerForCausalLM.from_pretrained(path, device=0).lm_head.weight.device == torch.device("cuda", 0)
        assert AutoLigerForCausalLM.from_config(config, device=0).lm_head.weight.device == torch.device("cuda", 0)
    else:  # device=0 means cuda:0 (as in torch.device(0)); a CPU build must refuse it, not load on the CPU
        with pytest.raises((RuntimeError, AssertionError)):
            AutoLigerForCausalLM.from_pretrained(path, device=0)
        with pytest.raises((RuntimeError, AssertionError)):
            AutoLigerForCausalLM.from_config(config, device=0)


def _tied_qwen2(tmp_path, edit):
    from liger_models import LigerQwen2ForCausalLM

    model = LigerQwen2ForCausalLM.from_config(Qwen2Config.tiny(num_hidden_layers=1, tie_word_embeddings=True))
    model.save_pretrained(tmp_path)
    _rewrite(tmp_path, edit)
    return model


@pytest.mark.parametrize("stored", ["equal", "different", "head_only"])
def test_tied_config_with_a_stored_head_loads_like_hf(tmp_path, stored):
    transformers = pytest.importorskip("transformers")
    other = torch.randn(128, 64)

    def edit(t):
        embed = t["model.embed_tokens.weight"]
        t["lm_head.weight"] = other if stored == "different" else embed.clone()
        if stored == "head_only":
            del t["model.embed_tokens.weight"]

    _tied_qwen2(tmp_path, edit)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    if stored == "different":
        with pytest.warns(UserWarning, match="untied head"):
            ours = AutoLigerForCausalLM.from_pretrained(tmp_path)
    else:
        ours = AutoLigerForCausalLM.from_pretrained(tmp_path)
    assert torch.equal(ours.lm_head.weight, hf.lm_head.weight)
    assert torch.equal(ours.model.embed_tokens.weight, hf.model.embed_tokens.weight)
    assert (ours.lm_head.weight is ours.model.embed_tokens.weight) == (stored != "different")
    assert ours.config.tie_word_embeddings == (stored != "different")


@pytest.mark.parametrize("config, message", [
    ({"medusa_num_heads": 3, "medusa_num_layers": 1, "base_model_name_or_path": "org/base"}, "Medusa heads"),
    ({"model_type": "medusa", "num_heads": 3}, "Medusa heads"),
    ({"architectures": ["LlamaForCausalLM"]}, "no model_type"),
    ([1, 2], "not a JSON object"),
    ("{not json", "not valid JSON"),
])
def test_directories_that_are_not_causal_lm_checkpoints(tmp_path, config, message):
    (tmp_path / "config.json").write_text(config if isinstance(config, str) else json.dumps(config))
    for load in (AutoLigerForCausalLM.from_pretrained, LigerLlamaForCausalLM.from_pretrained):
        with pytest.raises(ValueError, match=message):
            load(tmp_path)


def test_path_to_a_file_or_a_broken_index(checkpoint):
    model, path = checkpoint
    with pytest.raises(NotADirectoryError, match="is a file.*checkpoint directory"):
        AutoLigerForCausalLM.from_pretrained(path / "model.safetensors")
    model.save_pretrained(path, max_shard_size="20KB")
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}}))
    with pytest.raises(ValueError, match="model.safetensors.index.json.*weight_map"):
        AutoLigerForCausalLM.from_pretrained(path)


def test_from_hub_on_a_bin_only_repo_says_why(tmp_path, checkpoint):
    # from_hub never downloads pickles, so a sharded .bin repo arrives as config.json + the .bin index only.
    _, path = checkpoint
    repo = tmp_path / "bin_repo"
    repo.mkdir()
    (repo / "config.json").write_bytes((path / "config.json").read_bytes())
    (repo / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": {"x": "pytorch_model-1.bin"}}))
    cache = hub_cache(tmp_path / "hub", repo)
    with pytest.raises(FileNotFoundError, match="only safetensors"):
        AutoLigerForCausalLM.from_hub("org/tiny", cache_dir=cache, local_files_only=True)


def test_save_through_a_symlinked_directory_writes_into_its_target(checkpoint):
    # An output directory that is a symlink (to another disk, say) must receive the checkpoint; the swap must not
    # replace the link with a new directory beside it and leave the target holding the previous save.
    model, path = checkpoint
    link = path.parent / "out"
    link.symlink_to(path, target_is_directory=True)
    other = LigerLlamaForCausalLM.from_config(LlamaConfig.tiny(num_hidden_layers=1))
    other.save_pretrained(link)
    assert link.is_symlink()
    loaded = AutoLigerForCausalLM.from_pretrained(path)
    assert torch.equal(loaded.lm_head.weight, other.lm_head.weight)
    assert (path / "tokenizer.json").is_file()
    assert sorted(p.name for p in path.parent.iterdir()) == ["ckpt", "out"]  # no stale temporary entries


def test_save_into_a_mount_point_is_refused_before_writing(checkpoint, monkeypatch):
    # A container volume's root cannot be renamed (EBUSY): the swap would fail only after every shard was written.
    model, path = checkpoint
    before = sorted(p.name for p in path.iterdir())
    is_mount = os.path.ismount
    monkeypatch.setattr(os.path, "ismount", lambda p: os.fspath(p) == os.fspath(path) or is_mount(p))
    with pytest.raises(ValueError, match="mount point.*subdirectory"):
        model.save_pretrained(path)
    assert sorted(p.name for p in path.iterdir()) == before
    assert sorted(p.name for p in path.parent.iterdir()) == ["ckpt"]  # nothing staged beside it
    model.save_pretrained(path / "inside")  # a subdirectory of the volume works
    assert (path / "inside" / "config.json").is_file()


def test_hub_download_keeps_the_chat_template_file():
    # Recent transformers (v5 included) saves a tokenizer's chat template as chat_template.jinja (+ named ones under
    # additional_chat_templates/), no longer inside tokenizer_config.json: a snapshot without them has no chat format.
    from huggingface_hub.utils import filter_repo_objects

    repo = ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
            "additional_chat_templates/tool_use.jinja"]
    fetched = set(filter_repo_objects(repo, allow_patterns=hub.ALLOW_PATTERNS, ignore_patterns=hub.IGNORE_PATTERNS))
    assert fetched == set(repo)


def test_save_into_the_working_directory_keeps_it_usable(checkpoint, monkeypatch):
    # save_pretrained(".") swaps the directory: the process must not be left in the deleted old one, where every
    # relative path (the tokenizer saved next, a log file) fails with FileNotFoundError.
    model, path = checkpoint
    monkeypatch.chdir(path)
    model.save_pretrained(".")
    assert os.getcwd() == str(path.resolve())
    assert sorted(os.listdir(".")) == ["config.json", "model.safetensors", "tokenizer.json"]


@pytest.mark.parametrize("shard", [None, "20KB"])
def test_saved_weights_are_readable_like_the_config(checkpoint, shard):
    """safetensors writes its files owner-only (0600); the weights get the mode a plain write gives config.json,
    so a server running as another user (TGI, vLLM) or a teammate can read the checkpoint."""
    model, path = checkpoint
    old = os.umask(0o022)
    try:
        model.save_pretrained(path, **({} if shard is None else {"max_shard_size": shard}))
    finally:
        os.umask(old)
    weights = sorted(path.glob("*.safetensors"))
    assert weights
    for f in weights + [path / "config.json"]:
        assert os.stat(f).st_mode & 0o777 == 0o644, f.name


def test_save_pretrained_takes_transformers_safe_serialization(checkpoint):
    """model.save_pretrained(d, safe_serialization=True), the usual transformers call, saves; False (a .bin) is
    refused by name instead of an unexpected-keyword TypeError."""
    model, path = checkpoint
    model.save_pretrained(path / "again", safe_serialization=True)
    assert (path / "again" / "model.safetensors").is_file()
    with pytest.raises(ValueError, match="safetensors only"):
        model.save_pretrained(path / "bin", safe_serialization=False)
    assert not (path / "bin").exists()


# ---- real-world failure modes: gated repos, git clones without LFS, cut-short files, quantized repos --------------
def _hub_error(cls, message, status=None):
    """A huggingface_hub HTTP error as snapshot_download raises it, built without any network response."""
    err = cls.__new__(cls)
    Exception.__init__(err, message)
    err.response = None if status is None else type("Response", (), {"status_code": status})()
    return err


def test_from_hub_passes_the_token_and_names_auth_failures(checkpoint, monkeypatch):
    from huggingface_hub.errors import GatedRepoError, HfHubHTTPError, RepositoryNotFoundError

    _, path = checkpoint
    calls, raised = [], []

    def fake_download(repo_id, **kwargs):  # stands in for the Hub: records the call, then fails or returns the dir
        calls.append(kwargs)
        if raised:
            raise raised.pop()
        return str(path)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_download)
    secret = f"hf_{os.urandom(8).hex()}"
    AutoLigerForCausalLM.from_hub("meta-llama/Tiny", token=secret)
    assert calls[-1]["token"] == secret  # a gated repo needs it; HF_TOKEN stays the default (None)
    LigerLlamaForCausalLM.from_hub("meta-llama/Tiny", token=secret[::-1])  # the family classes take it too
    assert calls[-1]["token"] == secret[::-1]
    # Gated (a RepositoryNotFoundError subclass): it was reported as "not found", sending users to check the spelling.
    raised.append(_hub_error(GatedRepoError, "Access to model meta-llama/Tiny is restricted.", 403))
    with pytest.raises(PermissionError, match=r"gated.*huggingface.co/meta-llama/Tiny.*HF_TOKEN") as info:
        hub.snapshot("meta-llama/Tiny")
    assert "not found" not in str(info.value)
    raised.append(_hub_error(HfHubHTTPError, "Invalid credentials in Authorization header", 401))
    with pytest.raises(PermissionError, match="HTTP 401.*token"):
        hub.snapshot("meta-llama/Tiny", token="hf_expired")
    raised.append(_hub_error(RepositoryNotFoundError, "Repository Not Found", 404))
    with pytest.raises(FileNotFoundError, match="not found.*private.*HF_TOKEN"):
        hub.snapshot("org/private")
    raised.append(_hub_error(HfHubHTTPError, "Internal Server Error", 500))  # other HTTP errors pass unchanged
    with pytest.raises(HfHubHTTPError, match="Internal Server Error"):
        hub.snapshot("org/tiny")


def test_a_mistyped_local_path_is_not_called_only_a_bad_repo_id(tmp_path):
    for typo in (tmp_path / "ckpt_typo", "./out/ckpt", "~/no-such-dir-here"):
        with pytest.raises(ValueError, match="not an existing local directory"):
            AutoLigerForCausalLM.from_hub(str(typo), cache_dir=tmp_path / "hub", local_files_only=True)


def test_unreadable_weight_files_are_named(checkpoint):
    model, path = checkpoint
    model.save_pretrained(path, max_shard_size="20KB")
    shards = sorted(path.glob("model-*.safetensors"))
    victim = shards[torch.randint(len(shards), ()).item()]
    data = victim.read_bytes()
    # `git clone` without git-lfs leaves ~130-byte text pointers where the weights should be.
    victim.write_text(f"version https://git-lfs.github.com/spec/v1\noid sha256:{os.urandom(32).hex()}\n"
                      f"size {len(data)}\n")
    with pytest.raises(ValueError, match=f"{victim.name}.*Git LFS pointer.*git lfs pull"):
        AutoLigerForCausalLM.from_pretrained(path)
    # An interrupted copy: cut anywhere past the first byte.
    victim.write_bytes(data[:torch.randint(1, len(data) - 1, ()).item()])
    with pytest.raises(ValueError, match=f"{victim.name}.*not a readable safetensors file.*truncated"):
        AutoLigerForCausalLM.from_pretrained(path)
    victim.write_bytes(data)
    AutoLigerForCausalLM.from_pretrained(path)  # restored: loads again
    index = path / "model.safetensors.index.json"
    for broken, message in (("{\"weight_map\": {", "not valid JSON"), ("[]", "not a JSON object")):
        index.write_text(broken)  # these raised a bare JSONDecodeError / AttributeError that named no file
        with pytest.raises(ValueError, match=f"model.safetensors.index.json.*{message}"):
            AutoLigerForCausalLM.from_pretrained(path)


def test_a_quantized_checkpoint_is_named_as_such(checkpoint):
    model, path = checkpoint
    rows = torch.randint(1, 500, ()).item()

    def bnb_4bit(t):  # what bitsandbytes stores: packed uint8 rows and per-block scales beside each weight
        t["model.layers.0.mlp.down_proj.weight"] = torch.randint(0, 255, (rows, 1), dtype=torch.uint8)
        t["model.layers.0.mlp.down_proj.weight.absmax"] = torch.rand(rows)

    _rewrite(path, bnb_4bit)
    _set_config(path, quantization_config={"quant_method": "bitsandbytes", "load_in_4bit": True})
    with pytest.raises(ValueError, match="quantized checkpoint.*bitsandbytes.*unquantized") as info:
        AutoLigerForCausalLM.from_pretrained(path)
    assert "down_proj.weight.absmax" in str(info.value)  # the details are kept
    assert "load_bnb_4bit" in str(info.value)  # bitsandbytes 4-bit is read by the QLoRA loader
    # A stale quantization_config over plain weights (left by some merges) does not block loading.
    model.save_pretrained(path)
    _set_config(path, quantization_config={"quant_method": "gptq", "bits": 4})
    loaded = AutoLigerForCausalLM.from_pretrained(path)
    assert torch.equal(loaded.lm_head.weight, model.lm_head.weight)


def test_an_interrupted_download_in_the_cache_is_named(tmp_path, checkpoint):
    # huggingface_hub caches the repo's file listing (trees/<commit>.json) and can tell a partial snapshot from a
    # missing one; the partial one was reported as "not in the local Hub cache".
    model, path = checkpoint
    model.save_pretrained(path, max_shard_size="20KB")
    cache = hub_cache(tmp_path / "hub", path)
    repo_dir, snap = cache / "models--org--tiny", cache / "models--org--tiny" / "snapshots" / REVISION
    files = {p.name: {"size": p.stat().st_size, "blob_id": os.urandom(20).hex()} for p in snap.iterdir()}
    (repo_dir / "trees").mkdir()
    (repo_dir / "trees" / f"{REVISION}.json").write_text(json.dumps({"format_version": 1, "files": files}))
    AutoLigerForCausalLM.from_hub("org/tiny", cache_dir=cache, local_files_only=True)  # complete: loads
    shards = sorted(snap.glob("model-*.safetensors"))
    lost = shards[torch.randint(len(shards), ()).item()]
    lost.unlink()  # the download stopped before this shard
    with pytest.raises(FileNotFoundError, match=f"interrupted download.*{lost.name}") as info:
        AutoLigerForCausalLM.from_hub("org/tiny", cache_dir=cache, local_files_only=True)
    assert "not in the local Hub cache" not in str(info.value)


def test_registry_by_model_type_is_public():
    """The public API (docs/models.md#public-api) includes the registry by model_type: every family there, each class
    its own."""
    import liger_models

    assert set(liger_models.MODEL_CLASSES) == {"llama", "mistral", "qwen2", "gemma", "phi3", "qwen3", "gemma2",
                                               "gemma3_text", "mixtral", "qwen3_moe"}
    for model_type, cls in liger_models.MODEL_CLASSES.items():
        assert liger_models.model_class(model_type) is cls and cls.config_class.model_type == model_type
        assert getattr(liger_models, cls.__name__) is cls
    with pytest.raises(ValueError, match="unsupported model_type"):
        liger_models.model_class("gpt2")

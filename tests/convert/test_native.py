"""Native Meta Llama / Mistral checkpoints → HF format.

The truth is an independent forward of the *native* architecture written here (Meta's model.py in float64:
interleaved complex RoPE, GQA, SwiGLU, RMSNorm) on random native-layout weights, so the converter's q/k permutation
is never used to check itself. The converted directory must give the same logits in our models and in transformers.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file

from liger_models import AutoLigerForCausalLM
from liger_models.cli import main
from liger_models.convert.native import native_to_hf
from tests.helpers import assert_matches

VOCAB, FFN, T = 128, 96, 16
LLAMA2 = {"dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "vocab_size": -1, "multiple_of": 256,
          "ffn_dim_multiplier": 1.3, "norm_eps": 1e-5}  # multiple_of would give 256 rows, the tensors have FFN
LLAMA31 = {"dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "vocab_size": VOCAB, "multiple_of": 32,
           "ffn_dim_multiplier": 1.5, "norm_eps": 1e-5, "rope_theta": 500000.0, "use_scaled_rope": True}
# head_dim 32 ≠ dim / n_heads (as Mistral-Nemo), window wider than the test sequence.
MISTRAL = {"dim": 64, "n_layers": 2, "head_dim": 32, "hidden_dim": FFN, "n_heads": 4, "n_kv_heads": 2,
           "norm_eps": 1e-5, "sliding_window": 64, "vocab_size": VOCAB, "rope_theta": 1000000.0}
COLUMN_PARALLEL = ("attention.wq", "attention.wk", "attention.wv", "feed_forward.w1", "feed_forward.w3")
ROW_PARALLEL = ("attention.wo", "feed_forward.w2")


@pytest.fixture(autouse=True)
def _reference_path(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # conversion is under test here, not the kernels


# ---- the native architecture, written independently of the converter ---------------------------------------
def llama3_scaled(freqs: torch.Tensor, factor: float, low=1.0, high=4.0, old_len=8192) -> torch.Tensor:
    """Meta's apply_scaling (Llama 3.1), vectorised."""
    wavelen = 2 * math.pi / freqs
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * freqs / factor + smooth * freqs
    return torch.where(wavelen < old_len / high, freqs, torch.where(wavelen > old_len / low, freqs / factor, blended))


def native_forward(w: dict, p: dict, ids: torch.Tensor, positions: torch.Tensor, rope_factor=8.0) -> torch.Tensor:
    """Meta's Transformer.forward in float64 (no cache; the sliding window, if any, is wider than T)."""
    w = {k: v.double() for k, v in w.items()}
    D, H, eps = p["dim"], p["n_heads"], p["norm_eps"]
    Hkv, d = p.get("n_kv_heads") or H, p.get("head_dim") or D // H
    B, L = ids.shape
    # The angle table in float32 as Meta's precompute_freqs_cis builds it (HF too): at position 6000 a float32
    # angle is off by ~3e-4 rad from the exact one, so a float64 table would be a different model, not a truer one.
    freqs = 1.0 / p.get("rope_theta", 10000.0) ** (torch.arange(0, d, 2).float() / d)
    if p.get("use_scaled_rope"):
        freqs = llama3_scaled(freqs.double(), rope_factor).float()  # Meta scales in Python floats
    angles = torch.outer(positions.float(), freqs).double()  # (L, d/2)
    cis = torch.polar(torch.ones_like(angles), angles)

    def rope(x):  # (B, L, h, d): consecutive pairs are one complex number
        xc = torch.view_as_complex(x.reshape(B, L, -1, d // 2, 2))
        return torch.view_as_real(xc * cis[None, :, None, :]).reshape(B, L, -1, d)

    def rms(x, g):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * g

    mask = torch.full((L, L), float("-inf"), dtype=torch.float64).triu(1)
    h = w["tok_embeddings.weight"][ids]  # (B, L, D)
    for i in range(p["n_layers"]):
        def W(name, i=i):
            return w[f"layers.{i}.{name}.weight"]
        x = rms(h, W("attention_norm"))
        q = rope((x @ W("attention.wq").T).view(B, L, H, d))
        k = rope((x @ W("attention.wk").T).view(B, L, Hkv, d)).repeat_interleave(H // Hkv, dim=2)  # repeat_kv
        v = (x @ W("attention.wv").T).view(B, L, Hkv, d).repeat_interleave(H // Hkv, dim=2)
        scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(d) + mask
        attn = torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v).reshape(B, L, H * d)
        h = h + attn @ W("attention.wo").T
        x = rms(h, W("ffn_norm"))
        h = h + (F.silu(x @ W("feed_forward.w1").T) * (x @ W("feed_forward.w3").T)) @ W("feed_forward.w2").T
    head = w.get("output.weight", w["tok_embeddings.weight"])
    return rms(h, w["norm.weight"]) @ head.T


def random_native(p: dict, *, tied: bool = False) -> dict[str, torch.Tensor]:
    """Fresh float32 weights in Meta's names and layout."""
    D, H = p["dim"], p["n_heads"]
    Hkv, d = p.get("n_kv_heads") or H, p.get("head_dim") or D // H

    def lin(rows, cols, gain=1.0):
        return gain * torch.randn(rows, cols) / cols ** 0.5

    def norm():
        return 1 + 0.1 * torch.randn(D)

    w = {"tok_embeddings.weight": torch.randn(VOCAB, D), "norm.weight": norm()}
    if not tied:
        w["output.weight"] = lin(VOCAB, D)
    for i in range(p["n_layers"]):
        w.update({f"layers.{i}.attention.wq.weight": lin(H * d, D, 2.0),  # sharp attention: RoPE matters
                  f"layers.{i}.attention.wk.weight": lin(Hkv * d, D, 2.0),
                  f"layers.{i}.attention.wv.weight": lin(Hkv * d, D),
                  f"layers.{i}.attention.wo.weight": lin(D, H * d),
                  f"layers.{i}.feed_forward.w1.weight": lin(FFN, D),
                  f"layers.{i}.feed_forward.w3.weight": lin(FFN, D),
                  f"layers.{i}.feed_forward.w2.weight": lin(D, FFN),
                  f"layers.{i}.attention_norm.weight": norm(),
                  f"layers.{i}.ffn_norm.weight": norm()})
    return w


def meta_shards(w: dict, n: int, *, vocab_parallel: bool, kv_replicas: int = 1) -> list[dict[str, torch.Tensor]]:
    """Split as Meta's fairscale layers do: column-parallel on dim 0, row-parallel on dim 1, norms replicated;
    the embedding on dim 1 (Llama 2 ParallelEmbedding) or dim 0 (Llama 3 VocabParallelEmbedding). With more ranks
    than kv heads, each kv head is held by `kv_replicas` consecutive ranks (llama-models' reshard_mp, 405B MP16)."""
    shards: list[dict] = [{} for _ in range(n)]
    for name, t in w.items():
        if kv_replicas > 1 and (".attention.wk." in name or ".attention.wv." in name):
            for rank, shard in enumerate(shards):
                shard[name] = t.chunk(n // kv_replicas, 0)[rank // kv_replicas].clone()
            continue
        if name == "output.weight" or any(f".{c}." in name for c in COLUMN_PARALLEL):
            dim = 0
        elif any(f".{r}." in name for r in ROW_PARALLEL):
            dim = 1
        elif name == "tok_embeddings.weight":
            dim = 0 if vocab_parallel else 1
        else:
            dim = None
        parts = [t] * n if dim is None else t.chunk(n, dim)
        for shard, part in zip(shards, parts):
            shard[name] = part.clone()
    return shards


def write_meta(src, p, w, *, shards=1, vocab_parallel=True, extra=None, kv_replicas=1):
    src.mkdir(parents=True, exist_ok=True)
    (src / "params.json").write_text(json.dumps(p))
    for rank, shard in enumerate(meta_shards(w, shards, vocab_parallel=vocab_parallel, kv_replicas=kv_replicas)):
        shard.update(extra or {})
        torch.save(shard, src / f"consolidated.{rank:02d}.pth")
    return src


def write_mistral(src, p, w, *, files=1):
    src.mkdir(parents=True, exist_ok=True)
    (src / "params.json").write_text(json.dumps(p))
    names = list(w)
    if files == 1:
        save_file(w, str(src / "consolidated.safetensors"))
        return src
    for i in range(files):  # key-split files, as the larger Mistral releases ship
        part = {k: w[k] for k in names[i::files]}
        save_file(part, str(src / f"consolidated-{i + 1:05d}-of-{files:05d}.safetensors"))
    return src


def check_logits(out, p, w, *, positions=None, rope_factor=8.0, with_hf=True):
    """Ours and transformers on the converted directory vs the native float64 reference."""
    ids = torch.randint(0, VOCAB, (2, T))
    positions = torch.arange(T) if positions is None else positions
    ref = native_forward(w, p, ids, positions, rope_factor)
    pos = positions.expand(2, T)
    ours = AutoLigerForCausalLM.from_pretrained(out, dtype=torch.float32)
    with torch.no_grad():
        assert_matches(ours(ids, position_ids=pos).logits, ref, name="ours vs native")
    if with_hf:
        import transformers

        hf = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").float().eval()
        with torch.no_grad():
            assert_matches(hf(ids, position_ids=pos).logits, ref, name="transformers vs native")
    return ours, ids, ref


def config_of(out) -> dict:
    return json.loads((out / "config.json").read_text())


def leftovers(tmp_path) -> list[str]:
    return sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("."))


# ---- conversions --------------------------------------------------------------------------------------------
def test_llama2_two_way_model_parallel(tmp_path):
    w = random_native(LLAMA2)
    freqs = 1.0 / 10000.0 ** (torch.arange(0, 16, 2).float() / 16)  # Llama 1/2 store this buffer; it is dropped
    src = write_meta(tmp_path / "native", LLAMA2, w, shards=2, vocab_parallel=False, extra={"rope.freqs": freqs})
    (src / "tokenizer.model").write_bytes(b"\x0asentencepiece")
    out = native_to_hf(src, tmp_path / "hf", max_shard_size="40KB")
    cfg = config_of(out)
    assert cfg["model_type"] == "llama" and cfg["intermediate_size"] == FFN and cfg["vocab_size"] == VOCAB
    assert cfg["num_key_value_heads"] == 2 and not cfg["tie_word_embeddings"] and cfg["rope_scaling"] is None
    assert (out / "model.safetensors.index.json").is_file()  # our sharded save path
    assert (out / "tokenizer.model").read_bytes() == b"\x0asentencepiece"
    check_logits(out, LLAMA2, w)
    assert leftovers(tmp_path) == []


@pytest.mark.parametrize("factor", [None, 32.0], ids=["llama3.1-factor8", "factor32-override"])
def test_llama31_scaled_rope_vocab_parallel(tmp_path, factor):
    w = random_native(LLAMA31)
    src = write_meta(tmp_path / "native", LLAMA31, w, shards=2, vocab_parallel=True)
    out = native_to_hf(src, tmp_path / "hf", rope_scaling_factor=factor)
    rope = config_of(out)["rope_scaling"]
    assert rope["rope_type"] == "llama3" and rope["factor"] == (factor or 8.0)
    assert (rope["low_freq_factor"], rope["high_freq_factor"], rope["original_max_position_embeddings"]) == \
        (1.0, 4.0, 8192)
    positions = torch.arange(T) + 6000  # long wavelengths only show at large positions
    ours, ids, ref = check_logits(out, LLAMA31, w, positions=positions, rope_factor=factor or 8.0)
    unscaled = native_forward(w, {**LLAMA31, "use_scaled_rope": False}, ids, positions)
    assert (unscaled - ref).abs().max() > 1e-3, "the test positions do not exercise the rope scaling"


def test_more_ranks_than_kv_heads(tmp_path):
    # Llama 3.1 405B MP16: 8 kv heads on 16 ranks, so ranks 2i and 2i+1 both hold kv head i (not 16 distinct heads).
    w = random_native(LLAMA31)  # 4 heads, 2 kv heads
    src = write_meta(tmp_path / "native", LLAMA31, w, shards=4, vocab_parallel=True, kv_replicas=2)
    out = native_to_hf(src, tmp_path / "hf")
    assert config_of(out)["num_key_value_heads"] == 2
    check_logits(out, LLAMA31, w, with_hf=False)
    rank1 = torch.load(src / "consolidated.01.pth")
    rank1["layers.1.attention.wv.weight"] = rank1["layers.1.attention.wv.weight"] + 1  # replicas must agree
    torch.save(rank1, src / "consolidated.01.pth")
    with pytest.raises(ValueError, match=r"layers\.1\.attention\.wv\.weight"):
        native_to_hf(src, tmp_path / "hf2")


@pytest.mark.parametrize("output", ["absent", "copy"])
def test_llama_tied_embeddings(tmp_path, output):
    p = {**LLAMA31, "use_scaled_rope": False}
    w = random_native(p, tied=True)
    if output == "copy":  # Llama 3.2 1B/3B ship output.weight equal to the embedding
        w["output.weight"] = w["tok_embeddings.weight"].clone()
    out = native_to_hf(write_meta(tmp_path / "native", p, w), tmp_path / "hf")
    assert config_of(out)["tie_word_embeddings"] is True
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        assert "lm_head.weight" not in f.keys()
    ours, _, _ = check_logits(out, p, w)
    assert ours.lm_head.weight is ours.model.embed_tokens.weight


@pytest.mark.parametrize("files", [1, 2], ids=["single-file", "key-split"])
def test_mistral_safetensors_sliding_window_head_dim(tmp_path, files):
    w = random_native(MISTRAL)
    src = write_mistral(tmp_path / "native", MISTRAL, w, files=files)
    out = native_to_hf(src, tmp_path / "hf")
    cfg = config_of(out)
    assert cfg["model_type"] == "mistral" and cfg["sliding_window"] == 64 and cfg["head_dim"] == 32
    assert cfg["rope_theta"] == 1e6 and cfg["intermediate_size"] == FFN
    check_logits(out, MISTRAL, w)


def test_mistral_without_window_and_bf16_output(tmp_path):
    p = {k: v for k, v in MISTRAL.items() if k != "sliding_window"}
    w = random_native(p)
    out = native_to_hf(write_mistral(tmp_path / "native", p, w), tmp_path / "hf", dtype="bf16")
    cfg = config_of(out)
    assert cfg["sliding_window"] is None and cfg.get("dtype", cfg.get("torch_dtype")) == "bfloat16"
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}
        assert torch.equal(f.get_tensor("model.layers.0.mlp.down_proj.weight"),
                           w["layers.0.feed_forward.w2.weight"].bfloat16())


def test_family_forced_and_refused(tmp_path):
    w = random_native(MISTRAL)
    src = write_mistral(tmp_path / "native", MISTRAL, w)
    with pytest.raises(ValueError, match="sliding_window"):
        native_to_hf(src, tmp_path / "hf", family="llama")
    (src / "params.json").write_text(json.dumps({**MISTRAL, "sliding_window": [64, 64]}))  # per-layer pattern
    with pytest.raises(ValueError, match="sliding_window must be an integer"):
        native_to_hf(src, tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


def test_model_parallel_ranks_must_be_consecutive(tmp_path):
    src = write_meta(tmp_path / "native", LLAMA2, random_native(LLAMA2), shards=2)
    (src / "consolidated.01.pth").rename(src / "consolidated.02.pth")
    with pytest.raises(FileNotFoundError, match="consecutively"):
        native_to_hf(src, tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


# ---- refusals: a clear error naming the problem, and no output directory ------------------------------------
def _drop(w, key):
    w = dict(w)
    del w[key]
    return w


@pytest.mark.parametrize("case", ["missing", "unknown", "misshaped", "shard-shapes", "shard-keys", "replicated",
                                  "params-moe", "params-unknown", "vocab"])
def test_bad_inputs_raise_and_leave_nothing(tmp_path, case):
    p, w, shards = dict(LLAMA2), random_native(LLAMA2), 2
    expect = None
    if case == "missing":
        w, expect = _drop(w, "layers.1.ffn_norm.weight"), "layers.1.ffn_norm.weight"
    elif case == "unknown":
        w["layers.0.attention.wq.bias"] = torch.zeros(64)
        shards, expect = 1, "layers.0.attention.wq.bias"
    elif case == "misshaped":
        w["layers.1.feed_forward.w3.weight"] = torch.randn(FFN + 2, 64)
        shards, expect = 1, "layers.1.feed_forward.w3.weight"
    elif case == "vocab":
        p["vocab_size"], shards, expect = VOCAB + 1, 1, "vocab_size"
    elif case in ("params-moe", "params-unknown"):
        key = "moe" if case == "params-moe" else "n_experts_typo"
        p[key], expect = {"num_experts": 8} if key == "moe" else 3, key
    src = write_meta(tmp_path / "native", p, w, shards=shards, vocab_parallel=False)
    if case.startswith("shard-") or case == "replicated":
        rank1 = torch.load(src / "consolidated.01.pth")
        if case == "shard-shapes":  # a column-parallel shard whose column count disagrees with rank 0
            rank1["layers.0.attention.wv.weight"] = torch.randn(16, 70)
            expect = "layers.0.attention.wv.weight"
        elif case == "shard-keys":
            del rank1["layers.0.feed_forward.w2.weight"]
            expect = "layers.0.feed_forward.w2.weight"
        else:
            rank1["norm.weight"] = rank1["norm.weight"] + 1
            expect = "norm.weight"
        torch.save(rank1, src / "consolidated.01.pth")
    with pytest.raises(ValueError, match=expect.replace(".", r"\.")):
        native_to_hf(src, tmp_path / "hf")
    assert not (tmp_path / "hf").exists() and leftovers(tmp_path) == []


def test_failed_write_leaves_no_output(tmp_path, monkeypatch):
    import liger_models.convert.native as native

    src = write_meta(tmp_path / "native", LLAMA2, random_native(LLAMA2))
    (src / "tokenizer.model").write_bytes(b"x")

    def fail(*args, **kwargs):  # after the weights and config.json are written, before the rename
        raise OSError("disk full")

    monkeypatch.setattr(native.shutil, "copy2", fail)
    with pytest.raises(OSError, match="disk full"):
        native_to_hf(src, tmp_path / "hf")
    assert not (tmp_path / "hf").exists() and leftovers(tmp_path) == []


def test_refuses_a_non_empty_output_and_accepts_an_empty_one(tmp_path):
    src = write_meta(tmp_path / "native", LLAMA2, random_native(LLAMA2))
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("mine")
    with pytest.raises(FileExistsError):
        native_to_hf(src, tmp_path / "full")
    assert (tmp_path / "full" / "keep.txt").read_text() == "mine"
    (tmp_path / "empty").mkdir()
    assert (native_to_hf(src, tmp_path / "empty") / "config.json").is_file()


# ---- CLI and dependencies -----------------------------------------------------------------------------------
def test_cli_convert_native(tmp_path, capsys):
    with pytest.raises(SystemExit) as info:
        main(["convert-native", "--help"])
    assert info.value.code == 0
    usage = capsys.readouterr().out
    assert all(opt in usage for opt in ("--family", "--dtype", "--rope-factor", "SRC", "OUT"))
    w = random_native(MISTRAL)
    src = write_mistral(tmp_path / "native", MISTRAL, w)
    assert main(["convert-native", str(src), str(tmp_path / "hf"), "--family", "mistral", "--dtype", "fp32"]) == 0
    assert "wrote" in capsys.readouterr().out
    check_logits(tmp_path / "hf", MISTRAL, w, with_hf=False)
    assert main(["convert-native", str(src), str(tmp_path / "hf16"), "--dtype", "fp16"]) == 0  # as the API takes
    config = config_of(tmp_path / "hf16")
    assert config.get("dtype", config.get("torch_dtype")) == "float16"
    assert main(["convert-native", str(tmp_path / "nowhere"), str(tmp_path / "hf2")]) == 2
    assert "does not exist" in capsys.readouterr().err and not (tmp_path / "hf2").exists()


def test_conversion_does_not_import_transformers(tmp_path):
    src = write_mistral(tmp_path / "native", MISTRAL, random_native(MISTRAL))
    code = ("import sys; from liger_models.convert.native import native_to_hf; "
            f"native_to_hf({str(src)!r}, {str(tmp_path / 'hf')!r}); "
            "assert 'transformers' not in sys.modules, 'transformers was imported'")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]


@pytest.mark.parametrize("case", ["pth-rank", "safetensors-part", "params-json"])
def test_unreadable_files_are_named(tmp_path, case):
    # A truncated download: torch's / safetensors' / json's own messages name no file, and a release has many.
    if case == "pth-rank":
        src, bad = write_meta(tmp_path / "native", LLAMA2, random_native(LLAMA2), shards=2), "consolidated.01.pth"
    elif case == "safetensors-part":
        src = write_mistral(tmp_path / "native", MISTRAL, random_native(MISTRAL), files=2)
        bad = "consolidated-00002-of-00002.safetensors"
    else:
        src, bad = write_mistral(tmp_path / "native", MISTRAL, random_native(MISTRAL)), "params.json"
    data = (src / bad).read_bytes()
    (src / bad).write_bytes(data[:torch.randint(1, len(data) // 2, ()).item()])
    with pytest.raises(ValueError, match=bad.replace(".", r"\.")):
        native_to_hf(src, tmp_path / "hf")
    assert not (tmp_path / "hf").exists() and leftovers(tmp_path) == []


def test_output_through_a_link_to_an_empty_directory(tmp_path):
    # The link is what the user named; the converted checkpoint must land in its (empty) target, link kept.
    w = random_native(MISTRAL)
    src = write_mistral(tmp_path / "native", MISTRAL, w)
    (tmp_path / "target").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "target", target_is_directory=True)
    native_to_hf(src, tmp_path / "link")
    assert (tmp_path / "link").is_symlink() and (tmp_path / "target" / "config.json").is_file()
    assert leftovers(tmp_path) == []
    check_logits(tmp_path / "link", MISTRAL, w, with_hf=False)


def test_bad_shard_size_is_refused_before_reading_the_weights(tmp_path):
    # The rank below would take minutes to read in a real checkpoint (and here cannot be read at all): the size
    # typo must be the error, not something found after the whole checkpoint was loaded.
    src = write_meta(tmp_path / "native", LLAMA2, random_native(LLAMA2), shards=2)
    (src / "consolidated.01.pth").write_bytes(b"never read")
    with pytest.raises(ValueError, match="cannot parse size '5G'"):
        native_to_hf(src, tmp_path / "hf", max_shard_size="5G")
    assert not (tmp_path / "hf").exists() and leftovers(tmp_path) == []

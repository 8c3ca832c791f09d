"""Meta's and Mistral's native checkpoints → Hugging Face format (config.json + safetensors, our save path).

Inputs (one directory):
- Meta Llama (facebookresearch/llama, llama3, llama-models): ``params.json`` and ``consolidated.NN.pth``, one file
  per model-parallel rank. Column-parallel weights (wq, wk, wv, w1, w3, output) are split on dim 0, row-parallel
  ones (wo, w2) on dim 1, norms are replicated (and so are wk / wv when there are more ranks than kv heads, each
  kv head on n_ranks / n_kv_heads consecutive ranks: Llama 3.1 405B MP16); ``tok_embeddings`` is split on dim 1
  (Llama 1/2 ParallelEmbedding) or on dim 0 (Llama 3 VocabParallelEmbedding), which the shard shapes tell apart.
  ``rope.freqs`` (Llama 1/2) is dropped: it is recomputed from ``rope_theta``, as HF's converter does.
- Mistral (mistral-inference): ``params.json`` and ``consolidated.safetensors`` (or several ``consolidated*``
  safetensors that split the keys, not the tensors); the tensor names are Meta's.

What changes on the way: the native RoPE rotates interleaved (complex) pairs, HF's
rotates halves, so the rows of wq and wk are permuted per head, ``view(H, d/2, 2, D).transpose(1, 2)``. Everything
else is a rename. The intermediate size and vocabulary come from the tensors (Llama 2's ``vocab_size`` is -1 and
``multiple_of``/``ffn_dim_multiplier`` only describe how Meta sized w1). ``use_scaled_rope`` becomes HF's ``llama3``
rope scaling with Llama 3.1's factor 8 (low 1, high 4, original 8192) unless params.json carries
``rope_scaling_factor`` / ``rope_high_freq_factor`` (llama-models) or the caller passes ``rope_scaling_factor``:
Llama 3.2 1B/3B use 32, which their params.json does not say (HF's converter picks it by version).

A checkpoint without ``output.weight``, or whose ``output.weight`` equals the embedding bit for bit (Llama 3.2
1B/3B ship such a copy), is written with tied embeddings. Nothing is downloaded.

Tokenizer: a Llama 3.x ``tokenizer.model`` in tiktoken's format (text lines "base64 rank", detected by its first
line) becomes ``tokenizer.json`` + ``tokenizer_config.json`` (liger_models/convert/tiktoken_tokenizer.py, which says what is
built and from which of Meta's special-token lists); the file itself is kept as ``original/tokenizer.model`` and
config.json's bos / eos ids are the tokenizer's. The special-token list is Llama 3.1's when params.json names
``use_scaled_rope`` (3.1, 3.2, 3.3), else Llama 3's, unless the caller picks one. A SentencePiece
``tokenizer.model`` / ``tokenizer.model.vN`` (Llama 1/2, Mistral v0.1–v0.3; a file that parses as a ModelProto) is
converted the same way by liger_models/convert/sentencepiece_tokenizer.py (the highest ``vN`` when there are several; all of
them are kept under ``original/``); one that is not a BPE model with byte fallback is refused. Every other tokenizer
file (``tekken.json``, or a ``tokenizer.model`` that is neither format) is copied as it is. MoE (Mixtral, Llama 4),
vision and quantised checkpoints are out of scope: their params.json keys are refused. The whole checkpoint is held
in host memory once (shards are memory-mapped).
"""

from __future__ import annotations

import os
import pickle
import re
import shutil
from pathlib import Path
from typing import Callable

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from liger_models import atomic
from liger_models.convert import sentencepiece_tokenizer as spt
from liger_models.convert.tiktoken_tokenizer import BOS, EOS, convert_tiktoken, is_tiktoken_file, save_hf_tokenizer
from liger_models.hub import parse_size, read_json_object, save_state_dict
from liger_models.llama.config import LlamaConfig
from liger_models.mistral.config import MistralConfig
from liger_models.modules.config import LigerConfig

FAMILIES = {"llama": LlamaConfig, "mistral": MistralConfig}
DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp32": torch.float32, "float32": torch.float32,
          "fp16": torch.float16, "float16": torch.float16}
# Llama 3.1's use_scaled_rope constants (llama3 apply_scaling); llama-models may override factor / high_freq_factor.
LLAMA31_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}
TOKENIZER_FILES = re.compile(r"^(tokenizer\.model(\.v\d+)?|tekken\.json)$")

_COMMON_PARAMS = {"dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "norm_eps", "rope_theta",
                  "max_seq_len", "max_batch_size"}  # max_*: inference-cache sizes, not architecture
_FAMILY_PARAMS = {
    "llama": _COMMON_PARAMS | {"multiple_of", "ffn_dim_multiplier", "use_scaled_rope", "rope_scaling_factor",
                               "rope_high_freq_factor", "head_dim"},
    "mistral": _COMMON_PARAMS | {"head_dim", "hidden_dim", "sliding_window"},
}
_UNSUPPORTED_PARAMS = {"moe": "mixture of experts", "vision_encoder": "a vision encoder", "lora": "LoRA adapters",
                       "quantization": "quantised weights", "quantization_args": "quantised weights",
                       "yarn": "YaRN rope scaling", "vision_chunk_size": "a vision encoder",
                       "vision_max_num_chunks": "a vision encoder"}

_GLOBAL_NAMES = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
                 "output.weight": "lm_head.weight"}
_LAYER_NAMES = {"attention.wq": "self_attn.q_proj", "attention.wk": "self_attn.k_proj",
                "attention.wv": "self_attn.v_proj", "attention.wo": "self_attn.o_proj",
                "feed_forward.w1": "mlp.gate_proj", "feed_forward.w3": "mlp.up_proj",
                "feed_forward.w2": "mlp.down_proj", "attention_norm": "input_layernorm",
                "ffn_norm": "post_attention_layernorm"}
_LAYER_KEY = re.compile(r"^layers\.(\d+)\.(.+)\.weight$")
_SKIPPED = {"rope.freqs"}
_RANK_FILE = re.compile(r"^consolidated\.(\d+)\.pth$")
# Model-parallel split dims (Meta's fairscale layers): column-parallel on 0, row-parallel on 1, None = replicated.
_SPLIT_DIM = {"attention.wq": 0, "attention.wk": 0, "attention.wv": 0, "feed_forward.w1": 0, "feed_forward.w3": 0,
              "attention.wo": 1, "feed_forward.w2": 1, "attention_norm": None, "ffn_norm": None,
              "output.weight": 0, "norm.weight": None, "rope.freqs": None}


# ---- reading ------------------------------------------------------------------------------------------------
def read_params(src: Path) -> dict:
    """params.json as a dict, or a clear error."""
    path = src / "params.json"
    if not path.is_file():
        raise FileNotFoundError(f"no params.json in {str(src)!r} (not a Meta / Mistral native checkpoint)")
    return read_json_object(path)  # json's own errors name no file


def weight_files(src: Path) -> list[Path]:
    """consolidated*.safetensors (key-split files) if any, else consolidated.NN.pth (model-parallel ranks)."""
    safetensors = sorted(src.glob("consolidated*.safetensors"))
    if safetensors:
        return safetensors
    ranked = sorted((int(m.group(1)), p) for p in src.glob("consolidated.*.pth")
                    if (m := _RANK_FILE.match(p.name)))
    ranks, pth = [r for r, _ in ranked], [p for _, p in ranked]
    if ranks != list(range(len(pth))):
        raise FileNotFoundError(f"model-parallel shards in {str(src)!r} must be consolidated.00.pth … "
                                f"consecutively, found {[p.name for p in pth]}")
    if not pth:
        raise FileNotFoundError(f"no consolidated*.safetensors or consolidated.NN.pth in {str(src)!r}")
    return pth


def detect_family(params: dict, files: list[Path]) -> str:
    """Llama or Mistral from params.json's keys (Mistral names head_dim / hidden_dim / sliding_window, Meta names
    multiple_of / ffn_dim_multiplier / use_scaled_rope); else by file format (mistral-inference writes safetensors)."""
    if params.keys() & {"hidden_dim", "sliding_window"}:
        return "mistral"
    if params.keys() & {"multiple_of", "ffn_dim_multiplier", "use_scaled_rope"}:
        return "llama"
    return "mistral" if files[0].suffix == ".safetensors" else "llama"


def check_params(params: dict, family: str) -> None:
    """Refuse params.json keys that describe an architecture this converter would silently get wrong."""
    unsupported = sorted(k for k in params if k in _UNSUPPORTED_PARAMS and params[k])
    if unsupported:
        raise ValueError(f"params.json has {unsupported} ({', '.join(_UNSUPPORTED_PARAMS[k] for k in unsupported)}),"
                         f" which the native converter does not support")
    unknown = sorted(k for k in params if k not in _FAMILY_PARAMS[family] and k not in _UNSUPPORTED_PARAMS)
    if unknown:
        raise ValueError(f"unknown params.json keys for family {family!r}: {unknown}")
    missing = sorted(k for k in ("dim", "n_layers", "n_heads") if k not in params)
    if missing:
        raise ValueError(f"params.json lacks {missing}")
    if family == "llama" and params.get("sliding_window"):
        raise ValueError("params.json sets sliding_window, which Llama does not have (use family='mistral')")
    window = params.get("sliding_window")
    if window is not None and (not isinstance(window, int) or isinstance(window, bool)):
        # A list gives per-layer windows (Ministral's interleaved pattern), which HF's Mistral cannot express.
        raise ValueError(f"params.json sliding_window must be an integer or null, got {window!r}")


def _load_pth(path: Path) -> dict[str, torch.Tensor]:
    # mmap: a rank's tensors are paged in only when merged; weights_only: a checkpoint must not run code.
    try:
        state = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    except (PermissionError, FileNotFoundError):
        raise
    except (OSError, RuntimeError, EOFError, pickle.UnpicklingError) as e:
        # A truncated download is the usual cause (mmap of one gives a bare "[Errno 22] Invalid argument"); torch's
        # message does not say which of the ranks it is.
        raise ValueError(f"cannot read {path.name} (corrupt or truncated?): {e}") from e
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ValueError(f"{path.name} is not a flat state dict of tensors")
    return state


def _load_safetensors(files: list[Path]) -> dict[str, torch.Tensor]:
    state: dict[str, torch.Tensor] = {}
    for file in files:
        try:
            tensors = load_file(str(file))
        except SafetensorError as e:  # its message names no file, and the large releases ship dozens
            raise ValueError(f"cannot read {file.name} (corrupt or truncated?): {e}") from e
        for name, tensor in tensors.items():
            if name in state:
                raise ValueError(f"tensor {name!r} appears in more than one consolidated*.safetensors file")
            state[name] = tensor
    return state


def load_native(files: list[Path], dim: int, n_kv_heads: int | None = None) -> dict[str, torch.Tensor]:
    """One native state dict (Meta names) from safetensors files or model-parallel .pth ranks."""
    if files[0].suffix == ".safetensors":
        return _load_safetensors(files)
    return merge_model_parallel([_load_pth(f) for f in files], dim, [f.name for f in files], n_kv_heads)


# ---- model-parallel merge ----------------------------------------------------------------------------------
def split_dim(name: str, shard: torch.Tensor, dim: int, n: int) -> int | None:
    """The dim `name` is split on across n ranks (None: replicated)."""
    if name == "tok_embeddings.weight":
        # Llama 1/2 split the embedding dim, Llama 3 the vocabulary: the rank's width says which.
        if n > 1 and shard.ndim == 2 and shard.shape[1] * n == dim:
            return 1
        return 0
    m = _LAYER_KEY.match(name)
    part = m.group(2) if m else name
    if part not in _SPLIT_DIM:
        raise ValueError(f"unknown tensor {name!r} in the native checkpoint")
    return _SPLIT_DIM[part]


def _kv_replicas(name: str, n: int, n_kv_heads: int | None) -> int:
    """How many consecutive ranks hold the same kv heads: with more ranks than kv heads (Llama 3.1 405B MP16, 8 kv
    heads), llama-models gives each kv head to n / n_kv_heads ranks (reshard_mp's repeat_qk_qv)."""
    m = _LAYER_KEY.match(name)
    if n_kv_heads is None or n <= n_kv_heads or not m or m.group(2) not in ("attention.wk", "attention.wv"):
        return 1
    if n % n_kv_heads:
        raise ValueError(f"{n} model-parallel ranks cannot share {n_kv_heads} kv heads evenly ({name!r})")
    return n // n_kv_heads


def _merge_one(name: str, parts: list[torch.Tensor], dim: int, shard_names: list[str],
               n_kv_heads: int | None = None) -> torch.Tensor:
    axis = split_dim(name, parts[0], dim, len(parts))
    replicas = _kv_replicas(name, len(parts), n_kv_heads)
    if replicas > 1:  # keep one rank of each group of replicas, which must agree
        for start in range(0, len(parts), replicas):
            group = parts[start:start + replicas]
            if any(p.shape != group[0].shape or not torch.equal(p, group[0]) for p in group[1:]):
                raise ValueError(f"replicated kv heads of {name!r} differ across model-parallel shards "
                                 f"{shard_names[start:start + replicas]}")
        parts, shard_names = parts[::replicas], shard_names[::replicas]
    shapes = [tuple(p.shape) for p in parts]
    if axis is None:
        if len(set(shapes)) > 1 or not all(torch.equal(parts[0], p) for p in parts[1:]):
            raise ValueError(f"replicated tensor {name!r} differs across model-parallel shards "
                             f"({dict(zip(shard_names, shapes))})")
        return parts[0]
    others = {s[:axis] + s[axis + 1:] for s in shapes}
    if len(others) > 1 or len({p.ndim for p in parts}) > 1:
        raise ValueError(f"mismatched shard shapes for {name!r} (split on dim {axis}): "
                         f"{dict(zip(shard_names, shapes))}")
    return torch.cat(parts, dim=axis)


def merge_model_parallel(shards: list[dict[str, torch.Tensor]], dim: int, shard_names: list[str] | None = None,
                         n_kv_heads: int | None = None) -> dict[str, torch.Tensor]:
    """Meta's consolidated.NN.pth ranks → one state dict (a single rank passes through unchanged). `n_kv_heads`
    (params.json's, or n_heads) tells replicated kv heads apart from split ones when there are more ranks."""
    shard_names = shard_names or [f"shard {i}" for i in range(len(shards))]
    if len(shards) == 1:
        return dict(shards[0])
    for name, shard in zip(shard_names[1:], shards[1:]):
        if shard.keys() != shards[0].keys():
            diff = sorted(shards[0].keys() ^ shard.keys())
            raise ValueError(f"{name} and {shard_names[0]} hold different tensors: {diff[:10]}")
    return {name: _merge_one(name, [s[name] for s in shards], dim, shard_names, n_kv_heads) for name in shards[0]}


# ---- config ------------------------------------------------------------------------------------------------
def _rope_scaling(params: dict, rope_scaling_factor: float | None) -> dict | None:
    if not params.get("use_scaled_rope"):
        if rope_scaling_factor is not None:
            raise ValueError("rope_scaling_factor is given but params.json does not set use_scaled_rope")
        return None
    rope = dict(LLAMA31_ROPE)
    rope["factor"] = float(rope_scaling_factor or params.get("rope_scaling_factor") or rope["factor"])
    rope["high_freq_factor"] = float(params.get("rope_high_freq_factor") or rope["high_freq_factor"])
    return rope


def _max_positions(params: dict, family: str, vocab: int) -> int:
    """HF's max_position_embeddings: not in params.json (its max_seq_len, when present, sizes an inference cache)
    and without effect on default / llama3 RoPE logits; the values HF's converters write (Llama 3.1 131072,
    Llama 3 8192, Llama 2 4096, Mistral 32768)."""
    if family == "mistral":
        return 32768
    if params.get("use_scaled_rope"):
        return 131072
    return 8192 if vocab >= 128000 else 4096


def _special_tokens(family: str, vocab: int) -> dict:
    # Llama 3's tiktoken vocabulary puts <|begin_of_text|> / <|end_of_text|> at 128000 / 128001; SentencePiece
    # vocabularies (Llama 1/2, Mistral) use 1 / 2. Instruct models stop on other ids too: a generation concern.
    if family == "llama" and vocab >= 128256:
        return {"bos_token_id": 128000, "eos_token_id": 128001}
    return {"bos_token_id": 1, "eos_token_id": 2}


def _tensor_rows(state: dict[str, torch.Tensor], name: str) -> int:
    if name not in state:
        raise ValueError(f"missing tensor {name!r} in the native checkpoint")
    return int(state[name].shape[0])


def native_config(params: dict, state: dict[str, torch.Tensor], family: str, *,
                  rope_scaling_factor: float | None = None) -> LigerConfig:
    """The HF config of a native checkpoint: params.json for the architecture, the tensors for the sizes that
    params.json leaves open or gives only as a recipe (vocabulary, intermediate size)."""
    vocab = _tensor_rows(state, "tok_embeddings.weight")
    if params.get("vocab_size", -1) > 0 and params["vocab_size"] != vocab:
        raise ValueError(f"params.json vocab_size {params['vocab_size']} != tok_embeddings.weight rows {vocab}")
    n_layers = int(params["n_layers"])
    if n_layers:
        intermediate = _tensor_rows(state, "layers.0.feed_forward.w1.weight")
    else:  # nothing to read it from, and nothing uses it
        intermediate = int(params.get("hidden_dim") or 4 * params["dim"])
    if params.get("hidden_dim") and params["hidden_dim"] != intermediate:
        raise ValueError(f"params.json hidden_dim {params['hidden_dim']} != layers.0.feed_forward.w1.weight rows "
                         f"{intermediate}")
    fields = dict(vocab_size=vocab, hidden_size=int(params["dim"]), intermediate_size=intermediate,
                  num_hidden_layers=n_layers, num_attention_heads=int(params["n_heads"]),
                  num_key_value_heads=int(params.get("n_kv_heads") or params["n_heads"]),
                  head_dim=params.get("head_dim"), rms_norm_eps=float(params.get("norm_eps", 1e-5)),
                  # Mistral without rope_theta: 1e4 as in HF's converter and Mistral-7B-v0.1 (mistral-inference
                  # itself would use 1e6; every later Mistral release names its theta).
                  rope_theta=float(params.get("rope_theta", 10000.0)),
                  rope_scaling=_rope_scaling(params, rope_scaling_factor),
                  max_position_embeddings=_max_positions(params, family, vocab),
                  tie_word_embeddings=is_tied(state), **_special_tokens(family, vocab))
    if family == "mistral":
        fields["sliding_window"] = params.get("sliding_window")
    return FAMILIES[family](**fields)


def is_tied(state: dict[str, torch.Tensor]) -> bool:
    """No output.weight, or one that is the embedding bit for bit: HF's tied layout (Llama 3.2 1B/3B)."""
    output, embedding = state.get("output.weight"), state.get("tok_embeddings.weight")
    if output is None:
        return True
    return embedding is not None and output.shape == embedding.shape and torch.equal(output, embedding)


# ---- checking and renaming ----------------------------------------------------------------------------------
def expected_shapes(config: LigerConfig) -> dict[str, tuple[int, ...]]:
    """Every native tensor name of this architecture and its shape."""
    D, V, ffn = config.hidden_size, config.vocab_size, config.intermediate_size
    q, kv = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
    shapes = {"tok_embeddings.weight": (V, D), "norm.weight": (D,)}
    if not config.tie_word_embeddings:
        shapes["output.weight"] = (V, D)
    per_layer = {"attention.wq": (q, D), "attention.wk": (kv, D), "attention.wv": (kv, D), "attention.wo": (D, q),
                 "feed_forward.w1": (ffn, D), "feed_forward.w3": (ffn, D), "feed_forward.w2": (D, ffn),
                 "attention_norm": (D,), "ffn_norm": (D,)}
    for i in range(config.num_hidden_layers):
        shapes.update({f"layers.{i}.{part}.weight": shape for part, shape in per_layer.items()})
    return shapes


def check_native_state(state: dict[str, torch.Tensor], config: LigerConfig) -> None:
    """Raise naming every unknown, missing or mis-shaped tensor (before anything is written)."""
    expected = expected_shapes(config)
    tied_copy = {"output.weight"} if config.tie_word_embeddings else set()
    unknown = sorted(k for k in state if k not in expected and k not in _SKIPPED and k not in tied_copy)
    missing = sorted(k for k in expected if k not in state)
    misshaped = [f"{k}: {tuple(state[k].shape)} vs expected {shape}" for k, shape in expected.items()
                 if k in state and tuple(state[k].shape) != shape]
    problems = []
    if unknown:
        problems.append(f"unknown tensors: {unknown[:20]}")
    if missing:
        problems.append(f"missing tensors: {missing[:20]}")
    if misshaped:
        problems.append("mis-shaped tensors: " + "; ".join(misshaped[:20]))
    if problems:
        raise ValueError("native checkpoint does not match its params.json: " + " | ".join(problems))


def permute_rope(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """Interleaved-pair rows → rotate-half rows, per head: row pairs (2j, 2j+1) become rows (j, j + d/2)."""
    rows, cols = weight.shape
    d = rows // heads
    return weight.view(heads, d // 2, 2, cols).transpose(1, 2).reshape(rows, cols)  # (H·d, D)


def hf_name(name: str) -> str:
    """Meta / Mistral tensor name → HF name."""
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    m = _LAYER_KEY.match(name)
    return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}.weight"


def to_hf_state_dict(state: dict[str, torch.Tensor], config: LigerConfig,
                     dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """Checked native state → HF names, q/k rows permuted, optionally cast (a tied head is left out)."""
    out = {}
    for name in expected_shapes(config):
        tensor = state[name]
        if name.endswith("attention.wq.weight"):
            tensor = permute_rope(tensor, config.num_attention_heads)
        elif name.endswith("attention.wk.weight"):
            tensor = permute_rope(tensor, config.num_key_value_heads)
        out[hf_name(name)] = tensor.to(dtype) if dtype is not None else tensor
    return out


# ---- writing ------------------------------------------------------------------------------------------------
def _check_out_dir(out: Path) -> None:
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(f"output {str(out)!r} exists and is not an empty directory")


def write_hf(state: dict[str, torch.Tensor], config: LigerConfig, out: Path, extra_files: list[Path],
             max_shard_size: int | str, write_extra: Callable[[Path], None] | None = None) -> None:
    """Weights, config.json, `extra_files` and whatever `write_extra(directory)` writes into a hidden sibling,
    renamed to `out` only once complete."""
    atomic.sweep(out.parent, target=out.name)  # what conversions killed midway left (a whole model copy each)
    staging = atomic.temp_path(out)
    try:
        save_state_dict(state, config, staging, max_shard_size=max_shard_size)
        for file in extra_files:
            shutil.copy2(file, staging / file.name)
        if write_extra is not None:
            write_extra(staging)
        if out.is_dir():
            out.rmdir()  # empty (checked): rename needs the name free on every platform
        os.rename(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def tiktoken_model(files: list[Path], family: str) -> Path | None:
    """The Llama 3 tiktoken tokenizer.model among the tokenizer files, if any."""
    if family != "llama":
        return None
    return next((f for f in files if f.name == "tokenizer.model" and is_tiktoken_file(f)), None)


def llama3_tokenizer_writer(model_file: Path, params: dict, config: LigerConfig,
                            llama3_specials: str | None) -> Callable[[Path], None]:
    """Convert the tiktoken tokenizer now (a bad file fails before anything is written), point config's bos / eos
    at its ids, and return what writes it, with the original file under original/."""
    # Llama 3.1+ params.json name use_scaled_rope, Llama 3's do not: the one key that tells their token lists apart.
    version = llama3_specials or ("3.1" if "use_scaled_rope" in params else "3")
    tokenizer, specials = convert_tiktoken(model_file, version=version, vocab_size=config.vocab_size)
    config.bos_token_id, config.eos_token_id = specials[BOS], specials[EOS]

    def write(directory: Path) -> None:
        save_hf_tokenizer(tokenizer, directory, model_max_length=config.max_position_embeddings)
        (directory / "original").mkdir()
        shutil.copy2(model_file, directory / "original" / model_file.name)

    return write


def sentencepiece_models(files: list[Path]) -> list[Path]:
    """The SentencePiece tokenizer.model / tokenizer.model.vN files among the tokenizer files."""
    return [f for f in files if f.name.startswith("tokenizer.model") and spt.is_sentencepiece_file(f)]


def _model_version(path: Path) -> int:
    # tokenizer.model → 0, tokenizer.model.v3 → 3: Mistral names each later vocabulary by its version.
    return int(path.suffix[2:]) if path.suffix.startswith(".v") else 0


def sentencepiece_tokenizer_writer(model_files: list[Path], config: LigerConfig) -> Callable[[Path], None]:
    """Convert the newest SentencePiece model now (an unsupported one fails before anything is written), point
    config's bos / eos at its ids, and return what writes it, with every SentencePiece file under original/."""
    newest = max(model_files, key=_model_version)
    tokenizer, model = spt.convert_sentencepiece(newest, vocab_size=config.vocab_size)
    # A model without a BOS / EOS piece has none: the Llama 2 defaults (1 / 2) would name ordinary pieces.
    config.bos_token_id = model.bos_id if model.piece(model.bos_id) is not None else None
    config.eos_token_id = model.eos_id if model.piece(model.eos_id) is not None else None

    def write(directory: Path) -> None:
        spt.save_hf_tokenizer(tokenizer, model, directory, model_max_length=config.max_position_embeddings)
        (directory / "original").mkdir()
        for file in model_files:
            shutil.copy2(file, directory / "original" / file.name)

    return write


def tokenizer_writer(tokenizers: list[Path], family: str, params: dict, config: LigerConfig,
                     llama3_specials: str | None) -> Callable[[Path], None] | None:
    """What converts the tokenizer, if a file is convertible; the files it takes are removed from `tokenizers`
    (the list of files copied as they are)."""
    tiktoken_file = tiktoken_model(tokenizers, family)
    if tiktoken_file is not None:
        tokenizers.remove(tiktoken_file)
        return llama3_tokenizer_writer(tiktoken_file, params, config, llama3_specials)
    if llama3_specials is not None:
        raise ValueError("llama3_specials is given but there is no tiktoken tokenizer.model to convert")
    model_files = sentencepiece_models(tokenizers)
    if not model_files:
        return None
    for file in model_files:
        tokenizers.remove(file)
    return sentencepiece_tokenizer_writer(model_files, config)


def native_to_hf(src_dir: str | Path, out_dir: str | Path, *, family: str | None = None,
                 dtype: torch.dtype | str | None = None, rope_scaling_factor: float | None = None,
                 max_shard_size: int | str = "5GB", llama3_specials: str | None = None) -> Path:
    """Convert a Meta Llama or Mistral native checkpoint directory into an HF one (see the module docstring).

    family: "llama" or "mistral" (default: from params.json). dtype: torch dtype or "bf16" / "fp32" / "fp16"
    (default: the checkpoint's). rope_scaling_factor: the llama3 factor for use_scaled_rope checkpoints whose
    params.json does not name it (default 8, Llama 3.1; Llama 3.2 1B/3B need 32). llama3_specials: "3" or "3.1",
    Meta's special-token list for a tiktoken tokenizer.model (default: "3.1" if params.json names use_scaled_rope,
    else "3"). `out_dir` must not exist or be empty; it appears only once complete. No transformers import; nothing
    is downloaded.
    """
    # resolve(): a link to an empty directory is written through, as save_state_dict does (the link itself is no
    # directory that rmdir / rename could replace: the conversion failed only after every tensor was written).
    src, out = Path(src_dir).expanduser(), Path(out_dir).expanduser().resolve()
    if not src.is_dir():
        raise FileNotFoundError(f"native checkpoint directory {str(src)!r} does not exist")
    _check_out_dir(out)
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(f"unknown dtype {dtype!r} (choose from {sorted(DTYPES)})")
        dtype = DTYPES[dtype]
    parse_size(max_shard_size)  # a typo ("5G") is told now, not after every shard has been read and converted
    params, files = read_params(src), weight_files(src)
    family = family or detect_family(params, files)
    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r} (choose from {sorted(FAMILIES)})")
    check_params(params, family)
    state = load_native(files, int(params["dim"]), int(params.get("n_kv_heads") or params["n_heads"]))
    config = native_config(params, state, family, rope_scaling_factor=rope_scaling_factor)
    check_native_state(state, config)
    hf_state = to_hf_state_dict(state, config, dtype)
    tokenizers = sorted(p for p in src.iterdir() if p.is_file() and TOKENIZER_FILES.match(p.name))
    write_tokenizer = tokenizer_writer(tokenizers, family, params, config, llama3_specials)
    write_hf(hf_state, config, out, tokenizers, max_shard_size, write_tokenizer)
    return out

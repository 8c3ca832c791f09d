"""Checkpoint I/O in Hugging Face format: load, save, download, tokenizer.

Loading (``load_pretrained``) builds the model on the meta device, materialises it empty in the target dtype and
device, checks every tensor name and shape in the safetensors headers against the model before reading any data
(missing, mis-shaped and unexpected tensors are named), then streams the shards one tensor at a time into the
parameters (``copy_`` converts dtype and device), so host memory never holds more than one tensor of the checkpoint.
Allowed differences from the model's state_dict: ``*.rotary_emb.inv_freq`` (stale buffers of old conversions) are
skipped. With tied embeddings, as in transformers v5: a stored ``lm_head.weight`` equal to the embedding is skipped,
one that differs unties the model (both are loaded, with a warning), and one stored without the embedding fills it.
(Telling equal from different reads both tensors: the one place two checkpoint tensors are in memory at once.)
dtype: None or "auto" = config.json's dtype, else the checkpoint's (HF v5 "auto"); a name ("bfloat16") or torch.dtype.

Saving writes ``model.safetensors`` or ``model-0000i-of-0000N.safetensors`` + ``model.safetensors.index.json`` above
``max_shard_size`` (tied head stored once), and config.json with the original keys; everything is written to a
temporary sibling directory first, then renamed over the target, so a failed save leaves the previous one intact;
what a save killed midway left there (liger_models.atomic's names: a whole model copy) the next save of the same
directory clears, or puts back if the kill came between the swap's two renames.
Saving over an existing directory replaces only a previous save's own files (weights, index, config.json): every
other entry (tokenizer, README, other safetensors such as Medusa heads, sub-directories) is moved across unchanged.
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
import shutil
import warnings
from pathlib import Path
from typing import NamedTuple

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from tokenizers import Tokenizer

from liger_models import atomic
from liger_models.input_files import read_json_object
from liger_models.wrapped_checkpoint import WrappedCheckpoint

SAFE_WEIGHTS = "model.safetensors"
SAFE_INDEX = "model.safetensors.index.json"
# Where a checkpoint keeps its chat template: transformers v5 saves chat_template.jinja (the default template) and
# additional_chat_templates/<name>.jinja (named ones); older tokenizers keep it in tokenizer_config.json's
# "chat_template" (a string, or a list of named templates), older processors in chat_template.json.
CHAT_TEMPLATE_FILE, CHAT_TEMPLATE_DIR, LEGACY_CHAT_TEMPLATE_FILE = (
    "chat_template.jinja", "additional_chat_templates", "chat_template.json")
# A checkpoint's tokenizer: every file transformers may read it from, as fnmatch patterns of paths in the checkpoint
# directory. The one rule for what a Hub download fetches and what training copies into its checkpoints, so that a
# trained checkpoint is prompted, decoded and trained further exactly as its source was: the fast tokenizer and its
# config (tokenizer.json, tokenizer_config.json), the special and added tokens, the chat templates, and the slow
# tokenizers' vocabularies (SentencePiece tokenizer.model[.vN] / spiece.model, BPE vocab.json + merges.txt,
# WordPiece vocab.txt, tiktoken, Mistral's tekken.json) that transformers' slow classes read.
TOKENIZER_PATTERNS = ("tokenizer*", "special_tokens_map.json", "added_tokens.json", CHAT_TEMPLATE_FILE,
                      LEGACY_CHAT_TEMPLATE_FILE, f"{CHAT_TEMPLATE_DIR}/*.jinja", "vocab.json", "merges.txt",
                      "vocab.txt", "spiece.model", "*.tiktoken", "tekken.json")
ALLOW_PATTERNS = ["*.json", "*.safetensors", *TOKENIZER_PATTERNS]
# consolidated*.safetensors: Mistral repos' second copy of the weights for mistral-inference (never read here).
IGNORE_PATTERNS = ["original/*", "*.pth", "*.bin", "*.gguf", "*.pt", "consolidated*.safetensors"]
_SKIPPED = re.compile(r".*\.rotary_emb\.inv_freq$")
EMBED, HEAD = "model.embed_tokens.weight", "lm_head.weight"
_SAFE_DTYPES = {"F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32, "F64": torch.float64}
_OWN_OUTPUT = re.compile(rf"^(config\.json|{re.escape(SAFE_WEIGHTS)}|{re.escape(SAFE_INDEX)}|"
                         r"model-\d{5}-of-\d{5}\.safetensors)$")


ADAPTER_CONFIG = "adapter_config.json"  # what marks a PEFT adapter directory (liger_models.lora writes them)
# A training run keeps its checkpoints as <output-dir>/checkpoints/step_NNNNNN/, and in that root a text file of this
# name holding the newest one's directory name (train/checkpointing.py writes it).
CHECKPOINT_POINTER = "latest"


def pointed_checkpoint(root: Path) -> Path | None:
    """The directory that ``root``'s pointer file names, when there is one and it is a directory."""
    pointer = root / CHECKPOINT_POINTER
    if not pointer.is_file():
        return None
    named = root / pointer.read_text(encoding="utf-8").strip()
    return named if named.name and named.is_dir() else None


def newest_run_checkpoint(path: Path) -> str:
    """For an error about a path that is no checkpoint: when it is a training run's output directory, its
    checkpoints root or the pointer file in that root, the words naming the newest checkpoint to pass instead (else
    "")."""
    if path.is_file():
        named = pointed_checkpoint(path.parent) if path.name == CHECKPOINT_POINTER else None
        what = "is a training run's pointer to its newest checkpoint"
    else:
        named = pointed_checkpoint(path) or pointed_checkpoint(path / "checkpoints")
        what = "holds a training run's checkpoints"
    return "" if named is None else f"; it {what}, the newest is {str(named)!r}: pass that"


def resolve_dir(path: str | Path) -> Path:
    """An existing checkpoint directory with a config.json, or a clear error. A training run's output directory,
    its checkpoints root or the pointer file in it is answered with the newest checkpoint's path to pass instead."""
    path = Path(path).expanduser()
    if path.is_file():  # e.g. .../model.safetensors: "does not exist" would be wrong
        raise NotADirectoryError(f"{str(path)!r} is a file" + (newest_run_checkpoint(path) or (
            f"; pass the checkpoint directory that holds it ({str(path.parent)!r})")))
    if not path.is_dir():
        raise FileNotFoundError(f"checkpoint directory {str(path)!r} does not exist (for a Hub repo use from_hub)")
    if not (path / "config.json").is_file():
        if (path / ADAPTER_CONFIG).is_file():  # a `train --lora-r` checkpoint, or HF + PEFT's save_pretrained
            raise FileNotFoundError(
                f"no config.json in {str(path)!r}: it holds a LoRA adapter ({ADAPTER_CONFIG}), not a model. Decode "
                f"with it through `liger-models generate --model {path}`, or merge it into its base with "
                f"`liger-models merge-lora --adapter {path} --out DIR` and pass DIR (from Python: load the base, then "
                "liger_models.lora.load_adapter)")
        raise FileNotFoundError(f"no config.json in {str(path)!r}{newest_run_checkpoint(path)}")
    return path


GENERATION_CONFIG = "generation_config.json"


def read_generation_config(path: Path) -> dict:
    """generation_config.json of a checkpoint directory as a dict ({} when absent): HF's generate takes its stop
    and pad ids from it (an instruct model's config.json often names only the end-of-text id, not end-of-turn)."""
    file = path / GENERATION_CONFIG
    return read_json_object(file) if file.is_file() else {}


def read_config(path: str | Path) -> dict:
    """config.json of a checkpoint directory as a dict (a clear error when it is not a JSON object)."""
    return read_json_object(resolve_dir(path) / "config.json")


def config_model_type(raw: dict, path: str | Path) -> str:
    """config.json's ``model_type``, or an error that says what the directory holds instead."""
    # Medusa heads (format B) carry medusa_* keys and no model_type; vLLM's layout says "medusa". A stage-2
    # directory (base + heads) has the base's model_type and loads here as the base model.
    if raw.get("model_type") == "medusa" or ("model_type" not in raw and "medusa_num_heads" in raw):
        raise ValueError(f"{str(path)!r} holds Medusa heads, not a causal LM: load it with "
                         "liger_models.medusa.MedusaModel.from_pretrained")
    if not raw.get("model_type"):
        raise ValueError(f"config.json in {str(path)!r} has no model_type, so the architecture is unknown")
    return raw["model_type"]


def is_bnb_4bit(raw: dict) -> bool:
    """Whether config.json ``raw`` says bitsandbytes 4-bit weights (``quantization_config``)."""
    quant = raw.get("quantization_config")
    return isinstance(quant, dict) and quant.get("quant_method") == "bitsandbytes" and bool(quant.get("load_in_4bit"))


def checkpoint_files(path: Path) -> list[Path]:
    """The safetensors files of a checkpoint: the single file, else the union of the index's shards (HF's order
    when a directory holds both)."""
    if (path / SAFE_WEIGHTS).is_file():
        return [path / SAFE_WEIGHTS]
    if (path / SAFE_INDEX).is_file():
        weight_map = read_json_object(path / SAFE_INDEX).get("weight_map")  # a bad file is named, not a traceback
        if not isinstance(weight_map, dict):
            raise ValueError(f"{SAFE_INDEX} in {str(path)!r} has no weight_map (tensor name -> shard file)")
        shards = sorted(set(weight_map.values()))
        missing = [s for s in shards if not (path / s).is_file()]
        if missing:
            raise FileNotFoundError(f"{SAFE_INDEX} in {str(path)!r} names missing shard files: {missing}")
        return [path / s for s in shards]
    # from_hub never downloads pickles: a .bin repo arrives with at most its index (pytorch_model.bin.index.json).
    other = [p.name for p in path.iterdir()
             if p.suffix in (".bin", ".pt", ".pth") or p.name.endswith(".bin.index.json")]
    hint = f" (found {other}: only safetensors checkpoints are supported)" if other else ""
    raise FileNotFoundError(f"no {SAFE_WEIGHTS} or {SAFE_INDEX} in {str(path)!r}{hint}")


def _expected_tensors(model: torch.nn.Module, stored: set[str] | None = None) -> dict[str, torch.Tensor]:
    """The tensors a checkpoint holds, by name (the tensors to copy into, when loading). ``stored``: the names a
    checkpoint being loaded has, for a model that accepts another layout of some tensors (stacked experts)."""
    state = model.state_dict(keep_vars=True)
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    if stored is not None and hasattr(model, "expect_stored_layout"):
        model.expect_stored_layout(state, stored)
    return state


class _Header(NamedTuple):
    file: Path
    shape: tuple[int, ...]
    dtype: str  # safetensors' name: "BF16", "F32", ...
    stored: str = ""  # the name in the file where it differs from the key (a multimodal checkpoint's decoder)


def _read_headers(files: list[Path]) -> dict[str, _Header]:
    """Every tensor of the checkpoint, in file order: its file, shape and dtype (headers only, no data). Read once
    per load; the tied-head routing, the shape check and the dtype fallback all work from it."""
    headers: dict[str, _Header] = {}
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():
                    meta = f.get_slice(name)
                    headers[name] = _Header(file, tuple(meta.get_shape()), meta.get_dtype())
        except SafetensorError as e:  # safetensors' own message names neither the file nor the likely cause
            raise ValueError(_unreadable_weights(file, e)) from e
    return headers


def _unreadable_weights(file: Path, error: Exception) -> str:
    """Why a safetensors file cannot be opened, in words: a repo cloned without git-lfs holds small text pointers
    instead of the weights; a copied or interrupted download is cut short."""
    with open(file, "rb") as f:
        head = f.read(64)
    if head.startswith(b"version https://git-lfs"):
        return (f"{str(file)!r} is a Git LFS pointer, not the weights (the repo was cloned without git-lfs): run "
                "`git lfs pull` in it, or load the repo with from_hub")
    return (f"{str(file)!r} is not a readable safetensors file ({file.stat().st_size} bytes; truncated or "
            f"interrupted download?): {error}")


def _read_tensor(headers: dict[str, _Header], name: str) -> torch.Tensor:
    with safe_open(str(headers[name].file), framework="pt", device="cpu") as f:
        return f.get_tensor(headers[name].stored or name)


def _read_all(headers: dict[str, _Header]) -> dict[str, torch.Tensor]:
    """Every tensor ``headers`` names, by key, each file opened once."""
    tensors = {}
    for file in dict.fromkeys(h.file for h in headers.values()):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            tensors.update({key: f.get_tensor(h.stored or key) for key, h in headers.items() if h.file == file})
    return tensors


def _unwrap(wrapper: WrappedCheckpoint, headers: dict[str, _Header]) -> dict[str, _Header]:
    """The decoder's headers under its own names (each remembering its stored one); every other tensor of the
    checkpoint is read into ``wrapper.carried`` as stored."""
    decoder, carried = wrapper.split({stored: header._replace(stored=stored) for stored, header in headers.items()})
    wrapper.carried.update(_read_all(carried))
    return decoder


def _tied_head_routes(config, headers: dict[str, _Header]) -> dict[str, str | None]:
    """Where a stored ``lm_head.weight`` goes in a tied model (None: skipped), as transformers v5 decides.

    Tied and both stored: equal, the head is a redundant copy; different, HF does NOT tie (it warns and loads both),
    so neither do we: dropping it would silently change the logits. Only the head stored: it is the shared matrix.
    """
    if not config.tie_word_embeddings or HEAD not in headers:
        return {}
    if EMBED not in headers:
        return {HEAD: EMBED}
    # Two V×D tensors in host memory, once, and only for checkpoints that store the tied head twice.
    if torch.equal(_read_tensor(headers, HEAD), _read_tensor(headers, EMBED)):
        return {HEAD: None}
    warnings.warn("tie_word_embeddings is true but the checkpoint stores a different lm_head.weight: loading an "
                  "untied head, as transformers does (set tie_word_embeddings to false to silence this)", stacklevel=3)
    config.tie_word_embeddings = False  # a fresh config of this load only
    return {}


def _check_headers(headers: dict[str, _Header], expected: dict[str, torch.Tensor],
                   routes: dict[str, str | None]) -> None:
    """Raise naming every missing, mis-shaped or unexpected tensor before any data is read (a checkpoint's tensors
    by the names its files give them)."""
    seen, unexpected, misshaped = set(), [], []
    for key, header in headers.items():
        name, stored = routes.get(key, key), header.stored or key
        if _SKIPPED.match(key) or name is None:
            continue
        if name not in expected:
            unexpected.append(stored)
            continue
        seen.add(name)
        if header.shape != tuple(expected[name].shape):
            misshaped.append(f"{stored}: checkpoint {header.shape} vs model {tuple(expected[name].shape)} "
                             f"({header.file.name})")
    missing = [n for n in expected if n not in seen]
    problems = []
    if "lm_head.weight" in missing:
        problems.append("lm_head.weight is missing but tie_word_embeddings is false (untied head; a random head "
                        "would be silently wrong)")
    if missing:
        problems.append(f"missing tensors: {missing[:20]}{' …' if len(missing) > 20 else ''}")
    if misshaped:
        problems.append("mis-shaped tensors: " + "; ".join(misshaped[:20]))
    if unexpected:
        problems.append(f"unexpected tensors (not in this architecture): {unexpected[:20]}")
    if problems:
        raise ValueError("checkpoint does not match the model config: " + " | ".join(problems))


def _checkpoint_dtype(headers: dict[str, _Header]) -> torch.dtype | None:
    """The first floating-point dtype stored in the checkpoint (what HF v5 "auto" falls back to)."""
    return next((_SAFE_DTYPES[h.dtype] for h in headers.values() if h.dtype in _SAFE_DTYPES), None)


def parse_dtype(dtype: torch.dtype | str | None) -> torch.dtype | None:
    """A dtype argument: None or "auto" → None (the caller's default), else a floating-point torch.dtype or its
    name ("bfloat16", as HF accepts); anything else raises (a string reaching Module.to() reads as a device)."""
    if dtype is None or dtype == "auto":
        return None
    parsed = getattr(torch, dtype, None) if isinstance(dtype, str) else dtype
    if not isinstance(parsed, torch.dtype) or not parsed.is_floating_point:
        raise ValueError(f"dtype={dtype!r}: need a floating-point torch.dtype, its name (e.g. 'bfloat16') or 'auto'")
    return parsed


def resolve_dtype(dtype: torch.dtype | str | None, config, headers: dict[str, _Header]) -> torch.dtype:
    """The parameter dtype of a load: the one asked for, else config.json's, else the checkpoint's (HF v5 "auto")."""
    chosen = parse_dtype(dtype) or config.dtype or _checkpoint_dtype(headers) or torch.float32
    if not chosen.is_floating_point:  # config.json's "int8" (a quantized export) would fail deep in Module.to
        raise ValueError(f"config.json's dtype {chosen} is not a floating-point type: pass dtype= (e.g. "
                         "torch.bfloat16) to load the weights in one")
    return chosen


def load_pretrained(path: str | Path, cls, *, dtype: torch.dtype | str | None = None,
                    device: torch.device | str | int | None = None):
    """Instantiate ``cls`` from an HF checkpoint directory (see the module docstring)."""
    path = resolve_dir(path)
    raw = read_config(path)
    model_type, expected_type = config_model_type(raw, path), cls.config_class.model_type
    if model_type != expected_type and model_type not in cls.config_class.wrapped_in:
        raise ValueError(f"{cls.__name__} loads model_type {expected_type!r}, but {str(path)!r} has "
                         f"{model_type!r} (use AutoLigerForCausalLM)")
    files = checkpoint_files(path)
    headers = _read_headers(files)
    wrapper, decoder_config = None, raw
    if model_type != expected_type:  # a multimodal checkpoint: its text_config is this family's decoder
        wrapper = WrappedCheckpoint.of(raw, headers, path)
        decoder_config = wrapper.text_config()
    try:
        config = cls.config_class.from_hf(decoder_config)
    except (ValueError, TypeError) as e:  # a value of the wrong type or range: say which file holds it
        raise ValueError(f"{str(path / 'config.json')!r}: {e}") from e
    config.extra["_name_or_path"] = str(path)  # not written back (to_hf leaves out "_" keys)
    if wrapper is not None:
        headers = _unwrap(wrapper, headers)
    dtype = resolve_dtype(dtype, config, headers)
    device = torch.device("cpu" if device is None else device)  # not `device or`: device 0 is cuda:0
    routes = _tied_head_routes(config, headers)  # may untie config: before the model is built
    with torch.device("meta"):
        model = cls(config)
    model = model.to(dtype).to_empty(device=device)  # no data yet; cast on meta is free
    model.tie_weights()
    expected = _expected_tensors(model, set(headers))
    try:
        _check_headers(headers, expected, routes)
    except ValueError as e:
        # GPTQ / AWQ / bitsandbytes / fp8 repos store packed weights and scales: name that, not 100 shape errors. Only
        # on a mismatch: a merged model that kept a stale quantization_config over plain weights still loads.
        quant = raw.get("quantization_config")
        if quant:
            method = quant.get("quant_method", "unknown method") if isinstance(quant, dict) else quant
            if is_bnb_4bit(raw):
                raise ValueError(f"{str(path)!r} holds a quantized checkpoint (quantization_config: bitsandbytes "
                                 f"4-bit): load it with liger_models.lora.load_bnb_4bit(path) (an NF4 base for "
                                 f"QLoRA, which liger_models.lora.load_causal_lm(path) and every --model command "
                                 f"pick by themselves), or load the unquantized weights ({e})") from e
            raise ValueError(f"{str(path)!r} holds a quantized checkpoint (quantization_config: {method}), which "
                             f"is not supported: load the unquantized (bf16/fp16/fp32) weights instead ({e})") from e
        raise
    with torch.no_grad():
        for file in files:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for key, header in headers.items():
                    name = routes.get(key, key)
                    if header.file == file and name in expected:
                        expected[name].copy_(f.get_tensor(header.stored or key))
    model.generation_config = read_generation_config(path)
    model.checkpoint_wrapper = wrapper
    return model.eval()


def snapshot(repo_id: str, *, revision: str | None = None, cache_dir: str | Path | None = None,
             local_files_only: bool = False, token: str | bool | None = None) -> Path:
    """Local snapshot directory of a Hub repo (only *.json, *.safetensors, tokenizer and chat-template files are
    fetched).

    Honours ``HF_HUB_OFFLINE`` / ``local_files_only`` (cache only, refs resolved from ``refs/``) and ``cache_dir``.
    ``token`` is passed to huggingface_hub (None: ``HF_TOKEN`` or the stored login), for gated and private repos.
    An existing local directory (e.g. an already downloaded snapshot) is returned as it is.
    """
    if Path(repo_id).expanduser().is_dir():
        return resolve_dir(repo_id)
    # Imported on a download only: huggingface_hub's API modules take a quarter of a second to import.
    from huggingface_hub import constants, errors, snapshot_download
    from huggingface_hub.errors import GatedRepoError, HfHubHTTPError, HFValidationError, LocalEntryNotFoundError, \
        RepositoryNotFoundError, RevisionNotFoundError

    login = "pass token= or set HF_TOKEN (or run `hf auth login`)"
    try:
        local = snapshot_download(repo_id, revision=revision, cache_dir=cache_dir, local_files_only=local_files_only,
                                  allow_patterns=ALLOW_PATTERNS, ignore_patterns=IGNORE_PATTERNS, token=token)
    except HFValidationError as e:  # most often a mistyped local path, which huggingface_hub reads as a repo id
        raise ValueError(f"{repo_id!r} is not an existing local directory, and is an invalid Hub repo id: {e}") from e
    except GatedRepoError as e:  # a subclass of RepositoryNotFoundError: "not found" would send users to the spelling
        raise PermissionError(f"Hub repo {repo_id!r} is gated: accept its terms at https://huggingface.co/{repo_id} "
                              f"with your account, then {login}. ({str(e).splitlines()[0] if str(e) else ''})") from e
    except (RepositoryNotFoundError, RevisionNotFoundError) as e:
        raise FileNotFoundError(f"Hub repo {repo_id!r} (revision {revision or 'main'}) not found (if it is private, "
                                f"{login}): {e}") from e
    except HfHubHTTPError as e:
        if getattr(getattr(e, "response", None), "status_code", None) != 401:
            raise
        raise PermissionError(f"the Hub refused the credentials for {repo_id!r} (HTTP 401: an invalid or expired "
                              f"token?); {login} with a valid token") from e
    except LocalEntryNotFoundError as e:
        # huggingface_hub ≥ 1.x knows, from its cached file listing, that an interrupted download left files out: its
        # message names them. "Not in the cache" would be wrong (the snapshot is there, partly).
        incomplete = getattr(errors, "IncompleteSnapshotError", None)
        if incomplete is not None and isinstance(e, incomplete):
            raise FileNotFoundError(f"the cached snapshot of {repo_id!r} (revision {revision or 'main'}) is an "
                                    f"interrupted download: {e}") from e
        where = (f"{repo_id!r} (revision {revision or 'main'}) is not in the local Hub cache "
                 f"{str(cache_dir) if cache_dir else '(default)'}")
        if local_files_only or constants.HF_HUB_OFFLINE:
            raise FileNotFoundError(f"{where} and downloads are disabled") from e
        # Downloads were allowed: the Hub (or HF_ENDPOINT) could not be reached; say why, not "disabled".
        cause = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise FileNotFoundError(f"{where} and could not reach the Hub to download it ({cause})") from e
    return resolve_dir(local)


def resolve_model(model: str) -> Path:
    """``--model`` as a directory: a local model directory, or the local snapshot of a Hub repo id (downloaded if
    needed). A path that does not exist is refused by name rather than looked up on the Hub."""
    path = Path(model).expanduser()
    if path.exists():
        return resolve_dir(path)
    if model.startswith((".", "/", "~")) or model.count("/") > 1:
        raise FileNotFoundError(f"--model {model!r}: no such directory (and not a Hub repo id)")
    return snapshot(model)


def named_base(directory: Path, config_name: str, flag: str) -> Path:
    """The base model directory that ``directory``'s ``config_name`` names in ``base_model_name_or_path`` (Medusa
    heads, a LoRA adapter): as written (absolute, or relative to here), else relative to ``directory`` (a run
    directory moved as a whole), else a Hub id's snapshot. ``flag`` names the option in errors."""
    config = directory / config_name
    if not config.is_file():
        raise ValueError(f"{flag} {directory}: no {config_name}{newest_run_checkpoint(directory)}")
    base = read_json_object(config).get("base_model_name_or_path")
    if not base:
        raise ValueError(f"{flag} {directory}: its {config_name} names no base_model_name_or_path; pass --model")
    for candidate in (Path(base).expanduser(), directory / base):
        if candidate.is_dir():
            return candidate
    if base.startswith((".", "/", "~")) or base.count("/") > 1:  # a path, not a Hub id: never a download
        raise FileNotFoundError(f"{flag} {directory}: its {config_name} names the base {base!r}, which is not a "
                                "directory here; pass --model")
    return resolve_model(base)


def parse_size(size: int | str) -> int:
    """Bytes from 5000000, "5000000", "5GB" (10^9), "500MB", "2GiB" (2^30), "200KB" …; as in HF, a decimal unit
    ending in a lowercase b counts bits ("5Gb" = 5·10^9 / 8 bytes)."""
    if isinstance(size, int):
        return size
    if size.strip().isdigit():
        return int(size)
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?i?B)\s*", size, re.IGNORECASE)
    if not m:
        raise ValueError(f"cannot parse size {size!r} (examples: 5GB, 500MB, 2GiB, 1000000)")
    unit = m.group(2)
    power = "BKMGT".index(unit[0].upper())
    binary = "I" in unit.upper()
    n = int(float(m.group(1)) * ((1024 if binary else 1000) ** power))
    return n // 8 if unit.endswith("b") and not binary and power else n


def _plan_shards(state: dict[str, torch.Tensor], max_bytes: int) -> list[list[str]]:
    shards, current, size = [], [], 0
    for name, t in state.items():
        nbytes = t.numel() * t.element_size()
        if current and size + nbytes > max_bytes:
            shards.append(current)
            current, size = [], 0
        current.append(name)
        size += nbytes
    return shards + [current] if current else shards


def save_pretrained(model, directory: str | Path, *, max_shard_size: int | str = "5GB") -> None:
    """HF-format safetensors + config.json into ``directory``, atomically (see the module docstring)."""
    state = {k: v.detach() for k, v in _expected_tensors(model).items()}
    save_state_dict(state, model.config, directory, max_shard_size=max_shard_size,
                    generation_config=getattr(model, "generation_config", None),
                    wrapper=getattr(model, "checkpoint_wrapper", None))


def save_state_dict(state: dict[str, torch.Tensor], config, directory: str | Path, *,
                    max_shard_size: int | str = "5GB", generation_config: dict | None = None,
                    wrapper: WrappedCheckpoint | None = None) -> None:
    """``save_pretrained`` for tensors that are already HF-named (a tied ``lm_head.weight`` left out) and a config
    with ``to_hf()``: checkpoint converters write through here without building a model. A non-empty
    ``generation_config`` is written as generation_config.json (replacing one already in the directory). With
    ``wrapper`` (a decoder loaded from a multimodal checkpoint) the whole multimodal checkpoint is written."""
    dtype = str(next(iter(state.values())).dtype).removeprefix("torch.")
    if wrapper is None:
        config = config.to_hf()
        config["torch_dtype" if "torch_dtype" in config else "dtype"] = dtype
    else:
        config = wrapper.config_json(config.to_hf(), dtype)
        state = wrapper.stored_state(state)
    # resolve(), not absolute(): a symlinked output directory is saved into its target (the swap below would
    # otherwise replace the link with a new directory beside it, on the link's filesystem).
    directory = Path(directory).expanduser().resolve()
    atomic.sweep(directory.parent, target=directory.name)
    if directory.is_dir() and os.path.ismount(directory):
        # The checkpoint is staged beside the directory and swapped in by rename, which a mount point (a container
        # volume's root) refuses with EBUSY after all the writing: say so before writing anything.
        raise ValueError(f"{directory} is a mount point, which cannot be replaced atomically; save into a "
                         "subdirectory of it instead")
    shards = _plan_shards(state, parse_size(max_shard_size))
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = atomic.temp_path(directory)
    old = atomic.temp_path(directory, "old")
    tmp.mkdir()
    moved: list[str] = []  # the user's entries, moved (not copied) from directory into tmp
    try:
        weight_map = {}
        for i, names in enumerate(shards):
            fname = SAFE_WEIGHTS if len(shards) == 1 else f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            # A copy per shard: packed q|k|v views share storage, which safetensors refuses; memory ≤ one shard.
            tensors = {n: state[n].to("cpu", copy=True).contiguous() for n in names}
            save_file(tensors, str(tmp / fname), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(names, fname))
        if len(shards) > 1:
            total = sum(t.numel() * t.element_size() for t in state.values())
            index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
            (tmp / SAFE_INDEX).write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        if generation_config:
            (tmp / GENERATION_CONFIG).write_text(json.dumps(generation_config, indent=2) + "\n", encoding="utf-8")
        # safetensors (0.8) writes its files owner-only (0600): give the weights the mode config.json got from a
        # plain write (the umask's), or a server running as another user (TGI, vLLM), or a teammate, cannot read them.
        mode = (tmp / "config.json").stat().st_mode & 0o777
        for fname in set(weight_map.values()):
            os.chmod(tmp / fname, mode)
        if directory.exists():  # keep every entry but a previous save's own files (and what this save replaces)
            for p in directory.iterdir():
                if not (_OWN_OUTPUT.match(p.name) or (tmp / p.name).exists()):
                    os.rename(p, tmp / p.name)
                    moved.append(p.name)
            in_it = os.path.samefile(".", directory)  # the working directory: follow it into the new one below
            os.rename(directory, old)
            os.rename(tmp, directory)
            if in_it:  # else the process stays in the deleted old directory, where every relative path fails
                os.chdir(directory)
            atomic.discard(old)  # a kill inside the deletion must not leave an "old" that a sweep would put back
        else:
            os.rename(tmp, directory)
    except BaseException:
        if old.exists() and not directory.exists():
            os.rename(old, directory)
        for name in moved:  # the user's entries go back where they were
            if (tmp / name).exists():
                os.rename(tmp / name, directory / name)
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def tokenizer_files(directory: str | Path) -> list[str]:
    """The tokenizer files (TOKENIZER_PATTERNS) a checkpoint directory holds, as paths relative to it."""
    root = Path(directory)
    found = [p for p in root.iterdir() if p.is_file()]
    if (root / CHAT_TEMPLATE_DIR).is_dir():
        found += [p for p in (root / CHAT_TEMPLATE_DIR).iterdir() if p.is_file()]
    names = (p.relative_to(root).as_posix() for p in found)
    return sorted(n for n in names if any(fnmatch.fnmatchcase(n, pattern) for pattern in TOKENIZER_PATTERNS))


def copy_tokenizer_files(src: str | Path, dst: str | Path) -> list[str]:
    """Copy every tokenizer file of checkpoint ``src`` (TOKENIZER_PATTERNS) into ``dst``; a file ``dst`` already
    holds is kept (what the save itself wrote wins). Returns the paths copied, relative to the directories."""
    src, dst = Path(src), Path(dst)
    copied = []
    for name in tokenizer_files(src):
        if (dst / name).exists():
            continue
        (dst / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src / name, dst / name)
        copied.append(name)
    return copied


def load_tokenizer(path: str | Path):
    """``tokenizers.Tokenizer`` from a checkpoint directory's tokenizer.json, with its truncation and padding
    settings switched off (fine-tuned repos often save them; they would silently cut documents short and pad
    them with tokens that training would then learn)."""
    file = Path(path).expanduser() / "tokenizer.json"
    if not file.is_file():
        raise FileNotFoundError(f"no tokenizer.json in {str(path)!r} (only fast-tokenizer files are supported)")
    try:
        tokenizer = Tokenizer.from_file(str(file))
    except Exception as e:  # tokenizers raises a bare Exception ("EOF while parsing ... at line 179 column 14")
        raise ValueError(f"{str(file)!r} is not a readable tokenizer.json ({e}; truncated or interrupted "
                         "download?)") from e
    tokenizer.no_truncation()
    tokenizer.no_padding()
    return tokenizer

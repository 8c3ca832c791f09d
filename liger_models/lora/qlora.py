"""bitsandbytes 4-bit HF checkpoints: load them as they are (NF4 bases in LoraLinear), and write them.

What transformers + bitsandbytes save for a 4-bit model (kernels/ops/nf4.py has the byte layout): config.json with
``quantization_config`` {quant_method: bitsandbytes, load_in_4bit: true, bnb_4bit_quant_type: nf4, …}; per
quantised linear ``<name>.weight`` (uint8 codes [n/2, 1]), ``.weight.absmax``, ``.weight.quant_map``, with double
quantisation ``.weight.nested_absmax`` / ``.weight.nested_quant_map``, and ``.weight.quant_state.bitsandbytes__nf4``
(JSON bytes: quant_type, blocksize, dtype, shape, nested_*); everything else (embeddings, norms, lm_head, modules in
``llm_int8_skip_modules``) stays 16-bit under its HF name. Each tensor's JSON state is trusted over the config.

A multimodal checkpoint (Gemma 3 4B-27B, liger_models/wrapped_checkpoint.py) loads as its text decoder the same way;
the tensors that are not the decoder's are kept beside it, those of 4-bit linears (a quantised vision tower)
dequantised to the compute dtype at load, so that every later save (dense or 4-bit) writes them as plain weights
(``save_bnb_4bit`` names the vision tower and projector in ``llm_int8_skip_modules``).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from liger_models import atomic
from liger_models.auto import WRAPPED, AutoLigerForCausalLM, model_class
from liger_models.hub import (checkpoint_files, config_model_type, is_bnb_4bit, parse_dtype, read_config,
                              resolve_dir)
from liger_models.kernels.ops.nf4 import (QUANT_STATE_KEY, bnb_tensors, bnb_tensors_of, dequantize_nf4_reference,
                                          from_bnb_tensors)
from liger_models.modules.lora_linear import LoraLinear, NF4Weight
from liger_models.modules.moe import per_expert_tensors
from liger_models.wrapped_checkpoint import OTHER_PARTS, WrappedCheckpoint

from .attach import _replace, lora_modules, quantize_base_
from .config import decoder_linears


def _read_tensors(path: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for file in checkpoint_files(path):
        tensors.update(load_file(str(file)))
    return tensors


def load_bnb_4bit(path: str | Path, dtype: torch.dtype | None = None, device: str | torch.device = "cpu"):
    """A model from a bitsandbytes NF4 checkpoint: quantised linears become NF4-based LoraLinear (no adapter yet),
    the rest loads as usual in ``dtype`` (default: the quant state's compute dtype)."""
    path = resolve_dir(path)
    raw = read_config(path)
    if not is_bnb_4bit(raw):
        raise ValueError(f"{str(path)!r}: config.json has no bitsandbytes 4-bit quantization_config")
    quant = raw["quantization_config"]
    if quant.get("bnb_4bit_quant_type", "fp4") != "nf4":
        raise ValueError(f"{str(path)!r}: bnb_4bit_quant_type {quant.get('bnb_4bit_quant_type', 'fp4')!r} is not "
                         "supported (only nf4)")
    model_type = config_model_type(raw, path)
    cls = model_class(model_type)
    tensors = _read_tensors(path)
    wrapper = None
    if model_type in WRAPPED:  # a multimodal checkpoint: its text decoder, the rest kept (module docstring)
        wrapper = WrappedCheckpoint.of(raw, tensors, path)
        tensors, others = wrapper.split(tensors)
        wrapper.carried.update(_dense(others))
        raw = wrapper.text_config()
    config = cls.config_class.from_hf({k: v for k, v in raw.items() if k != "quantization_config"})
    states = {k[: -len(".weight." + QUANT_STATE_KEY)] for k in tensors if k.endswith(".weight." + QUANT_STATE_KEY)}
    if dtype is None:
        dtypes = {json.loads(bytes(tensors[f"{n}.weight.{QUANT_STATE_KEY}"].tolist()))["dtype"] for n in states}
        dtype = getattr(torch, dtypes.pop()) if len(dtypes) == 1 else torch.bfloat16
    # Built on the meta device: no dense weight of a quantised linear is ever allocated, so a 4-bit checkpoint loads
    # into about its own size on the device, not the dense model's (an 8B base: ~6 GiB, not 16). Nothing is drawn
    # from the caller's random stream either, from which a training run draws its adapters next.
    target = torch.device(device)
    with torch.random.fork_rng(devices=[]), torch.device("meta"):
        model = cls(config).to(dtype)
    with torch.no_grad():
        for name, lin in decoder_linears(model).items():
            if name not in states:
                continue
            codes, absmax, state = from_bnb_tensors(tensors, name)
            shape = tuple(state["shape"])
            if shape != (lin.out_features, lin.in_features):
                expected = (lin.out_features, lin.in_features)
                raise ValueError(f"{name}: quantised shape {shape} != the config's {expected}")
            bias = None
            if lin.bias is not None:
                bias = torch.nn.Parameter(tensors[f"{name}.bias"].to(device=device, dtype=dtype), requires_grad=False)
            _replace(model, name, LoraLinear(lin.in_features, lin.out_features, None, bias,
                                             quant=NF4Weight(codes.to(device), absmax.to(device), shape, dtype)))
        _materialise_(model, target)
        expected = model.state_dict(keep_vars=True)
        if config.tie_word_embeddings:
            expected.pop("lm_head.weight", None)
        missing = [k for k in expected if k not in tensors]
        if missing:
            raise ValueError(f"{str(path)!r}: {missing[0]!r} is missing from the checkpoint")
        for key, p in expected.items():
            p.copy_(tensors[key])
    model.pack_()
    model.checkpoint_wrapper = wrapper
    return model.eval()


def _materialise_(model: torch.nn.Module, device: torch.device) -> None:
    """Allocate on ``device``, uninitialised, every tensor of ``model`` still on the meta device (what the
    checkpoint's tensors are copied into next), and tie the head again where the config ties it (each module's
    tensors are allocated apart)."""
    for module in model.modules():
        own = [*module.parameters(recurse=False), *module.buffers(recurse=False)]
        if any(t.is_meta for t in own):
            module.to_empty(device=device, recurse=False)
    model.tie_weights()


def load_causal_lm(path: str | Path, dtype: torch.dtype | str | None = None,
                   device: str | torch.device | int | None = None, *, quantise: bool = False):
    """The causal LM stored at ``path`` as it is stored: a bitsandbytes 4-bit checkpoint as its NF4 base
    (``load_bnb_4bit``: it decodes, trains Medusa heads on top, and trains through adapters), any other through
    ``AutoLigerForCausalLM.from_pretrained``. What the commands that read ``--model`` load.

    ``quantise``: a dense checkpoint's NF4 base, as ``quantize_base_`` makes it (what `--qlora` trains on), with the
    dense weights read into host memory and sent to ``device`` one weight at a time to be quantised there: the
    device holds the NF4 model and one dense weight at most, not the dense model (a 16 GiB 8B base fits a 12 GiB
    card, as with bitsandbytes' load_in_4bit). A 4-bit checkpoint is NF4 already."""
    path = resolve_dir(path)
    target = torch.device("cpu" if device is None else device)
    if is_bnb_4bit(read_config(path)):
        return load_bnb_4bit(path, dtype=parse_dtype(dtype), device=target)
    if not quantise:
        return AutoLigerForCausalLM.from_pretrained(path, dtype=dtype, device=device)
    model = AutoLigerForCausalLM.from_pretrained(path, dtype=dtype, device="cpu")
    quantize_base_(model, device=target)
    return model.to(target)


def _dense(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``tensors`` with each 4-bit linear's set (codes, scales, quant state) replaced by its dequantised weight in the
    quant state's dtype."""
    suffix = ".weight." + QUANT_STATE_KEY
    out = dict(tensors)
    for name in [k[: -len(suffix)] for k in tensors if k.endswith(suffix)]:
        codes, absmax, state = from_bnb_tensors(tensors, name)
        for key in [k for k in out if k.startswith(f"{name}.weight.") or k == f"{name}.weight"]:
            del out[key]
        out[f"{name}.weight"] = dequantize_nf4_reference(codes, absmax, tuple(state["shape"]),
                                                         getattr(torch, state["dtype"]))
    return out


@torch.no_grad()
def save_bnb_4bit(model, directory: str | Path, double_quant: bool = True) -> None:
    """Write ``model`` as bitsandbytes + transformers save a 4-bit NF4 model: every decoder linear in NF4, the rest
    (mixture-of-experts stacks included: transformers' bitsandbytes path keeps them dense) as they are. A model
    already in NF4 (``quantize_base_``) is written as it is: each linear's own codes and fp32 block scales
    (``double_quant`` does not apply to them: quantising the scales again would re-round them), and NF4 expert stacks
    dequantised to the compute dtype, the weights the adapters trained against."""
    if lora_modules(model):
        raise ValueError("save_bnb_4bit writes the base: the model carries LoRA adapters (save them with "
                         "save_adapter, or merge them first)")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    linears = decoder_linears(model)
    double_quant = double_quant and not any(isinstance(lin, LoraLinear) and lin.quant is not None
                                            for lin in linears.values())
    for name, lin in linears.items():
        if isinstance(lin, LoraLinear) and lin.quant is not None:
            q = lin.quant
            tensors = bnb_tensors_of(q.codes, q.absmax, q.shape, q.dtype, double_quant=False)
        else:
            tensors = bnb_tensors(state.pop(f"{name}.weight"), double_quant)
        state.update({f"{name}.{suffix}": t.contiguous() for suffix, t in tensors.items()})
    for i, layer in enumerate(model.model.layers):
        experts = getattr(layer.mlp, "experts", None)
        if experts is not None and experts.nf4:
            dtype = model.dtype
            views = per_expert_tensors(experts.dense_stack("gate_up_proj", dtype), experts.dense_stack(
                "down_proj", dtype), f"model.layers.{i}.{layer._disk_block}.", layer._expert_names)
            state.update({k: v.clone().contiguous() for k, v in views.items()})
    wrapper = getattr(model, "checkpoint_wrapper", None)
    if wrapper is not None:  # the whole multimodal checkpoint: the rest of it as plain weights beside the decoder
        state = wrapper.stored_state(state)
    # Each file whole under a temporary name, then renamed into place (liger_models.atomic): a save killed midway
    # leaves the previous file.
    atomic.write_file(directory / "model.safetensors", lambda tmp: save_file(state, tmp, metadata={"format": "pt"}))
    dtype_name = str(model.dtype).removeprefix("torch.")
    quantization = {
        "quant_method": "bitsandbytes", "load_in_4bit": True, "load_in_8bit": False, "bnb_4bit_quant_type": "nf4",
        "bnb_4bit_use_double_quant": double_quant, "bnb_4bit_compute_dtype": dtype_name,
        "bnb_4bit_quant_storage": "uint8", "llm_int8_skip_modules": None, "llm_int8_threshold": 6.0,
        "llm_int8_has_fp16_weight": False, "llm_int8_enable_fp32_cpu_offload": False}
    if wrapper is None:
        config = model.config.to_hf() | {"quantization_config": quantization}
    else:  # transformers would quantise the vision tower's linears on load unless named here
        parts = {part for key in wrapper.carried for part in key.split(".") if part in OTHER_PARTS}
        quantization["llm_int8_skip_modules"] = sorted(parts) + ["lm_head"]
        config = wrapper.config_json(model.config.to_hf(), dtype_name, quantization)
    atomic.write_text(directory / "config.json", json.dumps(config, indent=2, sort_keys=True) + "\n")

"""The stable API (docs/api.md) keeps its promises: every pinned name still imports, every pinned signature still
accepts the calls it accepted (same positional order, same names, same defaults; new parameters only as optional
ones), and every pinned CLI option still exists. Adding is free; removing or changing needs a deliberate update of
tests/api_contract.json, docs/api.md and CHANGELOG.md (`python tests/test_api_contract.py --update` rewrites the
pins from the code)."""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import sys
from pathlib import Path

import pytest

CONTRACT = Path(__file__).with_name("api_contract.json")
FAMILIES = ("Llama", "Mistral", "Qwen2", "Qwen3", "Gemma", "Gemma2", "Gemma3", "Phi3", "Mixtral", "Qwen3Moe")
# The stable names, as "module:qualified.name" (a class pins its listed methods as "module:Class.method").
STABLE = [
    "liger_models:AutoLigerForCausalLM.from_pretrained", "liger_models:AutoLigerForCausalLM.from_hub",
    "liger_models:model_class", "liger_models:load_tokenizer", "liger_models:reference_mode",
    *(f"liger_models:Liger{f}ForCausalLM" for f in FAMILIES),
    *(f"liger_models:{f}Config" for f in FAMILIES if f != "Gemma3"), "liger_models:Gemma3TextConfig",
    *(f"liger_models.modules.causal_lm:LigerForCausalLM.{m}" for m in (
        "forward", "generate", "save_pretrained", "from_pretrained", "from_hub", "from_config",
        "resize_token_embeddings", "gradient_checkpointing_enable", "activation_checkpointing_enable",
        "num_parameters", "get_input_embeddings", "get_output_embeddings")),
    *(f"liger_models:Tokenizer.{m}" for m in ("__call__", "encode", "decode", "batch_decode",
                                                 "apply_chat_template")),
    "liger_models.medusa:MedusaModel.from_base", "liger_models.medusa:MedusaModel.from_pretrained",
    "liger_models.medusa:MedusaModel.save_pretrained", "liger_models.medusa:MedusaModel.forward",
    "liger_models.medusa:MedusaModel.generate", "liger_models.medusa:MedusaModel.param_groups",
    "liger_models.medusa:MedusaConfig", "liger_models.medusa:medusa_loss", "liger_models.medusa:medusa_head_weights",
    "liger_models.medusa:medusa_target_counts",
    *(f"liger_models.kernels:{name}" for name in (
        "rms_norm", "add_rms_norm", "RMSNorm", "layer_norm", "LayerNorm", "rope", "rope_packed", "qk_norm_rope",
        "swiglu", "swiglu_packed", "geglu", "geglu_packed", "gated_mlp", "gated_mlp_packed", "cross_entropy",
        "CrossEntropyLoss", "fused_linear_cross_entropy", "FusedLinearCrossEntropyLoss", "decode_attention",
        "softcap_attention",
        "adamw_step_")),
    "liger_models.train.optim:FusedAdamW", "liger_models.train.cuda_graph:GraphedStep",
    "liger_models.convert.native:native_to_hf", "liger_models.convert.medusa:save_vllm",
    "liger_models.convert.medusa:load_vllm",
    *(f"liger_models.recipes:{name}" for name in (
        "FinetuneConfig", "MedusaTrainingConfig", "GenerateConfig", "ChatConfig", "CalibrateConfig", "DemoConfig",
        "RunResult", "train_causal_lm", "train_medusa", "run_generate", "run_chat", "run_calibrate", "run_demo")),
]


def _resolve(target: str):
    module, qualname = target.split(":")
    obj = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def _parameters(obj) -> list[list]:
    """[name, kind, default] per parameter; a class pins its constructor."""
    signature = inspect.signature(obj.__init__ if inspect.isclass(obj) else obj)
    out = []
    for p in signature.parameters.values():
        if p.name in ("self", "cls"):
            continue
        default = None if p.default is inspect.Parameter.empty else repr(p.default)
        out.append([p.name, p.kind.name, default])
    return out


def _cli_options() -> dict[str, list[str]]:
    from liger_models.cli import build_parser

    parser = build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return {name: sorted(o for a in sub._actions for o in a.option_strings)
            for name, sub in sorted(commands.choices.items())}


def current() -> dict:
    return {"signatures": {t: _parameters(_resolve(t)) for t in STABLE}, "cli": _cli_options()}


def _compatible(pinned: list[list], now: list[list]) -> str | None:
    """Why ``now`` breaks a call that ``pinned`` accepted, or None."""
    by_name = {p[0]: p for p in now}
    positional = [p for p in now if p[1] in ("POSITIONAL_ONLY", "POSITIONAL_OR_KEYWORD")]
    for i, (name, kind, default) in enumerate(pinned):
        if kind in ("VAR_POSITIONAL", "VAR_KEYWORD"):
            if not any(p[1] == kind for p in now):
                return f"*{name} / **{name} was removed"
            continue
        if name not in by_name:
            return f"parameter {name!r} was removed or renamed"
        _, now_kind, now_default = by_name[name]
        if kind in ("POSITIONAL_ONLY", "POSITIONAL_OR_KEYWORD") and (
                i >= len(positional) or positional[i][0] != name):
            return f"parameter {name!r} moved from position {i}"
        if kind == "POSITIONAL_OR_KEYWORD" and now_kind == "KEYWORD_ONLY":
            return f"parameter {name!r} became keyword-only"
        if default != now_default:
            return f"parameter {name!r}'s default changed from {default} to {now_default}"
    added_required = [p[0] for p in now if p[2] is None and p[1] not in ("VAR_POSITIONAL", "VAR_KEYWORD")
                      and p[0] not in {q[0] for q in pinned}]
    if added_required:
        return f"new required parameters {added_required}"
    return None


@pytest.fixture(scope="module")
def contract() -> dict:
    return json.loads(CONTRACT.read_text())


def test_every_stable_name_is_pinned(contract):
    assert sorted(contract["signatures"]) == sorted(STABLE)


@pytest.mark.parametrize("target", STABLE)
def test_stable_signature_still_accepts_the_pinned_calls(contract, target):
    problem = _compatible(contract["signatures"][target], _parameters(_resolve(target)))
    assert problem is None, f"{target}: {problem} (update tests/api_contract.json, docs/api.md and CHANGELOG.md)"


def test_every_pinned_cli_option_still_exists(contract):
    now = _cli_options()
    for command, options in contract["cli"].items():
        assert command in now, f"liger-models {command} was removed"
        missing = sorted(set(options) - set(now[command]))
        assert not missing, f"liger-models {command} lost {missing}"


def test_the_compatibility_rule_catches_breaks():
    pinned = [["x", "POSITIONAL_OR_KEYWORD", None], ["n", "KEYWORD_ONLY", "1"]]
    assert _compatible(pinned, pinned + [["extra", "KEYWORD_ONLY", "None"]]) is None
    assert "removed" in _compatible(pinned, pinned[:1])
    assert "default" in _compatible(pinned, [pinned[0], ["n", "KEYWORD_ONLY", "2"]])
    assert "required" in _compatible(pinned, pinned + [["y", "KEYWORD_ONLY", None]])
    assert "position" in _compatible(pinned, [["w", "POSITIONAL_OR_KEYWORD", None], *pinned])


def _dump(contract: dict) -> str:
    """One line per pinned name or command, so a change reads as a one-line diff."""
    lines = []
    for section, entries in contract.items():
        body = ",\n".join(f"  {json.dumps(k)}: {json.dumps(v)}" for k, v in entries.items())
        lines.append(f"{json.dumps(section)}: {{\n{body}\n }}")
    return "{\n " + ",\n ".join(lines) + "\n}\n"


if __name__ == "__main__" and "--update" in sys.argv:
    CONTRACT.write_text(_dump(current()))
    print(f"wrote {CONTRACT}")

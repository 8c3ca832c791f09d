"""benchmarks/tools/vllm_lora_loader.py's save half (its load half needs vLLM, no test dependency): every adapter it
writes, read back as a PEFT reader reads it (the scale from r / lora_alpha / use_rslora and the patterns), gives
scale · B · A equal to the delta it records from merge_lora, module by module; an adapter on one layer changes that
layer's weights alone, and token-row adapters exactly their rows of the tables."""

import json
import math
import re
import sys
from pathlib import Path

from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks" / "tools"))
import vllm_lora_loader  # noqa: E402


def _scale(cfg: dict, module: str) -> float:
    def pattern(patterns: dict, default):
        return next((v for k, v in patterns.items() if re.match(rf"(.*\.)?({k})$", module)), default)

    r, alpha = pattern(cfg["rank_pattern"], cfg["r"]), pattern(cfg["alpha_pattern"], cfg["lora_alpha"])
    return alpha / math.sqrt(r) if cfg["use_rslora"] else alpha / r


def test_every_saved_adapter_reads_back_as_the_delta_merge_lora_adds(tmp_path):
    vllm_lora_loader.save(tmp_path)
    index = json.loads((tmp_path / "index.json").read_text())
    assert len(index) == 30 and {info["family"] for info in index.values()} == set(vllm_lora_loader.FAMILIES)
    checked = 0
    for name, info in index.items():
        directory = tmp_path / name
        cfg = json.loads((directory / "adapter_config.json").read_text())
        files, expected = load_file(str(directory / "adapter_model.safetensors")), load_file(
            str(directory / "expected.safetensors"))
        if cfg["use_dora"] or cfg["modules_to_save"]:
            continue  # their merge is not s·B·A alone (vLLM refuses both)
        if cfg.get("layers_to_transform"):  # only the named layers' weights change
            assert all(key.startswith(f"model.layers.{cfg['layers_to_transform'][0]}.") for key in expected), name
        for leaf, ids in (cfg.get("trainable_token_indices") or {}).items():  # exactly those rows change
            table = expected["model.embed_tokens.weight" if leaf == "embed_tokens" else "lm_head.weight"]
            assert table.abs().amax(dim=1).nonzero().flatten().tolist() == sorted(ids), (name, leaf)
        for key, a in files.items():
            if not key.endswith((".lora_A.weight", ".lora_embedding_A")) or ".experts" in key:
                continue  # the stacked experts' deltas sit under per-expert names (the tool checks them load as-is)
            module = key.removeprefix("base_model.model.").rsplit(".lora_", 1)[0]
            b = files[key.replace("lora_A", "lora_B").replace("lora_embedding_A", "lora_embedding_B")]
            delta = _scale(cfg, module) * (b.double() @ a.double())
            if "embedding" in key:
                delta = delta.t()
            weight = f"{module}.weight"
            if weight not in expected:  # Mixtral's router: ….block_sparse_moe.gate in its checkpoints
                weight = weight.replace(".mlp.gate", ".block_sparse_moe.gate")
            ours = expected[weight]
            assert (delta - ours).abs().max() <= 1e-6 * ours.abs().max(), (name, module)
            checked += 1
    assert checked > 300

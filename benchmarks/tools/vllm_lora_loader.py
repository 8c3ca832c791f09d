"""vLLM's LoRA loader on adapters this project saves, on the CPU.

vLLM is no test dependency (its wheel is 336 MB and its dependencies gigabytes more: past what CI installs in its
time, and past what a device call may carry), so this check runs by hand, in two environments:

    python benchmarks/tools/vllm_lora_loader.py save DIR             # this project's environment
    python benchmarks/tools/vllm_lora_loader.py load DIR --out F     # an environment where `pip install vllm` ran

``save`` builds a tiny random model of every family with LoRA on every linear of the decoder (nonzero B), on the
embeddings and lm_head where the family leaves them untied, rsLoRA and a rank_pattern on some, and writes each
adapter with ``save_adapter``, beside ``expected.safetensors``: per adapted module the weight delta that this project
applies, W_merged − W (``merge_lora``; the embedding table's as [vocab, hidden]). Also written: a DoRA adapter, one
with ``modules_to_save``, one on decoder layer 1 only (PEFT's ``layers_to_transform``), and two with trainable-token
rows (PEFT's ``trainable_token_indices``: on both untied tables, and on a tied one).

``load`` reads every adapter with vLLM's own ``PEFTHelper.from_local_dir`` and ``LoRAModel.from_local_checkpoint``
(device cpu, fp32), with the module names vLLM's model classes accept for these families (their linears, packed
q|k|v and gate|up listed by their parts, as its model manager expands them; the embeddings; a mixture-of-experts
block's ``experts`` and router ``gate``), and checks, per module vLLM loaded, that scaling · B · A (vLLM's delta: y
+= scaling · (x Aᵀ) Bᵀ; the embedding's (scaling · B · A)ᵀ) equals this project's delta. The experts' stacked
adapters are checked to load unchanged (their delta is applied by vLLM's fused-MoE layer, which needs a GPU). The
DoRA, ``modules_to_save`` and token-row adapters must be refused by vLLM (it can apply none of them), with its
message recorded. vLLM's log-probabilities with such adapters: vllm_lora_logits.py.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

FAMILIES = ["llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3", "phi3", "mixtral", "qwen3_moe"]
# The module names vLLM's model classes take adapters on, as its model manager lists them (packed modules by their
# parts); Phi-3's q|k|v and gate|up are single linears in HF and in PEFT's files.
VLLM_MODULES = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "qkv_proj",
                "gate_up_proj", "embed_tokens", "lm_head", "experts", "gate"}


def model_of(family: str, **sizes):
    """A random model of ``family`` at its config's tiny() sizes (``sizes`` override them), heads untied where the
    family allows it."""
    import torch

    import liger_models as lm

    classes = {"llama": lm.LigerLlamaForCausalLM, "mistral": lm.LigerMistralForCausalLM,
               "qwen2": lm.LigerQwen2ForCausalLM, "qwen3": lm.LigerQwen3ForCausalLM,
               "gemma": lm.LigerGemmaForCausalLM, "gemma2": lm.LigerGemma2ForCausalLM,
               "gemma3": lm.LigerGemma3ForCausalLM, "phi3": lm.LigerPhi3ForCausalLM,
               "mixtral": lm.LigerMixtralForCausalLM, "qwen3_moe": lm.LigerQwen3MoeForCausalLM}
    cls = classes[family]
    overrides = {}
    if family in ("llama", "mistral", "qwen2", "qwen3", "phi3", "mixtral", "qwen3_moe"):
        overrides["tie_word_embeddings"] = False
    model = cls(cls.config_class.tiny(**overrides, **sizes))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.05)
    return model


def _cases(family: str) -> list[tuple[str, dict]]:
    """(adapter name, LoraSettings fields) for one family."""
    moe = family in ("mixtral", "qwen3_moe")
    tied = family in ("gemma", "gemma2", "gemma3")
    linears = dict(r=8, alpha=16.0, targets="all-linear",
                   target_parameters=["experts.gate_up_proj", "experts.down_proj"] if moe else [])
    cases = [(f"{family}-all-linear", linears),
             (f"{family}-rslora-rank-pattern", dict(linears, r=4, alpha=8.0, use_rslora=True,
                                                    rank_pattern={"o_proj": 2}, alpha_pattern={"o_proj": 3.0}))]
    if not tied and not moe:
        attention = "qkv_proj" if family == "phi3" else "q_proj"
        cases.append((f"{family}-with-embeddings", dict(r=4, alpha=8.0,
                                                        targets=[attention, "down_proj", "embed_tokens", "lm_head"])))
    if family == "llama":
        cases.append(("llama-dora", dict(r=4, alpha=8.0, targets="all-linear", use_dora=True)))
        cases.append(("llama-modules-to-save", dict(r=4, alpha=8.0, targets="all-linear",
                                                    modules_to_save=["lm_head"])))
        # PEFT's layers_to_transform: adapters in decoder layer 1 only
        cases.append(("llama-layers-to-transform", dict(r=4, alpha=8.0, targets="all-linear",
                                                        layers_to_transform=[1])))
        # PEFT's trainable_token_indices: rows of both untied tables beside the adapters
        cases.append(("llama-token-rows", dict(r=4, alpha=8.0, targets="all-linear",
                                               trainable_token_indices={"embed_tokens": [3, 5],
                                                                        "lm_head": [5, 7]})))
    if family == "gemma":  # the tied table's rows, which the head shares
        cases.append(("gemma-token-rows", dict(r=4, alpha=8.0, targets="all-linear",
                                               trainable_token_indices=[3, 5])))
    return cases


def save(root: Path) -> None:
    import torch
    from safetensors.torch import save_file

    from liger_models.lora import LoraSettings, add_lora, merge_lora, save_adapter

    root.mkdir(parents=True, exist_ok=True)
    index = {}
    for family in FAMILIES:
        for name, fields in _cases(family):
            torch.manual_seed(len(index))
            model = model_of(family)
            add_lora(model, LoraSettings(**fields))
            with torch.no_grad():  # B starts at zero (and the embedding's A): random, so every delta is nonzero
                for pname, p in model.named_parameters():
                    if p.requires_grad and ("lora_" in pname or "lora" in pname.split(".")[-1]):
                        p.normal_(0.0, 0.1)
                    if pname.endswith("trainable_tokens_delta"):  # token rows start as the table's: moved off
                        p.add_(torch.randn_like(p))
            directory = save_adapter(model, root / name)
            before = {k: v.detach().clone() for k, v in model.state_dict().items()}
            merge_lora(model)
            after = model.state_dict()
            deltas = {k: (after[k].double() - before[k].double()).contiguous() for k in before
                      if k in after and after[k].shape == before[k].shape and not torch.equal(after[k], before[k])}
            save_file(deltas, str(directory / "expected.safetensors"))
            index[name] = dict(family=family, settings=dict(fields), deltas=sorted(deltas))
    (root / "index.json").write_text(json.dumps(index, indent=1, default=str) + "\n")
    print(f"{len(index)} adapters in {root}")


VLLM_CLASSES = {"llama": "llama.LlamaForCausalLM", "mistral": "mistral.MistralForCausalLM",
                "qwen2": "qwen2.Qwen2ForCausalLM", "qwen3": "qwen3.Qwen3ForCausalLM", "gemma": "gemma.GemmaForCausalLM",
                "gemma2": "gemma2.Gemma2ForCausalLM", "gemma3": "gemma3.Gemma3ForCausalLM",
                "phi3": "phi3.Phi3ForCausalLM", "mixtral": "mixtral.MixtralForCausalLM",
                "qwen3_moe": "qwen3_moe.Qwen3MoeForCausalLM"}


def _renames(family: str):
    """The name mapper vLLM's worker hands its LoRA loader for this family's model class (its hf_to_vllm_mapper's
    renames), or None."""
    import importlib

    module, cls = VLLM_CLASSES[family].split(".")
    mapper = getattr(getattr(importlib.import_module(f"vllm.model_executor.models.{module}"), cls),
                     "hf_to_vllm_mapper", None)
    return None if mapper is None else mapper.get_rename_mapper()


def _delta(lora, name: str):
    """vLLM's weight delta for one loaded module, in float64, HF's weight layout."""
    a, b = lora.lora_a.double(), lora.lora_b.double()
    delta = lora.scaling * (b @ a)
    return delta.t() if name.endswith("embed_tokens") else delta


def load(root: Path, out: Path | None) -> int:
    import torch
    import vllm
    from safetensors.torch import load_file
    from vllm.lora import lora_model
    from vllm.lora.lora_model import LoRAModel
    from vllm.lora.peft_helper import PEFTHelper

    # vLLM's CUDA build decides that host memory can be pinned whatever the machine has; on one without a driver,
    # pinning fails. The loader's tensors are then left unpinned, which changes no value.
    lora_model.PIN_MEMORY = False

    index = json.loads((root / "index.json").read_text())
    report, failures = {"vllm": vllm.__version__, "torch": torch.__version__, "adapters": {}}, 0
    for name, info in index.items():
        directory = root / name
        row = report["adapters"][name] = {}
        try:
            helper = PEFTHelper.from_local_dir(str(directory), max_position_embeddings=256)
            loaded = LoRAModel.from_local_checkpoint(str(directory), VLLM_MODULES, helper, device="cpu",
                                                     dtype=torch.float32, lora_model_id=1,
                                                     weights_mapper=_renames(info["family"]))
        except Exception as exc:  # noqa: BLE001 - a refusal is the expected outcome for some adapters
            row["refused"] = f"{type(exc).__name__}: {exc}"[:400]
            expected_refusal = name.endswith(("-dora", "-modules-to-save", "-token-rows"))
            row["ok"] = expected_refusal
            failures += not expected_refusal
            continue
        expected = load_file(str(directory / "expected.safetensors"))
        files = load_file(str(directory / "adapter_model.safetensors"))
        checked, worst = 0, 0.0
        problems = []
        for module, lora in loaded.loras.items():
            if ".experts" in module:  # stacked experts: loaded unchanged (their delta is vLLM's fused-MoE layer's)
                if info["family"] == "mixtral" and ".mlp.experts" in module:
                    problems.append(f"{module}: vLLM's Mixtral names this block block_sparse_moe, this name "
                                    "(transformers v5's and PEFT's) matches no module of it, so vLLM leaves this "
                                    "adapter unapplied")
                for part, tensor in (("lora_A", lora.lora_a), ("lora_B", lora.lora_b)):
                    key = next((k for k in files if k.endswith(f"{module}.{part}.weight")), None)
                    if key is None or not torch.equal(files[key].float(), tensor):
                        problems.append(f"{module}.{part} differs from the file")
                checked += 1
                continue
            key = f"{module}.weight"
            if key not in expected and ".mlp.gate" in module:  # Mixtral's router: ….block_sparse_moe.gate on disk
                key = key.replace(".mlp.gate", ".block_sparse_moe.gate")
                problems.append(f"{module}: vLLM's Mixtral names this block block_sparse_moe, this name (transformers "
                                "v5's and PEFT's) matches no module of it, so vLLM leaves this adapter unapplied")
            if key not in expected:
                problems.append(f"{module}: vLLM loaded it, this project's merge changed no {key}")
                continue
            ours = expected[key]
            err = ((_delta(lora, module) - ours).abs().max() / ours.abs().max().clamp_min(1e-30)).item()
            worst = max(worst, err)
            checked += 1
            if err > 1e-6:
                problems.append(f"{module}: relative error {err:.2e}")
        missing = sorted({k.rsplit(".weight", 1)[0] for k in expected} - set(loaded.loras))
        # The experts' deltas are under HF's per-expert names (….experts.{e}.w1 / gate_proj …), vLLM's module is the
        # stack (checked above)
        missing = [m for m in missing if ".experts." not in m
                   and m.replace(".block_sparse_moe.gate", ".mlp.gate") not in loaded.loras]
        if missing:
            problems.append(f"modules this project adapts that vLLM did not load: {missing}")
        row.update(modules=checked, worst_relative_error=worst, problems=problems, ok=not problems)
        failures += bool(problems)
    text = json.dumps(report, indent=1)
    if out:
        out.write_text(text + "\n")
    print(text)
    print(f"{len(index) - failures} of {len(index)} as expected")
    return int(failures > 0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("step", choices=["save", "load"])
    p.add_argument("dir", type=Path)
    p.add_argument("--out", type=Path, help="load: write the report (JSON) here too")
    args = p.parse_args()
    if args.step == "save":
        save(args.dir)
    else:
        sys.exit(load(args.dir, args.out))


if __name__ == "__main__":
    main()

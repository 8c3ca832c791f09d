"""Training machinery, composed into the `liger-models` recipes by liger_models/recipes.

dataset.py (data files → packed windows, cached: data_cache.py) · packing.py (windows, position ids, labels) ·
batches.py (a resumable, seeded batch stream) · data.py (the data pipeline's names in one import) · optim.py
(FusedAdamW: AdamW in one Triton pass per parameter; warmup + cosine) · trainer.py (the loop: global normaliser,
metrics, checkpoints) · checkpointing.py (atomic save, checksum manifest, exact resume) · run_settings.py (what a
resume must not change) · run_dir.py (one run per output directory) · interrupt.py (a signal stops a run at a
checkpoint) · disk_space.py (a full disk in one line) · distributed.py (torchrun, FSDP2, activation checkpointing) ·
evaluate.py (held-out loss / head accuracy) · step_in_backward.py (optimizer step in backward, or in the forward for
linear-CE weights) · cuda_graph.py (a whole step replayed from a CUDA graph) · init_model.py (a random-init model
and tokenizer).
"""

"""Recipes: each ``liger-models`` command as a function of its config (configs.py), composing the model families,
Medusa and the training machinery (liger_models.train). cli.py parses flags into these configs and prints.

configs.py (every recipe's settings, validated) · training.py (what the training recipes share) · finetune.py
(``train``) · medusa.py (``train-medusa``) · decoding.py (``generate``, ``calibrate-tree``) · chat.py (``chat``) ·
demo.py (``demo``).
"""

from liger_models.recipes.configs import (CalibrateConfig, ChatConfig, DecodingConfig, DemoConfig, FinetuneConfig,
                                          GenerateConfig, MedusaTrainingConfig)
from liger_models.recipes.chat import run_chat
from liger_models.recipes.decoding import run_calibrate, run_generate
from liger_models.recipes.demo import run_demo
from liger_models.recipes.finetune import train_causal_lm
from liger_models.recipes.medusa import train_medusa
from liger_models.recipes.training import RunResult

__all__ = ["CalibrateConfig", "ChatConfig", "DecodingConfig", "DemoConfig", "FinetuneConfig", "GenerateConfig",
           "MedusaTrainingConfig", "RunResult", "run_calibrate", "run_chat", "run_demo", "run_generate",
           "train_causal_lm", "train_medusa"]

"""``liger-models train``: fine-tune (or pre-train) a causal LM on packed text and chat data.

The pieces and their order are training.py's; a checkpoint is an HF model directory with ``--model``'s tokenizer
files (chat templates included) and generation_config.json copied in, so it loads, decodes and trains further as
the model it came from. With ``lora_r`` only adapters train (liger_models.lora) and a checkpoint is a PEFT adapter
directory instead; the base always comes from ``model``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from liger_models.hub import resolve_model
from liger_models.lora import save_adapter
from liger_models.recipes import training as T
from liger_models.recipes.configs import FinetuneConfig
from liger_models.recipes.lora import attach, load_base, lora_settings, quantises_as_it_loads
from liger_models.train.optim import decay_param_groups
from liger_models.train.trainer import CausalLMTask


def train_causal_lm(config: FinetuneConfig | argparse.Namespace) -> T.RunResult:
    """Fine-tune (or pre-train) a causal LM on ``config.data``; see the module docstring. A parsed command line
    (cli.build_parser) is taken too, as its config."""
    config = FinetuneConfig.coerce(config)
    config.validate()

    def run() -> T.RunResult:
        info, resume = T.setup(config)
        model_dir = resolve_model(config.model)
        settings = T.settings(config, info, model_dir, resume, config.peak_lr())
        lora = lora_settings(config)
        # A LoRA checkpoint holds the adapters only: the base always comes from --model.
        source = model_dir if lora is not None else (resume or model_dir)
        model = load_base(source, T.dtype_of(config, info.device), info.device, lora,
                          quantise=quantises_as_it_loads(config.qlora, info.world_size))
        if lora is not None:
            attach(model, lora, config.qlora, resume)
        stream, eval_data = T.data(config, model_dir, model.config.vocab_size, info)
        T.prepare(model, model.model.layers, config, info)
        groups = decay_param_groups(model, config.peak_lr(), config.weight_decay)

        def export(directory: Path, full_state: dict | None, final: Path) -> None:
            target = model if full_state is None else T.shadow_base(model, full_state)
            if full_state is not None:
                T.check_materialised(target)
            if lora is not None:  # a PEFT adapter directory (HF + PEFT loads it onto --model)
                save_adapter(target, directory, base_model=T.base_name(config.model))
            else:
                target.save_pretrained(directory)
            T.copy_tokenizer(model_dir, directory)

        return T.finish(config, info, model, CausalLMTask(), (stream, eval_data), groups, export, resume, settings)

    return T.in_process_group(run, config)

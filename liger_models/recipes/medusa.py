"""``liger-models train-medusa``: Medusa heads on a causal LM, stage 1 (frozen base, heads only) or stage 2 (heads
and base together, the base loss on, the heads at ``head_lr_multiplier`` × the LR).

The pieces and their order are training.py's. A stage-1 checkpoint is a heads directory in the Medusa/TGI format
whose ``base_model_name_or_path`` is ``--model`` (its tokenizer files beside it); a stage-2 checkpoint holds the
trained base plus the heads. Stage 2 with ``lora_r`` trains the base through LoRA adapters (on an NF4 base with
``qlora``), as the Medusa-2 recipe does: its checkpoint is the heads directory plus the adapter in PEFT's format,
both of ``--model``, which MedusaModel.from_pretrained (and so ``liger-models generate --medusa``) attaches again.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from liger_models.hub import resolve_model
from liger_models.medusa import MedusaHeads, MedusaModel
from liger_models.recipes import training as T
from liger_models.recipes.configs import MedusaTrainingConfig
from liger_models.recipes.lora import attach, load_base, lora_settings, quantises_as_it_loads
from liger_models.train.trainer import MedusaTask


def _medusa_model(config: MedusaTrainingConfig, model_dir: Path, dtype, device, resume: Path | None,
                  lora, world_size: int) -> MedusaModel:
    def with_this_runs_loss(medusa):
        # The loss settings are this run's (stage 2 usually changes the schedule), not the saved heads', whether the
        # heads come from --init-heads or from the checkpoint being resumed (which saved the same settings). So is
        # the base that stage-1 heads name: the one they are trained on, --model.
        medusa.config.heads_coefficient, medusa.config.decay_coefficient = config.lambda0, config.decay
        medusa.config.scheduler, medusa.config.base_loss_weight = config.schedule, config.base_loss_weight
        if config.stage == 1:
            medusa.config.base_model_name_or_path = T.base_name(config.model)
        return medusa

    # The head-shape options given (None: not given); fresh heads take MedusaConfig's defaults for the others.
    shape = {k: v for k, v in (("num_heads", config.num_heads), ("num_layers", config.num_layers),
                               ("share_lm_head", config.share_lm_head)) if v is not None}

    def loaded(medusa, flag: str, directory):
        # The heads' shape is the file's: a shape option given that disagrees would be ignored without a word.
        for name, given in shape.items():
            value = getattr(medusa.config, name)
            if given != value:
                option = "--" + name.replace("_", "-")
                shown = option if isinstance(given, bool) else f"{option} {given}"
                raise ValueError(f"{shown} disagrees with the heads of {flag} {directory} ({name}: {value}); "
                                 f"drop it, or train new heads without {flag}")
        return with_this_runs_loss(medusa)

    if resume is not None and config.stage == 2 and lora is None:
        medusa = MedusaModel.from_pretrained(str(resume), dtype=dtype, device=device, stage=2, load_tree=False)
        return loaded(medusa, "--resume", resume)
    # Stage 1 trains heads on a frozen base, so a bitsandbytes 4-bit --model serves as it is; stage 2 trains it
    # through adapters only.
    base = load_base(model_dir, dtype, device, lora, trains_base=config.stage == 2,
                     quantise=quantises_as_it_loads(config.qlora, world_size))
    if lora is not None:  # adapters on --model's base, as the checkpoint being resumed saved them
        attach(base, lora, config.qlora, resume)
    heads_dir = resume or config.init_heads
    if heads_dir is not None:
        medusa = MedusaModel.from_pretrained(str(heads_dir), base=base, dtype=dtype, device=device,
                                             stage=config.stage, load_tree=False)
        return loaded(medusa, "--resume" if resume else "--init-heads", heads_dir)
    return MedusaModel.from_base(
        base, stage=config.stage, **shape, base_model_name_or_path=T.base_name(config.model),
        heads_coefficient=config.lambda0, decay_coefficient=config.decay, scheduler=config.schedule,
        base_loss_weight=config.base_loss_weight,
    )


def train_medusa(config: MedusaTrainingConfig | argparse.Namespace) -> T.RunResult:
    """Train Medusa heads (stage 1: frozen base) or heads + base (stage 2); see the module docstring. A parsed
    command line (cli.build_parser) is taken too, as its config."""
    config = MedusaTrainingConfig.coerce(config)
    config.validate()

    def run() -> T.RunResult:
        info, resume = T.setup(config)
        model_dir = resolve_model(config.model)
        lr = config.peak_lr()
        settings = T.settings(config, info, model_dir, resume, lr)
        lora = lora_settings(config)
        medusa = _medusa_model(config, model_dir, T.dtype_of(config, info.device), info.device, resume, lora,
                               info.world_size)
        stream, eval_data = T.data(config, model_dir, medusa.config.vocab_size, info)
        T.prepare(medusa, medusa.base.model.layers, config, info, more_units=medusa.heads)
        # --weight-decay is on matrices only, as for the causal LM: not on the heads' biases nor the base's norms.
        groups = medusa.param_groups(lr, config.head_lr_multiplier, config.weight_decay)  # no decay on 1-D

        def export(directory: Path, full_state: dict | None, final: Path) -> None:
            target = medusa
            if full_state is not None:
                base = T.shadow_base(medusa.base, full_state, prefix="base.")
                heads = MedusaHeads(medusa.config, base.lm_head, device="meta")
                heads.load_state_dict({k[len("heads."):]: v for k, v in full_state.items()
                                       if k.startswith("heads.")}, strict=True, assign=True)
                target = MedusaModel(base, heads, stage=medusa.stage)
                T.check_materialised(target.heads)
                if medusa.stage == 2:  # the whole base, or its adapters
                    T.check_materialised(target.base)
            target.save_pretrained(str(directory), location=str(final))
            T.copy_tokenizer(model_dir, directory)

        task = MedusaTask(medusa.config.num_heads)
        return T.finish(config, info, medusa, task, (stream, eval_data), groups, export, resume, settings)

    return T.in_process_group(run, config)

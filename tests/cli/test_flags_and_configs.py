"""Each command's flags map one to one onto its recipe config (liger_models/recipes/configs.py): the config built
from a command line with only the required flags is the config a Python caller builds with only the required fields,
so the CLI's defaults are the configs' defaults."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from liger_models.cli import build_parser
from liger_models.recipes import (CalibrateConfig, ChatConfig, DemoConfig, FinetuneConfig, GenerateConfig,
                                  MedusaTrainingConfig)

REQUIRED = [
    (["train", "--model", "m", "--data", "d.txt"], FinetuneConfig, dict(model="m", data=["d.txt"])),
    (["train-medusa", "--model", "m", "--data", "d.txt"], MedusaTrainingConfig, dict(model="m", data=["d.txt"])),
    (["generate", "--prompt", "hi"], GenerateConfig, dict(prompt=["hi"])),
    (["chat"], ChatConfig, {}),
    (["calibrate-tree", "--medusa", "h", "--data", "d.txt"], CalibrateConfig, dict(medusa="h", data=["d.txt"])),
    (["demo"], DemoConfig, {}),
]


@pytest.mark.parametrize("argv, config, fields", REQUIRED, ids=[r[0][0] for r in REQUIRED])
def test_flag_defaults_are_the_config_defaults(argv, config, fields):
    assert config.from_args(build_parser().parse_args(argv)) == config(**fields)


def test_every_config_field_is_a_flag():
    """A field without a flag would be a setting only Python callers can reach."""
    for argv, config, _ in REQUIRED:
        parsed = vars(build_parser().parse_args(argv))
        missing = [f.name for f in dataclasses.fields(config) if f.name not in parsed]
        assert not missing, f"{argv[0]}: fields without a flag: {missing}"


def test_a_flag_without_a_field_is_refused():
    args = build_parser().parse_args(["train", "--model", "m", "--data", "d.txt"])
    with pytest.raises(TypeError, match="not_a_field"):
        FinetuneConfig.from_args(argparse.Namespace(**vars(args), not_a_field=1))


def test_configs_are_keyword_only_and_frozen():
    with pytest.raises(TypeError):
        FinetuneConfig("m", ["d.txt"])
    config = FinetuneConfig(model="m", data=["d.txt"])
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.lr = 1.0
    assert dataclasses.replace(config, lr=1e-4).lr == 1e-4


def test_a_recipe_refuses_another_recipes_config():
    from liger_models.recipes import train_medusa

    with pytest.raises(TypeError, match="expected a MedusaTrainingConfig, got FinetuneConfig"):
        train_medusa(FinetuneConfig(model="m", data=["d.txt"]))


@pytest.mark.parametrize("fields, expected", [
    (dict(), 2e-5), (dict(lora_r=8), 2e-4), (dict(lora_r=8, lr=3e-5), 3e-5), (dict(lr=1e-3), 1e-3),
])
def test_the_default_learning_rate_is_higher_for_lora_adapters(fields, expected):
    """Adapters start at zero and train at ~2e-4 (QLoRA's recipe): the whole model's 2e-5 would barely move them."""
    assert FinetuneConfig(model="m", data=["d.txt"], **fields).peak_lr() == expected
    argv = [f"--{k.replace('_', '-')}={v}" for k, v in fields.items()]
    args = build_parser().parse_args(["train", "--model", "m", "--data", "d.txt", *argv])
    assert FinetuneConfig.from_args(args).peak_lr() == expected


@pytest.mark.parametrize("stage, fields, expected", [
    (1, dict(), 2.5e-4), (2, dict(), 2e-5), (2, dict(lora_r=8), 2e-4), (2, dict(lr=1e-5, lora_r=8), 1e-5),
    (1, dict(lr=1e-3), 1e-3),
])
def test_medusa_default_learning_rates(stage, fields, expected):
    assert MedusaTrainingConfig(model="m", data=["d.txt"], stage=stage, **fields).peak_lr() == expected

"""The CLI on tiny Qwen3, Mixtral and Qwen3-MoE directories: `train`, `generate` from the trained checkpoint, then
`train-medusa` heads on it and `generate --medusa` (the commands pick the family from config.json through
AutoLigerForCausalLM)."""

from __future__ import annotations

import pytest

from liger_models import (AutoLigerForCausalLM, LigerMixtralForCausalLM, LigerQwen3ForCausalLM,
                          LigerQwen3MoeForCausalLM, MixtralConfig, Qwen3Config, Qwen3MoeConfig)
from liger_models.cli import main
from liger_models.text.bpe import save_tokenizer, train_bpe_tokenizer
from tests.helpers import EOS, shakespeare

pytestmark = pytest.mark.usefixtures("reference_path")

FAMILIES = {"qwen3": (LigerQwen3ForCausalLM, Qwen3Config), "mixtral": (LigerMixtralForCausalLM, MixtralConfig),
            "qwen3_moe": (LigerQwen3MoeForCausalLM, Qwen3MoeConfig)}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_train_then_generate(family, text_file, tmp_path, capsys):
    cls, config_cls = FAMILIES[family]
    tokenizer = train_bpe_tokenizer(shakespeare(30_000).splitlines(), vocab_size=300, eos_token=EOS)
    config = config_cls.tiny(vocab_size=tokenizer.get_vocab_size(), bos_token_id=None,
                             eos_token_id=tokenizer.token_to_id(EOS), pad_token_id=None)
    model_dir = tmp_path / "model"
    cls.from_config(config).save_pretrained(model_dir)
    save_tokenizer(tokenizer, model_dir, eos_token=EOS)
    assert main(["train", "--model", str(model_dir), "--data", str(text_file), "--output-dir", str(tmp_path / "run"),
                 "--seq-len", "32", "--batch-size", "2", "--max-steps", "2", "--save-every", "2", "--quiet"]) == 0
    checkpoint = tmp_path / "run" / "checkpoints" / "step_000002"
    assert type(AutoLigerForCausalLM.from_pretrained(checkpoint)) is cls
    capsys.readouterr()
    # A random tiny model may well say end-of-sequence first: --min-new-tokens keeps four to show.
    assert main(["generate", "--device", "cpu", "--model", str(checkpoint), "--prompt", "Now is the",
                 "--max-new-tokens", "4", "--min-new-tokens", "4"]) == 0
    out, err = capsys.readouterr()
    assert "4 new tokens" in err and out.removesuffix("\n")
    # Medusa heads on top (stage 1: the base frozen), then speculative generation with them.
    assert main(["train-medusa", "--model", str(checkpoint), "--data", str(text_file), "--num-heads", "2",
                 "--output-dir", str(tmp_path / "medusa"), "--seq-len", "32", "--batch-size", "2", "--max-steps",
                 "2", "--save-every", "2", "--quiet"]) == 0
    heads = tmp_path / "medusa" / "checkpoints" / "step_000002"
    capsys.readouterr()
    assert main(["generate", "--device", "cpu", "--model", str(checkpoint), "--medusa", str(heads), "--prompt",
                 "Now is the", "--max-new-tokens", "6", "--compare"]) == 0
    out, err = capsys.readouterr()
    assert "identical tokens: True" in err

"""The CLI on tiny local Gemma 2 and Gemma 3 checkpoints: a few training steps, then greedy generation equal to the
library's (the families' numerics are tested against transformers in tests/models)."""

from __future__ import annotations

import pytest
import torch

from liger_models import AutoLigerForCausalLM, Gemma2Config, Gemma3TextConfig, LigerGemma2ForCausalLM
from liger_models import LigerGemma3ForCausalLM
from liger_models.cli import main
from liger_models.hub import load_tokenizer
from liger_models.text.bpe import save_tokenizer, train_bpe_tokenizer
from tests.helpers import EOS, shakespeare

pytestmark = pytest.mark.usefixtures("reference_path")

FAMILIES = {"gemma2": (Gemma2Config, LigerGemma2ForCausalLM), "gemma3_text": (Gemma3TextConfig, LigerGemma3ForCausalLM)}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_train_then_generate(family, text_file, tmp_path, capsys):
    config_cls, model_cls = FAMILIES[family]
    tokenizer = train_bpe_tokenizer(shakespeare(30_000).splitlines(), vocab_size=300, eos_token=EOS)
    config = config_cls.tiny(vocab_size=tokenizer.get_vocab_size(), bos_token_id=None, pad_token_id=None,
                             eos_token_id=tokenizer.token_to_id(EOS))
    model_dir = tmp_path / "model"
    model_cls.from_config(config).save_pretrained(model_dir)
    save_tokenizer(tokenizer, model_dir, eos_token=EOS)

    assert main(["train", "--model", str(model_dir), "--data", str(text_file), "--output-dir", str(tmp_path / "lm"),
                 "--seq-len", "16", "--batch-size", "2", "--max-steps", "2", "--dtype", "fp32", "--device", "cpu",
                 "--quiet"]) == 0
    checkpoint = tmp_path / "lm" / "checkpoints" / "step_000002"
    trained = AutoLigerForCausalLM.from_pretrained(checkpoint)
    assert type(trained) is model_cls and trained.config.layer_types == config.layer_types
    capsys.readouterr()

    assert main(["generate", "--device", "cpu", "--model", str(checkpoint), "--prompt", "ROMEO:",
                 "--max-new-tokens", "6", "--greedy"]) == 0
    ids = torch.tensor([load_tokenizer(checkpoint).encode("ROMEO:").ids])
    new = trained.generate(ids, 6, do_sample=False)[0, ids.shape[1]:].tolist()
    assert capsys.readouterr().out == load_tokenizer(checkpoint).decode(new, skip_special_tokens=True) + "\n"

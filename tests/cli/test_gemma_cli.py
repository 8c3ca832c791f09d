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


def test_multimodal_gemma3_trains_its_decoder_with_lora_and_merges_back_whole(text_file, tmp_path):
    """A Gemma 3 4B-27B-style checkpoint (Gemma3ForConditionalGeneration, model_type gemma3): `train --lora-r` trains
    the text decoder's adapters, and `merge-lora` writes the whole multimodal checkpoint, vision tower unchanged,
    that transformers loads with the adapted decoder's logits."""
    import transformers
    from safetensors.torch import load_file

    from liger_models.lora import load_adapter
    from tests.models.parity import build_gemma3_multimodal, float64_reference, max_rel

    peft = pytest.importorskip("peft")

    tokenizer = train_bpe_tokenizer(shakespeare(30_000).splitlines(), vocab_size=300, eos_token=EOS)
    hf = build_gemma3_multimodal(vocab=tokenizer.get_vocab_size() + 3, eos_token_id=tokenizer.token_to_id(EOS),
                                 bos_token_id=None, pad_token_id=None)
    base = tmp_path / "gemma-3-mm"
    hf.save_pretrained(base)
    save_tokenizer(tokenizer, base, eos_token=EOS)
    assert main(["train", "--model", str(base), "--data", str(text_file), "--output-dir", str(tmp_path / "run"),
                 "--seq-len", "16", "--batch-size", "2", "--max-steps", "2", "--lr", "1e-2", "--dtype", "fp32",
                 "--device", "cpu", "--quiet", "--lora-r", "4", "--lora-alpha", "8"]) == 0
    adapter = tmp_path / "run" / "checkpoints" / "step_000002"
    assert main(["merge-lora", "--adapter", str(adapter), "--out", str(tmp_path / "merged"), "--dtype", "fp32"]) == 0

    before = load_file(str(base / "model.safetensors"))
    after = load_file(str(tmp_path / "merged" / "model.safetensors"))
    assert set(after) == set(before)
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed and all(k.startswith("language_model.model.layers.") for k in changed)
    ours = AutoLigerForCausalLM.from_pretrained(base, dtype=torch.float32)
    load_adapter(ours, adapter)
    exact = peft.PeftModel.from_pretrained(float64_reference(hf), adapter).eval()  # transformers + PEFT, float64
    merged = transformers.Gemma3ForConditionalGeneration.from_pretrained(tmp_path / "merged", dtype=torch.float32)
    ids = torch.randint(3, tokenizer.get_vocab_size(), (2, 12))
    with torch.no_grad():  # the merged file as close to float64 as the adapted model is (twice that, or 1e-5)
        truth = exact(input_ids=ids).logits
        bound = max(2 * max_rel(ours.eval()(ids).logits.double(), truth), 1e-5)
        assert max_rel(merged.eval()(input_ids=ids).logits.double(), truth) <= bound

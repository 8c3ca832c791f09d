"""``liger_models.load_tokenizer`` called as transformers' users call a tokenizer, against transformers.AutoTokenizer
on the same files (a BPE tokenizer with a ChatML-style template, saved the way transformers v5 saves one)."""

from __future__ import annotations

import json

import pytest
import torch
import transformers

from liger_models import Tokenizer, load_tokenizer
from liger_models.train.init_model import init_model_dir

CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{% if enable_thinking is defined and not enable_thinking %}{{ '<think></think>' }}{% endif %}{% endif %}"
)
TEXTS = ["ROMEO: What light through yonder window breaks?", "To be", "", "Ay, marry, is't; but to the wise."]
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Who art thou?"},
        {"role": "assistant", "content": "A friend."}]


@pytest.fixture(scope="module", params=["right", "left"])
def checkpoint(request, tmp_path_factory):
    out = init_model_dir(tmp_path_factory.mktemp("tok"), "demo")
    (out / "chat_template.jinja").write_text(CHATML)
    config = json.loads((out / "tokenizer_config.json").read_text())
    config.update(pad_token=config["eos_token"], padding_side=request.param)
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return out


@pytest.fixture(scope="module")
def pair(checkpoint):
    return load_tokenizer(checkpoint), transformers.AutoTokenizer.from_pretrained(str(checkpoint))


def test_special_tokens_and_sizes(pair):
    ours, hf = pair
    assert isinstance(ours, Tokenizer)
    assert (ours.eos_token, ours.eos_token_id, ours.pad_token, ours.pad_token_id) == \
        (hf.eos_token, hf.eos_token_id, hf.pad_token, hf.pad_token_id)
    assert ours.bos_token_id == hf.bos_token_id
    assert len(ours) == len(hf)
    assert ours.convert_tokens_to_ids(ours.eos_token) == hf.convert_tokens_to_ids(hf.eos_token)


@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_encode_and_call_match(pair, add_special_tokens):
    ours, hf = pair
    for text in TEXTS:
        assert ours.encode(text, add_special_tokens=add_special_tokens) == \
            hf.encode(text, add_special_tokens=add_special_tokens)
        assert ours(text, add_special_tokens=add_special_tokens) == \
            dict(hf(text, add_special_tokens=add_special_tokens))
    assert ours(TEXTS) == dict(hf(TEXTS))


def test_padding_truncation_and_tensors(pair):
    ours, hf = pair
    for kwargs in (dict(padding=True), dict(padding="max_length", max_length=20, truncation=True),
                   dict(padding=True, truncation=True, max_length=5)):
        got, ref = ours(TEXTS, return_tensors="pt", **kwargs), hf(TEXTS, return_tensors="pt", **kwargs)
        assert torch.equal(got["input_ids"], ref["input_ids"]) and torch.equal(got["attention_mask"],
                                                                              ref["attention_mask"]), kwargs
    single = ours(TEXTS[0], return_tensors="pt")["input_ids"]
    assert single.shape == (1, len(ours.encode(TEXTS[0])))
    with pytest.raises(ValueError, match="padding=True"):
        ours(TEXTS, return_tensors="pt")


def test_decode_and_batch_decode(pair):
    ours, hf = pair
    batch = [hf.encode(t) + [hf.eos_token_id] for t in TEXTS]
    for skip in (False, True):
        assert ours.batch_decode(batch, skip_special_tokens=skip) == hf.batch_decode(batch, skip_special_tokens=skip)
    assert ours.decode(torch.tensor(batch[0])) == hf.decode(batch[0])


def test_apply_chat_template_matches(pair):
    ours, hf = pair
    for kwargs in (dict(tokenize=False), dict(tokenize=False, add_generation_prompt=True),
                   dict(tokenize=False, add_generation_prompt=True, enable_thinking=False),
                   dict(tokenize=False, continue_final_message=True)):
        assert ours.apply_chat_template(CHAT, **kwargs) == hf.apply_chat_template(CHAT, **kwargs), kwargs
    assert ours.apply_chat_template(CHAT[:2], add_generation_prompt=True) == \
        dict(hf.apply_chat_template(CHAT[:2], add_generation_prompt=True))
    assert ours.apply_chat_template(CHAT, return_dict=False) == hf.apply_chat_template(CHAT, return_dict=False)
    batch = [CHAT, CHAT[:2]]
    got = ours.apply_chat_template(batch, add_generation_prompt=True, padding=True, return_tensors="pt")
    ref = hf.apply_chat_template(batch, add_generation_prompt=True, padding=True, return_tensors="pt")
    assert torch.equal(got["input_ids"], ref["input_ids"]) and torch.equal(got["attention_mask"],
                                                                          ref["attention_mask"])


def test_missing_template_and_bad_input_are_refused(tmp_path):
    out = init_model_dir(tmp_path / "plain", "demo")
    tokenizer = load_tokenizer(out)
    assert tokenizer.chat_template is None
    with pytest.raises(ValueError, match="no chat template"):
        tokenizer.apply_chat_template(CHAT)
    with pytest.raises(TypeError, match="str or a list of str"):
        tokenizer(123)
    with pytest.raises(ValueError, match="do not go together"):
        load_tokenizer(out).apply_chat_template(CHAT, chat_template=CHATML, add_generation_prompt=True,
                                                continue_final_message=True)

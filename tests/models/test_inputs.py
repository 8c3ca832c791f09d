"""A forward call's inputs are checked before use (liger_models/modules/inputs.py): every bad input is a ValueError
naming the argument, what it got and what was expected, not an IndexError from the embedding (a device-side assert
on CUDA) or a shape error deep in the stack; good inputs give what they gave before, with one host read per call."""

import re

import pytest
import torch

from liger_models import LigerLlamaForCausalLM, LlamaConfig
from liger_models.modules import inputs
from liger_models.modules.attention import AttentionMask, document_ids

V, B, T = 40, 2, 6


@pytest.fixture(scope="module")
def model() -> LigerLlamaForCausalLM:
    config = LlamaConfig.tiny(vocab_size=V, hidden_size=32, intermediate_size=64, num_attention_heads=2,
                              num_key_value_heads=1, num_hidden_layers=1)
    return LigerLlamaForCausalLM.from_config(config, dtype=torch.float64).eval()


@pytest.fixture
def ids() -> torch.Tensor:
    return torch.randint(0, V, (B, T))


def _with(ids: torch.Tensor, where: tuple, value: int) -> torch.Tensor:
    ids = ids.clone()
    ids[where] = value
    return ids


@pytest.mark.parametrize("bad", [V, V + 7, -1, -100])
def test_token_ids_outside_the_vocabulary(model, ids, bad):
    message = f"input_ids hold token id {bad}, outside the model's vocabulary [0, vocab_size={V})"
    for call in (model, model.model):  # the causal LM and its decoder alone (what Medusa calls)
        with pytest.raises(ValueError, match=f"^{re.escape(message)}"):
            call(_with(ids, (1, 3), bad))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bool, torch.int16, torch.uint8], ids=str)
def test_token_ids_of_a_type_the_embedding_cannot_index_with(model, ids, dtype):
    with pytest.raises(ValueError, match=f"input_ids must be int64 \\(or int32\\) token ids, got dtype {dtype}"):
        model(ids.to(dtype))


def test_token_ids_without_a_batch_dim(model, ids):
    with pytest.raises(ValueError, match=r"input_ids must be \(batch, seq_len\), got shape \(6,\) .*ids\[None\]"):
        model(ids[0])


@pytest.mark.parametrize("positions", [
    torch.arange(T + 1)[None].expand(B, T + 1),  # one position too many
    torch.arange(T)[None].expand(B + 1, T),  # a row too many
    torch.arange(T),  # no batch dim
    torch.arange(T)[None, None],  # one dim too many
], ids=["long", "rows", "1-D", "3-D"])
def test_position_ids_of_the_wrong_shape(model, ids, positions):
    expected = (f"position_ids must be (batch, seq_len) = {(B, T)} or (1, {T}) for input_ids of shape {(B, T)}, "
                f"got shape {tuple(positions.shape)}")
    with pytest.raises(ValueError, match=re.escape(expected)):
        model(ids, position_ids=positions)


def test_position_ids_that_are_not_integers(model, ids):
    with pytest.raises(ValueError, match="position_ids must be integer positions, got dtype torch.float32"):
        model(ids, position_ids=torch.arange(T, dtype=torch.float32)[None])


def _additive(mask: torch.Tensor) -> torch.Tensor:
    return torch.zeros(mask.shape).masked_fill(mask == 0, float("-inf"))


@pytest.mark.parametrize("make", [lambda m: _additive(m), lambda m: torch.zeros(m.shape), lambda m: m * 0.5],
                         ids=["additive", "additive-all-visible", "not-0/1"])
def test_attention_mask_of_a_float_type_that_may_be_additive(model, ids, make):
    # Additive masks (0 / -inf) would read inverted through mask != 0; a float row of zeros only is one of them
    # ("attend to everything"), as are values other than 0 and 1.
    mask = torch.ones(B, T, dtype=torch.long)
    mask[0, :2] = 0
    with pytest.raises(ValueError, match="attention_mask must be HF's 0/1 padding mask, got dtype torch.float32 with "
                                         "values other than 0 and 1 or a row of zeros only"):
        model(ids, attention_mask=make(mask))


def test_attention_mask_of_floats_0_1_reads_as_the_integer_mask(model, ids):
    # What PEFT's prompt learning passes: its virtual tokens' float ones concatenated with the user's mask.
    mask = torch.ones(B, T, dtype=torch.long)
    mask[0, :2] = 0
    with torch.no_grad():
        expected = model(ids, attention_mask=mask).logits
        assert torch.equal(model(ids, attention_mask=mask.float()).logits, expected)


def test_attention_mask_of_the_wrong_shape(model, ids):
    with pytest.raises(ValueError, match=rf"attention_mask must be \(batch, past \+ new tokens\) = \({B}, {T}\), "
                                         rf"got shape \({B}, {T - 1}\)"):
        model(ids, attention_mask=torch.ones(B, T - 1, dtype=torch.long))


@pytest.mark.parametrize("name", ["position_ids", "attention_mask"])
def test_inputs_on_another_device_than_the_ids(model, ids, name):
    other = {"position_ids": torch.arange(T)[None], "attention_mask": torch.ones(B, T, dtype=torch.long)}[name]
    with pytest.raises(ValueError, match=f"{name} is on meta, input_ids on cpu: pass them on one device"):
        model(ids, **{name: other.to("meta")})


@pytest.mark.parametrize("bad", [V, -1, -7])
def test_labels_outside_the_vocabulary_are_the_losss_to_refuse(model, ids, bad):
    # The loss kernels' own check (kernels/ops/_labels.py LabelCheck), which the input checks leave the values to.
    labels = _with(ids, (0, 2), bad)
    with pytest.raises(ValueError, match=rf"label {bad} is outside the vocabulary \[0, {V}\) and is not "
                                         r"ignore_index=-100 \(1 such labels\)"):
        model(ids, labels=labels)


@pytest.mark.parametrize("labels, message", [
    (torch.zeros(B, T - 1, dtype=torch.long), rf"labels must have the inputs' \(batch, seq_len\) shape "
                                              rf"\({B}, {T}\) .*got shape \({B}, {T - 1}\)"),
    (torch.zeros(B, T), r"labels must be int64 \(or int32\) token ids \(-100 where no loss\), got dtype "
                        r"torch.float32"),
    (torch.zeros(B, T, dtype=torch.long, device="meta"), "labels is on meta, the inputs on cpu"),
], ids=["shape", "float", "device"])
def test_labels_of_the_wrong_shape_type_or_device(ids, labels, message):
    with pytest.raises(ValueError, match=message):
        inputs.check_labels(labels, ids.shape, ids.device)


def test_the_causal_lm_refuses_float_labels_and_wrong_shapes(model, ids):
    with pytest.raises(ValueError, match="labels must be int64"):
        model(ids, labels=ids.double())
    with pytest.raises(ValueError, match="labels must have the inputs' .batch, seq_len. shape"):
        model(ids, labels=ids[:, 1:])
    embeds = model.get_input_embeddings()(ids)
    with pytest.raises(ValueError, match="labels must have the inputs'"):  # inputs_embeds give the shape too
        model(inputs_embeds=embeds, labels=ids[:, 1:])


def test_good_inputs_give_what_they_gave_before(model, ids):
    # The checked forward against the stack run on the same inputs without any check (DecoderModel.run).
    positions = torch.cat([torch.arange(2), torch.arange(T - 2)])[None].expand(B, T)  # two packed documents
    with torch.no_grad():
        unchecked = model.model.run(ids, positions, AttentionMask(T, 0, document_ids(positions), ids.device))
        assert torch.equal(model.model(ids, positions), unchecked)
        assert torch.equal(model.model(ids.int(), positions.int()), unchecked)  # int32 ids and positions
        assert torch.equal(model.model(ids, positions[:1]), unchecked)  # one row of positions for every sequence
        left = torch.ones(B, T, dtype=torch.long)
        left[1, :2] = 0  # row 1 left-padded
        masked = model(ids, attention_mask=left).logits
        assert torch.equal(model(ids, attention_mask=left.bool()).logits, masked)
        loss = model(ids, labels=ids).loss
        assert torch.equal(model(ids, labels=ids.int()).loss, loss)
        assert model(ids[:, :0]).logits.shape == (B, 0, V)  # no tokens: nothing to check, nothing computed


def test_one_host_read_of_the_ids_per_call(model, ids, monkeypatch):
    calls = []
    aminmax = torch.aminmax
    monkeypatch.setattr(torch, "aminmax", lambda t: calls.append(t.shape) or aminmax(t))
    with torch.no_grad():
        model(ids, labels=ids, position_ids=torch.arange(T)[None], attention_mask=torch.ones_like(ids))
    assert calls == [ids.shape]


def test_no_host_read_where_none_is_possible(model, monkeypatch):
    # While torch.compile traces, or a CUDA graph is being captured, the range is not read: a sync would break the
    # compiled graph, and is illegal during capture. Shapes and types are checked all the same.
    bad = torch.full((1, 3), V)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    inputs.check_input_ids(bad, V)
    with pytest.raises(ValueError, match="input_ids must be int64"):
        inputs.check_input_ids(bad.float(), V)
    monkeypatch.undo()
    inputs.check_input_ids(bad.to("meta"), V)  # the meta device has no values
    with pytest.raises(ValueError, match=f"token id {V}"):
        inputs.check_input_ids(bad, V)


@pytest.mark.gpu
def test_cuda_ids_checked_eagerly_and_left_alone_during_capture():
    bad = torch.full((1, 3), V, device="cuda")
    with pytest.raises(ValueError, match=f"token id {V}"):
        inputs.check_input_ids(bad, V)
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        inputs.check_input_ids(bad, V)  # a host read here would raise "operation not permitted when capturing"
        shifted = bad - 1  # something to capture
    graph.replay()
    assert int(shifted.max()) == V - 1


def test_decoding_reads_the_ids_once_for_the_prompt_not_per_step(model, ids, monkeypatch):
    """generate checks its prompt once; the tokens it feeds back are the model's own, so no step waits on a read
    (on CUDA each read would be a device sync per token)."""
    calls = []
    aminmax = torch.aminmax
    monkeypatch.setattr(torch, "aminmax", lambda t: calls.append(t.shape) or aminmax(t))
    out = model.generate(ids, max_new_tokens=5, do_sample=False, eos_token_id=[])
    assert out.shape[1] == ids.shape[1] + 5
    assert calls == [ids.shape]
    calls.clear()
    model(ids)  # outside a decoding loop every call reads again
    assert calls == [ids.shape]
    with pytest.raises(ValueError, match="outside the model's vocabulary"):
        model.generate(torch.full_like(ids, V), max_new_tokens=2)

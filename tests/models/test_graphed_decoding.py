"""CUDA-graph decoding (modules/graphed_decoding.py): the static cache and device masks give the eager path's tokens.

On the CPU the graphed calls run eagerly (CAPTURE off): the static cache, its slot writes, the masks computed from
device tensors and the reloads after a longrope switch are all checked there; capture and replay run in the GPU
tests at the end.
"""

import pytest
import torch

from liger_models import LigerMistralForCausalLM, MistralConfig
from liger_models.medusa import MedusaModel
from liger_models.modules import graphed_decoding
from liger_models.modules.attention import AttentionMask
from liger_models.modules.cache import KVCache
from liger_models.modules.graphed_decoding import DeviceMask, GraphedCall, StaticKVCache
from tests.medusa.test_decoding import _rotary_switch_base
from tests.models.test_inference import left_padded


@pytest.fixture
def eager_graphs(monkeypatch):
    monkeypatch.setattr(graphed_decoding, "CAPTURE", False)


def _mistral(window: int | None, dtype=torch.float64, device="cpu"):
    cfg = MistralConfig.tiny(sliding_window=window, initializer_range=0.3)
    return LigerMistralForCausalLM.from_config(cfg, dtype=dtype, device=device)


@pytest.mark.parametrize("window", [None, 4])
def test_generate_graphed_equals_eager(eager_graphs, window):
    model = _mistral(window)
    prompt = torch.randint(3, 128, (2, 7))
    plain = model.generate(prompt, max_new_tokens=12, eos_token_id=[])
    assert torch.equal(model.generate(prompt, max_new_tokens=12, eos_token_id=[], cuda_graph=True), plain)


def test_generate_graphed_left_padded_and_stopping_rows(eager_graphs):
    model = _mistral(5)
    ids, mask = left_padded(3, 8, [0, 3, 5])
    plain = model.generate(ids, attention_mask=mask, max_new_tokens=10, eos_token_id=[])
    eos = int(plain[1, 8 + 2])  # one row stops early: the others go on through the graph
    plain = model.generate(ids, attention_mask=mask, max_new_tokens=10, eos_token_id=eos, pad_token_id=0)
    graphed = model.generate(ids, attention_mask=mask, max_new_tokens=10, eos_token_id=eos, pad_token_id=0,
                             cuda_graph=True)
    assert torch.equal(graphed, plain)


def test_generate_graphed_sampling_equals_eager(eager_graphs):
    model = _mistral(None)
    prompt = torch.randint(3, 128, (2, 5))
    kw = dict(max_new_tokens=8, do_sample=True, temperature=0.9, top_k=20, eos_token_id=[])
    a = model.generate(prompt, generator=torch.Generator().manual_seed(3), **kw)
    b = model.generate(prompt, generator=torch.Generator().manual_seed(3), cuda_graph=True, **kw)
    assert torch.equal(a, b)


@pytest.mark.parametrize("kind", ["longrope", "dynamic"])
def test_generate_graphed_across_rotary_table_changes(eager_graphs, kind):
    # longrope switching re-prefills eagerly and reloads the static cache; dynamic NTK's table comes from the
    # positions on the device at every call.
    base = _rotary_switch_base(kind, seed=1)
    prompt = torch.randint(3, 50, (1, 6))
    plain = base.generate(prompt, max_new_tokens=14, eos_token_id=[])
    assert torch.equal(base.generate(prompt, max_new_tokens=14, eos_token_id=[], cuda_graph=True), plain)


@pytest.mark.parametrize("kind", [None, "longrope", "dynamic"])
def test_medusa_graphed_equals_plain_greedy(eager_graphs, kind):
    base = _mistral(4) if kind is None else _rotary_switch_base(kind, seed=2)
    model = MedusaModel.from_base(base, num_heads=3)
    for k in range(3):  # heads that echo the base's guess: some trees get accepted, so the cache is compacted
        model.heads[k][0].linear.bias.data.zero_()
    prompt = torch.randint(3, 50, (1, 6))
    plain = base.generate(prompt, max_new_tokens=10, eos_token_id=[])  # past the rotary switch at 12 positions
    eager, steps = model.generate(prompt, max_new_tokens=10, eos_token_id=[], return_stats=True)
    graphed, graphed_steps = model.generate(prompt, max_new_tokens=10, eos_token_id=[], return_stats=True,
                                            cuda_graph=True)
    assert torch.equal(eager, plain) and torch.equal(graphed, plain) and graphed_steps == steps


@pytest.mark.parametrize("window", [None, 3])
def test_device_mask_equals_the_host_mask(window):
    # One decoding token at slot 9 of a 16-slot cache with padding: the slots up to 9 match AttentionMask's rule,
    # later slots are never visible.
    padding = torch.rand(2, 16) > 0.3
    start = torch.tensor(9)
    dev = DeviceMask(start, torch.ones(1, 1, dtype=torch.bool), torch.zeros(1, dtype=torch.long), 16, padding)
    host = AttentionMask(1, 9, None, torch.device("cpu"), padding[:, :10])
    got = dev.boolean(window)
    assert got.shape == (2, 1, 1, 16)
    assert torch.equal(got[..., :10], host.boolean(window)) and not got[..., 10:].any()


def test_static_cache_refuses_what_does_not_fit():
    model = _mistral(None)
    cache = KVCache()
    model.model(torch.randint(0, 128, (1, 6)), cache=cache)
    with pytest.raises(ValueError, match="do not fit"):
        StaticKVCache(5).load(cache)
    static = StaticKVCache(8)
    static.load(cache)
    for layer_idx, (keys, values) in static.layers.items():
        assert torch.equal(keys[:, :, :6], cache._layers[layer_idx][0][:, :, :6])
        assert not keys[:, :, 6:].any() and not values[:, :, 6:].any()  # masked slots still meet the softmax
    with pytest.raises(ValueError, match="past the"):
        static.keep(6, torch.arange(3))


def test_graphed_call_refuses_a_cpu_model_and_slots_past_the_cache(eager_graphs, monkeypatch):
    model = _mistral(None)
    static = StaticKVCache(8)
    one = (torch.ones(1, 1, dtype=torch.bool), torch.zeros(1, dtype=torch.long))
    call = GraphedCall(model, static, 1, *one)
    with pytest.raises(ValueError, match="pass the static cache"):
        call(torch.zeros(1, 1, dtype=torch.long), 8, 8)
    monkeypatch.setattr(graphed_decoding, "CAPTURE", True)
    with pytest.raises(ValueError, match="CUDA device"):
        GraphedCall(model, static, 1, *one)


@pytest.mark.gpu
@pytest.mark.parametrize("window", [None, 6])
def test_generate_cuda_graph_equals_eager_on_gpu(window):
    model = _mistral(window, torch.float32, "cuda")
    ids, mask = left_padded(2, 9, [0, 4])
    ids, mask = ids.cuda(), mask.cuda()
    plain = model.generate(ids, attention_mask=mask, max_new_tokens=24, eos_token_id=[])
    graphed = model.generate(ids, attention_mask=mask, max_new_tokens=24, eos_token_id=[], cuda_graph=True)
    assert torch.equal(graphed, plain)


@pytest.mark.gpu
def test_medusa_cuda_graph_equals_plain_greedy_on_gpu():
    base = _mistral(8, torch.float32, "cuda")
    model = MedusaModel.from_base(base, num_heads=3).cuda()
    for k in range(3):
        model.heads[k][0].linear.bias.data.zero_()
    prompt = torch.randint(3, 128, (1, 6), device="cuda")
    plain = base.generate(prompt, max_new_tokens=40, eos_token_id=[])
    graphed, steps = model.generate(prompt, max_new_tokens=40, eos_token_id=[], return_stats=True, cuda_graph=True)
    assert torch.equal(graphed, plain) and sum(steps) == 40

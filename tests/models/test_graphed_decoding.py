"""CUDA-graph decoding (modules/graphed_decoding.py): the static cache and device masks give the eager path's tokens.

On the CPU the graphed calls run eagerly (CAPTURE off): the static cache, its slot writes, the masks computed from
device tensors and the reloads after a longrope switch are all checked there; capture and replay run in the GPU
tests at the end.
"""

from types import SimpleNamespace

import pytest
import torch

from liger_models import LigerMistralForCausalLM, MistralConfig
from liger_models.gemma.config import GemmaConfig
from liger_models.gemma2 import Gemma2Config, LigerGemma2ForCausalLM
from liger_models.gemma3 import Gemma3TextConfig, LigerGemma3ForCausalLM
from liger_models.gemma.modeling import LigerGemmaForCausalLM
from liger_models.medusa import MedusaModel
from liger_models.medusa.decoding import dense_medusa_choices, generate_medusa_buffers, medusa_generate
from liger_models.medusa.graphed_step import GraphedSteps
from liger_models.qwen2.config import Qwen2Config
from liger_models.qwen2.modeling import LigerQwen2ForCausalLM
from liger_models.modules import graphed_decoding
from liger_models.modules.attention import AttentionMask
from liger_models.modules.cache import KVCache
from liger_models.modules.graphed_decoding import GraphedCall, StaticKVCache, device_mask
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
    kw = dict(max_new_tokens=10, eos_token_id=[], return_stats=True, medusa_choices=dense_medusa_choices([2, 2, 1]))
    eager, steps = model.generate(prompt, **kw)
    graphed, graphed_steps = model.generate(prompt, cuda_graph=True, **kw)
    assert torch.equal(eager, plain) and torch.equal(graphed, plain) and graphed_steps == steps


@pytest.mark.parametrize("kind", [None, "longrope", "dynamic"])
def test_medusa_graphed_sampling_equals_eager(eager_graphs, kind):
    # Typical acceptance in the graphed step: the same acceptance code and the same draws in the same order (the
    # root is drawn when the state is set, in both), so a seeded generator gives the eager tokens and step sizes,
    # across longrope's re-prefill and the root-only steps at a rotary table change too.
    # A lower threshold than the default 0.09 / 0.3, and a fresh random base (up to three) until one accepts a tree
    # past its root: an occasional random base accepts none (LIGER_TEST_SEED=588346767 at 0.03; none in 60 other
    # seeds), and then the graphed acceptance would go unchecked.
    kw = dict(max_new_tokens=16, eos_token_id=[], temperature=0.8, return_stats=True, posterior_threshold=0.03,
              posterior_alpha=0.1, medusa_choices=dense_medusa_choices([2, 2, 1]))
    for attempt in range(3):
        base = _mistral(4) if kind is None else _rotary_switch_base(kind, seed=3 + attempt)
        model = MedusaModel.from_base(base, num_heads=3)
        for k in range(3):
            model.heads[k][0].linear.bias.data.zero_()
        prompt = torch.randint(3, 50, (1, 6))
        eager, steps = model.generate(prompt, generator=torch.Generator().manual_seed(7), **kw)
        graphed, graphed_steps = model.generate(prompt, generator=torch.Generator().manual_seed(7), cuda_graph=True,
                                                **kw)
        assert torch.equal(graphed, eager) and graphed_steps == steps
        if max(steps) > 1:
            break
    assert max(steps) > 1, "no tree was accepted past its root by three random bases"
    greedy = model.generate(prompt, max_new_tokens=16, eos_token_id=[])
    assert not torch.equal(eager, greedy)  # the draws were really random


@pytest.mark.parametrize("family", ["gemma", "qwen2-layer-windows", "gemma2-softcaps", "gemma3-two-ropes"])
@pytest.mark.parametrize("new_tokens", [1, 2, 9])
def test_generate_graphed_other_families(eager_graphs, family, new_tokens):
    # Gemma's scaled embeddings and Qwen2's qkv bias with a window on some layers only; Gemma 2's soft-capped
    # scores and logits on a static cache (the capped-math attention path) and Gemma 3's two RoPE tables and q/k
    # norms, with windows of 5 on their sliding layers; budgets of 1 (no graphed step at all) and 2 (exactly one).
    if family == "gemma":
        model = LigerGemmaForCausalLM.from_config(GemmaConfig.tiny(initializer_range=0.3), dtype=torch.float64)
    elif family.startswith("gemma2"):
        model = LigerGemma2ForCausalLM.from_config(Gemma2Config.tiny(initializer_range=0.3), dtype=torch.float64)
    elif family.startswith("gemma3"):
        model = LigerGemma3ForCausalLM.from_config(Gemma3TextConfig.tiny(initializer_range=0.3), dtype=torch.float64)
    else:
        cfg = Qwen2Config.tiny(initializer_range=0.3, use_sliding_window=True, sliding_window=3, max_window_layers=1)
        model = LigerQwen2ForCausalLM.from_config(cfg, dtype=torch.float64)
    ids, mask = left_padded(3, 7, [0, 2, 6])
    plain = model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, eos_token_id=[])
    graphed = model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, eos_token_id=[], cuda_graph=True)
    assert torch.equal(graphed, plain)


class OracleHeads:
    """Stand-in Medusa heads that know the base's greedy continuation `plain`: at the position whose hidden state
    they are given, head k ranks the true token k + 2 ahead at a random rank below widths[k], so trees are accepted
    deep and along any branch (every node of the tree gets moved by `keep` at some step)."""

    def __init__(self, base, plain: torch.Tensor, widths: list[int]):
        V = base.config.vocab_size
        self.config = SimpleNamespace(hidden_size=base.config.hidden_size, vocab_size=V)
        self.num_heads, self.widths, self.plain = len(widths), widths, plain[0]
        with torch.no_grad():
            self.states = base.model(plain)[0]  # (T, H): the state after each token of the continuation
        self.at = -1

    def logits(self, hidden: torch.Tensor, num_heads: int) -> torch.Tensor:
        # Which position this hidden state is: the nearest state past the previous call's (with a sliding window,
        # a repeating text repeats states exactly, and the earliest match after the last one is the true one).
        later = self.states[self.at + 1:]
        self.at += 1 + int((later - hidden).abs().sum(-1).argmin())
        at = self.at
        out = torch.randn(num_heads, 1, self.config.vocab_size, dtype=torch.float64)
        for k in range(num_heads):
            if at + 2 + k < len(self.plain):
                order = out[k, 0].argsort(descending=True)
                true, other = int(self.plain[at + 2 + k]), int(order[torch.randint(0, self.widths[k], ())])
                out[k, 0, true], out[k, 0, other] = out[k, 0, other].clone(), out[k, 0, true].clone()
        return out


@pytest.mark.parametrize("window", [None, 2])
@pytest.mark.parametrize("graphed", [False, True])
def test_medusa_deep_acceptance_on_any_branch(eager_graphs, window, graphed):
    # Window 2 cuts inside a depth-3 tree; the accepted path is a random branch, moved down by KVCache.keep (eager)
    # or, graphed, by the whole greedy step on the device (medusa/graphed_step.py). These heads keep host state
    # between calls; DeviceOracleHeads below is their capturable twin for the GPU.
    base = _mistral(window)
    prompt = torch.randint(3, 128, (1, 5))
    plain = base.generate(prompt, max_new_tokens=18, eos_token_id=[])
    widths = [3, 2, 2]
    out, steps = medusa_generate(base, OracleHeads(base, plain, widths), prompt, 18, eos_token_id=[], topk=3,
                                 medusa_choices=dense_medusa_choices(widths), return_stats=True, cuda_graph=graphed)
    assert torch.equal(out, plain)
    assert sum(steps) == 18 and max(steps) == 4 and len(steps) <= 6  # 4 tokens a step wherever the future is known


class DeviceOracleHeads:
    """OracleHeads in device ops only, so a captured Medusa step can call them: the position is the continuation's
    state nearest the given one (a state repeated under a sliding window has the same greedy future), and each
    head's logits are a fixed random row with the true token swapped to a random rank below the head's width."""

    def __init__(self, base, plain: torch.Tensor, widths: list[int]):
        V, T, K = base.config.vocab_size, plain.shape[1], len(widths)
        self.config = SimpleNamespace(hidden_size=base.config.hidden_size, vocab_size=V)
        self.num_heads = K
        with torch.no_grad():
            self.states = base.model(plain)[0]  # (T, H)
        table = torch.randn(T, K, V, dtype=torch.float64)
        for at in range(T):
            for k in range(K):
                if at + 2 + k < T:
                    order = table[at, k].argsort(descending=True)
                    true, other = int(plain[0, at + 2 + k]), int(order[torch.randint(0, widths[k], ())])
                    table[at, k, true], table[at, k, other] = table[at, k, other].clone(), table[at, k, true].clone()
        self.table = table.to(plain.device)

    def logits(self, hidden: torch.Tensor, num_heads: int) -> torch.Tensor:
        # Under a sliding window a state repeats exactly, so the tree step's hidden is as near (up to rounding) to a
        # late copy, whose table row no longer knows the future, as to the earliest; argmin alone picked the late
        # one on the H200 at seed 1209015854. The earliest of the near ones always knows it.
        d = (self.states - hidden).abs().sum(-1)
        at = (d <= d.min() + 1e-4 * hidden.abs().sum()).int().argmax().view(1)
        return self.table.index_select(0, at)[0, :num_heads, None]  # (K, 1, V)


def _deep_acceptance_is_plain_greedy(window: int | None, dtype, device: str) -> None:
    base = _mistral(window, dtype, device)
    prompt = torch.randint(3, 128, (1, 5), device=device)
    plain = base.generate(prompt, max_new_tokens=18, eos_token_id=[])
    widths = [3, 2, 2]
    out, steps = medusa_generate(base, DeviceOracleHeads(base, plain, widths), prompt, 18, eos_token_id=[], topk=3,
                                 medusa_choices=dense_medusa_choices(widths), return_stats=True, cuda_graph=True)
    assert torch.equal(out, plain)
    assert sum(steps) == 18 and max(steps) == 4 and len(steps) <= 6


def test_graphed_greedy_step_refuses_a_tree_past_the_cache(eager_graphs):
    # Inside a graph a slot past the cache would be a device-side assert that ends the process's CUDA context.
    base = _mistral(None)
    heads = MedusaModel.from_base(base, num_heads=2).heads
    buffers = generate_medusa_buffers(dense_medusa_choices([2, 1]), 2, 3)
    steps = GraphedSteps(base, heads, buffers, 3, 8, (0.0, 0.09, 0.3), None)
    steps.prefill(torch.randint(3, 50, (1, 3)))
    assert 1 <= len(steps.tree(3)) <= 3  # slots 3 … 7: the 5 nodes fit exactly
    with pytest.raises(ValueError, match="passes the static cache's 8"):
        steps.tree(4)


def test_graphed_steps_launched_ahead_give_the_same_tokens(eager_graphs):
    # A step launched before the previous one's tokens are read starts from the state that step left on the device
    # (its length included); the caller may only follow it with that tree step, at the slot it starts at.
    base = _mistral(None).requires_grad_(False)  # as medusa_generate runs it (no_grad)
    buffers = generate_medusa_buffers(dense_medusa_choices([2, 2]), 2, 3)
    prompt = torch.randint(3, 50, (1, 3))
    plain = base.generate(prompt, max_new_tokens=30, eos_token_id=[])
    heads = DeviceOracleHeads(base, plain, [2, 2])  # they know the continuation: trees are accepted
    tokens = {}
    for ahead in (False, True):
        steps = GraphedSteps(base, heads, buffers, 3, 40, (0.0, 0.09, 0.3), None)
        steps.prefill(prompt)
        length, out = 3, []
        for _ in range(5):
            step = steps.tree(length, ahead)
            out.append(step)
            length += len(step)
        tokens[ahead] = out
        if ahead:
            with pytest.raises(RuntimeError, match="launched ahead"):
                steps.root_only(length)
            with pytest.raises(RuntimeError, match=f"starts at slot {length}, not {length + 1}"):
                steps.tree(length + 1)
            assert steps.tree(length)  # the queued step, still usable
    assert tokens[True] == tokens[False] and min(len(t) for t in tokens[True]) == 3
    assert sum(tokens[True], []) == plain[0, 3: 3 + 15].tolist()
    # Through medusa_generate: an EOS ends the call while a step is queued behind it.
    model = MedusaModel.from_base(base, num_heads=2)
    eos = int(plain[0, 3 + 8])
    kw = dict(max_new_tokens=14, eos_token_id=eos, medusa_choices=dense_medusa_choices([2, 2]), topk=3)
    stopped = plain[:, : 3 + int((plain[0, 3:] == eos).nonzero()[0]) + 1]
    assert torch.equal(model.generate(prompt, cuda_graph=True, **kw), stopped)
    assert torch.equal(model.generate(prompt, **kw), stopped)


def test_device_oracle_heads_accept_deep_on_the_cpu(eager_graphs):
    # The GPU test's heads themselves (a wrong oracle would make that test pass or fail for the wrong reason).
    _deep_acceptance_is_plain_greedy(2, torch.float64, "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("window", [None, 2])
def test_graphed_greedy_step_accepts_deep_on_any_branch_on_gpu(window):
    _deep_acceptance_is_plain_greedy(window, torch.float32, "cuda")


@pytest.mark.parametrize("window", [None, 1, 2, 5])
@pytest.mark.parametrize("past", [0, 4, 9])
def test_device_mask_equals_the_host_mask_for_a_tree(window, past):
    b = generate_medusa_buffers(dense_medusa_choices([3, 2, 2]), num_heads=3, topk=3)
    T = len(b.tree_indices)
    host = AttentionMask(T, past, None, torch.device("cpu"), None, (b.tree_mask, b.tree_position_ids))
    dev = device_mask(torch.tensor(past), b.tree_mask, b.tree_position_ids, past + T + 5, None).boolean(window)
    assert torch.equal(dev[..., : past + T], host.boolean(window)) and not dev[..., past + T:].any()


def test_graphed_call_never_takes_the_flex_path(eager_graphs):
    # flex="always" (a test knob) must not reach a mask that is a tensor computed in the graph.
    model = _mistral(None)
    for layer in model.model.layers:
        layer.self_attn.flex = "always"
    prompt = torch.randint(3, 128, (1, 5))
    plain = model.generate(prompt, max_new_tokens=4, eos_token_id=[])
    assert torch.equal(model.generate(prompt, max_new_tokens=4, eos_token_id=[], cuda_graph=True), plain)


@pytest.mark.parametrize("window", [None, 3])
def test_device_mask_equals_the_host_mask(window):
    # One decoding token at slot 9 of a 16-slot cache with padding: the slots up to 9 match AttentionMask's rule,
    # later slots are never visible.
    padding = torch.rand(2, 16) > 0.3
    start = torch.tensor(9)
    dev = device_mask(start, torch.ones(1, 1, dtype=torch.bool), torch.zeros(1, dtype=torch.long), 16, padding)
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
    for bad in (torch.arange(3), torch.tensor([0, 2])):  # past the slots; one node past them
        with pytest.raises(ValueError, match="outside the 8"):
            static.keep(6, bad)


def test_keep_refuses_entries_outside_the_filled_ones():
    # A tree of 5 entries after 5 committed ones: node 6 would read a stale slot of the preallocated buffer, a
    # negative index a committed entry.
    cache = KVCache(capacity=32)
    k = torch.randn(1, 1, 10, 4)
    cache.update(0, k, k)
    for bad in (torch.tensor([0, 6]), torch.tensor([0, -1]), torch.arange(6)):
        with pytest.raises(ValueError, match="outside the 10"):
            cache.keep(5, bad)
    cache.keep(5, torch.tensor([0, 4]))
    assert cache.seq_length() == 7 and torch.equal(cache._layers[0][0][:, :, 6], k[:, :, 9])


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
@pytest.mark.parametrize("do_sample", [False, True])
def test_generate_cuda_graph_stops_where_eager_stops_on_gpu(do_sample):
    # Replays are queued ahead of the host's look at which rows finished (generate.FinishWatch): steps queued past
    # the last row's EOS must be cut, one row stopping early must not stop the others, and (sampling) the draws
    # must stay in the eager order, whichever step the host noticed the end at.
    model = _mistral(3, torch.float32, "cuda")
    ids, mask = left_padded(3, 8, [0, 2, 5])
    ids, mask = ids.cuda(), mask.cuda()
    kw = dict(attention_mask=mask, max_new_tokens=40, do_sample=do_sample, temperature=0.9, top_k=0, top_p=0.95)

    def run(graph, **more):
        torch.cuda.manual_seed(11)
        return model.generate(ids, cuda_graph=graph, **kw, **more)

    free = run(False, eos_token_id=[])
    assert torch.equal(run(True, eos_token_id=[]), free) and free.shape[1] == 8 + 40
    one_row = int(free[1, 8 + 3])  # row 1 stops at step 3 (or earlier); the others need not
    assert torch.equal(run(True, eos_token_id=one_row, pad_token_id=0), run(False, eos_token_id=one_row,
                                                                             pad_token_id=0))
    every_row = sorted({int(t) for t in free[:, 8 + 6]})  # every row stops by step 6: the call ends there
    eager = run(False, eos_token_id=every_row, pad_token_id=0)
    graphed = run(True, eos_token_id=every_row, pad_token_id=0)
    assert torch.equal(graphed, eager) and eager.shape[1] <= 8 + 7 and graphed.is_contiguous()


@pytest.mark.gpu
@pytest.mark.parametrize("kind", [None, "shared", "longrope", "dynamic"])
def test_medusa_cuda_graph_equals_plain_greedy_on_gpu(kind):
    # Whole steps captured (medusa/graphed_step.py), greedy and sampling, with the one-token graph where the rotary
    # table changes and a re-prefill at longrope's switch. Sampling draws from a registered generator (or the
    # default one) inside the replays, in the eager order: the same seed gives the same tokens.
    if kind in ("longrope", "dynamic"):
        base = _rotary_switch_base(kind, seed=2).to("cuda", torch.float32)
    else:
        base = _mistral(8, torch.float32, "cuda")
    model = MedusaModel.from_base(base, num_heads=3, share_lm_head=kind == "shared").cuda()
    for k in range(3):
        model.heads[k][0].linear.bias.data.zero_()
    prompt = torch.randint(3, 50, (1, 6), device="cuda")
    plain = base.generate(prompt, max_new_tokens=40, eos_token_id=[])
    graphed, steps = model.generate(prompt, max_new_tokens=40, eos_token_id=[], return_stats=True, cuda_graph=True)
    assert torch.equal(graphed, plain) and sum(steps) == 40
    # Greedy draws nothing: a generator on another device is ignored, never registered with the graph.
    assert torch.equal(model.generate(prompt, max_new_tokens=40, eos_token_id=[], cuda_graph=True,
                                      generator=torch.Generator()), plain)
    kw = dict(max_new_tokens=30, eos_token_id=[], temperature=0.7, return_stats=True, posterior_threshold=0.03,
              posterior_alpha=0.1)  # below the defaults, so that a random base surely accepts some tree
    sampled = [model.generate(prompt, generator=torch.Generator("cuda").manual_seed(5), cuda_graph=graph, **kw)
               for graph in (False, True)]
    assert torch.equal(sampled[0][0], sampled[1][0]) and sampled[0][1] == sampled[1][1]
    assert max(sampled[1][1]) > 1 and len(sampled[1][1]) > 3  # trees accepted, in replays after the capture
    defaults = []
    for graph in (False, True):
        torch.cuda.manual_seed(6)
        defaults.append(model.generate(prompt, cuda_graph=graph, **kw)[0])
    assert torch.equal(*defaults) and not torch.equal(defaults[0], sampled[0][0])


def _bf16_steps_as_accurate_as_eager(device: str) -> None:
    # bf16 tokens may differ at near-ties (the masked attention over the static cache rounds apart from the eager
    # kernel's); the logits must not be less accurate, step after step, than the eager step's. Reference: the same
    # bf16-rounded weights in fp32 arithmetic (unrounded weights would measure the weights' rounding instead). A
    # whole bf16 model sits 1-4% (relative L2) from that reference, so the bound is relative to the eager step's
    # error, as docs/kernels.md#correctness-protocol bounds a kernel against eager PyTorch: at most 2× it (a
    # rounding's worth at least).
    import copy

    from tests.helpers import rel_l2

    model = _mistral(6, torch.float32, device).to(torch.bfloat16)
    ref_model = copy.deepcopy(model).float()
    prompt = torch.randint(3, 128, (1, 9), device=device)
    ref_cache, cache = KVCache(), KVCache()
    ref_model(prompt, past_key_values=ref_cache, use_cache=True)
    model(prompt, past_key_values=cache, use_cache=True)
    static = StaticKVCache(40)
    static.load(cache)
    call = GraphedCall(model, static, 1, torch.ones(1, 1, dtype=torch.bool), torch.zeros(1, dtype=torch.long))
    for slot in range(9, 30):
        token = torch.randint(3, 128, (1, 1), device=device)
        ref = ref_model(token, past_key_values=ref_cache, use_cache=True).logits[:, -1]
        eager = model(token, past_key_values=cache, use_cache=True).logits[:, -1]
        graphed = call(token, slot, slot)[1][:, -1]
        err, eager_err = rel_l2(graphed, ref), rel_l2(eager, ref)
        assert not graphed.isnan().any() and err <= max(2 * eager_err, 4e-3), (slot, err, eager_err)


def test_static_path_in_bf16_is_as_accurate_as_the_eager_step(eager_graphs):
    _bf16_steps_as_accurate_as_eager("cpu")


@pytest.mark.gpu
def test_graphed_step_in_bf16_is_as_accurate_as_the_eager_step():
    _bf16_steps_as_accurate_as_eager("cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("finish", [None, 2, 3])
def test_finish_watch_drains_unread_flags_on_gpu(finish):
    """A finish whose pinned flag the host has not read when the token budget runs out is still found (drain).
    The GPU is held busy first, so no flag lands during the steps. Graphed generate once returned a pad column past
    the last EOS when every row finished one step before the budget's end (seed 1209015854)."""
    from liger_models.modules.generate import FinishWatch

    watch = FinishWatch(5, True)
    torch.cuda._sleep(100_000_000)  # ~50 ms of GPU time ahead of the flags' copies
    for step in range(4):
        done = torch.full((3,), finish is not None and step >= finish, device="cuda")
        assert watch.finished_at(step, done) is None  # nothing landed yet
    assert watch.drain() == finish
    assert len(watch.pending) == (0 if finish is None else 3 - finish)  # the steps after the finish stay unread

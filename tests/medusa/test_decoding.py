"""Tree decoding: buffers, tree-masked verification on the KV cache, acceptance rules, and greedy output == plain
greedy output."""

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from liger_models.medusa import MedusaConfig, MedusaHeads, MedusaModel
from liger_models.medusa.decoding import (default_medusa_choices, dense_medusa_choices,
                                          generate_medusa_buffers, medusa_generate)
from liger_models.modules.cache import KVCache
from tests.medusa._common import accept_paths as _accept, make_base

V, H = 37, 16


def test_buffers_small_tree():
    b = generate_medusa_buffers([(1,), (0, 1), (0,), (0, 0), (1, 0)], num_heads=2, topk=10)
    # Sorted nodes: root, (0,), (1,), (0,0), (0,1), (1,0)
    assert b.tree_indices.tolist() == [0, 1, 2, 11, 12, 11]
    assert b.tree_position_ids.tolist() == [0, 1, 1, 2, 2, 2]
    assert b.tree_mask.int().tolist() == [
        [1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [1, 0, 1, 0, 0, 0],
        [1, 1, 0, 1, 0, 0],
        [1, 1, 0, 0, 1, 0],
        [1, 0, 1, 0, 0, 1],
    ]
    assert b.retrieve_indices.tolist() == [[0, 1, 3], [0, 1, 4], [0, 2, 5]]
    b = generate_medusa_buffers([(0,), (1,), (0, 0)], num_heads=3)
    assert b.retrieve_indices.tolist() == [[0, 2, -1], [0, 1, 3]]


def test_dense_and_default_choices():
    assert dense_medusa_choices([2, 1]) == [(0,), (1,), (0, 0), (1, 0)]
    assert len(default_medusa_choices(5)) == 4 + 8 + 16 + 16
    assert max(len(c) for c in default_medusa_choices(2)) == 2


@pytest.mark.parametrize("choices,match", [([(0, 0, 0)], "only 2 Medusa heads"), ([(0,), (10,)], r"\[0, 10\)"),
                                           ([(0,), (1, 0)], "parent"), ([], "non-empty"),
                                           ([1, 2], "dense_medusa_choices")])  # v0.1's dense widths
def test_bad_choices_raise(choices, match):
    with pytest.raises(ValueError, match=match):
        generate_medusa_buffers(choices, num_heads=2)


def test_greedy_acceptance_picks_longest_prefix():
    # Base argmax after each position: rows predict [5, 6, 7]; candidates are root + 3 tokens.
    logits = torch.full((3, 4, 9), -5.0)
    for p in range(3):
        for j, t in enumerate([5, 6, 7, 8]):
            logits[p, j, t] = 5.0
    paths = torch.tensor([[1, 5, 0, 0], [1, 5, 6, 0], [1, 5, 6, 7]])
    valid = torch.ones(3, 4, dtype=torch.bool)
    assert _accept(paths, valid, logits, 0.0, 0.09, 0.3) == (2, 3)
    valid[2, 3] = False  # a padded position never counts
    assert _accept(paths, valid, logits, 0.0, 0.09, 0.3) == (1, 2)


def test_typical_acceptance_after_a_masked_token():
    # A -inf logit (a token the base can never emit) holds no probability mass: the entropy must ignore it rather
    # than become NaN (0 · -inf), which would reject every candidate after that node. Finite -1e4 is the control.
    for masked in (float("-inf"), -1e4):
        logits = torch.tensor([[[0.0, 10.0, masked], [0.0, 0.0, 0.0]]])
        assert _accept(torch.tensor([[0, 1]]), torch.ones(1, 2, dtype=torch.bool), logits, 1.0, 0.09, 0.3) == (0, 1)


def test_typical_acceptance_extremes_and_tie_break():
    logits = torch.randn(3, 4, 9)
    paths = torch.randint(0, 9, (3, 4))
    valid = torch.ones(3, 4, dtype=torch.bool)
    assert _accept(paths, valid, logits, 0.7, 0.0, 0.3)[1] == 3  # threshold min(0, ·) = 0: everything accepted
    assert _accept(paths, valid, logits, 0.7, 1.0, 1e9)[1] == 0  # p > 1 never holds
    # Equal lengths: the row whose tokens the base finds most likely wins.
    logp = torch.log_softmax(logits[:, :-1] / 0.7, -1).gather(-1, paths[:, 1:, None]).squeeze(-1)
    assert _accept(paths, valid, logits, 0.7, 0.0, 0.3)[0] == int(logp.sum(1).argmax())


def _window_base(window: int | None):
    """A 2-layer float64 Mistral (sliding window `window`; None: plain causal)."""
    from liger_models.mistral.config import MistralConfig
    from liger_models.mistral.modeling import LigerMistralForCausalLM

    config = MistralConfig.tiny(vocab_size=V, sliding_window=window, initializer_range=0.3)
    return LigerMistralForCausalLM.from_config(config, dtype=torch.float64)


@pytest.mark.parametrize("window", [None, 3, 5])
def test_tree_verification_equals_each_path_run_alone(window):
    # Every tree node's hidden state from one tree-masked call on top of the cache == running the prefix followed by
    # the node's root-to-node path as a plain sequence (windows count positions by depth, not by node index).
    base = _window_base(window)
    choices = [(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 1, 0)]
    b = generate_medusa_buffers(choices, num_heads=3, topk=3)
    prefix, tree = torch.randint(0, V, (1, 7)), torch.randint(0, V, (len(b.tree_indices),))
    poisoned = torch.full((1, len(tree), base.config.hidden_size), float("nan"), dtype=torch.float64)
    cache = KVCache()
    base.model(prefix, cache=cache)
    poisoned.copy_(base.model(tree[None], (7 + b.tree_position_ids)[None], cache=cache, tree_mask=b.tree_mask))
    assert cache.seq_length() == 7 + len(tree)
    ancestors = b.tree_mask.nonzero()  # (node, ancestor-or-self) pairs, ancestors in depth order
    for node in range(len(tree)):
        path = ancestors[ancestors[:, 0] == node, 1]
        full = base.model(torch.cat([prefix, tree[path][None]], 1))
        torch.testing.assert_close(poisoned[0, node], full[0, -1], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("window", [None, 4])
def test_kept_path_continues_like_the_plain_sequence(window):
    base = _window_base(window)
    b = generate_medusa_buffers(dense_medusa_choices([3, 2, 2]), num_heads=3, topk=3)
    prefix, tree = torch.randint(0, V, (1, 6)), torch.randint(0, V, (len(b.tree_indices),))
    cache = KVCache()
    base.model(prefix, cache=cache)
    base.model(tree[None], (6 + b.tree_position_ids)[None], cache=cache, tree_mask=b.tree_mask)
    nodes = b.retrieve_indices[torch.randint(0, len(b.retrieve_indices), ())][:3]  # root + 2 accepted
    cache.keep(6, nodes)
    assert cache.seq_length() == 9
    more = torch.randint(0, V, (1, 2))
    out = base.model(more, cache=cache)
    full = base.model(torch.cat([prefix, tree[nodes][None], more], 1))
    torch.testing.assert_close(out, full[:, -2:], rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="outside the 11 filled"):  # 9 kept + the 2 more
        cache.keep(9, torch.arange(5))


def test_tree_mask_needs_positions_and_its_shape():
    base = make_base(V, H, torch.float64)
    ids = torch.randint(0, V, (1, 3))
    with pytest.raises(ValueError, match="tree_mask"):
        base.model(ids, tree_mask=torch.ones(3, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match="tree_mask"):
        base.model(ids, torch.arange(3)[None], tree_mask=torch.ones(2, 2, dtype=torch.bool))


class CounterBase(nn.Module):
    """next token = perm[token]: one-hot hidden states and a permutation lm_head (a base whose future is known)."""

    def __init__(self, perm: torch.Tensor):
        super().__init__()
        n = len(perm)
        self.perm = perm
        self.config = SimpleNamespace(hidden_size=n, vocab_size=n)
        self.lm_head = nn.Linear(n, n, bias=False, dtype=torch.float64)
        self.lm_head.weight.data = torch.eye(n, dtype=torch.float64)[perm].t().contiguous()  # W[perm[i], i] = 1
        self.model = lambda ids, position_ids=None, cache=None, **_: nn.functional.one_hot(ids, n).double()

    def greedy(self, ids: torch.Tensor, n: int) -> torch.Tensor:
        out = ids[0].tolist()
        for _ in range(n):
            out.append(int(self.perm[out[-1]]))
        return torch.tensor(out)[None]


def _counter_heads(base, good: int):
    """Heads 1..good predict perfectly (the permutation applied k+1 more times); the others rank the truth last."""
    heads = MedusaHeads(MedusaConfig.for_base(base, num_heads=4), base.lm_head)
    P = base.lm_head.weight.data
    for k in range(4):
        heads[k][0].linear.bias.data.zero_()  # SiLU(0) = 0: the ResBlock is then exactly the identity
        truth = torch.linalg.matrix_power(P, k + 2)
        heads[k][1].weight.data = truth if k < good else torch.linalg.matrix_power(P, k + 3) - 10 * truth
    return heads


@pytest.mark.parametrize("good", [0, 2, 4])
def test_acceptance_lengths_on_a_known_future(good):
    perm = torch.randperm(V)
    base = CounterBase(perm)
    heads = _counter_heads(base, good)
    prompt = torch.randint(0, V, (1, 3))
    out, steps = medusa_generate(base, heads, prompt, 20, return_stats=True)
    assert torch.equal(out, base.greedy(prompt, 20))
    depth = 4  # default tree depth with 4 heads
    per_step = 1 + min(good, depth)
    assert steps[:-1] == [per_step] * (len(steps) - 1) and sum(steps) == 20


@pytest.mark.parametrize("share", [False, True])
def test_greedy_medusa_equals_plain_greedy_on_tiny_llama(share):
    base = make_base(V, H, torch.float64, layers=2)
    model = MedusaModel.from_base(base, num_heads=4, share_lm_head=share)
    for k in range(4):  # heads that echo the base's next-token guess get accepted whenever the text repeats
        model.heads[k][0].linear.bias.data.zero_()
    prompt = torch.randint(3, V, (1, 6))
    plain = base.generate(prompt, max_new_tokens=30, eos_token_id=[])
    medusa, steps = model.generate(prompt, max_new_tokens=30, eos_token_id=[], return_stats=True)
    assert torch.equal(medusa, plain)
    assert sum(steps) == 30


def _rotary_switch_base(kind: str, seed: int):
    """A tiny random base whose rotary table changes with the length: Phi-3 longrope switching at 12 positions, or
    Llama dynamic NTK past max_position_embeddings = 12."""
    from liger_models.llama.config import LlamaConfig
    from liger_models.llama.modeling import LigerLlamaForCausalLM
    from liger_models.phi3.config import Phi3Config
    from liger_models.phi3.modeling import LigerPhi3ForCausalLM

    torch.manual_seed(seed)
    small = dict(hidden_size=32, num_attention_heads=2, num_key_value_heads=2, vocab_size=50, num_hidden_layers=2,
                 initializer_range=0.3)
    if kind == "longrope":
        half = 8  # head_dim 16
        rope = {"rope_type": "longrope", "short_factor": [1.0 + i / 8 for i in range(half)],
                "long_factor": [3.0 + i for i in range(half)]}
        cfg = Phi3Config.tiny(rope_scaling=rope, original_max_position_embeddings=12, max_position_embeddings=64,
                              **small)
        return LigerPhi3ForCausalLM.from_config(cfg, dtype=torch.float64)
    cfg = LlamaConfig.tiny(rope_scaling={"rope_type": "dynamic", "factor": 4.0}, max_position_embeddings=12, **small)
    return LigerLlamaForCausalLM.from_config(cfg, dtype=torch.float64)


@pytest.mark.parametrize("kind", ["longrope", "dynamic"])
def test_greedy_medusa_equals_plain_greedy_across_rotary_table_changes(kind):
    # The 6-token prompt grows past 12 positions: longrope switches its factors (plain greedy then recomputes the
    # sequence), dynamic NTK changes its table at every length past 12.
    for seed in range(4):
        base = _rotary_switch_base(kind, seed)
        model = MedusaModel.from_base(base, num_heads=3)
        for k in range(3):
            model.heads[k][0].linear.bias.data.zero_()
        prompt = torch.randint(3, 50, (1, 6))
        plain = base.generate(prompt, max_new_tokens=16, eos_token_id=[])
        assert torch.equal(model.generate(prompt, max_new_tokens=16, eos_token_id=[]), plain), seed


def test_eos_defaults_to_the_config_like_plain_generate():
    base = make_base(V, H, torch.float64, layers=1)
    heads = MedusaModel.from_base(base, num_heads=2).heads
    prompt = torch.randint(3, V, (1, 4))
    base.config.eos_token_id = int(base.generate(prompt, max_new_tokens=12, eos_token_id=[])[0, 4 + 2])
    plain = base.generate(prompt, max_new_tokens=12)  # stops at the config's EOS
    assert plain.shape[1] < 4 + 12
    assert torch.equal(medusa_generate(base, heads, prompt, 12), plain)


def test_eos_stops_like_plain_greedy():
    base = make_base(V, H, torch.float64, layers=1)
    heads = MedusaModel.from_base(base, num_heads=2).heads
    prompt = torch.randint(3, V, (1, 4))
    plain = base.generate(prompt, max_new_tokens=12, eos_token_id=[])
    eos = int(plain[0, 4 + 3])  # the 4th generated token acts as EOS
    first = (plain[0, 4:] == eos).nonzero()[0].item()
    out = medusa_generate(base, heads, prompt, 12, eos_token_id=eos)
    assert torch.equal(out, plain[:, : 4 + first + 1])


def test_sampling_is_reproducible_and_bad_inputs_raise():
    base = make_base(V, H, torch.float64)
    heads = MedusaModel.from_base(base, num_heads=2).heads
    prompt = torch.randint(3, V, (1, 4))  # no pad id 0: that would be padding (test_decoding_padding.py)
    # EOS off: a sampled config EOS would end the sequence early (EOS handling has its own tests).
    sample = dict(temperature=0.8, eos_token_id=[])
    a = medusa_generate(base, heads, prompt, 10, **sample, generator=torch.Generator().manual_seed(1))
    b = medusa_generate(base, heads, prompt, 10, **sample, generator=torch.Generator().manual_seed(1))
    assert torch.equal(a, b) and a.shape == (1, 14) and a.max() < V
    with pytest.raises(ValueError, match="at least one token"):  # nothing to continue (an IndexError before)
        medusa_generate(base, heads, prompt[:, :0], 4)
    with pytest.raises(ValueError, match="temperature"):
        medusa_generate(base, heads, prompt, 4, temperature=-1.0)


def test_draw_follows_softmax_at_the_temperature():
    # The exponential race (acceptance.draw) against softmax(logits / T): 60000 draws of a 6-token row, every
    # frequency within 5 standard deviations; a token of probability 0 is never drawn; argmax at T = 0.
    from liger_models.medusa.acceptance import draw

    logits = torch.linspace(-2, 2, 6, dtype=torch.float64)[torch.randperm(6)] + 0.3 * torch.randn(6)
    logits[4] = float("-inf")  # spread apart, so that T = 1 is distinguishable from T = 0.6
    temperature, draws = 0.6, 60000
    generator = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    tokens = draw(logits.expand(draws, 6), temperature, generator)
    freq = torch.bincount(tokens, minlength=6).double() / draws
    p = torch.softmax(logits / temperature, -1)
    assert (freq - p).abs().max() <= 5 * (p * (1 - p) / draws).sqrt().max() + 1e-12 and freq[4] == 0
    wrong_t = torch.softmax(logits / 1.0, -1)  # the temperature is applied: T = 1 would be far off
    assert (freq - wrong_t).abs().max() > 10 * (p * (1 - p) / draws).sqrt().max()
    assert torch.equal(draw(logits.expand(3, 6), 0.0, None), logits.argmax().expand(3))
    again = draw(logits.expand(draws, 6), temperature, torch.Generator().manual_seed(generator.initial_seed()))
    assert torch.equal(again, tokens)  # the generator alone decides the draws


def test_a_generator_on_another_device_is_refused():
    base = make_base(V, H, torch.float64)
    heads = MedusaModel.from_base(base, num_heads=2).heads
    prompt = torch.randint(3, V, (1, 4))
    on_gpu = SimpleNamespace(device=torch.device("cuda", 0))  # a CUDA generator, which a CPU machine cannot build
    with pytest.raises(ValueError, match="generator is on cuda:0"):
        medusa_generate(base, heads, prompt, 4, temperature=0.7, generator=on_gpu)
    # greedy draws nothing; no stop ids, so a random model that emits its EOS id still runs the whole budget
    assert medusa_generate(base, heads, prompt, 4, eos_token_id=[], generator=on_gpu).shape == (1, 8)

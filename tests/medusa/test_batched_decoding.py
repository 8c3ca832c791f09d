"""Medusa decoding of several prompts at once (medusa/batched_steps.py): every row at its own length, greedy output
equal to plain batched generate's (each row's to its plain greedy decoding alone), eager and step-graphed alike.

On the CPU the graphed steps run eagerly (CAPTURE off); the GPU tests at the end capture and replay them."""

from types import SimpleNamespace

import pytest
import torch

from liger_models.medusa import MedusaModel
from liger_models.medusa.acceptance import accept
from liger_models.medusa.batched_steps import BatchedSteps, rows_capacity
from liger_models.medusa.decoding import dense_medusa_choices, generate_medusa_buffers, medusa_generate
from liger_models.modules import graphed_decoding
from liger_models.modules.graphed_decoding import StaticKVCache
from tests.medusa._common import make_base
from tests.medusa.test_decoding import _rotary_switch_base
from tests.models.test_graphed_decoding import _mistral
from tests.models.test_inference import left_padded

WIDTHS = [3, 2, 2]


@pytest.fixture
def eager_graphs(monkeypatch):
    monkeypatch.setattr(graphed_decoding, "CAPTURE", False)


class RowOracleHeads:
    """Stand-in heads that know each row's plain greedy continuation, in device ops only (a captured step calls
    them): a row's hidden state is matched to the nearest state of its own continuation, and head k ranks the true
    token k + 2 ahead at a random rank below WIDTHS[k] (or, with probability ``miss``, outside the top-k, where no
    tree has it), so rows accept deep trees along random branches, and different counts at each step."""

    def __init__(self, base, continuations: list[torch.Tensor], miss: float = 0.0):
        V, K = base.config.vocab_size, len(WIDTHS)
        self.config = SimpleNamespace(hidden_size=base.config.hidden_size, vocab_size=V)
        self.num_heads = K
        states, tables, rows = [], [], []
        for b, tokens in enumerate(continuations):  # tokens (1, T_b): a row's real tokens, prompt and continuation
            with torch.no_grad():
                states.append(base.model(tokens)[0])
            T = tokens.shape[1]
            table = torch.randn(T, K, V, dtype=torch.float64)
            for at in range(T - 2):
                for k in range(min(K, T - 2 - at)):
                    order = table[at, k].argsort(descending=True)
                    rank = torch.randint(0, WIDTHS[k], ()) if torch.rand(()) >= miss else torch.randint(4, V, ())
                    true, other = int(tokens[0, at + 2 + k]), int(order[rank])
                    table[at, k, true], table[at, k, other] = table[at, k, other].clone(), table[at, k, true].clone()
            tables.append(table)
            rows.append(torch.full((T,), b))
        device = continuations[0].device
        self.states, self.table = torch.cat(states), torch.cat(tables).to(device)
        self.row_of = torch.cat(rows).to(device)

    def logits(self, hidden: torch.Tensor, num_heads: int) -> torch.Tensor:
        distance = (self.states[None] - hidden[:, None]).abs().sum(-1)  # (B, all states)
        other_row = self.row_of[None] != torch.arange(len(hidden), device=hidden.device)[:, None]
        at = distance.masked_fill(other_row, float("inf")).argmin(-1)  # (B,)
        return self.table.index_select(0, at)[:, :num_heads].transpose(0, 1)  # (K, B, V)


def _rows_alone(base, ids, mask, new_tokens):
    """Each row's real prompt tokens continued by plain greedy decoding alone, (1, T_b + new_tokens) each."""
    return [base.generate(ids[b: b + 1, int((mask[b] == 0).sum()):], max_new_tokens=new_tokens, eos_token_id=[])
            for b in range(len(ids))]


def _decode(base, heads, ids, mask, new_tokens, **kwargs):
    return medusa_generate(base, heads, ids, new_tokens, attention_mask=mask, topk=3, return_stats=True,
                           medusa_choices=dense_medusa_choices(WIDTHS), **kwargs)


@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("graphed", [False, True])
def test_rows_decode_like_plain_batched_generate(eager_graphs, window, graphed):
    base = _mistral(window)
    ids, mask = left_padded(3, 7, [0, 2, 5])
    plain = base.generate(ids, attention_mask=mask, max_new_tokens=16, eos_token_id=[])
    alone = _rows_alone(base, ids, mask, 16)
    for b in range(3):
        assert torch.equal(plain[b, int((mask[b] == 0).sum()):], alone[b][0])
    out, steps = _decode(base, RowOracleHeads(base, alone), ids, mask, 16, eos_token_id=[], cuda_graph=graphed)
    assert torch.equal(out, plain)
    assert [sum(s) for s in steps] == [16] * 3
    assert all(max(s) == 4 and len(s) <= 8 for s in steps)  # deep trees accepted in every row
    # Heads that miss now and then: the rows accept different counts, so their lengths part.
    out, steps = _decode(base, RowOracleHeads(base, alone, miss=0.3), ids, mask, 16, eos_token_id=[],
                         cuda_graph=graphed)
    assert torch.equal(out, plain) and [sum(s) for s in steps] == [16] * 3
    assert len({tuple(s) for s in steps}) > 1 and max(max(s) for s in steps) > 1


@pytest.mark.parametrize("graphed", [False, True])
def test_a_row_that_stops_is_filled_while_the_others_go_on(eager_graphs, graphed):
    base = _mistral(None)
    ids, mask = left_padded(3, 6, [1, 0, 3])
    alone = _rows_alone(base, ids, mask, 14)
    heads = RowOracleHeads(base, alone)
    eos = int(alone[1][0, 6 + 3])  # row 1 stops after its 4th new token (or earlier, where that id came before)
    plain = base.generate(ids, attention_mask=mask, max_new_tokens=14, eos_token_id=eos, pad_token_id=0)
    out, steps = _decode(base, heads, ids, mask, 14, eos_token_id=eos, pad_token_id=0, cuda_graph=graphed)
    assert torch.equal(out, plain)
    assert sum(steps[1]) <= 4 and (out[1, 6 + sum(steps[1]):] == 0).all()
    # Every row stops: the output ends at the longest row, as plain generate's does.
    eos_all = [int(alone[b][0, -5]) for b in range(3)]
    plain = base.generate(ids, attention_mask=mask, max_new_tokens=14, eos_token_id=eos_all, pad_token_id=0)
    out, _ = _decode(base, heads, ids, mask, 14, eos_token_id=eos_all, pad_token_id=0, cuda_graph=graphed)
    assert torch.equal(out, plain) and out.shape[1] < 6 + 14


@pytest.mark.parametrize("share", [False, True])
def test_real_heads_on_unpadded_rows(share):
    base = make_base(37, 16, torch.float64, layers=2)
    model = MedusaModel.from_base(base, num_heads=3, share_lm_head=share)
    for k in range(3):  # heads that echo the base's next-token guess get accepted whenever the text repeats
        model.heads[k][0].linear.bias.data.zero_()
    prompts = torch.randint(3, 37, (4, 5))
    plain = base.generate(prompts, max_new_tokens=20, eos_token_id=[])
    out, steps = model.generate(prompts, max_new_tokens=20, eos_token_id=[], return_stats=True)
    assert torch.equal(out, plain) and [sum(s) for s in steps] == [20] * 4
    for b in range(4):
        assert torch.equal(out[b: b + 1], base.generate(prompts[b: b + 1], max_new_tokens=20, eos_token_id=[]))


def test_sampled_rows_reproducible_and_graphed_equals_eager(eager_graphs):
    base = _mistral(None)
    model = MedusaModel.from_base(base, num_heads=2)
    ids, mask = left_padded(2, 5, [0, 2])
    runs = [model.generate(ids, 12, attention_mask=mask, temperature=0.9, eos_token_id=[], cuda_graph=graphed,
                           generator=torch.Generator().manual_seed(3)) for graphed in (False, True, False)]
    assert torch.equal(runs[0], runs[1]) and torch.equal(runs[0], runs[2])
    assert runs[0].shape == (2, 17) and 0 <= int(runs[0].min()) and int(runs[0].max()) < 128
    assert torch.equal(runs[0][:, :5], ids)


def test_batched_acceptance_is_each_rows_own():
    # accept on (B, N) node tokens is accept on each row alone, greedy and typical, with ties and short paths.
    buffers = generate_medusa_buffers(dense_medusa_choices([3, 2, 2]), 3, topk=3)
    N, V = len(buffers.tree_indices), 6
    for temperature in (0.0, 0.7):
        tokens = torch.randint(0, V, (5, N))
        logits = torch.randn(5, N, V, dtype=torch.float64).round()  # rounded: ties in argmax and in scores
        logits[2] = logits[2].masked_fill(torch.rand(N, V) < 0.3, float("-inf"))
        rows, ns = accept(tokens, logits, buffers.path_nodes, buffers.path_valid, temperature, 0.3, 0.3)
        for b in range(5):
            row, n = accept(tokens[b], logits[b], buffers.path_nodes, buffers.path_valid, temperature, 0.3, 0.3)
            assert (int(rows[b]), int(ns[b])) == (int(row), int(n))


def test_static_cache_rows_write_and_keep_their_own_slots():
    cache = StaticKVCache(9)
    cache._allocate([(torch.zeros(3, 2, 1, 4),) * 2] * 2, [0, 1])
    reference = cache.buffer.clone()
    start = torch.tensor([0, 2, 4])
    cache.slots = start[:, None] + torch.arange(3)
    k, v = torch.randn(3, 2, 3, 4), torch.randn(3, 2, 3, 4)
    keys, values = cache.update(1, k, v)
    for b in range(3):
        s = int(start[b])
        reference[1, 0, b, :, s: s + 3], reference[1, 1, b, :, s: s + 3] = k[b], v[b]
    assert torch.equal(cache.buffer, reference) and keys.shape == (3, 2, 9, 4)
    keep = torch.tensor([[2, 0], [1, 2], [0, 1]])
    cache.keep_on_device(start, keep, torch.arange(2))
    for b in range(3):
        s = int(start[b])
        reference[..., b, :, s: s + 2, :] = reference[..., b, :, s + keep[b], :].clone()
    assert torch.equal(cache.buffer, reference)


def test_a_rotary_table_that_changes_with_the_length_is_refused_for_rows():
    base = _rotary_switch_base("longrope", 0)  # switches past 12 positions
    model = MedusaModel.from_base(base, num_heads=2)
    prompts = torch.randint(3, 50, (2, 4))
    with pytest.raises(ValueError, match="one at a time"):
        model.generate(prompts, max_new_tokens=10, eos_token_id=[])
    plain = base.generate(prompts, max_new_tokens=2, eos_token_id=[])  # positions up to 4 + 2 + 2 · depth 2: in
    assert torch.equal(model.generate(prompts, max_new_tokens=2, eos_token_id=[],
                                      medusa_choices=dense_medusa_choices([2, 2])), plain)


def test_the_rotary_check_counts_padded_rows_positions_not_their_slots():
    # 14 slots but, with 4+ pads per row, positions that end at 9: longrope's switch past 12 lies within the rows'
    # steps (plain generate's first steps rotate with the short table, a Medusa tree reaching past 12 with the
    # long one), so the rows are refused, although the slots are past the switch from the start.
    base = _rotary_switch_base("longrope", 0)
    model = MedusaModel.from_base(base, num_heads=2)
    mask = torch.ones(2, 14, dtype=torch.long)
    mask[0, :5], mask[1, :4] = 0, 0
    ids = torch.randint(3, 50, (2, 14)).masked_fill(mask == 0, 0)
    with pytest.raises(ValueError, match="one at a time"):
        model.generate(ids, 4, attention_mask=mask, eos_token_id=[])
    # Dynamic NTK past 12 positions: 14 slots, but every position these steps reach stays within 12, so the table
    # never changes and the rows decode as plain generate does them.
    base = _rotary_switch_base("dynamic", 0)
    model = MedusaModel.from_base(base, num_heads=2)
    mask[0, :8], mask[1, :9] = 0, 0
    ids = ids.masked_fill(mask == 0, 0)
    plain = base.generate(ids, attention_mask=mask, max_new_tokens=1, eos_token_id=[])
    assert torch.equal(model.generate(ids, 1, attention_mask=mask, eos_token_id=[],
                                      medusa_choices=dense_medusa_choices([2, 2])), plain)


@pytest.mark.parametrize("graphed", [False, True])
def test_eager_rows_take_no_step_past_the_last_eos(eager_graphs, monkeypatch, graphed):
    # Every row stops at its first token: eagerly that is one tree call; a step launched ahead (graphed: queued
    # before the read, CAPTURE off or on) is the only one that may be wasted.
    base = _mistral(None)
    model = MedusaModel.from_base(base, num_heads=2)
    ids, mask = left_padded(2, 5, [0, 2])
    first = base.generate(ids, attention_mask=mask, max_new_tokens=1, eos_token_id=[])[:, 5].tolist()
    calls = []
    step = BatchedSteps._step
    monkeypatch.setattr(BatchedSteps, "_step", lambda self: (calls.append(1), step(self))[1])
    out, steps = model.generate(ids, 12, attention_mask=mask, eos_token_id=first, return_stats=True,
                                cuda_graph=graphed)
    assert steps == [[1], [1]] and out[:, 5].tolist() == first and out.shape == (2, 6)
    assert len(calls) == (2 if graphed else 1)


def test_steps_stay_inside_the_cache_whatever_the_rows_accept(eager_graphs):
    # One row accepts every tree (the oracle), the other never (its heads are wrong): rows_capacity's bound holds
    # for the fast row's overshoot and the slow row's frozen trees after it is done.
    base = _mistral(None).requires_grad_(False)
    prompts = torch.randint(3, 128, (2, 4))
    alone = [base.generate(prompts[b: b + 1], max_new_tokens=9, eos_token_id=[]) for b in range(2)]
    heads = RowOracleHeads(base, [alone[0], alone[1].flip(1)])  # row 1's continuation reversed: nothing accepted
    buffers = generate_medusa_buffers(dense_medusa_choices(WIDTHS), 3, 3)
    capacity = rows_capacity(4, 9, buffers)
    steps = BatchedSteps(base, heads, buffers, 3, capacity, (0.0, 0.09, 0.3), None, batch=2, budget=9, eos=[],
                         graphed=True)
    steps.prefill(prompts, None)
    for _ in range(12):
        steps.tree()
    assert steps.done.all() and int((steps.length + len(buffers.tree_indices)).max()) <= capacity


@pytest.mark.gpu
@pytest.mark.parametrize("window", [None, 2])
def test_graphed_rows_decode_like_plain_batched_generate_on_gpu(window):
    base = _mistral(window, torch.float32, "cuda")
    ids, mask = (t.cuda() for t in left_padded(3, 7, [0, 2, 5]))
    plain = base.generate(ids, attention_mask=mask, max_new_tokens=16, eos_token_id=[])
    alone = _rows_alone(base, ids, mask, 16)
    eos = int(alone[2][0, 2 + 6])
    plain = base.generate(ids, attention_mask=mask, max_new_tokens=16, eos_token_id=eos, pad_token_id=0)
    out, steps = _decode(base, RowOracleHeads(base, alone), ids, mask, 16, eos_token_id=eos, pad_token_id=0,
                         cuda_graph=True)
    assert torch.equal(out, plain)
    assert max(max(s) for s in steps) == 4

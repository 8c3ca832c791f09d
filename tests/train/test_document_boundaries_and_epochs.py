"""Data edge cases of liger_models/train/{data,packing}.py: exactly one EOS per plain document when the tokenizer
adds it, documents without tokens skipped (at the end too), a new shuffle every epoch."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tokenizers import processors

from liger_models.train.data import (BatchStream, Document, SpecialTokens, pack_documents, tokenize_chunk,
                                     train_bpe_tokenizer)

from tests.helpers import EOS, shakespeare


@pytest.fixture(scope="module")
def eos_appending_tokenizer():
    """A tokenizer whose post-processor closes every text with EOS itself (as many HF tokenizers do)."""
    tok = train_bpe_tokenizer(shakespeare(20_000).splitlines(), vocab_size=280, eos_token=EOS)
    eos_id = tok.token_to_id(EOS)
    tok.post_processor = processors.TemplateProcessing(single=f"$A {EOS}", special_tokens=[(EOS, eos_id)])
    return tok


def test_plain_documents_get_exactly_one_eos_when_the_tokenizer_adds_it(eos_appending_tokenizer):
    """EOS is appended only when the post-processor has not already put one there: a second EOS would teach the
    model EOS → EOS and shift every later document's tokens by one."""
    tok = eos_appending_tokenizer
    eos_id = tok.token_to_id(EOS)
    special = SpecialTokens(eos_id=eos_id, eos_text=EOS)
    text = shakespeare(20_000)
    starts = torch.randint(0, 19_000, (3,)).tolist()
    docs = [Document(text[s: s + int(torch.randint(20, 300, ()))]) for s in starts]
    ids, mask, lengths = tokenize_chunk(docs, tok, special)
    bounds = np.cumsum(lengths)
    for doc, end, n in zip(docs, bounds, lengths):
        body = ids[end - n: end]
        assert body[-1] == eos_id and body[-2] != eos_id
        assert (body == eos_id).sum() == 1
        assert tok.decode(body[:-1].tolist()) == doc.text
    assert mask.all() and ids.size == int(bounds[-1])


def test_documents_without_tokens_are_skipped_even_at_the_end():
    """An empty document has no start: one at the end of the list (after filtering, a document that tokenized to
    nothing) must not put a boundary past the stream, nor change the windows."""
    n = int(torch.randint(5, 12, ()))
    seq_len = int(torch.randint(2, 5, ()))
    a = torch.randint(0, 50, (n,)).tolist()
    total = n + n // 2
    b = torch.randint(0, 50, (total - n,)).tolist()
    # Lengths chosen so the stream fills its windows exactly (the case with no padding after it).
    pad = -total % seq_len
    b += torch.randint(0, 50, (pad,)).tolist()
    docs = [(a, [True] * len(a)), (b, [True] * len(b))]
    ref = pack_documents(docs, seq_len)
    got = pack_documents(docs + [([], [])], seq_len)
    for x, y in zip((got.input_ids, got.labels, got.position_ids), (ref.input_ids, ref.labels, ref.position_ids)):
        assert torch.equal(x, y)


def test_batch_stream_reshuffles_every_epoch():
    """Each epoch is its own seeded permutation: replaying epoch 0's order forever would make every epoch see the
    windows (and the same batch compositions) in the same order."""
    n, seq_len = 13, 3
    ds = pack_documents([(list(range(n * seq_len)), [True] * (n * seq_len))], seq_len)
    stream = BatchStream(ds, 1, seed=int(torch.randint(0, 1000, ())))
    orders = [[int(stream.next_batch()["input_ids"][0, 0]) // seq_len for _ in range(n)] for _ in range(3)]
    for order in orders:
        assert sorted(order) == list(range(n))  # still a permutation of all windows
    # Three equal permutations of 13 windows by chance: probability 1/13!² — far below any flake budget.
    assert not (orders[0] == orders[1] == orders[2])

"""The tokenized-data cache: a hit equals a miss, every key ingredient changing misses, damaged files are rebuilt,
and the training recipes put it in <output_dir>/.data_cache (rank 0 writing it under torchrun)."""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import warnings

import pytest
import torch
from tokenizers import Tokenizer

import liger_models.train.dataset as data_module
from liger_models.train import data_cache
from liger_models.train.data import build_dataset, read_special_tokens, save_tokenizer, train_bpe_tokenizer

from tests.helpers import EOS, run_two_ranks, shakespeare

CHAT = [{"role": "user", "content": "Who goes there?"}, {"role": "assistant", "content": "A friend, good sir."}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("tok")
    save_tokenizer(train_bpe_tokenizer(shakespeare(20_000).splitlines(), vocab_size=300, eos_token=EOS), out, EOS)
    return out


@pytest.fixture
def setup(model_dir, tmp_path):
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    special = read_special_tokens(tokenizer, model_dir)
    text = tmp_path / "a.txt"
    text.write_text(shakespeare(4_000))
    chat = tmp_path / "b.jsonl"
    chat.write_text(json.dumps({"messages": CHAT}) + "\n" + json.dumps({"text": "plain"}) + "\n")
    return tokenizer, special, [text, chat]


def _tensors(ds):
    return ds.input_ids, ds.labels, ds.position_ids


def _assert_same(a, b):
    for x, y in zip(_tensors(a), _tensors(b)):
        assert x.dtype == y.dtype == torch.int32 and torch.equal(x, y)


def _no_tokenizing(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("tokenized although the cache holds the data")

    monkeypatch.setattr(data_module, "_tokenize_and_pack", refuse)


def test_hit_equals_miss_and_skips_tokenizing(setup, tmp_path, monkeypatch):
    tokenizer, special, paths = setup
    cache = tmp_path / "cache"
    plain = build_dataset(paths, tokenizer, special, 16, "simple")
    miss = build_dataset(paths, tokenizer, special, 16, "simple", cache_dir=cache)
    [entry] = list(cache.iterdir())  # one file, no temporary left behind
    assert entry.suffix == ".safetensors"
    _no_tokenizing(monkeypatch)
    hit = build_dataset(paths, tokenizer, special, 16, "simple", cache_dir=cache)
    _assert_same(plain, miss)
    _assert_same(plain, hit)
    assert hit.batch(torch.tensor([1, 0]))["labels"].dtype == torch.int64  # used like a fresh one


def test_every_key_ingredient_changes_the_key(setup, tmp_path, monkeypatch):
    tokenizer, special, paths = setup
    base = dict(paths=paths, tokenizer_json=tokenizer.to_str(), special=dataclasses.asdict(special),
                chat_template="auto", seq_len=16)
    keys = {data_cache.dataset_key(**base)}
    assert data_cache.dataset_key(**base) in keys  # deterministic

    def variant(**change):
        keys.add(data_cache.dataset_key(**{**base, **change}))
        return len(keys)

    edited = tmp_path / "edited.txt"
    edited.write_text(paths[0].read_text() + " ")
    grown = Tokenizer.from_str(tokenizer.to_str())
    grown.add_special_tokens(["<|new|>"])
    renamed = tmp_path / "a.jsonl"  # the same bytes read as another format
    renamed.write_bytes(paths[0].read_bytes())
    changes = [
        dict(paths=[edited, paths[1]]),
        dict(paths=[paths[1], paths[0]]),
        dict(paths=[renamed, paths[1]]),
        dict(tokenizer_json=grown.to_str()),
        dict(special={**base["special"], "eos_id": base["special"]["eos_id"] + 1}),
        dict(special={**base["special"], "chat_template": "{{ messages }}"}),
        dict(chat_template="simple"),
        dict(seq_len=17),
    ]
    for n, change in enumerate(changes, 2):
        assert variant(**change) == n, change
    monkeypatch.setattr(data_cache, "FORMAT_VERSION", data_cache.FORMAT_VERSION + 1)
    assert variant() == len(changes) + 2


def test_changed_data_file_misses(setup, tmp_path):
    tokenizer, special, paths = setup
    cache = tmp_path / "cache"
    build_dataset(paths, tokenizer, special, 16, cache_dir=cache)
    paths[0].write_text(shakespeare(2_000))
    fresh = build_dataset(paths, tokenizer, special, 16)
    _assert_same(build_dataset(paths, tokenizer, special, 16, cache_dir=cache), fresh)
    assert len(list(cache.iterdir())) == 2


def _truncate(path):
    path.write_bytes(path.read_bytes()[:-100])


def _flip_data_byte(path):
    raw = bytearray(path.read_bytes())
    raw[-5] ^= 0x40
    path.write_bytes(bytes(raw))


def _garbage(path):
    path.write_bytes(b"\xff" * 64)


def _empty(path):
    path.write_bytes(b"")


@pytest.mark.parametrize("damage", [_truncate, _flip_data_byte, _garbage, _empty])
def test_damaged_cache_file_is_rebuilt_not_trusted(setup, tmp_path, damage):
    tokenizer, special, paths = setup
    cache = tmp_path / "cache"
    good = build_dataset(paths, tokenizer, special, 16, cache_dir=cache)
    [entry] = list(cache.iterdir())
    damage(entry)
    with pytest.warns(UserWarning, match="unusable"):
        rebuilt = build_dataset(paths, tokenizer, special, 16, cache_dir=cache)
    _assert_same(rebuilt, good)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # rewritten whole: the next load trusts it
        _assert_same(build_dataset(paths, tokenizer, special, 16, cache_dir=cache), good)


def test_file_of_another_key_is_not_trusted(setup, tmp_path):
    tokenizer, special, paths = setup
    cache = tmp_path / "cache"
    build_dataset(paths, tokenizer, special, 16, cache_dir=cache)
    [entry] = list(cache.iterdir())
    with pytest.warns(UserWarning, match="another key"):
        assert data_cache.load(entry, "0" * 64) is None


def _train_config(model_dir, data, out, *extra):
    from liger_models.cli import build_parser
    from liger_models.recipes.configs import FinetuneConfig

    argv = ["train", "--model", str(model_dir), "--data", str(data), "--output-dir", str(out), "--seq-len", "16"]
    return FinetuneConfig.from_args(build_parser().parse_args(argv + list(extra)))


def test_recipes_cache_under_output_dir_by_default(setup, model_dir, tmp_path, monkeypatch):
    from liger_models.recipes.training import data as _data
    from liger_models.train import distributed as D

    _, _, paths = setup
    stream, _ = _data(_train_config(model_dir, paths[0], tmp_path / "run"), model_dir, 300, D.DistInfo())
    assert len(list((tmp_path / "run" / ".data_cache").glob("*.safetensors"))) == 1
    _data(_train_config(model_dir, paths[0], tmp_path / "other", "--data-cache", str(tmp_path / "dc")),
          model_dir, 300, D.DistInfo())
    assert len(list((tmp_path / "dc").glob("*.safetensors"))) == 1 and not (tmp_path / "other").exists()
    _data(_train_config(model_dir, paths[0], tmp_path / "none", "--no-data-cache"), model_dir, 300, D.DistInfo())
    assert not (tmp_path / "none").exists()
    _no_tokenizing(monkeypatch)
    again, _ = _data(_train_config(model_dir, paths[0], tmp_path / "run"), model_dir, 300, D.DistInfo())
    _assert_same(again.dataset, stream.dataset)
    with pytest.raises(ValueError, match="contradict"):
        _train_config(model_dir, paths[0], tmp_path, "--data-cache", "x", "--no-data-cache").validate()


RANK_SCRIPT = """
import json, os, sys
import liger_models.train.dataset as data
from liger_models.cli import build_parser
from liger_models.train import distributed as D
from liger_models.recipes.configs import FinetuneConfig
from liger_models.recipes.training import data as _data

tokenized = []
real = data._tokenize_and_pack
data._tokenize_and_pack = lambda *a, **k: tokenized.append(1) or real(*a, **k)
info = D.init_distributed("cpu")
args = build_parser().parse_args(["train", "--model", sys.argv[1], "--data", sys.argv[2], "--output-dir", sys.argv[3],
                                  "--seq-len", "16"])
stream, _ = _data(FinetuneConfig.from_args(args), sys.argv[1], 300, info)
ids = stream.dataset.input_ids
with open(os.path.join(sys.argv[3], f"rank{info.rank}.json"), "w") as f:
    json.dump({"tokenized": len(tokenized), "sum": int(ids.long().sum()), "shape": list(ids.shape)}, f)
D.destroy_distributed()
"""


def test_torchrun_rank0_tokenizes_and_the_other_loads(setup, model_dir, tmp_path):
    _, _, paths = setup
    script = tmp_path / "ranks.py"
    script.write_text(RANK_SCRIPT)
    out = tmp_path / "out"
    out.mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run_two_ranks([str(script), str(model_dir), str(paths[0]), str(out)], env, timeout=180)
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    assert [r["tokenized"] for r in ranks] == [1, 0]
    assert ranks[0]["sum"] == ranks[1]["sum"] and ranks[0]["shape"] == ranks[1]["shape"]


@pytest.mark.parametrize("blocked", ["file_in_the_way", "disk_full"])
def test_a_cache_that_cannot_be_written_costs_no_run(setup, tmp_path, monkeypatch, blocked):
    """The cache only saves time: a --data-cache path that cannot take the file used to fail the run with a bare
    OSError after all the tokenizing, the data built and in memory; now a warning, and the data as without a cache."""
    tokenizer, special, paths = setup
    if blocked == "file_in_the_way":
        (tmp_path / "taken").write_text("not a directory")
        cache = tmp_path / "taken" / "cache"
    else:
        cache = tmp_path / "full"

        def no_space(tensors, filename, metadata=None):  # part of the file, then the disk is full
            with open(filename, "wb") as f:
                f.write(b"\0" * 100)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), filename)

        monkeypatch.setattr(data_cache, "save_file", no_space)
    seq_len = int(torch.randint(8, 24, ()))
    with pytest.warns(UserWarning, match="cannot take the tokenized data"):
        got = build_dataset(paths, tokenizer, special, seq_len, "simple", cache_dir=cache)
    _assert_same(got, build_dataset(paths, tokenizer, special, seq_len, "simple"))
    assert not cache.exists() or list(cache.iterdir()) == []  # no temporary left behind

"""Training data with fewer windows than one micro-batch: every micro-batch repeats them. The run goes on (memorising
a small text is a fair test of a setup) and says so with the numbers: windows, --seq-len, tokens to predict, the
micro-batch's sequences."""

from __future__ import annotations

import warnings

import pytest

from liger_models.cli import main
from liger_models.train.data import BatchStream, pack_documents

pytestmark = pytest.mark.usefixtures("reference_path")


def _dataset(tokens: int, seq_len: int):
    return pack_documents([(list(range(1, tokens + 1)), [True] * tokens)], seq_len)


def test_data_shorter_than_one_sequence_is_reported_with_its_numbers():
    with pytest.warns(UserWarning) as caught:
        BatchStream(_dataset(300, 1024), batch_size=8)
    message = str(caught[0].message)
    assert ("the training data fits in one sequence of --seq-len 1024 (299 tokens to predict), fewer than the 8 of "
            "one micro-batch: every micro-batch repeats it") in message
    assert "a smaller --seq-len" in message


def test_fewer_windows_than_a_micro_batch_across_ranks():
    dataset = _dataset(5 * 64, 64)  # five full windows, each predicting 63 tokens
    with pytest.warns(UserWarning, match=r"fills 5 sequences of --seq-len 64 \(315 tokens to predict\), fewer than "
                                         r"the 8 of one micro-batch: every micro-batch repeats them"):
        BatchStream(dataset, batch_size=4, rank=0, world_size=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        BatchStream(dataset, batch_size=4, rank=1, world_size=2)  # said once, by rank 0
        BatchStream(dataset, batch_size=5)  # a micro-batch of distinct windows: nothing to say
        BatchStream(_dataset(1024, 1024), batch_size=1)  # one full window, one per micro-batch


def test_the_cli_trains_on_a_short_text_and_says_so(tiny_model_dir, tmp_path):
    data = tmp_path / "short.txt"
    data.write_text("To be, or not to be, that is the question.", encoding="utf-8")
    with pytest.warns(UserWarning, match=r"the training data fits in one sequence of --seq-len 1024 \(\d+ tokens to "
                                         r"predict\), fewer than the 8 of one micro-batch"):
        assert main(["train", "--model", str(tiny_model_dir), "--data", str(data), "--output-dir",
                     str(tmp_path / "out"), "--max-steps", "2", "--quiet", "--no-data-cache", "--device", "cpu"]) == 0

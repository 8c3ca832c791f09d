"""Checks of a model call's inputs, each error naming the argument, what it got and what was expected.

Without them a bad input surfaces far from its cause: a token id outside the vocabulary is an IndexError inside the
embedding on the CPU and a device-side assert on CUDA (which leaves the process's CUDA context unusable); wrongly
shaped position_ids fail in an ``expand`` or in the rotary kernel; a float attention_mask is read as ``mask != 0``,
so an additive mask (0 / -inf) hides exactly the tokens it meant to keep. ``DecoderModel.forward`` runs
:func:`check_forward_inputs`; ``generate`` and Medusa decoding check their prompt with :func:`check_input_ids` and
then skip the per-call read for the tokens they chose themselves (:func:`checks_its_own_token_ids`).

Shapes and dtypes cost nothing to check. The id range needs the ids' minimum and maximum on the host: one small
reduction, a device sync on CUDA, so it is skipped where no value can be read: while torch.compile traces (the
compiled graph would break there), while a CUDA graph is captured (a sync is illegal then; the captured call
replays inputs copied into its static buffers, which the capturer checks) and on the meta device.

Labels are checked by shape and dtype only: their values (in [0, vocab) or the ignore index) are checked by the loss
itself (kernels/ops/_labels.py ``LabelCheck``), on the device without stalling it, before any logit is read.
"""

from __future__ import annotations

import contextlib
import functools

import torch

# What nn.Embedding (and the loss kernels, for labels) index with.
ID_DTYPES = (torch.int64, torch.int32)
# Depth of the blocks running now whose ids were checked up front (token_ids_checked_already): their forward
# calls skip the id range read.
_OWN_IDS = [0]


@contextlib.contextmanager
def token_ids_checked_already():
    """Within this block forward calls skip the id range read: for loops whose ids were checked once up front (a
    decoding loop's prompt, then the model's own tokens; a training run's dataset, checked when it was built), so
    a CUDA step never waits for the device to finish the previous one (one sync per call would serialise the
    host's launches with the GPU's work)."""
    _OWN_IDS[0] += 1
    try:
        yield
    finally:
        _OWN_IDS[0] -= 1


def checks_its_own_token_ids(decode):
    """Decorator for a decoding loop that checks its prompt itself (``check_input_ids``) and then feeds the model
    only tokens the model chose: its forward calls run in ``token_ids_checked_already``."""

    @functools.wraps(decode)
    def wrapper(*args, **kwargs):
        with token_ids_checked_already():
            return decode(*args, **kwargs)

    return wrapper


def _integral(t: torch.Tensor) -> bool:
    return not (t.is_floating_point() or t.is_complex() or t.dtype == torch.bool)


def values_readable(t: torch.Tensor) -> bool:
    """Whether reading ``t``'s values on the host is possible now (module docstring)."""
    if t.is_meta or torch.compiler.is_compiling():
        return False
    return not (t.is_cuda and torch.cuda.is_current_stream_capturing())


def check_input_ids(input_ids: torch.Tensor, vocab_size: int) -> None:
    """input_ids: int64 / int32 token ids in [0, vocab_size), with one host read of their range (module docstring)."""
    if not isinstance(input_ids, torch.Tensor):
        raise TypeError(f"input_ids must be a tensor of token ids, got {type(input_ids).__name__}")
    if input_ids.dtype not in ID_DTYPES:
        raise ValueError(f"input_ids must be int64 (or int32) token ids, got dtype {input_ids.dtype}")
    if input_ids.numel() == 0 or not values_readable(input_ids):
        return
    low, high = torch.stack(torch.aminmax(input_ids)).tolist()  # one device sync, not two
    if low < 0 or high >= vocab_size:
        bad = low if low < 0 else high
        raise ValueError(f"input_ids hold token id {bad}, outside the model's vocabulary [0, vocab_size={vocab_size})"
                         " (a tokenizer that does not match the checkpoint, or a pad id such as -100 / -1?)")


def check_position_ids(position_ids: torch.Tensor, input_ids: torch.Tensor) -> None:
    """position_ids: integer positions of shape (batch, seq_len) or (1, seq_len) (one row for every sequence), on
    input_ids' device."""
    B, T = input_ids.shape
    if not isinstance(position_ids, torch.Tensor):
        raise TypeError(f"position_ids must be a tensor, got {type(position_ids).__name__}")
    if position_ids.dim() != 2 or position_ids.shape[1] != T or position_ids.shape[0] not in (1, B):
        raise ValueError(f"position_ids must be (batch, seq_len) = {(B, T)} or (1, {T}) for input_ids of shape "
                         f"{(B, T)}, got shape {tuple(position_ids.shape)}")
    if not _integral(position_ids):
        raise ValueError(f"position_ids must be integer positions, got dtype {position_ids.dtype}")
    _check_device("position_ids", position_ids, input_ids)


def _reads_as_0_1(mask: torch.Tensor) -> bool:
    if mask.dim() != 2:
        return False  # the shape error is raised where the mask is read
    return bool((((mask == 0) | (mask == 1)).all() & (mask == 1).any(dim=-1).all()))


def check_attention_mask(attention_mask: torch.Tensor, input_ids: torch.Tensor) -> None:
    """attention_mask: HF's 2-D padding mask, 1 (or True) at real tokens, as integers, bools or floats, on input_ids'
    device. Its shape, which depends on the cache's length, is checked where the mask is read (decoder.key_padding).

    A float mask is taken when every value is 0 or 1 (PEFT's prompt learning concatenates a float ones mask for its
    virtual tokens, and HF reads 2-D float masks as 0/1); that costs one read of the values, only for float masks.
    Any other float mask may be additive (0 / -inf), which would read inverted, so it is refused; so is one with a row
    of zeros only, which as an additive mask would mean "attend to everything" instead of "all padding"."""
    if not isinstance(attention_mask, torch.Tensor):
        raise TypeError(f"attention_mask must be a tensor, got {type(attention_mask).__name__}")
    if attention_mask.is_complex() or (attention_mask.is_floating_point() and not _reads_as_0_1(attention_mask)):
        raise ValueError(f"attention_mask must be HF's 0/1 padding mask, got dtype {attention_mask.dtype} with values "
                         "other than 0 and 1 or a row of zeros only: a float mask may be additive (0 / -inf), which "
                         "would read inverted; pass mask.long() of a 0/1 mask")
    _check_device("attention_mask", attention_mask, input_ids)


def check_forward_inputs(input_ids: torch.Tensor, vocab_size: int, position_ids: torch.Tensor | None = None,
                         attention_mask: torch.Tensor | None = None) -> None:
    """Everything a decoder forward call is given, checked before any of it is used."""
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
        shape = tuple(input_ids.shape) if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__
        raise ValueError(f"input_ids must be (batch, seq_len), got shape {shape} "
                         "(a single sequence needs a batch dim: ids[None])")
    if position_ids is not None:
        check_position_ids(position_ids, input_ids)
    if attention_mask is not None:
        check_attention_mask(attention_mask, input_ids)
    if _OWN_IDS[0]:  # a decoding loop's own tokens (checks_its_own_token_ids): the dtype only, no device read
        if input_ids.dtype not in ID_DTYPES:
            raise ValueError(f"input_ids must be int64 (or int32) token ids, got dtype {input_ids.dtype}")
        return
    check_input_ids(input_ids, vocab_size)  # last: the one check that may wait for the device


def check_labels(labels: torch.Tensor, shape: tuple[int, int], device: torch.device) -> None:
    """labels: HF-aligned with the inputs (their (batch, seq_len) ``shape``, from input_ids or inputs_embeds; -100
    where no loss), int64 / int32, on the inputs' ``device``. Their values are the loss's to check (module
    docstring)."""
    if not isinstance(labels, torch.Tensor):
        raise TypeError(f"labels must be a tensor of token ids, got {type(labels).__name__}")
    if tuple(labels.shape) != tuple(shape):
        raise ValueError(f"labels must have the inputs' (batch, seq_len) shape {tuple(shape)} (HF-aligned: "
                         f"labels[:, t] is input_ids[:, t], -100 where no loss; the model shifts them), got shape "
                         f"{tuple(labels.shape)}")
    if labels.dtype not in ID_DTYPES:
        raise ValueError(f"labels must be int64 (or int32) token ids (-100 where no loss), got dtype {labels.dtype}")
    if labels.device != device:
        raise ValueError(f"labels is on {labels.device}, the inputs on {device}: pass them on one device")


def _check_device(name: str, tensor: torch.Tensor, input_ids: torch.Tensor) -> None:
    if tensor.device != input_ids.device:
        raise ValueError(f"{name} is on {tensor.device}, input_ids on {input_ids.device}: pass them on one device")

"""Plain autoregressive generation with a KV cache: greedy, or sampling with temperature / top-k / top-p.

Prompts of different lengths come left-padded with an ``attention_mask`` (HF convention); without one, as HF does,
the mask is inferred from an explicit pad_token_id (argument or config) found in the prompt, unless it is an EOS id.
Then, like HF, positions are cumsum(mask) − 1 (0 at padding) and padded keys are hidden; unpadded rows get exactly
the tokens they get alone. A row that emitted an EOS token is filled with the pad id (argument, else the
checkpoint's: generation_config.json's if it has that file, else config.json's, as HF; else its first EOS id) until
every row is done or ``max_new_tokens`` is reached.
When the rotary table for cached positions would change (longrope crossing original_max_position_embeddings), the
cache is dropped and the whole sequence is recomputed, as HF's Phi3 does.
``cuda_graph=True`` replays every one-token step as a CUDA graph (modules/graphed_decoding.py): a batch-1 step is
otherwise bound by the host issuing ~200 kernels (Llama-3.2-1B on an H200: 11–16 → 1.2–1.3 ms per token).

Sampling settings left out (None) are taken as HF's generate takes them: from the checkpoint's
generation_config.json (Llama 3 Instruct's says do_sample true, temperature 0.6, top_p 0.9, max_length 4096), else
HF's global defaults (greedy; when sampling, temperature 1, top_k 50, no top-p). Arguments always win: pass
do_sample=False for greedy, top_k=0 for no top-k. The length is max_new_tokens, else the file's max_new_tokens, else
its max_length minus the prompt length (HF's rule), else 32 (ours; HF's global max_length 20 counts the prompt). The
file's other settings (repetition_penalty, min_p, num_beams, …) are not implemented and are ignored. Sampling with
generator=None draws from torch's global generator, as HF does: the same seed gives HF's tokens.
"""

from __future__ import annotations

import numbers
from collections import deque

import torch

from .cache import KVCache


# HF's global defaults (GenerationConfig._get_default_generation_params) for what neither the caller nor the
# checkpoint's generation_config.json sets; max_new_tokens is ours (HF's max_length 20 includes the prompt).
SAMPLING_DEFAULTS = {"do_sample": False, "temperature": 1.0, "top_k": 50, "top_p": 1.0}
DEFAULT_MAX_NEW_TOKENS = 32
# KV slots reserved up front for new tokens: a budget taken from a checkpoint's max_length (4096 or more) would
# otherwise preallocate it all even when an EOS comes after a few tokens; past this the cache grows by doubling.
PREALLOCATED_NEW_TOKENS = 1024


def warp_logits(logits: torch.Tensor, temperature: float = 1.0, top_k: int | None = None,
                top_p: float | None = None) -> torch.Tensor:
    """(B, V) float logits with temperature, then top-k, then top-p applied as HF's warpers do (filtered: -inf)."""
    if not temperature > 0:  # not `<= 0`: NaN would pass and fail later as NaN probabilities in multinomial
        raise ValueError(f"temperature must be > 0 when sampling, got {temperature}")
    if top_k is not None and top_k < 0:
        raise ValueError(f"top_k must be >= 0 (0: no top-k filtering), got {top_k}")
    if top_p is not None and not 0 <= top_p <= 1:
        raise ValueError(f"top_p must be in [0, 1], got {top_p}")
    logits = logits / temperature
    if top_k and top_k < logits.shape[-1]:  # None or 0: no top-k filtering (HF's convention for 0)
        kth = logits.topk(top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        # TopPLogitsWarper's exact rule and arithmetic: ascending order, drop a token when the mass of the tokens
        # up to it (itself included) is <= 1 - top_p, always keep the most likely one. "The mass above it is
        # > top_p" is the same set in exact arithmetic but keeps one token more when the sums meet exactly.
        sorted_logits, order = logits.sort(dim=-1, descending=False)
        drop = sorted_logits.softmax(-1).cumsum(-1) <= 1 - top_p
        drop[..., -1] = False
        logits = logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    return logits


def sample_next(logits: torch.Tensor, *, do_sample: bool = False, temperature: float = 1.0, top_k: int | None = None,
                top_p: float | None = None, generator: torch.Generator | None = None) -> torch.Tensor:
    """Next token ids (B,) from last-position logits (B, V): argmax, or a draw after ``warp_logits``."""
    logits = logits.float()
    if not do_sample:
        return logits.argmax(-1)
    probs = warp_logits(logits, temperature, top_k, top_p).softmax(-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def checkpoint_generation_config(model) -> dict:
    """The model's generation_config.json as loaded ({} when the checkpoint has none)."""
    return getattr(model, "generation_config", None) or {}


def default_token_id(model, key: str):
    """``key`` (eos_token_id, pad_token_id) as HF's generate defaults it. A checkpoint with a generation_config.json
    takes the value from that file alone (Llama 3 Instruct's lists <|eot_id|> there, its config.json only
    <|end_of_text|>): HF loads its GenerationConfig from the file and never looks at config.json's ids then, so a
    key the file lacks is None (no EOS stop; pad = the first EOS). Without the file, config.json's value."""
    generation_config = checkpoint_generation_config(model)
    if generation_config:
        return generation_config.get(key)
    return getattr(getattr(model, "config", None), key, None)


def _integral(t: torch.Tensor) -> bool:
    return not (t.is_floating_point() or t.is_complex() or t.dtype == torch.bool)


def token_id_list(ids, name: str) -> list[int]:
    """One id or several as a list of ints. Like HF's generate, a numpy integer or a (0-d) tensor is accepted too
    (e.g. an id read back from a tensor of tokens); anything not integral is named."""
    flat = torch.as_tensor(ids).flatten()
    if flat.numel() == 0:  # [] (no stop ids) becomes a float tensor: not an error
        return []
    if not _integral(flat):
        raise ValueError(f"{name} must be an integer token id or a list of them, got {ids!r}")
    return [int(i) for i in flat.tolist()]


def pad_token(model, pad_token_id) -> int | None:
    """The pad id: the argument (an int, numpy or tensor scalar), else the checkpoint's default; None if neither."""
    pad = default_token_id(model, "pad_token_id") if pad_token_id is None else pad_token_id
    if pad is None:
        return None
    (pad,) = token_id_list(pad, "pad_token_id")
    return pad


def eos_token_ids(model, eos_token_id: int | list[int] | None) -> list[int]:
    """The stop ids: the argument (one id or several), else the checkpoint's default (`default_token_id`)."""
    eos = default_token_id(model, "eos_token_id") if eos_token_id is None else eos_token_id
    return [] if eos is None else token_id_list(eos, "eos_token_id")


def check_input_ids(input_ids: torch.Tensor, vocab_size: int) -> None:
    """Refuse ids the embedding cannot look up: on the CPU an IndexError deep inside the model, on CUDA a
    device-side assert that leaves the process's CUDA context unusable (e.g. a tokenizer with added tokens and
    an embedding that was never resized)."""
    if not _integral(input_ids):
        raise ValueError(f"input_ids must be integer token ids, got dtype {input_ids.dtype}")
    if input_ids.numel() == 0:
        return
    low, high = torch.stack(torch.aminmax(input_ids)).tolist()  # one device sync, not two
    if low < 0 or high >= vocab_size:
        bad = low if low < 0 else high
        raise ValueError(f"input_ids hold token id {bad}, outside the model's vocabulary [0, vocab_size={vocab_size})"
                         " (a tokenizer that does not match the checkpoint, or a pad id such as -100 / -1?)")


def prompt_mask(input_ids: torch.Tensor, attention_mask: torch.Tensor | None, pad: int | None,
                eos: torch.Tensor) -> torch.Tensor | None:
    """The prompt's attention_mask: the given one, else (as HF infers it) input_ids != pad when an explicit pad id
    that is not an EOS id occurs in the prompt, else None (no padding)."""
    if attention_mask is not None:
        if attention_mask.shape != input_ids.shape:
            raise ValueError(f"attention_mask shape {tuple(attention_mask.shape)} != input_ids shape "
                             f"{tuple(input_ids.shape)}")
        return attention_mask.long()
    if pad is None or bool(torch.isin(pad, eos)) or not bool((input_ids == pad).any()):
        return None
    return (input_ids != pad).long()


def padded_positions(mask: torch.Tensor) -> torch.Tensor:
    """HF's positions for a (B, T) attention_mask: cumsum(mask) − 1 at real tokens, 0 at padding."""
    return (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)


def fill_token(vocab_size: int, pad: int | None, eos: list[int]) -> int:
    """What a row that stopped is filled with: the pad id (argument, else generation_config's / config's, as HF),
    else the first EOS id, else 0. A pad id outside the vocabulary (some configs say -1) could not be fed back, so it
    counts as none."""
    if pad is not None and 0 <= pad < vocab_size:
        return pad
    return eos[0] if eos else 0


def generation_setting(model, key: str, value):
    """``value`` if given (not None), else generation_config.json's ``key`` if it sets one, else HF's default."""
    if value is not None:
        return value
    from_file = checkpoint_generation_config(model).get(key)
    return from_file if from_file is not None else SAMPLING_DEFAULTS[key]


def new_token_budget(model, max_new_tokens: int | None, prompt_length: int) -> int:
    """max_new_tokens if given, else generation_config.json's, else its max_length − prompt length (HF's rule;
    an error when the prompt already fills it, as in HF), else DEFAULT_MAX_NEW_TOKENS. A budget below 1 is an error,
    as in HF (it would return the prompt unchanged and hide the mistake)."""
    generation_config = checkpoint_generation_config(model)
    for source, budget in (("max_new_tokens", max_new_tokens),
                           ("generation_config.json's max_new_tokens", generation_config.get("max_new_tokens"))):
        if budget is not None:
            if isinstance(budget, bool) or not isinstance(budget, numbers.Integral) or budget < 1:  # numpy ints pass
                raise ValueError(f"{source} must be an integer ≥ 1, got {budget!r}")
            return int(budget)
    max_length = generation_config.get("max_length")
    if max_length is None:
        return DEFAULT_MAX_NEW_TOKENS
    if prompt_length >= max_length:
        raise ValueError(f"the prompt has {prompt_length} tokens, but generation_config.json's max_length is "
                         f"{max_length} (prompt included): pass max_new_tokens")
    return max_length - prompt_length


@torch.no_grad()
def generate(model, input_ids: torch.Tensor, max_new_tokens: int | None = None, *, do_sample: bool | None = None,
             temperature: float | None = None, top_k: int | None = None, top_p: float | None = None,
             eos_token_id: int | list[int] | None = None, pad_token_id: int | None = None,
             attention_mask: torch.Tensor | None = None, generator: torch.Generator | None = None,
             cuda_graph: bool = False) -> torch.Tensor:
    """(B, T) prompt (left-padded when lengths differ; see the module docstring) → (B, T + n) tokens,
    n ≤ max_new_tokens. Settings left None come from generation_config.json, else HF's defaults (greedy unless the
    file says do_sample); eos/pad default to the checkpoint's ids.

    cuda_graph: after the (eager) prefill, replay each one-token step as a CUDA graph over a static cache of
    T + max_new_tokens slots (modules/graphed_decoding.py), without the host's per-kernel cost (at batch 1 the step
    is otherwise host-bound), at the price of one capture per call and the whole budget's cache allocated up front.
    The same computation: in fp32 the same tokens; in bf16 the masked attention over the static cache rounds apart
    from the eager kernel's, so a near-tied argmax may flip."""
    if input_ids.dim() != 2 or input_ids.shape[1] == 0:
        raise ValueError(f"input_ids must be (batch, length) with at least one token (e.g. the BOS id), got shape "
                         f"{tuple(input_ids.shape)}")
    check_input_ids(input_ids, model.config.vocab_size)
    max_new_tokens = new_token_budget(model, max_new_tokens, input_ids.shape[1])
    do_sample, temperature, top_k, top_p = (generation_setting(model, key, value) for key, value in (
        ("do_sample", do_sample), ("temperature", temperature), ("top_k", top_k), ("top_p", top_p)))
    eos = torch.tensor(eos_token_ids(model, eos_token_id), dtype=torch.long, device=input_ids.device)
    explicit_pad = pad_token(model, pad_token_id)
    mask = prompt_mask(input_ids, attention_mask, explicit_pad, eos)  # (B, T) or None
    positions = None if mask is None else padded_positions(mask)
    pad = fill_token(model.config.vocab_size, explicit_pad, eos.tolist())
    rotary = model.model.rotary
    capacity = input_ids.shape[1] + min(max_new_tokens, PREALLOCATED_NEW_TOKENS)

    def prefill(tokens: torch.Tensor) -> tuple[torch.Tensor, KVCache]:
        cache = KVCache(0 if graphed is not None else capacity)  # graphed: copied into the static cache
        out = model(tokens, num_logits_to_keep=1, past_key_values=cache, use_cache=True, attention_mask=mask,
                    position_ids=positions)
        return out.logits[:, -1], cache

    graphed = None
    if cuda_graph:  # before the prefill: a model off CUDA is refused before any work
        graphed = _graphed_step(model, input_ids.shape[0], input_ids.shape[1] + max_new_tokens, mask)
    logits, cache = prefill(input_ids)
    if graphed is not None:
        graphed.cache.load(cache)
    regime = rotary.regime(input_ids.shape[1])
    tokens, done = input_ids, torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
    # Asynchronous only where it pays: graph replays that can stop early (no pinned flags without stop ids).
    watch = FinishWatch(max_new_tokens, graphed is not None and graphed.graphed and len(eos) > 0)
    for step in range(max_new_tokens):
        nxt = sample_next(logits, do_sample=do_sample, temperature=temperature, top_k=top_k, top_p=top_p,
                          generator=generator)
        nxt = torch.where(done, torch.full_like(nxt, pad), nxt)
        tokens = torch.cat([tokens, nxt[:, None]], dim=1)
        if mask is not None:  # the new token is real in every row (HF keeps finished rows' pads visible too)
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
            positions = torch.cat([positions, positions[:, -1:] + 1], dim=1)
        finished = None
        if step == max_new_tokens - 1:  # the budget is spent; a finish whose flag had not landed yet still counts
            finished = watch.drain()
        elif len(eos):  # without stop ids no row ever finishes: nothing to read back
            done = done | torch.isin(nxt, eos)
            finished = watch.finished_at(step, done)
        if finished is not None:  # steps queued past it (graphed) only added pads: cut them
            tokens = tokens[:, : input_ids.shape[1] + finished + 1].contiguous()
        if finished is not None or step == max_new_tokens - 1:
            break
        if rotary.regime(tokens.shape[1]) != regime:
            regime = rotary.regime(tokens.shape[1])
            logits, cache = prefill(tokens)
            if graphed is not None:
                graphed.cache.load(cache)
        elif graphed is not None:  # the new token sits at slot T − 1; its position is that, or HF's with padding
            slot = tokens.shape[1] - 1
            logits = graphed(nxt[:, None], slot if positions is None else positions[:, -1:], slot)[1][:, -1]
        else:
            out = model(nxt[:, None], num_logits_to_keep=1, past_key_values=cache, use_cache=True,
                        attention_mask=mask, position_ids=None if positions is None else positions[:, -1:])
            logits = out.logits[:, -1]
    return tokens


class FinishWatch:
    """When every row has finished, learnt without stalling the GPU.

    Eagerly the host is the bottleneck, so it reads ``done.all()`` at every step. With graph replays it is the
    other way round: a step takes the GPU longer (Llama-3.2-1B on an H200: ~1.3 ms) than the host needs to queue the
    next one, and a read per step drains that queue: the GPU then idles while Python goes round the loop (1.50 ms
    per token against 1.30 ms of kernels, benchmarks/tools/profile_decode.py). So here each step's ``done.all()`` is
    copied to pinned memory without waiting, and the host looks only at steps whose copies have landed, blocking
    only when LOOKAHEAD steps are in flight: at most that many steps run past the last EOS, and their tokens (all
    pads) are cut by the caller."""

    LOOKAHEAD = 4

    def __init__(self, steps: int, asynchronous: bool) -> None:
        self.asynchronous = asynchronous
        if asynchronous:
            self.flags = torch.zeros(steps, dtype=torch.bool, pin_memory=True)
            self.pending: deque[tuple[int, torch.cuda.Event]] = deque()

    def finished_at(self, step: int, done: torch.Tensor) -> int | None:
        """The first step known to have finished every row (done (B,) after ``step``); None while none is."""
        if not self.asynchronous:
            return step if bool(done.all()) else None
        self.flags[step].copy_(done.all(), non_blocking=True)
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(done.device))  # the model's GPU, which need not be the current one
        self.pending.append((step, event))
        while self.pending:
            oldest, landed = self.pending[0]
            if len(self.pending) > self.LOOKAHEAD:
                landed.synchronize()
            elif not landed.query():
                return None
            self.pending.popleft()
            if bool(self.flags[oldest]):
                return oldest
        return None

    def drain(self) -> int | None:
        """The first step that finished every row among those whose flags had not been read yet (waiting for them):
        at the end of the budget, a finish a few steps back may not have landed when its step was queued."""
        while self.asynchronous and self.pending:
            step, landed = self.pending.popleft()
            landed.synchronize()
            if bool(self.flags[step]):
                return step
        return None


def _graphed_step(model, batch: int, capacity: int, mask: torch.Tensor | None):
    """One-token decoding steps replayed as a CUDA graph, over a static cache of ``capacity`` slots."""
    from .graphed_decoding import GraphedCall, StaticKVCache

    device = model.lm_head.weight.device
    valid = None
    if mask is not None:  # left padding: the prompt's padded slots stay hidden; generated tokens are all real
        valid = torch.ones(mask.shape[0], capacity, dtype=torch.bool, device=device)
        valid[:, : mask.shape[1]] = mask.bool()
    return GraphedCall.one_token(model, StaticKVCache(capacity), batch, valid)

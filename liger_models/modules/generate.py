"""Plain autoregressive generation with a KV cache: greedy or sampling, with HF generate's logits processors.

Prompts of different lengths come left-padded with an ``attention_mask`` (HF convention); without one, as HF does,
the mask is inferred from an explicit pad_token_id (argument or config) found in the prompt, unless it is an EOS id.
Then, like HF, positions are cumsum(mask) − 1 (0 at padding) and padded keys are hidden; unpadded rows get exactly
the tokens they get alone. A row that emitted an EOS token (or completed a stop string) is filled with the pad id
(argument, else the checkpoint's: generation_config.json's if it has that file, else config.json's, as HF; else its
first EOS id) until every row is done or the budget is spent; as in HF, without any EOS setting a row that completed
a stop string goes on generating until every row has.
When the rotary table for cached positions would change (longrope crossing original_max_position_embeddings), the
cache is dropped and the whole sequence is recomputed, as HF's Phi3 does.
``cuda_graph=True`` replays every one-token step as a CUDA graph (modules/graphed_decoding.py): a batch-1 step is
otherwise bound by the host issuing ~200 kernels (Llama-3.2-1B on an H200: 11–16 → 1.2–1.3 ms per token).

Settings are HF's GenerationConfig fields, resolved as HF's generate resolves them: the argument, else the
checkpoint's generation_config.json (Llama 3 Instruct's says do_sample true, temperature 0.6, top_p 0.9, max_length
4096), else HF's global default (greedy; when sampling, temperature 1, top_k 50, no top-p). Arguments always win:
pass do_sample=False for greedy, top_k=0 for no top-k, repetition_penalty=1.0 for no penalty, stop_strings=[] for no
stop strings. Applied as HF applies them, in its order: repetition_penalty (every token id of the sequence so far,
left padding excluded), no_repeat_ngram_size, min_new_tokens / min_length (EOS ids blocked until then; min_length
counts the prompt), then, when sampling, temperature, top_k, top_p, min_p. The length is max_new_tokens, else
max_length minus the prompt length (argument, then the file, max_new_tokens from either winning over max_length,
HF's rule), else 32 (ours; HF's global max_length 20 counts the prompt). stop_strings (with ``tokenizer=``) end a
row at the token with which its decoded text comes to hold a stop string that ends inside that token's text (HF's
StopStringCriteria; that token is kept). A ``streamer`` (HF's BaseStreamer protocol: TextStreamer works) gets
``put(prompt)``, then ``put(tokens)`` with each step's (B,) tokens, then ``end()``. A ``generation_config`` argument
(an HF GenerationConfig, as TRL's GRPO / RLOO / online trainers pass, or a dict) sets what it sets as arguments do,
keyword arguments over it (HF's precedence).
Every other GenerationConfig field that would change the tokens (num_beams > 1, penalty_alpha, bad_words_ids,
typical_p, …: ``REFUSED``), and HF generate's other arguments (assistant_model, logits_processor, …), are refused
with a ValueError naming the setting and where it came from; fields that cannot change the tokens (use_cache,
output_scores, …: ``INERT``) are accepted; an unknown keyword is a TypeError (keys of generation_config.json that
are no GenerationConfig field do nothing in HF either, and are ignored). Sampling with generator=None draws from
torch's global generator, as HF does: the same seed gives HF's tokens.
"""

from __future__ import annotations

import numbers
from collections import deque
from typing import Any, Callable, NamedTuple

import torch

from .cache import KVCache
from .graphed_decoding import GraphedCall, StaticKVCache
from .inputs import _integral, check_input_ids, checks_its_own_token_ids

GENERATION_CONFIG_FILE = "generation_config.json"
# HF's global defaults (GenerationConfig._get_default_generation_params) of the settings generate implements, for
# what neither the caller nor the checkpoint's generation_config.json sets. The length is separate
# (`new_token_budget`): HF's max_length 20 includes the prompt, ours is DEFAULT_MAX_NEW_TOKENS new tokens.
HF_DEFAULTS = {"do_sample": False, "temperature": 1.0, "top_k": 50, "top_p": 1.0, "min_p": None,
               "repetition_penalty": 1.0, "no_repeat_ngram_size": 0, "min_new_tokens": None, "min_length": 0,
               "stop_strings": None}
IMPLEMENTED = frozenset(HF_DEFAULTS) | {"max_new_tokens", "max_length", "eos_token_id", "pad_token_id"}
SAMPLING = frozenset({"do_sample", "temperature", "top_k", "top_p", "min_p", "typical_p", "epsilon_cutoff",
                      "eta_cutoff", "top_h"})
DEFAULT_MAX_NEW_TOKENS = 32
# KV slots reserved up front for new tokens: a budget taken from a checkpoint's max_length (4096 or more) would
# otherwise preallocate it all even when an EOS comes after a few tokens; past this the cache grows by doubling.
PREALLOCATED_NEW_TOKENS = 1024


class Refused(NamedTuple):
    """A setting generate does not implement: ``active(value, settings)`` says whether HF's generate would act on
    ``value`` (then it is refused); ``what`` names the feature; ``neutral`` is a value that turns it off (None:
    only leaving it out does)."""

    active: Callable[[Any, "Settings"], bool]
    what: str
    neutral: Any = None


def _given(value, settings) -> bool:
    """HF acts on a list / dict setting whenever it is there; an empty one does nothing."""
    return not (isinstance(value, (list, tuple, dict, str)) and len(value) == 0)


def _true(value, settings) -> bool:
    return bool(value)


def _sampling(active: Callable[[Any], bool]) -> Callable[[Any, "Settings"], bool]:
    """HF applies its sampling warpers only when do_sample is true."""
    return lambda value, settings: bool(settings["do_sample"]) and active(value)


# GenerationConfig's fields that change the tokens (under the condition HF acts on them) and that generate does not
# implement, then HF generate's arguments outside GenerationConfig.
REFUSED: dict[str, Refused] = {
    "num_beams": Refused(lambda v, s: v > 1, "beam search", 1),
    "num_beam_groups": Refused(lambda v, s: v > 1, "group beam search", 1),
    "penalty_alpha": Refused(lambda v, s: v > 0 and not s["do_sample"] and s["top_k"] > 1, "contrastive search", 0.0),
    "constraints": Refused(_given, "constrained beam search"),
    "force_words_ids": Refused(_given, "constrained beam search (force_words_ids)"),
    "dola_layers": Refused(_given, "DoLa decoding"),
    "use_mtp": Refused(_true, "multi-token-prediction decoding", False),
    "prompt_lookup_num_tokens": Refused(_given, "prompt-lookup decoding"),
    "assistant_early_exit": Refused(_given, "early-exit assisted decoding"),
    "is_assistant": Refused(_true, "decoding as an assistant model", False),
    "token_healing": Refused(_true, "token healing", False),
    "num_return_sequences": Refused(lambda v, s: v > 1, "several sequences per prompt", 1),
    "return_dict_in_generate": Refused(_true, "a GenerateOutput result (generate returns the token tensor)", False),
    "max_time": Refused(_given, "a time limit"),
    "cache_implementation": Refused(lambda v, s: v == "paged", "continuous batching (cache_implementation 'paged')"),
    "guidance_scale": Refused(lambda v, s: v != 1, "classifier-free guidance", 1.0),
    "sequence_bias": Refused(_given, "sequence_bias", {}),
    "bad_words_ids": Refused(_given, "banned words (bad_words_ids)", []),
    "encoder_repetition_penalty": Refused(lambda v, s: v != 1, "the prompt-only repetition penalty", 1.0),
    "encoder_no_repeat_ngram_size": Refused(lambda v, s: v > 0, "n-gram blocking against the prompt", 0),
    "suppress_tokens": Refused(_given, "suppressed tokens", []),
    "begin_suppress_tokens": Refused(_given, "tokens suppressed at the start", []),
    "forced_bos_token_id": Refused(_given, "a forced first token"),
    "forced_eos_token_id": Refused(_given, "a forced last token"),
    "remove_invalid_values": Refused(_true, "NaN / inf removal", False),
    "exponential_decay_length_penalty": Refused(_given, "the exponential length penalty"),
    "renormalize_logits": Refused(_true, "renormalized scores", False),
    "watermarking_config": Refused(_given, "watermarking"),
    "typical_p": Refused(_sampling(lambda v: v < 1), "typical sampling", 1.0),
    "epsilon_cutoff": Refused(_sampling(lambda v: 0 < v < 1), "epsilon sampling", 0.0),
    "eta_cutoff": Refused(_sampling(lambda v: 0 < v < 1), "eta sampling", 0.0),
    "top_h": Refused(_sampling(lambda v: True), "top-h sampling"),
    # HF generate's own arguments
    "assistant_model": Refused(_given, "assisted decoding"),
    "assistant_tokenizer": Refused(_given, "assisted decoding"),
    "logits_processor": Refused(_given, "custom logits processors", []),
    "stopping_criteria": Refused(_given, "custom stopping criteria", []),
    "prefix_allowed_tokens_fn": Refused(_given, "prefix-constrained decoding"),
    "negative_prompt_ids": Refused(_given, "classifier-free guidance's negative prompt"),
    "negative_prompt_attention_mask": Refused(_given, "classifier-free guidance's negative prompt"),
    "custom_generate": Refused(_given, "a custom decoding method"),
    "synced_gpus": Refused(_true, "synced GPUs (DeepSpeed ZeRO-3)", False),
}
# Fields that cannot change the tokens of greedy or sampled decoding: caching and compilation, the extra outputs HF
# returns only with return_dict_in_generate (refused), beam-search scoring and assisted-decoding knobs (inert without
# beams or an assistant, both refused), the file's metadata.
INERT = frozenset({
    "use_cache", "cache_config", "max_cache_len", "compile_config", "disable_compile", "prefill_chunk_size",
    "output_attentions", "output_hidden_states", "output_scores", "output_logits", "bos_token_id",
    "decoder_start_token_id", "early_stopping", "length_penalty", "diversity_penalty", "low_memory",
    "num_assistant_tokens", "num_assistant_tokens_schedule", "assistant_confidence_threshold",
    "assistant_lookbehind", "target_lookbehind", "max_matching_ngram_size", "assistant_ensemble_weight",
    "speculation_type", "continuous_batching_config", "trust_remote_code", "transformers_version",
    "_from_model_config", "_commit_hash"})


class Settings:
    """Generation settings as HF's generate resolves them: the argument when given (not None), else the checkpoint's
    generation_config.json, else HF's global default; each value knows where it came from, for error messages.
    ``ignored_file_keys``: keys of the file a decoder does not take (Medusa: the file's sampling settings)."""

    def __init__(self, model, arguments: dict[str, Any], ignored_file_keys: frozenset[str] = frozenset()) -> None:
        self.arguments = {key: value for key, value in arguments.items() if value is not None}
        self.file = {key: value for key, value in checkpoint_generation_config(model).items()
                     if value is not None and key not in ignored_file_keys}

    def __getitem__(self, key: str):
        if key in self.arguments:
            return self.arguments[key]
        return self.file.get(key, HF_DEFAULTS.get(key))

    def describe(self, key: str) -> str:
        """``key=value`` and where it came from, for an error message."""
        where = ("argument" if key in self.arguments else
                 f"from {GENERATION_CONFIG_FILE}" if key in self.file else "HF's default")
        return f"{key}={self[key]!r} ({where})"


def generation_config_values(config: Any) -> dict[str, Any]:
    """The settings a ``generation_config`` argument sets: a dict's items, or those of an HF GenerationConfig (its
    ``to_diff_dict()``: what differs from a fresh one, which TRL's trainers build and pass), None values left out. In
    HF's generate they win over the checkpoint's generation_config.json and lose to keyword arguments."""
    if isinstance(config, dict):
        values = dict(config)
    elif callable(getattr(config, "to_diff_dict", None)):
        values = config.to_diff_dict()
    elif callable(getattr(config, "to_dict", None)):
        values = config.to_dict()
    else:
        raise TypeError(f"generate: generation_config must be a GenerationConfig or a dict, got "
                        f"{type(config).__name__}")
    return {key: value for key, value in values.items() if value is not None}


def check_keywords(keywords: dict[str, Any], known: frozenset[str], caller: str) -> None:
    """A keyword that is no generation setting (a typo, an argument of another API) is a TypeError, as Python
    raises for an unexpected keyword."""
    unknown = sorted(set(keywords) - known)
    if unknown:
        raise TypeError(f"{caller}() got unexpected keyword arguments {unknown}: not HF generation settings")


def refuse_unsupported(settings: Settings, refused: dict[str, Refused], decoder: str) -> None:
    """A ValueError for the first setting (argument or generation_config.json) in ``refused`` that HF's generate
    would act on, naming it, where it came from and how to decode without it."""
    for key, rule in refused.items():
        value = settings[key]
        try:
            active = value is not None and rule.active(value, settings)
        except TypeError:  # e.g. a string where HF compares a number
            raise ValueError(f"{settings.describe(key)} is not a value HF's generate takes") from None
        if not active:
            continue
        if key in settings.arguments:
            hint = "leave it out"
        elif rule.neutral is not None:
            hint = f"pass {key}={rule.neutral!r} to decode without it"
        else:
            hint = "remove it from model.generation_config to decode without it"
        raise ValueError(f"{decoder} does not implement {rule.what}: {settings.describe(key)}; {hint}")


def _number(settings: Settings, key: str, integral: bool, holds: Callable[[Any], bool], rule: str):
    """settings[key], checked: an int (numpy ints too) or a real number, for which ``holds`` is true."""
    value = settings[key]
    kind = numbers.Integral if integral else numbers.Real
    if isinstance(value, bool) or not isinstance(value, kind) or not holds(value):
        raise ValueError(f"{key} must be {rule}, got {settings.describe(key)}")
    return int(value) if integral else float(value)


def warp_logits(logits: torch.Tensor, temperature: float = 1.0, top_k: int | None = None,
                top_p: float | None = None, min_p: float | None = None) -> torch.Tensor:
    """(B, V) float logits with temperature, then top-k, top-p and min-p applied as HF's warpers do (filtered:
    -inf)."""
    if not temperature > 0:  # not `<= 0`: NaN would pass and fail later as NaN probabilities in multinomial
        raise ValueError(f"temperature must be > 0 when sampling, got {temperature}")
    if top_k is not None and top_k < 0:
        raise ValueError(f"top_k must be >= 0 (0: no top-k filtering), got {top_k}")
    if top_p is not None and not 0 <= top_p <= 1:
        raise ValueError(f"top_p must be in [0, 1], got {top_p}")
    if min_p is not None and not 0 <= min_p <= 1:
        raise ValueError(f"min_p must be in [0, 1], got {min_p}")
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
    if min_p is not None:
        # MinPLogitsWarper: drop a token less likely than min_p × the likeliest one's probability (which, with
        # min_p <= 1, always stays).
        probs = logits.softmax(-1)
        logits = logits.masked_fill(probs < min_p * probs.amax(-1, keepdim=True), float("-inf"))
    return logits


def sample_next(logits: torch.Tensor, *, do_sample: bool = False, temperature: float = 1.0, top_k: int | None = None,
                top_p: float | None = None, min_p: float | None = None,
                generator: torch.Generator | None = None) -> torch.Tensor:
    """Next token ids (B,) from last-position logits (B, V): argmax, or a draw after ``warp_logits``."""
    logits = logits.float()
    if not do_sample:
        return logits.argmax(-1)
    probs = warp_logits(logits, temperature, top_k, top_p, min_p).softmax(-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def penalize_repetitions(scores: torch.Tensor, history: torch.Tensor, penalty: float,
                         skip: torch.Tensor | None = None) -> torch.Tensor:
    """HF's RepetitionPenaltyLogitsProcessor: the score of every token id in ``history`` (B, L) is divided by
    ``penalty`` when positive and multiplied by it when negative, once however often the id occurs. skip (B,): how
    many leading positions of each row do not count (its left padding, as HF reads it off the attention mask)."""
    vocab = scores.shape[-1]
    if skip is not None:  # skipped positions point at a spare column past the vocabulary
        history = history.masked_fill(torch.arange(history.shape[1], device=history.device) < skip[:, None], vocab)
    seen = torch.zeros(scores.shape[0], vocab + 1, dtype=torch.bool, device=scores.device)
    seen = seen.scatter(1, history, True)[:, :vocab]
    return torch.where(seen, torch.where(scores < 0, scores * penalty, scores / penalty), scores)


def block_repeated_ngrams(scores: torch.Tensor, history: torch.Tensor, n: int) -> torch.Tensor:
    """HF's NoRepeatNGramLogitsProcessor: a token that would complete an n-gram already in ``history`` (B, L),
    prompt and padding included, gets -inf."""
    length, vocab = history.shape[1], scores.shape[-1]
    if length < n:
        return scores
    ngrams = history.unfold(1, n, 1)  # (B, L − n + 1, n): every n-gram so far
    # An n-gram whose first n − 1 tokens are the sequence's last n − 1 would be repeated by its last token.
    context = history[:, length - n + 1:]  # (B, n − 1)
    repeats = (ngrams[..., :-1] == context[:, None]).all(-1)
    banned = torch.where(repeats, ngrams[..., -1], vocab)  # the others go to a spare column
    mask = torch.zeros(scores.shape[0], vocab + 1, dtype=torch.bool, device=scores.device).scatter(1, banned, True)
    return scores.masked_fill(mask[:, :vocab], float("-inf"))


class LogitsRules:
    """Each step's scores as HF's processors leave them (module docstring: penalty, n-grams, minimum length, then
    the sampling warpers), and the token picked from them."""

    def __init__(self, settings: Settings, eos: torch.Tensor, mask: torch.Tensor | None, prompt_length: int) -> None:
        self.eos = eos
        self.repetition_penalty = _number(settings, "repetition_penalty", False, lambda v: v > 0,
                                          "a number > 0 (1: no penalty)")
        # HF skips each row's leading padding: the attention mask's first nonzero position.
        self.penalty_skip = None if mask is None else (mask != 0).int().argmax(1)
        self.ngram_size = _number(settings, "no_repeat_ngram_size", True, lambda v: v >= 0,
                                  "an integer ≥ 0 (0: no n-gram blocking)")
        self.min_length = self._min_length(settings, prompt_length)
        self.do_sample = bool(settings["do_sample"])
        self.sampling = {}
        if self.do_sample:
            min_p = settings["min_p"]
            if min_p is not None:
                min_p = _number(settings, "min_p", False, lambda v: 0 <= v <= 1, "in [0, 1]")
            self.sampling = dict(temperature=settings["temperature"], top_k=settings["top_k"],
                                 top_p=settings["top_p"], min_p=min_p)

    @staticmethod
    def _min_length(settings: Settings, prompt_length: int) -> int:
        """The length (prompt included) below which EOS is blocked: prompt + min_new_tokens when that is set (it
        wins, as in HF), else min_length."""
        if settings["min_new_tokens"] is not None:
            return prompt_length + _number(settings, "min_new_tokens", True, lambda v: v >= 0, "an integer ≥ 0")
        return _number(settings, "min_length", True, lambda v: v >= 0, "an integer ≥ 0 (the prompt counts)")

    def scores(self, logits: torch.Tensor, history: torch.Tensor) -> torch.Tensor:
        """(B, V) float32 scores from last-position logits, ``history`` (B, L) being the sequence so far."""
        scores = logits.float()
        if self.repetition_penalty != 1.0:
            scores = penalize_repetitions(scores, history, self.repetition_penalty, self.penalty_skip)
        if self.ngram_size > 0:
            scores = block_repeated_ngrams(scores, history, self.ngram_size)
        if history.shape[1] < self.min_length and len(self.eos):
            vocabulary = torch.arange(scores.shape[-1], device=scores.device)
            scores = scores.masked_fill(torch.isin(vocabulary, self.eos), float("-inf"))
        return scores

    def next_tokens(self, logits: torch.Tensor, history: torch.Tensor,
                    generator: torch.Generator | None) -> torch.Tensor:
        return sample_next(self.scores(logits, history), do_sample=self.do_sample, generator=generator,
                           **self.sampling)


class StopStrings:
    """HF's StopStringCriteria on decoded text: a sequence ends at the token with which its text comes to hold a stop
    string ending inside that token's text (the string may start in earlier tokens, the prompt included, and the
    token may run on past it). Tokens are decoded with ``tokenizer.decode(ids, skip_special_tokens=False)``
    (a ``tokenizers.Tokenizer`` or an HF tokenizer), special tokens as their text, as HF matches them."""

    def __init__(self, strings, tokenizer, where: str) -> None:
        strings = [strings] if isinstance(strings, str) else strings
        if (not isinstance(strings, (list, tuple)) or not strings
                or not all(isinstance(s, str) and s for s in strings)):
            raise ValueError(f"stop_strings must be a non-empty string or a list of them, got {where}")
        if tokenizer is None:
            raise ValueError(f"stop strings are matched on decoded text: pass tokenizer= to generate ({where})")
        self.strings, self.tokenizer = tuple(strings), tokenizer
        # A token holds at least one byte, so a stop string spans at most its UTF-8 length in tokens; one token more
        # puts the window's first token (whose leading space a decoder may strip) before any match.
        self.window = max(len(s.encode("utf-8")) for s in self.strings) + 1

    def _text(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def ends_with_stop(self, ids: list[int]) -> bool:
        """Whether the last token of ``ids`` completes a stop string."""
        tail = ids[-self.window:]
        text, before = self._text(tail), self._text(tail[:-1])
        # The text the last token added starts where the two texts part (a decoder may rewrite the end of the
        # text before, e.g. an incomplete UTF-8 character that this token completes).
        new = next((i for i, (a, b) in enumerate(zip(text, before)) if a != b), min(len(text), len(before)))
        return any(text.find(s, max(0, new - len(s) + 1)) >= 0 for s in self.strings)

    def hits(self, tokens: torch.Tensor, done: torch.Tensor) -> torch.Tensor:
        """(B,) bool: the rows not yet done whose last token completes a stop string (one read of the device)."""
        rows, finished = tokens[:, -self.window:].tolist(), done.tolist()
        return torch.tensor([not f and self.ends_with_stop(r) for r, f in zip(rows, finished)], device=tokens.device)

    def first_stop(self, ids: list[int], start: int) -> int | None:
        """The first index ≥ start of ``ids`` whose token completes a stop string, or None."""
        return next((i for i in range(start, len(ids)) if self.ends_with_stop(ids[: i + 1])), None)

    def text_through_stop(self, prompt: list[int], new_ids: list[int]) -> str:
        """The text of ``new_ids`` (decoded without special tokens), cut right after the stop string that their last
        token completes: that token may run on past the string (a stop string "::i" completed by the token "ir"),
        and a user reads the text up to the string. The string may start in the prompt; the text is left whole when
        decoding the prompt alone does not give the start of the joint text (a merge across the boundary)."""
        decode = lambda ids: self.tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
        head, text, before = decode(prompt), decode(prompt + new_ids), decode(prompt + new_ids[:-1])
        if not text.startswith(head):
            return decode(new_ids)
        new = next((i for i, (a, b) in enumerate(zip(text, before)) if a != b), min(len(text), len(before)))
        ends = [at + len(s) for s in self.strings if (at := text.find(s, max(0, new - len(s) + 1))) >= 0]
        return text[len(head):min(ends)] if ends else text[len(head):]


def stop_strings_of(settings: Settings, tokenizer) -> StopStrings | None:
    """The resolved stop_strings as a StopStrings, None when there are none: an empty list turns the file's off (None
    would fall back to them)."""
    strings = settings["stop_strings"]
    if strings is None or (isinstance(strings, (list, tuple)) and not strings):
        return None
    return StopStrings(strings, tokenizer, settings.describe("stop_strings"))


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


def eos_setting(model, eos_token_id):
    """The EOS setting as given: the argument, else the checkpoint's default (`default_token_id`); None if neither."""
    return default_token_id(model, "eos_token_id") if eos_token_id is None else eos_token_id


def eos_token_ids(model, eos_token_id: int | list[int] | None) -> list[int]:
    """The stop ids: the argument (one id or several), else the checkpoint's default (`default_token_id`)."""
    eos = eos_setting(model, eos_token_id)
    return [] if eos is None else token_id_list(eos, "eos_token_id")


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


def _count(source: str, value, least: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < least:  # numpy ints pass
        raise ValueError(f"{source} must be an integer ≥ {least}, got {value!r}")
    return int(value)


def new_token_budget(model, max_new_tokens: int | None, prompt_length: int, max_length: int | None = None) -> int:
    """HF's rule: max_new_tokens (argument, else generation_config.json's), else max_length (argument, else the
    file's) minus the prompt length (an error when the prompt already fills it, as in HF), else
    DEFAULT_MAX_NEW_TOKENS. A budget below 1 is an error, as in HF (it would return the prompt unchanged and hide
    the mistake)."""
    generation_config = checkpoint_generation_config(model)
    for source, budget in (("max_new_tokens", max_new_tokens),
                           (f"{GENERATION_CONFIG_FILE}'s max_new_tokens", generation_config.get("max_new_tokens"))):
        if budget is not None:
            return _count(source, budget, 1)
    for source, limit in (("max_length", max_length),
                          (f"{GENERATION_CONFIG_FILE}'s max_length", generation_config.get("max_length"))):
        if limit is not None:
            limit = _count(source, limit, 1)
            if prompt_length >= limit:
                raise ValueError(f"the prompt has {prompt_length} tokens, but {source} is {limit} (prompt "
                                 "included): pass max_new_tokens")
            return limit - prompt_length
    return DEFAULT_MAX_NEW_TOKENS


# What a decoding step's arguments may hold (prepare_inputs_for_generation's keys); a patched hook that returns
# anything else would be asking for something this loop does not do.
_STEP_KEYS = frozenset({"input_ids", "inputs_embeds", "attention_mask", "position_ids", "past_key_values", "use_cache",
                        "cache_position"})


def prompt_learning_prefix(model, input_ids: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor | None:
    """The embeddings PEFT's prompt learning (prompt tuning, P-tuning) puts before the prompt, (B, V, H), or None.

    PEFT's ``generate`` swaps the model's ``prepare_inputs_for_generation`` for its own, which replaces the first
    step's input_ids by ``inputs_embeds`` = [virtual tokens | the prompt's embeddings]. This loop does not go through
    that hook at every step, so it asks it once for the prefill and keeps the virtual tokens (they do not depend on
    the prompt); anything else the hook would change is refused rather than ignored (prefix tuning's transformers
    Cache among it)."""
    hook = model.__dict__.get("prepare_inputs_for_generation")  # set on the instance: someone patched it
    if hook is None:
        return None
    mask = torch.ones_like(input_ids) if mask is None else mask
    step = hook(input_ids, past_key_values=None, attention_mask=mask, use_cache=True)
    unknown = sorted(k for k, v in step.items() if v is not None and k not in _STEP_KEYS)
    cache = step.get("past_key_values")
    if unknown or (cache is not None and not isinstance(cache, KVCache)):
        what = ", ".join(unknown) if unknown else f"past_key_values of type {type(cache).__name__}"
        raise ValueError(f"generate: the patched prepare_inputs_for_generation asks for {what}, which this model's "
                         "decoding loop does not take (PEFT's prefix tuning is not supported; prompt tuning is)")
    embeds = step.get("inputs_embeds")
    if embeds is None:
        return None
    virtual = embeds.shape[1] - input_ids.shape[1]
    if embeds.dim() != 3 or embeds.shape[0] != input_ids.shape[0] or virtual < 0:
        raise ValueError(f"generate: the patched prepare_inputs_for_generation returned inputs_embeds of shape "
                         f"{tuple(embeds.shape)} for input_ids of shape {tuple(input_ids.shape)}")
    return embeds[:, :virtual].detach() if virtual else None


@torch.no_grad()
@checks_its_own_token_ids
def generate(model, input_ids: torch.Tensor, max_new_tokens: int | None = None, *, do_sample: bool | None = None,
             temperature: float | None = None, top_k: int | None = None, top_p: float | None = None,
             min_p: float | None = None, repetition_penalty: float | None = None,
             no_repeat_ngram_size: int | None = None, min_new_tokens: int | None = None,
             min_length: int | None = None, max_length: int | None = None, stop_strings: str | list[str] | None = None,
             eos_token_id: int | list[int] | None = None, pad_token_id: int | None = None,
             attention_mask: torch.Tensor | None = None, generator: torch.Generator | None = None,
             tokenizer=None, streamer=None, cuda_graph: bool = False, **hf_settings) -> torch.Tensor:
    """(B, T) prompt (left-padded when lengths differ; see the module docstring) → (B, T + n) tokens,
    n ≤ the budget. Settings left None come from generation_config.json, else HF's defaults (greedy unless the
    file says do_sample); eos/pad default to the checkpoint's ids. ``hf_settings``: HF's other GenerationConfig
    fields, accepted when they cannot change the tokens, else refused (module docstring).

    tokenizer: decodes tokens for stop_strings. streamer: ``put(ids)`` / ``end()`` as HF's BaseStreamer.
    cuda_graph: after the (eager) prefill, replay each one-token step as a CUDA graph over a static cache of
    T + budget slots (modules/graphed_decoding.py), without the host's per-kernel cost (at batch 1 the step is
    otherwise host-bound), at the price of one capture per call and the whole budget's cache allocated up front.
    The processors and the pick run on the logits each replay returns, as in the eager loop; stop strings and a
    streamer read every step's tokens back, which the replays otherwise run ahead of. The same computation: in
    fp32 the same tokens; in bf16 the masked attention over the static cache rounds apart from the eager kernel's,
    so a near-tied argmax may flip."""
    config = hf_settings.pop("generation_config", None)
    if config is not None:  # its settings as arguments, the keyword arguments over them (HF's precedence)
        named = dict(max_new_tokens=max_new_tokens, do_sample=do_sample, temperature=temperature, top_k=top_k,
                     top_p=top_p, min_p=min_p, repetition_penalty=repetition_penalty,
                     no_repeat_ngram_size=no_repeat_ngram_size, min_new_tokens=min_new_tokens, min_length=min_length,
                     max_length=max_length, stop_strings=stop_strings, eos_token_id=eos_token_id,
                     pad_token_id=pad_token_id, **hf_settings)
        given = {key: value for key, value in named.items() if value is not None}
        return generate(model, input_ids, attention_mask=attention_mask, generator=generator, tokenizer=tokenizer,
                        streamer=streamer, cuda_graph=cuda_graph, **{**generation_config_values(config), **given})
    if input_ids.dim() != 2 or input_ids.shape[1] == 0:
        raise ValueError(f"input_ids must be (batch, length) with at least one token (e.g. the BOS id), got shape "
                         f"{tuple(input_ids.shape)}")
    check_keywords(hf_settings, frozenset(REFUSED) | INERT, "generate")
    settings = Settings(model, dict(
        do_sample=do_sample, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
        repetition_penalty=repetition_penalty, no_repeat_ngram_size=no_repeat_ngram_size,
        min_new_tokens=min_new_tokens, min_length=min_length, stop_strings=stop_strings, **hf_settings))
    refuse_unsupported(settings, REFUSED, "generate")
    check_input_ids(input_ids, model.config.vocab_size)
    prompt_length = input_ids.shape[1]
    max_new_tokens = new_token_budget(model, max_new_tokens, prompt_length, max_length)
    eos = torch.tensor(eos_token_ids(model, eos_token_id), dtype=torch.long, device=input_ids.device)
    # HF fills finished rows with the pad id only when some EOS setting exists (even an empty list).
    fill_finished = eos_setting(model, eos_token_id) is not None
    explicit_pad = pad_token(model, pad_token_id)
    mask = prompt_mask(input_ids, attention_mask, explicit_pad, eos)  # (B, T) or None
    rules = LogitsRules(settings, eos, mask, prompt_length)
    stops = stop_strings_of(settings, tokenizer)
    pad = fill_token(model.config.vocab_size, explicit_pad, eos.tolist())
    rotary = model.model.rotary
    # PEFT's prompt learning: virtual tokens before the prompt, in the cache and the attention mask; positions then
    # count the cache's slots (HF + PEFT drop position_ids there), padding or not.
    prefix = prompt_learning_prefix(model, input_ids, mask)
    virtual = 0 if prefix is None else prefix.shape[1]
    attn_mask = mask  # the model's mask: the prompt's, after the virtual tokens' ones
    if prefix is not None and mask is not None:
        attn_mask = torch.cat([torch.ones_like(mask[:, :1]).expand(-1, virtual), mask], dim=1)
    positions = None if mask is None or prefix is not None else padded_positions(mask)
    capacity = virtual + prompt_length + min(max_new_tokens, PREALLOCATED_NEW_TOKENS)

    def prefill(tokens: torch.Tensor) -> tuple[torch.Tensor, KVCache]:
        cache = KVCache(0 if graphed is not None else capacity)  # graphed: copied into the static cache
        inputs = {"input_ids": tokens} if prefix is None else \
            {"inputs_embeds": torch.cat([prefix, model.model.embed_tokens(tokens).to(prefix.dtype)], dim=1)}
        out = model(**inputs, num_logits_to_keep=1, past_key_values=cache, use_cache=True, attention_mask=attn_mask,
                    position_ids=positions)
        return out.logits[:, -1], cache

    graphed = None
    if cuda_graph:  # before the prefill: a model off CUDA is refused before any work
        graphed = _graphed_step(model, input_ids.shape[0], virtual + prompt_length + max_new_tokens, attn_mask)
    if streamer is not None:
        streamer.put(input_ids.cpu())
    logits, cache = prefill(input_ids)
    if graphed is not None:
        graphed.cache.load(cache)
    regime = rotary.regime(virtual + prompt_length)
    tokens, done = input_ids, torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
    can_finish = len(eos) > 0 or stops is not None  # otherwise no row ever finishes: nothing to read back
    # Asynchronous only where it pays: graph replays that can stop early and whose tokens need not be read each step.
    watch = FinishWatch(max_new_tokens, graphed is not None and graphed.graphed and can_finish
                        and stops is None and streamer is None)
    for step in range(max_new_tokens):
        nxt = rules.next_tokens(logits, tokens, generator)
        if fill_finished:
            nxt = torch.where(done, torch.full_like(nxt, pad), nxt)
        tokens = torch.cat([tokens, nxt[:, None]], dim=1)
        if streamer is not None:
            streamer.put(nxt.cpu())
        if attn_mask is not None:  # the new token is real in every row (HF keeps finished rows' pads visible too)
            attn_mask = torch.cat([attn_mask, torch.ones_like(attn_mask[:, :1])], dim=1)
        if positions is not None:
            positions = torch.cat([positions, positions[:, -1:] + 1], dim=1)
        finished = None
        if step == max_new_tokens - 1:  # the budget is spent; a finish whose flag had not landed yet still counts
            finished = watch.drain()
        elif can_finish:
            done = done | torch.isin(nxt, eos)
            if stops is not None:
                done = done | stops.hits(tokens, done)
            finished = watch.finished_at(step, done)
        if finished is not None:  # steps queued past it (graphed) only added pads: cut them
            tokens = tokens[:, : prompt_length + finished + 1].contiguous()
        if finished is not None or step == max_new_tokens - 1:
            break
        if rotary.regime(virtual + tokens.shape[1]) != regime:
            regime = rotary.regime(virtual + tokens.shape[1])
            logits, cache = prefill(tokens)
            if graphed is not None:
                graphed.cache.load(cache)
        elif graphed is not None:  # the new token sits at slot T − 1; its position is that, or HF's with padding
            slot = virtual + tokens.shape[1] - 1
            logits = graphed(nxt[:, None], slot if positions is None else positions[:, -1:], slot)[1][:, -1]
        else:
            out = model(nxt[:, None], num_logits_to_keep=1, past_key_values=cache, use_cache=True,
                        attention_mask=attn_mask, position_ids=None if positions is None else positions[:, -1:])
            logits = out.logits[:, -1]
    if streamer is not None:
        streamer.end()
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
    device = model.lm_head.weight.device
    valid = None
    if mask is not None:  # left padding: the prompt's padded slots stay hidden; generated tokens are all real
        valid = torch.ones(mask.shape[0], capacity, dtype=torch.bool, device=device)
        valid[:, : mask.shape[1]] = mask.bool()
    return GraphedCall.one_token(model, StaticKVCache(capacity), batch, valid)

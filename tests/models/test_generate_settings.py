"""generate's settings beyond sampling, as HF transformers' generate applies them: repetition_penalty,
no_repeat_ngram_size, min_new_tokens / min_length, min_p, several EOS ids, max_length, stop_strings and a streamer,
each from the argument and from generation_config.json, greedy and seeded sampling giving HF's tokens on the same
tiny checkpoint; every setting that would change the tokens and is not implemented refused from either source;
Medusa tree decoding refusing what it cannot honour; the CUDA-graph path and the CLI taking the same settings."""

from __future__ import annotations


import pytest
import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers.generation.logits_process import (MinPLogitsWarper, NoRepeatNGramLogitsProcessor,
                                                    RepetitionPenaltyLogitsProcessor)
from transformers.generation.stopping_criteria import StopStringCriteria

from liger_models import LigerLlamaForCausalLM, LlamaConfig
from liger_models.recipes import GenerateConfig
from liger_models.recipes.decoding import decode
from liger_models.medusa import MedusaModel
from liger_models.medusa.decoding import medusa_generate
from liger_models.modules import graphed_decoding
from liger_models.modules.generate import (IMPLEMENTED, INERT, REFUSED, StopStrings, block_repeated_ngrams,
                                           penalize_repetitions, warp_logits)

from .parity import build_hf, save_hf

PROMPT, NEW = 6, 10
TEXT = ("the quick brown fox jumps over the lazy dog, while a cat sleeps in the warm sun. "
        "Birds sing on an old oak tree; wind moves grass by the river bank, and children play games. "
        "Every morning she walks to the market to buy fresh bread, milk and cheese for the family! ")


def _tokenizers() -> tuple[Tokenizer, transformers.PreTrainedTokenizerFast]:
    """A byte-level BPE tokenizer of 128 tokens (the tiny models' vocabulary), every token ASCII text: as a
    ``tokenizers.Tokenizer`` (what load_tokenizer gives) and as HF's fast tokenizer around the same object."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=128, special_tokens=["<pad>", "<s>", "</s>"], show_progress=False)
    tokenizer.train_from_iterator([TEXT], trainer=trainer)
    assert tokenizer.get_vocab_size() == 128
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", bos_token="<s>",
                                                eos_token="</s>")
    return tokenizer, fast


def _pair(tmp_path, **generation):
    """A tiny HF Llama with tied embeddings whose generation_config.json holds ``generation``, loaded by HF and by us.
    Its greedy continuation repeats the prompt's last token (the embedding's self-similarity leads the logits by a
    factor of 1.5–4), so each processor visibly changes the tokens."""
    hf = build_hf(transformers.LlamaConfig, tie_word_embeddings=True)
    hf.generation_config = transformers.GenerationConfig(**{"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
                                                           **generation})
    path = save_hf(hf, tmp_path)
    reference = transformers.AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").eval()
    return reference, LigerLlamaForCausalLM.from_pretrained(path, dtype=torch.float32)


def _left_padded() -> tuple[torch.Tensor, torch.Tensor]:
    """Three prompts of PROMPT tokens (ids ≥ 3), rows 1 and 2 with 2 and 4 pads (id 0) on the left."""
    ids = torch.randint(3, 128, (3, PROMPT))
    mask = torch.ones_like(ids)
    for row, pads in enumerate((0, 2, 4)):
        ids[row, :pads], mask[row, :pads] = 0, 0
    return ids, mask


def _both(hf, ours, ids, seed: int | None = None, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """HF's and our generate on the same arguments; seeded alike when sampling (both draw from torch's global
    generator)."""
    outs = []
    for model in (hf, ours):
        if seed is not None:
            torch.manual_seed(seed)
        outs.append(model.generate(ids, **kwargs))
    return outs[0], outs[1]


class Recorder:
    """A streamer (HF's BaseStreamer protocol) that records its calls."""

    def __init__(self) -> None:
        self.calls: list = []

    def put(self, value: torch.Tensor) -> None:
        self.calls.append(("put", value.device.type, value.tolist()))

    def end(self) -> None:
        self.calls.append(("end",))


# ---------------------------------------------------------------------------------------------------------------
# The processors, each against HF's own on random scores


def test_repetition_penalty_equals_hf_processor():
    torch.manual_seed(0)
    scores, history = torch.randn(4, 40) * 3, torch.randint(0, 40, (4, 30))
    skip = torch.tensor([0, 3, 29, 30])  # left padding per row, as HF reads it off the attention mask
    for penalty in (1.7, 0.4):
        expected = RepetitionPenaltyLogitsProcessor(penalty, prompt_ignore_length=skip)(history, scores.clone())
        assert torch.equal(penalize_repetitions(scores, history, penalty, skip), expected)
        expected = RepetitionPenaltyLogitsProcessor(penalty)(history, scores.clone())
        assert torch.equal(penalize_repetitions(scores, history, penalty), expected)


@pytest.mark.parametrize("n", [1, 2, 3, 5])
def test_ngram_blocking_equals_hf_processor(n):
    torch.manual_seed(n)
    scores, history = torch.randn(6, 9), torch.randint(0, 4, (6, 12))  # 4 ids: many repeated n-grams
    for length in (n - 1, n, 12):
        part = history[:, :length]
        assert torch.equal(block_repeated_ngrams(scores, part, n), NoRepeatNGramLogitsProcessor(n)(part, scores))


def test_min_p_equals_hf_warper():
    torch.manual_seed(0)
    scores = torch.randn(8, 50) * 2
    for min_p in (0.0, 0.05, 0.3, 1.0):
        kept = torch.isfinite(warp_logits(scores, min_p=min_p))
        assert torch.equal(kept, torch.isfinite(MinPLogitsWarper(min_p)(None, scores))), min_p


def test_stop_strings_match_where_hf_criteria_match():
    """After every token of random sequences, our decoded-text rule stops exactly where HF's StopStringCriteria does:
    stop strings across token boundaries, a last token running past the string, a string starting in the prompt."""
    tokenizer, fast = _tokenizers()
    generator = torch.Generator().manual_seed(0)
    sequences = torch.randint(3, 128, (40, 8), generator=generator)
    texts = [fast.decode(seq) for seq in sequences.tolist()]
    # Substrings of the sequences' own texts, so that they occur: 1 to 5 characters from random places.
    strings = sorted({text[i: i + w] for text in texts[:12] for i, w in ((3, 2), (7, 5), (10, 1), (5, 3))
                      if len(text) >= i + w})
    hf = StopStringCriteria(fast, strings)
    ours = StopStrings(strings, tokenizer, "test")
    for length in range(1, 9):
        expected = hf(sequences[:, :length], None).tolist()
        assert [ours.ends_with_stop(seq) for seq in sequences[:, :length].tolist()] == expected, length


def test_text_through_stop_ends_at_the_first_stop_string():
    """A sequence stopped by a stop string reads up to that string's end: the stopping token's text past it is cut
    (a token running on past the string), and a string that starts in the prompt is found across the boundary."""
    tokenizer, _ = _tokenizers()
    generator = torch.Generator().manual_seed(1)
    sequences = torch.randint(3, 128, (60, 10), generator=generator).tolist()
    texts = [tokenizer.decode(seq) for seq in sequences]
    strings = sorted({text[i: i + w] for text in texts[:20] for i, w in ((4, 2), (9, 3), (13, 1)) if len(text) >= i + w})
    stops, prompt_length, run_on = StopStrings(strings, tokenizer, "test"), 3, 0
    for seq in sequences:
        end = stops.first_stop(seq, prompt_length)
        if end is None:
            continue
        prompt, new = seq[:prompt_length], seq[prompt_length: end + 1]
        text = stops.text_through_stop(prompt, new)
        head = tokenizer.decode(prompt)
        whole = head + text
        assert any(whole.endswith(s) for s in strings), (whole, text)
        # No stop string ends earlier after the prompt (one inside the prompt alone stops nothing, as in HF).
        assert not any(whole.find(s, max(0, len(head) - len(s) + 1), len(whole) - 1) >= 0 for s in strings), whole
        assert tokenizer.decode(new).startswith(text)
        run_on += text != tokenizer.decode(new)
    assert run_on >= 5  # the stopping token ran past the string in these cases: the cut was needed


# ---------------------------------------------------------------------------------------------------------------
# generate against HF's generate, each setting from the argument and from generation_config.json

# Values that turn each setting off (None would fall back to generation_config.json).
NEUTRAL = dict(repetition_penalty=1.0, no_repeat_ngram_size=0, min_p=0.0, top_k=50)
CASES = {
    "repetition_penalty": dict(repetition_penalty=5.0),  # strong: the repeated token leads by 1.5–4×
    "repetition_reward": dict(repetition_penalty=0.5),
    "no_repeat_ngram_size": dict(no_repeat_ngram_size=2),
    "no_repeat_unigram": dict(no_repeat_ngram_size=1),
    "min_p": dict(min_p=0.5),  # sampling only: HF's greedy ignores it
    "together": dict(repetition_penalty=1.5, no_repeat_ngram_size=3, min_p=0.1, top_k=20),
}


@pytest.mark.parametrize("source", ["argument", "file"])
@pytest.mark.parametrize("case", list(CASES))
def test_processors_give_hf_tokens(tmp_path, case, source):
    settings = CASES[case]
    # HF refuses to save sampling settings without do_sample; every call here passes do_sample, which wins.
    hf, ours = _pair(tmp_path, **({**settings, "do_sample": True} if source == "file" else {}))
    given = settings if source == "argument" else {}
    ids, mask = _left_padded()
    common = dict(attention_mask=mask, max_new_tokens=NEW, eos_token_id=[])
    greedy, mine = _both(hf, ours, ids, do_sample=False, **common, **given)
    assert torch.equal(mine, greedy)
    sampled = []
    for seed in range(2):
        theirs, mine = _both(hf, ours, ids, seed, do_sample=True, temperature=0.7, **common, **given)
        assert torch.equal(mine, theirs), seed
        sampled.append(theirs)
    # The setting changes HF's tokens here: decoding that ignored it (today's generate did) fails the test.
    off = {**given, **{key: NEUTRAL[key] for key in settings}}
    unset = [hf.generate(ids, do_sample=False, **common, **off)]
    for seed in range(2):
        torch.manual_seed(seed)
        unset.append(hf.generate(ids, do_sample=True, temperature=0.7, **common, **off))
    assert not all(torch.equal(a, b) for a, b in zip([greedy, *sampled], unset))


@pytest.mark.parametrize("source", ["argument", "file"])
@pytest.mark.parametrize("setting", ["min_new_tokens", "min_length"])
def test_minimum_length_blocks_every_eos_id_like_hf(tmp_path, setting, source):
    """Several EOS ids, each row's greedy next token among them: every row would stop at once; min_new_tokens (or
    min_length, which counts the prompt) blocks all of them until then, as HF's processors do."""
    # The EOS ids are the rows' own greedy first tokens, read off the same model built once before (same seed):
    # the repeated last token is the usual first token, not every seed's (LIGER_TEST_SEED=1410648606).
    weights_seed = int(torch.randint(2**31, ()))
    ids = torch.randint(3, 128, (3, PROMPT))
    torch.manual_seed(weights_seed)
    _, probe = _pair(tmp_path / "probe")
    with torch.no_grad():
        eos = sorted(set(probe(ids).logits[:, -1].argmax(-1).tolist()))
    settings = {"eos_token_id": eos, setting: 4 if setting == "min_new_tokens" else PROMPT + 4}
    torch.manual_seed(weights_seed)
    hf, ours = _pair(tmp_path / "pair", **(settings if source == "file" else {}))
    given = settings if source == "argument" else {}
    theirs, mine = _both(hf, ours, ids, do_sample=False, max_new_tokens=NEW, pad_token_id=0, **given)
    assert torch.equal(mine, theirs) and theirs.shape[1] >= PROMPT + 5
    for seed in range(2):
        theirs, mine = _both(hf, ours, ids, seed, do_sample=True, max_new_tokens=NEW, pad_token_id=0, **given)
        assert torch.equal(mine, theirs), seed
    unset = ours.generate(ids, do_sample=False, max_new_tokens=NEW, pad_token_id=0, eos_token_id=eos,
                          **{setting: 0})
    assert unset.shape[1] == PROMPT + 1  # without it every row stops at its first token


def test_min_new_tokens_wins_over_min_length_like_hf(tmp_path):
    ids = torch.randint(3, 128, (2, PROMPT))
    eos = sorted(set(ids[:, -1].tolist()))
    # The file's min_new_tokens against an argument's min_length: HF takes min_new_tokens.
    hf, ours = _pair(tmp_path, min_new_tokens=2, eos_token_id=eos)
    theirs, mine = _both(hf, ours, ids, do_sample=False, max_new_tokens=NEW, min_length=PROMPT + 7)
    assert torch.equal(mine, theirs)


def test_max_length_counts_the_prompt_and_max_new_tokens_wins_like_hf(tmp_path):
    ids = torch.randint(3, 128, (2, PROMPT))
    hf, ours = _pair(tmp_path / "plain")
    theirs, mine = _both(hf, ours, ids, max_length=PROMPT + 5, eos_token_id=[])
    assert torch.equal(mine, theirs) and mine.shape[1] == PROMPT + 5
    theirs, mine = _both(hf, ours, ids, max_length=PROMPT + 5, max_new_tokens=2, eos_token_id=[])
    assert torch.equal(mine, theirs) and mine.shape[1] == PROMPT + 2
    with pytest.raises(ValueError, match="max_length is 6"):
        ours.generate(ids, max_length=PROMPT)
    hf, ours = _pair(tmp_path / "budget", max_new_tokens=3)  # the file's max_new_tokens wins over max_length too
    theirs, mine = _both(hf, ours, ids, max_length=PROMPT + 7, eos_token_id=[])
    assert torch.equal(mine, theirs) and mine.shape[1] == PROMPT + 3


def _boundary_string(tokenizer, ids: list[int], k: int) -> str:
    """The last character of token k − 1's text and the first of token k's: a stop string ending inside token k."""
    text = [tokenizer.decode(ids[i: i + 1], skip_special_tokens=False) for i in (k - 1, k)]
    return text[0][-1] + text[1][0]


@pytest.mark.parametrize("source", ["argument", "file"])
def test_stop_strings_cut_where_hf_cuts(tmp_path, source):
    """Rows stop at different steps (each at the token completing one of two stop strings, the other rows filled with
    the pad id), with an HF fast tokenizer or the tokenizers.Tokenizer load_tokenizer gives."""
    tokenizer, fast = _tokenizers()
    hf, ours = _pair(tmp_path)
    ids, mask = _left_padded()
    # n-gram blocking varies the otherwise repeated token
    common = dict(attention_mask=mask, max_new_tokens=NEW, eos_token_id=[], pad_token_id=0, no_repeat_ngram_size=2,
                  do_sample=False)
    full = hf.generate(ids, **common)
    strings = [_boundary_string(fast, full[row, PROMPT:].tolist(), k) for row, k in ((0, 4), (2, 2))]
    if source == "file":
        hf.generation_config.stop_strings = strings
        ours.generation_config["stop_strings"] = strings
        given = {}
    else:
        given = dict(stop_strings=strings)
    theirs, mine = _both(hf, ours, ids, tokenizer=fast, **common, **given)
    assert torch.equal(mine, theirs) and not torch.equal(theirs, full)
    assert torch.equal(ours.generate(ids, tokenizer=tokenizer, **common, **given), theirs)
    for seed in range(2):
        theirs, mine = _both(hf, ours, ids, seed, tokenizer=fast, **{**common, "do_sample": True}, **given)
        assert torch.equal(mine, theirs), seed
    where = "argument" if source == "argument" else "from generation_config.json"
    with pytest.raises(ValueError, match=rf"tokenizer=.*stop_strings=.*\({where}\)"):
        ours.generate(ids, **common, **given)


def test_stop_strings_refuse_what_is_not_a_string_and_an_empty_list_turns_the_file_off():
    tokenizer, _ = _tokenizers()
    model = LigerLlamaForCausalLM.from_config(LlamaConfig.tiny())
    prompt = torch.randint(3, 128, (1, 4))
    for bad in ([""], [3], ""):
        with pytest.raises(ValueError, match="stop_strings must be a non-empty string"):
            model.generate(prompt, 2, stop_strings=bad, tokenizer=tokenizer)
    expected = model.generate(prompt, 3, eos_token_id=[])
    model.generation_config = {"stop_strings": ["x"]}  # no tokenizer needed once turned off
    assert torch.equal(model.generate(prompt, 3, eos_token_id=[], stop_strings=[]), expected)


def test_streamer_gets_what_hf_streamer_gets(tmp_path):
    """put(prompt), put(each step's tokens, a finished row's pad included), end(): the same calls as from HF."""
    tokenizer, fast = _tokenizers()
    hf, ours = _pair(tmp_path)
    ids, mask = _left_padded()
    common = dict(attention_mask=mask, max_new_tokens=NEW, pad_token_id=0, no_repeat_ngram_size=2, do_sample=False)
    full = hf.generate(ids, eos_token_id=[], **common)
    eos = int(full[1, PROMPT + 3])  # row 1 stops after 4 tokens (or earlier), the others go on
    stop = _boundary_string(fast, full[0, PROMPT:].tolist(), 6)
    calls = []
    for model in (hf, ours):
        recorder = Recorder()
        model.generate(ids, eos_token_id=eos, stop_strings=[stop], tokenizer=fast, streamer=recorder, **common)
        calls.append(recorder.calls)
    assert calls[1] == calls[0]
    assert calls[0][0] == ("put", "cpu", ids.tolist()) and calls[0][-1] == ("end",) and len(calls[0]) > 3


@pytest.mark.parametrize("skip_prompt", [False, True])
def test_text_streamer_prints_what_it_prints_from_hf(tmp_path, capsys, skip_prompt):
    _, fast = _tokenizers()
    hf, ours = _pair(tmp_path)
    ids = torch.randint(3, 128, (1, PROMPT))
    printed = []
    for model in (hf, ours):
        model.generate(ids, max_new_tokens=NEW, eos_token_id=[], do_sample=False, no_repeat_ngram_size=2,
                       streamer=transformers.TextStreamer(fast, skip_prompt=skip_prompt))
        printed.append(capsys.readouterr().out)
    assert printed[1] == printed[0] and printed[0].strip()


# ---------------------------------------------------------------------------------------------------------------
# Settings generate does not implement: refused, from the argument or from generation_config.json

REFUSED_CASES = [("num_beams", 4), ("num_beam_groups", 2), ("penalty_alpha", 0.6), ("guidance_scale", 1.5),
           ("bad_words_ids", [[5]]), ("force_words_ids", [[5]]), ("sequence_bias", [[[5], 2.0]]),
           ("suppress_tokens", [5]), ("begin_suppress_tokens", [5]), ("forced_bos_token_id", 5),
           ("forced_eos_token_id", 5), ("exponential_decay_length_penalty", [2, 1.5]), ("renormalize_logits", True),
           ("remove_invalid_values", True), ("encoder_repetition_penalty", 1.3), ("encoder_no_repeat_ngram_size", 2),
           ("num_return_sequences", 2), ("return_dict_in_generate", True), ("max_time", 5.0),
           ("token_healing", True), ("dola_layers", "low"), ("prompt_lookup_num_tokens", 3),
           ("assistant_early_exit", 2), ("use_mtp", True), ("is_assistant", True),
           ("watermarking_config", {"greenlist_ratio": 0.25}), ("cache_implementation", "paged")]
# Sampling warpers: refused when sampling, ignored (as HF ignores them) when greedy.
REFUSED_WHEN_SAMPLING = [("typical_p", 0.9), ("epsilon_cutoff", 3e-4), ("eta_cutoff", 3e-4), ("top_h", 0.5)]


def test_every_generation_config_field_is_implemented_refused_or_inert():
    """A field transformers adds is a decision to make here, not a setting to drop."""
    fields = set(transformers.GenerationConfig().to_dict())
    assert fields - (IMPLEMENTED | set(REFUSED) | INERT) == set()


@pytest.fixture
def tiny():
    return LigerLlamaForCausalLM.from_config(LlamaConfig.tiny())


@pytest.mark.parametrize("key,value", REFUSED_CASES + REFUSED_WHEN_SAMPLING,
                         ids=[key for key, _ in REFUSED_CASES + REFUSED_WHEN_SAMPLING])
def test_unimplemented_settings_are_refused(tiny, key, value):
    prompt = torch.randint(3, 128, (1, 4))
    sampling = {"do_sample": True} if key in dict(REFUSED_WHEN_SAMPLING) else {}
    with pytest.raises(ValueError, match=rf"generate does not implement .*: {key}=.* \(argument\)"):
        tiny.generate(prompt, 2, **sampling, **{key: value})
    tiny.generation_config = {key: value, **sampling}
    with pytest.raises(ValueError, match=rf"{key}=.* \(from generation_config\.json\); (pass|remove)"):
        tiny.generate(prompt, 2)


def test_sampling_warpers_do_nothing_when_greedy(tiny):
    prompt = torch.randint(3, 128, (1, 4))
    expected = tiny.generate(prompt, 5, eos_token_id=[])
    tiny.generation_config = {key: value for key, value in REFUSED_WHEN_SAMPLING}
    assert torch.equal(tiny.generate(prompt, 5, eos_token_id=[], **dict(REFUSED_WHEN_SAMPLING)), expected)


@pytest.mark.parametrize("key,value", [
    ("assistant_model", object()), ("logits_processor", [lambda ids, scores: scores]),
    ("stopping_criteria", [lambda ids, scores: False]), ("prefix_allowed_tokens_fn", lambda batch, ids: [3]),
    ("negative_prompt_ids", torch.ones(1, 2, dtype=torch.long)), ("custom_generate", "some/repo"),
    ("synced_gpus", True)])
def test_hf_generate_arguments_that_change_decoding_are_refused(tiny, key, value):
    with pytest.raises(ValueError, match=rf"generate does not implement .*: {key}="):
        tiny.generate(torch.randint(3, 128, (1, 4)), 2, **{key: value})


def test_a_generation_config_argument_decodes_as_hfs(tmp_path):
    """TRL's GRPO / RLOO trainers pass ``generation_config=GenerationConfig(...)`` (do_sample, top_k=0, top_p,
    temperature, repetition_penalty, max_new_tokens, disable_compile, ...): its settings win over the checkpoint's
    generation_config.json, keyword arguments win over it, and the tokens are HF's, greedy and seeded sampling. One
    the loop does not implement is refused from there too, and a dict works as the object does."""
    hf, ours = _pair(tmp_path, do_sample=True, top_k=5, repetition_penalty=1.3)  # the file's settings
    ids, mask = _left_padded()
    config = transformers.GenerationConfig(do_sample=True, top_k=0, top_p=0.9, temperature=0.8,
                                           repetition_penalty=5.0, max_new_tokens=6, disable_compile=True,
                                           eos_token_id=[], pad_token_id=0)
    for seed in range(2):
        theirs, mine = _both(hf, ours, ids, seed, attention_mask=mask, generation_config=config)
        assert torch.equal(mine, theirs) and mine.shape[1] == PROMPT + 6, seed
    greedy_hf, greedy = _both(hf, ours, ids, attention_mask=mask, generation_config=config, do_sample=False,
                              max_new_tokens=4)  # keyword arguments over the object
    assert torch.equal(greedy, greedy_hf) and greedy.shape[1] == PROMPT + 4
    as_dict = ours.generate(ids, attention_mask=mask, generation_config=config.to_diff_dict(), do_sample=False,
                            max_new_tokens=4)
    assert torch.equal(as_dict, greedy)
    # the setting matters here: without the object the file's (repetition_penalty 1.3, top_k 5) decode otherwise
    assert not torch.equal(ours.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=4), greedy)
    with pytest.raises(ValueError, match="generate does not implement beam search: num_beams=4"):
        ours.generate(ids, generation_config=transformers.GenerationConfig(num_beams=4))
    with pytest.raises(TypeError, match="generation_config must be a GenerationConfig or a dict"):
        ours.generate(ids, generation_config=3)


def test_settings_that_cannot_change_the_tokens_are_accepted_and_typos_are_not(tiny):
    prompt = torch.randint(3, 128, (2, 4))
    expected = tiny.generate(prompt, 4, eos_token_id=[])
    inert = dict(use_cache=False, output_scores=True, output_logits=False, return_dict_in_generate=False,
                 num_beams=1, num_return_sequences=1, length_penalty=2.0, early_stopping=True, bos_token_id=1,
                 cache_implementation="static", penalty_alpha=0.0, guidance_scale=1.0, bad_words_ids=[],
                 transformers_version="5.25.0", _from_model_config=True)
    assert torch.equal(tiny.generate(prompt, 4, eos_token_id=[], logits_processor=[], **inert), expected)
    tiny.generation_config = dict(inert)
    assert torch.equal(tiny.generate(prompt, 4, eos_token_id=[]), expected)
    with pytest.raises(TypeError, match="repetition_penaltyy"):
        tiny.generate(prompt, 4, repetition_penaltyy=1.2)


@pytest.mark.parametrize("key,value,message", [
    ("repetition_penalty", 0.0, "repetition_penalty must be a number > 0"),
    ("no_repeat_ngram_size", -1, "no_repeat_ngram_size must be an integer ≥ 0"),
    ("min_new_tokens", 1.5, "min_new_tokens must be an integer ≥ 0"),
    ("min_length", -2, "min_length must be an integer ≥ 0")])
def test_bad_processor_values_are_named(tiny, key, value, message):
    prompt = torch.randint(3, 128, (1, 4))
    with pytest.raises(ValueError, match="min_p must be in"):
        tiny.generate(prompt, 2, do_sample=True, min_p=1.5)
    with pytest.raises(ValueError, match=rf"{message}.*\(argument\)"):
        tiny.generate(prompt, 2, **{key: value})
    tiny.generation_config = {key: value}
    with pytest.raises(ValueError, match=rf"{message}.*\(from generation_config\.json\)"):
        tiny.generate(prompt, 2)


# ---------------------------------------------------------------------------------------------------------------
# Medusa tree decoding: what it cannot honour is refused, never ignored


@pytest.mark.parametrize("key,value", [("repetition_penalty", 1.3), ("no_repeat_ngram_size", 2),
                                       ("min_new_tokens", 3), ("min_length", 9), ("stop_strings", ["x"]),
                                       ("num_beams", 2)])
def test_medusa_refuses_settings_it_cannot_honour(tiny, key, value):
    medusa = MedusaModel.from_base(tiny, num_heads=2)
    prompt = torch.randint(3, 128, (1, 4))
    with pytest.raises(ValueError, match=rf"Medusa tree decoding does not implement .*: {key}=.* \(argument\)"):
        medusa.generate(prompt, 4, **{key: value})
    tiny.generation_config = {key: value}
    with pytest.raises(ValueError, match=rf"{key}=.* \(from generation_config\.json\)"):
        medusa_generate(tiny, medusa.heads, prompt, 4)


def test_medusa_takes_a_neutral_argument_over_the_file_and_refuses_plain_sampling(tiny):
    heads = MedusaModel.from_base(tiny, num_heads=2).heads
    prompt = torch.randint(3, 128, (2, 5))
    # The file's sampling settings are not Medusa's (typical acceptance is): not taken, so not refused either.
    tiny.generation_config = {"repetition_penalty": 1.3, "do_sample": True, "top_p": 0.9, "typical_p": 0.5}
    out = medusa_generate(tiny, heads, prompt, 6, repetition_penalty=1.0, eos_token_id=[])
    assert torch.equal(out, tiny.generate(prompt, 6, do_sample=False, repetition_penalty=1.0, eos_token_id=[]))
    with pytest.raises(ValueError, match="top_p"):
        medusa_generate(tiny, heads, prompt, 4, repetition_penalty=1.0, top_p=0.9)
    with pytest.raises(TypeError, match="bogus"):
        medusa_generate(tiny, heads, prompt, 4, bogus=1)


# ---------------------------------------------------------------------------------------------------------------
# The CUDA-graph path and the CLI


def _graphed_against_eager(model, tokenizer, device):
    ids = torch.randint(3, 128, (3, PROMPT), device=device)
    common = dict(max_new_tokens=NEW, pad_token_id=0, repetition_penalty=1.5, no_repeat_ngram_size=2,
                  do_sample=False, tokenizer=tokenizer)
    full = model.generate(ids, eos_token_id=[], **common)
    eos = [int(full[1, PROMPT + 5])]
    stop = _boundary_string(tokenizer, full[0, PROMPT:].tolist(), 3)
    outs, calls = [], []
    for graphed in (False, True):
        recorder = Recorder()
        outs.append(model.generate(ids, eos_token_id=eos, min_new_tokens=2, stop_strings=[stop], streamer=recorder,
                                   cuda_graph=graphed, **common))
        calls.append(recorder.calls)
    assert torch.equal(outs[1], outs[0]) and calls[1] == calls[0]
    assert not torch.equal(outs[0], full)


def test_cuda_graph_path_applies_the_settings(monkeypatch):
    monkeypatch.setattr(graphed_decoding, "CAPTURE", False)  # CPU: the graphed calls run eagerly
    tokenizer, _ = _tokenizers()
    model = LigerLlamaForCausalLM.from_config(LlamaConfig.tiny(tie_word_embeddings=True))
    _graphed_against_eager(model, tokenizer, "cpu")


@pytest.mark.gpu
def test_cuda_graph_path_applies_the_settings_on_gpu():
    tokenizer, _ = _tokenizers()
    model = LigerLlamaForCausalLM.from_config(LlamaConfig.tiny(tie_word_embeddings=True), device="cuda")
    _graphed_against_eager(model, tokenizer, "cuda")


def _options(**given) -> GenerateConfig:
    return GenerateConfig(model="m", **given)


def test_cli_processor_options_reach_generate_and_medusa_refuses_them():
    args = _options(greedy=True, repetition_penalty=1.3, no_repeat_ngram_size=2, stop=["\n\n"])
    settings = dict(do_sample=False, repetition_penalty=1.3, no_repeat_ngram_size=2, stop_strings=["\n\n"])
    assert args.sampling_settings(medusa=False) == (settings, {})
    with pytest.raises(ValueError, match="--repetition-penalty / --no-repeat-ngram-size / --stop: Medusa"):
        args.sampling_settings(medusa=True)
    neutral = _options(repetition_penalty=1.0, min_new_tokens=0)  # overrides a file's values for Medusa
    assert neutral.sampling_settings(medusa=True) == (
        dict(temperature=0.0, repetition_penalty=1.0, min_new_tokens=0),
        dict(do_sample=False, repetition_penalty=1.0, min_new_tokens=0))
    assert _options(greedy=True).sampling_settings(medusa=False) == (dict(do_sample=False), {})


def test_cli_decode_cuts_each_row_at_its_stop_string():
    """A batch decoded in one call: each row's continuation ends at its stop string, as when decoded alone."""
    tokenizer, _ = _tokenizers()
    model = LigerLlamaForCausalLM.from_config(LlamaConfig.tiny(tie_word_embeddings=True))
    prompts = [torch.randint(3, 128, (n,)).tolist() for n in (4, 7)]
    sampling = dict(do_sample=False, repetition_penalty=3.0)
    first = model.generate(torch.tensor([prompts[0]]), NEW, eos_token_id=[], **sampling)[0, 4:].tolist()
    sampling["stop_strings"] = [_boundary_string(tokenizer, first, 3)]
    results = decode(model, prompts, torch.device("cpu"), max_new_tokens=NEW, sampling=sampling, seed=0,
                     cuda_graph=False, tokenizer=tokenizer)
    for prompt, result in zip(prompts, results):
        alone = model.generate(torch.tensor([prompt]), NEW, tokenizer=tokenizer, **sampling)[0, len(prompt):]
        assert result.new_ids == alone.tolist()
    assert len(results[0].new_ids) <= 4

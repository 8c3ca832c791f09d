"""The decoding recipes behind ``liger-models generate`` and ``calibrate-tree`` (chat.py: ``chat``).

``liger-models generate``: prompts in, text out, through plain decoding or Medusa tree decoding, with the time each
took. ``liger-models calibrate-tree``: fit a Medusa tree to trained heads on prompts from a data file
(medusa/calibrate.py) and save it next to them, where ``generate`` and ``MedusaModel.generate`` pick it up.

Loading: ``--model`` is a model directory or Hub id; ``--medusa`` a heads directory (Medusa/TGI format, v0.1 or
vLLM layout) or a stage-2 directory (base + heads). Without ``--model`` the base comes from the heads' directory
(stage 2) or from their config's ``base_model_name_or_path``. ``--adapter`` attaches a PEFT LoRA adapter (a
`train --lora-r` checkpoint, or one trained with HF + PEFT) to the base, unmerged: the model training computed;
``--model`` given an adapter directory alone does the same with the base its adapter_config.json names. The model
may be a bitsandbytes 4-bit checkpoint (its NF4 base, ``load_causal_lm``); ``--qlora-base`` quantises a dense base
to NF4 as it loads, as ``train --qlora`` does, so that a QLoRA adapter decodes on the base it trained against. The
tokenizer is the model's ``tokenizer.json``, else the one training copies next to the adapter or the heads.

Prompts: each ``--prompt`` / ``--prompt-file`` is decoded on its own, so each time is that prompt's alone, or with
``--batch-size N`` N at a time, left-padded in one call (plain or Medusa; a row's tokens are those it gets alone),
timed per batch.
Plain text is encoded as training encodes a plain document (the tokenizer's post-processor adds BOS where it
does); with ``--chat`` each prompt is one user turn (after ``--system``), rendered with the chat template training
uses (``render_generation_prompt``), so a model fine-tuned here is prompted in the format it learned.

Settings: plain decoding takes what is not given from the checkpoint's generation_config.json, as HF's generate does
(``--greedy`` forces argmax; ``--repetition-penalty``, ``--no-repeat-ngram-size``, ``--min-new-tokens`` and
``--stop`` override the file's processors, a row's text ending at its first stop string); Medusa decoding is greedy
unless ``--temperature`` > 0 (typical acceptance) and refuses those processors, the file's included, except at their
neutral values (``--repetition-penalty 1`` decodes a checkpoint whose file sets one). On CUDA
every step replays as one CUDA graph (``--no-cuda-graph`` runs eagerly), after an untimed warm-up call that
compiles the kernels; a call's time includes its graph capture (15–60 ms on an H200), as a user's call would.
``--compare`` also runs plain decoding on each prompt, so Medusa's speed-up is measured on the same machine, and,
when both are greedy, checks that the tokens are identical; each new prompt shape is then first decoded untimed by
both (Triton compiles per shape class), so neither's time holds compilation the other triggered. Medusa decoding
verifies the calibrated tree when the heads' directory holds one (``--default-tree``: the default tree).

Calibration prompts (``calibration_prompts``): a chat conversation gives its text up to the first assistant token
(the generation prompt training rendered); plain text gives windows of ``--prompt-tokens`` tokens. ``--prompts`` of
them, evenly spaced through the data, are decoded greedily for ``--new-tokens``.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from liger_models.hub import ADAPTER_CONFIG, is_bnb_4bit, load_tokenizer, named_base, read_config, resolve_model
from liger_models.input_files import read_text
from liger_models.lora import load_adapter, load_causal_lm
from liger_models.medusa import MedusaModel
from liger_models.medusa.calibrate import calibrate_medusa_choices, save_medusa_choices
from liger_models.medusa.checkpoint import CONFIG_NAME, holds_base_model, read_json
from liger_models.medusa.tree import TREE_TOKENS, default_medusa_choices, tree_for_batch
from liger_models.modules.generate import Settings, eos_token_ids, pad_token, stop_strings_of
from liger_models.recipes.configs import CalibrateConfig, DecodingConfig, GenerateConfig
from liger_models.recipes.lora import dense_base_note
from liger_models.text.chat import chat_template_note, render_generation_prompt
from liger_models.text.documents import load_documents
from liger_models.text.tokenize import tokenize_chunk
from liger_models.tokenizer import read_special_tokens

WARM_UP_TOKENS = 4  # enough for the prefill, a graph capture and a few steps to compile every kernel once


@dataclass
class Decoded:
    """One prompt's result: the continuation (prompt excluded), its token ids and the wall time of the call."""

    text: str
    new_ids: list[int]
    seconds: float
    tokens_per_step: float | None = None  # Medusa: tokens emitted per base-model forward (1.0 = plain decoding)


@dataclass
class PromptResult:
    prompt: str
    prompt_ids: list[int]
    decoded: Decoded  # Medusa's when --medusa is given, else plain decoding's
    plain: Decoded | None = None  # --compare: plain decoding of the same prompt


def _medusa_base(medusa_dir: Path) -> Path:
    """The base model directory for a heads directory given alone."""
    if holds_base_model(read_json(medusa_dir / CONFIG_NAME)):  # a stage-2 directory: the full base is there
        return medusa_dir
    return named_base(medusa_dir, CONFIG_NAME, "--medusa")


def is_adapter_dir(directory: Path) -> bool:
    """A PEFT adapter directory alone (a `train --lora-r` checkpoint): adapter_config.json and no model or heads
    config.json."""
    return (directory / ADAPTER_CONFIG).is_file() and not (directory / CONFIG_NAME).is_file()


@dataclass
class Sources:
    """Where a command's model, adapter, heads and tokenizer are, found before any weights load (a Hub id is
    fetched)."""

    model_dir: Path
    medusa_dir: Path | None
    tokenizer_dir: Path
    adapter_dir: Path | None = None


def locate(model: str | None, medusa: str | None, adapter: str | None = None) -> Sources:
    """The directories of ``--model`` / ``--medusa`` / ``--adapter``. ``--model`` may be an adapter directory alone
    (what `train --lora-r` saves): its base is the one its adapter_config.json names, with it attached."""
    if model is None and medusa is None and adapter is None:
        raise ValueError("give --model, --medusa, --adapter, or several")
    medusa_dir = None if medusa is None else Path(medusa).expanduser()
    adapter_dir = None if adapter is None else Path(adapter).expanduser()
    model_dir = None
    if model is not None and is_adapter_dir(Path(model).expanduser()):
        if adapter_dir is not None:
            raise ValueError(f"--model {model} is a LoRA adapter directory and --adapter names another: give one")
        adapter_dir = Path(model).expanduser()
    elif model is not None:
        model_dir = resolve_model(model)
    if model_dir is None:
        model_dir = (named_base(adapter_dir, ADAPTER_CONFIG, "--adapter") if adapter_dir is not None
                     else _medusa_base(medusa_dir))
    places = [model_dir] + [d for d in (adapter_dir, medusa_dir) if d not in (None, model_dir)]
    tokenizer_dir = next((d for d in places if (d / "tokenizer.json").is_file()), None)
    if tokenizer_dir is None:
        raise FileNotFoundError(f"no tokenizer.json in {' or '.join(map(str, places))}")
    return Sources(model_dir, medusa_dir, tokenizer_dir, adapter_dir)


def load_models(sources: Sources, dtype: torch.dtype | None, device: torch.device, *, load_tree: bool = True,
                qlora_base: bool = False):
    """(base model, MedusaModel or None), in eval mode, the adapter attached to the base when there is one;
    ``load_tree``: the heads' calibrated tree too; ``qlora_base``: the base quantised to NF4 first, as `train
    --qlora` quantises it (refused for a checkpoint stored in 4 bits, already NF4)."""
    if qlora_base and is_bnb_4bit(read_config(sources.model_dir)):
        raise ValueError(f"--qlora-base: {sources.model_dir} is a bitsandbytes 4-bit checkpoint, which loads as an NF4 "
                         "base already")
    base = load_causal_lm(sources.model_dir, dtype=dtype, device=device, quantise=qlora_base).eval()
    if sources.adapter_dir is not None:
        load_adapter(base, sources.adapter_dir)
    if sources.medusa_dir is None:
        return base, None
    return base, MedusaModel.from_pretrained(str(sources.medusa_dir), base=base, load_tree=load_tree).eval()


def encode_prompt(text: str, tokenizer, special, *, chat: bool, system: str | None = None,
                  chat_template: str = "auto") -> list[int]:
    """The prompt's token ids, as training would encode it (module docstring)."""
    if chat:
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": text}]
        return encode_conversation(messages, tokenizer, special, chat_template)
    ids = tokenizer.encode(text).ids
    if not ids:  # an empty text with no BOS to add: generate needs one token to start from
        raise ValueError(f"the prompt {text!r} encodes to no tokens (the tokenizer adds no BOS): give some text")
    return ids


def encode_conversation(messages: list[dict], tokenizer, special, chat_template: str = "auto") -> list[int]:
    """A conversation's token ids up to where the assistant's reply starts, as training renders and encodes chat."""
    doc = render_generation_prompt(messages, special, chat_template)
    return tokenizer.encode(doc.text, add_special_tokens=not doc.template_bos).ids


def timed_call(run, device: torch.device):
    """(run(), its wall seconds), the device synchronised before and after so the time is the work's."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    out = run()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return out, time.perf_counter() - start


def decode(model, prompts: list[list[int]], device: torch.device, *, max_new_tokens: int | None, sampling: dict,
           seed: int, cuda_graph: bool, tokenizer, medusa_choices=None,
           tree_tokens: int | None = None) -> list[Decoded]:
    """One call of plain (``model`` a causal LM) or Medusa (a MedusaModel) decoding on the prompts (token ids),
    left-padded into one batch when there are several, timed; each prompt's result, the call's time in each."""
    base = model.base if isinstance(model, MedusaModel) else model
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)  # id 0 at padding: any id does, the mask hides it
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt):], mask[row, width - len(prompt):] = torch.tensor(prompt), 1
    ids, mask = ids.to(device), mask.to(device)
    call = dict(generator=torch.Generator(device=device).manual_seed(seed), cuda_graph=cuda_graph)
    # Every id is text, even one that equals the pad id, which generate would take for padding. The mask that says
    # so goes only to prompts that hold the pad id or are padded: a mask sends plain decoding down its padded path,
    # which --compare would then time against Medusa's unmasked one.
    pad = pad_token(base, None)
    if bool((mask == 0).any()) or (pad is not None and bool((ids == pad).any())):
        call["attention_mask"] = mask
    stops = None
    if not isinstance(model, MedusaModel):  # stop strings (--stop or the file's) are matched on decoded text
        stops = stop_strings_of(Settings(base, {"stop_strings": sampling.get("stop_strings")}), tokenizer)
        out, seconds = timed_call(lambda: model.generate(ids, max_new_tokens, **call, **sampling,
                                                         tokenizer=tokenizer), device)
        steps = None
    else:
        (out, steps), seconds = timed_call(lambda: model.generate(
            ids, max_new_tokens, **call, return_stats=True, medusa_choices=medusa_choices, tree_tokens=tree_tokens,
            **sampling), device)
        steps = [steps] if len(prompts) == 1 else steps  # one list of tokens per step for each row
    eos = set(eos_token_ids(base, None))
    results = []
    for row in range(len(prompts)):
        new_ids = out[row, width:].tolist()
        ends = [next((i for i, t in enumerate(new_ids) if t in eos), None)]
        if stops is not None:  # the first stop string, matched on the row as generate saw it (its padding included)
            at = stops.first_stop(out[row].tolist(), width)
            ends.append(None if at is None else at - width)
        stop = min((i for i in ends if i is not None), default=None)
        new_ids = new_ids if stop is None else new_ids[: stop + 1]  # a row that stopped early was filled after it
        per_step = None if steps is None or not steps[row] else sum(steps[row]) / len(steps[row])
        if stops is not None and stop is not None and stop == ends[-1] != ends[0]:  # ended by a stop string
            text = stops.text_through_stop(prompts[row], new_ids)
        else:
            text = tokenizer.decode(new_ids, skip_special_tokens=True)
        results.append(Decoded(text, new_ids, seconds, per_step))
    return results


def tokenizer_and_specials(tokenizer_dir: Path):
    tokenizer = load_tokenizer(tokenizer_dir)
    return tokenizer, read_special_tokens(tokenizer, tokenizer_dir)


def read_prompt_file(path: str) -> str:
    """A prompt file's text, read as training reads a .txt document (UTF-8, a byte-order mark dropped)."""
    return read_text(path, name=f"--prompt-file {path}")


@dataclass
class Decoder:
    """A decoding command's loaded models and settings: decodes one prompt (token ids) at a time, timed."""

    base: torch.nn.Module
    medusa: torch.nn.Module | None  # a MedusaModel, or None for plain decoding
    choices: list[tuple[int, ...]] | None  # the tree Medusa verifies
    call: dict  # decode()'s max_new_tokens, seed, cuda_graph, tokenizer
    sampling: dict
    plain_sampling: dict  # --compare's plain decoding
    tree_tokens: int | None = None  # a batch's tree cut to this many tokens per call (medusa.tree.tree_for_batch)

    def __call__(self, ids: list[int], *, plain: bool = False, max_new_tokens: int | None = None) -> Decoded:
        return self.batch([ids], plain=plain, max_new_tokens=max_new_tokens)[0]

    def batch(self, prompts: list[list[int]], *, plain: bool = False,
              max_new_tokens: int | None = None) -> list[Decoded]:
        """The prompts decoded in one call (left-padded), each one's result."""
        device = self.base.lm_head.weight.device
        call = self.call if max_new_tokens is None else {**self.call, "max_new_tokens": max_new_tokens}
        if plain or self.medusa is None:
            return decode(self.base, prompts, device, **call, sampling=self.plain_sampling if plain else self.sampling)
        return decode(self.medusa, prompts, device, **call, sampling=self.sampling, medusa_choices=self.choices,
                      tree_tokens=self.tree_tokens)

    def warm_up(self, prompts: list[list[int]], compare: bool = False, whole: bool = False) -> None:
        """On CUDA, compile every kernel once (and capture once) outside the timed calls. ``whole``: decode the
        whole budget, so that kernels specialised to the cache's size (which the budget sets) compile too."""
        if self.base.lm_head.weight.is_cuda:
            tokens = None if whole else WARM_UP_TOKENS
            self.batch(prompts, max_new_tokens=tokens)
            if compare:
                self.batch(prompts, plain=True, max_new_tokens=tokens)


def open_decoder(config: DecodingConfig, sources: Sources, tokenizer, log, *, rows: int = 1,
                 tree_tokens: int | None = None) -> Decoder:
    """Load the models of ``sources`` as the config says and report the Medusa tree on ``log``. ``rows``: prompts
    per call, ``tree_tokens``: the tree's cut per call (GenerateConfig's; chat decodes one row: nothing to cut)."""
    device, dtype = config.device_and_dtype()
    sampling, plain_sampling = config.sampling_settings(config.medusa is not None)
    base, medusa = load_models(sources, dtype, device, load_tree=not config.default_tree, qlora_base=config.qlora_base)
    adapter = sources.adapter_dir
    if adapter is None and sources.medusa_dir is not None and (sources.medusa_dir / ADAPTER_CONFIG).is_file():
        adapter = sources.medusa_dir  # heads trained through an adapter of the base (stage 2), which they attach
    note = dense_base_note(adapter, base)
    if note is not None:
        print(note, file=log, flush=True)
    choices = None
    tree_tokens = TREE_TOKENS if tree_tokens is None else tree_tokens
    if medusa is not None:
        choices = medusa.medusa_choices or default_medusa_choices(medusa.heads.num_heads)
        tree = "default" if medusa.medusa_choices is None else "calibrated"
        cut = len(tree_for_batch(choices, rows, tree_tokens))
        cut_note = "" if cut == len(choices) else f"; {cut + 1} nodes per row in batches of {rows} (--tree-tokens)"
        print(f"[medusa] {len(choices) + 1}-node {tree} tree{cut_note}", file=log, flush=True)
    call = dict(max_new_tokens=config.max_new_tokens, seed=config.seed, tokenizer=tokenizer,
                cuda_graph=device.type == "cuda" and not config.no_cuda_graph)
    return Decoder(base, medusa, choices, call, sampling, plain_sampling, tree_tokens)


def run_generate(config: GenerateConfig | argparse.Namespace, out=None, log=None) -> list[PromptResult]:
    """The command: load, encode each prompt, decode (and --compare), print the text to ``out`` (stdout) and the
    timings to ``log`` (stderr). A parsed command line (cli.build_parser) is taken too, as its config."""
    out, log = out or sys.stdout, log or sys.stderr  # looked up now: a caller (or a test) may have replaced them
    config = GenerateConfig.coerce(config)
    config.validate()
    prompts = list(config.prompt or []) + [read_prompt_file(f) for f in config.prompt_file or []]
    sources = locate(config.model, config.medusa, config.adapter)
    tokenizer, special = tokenizer_and_specials(sources.tokenizer_dir)
    if config.chat:
        print(chat_template_note(special, config.chat_template or "auto"), file=log, flush=True)
    encoded = [encode_prompt(p, tokenizer, special, chat=config.chat, system=config.system,
                             chat_template=config.chat_template or "auto") for p in prompts]
    decoder = open_decoder(config, sources, tokenizer, log, rows=config.batch_size, tree_tokens=config.tree_tokens)
    size = config.batch_size
    batches = [list(range(start, min(start + size, len(prompts)))) for start in range(0, len(prompts), size)]
    results, warmed = [], set()
    for batch in batches:
        chunk = [encoded[i] for i in batch]
        # Triton compiles a kernel per shape class (rows, the cache's size), so the first call of a new prompt
        # shape pays compilation: once untimed at the start, and, for --compare, before every new shape by both
        # decoders, so that neither's time holds the other's compiles.
        shape = (len(chunk), max(len(ids) for ids in chunk))
        if not warmed or (config.compare and shape not in warmed):
            decoder.warm_up(chunk, config.compare, whole=config.compare)
        warmed.add(shape)
        decoded = decoder.batch(chunk)
        plain = decoder.batch(chunk, plain=True) if config.compare else [None] * len(batch)
        done = [PromptResult(prompts[i], encoded[i], d, p) for i, d, p in zip(batch, decoded, plain)]
        for result in done:
            print(result.decoded.text, file=out, flush=True)
        print(_summary(done, medusa=decoder.medusa is not None,
                       greedy=decoder.plain_sampling.get("do_sample") is False), file=log, flush=True)
        results += done
    return results


def calibration_prompts(paths, tokenizer, special, *, count: int, prompt_tokens: int,
                        chat_template: str = "auto") -> list[list[int]]:
    """``count`` prompts evenly spaced through the data (module docstring), encoded as training encodes them."""
    docs = load_documents(paths, special, chat_template)
    ids, has_loss, lengths = tokenize_chunk(docs, tokenizer, special)
    candidates, offset = [], 0
    for doc, n in zip(docs, lengths.tolist()):
        doc_ids, doc_loss = ids[offset: offset + n].tolist(), has_loss[offset: offset + n]
        offset += n
        if doc.spans is not None:  # chat: up to the first assistant token
            if doc_loss.any():
                candidates.append(doc_ids[: int(doc_loss.argmax())])
            continue
        if doc_ids and doc_ids[-1] == special.eos_id:  # the EOS tokenize_chunk closed the document with
            doc_ids = doc_ids[:-1]
        candidates += [doc_ids[i: i + prompt_tokens] for i in range(0, len(doc_ids) - prompt_tokens + 1, prompt_tokens)]
    candidates = [c for c in candidates if c]
    if not candidates:
        raise ValueError(f"no prompt of {prompt_tokens} tokens in {[str(p) for p in paths]}: give more text or a "
                         "smaller --prompt-tokens")
    picks = torch.linspace(0, len(candidates) - 1, min(count, len(candidates))).round().long().unique().tolist()
    return [candidates[i] for i in picks]


def run_calibrate(config: CalibrateConfig | argparse.Namespace, log=None):
    """The calibrate-tree command: fit the tree, save it next to the heads, report what it gains. A parsed
    command line (cli.build_parser) is taken too, as its config."""
    log = log or sys.stderr
    config = CalibrateConfig.coerce(config)
    config.validate()
    device, dtype = config.device_and_dtype()
    sources = locate(config.model, config.medusa)
    tokenizer, special = tokenizer_and_specials(sources.tokenizer_dir)
    # The data is read before the weights load, so a mistake there costs no model load.
    prompts = calibration_prompts(config.data, tokenizer, special, count=config.prompts,
                                  prompt_tokens=config.prompt_tokens, chat_template=config.chat_template)
    # The tree already saved there (if any) is the one being replaced: not loaded, so a broken one is no obstacle.
    base, medusa = load_models(sources, dtype, device, load_tree=False)
    calibration = calibrate_medusa_choices(
        base, medusa.heads, [torch.tensor(p, device=device) for p in prompts], new_tokens=config.new_tokens,
        size=config.size, cuda_graph=device.type == "cuda" and not config.no_cuda_graph)
    path = save_medusa_choices(sources.medusa_dir, calibration)
    default_nodes = len(default_medusa_choices(medusa.heads.num_heads)) + 1
    if calibration.kept_default:
        fitted = f"the default {default_nodes}-node tree kept (no fitted tree did better)"
    else:
        fitted = f"a {len(calibration.medusa_choices) + 1}-node tree"
    print(f"{fitted}, from {calibration.positions} positions of {len(prompts)} greedy continuations: "
          f"{calibration.tokens_per_step:.2f} tokens per base-model forward when decoding them (the default "
          f"{default_nodes}-node tree: {calibration.default_tokens_per_step:.2f})", file=log, flush=True)
    cuts = ", ".join(f"{batch} rows: {nodes} nodes, {tokens:.2f}"
                     for batch, (nodes, tokens) in calibration.by_batch.items())
    print(f"batched (the tree cut to {TREE_TOKENS} tokens per call), per row: {cuts}\nwrote {path}", file=log,
          flush=True)
    return calibration


def describe_rate(d: Decoded) -> str:
    return _rate(len(d.new_ids), d.seconds)


def _rate(tokens: int, seconds: float) -> str:
    return f"{tokens} new tokens in {seconds:.2f} s ({tokens / max(seconds, 1e-9):.1f} tokens/s)"


def _summary(results: list[PromptResult], *, medusa: bool, greedy: bool) -> str:
    """One prompt's timing line (one batch's, for several decoded in one call; the call's time is theirs together)."""
    decoded = [r.decoded for r in results]
    tokens, seconds = sum(len(d.new_ids) for d in decoded), decoded[0].seconds
    lengths = sorted(len(r.prompt_ids) for r in results)
    what = (f"{lengths[0]}-token prompt" if len(results) == 1 else
            f"{len(results)} prompts of {lengths[0]}–{lengths[-1]} tokens in one batch")
    line = f"[{'medusa' if medusa else 'plain'}] {what}, {_rate(tokens, seconds)}"
    per_step = [d.tokens_per_step for d in decoded if d.tokens_per_step is not None]
    if per_step:
        line += f", {sum(per_step) / len(per_step):.2f} tokens per base-model forward"
        line += "" if len(results) == 1 else " (mean over the rows)"
    if results[0].plain is not None:
        plain = [r.plain for r in results]
        plain_tokens, plain_seconds = sum(len(p.new_ids) for p in plain), plain[0].seconds
        speedup = (tokens / max(seconds, 1e-9)) / max(plain_tokens / max(plain_seconds, 1e-9), 1e-9)
        same = "same prompt" if len(results) == 1 else "same batch"
        line += f"\n[plain]  {same}, {_rate(plain_tokens, plain_seconds)}: Medusa {speedup:.2f}× the tokens/s"
        if greedy:
            line += f"; identical tokens: {all(d.new_ids == p.new_ids for d, p in zip(decoded, plain))}"
    return line

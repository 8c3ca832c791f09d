"""Medusa tree decoding: candidates from the heads' top-k, verification by the base model, greedy/typical acceptance.

One step (of one sequence, as in the reference implementation; several sequences, or a left-padded one, decode
each at its own length: medusa/batched_steps.py):
  1. The root is the base model's own next token (argmax, or drawn when temperature > 0); head d (1-based)
     proposes its top-k tokens for the position d steps after the root.
  2. `medusa_choices` is a tree of rank paths: (0, 1) = head 1's rank 0, then head 2's rank 1. Every root-to-leaf
     path of the tree is one candidate continuation.
  3. The base verifies all candidates in one forward call and each path keeps its longest accepted prefix:
     greedy (temperature 0): a token is accepted iff it is the base's argmax after the tokens before it — the output
     is then token for token what plain greedy decoding of the base produces;
     typical (temperature > 0): accepted iff p_base(x) > min(ε, δ·exp(−H(p_base))) (posterior_threshold ε,
     posterior_alpha δ; not distribution-preserving), ties on length broken by the summed log-probability
     (medusa/acceptance.py).
  4. The step emits root + accepted tokens; the base's prediction after the last accepted token is the next root.

Rotary tables that depend on the sequence length (longrope's switch at original_max_position_embeddings, dynamic
NTK past max_position_embeddings): plain greedy decoding rotates position p with the table for length p + 1 and,
when longrope switches, recomputes the whole sequence (modules/generate.py). A verification call rotates all its
positions with the table of its last one, so a step whose tree would span two tables verifies the root alone, and
a longrope switch re-prefills the committed tokens, as plain greedy does: the greedy output stays identical.

Verification layout. As in the reference implementation, the 1 + N tree nodes run as one sequence on top of the
KV cache with a tree attention mask (each node sees the cache, its ancestors and itself; `DecoderModel`'s
tree_mask) at positions past + depth; the accepted path's keys and values are then moved down to the committed
positions (`KVCache.keep`) and the rest of the tree is dropped. One verification call costs 1 + N tokens of
compute, and nothing prefix-sized is copied.

cuda_graph=True: every step replays whole as one CUDA graph (heads, candidates, verification, acceptance, compaction,
the next root's draw; medusa/graphed_step.py) over a static cache, one host read per step, for greedy and typical
acceptance alike; the draws follow the eager path's, so a seeded generator gives the same tokens either way.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from liger_models.medusa.acceptance import accept, draw
from liger_models.medusa.batched_steps import BatchedSteps, check_one_rotary_table, decode_rows, rows_capacity
from liger_models.medusa.graphed_step import GraphedSteps
from liger_models.medusa.heads import MedusaHeads, base_logits
from liger_models.medusa.tree import (TOPK, TREE_TOKENS, MedusaBuffers, candidate_tokens, default_medusa_choices,
                                     dense_medusa_choices, generate_medusa_buffers, tree_for_batch)
from liger_models.modules.cache import KVCache
from liger_models.modules.inputs import check_input_ids, checks_its_own_token_ids
from liger_models.modules.generate import (IMPLEMENTED, INERT, PREALLOCATED_NEW_TOKENS, REFUSED, SAMPLING, Refused,
                                           Settings, check_keywords, eos_token_ids, fill_token,
                                           new_token_budget, pad_token, prompt_mask, refuse_unsupported)

# Graphed steps launch the next step before reading this one's tokens when the next is certain (GraphedSteps.tree);
# False reads every step before the next is launched (benchmarks/tools/profile_decode.py compares the two).
LAUNCH_AHEAD = True

# Settings plain generate applies that tree decoding does not (its greedy output is plain greedy decoding's only
# without them): refused, from an argument or from generation_config.json, where they would change the tokens.
NOT_IN_TREE_DECODING = {
    "repetition_penalty": Refused(lambda v, s: v != 1, "a repetition penalty", 1.0),
    "no_repeat_ngram_size": Refused(lambda v, s: v > 0, "n-gram blocking", 0),
    "min_new_tokens": Refused(lambda v, s: v > 0, "a minimum length", 0),
    "min_length": Refused(lambda v, s: v > 0, "a minimum length", 0),
    "stop_strings": Refused(lambda v, s: bool(v), "stop strings", []),
}

# The tree's layout lives in tree.py; its names stay importable from here, where decoding has always offered them.
__all__ = ["TOPK", "TREE_TOKENS", "MedusaBuffers", "default_medusa_choices", "dense_medusa_choices",
           "generate_medusa_buffers", "medusa_generate", "tree_for_batch"]


class _Steps:
    """Medusa steps run eagerly on a KVCache, the acceptance's result read by the host. The state is the base's last
    hidden state (1, H) and the next root (1,), drawn when the state is set, as ``GraphedSteps`` (cuda_graph=True)
    draws it, so both consume a generator in the same order."""

    def __init__(self, base: nn.Module, heads: MedusaHeads, buffers: MedusaBuffers, topk: int, capacity: int,
                 acceptance: tuple[float, float, float], generator: torch.Generator | None) -> None:
        self.base, self.heads, self.buffers, self.topk, self.capacity = base, heads, buffers, topk, capacity
        self.acceptance, self.generator = acceptance, generator
        self.cache: KVCache | None = None
        self.hidden = self.root = None

    def prefill(self, ids: torch.Tensor) -> None:
        """A fresh cache holding ids (1, T); the state after them."""
        self.cache = KVCache(self.capacity)
        self._set_state(self.base.model(ids, cache=self.cache)[:, -1])

    def _set_state(self, hidden: torch.Tensor, logits: torch.Tensor | None = None) -> None:
        """hidden (1, H) and, if known, the base's logits there (1, V)."""
        self.hidden = hidden
        logits = base_logits(self.base, hidden) if logits is None else logits
        self.root = draw(logits, self.acceptance[0], self.generator)

    def root_only(self, length: int) -> list[int]:
        """Emit the root alone, at position ``length``."""
        root = self.root
        self._set_state(self.base.model(root[None], cache=self.cache)[:, 0])
        return root.tolist()

    def tree(self, length: int, ahead: bool = False) -> list[int]:
        """One Medusa step after ``length`` committed tokens: the root and the accepted candidates (``ahead``:
        see ``GraphedSteps.tree``; eagerly nothing is gained by it)."""
        buffers = self.buffers
        tree = candidate_tokens(self.heads, self.hidden, self.root, buffers, self.topk)[0]  # (1+N,)
        positions = (length + buffers.tree_position_ids)[None]
        out = self.base.model(tree[None], positions, cache=self.cache, tree_mask=buffers.tree_mask)[0]  # (1+N, H)
        logits = base_logits(self.base, out)  # (1+N, V)
        row, n = accept(tree, logits, buffers.path_nodes, buffers.path_valid, *self.acceptance)
        nodes = buffers.path_nodes[int(row), : int(n) + 1]  # the accepted path, root first
        self.cache.keep(length, nodes)
        self._set_state(out[nodes[-1:]], logits[nodes[-1:]])
        return tree[nodes].tolist()


@torch.no_grad()
@checks_its_own_token_ids
def medusa_generate(base: nn.Module, heads: MedusaHeads, input_ids: torch.Tensor, max_new_tokens: int | None = None, *,
                    medusa_choices: Sequence[Sequence[int]] | None = None, temperature: float = 0.0,
                    posterior_threshold: float = 0.09, posterior_alpha: float = 0.3, topk: int = TOPK,
                    eos_token_id: int | Sequence[int] | None = None, pad_token_id: int | None = None,
                    attention_mask: torch.Tensor | None = None, generator: torch.Generator | None = None,
                    return_stats: bool = False, cuda_graph: bool = False, tree_tokens: int | None = TREE_TOKENS,
                    max_length: int | None = None, **settings):
    """(B, T) prompts → (B, T + n) tokens, n ≤ max_new_tokens, each row stopping after an EOS token. max_new_tokens
    None takes max_length or the checkpoint's generation_config.json as plain generate does (`new_token_budget`).
    settings: HF GenerationConfig fields, as plain generate takes them; those that would change the tokens and that
    tree decoding does not implement (repetition_penalty, no_repeat_ngram_size, min_new_tokens / min_length,
    stop_strings, beam search, …) are refused with a ValueError naming the setting and its source (argument or
    generation_config.json), plain generate's sampling settings (do_sample, top_k, top_p, …) when given as arguments
    too; an unknown keyword is a TypeError. Prompts of different lengths come left-padded with an attention_mask
    (or the pad id, as plain generate infers it); rows that stop early are filled with the pad id, as plain generate
    fills them (medusa/batched_steps.py).

    base: a zoo causal LM (`.model(ids, position_ids, cache=...)`, `.lm_head`); heads: its Medusa heads.
    temperature 0 is greedy (identical output to plain greedy decoding); > 0 uses typical acceptance. Unlike the
    budget, the default stays greedy whatever generation_config.json says: typical acceptance is not the sampling
    (do_sample / top_p / top_k) that file describes, so its sampling settings are not applied here.
    return_stats: also return the list of tokens emitted per step (root + accepted; the mean is the speedup
    in base forward calls); for several rows, one such list per row.
    generator: the draws' (temperature > 0), on the model's device; None takes the device's default.
    cuda_graph: replay each whole step as one CUDA graph over a static cache of T + max_new_tokens + tree slots
    (medusa/graphed_step.py), without the host's per-kernel cost, which otherwise bounds a batch-1 step. In bf16 a
    near-tied argmax may flip, as with generate's cuda_graph. Several rows (or a padded one) take a static cache of
    T + max_new_tokens + depth + tree slots either way, and refuse a rotary table that changes within the positions
    they reach (longrope, dynamic NTK: `batched_steps.check_one_rotary_table`), which one unpadded sequence handles.
    A prompt id equal to the pad id (argument, else the checkpoint's) is padding, as in plain generate, unless
    attention_mask says otherwise (all ones: those ids are real text).
    medusa_choices: the tree (rank paths; None: the default one), verified whole while the batch's rows × (1 + its
    nodes) fit in ``tree_tokens``, else cut to fit, its first-listed choices kept (`tree.tree_for_batch`: the
    45-node default tree whole up to two rows, 24 nodes at four, 12 at eight). tree_tokens None or 0: never cut.
    """
    if input_ids.dim() != 2 or 0 in input_ids.shape:
        raise ValueError(f"input_ids must be (batch, length) with at least one token (e.g. the BOS id), got shape "
                         f"{tuple(input_ids.shape)}")
    if not temperature >= 0:  # not `< 0`: NaN would pass, and every draw would be argmax over NaN
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    check_tree_decoding_settings(base, settings)
    vocab_size = base.config.vocab_size
    if (heads.config.hidden_size, heads.config.vocab_size) != (base.config.hidden_size, vocab_size):
        # MedusaModel refuses such a pair; called directly, heads for a smaller vocabulary ran silently (they never
        # propose the base's last ids) and a wider base failed inside a head's GEMM.
        raise ValueError(f"Medusa heads are for hidden/vocab {(heads.config.hidden_size, heads.config.vocab_size)}, "
                         f"the base model has {(base.config.hidden_size, vocab_size)}")
    check_input_ids(input_ids, vocab_size)
    if temperature > 0 and generator is not None and generator.device.type != input_ids.device.type:
        raise ValueError(f"the generator is on {generator.device}, the model's tokens on {input_ids.device}: draws "
                         "happen on the model's device (torch.Generator(device=...))")
    if not 0 < topk <= heads.config.vocab_size:
        raise ValueError(f"topk must be in [1, vocab_size={heads.config.vocab_size}], got {topk}")
    max_new_tokens = new_token_budget(base, max_new_tokens, input_ids.shape[1], max_length)
    device = input_ids.device
    choices = default_medusa_choices(heads.num_heads) if medusa_choices is None else medusa_choices
    buffers = generate_medusa_buffers(choices, heads.num_heads, topk, device)  # checks the tree whatever the batch
    cut = tree_for_batch(choices, input_ids.shape[0], tree_tokens)
    if len(cut) < len(choices):
        buffers = generate_medusa_buffers(cut, heads.num_heads, topk, device)
    depth = buffers.depth
    eos_list = eos_token_ids(base, eos_token_id)  # the checkpoint's default, as generate takes it
    eos = set(eos_list)
    pad_token_id = pad_token(base, pad_token_id)  # the checkpoint's default, as generate takes it
    mask = prompt_mask(input_ids, attention_mask, pad_token_id,
                       torch.tensor(eos_list, dtype=torch.long, device=device))
    acceptance = (temperature, posterior_threshold, posterior_alpha)
    mask = None if mask is None or bool(mask.all()) else mask  # all ones: nothing to hide
    if input_ids.shape[0] > 1 or mask is not None:
        capacity = rows_capacity(input_ids.shape[1], max_new_tokens, buffers)
        check_one_rotary_table(base, input_ids.shape[1], max_new_tokens, depth, mask)
        steps = BatchedSteps(base, heads, buffers, topk, capacity, acceptance, generator, batch=input_ids.shape[0],
                             budget=max_new_tokens, eos=eos_list, graphed=cuda_graph)
        fill = fill_token(vocab_size, pad_token_id, eos_list)
        # Eagerly a step launched ahead gains nothing and, once an EOS ends every row, is a whole wasted tree call.
        result, per_row = decode_rows(steps, input_ids, mask, max_new_tokens, eos, fill, LAUNCH_AHEAD and cuda_graph)
        # One sequence's stats are one list whether or not its prompt holds padding (the pad id may occur in it).
        per_row = per_row[0] if input_ids.shape[0] == 1 else per_row
        return (result, per_row) if return_stats else result
    rotary = getattr(base.model, "rotary", None)
    regime, table_key = (rotary.regime, rotary.table_key) if rotary is not None else ((lambda n: None),) * 2

    # Room for the prompt, the budget and one tree (eagerly: the budget up to generate's preallocation, past which
    # the cache grows; a static cache cannot grow).
    budget = max_new_tokens if cuda_graph else min(max_new_tokens, PREALLOCATED_NEW_TOKENS)
    capacity = input_ids.shape[1] + budget + len(buffers.tree_indices)
    steps = (GraphedSteps if cuda_graph else _Steps)(base, heads, buffers, topk, capacity, acceptance, generator)
    steps.prefill(input_ids)
    length = input_ids.shape[1]  # committed tokens
    cached_regime = regime(length)
    new_tokens: list[int] = []
    per_step = []
    while len(new_tokens) < max_new_tokens:
        if regime(length) != cached_regime:  # longrope switched: recompute the sequence, as generate does
            cached_regime = regime(length)
            steps.prefill(_joined(input_ids, new_tokens))
        if table_key(length + depth + 1) != table_key(length):  # the tree would span two rotary tables: root alone
            step_tokens = steps.root_only(length)
        else:
            # Whether the next call is surely a tree step too (the budget not spent, no re-prefill, no root-only
            # step: regime and table are monotone in the length): a graphed one is then launched before this one's
            # tokens are read.
            furthest = length + depth + 1  # where the next step can start at the latest
            ahead = (LAUNCH_AHEAD and len(new_tokens) + depth + 1 < max_new_tokens
                     and regime(furthest) == cached_regime and table_key(furthest + depth + 1) == table_key(length))
            step_tokens = steps.tree(length, ahead)
        length += len(step_tokens)
        step_tokens = step_tokens[: max_new_tokens - len(new_tokens)]
        stop = [i for i, t in enumerate(step_tokens) if t in eos]
        if stop:
            step_tokens = step_tokens[: stop[0] + 1]
        new_tokens += step_tokens
        per_step.append(len(step_tokens))
        if stop:
            break
    result = _joined(input_ids, new_tokens)
    return (result, per_step) if return_stats else result


def check_tree_decoding_settings(base: nn.Module, settings: dict) -> None:
    """Refuse what tree decoding would otherwise ignore: an unknown keyword (TypeError), plain generate's sampling
    given as an argument, and any setting, argument or generation_config.json, that would change the tokens and that
    it does not implement. The file's sampling settings are not taken (see medusa_generate), so not refused."""
    check_keywords(settings, frozenset(REFUSED) | INERT | IMPLEMENTED | SAMPLING, "medusa_generate")
    sampling = sorted(key for key in SAMPLING if settings.get(key) is not None)
    if sampling:
        raise ValueError(f"Medusa tree decoding samples with typical acceptance (temperature > 0) and is greedy at "
                         f"temperature 0: {', '.join(sampling)} (argument) are plain generate's sampling settings")
    resolved = Settings(base, settings, ignored_file_keys=SAMPLING)
    refuse_unsupported(resolved, {**NOT_IN_TREE_DECODING, **REFUSED}, "Medusa tree decoding")


def _joined(input_ids: torch.Tensor, new_tokens: list[int]) -> torch.Tensor:
    """The (1, T + n) sequence: the prompt, then the new tokens (int64, as the model's ids)."""
    new = torch.tensor(new_tokens, dtype=torch.long, device=input_ids.device)
    return torch.cat([input_ids[0], new])[None]

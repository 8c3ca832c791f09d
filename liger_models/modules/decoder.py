"""Decoder layer and decoder stack with the residual stream carried through fused add + RMSNorm.

HF computes, per layer, ``h = h + attn(norm_in(h)); h = h + mlp(norm_post(h))`` and finally ``norm(h)``. Here each
norm also does the preceding residual add: a layer receives (x, residual) where the true stream is x + residual,
and ``add_rms_norm`` returns both the normalised input and the new stream in one pass. The first layer's input
norm sees the embeddings alone; the final norm folds in the last MLP output.
"""

from __future__ import annotations

from functools import partial

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from .attention import Attention, AttentionMask, document_ids
from .cache import KVCache
from .config import LigerConfig
from .embedding import ScaledEmbedding
from .fused import add_norm, norm_linear
from .inputs import check_attention_mask, check_forward_inputs, check_position_ids
from .mlp import GatedMLP
from .moe import SparseMoeBlock, per_expert_state_dict, stacked_from_per_expert
from .norm import make_norm
from .rope import RotaryEmbedding


def key_padding(attention_mask: torch.Tensor | None, batch: int, kv_len: int) -> torch.Tensor | None:
    """(B, kv_len) bool, True for real tokens, from HF's 2D attention_mask; None when nothing is padded."""
    if attention_mask is None:
        return None
    if attention_mask.dim() != 2 or tuple(attention_mask.shape) != (batch, kv_len):
        raise ValueError(f"attention_mask must be (batch, past + new tokens) = {(batch, kv_len)}, got shape "
                         f"{tuple(attention_mask.shape)}")
    padding = attention_mask.bool()
    return None if bool(padding.all()) else padding  # all ones: keep the unmasked fast path


def check_inputs_embeds(inputs_embeds: torch.Tensor, input_ids: torch.Tensor | None, hidden_size: int) -> None:
    """inputs_embeds: (batch, seq_len, hidden_size) floats, given instead of input_ids (not with them)."""
    if input_ids is not None:
        raise ValueError("pass input_ids or inputs_embeds, not both")
    tensor = isinstance(inputs_embeds, torch.Tensor)
    if not tensor or inputs_embeds.dim() != 3 or inputs_embeds.shape[-1] != hidden_size:
        shape = tuple(inputs_embeds.shape) if tensor else type(inputs_embeds).__name__
        raise ValueError(f"inputs_embeds must be (batch, seq_len, hidden_size={hidden_size}), got shape {shape}")
    if not inputs_embeds.is_floating_point():
        raise ValueError(f"inputs_embeds must be floating point embeddings, got dtype {inputs_embeds.dtype} (token ids "
                         "go in input_ids)")


class DecoderLayer(nn.Module):
    """HF names: input_layernorm, self_attn, post_attention_layernorm, mlp; with ``config.sandwich_norms`` (Gemma
    2/3) also pre_feedforward_layernorm and post_feedforward_layernorm.

    Sandwich order (HF): h = h + N_post_attn(attn(N_in(h))); h = h + N_post_ffw(mlp(N_pre_ffw(h))). The two "post"
    norms act on a block's output alone, before its residual add, so they run unfused; the adds still fuse into the
    norm that follows them (N_pre_ffw, then the next layer's N_in or the final norm), exactly as in the plain
    layer, where post_attention_layernorm is the MLP's input norm.
    """

    def __init__(self, config: LigerConfig, layer_idx: int) -> None:
        super().__init__()
        self.input_layernorm = make_norm(config)
        self.self_attn = Attention(config, layer_idx)
        self.post_attention_layernorm = make_norm(config)
        self.sandwich = config.sandwich_norms
        if self.sandwich:
            self.pre_feedforward_layernorm = make_norm(config)
            self.post_feedforward_layernorm = make_norm(config)
        # Set by a wrapper that runs this layer's forward under a checkpoint (train.distributed.
        # apply_activation_checkpointing): DecoderModel.run then hands it one stream tensor, not the (x, residual) pair.
        self.checkpointed = False
        # Rows per MLP chunk in a differentiable call (LigerForCausalLM.mlp_chunking_enable), or None: the whole MLP.
        self.mlp_chunk_tokens: int | None = None
        self.sparse = config.layer_is_sparse(layer_idx)
        if self.sparse and self.sandwich:
            raise ValueError("a sparse (mixture-of-experts) layer with sandwich norms is not supported")
        self.mlp = SparseMoeBlock(config) if self.sparse else GatedMLP(config)
        if self.sparse:
            # Checkpoint names: per expert on disk (under the family's block name), stacked in memory.
            self._disk_block = config.moe_block_name
            self._expert_names = config.expert_tensor_names
            self.register_state_dict_post_hook(_experts_to_disk_names)
            self._register_load_state_dict_pre_hook(_experts_from_disk_names, with_module=True)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                mask: AttentionMask, cache: KVCache | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (mlp output, residual stream before it); their sum is HF's layer output."""
        qkv, residual = norm_linear(self.input_layernorm, x, residual, self.self_attn.projections())
        a = self.self_attn.from_qkv(qkv, cos, sin, mask, cache)
        if self.sparse:  # the router and the experts both read the normalised input
            h, residual = add_norm(self.post_attention_layernorm, a, residual)
            return self.mlp(h), residual
        chunk = self.mlp_chunk_tokens
        if chunk is not None and torch.is_grad_enabled() and a.shape[:-1].numel() > chunk:
            return self._chunked_mlp(a, residual, chunk)
        if not self.sandwich:
            gate_up, residual = norm_linear(self.post_attention_layernorm, a, residual, self.mlp.projections())
            return self.mlp.from_gate_up(gate_up), residual
        a = self.post_attention_layernorm(a)
        gate_up, residual = norm_linear(self.pre_feedforward_layernorm, a, residual, self.mlp.projections())
        return self.post_feedforward_layernorm(self.mlp.from_gate_up(gate_up)), residual

    def _chunked_mlp(self, a: torch.Tensor, residual: torch.Tensor, chunk: int):
        """The MLP half over row chunks of the stream, each checkpointed: backward recomputes one chunk's gate|up,
        activation and norm at a time, so the layer never holds them for every token at once (they dominate a long
        sequence's per-token memory once the layers are checkpointed). The stream is the same sum the fused add-norm
        forms; each row's numbers are the unchunked MLP's."""
        if self.sandwich:
            a = self.post_attention_layernorm(a)
        stream = a + residual
        rows = stream.reshape(-1, stream.shape[-1])
        out = [checkpoint(self._mlp_rows, rows[i:i + chunk], use_reentrant=False)
               for i in range(0, rows.shape[0], chunk)]
        return torch.cat(out).view(stream.shape), stream

    def _mlp_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """MLP(norm(rows)) for rows (n, H) of the stream (the sandwich's post-feed-forward norm included)."""
        norm = self.pre_feedforward_layernorm if self.sandwich else self.post_attention_layernorm
        gate_up, _ = norm_linear(norm, rows[None], None, self.mlp.projections())
        out = self.mlp.from_gate_up(gate_up)
        return (self.post_feedforward_layernorm(out) if self.sandwich else out)[0]


def chunk_mlps(layers, tokens: int | None) -> None:
    """Each layer's MLP over checkpointed chunks of at most ``tokens`` rows in differentiable calls (None: whole
    again; ``LigerForCausalLM.mlp_chunking_enable``). Dense layers only: a mixture-of-experts layer is refused."""
    if tokens is not None and (not isinstance(tokens, int) or isinstance(tokens, bool) or tokens < 1):
        raise ValueError(f"MLP chunk tokens must be a positive integer, got {tokens!r}")
    layers = list(layers)
    sparse = [i for i, layer in enumerate(layers) if layer.sparse]
    if tokens is not None and sparse:
        raise ValueError(f"MLP chunking covers dense layers only; layers {sparse} are mixture-of-experts")
    for layer in layers:
        layer.mlp_chunk_tokens = tokens


def _experts_to_disk_names(layer: DecoderLayer, state_dict: dict, prefix: str, local_metadata: dict) -> None:
    per_expert_state_dict(layer.mlp, state_dict, prefix + "mlp.", f"{prefix}{layer._disk_block}.",
                          layer._expert_names)


def _experts_from_disk_names(layer: DecoderLayer, state_dict: dict, prefix: str, *args) -> None:
    # Runs before this layer checks its keys, so the per-expert names never count as unexpected.
    stacked_from_per_expert(state_dict, prefix + "mlp.", tuple(dict.fromkeys((f"{prefix}{layer._disk_block}.",
                                                                              prefix + "mlp."))),
                            layer._expert_names, layer.mlp.num_experts)


class DecoderModel(nn.Module):
    """HF ``<Family>Model``: embed_tokens, layers, norm. Returns hidden states after the final norm."""

    def __init__(self, config: LigerConfig) -> None:
        super().__init__()
        self.config = config
        pad = config.pad_token_id if config.pad_token_id is not None and 0 <= config.pad_token_id < config.vocab_size \
            else None
        self.embed_tokens = (ScaledEmbedding(config.vocab_size, config.hidden_size, pad, embed_scale=config.embed_scale)
                             if config.scale_embeddings else nn.Embedding(config.vocab_size, config.hidden_size, pad))
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = make_norm(config)
        self.rotary = RotaryEmbedding(config)
        # Families with per-layer-type RoPE (Gemma 3) get a second table; each table is computed once per call.
        # layer_rope_table[i]: the table of layer i (0: self.rotary, the config's own; 1: self.rotary_local).
        own = (config.rope_theta, config.rope_scaling)
        ropes = [config.layer_rope(i) for i in range(config.num_hidden_layers)]
        others = list({repr(r): r for r in ropes if r != own}.values())
        if len(others) > 1:
            raise ValueError(f"at most two RoPE tables are supported, got {[own, *others]}")
        self.rotary_local = RotaryEmbedding(config, others[0]) if others else None
        self.layer_rope_table = [0 if r == own else 1 for r in ropes]
        self.gradient_checkpointing = False
        # How a checkpointed layer is run (torch.utils.checkpoint with its keyword arguments, possibly offloading what
        # it saves) and which layers are: every checkpoint_every-th. LigerForCausalLM.activation_checkpointing_enable
        # sets them, as HF's does.
        self.checkpoint_fn = partial(checkpoint, use_reentrant=False)
        self.checkpoint_every = 1

    def forward(self, input_ids: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
                cache: KVCache | None = None, attention_mask: torch.Tensor | None = None, *,
                tree_mask: torch.Tensor | None = None, inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids (B, T) → hidden (B, T, H). position_ids restarting at 0 mark packed documents (no cache and no
        attention_mask, as in HF v5); attention_mask (B, past + T), 0 at padding, hides padded keys.

        tree_mask (T, T) bool: the new tokens form a tree (speculative decoding's candidates, verified in one call):
        token i sees the whole cache and the new tokens j where tree_mask[i, j] (its ancestors and itself), not
        simply those before it; position_ids (1, T) must then give each token's position, past + its depth.

        inputs_embeds (B, T, H), instead of input_ids: embeddings as ``embed_tokens`` gives them (HF's
        ``get_input_embeddings()(ids)``; PEFT's prompt tuning prepends learned ones), taken as they are: Gemma's √H
        scaling is inside the embedding module (modules/embedding.py), as in transformers v5.

        Every input is checked first (modules/inputs.py), token ids against the vocabulary included."""
        tokens = self.check_inputs(input_ids, inputs_embeds, position_ids, attention_mask)
        B, T = tokens.shape
        past = cache.seq_length() if cache is not None else 0
        padding = key_padding(attention_mask, B, past + T)
        tree = None
        if tree_mask is not None:
            if position_ids is None or tuple(tree_mask.shape) != (T, T) or padding is not None:
                raise ValueError(f"tree_mask must be ({T}, {T}) for {T} new tokens, with their position_ids and "
                                 "without padding")
            tree = (tree_mask.to(device=tokens.device, dtype=torch.bool), position_ids[0] - past)
        documents = None
        if position_ids is None:
            position_ids = torch.arange(past, past + T, device=tokens.device)[None]  # (1, T)
        elif cache is None and attention_mask is None and tree is None:
            documents = document_ids(position_ids.expand(B, T))
        return self.run(input_ids, position_ids, AttentionMask(T, past, documents, tokens.device, padding, tree),
                        cache, inputs_embeds=inputs_embeds)

    def check_inputs(self, input_ids: torch.Tensor | None, inputs_embeds: torch.Tensor | None,
                     position_ids: torch.Tensor | None, attention_mask: torch.Tensor | None) -> torch.Tensor:
        """Check the inputs; returns input_ids, or a (B, T) view of inputs_embeds whose shape and device stand for
        them."""
        if inputs_embeds is None:
            check_forward_inputs(input_ids, self.config.vocab_size, position_ids, attention_mask)
            return input_ids
        check_inputs_embeds(inputs_embeds, input_ids, self.config.hidden_size)
        tokens = inputs_embeds[..., 0]
        if position_ids is not None:
            check_position_ids(position_ids, tokens)
        if attention_mask is not None:
            check_attention_mask(attention_mask, tokens)
        return tokens

    def run(self, input_ids: torch.Tensor | None, position_ids: torch.Tensor, mask: AttentionMask,
            cache: KVCache | None = None, *, inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """The stack on given positions and attention mask (``forward`` builds them; a CUDA-graphed decoding call
        passes masks computed on the device, modules/graphed_decoding.py)."""
        x = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds  # (B, T, H), scaled (Gemma)
        tables = [self.rotary(position_ids)]  # (cos, sin), each (B or 1, T, R) fp32
        if self.rotary_local is not None:
            tables.append(self.rotary_local(position_ids))
        residual = None
        for i, layer in enumerate(self.layers):
            cos, sin = tables[self.layer_rope_table[i]]
            checkpointed = self.gradient_checkpointing and self.training and i % self.checkpoint_every == 0
            if residual is not None and (checkpointed or (layer.checkpointed and torch.is_grad_enabled())):
                # A checkpoint keeps its inputs until backward: one stream tensor instead of the (x, residual) pair
                # halves what every checkpointed layer holds. The sum is the one the layer's add-norm forms first,
                # rounded the same way, so the layer computes the same numbers.
                x, residual = x + residual, None
            if checkpointed:
                x, residual = self.checkpoint_fn(layer, x, residual, cos, sin, mask, cache)
            else:
                x, residual = layer(x, residual, cos, sin, mask, cache)
        if residual is None:
            return self.norm(x)
        return add_norm(self.norm, x, residual)[0]

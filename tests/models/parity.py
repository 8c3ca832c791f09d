"""Shared checks for the per-family parity tests: tiny random HF model → save_pretrained → our from_pretrained.

Everything runs on the CPU: ours in float32 against HF in float64 (the reference numerics:
docs/models.md#the-shared-decoder).
"""

from __future__ import annotations

import copy
import json
import types
from pathlib import Path

import torch
import torch.nn.functional as F
import transformers
from safetensors import safe_open

from liger_models import AutoLigerForCausalLM
from liger_models.modules import KVCache

TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2)
# The mixture-of-experts families on top of TINY: (HF config class, overrides).
TINY_MOE = {"qwen3_moe": (transformers.Qwen3MoeConfig, dict(head_dim=16, moe_intermediate_size=32, num_experts=4,
                                                            num_experts_per_tok=2, norm_topk_prob=True)),
            "mixtral": (transformers.MixtralConfig, dict(num_local_experts=4, num_experts_per_tok=2))}


def build_hf(config_cls, **overrides) -> transformers.PreTrainedModel:
    """A tiny random HF causal LM in float32 with eager attention."""
    config = config_cls(**{**TINY, **overrides})
    config._attn_implementation = "eager"
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").float().eval()
    return perturb_norms(model)


def perturb_norms(model: torch.nn.Module) -> torch.nn.Module:
    """Every norm weight moved by N(0, 0.1²): they start at 1 (0 in Gemma's 1 + w), where a norm applied without its
    weight, or with another layer's, would pass unnoticed."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model


def build_gemma3_multimodal(tied: bool = True, vocab: int = 300, **text) -> transformers.PreTrainedModel:
    """A tiny random Gemma3ForConditionalGeneration in fp32 (a SigLIP tower of one layer), norms perturbed, the last
    three token ids the image ones; ``tied``: config.json's top-level tie_word_embeddings, which transformers applies
    to the whole model."""
    text_config = transformers.Gemma3TextConfig(**{
        "vocab_size": vocab, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 3,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "sliding_window": 5,
        "query_pre_attn_scalar": 24, "layer_types": ["sliding_attention", "sliding_attention", "full_attention"],
        "rope_scaling": {"rope_type": "linear", "factor": 2.0}, "tie_word_embeddings": tied, **text})
    vision = transformers.SiglipVisionConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                             num_attention_heads=2, image_size=28, patch_size=14)
    config = transformers.Gemma3Config(text_config=text_config.to_dict(), vision_config=vision.to_dict(),
                                       mm_tokens_per_image=4, boi_token_index=vocab - 3,
                                       eoi_token_index=vocab - 2, image_token_index=vocab - 1, tie_word_embeddings=tied)
    model = transformers.Gemma3ForConditionalGeneration(config).float().eval()
    return perturb_norms(model)


def build_mistral3_multimodal(tied: bool = False, vocab: int = 300) -> transformers.PreTrainedModel:
    """A tiny random Mistral3ForConditionalGeneration (Mistral Small 3.1's layout: a Mistral decoder whose
    text_config says untied, beside a one-layer Pixtral tower) in fp32, norms perturbed; the last token id is the
    image one. ``tied``: the top level's tie_word_embeddings, which is what transformers 5 applies."""
    text = transformers.MistralConfig(vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=32, sliding_window=None,
                                      tie_word_embeddings=False)
    vision = transformers.PixtralVisionConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                              num_attention_heads=2, image_size=28, patch_size=14, head_dim=16)
    config = transformers.Mistral3Config(text_config=text.to_dict(), vision_config=vision.to_dict(),
                                         image_token_index=vocab - 1, spatial_merge_size=2, tie_word_embeddings=tied)
    model = transformers.Mistral3ForConditionalGeneration(config).float().eval()
    return perturb_norms(model)


def save_hf(model, directory: Path, max_shard_size: str | None = None, v4_style: bool = False) -> Path:
    """HF save_pretrained; v4_style rewrites config.json the way transformers 4.x wrote it (rope_scaling + type)."""
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(directory, **kwargs)
    if v4_style:
        path = directory / "config.json"
        cfg = json.loads(path.read_text())
        rope = dict(cfg.pop("rope_parameters", None) or {})
        cfg["rope_theta"] = rope.pop("rope_theta", 10000.0)
        rope_type = rope.pop("rope_type", "default")
        cfg["rope_scaling"] = None if rope_type == "default" else {"type": rope_type, **rope}
        cfg["torch_dtype"] = cfg.pop("dtype", "float32")
        path.write_text(json.dumps(cfg))
    return directory


def max_rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a − b| / max(max |b|, 1e-6)."""
    return (a - b).abs().max().item() / max(b.abs().max().item(), 1e-6)


def _rms_norm_float64(self, x: torch.Tensor) -> torch.Tensor:
    eps = getattr(self, "variance_epsilon", getattr(self, "eps", None))
    x = x.double()
    normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return normed * ((1.0 + self.weight) if type(self).__name__.startswith("Gemma") else self.weight)


def _rotary_float64(hf_forward):
    def forward(self, x: torch.Tensor, position_ids: torch.Tensor, *layer_type: str):
        # layer_type: Gemma 3's rotary module holds one table per layer type.
        hf_forward(x, position_ids, *layer_type)  # runs HF's update of a length-dependent table (dynamic NTK, ...)
        prefix = f"{layer_type[0]}_" if layer_type else ""
        inv_freq, scaling = getattr(self, f"{prefix}inv_freq"), getattr(self, f"{prefix}attention_scaling")
        angles = position_ids[:, :, None].double() * inv_freq.double()[None, None, :]
        angles = torch.cat((angles, angles), dim=-1)
        return angles.cos() * scaling, angles.sin() * scaling
    return forward


def _float64_eager_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, softcap=None,
                             **kwargs):
    """HF's eager attention (scale, soft-cap, additive mask, softmax) with the softmax kept in float64: the
    reference for models whose soft-capped scores SDPA cannot take (Gemma 2)."""
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    scores = torch.matmul(query, key.transpose(2, 3)) * scaling
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if attention_mask is not None:
        scores = scores + attention_mask
    out = torch.matmul(torch.softmax(scores, dim=-1), value)
    return out.transpose(1, 2).contiguous(), None


def supports_sdpa(hf) -> bool:
    """Whether HF's SDPA path computes this model's attention. Not where HF refuses it (5.25's Gemma 2), and not where
    the scores are soft-capped: 5.17 (the GPU machine's) still lets Gemma 2 run SDPA, which drops the cap without a
    word, and a float64 "truth" built on it differed from ours by 1e-2 in the q/k gradients."""
    if getattr(hf.config, "attn_logit_softcapping", None) is not None:
        return False
    return getattr(type(hf), "_supports_sdpa", True) is not False


def float64_reference(hf) -> transformers.PreTrainedModel:
    """HF's model computing in float64 throughout.

    ``.double()`` alone is not that: HF's RMSNorms and rotary tables cast to float32 inside, and its eager attention
    takes the softmax in float32, so a float64 copy still carries float32 rounding (2-3e-5 relative in the q/k
    gradients of a saturated softmax, a third of the bound below). Here the norms and angles are recomputed in
    float64 and attention runs through SDPA, whose CPU kernel keeps float64. The loss is taken outside (HF's loss
    upcasts "to float", i.e. down to float32).

    It also judges a merged LoRA export as transformers loads it (fp32 weights): computing in float64, its logits
    differ from float64 HF + PEFT's by W + s·B·A's one rounding to fp32 alone, not by the spread of HF's fp32
    forward over those weights, a draw of its own on random tiny models (one CI seed had the Gemma 3 multimodal
    export 1.05e-5 of the largest logit off in fp32, 3.9x HF + PEFT's fp32 error, and 1.1e-6 in float64; 12 seeds
    gave 2e-7 to 2.5e-6 in float64). A wrong merge (a module left out) is off by orders more.
    """
    exact = copy.deepcopy(hf).double()
    if supports_sdpa(hf):
        exact.set_attn_implementation("sdpa")
    else:  # eager, with its float32 softmax replaced (the modeling module looks the function up at call time)
        modeling = __import__(type(hf).__module__, fromlist=["eager_attention_forward"])
        forward = exact.forward

        def float64_forward(*args, **kwargs):
            eager = modeling.eager_attention_forward
            modeling.eager_attention_forward = _float64_eager_attention
            try:
                return forward(*args, **kwargs)
            finally:
                modeling.eager_attention_forward = eager
        exact.forward = float64_forward
    for module in exact.modules():
        name = type(module).__name__
        if name.endswith("RMSNorm"):
            module.forward = types.MethodType(_rms_norm_float64, module)
        elif name.endswith("RotaryEmbedding"):
            module.forward = types.MethodType(_rotary_float64(module.forward), module)
    return exact


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """HF's shifted next-token cross-entropy, mean over the kept targets, in the logits' dtype (float32 logits: HF's
    own loss, which upcasts to float32)."""
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100)


OURS_MOVED = 2  # ulp-moved copies of ours whose errors join its own where that is past a bound (check_parity)


def moved_one_ulp(model, generator: torch.Generator):
    """A copy of the float32 model with every floating-point weight moved one ulp up or down at random (an NF4
    base's codes stay as they are), and no gradients (a copy of a model that has stepped would carry its gradients
    into the copy's own step)."""
    moved = copy.deepcopy(model)
    moved.zero_grad(set_to_none=True)
    with torch.no_grad():
        for p in moved.parameters():
            if not p.is_floating_point():
                continue
            sign = torch.randint(0, 2, p.shape, generator=generator).to(p.dtype) * 2 - 1
            p.mul_(1 + sign * torch.finfo(p.dtype).eps)
    return moved


def median_of_draws(own: float, moved: list[float]) -> float:
    """Ours' error as one draw among its ulp-moved copies' (OURS_MOVED of them): the median of all."""
    return sorted([own, *moved])[len(moved) // 2]


def check_parity(hf, directory: Path, seq_len: int, *, batch: int = 1, position_ids: torch.Tensor | None = None,
                 grads: bool = True, ours=None):
    """Logits, loss and every parameter's gradient equal HF's. Returns ours.

    The truth is HF computed in float64 (``float64_reference``). Ours (float32) must be within 1e-4 of it (absolute
    for logits, relative to the tensor's max for gradients, 1e-5 relative for the loss) — or, where the case is so
    ill-conditioned that HF's own float32 run is further off than that (random q/k biases can saturate a softmax),
    within 2× the error of HF in float32. HF in float32 runs twice, with its eager attention and with SDPA (the
    kernel ours calls, whose CPU float32 backward is up to 3× less accurate than eager's on such a softmax); the
    larger error sets the bound. Comparing float32 to float32 instead made the test fail on seeds where ours was
    the more accurate of the two. Each also runs on its weights moved by one float32 ulp (random signs): a stable
    float32 computation is the exact one at inputs moved by about that much, so these peers show how far such a
    move carries an ill-conditioned quantity. Layer 1's q/k-norm weight gradients of Qwen3 with random q/k biases
    are such sums of cancelling terms: over 150 seeds ours and HF float32 average the same error (9e-6) and both
    pass 1e-4 at times (1.4e-4, 1.0e-4), so two unperturbed peers alone set too narrow a bound on a few seeds.

    Ours is one draw from that same spread, so where its own run is outside a bound, ours' error is the median of
    three: its run and two copies of ours moved by one ulp (``OURS_MOVED``); a wrong computation is off in all three.
    On Qwen3 with random q/k biases (LIGER_TEST_SEED=717633042) ours' layer-1 k_proj gradient drew 1.12e-4 against a
    bound of 1.03e-4, while over 150 ulp-moved copies ours and HF's SDPA peer had the same spread (median 3.6e-5 and
    3.4e-5, 95th percentile 6.5e-5 and 6.7e-5, worst 8.5e-5 and 7.9e-5): both call torch's SDPA identically (shapes,
    strides, is_causal, enable_gqa), and with ours' SDPA swapped for the math kernel the unmoved draw is 4.4e-5.
    """
    ours = ours or AutoLigerForCausalLM.from_pretrained(directory, dtype=torch.float32)
    truth = float64_reference(hf)
    peers = {"hf eager": hf}
    if supports_sdpa(hf):
        peers["hf sdpa"] = copy.deepcopy(hf)
        peers["hf sdpa"].set_attn_implementation("sdpa")
    generator = torch.Generator().manual_seed(int(torch.randint(2**31, ())))
    peers.update({f"{tag} ±1ulp": moved_one_ulp(peer, generator) for tag, peer in list(peers.items())})
    vocab = hf.config.vocab_size
    ids = torch.randint(3, vocab, (batch, seq_len))
    labels = ids.clone()
    labels[0, : seq_len // 3] = -100  # some ignored targets
    kwargs = {} if position_ids is None else {"position_ids": position_ids}

    def bound(peer_errors, floor: float) -> float:
        return max(floor, 2 * max(peer_errors))

    def error(logits: torch.Tensor, exact: torch.Tensor) -> float:
        return (logits.double() - exact).abs().max().item()

    moved: list = []  # OURS_MOVED copies of ours moved by one ulp, made only where a check needs them
    moved_losses: list[float] = []  # their training step's losses (gradients kept), once run

    def moved_copies(train: bool) -> list:
        if not moved:
            moved.extend(moved_one_ulp(ours, generator) for _ in range(OURS_MOVED))
        if train and not moved_losses:
            for copy_ in moved:
                loss = copy_(ids, labels=labels, **kwargs).loss
                loss.backward()
                moved_losses.append(loss.item())
        return moved

    def ours_error(own: float, limit: float, moved_error, train: bool = True) -> tuple[float, list[float]]:
        """Ours' error: its own run's, or where that is past ``limit`` the median of it and the moved copies'
        (``moved_error(i)`` of copy i)."""
        if own <= limit:
            return own, []
        others = [moved_error(i) for i in range(len(moved_copies(train)))]
        return median_of_draws(own, others), others

    def moved_note(others: list[float]) -> str:
        return f"; ours moved by one ulp: {' / '.join(f'{e:.3e}' for e in others)}" if others else ""

    with torch.no_grad():
        exact = truth(ids, use_cache=False, **kwargs).logits
        peer_errs = [error(peer(ids, use_cache=False, **kwargs).logits, exact) for peer in peers.values()]
        err, others = ours_error(error(ours(ids, **kwargs).logits, exact), bound(peer_errs, 1e-4),
                                 lambda i: error(moved[i](ids, **kwargs).logits, exact), train=False)
    assert err <= bound(peer_errs, 1e-4), \
        (f"logits differ from float64 HF by {err:.3e} (HF float32, {' / '.join(peers)}: "
         f"{' / '.join(f'{e:.3e}' for e in peer_errs)}{moved_note(others)})")
    if not grads:
        return ours
    losses = {}
    for tag, model in (("truth", truth), *peers.items(), ("ours", ours)):
        model.zero_grad(set_to_none=True)
        if model is ours:  # our own loss path is under test
            loss = ours(ids, labels=labels, **kwargs).loss
        else:  # HF's loss, taken in the logits' dtype (HF's own would round float64 logits to float32)
            loss = causal_lm_loss(model(ids, use_cache=False, **kwargs).logits, labels)
        loss.backward()
        losses[tag] = loss.item()
    scale = max(1.0, abs(losses["truth"]))
    loss_bound = bound([abs(losses[tag] - losses["truth"]) for tag in peers], 1e-5 * scale)
    loss_err, others = ours_error(abs(losses["ours"] - losses["truth"]), loss_bound,
                                  lambda i: abs(moved_losses[i] - losses["truth"]))
    assert loss_err <= loss_bound, f"{losses}{moved_note(others)}"
    exact_params = dict(truth.named_parameters())
    peer_params = [dict(peer.named_parameters()) for peer in peers.values()]
    names = [n for n, _ in ours.named_parameters()]
    assert set(names) <= set(exact_params), f"names HF does not have: {set(names) - set(exact_params)}"
    for name, p in ours.named_parameters():
        assert p.grad is not None, f"{name}: no gradient"
        exact_grad = exact_params[name].grad
        peer_rels = [max_rel(params[name].grad.double(), exact_grad) for params in peer_params]
        rel, others = ours_error(max_rel(p.grad.double(), exact_grad), bound(peer_rels, 1e-4),
                                 lambda i: max_rel(moved[i].get_parameter(name).grad.double(), exact_grad))
        assert rel <= bound(peer_rels, 1e-4), (
            f"{name}: gradient differs from float64 HF by {rel:.3e} relative to its max (HF float32, "
            f"{' / '.join(peers)}: {' / '.join(f'{e:.3e}' for e in peer_rels)}{moved_note(others)})")
    return ours


def check_roundtrip(ours, directory: Path, seq_len: int = 10, max_shard_size: str = "5GB") -> None:
    """Our save_pretrained loads into transformers with logits identical to ours."""
    ours.save_pretrained(directory, max_shard_size=max_shard_size)
    back = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32,
                                                             attn_implementation="eager").eval()
    ids = torch.randint(3, ours.config.vocab_size, (2, seq_len))
    with torch.no_grad():
        err = (back(ids).logits - ours(ids).logits).abs().max().item()
    assert err <= 1e-4, f"transformers reloading our checkpoint differs by {err:.3e}"


def check_bf16_parity(hf, directory: Path, seq_len: int, *, batch: int = 2, floor: float = 2e-3):
    """Ours in bf16 against HF in fp32 (the reference): logits, loss and every gradient no further from it than
    2× HF's own bf16 run, plus ``floor`` (relative L2; tensors HF gets almost exactly). Returns ours."""
    ours = AutoLigerForCausalLM.from_pretrained(directory, dtype=torch.bfloat16)
    hf_bf16 = copy.deepcopy(hf).to(torch.bfloat16)
    ids = torch.randint(3, hf.config.vocab_size, (batch, seq_len))

    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        a, b = a.double(), b.double()
        return ((a - b).norm() / b.norm().clamp_min(1e-12)).item()

    with torch.no_grad():
        ref = hf(ids, use_cache=False).logits
        hf_err, err = rel(hf_bf16(ids, use_cache=False).logits, ref), rel(ours(ids).logits, ref)
    assert err <= 2 * hf_err + floor, f"bf16 logits: ours {err:.2e} vs HF bf16 {hf_err:.2e}"
    losses = {}
    for tag, model in (("ref", hf), ("hf", hf_bf16), ("ours", ours)):
        model.zero_grad(set_to_none=True)
        loss = ours(ids, labels=ids).loss if model is ours else causal_lm_loss(
            model(ids, use_cache=False).logits.float(), ids)
        loss.backward()
        losses[tag] = loss.item()
    assert abs(losses["ours"] - losses["ref"]) <= 2 * abs(losses["hf"] - losses["ref"]) + 1e-3 * losses["ref"], losses
    ref_params, hf_params = dict(hf.named_parameters()), dict(hf_bf16.named_parameters())
    for name, p in ours.named_parameters():
        hf_err = rel(hf_params[name].grad, ref_params[name].grad)
        err = rel(p.grad, ref_params[name].grad)
        assert err <= 2 * hf_err + floor, f"bf16 grad {name}: ours {err:.2e} vs HF bf16 {hf_err:.2e}"
    return ours


def check_packed_documents(hf, ours, lengths) -> list[torch.Tensor]:
    """Documents of these lengths packed in one row (position_ids restarting at 0) give the logits HF gives each
    document alone, within 1e-4. Returns the documents."""
    docs = [torch.randint(3, 128, (1, n)) for n in lengths]
    position_ids = torch.cat([torch.arange(n) for n in lengths])[None]
    with torch.no_grad():
        packed = ours(torch.cat(docs, dim=1), position_ids=position_ids).logits
        ref = torch.cat([hf(doc, use_cache=False).logits for doc in docs], dim=1)
    assert (packed - ref).abs().max().item() <= 1e-4
    return docs


def check_cached_generate(hf, ours, prompt_len: int, new_tokens: int, *, every_step: bool = True) -> None:
    """Greedy generate equals HF's token for token; with ``every_step``, each cached step's logits also equal an
    uncached HF forward over the whole sequence, within 1e-4."""
    ids = torch.randint(3, 128, (2, prompt_len))
    ref = copy.deepcopy(hf).generate(ids, max_new_tokens=new_tokens, do_sample=False, eos_token_id=[], pad_token_id=0)
    assert torch.equal(ours.generate(ids, max_new_tokens=new_tokens, eos_token_id=[], pad_token_id=0), ref)
    if not every_step:
        return
    cache, steps = KVCache(), []
    with torch.no_grad():
        steps.append(ours(ref[:, :prompt_len], past_key_values=cache, use_cache=True).logits[:, -1])
        for t in range(prompt_len, ref.shape[1]):
            steps.append(ours(ref[:, t : t + 1], past_key_values=cache, use_cache=True).logits[:, -1])
        full = hf(ref, use_cache=False).logits[:, prompt_len - 1:]
    assert (torch.stack(steps, dim=1) - full).abs().max().item() <= 1e-4


def stored_names(directory: Path) -> set[str]:
    """The tensor names in a checkpoint directory's safetensors files."""
    names = set()
    for file in directory.glob("*.safetensors"):
        with safe_open(str(file), framework="pt") as f:
            names |= set(f.keys())
    return names

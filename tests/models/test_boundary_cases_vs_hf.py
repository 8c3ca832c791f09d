"""Model boundary cases against transformers: exactly at a switch length (longrope, a sliding window one shorter
than the sequence), batches whose rows differ, bf16 rounding of a constant, configs whose explicit keys disagree
with the derived defaults.

Everything is compared with transformers (eager, float32 unless stated) on tiny random models and fresh inputs.
"""

import pytest
import torch
import transformers

from liger_models import LigerMistralForCausalLM, MistralConfig
from liger_models.modules import KVCache

from .parity import build_hf, check_parity, save_hf

ORIGINAL = 12  # longrope's original_max_position_embeddings in the Phi3 case


def _longrope_phi3():
    half = 64 // 4 // 2  # rotary_dim / 2
    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": (1.0 + 0.5 * torch.rand(half)).tolist(),
            "long_factor": (1.0 + 5 * torch.rand(half)).tolist()}
    return build_hf(transformers.Phi3Config, max_position_embeddings=64, original_max_position_embeddings=ORIGINAL,
                    rope_parameters=rope, pad_token_id=0)


@pytest.mark.parametrize("seq_len", [ORIGINAL, ORIGINAL + 1], ids=["at-switch", "one-past-switch"])
def test_longrope_switch_is_strictly_past_the_original_length(tmp_path, seq_len):
    # HF picks the long factors only when max(position_ids) + 1 > original: a sequence of exactly `original` tokens
    # still uses the short ones. The existing tests sit 2 below and 8 above the switch, so `>=` went unnoticed.
    hf = _longrope_phi3()
    check_parity(hf, save_hf(hf, tmp_path / "hf"), seq_len=seq_len, grads=False)


def test_sliding_window_one_shorter_than_the_sequence(tmp_path):
    # T = W + 1 is the first length where the window hides a key (the first token, from the last query). A fast
    # path that skips the mask one token too long (window + 1 < kv_len) is only visible here.
    window = 6
    hf = build_hf(transformers.MistralConfig, sliding_window=window)
    check_parity(hf, save_hf(hf, tmp_path / "hf"), seq_len=window + 1, grads=False)


def test_cached_step_that_first_drops_a_key_from_the_window():
    # Decoding with a cache: the step whose kv length is W + 1 is the first that must mask the oldest key.
    window = 5
    model = LigerMistralForCausalLM.from_config(MistralConfig.tiny(sliding_window=window))
    ids = torch.randint(3, 128, (2, window + 3))
    with torch.no_grad():
        full = model(ids).logits
        cache = KVCache()
        steps = [model(ids[:, :window], past_key_values=cache, use_cache=True).logits]
        for t in range(window, ids.shape[1]):
            steps.append(model(ids[:, t : t + 1], past_key_values=cache, use_cache=True).logits)
    assert (torch.cat(steps, dim=1) - full).abs().max().item() <= 1e-5


def test_packed_single_token_documents_do_not_see_each_other():
    # A one-token document right after a document's first token gives position_ids ... 0, 0 ...: the step is 0,
    # not negative, so a boundary rule "positions went down" misses it; HF's rule is "did not step by +1".
    model = LigerMistralForCausalLM.from_config(MistralConfig.tiny(sliding_window=None))
    lengths = [1, 1, 4, 1, 3]
    docs = [torch.randint(3, 128, (1, n)) for n in lengths]
    position_ids = torch.cat([torch.arange(n) for n in lengths])[None]
    with torch.no_grad():
        out = model(torch.cat(docs, dim=1), position_ids=position_ids).logits
        ref = torch.cat([model(d).logits for d in docs], dim=1)
    assert (out - ref).abs().max().item() <= 1e-5


def test_packed_rows_with_different_boundaries(tmp_path):
    # Each row of a packed batch has its own documents; a mask built from row 0's boundaries alone would let row 1
    # attend across its own boundary (and cut row 1's documents where row 0's end).
    hf = build_hf(transformers.LlamaConfig)
    ours = check_parity(hf, save_hf(hf, tmp_path / "hf"), seq_len=4, grads=False)
    position_ids = torch.stack([torch.cat([torch.arange(3), torch.arange(7)]),
                                torch.cat([torch.arange(6), torch.arange(4)])])
    ids = torch.randint(3, 128, (2, 10))
    with torch.no_grad():
        out = ours(ids, position_ids=position_ids).logits
        for row in range(2):
            ref = hf(ids[row : row + 1], position_ids=position_ids[row : row + 1], use_cache=False).logits
            assert (out[row : row + 1] - ref).abs().max().item() <= 1e-4, f"row {row}"


def test_gemma_embedding_scale_rounded_to_bf16_like_hf(tmp_path):
    # HF multiplies the bf16 embeddings by sqrt(hidden) already rounded to bf16 (sqrt(64) = 8 is exact, so use a
    # hidden size whose root is not: 72 → 8.485 → 8.5 in bf16). Multiplying by the fp32 constant gives other bits.
    hf = build_hf(transformers.GemmaConfig, hidden_size=72, head_dim=16, num_key_value_heads=1).to(torch.bfloat16)
    directory = save_hf(hf, tmp_path / "hf")
    from liger_models import AutoLigerForCausalLM

    ours = AutoLigerForCausalLM.from_pretrained(directory, dtype=torch.bfloat16)
    ids = torch.randint(3, 128, (2, 9))
    seen = {}
    # The first layer's input is the scaled embedding (a pre-hook that returns None leaves the call unchanged).
    hook = ours.model.layers[0].register_forward_pre_hook(lambda module, args: seen.update(x=args[0]))
    with torch.no_grad():
        ours(ids)
        expected = hf(ids, output_hidden_states=True, use_cache=False).hidden_states[0]
    hook.remove()
    assert seen["x"].dtype == torch.bfloat16
    assert torch.equal(seen["x"], expected)


def test_qwen2_explicit_layer_types_win_over_max_window_layers(tmp_path):
    # layer_types, when config.json has it, decides which layers slide, even against max_window_layers (here it
    # says the opposite: the lower layer slides). Configs without the key were the only ones tested.
    hf = build_hf(transformers.Qwen2Config, use_sliding_window=True, sliding_window=4, max_window_layers=1,
                  layer_types=["sliding_attention", "full_attention"])
    ours = check_parity(hf, save_hf(hf, tmp_path / "hf"), seq_len=12, grads=False)
    assert [layer.self_attn.window for layer in ours.model.layers] == [4, None]


def test_generate_recomputes_exactly_when_the_longrope_table_switches():
    # generate drops its cache when rotary.regime(length) changes, i.e. it must change exactly where the factors
    # used for a call ending at that length change. Flipping one token early (>=) recomputes at `original` with the
    # short factors and then keeps those short-factor keys when the long ones take over: greedy tokens of the tiny
    # model often survive that, so the rule is checked against the table itself.
    half = 8
    rope = {"rope_type": "longrope", "short_factor": (1.0 + torch.rand(half)).tolist(),
            "long_factor": (3.0 + 4 * torch.rand(half)).tolist()}
    from liger_models import Phi3Config
    from liger_models.modules.rope import RotaryEmbedding

    rotary = RotaryEmbedding(Phi3Config.tiny(rope_scaling=rope, original_max_position_embeddings=ORIGINAL))
    for length in range(ORIGINAL - 2, ORIGINAL + 3):
        previous = rotary.inv_freq(torch.arange(length - 1)[None])
        current = rotary.inv_freq(torch.arange(length)[None])
        switched = not torch.equal(previous, current)
        assert (rotary.regime(length) != rotary.regime(length - 1)) == switched, length
        assert switched == (length == ORIGINAL + 1), length


@pytest.mark.parametrize("window", [None, 2])
@pytest.mark.parametrize("past", [0, 3])
def test_padding_mask_never_leaves_a_query_row_empty(past, window):
    # CPU SDPA returns 0 for a query that may see no key, so a left-padding mask without the "j == i" escape passes
    # every logits test on the CPU; fused GPU kernels give NaN there instead, which then reaches real rows through
    # the padded values. So the rule itself is checked: padded keys hidden; a padded query that has a real key in
    # its range sees those (as HF's masks do), one that has none sees itself. Padding at random slots covers left
    # and right padding and PEFT's virtual tokens before a left-padded prompt.
    from liger_models.modules.attention import AttentionMask

    kv_len = 6 + past
    real = torch.rand(4, kv_len) < 0.5  # (B, S)
    real[:, -1] = True
    allowed = AttentionMask(6, past, None, torch.device("cpu"), real).boolean(window)[:, 0]  # (B, T, S)
    q_abs = torch.arange(past, kv_len)[None, :, None]
    kv = torch.arange(kv_len)[None, None, :]
    in_range = (kv <= q_abs) & (True if window is None else q_abs - kv < window)
    sees_real = (in_range & real[:, None, :]).any(-1, keepdim=True)
    expected = in_range & (real[:, None, :] | ((kv == q_abs) & ~sees_real))
    assert torch.equal(allowed, expected)
    assert allowed.any(-1).all()


def test_qwen2_window_layers_from_max_window_layers_when_config_has_no_layer_types(tmp_path):
    # transformers 4.x wrote no layer_types; then layers i >= max_window_layers slide. HF v5's save_pretrained always
    # writes layer_types, so the other parity tests never reach this rule (a `>` there went unnoticed).
    import json

    hf = build_hf(transformers.Qwen2Config, num_hidden_layers=3, use_sliding_window=True, sliding_window=4,
                  max_window_layers=1)
    directory = save_hf(hf, tmp_path / "hf")
    cfg = json.loads((directory / "config.json").read_text())
    assert cfg.pop("layer_types") == ["full_attention", "sliding_attention", "sliding_attention"]
    (directory / "config.json").write_text(json.dumps(cfg))
    ours = check_parity(hf, directory, seq_len=10, grads=False)
    assert [layer.self_attn.window for layer in ours.model.layers] == [None, 4, 4]


def test_generate_step_logits_across_the_longrope_switch_equal_an_uncached_forward():
    # Greedy tokens of a tiny random model hardly move when the rotation changes (flat attention), so a generate
    # that never recomputed its short-factor cache at the switch still produced HF's tokens. Here every logits row
    # generate decides on is compared with a fresh uncached forward of the same prefix.
    from liger_models import LigerPhi3ForCausalLM, Phi3Config

    half = 8
    rope = {"rope_type": "longrope", "short_factor": (1.0 + torch.rand(half)).tolist(),
            "long_factor": (3.0 + 4 * torch.rand(half)).tolist()}
    model = LigerPhi3ForCausalLM.from_config(Phi3Config.tiny(rope_scaling=rope, original_max_position_embeddings=8))
    seen = []
    hook = model.register_forward_hook(lambda module, args, out: seen.append(out.logits[:, -1]))
    prompt = torch.randint(3, 128, (2, 5))
    tokens = model.generate(prompt, max_new_tokens=7, eos_token_id=[], pad_token_id=0)
    hook.remove()
    assert tokens.shape[1] == 12 and len(seen) == 7  # the last token is sampled, never fed back
    with torch.no_grad():
        for step, logits in enumerate(seen):
            ref = model(tokens[:, : 5 + step]).logits[:, -1]
            assert (logits - ref).abs().max().item() <= 1e-5, f"prefix length {5 + step}"


def test_rope_scaling_wins_over_rope_parameters_when_config_has_both(tmp_path):
    # A config.json carrying both spellings (a v4 file re-saved with edits) is read by transformers v5 with
    # rope_scaling first; with the priority swapped the linear factor below would be silently dropped.
    import json

    hf = build_hf(transformers.LlamaConfig, rope_parameters={"rope_type": "linear", "factor": 4.0,
                                                             "rope_theta": 10000.0})
    directory = save_hf(hf, tmp_path / "hf")
    cfg = json.loads((directory / "config.json").read_text())
    cfg["rope_scaling"] = dict(cfg["rope_parameters"])
    cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0}
    (directory / "config.json").write_text(json.dumps(cfg))
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32,
                                                                 attn_implementation="eager").eval()
    assert reloaded.config.rope_parameters["rope_type"] == "linear"  # the premise: HF reads rope_scaling
    ours = check_parity(reloaded, directory, seq_len=10, grads=False)
    assert ours.config.rope_scaling["rope_type"] == "linear"


def test_pad_token_row_gets_no_gradient_and_starts_at_zero():
    # HF builds embed_tokens with padding_idx = pad_token_id: the pad row is initialised to zero and never trained,
    # even when pad tokens are fed with labels -100. Parity tests draw ids above the pad id, so they cannot see it.
    model = LigerMistralForCausalLM.from_config(MistralConfig.tiny(pad_token_id=0))
    embed = model.model.embed_tokens.weight
    assert torch.equal(embed[0], torch.zeros_like(embed[0]))
    ids = torch.randint(3, 128, (2, 8))
    ids[:, :3] = 0  # left padding
    labels = ids.masked_fill(ids == 0, -100)
    model(ids, labels=labels).loss.backward()
    assert torch.equal(embed.grad[0], torch.zeros_like(embed[0]))
    assert embed.grad[ids[0, 3]].abs().sum() > 0  # a real token's row does get a gradient

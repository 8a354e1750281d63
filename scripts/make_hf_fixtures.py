#!/usr/bin/env python3
"""Writes tests/fixtures/hf/<case>/: tiny random Hugging Face transformers
models, one per family and option that mha::hf reads, with the recorded
input and output of one attention layer, for tests/test_hf.cpp.

Each case directory holds the checkpoint as transformers writes it
(config.json and model.safetensors, or shards with their index, or
pytorch_model.bin) and reference.safetensors in the format of
record_reference.py (docs/porting.md, "Prove your port") with
__metadata__ model_dir "." instead of the layer's tensors. Models are float32
with eager attention; weights are redrawn N(0, 0.2) so that attention is far
from uniform. Run in the sid chroot (transformers 5.x, torch 2.x):

    /work/shared/tools/in-trixie.sh -r /opt/sid . -- \
        python3 scripts/make_hf_fixtures.py            # every case
        python3 scripts/make_hf_fixtures.py families   # 2025's only
        python3 scripts/make_hf_fixtures.py gradients  # more gradients
"""

import json
import os
import shutil
import sys

import torch
import transformers as tf
from safetensors.torch import save_file

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import record_reference as rr  # noqa: E402

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests",
                    "fixtures", "hf")
N, L, VOCAB = 2, 6, 16
# Row 1 is right-padded: its last two keys are padding (no query row is
# fully masked then, causal or not).
RIGHT_PADDED = torch.tensor([[1] * L, [1] * (L - 2) + [0] * 2])


def common(**kw):
    base = dict(vocab_size=VOCAB, attn_implementation="eager", dtype="float32")
    base.update(kw)
    return base


def llama_like(cls, layers=1, **kw):
    return cls(**common(hidden_size=32, intermediate_size=16,
                        num_attention_heads=4, num_key_value_heads=2,
                        num_hidden_layers=layers, max_position_embeddings=64,
                        **kw))


def build(model_cls, config, seed):
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    return model


def save_model(model, path, how="safetensors", config_edit=None):
    os.makedirs(path, exist_ok=True)
    if how == "bin":
        model.config.save_pretrained(path)
        torch.save(model.state_dict(), os.path.join(path, "pytorch_model.bin"))
    elif how == "sharded":
        model.save_pretrained(path, max_shard_size="16KB")
    else:
        model.save_pretrained(path)
    for extra in ("generation_config.json",):
        if os.path.exists(os.path.join(path, extra)):
            os.remove(os.path.join(path, extra))
    if config_edit is not None:
        with open(os.path.join(path, "config.json")) as f:
            config = json.load(f)
        config_edit(config)
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(config, f, indent=2, sort_keys=True)


def write_reference(path, tensors, meta):
    # The checkpoint sits next to the file: drop the layer's own tensors.
    keep = {k: v for k, v in tensors.items()
            if k in ("hidden_states", "output", "weights", "attention_mask",
                     "position_ids", "layer_output") or k.startswith("step")}
    meta = dict(meta)
    meta["model_dir"] = "."
    save_file({k: v.contiguous() for k, v in keep.items()},
              os.path.join(path, "reference.safetensors"), metadata=meta)


def case(name, model, layer=0, mask=None, how="safetensors", stack="encoder",
         config_edit=None, seed=0, embedded=False):
    path = os.path.join(ROOT, name)
    shutil.rmtree(path, ignore_errors=True)
    torch.manual_seed(1000 + seed)
    ids = torch.randint(0, VOCAB, (N, L))
    tensors, meta = rr.record(model, layer, ids, mask, stack=stack)
    if model.config.model_type == "bert":
        # The whole encoder layer too (load_encoder_layer).
        layer_module = model.base_model.encoder.layer[layer]
        seen = {}
        h = layer_module.register_forward_hook(
            lambda _m, _a, out: seen.__setitem__("out", out))
        with torch.no_grad():
            model(input_ids=ids, attention_mask=mask)
        h.remove()
        out = seen["out"]
        tensors["layer_output"] = out[0] if isinstance(out, tuple) else out
    save_model(model, path, how, config_edit)
    write_reference(path, tensors, meta)
    if embedded:
        # As record_reference.py writes it: the layer's tensors and config
        # inside, no model_dir.
        save_file(tensors, os.path.join(path, "recorded.safetensors"),
                  metadata=meta)
    print(f"{name}: layer {layer}, output {list(tensors['output'].shape)}")


def cached_case(name, model, layer=0):
    """Left-padded batched decoding through one DynamicCache: a prompt step,
    then three steps of one token; the layer's input and output per step.
    (A sliding layer's cache in transformers keeps only the window's
    tokens, and so its weights have fewer columns than mha's: use a full
    layer.)"""
    path = os.path.join(ROOT, name)
    shutil.rmtree(path, ignore_errors=True)
    torch.manual_seed(77)
    prompt = 5
    mask = torch.tensor([[1] * prompt, [0, 0] + [1] * (prompt - 2)])
    ids = torch.randint(0, VOCAB, (N, prompt))
    cache = tf.DynamicCache(config=model.config)
    mod = rr.attention_module_name(model, layer)
    tensors = {}
    steps = 4
    for step in range(steps):
        if step > 0:
            ids = torch.randint(0, VOCAB, (N, 1))
            mask = torch.cat([mask, torch.ones(N, 1, dtype=mask.dtype)], 1)
        pos = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)
        pos = pos[:, -ids.shape[1]:]
        hidden, out, weights, _ = rr.run_layer(
            model, mod, dict(input_ids=ids, attention_mask=mask,
                             position_ids=pos, past_key_values=cache,
                             use_cache=True))
        tensors[f"step{step}.hidden_states"] = hidden
        tensors[f"step{step}.output"] = out
        tensors[f"step{step}.weights"] = weights
        tensors[f"step{step}.position_ids"] = pos
    tensors["attention_mask"] = mask
    save_model(model, path)
    write_reference(path, tensors, rr.metadata(model, layer, "encoder"))
    print(f"{name}: {steps} steps")


def linear_layer_case(name, model, layer):
    """Qwen3-Next's Gated DeltaNet layer `layer` (linear_attn), for
    load_gated_delta_net: its input and output on a right-padded batch, and
    a decoding run (a prompt of 5 tokens, then 3 single tokens) through the
    model's cache: step<k>.hidden_states / step<k>.output."""
    path = os.path.join(ROOT, name)
    shutil.rmtree(path, ignore_errors=True)
    mod = dict(model.named_modules())[f"layers.{layer}.linear_attn"]
    seen = {}

    def hook(_m, args, kwargs, out):
        seen["in"] = kwargs.get("hidden_states", args[0] if args else None)
        seen["out"] = out[0] if isinstance(out, tuple) else out

    h = mod.register_forward_hook(hook, with_kwargs=True)
    torch.manual_seed(78)
    ids = torch.randint(0, VOCAB, (N, L))
    model(input_ids=ids, attention_mask=RIGHT_PADDED)
    tensors = {"hidden_states": seen["in"], "output": seen["out"],
               "attention_mask": RIGHT_PADDED}
    cache = tf.DynamicCache(config=model.config)
    ids = torch.randint(0, VOCAB, (N, 5))
    for step in range(4):
        if step > 0:
            ids = torch.randint(0, VOCAB, (N, 1))
        model(input_ids=ids, past_key_values=cache, use_cache=True)
        tensors[f"step{step}.hidden_states"] = seen["in"]
        tensors[f"step{step}.output"] = seen["out"]
    h.remove()
    save_model(model, path)
    # A reference file as mha-parity --reference reads it (the attention
    # mask is the forward's; the steps have none).
    save_file({k: v.contiguous() for k, v in tensors.items()},
              os.path.join(path, "reference.safetensors"),
              metadata=dict(rr.metadata(model, layer, "encoder"),
                            model_dir="."))
    print(f"{name}: layer {layer} (linear attention), 4 decoding steps")


def gradient_case(name, model, layer, module_name, rotary=None):
    """gradients.safetensors beside case `name`'s checkpoint: the module's
    output on a causal, unpadded batch (hidden_states, R, output) and the
    gradients of sum(output · R) with respect to hidden_states
    ("grad.hidden_states") and every parameter of the module ("grad.<its
    name>"), float32. `rotary(x, position_ids)` gives the position
    embeddings (default: the model's rotary_emb)."""
    path = os.path.join(ROOT, name)
    mod = dict(model.named_modules())[module_name]
    torch.manual_seed(79)
    with torch.enable_grad():
        x = torch.randn(N, L, model.config.hidden_size, requires_grad=True)
        R = torch.randn(N, L, model.config.hidden_size)
        if module_name.endswith("linear_attn"):
            out = mod(x)
        else:
            pos = torch.arange(L).unsqueeze(0).expand(N, L)
            pe = (rotary or model.rotary_emb)(x, pos)
            mask = torch.full((L, L), float("-inf")).triu(1).view(1, 1, L, L)
            out = mod(hidden_states=x, position_embeddings=pe,
                      attention_mask=mask)[0]
        mod.zero_grad()
        (out * R).sum().backward()
    tensors = {"hidden_states": x.detach(), "R": R, "output": out.detach(),
               "grad.hidden_states": x.grad}
    for pname, p in mod.named_parameters():
        tensors["grad." + pname] = p.grad
    save_file({k: v.contiguous() for k, v in tensors.items()},
              os.path.join(path, "gradients.safetensors"),
              metadata={"layer": str(layer)})
    print(f"{name}: gradients of {len(tensors) - 4} parameters")


def to_4x_rope(config):
    """A transformers 4.x config.json: rope_theta and rope_scaling at the top
    instead of 5.x's rope_parameters."""
    params = config.pop("rope_parameters")
    config["rope_theta"] = params.pop("rope_theta")
    config["rope_scaling"] = None if params["rope_type"] == "default" else params


def to_4x_neox(config):
    params = config.pop("rope_parameters")
    config["rotary_emb_base"] = params["rope_theta"]
    config["rotary_pct"] = params["partial_rotary_factor"]


def main():
    os.makedirs(ROOT, exist_ok=True)
    torch.set_grad_enabled(False)

    # Llama: grouped-query attention, layer 1 of 2, with the LM head (names
    # with the base-model prefix "model.").
    llama = build(tf.LlamaForCausalLM, llama_like(tf.LlamaConfig, 2), 1)
    case("llama", llama, layer=1, mask=RIGHT_PADDED)
    # The same model with a transformers 4.x config.json.
    case("llama_4x", llama, layer=1, config_edit=to_4x_rope)
    # Sharded safetensors with model.safetensors.index.json.
    case("llama_sharded", llama, layer=1, how="sharded")
    # Every rope_type of transformers 5.x for Llama-family decoders.
    scalings = {
        "linear": {"rope_type": "linear", "factor": 2.0},
        "dynamic": {"rope_type": "dynamic", "factor": 2.0},
        "yarn": {"rope_type": "yarn", "factor": 4.0,
                 "original_max_position_embeddings": 4},
        "yarn_attention_factor": {"rope_type": "yarn", "factor": 4.0,
                                  "original_max_position_embeddings": 4,
                                  "attention_factor": 1.3, "beta_fast": 16.0,
                                  "beta_slow": 2.0},
        "llama3": {"rope_type": "llama3", "factor": 8.0,
                   "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": 4},
        "longrope": {"rope_type": "longrope",
                     "short_factor": [1.0, 1.5, 2.0, 3.0],
                     "long_factor": [2.0, 3.0, 4.0, 6.0],
                     "original_max_position_embeddings": 4},
    }
    for i, (kind, params) in enumerate(scalings.items()):
        params = dict(params, rope_theta=10000.0)
        # dynamic grows theta only past max_position_embeddings: 4 < L.
        mpe = {"dynamic": 4, "longrope": 16, "yarn": 16}.get(kind, 64)
        config = llama_like(tf.LlamaConfig, rope_parameters=params)
        config.max_position_embeddings = mpe
        model = build(tf.LlamaModel, config, 10 + i)
        case(f"llama_rope_{kind}", model)
    # A 4.x config with rope_scaling (llama3).
    config = llama_like(tf.LlamaConfig,
                        rope_parameters=dict(scalings["llama3"],
                                             rope_theta=500000.0))
    case("llama_4x_llama3", build(tf.LlamaModel, config, 20),
         config_edit=to_4x_rope)
    # Left-padded batched decoding through DynamicCache.
    cached_case("llama_cache",
                build(tf.LlamaModel, llama_like(tf.LlamaConfig), 21))

    # Mistral: sliding window 3 over 6 tokens.
    mistral = build(tf.MistralModel,
                    llama_like(tf.MistralConfig, sliding_window=3), 2)
    case("mistral", mistral)
    # Qwen2: biases on q, k, v (not o); sliding window from layer 1 on.
    qwen = build(tf.Qwen2Model,
                 llama_like(tf.Qwen2Config, 2, use_sliding_window=True,
                            sliding_window=3, max_window_layers=1), 3)
    case("qwen2", qwen, layer=0)
    case("qwen2_window", qwen, layer=1)

    # GPT-J: rotary_dim 4 of head_dim 8, interleaved pairs.
    gptj = build(tf.GPTJForCausalLM,
                 tf.GPTJConfig(**common(n_embd=32, n_head=4, n_layer=1,
                                        n_positions=64, rotary_dim=4,
                                        n_inner=32)), 4)
    case("gptj", gptj)
    # GPT-NeoX: rotary_pct 0.5 of head_dim 8 (half pairing), fused per-head
    # query_key_value; a 4.x config (rotary_pct, rotary_emb_base) too.
    neox = build(tf.GPTNeoXModel,
                 tf.GPTNeoXConfig(**common(hidden_size=32,
                                           num_attention_heads=4,
                                           num_hidden_layers=1,
                                           intermediate_size=32,
                                           rotary_pct=0.5,
                                           rotary_emb_base=5000,
                                           max_position_embeddings=64)), 5)
    case("gpt_neox", neox, mask=RIGHT_PADDED)
    case("gpt_neox_4x", neox, config_edit=to_4x_neox)

    # Falcon: multi-query (fused [q..., k, v]) and the new architecture
    # (grouped [q..., k, v] per key/value head).
    falcon_mqa = build(tf.FalconModel,
                       tf.FalconConfig(**common(hidden_size=32,
                                                num_attention_heads=4,
                                                num_hidden_layers=1,
                                                ffn_hidden_size=32,
                                                multi_query=True,
                                                new_decoder_architecture=False,
                                                bias=False)), 6)
    case("falcon_mqa", falcon_mqa)
    falcon_new = build(tf.FalconModel,
                       tf.FalconConfig(**common(hidden_size=32,
                                                num_attention_heads=4,
                                                num_kv_heads=2,
                                                ffn_hidden_size=32,
                                                num_hidden_layers=1,
                                                new_decoder_architecture=True,
                                                bias=True)), 7)
    case("falcon_new", falcon_new, mask=RIGHT_PADDED)

    # BLOOM: ALiBi with 6 heads (not a power of two), per-head fused qkv.
    bloom = build(tf.BloomModel,
                  tf.BloomConfig(**common(hidden_size=24, n_head=6,
                                          n_layer=1)), 8)
    case("bloom", bloom, mask=RIGHT_PADDED)

    # GPT-2: Conv1D weights, layer 1 scaled by 1/(layer + 1) as well, with
    # the LM head (prefix "transformer."), stored as pytorch_model.bin.
    gpt2 = build(tf.GPT2LMHeadModel,
                 tf.GPT2Config(**common(n_embd=32, n_head=4, n_layer=2,
                                        n_positions=64, n_inner=32,
                                        scale_attn_by_inverse_layer_idx=True)),
                 9)
    case("gpt2", gpt2, layer=1, how="bin", embedded=True)

    # BERT: the attention and the whole encoder layer (post-norm, GELU).
    bert = build(lambda c: tf.BertModel(c, add_pooling_layer=False),
                 tf.BertConfig(**common(hidden_size=32, num_attention_heads=4,
                                        num_hidden_layers=1,
                                        intermediate_size=32,
                                        max_position_embeddings=64)), 10)
    case("bert", bert, mask=RIGHT_PADDED)

    # T5: self-attention of the encoder and of the decoder, layer 1 of 2
    # (relative_attention_bias of block 0, shared), scale 1.
    t5 = build(tf.T5Model,
               tf.T5Config(**common(d_model=32, d_kv=8, d_ff=16, num_heads=4,
                                    num_layers=2,
                                    relative_attention_num_buckets=8,
                                    relative_attention_max_distance=16)), 11)
    case("t5_encoder", t5, layer=1, mask=RIGHT_PADDED)
    case("t5_decoder", t5, layer=1, stack="decoder", embedded=True)

    total = 0
    for dirpath, _, files in os.walk(ROOT):
        total += sum(os.path.getsize(os.path.join(dirpath, f)) for f in files)
    print(f"total {total / 1024:.0f} KiB")


def main_families():
    """The 2025 families (issue 60): `make_hf_fixtures.py families` writes
    only these, leaving the other cases as they are."""
    os.makedirs(ROOT, exist_ok=True)
    torch.set_grad_enabled(False)
    # Qwen3: head_dim 12 (4 heads x 12 != 32), per-head q/k RMSNorm before
    # rotary; layer 1 slides (window 3).
    qwen3 = build(tf.Qwen3Model,
                  llama_like(tf.Qwen3Config, 2, head_dim=12,
                             use_sliding_window=True, sliding_window=3,
                             max_window_layers=1), 30)
    case("qwen3", qwen3, layer=0, mask=RIGHT_PADDED)
    case("qwen3_window", qwen3, layer=1)
    cached_case("qwen3_cache", qwen3)
    gradient_case("qwen3", qwen3, 0, "layers.0.self_attn")
    # OLMo 2: RMSNorm over the whole q and k projections.
    olmo2 = build(tf.Olmo2Model, llama_like(tf.Olmo2Config), 31)
    case("olmo2", olmo2, mask=RIGHT_PADDED)
    # gpt-oss: sinks, biases, head_dim 12; layer 0 slides (window 3), layer
    # 1 is full. Plain rotary (its default YaRN has truncate=false, which
    # mha's RotaryScaling does not read).
    oss = build(tf.GptOssModel,
                tf.GptOssConfig(**common(
                    hidden_size=32, intermediate_size=16,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=12,
                    num_hidden_layers=2, num_local_experts=2,
                    num_experts_per_tok=1, sliding_window=3,
                    max_position_embeddings=64,
                    rope_parameters={"rope_type": "default",
                                     "rope_theta": 10000.0})), 32)
    case("gpt_oss", oss, layer=0, mask=RIGHT_PADDED)
    case("gpt_oss_full", oss, layer=1, mask=RIGHT_PADDED)
    cached_case("gpt_oss_cache", oss, layer=1)
    # Gemma 3 (text): head_dim 12, norms scaled by 1 + weight, scale
    # query_pre_attn_scalar^-1/2, local (sliding, window 3, rope 10000)
    # and global (rope 1e6, linear scaling) layers.
    gemma3 = build(tf.Gemma3ForCausalLM,
                   tf.Gemma3TextConfig(**common(
                       hidden_size=32, intermediate_size=16,
                       num_attention_heads=4, num_key_value_heads=2,
                       head_dim=12, num_hidden_layers=2,
                       query_pre_attn_scalar=20, sliding_window=3,
                       layer_types=["sliding_attention", "full_attention"],
                       max_position_embeddings=64,
                       rope_parameters={
                           "sliding_attention": {"rope_type": "default",
                                                 "rope_theta": 10000.0},
                           "full_attention": {"rope_type": "linear",
                                              "factor": 2.0,
                                              "rope_theta": 1000000.0}})),
                   33)
    case("gemma3", gemma3, layer=0, mask=RIGHT_PADDED)
    case("gemma3_global", gemma3, layer=1, mask=RIGHT_PADDED)
    # Qwen3-Next: the full-attention layer (1) of a [linear, full] pair:
    # output gate, (1 + weight) norms, a quarter of head_dim rotated.
    qnext = build(tf.Qwen3NextModel,
                  tf.Qwen3NextConfig(**common(
                      hidden_size=32, intermediate_size=16,
                      num_attention_heads=4, num_key_value_heads=2,
                      head_dim=16, num_hidden_layers=2,
                      layer_types=["linear_attention", "full_attention"],
                      linear_num_key_heads=2, linear_num_value_heads=4,
                      linear_key_head_dim=8, linear_value_head_dim=8,
                      num_experts=2, num_experts_per_tok=1,
                      moe_intermediate_size=16,
                      shared_expert_intermediate_size=16,
                      max_position_embeddings=64)), 34)
    case("qwen3_next", qnext, layer=1, mask=RIGHT_PADDED)
    linear_layer_case("qwen3_next_linear", qnext, layer=0)
    gradient_case("qwen3_next_linear", qnext, 0, "layers.0.linear_attn")
    # Llama 4 (text): rope layers 0-2 chunked (3 positions), L2 norm,
    # interleaved rotary; layer 3 NoPE with temperature tuning (floor_scale
    # 2 so that 6 tokens see it).
    llama4 = build(tf.Llama4ForCausalLM,
                   tf.Llama4TextConfig(**common(
                       hidden_size=32, intermediate_size=16,
                       intermediate_size_mlp=16, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=8,
                       num_hidden_layers=4, num_local_experts=2,
                       num_experts_per_tok=1, attention_chunk_size=3,
                       floor_scale=2, attn_scale=0.5,
                       max_position_embeddings=64)), 35)
    case("llama4_chunked", llama4, layer=0, mask=RIGHT_PADDED)
    case("llama4_nope", llama4, layer=3, mask=RIGHT_PADDED)
    # DeepSeek-V3's Multi-head Latent Attention (load_latent_attention):
    # q and kv latents, interleaved rotary on 4 of 12 query/key features,
    # v_head_dim 6, yarn with mscale_all_dim (mscale² in the scale).
    ds3 = build(tf.DeepseekV3ForCausalLM,
                tf.DeepseekV3Config(**common(
                    hidden_size=32, intermediate_size=16,
                    moe_intermediate_size=16, num_attention_heads=4,
                    num_key_value_heads=4, num_hidden_layers=1,
                    q_lora_rank=12, kv_lora_rank=10, qk_nope_head_dim=8,
                    qk_rope_head_dim=4, v_head_dim=6, n_routed_experts=2,
                    num_experts_per_tok=1, n_group=1, topk_group=1,
                    first_k_dense_replace=1, max_position_embeddings=64,
                    rope_parameters={"rope_type": "yarn", "factor": 4.0,
                                     "rope_theta": 10000.0,
                                     "original_max_position_embeddings": 16,
                                     "beta_fast": 32.0, "beta_slow": 1.0,
                                     "mscale": 1.0, "mscale_all_dim": 1.0})),
                36)
    case("deepseek_v3", ds3, mask=RIGHT_PADDED)
    gradient_case("deepseek_v3", ds3.model, 0, "layers.0.self_attn")
    # DeepSeek-V2-Lite's form: no query latent (q_proj).
    ds2 = build(tf.DeepseekV2ForCausalLM,
                tf.DeepseekV2Config(**common(
                    hidden_size=32, intermediate_size=16,
                    moe_intermediate_size=16, num_attention_heads=4,
                    num_key_value_heads=4, num_hidden_layers=1,
                    q_lora_rank=None, kv_lora_rank=10, qk_nope_head_dim=8,
                    qk_rope_head_dim=4, v_head_dim=6, n_routed_experts=2,
                    num_experts_per_tok=1, first_k_dense_replace=1,
                    max_position_embeddings=64)), 37)
    case("deepseek_v2", ds2, mask=RIGHT_PADDED)


def main_gradients():
    """gradients.safetensors for the families whose cases hold the model
    already: each model is read back from its committed case directory, so
    the gradients belong to that checkpoint (`make_hf_fixtures.py
    gradients`). Full-attention layers only: gradient_case's mask is the
    plain causal one."""
    torch.set_grad_enabled(False)
    for name, cls, layer in (("olmo2", tf.Olmo2Model, 0),
                             ("gpt_oss_full", tf.GptOssModel, 1),
                             ("deepseek_v2", tf.DeepseekV2Model, 0)):
        model = cls.from_pretrained(os.path.join(ROOT, name),
                                    attn_implementation="eager").eval()
        gradient_case(name, model, layer, f"layers.{layer}.self_attn")
    # Qwen3-Next's full layer (output gate, (1 + weight) norms, partial
    # rotary), Gemma 3's global layer (its rope by layer type).
    qnext = tf.Qwen3NextModel.from_pretrained(
        os.path.join(ROOT, "qwen3_next"), attn_implementation="eager").eval()
    gradient_case("qwen3_next", qnext, 1, "layers.1.self_attn")
    gemma3 = tf.Gemma3TextModel.from_pretrained(
        os.path.join(ROOT, "gemma3_global"),
        attn_implementation="eager").eval()
    gradient_case("gemma3_global", gemma3, 1, "layers.1.self_attn",
                  lambda x, pos: gemma3.rotary_emb(x, pos, "full_attention"))
    # Llama 4's NoPE layer (temperature tuning, full causal attention).
    llama4 = tf.Llama4TextModel.from_pretrained(
        os.path.join(ROOT, "llama4_nope"), attn_implementation="eager").eval()
    gradient_case("llama4_nope", llama4, 3, "layers.3.self_attn")


if __name__ == "__main__":
    if sys.argv[1:] == ["families"]:
        main_families()
    elif sys.argv[1:] == ["gradients"]:
        main_gradients()
    else:
        main()

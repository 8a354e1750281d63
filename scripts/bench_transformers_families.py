#!/usr/bin/env python3
"""transformers 5.x's attention modules of the 2025 families on the CPU
(eager, 2 threads), the other side of scripts/bench_families.cpp's
comparison (issue 60): forward and forward+backward at (1, 2048, hidden
1024), medians of 3. Run in the sid chroot:

    /work/shared/tools/in-trixie.sh -r /opt/sid -e OMP_WAIT_POLICY=PASSIVE \\
        . -- python3 scripts/bench_transformers_families.py
"""
import time

import torch
import transformers as tf
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as ds3
from transformers.models.gemma3 import modeling_gemma3 as gemma3
from transformers.models.gpt_oss import modeling_gpt_oss as oss
from transformers.models.llama4 import modeling_llama4 as llama4
from transformers.models.olmo2 import modeling_olmo2 as olmo2
from transformers.models.qwen3 import modeling_qwen3 as qwen3
from transformers.models.qwen3_next import modeling_qwen3_next as qnext

torch.set_num_threads(2)
L, E = 2048, 1024


def median_ms(f, n=3):
    times = []
    for _ in range(n):
        t = time.perf_counter()
        f()
        times.append(time.perf_counter() - t)
    return sorted(times)[n // 2] * 1e3


def attention_case(name, attn, rotary, causal_mask=True):
    x = torch.randn(1, L, E)
    pos = torch.arange(L).unsqueeze(0)
    pe = rotary(x, pos)
    mask = torch.full((L, L), float("-inf")).triu(1).view(1, 1, L, L)

    def fwd():
        with torch.no_grad():
            attn(hidden_states=x, position_embeddings=pe, attention_mask=mask)

    def fwd_bwd():
        xg = x.clone().requires_grad_(True)
        pe_g = rotary(xg, pos)
        attn(hidden_states=xg, position_embeddings=pe_g,
             attention_mask=mask)[0].sum().backward()

    print(f"{name}: forward {median_ms(fwd):.0f} ms, "
          f"forward+backward {median_ms(fwd_bwd):.0f} ms")


def main():
    c = tf.Qwen3Config(hidden_size=E, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128,
                       attn_implementation="eager")
    attention_case("Qwen3Attention (16 heads, 8 kv, head_dim 128)",
                   qwen3.Qwen3Attention(c, 0).eval(),
                   qwen3.Qwen3RotaryEmbedding(c))
    c = tf.GptOssConfig(hidden_size=E, num_attention_heads=16,
                        num_key_value_heads=8, head_dim=64,
                        layer_types=["full_attention"], num_hidden_layers=1,
                        attn_implementation="eager")
    attention_case("GptOssAttention (16 heads, 8 kv, head_dim 64, sinks)",
                   oss.GptOssAttention(c, 0).eval(),
                   oss.GptOssRotaryEmbedding(c))
    c = tf.Olmo2Config(hidden_size=E, num_attention_heads=16,
                       num_key_value_heads=8, attn_implementation="eager")
    attention_case("Olmo2Attention (16 heads, 8 kv, head_dim 64, full norms)",
                   olmo2.Olmo2Attention(c, 0).eval(),
                   olmo2.Olmo2RotaryEmbedding(c))
    c = tf.Gemma3TextConfig(hidden_size=E, attn_implementation="eager")
    rope = gemma3.Gemma3RotaryEmbedding(c)
    attention_case("Gemma3Attention (8 heads, 4 kv, head_dim 256, global)",
                   gemma3.Gemma3Attention(c, 5).eval(),
                   lambda x, pos: rope(x, pos, "full_attention"))
    c = tf.Llama4TextConfig(hidden_size=E, num_attention_heads=16,
                            num_key_value_heads=8, head_dim=64,
                            attn_implementation="eager")
    attention_case("Llama4TextAttention (16 heads, 8 kv, head_dim 64, "
                   "chunks of 8192, L2 norm)",
                   llama4.Llama4TextAttention(c, 0).eval(),
                   llama4.Llama4TextRotaryEmbedding(c))
    c = tf.DeepseekV3Config(hidden_size=E, num_attention_heads=16,
                            num_key_value_heads=16,
                            q_lora_rank=384, kv_lora_rank=512,
                            qk_nope_head_dim=128, qk_rope_head_dim=64,
                            v_head_dim=128, attn_implementation="eager")
    attention_case("DeepseekV3Attention (16 heads, MLA)",
                   ds3.DeepseekV3Attention(c, 0).eval(),
                   ds3.DeepseekV3RotaryEmbedding(c))
    c = tf.Qwen3NextConfig(hidden_size=E, linear_num_key_heads=8,
                           linear_num_value_heads=16, linear_key_head_dim=128,
                           linear_value_head_dim=128,
                           layer_types=["linear_attention", "full_attention"],
                           num_hidden_layers=2)
    gdn = qnext.Qwen3NextGatedDeltaNet(c, 0).eval()
    x = torch.randn(1, L, E)

    def fwd():
        with torch.no_grad():
            gdn(x)

    def fwd_bwd():
        xg = x.clone().requires_grad_(True)
        gdn(xg).sum().backward()

    print(f"Qwen3NextGatedDeltaNet (8 key / 16 value heads of 128): forward "
          f"{median_ms(fwd):.0f} ms, forward+backward {median_ms(fwd_bwd):.0f} "
          "ms")


if __name__ == "__main__":
    main()

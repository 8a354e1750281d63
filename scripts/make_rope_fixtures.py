#!/usr/bin/env python3
"""Records what Hugging Face transformers' rotary embedding gives, for
tests/test_model_conventions.cpp.

For every rope type transformers 5.x ships for decoder models ("default",
"linear", "dynamic", "yarn", "longrope", "llama3"), with all of head_dim
rotated and with half of it (partial_rotary_factor 0.5, GPT-NeoX's
rotary_pct), a fresh GPTNeoXRotaryEmbedding (the class every decoder's
rotary module copies, with dynamic_rope_update) is built from a config and
called on int64 positions (2, T). Written:

  tests/fixtures/rope_fixtures.safetensors, per case NAME:
    NAME.positions          int64 (2, T), the position_ids given
    NAME.inv_freq           float32 (R/2), the module's inv_freq after the
                            call (dynamic and longrope change it)
    NAME.cos, NAME.sin      float32 (2, T, R), cos/sin as the module returns
                            them (angles duplicated: cat(freqs, freqs)),
                            attention scaling included
    NAME.attention_scaling  float32 (1)
  tests/fixtures/rope_fixtures.json: {"transformers": version, "cases":
    [{"name", "head_dim", "rotary_dim", "max_position_embeddings",
      "rope_parameters": the config's dict after transformers standardised
      it (rope_theta, rope_type and the type's keys)}]}

Run in the sid chroot, which has python3-transformers 5.x:
  /work/shared/tools/in-trixie.sh -r /opt/sid /work/wt-hf -- \
      python3 scripts/make_rope_fixtures.py
"""

import json
import os

import torch
import transformers
from safetensors.torch import save_file
from transformers import GPTNeoXConfig
from transformers.models.gpt_neox.modeling_gpt_neox import GPTNeoXRotaryEmbedding

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "..", "tests", "fixtures")

HIDDEN, HEADS = 64, 4  # head_dim 16
HEAD_DIM = HIDDEN // HEADS
T = 12

# Positions (2, T): row 0 from 0, row 1 left-padded (pads at 0, as
# transformers' generate writes them) then from 0.
SHORT = torch.stack(
    [torch.arange(T), torch.cat([torch.zeros(3, dtype=torch.long), torch.arange(T - 3)])]
)
# Beyond max_position_embeddings / original_max_position_embeddings (16):
# dynamic grows its base, longrope takes long_factor.
LONG = torch.stack([torch.arange(28, 28 + T), torch.arange(20, 20 + T)])
# Thousands of positions, where transformers' float32 angles drift: the test
# compares both with a float64 evaluation instead (cases named *_large).
LARGE = torch.stack([torch.arange(4000, 4000 + T), torch.arange(7000, 7000 + T)])


def cases():
    """(name, rope_parameters without partial_rotary_factor,
    max_position_embeddings, positions)."""
    g = torch.Generator().manual_seed(0)
    out = []
    for partial in (1.0, 0.5):
        tag = "full" if partial == 1.0 else "half"
        half = int(HEAD_DIM * partial) // 2
        out += [
            (f"default_{tag}", {"rope_type": "default", "rope_theta": 10000.0}, 64, SHORT),
            (f"default_theta500_{tag}", {"rope_type": "default", "rope_theta": 500.0}, 64, SHORT),
            (f"linear_{tag}", {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}, 64, SHORT),
            (f"dynamic_short_{tag}", {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}, 16, SHORT),
            (f"dynamic_long_{tag}", {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}, 16, LONG),
            (
                f"yarn_{tag}",
                {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                 "original_max_position_embeddings": 16},
                64,
                SHORT,
            ),
            (
                f"yarn_params_{tag}",
                {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0,
                 "original_max_position_embeddings": 32, "beta_fast": 16.0,
                 "beta_slow": 2.0, "truncate": False, "attention_factor": 1.25},
                256,
                LONG,
            ),
            (
                f"yarn_mscale_{tag}",
                {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                 "original_max_position_embeddings": 16, "mscale": 1.0,
                 "mscale_all_dim": 0.5},
                64,
                SHORT,
            ),
        ]
        short = (1.0 + 3.0 * torch.rand(half, generator=g, dtype=torch.float64)).tolist()
        long = (1.0 + 3.0 * torch.rand(half, generator=g, dtype=torch.float64)).tolist()
        for length, positions in (("short", SHORT), ("long", LONG)):
            out.append(
                (
                    f"longrope_{length}_{tag}",
                    {"rope_type": "longrope", "rope_theta": 10000.0, "factor": 4.0,
                     "original_max_position_embeddings": 16,
                     "short_factor": short, "long_factor": long},
                    64,
                    positions,
                )
            )
        out.append(
            (
                f"longrope_attention_factor_{tag}",
                {"rope_type": "longrope", "rope_theta": 10000.0, "factor": 4.0,
                 "original_max_position_embeddings": 16, "attention_factor": 0.75,
                 "short_factor": short, "long_factor": long},
                64,
                LONG,
            )
        )
        out.append(
            (
                f"llama3_{tag}",
                {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                 "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                 "original_max_position_embeddings": 32},
                128,
                SHORT,
            )
        )
        if partial == 1.0:
            out += [
                ("default_large_full", {"rope_type": "default", "rope_theta": 10000.0}, 8192, LARGE),
                ("linear_large_full", {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}, 8192, LARGE),
            ]
        # This round's cases (their names end with its tag) get its factor.
        out = [
            (name, dict(params, partial_rotary_factor=partial), max_pos, positions)
            if name.endswith(tag) else (name, params, max_pos, positions)
            for name, params, max_pos, positions in out
        ]
    return out


def main():
    tensors, index = {}, []
    for name, params, max_pos, positions in cases():
        config = GPTNeoXConfig(
            hidden_size=HIDDEN,
            num_attention_heads=HEADS,
            intermediate_size=4 * HIDDEN,
            num_hidden_layers=1,
            max_position_embeddings=max_pos,
            rope_parameters=dict(params),
        )
        rope = GPTNeoXRotaryEmbedding(config)
        x = torch.zeros(1, dtype=torch.float32)
        cos, sin = rope(x, positions)
        rotary_dim = int(HEAD_DIM * params.get("partial_rotary_factor", 1.0))
        assert cos.shape == (2, T, rotary_dim), (name, cos.shape)
        tensors[f"{name}.positions"] = positions.clone()
        tensors[f"{name}.inv_freq"] = rope.inv_freq.float().contiguous()
        tensors[f"{name}.cos"] = cos.contiguous()
        tensors[f"{name}.sin"] = sin.contiguous()
        tensors[f"{name}.attention_scaling"] = torch.tensor([float(rope.attention_scaling)])
        index.append(
            {
                "name": name,
                "head_dim": HEAD_DIM,
                "rotary_dim": rotary_dim,
                "max_position_embeddings": max_pos,
                "rope_parameters": config.rope_parameters,
            }
        )
    save_file(tensors, os.path.join(OUT, "rope_fixtures.safetensors"))
    with open(os.path.join(OUT, "rope_fixtures.json"), "w") as f:
        json.dump({"transformers": transformers.__version__, "cases": index}, f, indent=1)
        f.write("\n")
    print(f"{len(index)} cases, transformers {transformers.__version__}")


if __name__ == "__main__":
    main()

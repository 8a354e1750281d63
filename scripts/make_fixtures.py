#!/usr/bin/env python3
"""Writes the golden fixtures of the tests into tests/fixtures/.

Python's nn.MultiheadAttention, nn.TransformerEncoderLayer and
nn.TransformerEncoder, with small random weights, run on small random inputs;
their state dicts, inputs, outputs and input gradients are stored for the C++
tests to load into mha's modules and compare against (1e-5, float32).

Run it with PyTorch >= 2.1 (nn.TransformerEncoderLayer's `bias`), e.g. the
Python of the Debian 13 lab chroot, from the repository root:

    /work/shared/tools/in-trixie.sh "$PWD" -- python3 scripts/make_fixtures.py

Everything is seeded: a rerun with the same PyTorch writes the same bytes.
Only PyTorch (and its numpy) is needed: safetensors files are written by hand
below, as the format is simple (the `safetensors` package is not required).

Fixture format (version 1)
--------------------------
tests/fixtures/fixtures.json:
    {"format": 1, "generator": "scripts/make_fixtures.py",
     "torch_version": "2.6.0...", "fixtures": [FIXTURE, ...]}

FIXTURE:
    "name":    unique; the stem of the fixture's files.
    "module":  "MultiheadAttention" | "TransformerEncoderLayer" |
               "TransformerEncoder"
    "options": constructor options, under PyTorch's (= mha's) names:
        MultiheadAttention: embed_dim, num_heads, dropout, bias, add_bias_kv,
            add_zero_attn, kdim, vdim (ints, equal to embed_dim when not
            set), batch_first.
        TransformerEncoderLayer: d_model, nhead, dim_feedforward, dropout,
            activation ("relu" | "gelu"), layer_norm_eps, batch_first,
            norm_first, bias.
        TransformerEncoder: layer (the TransformerEncoderLayer options above),
            num_layers, norm (true: a final nn.LayerNorm(d_model)), norm_eps
            (that LayerNorm's eps).
    "forward": the call's non-tensor arguments:
        MultiheadAttention: self_attention (true: key and value are the query
            tensor itself, mha: leave key/value undefined), need_weights,
            average_attn_weights.
        TransformerEncoderLayer / TransformerEncoder: {} (the call is
            m(src, src_key_padding_mask=...), no src_mask, is_causal false).
    "state_dict": files holding the same state dict ("pt" and "pt_dict"
        only for some fixtures):
        "safetensors": NAME.safetensors
        "pt":          NAME.pt       torch.save(m.state_dict())  (OrderedDict)
        "pt_dict":     NAME.dict.pt  torch.save(dict(m.state_dict()))
    "keys":  the state dict's keys, in PyTorch's order.
    "data":  NAME.data.safetensors, the tensors of the call:
        MultiheadAttention: query; key and value (cross attention only);
            key_padding_mask; output; weights (need_weights only);
            output_grad; grad_query; grad_key and grad_value (cross only).
        encoders: src; src_key_padding_mask; output; output_grad; grad_src.
    Masks are bool (N, S), true = padded; some positions of every fixture are
    padded, no sequence completely. Other tensors are float32, laid out by
    batch_first: (N, L, E) or (L, N, E). output_grad is a fixed random tensor
    R shaped like output, and grad_X is the gradient of sum(output * R) with
    respect to input X.

The modules run in eval mode with dropout 0 but with autograd on, so that
PyTorch takes its ordinary (not the no_grad "fast path") code, whose padded
rows DESIGN.md follows. Every parameter is perturbed randomly after
construction, so LayerNorm weights and biases differ from 1 and 0 and the
layers of a TransformerEncoder differ from each other.

All fixtures together stay well under 1 MB.
"""

import json
import os
import struct
import sys

import torch
from torch import nn

OUT_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..",
                       "tests", "fixtures")

SAFETENSORS_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16",
    torch.bfloat16: "BF16", torch.int64: "I64", torch.int32: "I32",
    torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL",
}


def write_safetensors(path, tensors):
    """Writes {name: tensor} as safetensors (little-endian machines).

    Layout: 8-byte little-endian header length N, N bytes of JSON header
    {name: {"dtype", "shape", "data_offsets": [begin, end]}} padded with
    spaces to a multiple of 8, then the tensors' bytes back to back.
    """
    header = {"__metadata__": {"format": "pt"}}
    blobs = []
    offset = 0
    for name, t in tensors.items():
        t = t.detach().cpu().contiguous()
        data = t.reshape(-1).view(torch.uint8).numpy().tobytes()
        header[name] = {"dtype": SAFETENSORS_DTYPES[t.dtype],
                        "shape": list(t.shape),
                        "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for blob in blobs:
            f.write(blob)


def padding_mask(lengths, S):
    """Bool (N, S): true at positions >= the sequence's length."""
    return torch.arange(S)[None, :] >= torch.tensor(lengths)[:, None]


def perturb(module):
    with torch.no_grad():
        for p in module.parameters():
            p.add_(0.1 * torch.randn_like(p))


def save_state_dict(module, name, pt):
    files = {"safetensors": name + ".safetensors"}
    sd = module.state_dict()
    write_safetensors(os.path.join(OUT_DIR, files["safetensors"]), sd)
    if pt:
        files["pt"] = name + ".pt"
        files["pt_dict"] = name + ".dict.pt"
        torch.save(sd, os.path.join(OUT_DIR, files["pt"]))
        torch.save(dict(sd), os.path.join(OUT_DIR, files["pt_dict"]))
    return files, list(sd.keys())


def mha_fixture(name, options, forward, N, L, S, lengths, pt=True):
    torch.manual_seed(sum(map(ord, name)))
    m = nn.MultiheadAttention(options["embed_dim"], options["num_heads"],
                              dropout=0.0, bias=options["bias"],
                              add_bias_kv=options["add_bias_kv"],
                              add_zero_attn=options["add_zero_attn"],
                              kdim=options["kdim"], vdim=options["vdim"],
                              batch_first=options["batch_first"])
    perturb(m)
    m.eval()

    def shaped(n, length, e):
        shape = (n, length, e) if options["batch_first"] else (length, n, e)
        return torch.randn(shape, requires_grad=True)

    data = {}
    query = shaped(N, L, options["embed_dim"])
    data["query"] = query
    if forward["self_attention"]:
        key = value = query
    else:
        key = shaped(N, S, options["kdim"])
        value = shaped(N, S, options["vdim"])
        data["key"] = key
        data["value"] = value
    mask = padding_mask(lengths, S)
    data["key_padding_mask"] = mask
    output, weights = m(query, key, value, key_padding_mask=mask,
                        need_weights=forward["need_weights"],
                        average_attn_weights=forward["average_attn_weights"])
    grad_out = torch.randn_like(output)
    inputs = [("query", query)]
    if not forward["self_attention"]:
        inputs += [("key", key), ("value", value)]
    grads = torch.autograd.grad((output * grad_out).sum(),
                                [t for _, t in inputs])
    data["output"] = output
    if forward["need_weights"]:
        data["weights"] = weights
    data["output_grad"] = grad_out
    for (input_name, _), grad in zip(inputs, grads):
        data["grad_" + input_name] = grad
    return finish(name, "MultiheadAttention", options, forward, m, data, pt)


def layer_options(d_model, nhead, dim_feedforward, activation="relu",
                  layer_norm_eps=1e-5, batch_first=True, norm_first=False,
                  bias=True):
    return {"d_model": d_model, "nhead": nhead,
            "dim_feedforward": dim_feedforward, "dropout": 0.0,
            "activation": activation, "layer_norm_eps": layer_norm_eps,
            "batch_first": batch_first, "norm_first": norm_first,
            "bias": bias}


def make_layer(o):
    return nn.TransformerEncoderLayer(
        o["d_model"], o["nhead"], dim_feedforward=o["dim_feedforward"],
        dropout=o["dropout"], activation=o["activation"],
        layer_norm_eps=o["layer_norm_eps"], batch_first=o["batch_first"],
        norm_first=o["norm_first"], bias=o["bias"])


def encoder_fixture(name, module, options, N, L, lengths, pt=False):
    torch.manual_seed(sum(map(ord, name)))
    layer = options["layer"] if module == "TransformerEncoder" else options
    if module == "TransformerEncoder":
        norm = (nn.LayerNorm(layer["d_model"], eps=options["norm_eps"])
                if options["norm"] else None)
        m = nn.TransformerEncoder(make_layer(layer), options["num_layers"],
                                  norm=norm, enable_nested_tensor=False)
    else:
        m = make_layer(layer)
    perturb(m)
    m.eval()
    shape = ((N, L, layer["d_model"]) if layer["batch_first"]
             else (L, N, layer["d_model"]))
    src = torch.randn(shape, requires_grad=True)
    mask = padding_mask(lengths, L)
    output = m(src, src_key_padding_mask=mask)
    grad_out = torch.randn_like(output)
    (grad_src,) = torch.autograd.grad((output * grad_out).sum(), [src])
    data = {"src": src, "src_key_padding_mask": mask, "output": output,
            "output_grad": grad_out, "grad_src": grad_src}
    return finish(name, module, options, {}, m, data, pt)


def finish(name, module_name, options, forward, m, data, pt):
    files, keys = save_state_dict(m, name, pt)
    data_file = name + ".data.safetensors"
    write_safetensors(os.path.join(OUT_DIR, data_file), data)
    return {"name": name, "module": module_name, "options": options,
            "forward": forward, "state_dict": files, "keys": keys,
            "data": data_file}


def mha_options(embed_dim, num_heads, bias=True, add_bias_kv=False,
                add_zero_attn=False, kdim=None, vdim=None, batch_first=True):
    return {"embed_dim": embed_dim, "num_heads": num_heads, "dropout": 0.0,
            "bias": bias, "add_bias_kv": add_bias_kv,
            "add_zero_attn": add_zero_attn, "kdim": kdim or embed_dim,
            "vdim": vdim or embed_dim, "batch_first": batch_first}


def main():
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    os.makedirs(OUT_DIR, exist_ok=True)
    fixtures = [
        mha_fixture("mha_self_padding", mha_options(8, 2),
                    {"self_attention": True, "need_weights": True,
                     "average_attn_weights": True},
                    N=3, L=5, S=5, lengths=[5, 3, 4]),
        mha_fixture("mha_kdim_vdim", mha_options(8, 2, kdim=6, vdim=4),
                    {"self_attention": False, "need_weights": True,
                     "average_attn_weights": False},
                    N=2, L=4, S=6, lengths=[6, 4]),
        mha_fixture("mha_no_bias_seq_first",
                    mha_options(12, 3, bias=False, batch_first=False),
                    {"self_attention": False, "need_weights": False,
                     "average_attn_weights": True},
                    N=2, L=5, S=4, lengths=[4, 2]),
        mha_fixture("mha_bias_kv_zero_attn",
                    mha_options(8, 4, add_bias_kv=True, add_zero_attn=True),
                    {"self_attention": True, "need_weights": True,
                     "average_attn_weights": True},
                    N=2, L=4, S=4, lengths=[4, 3], pt=False),
        encoder_fixture("encoder_layer_post_relu", "TransformerEncoderLayer",
                        layer_options(16, 4, 32), N=3, L=5,
                        lengths=[5, 2, 4], pt=True),
        encoder_fixture("encoder_layer_pre_gelu", "TransformerEncoderLayer",
                        layer_options(12, 2, 24, activation="gelu",
                                      norm_first=True),
                        N=2, L=6, lengths=[4, 6]),
        encoder_fixture("encoder_layer_seq_first", "TransformerEncoderLayer",
                        layer_options(8, 2, 16, batch_first=False),
                        N=3, L=4, lengths=[4, 1, 3]),
        encoder_fixture("encoder_layer_no_bias", "TransformerEncoderLayer",
                        layer_options(8, 2, 16, bias=False),
                        N=2, L=5, lengths=[3, 5], pt=True),
        encoder_fixture("encoder_layer_eps", "TransformerEncoderLayer",
                        layer_options(8, 4, 16, layer_norm_eps=1e-2),
                        N=2, L=4, lengths=[4, 2]),
        encoder_fixture("encoder_2_layers_norm", "TransformerEncoder",
                        {"layer": layer_options(8, 2, 16), "num_layers": 2,
                         "norm": True, "norm_eps": 1e-5},
                        N=2, L=6, lengths=[6, 3], pt=True),
    ]
    index = {"format": 1, "generator": "scripts/make_fixtures.py",
             "torch_version": torch.__version__, "fixtures": fixtures}
    with open(os.path.join(OUT_DIR, "fixtures.json"), "w") as f:
        json.dump(index, f, indent=1)
        f.write("\n")
    total = sum(os.path.getsize(os.path.join(OUT_DIR, n))
                for n in os.listdir(OUT_DIR))
    print(f"make_fixtures: {len(fixtures)} fixtures, {total} bytes in "
          f"{os.path.relpath(OUT_DIR)} (PyTorch {torch.__version__})")
    if total > 1_000_000:
        sys.exit("make_fixtures: fixtures exceed 1 MB")


if __name__ == "__main__":
    main()

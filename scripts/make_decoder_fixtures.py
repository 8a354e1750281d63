#!/usr/bin/env python3
"""Writes the golden fixtures of the Transformer decoder's tests into
tests/fixtures/decoder/ (tests/test_transformer_decoder.cpp).

Python's nn.TransformerDecoderLayer, nn.TransformerDecoder and nn.Transformer,
with small random weights, run on small random inputs with every mask of
their forward; their state dicts, inputs, outputs and the gradients of the
inputs and of every parameter are stored for the C++ tests to load into mha's
modules and compare against (1e-5 in float32, 1e-10 in float64).

Run it from the repository root with PyTorch 2.x (the Python of the Debian
sid lab chroot) for tests/fixtures/decoder/, and with the host's PyTorch
1.13 for tests/fixtures/decoder-1.13/ (its layers have no `bias` and no
`tgt_is_causal`: the fixtures that need them are left out):

    /work/shared/tools/in-trixie.sh -r /opt/sid "$PWD" -- \
        python3 scripts/make_decoder_fixtures.py
    /usr/bin/python3 scripts/make_decoder_fixtures.py tests/fixtures/decoder-1.13

Everything is seeded: a rerun with the same PyTorch writes the same bytes.
It reuses the safetensors writer and helpers of scripts/make_fixtures.py.

Fixture format (version 1)
--------------------------
DIR/decoder.json (DIR: tests/fixtures/decoder or the argument):
    {"format": 1, "generator": "scripts/make_decoder_fixtures.py",
     "torch_version": "...", "fixtures": [FIXTURE, ...]}

FIXTURE:
    "name":    unique; the stem of the fixture's files.
    "module":  "TransformerDecoderLayer" | "TransformerDecoder" |
               "Transformer"
    "dtype":   "float32" | "float64"
    "options": constructor options under PyTorch's (= mha's) names:
        TransformerDecoderLayer: d_model, nhead, dim_feedforward, dropout,
            activation ("relu" | "gelu"), layer_norm_eps, batch_first,
            norm_first, bias.
        TransformerDecoder: layer (the options above), num_layers, norm
            (true: a final nn.LayerNorm(d_model, eps=layer_norm_eps)).
        Transformer: d_model, nhead, num_encoder_layers, num_decoder_layers,
            dim_feedforward, dropout, activation, layer_norm_eps,
            batch_first, norm_first, bias.
    "forward": {"tgt_is_causal": bool, "memory_is_causal": bool}: the flags
        passed with the masks (Python treats them as hints; every mask they
        describe is also passed).
    "state_dict": {"safetensors": NAME.safetensors[, "pt": NAME.pt]}
    "keys":  the state dict's keys, in PyTorch's order.
    "data":  NAME.data.safetensors, the tensors of the call, each present
        only where the call used it:
        inputs: tgt, memory (decoders) or src, tgt (Transformer);
        masks: tgt_mask, memory_mask, src_mask, tgt_key_padding_mask,
            memory_key_padding_mask, src_key_padding_mask (bool: true =
            blocked, or floating: added to the scores);
        output; output_grad (a fixed random tensor R shaped like output);
        grad_<input>: the gradient of sum(output * R) with respect to the
            input; grad.<parameter name>: the same for every parameter.
"""

import inspect
import json
import os
import sys

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from make_fixtures import padding_mask, perturb, write_safetensors  # noqa

OUT_DIR = (sys.argv[1] if len(sys.argv) > 1 else
           os.path.join(os.path.dirname(os.path.abspath(__file__)), "..",
                        "tests", "fixtures", "decoder"))
# PyTorch >= 2.1: the layers' `bias`; >= 2.0: forward's `tgt_is_causal`.
HAS_BIAS = "bias" in inspect.signature(nn.TransformerDecoderLayer).parameters
HAS_IS_CAUSAL = "tgt_is_causal" in inspect.signature(
    nn.TransformerDecoderLayer.forward).parameters


def layer_options(d_model, nhead, dim_feedforward, activation="relu",
                  layer_norm_eps=1e-5, batch_first=True, norm_first=False,
                  bias=True):
    return {"d_model": d_model, "nhead": nhead,
            "dim_feedforward": dim_feedforward, "dropout": 0.0,
            "activation": activation, "layer_norm_eps": layer_norm_eps,
            "batch_first": batch_first, "norm_first": norm_first,
            "bias": bias}


def bias_kwarg(o):
    """{"bias": ...} where this PyTorch has the option (1.13: always on)."""
    return {"bias": o["bias"]} if HAS_BIAS else {}


def make_layer(o):
    return nn.TransformerDecoderLayer(
        o["d_model"], o["nhead"], dim_feedforward=o["dim_feedforward"],
        dropout=o["dropout"], activation=o["activation"],
        layer_norm_eps=o["layer_norm_eps"], batch_first=o["batch_first"],
        norm_first=o["norm_first"], **bias_kwarg(o))


def sequence(o, n, length, dtype):
    shape = ((n, length, o["d_model"]) if o["batch_first"]
             else (length, n, o["d_model"]))
    return torch.randn(shape, dtype=dtype, requires_grad=True)


def causal(length, kind, dtype):
    """Causal mask: bool (true = blocked) or float (-inf above the
    diagonal), as nn.Transformer.generate_square_subsequent_mask."""
    blocked = torch.triu(torch.ones(length, length, dtype=torch.bool), 1)
    if kind == "bool":
        return blocked
    return torch.zeros(length, length, dtype=dtype).masked_fill(
        blocked, float("-inf"))


def fixture(name, module, options, dtype=torch.float32, N=2, T=5, S=6,
            tgt_lengths=None, memory_lengths=None, tgt_mask="float",
            memory_mask=None, src_mask=None, pt=False):
    torch.manual_seed(sum(map(ord, name)))
    layer = options["layer"] if module == "TransformerDecoder" else options
    if not layer["bias"] and not HAS_BIAS:
        return None  # PyTorch < 2.1: no bias=False
    if module == "TransformerDecoderLayer":
        m = make_layer(options)
    elif module == "TransformerDecoder":
        norm = (nn.LayerNorm(layer["d_model"], eps=layer["layer_norm_eps"],
                             **bias_kwarg(layer))
                if options["norm"] else None)
        m = nn.TransformerDecoder(make_layer(layer), options["num_layers"],
                                  norm=norm)
    else:
        m = nn.Transformer(
            options["d_model"], options["nhead"],
            num_encoder_layers=options["num_encoder_layers"],
            num_decoder_layers=options["num_decoder_layers"],
            dim_feedforward=options["dim_feedforward"],
            dropout=options["dropout"], activation=options["activation"],
            layer_norm_eps=options["layer_norm_eps"],
            batch_first=options["batch_first"],
            norm_first=options["norm_first"], **bias_kwarg(options))
    m = m.to(dtype)
    perturb(m)
    m.eval()

    data = {}
    inputs = []
    if module == "Transformer":
        data["src"] = sequence(layer, N, S, dtype)
        inputs.append("src")
    data["tgt"] = sequence(layer, N, T, dtype)
    inputs.append("tgt")
    if module != "Transformer":
        data["memory"] = sequence(layer, N, S, dtype)
        inputs.append("memory")
    kwargs = {}
    if tgt_mask is not None:
        kwargs["tgt_mask"] = data["tgt_mask"] = causal(T, tgt_mask, dtype)
    if memory_mask is not None:
        # Token i sees memory j <= i + 1 (every row sees two keys at least).
        blocked = torch.triu(torch.ones(T, S, dtype=torch.bool), 2)
        if memory_mask == "float":
            blocked = torch.zeros(T, S, dtype=dtype).masked_fill(
                blocked, float("-inf"))
        kwargs["memory_mask"] = data["memory_mask"] = blocked
    if src_mask is not None:
        kwargs["src_mask"] = data["src_mask"] = causal(S, src_mask, dtype)
    if tgt_lengths is not None:
        kwargs["tgt_key_padding_mask"] = data["tgt_key_padding_mask"] = \
            padding_mask(tgt_lengths, T)
    if memory_lengths is not None:
        mask = padding_mask(memory_lengths, S)
        kwargs["memory_key_padding_mask"] = \
            data["memory_key_padding_mask"] = mask
        if module == "Transformer":
            kwargs["src_key_padding_mask"] = \
                data["src_key_padding_mask"] = mask
    forward = {"tgt_is_causal": tgt_mask is not None,
               "memory_is_causal": False}
    args = [data[x] for x in inputs]
    if HAS_IS_CAUSAL:
        kwargs["tgt_is_causal"] = forward["tgt_is_causal"]
    output = m(*args, **kwargs)
    grad_out = torch.randn_like(output)
    params = list(m.named_parameters())
    grads = torch.autograd.grad((output * grad_out).sum(),
                                args + [p for _, p in params])
    data["output"] = output
    data["output_grad"] = grad_out
    for input_name, grad in zip(inputs, grads):
        data["grad_" + input_name] = grad
    for (param_name, _), grad in zip(params, grads[len(inputs):]):
        data["grad." + param_name] = grad

    sd = m.state_dict()
    files = {"safetensors": name + ".safetensors"}
    write_safetensors(os.path.join(OUT_DIR, files["safetensors"]), sd)
    if pt:
        files["pt"] = name + ".pt"
        torch.save(sd, os.path.join(OUT_DIR, files["pt"]))
    data_file = name + ".data.safetensors"
    write_safetensors(os.path.join(OUT_DIR, data_file), data)
    return {"name": name, "module": module,
            "dtype": str(dtype).replace("torch.", ""), "options": options,
            "forward": forward, "state_dict": files, "keys": list(sd.keys()),
            "data": data_file}


def transformer_options(d_model, nhead, dim_feedforward, num_encoder_layers=2,
                        num_decoder_layers=2, **kwargs):
    o = layer_options(d_model, nhead, dim_feedforward, **kwargs)
    o["num_encoder_layers"] = num_encoder_layers
    o["num_decoder_layers"] = num_decoder_layers
    return o


def main():
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    os.makedirs(OUT_DIR, exist_ok=True)
    f64 = torch.float64
    fixtures = [
        fixture("decoder_layer_post_relu", "TransformerDecoderLayer",
                layer_options(16, 4, 32), tgt_lengths=[5, 3],
                memory_lengths=[6, 4], pt=True),
        fixture("decoder_layer_pre_gelu", "TransformerDecoderLayer",
                layer_options(12, 2, 24, activation="gelu", norm_first=True),
                N=3, T=4, S=5, tgt_mask="bool", memory_lengths=[5, 2, 4],
                memory_mask="bool"),
        fixture("decoder_layer_seq_first", "TransformerDecoderLayer",
                layer_options(8, 2, 16, batch_first=False), N=3, T=4, S=3,
                tgt_lengths=[4, 2, 3], memory_lengths=[3, 1, 2],
                memory_mask="float"),
        fixture("decoder_layer_no_bias", "TransformerDecoderLayer",
                layer_options(8, 2, 16, bias=False, layer_norm_eps=1e-2),
                tgt_mask=None, memory_lengths=[6, 3], pt=True),
        fixture("decoder_layer_f64", "TransformerDecoderLayer",
                layer_options(8, 4, 16, norm_first=True), dtype=f64,
                tgt_lengths=[5, 4], memory_lengths=[4, 6]),
        fixture("decoder_2_layers_norm", "TransformerDecoder",
                {"layer": layer_options(8, 2, 16), "num_layers": 2,
                 "norm": True},
                tgt_lengths=[5, 2], memory_lengths=[6, 5], pt=True),
        fixture("transformer_batch_first", "Transformer",
                transformer_options(16, 4, 32), tgt_lengths=[5, 3],
                memory_lengths=[6, 4], pt=True),
        fixture("transformer_seq_first_pre_gelu", "Transformer",
                transformer_options(8, 2, 16, batch_first=False,
                                    norm_first=True, activation="gelu"),
                N=3, T=4, S=5, memory_lengths=[5, 3, 4], src_mask="bool",
                pt=True),
        fixture("transformer_no_bias_f64", "Transformer",
                transformer_options(8, 2, 16, num_encoder_layers=1,
                                    num_decoder_layers=3, bias=False),
                dtype=f64, tgt_lengths=[5, 4], memory_lengths=[6, 2],
                memory_mask="float"),
    ]
    fixtures = [f for f in fixtures if f is not None]
    index = {"format": 1, "generator": "scripts/make_decoder_fixtures.py",
             "torch_version": torch.__version__, "fixtures": fixtures}
    with open(os.path.join(OUT_DIR, "decoder.json"), "w") as f:
        json.dump(index, f, indent=1)
        f.write("\n")
    total = sum(os.path.getsize(os.path.join(OUT_DIR, n))
                for n in os.listdir(OUT_DIR))
    print(f"make_decoder_fixtures: {len(fixtures)} fixtures, {total} bytes "
          f"in {os.path.relpath(OUT_DIR)} (PyTorch {torch.__version__})")
    if total > 1_000_000:
        sys.exit("make_decoder_fixtures: fixtures exceed 1 MB")


if __name__ == "__main__":
    main()

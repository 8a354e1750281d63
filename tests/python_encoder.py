#!/usr/bin/env python3
"""The Python half of the C++ -> Python direction for the encoder layer
(tests/test_transformer.cpp, TransformerFixtureTest.CppWeightsGiveTheSameOutputsInPython).

Usage: python_encoder.py DIR

Reads DIR/options.json (the mha::TransformerEncoderLayer options under
PyTorch's names), DIR/layer.pt (written by mha::save_state_dict) with a plain
torch.load (and weights_only=True where this PyTorch has it), and
DIR/input.safetensors (src, src_key_padding_mask). Builds
nn.TransformerEncoderLayer with those options, loads the state dict strictly,
runs it in eval mode with autograd on (the no_grad fast path treats padded
rows differently) and writes DIR/output.safetensors (output).
"""

import inspect
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from python_roundtrip import read_safetensors, write_safetensors  # noqa: E402


def main():
    directory = sys.argv[1]
    with open(os.path.join(directory, "options.json")) as f:
        o = json.load(f)
    kwargs = dict(dim_feedforward=o["dim_feedforward"], dropout=0.0,
                  activation=o["activation"],
                  layer_norm_eps=o["layer_norm_eps"],
                  batch_first=o["batch_first"], norm_first=o["norm_first"])
    layer = torch.nn.TransformerEncoderLayer(o["d_model"], o["nhead"],
                                             **kwargs)
    load = {}
    if "weights_only" in inspect.signature(torch.load).parameters:
        load["weights_only"] = True
    state = torch.load(os.path.join(directory, "layer.pt"), **load)
    layer.load_state_dict(state, strict=True)
    layer.eval()
    inputs = read_safetensors(os.path.join(directory, "input.safetensors"))
    output = layer(inputs["src"],
                   src_key_padding_mask=inputs["src_key_padding_mask"])
    write_safetensors(os.path.join(directory, "output.safetensors"),
                      {"output": output.detach().contiguous()})
    print("python_encoder.py: torch %s, %s" % (torch.__version__,
                                              ", ".join(sorted(load)) or
                                              "plain torch.load"))


if __name__ == "__main__":
    main()

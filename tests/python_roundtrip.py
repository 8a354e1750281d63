#!/usr/bin/env python3
"""The Python half of the C++ -> file -> Python -> file -> C++ round trip of
tests/test_state_dict.cpp (StateDictPythonTest).

Usage: python_roundtrip.py DIR

Reads DIR/cpp.pt and DIR/cpp.safetensors, written by mha::save/write_state_dict:
  * loads cpp.pt with a plain torch.load, and again with weights_only=True
    where this PyTorch has that argument, and checks it is a
    collections.OrderedDict;
  * reads cpp.safetensors (by hand, without the safetensors package);
  * checks that all three hold the same names in the same order, dtypes,
    shapes and values.
Then writes the transformed state dict (floating: x * 2, integer: x * 3 - 1,
bool: not x) as
  * DIR/py.pt        torch.save(OrderedDict): 2-D tensors saved as transposed
                     (non-contiguous) views, 1-D ones as views at offset 3 of
                     a larger storage, so the C++ reader meets strides and
                     offsets;
  * DIR/py.dict.pt   torch.save(dict(...));
  * DIR/py.safetensors.
Prints one line saying what it did; exits non-zero with a message on failure.
"""

import collections
import inspect
import json
import os
import struct
import sys

import torch

DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
    "BF16": torch.bfloat16, "I64": torch.int64, "I32": torch.int32,
    "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}
NAMES = {dtype: name for name, dtype in DTYPES.items()}


def read_safetensors(path):
    with open(path, "rb") as f:
        blob = f.read()
    (n,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8:8 + n])
    data = blob[8 + n:]
    header.pop("__metadata__", None)
    entries = sorted(header.items(), key=lambda kv: kv[1]["data_offsets"])
    out = collections.OrderedDict()
    for name, info in entries:
        begin, end = info["data_offsets"]
        dtype = DTYPES[info["dtype"]]
        if begin == end:
            out[name] = torch.empty(info["shape"], dtype=dtype)
            continue
        raw = torch.frombuffer(bytearray(data[begin:end]), dtype=torch.uint8)
        out[name] = raw.view(dtype).reshape(info["shape"]).clone()
    return out


def write_safetensors(path, tensors):
    header = {"__metadata__": {"format": "pt"}}
    blobs = []
    offset = 0
    for name, t in tensors.items():
        t = t.detach().cpu().contiguous()
        raw = t.reshape(-1).view(torch.uint8).numpy().tobytes()
        header[name] = {"dtype": NAMES[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + b"".join(blobs))


def check_same(what, got, expected):
    if list(got.keys()) != list(expected.keys()):
        sys.exit(f"{what}: keys {list(got.keys())} != {list(expected.keys())}")
    for name, t in expected.items():
        g = got[name]
        if g.dtype != t.dtype or g.shape != t.shape or not torch.equal(g, t):
            sys.exit(f"{what}: '{name}' differs: {g.dtype} {tuple(g.shape)} "
                     f"{g} != {t.dtype} {tuple(t.shape)} {t}")


def transform(t):
    if t.dtype == torch.bool:
        return ~t
    if t.is_floating_point():
        return t * 2
    return t * 3 - 1


def strided_copy(t):
    """The same values, stored non-contiguously or at a storage offset."""
    if t.dim() == 2:
        view = torch.empty(t.shape[1], t.shape[0], dtype=t.dtype).t()
    elif t.dim() == 1 and t.numel() > 0:
        view = torch.zeros(t.numel() + 3, dtype=t.dtype)[3:]
    else:
        return t
    view.copy_(t)
    return view


def main():
    directory = sys.argv[1]
    loaded = torch.load(os.path.join(directory, "cpp.pt"))
    if type(loaded) is not collections.OrderedDict:
        sys.exit(f"cpp.pt: torch.load gave {type(loaded)}, not an OrderedDict")
    modes = ["torch.load"]
    if "weights_only" in inspect.signature(torch.load).parameters:
        safe = torch.load(os.path.join(directory, "cpp.pt"), weights_only=True)
        check_same("cpp.pt (weights_only=True)", safe, loaded)
        modes.append("weights_only=True")
    from_safetensors = read_safetensors(
        os.path.join(directory, "cpp.safetensors"))
    check_same("cpp.safetensors vs cpp.pt", from_safetensors, loaded)

    out = collections.OrderedDict(
        (name, transform(t)) for name, t in loaded.items())
    strided = collections.OrderedDict(
        (name, strided_copy(t)) for name, t in out.items())
    torch.save(strided, os.path.join(directory, "py.pt"))
    torch.save(dict(out), os.path.join(directory, "py.dict.pt"))
    write_safetensors(os.path.join(directory, "py.safetensors"), out)
    print(f"python_roundtrip: PyTorch {torch.__version__}: read {len(loaded)} "
          f"tensors ({', '.join(modes)}, safetensors), wrote py.pt, "
          f"py.dict.pt, py.safetensors")


if __name__ == "__main__":
    main()

// State dicts on disk: loading and saving a module's parameters and buffers
// as safetensors files or PyTorch (torch.save) zip files, so that weights
// move both ways between Python and C++.
//
// Keys are PyTorch's dotted names, as Python's `module.state_dict()` gives
// them: a module's own parameters, then its own buffers, then those of each
// child under "<child>." (e.g. `in_proj_weight`, `out_proj.weight`,
// `self_attn.in_proj_weight`, `layers.0.linear1.weight`).
//
// Formats:
//   * safetensors (https://github.com/huggingface/safetensors, "Format"):
//     an 8-byte little-endian header length N, N bytes of JSON header
//     {"name": {"dtype": "F32", "shape": [2, 3], "data_offsets": [b, e]},
//     "__metadata__": {"key": "value"}}, then the raw little-endian data;
//     offsets are relative to the data section, which the tensors cover
//     exactly, without holes or overlaps.
//   * PyTorch zip files
//   (https://pytorch.org/docs/stable/notes/serialization.html):
//     a zip archive holding the pickle `data.pkl` and one record `data/<key>`
//     per storage, as Python's `torch.save(obj, path)` writes since 1.6.
//     mha reads the pickle with its own small unpickler, which accepts only
//     what a state dict needs (dicts and collections.OrderedDict of tensors
//     rebuilt by torch._utils._rebuild_tensor_v2), and never runs anything:
//     a checkpoint is untrusted input.
//
// Supported dtypes, both formats: float64, float32, float16, bfloat16, int64,
// int32, int16, int8, uint8, bool. Files are little-endian (as every
// safetensors and PyTorch file written on common hardware); mha builds only
// on little-endian machines.
//
// Every error is a c10::Error whose message names the file. Reading a file
// holds at most 64 MiB + 4 times its size of memory; a file that would need
// more (a hostile one: millions of objects or tensors in a few megabytes)
// is refused with such an error (docs/reliability.md).
#pragma once

#include <torch/torch.h>

#include <string>
#include <vector>

namespace mha {

/// What `load_state_dict(..., strict=false)` did not match. Keys are listed
/// in the order of the module (missing) and of the file (unexpected).
struct LoadResult {
  /// In the module, not in the file: these tensors were left as they were.
  std::vector<std::string> missing_keys;
  /// In the file, not in the module: these were ignored.
  std::vector<std::string> unexpected_keys;
};

/// A module's state dict, as Python's `module.state_dict()`: every defined
/// parameter and buffer under its dotted name, in PyTorch's order (own
/// parameters, own buffers, then each child recursively). The tensors are
/// detached and share storage with the module's.
///
/// Example:
///   mha::MultiHeadAttention attn(8, 2);
///   auto sd = mha::state_dict(*attn);  // in_proj_weight, in_proj_bias,
///                                      // out_proj.weight, out_proj.bias
torch::OrderedDict<std::string, torch::Tensor> state_dict(
    const torch::nn::Module& module);

/// Reads every tensor of a state-dict file, in file order (safetensors: by
/// data offset; PyTorch files: the dict's order). The format is chosen by
/// content: a zip archive ("PK") is a PyTorch file, a file whose ninth byte
/// opens the JSON header ('{') is safetensors. Tensors come back on the CPU,
/// contiguous, with the file's dtype (one of those listed at the top).
///
/// Throws c10::Error naming `path` when the file cannot be read, is neither
/// format (including the legacy non-zip torch.save format), is truncated or
/// inconsistent (header length past the end of the file, data offsets out of
/// range, overlapping, leaving holes or disagreeing with shape x dtype size,
/// a storage smaller than a tensor's size and stride need), uses an
/// unsupported dtype, or (PyTorch files) holds anything but a dict of string
/// keys and tensors: an unsupported pickle opcode or a global other than
/// collections.OrderedDict, torch._utils._rebuild_tensor_v2,
/// torch._utils._rebuild_parameter and torch.<Type>Storage (or
/// torch.cuda.<Type>Storage) is refused by name. Duplicate keys are an error.
torch::OrderedDict<std::string, torch::Tensor> read_state_dict(
    const std::string& path);

/// Writes `tensors` to `path`: safetensors when the path ends in
/// ".safetensors", otherwise a PyTorch zip file that Python's plain
/// `torch.load(path)` reads (also with weights_only=True) as a
/// collections.OrderedDict of CPU tensors, and that `read_state_dict` reads.
/// Tensors may live on any device and be non-contiguous; the file gets a
/// contiguous little-endian copy of each. The file is written next to `path`
/// under a temporary name and then renamed, so an existing file is replaced
/// only by a complete one.
///
/// Throws c10::Error naming `path` when a tensor is undefined, not strided
/// (sparse, quantized...), has an unsupported dtype, or the file cannot be
/// written.
void write_state_dict(
    const torch::OrderedDict<std::string, torch::Tensor>& tensors,
    const std::string& path);

/// Loads the state-dict file `path` into `module`: every parameter and buffer
/// of `module` (the keys of `mha::state_dict(module)`) gets the value stored
/// under its name, copied under torch::NoGradGuard into the existing tensor,
/// so the module keeps its dtypes (values are converted) and devices. The
/// format is chosen by content, as `read_state_dict` does: safetensors, or a
/// PyTorch zip file written by Python's `torch.save(model.state_dict(), path)`
/// (an OrderedDict) or `torch.save(dict(model.state_dict()), path)`, or by
/// `save_state_dict`.
///
/// The module is changed only when the whole file fits: shape mismatches
/// always, and with `strict` also missing keys (in the module, not in the
/// file) and unexpected keys (in the file, not in the module), raise one
/// c10::Error naming the file and listing every offending key, with both
/// shapes for a mismatch (`linear1.weight: file [8, 4], module [16, 4]`).
/// With `strict=false` missing and unexpected keys are returned instead
/// (missing tensors keep their values). Errors of `read_state_dict` pass
/// through.
///
/// Example:
///   # Python
///   torch.save(nn.MultiheadAttention(8, 2, batch_first=True).state_dict(),
///              "attn.pt")
///   // C++
///   mha::MultiHeadAttention attn(8, 2);
///   mha::load_state_dict(*attn, "attn.pt");
LoadResult load_state_dict(torch::nn::Module& module, const std::string& path,
                           bool strict = true);

/// Saves `mha::state_dict(module)` to `path`, as `write_state_dict` does:
/// safetensors when the path ends in ".safetensors", otherwise a PyTorch zip
/// file that Python's `torch.load(path)` reads (weights_only=True included)
/// as a collections.OrderedDict, ready for `model.load_state_dict(...)`.
///
/// Throws c10::Error naming `path` as `write_state_dict` does.
///
/// Example:
///   mha::save_state_dict(*attn, "attn.safetensors");
void save_state_dict(const torch::nn::Module& module, const std::string& path);

}  // namespace mha

// Attention masks: the causal masks (bool, and Python nn.Transformer's float
// one), explicit conversion of "1 = keep" masks, and the single point where
// boolean and additive masks are merged.
//
// Mask conventions (the same at every mha entry point):
//   * bool mask: `true` marks a position that may NOT be attended to.
//   * floating mask: added to the attention scores (0 = allowed,
//     -inf = blocked, any other value biases the score).
//   * integer masks are rejected, never guessed.
//
// WARNING: torch's own `at::scaled_dot_product_attention` uses the opposite
// bool convention (true = takes part). Every mha function and module uses
// true = blocked, as torch::nn::MultiheadAttention's key_padding_mask and
// Python's nn.MultiheadAttention attn_mask do. Convert a tutorial-style
// "1 = keep" mask with `from_keep_mask`.
//
// Example, causal_mask(3, 4) (x = blocked, . = allowed):
//          key j: 0 1 2 3
//   query i = 0:  . x x x
//   query i = 1:  . . x x
//   query i = 2:  . . . x
//
// Semantics: PyTorch documentation of torch.nn.MultiheadAttention and
// torch.nn.functional.scaled_dot_product_attention.
#pragma once

#include <torch/torch.h>

#include <string>

namespace mha {

/// Causal (look-ahead) mask: bool (L, S), `true` where key j > query i, i.e.
/// `triu(ones(L, S), 1)`. Alignment is top-left for L != S.
///
/// Args:
///   L: target (query) length, >= 0.
///   S: source (key) length, >= 0.
///   options: only the device is used; the dtype is always bool.
/// Throws c10::Error when L or S is negative.
torch::Tensor causal_mask(int64_t L, int64_t S,
                          torch::TensorOptions options = {});

/// The float causal mask of Python's nn.Transformer: (L, L), -inf above the
/// diagonal (key j > query i) and 0 elsewhere, an additive mask for
/// tgt_mask / src_mask / attn_mask. Python's
/// `nn.Transformer.generate_square_subsequent_mask(sz, device, dtype)`
/// (LibTorch has it as the static TransformerImpl member).
///
/// Example, generate_square_subsequent_mask(3):
///   0 -inf -inf
///   0    0 -inf
///   0    0    0
///
/// Args:
///   L: the sequence length, >= 0.
///   options: device and dtype; the dtype must be floating (default: the
///     default dtype, float32 unless changed, as Python's).
/// Throws c10::Error when L is negative or the dtype is not floating.
torch::Tensor generate_square_subsequent_mask(
    int64_t L, torch::TensorOptions options = {});

/// Converts a "1 = keep, 0 = blocked" mask (bool, integer or floating, any
/// shape) into an mha bool mask where `true` = blocked: `keep == 0`.
/// Throws c10::Error when a non-bool mask holds values other than 0 and 1.
///
/// Example: from_keep_mask(torch::tensor({1, 1, 0})) -> {false, false, true}.
torch::Tensor from_keep_mask(const torch::Tensor& keep);

/// Checks that `mask` is a usable attention mask: bool, or floating with the
/// dtype `dtype` of the scores it is added to, on `device`. `name` is the
/// argument's name for the error message. Undefined masks pass.
/// Throws c10::Error otherwise (integer masks, dtype or device mismatch).
void check_mask(const torch::Tensor& mask, const std::string& name,
                torch::ScalarType dtype, const torch::Device& device);

/// Merges masks into one additive mask of dtype `dtype`: bool masks become
/// 0 / -inf, floating masks are added as they are, and the parts broadcast
/// together (so a blocked position stays blocked: -inf + x = -inf).
/// Undefined parts are skipped; returns an undefined tensor when every part is
/// undefined. Callers check the shapes first: this function broadcasts.
torch::Tensor merge_masks(torch::ArrayRef<torch::Tensor> masks,
                          torch::ScalarType dtype);

}  // namespace mha

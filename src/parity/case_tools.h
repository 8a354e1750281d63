// Internal to mha::parity: what run_case.cpp (attention cases) and
// run_layer_case.cpp (encoder and decoder layer and Transformer cases) share:
// the case's masks and layouts, the reference runs and the judgement
// (mha/parity.h).
//
// Glossary: N batch, L target length, S source length, E embed_dim,
// H num_heads.
#pragma once

#include <torch/torch.h>

#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "mha/parity.h"

namespace mha::parity::detail {

constexpr double kInf = std::numeric_limits<double>::infinity();

/// Named tensors compared part by part, in one order for every run.
using Parts = std::vector<std::pair<std::string, torch::Tensor>>;

/// Random canonical masks for a case into `in` (key_padding_mask (N, S),
/// attn_mask (L, S) or (N*H, L, S), is_causal); float masks hold finite
/// biases and -inf at the blocked positions.
void make_masks(const Case& c, int64_t N, int64_t H, int64_t L, int64_t S,
                torch::ScalarType dtype, const torch::Device& device,
                Inputs& in);

/// True when some query row has every key blocked.
bool has_fully_masked_row(const Case& c, const Inputs& in, int64_t N, int64_t H,
                          int64_t L, int64_t S);

/// A canonical (N, T, F) tensor in the layout the case feeds mha, and back.
torch::Tensor to_case_layout(const Case& c, const torch::Tensor& x);
torch::Tensor from_case_layout(const Case& c, const torch::Tensor& x);

/// Known reasons why torch::nn cannot be the reference for the case ("" if
/// none).
std::string reference_difference(const Case& c, int64_t kdim, int64_t vdim,
                                 bool fully_masked, bool padding);

/// t detached, converted to dtype, copied, requiring grad.
torch::Tensor leaf(const torch::Tensor& t, torch::ScalarType dtype);

/// `mask` (float (L, S) or undefined) plus a float causal mask, -inf above
/// the diagonal: how torch::nn, which has no is_causal, is given one.
torch::Tensor plus_float_causal(const torch::Tensor& mask, int64_t L, int64_t S,
                                const torch::TensorOptions& on);

/// bfloat16 or float16.
bool is_half(torch::ScalarType dtype);

/// Runs torch::nn through `run`; if it throws, keeps the first line of the
/// message (at most 60 characters) in `threw` and marks torch::nn as used
/// and not within tolerance.
template <typename Run>
Parts run_reference(Run&& run, std::string& threw, CaseResult& result) {
  try {
    return run();
  } catch (const c10::Error& e) {
    threw = e.what_without_backtrace();
    threw = threw.substr(0, std::min<size_t>(threw.find('\n'), 60));
    result.torch_nn.used = true;
    result.torch_nn.within = false;
    return {};
  }
}

/// Compares mha's tensors with both references' and sets result's status.
/// `half_parts`: the float64 reference's computation run in the case's half
/// dtype (same parts), or empty: the half rule's base, with torch::nn's
/// where that is valid (the larger of the two errors).
void judge(const Case& c, const Parts& mine_parts, const Parts& f64_parts,
           const Parts& nn_parts, const std::string& ref_diff,
           const std::string& nn_threw, CaseResult& result,
           const Parts& half_parts = {});

/// run_case for an encoder-layer case (Case::encoder_layer).
CaseResult run_encoder_case(const Case& c, const torch::Device& device,
                            uint64_t seed);

/// run_case for a decoder-layer case (Case::decoder_layer).
CaseResult run_decoder_case(const Case& c, const torch::Device& device,
                            uint64_t seed);

/// run_case for a Transformer case (Case::transformer).
CaseResult run_transformer_case(const Case& c, const torch::Device& device,
                                uint64_t seed);

}  // namespace mha::parity::detail

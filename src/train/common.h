// Internal helpers shared by the training sources (src/train/*.cpp):
// formatting, hashing and seed mixing, small tensors, and the few functions
// that two concepts share. Not installed; namespace mha::train::detail.
//
// Glossary: N batch, L sequence length, C classes.
#pragma once

#include <torch/torch.h>

#include <algorithm>
#include <array>
#include <charconv>
#include <cstdint>
#include <cstdio>
#include <random>
#include <string>
#include <system_error>
#include <utility>
#include <vector>

#include "mha/train/report.h"

namespace mha::train::detail {

/// printf-style formatting into a std::string (the library does not link
/// fmt).
template <class... Args>
std::string printf_string(const char* format, Args... args) {
  const int size = std::snprintf(nullptr, 0, format, args...);
  std::string out(static_cast<size_t>(std::max(size, 0)), '\0');
  std::snprintf(out.data(), out.size() + 1, format, args...);
  return out;
}

/// The shortest decimal text that reads back as exactly `value`.
inline std::string exact_decimal(double value) {
  std::array<char, 32> buffer{};
  auto [end, error] =
      std::to_chars(buffer.data(), buffer.data() + buffer.size(), value);
  TORCH_INTERNAL_ASSERT(error == std::errc());
  return std::string(buffer.data(), end);
}

/// A CPU int64 tensor of `shape` holding `values`.
inline torch::Tensor int64_tensor(std::vector<int64_t> values,
                                  torch::IntArrayRef shape) {
  return torch::from_blob(values.data(), shape, torch::kInt64).clone();
}

/// FNV-1a hash of a text: identifies the training text in fingerprints.
inline uint64_t fnv1a(const std::string& text) {
  uint64_t hash = 0xcbf29ce484222325ULL;
  for (const unsigned char c : text) {
    hash = (hash ^ c) * 0x100000001b3ULL;
  }
  return hash;
}

/// SplitMix64's output function (Steele et al. 2014): mixes `x` so that
/// nearby inputs give unrelated outputs.
inline uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

/// An integer uniform in [0, n), n >= 1 (modulo bias < n / 2^64).
inline int64_t uniform_below(std::mt19937_64& rng, int64_t n) {
  return static_cast<int64_t>(rng() % static_cast<uint64_t>(n));
}

/// The summed cross-entropy over targets other than kIgnoreIndex, and how
/// many there are. logits (N, L, C), target (N, L) int64.
/// (src/train/models.cpp)
std::pair<torch::Tensor, torch::Tensor> masked_cross_entropy_sum(
    const torch::Tensor& logits, const torch::Tensor& target);

/// The loss history as a (steps, 6) float64 table, one LossRecord a row, and
/// back: how checkpoints and the data-parallel resume carry it.
/// (src/train/checkpoint.cpp)
torch::Tensor history_to_tensor(const std::vector<LossRecord>& history);
std::vector<LossRecord> history_from_tensor(const torch::Tensor& tensor);

}  // namespace mha::train::detail

#include "mha/positions.h"

#include <cmath>
#include <string>
#include <vector>

namespace mha {
namespace {

/// `options` with float32 when it names no dtype.
torch::TensorOptions with_float_default(const torch::TensorOptions& options) {
  return options.has_dtype() ? options : options.dtype(torch::kFloat32);
}

}  // namespace

torch::Tensor rotary_embedding(const torch::Tensor& x, int64_t position_offset,
                               double theta, RotaryPairing pairing) {
  TORCH_CHECK(x.defined(), "rotary_embedding: x is undefined");
  TORCH_CHECK(x.dim() >= 2,
              "rotary_embedding: x must be (..., T, D) with at least 2 dims, "
              "but got ",
              x.sizes());
  const int64_t T = x.size(-2), D = x.size(-1);
  TORCH_CHECK(D % 2 == 0,
              "rotary_embedding: x's last dim D (features per head) must be "
              "even, but got ",
              x.sizes());
  TORCH_CHECK(torch::isFloatingType(x.scalar_type()),
              "rotary_embedding: x must be floating, but got dtype ",
              x.scalar_type());
  TORCH_CHECK(position_offset >= 0,
              "rotary_embedding: position_offset must be >= 0, but got ",
              position_offset);
  TORCH_CHECK(std::isfinite(theta) && theta > 0.0,
              "rotary_embedding: theta must be finite and > 0, but got ",
              theta);
  const auto f64 = torch::TensorOptions().dtype(torch::kFloat64);
  // w_i = theta^(-2i / D), i in [0, D/2); angles (T, D/2) = p · w_i.
  auto frequencies =
      torch::pow(theta, -torch::arange(0, D, 2, f64) / static_cast<double>(D));
  auto positions = torch::arange(position_offset, position_offset + T, f64);
  auto angles = torch::outer(positions, frequencies);  // (T, D/2)
  const auto options = x.options();
  auto cos = angles.cos().to(options);  // (T, D/2)
  auto sin = angles.sin().to(options);
  if (pairing == RotaryPairing::kHalf) {
    auto a = x.narrow(-1, 0, D / 2), b = x.narrow(-1, D / 2, D / 2);
    return torch::cat({a * cos - b * sin, a * sin + b * cos}, -1);
  }
  auto pairs = x.unflatten(-1, {D / 2, 2});  // (..., T, D/2, 2)
  auto a = pairs.select(-1, 0), b = pairs.select(-1, 1);
  return torch::stack({a * cos - b * sin, a * sin + b * cos}, -1).flatten(-2);
}

torch::Tensor alibi_slopes(int64_t num_heads, torch::TensorOptions options) {
  TORCH_CHECK(num_heads >= 1, "alibi_slopes: num_heads must be >= 1, but got ",
              num_heads);
  // The slopes of a power of two P heads: 2^(-8 (h + 1) / P).
  auto power_of_two_slopes = [](int64_t P) {
    std::vector<double> slopes;
    for (int64_t h = 0; h < P; ++h) {
      slopes.push_back(std::pow(
          2.0, -8.0 * static_cast<double>(h + 1) / static_cast<double>(P)));
    }
    return slopes;
  };
  int64_t P = 1;
  while (P * 2 <= num_heads) {
    P *= 2;
  }
  auto slopes = power_of_two_slopes(P);
  const auto extra = power_of_two_slopes(2 * P);
  for (size_t i = 0; static_cast<int64_t>(slopes.size()) < num_heads; i += 2) {
    slopes.push_back(extra[i]);
  }
  return torch::tensor(slopes, torch::kFloat64).to(with_float_default(options));
}

torch::Tensor alibi_bias(int64_t num_heads, int64_t L, int64_t S,
                         int64_t query_offset, torch::TensorOptions options) {
  TORCH_CHECK(L >= 0 && S >= 0,
              "alibi_bias: L and S must be >= 0, but got L=", L, ", S=", S);
  const auto f64 = torch::TensorOptions(options).dtype(torch::kFloat64);
  auto slopes = alibi_slopes(num_heads, f64);  // (H)
  auto i =
      torch::arange(L, f64).unsqueeze(1) + static_cast<double>(query_offset);
  auto j = torch::arange(S, f64).unsqueeze(0);
  auto distance = (i - j).abs();                // (L, S)
  return (-slopes.view({-1, 1, 1}) * distance)  // (H, L, S)
      .to(with_float_default(options));
}

torch::Tensor relative_position_bucket(const torch::Tensor& relative_position,
                                       bool bidirectional, int64_t num_buckets,
                                       int64_t max_distance) {
  TORCH_CHECK(relative_position.defined() &&
                  !torch::isFloatingType(relative_position.scalar_type()) &&
                  relative_position.scalar_type() != torch::kBool,
              "relative_position_bucket: relative_position must be an integer "
              "tensor, but got ",
              relative_position.defined()
                  ? std::string(c10::toString(relative_position.scalar_type()))
                  : std::string("an undefined tensor"));
  const int64_t n = bidirectional ? num_buckets / 2 : num_buckets;
  const int64_t max_exact = n / 2;
  TORCH_CHECK(max_exact >= 1,
              "relative_position_bucket: num_buckets must be >= ",
              bidirectional ? 4 : 2, bidirectional ? " (bidirectional)" : "",
              ", but got ", num_buckets);
  TORCH_CHECK(max_distance > max_exact,
              "relative_position_bucket: max_distance must exceed the exact "
              "buckets (",
              max_exact, "), but got ", max_distance);
  auto position = relative_position.to(torch::kLong);
  auto bucket = torch::zeros_like(position);
  torch::Tensor distance;
  if (bidirectional) {
    bucket = bucket + position.gt(0).to(torch::kLong) * n;
    distance = position.abs();
  } else {
    distance = -position.clamp_max(0);
  }
  // Logarithmic buckets, computed in float32 as T5 and Hugging Face do (so
  // that a distance on a bucket edge lands where theirs does).
  auto large =
      max_exact + (torch::log(distance.clamp_min(max_exact).to(torch::kFloat) /
                              static_cast<double>(max_exact)) /
                   std::log(static_cast<double>(max_distance) /
                            static_cast<double>(max_exact)) *
                   static_cast<double>(n - max_exact))
                      .to(torch::kLong);
  large = large.clamp_max(n - 1);
  return bucket + torch::where(distance.lt(max_exact), distance, large);
}

}  // namespace mha

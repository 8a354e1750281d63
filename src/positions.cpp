#include "mha/positions.h"

#include <cmath>

namespace mha {

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

}  // namespace mha

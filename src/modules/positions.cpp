// Position information for attention (mha/positions.h): rotary embedding
// with its frequency scalings, ALiBi, T5's relative buckets.
//
// Glossary: T positions (rows), D features per head, R rotated features
// (rotary_dim), N batch; w_i the inverse frequencies, i in [0, R/2).
#include "mha/positions.h"

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

namespace mha {
namespace {

constexpr double kPi = 3.14159265358979323846;

/// `options` with float32 when it names no dtype.
torch::TensorOptions with_float_default(const torch::TensorOptions& options) {
  return options.has_dtype() ? options : options.dtype(torch::kFloat32);
}

/// The unscaled inverse frequencies w_i = theta^(-2i / R), float64 (R/2).
torch::Tensor base_inv_freq(int64_t R, double theta) {
  const auto f64 = torch::TensorOptions().dtype(torch::kFloat64);
  return torch::pow(theta,
                    -torch::arange(0, R, 2, f64) / static_cast<double>(R));
}

/// x's feature pairs rotated by cos and sin (broadcastable to (..., T,
/// D/2)): (a cos - b sin, a sin + b cos) for each pair (a, b).
torch::Tensor rotate_pairs(const torch::Tensor& x, const torch::Tensor& cos,
                           const torch::Tensor& sin, RotaryPairing pairing) {
  const int64_t D = x.size(-1);
  if (pairing == RotaryPairing::kHalf) {
    auto a = x.narrow(-1, 0, D / 2), b = x.narrow(-1, D / 2, D / 2);
    return torch::cat({a * cos - b * sin, a * sin + b * cos}, -1);
  }
  auto pairs = x.unflatten(-1, {D / 2, 2});  // (..., T, D/2, 2)
  auto a = pairs.select(-1, 0), b = pairs.select(-1, 1);
  return torch::stack({a * cos - b * sin, a * sin + b * cos}, -1).flatten(-2);
}

/// O: original_max_position_embeddings, or M where it is 0.
int64_t original_length(const RotaryScaling& s) {
  return s.original_max_position_embeddings > 0
             ? s.original_max_position_embeddings
             : s.max_position_embeddings;
}

/// YaRN's attention scale of a context factor (HF: get_mscale).
double yarn_mscale(double factor, double mscale) {
  return factor <= 1.0 ? 1.0 : 0.1 * mscale * std::log(factor) + 1.0;
}

/// YaRN's inverse frequencies: w_i / factor (interpolation) and w_i
/// (extrapolation) blended by a ramp over i between the correction dims.
torch::Tensor yarn_inv_freq(const torch::Tensor& w, int64_t R, double theta,
                            const RotaryScaling& s) {
  const double beta_fast = s.beta_fast != 0.0 ? s.beta_fast : 32.0;
  const double beta_slow = s.beta_slow != 0.0 ? s.beta_slow : 1.0;
  const double O = static_cast<double>(original_length(s));
  // The feature index whose wavelength fits `rotations` times into O.
  auto correction_dim = [&](double rotations) {
    return static_cast<double>(R) * std::log(O / (rotations * 2.0 * kPi)) /
           (2.0 * std::log(theta));
  };
  double low = correction_dim(beta_fast), high = correction_dim(beta_slow);
  if (s.truncate) {
    low = std::floor(low);
    high = std::ceil(high);
  }
  low = std::max(low, 0.0);
  high = std::min(high, static_cast<double>(R - 1));
  if (low == high) {
    high += 0.001;  // as HF: no division by zero
  }
  auto ramp = ((torch::arange(R / 2, w.options()) - low) / (high - low))
                  .clamp(0.0, 1.0);  // (R/2): 0 extrapolate .. 1 interpolate
  return w / s.factor * ramp + w * (1.0 - ramp);
}

/// Llama 3.1's inverse frequencies: long wavelengths / factor, short ones
/// kept, a smooth blend between.
torch::Tensor llama3_inv_freq(const torch::Tensor& w, const RotaryScaling& s) {
  const double O = static_cast<double>(original_length(s));
  const double low_wavelength = O / s.low_freq_factor;
  const double high_wavelength = O / s.high_freq_factor;
  auto wavelength = 2.0 * kPi / w;  // (R/2)
  auto scaled = torch::where(wavelength > low_wavelength, w / s.factor, w);
  auto smooth = (O / wavelength - s.low_freq_factor) /
                (s.high_freq_factor - s.low_freq_factor);
  auto smoothed = (1.0 - smooth) * scaled / s.factor + smooth * scaled;
  auto medium =
      wavelength.ge(high_wavelength).logical_and(wavelength.le(low_wavelength));
  return torch::where(medium, smoothed, scaled);
}

}  // namespace

void check_rotary_scaling(const RotaryScaling& s, int64_t rotary_dim,
                          const char* who) {
  TORCH_CHECK(rotary_dim >= 2 && rotary_dim % 2 == 0, who,
              ": rotary_dim must be even and >= 2, but got ", rotary_dim);
  const auto& type = s.rope_type;
  TORCH_CHECK(type == "default" || type == "linear" || type == "dynamic" ||
                  type == "yarn" || type == "longrope" || type == "llama3",
              who,
              ": rotary_scaling.rope_type must be one of \"default\", "
              "\"linear\", \"dynamic\", \"yarn\", \"longrope\", "
              "\"llama3\", but got \"",
              type, "\"");
  if (type == "default") {
    return;
  }
  TORCH_CHECK(std::isfinite(s.factor) && s.factor > 0.0, who,
              ": rotary_scaling.factor must be finite and > 0 for rope_type "
              "\"",
              type, "\", but got ", s.factor);
  TORCH_CHECK(
      s.original_max_position_embeddings >= 0 && s.max_position_embeddings >= 0,
      who,
      ": rotary_scaling.original_max_position_embeddings and "
      "max_position_embeddings must be >= 0, but got ",
      s.original_max_position_embeddings, " and ", s.max_position_embeddings);
  TORCH_CHECK(
      !s.attention_factor.has_value() ||
          ((type == "yarn" || type == "longrope") &&
           std::isfinite(*s.attention_factor) && *s.attention_factor > 0.0),
      who,
      ": rotary_scaling.attention_factor must be finite and > 0, "
      "and is read by rope_type \"yarn\" and \"longrope\" only, but "
      "got ",
      s.attention_factor.value_or(0.0), " with rope_type \"", type, "\"");
  if (type == "dynamic") {
    TORCH_CHECK(original_length(s) > 0 || s.max_position_embeddings > 0, who,
                ": rotary_scaling of rope_type \"dynamic\" needs "
                "max_position_embeddings (or original_max_position_embeddings)"
                " > 0, but both are 0");
    TORCH_CHECK(rotary_dim > 2, who,
                ": rope_type \"dynamic\" needs rotary_dim > 2 (its exponent "
                "is R / (R - 2)), but got ",
                rotary_dim);
  }
  if (type == "yarn" || type == "longrope" || type == "llama3") {
    TORCH_CHECK(original_length(s) > 0, who, ": rotary_scaling of rope_type \"",
                type,
                "\" needs original_max_position_embeddings or "
                "max_position_embeddings > 0, but both are 0");
  }
  if (type == "yarn") {
    TORCH_CHECK(std::isfinite(s.beta_fast) && std::isfinite(s.beta_slow) &&
                    s.beta_fast >= 0.0 && s.beta_slow >= 0.0,
                who,
                ": rotary_scaling.beta_fast and beta_slow must be finite and "
                ">= 0, but got ",
                s.beta_fast, " and ", s.beta_slow);
    TORCH_CHECK(std::isfinite(s.mscale.value_or(0.0)) &&
                    std::isfinite(s.mscale_all_dim.value_or(0.0)),
                who,
                ": rotary_scaling.mscale and mscale_all_dim must be finite");
  }
  if (type == "longrope") {
    const auto half = static_cast<size_t>(rotary_dim / 2);
    TORCH_CHECK(s.short_factor.size() == half && s.long_factor.size() == half,
                who,
                ": rotary_scaling.short_factor and long_factor must have "
                "rotary_dim / 2 = ",
                half, " entries, but have ", s.short_factor.size(), " and ",
                s.long_factor.size());
    for (const auto* factors : {&s.short_factor, &s.long_factor}) {
      for (double f : *factors) {
        TORCH_CHECK(std::isfinite(f) && f > 0.0, who,
                    ": rotary_scaling.short_factor and long_factor entries "
                    "must be finite and > 0, but one is ",
                    f);
      }
    }
  }
  if (type == "llama3") {
    TORCH_CHECK(s.low_freq_factor > 0.0 &&
                    s.high_freq_factor > s.low_freq_factor &&
                    std::isfinite(s.high_freq_factor),
                who,
                ": rotary_scaling needs 0 < low_freq_factor < "
                "high_freq_factor (finite) for rope_type \"llama3\", but got "
                "low_freq_factor=",
                s.low_freq_factor, ", high_freq_factor=", s.high_freq_factor);
  }
}

RotaryFrequencies rotary_frequencies(int64_t rotary_dim, double theta,
                                     const RotaryScaling& s, int64_t seq_len) {
  check_rotary_scaling(s, rotary_dim, "rotary_frequencies");
  TORCH_CHECK(std::isfinite(theta) && theta > 0.0,
              "rotary_frequencies: theta must be finite and > 0, but got ",
              theta);
  const int64_t R = rotary_dim;
  auto w = base_inv_freq(R, theta);  // (R/2)
  const auto& type = s.rope_type;
  if (type == "linear") {
    return {w / s.factor, 1.0};
  }
  if (type == "dynamic") {
    // HF: seq_len = max(seq_len, M); the base grows only beyond M.
    const int64_t M = s.max_position_embeddings > 0 ? s.max_position_embeddings
                                                    : original_length(s);
    if (seq_len <= M) {
      return {w, 1.0};
    }
    const double grown =
        s.factor * static_cast<double>(seq_len) / static_cast<double>(M) -
        (s.factor - 1.0);
    const double base =
        theta * std::pow(grown, static_cast<double>(R) / (R - 2.0));
    return {base_inv_freq(R, base), 1.0};
  }
  if (type == "yarn") {
    double factor = 1.0;
    if (s.attention_factor.has_value()) {
      factor = *s.attention_factor;
    } else if (s.mscale.value_or(0.0) != 0.0 &&
               s.mscale_all_dim.value_or(0.0) != 0.0) {
      factor = yarn_mscale(s.factor, *s.mscale) /
               yarn_mscale(s.factor, *s.mscale_all_dim);
    } else {
      factor = yarn_mscale(s.factor, 1.0);
    }
    return {yarn_inv_freq(w, R, theta, s), factor};
  }
  if (type == "longrope") {
    const int64_t O = original_length(s);
    double factor = 1.0;
    if (s.attention_factor.has_value()) {
      factor = *s.attention_factor;
    } else if (s.factor > 1.0) {
      factor = std::sqrt(1.0 +
                         std::log(s.factor) / std::log(static_cast<double>(O)));
    }
    const auto& ext = seq_len > O ? s.long_factor : s.short_factor;
    return {w / torch::tensor(ext, w.options()), factor};
  }
  if (type == "llama3") {
    return {llama3_inv_freq(w, s), 1.0};
  }
  return {w, 1.0};  // "default"
}

torch::Tensor rotary_embedding_at(const torch::Tensor& x,
                                  const torch::Tensor& positions, double theta,
                                  RotaryPairing pairing,
                                  c10::optional<int64_t> rotary_dim,
                                  const RotaryScaling& scaling) {
  TORCH_CHECK(x.defined() && x.dim() >= 2,
              "rotary_embedding_at: x must be (..., T, D) with at least 2 "
              "dims, but got ",
              x.defined() ? x.sizes() : torch::IntArrayRef{});
  TORCH_CHECK(torch::isFloatingType(x.scalar_type()),
              "rotary_embedding_at: x must be floating, but got dtype ",
              x.scalar_type());
  const int64_t T = x.size(-2), D = x.size(-1);
  const int64_t R = rotary_dim.value_or(D);
  TORCH_CHECK(R >= 2 && R % 2 == 0 && R <= D,
              "rotary_embedding_at: rotary_dim must be even with 2 <= "
              "rotary_dim <= D = ",
              D, ", but got ", R);
  TORCH_CHECK(positions.defined() && positions.scalar_type() == torch::kLong,
              "rotary_embedding_at: positions must be int64, but got ",
              positions.defined()
                  ? std::string(c10::toString(positions.scalar_type()))
                  : std::string("an undefined tensor"));
  const bool per_row = positions.dim() == 2;
  TORCH_CHECK((positions.dim() == 1 && positions.size(0) == T) ||
                  (per_row && x.dim() >= 3 && positions.size(0) == x.size(0) &&
                   positions.size(1) == T),
              "rotary_embedding_at: positions must be (T) = (", T,
              ") or (N, T) = (", x.dim() >= 3 ? x.size(0) : 1, ", ", T,
              ") for x ", x.sizes(), ", but got ", positions.sizes());
  TORCH_CHECK(positions.device() == x.device(),
              "rotary_embedding_at: positions must be on x's device ",
              x.device(), ", but got ", positions.device());
  int64_t seq_len = 0;
  const auto& type = scaling.rope_type;
  if ((type == "dynamic" || type == "longrope") && positions.numel() > 0) {
    // HF: 1 + the largest position of the call, over the whole batch.
    seq_len = positions.max().item<int64_t>() + 1;
  }
  const auto freq = rotary_frequencies(R, theta, scaling, seq_len);
  auto angles = positions.to(torch::kFloat64).unsqueeze(-1) *
                freq.inv_freq.to(x.device());  // (T, R/2) or (N, T, R/2)
  auto cos = angles.cos(), sin = angles.sin();
  if (freq.attention_factor != 1.0) {
    cos = cos * freq.attention_factor;
    sin = sin * freq.attention_factor;
  }
  if (per_row) {
    // (N, T, R/2) → (N, 1, ..., 1, T, R/2), broadcasting over x's middle dims.
    std::vector<int64_t> shape(static_cast<size_t>(x.dim()), 1);
    shape.front() = x.size(0);
    shape[shape.size() - 2] = T;
    shape.back() = R / 2;
    cos = cos.reshape(shape);
    sin = sin.reshape(shape);
  }
  cos = cos.to(x.options());
  sin = sin.to(x.options());
  if (R == D) {
    return rotate_pairs(x, cos, sin, pairing);
  }
  return torch::cat({rotate_pairs(x.narrow(-1, 0, R), cos, sin, pairing),
                     x.narrow(-1, R, D - R)},
                    -1);
}

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
  auto frequencies = base_inv_freq(D, theta);
  auto positions = torch::arange(position_offset, position_offset + T, f64);
  auto angles = torch::outer(positions, frequencies);  // (T, D/2)
  const auto options = x.options();
  auto cos = angles.cos().to(options);  // (T, D/2)
  auto sin = angles.sin().to(options);
  return rotate_pairs(x, cos, sin, pairing);
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

// The vocabulary of bench.h: shapes ("N,L,E,H"), the modes a row measures,
// the dense FLOP count of a repetition, the statistics of timing samples and
// the names of the memory methods. The measuring itself is in bench.cpp.
//
// Glossary: N batch, L sequence length (S = L), E embed_dim, H num_heads,
// F dim_feedforward.
#include <algorithm>
#include <cmath>
#include <sstream>

#include "bench/bench.h"

namespace mha::bench {

namespace {

struct ModeEntry {
  Mode mode;
  const char* name;
  const char* description;
};

const ModeEntry kModes[] = {
    {Mode::kForward, "fwd", "forward, need_weights=false, autograd on"},
    {Mode::kForwardWeights, "fwd-weights",
     "forward, need_weights=true (averaged over heads), autograd on"},
    {Mode::kCausal, "causal",
     "forward, need_weights=false; mha is_causal=true without a mask, "
     "torch::nn a float (L, L) -inf mask"},
    {Mode::kForwardBackward, "fwd-bwd",
     "forward+backward of sum(out * fixed random), need_weights=false; grads "
     "of input and parameters"},
    {Mode::kInference, "inference",
     "forward under NoGradGuard, need_weights=false"},
    {Mode::kEncoder, "encoder",
     "TransformerEncoderLayer (F=4E, relu, post-norm, seq-first) forward "
     "under NoGradGuard"},
};

const ModeEntry& entry(Mode mode) {
  for (const auto& e : kModes) {
    if (e.mode == mode) {
      return e;
    }
  }
  TORCH_INTERNAL_ASSERT(false, "unknown mode");
}

}  // namespace

std::optional<Shape> parse_shape(const std::string& text, std::string& error) {
  std::vector<int64_t> values;
  std::stringstream stream(text);
  std::string item;
  while (std::getline(stream, item, ',')) {
    try {
      size_t used = 0;
      const long long v = std::stoll(item, &used);
      if (used != item.size() || v <= 0) {
        throw std::invalid_argument(item);
      }
      values.push_back(v);
    } catch (const std::exception&) {
      error = "--config " + text +
              ": expected four positive integers N,L,E,H, got '" + item + "'";
      return std::nullopt;
    }
  }
  if (values.size() != 4) {
    error = "--config " + text + ": expected four values N,L,E,H, got " +
            std::to_string(values.size());
    return std::nullopt;
  }
  Shape s{values[0], values[1], values[2], values[3]};
  if (s.embed_dim % s.num_heads != 0) {
    error = "--config " + text + ": E = " + std::to_string(s.embed_dim) +
            " must be divisible by H = " + std::to_string(s.num_heads);
    return std::nullopt;
  }
  return s;
}

std::string to_string(const Shape& s) {
  return "(" + std::to_string(s.batch) + "," + std::to_string(s.length) + "," +
         std::to_string(s.embed_dim) + "," + std::to_string(s.num_heads) + ")";
}

const std::vector<Mode>& all_modes() {
  static const std::vector<Mode> modes = [] {
    std::vector<Mode> m;
    for (const auto& e : kModes) {
      m.push_back(e.mode);
    }
    return m;
  }();
  return modes;
}

const char* name(Mode mode) { return entry(mode).name; }

const char* description(Mode mode) { return entry(mode).description; }

std::optional<Mode> parse_mode(const std::string& text) {
  for (const auto& e : kModes) {
    if (text == e.name) {
      return e.mode;
    }
  }
  return std::nullopt;
}

double dense_flops(const Shape& s, Mode mode) {
  const double N = static_cast<double>(s.batch);
  const double L = static_cast<double>(s.length);
  const double S = L;  // self-attention
  const double E = static_cast<double>(s.embed_dim);
  const double projections = 8 * N * L * E * E;  // Q, K, V, out
  const double attention = 4 * N * L * S * E;    // Q·Kᵀ and A·V
  double forward = projections + attention;
  if (mode == Mode::kEncoder) {
    const double F = 4 * E;
    forward += 4 * N * L * E * F;  // linear1 and linear2
  }
  return mode == Mode::kForwardBackward ? 3 * forward : forward;
}

Stats summarize(std::vector<double> samples) {
  TORCH_INTERNAL_ASSERT(!samples.empty(), "summarize: no samples");
  Stats s;
  s.samples = samples;
  std::sort(samples.begin(), samples.end());
  auto quantile = [&](double q) {
    const double pos = q * static_cast<double>(samples.size() - 1);
    const auto lo = static_cast<size_t>(std::floor(pos));
    const auto hi = std::min(lo + 1, samples.size() - 1);
    return samples[lo] +
           (pos - static_cast<double>(lo)) * (samples[hi] - samples[lo]);
  };
  s.min = samples.front();
  s.max = samples.back();
  s.median = quantile(0.5);
  s.q1 = quantile(0.25);
  s.q3 = quantile(0.75);
  return s;
}

const char* name(MemoryMethod method) {
  switch (method) {
    case MemoryMethod::kClearRefs:
      return "clear_refs";
    case MemoryMethod::kFork:
      return "fork";
    case MemoryMethod::kNone:
      return "none";
  }
  return "?";
}

}  // namespace mha::bench

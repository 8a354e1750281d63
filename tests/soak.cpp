// A soak run (issue 22, item 7; scripts/soak.sh, not a CTest test): many
// forward calls of varied shapes in one process, printing the resident set
// size (RSS) at intervals so that a leak shows as a rising column.
//
// Glossary: N batch, L sequence length, E embed_dim.
#include <torch/torch.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>

#include "mha/multi_head_attention.h"

namespace {

/// VmRSS of this process in KiB (from /proc/self/status), or -1.
long rss_kib() {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line)) {
    if (line.rfind("VmRSS:", 0) == 0) {
      return std::strtol(line.c_str() + 6, nullptr, 10);
    }
  }
  return -1;
}

}  // namespace

int main(int argc, char** argv) {
  const long calls = argc > 1 ? std::strtol(argv[1], nullptr, 10) : 100000;
  const long every = argc > 2 ? std::strtol(argv[2], nullptr, 10) : 10000;
  torch::manual_seed(0);
  constexpr int64_t E = 64;
  mha::MultiHeadAttention self_attn(mha::MultiHeadAttentionOptions(E, 4));
  mha::MultiHeadAttention windowed(
      mha::MultiHeadAttentionOptions(E, 4).window(8).position_bias(
          mha::PositionBias::kAlibi));
  self_attn->eval();
  windowed->eval();
  torch::NoGradGuard no_grad;
  const auto start = std::chrono::steady_clock::now();
  std::printf("%10s %10s %10s\n", "calls", "rss_kib", "seconds");
  double checksum = 0.0;
  for (long i = 1; i <= calls; ++i) {
    // Shapes and options vary with i: N 1..4, L 1..97, weights on/off,
    // causal on/off, a key padding mask every third call, two modules.
    const int64_t N = 1 + i % 4, L = 1 + (i * 7) % 97;
    const bool need_weights = i % 2 == 0, causal = i % 5 < 2;
    auto x = torch::randn({N, L, E});
    torch::Tensor padding;
    if (i % 3 == 0) {
      padding = torch::rand({N, L}).gt(0.8);
    }
    auto& m = i % 7 == 0 ? windowed : self_attn;
    auto [out, w] =
        m->forward(x, {}, {}, padding, need_weights, {}, true, causal);
    checksum += out.sum().item<double>() * 1e-9;
    if (i % every == 0 || i == 1) {
      const double seconds = std::chrono::duration<double>(
                                 std::chrono::steady_clock::now() - start)
                                 .count();
      std::printf("%10ld %10ld %10.1f\n", i, rss_kib(), seconds);
      std::fflush(stdout);
    }
  }
  std::printf("checksum %.6f\n", checksum);
  return 0;
}

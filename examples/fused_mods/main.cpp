// Example: Gemma 2's soft-capping and a causal mask as fused mods (generic
// lambdas that mha compiles into its tile loop, flex_attention.h), checked
// against the same mods written eagerly with ATen ops (forward and the
// gradient of the query), and timed beside them and beside the causal call
// without a score mod, in this program's own build (the flags a user has).
//
// Usage: fused_mods [L]   (default 4096; (1, 8, L, 64) float32)
// Exits 1 when a check fails.
//
// Glossary: B batch, H heads, L sequence length, E features.
#include <mha/mha.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <iostream>
#include <string>
#include <vector>

namespace {

int failures = 0;

void check(bool ok, const std::string& what) {
  std::cout << (ok ? "ok:     " : "FAILED: ") << what << '\n';
  failures += ok ? 0 : 1;
}

/// Median milliseconds of `runs` calls of f (after one untimed call).
template <class F>
double median_ms(F f, int runs) {
  f();
  std::vector<double> ms;
  for (int i = 0; i < runs; ++i) {
    const auto start = std::chrono::steady_clock::now();
    f();
    ms.push_back(std::chrono::duration<double, std::milli>(
                     std::chrono::steady_clock::now() - start)
                     .count());
  }
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  const int64_t L = argc > 1 ? std::atoll(argv[1]) : 4096;
  torch::manual_seed(0);
  const auto q = torch::randn({1, 8, L, 64});  // (B, H, L, E)
  const auto k = torch::randn({1, 8, L, 64});
  const auto v = torch::randn({1, 8, L, 64});

  // Written once: the CPU core runs these on each run of scores in its tile
  // loop, compiled here (the compiler vectorises the loop); backward gets
  // the derivative from dual numbers.
  const auto softcap = mha::fused_score_mod([](auto s, auto, auto, auto, auto) {
    return 30 * mha::fused::tanh(s / 30);
  });
  const auto causal = mha::create_block_mask(
      mha::fused_mask_mod(
          [](auto, auto, auto q_idx, auto kv_idx) { return q_idx >= kv_idx; }),
      c10::nullopt, c10::nullopt, L, L);

  // The same, eagerly (a pass of ATen ops over each tile).
  const mha::ScoreMod eager_softcap =
      [](const torch::Tensor& s, const torch::Tensor&, const torch::Tensor&,
         const torch::Tensor&,
         const torch::Tensor&) { return 30.0 * torch::tanh(s / 30.0); };
  const auto eager_causal = mha::create_block_mask(
      [](const torch::Tensor&, const torch::Tensor&, const torch::Tensor& q_idx,
         const torch::Tensor& kv_idx) { return q_idx >= kv_idx; },
      c10::nullopt, c10::nullopt, L, L);

  auto forward = [&](const mha::ScoreMod& mod, const mha::BlockMask& mask) {
    torch::NoGradGuard no_grad;
    return std::get<0>(mha::flex_attention(q, k, v, mod, mask));
  };
  auto query_gradient = [&](const mha::ScoreMod& mod,
                            const mha::BlockMask& mask) {
    auto leaf = q.clone().requires_grad_();
    auto out = std::get<0>(mha::flex_attention(leaf, k, v, mod, mask));
    out.sum().backward();
    return leaf.grad();
  };
  const auto fused_out = forward(softcap, causal);
  const auto eager_out = forward(eager_softcap, eager_causal);
  check(torch::allclose(fused_out, eager_out, 1e-4, 1e-5),
        "fused soft-cap + causal equals the eager mods (forward)");
  check(
      torch::allclose(query_gradient(softcap, causal),
                      query_gradient(eager_softcap, eager_causal), 1e-4, 1e-5),
      "and the gradient of the query");

  const int runs = 5;
  const double fused_ms = median_ms([&] { forward(softcap, causal); }, runs);
  const double eager_ms =
      median_ms([&] { forward(eager_softcap, eager_causal); }, runs);
  const double causal_ms = median_ms([&] { forward({}, causal); }, runs);
  std::cout << "(1, 8, " << L << ", 64) float32 forward, median of " << runs
            << ": soft-cap + causal fused " << fused_ms << " ms, eager "
            << eager_ms << " ms; causal alone " << causal_ms
            << " ms (fused / causal " << fused_ms / causal_ms << ")\n";
  return failures == 0 ? 0 : 1;
}

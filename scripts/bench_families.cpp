// The measurements of issue 60's targets on this machine, not part of the
// build: scripts/bench-families.sh compiles this against build/libmha.a.
//
// 1. MLA decoding at a cache of 16384 tokens (DeepSeek-V3's head sizes, 16
//    heads, E 1024): one token's forward_cached by the naive and the
//    absorbed path, and the cache's bytes per token.
// 2. Gated DeltaNet (Qwen3-Next's sizes at E 1024: 8 key heads, 16 value
//    heads of 128): forward time at L = 8k .. 64k (inference), and one
//    decoding token after 1k and after 64k tokens.
// 3. With --versus-transformers: the 2025 families' attention at (1, 2048,
//    1024), forward and forward+backward, beside
//    scripts/bench_transformers_families.py (run both in one environment).
// Medians of the repetitions; 2 threads unless OMP_NUM_THREADS says.
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <string>
#include <vector>

#include "mha/gated_delta_net.h"
#include "mha/latent_attention.h"
#include "mha/multi_head_attention.h"

namespace {

template <typename F>
double median_ms(int reps, F&& f) {
  std::vector<double> t;
  for (int i = 0; i < reps; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    f();
    t.push_back(std::chrono::duration<double, std::milli>(
                    std::chrono::steady_clock::now() - t0)
                    .count());
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

}  // namespace

/// Forward (no autograd) and forward+backward of f at x (1, 2048, 1024),
/// the shapes of scripts/bench_transformers_families.py.
template <typename F>
void versus_transformers(const char* name, F&& f) {
  auto x = torch::randn({1, 2048, 1024});
  double fwd = 0;
  {
    torch::NoGradGuard no_grad;
    fwd = median_ms(3, [&] { f(x); });
  }
  const double both = median_ms(3, [&] {
    auto xg = x.clone().requires_grad_(true);
    f(xg).sum().backward();
  });
  std::printf("%s: forward %.0f ms, forward+backward %.0f ms\n", name, fwd,
              both);
}

int main(int argc, char** argv) {
  at::set_num_threads(std::max(2, at::get_num_threads()));
  torch::manual_seed(0);
  if (argc > 1 && std::string(argv[1]) == "--versus-transformers") {
    mha::MultiHeadAttention qwen3(mha::MultiHeadAttentionOptions(1024, 16)
                                      .num_kv_heads(8)
                                      .head_dim(128)
                                      .bias(false)
                                      .rotary(true)
                                      .qk_norm(mha::QKNorm::kPerHead));
    versus_transformers("mha Qwen3 attention", [&](const torch::Tensor& x) {
      return std::get<0>(qwen3->forward(x, {}, {}, {}, false, {}, true, true));
    });
    mha::MultiHeadAttention oss(mha::MultiHeadAttentionOptions(1024, 16)
                                    .num_kv_heads(8)
                                    .head_dim(64)
                                    .rotary(true)
                                    .attention_sinks(true));
    versus_transformers("mha gpt-oss attention", [&](const torch::Tensor& x) {
      return std::get<0>(oss->forward(x, {}, {}, {}, false, {}, true, true));
    });
    mha::MultiHeadAttention olmo2(mha::MultiHeadAttentionOptions(1024, 16)
                                      .num_kv_heads(8)
                                      .bias(false)
                                      .rotary(true)
                                      .qk_norm(mha::QKNorm::kFull));
    versus_transformers("mha OLMo 2 attention", [&](const torch::Tensor& x) {
      return std::get<0>(olmo2->forward(x, {}, {}, {}, false, {}, true, true));
    });
    mha::MultiHeadAttention gemma3(mha::MultiHeadAttentionOptions(1024, 8)
                                       .num_kv_heads(4)
                                       .head_dim(256)
                                       .bias(false)
                                       .rotary(true)
                                       .qk_norm(mha::QKNorm::kPerHead)
                                       .qk_norm_unit_offset(true));
    versus_transformers("mha Gemma 3 attention", [&](const torch::Tensor& x) {
      return std::get<0>(gemma3->forward(x, {}, {}, {}, false, {}, true, true));
    });
    mha::MultiHeadAttention llama4(
        mha::MultiHeadAttentionOptions(1024, 16)
            .num_kv_heads(8)
            .head_dim(64)
            .bias(false)
            .rotary(true)
            .rotary_pairing(mha::RotaryPairing::kInterleaved)
            .qk_norm(mha::QKNorm::kL2)
            .attention_chunk_size(8192));
    versus_transformers("mha Llama 4 attention", [&](const torch::Tensor& x) {
      return std::get<0>(llama4->forward(x, {}, {}, {}, false, {}, true, true));
    });
    mha::MultiHeadLatentAttention mla(
        mha::MultiHeadLatentAttentionOptions(1024, 16).q_lora_rank(384));
    versus_transformers(
        "mha MLA (DeepSeek-V3 sizes)",
        [&](const torch::Tensor& x) { return mla->forward(x); });
    mha::GatedDeltaNet gdn(mha::GatedDeltaNetOptions(1024)
                               .num_key_heads(8)
                               .num_value_heads(16)
                               .key_head_dim(128)
                               .value_head_dim(128));
    versus_transformers("mha GatedDeltaNet", [&](const torch::Tensor& x) {
      return gdn->forward(x);
    });
    return 0;
  }
  torch::NoGradGuard no_grad;
  {
    mha::MultiHeadLatentAttention m(
        mha::MultiHeadLatentAttentionOptions(1024, 16));
    const int64_t S = 16384;
    auto cache = m->make_cache(1, S + 8);
    // Fill the cache in chunks (the prompt), then time single tokens.
    for (int64_t t = 0; t < S; t += 1024) {
      m->forward_cached(torch::randn({1, 1024, 1024}), cache, true, {}, {},
                        mha::LatentPath::kNaive);
    }
    const int64_t P = cache.size();
    auto x = torch::randn({1, 1, 1024});
    auto step = [&](mha::LatentPath path) {
      return median_ms(9, [&] {
        auto c = cache;  // same P each time: the copy shares the buffers
        m->forward_cached(x, c, true, {}, {}, path);
      });
    };
    const double naive = step(mha::LatentPath::kNaive);
    const double absorbed = step(mha::LatentPath::kAbsorbed);
    std::printf(
        "MLA decode at cache %lld: naive %.2f ms, absorbed %.2f ms "
        "(absorbed/naive %.3f); auto picks %s; cache %lld numbers = %lld "
        "bytes per token (float32)\n",
        static_cast<long long>(P), naive, absorbed, absorbed / naive,
        m->auto_path(1, P + 1) == mha::LatentPath::kAbsorbed ? "absorbed"
                                                             : "naive",
        static_cast<long long>(cache.numbers_per_token()),
        static_cast<long long>(cache.numbers_per_token() * 4));
  }
  {
    mha::GatedDeltaNet m(mha::GatedDeltaNetOptions(1024)
                             .num_key_heads(8)
                             .num_value_heads(16)
                             .key_head_dim(128)
                             .value_head_dim(128));
    double first = 0;
    for (int64_t L : {8192, 16384, 32768, 65536}) {
      auto x = torch::randn({1, L, 1024});
      const double ms = median_ms(3, [&] { m->forward(x); });
      if (first == 0) {
        first = ms;
      }
      std::printf("GatedDeltaNet forward L=%lld: %.0f ms (x%.2f of 8k)\n",
                  static_cast<long long>(L), ms, ms / first);
    }
    for (int64_t P : {1024, 65536}) {
      auto state = m->make_state(1);
      m->forward_cached(torch::randn({1, P, 1024}), state);
      auto x = torch::randn({1, 1, 1024});
      const double ms = median_ms(21, [&] {
        auto s = state;
        s.conv = state.conv.clone();
        s.recurrent = state.recurrent.clone();
        m->forward_cached(x, s);
      });
      std::printf("GatedDeltaNet decode after %lld tokens: %.3f ms\n",
                  static_cast<long long>(P), ms);
    }
  }
}

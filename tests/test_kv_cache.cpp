// Tests of mha::KVCache and MultiHeadAttention::forward_cached: decoding
// step by step equals recomputing the whole sequence (the reference: the
// module's forward with is_causal over every token so far), with each
// position option, grouped heads and both layouts; gradients of the new
// tokens; and the errors.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <string>
#include <vector>

#include "mha/kv_cache.h"
#include "mha/multi_head_attention.h"
#include "test_helpers.h"

namespace {

class KVCacheTest : public SeededTest {};

struct Variant {
  std::string name;
  mha::MultiHeadAttentionOptions options;
};

std::vector<Variant> variants() {
  const int64_t E = 16, H = 4;
  auto base = mha::MultiHeadAttentionOptions(E, H);
  auto with_window = base;
  with_window.window(3);
  auto rotary = base;
  rotary.rotary(true);
  auto alibi = base;
  alibi.position_bias(mha::PositionBias::kAlibi);
  auto relative = base;
  relative.position_bias(mha::PositionBias::kRelative)
      .relative_bidirectional(false)
      .relative_num_buckets(8)
      .relative_max_distance(10);
  auto grouped = base;
  grouped.num_kv_heads(2).rotary(true).window(5);
  auto seq_first = base;
  seq_first.batch_first(false).rotary(true);
  return {{"plain", base},         {"window", with_window},
          {"rotary", rotary},      {"alibi", alibi},
          {"relative", relative},  {"grouped+rotary+window", grouped},
          {"seq_first", seq_first}};
}

// A 5-token prompt, single tokens, then a 3-token chunk, in float32 and
// float64, causal: every call's output and per-head weights equal the rows
// of forward(whole sequence so far, is_causal=true).
TEST_F(KVCacheTest, DecodingEqualsRecomputation) {
  const int64_t N = 2, E = 16;
  for (const auto& variant : variants()) {
    for (auto dtype : {torch::kFloat32, torch::kFloat64}) {
      SCOPED_TRACE(variant.name + ", " + c10::toString(dtype));
      mha::MultiHeadAttention m(variant.options);
      m->to(dtype);
      m->eval();
      torch::NoGradGuard no_grad;
      const bool batch_first = variant.options.batch_first();
      const int64_t total = 12;
      auto x = torch::randn({N, total, E}, dtype);  // batch-first tokens
      auto cache = m->make_kv_cache(N, 16);
      const double tol = dtype == torch::kFloat64 ? 1e-12 : 2e-5;
      int64_t done = 0;
      for (int64_t step : {5, 1, 1, 1, 1, 3}) {
        auto chunk = x.narrow(1, done, step);
        auto [out, w] = m->forward_cached(
            batch_first ? chunk : chunk.transpose(0, 1), cache,
            /*is_causal=*/true, /*need_weights=*/true,
            /*average_attn_weights=*/false);
        done += step;
        EXPECT_EQ(cache.size(), done);
        auto seq = x.narrow(1, 0, done);
        auto [full, full_w] =
            m->forward(batch_first ? seq : seq.transpose(0, 1), {}, {}, {},
                       true, {}, /*average_attn_weights=*/false,
                       /*is_causal=*/true);
        auto expected = batch_first ? full.narrow(1, done - step, step)
                                    : full.narrow(0, done - step, step);
        expect_close(out, expected, tol, tol,
                     "output after " + std::to_string(done));
        expect_close(w, full_w.narrow(2, done - step, step), tol, tol,
                     "weights after " + std::to_string(done));
      }
    }
  }
}

// Without is_causal a new token sees every new token of its call, too; and
// unbatched input works as N = 1.
TEST_F(KVCacheTest, NonCausalChunkAndUnbatched) {
  mha::MultiHeadAttention m(mha::MultiHeadAttentionOptions(8, 2).rotary(true));
  m->to(torch::kFloat64);
  torch::NoGradGuard no_grad;
  auto x = torch::randn({6, 8}, torch::kFloat64);  // unbatched (T, E)
  auto cache = m->make_kv_cache(1, 6);
  m->forward_cached(x.narrow(0, 0, 4), cache);
  auto [out, w] = m->forward_cached(x.narrow(0, 4, 2), cache,
                                    /*is_causal=*/false, /*need_weights=*/true);
  // Reference: the last two rows see all six keys; the first four only the
  // first four (causal among them, as the prompt call was).
  auto mask = torch::zeros({6, 6}, torch::kBool);
  mask.narrow(0, 0, 4).copy_(torch::ones({4, 6}, torch::kBool).triu(1));
  auto [full, full_w] = m->forward(x, {}, {}, {}, true, mask);
  expect_close(out, full.narrow(0, 4, 2), 1e-12, 1e-12, "output");
  expect_close(w, full_w.narrow(0, 4, 2), 1e-12, 1e-12, "weights");
}

// Under autograd, gradients reach the new tokens' input as in the full
// causal forward (whose earlier rows do not see the new tokens).
TEST_F(KVCacheTest, GradientOfNewTokensEqualsFullForward) {
  mha::MultiHeadAttention m(
      mha::MultiHeadAttentionOptions(16, 4).num_kv_heads(2).rotary(true));
  m->to(torch::kFloat64);
  auto x = torch::randn({2, 9, 16}, torch::kFloat64);
  auto g = torch::randn({2, 3, 16}, torch::kFloat64);
  auto cache = m->make_kv_cache(2, 9);
  {
    torch::NoGradGuard no_grad;
    m->forward_cached(x.narrow(1, 0, 6), cache);
  }
  auto new_tokens = x.narrow(1, 6, 3).clone().requires_grad_();
  auto out = std::get<0>(m->forward_cached(new_tokens, cache));
  (out * g).sum().backward();

  auto prefix = x.narrow(1, 0, 6);
  auto ref_tokens = x.narrow(1, 6, 3).clone().requires_grad_();
  auto full = std::get<0>(m->forward(torch::cat({prefix, ref_tokens}, 1), {},
                                     {}, {}, false, {}, true, true));
  (full.narrow(1, 6, 3) * g).sum().backward();
  expect_close(new_tokens.grad(), ref_tokens.grad(), 1e-12, 1e-12,
               "input grad");
}

TEST(KVCacheErrors, NameTheArgument) {
  mha::MultiHeadAttention m(mha::MultiHeadAttentionOptions(8, 2));
  auto cache = m->make_kv_cache(2, 4);
  EXPECT_EQ(cache.capacity(), 4);
  EXPECT_EQ(cache.head_dim(), 4);
  EXPECT_THROW_MSG(m->forward_cached(torch::randn({3, 1, 8}), cache),
                   "cache must hold (N, num_kv_heads, head_dim) = (3, 2, 4), "
                   "but holds (2, 2, 4)");
  EXPECT_THROW_MSG(m->forward_cached(torch::randn({2, 5, 8}), cache),
                   "cache has room for 4 more positions (capacity 4, 0 held), "
                   "but query has 5");
  EXPECT_THROW_MSG(
      m->forward_cached(torch::randn({2, 1, 8}, torch::kFloat64), cache),
      "parameters' dtype");
  auto wrong_dtype = mha::KVCache(2, 2, 4, 4, torch::kFloat64);
  EXPECT_THROW_MSG(m->forward_cached(torch::randn({2, 1, 8}), wrong_dtype),
                   "cache must have query's dtype");
  EXPECT_THROW_MSG(
      cache.append(torch::randn({2, 2, 1, 3}), torch::randn({2, 2, 1, 3})),
      "key and value must both be (N, Hkv, T, D) = (2, 2, T, 4)");
  EXPECT_THROW_MSG(mha::KVCache(0, 2, 4, 4), "batch_size, num_kv_heads");
  cache.append(torch::randn({2, 2, 3, 4}), torch::randn({2, 2, 3, 4}));
  EXPECT_THROW_MSG(
      cache.append(torch::randn({2, 2, 2, 4}), torch::randn({2, 2, 2, 4})),
      "2 positions do not fit: 3 of 4 are held");
  cache.clear();
  EXPECT_EQ(cache.size(), 0);
  EXPECT_THROW_MSG(mha::MultiHeadAttention(
                       mha::MultiHeadAttentionOptions(8, 2).add_bias_kv(true))
                       ->forward_cached(torch::randn({2, 1, 8}), cache),
                   "add_bias_kv and add_zero_attn are not supported");
}

}  // namespace

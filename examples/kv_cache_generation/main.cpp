// Example: greedy generation with a tiny causal language model (token
// embedding, one rotary self-attention block, output head) through a KV
// cache: the prompt is projected once, then each new token costs one
// query against the cached keys and values. Checked against generating
// without a cache (the whole sequence recomputed at every step): the same
// tokens, and the same logits to float32 rounding.
//
// Usage: kv_cache_generation
// Exits 1 when a check fails.
//
// Glossary: N batch (1), T tokens, E embed_dim, V vocabulary size.
#include <mha/mha.h>

#include <iostream>
#include <string>
#include <vector>

namespace {

constexpr int64_t kVocab = 12, kEmbed = 32, kHeads = 4, kNew = 8;

struct TinyLmImpl : torch::nn::Module {
  TinyLmImpl()
      : embed(register_module("embed", torch::nn::Embedding(kVocab, kEmbed))),
        attn(register_module("attn",
                             mha::MultiHeadAttention(
                                 mha::MultiHeadAttentionOptions(kEmbed, kHeads)
                                     .rotary(true)))),  // positions by rotation
        head(register_module("head", torch::nn::Linear(kEmbed, kVocab))) {}

  // All tokens at once, causal: logits (N, T, V).
  torch::Tensor forward(const torch::Tensor& tokens) {
    const auto x = embed(tokens);  // (N, T, E)
    const auto a =
        std::get<0>(attn->forward(x, {}, {}, {}, /*need_weights=*/false, {},
                                  /*average_attn_weights=*/true,
                                  /*is_causal=*/true));  // (N, T, E)
    return head(x + a);                                  // (N, T, V)
  }

  // Only the new tokens; earlier ones come from the cache: (N, T_new, V).
  torch::Tensor forward_cached(const torch::Tensor& tokens,
                               mha::KVCache& cache) {
    const auto x = embed(tokens);                                // (N, T, E)
    const auto a = std::get<0>(attn->forward_cached(x, cache));  // (N, T, E)
    return head(x + a);                                          // (N, T, V)
  }

  torch::nn::Embedding embed;
  mha::MultiHeadAttention attn;
  torch::nn::Linear head;
};
TORCH_MODULE(TinyLm);

std::string text(const std::vector<int64_t>& tokens) {
  std::string s;
  for (auto t : tokens) s += std::to_string(t) + " ";
  return s;
}

}  // namespace

int main() {
  torch::manual_seed(0);
  TinyLm model;
  model->eval();
  torch::NoGradGuard no_grad;
  const std::vector<int64_t> prompt = {3, 1, 4, 1, 5};

  // Without a cache: the whole sequence at every step.
  std::vector<int64_t> plain = prompt;
  std::vector<torch::Tensor> plain_logits;
  for (int64_t step = 0; step < kNew; ++step) {
    const auto logits = model(torch::tensor(plain).unsqueeze(0))
                            .select(1, -1);  // (N, V), last position
    plain_logits.push_back(logits);
    plain.push_back(logits.argmax(-1).item<int64_t>());
  }

  // With the cache: the prompt once, then one token per step.
  auto cache = model->attn->make_kv_cache(
      /*batch_size=*/1,
      /*capacity=*/static_cast<int64_t>(prompt.size()) + kNew);
  std::vector<int64_t> cached = prompt;
  auto logits = model->forward_cached(torch::tensor(prompt).unsqueeze(0), cache)
                    .select(1, -1);  // (N, V)
  double max_err = 0;
  for (int64_t step = 0; step < kNew; ++step) {
    max_err = std::max(
        max_err, (logits - plain_logits[step]).abs().max().item<double>());
    cached.push_back(logits.argmax(-1).item<int64_t>());
    logits =
        model
            ->forward_cached(torch::tensor({cached.back()}).view({1, 1}), cache)
            .select(1, -1);  // (N, V)
  }

  std::cout << "prompt:              " << text(prompt) << '\n'
            << "generated, no cache: " << text(plain) << '\n'
            << "generated, KV cache: " << text(cached) << '\n'
            << "cache holds " << cache.size() << " of " << cache.capacity()
            << " positions; max abs logit difference " << max_err << '\n';
  const bool same_tokens = plain == cached;
  const bool same_logits = max_err < 1e-5;
  const bool full = cache.size() == static_cast<int64_t>(prompt.size()) + kNew;
  std::cout << (same_tokens ? "ok:     " : "FAILED: ")
            << "the cache generates the same tokens\n"
            << (same_logits ? "ok:     " : "FAILED: ")
            << "and the same logits at every step\n"
            << (full ? "ok:     " : "FAILED: ")
            << "the cache holds the prompt and every generated token\n";
  const bool ok = same_tokens && same_logits && full;
  std::cout << (ok ? "kv_cache_generation: all checks passed\n"
                   : "kv_cache_generation: a check failed\n");
  return ok ? 0 : 1;
}

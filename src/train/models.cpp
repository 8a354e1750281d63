// The toy models: DigitTransformer and masked_cross_entropy, and the
// character language model (GPTBlock, CharLM) with generate().
// Glossary: N batch, L sequence length (digit tasks), T context length (the
// character model), E model width, V vocabulary size, C classes.
#include "mha/train/models.h"

#include <ATen/CPUGeneratorImpl.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <utility>

#include "common.h"

namespace mha::train {

namespace F = torch::nn::functional;
using detail::masked_cross_entropy_sum;

// ------------------------------------------------------- digit model ---

DigitTransformerImpl::DigitTransformerImpl(
    const DigitTransformerOptions& options_)
    : options(options_) {
  reset();
}

void DigitTransformerImpl::reset() {
  const int64_t E = options.d_model();
  TORCH_CHECK(options.max_len() >= 1,
              "DigitTransformer: max_len must be >= 1, but got ",
              options.max_len());
  TORCH_CHECK(options.num_layers() >= 1,
              "DigitTransformer: num_layers must be >= 1, but got ",
              options.num_layers());
  tok_emb =
      register_module("tok_emb", torch::nn::Embedding(kDigitVocabSize, E));
  pos_emb =
      register_module("pos_emb", torch::nn::Embedding(options.max_len(), E));
  TransformerEncoderLayer layer(
      TransformerEncoderLayerOptions(E, options.nhead())
          .dim_feedforward(options.dim_feedforward())
          .dropout(options.dropout())
          .norm_first(true));
  const auto kind = options.attention_kind();
  if (kind != AttentionKind::kSoftmax) {
    // The layer's self-attention replaced before the encoder copies it
    // (the copies keep the replacement: Cloneable clones every child).
    auto attention =
        MultiHeadAttentionOptions(E, options.nhead()).attention_kind(kind);
    if (kind == AttentionKind::kLinformer) {
      attention.dropout(options.dropout())
          .projected_length(options.projected_length() > 0
                                ? options.projected_length()
                                : std::max<int64_t>(1, options.max_len() / 2))
          .max_length(options.max_len());
    }
    layer->self_attn =
        layer->replace_module("self_attn", MultiHeadAttention(attention));
  }
  encoder = register_module(
      "encoder",
      TransformerEncoder(
          TransformerEncoderOptions(layer, options.num_layers())
              .norm(torch::nn::AnyModule(LayerNorm(LayerNormOptions(E))))));
  head = register_module("head", torch::nn::Linear(E, kNumDigits));
}

torch::Tensor DigitTransformerImpl::forward(const torch::Tensor& input,
                                            const torch::Tensor& padding) {
  TORCH_CHECK(input.dim() == 2 && input.size(1) <= options.max_len(),
              "DigitTransformer: input must be (N, L) with L <= max_len = ",
              options.max_len(), ", but got ", input.sizes());
  const int64_t L = input.size(1);
  auto positions = torch::arange(L, input.options());  // (L)
  auto x = tok_emb(input) + pos_emb(positions);        // (N, L, E) + (L, E)
  x = encoder->forward(x, /*mask=*/{},
                       /*src_key_padding_mask=*/padding);  // (N, L, E)
  return head(x);                                          // (N, L, kNumDigits)
}

namespace detail {

/// The summed cross-entropy over targets other than kIgnoreIndex, and how
/// many there are. logits (N, L, C), target (N, L) int64.
std::pair<torch::Tensor, torch::Tensor> masked_cross_entropy_sum(
    const torch::Tensor& logits, const torch::Tensor& target) {
  TORCH_CHECK(logits.dim() == 3 && target.dim() == 2 &&
                  logits.size(0) == target.size(0) &&
                  logits.size(1) == target.size(1),
              "masked_cross_entropy: logits must be (N, L, C) and target "
              "(N, L), but got logits ",
              logits.sizes(), " and target ", target.sizes());
  const int64_t C = logits.size(2);
  auto flat_target = target.reshape({-1});  // (N*L)
  auto summed = F::cross_entropy(logits.reshape({-1, C}), flat_target,
                                 F::CrossEntropyFuncOptions()
                                     .ignore_index(kIgnoreIndex)
                                     .reduction(torch::kSum));  // ()
  return {summed, (flat_target != kIgnoreIndex).sum()};         // (), ()
}

}  // namespace detail

torch::Tensor masked_cross_entropy(const torch::Tensor& logits,
                                   const torch::Tensor& target) {
  auto [summed, real_tokens] = masked_cross_entropy_sum(logits, target);
  return summed / real_tokens.clamp_min(1);
}
// ----------------------------------------------- character language model ---

namespace {

void check_char_lm_options(const CharLMOptions& o) {
  TORCH_CHECK(o.vocab_size() >= 1, "CharLM: vocab_size must be >= 1, but got ",
              o.vocab_size());
  TORCH_CHECK(o.block_size() >= 1, "CharLM: block_size must be >= 1, but got ",
              o.block_size());
  TORCH_CHECK(o.n_layer() >= 1, "CharLM: n_layer must be >= 1, but got ",
              o.n_layer());
  TORCH_CHECK(o.n_head() >= 1 && o.n_embd() % o.n_head() == 0,
              "CharLM: n_head must divide n_embd, but got n_embd ", o.n_embd(),
              " and n_head ", o.n_head());
  TORCH_CHECK(o.dropout() >= 0.0 && o.dropout() < 1.0,
              "CharLM: dropout must be in [0, 1), but got ", o.dropout());
  TORCH_CHECK(o.attention_kind() != AttentionKind::kLinformer,
              "CharLM: attention_kind kLinformer cannot be causal (its "
              "projection along the sequence mixes later positions into "
              "earlier ones); use kSoftmax, kLinear or kPerformer");
}

}  // namespace

GPTBlockImpl::GPTBlockImpl(const CharLMOptions& options_) : options(options_) {
  reset();
}

void GPTBlockImpl::reset() {
  check_char_lm_options(options);
  const int64_t E = options.n_embd();
  ln_1 = register_module("ln_1", LayerNorm(LayerNormOptions(E)));
  // The linear kinds form no weights to drop, and have no window: they
  // attend to the whole prefix.
  const bool softmax = options.attention_kind() == AttentionKind::kSoftmax;
  auto attn_options = MultiHeadAttentionOptions(E, options.n_head())
                          .dropout(softmax ? options.dropout() : 0.0)
                          .attention_kind(options.attention_kind());
  if (options.rotary()) {
    attn_options.rotary(true);
    if (softmax) {
      attn_options.window(options.block_size());
    }
  }
  attn = register_module("attn", MultiHeadAttention(attn_options));
  ln_2 = register_module("ln_2", LayerNorm(LayerNormOptions(E)));
  c_fc = register_module("c_fc", torch::nn::Linear(E, 4 * E));
  c_proj = register_module("c_proj", torch::nn::Linear(4 * E, E));
  dropout = register_module("dropout", torch::nn::Dropout(options.dropout()));
}

torch::Tensor GPTBlockImpl::forward(const torch::Tensor& x,
                                    const torch::Tensor& positions,
                                    const BlockMask& block_mask,
                                    const torch::Tensor& key_padding_mask) {
  return std::get<0>(forward_impl(x, /*need_weights=*/false, positions,
                                  block_mask, key_padding_mask));
}

std::tuple<torch::Tensor, torch::Tensor> GPTBlockImpl::forward_with_weights(
    const torch::Tensor& x) {
  return forward_impl(x, /*need_weights=*/true);
}

std::tuple<torch::Tensor, torch::Tensor> GPTBlockImpl::forward_impl(
    const torch::Tensor& x, bool need_weights, const torch::Tensor& positions,
    const BlockMask& block_mask, const torch::Tensor& key_padding_mask) {
  auto [attended, weights] = attn->forward(
      ln_1(x), /*key=*/{}, /*value=*/{}, key_padding_mask, need_weights,
      /*attn_mask=*/{}, /*average_attn_weights=*/false,
      /*is_causal=*/true, positions,
      block_mask);  // (N, T, E), (N, H, T, T) or undefined
  return {residuals(x, attended), weights};
}

torch::Tensor GPTBlockImpl::forward_cached(const torch::Tensor& x,
                                           KVCache& cache) {
  return residuals(x, std::get<0>(attn->forward_cached(ln_1(x), cache)));
}

torch::Tensor GPTBlockImpl::residuals(const torch::Tensor& x,
                                      const torch::Tensor& attended) {
  auto h = x + dropout(attended);                 // (N, T, E)
  auto mlp = c_proj(torch::gelu(c_fc(ln_2(h))));  // (N,T,E)→(N,T,4E)→(N,T,E)
  return h + dropout(mlp);                        // (N, T, E)
}

CharLMImpl::CharLMImpl(const CharLMOptions& options_) : options(options_) {
  reset();
}

void CharLMImpl::reset() {
  check_char_lm_options(options);
  const int64_t E = options.n_embd();
  wte = register_module("wte", torch::nn::Embedding(options.vocab_size(), E));
  wpe = nullptr;
  if (!options.rotary()) {
    wpe = register_module("wpe", torch::nn::Embedding(options.block_size(), E));
  }
  drop = register_module("drop", torch::nn::Dropout(options.dropout()));
  h = register_module("h", torch::nn::ModuleList());
  for (int64_t i = 0; i < options.n_layer(); ++i) {
    h->push_back(GPTBlock(options));
  }
  ln_f = register_module("ln_f", LayerNorm(LayerNormOptions(E)));

  // nanoGPT's initialisation: N(0, 0.02) weights, zero biases, and the
  // projections into the residual stream scaled down by sqrt(2 n_layer).
  torch::NoGradGuard no_grad;
  const double residual_std = 0.02 / std::sqrt(2.0 * options.n_layer());
  wte->weight.normal_(0.0, 0.02);
  if (wpe) {
    wpe->weight.normal_(0.0, 0.02);
  }
  for (const auto& module : *h) {
    auto* block = module->as<GPTBlockImpl>();
    block->attn->in_proj_weight.normal_(0.0, 0.02);
    block->attn->in_proj_bias.zero_();
    block->attn->out_proj->weight.normal_(0.0, residual_std);
    block->attn->out_proj->bias.zero_();
    block->c_fc->weight.normal_(0.0, 0.02);
    block->c_fc->bias.zero_();
    block->c_proj->weight.normal_(0.0, residual_std);
    block->c_proj->bias.zero_();
  }
}

namespace {

/// The CharLM's input embedding of idx (N, T) at positions offset..offset +
/// T - 1, or at `positions` (N, T) where defined: wte, plus wpe without
/// rotary (checked against block_size).
torch::Tensor embed(CharLMImpl& lm, const torch::Tensor& idx, int64_t offset,
                    const char* what, const torch::Tensor& positions = {}) {
  TORCH_CHECK(idx.dim() == 2, what, ": idx must be (N, T), but got ",
              idx.sizes());
  if (positions.defined()) {
    TORCH_CHECK(positions.sizes() == idx.sizes() &&
                    positions.scalar_type() == torch::kInt64,
                what, ": positions must be int64 of idx's shape ", idx.sizes(),
                ", but got ", positions.scalar_type(), " ", positions.sizes());
  }
  if (lm.options.rotary()) {
    return lm.wte(idx);  // (N, T, E); positions enter in attention
  }
  if (positions.defined()) {
    TORCH_CHECK(positions.numel() == 0 ||
                    (positions.min().item<int64_t>() >= 0 &&
                     positions.max().item<int64_t>() < lm.options.block_size()),
                what, ": positions must be in [0, block_size = ",
                lm.options.block_size(), ")");
    return lm.wte(idx) + lm.wpe(positions);  // (N, T, E) + (N, T, E)
  }
  const int64_t T = idx.size(1);
  TORCH_CHECK(offset + T <= lm.options.block_size(), what,
              ": idx must be (N, T) with T <= block_size = ",
              lm.options.block_size() - offset,
              offset > 0 ? " (after the cached positions)" : "", ", but got ",
              idx.sizes());
  auto at = torch::arange(offset, offset + T, idx.options());  // (T)
  return lm.wte(idx) + lm.wpe(at);  // (N, T, E) + (T, E)
}

}  // namespace

torch::Tensor CharLMImpl::forward(const torch::Tensor& idx,
                                  const torch::Tensor& positions,
                                  const BlockMask& block_mask,
                                  const torch::Tensor& key_padding_mask) {
  auto x = drop(embed(*this, idx, 0, "CharLM", positions));  // (N, T, E)
  for (const auto& block : *h) {
    x = block->as<GPTBlockImpl>()->forward(x, positions, block_mask,
                                           key_padding_mask);  // (N, T, E)
  }
  x = ln_f(x);                           // (N, T, E)
  return torch::linear(x, wte->weight);  // (N,T,E)·(E,V) → (N, T, V)
}

BlockMask packed_documents_block_mask(
    const std::vector<torch::Tensor>& row_lengths, int64_t block) {
  TORCH_CHECK(!row_lengths.empty(),
              "packed_documents_block_mask: no rows (row_lengths is empty)");
  // Each row's causal document mask (create_document_block_mask checks its
  // lengths), stacked along B; the mask function reads each row's
  // documents from a (rows, T) table.
  std::vector<BlockMask> rows;
  std::vector<torch::Tensor> docs;
  for (const auto& lengths : row_lengths) {
    rows.push_back(create_document_block_mask(lengths, /*causal=*/true, block));
    docs.push_back(document_ids(lengths));  // (T)
    TORCH_CHECK(rows.back().q_len == rows.front().q_len,
                "packed_documents_block_mask: every row must hold the same "
                "number of characters, but row 0 holds ",
                rows.front().q_len, " and row ", rows.size() - 1, " holds ",
                rows.back().q_len);
  }
  auto stack = [&](torch::Tensor BlockMask::*field) {
    std::vector<torch::Tensor> parts;
    for (const auto& row : rows) {
      parts.push_back(row.*field);  // (1, 1, ...)
    }
    return torch::cat(parts, 0);  // (rows, 1, ...)
  };
  BlockMask mask = rows.front();
  mask.kv_num_blocks = stack(&BlockMask::kv_num_blocks);
  mask.kv_indices = stack(&BlockMask::kv_indices);
  mask.full_kv_num_blocks = stack(&BlockMask::full_kv_num_blocks);
  mask.full_kv_indices = stack(&BlockMask::full_kv_indices);
  mask.mask_mod = [doc = torch::stack(docs)](
                      const torch::Tensor& b, const torch::Tensor&,
                      const torch::Tensor& q_idx, const torch::Tensor& kv_idx) {
    const auto d = doc.to(q_idx.device());  // (rows, T)
    return d.index({b, q_idx})
        .eq(d.index({b, kv_idx}))
        .logical_and(q_idx.ge(kv_idx));
  };
  return mask;
}

std::vector<KVCache> CharLMImpl::make_kv_caches(int64_t batch_size,
                                                int64_t capacity) const {
  std::vector<KVCache> caches;
  for (const auto& block : *h) {
    caches.push_back(
        block->as<GPTBlockImpl>()->attn->make_kv_cache(batch_size, capacity));
  }
  return caches;
}

torch::Tensor CharLMImpl::forward_cached(const torch::Tensor& idx,
                                         std::vector<KVCache>& caches) {
  TORCH_CHECK(caches.size() == h->size(),
              "CharLM::forward_cached: caches must hold one KVCache per block "
              "(",
              h->size(), "), but got ", caches.size());
  auto x = drop(embed(*this, idx, caches.front().size(),
                      "CharLM::forward_cached"));  // (N, T, E)
  for (size_t i = 0; i < h->size(); ++i) {
    x = (*h)[i]->as<GPTBlockImpl>()->forward_cached(x, caches[i]);
  }
  x = ln_f(x);                           // (N, T, E)
  return torch::linear(x, wte->weight);  // (N, T, V)
}

std::vector<torch::Tensor> CharLMImpl::attention_weights(
    const torch::Tensor& idx) {
  torch::NoGradGuard no_grad;
  const bool was_training = is_training();
  eval();
  auto x = embed(*this, idx, 0, "CharLM::attention_weights");  // (N, T, E)
  std::vector<torch::Tensor> weights;
  for (const auto& block : *h) {
    torch::Tensor w;
    std::tie(x, w) = block->as<GPTBlockImpl>()->forward_with_weights(x);
    weights.push_back(w.to(torch::kFloat));  // (N, H, T, T)
  }
  train(was_training);
  return weights;
}

torch::Tensor generate(CharLM& model, const torch::Tensor& prompt,
                       int64_t max_new_tokens, const SamplingOptions& options,
                       bool use_kv_cache) {
  TORCH_CHECK(prompt.dim() == 1 && prompt.numel() >= 1,
              "generate: prompt must be 1-D and non-empty, but got ",
              prompt.sizes());
  TORCH_CHECK(max_new_tokens >= 0,
              "generate: max_new_tokens must be >= 0, but got ",
              max_new_tokens);
  TORCH_CHECK(options.temperature() > 0.0,
              "generate: temperature must be > 0, but got ",
              options.temperature());
  TORCH_CHECK(options.top_k() >= 0, "generate: top_k must be >= 0, but got ",
              options.top_k());
  torch::NoGradGuard no_grad;
  const bool was_training = model->is_training();
  model->eval();
  const auto device = model->wte->weight.device();
  const int64_t V = model->options.vocab_size();
  const bool rotary = model->options.rotary();
  // The longest context the model reads: everything with rotary (its
  // window limits each block), else block_size.
  const int64_t context_limit = rotary ? std::numeric_limits<int64_t>::max()
                                       : model->options.block_size();
  auto generator = at::make_generator<at::CPUGeneratorImpl>(options.seed());

  // The next character from the logits (V) of the last position.
  auto pick = [&](const torch::Tensor& last_logits) {
    auto logits = last_logits.to(torch::kCPU, torch::kFloat32) /
                  options.temperature();  // (V)
    if (options.top_k() > 0 && options.top_k() < V) {
      auto kth = std::get<0>(logits.topk(options.top_k())).select(0, -1);
      logits = logits.masked_fill(logits < kth,
                                  -std::numeric_limits<float>::infinity());
    }
    auto probs = torch::softmax(logits, /*dim=*/0);  // (V)
    return torch::multinomial(probs, /*num_samples=*/1,
                              /*replacement=*/false, generator);  // (1)
  };

  auto ids = prompt.to(torch::kCPU, torch::kInt64);  // (T0 + generated)
  const int64_t total = ids.size(0) + max_new_tokens;
  std::vector<KVCache> caches;
  // The cache serves while the whole text fits the context.
  const bool cached =
      use_kv_cache && max_new_tokens > 0 && total - 1 <= context_limit;
  if (cached) {
    caches = model->make_kv_caches(/*batch_size=*/1, total - 1);
  }
  torch::Tensor pending = ids;  // characters not yet fed through the caches
  for (int64_t i = 0; i < max_new_tokens; ++i) {
    torch::Tensor logits;  // (1, T, V)
    if (cached) {
      logits = model->forward_cached(pending.unsqueeze(0).to(device), caches);
    } else {
      const int64_t T = std::min(ids.size(0), context_limit);
      auto context = ids.narrow(0, ids.size(0) - T, T).unsqueeze(0);  // (1,T)
      logits = model(context.to(device));
    }
    auto next = pick(logits.select(1, logits.size(1) - 1).squeeze(0));
    ids = torch::cat({ids, next});
    pending = next;
  }
  model->train(was_training);
  return ids;
}

}  // namespace mha::train

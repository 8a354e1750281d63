// Glossary: N batch, L sequence length (digit tasks), T context length (the
// character model), E model width, V vocabulary size, C classes.
#include "mha/train.h"

#include <ATen/CPUGeneratorImpl.h>

#include <algorithm>
#include <array>
#include <charconv>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <mutex>
#include <random>
#include <sstream>
#include <utility>

#include "mha/plot.h"
#include "mha/state_dict.h"
#include "xml_escape.h"

namespace mha::train {
namespace {

namespace F = torch::nn::functional;
namespace fs = std::filesystem;

/// printf-style formatting into a std::string (the library does not link
/// fmt).
template <class... Args>
std::string printf_string(const char* format, Args... args) {
  const int size = std::snprintf(nullptr, 0, format, args...);
  std::string out(static_cast<size_t>(std::max(size, 0)), '\0');
  std::snprintf(out.data(), out.size() + 1, format, args...);
  return out;
}

/// The shortest decimal text that reads back as exactly `value`.
std::string exact_decimal(double value) {
  std::array<char, 32> buffer{};
  auto [end, error] =
      std::to_chars(buffer.data(), buffer.data() + buffer.size(), value);
  TORCH_INTERNAL_ASSERT(error == std::errc());
  return std::string(buffer.data(), end);
}

/// A CPU int64 tensor of `shape` holding `values`.
torch::Tensor int64_tensor(std::vector<int64_t> values,
                           torch::IntArrayRef shape) {
  return torch::from_blob(values.data(), shape, torch::kInt64).clone();
}

/// FNV-1a hash of a text: identifies the training text in fingerprints.
uint64_t fnv1a(const std::string& text) {
  uint64_t hash = 0xcbf29ce484222325ULL;
  for (const unsigned char c : text) {
    hash = (hash ^ c) * 0x100000001b3ULL;
  }
  return hash;
}

constexpr double kPi = 3.14159265358979323846;

uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

/// An integer uniform in [0, n), n >= 1 (modulo bias < n / 2^64).
int64_t uniform_below(std::mt19937_64& rng, int64_t n) {
  return static_cast<int64_t>(rng() % static_cast<uint64_t>(n));
}

}  // namespace

// ------------------------------------------------------------ randomness ---

uint64_t derive_seed(uint64_t seed, int64_t step, SeedStream stream) {
  uint64_t h = splitmix64(seed);
  h = splitmix64(h ^ static_cast<uint64_t>(step));
  return splitmix64(h ^ static_cast<uint64_t>(stream));
}

// ---------------------------------------------------- digit sequence data ---

DigitBatch make_digit_batch(const DigitDataOptions& options, int64_t batch_size,
                            uint64_t seed) {
  const int64_t min_len = options.min_len(), max_len = options.max_len();
  TORCH_CHECK(batch_size >= 1,
              "make_digit_batch: batch_size must be >= 1, but got ",
              batch_size);
  TORCH_CHECK(min_len >= 1 && min_len <= max_len,
              "make_digit_batch: need 1 <= min_len <= max_len, but got "
              "min_len ",
              min_len, " and max_len ", max_len);
  std::mt19937_64 rng(seed);
  const int64_t N = batch_size, L = max_len;
  std::vector<int64_t> input(N * L, kPadToken);
  std::vector<int64_t> target(N * L, kIgnoreIndex);
  std::vector<int64_t> lengths(N);
  std::vector<int64_t> digits;
  for (int64_t n = 0; n < N; ++n) {
    const int64_t length = min_len + uniform_below(rng, max_len - min_len + 1);
    digits.resize(length);
    for (auto& digit : digits) {
      digit = uniform_below(rng, kNumDigits);
    }
    std::copy(digits.begin(), digits.end(), input.begin() + n * L);
    if (options.rule() == DigitRule::kReverse) {
      std::reverse(digits.begin(), digits.end());
    } else {
      std::sort(digits.begin(), digits.end());
    }
    std::copy(digits.begin(), digits.end(), target.begin() + n * L);
    lengths[n] = length;
  }
  DigitBatch batch;
  batch.input = int64_tensor(std::move(input), {N, L});    // (N, L)
  batch.target = int64_tensor(std::move(target), {N, L});  // (N, L)
  batch.lengths = int64_tensor(std::move(lengths), {N});   // (N)
  batch.padding = torch::arange(L, torch::kInt64).unsqueeze(0) >=
                  batch.lengths.unsqueeze(1);  // (1, L) >= (N, 1) → (N, L)
  return batch;
}

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

namespace {

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

}  // namespace

torch::Tensor masked_cross_entropy(const torch::Tensor& logits,
                                   const torch::Tensor& target) {
  auto [summed, real_tokens] = masked_cross_entropy_sum(logits, target);
  return summed / real_tokens.clamp_min(1);
}

// ------------------------------------------------------ character data ---

CharVocab::CharVocab(const std::string& text) : id_of_(256, -1) {
  TORCH_CHECK(!text.empty(), "CharVocab: the text is empty");
  std::array<bool, 256> present{};
  for (const unsigned char c : text) {
    present[c] = true;
  }
  for (int c = 0; c < 256; ++c) {
    if (present[c]) {
      id_of_[c] = static_cast<int64_t>(chars_.size());
      chars_.push_back(static_cast<char>(c));
    }
  }
}

torch::Tensor CharVocab::encode(const std::string& text) const {
  std::vector<int64_t> ids(text.size());
  for (size_t i = 0; i < text.size(); ++i) {
    const auto c = static_cast<unsigned char>(text[i]);
    TORCH_CHECK(id_of_[c] >= 0, "CharVocab::encode: byte ", int{c},
                " at offset ", i, " is not in the vocabulary");
    ids[i] = id_of_[c];
  }
  const auto T = static_cast<int64_t>(ids.size());
  return int64_tensor(std::move(ids), {T});  // (T)
}

std::string CharVocab::decode(const torch::Tensor& ids) const {
  TORCH_CHECK(ids.dim() == 1, "CharVocab::decode: ids must be 1-D, but got ",
              ids.sizes());
  auto cpu = ids.to(torch::kCPU, torch::kInt64).contiguous();
  std::string text;
  text.reserve(cpu.numel());
  const int64_t* data = cpu.data_ptr<int64_t>();
  for (int64_t i = 0; i < cpu.numel(); ++i) {
    TORCH_CHECK(data[i] >= 0 && data[i] < size(), "CharVocab::decode: id ",
                data[i], " at index ", i, " is outside [0, ", size(), ")");
    text.push_back(chars_[data[i]]);
  }
  return text;
}

CharCorpus make_char_corpus(const std::string& text, double val_fraction,
                            int64_t context) {
  TORCH_CHECK(val_fraction > 0.0 && val_fraction < 1.0,
              "make_char_corpus: val_fraction must be in (0, 1), but got ",
              val_fraction);
  TORCH_CHECK(context >= 1, "make_char_corpus: context must be >= 1, but got ",
              context);
  const auto n = static_cast<int64_t>(text.size());
  const auto n_val = static_cast<int64_t>(std::llround(n * val_fraction));
  const int64_t n_train = n - n_val;
  TORCH_CHECK(n_train > context && n_val > context, "the text (", n,
              " characters) is too short for a context of ", context,
              " characters: its training part has ", n_train,
              " and its validation part ", n_val,
              " characters, and each needs more than ", context);
  CharCorpus corpus{CharVocab(text), torch::Tensor(), torch::Tensor()};
  auto ids = corpus.vocab.encode(text);                // (T_train + T_val)
  corpus.train = ids.narrow(0, 0, n_train).clone();    // (T_train)
  corpus.val = ids.narrow(0, n_train, n_val).clone();  // (T_val)
  return corpus;
}

std::string read_text_file(const std::string& path) {
  std::ifstream file(path, std::ios::binary);
  TORCH_CHECK(file.good(), "cannot read the text file '", path, "'");
  std::string text((std::istreambuf_iterator<char>(file)),
                   std::istreambuf_iterator<char>());
  TORCH_CHECK(!file.bad(), "error while reading the text file '", path, "'");
  return text;
}

double unigram_baseline(const CharCorpus& corpus) {
  const int64_t V = corpus.vocab.size();
  auto counts = torch::bincount(corpus.train, /*weights=*/{}, /*minlength=*/V)
                    .to(torch::kFloat64) +
                1.0;                               // (V), add-one
  auto log_p = torch::log(counts / counts.sum());  // (V)
  return -log_p.index_select(0, corpus.val).mean().item<double>();
}

std::pair<torch::Tensor, torch::Tensor> sample_char_batch(
    const torch::Tensor& data, int64_t batch_size, int64_t context,
    uint64_t seed) {
  TORCH_CHECK(batch_size >= 1,
              "sample_char_batch: batch_size must be >= 1, but got ",
              batch_size);
  TORCH_CHECK(data.dim() == 1 && data.size(0) > context && context >= 1,
              "sample_char_batch: data must be 1-D and longer than the "
              "context ",
              context, ", but got ", data.sizes());
  std::mt19937_64 rng(seed);
  const int64_t N = batch_size, T = context;
  std::vector<int64_t> offsets(N);
  for (auto& offset : offsets) {
    offset = uniform_below(rng, data.size(0) - T);  // window [o, o + T]
  }
  auto starts = int64_tensor(std::move(offsets), {N, 1});     // (N, 1)
  auto index = starts + torch::arange(T + 1, torch::kInt64);  // (N, T+1)
  auto windows = data.index_select(0, index.reshape({-1})).view({N, T + 1});
  return {windows.narrow(1, 0, T).contiguous(),   // (N, T) input
          windows.narrow(1, 1, T).contiguous()};  // (N, T) target
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
}

}  // namespace

GPTBlockImpl::GPTBlockImpl(const CharLMOptions& options_) : options(options_) {
  reset();
}

void GPTBlockImpl::reset() {
  check_char_lm_options(options);
  const int64_t E = options.n_embd();
  ln_1 = register_module("ln_1", LayerNorm(LayerNormOptions(E)));
  auto attn_options =
      MultiHeadAttentionOptions(E, options.n_head()).dropout(options.dropout());
  if (options.rotary()) {
    attn_options.rotary(true).window(options.block_size());
  }
  attn = register_module("attn", MultiHeadAttention(attn_options));
  ln_2 = register_module("ln_2", LayerNorm(LayerNormOptions(E)));
  c_fc = register_module("c_fc", torch::nn::Linear(E, 4 * E));
  c_proj = register_module("c_proj", torch::nn::Linear(4 * E, E));
  dropout = register_module("dropout", torch::nn::Dropout(options.dropout()));
}

torch::Tensor GPTBlockImpl::forward(const torch::Tensor& x) {
  return std::get<0>(forward_impl(x, /*need_weights=*/false));
}

std::tuple<torch::Tensor, torch::Tensor> GPTBlockImpl::forward_with_weights(
    const torch::Tensor& x) {
  return forward_impl(x, /*need_weights=*/true);
}

std::tuple<torch::Tensor, torch::Tensor> GPTBlockImpl::forward_impl(
    const torch::Tensor& x, bool need_weights) {
  auto [attended, weights] = attn->forward(
      ln_1(x), /*key=*/{}, /*value=*/{},
      /*key_padding_mask=*/{}, need_weights, /*attn_mask=*/{},
      /*average_attn_weights=*/false,
      /*is_causal=*/true);  // (N, T, E), (N, H, T, T) or undefined
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
/// T - 1: wte, plus wpe without rotary (checked against block_size).
torch::Tensor embed(CharLMImpl& lm, const torch::Tensor& idx, int64_t offset,
                    const char* what) {
  TORCH_CHECK(idx.dim() == 2, what, ": idx must be (N, T), but got ",
              idx.sizes());
  if (lm.options.rotary()) {
    return lm.wte(idx);  // (N, T, E); positions enter in attention
  }
  const int64_t T = idx.size(1);
  TORCH_CHECK(offset + T <= lm.options.block_size(), what,
              ": idx must be (N, T) with T <= block_size = ",
              lm.options.block_size() - offset,
              offset > 0 ? " (after the cached positions)" : "", ", but got ",
              idx.sizes());
  auto positions = torch::arange(offset, offset + T, idx.options());  // (T)
  return lm.wte(idx) + lm.wpe(positions);  // (N, T, E) + (T, E)
}

}  // namespace

torch::Tensor CharLMImpl::forward(const torch::Tensor& idx) {
  auto x = drop(embed(*this, idx, 0, "CharLM"));  // (N, T, E)
  for (const auto& block : *h) {
    x = block->as<GPTBlockImpl>()->forward(x);  // (N, T, E)
  }
  x = ln_f(x);                           // (N, T, E)
  return torch::linear(x, wte->weight);  // (N,T,E)·(E,V) → (N, T, V)
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

// ------------------------------------------------------- optimisation ---

double LrSchedule::at(int64_t step) const {
  if (step <= warmup_steps && warmup_steps > 0) {
    return peak_lr * static_cast<double>(step) / warmup_steps;
  }
  const int64_t decay_steps = std::max<int64_t>(total_steps - warmup_steps, 1);
  const double progress = std::clamp(
      static_cast<double>(step - warmup_steps) / decay_steps, 0.0, 1.0);
  return min_lr + (peak_lr - min_lr) * 0.5 * (1.0 + std::cos(kPi * progress));
}

std::unique_ptr<torch::optim::AdamW> make_adamw(torch::nn::Module& module,
                                                double lr, double weight_decay,
                                                double beta1, double beta2) {
  std::vector<torch::Tensor> decayed, not_decayed;
  for (const auto& parameter : module.parameters()) {
    (parameter.dim() >= 2 ? decayed : not_decayed).push_back(parameter);
  }
  auto options = [&](double decay) {
    return std::make_unique<torch::optim::AdamWOptions>(
        torch::optim::AdamWOptions(lr)
            .betas(std::make_tuple(beta1, beta2))
            .weight_decay(decay));
  };
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(decayed, options(weight_decay));
  groups.emplace_back(not_decayed, options(0.0));
  return std::make_unique<torch::optim::AdamW>(std::move(groups),
                                               *options(weight_decay));
}

void set_learning_rate(torch::optim::AdamW& optimizer, double lr) {
  for (auto& group : optimizer.param_groups()) {
    static_cast<torch::optim::AdamWOptions&>(group.options()).lr(lr);
  }
}

// ------------------------------------------------------------ loss curve ---

namespace {

std::ofstream open_for_writing(const std::string& path, const char* what) {
  std::ofstream file(path, std::ios::binary | std::ios::trunc);
  TORCH_CHECK(file.good(), what, ": cannot write '", path, "'");
  return file;
}

void finish_writing(std::ofstream& file, const std::string& path,
                    const char* what) {
  file.close();
  TORCH_CHECK(!file.fail(), what, ": error while writing '", path, "'");
}

/// Round tick positions covering [lo, hi], about `target` of them.
std::vector<double> linear_ticks(double lo, double hi, int target) {
  const double raw = (hi - lo) / std::max(target, 1);
  const double magnitude = std::pow(10.0, std::floor(std::log10(raw)));
  double step = magnitude;
  for (const double m : {1.0, 2.0, 5.0, 10.0}) {
    step = m * magnitude;
    if ((hi - lo) / step <= target) {
      break;
    }
  }
  std::vector<double> ticks;
  for (double t = std::ceil(lo / step) * step; t <= hi + 1e-9 * step;
       t += step) {
    ticks.push_back(t);
  }
  return ticks;
}

/// Tick values on a log axis spanning [10^lo, 10^hi]: the finest of the
/// mantissa sets {1..9}, {1, 2, 5}, {1} that gives at most 10 ticks.
std::vector<double> log_ticks(double lo, double hi) {
  const std::vector<std::vector<double>> mantissa_sets = {
      {1, 1.5, 2, 3, 4, 5, 6, 7, 8, 9}, {1, 2, 5}, {1}};
  std::vector<double> ticks;
  for (const auto& mantissas : mantissa_sets) {
    ticks.clear();
    for (int e = static_cast<int>(std::floor(lo)) - 1;
         e <= static_cast<int>(std::ceil(hi)); ++e) {
      for (const double m : mantissas) {
        const double v = m * std::pow(10.0, e);
        const double lv = std::log10(v);
        if (lv >= lo && lv <= hi) {
          ticks.push_back(v);
        }
      }
    }
    if (ticks.size() <= 10) {
      break;
    }
  }
  return ticks;
}

}  // namespace

void write_loss_csv(const std::vector<LossRecord>& records,
                    const std::string& path) {
  auto file = open_for_writing(path, "write_loss_csv");
  file << "step,lr,train_loss,val_loss,tokens_per_s,elapsed_s\n";
  for (const auto& r : records) {
    file << r.step << ',' << exact_decimal(r.lr) << ','
         << exact_decimal(r.train_loss) << ','
         << (std::isnan(r.val_loss) ? "" : exact_decimal(r.val_loss)) << ','
         << printf_string("%.1f", r.tokens_per_s) << ','
         << printf_string("%.3f", r.elapsed_s) << '\n';
  }
  finish_writing(file, path, "write_loss_csv");
}

void write_loss_svg(const std::vector<LossRecord>& records,
                    const std::string& title, const std::string& path) {
  TORCH_CHECK(!records.empty(), "write_loss_svg: no records to plot for '",
              path, "'");
  // Plot area in SVG pixels.
  constexpr double kWidth = 800, kHeight = 460;
  constexpr double kLeft = 70, kRight = 20, kTop = 44, kBottom = 56;
  constexpr double kPlotW = kWidth - kLeft - kRight;
  constexpr double kPlotH = kHeight - kTop - kBottom;

  // Ranges: steps linearly, losses on a log10 scale.
  const double x0 = static_cast<double>(records.front().step);
  const double x1 = std::max(static_cast<double>(records.back().step), x0 + 1);
  double lo = std::numeric_limits<double>::infinity(), hi = -lo;
  for (const auto& r : records) {
    for (const double v : {r.train_loss, r.val_loss}) {
      if (std::isfinite(v) && v > 0) {
        lo = std::min(lo, v);
        hi = std::max(hi, v);
      }
    }
  }
  if (!std::isfinite(lo)) {
    lo = 0.1;
    hi = 10.0;
  }
  double y0 = std::log10(lo), y1 = std::log10(hi);
  const double pad = std::max(0.05 * (y1 - y0), 0.02);
  y0 -= pad;
  y1 += pad;
  auto px = [&](double step) {
    return kLeft + (step - x0) / (x1 - x0) * kPlotW;
  };
  auto py = [&](double loss) {
    return kTop + (y1 - std::log10(loss)) / (y1 - y0) * kPlotH;
  };
  auto plottable = [](double v) { return std::isfinite(v) && v > 0; };

  // The raw training loss, averaged in buckets to at most ~1000 points, and
  // its exponential moving average (bias-corrected, over ~2% of the run).
  // Both average log(loss), the quantity the axis shows.
  const auto count = static_cast<int64_t>(records.size());
  const int64_t bucket = std::max<int64_t>(1, (count + 999) / 1000);
  std::string raw_points, smooth_points;
  const double beta = 1.0 - 1.0 / std::clamp<double>(count / 50.0, 1.0, 200.0);
  double ema = 0.0, ema_weight = 0.0;
  for (int64_t begin = 0; begin < count; begin += bucket) {
    const int64_t end = std::min(count, begin + bucket);
    double step_sum = 0, log_sum = 0;
    int64_t n = 0;
    for (int64_t i = begin; i < end; ++i) {
      const auto& r = records[i];
      if (plottable(r.train_loss)) {
        const double log_loss = std::log(r.train_loss);
        step_sum += static_cast<double>(r.step);
        log_sum += log_loss;
        ++n;
        ema = beta * ema + (1 - beta) * log_loss;
        ema_weight = beta * ema_weight + (1 - beta);
      }
    }
    if (n > 0) {
      raw_points += printf_string("%.1f,%.1f ", px(step_sum / n),
                                  py(std::exp(log_sum / n)));
    }
    if (ema_weight > 0) {
      smooth_points += printf_string(
          "%.1f,%.1f ", px(static_cast<double>(records[end - 1].step)),
          py(std::exp(ema / ema_weight)));
    }
  }
  std::string val_points, val_marks;
  for (const auto& r : records) {
    if (plottable(r.val_loss)) {
      const double x = px(static_cast<double>(r.step)), y = py(r.val_loss);
      val_points += printf_string("%.1f,%.1f ", x, y);
      val_marks += printf_string(
          "<circle cx=\"%.1f\" cy=\"%.1f\" r=\"3.5\" fill=\"#e6550d\"/>\n", x,
          y);
    }
  }

  std::ostringstream svg;
  svg << printf_string(
      "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"%.0f\" "
      "height=\"%.0f\" viewBox=\"0 0 %.0f %.0f\" "
      "font-family=\"sans-serif\" font-size=\"12\">\n",
      kWidth, kHeight, kWidth, kHeight, kWidth, kHeight);
  svg << "<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n";
  svg << printf_string(
      "<text x=\"%.1f\" y=\"26\" text-anchor=\"middle\" font-size=\"15\">",
      kWidth / 2);
  svg << detail::xml_escape(title) << "</text>\n";
  // Grid and tick labels.
  for (const double t : linear_ticks(x0, x1, 8)) {
    const double x = px(t);
    svg << printf_string(
        "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" "
        "stroke=\"#e5e5e5\"/>\n<text x=\"%.1f\" y=\"%.1f\" "
        "text-anchor=\"middle\">%.0f</text>\n",
        x, kTop, x, kTop + kPlotH, x, kTop + kPlotH + 16, t);
  }
  for (const double t : log_ticks(y0, y1)) {
    const double y = py(t);
    svg << printf_string(
        "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" "
        "stroke=\"#e5e5e5\"/>\n<text x=\"%.1f\" y=\"%.1f\" "
        "text-anchor=\"end\">%g</text>\n",
        kLeft, y, kLeft + kPlotW, y, kLeft - 6, y + 4, t);
  }
  svg << printf_string(
      "<rect x=\"%.1f\" y=\"%.1f\" width=\"%.1f\" height=\"%.1f\" "
      "fill=\"none\" stroke=\"#333\"/>\n",
      kLeft, kTop, kPlotW, kPlotH);
  svg << printf_string(
      "<text x=\"%.1f\" y=\"%.1f\" text-anchor=\"middle\">step</text>\n",
      kLeft + kPlotW / 2, kHeight - 14);
  svg << printf_string(
      "<text transform=\"translate(18 %.1f) rotate(-90)\" "
      "text-anchor=\"middle\">loss (nats per token, log scale)</text>\n",
      kTop + kPlotH / 2);
  // Curves.
  svg << "<polyline fill=\"none\" stroke=\"#9ecae1\" stroke-width=\"1\" "
         "points=\""
      << raw_points << "\"/>\n";
  svg << "<polyline fill=\"none\" stroke=\"#08519c\" stroke-width=\"2\" "
         "points=\""
      << smooth_points << "\"/>\n";
  if (!val_points.empty()) {
    svg << "<polyline fill=\"none\" stroke=\"#e6550d\" stroke-width=\"1.5\" "
           "points=\""
        << val_points << "\"/>\n"
        << val_marks;
  }
  // Legend, top right.
  const double lx = kLeft + kPlotW - 214, ly = kTop + 12;
  const std::array<std::pair<const char*, const char*>, 3> legend = {
      {{"#9ecae1", "training loss"},
       {"#08519c", "training loss, moving average"},
       {"#e6550d", "validation loss"}}};
  svg << printf_string(
      "<rect x=\"%.1f\" y=\"%.1f\" width=\"206\" height=\"58\" "
      "fill=\"white\" fill-opacity=\"0.85\" stroke=\"#ccc\"/>\n",
      lx - 6, ly - 8);
  for (size_t i = 0; i < legend.size(); ++i) {
    const double y = ly + 18.0 * static_cast<double>(i);
    svg << printf_string(
        "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" "
        "stroke=\"%s\" stroke-width=\"3\"/>\n<text x=\"%.1f\" "
        "y=\"%.1f\">%s</text>\n",
        lx, y + 2, lx + 20, y + 2, legend[i].first, lx + 26, y + 6,
        legend[i].second);
  }
  svg << "</svg>\n";

  auto file = open_for_writing(path, "write_loss_svg");
  file << svg.str();
  finish_writing(file, path, "write_loss_svg");
}

// ------------------------------------------------------------ tasks ---

std::pair<int64_t, int64_t> Shard::rows(int64_t rows) const {
  return {rows * index / count, rows * (index + 1) / count};
}

double TrainTask::validation_loss() { return validation_loss_sum().mean(); }

void TrainTask::set_shard(const Shard& shard) {
  TORCH_CHECK(shard.count >= 1 && shard.index >= 0 && shard.index < shard.count,
              "TrainTask::set_shard: need 0 <= index < count, but got index ",
              shard.index, " and count ", shard.count);
  shard_ = shard;
}

DigitTask::DigitTask(const DigitDataOptions& data,
                     const DigitTransformerOptions& model_options,
                     int64_t batch_size, uint64_t seed, torch::Device device)
    : data_(data),
      batch_size_(batch_size),
      seed_(seed),
      device_(device),
      model_(nullptr) {
  TORCH_CHECK(batch_size >= 1, "DigitTask: batch_size must be >= 1, but got ",
              batch_size);
  TORCH_CHECK(model_options.max_len() >= data.max_len(),
              "DigitTask: the model's max_len (", model_options.max_len(),
              ") must be >= the data's max_len (", data.max_len(), ")");
  torch::manual_seed(derive_seed(seed, 0, SeedStream::kModelInit));
  model_ = DigitTransformer(model_options);
  model_->to(device_);
  val_batch_ = make_digit_batch(data_, /*batch_size=*/500,
                                derive_seed(seed_, 0, SeedStream::kEvalData));
}

std::string DigitTask::name() const {
  return printf_string("%s digit sequences of length %lld-%lld",
                       data_.rule() == DigitRule::kReverse ? "reverse" : "sort",
                       static_cast<long long>(data_.min_len()),
                       static_cast<long long>(data_.max_len()));
}

BatchLoss DigitTask::training_loss(int64_t step) {
  const auto batch = make_digit_batch(
      data_, batch_size_, derive_seed(seed_, step, SeedStream::kTrainData));
  const auto [first, last] = shard().rows(batch_size_);
  auto rows = [&, first = first, last = last](const torch::Tensor& t) {
    return t.narrow(0, first, last - first).to(device_);  // (rows, L)
  };
  auto logits = model_(rows(batch.input), rows(batch.padding));  // (n, L, 10)
  return {masked_cross_entropy(logits, rows(batch.target)),
          batch.lengths.narrow(0, first, last - first).sum().item<int64_t>()};
}

LossSum DigitTask::validation_loss_sum() {
  const auto [first, last] = shard().rows(val_batch_.input.size(0));
  if (first == last) {
    return {};
  }
  torch::NoGradGuard no_grad;
  model_->eval();
  auto rows = [&, first = first, last = last](const torch::Tensor& t) {
    return t.narrow(0, first, last - first).to(device_);  // (rows, L)
  };
  auto logits =
      model_(rows(val_batch_.input), rows(val_batch_.padding));  // (n, L, 10)
  const auto [summed, tokens] =
      masked_cross_entropy_sum(logits, rows(val_batch_.target));
  model_->train();
  return {summed.item<double>(), tokens.item<int64_t>()};
}

DigitTask::Accuracy DigitTask::accuracy(int64_t num_sequences) {
  TORCH_CHECK(num_sequences >= 1,
              "DigitTask::accuracy: num_sequences must be >= 1, but got ",
              num_sequences);
  torch::NoGradGuard no_grad;
  const bool was_training = model_->is_training();
  model_->eval();
  const auto held_out = make_digit_batch(
      data_, num_sequences, derive_seed(seed_, 0, SeedStream::kEvalData));
  int64_t right_sequences = 0, right_digits = 0, digits = 0;
  constexpr int64_t kChunk = 1000;
  for (int64_t begin = 0; begin < num_sequences; begin += kChunk) {
    const int64_t n = std::min(kChunk, num_sequences - begin);
    auto input = held_out.input.narrow(0, begin, n).to(device_);      // (n, L)
    auto padding = held_out.padding.narrow(0, begin, n).to(device_);  // (n, L)
    auto target = held_out.target.narrow(0, begin, n).to(device_);    // (n, L)
    auto predicted = model_(input, padding).argmax(-1);               // (n, L)
    auto right = (predicted == target) & padding.logical_not();       // (n, L)
    right_digits += right.sum().item<int64_t>();
    digits += padding.logical_not().sum().item<int64_t>();
    right_sequences +=
        (right | padding).all(/*dim=*/1).sum().item<int64_t>();  // (n) → ()
  }
  model_->train(was_training);
  Accuracy result;
  result.sequence = static_cast<double>(right_sequences) / num_sequences;
  result.token =
      static_cast<double>(right_digits) / std::max<int64_t>(digits, 1);
  result.num_sequences = num_sequences;
  return result;
}

std::string DigitTask::fingerprint() const {
  const auto& m = model_->options;
  return printf_string(
      "task=%s min_len=%lld max_len=%lld d_model=%lld nhead=%lld "
      "num_layers=%lld dim_feedforward=%lld dropout=%s batch_size=%lld "
      "seed=%llu",
      data_.rule() == DigitRule::kReverse ? "reverse" : "sort",
      static_cast<long long>(data_.min_len()),
      static_cast<long long>(data_.max_len()),
      static_cast<long long>(m.d_model()), static_cast<long long>(m.nhead()),
      static_cast<long long>(m.num_layers()),
      static_cast<long long>(m.dim_feedforward()),
      exact_decimal(m.dropout()).c_str(), static_cast<long long>(batch_size_),
      static_cast<unsigned long long>(seed_));
}

CharLMTask::CharLMTask(CharCorpus corpus, const CharLMOptions& model_options,
                       int64_t batch_size, uint64_t seed, torch::Device device)
    : corpus_(std::move(corpus)),
      batch_size_(batch_size),
      seed_(seed),
      device_(device),
      model_(nullptr) {
  TORCH_CHECK(batch_size >= 1, "CharLMTask: batch_size must be >= 1, but got ",
              batch_size);
  TORCH_CHECK(
      model_options.vocab_size() == corpus_.vocab.size(),
      "CharLMTask: the model's vocab_size (", model_options.vocab_size(),
      ") must equal the corpus's vocabulary size (", corpus_.vocab.size(), ")");
  TORCH_CHECK(corpus_.train.size(0) > model_options.block_size() &&
                  corpus_.val.size(0) > model_options.block_size(),
              "CharLMTask: the training (", corpus_.train.size(0),
              " characters) and validation (", corpus_.val.size(0),
              " characters) parts must be longer than the context (",
              model_options.block_size(), ")");
  torch::manual_seed(derive_seed(seed, 0, SeedStream::kModelInit));
  model_ = CharLM(model_options);
  model_->to(device_);
}

std::string CharLMTask::name() const {
  return printf_string(
      "character language model (%lld characters)",
      static_cast<long long>(corpus_.train.size(0) + corpus_.val.size(0)));
}

BatchLoss CharLMTask::training_loss(int64_t step) {
  const int64_t T = model_->options.block_size();
  const auto [input, target] =
      sample_char_batch(corpus_.train, batch_size_, T,
                        derive_seed(seed_, step, SeedStream::kTrainData));
  const auto [first, last] = shard().rows(batch_size_);
  auto logits =
      model_(input.narrow(0, first, last - first).to(device_));  // (n, T, V)
  auto loss = F::cross_entropy(
      logits.reshape({-1, logits.size(2)}),
      target.narrow(0, first, last - first).to(device_).reshape({-1}));  // ()
  return {loss, (last - first) * T};
}

LossSum CharLMTask::validation_loss_sum() {
  const int64_t T = model_->options.block_size();
  const int64_t windows = (corpus_.val.size(0) - 1) / T;
  const auto [first, last] = shard().rows(windows);
  if (first == last) {
    return {};
  }
  torch::NoGradGuard no_grad;
  model_->eval();
  auto input = corpus_.val.narrow(0, 0, windows * T).view({windows, T});
  auto target = corpus_.val.narrow(0, 1, windows * T).view({windows, T});
  double loss_sum = 0.0;
  constexpr int64_t kChunk = 64;
  for (int64_t begin = first; begin < last; begin += kChunk) {
    const int64_t n = std::min(kChunk, last - begin);
    auto logits = model_(input.narrow(0, begin, n).to(device_));  // (n, T, V)
    loss_sum +=
        F::cross_entropy(logits.reshape({-1, logits.size(2)}),
                         target.narrow(0, begin, n).to(device_).reshape({-1}),
                         F::CrossEntropyFuncOptions().reduction(torch::kSum))
            .item<double>();
  }
  model_->train();
  return {loss_sum, (last - first) * T};
}

std::string CharLMTask::fingerprint() const {
  const auto& m = model_->options;
  return printf_string(
      "task=charlm text_chars=%lld val_chars=%lld text_fnv1a=%016llx "
      "block_size=%lld n_embd=%lld n_head=%lld n_layer=%lld dropout=%s "
      "positions=%s batch_size=%lld seed=%llu",
      static_cast<long long>(corpus_.train.size(0) + corpus_.val.size(0)),
      static_cast<long long>(corpus_.val.size(0)),
      static_cast<unsigned long long>(fnv1a(
          corpus_.vocab.decode(torch::cat({corpus_.train, corpus_.val})))),
      static_cast<long long>(m.block_size()),
      static_cast<long long>(m.n_embd()), static_cast<long long>(m.n_head()),
      static_cast<long long>(m.n_layer()), exact_decimal(m.dropout()).c_str(),
      m.rotary() ? "rotary" : "learned", static_cast<long long>(batch_size_),
      static_cast<unsigned long long>(seed_));
}

double CharLMTask::unigram_baseline() const {
  return mha::train::unigram_baseline(corpus_);
}

std::string CharLMTask::sample(const std::string& prompt, int64_t length,
                               const SamplingOptions& options,
                               bool use_kv_cache) {
  std::string known;
  for (const char c : prompt) {
    if (corpus_.vocab.chars().find(c) != std::string::npos) {
      known.push_back(c);
    }
  }
  auto prompt_ids = known.empty() ? corpus_.val.narrow(0, 0, 1)
                                  : corpus_.vocab.encode(known);  // (T0)
  return corpus_.vocab.decode(
      generate(model_, prompt_ids, length, options, use_kv_cache));
}

namespace {

/// A character as an axis label: visible stand-ins for white space and
/// control characters.
std::string char_label(char c) {
  switch (c) {
    case ' ':
      return "\u2423";  // ␣
    case '\n':
      return "\u23ce";  // ⏎
    case '\t':
      return "\u21e5";  // ⇥
    default:
      break;
  }
  const auto u = static_cast<unsigned char>(c);
  if (u < 0x20 || u == 0x7f) {
    return printf_string("\\x%02x", u);
  }
  return std::string(1, c);
}

}  // namespace

std::vector<std::string> CharLMTask::plot_attention(const std::string& dir,
                                                    int64_t length) {
  const int64_t T = model_->options.block_size();
  TORCH_CHECK(length >= 1 && length <= T,
              "CharLMTask::plot_attention: length must be in [1, ", T,
              "] (the context), but got ", length);
  std::error_code error;
  std::filesystem::create_directories(dir, error);
  TORCH_CHECK(!error, "CharLMTask::plot_attention: cannot create directory '",
              dir, "': ", error.message());
  auto ids = corpus_.val.narrow(0, 0, length);  // (length)
  const std::string text = corpus_.vocab.decode(ids);
  plot::HeatmapOptions plot_options;
  for (const char c : text) {
    plot_options.row_labels.push_back(char_label(c));
  }
  plot_options.col_labels = plot_options.row_labels;
  plot_options.cell_size = 12;
  auto weights =
      model_->attention_weights(ids.unsqueeze(0).to(device_));  // [(1,H,T,T)]
  std::vector<std::string> paths;
  for (size_t layer = 0; layer < weights.size(); ++layer) {
    const int64_t heads = weights[layer].size(1);
    plot_options.panel_titles.clear();
    for (int64_t head = 0; head < heads; ++head) {
      plot_options.panel_titles.push_back(printf_string(
          "layer %zu, head %lld", layer, static_cast<long long>(head)));
    }
    plot_options.title = printf_string(
        "char LM attention, layer %zu: row = predicting after that "
        "character, column = attended character",
        layer);
    const auto path =
        (std::filesystem::path(dir) / printf_string("layer%zu.svg", layer))
            .string();
    plot::write_heatmap_svg(weights[layer][0], path, plot_options);
    paths.push_back(path);
  }
  return paths;
}

// ------------------------------------------------------- checkpoints ---

RunFiles::RunFiles(const std::string& out_dir) {
  const fs::path root(out_dir);
  checkpoint_dir = (root / "checkpoint").string();
  model = (root / "checkpoint" / "model.safetensors").string();
  trainer = (root / "checkpoint" / "trainer.pt").string();
  loss_csv = (root / "loss.csv").string();
  loss_svg = (root / "loss.svg").string();
}

namespace {

/// Columns of the history tensor in trainer.pt.
constexpr int64_t kHistoryColumns = 6;

torch::Tensor history_to_tensor(const std::vector<LossRecord>& history) {
  auto table =
      torch::empty({static_cast<int64_t>(history.size()), kHistoryColumns},
                   torch::kFloat64);  // (steps, 6)
  auto rows = table.accessor<double, 2>();
  for (size_t i = 0; i < history.size(); ++i) {
    const auto& r = history[i];
    const std::array<double, kHistoryColumns> row = {
        static_cast<double>(r.step),
        r.lr,
        r.train_loss,
        r.val_loss,
        r.tokens_per_s,
        r.elapsed_s};
    for (int64_t j = 0; j < kHistoryColumns; ++j) {
      rows[static_cast<int64_t>(i)][j] = row[j];
    }
  }
  return table;
}

std::vector<LossRecord> history_from_tensor(const torch::Tensor& tensor) {
  auto table = tensor.to(torch::kCPU, torch::kFloat64).contiguous();
  TORCH_CHECK(table.dim() == 2 && table.size(1) == kHistoryColumns,
              "load_checkpoint: the history must be (steps, ", kHistoryColumns,
              "), but got ", table.sizes());
  auto rows = table.accessor<double, 2>();
  std::vector<LossRecord> history(table.size(0));
  for (int64_t i = 0; i < table.size(0); ++i) {
    auto& r = history[i];
    r.step = static_cast<int64_t>(rows[i][0]);
    r.lr = rows[i][1];
    r.train_loss = rows[i][2];
    r.val_loss = rows[i][3];
    r.tokens_per_s = rows[i][4];
    r.elapsed_s = rows[i][5];
  }
  return history;
}

/// The "key=value" entries of `a` and `b` that differ, as "key: a vs b".
std::string fingerprint_difference(const std::string& a, const std::string& b) {
  auto split = [](const std::string& s) {
    std::vector<std::string> items;
    std::istringstream in(s);
    for (std::string item; in >> item;) {
      items.push_back(item);
    }
    return items;
  };
  auto key_of = [](const std::string& item) {
    return item.substr(0, item.find('='));
  };
  const auto items_a = split(a), items_b = split(b);
  std::string out;
  for (const auto& item : items_a) {
    const auto key = key_of(item);
    std::string other = "(absent)";
    for (const auto& candidate : items_b) {
      if (key_of(candidate) == key) {
        other = candidate.substr(key.size() + 1);
      }
    }
    const std::string value =
        item.substr(std::min(item.size(), key.size() + 1));
    if (value != other) {
      out += (out.empty() ? "" : ", ") + key + " " + value + " vs " + other;
    }
  }
  return out.empty() ? a + " vs " + b : out;
}

}  // namespace

void save_checkpoint(const RunFiles& files, const torch::nn::Module& model,
                     torch::optim::Optimizer& optimizer,
                     const std::vector<LossRecord>& history,
                     const std::string& fingerprint) {
  const fs::path final_dir(files.checkpoint_dir);
  const fs::path temporary = final_dir.string() + ".tmp";
  const fs::path previous = final_dir.string() + ".old";
  try {
    fs::remove_all(temporary);
    fs::create_directories(temporary);

    // The weights, in a format mha::load_state_dict (and Python) reads.
    save_state_dict(model, (temporary / "model.safetensors").string());

    // Everything else the loop needs to continue exactly.
    torch::serialize::OutputArchive archive;
    archive.write("fingerprint", c10::IValue(fingerprint));
    archive.write("step", c10::IValue(history.empty() ? int64_t{0}
                                                      : history.back().step));
    {
      auto generator = at::detail::getDefaultCPUGenerator();
      std::lock_guard<std::mutex> lock(generator.mutex());
      archive.write("rng_cpu", generator.get_state());
    }
    archive.write("history", history_to_tensor(history));
    torch::serialize::OutputArchive optimizer_archive;
    optimizer.save(optimizer_archive);
    archive.write("optimizer", optimizer_archive);
    archive.save_to((temporary / "trainer.pt").string());

    // Swap the complete new checkpoint in.
    fs::remove_all(previous);
    if (fs::exists(final_dir)) {
      fs::rename(final_dir, previous);
    }
    fs::rename(temporary, final_dir);
    fs::remove_all(previous);
  } catch (const fs::filesystem_error& e) {
    TORCH_CHECK(false, "save_checkpoint: cannot write '", files.checkpoint_dir,
                "': ", e.what());
  }
}

std::vector<LossRecord> load_checkpoint(const RunFiles& files,
                                        torch::nn::Module& model,
                                        torch::optim::Optimizer& optimizer,
                                        const std::string& fingerprint) {
  TORCH_CHECK(fs::exists(files.trainer) && fs::exists(files.model),
              "no checkpoint to resume in '", files.checkpoint_dir,
              "' (it needs model.safetensors and trainer.pt)");
  const auto parameters = model.parameters();
  const auto device =
      parameters.empty() ? torch::Device(torch::kCPU) : parameters[0].device();
  torch::serialize::InputArchive archive;
  archive.load_from(files.trainer, device);

  c10::IValue saved_fingerprint;
  archive.read("fingerprint", saved_fingerprint);
  TORCH_CHECK(
      saved_fingerprint.toStringRef() == fingerprint, "the checkpoint in '",
      files.checkpoint_dir,
      "' is from a run with other settings (checkpoint vs now: ",
      fingerprint_difference(saved_fingerprint.toStringRef(), fingerprint),
      ")");

  load_state_dict(model, files.model, /*strict=*/true);

  torch::serialize::InputArchive optimizer_archive;
  archive.read("optimizer", optimizer_archive);
  optimizer.load(optimizer_archive);

  torch::Tensor rng_state, history;
  archive.read("rng_cpu", rng_state);
  archive.read("history", history);
  {
    auto generator = at::detail::getDefaultCPUGenerator();
    std::lock_guard<std::mutex> lock(generator.mutex());
    generator.set_state(rng_state.to(torch::kCPU));
  }
  c10::IValue step;
  archive.read("step", step);
  auto records = history_from_tensor(history);
  TORCH_CHECK(!records.empty() && records.back().step == step.toInt(),
              "load_checkpoint: the history in '", files.trainer,
              "' does not end at the checkpoint's step ", step.toInt());
  return records;
}

// ------------------------------------------------------- training loop ---

void validate(const TrainOptions& o) {
  TORCH_CHECK(o.steps() >= 1, "train: steps must be >= 1, but got ", o.steps());
  TORCH_CHECK(o.lr() > 0.0 && o.min_lr() >= 0.0 && o.min_lr() <= o.lr(),
              "train: need 0 <= min_lr <= lr and lr > 0, but got lr ", o.lr(),
              " and min_lr ", o.min_lr());
  TORCH_CHECK(o.warmup_steps() >= 0 && o.warmup_steps() <= o.steps(),
              "train: warmup_steps must be in [0, steps = ", o.steps(),
              "], but got ", o.warmup_steps());
  TORCH_CHECK(o.weight_decay() >= 0.0,
              "train: weight_decay must be >= 0, but got ", o.weight_decay());
  TORCH_CHECK(o.grad_clip() >= 0.0, "train: grad_clip must be >= 0, but got ",
              o.grad_clip());
  TORCH_CHECK(
      o.eval_every() >= 0 && o.checkpoint_every() >= 0 && o.stop_at() >= 0,
      "train: eval_every, checkpoint_every and stop_at must be >= 0, "
      "but got ",
      o.eval_every(), ", ", o.checkpoint_every(), " and ", o.stop_at());
  TORCH_CHECK(!o.resume() || !o.out_dir().empty(),
              "train: resume needs an out_dir holding a checkpoint");
}

namespace {

/// The options a resumed run must share with its checkpoint.
std::string options_fingerprint(const TrainOptions& o) {
  return printf_string(
      "steps=%lld lr=%s min_lr=%s warmup_steps=%lld weight_decay=%s "
      "grad_clip=%s",
      static_cast<long long>(o.steps()), exact_decimal(o.lr()).c_str(),
      exact_decimal(o.min_lr()).c_str(),
      static_cast<long long>(o.warmup_steps()),
      exact_decimal(o.weight_decay()).c_str(),
      exact_decimal(o.grad_clip()).c_str());
}

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start)
      .count();
}

}  // namespace

namespace {

/// The optimizer state and history that a resumed data-parallel run sends
/// from rank 0 to the others, as the bytes of a LibTorch archive.
std::string pack_trainer_state(torch::optim::Optimizer& optimizer,
                               const std::vector<LossRecord>& history) {
  torch::serialize::OutputArchive archive;
  torch::serialize::OutputArchive optimizer_archive;
  optimizer.save(optimizer_archive);
  archive.write("optimizer", optimizer_archive);
  archive.write("history", history_to_tensor(history));
  std::ostringstream out;
  archive.save_to(out);
  return out.str();
}

std::vector<LossRecord> unpack_trainer_state(const std::string& bytes,
                                             torch::optim::Optimizer& optimizer,
                                             torch::Device device) {
  torch::serialize::InputArchive archive;
  std::istringstream in(bytes);
  archive.load_from(in, device);
  torch::serialize::InputArchive optimizer_archive;
  archive.read("optimizer", optimizer_archive);
  optimizer.load(optimizer_archive);
  torch::Tensor history;
  archive.read("history", history);
  return history_from_tensor(history);
}

/// Restores `task.shard()` when it goes out of scope.
class ShardScope {
 public:
  ShardScope(TrainTask& task, const Shard& shard)
      : task_(task), saved_(task.shard()) {
    task_.set_shard(shard);
  }
  ~ShardScope() { task_.set_shard(saved_); }
  ShardScope(const ShardScope&) = delete;
  ShardScope& operator=(const ShardScope&) = delete;

 private:
  TrainTask& task_;
  Shard saved_;
};

/// Sums (loss sum, tokens) over the ranks of `group`; returns the pair
/// unchanged without a group.
LossSum all_reduce(distributed::ProcessGroup* group, const LossSum& local) {
  if (group == nullptr) {
    return local;
  }
  auto both = torch::tensor({local.sum, static_cast<double>(local.tokens)},
                            torch::kFloat64)
                  .to(group->device());  // (2)
  group->all_reduce_sum(both);
  return {both[0].item<double>(), static_cast<int64_t>(both[1].item<double>())};
}

}  // namespace

TrainResult train(TrainTask& task, const TrainOptions& options,
                  const ProgressCallback& on_progress,
                  distributed::ProcessGroup* group) {
  validate(options);
  const int64_t rank = group != nullptr ? group->rank() : 0;
  const int64_t world_size = group != nullptr ? group->world_size() : 1;
  TORCH_CHECK(task.batch_size() >= world_size, "train: the batch size (",
              task.batch_size(), ") must be >= the number of processes (",
              world_size, "): every rank needs at least one sequence");
  ShardScope shard_scope(task, Shard{rank, world_size});
  torch::nn::Module& model = task.model();
  auto optimizer = make_adamw(model, options.lr(), options.weight_decay());
  const LrSchedule schedule{options.lr(), options.min_lr(),
                            options.warmup_steps(), options.steps()};
  const std::string fingerprint =
      task.fingerprint() + " " + options_fingerprint(options);
  std::optional<RunFiles> files;  // rank 0 only
  if (!options.out_dir().empty() && rank == 0) {
    files.emplace(options.out_dir());
    std::error_code error;
    fs::create_directories(options.out_dir(), error);
    TORCH_CHECK(!error, "train: cannot create the directory '",
                options.out_dir(), "': ", error.message());
  }

  TrainResult result;
  if (group == nullptr) {
    if (options.resume()) {
      result.history = load_checkpoint(*files, model, *optimizer, fingerprint);
    }
  } else {
    // Rank 0 reads the checkpoint (if resuming) and every rank starts from
    // its weights, optimizer state and history.
    if (options.resume()) {
      std::string state, failure;
      if (rank == 0) {
        try {
          result.history =
              load_checkpoint(*files, model, *optimizer, fingerprint);
          state = pack_trainer_state(*optimizer, result.history);
        } catch (const c10::Error& e) {
          failure = e.what_without_backtrace();
        }
      }
      // An empty state tells the other ranks that rank 0 failed.
      state = group->broadcast_bytes(state);
      TORCH_CHECK(rank != 0 || failure.empty(), failure);
      TORCH_CHECK(!state.empty(),
                  "train: rank 0 could not resume from its "
                  "checkpoint (its own message says why)");
      if (rank != 0) {
        const auto parameters = model.parameters();
        result.history =
            unpack_trainer_state(state, *optimizer,
                                 parameters.empty() ? torch::Device(torch::kCPU)
                                                    : parameters[0].device());
      }
    }
    distributed::broadcast_module(*group, model);
    if (rank != 0) {
      const uint64_t base = at::detail::getDefaultCPUGenerator().current_seed();
      torch::manual_seed(
          derive_seed(derive_seed(base, rank, SeedStream::kRankDropout),
                      result.history.empty() ? 0 : result.history.back().step,
                      SeedStream::kRankDropout));
    }
  }
  std::optional<distributed::GradientSynchronizer> synchronizer;
  if (group != nullptr) {
    synchronizer.emplace(*group, model,
                         distributed::GradientSyncOptions().reduction(
                             distributed::GradientReduction::kSum));
  }

  const int64_t first =
      result.history.empty() ? 1 : result.history.back().step + 1;
  const int64_t last = options.stop_at() > 0
                           ? std::min(options.stop_at(), options.steps())
                           : options.steps();
  const double elapsed_before =
      result.history.empty() ? 0.0 : result.history.back().elapsed_s;
  result.first_step = first;
  result.last_step = first - 1;

  const auto run_start = std::chrono::steady_clock::now();
  double train_seconds = 0.0;
  int64_t tokens = 0;
  model.train();
  for (int64_t step = first; step <= last; ++step) {
    const auto step_start = std::chrono::steady_clock::now();

    // One optimisation step: the scheduled learning rate, the loss of this
    // step's batch, its gradient (clipped), an AdamW update.
    const double lr = schedule.at(step);
    set_learning_rate(*optimizer, lr);
    optimizer->zero_grad();
    BatchLoss batch = task.training_loss(step);
    LossRecord record;
    record.step = step;
    record.lr = lr;
    int64_t step_tokens = batch.tokens;
    if (group == nullptr) {
      batch.loss.backward();
      record.train_loss = batch.loss.item<double>();  // waits for the step
    } else {
      // This rank's share of the global mean: its tokens' summed loss over
      // the tokens of every rank; the gradients are then summed.
      const double local_loss = batch.loss.item<double>();
      const LossSum global = all_reduce(
          group,
          {local_loss * static_cast<double>(batch.tokens), batch.tokens});
      step_tokens = global.tokens;
      record.train_loss = global.mean();
      (batch.loss * (static_cast<double>(batch.tokens) /
                     static_cast<double>(std::max<int64_t>(global.tokens, 1))))
          .backward();
      synchronizer->synchronize();
    }
    TORCH_CHECK(std::isfinite(record.train_loss), "train: the loss at step ",
                step, " is ", record.train_loss,
                " (training diverged; try a smaller lr)");
    if (options.grad_clip() > 0.0) {
      torch::nn::utils::clip_grad_norm_(model.parameters(),
                                        options.grad_clip());
    }
    optimizer->step();

    const double step_seconds = seconds_since(step_start);
    train_seconds += step_seconds;
    tokens += step_tokens;
    record.tokens_per_s = step_tokens / std::max(step_seconds, 1e-9);

    // Validation on schedule and at the end of the run's schedule (not at
    // stop_at, so that an interrupted and resumed run records the same).
    if (step == options.steps() ||
        (options.eval_every() > 0 && step % options.eval_every() == 0)) {
      record.val_loss = all_reduce(group, task.validation_loss_sum()).mean();
      result.val_loss = record.val_loss;
    }
    record.elapsed_s = elapsed_before + seconds_since(run_start);
    result.history.push_back(record);
    result.last_step = step;

    const bool save =
        files && (step == last || (options.checkpoint_every() > 0 &&
                                   step % options.checkpoint_every() == 0));
    if (save) {
      save_checkpoint(*files, model, *optimizer, result.history, fingerprint);
      write_loss_csv(result.history, files->loss_csv);
      write_loss_svg(result.history, task.name(), files->loss_svg);
    }

    if (on_progress) {
      Progress progress;
      progress.step = step;
      progress.steps = options.steps();
      progress.loss = record.train_loss;
      progress.lr = lr;
      progress.tokens_per_s = tokens / std::max(train_seconds, 1e-9);
      progress.elapsed_s = record.elapsed_s;
      const double run_seconds = seconds_since(run_start);
      progress.eta_s = run_seconds / static_cast<double>(step - first + 1) *
                       static_cast<double>(last - step);
      if (!std::isnan(record.val_loss)) {
        progress.val_loss = record.val_loss;
      }
      progress.checkpointed = save;
      on_progress(progress);
    }
  }
  return result;
}

// --------------------------------------------------------------- progress ---

ProgressThrottle::ProgressThrottle(bool interactive, int64_t steps,
                                   double min_interval_s, int64_t max_lines)
    : interactive_(interactive),
      steps_(steps),
      min_interval_s_(min_interval_s),
      every_(
          std::max<int64_t>(1, (steps + std::max<int64_t>(max_lines, 1) - 1) /
                                   std::max<int64_t>(max_lines, 1))) {}

bool ProgressThrottle::should_show(const Progress& progress, double now_s) {
  bool show;
  if (progress.step >= steps_ || progress.val_loss || progress.checkpointed) {
    show = true;
  } else if (interactive_) {
    show = now_s - last_shown_s_ >= min_interval_s_;
  } else {
    show = progress.step % every_ == 0;
  }
  if (show) {
    last_shown_s_ = now_s;
  }
  return show;
}

std::string format_duration(double seconds) {
  const auto s = static_cast<long long>(std::llround(std::max(seconds, 0.0)));
  if (s < 60) {
    return printf_string("%llds", s);
  }
  if (s < 3600) {
    return printf_string("%lldm%02llds", s / 60, s % 60);
  }
  return printf_string("%lldh%02lldm", s / 3600, (s % 3600) / 60);
}

std::string format_progress(const Progress& p) {
  const int width = static_cast<int>(std::to_string(p.steps).size());
  const double rate = p.tokens_per_s;
  const std::string tokens =
      rate >= 1e6 ? printf_string("%.2fM", rate / 1e6)
                  : (rate >= 1e3 ? printf_string("%.1fk", rate / 1e3)
                                 : printf_string("%.0f", rate));
  std::string line = printf_string(
      "step %*lld/%lld | loss %.4f | lr %.2e | %s tok/s | ETA %s", width,
      static_cast<long long>(p.step), static_cast<long long>(p.steps), p.loss,
      p.lr, tokens.c_str(), format_duration(p.eta_s).c_str());
  if (p.val_loss) {
    line += printf_string(" | val %.4f", *p.val_loss);
  }
  if (p.checkpointed) {
    line += " | saved";
  }
  return line;
}

}  // namespace mha::train

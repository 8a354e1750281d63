// The encoder–decoder toy task's data and model: addition batches,
// Seq2SeqTransformer (embeddings + mha::Transformer + head), greedy decoding
// through the decoder's cache or by recomputation, and exact-match counts.
// Glossary: N batch, S source length, T target length, E model width, V
// vocabulary size.
#include "mha/train/seq2seq.h"

#include <algorithm>
#include <random>
#include <utility>
#include <vector>

#include "common.h"

namespace mha::train {

using detail::int64_tensor;
using detail::uniform_below;

// ------------------------------------------------------------------ data ---

namespace {

/// The digits of `value`, most significant first ("0" for 0).
std::vector<int64_t> digits_of(uint64_t value) {
  std::vector<int64_t> digits;
  do {
    digits.push_back(static_cast<int64_t>(value % 10));
    value /= 10;
  } while (value > 0);
  std::reverse(digits.begin(), digits.end());
  return digits;
}

/// An operand: its digit count uniform in [min_digits, max_digits], then
/// uniform among the numbers with that many digits.
uint64_t draw_operand(std::mt19937_64& rng, const AdditionDataOptions& o) {
  const int64_t n =
      o.min_digits() + uniform_below(rng, o.max_digits() - o.min_digits() + 1);
  if (n == 1) {
    return static_cast<uint64_t>(uniform_below(rng, 10));
  }
  int64_t low = 1;
  for (int64_t i = 1; i < n; ++i) {
    low *= 10;
  }
  return static_cast<uint64_t>(low + uniform_below(rng, 9 * low));
}

}  // namespace

Seq2SeqBatch make_addition_batch(const AdditionDataOptions& options,
                                 int64_t batch_size, uint64_t seed) {
  TORCH_CHECK(batch_size >= 1,
              "make_addition_batch: batch_size must be >= 1, but got ",
              batch_size);
  TORCH_CHECK(options.min_digits() >= 1 &&
                  options.min_digits() <= options.max_digits() &&
                  options.max_digits() <= 18,
              "make_addition_batch: need 1 <= min_digits <= max_digits <= 18, "
              "but got min_digits ",
              options.min_digits(), " and max_digits ", options.max_digits());
  std::mt19937_64 rng(seed);
  const int64_t N = batch_size, S = options.source_length(),
                T = options.target_length();
  std::vector<int64_t> src(N * S, kAddPadToken);
  std::vector<int64_t> tgt_input(N * T, kAddPadToken);
  std::vector<int64_t> target(N * T, kIgnoreIndex);
  int64_t tokens = 0;
  for (int64_t n = 0; n < N; ++n) {
    const uint64_t a = draw_operand(rng, options);
    const uint64_t b = draw_operand(rng, options);
    // Source: a in positions [0, D) and b in [D + 1, 2D + 1), each
    // right-aligned (padding on the left), '+' at D between them.
    const auto a_digits = digits_of(a);
    const auto b_digits = digits_of(b);
    const int64_t D = options.max_digits();
    auto* row = src.data() + n * S;
    std::copy(a_digits.begin(), a_digits.end(),
              row + D - static_cast<int64_t>(a_digits.size()));
    row[D] = kAddPlusToken;
    std::copy(b_digits.begin(), b_digits.end(),
              row + S - static_cast<int64_t>(b_digits.size()));
    // Target: the sum's digits least significant first, then EOS; the
    // decoder input is BOS followed by the target without its EOS.
    auto sum = digits_of(a + b);
    std::reverse(sum.begin(), sum.end());
    sum.push_back(kAddEosToken);
    tgt_input[n * T] = kAddBosToken;
    std::copy(sum.begin(), sum.end() - 1, tgt_input.begin() + n * T + 1);
    std::copy(sum.begin(), sum.end(), target.begin() + n * T);
    tokens += static_cast<int64_t>(sum.size());
  }
  Seq2SeqBatch batch;
  batch.src = int64_tensor(std::move(src), {N, S});              // (N, S)
  batch.src_padding = batch.src == kAddPadToken;                 // (N, S)
  batch.tgt_input = int64_tensor(std::move(tgt_input), {N, T});  // (N, T)
  batch.target = int64_tensor(std::move(target), {N, T});        // (N, T)
  batch.tokens = tokens;
  return batch;
}

std::string addition_text(const torch::Tensor& row) {
  TORCH_CHECK(row.dim() == 1, "addition_text: row must be 1-D, but got ",
              row.sizes());
  const auto ids = row.to(torch::kCPU, torch::kInt64).contiguous();
  std::string text;
  for (int64_t i = 0; i < ids.size(0); ++i) {
    const int64_t id = ids[i].item<int64_t>();
    if (id == kAddEosToken || id == kIgnoreIndex) {
      break;
    }
    if (id == kAddPadToken) {
      continue;
    }
    text.push_back(id >= 0 && id <= 9 ? static_cast<char>('0' + id)
                                      : (id == kAddPlusToken ? '+' : '?'));
  }
  return text;
}

// ----------------------------------------------------------------- model ---

Seq2SeqTransformerImpl::Seq2SeqTransformerImpl(
    const Seq2SeqTransformerOptions& options_)
    : options(options_) {
  reset();
}

void Seq2SeqTransformerImpl::reset() {
  const auto& o = options;
  TORCH_CHECK(
      o.vocab_size() >= 1 && o.max_src_len() >= 1 && o.max_tgt_len() >= 1,
      "Seq2SeqTransformer: vocab_size, max_src_len and max_tgt_len "
      "must be >= 1, but got ",
      o.vocab_size(), ", ", o.max_src_len(), " and ", o.max_tgt_len());
  TORCH_CHECK(o.num_encoder_layers() >= 1 && o.num_decoder_layers() >= 1,
              "Seq2SeqTransformer: num_encoder_layers and num_decoder_layers "
              "must be >= 1, but got ",
              o.num_encoder_layers(), " and ", o.num_decoder_layers());
  const int64_t E = o.d_model();
  tok_emb = register_module("tok_emb", torch::nn::Embedding(o.vocab_size(), E));
  src_pos =
      register_module("src_pos", torch::nn::Embedding(o.max_src_len(), E));
  tgt_pos =
      register_module("tgt_pos", torch::nn::Embedding(o.max_tgt_len(), E));
  // Transformer checks d_model, nhead, dim_feedforward and dropout.
  transformer = register_module(
      "transformer",
      Transformer(TransformerOptions(E, o.nhead(), o.num_encoder_layers(),
                                     o.num_decoder_layers())
                      .dim_feedforward(o.dim_feedforward())
                      .dropout(o.dropout())
                      .norm_first(true)));
  head = register_module("head", torch::nn::Linear(E, o.vocab_size()));
}

namespace {

void check_tokens(const char* name, const torch::Tensor& ids, int64_t max_len) {
  TORCH_CHECK(ids.dim() == 2 && ids.size(1) >= 1 && ids.size(1) <= max_len &&
                  ids.scalar_type() == torch::kInt64,
              "Seq2SeqTransformer: ", name,
              " must be (N, L) int64 with 1 <= L <= ", max_len,
              ", but got shape ", ids.sizes(), " and dtype ",
              ids.scalar_type());
}

}  // namespace

torch::Tensor Seq2SeqTransformerImpl::encode(const torch::Tensor& src,
                                             const torch::Tensor& src_padding) {
  check_tokens("src", src, options.max_src_len());
  auto positions = torch::arange(src.size(1), src.options());  // (S)
  auto x = tok_emb(src) + src_pos(positions);  // (N, S, E) + (S, E)
  return transformer->encode(x, /*src_mask=*/{},
                             /*src_key_padding_mask=*/src_padding);  // (N,S,E)
}

torch::Tensor Seq2SeqTransformerImpl::forward(const torch::Tensor& src,
                                              const torch::Tensor& src_padding,
                                              const torch::Tensor& tgt) {
  check_tokens("src", src, options.max_src_len());
  check_tokens("tgt", tgt, options.max_tgt_len());
  TORCH_CHECK(src.size(0) == tgt.size(0),
              "Seq2SeqTransformer: src and tgt must have the same batch size, "
              "but got src ",
              src.sizes(), " and tgt ", tgt.sizes());
  auto src_positions = torch::arange(src.size(1), src.options());  // (S)
  auto tgt_positions = torch::arange(tgt.size(1), tgt.options());  // (T)
  auto x = tok_emb(src) + src_pos(src_positions);  // (N, S, E) + (S, E)
  auto y = tok_emb(tgt) + tgt_pos(tgt_positions);  // (N, T, E) + (T, E)
  y = transformer->forward(x, y, /*src_mask=*/{}, /*tgt_mask=*/{},
                           /*memory_mask=*/{},
                           /*src_key_padding_mask=*/src_padding,
                           /*tgt_key_padding_mask=*/{},
                           /*memory_key_padding_mask=*/src_padding,
                           /*src_is_causal=*/false, /*tgt_is_causal=*/true,
                           /*memory_is_causal=*/false);  // (N, T, E)
  return head(y);                                        // (N, T, V)
}

torch::Tensor Seq2SeqTransformerImpl::forward_cached(
    const torch::Tensor& tgt, TransformerDecoderCache& cache) {
  const int64_t start = cache.size();
  check_tokens("tgt", tgt, options.max_tgt_len() - start);
  auto positions = torch::arange(start, start + tgt.size(1),
                                 tgt.options());       // (T)
  auto y = tok_emb(tgt) + tgt_pos(positions);          // (N, T, E) + (T, E)
  return head(transformer->forward_cached(y, cache));  // (N, T, V)
}

torch::Tensor greedy_decode(Seq2SeqTransformer& model, const torch::Tensor& src,
                            const torch::Tensor& src_padding, int64_t bos,
                            int64_t eos, int64_t max_len, bool use_cache) {
  TORCH_CHECK(max_len >= 1 && max_len <= model->options.max_tgt_len(),
              "greedy_decode: max_len must be in [1, max_tgt_len = ",
              model->options.max_tgt_len(), "], but got ", max_len);
  torch::NoGradGuard no_grad;
  const bool was_training = model->is_training();
  model->eval();
  const int64_t N = src.size(0);
  auto tokens = torch::full({N, 1}, bos, src.options());  // (N, 1): BOS
  auto done = torch::zeros({N}, src.options().dtype(torch::kBool));  // (N)
  TransformerDecoderCache cache;
  if (use_cache) {
    cache = model->transformer->make_cache(model->encode(src, src_padding),
                                           max_len, src_padding);
  }
  for (int64_t t = 0; t < max_len; ++t) {
    auto logits = use_cache
                      ? model->forward_cached(tokens.narrow(1, t, 1), cache)
                      : model->forward(src, src_padding, tokens);  // (N, ·, V)
    auto next = logits.select(1, logits.size(1) - 1).argmax(-1);   // (N)
    next = torch::where(done, torch::full_like(next, eos), next);  // (N)
    tokens = torch::cat({tokens, next.unsqueeze(1)}, 1);           // (N, t + 2)
    done = done | (next == eos);
    if (done.all().item<bool>()) {
      break;
    }
  }
  model->train(was_training);
  return tokens.narrow(1, 1, tokens.size(1) - 1);  // (N, T'): without BOS
}

Seq2SeqMatches count_matches(const torch::Tensor& decoded,
                             const torch::Tensor& target, int64_t eos) {
  TORCH_CHECK(decoded.dim() == 2 && target.dim() == 2 &&
                  decoded.size(0) == target.size(0) &&
                  decoded.size(1) <= target.size(1),
              "count_matches: decoded must be (N, T') and target (N, T) with "
              "T' <= T, but got decoded ",
              decoded.sizes(), " and target ", target.sizes());
  const int64_t N = target.size(0), T = target.size(1);
  auto filled = torch::full({N, T}, eos, target.options());  // (N, T)
  filled.narrow(1, 0, decoded.size(1)).copy_(decoded);
  auto real = target != kIgnoreIndex;      // (N, T)
  auto right = (filled == target) & real;  // (N, T)
  Seq2SeqMatches matches;
  matches.sequences = N;
  matches.exact = (right | real.logical_not())
                      .all(/*dim=*/1)
                      .sum()
                      .item<int64_t>();  // (N) → ()
  matches.tokens = real.sum().item<int64_t>();
  matches.correct_tokens = right.sum().item<int64_t>();
  return matches;
}

}  // namespace mha::train

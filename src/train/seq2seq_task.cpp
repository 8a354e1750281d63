// The addition task (AdditionTask): teacher-forced batches and losses,
// validation, held-out accuracy by greedy decoding, and its fingerprint.
// Glossary: N batch, S source length, T target length, V vocabulary size.
#include <algorithm>
#include <sstream>

#include "common.h"
#include "mha/train/seq2seq.h"

namespace mha::train {

using detail::exact_decimal;
using detail::masked_cross_entropy_sum;
using detail::printf_string;

namespace {

constexpr int64_t kValidationExamples = 500;

/// Rows [first, first + count) of every tensor of `batch`, on `device`.
Seq2SeqBatch rows_of(const Seq2SeqBatch& batch, int64_t first, int64_t count,
                     torch::Device device) {
  auto rows = [&](const torch::Tensor& t) {
    return t.narrow(0, first, count).to(device);  // (count, ·)
  };
  Seq2SeqBatch part;
  part.src = rows(batch.src);                  // (count, S)
  part.src_padding = rows(batch.src_padding);  // (count, S)
  part.tgt_input = rows(batch.tgt_input);      // (count, T)
  part.target = rows(batch.target);            // (count, T)
  part.tokens = (part.target != kIgnoreIndex).sum().item<int64_t>();
  return part;
}

}  // namespace

AdditionTask::AdditionTask(const AdditionDataOptions& data,
                           const Seq2SeqTransformerOptions& model_options,
                           int64_t batch_size, uint64_t seed,
                           torch::Device device)
    : data_(data),
      batch_size_(batch_size),
      seed_(seed),
      device_(device),
      model_(nullptr) {
  TORCH_CHECK(batch_size >= 1,
              "AdditionTask: batch_size must be >= 1, but got ", batch_size);
  TORCH_CHECK(model_options.vocab_size() == kAddVocabSize,
              "AdditionTask: the model's vocab_size must be kAddVocabSize (",
              kAddVocabSize, "), but got ", model_options.vocab_size());
  TORCH_CHECK(model_options.max_src_len() >= data.source_length() &&
                  model_options.max_tgt_len() >= data.target_length(),
              "AdditionTask: the model's max_src_len and max_tgt_len must be "
              ">= the data's source and target lengths (",
              data.source_length(), " and ", data.target_length(),
              " for max_digits ", data.max_digits(), "), but got ",
              model_options.max_src_len(), " and ",
              model_options.max_tgt_len());
  // The held-out data first: it checks the data options.
  val_batch_ = held_out(kValidationExamples);
  torch::manual_seed(derive_seed(seed, 0, SeedStream::kModelInit));
  model_ = Seq2SeqTransformer(model_options);
  model_->to(device_);
}

Seq2SeqBatch AdditionTask::held_out(int64_t num_examples) const {
  return make_addition_batch(data_, num_examples,
                             derive_seed(seed_, 0, SeedStream::kEvalData));
}

std::string AdditionTask::name() const {
  return printf_string("add numbers of %lld-%lld digits (encoder-decoder)",
                       static_cast<long long>(data_.min_digits()),
                       static_cast<long long>(data_.max_digits()));
}

BatchLoss AdditionTask::training_loss(int64_t step) {
  const auto batch = make_addition_batch(
      data_, batch_size_, derive_seed(seed_, step, SeedStream::kTrainData));
  const auto [first, last] = shard().rows(batch_size_);
  const auto part = rows_of(batch, first, last - first, device_);
  auto logits = model_(part.src, part.src_padding, part.tgt_input);  // (n,T,V)
  return {masked_cross_entropy(logits, part.target), part.tokens};
}

LossSum AdditionTask::validation_loss_sum() {
  const auto [first, last] = shard().rows(val_batch_.src.size(0));
  if (first == last) {
    return {};
  }
  torch::NoGradGuard no_grad;
  model_->eval();
  const auto part = rows_of(val_batch_, first, last - first, device_);
  auto logits = model_(part.src, part.src_padding, part.tgt_input);  // (n,T,V)
  const auto [summed, tokens] = masked_cross_entropy_sum(logits, part.target);
  model_->train();
  return {summed.item<double>(), tokens.item<int64_t>()};
}

Seq2SeqMatches AdditionTask::accuracy(int64_t num_examples, bool use_cache) {
  TORCH_CHECK(num_examples >= 1,
              "AdditionTask::accuracy: num_examples must be >= 1, but got ",
              num_examples);
  const auto examples = held_out(num_examples);
  Seq2SeqMatches total;
  constexpr int64_t kChunk = 1000;
  for (int64_t begin = 0; begin < num_examples; begin += kChunk) {
    const int64_t n = std::min(kChunk, num_examples - begin);
    const auto part = rows_of(examples, begin, n, device_);
    auto decoded = greedy_decode(model_, part.src, part.src_padding,
                                 kAddBosToken, kAddEosToken,
                                 data_.target_length(), use_cache);  // (n, T')
    const auto matches = count_matches(decoded, part.target, kAddEosToken);
    total.sequences += matches.sequences;
    total.exact += matches.exact;
    total.tokens += matches.tokens;
    total.correct_tokens += matches.correct_tokens;
  }
  return total;
}

std::string AdditionTask::examples(int64_t count) {
  TORCH_CHECK(count >= 1,
              "AdditionTask::examples: count must be >= 1, but got ", count);
  const auto part = rows_of(held_out(count), 0, count, device_);
  auto decoded = greedy_decode(model_, part.src, part.src_padding, kAddBosToken,
                               kAddEosToken, data_.target_length())
                     .cpu();  // (count, T')
  // The answers are written least significant digit first: read them back.
  auto normal = [](std::string reversed) {
    std::reverse(reversed.begin(), reversed.end());
    return reversed;
  };
  std::ostringstream out;
  for (int64_t i = 0; i < count; ++i) {
    out << addition_text(part.src[i]) << " = "
        << normal(addition_text(part.target[i]))
        << " (model: " << normal(addition_text(decoded[i])) << ")\n";
  }
  return out.str();
}

std::string AdditionTask::fingerprint() const {
  const auto& m = model_->options;
  return printf_string(
      "task=add min_digits=%lld max_digits=%lld d_model=%lld nhead=%lld "
      "num_encoder_layers=%lld num_decoder_layers=%lld dim_feedforward=%lld "
      "dropout=%s max_src_len=%lld max_tgt_len=%lld batch_size=%lld "
      "seed=%llu",
      static_cast<long long>(data_.min_digits()),
      static_cast<long long>(data_.max_digits()),
      static_cast<long long>(m.d_model()), static_cast<long long>(m.nhead()),
      static_cast<long long>(m.num_encoder_layers()),
      static_cast<long long>(m.num_decoder_layers()),
      static_cast<long long>(m.dim_feedforward()),
      exact_decimal(m.dropout()).c_str(),
      static_cast<long long>(m.max_src_len()),
      static_cast<long long>(m.max_tgt_len()),
      static_cast<long long>(batch_size_),
      static_cast<unsigned long long>(seed_));
}

}  // namespace mha::train

// The training tasks: TrainTask and its shards, the digit task and the
// character language model task (batches, losses, fingerprints, samples,
// attention maps).
// Glossary: N batch, L sequence length (digit tasks), T context length (the
// character model), E model width, V vocabulary size, C classes.
#include "mha/train/tasks.h"

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <string>
#include <utility>

#include "common.h"
#include "mha/plot.h"

namespace mha::train {

namespace F = torch::nn::functional;
using detail::exact_decimal;
using detail::fnv1a;
using detail::masked_cross_entropy_sum;
using detail::printf_string;

// ------------------------------------------------------------ tasks ---

namespace {

/// " attention=linear" (and Linformer's k) for a kind other than softmax,
/// "" for softmax: the fingerprints of softmax models stay as they were.
std::string attention_suffix(AttentionKind kind, int64_t projected_length) {
  if (kind == AttentionKind::kSoftmax) {
    return "";
  }
  return std::string(" attention=") + to_string(kind) +
         (kind == AttentionKind::kLinformer
              ? " projected_length=" + std::to_string(projected_length)
              : "");
}

}  // namespace

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
      "seed=%llu%s",
      data_.rule() == DigitRule::kReverse ? "reverse" : "sort",
      static_cast<long long>(data_.min_len()),
      static_cast<long long>(data_.max_len()),
      static_cast<long long>(m.d_model()), static_cast<long long>(m.nhead()),
      static_cast<long long>(m.num_layers()),
      static_cast<long long>(m.dim_feedforward()),
      exact_decimal(m.dropout()).c_str(), static_cast<long long>(batch_size_),
      static_cast<unsigned long long>(seed_),
      attention_suffix(m.attention_kind(), m.projected_length()).c_str());
}

CharLMTask::CharLMTask(CharCorpus corpus, const CharLMOptions& model_options,
                       int64_t batch_size, uint64_t seed, torch::Device device,
                       const CharDocumentOptions& documents)
    : corpus_(std::move(corpus)),
      batch_size_(batch_size),
      seed_(seed),
      device_(device),
      documents_(documents),
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
  const int64_t T = model_options.block_size();
  if (documents_.min_len() == 0) {
    documents_.min_len(std::max<int64_t>(1, T / 8));
  }
  if (documents_.max_len() == 0) {
    documents_.max_len(T);
  }
  TORCH_CHECK(1 <= documents_.min_len() &&
                  documents_.min_len() <= documents_.max_len() &&
                  documents_.max_len() <= T,
              "CharLMTask: document lengths must satisfy 1 <= min_len <= "
              "max_len <= block_size = ",
              T, ", but got min_len ", documents_.min_len(), " and max_len ",
              documents_.max_len());
  TORCH_CHECK(documents_.block() >= 1,
              "CharLMTask: the documents' block must be >= 1, but got ",
              documents_.block());
  torch::manual_seed(derive_seed(seed, 0, SeedStream::kModelInit));
  model_ = CharLM(model_options);
  model_->to(device_);
}

std::string CharLMTask::name() const {
  const auto batching = documents_.batching();
  return printf_string(
      "character language model (%lld characters%s)",
      static_cast<long long>(corpus_.train.size(0) + corpus_.val.size(0)),
      batching == CharBatching::kPacked   ? ", packed documents"
      : batching == CharBatching::kPadded ? ", padded documents"
                                          : "");
}

PackedCharBatch CharLMTask::documents_of_step(int64_t step) const {
  return sample_packed_char_batch(
      corpus_.train, batch_size_, model_->options.block_size(),
      documents_.min_len(), documents_.max_len(),
      derive_seed(seed_, step, SeedStream::kTrainData));
}

BatchLoss CharLMTask::document_loss(const PackedCharBatch& batch, bool padded) {
  torch::Tensor logits, target;  // (rows, T, V), (rows, T)
  if (padded) {
    const auto rows = pad_documents(batch);  // one document a row
    logits = model_->forward(rows.input.to(device_), /*positions=*/{},
                             /*block_mask=*/{}, rows.padding.to(device_));
    target = rows.target.to(device_);
  } else {
    const auto mask =
        packed_documents_block_mask(batch.lengths, documents_.block());
    logits = model_->forward(batch.input.to(device_),
                             batch.positions.to(device_), mask);
    target = batch.target.to(device_);
  }
  return {masked_cross_entropy(logits, target), batch.predicted()};
}

LayoutThroughput CharLMTask::compare_document_layouts(int64_t batches) {
  TORCH_CHECK(batches >= 1,
              "CharLMTask::compare_document_layouts: batches must be >= 1, "
              "but got ",
              batches);
  model_->train();
  // Forward and backward of one layout; the gradients are dropped. Reading
  // a gradient waits for an accelerator to finish.
  auto run = [&](const PackedCharBatch& batch, bool padded) {
    const auto start = std::chrono::steady_clock::now();
    document_loss(batch, padded).loss.backward();
    model_->wte->weight.grad().view({-1})[0].item<float>();
    const std::chrono::duration<double> seconds =
        std::chrono::steady_clock::now() - start;
    model_->zero_grad();
    return seconds.count();
  };
  {
    const auto warm_up = documents_of_step(1);
    run(warm_up, false);
    run(warm_up, true);
  }
  LayoutThroughput result;
  double packed_s = 0.0, padded_s = 0.0;
  for (int64_t step = 1; step <= batches; ++step) {
    const auto batch = documents_of_step(step);
    packed_s += run(batch, /*padded=*/false);
    padded_s += run(batch, /*padded=*/true);
    int64_t longest = 0;
    for (const auto& row : batch.lengths) {
      longest = std::max(longest, row.max().item<int64_t>());
    }
    result.tokens += batch.input.numel();
    result.documents += batch.documents();
    result.padded_positions += batch.documents() * longest;
  }
  result.batches = batches;
  const auto tokens = static_cast<double>(result.tokens);
  result.packed_tokens_per_s = tokens / std::max(packed_s, 1e-9);
  result.padded_tokens_per_s = tokens / std::max(padded_s, 1e-9);
  return result;
}

BatchLoss CharLMTask::training_loss(int64_t step) {
  if (documents_.batching() != CharBatching::kWindows) {
    const auto [first, last] = shard().rows(batch_size_);
    return document_loss(documents_of_step(step).rows(first, last - first),
                         documents_.batching() == CharBatching::kPadded);
  }
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
  auto fingerprint = printf_string(
      "task=charlm text_chars=%lld val_chars=%lld text_fnv1a=%016llx "
      "block_size=%lld n_embd=%lld n_head=%lld n_layer=%lld dropout=%s "
      "positions=%s batch_size=%lld seed=%llu%s",
      static_cast<long long>(corpus_.train.size(0) + corpus_.val.size(0)),
      static_cast<long long>(corpus_.val.size(0)),
      static_cast<unsigned long long>(fnv1a(
          corpus_.vocab.decode(torch::cat({corpus_.train, corpus_.val})))),
      static_cast<long long>(m.block_size()),
      static_cast<long long>(m.n_embd()), static_cast<long long>(m.n_head()),
      static_cast<long long>(m.n_layer()), exact_decimal(m.dropout()).c_str(),
      m.rotary() ? "rotary" : "learned", static_cast<long long>(batch_size_),
      static_cast<unsigned long long>(seed_),
      attention_suffix(m.attention_kind(), 0).c_str());
  // Windows add nothing: their checkpoints stay resumable.
  const auto batching = documents_.batching();
  if (batching != CharBatching::kWindows) {
    fingerprint +=
        printf_string(" documents=%s min_len=%lld max_len=%lld",
                      batching == CharBatching::kPacked ? "packed" : "padded",
                      static_cast<long long>(documents_.min_len()),
                      static_cast<long long>(documents_.max_len()));
  }
  if (batching == CharBatching::kPacked) {
    fingerprint += printf_string(" block=%lld",
                                 static_cast<long long>(documents_.block()));
  }
  return fingerprint;
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

}  // namespace mha::train

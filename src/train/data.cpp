// Training data: derive_seed, the digit sequence batches, and character
// data (vocabulary, corpus split, unigram baseline, random windows).
// Glossary: N batch, L sequence length (digit tasks), T context length (the
// character model), E model width, V vocabulary size, C classes.
#include "mha/train/data.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <fstream>
#include <iterator>
#include <random>
#include <utility>

#include "common.h"

namespace mha::train {

using detail::int64_tensor;
using detail::splitmix64;
using detail::uniform_below;

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

// ---------------------------------------------------- packed documents ---

PackedCharBatch PackedCharBatch::rows(int64_t first, int64_t count) const {
  TORCH_CHECK(first >= 0 && count >= 0 && first + count <= input.size(0),
              "PackedCharBatch::rows: rows [", first, ", ", first + count,
              ") are outside the batch's ", input.size(0));
  PackedCharBatch part;
  part.input = input.narrow(0, first, count);
  part.target = target.narrow(0, first, count);
  part.positions = positions.narrow(0, first, count);
  part.lengths.assign(lengths.begin() + first, lengths.begin() + first + count);
  return part;
}

int64_t PackedCharBatch::documents() const {
  int64_t count = 0;
  for (const auto& row : lengths) {
    count += row.numel();
  }
  return count;
}

int64_t PackedCharBatch::predicted() const {
  return input.numel() - documents();
}

PackedCharBatch sample_packed_char_batch(const torch::Tensor& data,
                                         int64_t rows, int64_t context,
                                         int64_t min_len, int64_t max_len,
                                         uint64_t seed) {
  TORCH_CHECK(rows >= 1,
              "sample_packed_char_batch: rows must be >= 1, but got ", rows);
  TORCH_CHECK(data.dim() == 1 && data.size(0) > context && context >= 1,
              "sample_packed_char_batch: data must be 1-D and longer than "
              "the context ",
              context, ", but got ", data.sizes());
  TORCH_CHECK(1 <= min_len && min_len <= max_len && max_len <= context,
              "sample_packed_char_batch: need 1 <= min_len <= max_len <= "
              "context = ",
              context, ", but got min_len ", min_len, " and max_len ", max_len);
  std::mt19937_64 rng(seed);
  const int64_t N = rows, T = context, size = data.size(0);
  // Per character: where it is in the text, whether it ends its document,
  // and its position in the document.
  std::vector<int64_t> at, position;
  std::vector<uint8_t> last;
  at.reserve(N * T);
  position.reserve(N * T);
  last.reserve(N * T);
  PackedCharBatch batch;
  for (int64_t row = 0; row < N; ++row) {
    std::vector<int64_t> row_lengths;
    for (int64_t filled = 0; filled < T;) {
      const int64_t drawn = min_len + uniform_below(rng, max_len - min_len + 1);
      const int64_t length = std::min(drawn, T - filled);  // cut at the end
      const int64_t offset = uniform_below(rng, size - length + 1);
      for (int64_t i = 0; i < length; ++i) {
        at.push_back(offset + i);
        position.push_back(i);
        last.push_back(i == length - 1 ? 1 : 0);
      }
      row_lengths.push_back(length);
      filled += length;
    }
    const auto docs = static_cast<int64_t>(row_lengths.size());
    batch.lengths.push_back(int64_tensor(std::move(row_lengths), {docs}));
  }
  auto index = int64_tensor(at, {N * T});  // (N*T)
  auto ends = torch::from_blob(last.data(), {N * T}, torch::kUInt8)
                  .to(torch::kBool);  // (N*T): a document's last character
  batch.input = data.index_select(0, index).view({N, T});
  // The next character of the text, except after a document's last one
  // (which may be the text's last: clamped, then ignored).
  batch.target = data.index_select(0, (index + 1).clamp_max(size - 1))
                     .masked_fill(ends, kIgnoreIndex)
                     .view({N, T});
  batch.positions = int64_tensor(std::move(position), {N, T});
  return batch;
}

PaddedCharBatch pad_documents(const PackedCharBatch& batch) {
  const int64_t N = batch.input.size(0);
  const int64_t D = batch.documents();
  int64_t L = 0;
  for (const auto& row : batch.lengths) {
    L = std::max(L, row.max().item<int64_t>());
  }
  PaddedCharBatch padded;
  padded.input = torch::zeros({D, L}, torch::kInt64);
  padded.target = torch::full({D, L}, kIgnoreIndex, torch::kInt64);
  padded.padding = torch::ones({D, L}, torch::kBool);
  int64_t d = 0;
  for (int64_t row = 0; row < N; ++row) {
    const auto row_lengths = batch.lengths[row].contiguous();
    const int64_t* lengths = row_lengths.data_ptr<int64_t>();
    int64_t start = 0;
    for (int64_t i = 0; i < row_lengths.numel(); ++i, ++d) {
      const int64_t length = lengths[i];
      padded.input[d]
          .narrow(0, 0, length)
          .copy_(batch.input[row].narrow(0, start, length));
      padded.target[d]
          .narrow(0, 0, length)
          .copy_(batch.target[row].narrow(0, start, length));
      padded.padding[d].narrow(0, 0, length).fill_(false);
      start += length;
    }
  }
  return padded;
}

}  // namespace mha::train

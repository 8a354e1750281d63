// A key/value cache for incremental (autoregressive) decoding with
// MultiHeadAttention::forward_cached.
//
// Semantics: the keys and values of the tokens seen so far, kept per layer so
// that each new token projects only its own key and value (as the
// `past_key_values` of Hugging Face transformers and the cache of GPT-2's
// reference sampler).
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <utility>

namespace mha {

/// Preallocated keys and values of one attention layer:
/// (N, Hkv, capacity, D) each, of which the first size() positions hold the
/// projected (and, with rotary, rotated) keys and values of the tokens so
/// far. Appending copies into the buffers: no reallocation until clear().
/// One cache per layer and sequence batch; make it with
/// MultiHeadAttention::make_kv_cache or directly.
///
/// Example (greedy decoding with one layer):
///   mha::MultiHeadAttention attn(mha::MultiHeadAttentionOptions(64, 8));
///   auto cache = attn->make_kv_cache(/*batch_size=*/1, /*capacity=*/512);
///   auto y = std::get<0>(attn->forward_cached(prompt, cache));  // (1, T0, 64)
///   auto z = std::get<0>(attn->forward_cached(next, cache));    // (1, 1, 64)
class KVCache {
 public:
  /// An empty cache for batch_size sequences, num_kv_heads heads of
  /// head_dim features, at most `capacity` positions, with `options`'
  /// dtype and device (default float32, CPU).
  /// Throws c10::Error when a size is < 1 (capacity may be 0).
  KVCache(int64_t batch_size, int64_t num_kv_heads, int64_t capacity,
          int64_t head_dim, torch::TensorOptions options = {});

  /// Positions held (the next token's position).
  int64_t size() const { return size_; }
  /// Positions the buffers hold at most.
  int64_t capacity() const { return key_buffer_.size(2); }
  /// Sequences per batch, N (the buffers' dim 0).
  int64_t batch_size() const { return key_buffer_.size(0); }
  /// Key/value heads, Hkv (the buffers' dim 1).
  int64_t num_kv_heads() const { return key_buffer_.size(1); }
  /// Features per head, D (the buffers' dim 3).
  int64_t head_dim() const { return key_buffer_.size(3); }
  /// dtype and device of the buffers (those of the module's parameters).
  torch::TensorOptions options() const { return key_buffer_.options(); }

  /// Keys and values of the positions held, (N, Hkv, size(), D) views of
  /// the buffers (valid until the next append or clear).
  torch::Tensor key() const { return key_buffer_.narrow(2, 0, size_); }
  /// The values of the positions held, (N, Hkv, size(), D); as key().
  torch::Tensor value() const { return value_buffer_.narrow(2, 0, size_); }

  /// The token positions of the entries held, int64 (N, size()) on the
  /// buffers' device: what append recorded (a view, valid until the next
  /// append or clear).
  torch::Tensor positions() const {
    return position_buffer_.narrow(1, 0, size_);
  }
  /// True while every entry's position is its index (no append was given
  /// explicit positions since the last clear).
  bool positions_are_indices() const { return positions_are_indices_; }

  /// Appends key and value (N, Hkv, T, D) at entries [size(), size() + T)
  /// and returns key() and value() afterwards. `positions`, int64 (N, T)
  /// on the buffers' device, records the tokens' positions; undefined
  /// (default): their indices size() + 0..T-1. The copies carry no
  /// gradient. Throws c10::Error for another shape, dtype or device, or when
  /// the capacity would be exceeded.
  std::pair<torch::Tensor, torch::Tensor> append(
      const torch::Tensor& key, const torch::Tensor& value,
      const torch::Tensor& positions = {});

  /// Forgets every position (size() = 0); keeps the buffers.
  void clear() {
    size_ = 0;
    positions_are_indices_ = true;
  }

 private:
  torch::Tensor key_buffer_;       // (N, Hkv, capacity, D)
  torch::Tensor value_buffer_;     // (N, Hkv, capacity, D)
  torch::Tensor position_buffer_;  // (N, capacity) int64
  int64_t size_ = 0;
  bool positions_are_indices_ = true;
};

}  // namespace mha

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
/// A recurrent cache (KVCache::recurrent, what make_kv_cache gives a module
/// of attention_kind kLinear or kPerformer) holds no keys and values but the
/// constant-size state of linear attention (Katharopoulos et al., 2020,
/// arXiv:2006.16236, eq. 10-11), whatever the number of positions held.
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

  /// An empty recurrent cache: per sequence and key/value head the sums
  /// Σ_j φ(k_j) v_jᵀ (feature_dim x head_dim) and Σ_j φ(k_j) (feature_dim)
  /// over the positions held (at most `capacity`), allocated once; key()
  /// and value() hold no positions. Throws c10::Error when a size is < 1
  /// (capacity may be 0).
  static KVCache recurrent(int64_t batch_size, int64_t num_kv_heads,
                           int64_t capacity, int64_t feature_dim,
                           int64_t head_dim, torch::TensorOptions options = {});

  /// Positions held (the next token's position).
  int64_t size() const { return size_; }
  /// Positions the buffers hold at most.
  int64_t capacity() const { return capacity_; }
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
  /// A recurrent cache's: (N, Hkv, 0, D).
  torch::Tensor key() const { return key_buffer_.narrow(2, 0, stored()); }
  /// The values of the positions held, (N, Hkv, size(), D); as key().
  torch::Tensor value() const { return value_buffer_.narrow(2, 0, stored()); }

  /// The token positions of the entries held, int64 (N, size()) on the
  /// buffers' device: what append recorded (a view, valid until the next
  /// append or clear). A recurrent cache's: (N, 0).
  torch::Tensor positions() const {
    return position_buffer_.narrow(1, 0, stored());
  }
  /// True while every entry's position is its index (no append was given
  /// explicit positions since the last clear).
  bool positions_are_indices() const { return positions_are_indices_; }

  /// Appends key and value (N, Hkv, T, D) at entries [size(), size() + T)
  /// and returns key() and value() afterwards. `positions`, int64 (N, T)
  /// on the buffers' device, records the tokens' positions; undefined
  /// (default): their indices size() + 0..T-1. The copies carry no
  /// gradient. Throws c10::Error for another shape, dtype or device, when
  /// the capacity would be exceeded, or for a recurrent cache.
  std::pair<torch::Tensor, torch::Tensor> append(
      const torch::Tensor& key, const torch::Tensor& value,
      const torch::Tensor& positions = {});

  /// Forgets every position (size() = 0); keeps the buffers (a recurrent
  /// cache's state is zeroed).
  void clear();

  /// True for a cache made by recurrent().
  bool is_recurrent() const { return kv_state_.defined(); }
  /// A recurrent cache's F (the features of φ); 0 otherwise.
  int64_t feature_dim() const { return is_recurrent() ? kv_state_.size(2) : 0; }
  /// A recurrent cache's Σ_j φ(k_j) v_jᵀ · exp(-state_offset()), (N, Hkv,
  /// F, D), over the positions held; undefined otherwise.
  torch::Tensor kv_state() const { return kv_state_; }
  /// A recurrent cache's Σ_j φ(k_j) · exp(-state_offset()), (N, Hkv, F).
  torch::Tensor k_state() const { return k_state_; }
  /// A recurrent cache's (N, Hkv, F): the log of the factor row f of both
  /// sums is kept divided by (kPerformer: the largest exponent of feature f
  /// so far, so that they stay in range; -inf while no key counts; 0 for
  /// kLinear).
  torch::Tensor state_offset() const { return state_offset_; }
  /// A recurrent cache's state replaced by (kv (N, Hkv, F, D), k (N, Hkv,
  /// F), offset (N, Hkv, F) or undefined = 0), copied into its buffers (no
  /// gradient), now over `count` more positions (size() += count). Throws
  /// c10::Error for another shape, a cache that is not recurrent, or when
  /// the capacity would be exceeded.
  void update_state(const torch::Tensor& kv, const torch::Tensor& k,
                    const torch::Tensor& offset, int64_t count);

 private:
  /// Positions the key/value buffers hold: size(), 0 when recurrent.
  int64_t stored() const { return is_recurrent() ? 0 : size_; }

  torch::Tensor key_buffer_;       // (N, Hkv, capacity, D)
  torch::Tensor value_buffer_;     // (N, Hkv, capacity, D)
  torch::Tensor position_buffer_;  // (N, capacity) int64
  int64_t size_ = 0;
  int64_t capacity_ = 0;
  bool positions_are_indices_ = true;
  torch::Tensor kv_state_;      // (N, Hkv, F, D), recurrent only
  torch::Tensor k_state_;       // (N, Hkv, F)
  torch::Tensor state_offset_;  // (N, Hkv, F)
};

}  // namespace mha

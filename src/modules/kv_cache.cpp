// The key/value cache of incremental decoding (mha/kv_cache.h).
//
// Glossary: N batch, Hkv key/value heads, T new positions, D head_dim,
// C capacity, F features of a recurrent cache (linear attention).
#include "mha/kv_cache.h"

#include <limits>

namespace mha {

KVCache::KVCache(int64_t batch_size, int64_t num_kv_heads, int64_t capacity,
                 int64_t head_dim, torch::TensorOptions options) {
  TORCH_CHECK(
      batch_size >= 1 && num_kv_heads >= 1 && head_dim >= 1 && capacity >= 0,
      "KVCache: batch_size, num_kv_heads and head_dim must be >= 1 "
      "and capacity >= 0, but got batch_size=",
      batch_size, ", num_kv_heads=", num_kv_heads, ", capacity=", capacity,
      ", head_dim=", head_dim);
  capacity_ = capacity;
  const auto o = options.requires_grad(false);
  key_buffer_ = torch::empty({batch_size, num_kv_heads, capacity, head_dim}, o);
  value_buffer_ =
      torch::empty({batch_size, num_kv_heads, capacity, head_dim}, o);
  position_buffer_ =
      torch::empty({batch_size, capacity}, o.dtype(torch::kLong));  // (N, C)
}

KVCache KVCache::recurrent(int64_t batch_size, int64_t num_kv_heads,
                           int64_t capacity, int64_t feature_dim,
                           int64_t head_dim, torch::TensorOptions options) {
  TORCH_CHECK(feature_dim >= 1,
              "KVCache::recurrent: feature_dim must be >= 1, but got ",
              feature_dim);
  // Buffers of no positions: batch_size(), num_kv_heads(), head_dim() and
  // options() read them as for any cache.
  KVCache cache(batch_size, num_kv_heads, /*capacity=*/0, head_dim, options);
  cache.capacity_ = capacity;
  const auto o = options.requires_grad(false);
  cache.kv_state_ =
      torch::zeros({batch_size, num_kv_heads, feature_dim, head_dim},
                   o);  // (N, Hkv, F, D)
  cache.k_state_ =
      torch::zeros({batch_size, num_kv_heads, feature_dim}, o);  // (N, Hkv, F)
  cache.state_offset_ = torch::full({batch_size, num_kv_heads, feature_dim},
                                    -std::numeric_limits<double>::infinity(),
                                    o);  // (N, Hkv, F)
  return cache;
}

void KVCache::clear() {
  size_ = 0;
  positions_are_indices_ = true;
  if (is_recurrent()) {
    torch::NoGradGuard no_grad;
    kv_state_.zero_();
    k_state_.zero_();
    state_offset_.fill_(-std::numeric_limits<double>::infinity());
  }
}

void KVCache::update_state(const torch::Tensor& kv, const torch::Tensor& k,
                           const torch::Tensor& offset, int64_t count) {
  TORCH_CHECK(is_recurrent(),
              "KVCache::update_state: this cache holds keys and values, not "
              "the state of linear attention (make it with "
              "KVCache::recurrent)");
  TORCH_CHECK(
      kv.defined() && k.defined() && kv.sizes() == kv_state_.sizes() &&
          k.sizes() == k_state_.sizes() &&
          (!offset.defined() || offset.sizes() == state_offset_.sizes()),
      "KVCache::update_state: kv, k and offset must be (N, Hkv, F, D) "
      "= ",
      kv_state_.sizes(), ", (N, Hkv, F) = ", k_state_.sizes(),
      " and (N, Hkv, F) = ", state_offset_.sizes(), ", but got kv ",
      kv.defined() ? kv.sizes() : torch::IntArrayRef{}, ", k ",
      k.defined() ? k.sizes() : torch::IntArrayRef{}, ", offset ",
      offset.defined() ? offset.sizes() : torch::IntArrayRef{});
  TORCH_CHECK(count >= 0 && size_ + count <= capacity_,
              "KVCache::update_state: ", count,
              " positions do not fit: ", size_, " of ", capacity_, " are held");
  torch::NoGradGuard no_grad;
  kv_state_.copy_(kv);
  k_state_.copy_(k);
  if (offset.defined()) {
    state_offset_.copy_(offset);
  } else {
    state_offset_.zero_();
  }
  size_ += count;
}

std::pair<torch::Tensor, torch::Tensor> KVCache::append(
    const torch::Tensor& key, const torch::Tensor& value,
    const torch::Tensor& positions) {
  TORCH_CHECK(!is_recurrent(),
              "KVCache::append: this cache holds the constant-size state of "
              "linear attention (KVCache::recurrent), not keys and values");
  TORCH_CHECK(key.defined() && value.defined() && key.dim() == 4 &&
                  key.sizes() == value.sizes() && key.size(0) == batch_size() &&
                  key.size(1) == num_kv_heads() && key.size(3) == head_dim(),
              "KVCache::append: key and value must both be (N, Hkv, T, D) = (",
              batch_size(), ", ", num_kv_heads(), ", T, ", head_dim(),
              "), but got key ",
              key.defined() ? key.sizes() : torch::IntArrayRef{}, " and value ",
              value.defined() ? value.sizes() : torch::IntArrayRef{});
  TORCH_CHECK(key.scalar_type() == key_buffer_.scalar_type() &&
                  value.scalar_type() == key_buffer_.scalar_type() &&
                  key.device() == key_buffer_.device() &&
                  value.device() == key_buffer_.device(),
              "KVCache::append: key and value must be ",
              key_buffer_.scalar_type(), " on ", key_buffer_.device(),
              ", but got key ", key.scalar_type(), " on ", key.device(),
              " and value ", value.scalar_type(), " on ", value.device());
  const int64_t T = key.size(2);
  TORCH_CHECK(size_ + T <= capacity(), "KVCache::append: ", T,
              " positions do not fit: ", size_, " of ", capacity(),
              " are held");
  if (positions.defined()) {
    TORCH_CHECK(positions.scalar_type() == torch::kLong &&
                    positions.device() == key_buffer_.device() &&
                    positions.dim() == 2 && positions.size(0) == batch_size() &&
                    positions.size(1) == T,
                "KVCache::append: positions must be int64 (N, T) = (",
                batch_size(), ", ", T, ") on ", key_buffer_.device(),
                ", but got ", positions.scalar_type(), " ", positions.sizes(),
                " on ", positions.device());
  }
  {
    torch::NoGradGuard no_grad;
    key_buffer_.narrow(2, size_, T).copy_(key);
    value_buffer_.narrow(2, size_, T).copy_(value);
    auto slots = position_buffer_.narrow(1, size_, T);  // (N, T)
    if (positions.defined()) {
      slots.copy_(positions);
      positions_are_indices_ = false;
    } else {
      slots.copy_(torch::arange(size_, size_ + T, slots.options())
                      .unsqueeze(0)
                      .expand_as(slots));
    }
  }
  size_ += T;
  return {this->key(), this->value()};
}

}  // namespace mha

// The key/value cache of incremental decoding (mha/kv_cache.h).
//
// Glossary: N batch, Hkv key/value heads, T new positions, D head_dim,
// C capacity.
#include "mha/kv_cache.h"

namespace mha {

KVCache::KVCache(int64_t batch_size, int64_t num_kv_heads, int64_t capacity,
                 int64_t head_dim, torch::TensorOptions options) {
  TORCH_CHECK(
      batch_size >= 1 && num_kv_heads >= 1 && head_dim >= 1 && capacity >= 0,
      "KVCache: batch_size, num_kv_heads and head_dim must be >= 1 "
      "and capacity >= 0, but got batch_size=",
      batch_size, ", num_kv_heads=", num_kv_heads, ", capacity=", capacity,
      ", head_dim=", head_dim);
  const auto o = options.requires_grad(false);
  key_buffer_ = torch::empty({batch_size, num_kv_heads, capacity, head_dim}, o);
  value_buffer_ =
      torch::empty({batch_size, num_kv_heads, capacity, head_dim}, o);
  position_buffer_ =
      torch::empty({batch_size, capacity}, o.dtype(torch::kLong));  // (N, C)
}

std::pair<torch::Tensor, torch::Tensor> KVCache::append(
    const torch::Tensor& key, const torch::Tensor& value,
    const torch::Tensor& positions) {
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

#include "mha/masks.h"

#include <limits>

namespace mha {

torch::Tensor causal_mask(int64_t L, int64_t S, torch::TensorOptions options) {
  TORCH_CHECK(L >= 0 && S >= 0,
              "causal_mask: L and S must be >= 0, but got L=", L, ", S=", S);
  auto bool_options =
      torch::TensorOptions().dtype(torch::kBool).device(options.device());
  return torch::ones({L, S}, bool_options).triu(/*diagonal=*/1);  // (L, S)
}

torch::Tensor generate_square_subsequent_mask(int64_t L,
                                              torch::TensorOptions options) {
  TORCH_CHECK(L >= 0,
              "generate_square_subsequent_mask: L must be >= 0, but got ", L);
  const auto dtype = options.has_dtype()
                         ? c10::typeMetaToScalarType(options.dtype())
                         : c10::typeMetaToScalarType(c10::get_default_dtype());
  TORCH_CHECK(torch::isFloatingType(dtype),
              "generate_square_subsequent_mask: the dtype must be floating, "
              "but got ",
              dtype);
  return torch::full({L, L}, -std::numeric_limits<double>::infinity(),
                     options.dtype(dtype))
      .triu(/*diagonal=*/1);  // (L, L)
}

torch::Tensor from_keep_mask(const torch::Tensor& keep) {
  TORCH_CHECK(keep.defined(), "from_keep_mask: keep is an undefined tensor");
  if (keep.scalar_type() == torch::kBool) {
    return keep.logical_not();
  }
  TORCH_CHECK(
      !keep.is_complex(),
      "from_keep_mask: keep must be bool, integer or floating, but got ",
      keep.scalar_type());
  bool binary = ((keep == 0) | (keep == 1)).all().item<bool>();
  TORCH_CHECK(binary,
              "from_keep_mask: keep must hold only 0 (blocked) and 1 (keep), "
              "but got other values (dtype ",
              keep.scalar_type(), ", shape ", keep.sizes(), ")");
  return keep == 0;
}

void check_mask(const torch::Tensor& mask, const std::string& name,
                torch::ScalarType dtype, const torch::Device& device) {
  if (!mask.defined()) {
    return;
  }
  const auto type = mask.scalar_type();
  TORCH_CHECK(type == torch::kBool || torch::isFloatingType(type), name,
              " must be bool (true = blocked) or floating (added to the "
              "scores), but got dtype ",
              type, "; convert a \"1 = keep\" mask with mha::from_keep_mask");
  TORCH_CHECK(type == torch::kBool || type == dtype, name,
              " is floating, so it must have the query's dtype ", dtype,
              ", but got dtype ", type);
  TORCH_CHECK(mask.device() == device, name, " must be on the query's device ",
              device, ", but got device ", mask.device());
}

torch::Tensor merge_masks(torch::ArrayRef<torch::Tensor> masks,
                          torch::ScalarType dtype) {
  torch::Tensor blocked;   // union of the bool parts
  torch::Tensor additive;  // sum of the floating parts
  for (const auto& mask : masks) {
    if (!mask.defined()) {
      continue;
    }
    TORCH_CHECK(
        mask.scalar_type() == torch::kBool || mask.scalar_type() == dtype,
        "merge_masks: expected bool or ", dtype, " masks, but got ",
        mask.scalar_type());
    if (mask.scalar_type() == torch::kBool) {
      blocked = blocked.defined() ? blocked.logical_or(mask) : mask;
    } else {
      additive = additive.defined() ? additive + mask : mask;
    }
  }
  if (!blocked.defined()) {
    return additive;
  }
  const double neg_inf = -std::numeric_limits<double>::infinity();
  if (!additive.defined()) {
    return torch::zeros(blocked.sizes(), blocked.options().dtype(dtype))
        .masked_fill_(blocked, neg_inf);
  }
  auto shape = at::infer_size(additive.sizes(), blocked.sizes());
  return additive.expand(shape).masked_fill(blocked, neg_inf);
}

}  // namespace mha

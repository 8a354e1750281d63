// The feature maps of linear-cost attention (mha/linear_attention.h,
// core/linear_attention_core.h): elu + 1 (Katharopoulos et al., 2020,
// arXiv:2006.16236) and FAVOR+'s positive random features (Choromanski et
// al., 2021, arXiv:2009.14794), with their orthogonal random projections.
//
// Glossary: T rows, D head_dim, m random features.
#include <ATen/CPUGeneratorImpl.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "core/linear_attention_core.h"
#include "mha/linear_attention.h"

namespace mha {
namespace detail {

torch::Tensor favor_exponents(const torch::Tensor& x,
                              const torch::Tensor& random_features) {
  const double m = static_cast<double>(random_features.size(0));
  // In place on the product (its backward reads its inputs): one tensor of
  // the exponents' size (at L = 64k, m = 266, 4 heads, 279 MB, whose first
  // touch costs about 0.45 s of page faults here), not three.
  return torch::matmul(x, random_features.t())
      .sub_(x.square()
                .sum(-1, /*keepdim=*/true)
                .mul_(0.5)
                .add_(0.5 * std::log(m)));  // (..., T, m)
}

}  // namespace detail

torch::Tensor elu_feature_map(const torch::Tensor& x) {
  // In place on elu's own result (its backward reads its input): one
  // tensor of the features' size, not two (at L = 64k each fresh one costs
  // about 0.1 s of page faults here).
  return torch::elu(x).add_(1.0);
}

torch::Tensor orthogonal_random_features(int64_t nb_features, int64_t dim,
                                         uint64_t seed,
                                         torch::TensorOptions options) {
  TORCH_CHECK(nb_features >= 1 && dim >= 1,
              "orthogonal_random_features: nb_features and dim must be >= 1, "
              "but got nb_features=",
              nb_features, ", dim=", dim);
  torch::NoGradGuard no_grad;
  auto generator = at::make_generator<at::CPUGeneratorImpl>(seed);
  const auto f64 = torch::TensorOptions().dtype(torch::kFloat64);
  std::vector<torch::Tensor> blocks;
  for (int64_t rows = 0; rows < nb_features; rows += dim) {
    auto gaussian = at::randn({dim, dim}, generator, f64);  // (D, D)
    auto [q, r] = at::linalg_qr(gaussian);
    // Q made unique (R's diagonal positive), so that every LAPACK gives
    // the same features; its columns are orthonormal, the block its rows.
    q = q * torch::sign(r.diagonal()).unsqueeze(0);
    blocks.push_back(
        q.t().narrow(0, 0, std::min(dim, nb_features - rows)));  // (<=D, D)
  }
  auto w = torch::cat(blocks, 0);  // (m, D)
  // Each row's norm as a Gaussian vector's (chi with D degrees of freedom).
  auto norms = at::randn({nb_features, dim}, generator, f64).norm(2, {1});
  // TensorOptions::dtype() is the default dtype where none was set.
  return (w * norms.unsqueeze(1))
      .to(torch::TensorOptions()
              .dtype(options.dtype())
              .device(options.device()));  // (m, D)
}

torch::Tensor favor_features(const torch::Tensor& x,
                             const torch::Tensor& random_features) {
  TORCH_CHECK(x.defined() && x.dim() >= 2,
              "favor_features: x must be (..., T, D), but got ",
              x.defined() ? x.sizes() : torch::IntArrayRef{});
  TORCH_CHECK(random_features.defined() && random_features.dim() == 2 &&
                  random_features.size(1) == x.size(-1) &&
                  random_features.scalar_type() == x.scalar_type() &&
                  random_features.device() == x.device(),
              "favor_features: random_features must be (m, D) = (m, ",
              x.size(-1), ") of x's dtype ", x.scalar_type(), " on ",
              x.device(), ", but got ",
              random_features.defined() ? random_features.sizes()
                                        : torch::IntArrayRef{},
              " ",
              random_features.defined() ? random_features.scalar_type()
                                        : x.scalar_type());
  return detail::favor_exponents(x, random_features).exp_();
}

}  // namespace mha

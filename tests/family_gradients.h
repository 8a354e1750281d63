// The gradient check of the 2025 families' modules against transformers'
// (tests/fixtures/hf/<case>/gradients.safetensors, written by
// scripts/make_hf_fixtures.py families / gradients), shared by their test
// files.
#pragma once

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstdint>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

#include "mha/state_dict.h"

namespace family_tests {

/// sum(output · R)'s gradients of the family module loaded from `dir`
/// against transformers' (gradients.safetensors, make_hf_fixtures.py):
/// the input's and each parameter's, the transformers name of ours given by
/// `hf_name` ("a+b": transformers' a and b concatenated), float32 1e-5 +
/// 1e-4 |ref| of the largest gradient.
template <typename Module, typename Forward, typename HfName>
inline void expect_gradients_match(const std::string& dir, Module& m,
                                   Forward&& forward, HfName&& hf_name) {
  auto ref = mha::read_state_dict(dir + "/gradients.safetensors");
  auto x = ref["hidden_states"].clone().requires_grad_(true);
  auto out = forward(x);
  EXPECT_TRUE(torch::allclose(out, ref["output"], 1e-4, 1e-5));
  (out * ref["R"]).sum().backward();
  auto close = [](const torch::Tensor& got, const torch::Tensor& want,
                  const std::string& what) {
    ASSERT_TRUE(got.defined()) << what << ": no gradient";
    const double scale = want.abs().max().item<double>();
    const double err = (got - want).abs().max().item<double>();
    EXPECT_LE(err, 1e-5 + 1e-4 * scale) << what << " (largest " << scale << ")";
    std::cout << "[ grads    ] " << what << ": max abs " << err << " of "
              << scale << "\n";
  };
  close(x.grad(), ref["grad.hidden_states"], "hidden_states");
  int64_t compared = 0;
  for (const auto& p : m->named_parameters()) {
    // "a+b+c": ours is transformers' a, b and c concatenated (a packed
    // bias).
    std::vector<torch::Tensor> parts;
    std::stringstream names(hf_name(p.key()));
    for (std::string name; std::getline(names, name, '+');) {
      ASSERT_TRUE(ref.contains("grad." + name)) << "grad." << name;
      parts.push_back(ref["grad." + name]);
      ++compared;
    }
    close(p.value().grad(), torch::cat(parts), p.key());
  }
  EXPECT_EQ(compared + 4, static_cast<int64_t>(ref.size()));
}

/// Backward from sum(output · R) through `ours()` and then `reference()`
/// (each computes module m's output from the leaf x): their outputs equal
/// within out_rtol / out_atol, and the gradients of x and of every
/// parameter of m within 1e-10 / 1e-12 (float64 proofs). `what` prefixes
/// the messages.
template <typename Module, typename Ours, typename Reference>
void expect_same_gradients(Module& m, const torch::Tensor& x,
                           const torch::Tensor& R, Ours&& ours,
                           Reference&& reference, double out_rtol,
                           double out_atol, const std::string& what) {
  const torch::Tensor out = ours();
  (out * R).sum().backward();
  std::vector<torch::Tensor> grads{x.grad().clone()};
  for (auto& p : m->parameters()) {
    grads.push_back(p.grad().clone());
    p.mutable_grad() = torch::Tensor();
  }
  x.mutable_grad() = torch::Tensor();
  const torch::Tensor ref = reference();
  (ref * R).sum().backward();
  EXPECT_TRUE(torch::allclose(out, ref, out_rtol, out_atol))
      << what << "output: " << (out - ref).abs().max().item<double>();
  EXPECT_TRUE(torch::allclose(grads[0], x.grad(), 1e-10, 1e-12))
      << what << "grad x: " << (grads[0] - x.grad()).abs().max().item<double>();
  size_t i = 1;
  for (const auto& p : m->named_parameters()) {
    const torch::Tensor want = p.value().grad();
    EXPECT_TRUE(torch::allclose(grads[i], want, 1e-10, 1e-12))
        << what << "grad " << p.key() << ": "
        << (grads[i] - want).abs().max().item<double>();
    ++i;
  }
}

}  // namespace family_tests

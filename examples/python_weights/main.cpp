// Example: weights trained in Python, used from C++. make_weights.py saved a
// Python nn.TransformerEncoderLayer's state dict (torch.save) and its output
// on one batch; this program loads the state dict into
// mha::TransformerEncoderLayer and checks, as mha-parity does, its output
// against Python's, and its output and input gradient against
// torch::nn::TransformerEncoderLayer holding the same weights.
//
// Usage: python_weights encoder_layer.pt encoder_layer_io.pt
// Exits 1 when a check fails.
//
// Glossary: N batch, L sequence length, E d_model.
#include <mha/mha.h>

#include <iomanip>
#include <iostream>
#include <string>

namespace {

int failures = 0;

// One mha-parity-style row: max abs and max rel error against a reference,
// the tolerance (atol + rtol * |reference|), PASS/FAIL.
void compare(const std::string& what, const torch::Tensor& got,
             const torch::Tensor& expected, double atol, double rtol) {
  const auto diff = (got - expected).abs();
  const double max_abs = diff.max().item<double>();
  const double max_rel =
      (diff / expected.abs().clamp_min(1e-12)).max().item<double>();
  const bool pass = (diff <= atol + rtol * expected.abs()).all().item<bool>();
  std::cout << std::left << std::setw(36) << what << " max abs "
            << std::setw(12) << max_abs << " max rel " << std::setw(12)
            << max_rel << " tol " << atol << " + " << rtol << "|ref|  "
            << (pass ? "PASS" : "FAIL") << '\n';
  failures += pass ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 3) {
    std::cerr << "usage: python_weights encoder_layer.pt encoder_layer_io.pt\n";
    return 2;
  }
  // The layer as Python built it: d_model 16, 4 heads, feed-forward 32,
  // batch_first, post-norm, ReLU; dropout 0.
  mha::TransformerEncoderLayer layer(
      mha::TransformerEncoderLayerOptions(16, 4).dim_feedforward(32).dropout(
          0.0));
  layer->eval();
  // strict: every key of the file must match a parameter, and back.
  mha::load_state_dict(*layer, argv[1]);
  const auto io = mha::read_state_dict(argv[2]);
  const auto src = io["src"];            // (N, L, E)
  const auto python_out = io["output"];  // (N, L, E)
  std::cout << "loaded " << mha::state_dict(*layer).size() << " tensors from "
            << argv[1] << '\n';

  // 1. Against Python's own output (float32: a few ulps of difference).
  {
    torch::NoGradGuard no_grad;
    compare("output vs Python", layer(src), python_out, 1e-5, 1e-4);
  }

  // 2. Against torch::nn with the same weights: output and input gradient.
  //    LibTorch's layer is sequence-first: (L, N, E).
  torch::nn::TransformerEncoderLayer reference(
      torch::nn::TransformerEncoderLayerOptions(16, 4)
          .dim_feedforward(32)
          .dropout(0.0));
  reference->eval();
  mha::copy_weights(layer, reference);
  const auto x = src.clone().requires_grad_(true);
  const auto xt = src.transpose(0, 1).clone().requires_grad_(true);
  const auto out = layer(x);                           // (N, L, E)
  const auto ref_out = reference(xt).transpose(0, 1);  // (N, L, E)
  const auto upstream = torch::randn_like(out);        // d loss / d output
  (out * upstream).sum().backward();
  (ref_out * upstream).sum().backward();
  compare("output vs torch::nn", out.detach(), ref_out.detach(), 1e-5, 1e-4);
  compare("grad input vs torch::nn", x.grad(), xt.grad().transpose(0, 1), 1e-5,
          1e-4);

  std::cout << (failures == 0 ? "python_weights: all checks passed\n"
                              : "python_weights: a check failed\n");
  return failures == 0 ? 0 : 1;
}

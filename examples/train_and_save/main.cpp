// Example: train a tiny Transformer encoder to reverse sequences of digits
// (a few hundred Adam steps, a few seconds on a CPU), print the loss as it
// falls, save the state dict (safetensors: Python's safetensors.torch.
// load_file reads it; a path not ending in .safetensors gives a torch.save
// file) and load it into a fresh model.
//
// Usage: train_and_save [model.safetensors]   (default: reverser.safetensors)
// Checks: the loss falls below a third of its first value; the reloaded
// model gives exactly the trained model's outputs. Exits 1 when one fails.
//
// Glossary: N batch, L sequence length, E d_model, V vocabulary (digits).
#include <mha/mha.h>

#include <iomanip>
#include <iostream>
#include <string>

namespace {

constexpr int64_t kVocab = 10, kLength = 6, kModel = 32, kHeads = 4;

struct ReverserImpl : torch::nn::Module {
  ReverserImpl()
      : embed(register_module("embed", torch::nn::Embedding(kVocab, kModel))),
        position(register_parameter("position",
                                    0.1 * torch::randn({kLength, kModel}))),
        encoder(register_module(
            "encoder",
            mha::TransformerEncoder(mha::TransformerEncoderOptions(
                mha::TransformerEncoderLayer(
                    mha::TransformerEncoderLayerOptions(kModel, kHeads)
                        .dim_feedforward(64)
                        .dropout(0.0)),
                /*num_layers=*/2)))),
        head(register_module("head", torch::nn::Linear(kModel, kVocab))) {}

  // digits (N, L) int64 -> logits (N, L, V).
  torch::Tensor forward(const torch::Tensor& digits) {
    const auto x = embed(digits) + position;  // (N, L, E)
    return head(encoder(x));                  // (N, L, V)
  }

  torch::nn::Embedding embed;
  torch::Tensor position;
  mha::TransformerEncoder encoder;
  torch::nn::Linear head;
};
TORCH_MODULE(Reverser);

}  // namespace

int main(int argc, char** argv) {
  const std::string path = argc > 1 ? argv[1] : "reverser.safetensors";
  torch::manual_seed(0);
  Reverser model;
  torch::optim::Adam optimizer(model->parameters(),
                               torch::optim::AdamOptions(3e-3));
  model->train();
  double first_loss = 0, last_loss = 0;
  for (int step = 0; step <= 300; ++step) {
    const auto digits = torch::randint(kVocab, {32, kLength});  // (N, L)
    const auto target = digits.flip(1);                         // (N, L)
    const auto logits = model(digits);                          // (N, L, V)
    const auto loss = torch::nn::functional::cross_entropy(
        logits.reshape({-1, kVocab}), target.reshape(-1));
    optimizer.zero_grad();
    loss.backward();
    optimizer.step();
    last_loss = loss.item<double>();
    if (step == 0) first_loss = last_loss;
    if (step % 50 == 0) {
      std::cout << "step " << std::setw(3) << step << "  loss " << std::fixed
                << std::setprecision(4) << last_loss << '\n';
    }
  }
  int failures = 0;
  const bool fell = last_loss < first_loss / 3;
  std::cout << (fell ? "ok:     " : "FAILED: ") << "loss fell from "
            << first_loss << " to " << last_loss << '\n';
  failures += fell ? 0 : 1;

  // Save, then load into a model with other initial weights.
  model->eval();
  mha::save_state_dict(*model, path);
  torch::manual_seed(1);
  Reverser reloaded;
  reloaded->eval();
  mha::load_state_dict(*reloaded, path);  // strict: every key must match
  torch::NoGradGuard no_grad;
  const auto digits = torch::randint(kVocab, {4, kLength});  // (N, L)
  const auto logits = model(digits);                         // (N, L, V)
  const bool same = torch::equal(reloaded(digits), logits);
  std::cout << (same ? "ok:     " : "FAILED: ") << "the model reloaded from "
            << path << " gives the trained model's outputs exactly\n";
  failures += same ? 0 : 1;
  const auto accuracy =
      (logits.argmax(-1) == digits.flip(1)).to(torch::kFloat).mean();
  std::cout << "reversal accuracy on 4 new sequences: "
            << accuracy.item<double>() << '\n';

  std::cout << (failures == 0 ? "train_and_save: all checks passed\n"
                              : "train_and_save: a check failed\n");
  return failures == 0 ? 0 : 1;
}

// Optimisation: the warmup + cosine learning rate schedule and AdamW with
// decayed and undecayed parameter groups.
#include "mha/train/optim.h"

#include <algorithm>
#include <cmath>
#include <utility>
#include <vector>

namespace mha::train {

namespace {

constexpr double kPi = 3.14159265358979323846;

}  // namespace

// ------------------------------------------------------- optimisation ---

double LrSchedule::at(int64_t step) const {
  if (step <= warmup_steps && warmup_steps > 0) {
    return peak_lr * static_cast<double>(step) / warmup_steps;
  }
  const int64_t decay_steps = std::max<int64_t>(total_steps - warmup_steps, 1);
  const double progress = std::clamp(
      static_cast<double>(step - warmup_steps) / decay_steps, 0.0, 1.0);
  return min_lr + (peak_lr - min_lr) * 0.5 * (1.0 + std::cos(kPi * progress));
}

std::unique_ptr<torch::optim::AdamW> make_adamw(torch::nn::Module& module,
                                                double lr, double weight_decay,
                                                double beta1, double beta2) {
  std::vector<torch::Tensor> decayed, not_decayed;
  for (const auto& parameter : module.parameters()) {
    (parameter.dim() >= 2 ? decayed : not_decayed).push_back(parameter);
  }
  auto options = [&](double decay) {
    return std::make_unique<torch::optim::AdamWOptions>(
        torch::optim::AdamWOptions(lr)
            .betas(std::make_tuple(beta1, beta2))
            .weight_decay(decay));
  };
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(decayed, options(weight_decay));
  groups.emplace_back(not_decayed, options(0.0));
  return std::make_unique<torch::optim::AdamW>(std::move(groups),
                                               *options(weight_decay));
}

void set_learning_rate(torch::optim::AdamW& optimizer, double lr) {
  for (auto& group : optimizer.param_groups()) {
    static_cast<torch::optim::AdamWOptions&>(group.options()).lr(lr);
  }
}

}  // namespace mha::train

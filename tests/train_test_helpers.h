// Helpers of the training tests (test_train.cpp, test_train_seq2seq.cpp):
// a temporary directory, and the check that a run stopped and resumed
// reproduces the uninterrupted run exactly.
#pragma once

#include <gtest/gtest.h>
#include <torch/torch.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <string>
#include <system_error>

#include "mha/state_dict.h"
#include "mha/train.h"

namespace mha_test {

namespace train = mha::train;

/// A fresh, empty directory under the system's temporary directory,
/// removed with everything in it when the object goes.
class TempDir {
 public:
  explicit TempDir(const std::string& name)
      : path_((std::filesystem::temp_directory_path() /
               ("mha_test_train_" + std::to_string(::getpid()) + "_" + name))
                  .string()) {
    std::filesystem::remove_all(path_);
    std::filesystem::create_directories(path_);
  }
  ~TempDir() {
    std::error_code ignored;
    std::filesystem::remove_all(path_, ignored);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

/// Runs `make_task()` for `steps` uninterrupted, and again stopped at
/// `stop_at` and resumed in a fresh task (the global generator scrambled in
/// between, as a new process would have it); expects identical records.
template <class MakeTask>
void expect_exact_resume(MakeTask make_task, const std::string& name) {
  const auto options = train::TrainOptions()
                           .steps(24)
                           .warmup_steps(4)
                           .eval_every(5)
                           .checkpoint_every(6);
  const TempDir whole_dir(name + "_a"), dir(name + "_b");
  auto whole_task = make_task();
  const auto whole = train::train(
      whole_task, train::TrainOptions(options).out_dir(whole_dir.path()));

  auto first_task = make_task();
  const auto first = train::train(
      first_task, train::TrainOptions(options).out_dir(dir.path()).stop_at(9));
  ASSERT_EQ(first.last_step, 9);
  torch::rand({1000});  // the resumed run must not depend on this
  auto second_task = make_task();
  const auto second = train::train(
      second_task,
      train::TrainOptions(options).out_dir(dir.path()).resume(true));
  EXPECT_EQ(second.first_step, 10);
  ASSERT_EQ(second.history.size(), whole.history.size());
  for (size_t i = 0; i < whole.history.size(); ++i) {
    const auto& w = whole.history[i];
    const auto& r = second.history[i];
    EXPECT_EQ(r.step, w.step);
    EXPECT_EQ(r.lr, w.lr) << "step " << w.step;
    EXPECT_EQ(r.train_loss, w.train_loss) << "step " << w.step;
    EXPECT_EQ(std::isnan(r.val_loss), std::isnan(w.val_loss))
        << "step " << w.step;
    if (!std::isnan(w.val_loss)) {
      EXPECT_EQ(r.val_loss, w.val_loss) << "step " << w.step;
    }
  }
  // The final weights agree exactly too.
  const auto a = mha::state_dict(whole_task.model());
  const auto b = mha::state_dict(second_task.model());
  for (const auto& item : a) {
    EXPECT_TRUE(torch::equal(item.value(), b[item.key()])) << item.key();
  }
}

}  // namespace mha_test

// Data-parallel training (mha/distributed.h and train() with a group):
// the torchrun environment, the collectives (ranks as threads of this
// process), gradient synchronisation against hand computations, and real
// multi-process jobs (tests/distributed_worker.cpp) against one process.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <torch/torch.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "mha/distributed.h"
#include "mha/state_dict.h"
#include "mha/train.h"
#include "train/launch.h"

namespace {

namespace dist = mha::distributed;
namespace train = mha::train;
namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

// ------------------------------------------------------------ helpers ---

/// Sets (or, with nullopt, unsets) environment variables for a scope.
class ScopedEnv {
 public:
  explicit ScopedEnv(
      const std::map<std::string, std::optional<std::string>>& values) {
    for (const auto& [name, value] : values) {
      const char* old = std::getenv(name.c_str());
      saved_[name] = old ? std::optional<std::string>(old) : std::nullopt;
      set(name, value);
    }
  }
  ~ScopedEnv() {
    for (const auto& [name, value] : saved_) {
      set(name, value);
    }
  }
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;

 private:
  static void set(const std::string& name,
                  const std::optional<std::string>& value) {
    if (value) {
      setenv(name.c_str(), value->c_str(), 1);
    } else {
      unsetenv(name.c_str());
    }
  }
  std::map<std::string, std::optional<std::string>> saved_;
};

const std::map<std::string, std::optional<std::string>> kNoJob = {
    {"RANK", std::nullopt},        {"WORLD_SIZE", std::nullopt},
    {"LOCAL_RANK", std::nullopt},  {"MASTER_ADDR", std::nullopt},
    {"MASTER_PORT", std::nullopt}, {"GLOO_SOCKET_IFNAME", std::nullopt}};

/// A port on 127.0.0.1 that was free a moment ago (mha-train's own choice).
int free_port() {
  const int port = mha::tools::free_local_port();
  EXPECT_NE(port, 0) << "no free TCP port on 127.0.0.1";
  return port;
}

/// Runs body(group) on `world` ranks, each a thread of this process with its
/// own ProcessGroup on 127.0.0.1. Failures of any rank fail the test.
void run_ranks(int64_t world,
               const std::function<void(dist::ProcessGroup&)>& body,
               std::chrono::milliseconds timeout = std::chrono::seconds(30)) {
  const int port = free_port();
  std::vector<std::string> errors(world);
  std::vector<std::thread> threads;
  for (int64_t rank = 0; rank < world; ++rank) {
    threads.emplace_back([&, rank] {
      try {
        dist::LaunchEnv env;
        env.rank = rank;
        env.world_size = world;
        env.master_port = port;
        dist::ProcessGroup group(env,
                                 dist::ProcessGroupOptions().timeout(timeout));
        body(group);
      } catch (const std::exception& e) {
        errors[rank] = e.what();
      }
    });
  }
  for (auto& thread : threads) {
    thread.join();
  }
  for (int64_t rank = 0; rank < world; ++rank) {
    EXPECT_EQ(errors[rank], "") << "rank " << rank;
  }
}

#define SKIP_WITHOUT_C10D()                                              \
  if (!dist::available()) {                                              \
    GTEST_SKIP() << "this build has no c10d/Gloo (libgloo-dev missing)"; \
  }

// ---------------------------------------------------------- launch env ---

TEST(LaunchEnv, NoVariablesMeansNoJob) {
  ScopedEnv env(kNoJob);
  EXPECT_FALSE(dist::launch_env_from_environment().has_value());
}

TEST(LaunchEnv, ReadsTheTorchrunVariables) {
  ScopedEnv env({{"RANK", "1"},
                 {"WORLD_SIZE", "3"},
                 {"LOCAL_RANK", "0"},
                 {"MASTER_ADDR", "10.0.0.2"},
                 {"MASTER_PORT", "1234"}});
  const auto job = dist::launch_env_from_environment();
  ASSERT_TRUE(job.has_value());
  EXPECT_EQ(job->rank, 1);
  EXPECT_EQ(job->world_size, 3);
  EXPECT_EQ(job->local_rank, 0);
  EXPECT_EQ(job->master_addr, "10.0.0.2");
  EXPECT_EQ(job->master_port, 1234);
}

TEST(LaunchEnv, DefaultsForTheOptionalVariables) {
  ScopedEnv clear(kNoJob);
  ScopedEnv env({{"RANK", "2"}, {"WORLD_SIZE", "4"}});
  const auto job = dist::launch_env_from_environment();
  ASSERT_TRUE(job.has_value());
  EXPECT_EQ(job->local_rank, 2);
  EXPECT_EQ(job->master_addr, "127.0.0.1");
  EXPECT_EQ(job->master_port, 29500);
}

TEST(LaunchEnv, BadValuesNameTheVariable) {
  using Vars = std::map<std::string, std::optional<std::string>>;
  const std::vector<std::pair<Vars, std::string>> cases = {
      {{{"RANK", "2"}, {"WORLD_SIZE", "2"}},
       "RANK must be in [0, WORLD_SIZE - 1 = 1], but got 2"},
      {{{"RANK", "-1"}, {"WORLD_SIZE", "2"}}, "RANK must be in"},
      {{{"RANK", "0"}, {"WORLD_SIZE", "0"}},
       "WORLD_SIZE must be >= 1, but got 0"},
      {{{"RANK", "one"}, {"WORLD_SIZE", "2"}},
       "RANK must be an integer, but got 'one'"},
      {{{"RANK", "0"}, {"WORLD_SIZE", "2x"}},
       "WORLD_SIZE must be an integer, but got '2x'"},
      {{{"RANK", "0"}, {"WORLD_SIZE", std::nullopt}},
       "RANK and WORLD_SIZE must be set together, but only RANK='0' is set"},
      {{{"RANK", "0"}, {"WORLD_SIZE", "1"}, {"MASTER_PORT", "70000"}},
       "MASTER_PORT must be in [1, 65535], but got 70000"},
      {{{"RANK", "0"}, {"WORLD_SIZE", "1"}, {"LOCAL_RANK", "-3"}},
       "LOCAL_RANK must be >= 0, but got -3"},
      {{{"RANK", "0"}, {"WORLD_SIZE", "1"}, {"MASTER_ADDR", ""}},
       "MASTER_ADDR must not be empty"},
  };
  for (const auto& [vars, message] : cases) {
    ScopedEnv clear(kNoJob);
    ScopedEnv env(vars);
    try {
      dist::launch_env_from_environment();
      ADD_FAILURE() << "no error for " << message;
    } catch (const c10::Error& e) {
      EXPECT_NE(std::string(e.what()).find(message), std::string::npos)
          << e.what();
    }
  }
}

TEST(Backend, ParsesItsNames) {
  EXPECT_EQ(dist::parse_backend("gloo"), dist::Backend::kGloo);
  EXPECT_EQ(dist::parse_backend("nccl"), dist::Backend::kNccl);
  EXPECT_THROW(dist::parse_backend("mpi"), c10::Error);
  EXPECT_EQ(dist::backend_name(dist::Backend::kNccl), "nccl");
}

// --------------------------------------------------------------- shards ---

TEST(Shard, RowsCoverEveryRowOnceInNearEqualParts) {
  for (int64_t count = 1; count <= 5; ++count) {
    for (int64_t rows = 0; rows <= 23; ++rows) {
      int64_t next = 0;
      for (int64_t index = 0; index < count; ++index) {
        const auto [first, last] = train::Shard{index, count}.rows(rows);
        EXPECT_EQ(first, next) << rows << " rows, shard " << index;
        EXPECT_GE(last - first, rows / count);
        EXPECT_LE(last - first, rows / count + 1);
        next = last;
      }
      EXPECT_EQ(next, rows);
    }
  }
}

TEST(Shard, SetShardRejectsAnIndexOutsideTheCount) {
  train::DigitTask task(train::DigitDataOptions(train::DigitRule::kReverse),
                        train::DigitTransformerOptions(16).d_model(16).nhead(2),
                        /*batch_size=*/4, /*seed=*/1);
  EXPECT_THROW(task.set_shard({2, 2}), c10::Error);
  EXPECT_THROW(task.set_shard({0, 0}), c10::Error);
  task.set_shard({1, 2});
  EXPECT_EQ(task.shard().index, 1);
}

TEST(Shard, ShardLossesAddUpToTheWholeBatch) {
  // Two shards' summed losses (mean x tokens) are the one-shard sum, for
  // training and validation alike.
  train::DigitTask task(
      train::DigitDataOptions(train::DigitRule::kReverse).max_len(8),
      train::DigitTransformerOptions(8).d_model(16).nhead(2).num_layers(1),
      /*batch_size=*/7, /*seed=*/3);
  task.model().eval();  // no dropout either way
  torch::NoGradGuard no_grad;
  const auto whole = task.training_loss(5);
  double sum = 0.0;
  int64_t tokens = 0;
  for (int64_t index = 0; index < 2; ++index) {
    task.set_shard({index, 2});
    const auto part = task.training_loss(5);
    sum += part.loss.item<double>() * static_cast<double>(part.tokens);
    tokens += part.tokens;
  }
  EXPECT_EQ(tokens, whole.tokens);
  EXPECT_NEAR(sum / static_cast<double>(tokens), whole.loss.item<double>(),
              1e-5);

  task.set_shard({0, 1});
  const auto val_whole = task.validation_loss_sum();
  train::LossSum val_parts;
  for (int64_t index = 0; index < 3; ++index) {
    task.set_shard({index, 3});
    const auto part = task.validation_loss_sum();
    val_parts.sum += part.sum;
    val_parts.tokens += part.tokens;
  }
  EXPECT_EQ(val_parts.tokens, val_whole.tokens);
  EXPECT_NEAR(val_parts.sum, val_whole.sum, 1e-3 * std::abs(val_whole.sum));
}

// ----------------------------------------------------------- collectives ---

TEST(ProcessGroup, AllReduceBroadcastAndBarrier) {
  SKIP_WITHOUT_C10D();
  run_ranks(3, [](dist::ProcessGroup& group) {
    const auto r = static_cast<double>(group.rank());
    auto a = torch::full({2, 3}, r + 1.0);  // ranks hold 1, 2, 3
    auto b = torch::arange(4, torch::kFloat64) * r;
    std::vector<torch::Tensor> both{a, b};
    group.all_reduce_sum(both);
    EXPECT_TRUE(torch::equal(a, torch::full({2, 3}, 6.0)));
    EXPECT_TRUE(torch::equal(b, torch::arange(4, torch::kFloat64) * 3.0));

    auto c = torch::arange(5, torch::kInt64) + group.rank() * 10;
    group.broadcast(c, /*root=*/2);
    EXPECT_TRUE(torch::equal(c, torch::arange(5, torch::kInt64) + 20));

    const std::string payload("bytes\0with a zero", 17);
    EXPECT_EQ(group.broadcast_bytes(group.rank() == 1 ? payload : "other",
                                    /*root=*/1),
              payload);
    EXPECT_EQ(group.broadcast_bytes(group.rank() == 0 ? "" : "x"), "");
    EXPECT_THROW(group.broadcast(c, /*root=*/3), c10::Error);
    group.barrier();
  });
}

TEST(BroadcastModule, CopiesRootParametersAndBuffers) {
  SKIP_WITHOUT_C10D();
  // Different weights and running statistics on each rank.
  std::vector<torch::nn::Sequential> models;
  for (int64_t rank = 0; rank < 2; ++rank) {
    torch::manual_seed(100 + rank);
    models.emplace_back(torch::nn::Linear(4, 3), torch::nn::BatchNorm1d(3));
    models.back()->train();
    models.back()->forward(torch::randn({8, 4}));  // moves running_mean
  }
  const auto root_state = mha::state_dict(*models[0]);
  run_ranks(2, [&](dist::ProcessGroup& group) {
    dist::broadcast_module(group, *models[group.rank()]);
  });
  const auto copied = mha::state_dict(*models[1]);
  ASSERT_EQ(copied.size(), root_state.size());
  for (const auto& item : root_state) {
    EXPECT_TRUE(torch::equal(copied[item.key()], item.value())) << item.key();
  }
}

TEST(GradientSynchronizer, MeanAndSumMatchTheRanksGradients) {
  SKIP_WITHOUT_C10D();
  // Gradients set by hand: rank r's gradient of parameter i is
  // (i + 1) * (r + 1) * ones, except that parameter 1 has none on rank 1
  // (unused there), which counts as zeros.
  for (const auto reduction :
       {dist::GradientReduction::kMean, dist::GradientReduction::kSum}) {
    for (const int64_t bucket_bytes : {int64_t{16}, int64_t{1} << 20}) {
      std::vector<torch::nn::Sequential> models;
      for (int64_t rank = 0; rank < 2; ++rank) {
        models.emplace_back(torch::nn::Linear(3, 2), torch::nn::Linear(2, 2));
      }
      std::vector<int64_t> buckets(2);
      run_ranks(2, [&](dist::ProcessGroup& group) {
        auto& model = models[group.rank()];
        dist::GradientSynchronizer sync(
            group, *model,
            dist::GradientSyncOptions().reduction(reduction).bucket_bytes(
                bucket_bytes));
        buckets[group.rank()] = sync.num_buckets();
        auto parameters = model->parameters();
        for (size_t i = 0; i < parameters.size(); ++i) {
          if (group.rank() == 1 && i == 1) {
            continue;
          }
          parameters[i].mutable_grad() = torch::full_like(
              parameters[i], double((i + 1) * (group.rank() + 1)));
        }
        sync.synchronize();
      });
      const double divisor =
          reduction == dist::GradientReduction::kMean ? 2.0 : 1.0;
      for (const auto& model : models) {
        auto parameters = model->parameters();
        for (size_t i = 0; i < parameters.size(); ++i) {
          const double total = (i + 1) * 1.0 + (i == 1 ? 0.0 : (i + 1) * 2.0);
          ASSERT_TRUE(parameters[i].grad().defined());
          EXPECT_TRUE(
              torch::allclose(parameters[i].grad(),
                              torch::full_like(parameters[i], total / divisor)))
              << "parameter " << i << ", bucket_bytes " << bucket_bytes;
        }
      }
      // Parameters of 24, 8, 16 and 8 bytes: no two neighbours fit in 16
      // bytes together (4 buckets); 1 MiB holds all four.
      EXPECT_EQ(buckets[0], bucket_bytes == 16 ? 4 : 1);
      EXPECT_EQ(buckets[1], buckets[0]);
    }
  }
}

TEST(ProcessGroup, JoiningFailsAfterTheTimeoutWhenARankIsMissing) {
  SKIP_WITHOUT_C10D();
  dist::LaunchEnv env;
  env.rank = 0;
  env.world_size = 2;
  env.master_port = free_port();
  const auto start = Clock::now();
  try {
    dist::ProcessGroup group(
        env, dist::ProcessGroupOptions().timeout(std::chrono::seconds(2)));
    ADD_FAILURE() << "joined a job whose rank 1 never came";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("rank 0 of 2"), std::string::npos)
        << e.what();
  }
  const double waited =
      std::chrono::duration<double>(Clock::now() - start).count();
  EXPECT_GE(waited, 1.5);
  EXPECT_LT(waited, 30.0);
}

TEST(ProcessGroup, RejectsBadSettings) {
  dist::LaunchEnv env;
  env.rank = 2;
  env.world_size = 2;
  EXPECT_THROW(dist::ProcessGroup{env}, c10::Error);
  if (!dist::nccl_available()) {
    env.rank = 0;
    env.world_size = 1;
    EXPECT_THROW(dist::ProcessGroup(env, dist::ProcessGroupOptions().backend(
                                             dist::Backend::kNccl)),
                 c10::Error);
  }
}

// --------------------------------------------------- multi-process jobs ---

/// A running distributed_worker.
struct Worker {
  pid_t pid = -1;
  std::string stderr_path;
};

/// Starts distributed_worker OUT STEPS args..., as rank `rank` of `world`
/// at 127.0.0.1:port when world > 0, alone when world == 0.
Worker start_worker(const std::string& out, int64_t steps,
                    const std::vector<std::string>& args, int64_t rank,
                    int64_t world, int port) {
  std::vector<std::string> argv_strings = {MHA_DISTRIBUTED_WORKER, out,
                                           std::to_string(steps)};
  argv_strings.insert(argv_strings.end(), args.begin(), args.end());
  // The environment mha-train's launcher gives its workers.
  auto env_strings =
      world > 0
          ? mha::tools::worker_environment(
                {"RANK=" + std::to_string(rank),
                 "WORLD_SIZE=" + std::to_string(world), "MASTER_ADDR=127.0.0.1",
                 "MASTER_PORT=" + std::to_string(port)})
          : mha::tools::worker_environment({});
  auto pointers = [](std::vector<std::string>& strings) {
    std::vector<char*> result;
    for (auto& s : strings) {
      result.push_back(s.data());
    }
    result.push_back(nullptr);
    return result;
  };
  auto argv = pointers(argv_strings);
  auto envp = pointers(env_strings);
  Worker worker;
  worker.stderr_path = out + "/stderr" + std::to_string(rank) +
                       (world == 0 ? "-alone" : "") + ".txt";
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addopen(&actions, STDERR_FILENO,
                                   worker.stderr_path.c_str(),
                                   O_WRONLY | O_CREAT | O_TRUNC, 0644);
  const int error = posix_spawn(&worker.pid, MHA_DISTRIBUTED_WORKER, &actions,
                                nullptr, argv.data(), envp.data());
  posix_spawn_file_actions_destroy(&actions);
  EXPECT_EQ(error, 0) << "cannot start " << MHA_DISTRIBUTED_WORKER;
  return worker;
}

std::string read_file(const std::string& path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

/// Waits up to `limit` for the worker; returns its exit status, or -1 after
/// killing it when it did not exit in time (or was killed by a signal).
int wait_worker(const Worker& worker, std::chrono::seconds limit) {
  const auto deadline = Clock::now() + limit;
  while (true) {
    int status = 0;
    const pid_t done = waitpid(worker.pid, &status, WNOHANG);
    if (done == worker.pid) {
      return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
    }
    if (Clock::now() > deadline) {
      kill(worker.pid, SIGKILL);
      waitpid(worker.pid, &status, 0);
      return -1;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

/// Runs a job of `world` workers (0: one worker alone) to completion and
/// expects every one to succeed.
void run_job(const std::string& out, int64_t steps,
             const std::vector<std::string>& args, int64_t world) {
  fs::create_directories(out);
  const int port = free_port();
  std::vector<Worker> workers;
  for (int64_t rank = 0; rank < std::max<int64_t>(world, 1); ++rank) {
    workers.push_back(start_worker(out, steps, args, rank, world, port));
  }
  for (size_t rank = 0; rank < workers.size(); ++rank) {
    EXPECT_EQ(wait_worker(workers[rank], std::chrono::seconds(120)), 0)
        << "rank " << rank << ": " << read_file(workers[rank].stderr_path);
  }
}

/// The train_loss and val_loss columns of a loss CSV, by step.
std::map<int64_t, std::pair<double, double>> read_losses(
    const std::string& path) {
  std::map<int64_t, std::pair<double, double>> losses;
  std::ifstream in(path);
  std::string line;
  std::getline(in, line);  // header
  while (std::getline(in, line)) {
    std::vector<std::string> cells;
    std::stringstream row(line);
    for (std::string cell; std::getline(row, cell, ',');) {
      cells.push_back(cell);
    }
    EXPECT_GE(cells.size(), 4u) << line;
    losses[std::stoll(cells[0])] = {
        std::stod(cells[2]),
        cells[3].empty() ? std::nan("") : std::stod(cells[3])};
  }
  return losses;
}

void expect_same_losses(const std::string& actual_path,
                        const std::string& expected_path) {
  const auto actual = read_losses(actual_path);
  const auto expected = read_losses(expected_path);
  ASSERT_EQ(actual.size(), expected.size()) << actual_path;
  for (const auto& [step, losses] : expected) {
    ASSERT_EQ(actual.count(step), 1u) << "step " << step;
    const auto& [train_loss, val_loss] = actual.at(step);
    EXPECT_NEAR(train_loss, losses.first, 1e-5 * losses.first)
        << actual_path << ", step " << step;
    if (std::isnan(losses.second)) {
      EXPECT_TRUE(std::isnan(val_loss)) << "step " << step;
    } else {
      EXPECT_NEAR(val_loss, losses.second, 1e-5 * losses.second)
          << actual_path << ", step " << step;
    }
  }
}

void expect_close_parameters(const std::string& actual_path,
                             const std::string& expected_path, double rtol,
                             double atol) {
  const auto actual = mha::read_state_dict(actual_path);
  const auto expected = mha::read_state_dict(expected_path);
  ASSERT_EQ(actual.size(), expected.size());
  for (const auto& item : expected) {
    const auto& value = actual[item.key()];
    if (rtol == 0.0 && atol == 0.0) {
      EXPECT_TRUE(torch::equal(value, item.value())) << item.key();
    } else {
      EXPECT_TRUE(torch::allclose(value, item.value(), rtol, atol))
          << item.key() << ": max difference "
          << (value - item.value()).abs().max().item<double>();
    }
  }
}

class DataParallelTraining : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!dist::available()) {
      GTEST_SKIP() << "this build has no c10d/Gloo (libgloo-dev missing)";
    }
    dir_ = fs::temp_directory_path() /
           ("mha-distributed-" + std::to_string(getpid()) + "-" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override {
    if (!HasFailure()) {
      fs::remove_all(dir_);
    }
  }
  std::string path(const std::string& name) const {
    return (dir_ / name).string();
  }
  fs::path dir_;
};

// Parameters after training equal the single process's up to float
// rounding, amplified where the gradient is zero in exact arithmetic: the
// key projection's bias cannot change a softmax over keys, so its gradient
// is rounding noise that Adam turns into steps of up to lr (3e-3) in either
// run. Hence atol 1e-3 for parameters; the gradients themselves and the
// losses are compared tightly.
constexpr double kParamRtol = 1e-4, kParamAtol = 1e-3;

TEST_F(DataParallelTraining, TwoProcessesTakeTheStepsOfOne) {
  // Batch 16 with variable lengths: the two shards hold different numbers
  // of real tokens at every step. No clipping, so that the gradients'
  // scale shows (Adam itself is blind to it).
  run_job(path("alone"), 12, {"grad_clip=0"}, /*world=*/0);
  run_job(path("two"), 12, {"grad_clip=0"}, /*world=*/2);
  expect_same_losses(path("two/rank0.csv"), path("alone/rank0.csv"));
  expect_same_losses(path("two/rank1.csv"), path("alone/rank0.csv"));
  // Step 1's gradients: the whole batch's, on both ranks.
  expect_close_parameters(path("two/rank0.grads.safetensors"),
                          path("alone/rank0.grads.safetensors"), 1e-4, 1e-6);
  expect_close_parameters(path("two/rank1.grads.safetensors"),
                          path("two/rank0.grads.safetensors"), 0.0, 0.0);
  // The ranks hold identical parameters, and those of the single process up
  // to rounding (the sums run in another order).
  expect_close_parameters(path("two/rank1.safetensors"),
                          path("two/rank0.safetensors"), 0.0, 0.0);
  expect_close_parameters(path("two/rank0.safetensors"),
                          path("alone/rank0.safetensors"), kParamRtol,
                          kParamAtol);
}

TEST_F(DataParallelTraining, ResumesWithAnotherWorldSize) {
  run_job(path("alone"), 12, {}, /*world=*/0);
  // Two processes stop at step 6; one process resumes to 12, and the other
  // way round. Both end as the uninterrupted single process.
  const std::string a = "checkpoints=" + path("a");
  run_job(path("a"), 12, {a, "stop_at=6"}, /*world=*/2);
  run_job(path("a"), 12, {a, "resume=1"}, /*world=*/0);
  expect_same_losses(path("a/rank0.csv"), path("alone/rank0.csv"));
  expect_close_parameters(path("a/rank0.safetensors"),
                          path("alone/rank0.safetensors"), kParamRtol,
                          kParamAtol);

  const std::string b = "checkpoints=" + path("b");
  run_job(path("b"), 12, {b, "stop_at=6"}, /*world=*/0);
  run_job(path("b"), 12, {b, "resume=1"}, /*world=*/3);
  for (const char* rank : {"0", "1", "2"}) {
    expect_same_losses(path(std::string("b/rank") + rank + ".csv"),
                       path("alone/rank0.csv"));
  }
  expect_close_parameters(path("b/rank2.safetensors"),
                          path("b/rank0.safetensors"), 0.0, 0.0);
  expect_close_parameters(path("b/rank0.safetensors"),
                          path("alone/rank0.safetensors"), kParamRtol,
                          kParamAtol);
}

TEST_F(DataParallelTraining, AKilledRankMakesTheOtherExitWithAnError) {
  const int port = free_port();
  const auto out = dir_.string();
  const std::vector<std::string> args = {"timeout_ms=20000"};
  auto rank0 = start_worker(out, 1000000, args, 0, 2, port);
  auto rank1 = start_worker(out, 1000000, args, 1, 2, port);
  // Kill rank 1 once training is under way.
  const auto started = Clock::now();
  while (!fs::exists(path("rank1.step")) &&
         Clock::now() - started < std::chrono::seconds(60)) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  ASSERT_TRUE(fs::exists(path("rank1.step")))
      << read_file(rank1.stderr_path) << read_file(rank0.stderr_path);
  kill(rank1.pid, SIGKILL);
  wait_worker(rank1, std::chrono::seconds(10));
  const auto killed = Clock::now();
  const int status = wait_worker(rank0, std::chrono::seconds(40));
  const double seconds =
      std::chrono::duration<double>(Clock::now() - killed).count();
  EXPECT_EQ(status, 1) << read_file(rank0.stderr_path);
  EXPECT_LT(seconds, 25.0) << "the surviving rank took too long to stop";
  EXPECT_NE(read_file(rank0.stderr_path).find("failed on rank 0 of 2"),
            std::string::npos)
      << read_file(rank0.stderr_path);
}

}  // namespace

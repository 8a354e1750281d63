// Checkpoints: the run's file paths (RunFiles), and saving and restoring
// weights, optimizer, step, RNG state, loss history and fingerprint.
#include "mha/train/checkpoint.h"

#include <ATen/CPUGeneratorImpl.h>

#include <algorithm>
#include <array>
#include <filesystem>
#include <mutex>
#include <sstream>

#include "common.h"
#include "io/atomic_file.h"
#include "mha/state_dict.h"

namespace mha::train {

namespace fs = std::filesystem;
using detail::history_from_tensor;
using detail::history_to_tensor;

// ------------------------------------------------------- checkpoints ---

RunFiles::RunFiles(const std::string& out_dir) {
  const fs::path root(out_dir);
  checkpoint_dir = (root / "checkpoint").string();
  model = (root / "checkpoint" / "model.safetensors").string();
  trainer = (root / "checkpoint" / "trainer.pt").string();
  loss_csv = (root / "loss.csv").string();
  loss_svg = (root / "loss.svg").string();
}

namespace {

/// Columns of the history tensor in trainer.pt.
constexpr int64_t kHistoryColumns = 6;

}  // namespace

namespace detail {

torch::Tensor history_to_tensor(const std::vector<LossRecord>& history) {
  auto table =
      torch::empty({static_cast<int64_t>(history.size()), kHistoryColumns},
                   torch::kFloat64);  // (steps, 6)
  auto rows = table.accessor<double, 2>();
  for (size_t i = 0; i < history.size(); ++i) {
    const auto& r = history[i];
    const std::array<double, kHistoryColumns> row = {
        static_cast<double>(r.step),
        r.lr,
        r.train_loss,
        r.val_loss,
        r.tokens_per_s,
        r.elapsed_s};
    for (int64_t j = 0; j < kHistoryColumns; ++j) {
      rows[static_cast<int64_t>(i)][j] = row[j];
    }
  }
  return table;
}

std::vector<LossRecord> history_from_tensor(const torch::Tensor& tensor) {
  auto table = tensor.to(torch::kCPU, torch::kFloat64).contiguous();
  TORCH_CHECK(table.dim() == 2 && table.size(1) == kHistoryColumns,
              "load_checkpoint: the history must be (steps, ", kHistoryColumns,
              "), but got ", table.sizes());
  auto rows = table.accessor<double, 2>();
  std::vector<LossRecord> history(table.size(0));
  for (int64_t i = 0; i < table.size(0); ++i) {
    auto& r = history[i];
    r.step = static_cast<int64_t>(rows[i][0]);
    r.lr = rows[i][1];
    r.train_loss = rows[i][2];
    r.val_loss = rows[i][3];
    r.tokens_per_s = rows[i][4];
    r.elapsed_s = rows[i][5];
  }
  return history;
}

}  // namespace detail

namespace {

/// The "key=value" entries of `a` and `b` that differ, as "key: a vs b".
std::string fingerprint_difference(const std::string& a, const std::string& b) {
  auto split = [](const std::string& s) {
    std::vector<std::string> items;
    std::istringstream in(s);
    for (std::string item; in >> item;) {
      items.push_back(item);
    }
    return items;
  };
  auto key_of = [](const std::string& item) {
    return item.substr(0, item.find('='));
  };
  const auto items_a = split(a), items_b = split(b);
  std::string out;
  for (const auto& item : items_a) {
    const auto key = key_of(item);
    std::string other = "(absent)";
    for (const auto& candidate : items_b) {
      if (key_of(candidate) == key) {
        other = candidate.substr(key.size() + 1);
      }
    }
    const std::string value =
        item.substr(std::min(item.size(), key.size() + 1));
    if (value != other) {
      out += (out.empty() ? "" : ", ") + key + " " + value + " vs " + other;
    }
  }
  return out.empty() ? a + " vs " + b : out;
}

}  // namespace

bool recover_checkpoint(const RunFiles& files) {
  const fs::path final_dir(files.checkpoint_dir);
  const fs::path previous = final_dir.string() + ".old";
  try {
    if (fs::exists(final_dir) || !fs::exists(previous / "trainer.pt") ||
        !fs::exists(previous / "model.safetensors")) {
      return false;
    }
    fs::rename(previous, final_dir);
  } catch (const fs::filesystem_error& e) {
    TORCH_CHECK(false, "recover_checkpoint: cannot restore '",
                previous.string(), "' as '", files.checkpoint_dir,
                "': ", e.what());
  }
  mha::detail::sync_path(final_dir.parent_path().string(),
                         "recover_checkpoint");
  return true;
}

void save_checkpoint(const RunFiles& files, const torch::nn::Module& model,
                     torch::optim::Optimizer& optimizer,
                     const std::vector<LossRecord>& history,
                     const std::string& fingerprint) {
  const fs::path final_dir(files.checkpoint_dir);
  const fs::path temporary = final_dir.string() + ".tmp";
  const fs::path previous = final_dir.string() + ".old";
  // A crash at any point below leaves a complete checkpoint in final_dir,
  // or (between the two renames) in previous, which recover_checkpoint
  // moves back; first, finish such an interrupted swap.
  recover_checkpoint(files);
  try {
    fs::remove_all(temporary);
    fs::create_directories(temporary);

    // The weights, in a format mha::load_state_dict (and Python) reads.
    save_state_dict(model, (temporary / "model.safetensors").string());

    // Everything else the loop needs to continue exactly.
    torch::serialize::OutputArchive archive;
    archive.write("fingerprint", c10::IValue(fingerprint));
    archive.write("step", c10::IValue(history.empty() ? int64_t{0}
                                                      : history.back().step));
    {
      auto generator = at::detail::getDefaultCPUGenerator();
      std::lock_guard<std::mutex> lock(generator.mutex());
      archive.write("rng_cpu", generator.get_state());
    }
    archive.write("history", history_to_tensor(history));
    torch::serialize::OutputArchive optimizer_archive;
    optimizer.save(optimizer_archive);
    archive.write("optimizer", optimizer_archive);
    archive.save_to((temporary / "trainer.pt").string());
    // model.safetensors is synced by its writer (atomic_file.h).
    mha::detail::sync_path((temporary / "trainer.pt").string(),
                           "save_checkpoint");
    mha::detail::sync_path(temporary.string(), "save_checkpoint");

    // Swap the complete new checkpoint in.
    fs::remove_all(previous);
    if (fs::exists(final_dir)) {
      fs::rename(final_dir, previous);
    }
    fs::rename(temporary, final_dir);
    auto parent = final_dir.parent_path();
    mha::detail::sync_path(parent.empty() ? "." : parent.string(),
                           "save_checkpoint");
    fs::remove_all(previous);
  } catch (const fs::filesystem_error& e) {
    TORCH_CHECK(false, "save_checkpoint: cannot write '", files.checkpoint_dir,
                "': ", e.what());
  }
}

std::vector<LossRecord> load_checkpoint(const RunFiles& files,
                                        torch::nn::Module& model,
                                        torch::optim::Optimizer& optimizer,
                                        const std::string& fingerprint) {
  recover_checkpoint(files);
  TORCH_CHECK(fs::exists(files.trainer) && fs::exists(files.model),
              "no checkpoint to resume in '", files.checkpoint_dir,
              "' (it needs model.safetensors and trainer.pt)");
  const auto parameters = model.parameters();
  const auto device =
      parameters.empty() ? torch::Device(torch::kCPU) : parameters[0].device();
  torch::serialize::InputArchive archive;
  archive.load_from(files.trainer, device);

  c10::IValue saved_fingerprint;
  archive.read("fingerprint", saved_fingerprint);
  TORCH_CHECK(
      saved_fingerprint.toStringRef() == fingerprint, "the checkpoint in '",
      files.checkpoint_dir,
      "' is from a run with other settings (checkpoint vs now: ",
      fingerprint_difference(saved_fingerprint.toStringRef(), fingerprint),
      ")");

  load_state_dict(model, files.model, /*strict=*/true);

  torch::serialize::InputArchive optimizer_archive;
  archive.read("optimizer", optimizer_archive);
  optimizer.load(optimizer_archive);

  torch::Tensor rng_state, history;
  archive.read("rng_cpu", rng_state);
  archive.read("history", history);
  {
    auto generator = at::detail::getDefaultCPUGenerator();
    std::lock_guard<std::mutex> lock(generator.mutex());
    generator.set_state(rng_state.to(torch::kCPU));
  }
  c10::IValue step;
  archive.read("step", step);
  auto records = history_from_tensor(history);
  TORCH_CHECK(!records.empty() && records.back().step == step.toInt(),
              "load_checkpoint: the history in '", files.trainer,
              "' does not end at the checkpoint's step ", step.toInt());
  return records;
}

}  // namespace mha::train

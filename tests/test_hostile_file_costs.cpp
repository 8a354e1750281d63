// Tests that hostile state-dict files of several megabytes cost what their
// size allows (issue 47, part 5): at most 64 MiB + 4 times the file's size
// of memory over the process's footprint before the load, and (files over
// 1 MiB) at most 2 s of CPU. One test per kind of file, each built here:
// MARKs nested millions deep, tuples nested millions deep, memo floods
// (MEMOIZE, sparse LONG_BINPUT, BINGET), millions of pickle objects, a state
// dict of 700k empty tensors; safetensors headers of 300k tensors, of a
// shape of 8 million dimensions, of 1.2 million metadata strings; and
// through mha::hf, the 300k-tensor file as a checkpoint and an index of
// 400k names. Each load runs in a forked child, whose peak resident set
// (VmHWM, reset before the load) over its resident set before the load is
// the memory it cost, and whose CPU time is the time; the child ends with
// _exit, so the parent's state is untouched. A load must end in a clean
// c10::Error naming the file, or in success, within the bounds.
#include <gtest/gtest.h>
#include <malloc.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <torch/torch.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iostream>
#include <string>
#include <vector>

#include "fixture_helpers.h"
#include "mha/hf.h"
#include "mha/mha.h"
#include "state_dict_files.h"
#include "test_helpers.h"

#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
#define MHA_TEST_SANITIZED 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer) || \
    __has_feature(memory_sanitizer)
#define MHA_TEST_SANITIZED 1
#endif
#endif

namespace {

namespace fs = std::filesystem;
using handmade::Pickle;
using handmade::zip_bytes;

constexpr double kMiB = 1024.0 * 1024.0;

/// What one load in a child process cost and how it ended.
struct LoadCost {
  bool finished = false;  // the child reported (no crash, no hang)
  bool loaded = false;    // the load returned
  std::string error;      // the c10::Error's text when it threw
  double peak_mib = 0;    // peak resident set over the one before the load
  double cpu_s = 0;       // CPU time of the load (user + system)
  double wall_s = 0;
};

/// A field of /proc/self/status in kB ("VmRSS", "VmHWM"), -1 if absent.
long status_kb(const char* field) {
  FILE* f = std::fopen("/proc/self/status", "r");
  if (f == nullptr) {
    return -1;
  }
  char line[256];
  long kb = -1;
  const size_t n = std::strlen(field);
  while (std::fgets(line, sizeof line, f) != nullptr) {
    if (std::strncmp(line, field, n) == 0 && line[n] == ':') {
      kb = std::strtol(line + n + 1, nullptr, 10);
      break;
    }
  }
  std::fclose(f);
  return kb;
}

double cpu_seconds() {
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  return static_cast<double>(usage.ru_utime.tv_sec + usage.ru_stime.tv_sec) +
         static_cast<double>(usage.ru_utime.tv_usec + usage.ru_stime.tv_usec) *
             1e-6;
}

/// Runs `load` in a forked child and returns what it cost. The child resets
/// its peak resident set (clear_refs 5) before the load, so the peak is the
/// load's own; a child that runs over 120 s is killed (finished stays false).
LoadCost measure(const std::function<void()>& load) {
  int fds[2];
  if (pipe(fds) != 0) {
    ADD_FAILURE() << "pipe: " << std::strerror(errno);
    return {};
  }
  std::cout.flush();
  std::cerr.flush();
  const pid_t pid = fork();
  if (pid < 0) {
    ADD_FAILURE() << "fork: " << std::strerror(errno);
    return {};
  }
  if (pid == 0) {
    close(fds[0]);
    alarm(120);
    malloc_trim(0);  // free memory the parent left resident is not counted
    if (FILE* clear = std::fopen("/proc/self/clear_refs", "w")) {
      std::fputs("5", clear);
      std::fclose(clear);
    }
    const long rss_before = status_kb("VmRSS");
    const double cpu_before = cpu_seconds();
    const auto wall_before = std::chrono::steady_clock::now();
    std::string result;
    try {
      load();
      result = "loaded";
    } catch (const c10::Error& e) {
      result = std::string("error ") + e.what_without_backtrace();
    } catch (const std::exception& e) {
      result = std::string("other ") + e.what();
    }
    const double wall = std::chrono::duration<double>(
                            std::chrono::steady_clock::now() - wall_before)
                            .count();
    const double cpu = cpu_seconds() - cpu_before;
    const long peak = status_kb("VmHWM");
    const std::string report = std::to_string(peak - rss_before) + " " +
                               std::to_string(cpu) + " " +
                               std::to_string(wall) + " " + result;
    size_t written = 0;
    while (written < report.size()) {
      const ssize_t n =
          write(fds[1], report.data() + written, report.size() - written);
      if (n <= 0) {
        break;
      }
      written += static_cast<size_t>(n);
    }
    _exit(0);
  }
  close(fds[1]);
  std::string report;
  char buffer[4096];
  ssize_t n = 0;
  while ((n = read(fds[0], buffer, sizeof buffer)) > 0) {
    report.append(buffer, static_cast<size_t>(n));
  }
  close(fds[0]);
  int status = 0;
  waitpid(pid, &status, 0);
  LoadCost cost;
  long peak_kb = 0;
  int used = 0;
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0 ||
      std::sscanf(report.c_str(), "%ld %lf %lf %n", &peak_kb, &cost.cpu_s,
                  &cost.wall_s, &used) != 3) {
    ADD_FAILURE() << "the child did not finish (status " << status
                  << "): " << report;
    return cost;
  }
  cost.finished = true;
  cost.peak_mib = static_cast<double>(peak_kb) / 1024.0;
  const std::string result = report.substr(static_cast<size_t>(used));
  cost.loaded = result == "loaded";
  if (result.rfind("error ", 0) == 0) {
    cost.error = result.substr(6);
  } else if (!cost.loaded) {
    ADD_FAILURE() << "not a c10::Error: " << result;
  }
  return cost;
}

class HostileFileCostTest : public ::testing::Test {
 protected:
  void SetUp() override {
    // What every load needs once (LibTorch's allocator, the zip reader, a
    // c10::Error) is set up here, in the parent, and so not counted.
    mha::MultiHeadAttention attention(4, 2);
    const std::string warm = path("warm.pt");
    mha::save_state_dict(*attention, warm);
    mha::load_state_dict(*attention, warm);
    const std::string warm_st = path("warm.safetensors");
    mha::save_state_dict(*attention, warm_st);
    mha::load_state_dict(*attention, warm_st);
    try {
      mha::read_state_dict(path("absent.pt"));
    } catch (const c10::Error&) {
    }
  }

  std::string path(const std::string& name) const {
    return (fs::path(dir_) / name).string();
  }

  /// Writes `bytes` to the file `name` and returns its path.
  std::string file(const std::string& name, const std::string& bytes) const {
    const std::string p = path(name);
    std::ofstream out(p, std::ios::binary | std::ios::trunc);
    out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    return p;
  }

  /// Loads `path` with `load` in a child and checks the cost against the
  /// bounds of a file of `bytes` bytes: 64 MiB + 4 times its size, 2 s of
  /// CPU. `refusal` is what the error must say ("" when the load must
  /// succeed); the error must also name `path`.
  static LoadCost expect_bounded(const std::string& kind,
                                 const std::string& path, uint64_t bytes,
                                 const std::function<void()>& load,
                                 const std::string& refusal) {
    const LoadCost cost = measure(load);
    const double bound_mib = 64.0 + 4.0 * static_cast<double>(bytes) / kMiB;
    std::cout << "[  cost    ] " << kind << ": "
              << static_cast<double>(bytes) / kMiB << " MiB file, peak +"
              << cost.peak_mib << " MiB (bound " << bound_mib << "), "
              << cost.cpu_s << " s CPU, " << cost.wall_s << " s wall: "
              << (cost.loaded ? "loaded" : cost.error.substr(0, 300)) << "\n";
    if (!cost.finished) {
      return cost;
    }
    if (refusal.empty()) {
      EXPECT_TRUE(cost.loaded) << cost.error;
    } else {
      EXPECT_FALSE(cost.loaded);
      EXPECT_NE(cost.error.find(refusal), std::string::npos)
          << "message: " << cost.error << "\nexpected: " << refusal;
      EXPECT_NE(cost.error.find(path), std::string::npos)
          << "message: " << cost.error << "\nexpected to name " << path;
    }
#ifndef MHA_TEST_SANITIZED
    EXPECT_LE(cost.peak_mib, bound_mib) << kind;
#ifdef NDEBUG
    if (bytes > (1u << 20)) {
      EXPECT_LE(cost.cpu_s, 2.0) << kind;
    }
#endif
#endif
    return cost;
  }

  /// expect_bounded for mha::read_state_dict of the zip file of `records`.
  void expect_zip_bounded(
      const std::string& kind,
      const std::vector<std::pair<std::string, std::string>>& records,
      const std::string& refusal) {
    const std::string bytes = zip_bytes(records);
    const std::string p = file(kind + ".pt", bytes);
    expect_bounded(
        kind, p, bytes.size(), [&] { mha::read_state_dict(p); }, refusal);
  }

 private:
  std::string dir_ = fixtures::temp_dir("hostile-cost");
};

/// `value` as 4 little-endian bytes.
std::string le32(uint32_t value) {
  std::string s(4, '\0');
  for (int i = 0; i < 4; ++i) {
    s[static_cast<size_t>(i)] = static_cast<char>((value >> (8 * i)) & 0xff);
  }
  return s;
}

/// Repeats `unit` `n` times.
std::string repeat(const std::string& unit, size_t n) {
  std::string s;
  s.reserve(unit.size() * n);
  for (size_t i = 0; i < n; ++i) {
    s += unit;
  }
  return s;
}

constexpr size_t kMillion = 1000 * 1000;

TEST_F(HostileFileCostTest, NestedMarks) {
  // 16 million MARKs, never closed.
  Pickle p;
  p.proto().raw(std::string(16 * kMillion, '(')).op('.');
  expect_zip_bounded("nested-marks", {{"data.pkl", p.bytes}},
                     "brings the memory this load holds");
}

TEST_F(HostileFileCostTest, NestedTuples) {
  // ((((None,),),),...) 6 million deep: MARKs, then TUPLEs closing them.
  constexpr size_t kDepth = 6 * kMillion;
  Pickle p;
  p.proto().raw(std::string(kDepth, '(')).op('N');
  p.raw(std::string(kDepth, 't')).op('.');
  expect_zip_bounded("nested-tuples", {{"data.pkl", p.bytes}},
                     "brings the memory this load holds");
}

TEST_F(HostileFileCostTest, MemoFloods) {
  // 16 million MEMOIZEs of one None.
  Pickle memoize;
  memoize.proto().op('N').raw(std::string(16 * kMillion, '\x94')).op('.');
  expect_zip_bounded("memoize-flood", {{"data.pkl", memoize.bytes}},
                     "must be a dict or collections.OrderedDict");
  // 3 million LONG_BINPUTs at scattered indices.
  Pickle sparse;
  sparse.proto().op('N');
  for (uint32_t i = 0; i < 3 * kMillion; ++i) {
    sparse.op('r').raw(le32(0xfffffff0u - 7 * i));
  }
  sparse.op('.');
  expect_zip_bounded("sparse-memo-flood", {{"data.pkl", sparse.bytes}},
                     "brings the memory this load holds");
  // 8 million BINGETs of one memo entry: a stack of 8 million values.
  Pickle gets;
  gets.proto().op('N').op('q').op(0);
  gets.raw(repeat(std::string("h\x00", 2), 8 * kMillion)).op('.');
  expect_zip_bounded("binget-flood", {{"data.pkl", gets.bytes}},
                     "brings the memory this load holds");
}

TEST_F(HostileFileCostTest, MillionsOfObjects) {
  // A list of 5.3 million ints, 3 bytes each (BININT2): within the cap of
  // 1 object per 3 bytes.
  constexpr size_t kInts = 16 * kMillion / 3;
  Pickle p;
  p.proto().op(']').mark().raw(repeat(std::string("M\x01\x00", 3), kInts));
  p.op('e').op('.');
  expect_zip_bounded("object-flood", {{"data.pkl", p.bytes}},
                     "brings the memory this load holds");
}

TEST_F(HostileFileCostTest, MillionsOfEmptyTensors) {
  // An OrderedDict of 700k empty float32 tensors, views of one empty
  // storage, 24 bytes of pickle each: the first tensor memoizes what every
  // tensor shares (the global, the storage, size, stride, hooks), as
  // Python's pickler does, and the others fetch it with BINGETs.
  constexpr size_t kTensors = 700 * 1000;
  Pickle p;
  p.proto().ordered_dict().mark();
  p.op(0x8c).op(6).raw("000000");
  p.global("torch._utils", "_rebuild_tensor_v2").op('q').op(0).mark();
  p.mark().str("storage").global("torch", "FloatStorage").str("0").str("cpu");
  p.int1(0).op('t').op('Q').op('q').op(1);  // the storage
  p.int1(0);                                // storage offset
  p.int1(0).op(0x85).op('q').op(2);         // size (0,)
  p.int1(1).op(0x85).op('q').op(3);         // stride (1,)
  p.op(0x89).ordered_dict().op('q').op(4);  // requires_grad, hooks
  p.op('t').op('R');
  char key[8];
  for (size_t i = 1; i < kTensors; ++i) {
    if (i % 1000 == 0) {
      p.op('u').mark();
    }
    std::snprintf(key, sizeof key, "%06zx", i);
    p.op(0x8c).op(6).raw(key);
    p.raw(std::string("h\x00(h\x01K\x00h\x02h\x03\x89h\x04tR", 16));
  }
  p.op('u').op('.');
  expect_zip_bounded("tensor-flood", {{"data.pkl", p.bytes}, {"data/0", ""}},
                     "brings the memory this load holds");
}

/// A safetensors header of `n` float32 tensors of one element, "t000000"
/// and on, and their data.
std::string many_tensors_safetensors(size_t n) {
  std::string header = "{";
  char entry[128];
  for (size_t i = 0; i < n; ++i) {
    std::snprintf(entry, sizeof entry,
                  "%s\"t%06zu\":{\"dtype\":\"F32\",\"shape\":[1],"
                  "\"data_offsets\":[%zu,%zu]}",
                  i == 0 ? "" : ",", i, 4 * i, 4 * i + 4);
    header += entry;
  }
  header += "}";
  return handmade::safetensors(header, std::string(4 * n, '\0'));
}

TEST_F(HostileFileCostTest, SafetensorsHeaders) {
  // 300k tensors of one float each: 20 MB of header.
  const std::string tensors = many_tensors_safetensors(300 * 1000);
  const std::string many = file("many-tensors.safetensors", tensors);
  expect_bounded(
      "300k-tensor safetensors", many, tensors.size(),
      [&] { mha::read_state_dict(many); }, "brings the memory this load holds");
  // A shape of 8 million dimensions.
  const std::string dims = handmade::safetensors(
      R"({"a":{"dtype":"F32","shape":[)" + repeat("1,", 8 * kMillion) +
          R"(1],"data_offsets":[0,4]}})",
      std::string(4, '\0'));
  const std::string shape = file("shape.safetensors", dims);
  expect_bounded(
      "8M-dimension shape safetensors", shape, dims.size(),
      [&] { mha::read_state_dict(shape); },
      "the value of 'a' holds more than 4096 JSON values");
  // 1.2 million metadata strings before one tensor.
  std::string header = R"({"__metadata__":{)";
  char entry[32];
  for (size_t i = 0; i < 1200 * 1000; ++i) {
    std::snprintf(entry, sizeof entry, "%s\"k%07zu\":\"\"", i == 0 ? "" : ",",
                  i);
    header += entry;
  }
  header += R"(},"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})";
  const std::string bytes = handmade::safetensors(header, std::string(8, '\0'));
  const std::string metadata = file("metadata.safetensors", bytes);
  expect_bounded(
      "metadata-flood safetensors", metadata, bytes.size(),
      [&] {
        const auto dict = mha::read_state_dict(metadata);
        TORCH_CHECK(dict.size() == 1 && dict["a"].numel() == 2);
      },
      "");
}

TEST_F(HostileFileCostTest, HfCheckpoints) {
  // mha::hf reads a model directory's checkpoint with the same readers: of
  // the 300k-tensor file as model.safetensors it keeps only the layer's
  // tensors (none: the file is refused for lacking them).
  const std::string llama = fixtures::path("hf/llama");
  const std::string many_dir = fixtures::temp_dir("hostile-hf-many");
  fs::copy_file(llama + "/config.json", many_dir + "/config.json");
  const std::string tensors = many_tensors_safetensors(300 * 1000);
  const std::string many = many_dir + "/model.safetensors";
  std::ofstream(many, std::ios::binary) << tensors;
  expect_bounded(
      "300k-tensor model.safetensors (mha::hf)", many, tensors.size(),
      [&] { mha::hf::load_attention(many_dir, 1); },
      ": no tensor 'layers.1.self_attn.q_proj.weight'");
  // An index whose weight_map names 400k tensors the layer does not need
  // besides the real ones: only the layer's are kept.
  const std::string index_dir = fixtures::temp_dir("hostile-hf-index");
  fs::copy_file(llama + "/config.json", index_dir + "/config.json");
  fs::copy_file(llama + "/model.safetensors",
                index_dir + "/model-00001.safetensors");
  std::string index = R"({"metadata":{},"weight_map":{)";
  for (const auto& item : mha::read_state_dict(llama + "/model.safetensors")) {
    index += "\"" + item.key() + "\":\"model-00001.safetensors\",";
  }
  char entry[96];
  for (size_t i = 0; i < 400 * 1000; ++i) {
    std::snprintf(entry, sizeof entry,
                  "%s\"model.layers.%zu.mlp.up.weight\":\"model-%05zu.st\"",
                  i == 0 ? "" : ",", i + 100, i % 7);
    index += entry;
  }
  index += "}}";
  const std::string index_path = index_dir + "/model.safetensors.index.json";
  std::ofstream(index_path, std::ios::binary) << index;
  expect_bounded(
      "400k-name index.json (mha::hf)", index_path, index.size(),
      [&] { mha::hf::load_attention(index_dir, 1); }, "");
}

TEST_F(HostileFileCostTest, ManySmallTensorsStillLoad) {
  // Not hostile: 50,000 tensors of 16 floats under names of 36 characters,
  // as save_state_dict writes them (PyTorch zip and safetensors), load
  // whole, within the same bounds.
  torch::OrderedDict<std::string, torch::Tensor> many;
  char name[48];
  for (int i = 0; i < 50000; ++i) {
    std::snprintf(name, sizeof name, "model.layers.%05d.self_attn.q.weight", i);
    many.insert(name, torch::full({4, 4}, static_cast<float>(i)));
  }
  for (const char* extension : {".pt", ".safetensors"}) {
    const std::string p = path(std::string("many") + extension);
    mha::write_state_dict(many, p);
    expect_bounded(
        std::string("50k small tensors, ") + extension, p, fs::file_size(p),
        [&] {
          const auto dict = mha::read_state_dict(p);
          TORCH_CHECK(dict.size() == 50000 &&
                      dict["model.layers.49999.self_attn.q.weight"].equal(
                          torch::full({4, 4}, 49999.f)));
        },
        "");
  }
}

}  // namespace

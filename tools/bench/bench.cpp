// mha-bench's measuring: the contenders of a row (mha, torch::nn, and
// projections+SDPA from bench_sdpa.cpp) built on the same weights and
// inputs, their results compared with torch::nn's, the timed repetitions and
// peak memory (in process or in a child). The measurements beside the table
// are in bench_variants.cpp, formatting in bench_report.cpp.
//
// Glossary: N batch, L sequence length (S = L), E embed_dim, H num_heads,
// F dim_feedforward.
#include "bench/bench.h"

#include <malloc.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <fstream>
#include <limits>
#include <new>
#include <sstream>
#include <utility>

#include "bench/bench_run.h"
#include "bench/bench_sdpa.h"
#include "core/attention_core.h"
#include "mha/mha.h"
#include "mha/parity.h"
#include "modules/projection.h"

namespace mha::bench {

void synchronize(const torch::Device& device) {
  if (device.is_cuda()) {
    torch::cuda::synchronize();
  }
}

namespace {

/// Random biases (torch::nn initialises them to zero, which would hide a
/// bias mix-up from the check).
void randomize_biases(torch::nn::Module& module) {
  torch::NoGradGuard no_grad;
  for (auto& p : module.named_parameters()) {
    if (p.key().find("bias") != std::string::npos) {
      p.value().uniform_(-0.1, 0.1);
    }
  }
}

/// Settings::plant_fault: shifts one element of mha's out_proj.bias after
/// the weight copy (one element: a layer norm would cancel a uniform shift).
void plant_fault(torch::nn::Module& module) {
  torch::NoGradGuard no_grad;
  for (auto& p : module.named_parameters()) {
    if (p.key().find("out_proj.bias") != std::string::npos) {
      p.value()[0].add_(0.1);
    }
  }
}

/// Both contenders on the settings' device and dtype, torch::nn's weights
/// (with random biases) copied into mha's, the planted fault if asked for,
/// both in eval mode.
template <typename Ref, typename Ours>
void prepare_pair(Ref& ref, Ours& ours, const Settings& settings) {
  ref->to(settings.device, settings.dtype);
  ours->to(settings.device, settings.dtype);
  randomize_biases(*ref);
  mha::copy_weights(ref, ours);
  if (settings.plant_fault) {
    plant_fault(*ours);
  }
  ref->eval();
  ours->eval();
}

Contenders make_encoder(const Shape& s, const torch::Tensor& x,
                        const Settings& settings) {
  const int64_t E = s.embed_dim, H = s.num_heads;
  torch::nn::TransformerEncoderLayer ref(
      torch::nn::TransformerEncoderLayerOptions(E, H)
          .dim_feedforward(4 * E)
          .dropout(0.0));
  mha::TransformerEncoderLayer ours(mha::TransformerEncoderLayerOptions(E, H)
                                        .dim_feedforward(4 * E)
                                        .dropout(0.0)
                                        .batch_first(false));
  prepare_pair(ref, ours, settings);
  Contenders c;
  c.mha = [ours, x]() mutable {
    torch::NoGradGuard no_grad;
    return Named{{"output", ours->forward(x)}};  // (L, N, E)
  };
  c.torch_nn = [ref, x]() mutable {
    torch::NoGradGuard no_grad;
    return Named{{"output", ref->forward(x)}};  // (L, N, E)
  };
  c.sdpa = make_sdpa_encoder(ref, x, settings.plant_fault);
  return c;
}

/// The projections of a self-attention contender, on `ref`'s weights (own
/// copies, so that gradients stay apart): x (L, N, E) through the packed
/// in-projection, its value third (L, N, E) straight through out_proj, no
/// attention between; the mode's grad mode, and in fwd-bwd the backward of
/// (out · grad_out).sum() into the weights and its own input leaf. Through
/// torch::linear (torch::nn's and the SDPA contender's products), or with
/// `ours` through mha's projection (src/modules/projection.h: in float32,
/// oneDNN's product in fixed chunks of rows).
Run make_projections(const torch::nn::MultiheadAttention& ref,
                     const torch::Tensor& x, const torch::Tensor& grad_out,
                     Mode mode, bool ours) {
  auto copy = [](const torch::Tensor& t) {
    return t.defined() ? t.detach().clone().requires_grad_(true) : t;
  };
  std::vector<torch::Tensor> weights = {
      copy(ref->in_proj_weight), copy(ref->in_proj_bias),
      copy(ref->out_proj->weight), copy(ref->out_proj->bias)};
  const bool backward = mode == Mode::kForwardBackward;
  const bool no_grad = mode == Mode::kInference;
  auto input = backward ? x.clone().requires_grad_(true) : x;
  const int64_t E = x.size(2);
  using Linear = torch::Tensor (*)(const torch::Tensor&, const torch::Tensor&,
                                   const torch::Tensor&);
  const Linear linear =
      ours ? Linear{mha::detail::project}
           : Linear{[](const torch::Tensor& in, const torch::Tensor& w,
                       const torch::Tensor& b) {
               return torch::linear(in, w, b);
             }};
  return [weights, input, grad_out, backward, no_grad, E, linear]() mutable {
    torch::AutoGradMode grad_mode(/*enabled=*/!no_grad);
    for (auto& w : weights) {
      if (w.defined()) {
        w.mutable_grad() = torch::Tensor();
      }
    }
    input.mutable_grad() = torch::Tensor();
    auto qkv = linear(input, weights[0], weights[1]);  // (L, N, 3E)
    auto out = linear(qkv.narrow(-1, 2 * E, E), weights[2],
                      weights[3]);  // (L, N, E)
    if (!backward) {
      return Named{{"output", out}};
    }
    (out * grad_out).sum().backward();
    return Named{{"output", out.detach()}, {"grad input", input.grad()}};
  };
}

/// Errors of `ours` against `reference`, in float64 chunks (a (N, L, S)
/// weights tensor at L = 8192 would need gigabytes converted at once).
struct Diff {
  double max_abs = 0;
  double scale = 0;  ///< max |reference|
  bool within = true;
};
Diff compare(const torch::Tensor& ours, const torch::Tensor& reference,
             const mha::parity::Tolerance& tol) {
  Diff d;
  if (!ours.defined() || !reference.defined() ||
      ours.sizes() != reference.sizes()) {
    d.within = false;
    d.max_abs = std::numeric_limits<double>::infinity();
    return d;
  }
  torch::NoGradGuard no_grad;
  auto a = ours.detach().reshape({-1});
  auto b = reference.detach().reshape({-1});
  const int64_t total = a.numel();
  const int64_t chunk = int64_t{1} << 22;
  for (int64_t begin = 0; begin < total; begin += chunk) {
    const int64_t len = std::min(chunk, total - begin);
    auto b64 = b.narrow(0, begin, len).to(torch::kCPU, torch::kFloat64);
    d.scale = std::max(d.scale, b64.abs().max().item<double>());
  }
  // atol is relative to the tensor's own scale (gradients summed over N·L
  // positions are large), rtol elementwise.
  const double atol = tol.atol * std::max(1.0, d.scale);
  for (int64_t begin = 0; begin < total; begin += chunk) {
    const int64_t len = std::min(chunk, total - begin);
    auto a64 = a.narrow(0, begin, len).to(torch::kCPU, torch::kFloat64);
    auto b64 = b.narrow(0, begin, len).to(torch::kCPU, torch::kFloat64);
    auto diff = (a64 - b64).abs();
    if (!torch::isfinite(a64).all().item<bool>() ||
        !torch::isfinite(b64).all().item<bool>()) {
      d.within = false;
      d.max_abs = std::numeric_limits<double>::infinity();
      return d;
    }
    d.max_abs = std::max(d.max_abs, diff.max().item<double>());
    d.within =
        d.within && diff.le(b64.abs() * tol.rtol + atol).all().item<bool>();
  }
  return d;
}

Check check_results(const Named& ours, const Named& reference,
                    torch::ScalarType dtype) {
  const auto tol = mha::parity::tolerance_for(dtype);
  Check check;
  check.done = true;
  check.passed = true;
  check.atol = tol.atol;
  check.rtol = tol.rtol;
  for (const auto& [what, tensor] : ours) {
    auto match = std::find_if(reference.begin(), reference.end(),
                              [&](const auto& r) { return r.first == what; });
    Diff d;
    if (match == reference.end()) {
      d.within = false;
      d.max_abs = std::numeric_limits<double>::infinity();
    } else {
      d = compare(tensor, match->second, tol);
    }
    const double rel = d.max_abs / std::max(d.scale, 1e-30);
    check.compared.push_back(what);
    check.max_abs = std::max(check.max_abs, d.max_abs);
    // worst: the first tensor out of tolerance, else the largest error.
    if (!d.within && check.passed) {
      check.passed = false;
      check.worst = what;
    } else if (check.passed && rel >= check.max_rel) {
      check.worst = what;
    }
    check.max_rel = std::max(check.max_rel, rel);
  }
  // torch::nn results that mha lacks (e.g. a parameter without a gradient).
  for (const auto& result : reference) {
    auto match = std::find_if(ours.begin(), ours.end(), [&](const auto& r) {
      return r.first == result.first;
    });
    if (match == ours.end() && check.passed) {
      check.passed = false;
      check.worst = result.first + " (missing in mha)";
    }
  }
  return check;
}

/// Runs `body`; a thrown exception marks `result` OOM or error. Returns
/// whether `body` completed.
template <class Body>
bool attempt(ContenderResult& result, Body&& body) {
  try {
    body();
    return true;
  } catch (const std::exception& e) {
    result.status = is_out_of_memory(e) ? "OOM" : "error";
    const auto* c10_error = dynamic_cast<const c10::Error*>(&e);
    result.error =
        c10_error != nullptr ? c10_error->what_without_backtrace() : e.what();
    // The first line is enough for a report.
    result.error = result.error.substr(0, result.error.find('\n'));
    return false;
  }
}

bool ok(const ContenderResult& r) { return r.status == "ok"; }

}  // namespace

/// Writes "5" to /proc/self/clear_refs: VmHWM restarts from the current RSS.
bool reset_peak_rss() {
  std::ofstream clear_refs("/proc/self/clear_refs");
  clear_refs << "5";
  clear_refs.flush();
  return static_cast<bool>(clear_refs);
}

double measure_in_process(const Run& run, const torch::Device& device,
                          int64_t& peak_kib) {
  // The scratch mha's threads keep between calls freed, and freed heap
  // pages back to the kernel: a clean baseline, whose peak counts the
  // scratch the run needs.
  mha::detail::release_kept_scratch();
  malloc_trim(0);
  const int64_t before = proc_status_kib("VmRSS");
  TORCH_INTERNAL_ASSERT(reset_peak_rss(), "cannot write /proc/self/clear_refs");
  const double ms = time_once(run, device);
  peak_kib = proc_status_kib("VmHWM") - before;
  return ms;
}

namespace {

std::string child_spec(const Shape& s, Mode mode,
                       const std::string& contender) {
  return std::to_string(s.batch) + "," + std::to_string(s.length) + "," +
         std::to_string(s.embed_dim) + "," + std::to_string(s.num_heads) + ":" +
         name(mode) + ":" + contender;
}

/// MemoryMethod::kFork: runs a child process (fork + exec of
/// settings.child_command) that measures one contender. Throws
/// std::bad_alloc when the child ran out of memory, c10::Error when it failed.
int64_t measure_in_child(const Shape& s, Mode mode,
                         const std::string& contender,
                         const Settings& settings) {
  std::vector<std::string> args = settings.child_command;
  args.push_back("--memory-child");
  args.push_back(child_spec(s, mode, contender));
  std::vector<char*> argv;
  for (auto& a : args) {
    argv.push_back(a.data());
  }
  argv.push_back(nullptr);
  int fds[2];
  TORCH_CHECK(pipe(fds) == 0, "mha-bench: pipe() failed");
  const pid_t pid = fork();
  TORCH_CHECK(pid >= 0, "mha-bench: fork() failed");
  if (pid == 0) {
    // Only async-signal-safe calls until exec.
    dup2(fds[1], STDOUT_FILENO);
    close(fds[0]);
    close(fds[1]);
    execv(argv[0], argv.data());
    _exit(127);
  }
  close(fds[1]);
  std::string out;
  char buffer[256];
  ssize_t n;
  while ((n = read(fds[0], buffer, sizeof(buffer))) > 0) {
    out.append(buffer, static_cast<size_t>(n));
  }
  close(fds[0]);
  int status = 0;
  waitpid(pid, &status, 0);
  const int rc = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  if (rc == 3) {
    throw std::bad_alloc();
  }
  std::istringstream lines(out);
  std::string word;
  int64_t kib = -1;
  lines >> word >> kib;
  TORCH_CHECK(rc == 0 && word == "peak_kib" && kib >= 0,
              "mha-bench: memory child for ", child_spec(s, mode, contender),
              " failed (exit ", rc, "): ", out);
  return kib;
}

}  // namespace

double time_once(const Run& run, const torch::Device& device) {
  synchronize(device);
  const auto start = std::chrono::steady_clock::now();
  { auto results = run(); }
  synchronize(device);
  const auto stop = std::chrono::steady_clock::now();
  return std::chrono::duration<double, std::milli>(stop - start).count();
}

Contenders make_contenders(const Shape& s, Mode mode,
                           const Settings& settings) {
  torch::manual_seed(settings.seed);
  const int64_t N = s.batch, L = s.length, E = s.embed_dim, H = s.num_heads;
  const auto options =
      torch::TensorOptions().dtype(settings.dtype).device(settings.device);
  auto x = torch::randn({L, N, E}, options);  // (L, N, E): seq-first
  if (mode == Mode::kEncoder) {
    return make_encoder(s, x, settings);
  }
  torch::nn::MultiheadAttention ref(torch::nn::MultiheadAttentionOptions(E, H));
  mha::MultiHeadAttention ours(
      mha::MultiHeadAttentionOptions(E, H).batch_first(false));
  prepare_pair(ref, ours, settings);

  Contenders c;
  // fwd-bwd's fixed upstream gradient, drawn after x for every contender.
  torch::Tensor grad_out;
  if (mode == Mode::kForwardBackward) {
    grad_out = torch::randn({L, N, E}, options);  // (L, N, E)
  }
  c.sdpa = make_sdpa_attention(ref, x, grad_out, mode, settings.plant_fault);
  c.projections = make_projections(ref, x, grad_out, mode, /*ours=*/false);
  c.mha_projections = make_projections(ref, x, grad_out, mode, /*ours=*/true);
  switch (mode) {
    case Mode::kForward:
    case Mode::kForwardWeights:
    case Mode::kInference: {
      const bool weights = mode == Mode::kForwardWeights;
      const bool no_grad = mode == Mode::kInference;
      c.mha = [ours, x, weights, no_grad]() mutable {
        torch::AutoGradMode grad_mode(/*enabled=*/!no_grad);
        auto [out, w] = ours->forward(x, /*key=*/{}, /*value=*/{},
                                      /*key_padding_mask=*/{}, weights);
        Named r{{"output", out}};  // (L, N, E)
        if (weights) {
          r.emplace_back("weights", w);  // (N, L, S)
        }
        return r;
      };
      c.torch_nn = [ref, x, weights, no_grad]() mutable {
        torch::AutoGradMode grad_mode(/*enabled=*/!no_grad);
        auto [out, w] = ref->forward(x, x, x, /*key_padding_mask=*/{}, weights);
        Named r{{"output", out}};
        if (weights) {
          r.emplace_back("weights", w);
        }
        return r;
      };
      return c;
    }
    case Mode::kCausal: {
      // Built in place: no (L, L) temporary beyond the mask itself.
      auto mask =
          torch::full({L, L}, -std::numeric_limits<double>::infinity(), options)
              .triu_(/*diagonal=*/1);  // (L, S): -inf above the diagonal
      c.mha = [ours, x]() mutable {
        auto [out, w] = ours->forward(x, /*key=*/{}, /*value=*/{},
                                      /*key_padding_mask=*/{},
                                      /*need_weights=*/false,
                                      /*attn_mask=*/{},
                                      /*average_attn_weights=*/true,
                                      /*is_causal=*/true);
        return Named{{"output", out}};
      };
      c.torch_nn = [ref, x, mask]() mutable {
        auto [out, w] = ref->forward(x, x, x, /*key_padding_mask=*/{},
                                     /*need_weights=*/false, mask);
        return Named{{"output", out}};
      };
      return c;
    }
    case Mode::kForwardBackward: {
      // Each contender its own leaf with the same values.
      auto x_mha = x.clone().requires_grad_(true);
      auto x_ref = x.clone().requires_grad_(true);
      c.mha = [ours, x_mha, grad_out]() mutable {
        clear_grads(*ours, x_mha);
        auto [out, w] = ours->forward(x_mha, /*key=*/{}, /*value=*/{},
                                      /*key_padding_mask=*/{},
                                      /*need_weights=*/false);
        (out * grad_out).sum().backward();
        return backward_results(*ours, out, x_mha);
      };
      c.torch_nn = [ref, x_ref, grad_out]() mutable {
        clear_grads(*ref, x_ref);
        auto [out, w] = ref->forward(x_ref, x_ref, x_ref,
                                     /*key_padding_mask=*/{},
                                     /*need_weights=*/false);
        (out * grad_out).sum().backward();
        return backward_results(*ref, out, x_ref);
      };
      return c;
    }
    case Mode::kEncoder:
      break;
  }
  TORCH_INTERNAL_ASSERT(false, "unhandled mode");
}

double median_of(std::vector<double> v) {
  return summarize(std::move(v)).median;
}

bool clear_refs_writable() {
  return access("/proc/self/clear_refs", W_OK) == 0 && reset_peak_rss();
}

int64_t proc_status_kib(const std::string& field) {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line)) {
    if (line.rfind(field + ":", 0) == 0) {
      return std::stoll(line.substr(field.size() + 1));
    }
  }
  return -1;
}

bool is_out_of_memory(const std::exception& e) {
  if (dynamic_cast<const std::bad_alloc*>(&e) != nullptr) {
    return true;
  }
  const std::string what = e.what();
  return what.find("out of memory") != std::string::npos ||
         what.find("can't allocate memory") != std::string::npos;
}

RowResult run_row(const Shape& shape, Mode mode, const Settings& settings) {
  RowResult row;
  row.shape = shape;
  row.mode = mode;
  row.flops = dense_flops(shape, mode);
  row.warmup = std::max(settings.warmup, 1);
  auto& A = row.mha;
  auto& B = row.torch_nn;
  auto& C = row.sdpa;

  Contenders c;
  if (!attempt(A, [&] { c = make_contenders(shape, mode, settings); })) {
    B.status = C.status = A.status;
    B.error = C.error = A.error;
    return row;
  }
  if (!c.sdpa.run) {
    C.status = "n/a";
    C.error = c.sdpa.unavailable;
  }
  /// One contender through the row: its result, its run, the ms of its
  /// latest untimed run, its timed samples.
  struct Entry {
    ContenderResult* result;
    const Run* run;
    const char* name;  ///< as --memory-child spells it
    double last_ms = 0;
    std::vector<double> samples;
  };
  std::vector<Entry> entries = {{&A, &c.mha, "mha", 0, {}},
                                {&B, &c.torch_nn, "torch_nn", 0, {}},
                                {&C, &c.sdpa.run, "sdpa", 0, {}}};

  // 1. First run of each (untimed): peak memory, and the results, compared
  // with torch::nn's before anything is timed.
  {
    std::vector<Named> first(entries.size());
    for (size_t i = 0; i < entries.size(); ++i) {
      auto& e = entries[i];
      if (!ok(*e.result)) {
        continue;
      }
      attempt(*e.result, [&] {
        int64_t kib = -1;
        const Run keep = [&] {
          first[i] = (*e.run)();
          return Named{};
        };
        if (settings.memory == MemoryMethod::kClearRefs) {
          e.last_ms = measure_in_process(keep, settings.device, kib);
          e.result->peak_mib = static_cast<double>(kib) / 1024.0;
        } else {
          e.last_ms = time_once(keep, settings.device);
        }
      });
      if (e.result == &A && ok(A)) {
        row.path = mha::detail::to_string(mha::detail::last_attention_path());
      }
    }
    if (ok(B) && ok(C)) {
      row.sdpa_check = check_results(first[2], first[1], settings.dtype);
      if (!row.sdpa_check.passed) {
        C.status = "skipped";
        C.error = "results differ from torch::nn's; not timed";
        C.peak_mib = std::nullopt;
      }
    }
    if (ok(A) && ok(B)) {
      row.check = check_results(first[0], first[1], settings.dtype);
      if (!row.check.passed) {
        for (auto* r : {&A, &B, &C}) {
          if (ok(*r)) {
            r->status = "skipped";
            r->error = "results differ; not timed";
            r->peak_mib = std::nullopt;
          }
        }
        row.warmup = 1;
        return row;
      }
    }
  }
  if (settings.memory == MemoryMethod::kFork) {
    for (auto& e : entries) {
      if (ok(*e.result)) {
        attempt(*e.result, [&] {
          e.result->peak_mib = static_cast<double>(measure_in_child(
                                   shape, mode, e.name, settings)) /
                               1024.0;
        });
      }
    }
  }

  // 2. Further warm-ups, interleaved.
  for (int i = 1; i < settings.warmup; ++i) {
    for (auto& e : entries) {
      if (ok(*e.result)) {
        attempt(*e.result,
                [&] { e.last_ms = time_once(*e.run, settings.device); });
      }
    }
  }

  // 3. Timed repetitions A B C A B C ...
  int reps = settings.reps;
  if (reps <= 0) {
    double round_ms = 0;
    for (const auto& e : entries) {
      round_ms += ok(*e.result) ? e.last_ms : 0;
    }
    const double fit = settings.budget_s * 1000.0 / std::max(round_ms, 1e-3);
    reps = static_cast<int>(std::clamp(std::floor(fit),
                                       static_cast<double>(settings.min_reps),
                                       static_cast<double>(settings.max_reps)));
  }
  row.reps = reps;
  for (int i = 0; i < reps; ++i) {
    for (auto& e : entries) {
      if (ok(*e.result)) {
        attempt(*e.result, [&] {
          e.samples.push_back(time_once(*e.run, settings.device));
        });
      }
    }
  }
  for (auto& e : entries) {
    if (ok(*e.result) && !e.samples.empty()) {
      e.result->time_ms = summarize(e.samples);
      e.result->gflops = row.flops / (e.result->time_ms.median * 1e-3) / 1e9;
    }
  }
  if (ok(A) && ok(B)) {
    row.ratio = A.time_ms.median / B.time_ms.median;
  }
  if (ok(A) && ok(C)) {
    row.sdpa_ratio = A.time_ms.median / C.time_ms.median;
  }
  // Below 1 MiB the peaks are a few pages: their ratio would be noise.
  if (A.peak_mib && B.peak_mib && *B.peak_mib >= 1.0) {
    row.memory_ratio = *A.peak_mib / *B.peak_mib;
  }
  return row;
}

int64_t child_peak_kib(const Shape& shape, Mode mode,
                       const std::string& contender, const Settings& settings) {
  TORCH_CHECK(
      contender == "mha" || contender == "torch_nn" || contender == "sdpa",
      "--memory-child: contender must be mha, torch_nn or sdpa, got ",
      contender);
  auto c = make_contenders(shape, mode, settings);
  const Run& run = contender == "mha"        ? c.mha
                   : contender == "torch_nn" ? c.torch_nn
                                             : c.sdpa.run;
  TORCH_CHECK(static_cast<bool>(run), "--memory-child: the sdpa contender ",
              "cannot run here: ", c.sdpa.unavailable);
  malloc_trim(0);
  const int64_t before = proc_status_kib("VmRSS");
  time_once(run, settings.device);
  return proc_status_kib("VmHWM") - before;
}

}  // namespace mha::bench

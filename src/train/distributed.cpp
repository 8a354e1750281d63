#include "mha/distributed.h"

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <utility>

#include "compat.h"

#if MHA_WITH_DISTRIBUTED
// ProcessGroupGloo.hpp declares its class only with USE_C10D_GLOO defined
// (LibTorch's own build defines it; its installed headers do not).
#ifndef USE_C10D_GLOO
#define USE_C10D_GLOO
#endif
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#if MHA_WITH_NCCL
#ifndef USE_C10D_NCCL
#define USE_C10D_NCCL
#endif
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif
#endif

namespace mha::distributed {

bool available() { return MHA_WITH_DISTRIBUTED != 0; }

bool nccl_available() { return MHA_WITH_NCCL != 0; }

// ------------------------------------------------------------ launch env ---

namespace {

/// The value of environment variable `name`, or nullopt when unset.
std::optional<std::string> getenv_string(const char* name) {
  const char* value = std::getenv(name);
  if (value == nullptr) {
    return std::nullopt;
  }
  return std::string(value);
}

/// `text` as a base-10 integer; throws naming the variable otherwise.
int64_t parse_env_integer(const char* name, const std::string& text) {
  errno = 0;
  char* end = nullptr;
  const long long value = std::strtoll(text.c_str(), &end, 10);
  TORCH_CHECK(
      !text.empty() && end == text.c_str() + text.size() && errno != ERANGE,
      name, " must be an integer, but got '", text, "'");
  return static_cast<int64_t>(value);
}

}  // namespace

std::optional<LaunchEnv> launch_env_from_environment() {
  const auto rank = getenv_string("RANK");
  const auto world_size = getenv_string("WORLD_SIZE");
  if (!rank && !world_size) {
    return std::nullopt;
  }
  TORCH_CHECK(
      rank && world_size, "RANK and WORLD_SIZE must be set together, but only ",
      rank ? "RANK='" + *rank : "WORLD_SIZE='" + *world_size, "' is set");
  LaunchEnv env;
  env.world_size = parse_env_integer("WORLD_SIZE", *world_size);
  TORCH_CHECK(env.world_size >= 1, "WORLD_SIZE must be >= 1, but got ",
              env.world_size);
  env.rank = parse_env_integer("RANK", *rank);
  TORCH_CHECK(env.rank >= 0 && env.rank < env.world_size,
              "RANK must be in [0, WORLD_SIZE - 1 = ", env.world_size - 1,
              "], but got ", env.rank);
  env.local_rank = env.rank;
  if (const auto local_rank = getenv_string("LOCAL_RANK")) {
    env.local_rank = parse_env_integer("LOCAL_RANK", *local_rank);
    TORCH_CHECK(env.local_rank >= 0, "LOCAL_RANK must be >= 0, but got ",
                env.local_rank);
  }
  if (const auto addr = getenv_string("MASTER_ADDR")) {
    TORCH_CHECK(!addr->empty(), "MASTER_ADDR must not be empty");
    env.master_addr = *addr;
  }
  if (const auto port = getenv_string("MASTER_PORT")) {
    env.master_port = parse_env_integer("MASTER_PORT", *port);
    TORCH_CHECK(env.master_port >= 1 && env.master_port <= 65535,
                "MASTER_PORT must be in [1, 65535], but got ", env.master_port);
  }
  return env;
}

Backend parse_backend(const std::string& name) {
  if (name == "gloo") {
    return Backend::kGloo;
  }
  TORCH_CHECK(name == "nccl", "backend must be 'gloo' or 'nccl', but got '",
              name, "'");
  return Backend::kNccl;
}

std::string backend_name(Backend backend) {
  return backend == Backend::kGloo ? "gloo" : "nccl";
}

// ---------------------------------------------------------- process group ---

namespace {

/// What a caught exception says, without LibTorch's C++ backtrace.
std::string message_of(const std::exception& e) {
  if (const auto* error = dynamic_cast<const c10::Error*>(&e)) {
    return error->what_without_backtrace();
  }
  return e.what();
}

}  // namespace

#if MHA_WITH_DISTRIBUTED

namespace {

// The class the backends derive from: c10d::ProcessGroup in LibTorch 1.x,
// c10d::Backend from 2.0 on (ProcessGroup became a dispatcher over them).
#if MHA_C10D_BACKEND_CLASS
using CollectiveBackend = c10d::Backend;
#else
using CollectiveBackend = c10d::ProcessGroup;
#endif

bool is_loopback(const std::string& host) {
  return host == "localhost" || host.rfind("127.", 0) == 0 || host == "::1";
}

std::shared_ptr<::gloo::transport::Device> make_gloo_device(
    const LaunchEnv& env, const ProcessGroupOptions& options) {
  if (!options.interface().empty()) {
    return c10d::ProcessGroupGloo::createDeviceForInterface(
        options.interface());
  }
  const auto ifname = getenv_string("GLOO_SOCKET_IFNAME");
  if (ifname && !ifname->empty()) {
    return c10d::ProcessGroupGloo::createDeviceForInterface(*ifname);
  }
  if (is_loopback(env.master_addr)) {
    return c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1");
  }
  return c10d::ProcessGroupGloo::createDefaultDevice();
}

}  // namespace

struct ProcessGroup::Impl {
  LaunchEnv env;
  ProcessGroupOptions options;
  c10::intrusive_ptr<c10d::Store> store;
  c10::intrusive_ptr<CollectiveBackend> backend;

  /// Runs `work` (which returns a c10d Work) and waits for it; rethrows any
  /// failure as a c10::Error naming the operation and this rank.
  template <typename MakeWork>
  void run(const char* what, MakeWork&& make_work) {
    try {
      auto work = make_work();
      work->wait();
    } catch (const std::exception& e) {
      TORCH_CHECK(false, "distributed ", what, " failed on rank ", env.rank,
                  " of ", env.world_size,
                  " (a peer may have exited or stopped responding; timeout ",
                  options.timeout().count(), " ms): ", message_of(e));
    }
  }
};

ProcessGroup::ProcessGroup(const LaunchEnv& env,
                           const ProcessGroupOptions& options)
    : impl_(std::make_unique<Impl>()) {
  TORCH_CHECK(env.world_size >= 1 && env.rank >= 0 && env.rank < env.world_size,
              "ProcessGroup: need 0 <= rank < world_size, but got rank ",
              env.rank, " and world_size ", env.world_size);
  TORCH_CHECK(env.master_port >= 1 && env.master_port <= 65535,
              "ProcessGroup: master_port must be in [1, 65535], but got ",
              env.master_port);
  TORCH_CHECK(options.timeout().count() > 0,
              "ProcessGroup: timeout must be > 0 ms, but got ",
              options.timeout().count());
  TORCH_CHECK(options.backend() != Backend::kNccl || nccl_available(),
              "ProcessGroup: backend 'nccl' is not available: this build of "
              "mha has no c10d NCCL support (LibTorch without CUDA/NCCL); use "
              "'gloo'");
  impl_->env = env;
  impl_->options = options;

  const std::string where =
      env.master_addr + ":" + std::to_string(env.master_port);
  std::shared_ptr<::gloo::transport::Device> gloo_device;
  if (options.backend() == Backend::kGloo) {
    try {
      gloo_device = make_gloo_device(env, options);
    } catch (const std::exception& e) {
      TORCH_CHECK(false, "rank ", env.rank, " of ", env.world_size,
                  " cannot bind Gloo to ",
                  options.interface().empty()
                      ? std::string("this machine's address")
                      : "interface '" + options.interface() + "'",
                  ": ", message_of(e));
    }
  }
  try {
    c10d::TCPStoreOptions store_options;
    store_options.port = static_cast<std::uint16_t>(env.master_port);
    store_options.isServer = env.rank == 0;
    store_options.numWorkers = static_cast<std::size_t>(env.world_size);
    // Rank 0 returns at once; the peers' rendezvous below waits (with the
    // timeout) for every rank, so that a missing rank costs one timeout.
    store_options.waitWorkers = false;
    store_options.timeout = options.timeout();
#if MHA_TCPSTORE_HAS_LIBUV_OPTION
    store_options.useLibUV = false;  // see compat.h
#endif
    impl_->store =
        c10::make_intrusive<c10d::TCPStore>(env.master_addr, store_options);
  } catch (const std::exception& e) {
    TORCH_CHECK(false, "rank ", env.rank, " of ", env.world_size,
                env.rank == 0 ? " could not serve" : " could not reach",
                " the rendezvous store at ", where, " within ",
                options.timeout().count(), " ms: ", message_of(e));
  }
  try {
    const int rank = static_cast<int>(env.rank);
    const int size = static_cast<int>(env.world_size);
    if (options.backend() == Backend::kGloo) {
      auto gloo_options =
          c10d::ProcessGroupGloo::Options::create(options.timeout());
      gloo_options->devices.push_back(gloo_device);
      impl_->backend = c10::make_intrusive<c10d::ProcessGroupGloo>(
          impl_->store, rank, size, gloo_options);
    } else {
#if MHA_WITH_NCCL
      auto nccl_options = c10d::ProcessGroupNCCL::Options::create();
      nccl_options->timeout = options.timeout();
      impl_->backend = c10::make_intrusive<c10d::ProcessGroupNCCL>(
          impl_->store, rank, size, nccl_options);
#endif
    }
  } catch (const std::exception& e) {
    TORCH_CHECK(false, "rank ", env.rank, " of ", env.world_size,
                " could not connect to the other ranks within ",
                options.timeout().count(), " ms (",
                backend_name(options.backend()), ", rendezvous at ", where,
                "; did every rank start, with the same WORLD_SIZE, "
                "MASTER_ADDR and MASTER_PORT?): ",
                message_of(e));
  }
}

ProcessGroup::~ProcessGroup() = default;
ProcessGroup::ProcessGroup(ProcessGroup&&) noexcept = default;
ProcessGroup& ProcessGroup::operator=(ProcessGroup&&) noexcept = default;

int64_t ProcessGroup::rank() const { return impl_->env.rank; }
int64_t ProcessGroup::world_size() const { return impl_->env.world_size; }
Backend ProcessGroup::backend() const { return impl_->options.backend(); }
torch::Device ProcessGroup::device() const {
  return backend() == Backend::kNccl
             ? torch::Device(torch::kCUDA, static_cast<c10::DeviceIndex>(
                                               impl_->env.local_rank))
             : torch::Device(torch::kCPU);
}

void ProcessGroup::all_reduce_sum(std::vector<torch::Tensor>& tensors) {
  // c10d reads a list as one tensor per device (all summed together), so a
  // list of distinct tensors travels as one flat tensor.
  if (tensors.empty()) {
    return;
  }
  std::vector<torch::Tensor> flat{torch::cat([&] {
    std::vector<torch::Tensor> pieces;
    for (const auto& tensor : tensors) {
      pieces.push_back(tensor.reshape({-1}));
    }
    return pieces;
  }())};
  impl_->run("all-reduce", [&] { return impl_->backend->allreduce(flat, {}); });
  int64_t offset = 0;
  for (auto& tensor : tensors) {
    tensor.copy_(
        flat[0].narrow(0, offset, tensor.numel()).view(tensor.sizes()));
    offset += tensor.numel();
  }
}

void ProcessGroup::broadcast(torch::Tensor& tensor, int64_t root) {
  TORCH_CHECK(root >= 0 && root < world_size(),
              "broadcast: root must be in [0, ", world_size() - 1,
              "], but got ", root);
  std::vector<torch::Tensor> tensors{tensor};
  c10d::BroadcastOptions options;
  options.rootRank = root;
  impl_->run("broadcast",
             [&] { return impl_->backend->broadcast(tensors, options); });
}

void ProcessGroup::barrier() {
  impl_->run("barrier", [&] { return impl_->backend->barrier({}); });
}

#else  // !MHA_WITH_DISTRIBUTED

namespace {
[[noreturn]] void no_c10d() {
  TORCH_CHECK(false,
              "this build of mha has no distributed support (it needs "
              "LibTorch's c10d and the Gloo headers, Debian's libgloo-dev, at "
              "build time; install them and rebuild)");
}
}  // namespace

struct ProcessGroup::Impl {};

ProcessGroup::ProcessGroup(const LaunchEnv& /*env*/,
                           const ProcessGroupOptions& /*options*/) {
  no_c10d();
}
ProcessGroup::~ProcessGroup() = default;
ProcessGroup::ProcessGroup(ProcessGroup&&) noexcept = default;
ProcessGroup& ProcessGroup::operator=(ProcessGroup&&) noexcept = default;
int64_t ProcessGroup::rank() const { no_c10d(); }
int64_t ProcessGroup::world_size() const { no_c10d(); }
Backend ProcessGroup::backend() const { no_c10d(); }
torch::Device ProcessGroup::device() const { no_c10d(); }
void ProcessGroup::all_reduce_sum(std::vector<torch::Tensor>& /*tensors*/) {
  no_c10d();
}
void ProcessGroup::broadcast(torch::Tensor& /*tensor*/, int64_t /*root*/) {
  no_c10d();
}
void ProcessGroup::barrier() { no_c10d(); }

#endif  // MHA_WITH_DISTRIBUTED

void ProcessGroup::all_reduce_sum(torch::Tensor& tensor) {
  std::vector<torch::Tensor> tensors{tensor};
  all_reduce_sum(tensors);
}

std::string ProcessGroup::broadcast_bytes(const std::string& bytes,
                                          int64_t root) {
  const bool is_root = rank() == root;
  const auto device = this->device();
  auto length =
      torch::tensor({is_root ? static_cast<int64_t>(bytes.size()) : int64_t{0}},
                    torch::TensorOptions(torch::kInt64))
          .to(device);  // (1)
  broadcast(length, root);
  const int64_t n = length.item<int64_t>();
  auto data = torch::empty({n}, torch::kUInt8);  // (n)
  if (is_root && n > 0) {
    std::memcpy(data.data_ptr<uint8_t>(), bytes.data(), static_cast<size_t>(n));
  }
  data = data.to(device);
  if (n > 0) {
    broadcast(data, root);
  }
  data = data.cpu();
  return std::string(reinterpret_cast<const char*>(data.data_ptr<uint8_t>()),
                     static_cast<size_t>(n));
}

// ------------------------------------------------------ module and grads ---

void broadcast_module(ProcessGroup& group, torch::nn::Module& module,
                      int64_t root) {
  torch::NoGradGuard no_grad;
  for (auto& parameter : module.parameters()) {
    auto data = parameter.detach();
    if (data.is_contiguous()) {
      group.broadcast(data, root);
    } else {
      auto copy = data.contiguous();
      group.broadcast(copy, root);
      data.copy_(copy);
    }
  }
  for (auto& buffer : module.buffers()) {
    auto copy = buffer.contiguous();
    group.broadcast(copy, root);
    if (!copy.is_same(buffer)) {
      buffer.copy_(copy);
    }
  }
}

GradientSynchronizer::GradientSynchronizer(ProcessGroup& group,
                                           torch::nn::Module& module,
                                           const GradientSyncOptions& options)
    : group_(&group), options_(options) {
  TORCH_CHECK(options.bucket_bytes() >= 1,
              "GradientSynchronizer: bucket_bytes must be >= 1, but got ",
              options.bucket_bytes());
  int64_t bucket_bytes = 0;
  for (const auto& parameter : module.parameters()) {
    if (!parameter.requires_grad()) {
      continue;
    }
    const int64_t bytes = parameter.numel() * parameter.element_size();
    const bool fits =
        !buckets_.empty() &&
        buckets_.back().front().scalar_type() == parameter.scalar_type() &&
        buckets_.back().front().device() == parameter.device() &&
        bucket_bytes + bytes <= options.bucket_bytes();
    if (!fits) {
      buckets_.emplace_back();
      bucket_bytes = 0;
    }
    buckets_.back().push_back(parameter);
    bucket_bytes += bytes;
  }
}

void GradientSynchronizer::synchronize() {
  torch::NoGradGuard no_grad;
  const double scale = options_.reduction() == GradientReduction::kMean
                           ? 1.0 / static_cast<double>(group_->world_size())
                           : 1.0;
  for (auto& bucket : buckets_) {
    // One collective per bucket: all_reduce_sum sends the list as one flat
    // tensor and writes the sums back into each gradient.
    std::vector<torch::Tensor> grads;
    grads.reserve(bucket.size());
    for (auto& parameter : bucket) {
      if (!parameter.grad().defined()) {
        parameter.mutable_grad() = torch::zeros_like(parameter);
      }
      grads.push_back(parameter.grad());
    }
    group_->all_reduce_sum(grads);
    if (scale != 1.0) {
      for (auto& grad : grads) {
        grad.mul_(scale);
      }
    }
  }
}

}  // namespace mha::distributed

// Data-parallel training across processes and machines on c10d, the
// distributed engine inside LibTorch (the one PyTorch's DistributedDataParallel
// runs on). LibTorch has no C++ DDP module (PyTorch issue #48959); these are
// the pieces a training loop needs to be one:
//
//   * LaunchEnv: where this process sits in the job, from the torchrun
//     environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT).
//   * ProcessGroup: joins the job through a c10d TCPStore hosted by rank 0 and
//     runs collectives (all-reduce, broadcast, barrier) on Gloo (CPU tensors)
//     or NCCL (CUDA tensors).
//   * broadcast_module: every rank starts from rank 0's parameters and
//     buffers, as DDP does at construction.
//   * GradientSynchronizer: after backward(), the gradients of every rank are
//     summed or averaged in buckets of flattened gradients (DDP's default:
//     averaged, buckets of 25 MiB), so that every rank takes the same
//     optimizer step.
//
// A loop in which every rank computes the loss of its own shard of a global
// batch, normalised by the global count (see mha::train::train), then
// synchronises gradients with reduction kSum, takes exactly the step a
// single process takes on the whole batch (up to float rounding).
//
// Availability: the collectives need LibTorch's c10d and the Gloo headers
// (Debian: libgloo-dev) at build time. available() says whether this build
// has them; without them every function here that communicates throws
// c10::Error saying so. NCCL is compiled in only where LibTorch was built with
// it (nccl_available()).
//
// Failure: a rank that dies closes its connections, and the others' next
// collective fails at once; a rank that hangs or never joins makes the others
// fail after ProcessGroupOptions::timeout (a rank that starts before rank 0's
// store is up may wait up to twice that: once to reach the store, once for
// its peers). Either way the error is a c10::Error naming the operation, the
// rank and the cause: nothing waits forever.
//
// A data-parallel loop of your own (what mha::train::train does, in short):
//   auto env = mha::distributed::launch_env_from_environment();  // nullopt:
//   mha::distributed::ProcessGroup group(*env);                 //  not a job
//   Model model(...);                        // same structure on every rank
//   mha::distributed::broadcast_module(group, *model);  // rank 0's weights
//   torch::optim::AdamW optimizer(model->parameters(), ...);
//   mha::distributed::GradientSynchronizer sync(group, *model);  // mean
//   for (int64_t step = 1; step <= steps; ++step) {
//     auto batch = global_batch(step);      // the same on every rank
//     auto rows = my_rows(batch, group.rank(), group.world_size());
//     optimizer.zero_grad();
//     loss_fn(model(rows.input), rows.target).backward();  // mean over rows
//     sync.synchronize();  // every rank now holds the mean gradient
//     torch::nn::utils::clip_grad_norm_(model->parameters(), 1.0);  // after
//     optimizer.step();
//   }
// With shards of unequal size (or padding), divide each rank's summed loss
// by the global count instead and use GradientReduction::kSum.
#pragma once

#include <torch/torch.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace mha::distributed {

/// True when this build of mha includes c10d with the Gloo backend.
bool available();

/// True when this build of mha includes c10d's NCCL backend (LibTorch built
/// with CUDA and NCCL).
bool nccl_available();

/// Where this process sits in a job (the torchrun convention).
struct LaunchEnv {
  int64_t rank = 0;        ///< RANK: this process, in [0, world_size)
  int64_t world_size = 1;  ///< WORLD_SIZE: processes in the job, >= 1
  int64_t local_rank = 0;  ///< LOCAL_RANK: index on this machine (CUDA device)
  /// MASTER_ADDR: the host of rank 0, where the TCPStore listens.
  std::string master_addr = "127.0.0.1";
  /// MASTER_PORT: the TCPStore's port, in [1, 65535].
  int64_t master_port = 29500;
};

/// Reads the job's place from the environment: RANK and WORLD_SIZE (both or
/// neither), LOCAL_RANK (default RANK), MASTER_ADDR (default 127.0.0.1) and
/// MASTER_PORT (default 29500). Returns nullopt when neither RANK nor
/// WORLD_SIZE is set (not launched as part of a job).
/// Throws c10::Error naming the variable and its value when one is not an
/// integer, only one of RANK and WORLD_SIZE is set, WORLD_SIZE < 1, RANK is
/// outside [0, WORLD_SIZE), LOCAL_RANK < 0, MASTER_ADDR is empty or
/// MASTER_PORT is outside [1, 65535].
std::optional<LaunchEnv> launch_env_from_environment();

/// The c10d backend of a ProcessGroup.
enum class Backend {
  kGloo,  ///< CPU tensors, over TCP
  kNccl,  ///< CUDA tensors
};

/// "gloo" or "nccl". Throws c10::Error naming the value otherwise.
Backend parse_backend(const std::string& name);

/// "gloo" or "nccl".
std::string backend_name(Backend backend);

/// Options of ProcessGroup.
struct ProcessGroupOptions {
  /// The collectives' backend; its tensors must live on its device type.
  TORCH_ARG(Backend, backend) = Backend::kGloo;
  /// Joining the job and every collective fail with a c10::Error after this
  /// long. Must be > 0.
  TORCH_ARG(std::chrono::milliseconds, timeout) = std::chrono::seconds(300);
  /// Gloo: the network interface to bind (e.g. "eth0"). Empty: the
  /// interface named by GLOO_SOCKET_IFNAME if set; else 127.0.0.1 when
  /// MASTER_ADDR is a loopback address (one machine; host names need not
  /// resolve); else the address this machine's host name resolves to.
  TORCH_ARG(std::string, interface) = "";
};

/// The processes of one job and collectives among them: a c10d process
/// group (ProcessGroupGloo or ProcessGroupNCCL) that met through a TCPStore
/// served by rank 0 at env.master_addr:env.master_port.
///
/// Every rank must call the collectives in the same order with tensors of
/// the same shapes and dtypes (c10d's contract; a mismatch fails or hangs
/// until the timeout).
///
/// Example (one process per rank, launched with RANK etc. set):
///   auto env = mha::distributed::launch_env_from_environment();
///   mha::distributed::ProcessGroup group(*env);
///   auto t = torch::ones({3});
///   group.all_reduce_sum(t);  // every element == group.world_size()
class ProcessGroup {
 public:
  /// Joins the job: rank 0 starts the TCPStore server, the others connect
  /// to it, and all wait until world_size processes have joined.
  /// Throws c10::Error when this build has no c10d (or no NCCL for
  /// kNccl), when the options are invalid, when the store cannot be
  /// reached or served (e.g. the port is taken), or when not every rank
  /// joined within options.timeout.
  explicit ProcessGroup(const LaunchEnv& env,
                        const ProcessGroupOptions& options = {});
  ~ProcessGroup();
  /// Takes over `other`'s connection; `other` is left empty.
  ProcessGroup(ProcessGroup&&) noexcept;
  /// Drops the current group (as the destructor does), takes over `other`'s.
  ProcessGroup& operator=(ProcessGroup&&) noexcept;
  ProcessGroup(const ProcessGroup&) = delete;
  ProcessGroup& operator=(const ProcessGroup&) = delete;

  /// This process's rank, 0 <= rank < world_size() (LaunchEnv::rank).
  int64_t rank() const;
  /// Number of processes in the group (LaunchEnv::world_size).
  int64_t world_size() const;
  /// The collective backend in use: Backend::kGloo (CPU) or
  /// Backend::kNccl (CUDA).
  Backend backend() const;
  /// Where this rank's collective tensors must live: the CPU for Gloo,
  /// CUDA device LaunchEnv::local_rank for NCCL.
  torch::Device device() const;

  /// Replaces each tensor by its element-wise sum over all ranks, in place.
  /// The tensors must live on the backend's device type; they travel as one
  /// flat copy in their promoted dtype (one collective for the whole list).
  /// Throws c10::Error (naming the rank and the cause) when a peer has gone
  /// or the timeout passes.
  void all_reduce_sum(std::vector<torch::Tensor>& tensors);
  /// all_reduce_sum of one tensor.
  void all_reduce_sum(torch::Tensor& tensor);

  /// Copies `tensor` of rank `root` into `tensor` of every rank, in place.
  /// Same requirements and errors as all_reduce_sum; root in
  /// [0, world_size).
  void broadcast(torch::Tensor& tensor, int64_t root = 0);

  /// `bytes` of rank `root`, on every rank (other ranks' argument is
  /// ignored). Two collectives: the length, then the bytes.
  std::string broadcast_bytes(const std::string& bytes, int64_t root = 0);

  /// Returns when every rank has called it (or throws as all_reduce_sum).
  void barrier();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

/// Copies every parameter and buffer of `module` on rank `root` into the
/// same tensors of every other rank (as DDP does when it wraps a module), so
/// that all ranks start identical. The modules must have the same
/// structure on every rank. Throws as ProcessGroup::broadcast.
void broadcast_module(ProcessGroup& group, torch::nn::Module& module,
                      int64_t root = 0);

/// How GradientSynchronizer combines the ranks' gradients.
enum class GradientReduction {
  /// The mean over ranks: DDP's, right when each rank's loss is the mean
  /// over its own equally sized shard.
  kMean,
  /// The sum over ranks: right when each rank's loss is already divided by
  /// the global count (e.g. of real tokens), so that uneven shards or
  /// padding cannot skew the step.
  kSum,
};

/// Options of GradientSynchronizer.
struct GradientSyncOptions {
  /// How the ranks' gradients combine: GradientReduction::kMean (DDP's
  /// default) or GradientReduction::kSum.
  TORCH_ARG(GradientReduction, reduction) = GradientReduction::kMean;
  /// Gradients are flattened into buckets of at most this many bytes (one
  /// parameter larger than that gets a bucket of its own), one collective
  /// per bucket. DDP's default is 25 MiB. Must be >= 1.
  TORCH_ARG(int64_t, bucket_bytes) = int64_t{25} << 20;
};

/// Exchanges gradients across the ranks of a ProcessGroup after backward():
/// for each bucket, the gradients are copied into one flat tensor,
/// all-reduced (summed), divided by world_size for kMean, and copied back.
/// A parameter whose gradient is undefined on this rank (unused in its
/// forward) takes part as zeros, and ends with the reduced gradient. Buckets
/// hold one dtype and device each, in parameter order.
///
/// Example (per step):
///   optimizer.zero_grad();
///   loss.backward();
///   sync.synchronize();   // now every rank holds the same gradients
///   optimizer.step();
class GradientSynchronizer {
 public:
  /// Buckets the parameters of `module` that require gradients. The group
  /// must outlive the synchronizer. Throws c10::Error for bucket_bytes < 1.
  GradientSynchronizer(ProcessGroup& group, torch::nn::Module& module,
                       const GradientSyncOptions& options = {});

  /// Reduces the gradients of every rank (see the class comment). Every
  /// rank must call it once per step. Throws as ProcessGroup::all_reduce_sum.
  void synchronize();

  /// Number of buckets (collectives per synchronize()).
  int64_t num_buckets() const { return static_cast<int64_t>(buckets_.size()); }

 private:
  ProcessGroup* group_;
  GradientSyncOptions options_;
  std::vector<std::vector<torch::Tensor>> buckets_;  // parameters
};

}  // namespace mha::distributed

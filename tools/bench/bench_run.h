// Internal to mha-bench's measuring (bench.cpp, bench_variants.cpp): the
// contenders of one row on the same weights and inputs, and how one run of
// them is timed.
//
// Glossary: N batch, L sequence length (S = L), E embed_dim, H num_heads.
#pragma once

#include <torch/torch.h>

#include <vector>

#include "bench/bench.h"
#include "bench/bench_sdpa.h"

namespace mha::bench {

/// One row's contenders, built on the same weights and inputs.
struct Contenders {
  Run mha;
  Run torch_nn;
  SdpaContender sdpa;   ///< projections + at::scaled_dot_product_attention
  Run projections;      ///< the projections alone (self-attention modes)
  Run mha_projections;  ///< the same products through mha's projection
};

/// The contenders of (shape, mode): torch::nn's module with random biases,
/// mha's module on its weights, the SDPA contender, and (self-attention
/// modes) the projections alone; seeded from settings.seed.
Contenders make_contenders(const Shape& s, Mode mode, const Settings& settings);

/// Milliseconds of one run, its results released inside the timed region.
double time_once(const Run& run, const torch::Device& device);

/// The median of `v`.
double median_of(std::vector<double> v);

/// Writes "5" to /proc/self/clear_refs: VmHWM restarts from the current RSS.
bool reset_peak_rss();

/// One run (time_once) with the peak RSS above the RSS before it (KiB) in
/// `peak_kib`, after freeing the scratch mha's threads keep and trimming
/// the heap.
double measure_in_process(const Run& run, const torch::Device& device,
                          int64_t& peak_kib);

}  // namespace mha::bench

// mha-bench's batched-decoding rows: B prompts of different lengths decoded
// through one left-padded KVCache (key_padding_mask and per-sequence
// positions, Hugging Face's convention) against each prompt alone in its own
// cache, timed (prefill and decode apart) and compared step by step.
// Formatting is in bench_report.cpp.
//
// Glossary: B batch (prompts), P_b prompt b's length, P = max_b P_b (the
// padded width), G new tokens per sequence, E embed_dim, H num_heads, Hkv
// num_kv_heads.
#include <algorithm>
#include <chrono>
#include <utility>
#include <vector>

#include "bench/bench.h"
#include "mha/mha.h"

namespace mha::bench {

namespace {

using Clock = std::chrono::steady_clock;

double ms_since(Clock::time_point start, const torch::Device& device) {
  synchronize(device);
  return std::chrono::duration<double, std::milli>(Clock::now() - start)
      .count();
}

/// The next step's input from a step's input x and output y at the last
/// token, (.., 1, E): layer_norm(x + y) without affine parameters.
torch::Tensor next_input(const torch::Tensor& x, const torch::Tensor& y) {
  return torch::layer_norm(x + y, {x.size(-1)});
}

/// What one way of decoding produced and how long it took.
struct Decoded {
  double prefill_ms = 0;
  double decode_ms = 0;
  /// Per prompt b: its real tokens' prefill outputs (P_b, E) and its decode
  /// outputs (G, E).
  std::vector<torch::Tensor> prefill, steps;
};

/// The B prompts left-padded to P in one cache, then G steps for all.
/// The pads hold random embeddings (the mask must hide them). `plant_fault`:
/// no key_padding_mask, so the pads are attended and the check must fail.
Decoded decode_batched(MultiHeadAttention& attn, KVCache& cache,
                       const std::vector<torch::Tensor>& prompts,
                       int64_t new_tokens, bool plant_fault) {
  const auto device = prompts.front().device();
  const auto batch = static_cast<int64_t>(prompts.size());
  int64_t width = 0;
  for (const auto& p : prompts) {
    width = std::max(width, p.size(0));
  }
  const int64_t embed_dim = prompts.front().size(1);
  // Inputs and masks are built before the clock starts: a caller holds them.
  auto padded = torch::randn({batch, width, embed_dim},
                             prompts.front().options());  // (B, P, E)
  auto lengths = torch::empty({batch, 1}, torch::kLong);  // (B, 1)
  for (int64_t b = 0; b < batch; ++b) {
    const auto& p = prompts[static_cast<size_t>(b)];
    padded[b].narrow(0, width - p.size(0), p.size(0)).copy_(p);
    lengths[b][0] = p.size(0);
  }
  lengths = lengths.to(device);
  const auto keep =
      torch::arange(width, torch::TensorOptions().dtype(torch::kLong))
          .to(device)
          .unsqueeze(0)
          .ge(width - lengths);  // (B, P), true at real tokens
  const auto positions =
      (keep.to(torch::kLong).cumsum(1) - 1).masked_fill(keep.logical_not(), 0);
  const auto padding = torch::cat(
      {keep.logical_not(),
       torch::zeros({batch, new_tokens},
                    torch::TensorOptions().dtype(torch::kBool).device(device))},
      1);  // (B, P + G), true at the pads

  Decoded d;
  cache.clear();
  auto start = Clock::now();
  auto y = std::get<0>(attn->forward_cached(
      padded, cache, /*is_causal=*/true, /*need_weights=*/false,
      /*average_attn_weights=*/true,
      plant_fault ? torch::Tensor() : padding.narrow(1, 0, width),
      positions));  // (B, P, E)
  auto x = next_input(padded.narrow(1, width - 1, 1),
                      y.narrow(1, width - 1, 1));  // (B, 1, E)
  d.prefill_ms = ms_since(start, device);
  std::vector<torch::Tensor> outputs;
  start = Clock::now();
  for (int64_t g = 0; g < new_tokens; ++g) {
    auto out = std::get<0>(attn->forward_cached(
        x, cache, true, false, true,
        plant_fault ? torch::Tensor() : padding.narrow(1, 0, width + g + 1),
        lengths + g));  // (B, 1, E)
    outputs.push_back(out);
    x = next_input(x, out);
  }
  d.decode_ms = ms_since(start, device);
  const auto steps = torch::cat(outputs, 1);  // (B, G, E)
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t length = prompts[static_cast<size_t>(b)].size(0);
    d.prefill.push_back(y[b].narrow(0, width - length, length));
    d.steps.push_back(steps[b]);
  }
  return d;
}

/// Each prompt alone in a cleared batch-1 cache, then its G steps.
Decoded decode_one_at_a_time(MultiHeadAttention& attn, KVCache& cache,
                             const std::vector<torch::Tensor>& prompts,
                             int64_t new_tokens) {
  const auto device = prompts.front().device();
  Decoded d;
  for (const auto& prompt : prompts) {
    cache.clear();
    const int64_t length = prompt.size(0);
    auto start = Clock::now();
    auto y = std::get<0>(
        attn->forward_cached(prompt.unsqueeze(0), cache));  // (1, P_b, E)
    auto x = next_input(prompt.narrow(0, length - 1, 1).unsqueeze(0),
                        y.narrow(1, length - 1, 1));  // (1, 1, E)
    d.prefill_ms += ms_since(start, device);
    std::vector<torch::Tensor> outputs;
    start = Clock::now();
    for (int64_t g = 0; g < new_tokens; ++g) {
      auto out = std::get<0>(attn->forward_cached(x, cache));  // (1, 1, E)
      outputs.push_back(out);
      x = next_input(x, out);
    }
    d.decode_ms += ms_since(start, device);
    d.prefill.push_back(y[0]);
    d.steps.push_back(torch::cat(outputs, 1)[0]);  // (G, E)
  }
  return d;
}

double median(std::vector<double> v) { return summarize(std::move(v)).median; }

}  // namespace

BatchedDecodeRow measure_batched_decode(int64_t batch,
                                        const BatchedDecodeOptions& options,
                                        const Settings& settings) {
  TORCH_CHECK(batch >= 1 && options.max_prompt >= 2 && options.new_tokens >= 1,
              "measure_batched_decode: batch ", batch, ", max_prompt ",
              options.max_prompt, ", new_tokens ", options.new_tokens,
              ": expected batch >= 1, max_prompt >= 2, new_tokens >= 1");
  torch::NoGradGuard no_grad;
  torch::manual_seed(settings.seed);
  MultiHeadAttention attn(
      MultiHeadAttentionOptions(options.embed_dim, options.num_heads)
          .num_kv_heads(options.num_kv_heads)
          .rotary(true)
          .rotary_theta(options.rotary_theta)
          .bias(false));
  attn->to(settings.device, torch::kFloat32);
  attn->eval();
  const auto tensor_options =
      torch::TensorOptions().dtype(torch::kFloat32).device(settings.device);

  BatchedDecodeRow row;
  row.batch = batch;
  // Random lengths in [P/2, P]; with B > 1 the first is P and the last
  // P/2, so the batch is always padded.
  auto lengths =
      torch::randint(options.max_prompt / 2, options.max_prompt + 1, {batch},
                     torch::TensorOptions().dtype(torch::kLong));
  if (batch > 1) {
    lengths[0] = options.max_prompt;
    lengths[batch - 1] = options.max_prompt / 2;
  }
  std::vector<torch::Tensor> prompts;  // (P_b, E) each
  int64_t width = 0;
  for (int64_t b = 0; b < batch; ++b) {
    row.prompt_lengths.push_back(lengths[b].item<int64_t>());
    width = std::max(width, row.prompt_lengths.back());
    prompts.push_back(torch::randn(
        {row.prompt_lengths.back(), options.embed_dim}, tensor_options));
  }
  auto batched_cache = attn->make_kv_cache(batch, width + options.new_tokens);
  auto single_cache = attn->make_kv_cache(1, width + options.new_tokens);

  // The untimed first run of each way: its outputs are compared.
  const auto batched = decode_batched(attn, batched_cache, prompts,
                                      options.new_tokens, options.plant_fault);
  const auto single =
      decode_one_at_a_time(attn, single_cache, prompts, options.new_tokens);
  for (size_t b = 0; b < prompts.size(); ++b) {
    for (const auto& [got, want] :
         {std::pair{batched.prefill[b], single.prefill[b]},
          std::pair{batched.steps[b], single.steps[b]}}) {
      row.max_abs_diff =
          std::max(row.max_abs_diff, (got - want).abs().max().item<double>());
    }
  }
  row.passed = row.max_abs_diff <= options.tolerance;

  // Timed runs, alternating the two ways.
  std::vector<double> bp, bd, sp, sd;
  for (int i = 0; i < options.reps; ++i) {
    const auto b = decode_batched(attn, batched_cache, prompts,
                                  options.new_tokens, options.plant_fault);
    const auto s =
        decode_one_at_a_time(attn, single_cache, prompts, options.new_tokens);
    bp.push_back(b.prefill_ms);
    bd.push_back(b.decode_ms);
    sp.push_back(s.prefill_ms);
    sd.push_back(s.decode_ms);
  }
  row.batched_decode_samples_ms = bd;
  row.single_decode_samples_ms = sd;
  row.batched_prefill_ms = median(bp);
  row.batched_decode_ms = median(bd);
  row.single_prefill_ms = median(sp);
  row.single_decode_ms = median(sd);
  return row;
}

}  // namespace mha::bench

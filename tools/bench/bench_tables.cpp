// mha-bench's variants' tables (--variants): projections, sliding window,
// generation and batched decoding measured (bench_variants.cpp,
// bench_batched_decode.cpp), printed, and returned as their JSON rows; the
// flex table lives in bench_flex.cpp.
//
// Glossary: N batch, L sequence length (S = L), E embed_dim, H num_heads.
#include <fmt/core.h>

#include <algorithm>
#include <cmath>
#include <cstdio>

#include "bench/bench_tool.h"

namespace mha::bench {
namespace {

/// The sliding-window table: measured, printed, and its JSON rows.
nlohmann::json window_table(bool quick, const Settings& settings) {
  const std::vector<int64_t> lengths =
      quick ? std::vector<int64_t>{128, 256}
            : std::vector<int64_t>{1024, 2048, 4096, 8192};
  const int64_t window = quick ? 32 : 256;
  const int64_t embed_dim = quick ? 32 : 256, num_heads = quick ? 2 : 4;
  const int reps = quick ? 2 : 5;
  fmt::print(
      "\nsliding window: MultiHeadAttention({}, {}) causal, N = 1, "
      "inference, window {} vs none; median of {} runs each\n",
      embed_dim, num_heads, window, reps);
  fmt::print("{:>6} {:>12} {:>14} {:>12} {:>14} {:>7}\n", "L", "window ms",
             "window us/tok", "full ms", "full us/tok", "ratio");
  auto json = nlohmann::json::array();
  for (const auto& r :
       measure_window(lengths, window, embed_dim, num_heads, reps, settings)) {
    const double per_token = 1e3 / static_cast<double>(r.length);
    fmt::print("{:>6} {:>12.2f} {:>14.2f} {:>12.2f} {:>14.2f} {:>7.2f}\n",
               r.length, r.windowed_ms, r.windowed_ms * per_token, r.full_ms,
               r.full_ms * per_token, r.windowed_ms / r.full_ms);
    json.push_back({{"L", r.length},
                    {"window", r.window},
                    {"windowed_ms", r.windowed_ms},
                    {"full_ms", r.full_ms}});
  }
  std::fflush(stdout);
  return json;
}

/// The projections table: measured (shapes with L <= kMaxProjectionLength,
/// where the projections are a large share of a call), printed, and its
/// JSON rows.
nlohmann::json projections_table(const Plan& plan, const Settings& settings) {
  constexpr int64_t kMaxProjectionLength = 256;
  std::vector<Shape> shapes;
  for (const auto& shape : plan.shapes) {
    if (shape.length <= kMaxProjectionLength) {
      shapes.push_back(shape);
    }
  }
  fmt::print(
      "\nprojections: the in_proj and out_proj products alone (the value "
      "third of the packed in-projection straight to out_proj, no attention "
      "between),\nthrough torch::nn's (nn proj) and through mha's (mha proj); "
      "shapes with L <= {}; medians of interleaved runs\n",
      kMaxProjectionLength);
  fmt::print("{:<16} {:<12} {:>4} {:>12} {:>13} {:>12} {:>9} {:>8} {:>16}\n",
             "config N,L,E,H", "mode", "reps", "nn proj ms", "mha proj ms",
             "torch::nn ms", "mha ms", "proj/nn", "attention mha/nn");
  auto json = nlohmann::json::array();
  for (const auto& r : measure_projections(shapes, plan.modes, settings)) {
    const double nn_attention = r.torch_nn_ms - r.projections_ms;
    const double mha_attention = r.mha_ms - r.mha_projections_ms;
    const bool comparable = nn_attention > 0 && mha_attention > 0;
    const auto attention_ratio =
        comparable ? nlohmann::json(mha_attention / nn_attention)
                   : nlohmann::json(nullptr);
    fmt::print(
        "{:<16} {:<12} {:>4} {:>12.3f} {:>13.3f} {:>12.3f} {:>9.3f} {:>8.2f} "
        "{:>16}\n",
        to_string(r.shape), name(r.mode), r.reps, r.projections_ms,
        r.mha_projections_ms, r.torch_nn_ms, r.mha_ms,
        r.projections_ms / r.torch_nn_ms,
        comparable ? fmt::format("{:.2f}", mha_attention / nn_attention)
                   : std::string("-"));
    json.push_back({{"config", to_string(r.shape)},
                    {"mode", name(r.mode)},
                    {"reps", r.reps},
                    {"projections_ms", r.projections_ms},
                    {"mha_projections_ms", r.mha_projections_ms},
                    {"torch_nn_ms", r.torch_nn_ms},
                    {"mha_ms", r.mha_ms},
                    {"attention_ratio", attention_ratio}});
  }
  fmt::print(
      "proj/nn = nn proj / torch::nn: torch::nn's share in its projections; "
      "attention mha/nn = (mha - mha proj) / (torch::nn - nn proj)\n");
  std::fflush(stdout);
  return json;
}

/// The generation line: measured, printed, and its JSON.
nlohmann::json generation_table(bool quick, uint64_t seed, bool& differs) {
  const int64_t prompt = quick ? 32 : 256, new_tokens = quick ? 32 : 256;
  const int reps = quick ? 1 : 3;
  const auto g = measure_generation(prompt, new_tokens, reps, seed);
  differs = !g.identical;
  const double speedup = g.recomputed_s / g.cached_s;
  fmt::print(
      "\ngeneration: mha-train's default char LM (random weights), {} "
      "greedy characters after a {}-character prompt, median of {} runs\n"
      "  KV cache: {:.3f} s ({:.0f} tokens/s); recomputed every step: "
      "{:.3f} s ({:.0f} tokens/s); speedup {:.1f}x; same characters: "
      "{}\n",
      new_tokens, prompt, reps, g.cached_s,
      static_cast<double>(new_tokens) / g.cached_s, g.recomputed_s,
      static_cast<double>(new_tokens) / g.recomputed_s, speedup,
      g.identical ? "yes" : "NO");
  std::fflush(stdout);
  return {{"prompt", g.prompt},
          {"new_tokens", g.new_tokens},
          {"reps", g.reps},
          {"cached_s", g.cached_s},
          {"recomputed_s", g.recomputed_s},
          {"speedup", speedup},
          {"identical", g.identical}};
}

/// The batched-decoding table (B prompts through one left-padded cache vs
/// one at a time): measured, printed, and its JSON; `failed` when a batch
/// size's outputs differ from the sequences decoded alone.
nlohmann::json batched_decode_table(bool quick, const Settings& settings,
                                    bool& failed) {
  BatchedDecodeOptions o;
  o.reps = 7;
  o.plant_fault = settings.plant_fault;
  std::vector<int64_t> batches = {1, 8, 32};
  if (quick) {
    o.embed_dim = 32;
    o.num_heads = 4;
    o.max_prompt = 16;
    o.new_tokens = 8;
    o.reps = 1;
    batches = {3};
  }
  fmt::print(
      "\nbatched decoding: MultiHeadAttention({}, {}), num_kv_heads {}, "
      "rotary, no bias (Llama-like), float32 on {}, no grad; B prompts of "
      "{}..{} tokens, {} new tokens each;\n  batched: one KVCache, prompts "
      "left-padded, key_padding_mask + positions cumsum(mask) - 1 (HF); one "
      "at a time: each prompt in its own cache;\n  next input = "
      "layer_norm(input + output) of the last token (no affine); prefill "
      "and decode timed apart, tokens/s = B*G / decode time; median of {} "
      "runs;\n  check: max |batched - alone| over every prompt token and "
      "step, tolerance {:.0e}\n",
      o.embed_dim, o.num_heads, o.num_kv_heads, settings.device.str(),
      o.max_prompt / 2, o.max_prompt, o.new_tokens, o.reps, o.tolerance);
  // static: fmt 11 (C++20) checks the format at compile time, which needs
  // the array's address to be a constant.
  static constexpr char kHeadFormat[] =
      "{:>4} {:>7}   {:>10} {:>10} {:>9}   {:>10} {:>10} {:>9}  {:>7}  {}\n";
  fmt::print("{:>4} {:>7}   {:<31}   {}\n", "", "prompt",
             "one at a time (own caches)", "batched (one cache)");
  fmt::print(kHeadFormat, "B", "tokens", "prefill ms", "decode ms", "tokens/s",
             "prefill ms", "decode ms", "tokens/s", "speedup",
             "check (max |batched - alone|)");
  auto rows = nlohmann::json::array();
  failed = false;
  for (const auto batch : batches) {
    const auto r = measure_batched_decode(batch, o, settings);
    const double tokens = static_cast<double>(batch * o.new_tokens);
    const double single_rate = tokens / (r.single_decode_ms * 1e-3);
    const double batched_rate = tokens / (r.batched_decode_ms * 1e-3);
    int64_t prompt_tokens = 0;
    for (const auto p : r.prompt_lengths) {
      prompt_tokens += p;
    }
    failed = failed || !r.passed;
    fmt::print(
        "{:>4} {:>7}   {:>10.2f} {:>10.2f} {:>9.0f}   {:>10.2f} {:>10.2f} "
        "{:>9.0f}  {:>6.2f}x  {} {:.1e}\n",
        batch, prompt_tokens, r.single_prefill_ms, r.single_decode_ms,
        single_rate, r.batched_prefill_ms, r.batched_decode_ms, batched_rate,
        single_rate > 0 ? batched_rate / single_rate : 0.0,
        r.passed ? "ok" : "FAIL", r.max_abs_diff);
    rows.push_back({{"batch", batch},
                    {"prompt_lengths", r.prompt_lengths},
                    {"one_at_a_time",
                     {{"prefill_ms", r.single_prefill_ms},
                      {"decode_ms", r.single_decode_ms},
                      {"decode_ms_samples", r.single_decode_samples_ms},
                      {"decode_tokens_per_s", single_rate}}},
                    {"batched",
                     {{"prefill_ms", r.batched_prefill_ms},
                      {"decode_ms", r.batched_decode_ms},
                      {"decode_ms_samples", r.batched_decode_samples_ms},
                      {"decode_tokens_per_s", batched_rate}}},
                    {"decode_speedup", batched_rate / single_rate},
                    {"max_abs_diff", r.max_abs_diff},
                    {"passed", r.passed}});
  }
  fmt::print(
      "  one at a time: prefill and decode ms summed over the B prompts; "
      "speedup = batched / one-at-a-time decode tokens/s\n");
  std::fflush(stdout);
  return {{"embed_dim", o.embed_dim},
          {"num_heads", o.num_heads},
          {"num_kv_heads", o.num_kv_heads},
          {"rotary_theta", o.rotary_theta},
          {"device", settings.device.str()},
          {"dtype", "float32"},
          {"prompt_min", o.max_prompt / 2},
          {"prompt_max", o.max_prompt},
          {"new_tokens", o.new_tokens},
          {"reps", o.reps},
          {"next_input", "layer_norm(input + output), no affine"},
          {"tokens_per_s", "B*G / decode time (prefill excluded)"},
          {"tolerance", o.tolerance},
          {"rows", rows},
          {"passed", !failed}};
}

}  // namespace

Variants run_variants(const Args& args, const Plan& plan,
                      const Settings& settings) {
  auto named = [&](const char* variant) {
    return std::find(args.variant_texts.begin(), args.variant_texts.end(),
                     variant) != args.variant_texts.end();
  };
  auto wants = [&](const char* variant) {
    return args.variant_texts.empty() || named(variant);
  };
  Variants v;
  if (wants("projections")) {
    v.projections = projections_table(plan, settings);
  }
  if (wants("window")) {
    v.window = window_table(args.quick, settings);
  }
  if (wants("generation") && !settings.device.is_cuda()) {
    v.generation =
        generation_table(args.quick, args.seed, v.generation_differs);
  }
  if (wants("generation") || wants("batched-decode")) {
    bool failed = false;
    v.batched_decode = batched_decode_table(args.quick, settings, failed);
    v.generation_differs = v.generation_differs || failed;
  }
  // Long (L up to 16384): only when named.
  if (named("flex") && !settings.device.is_cuda()) {
    v.flex = flex_table(args.quick, settings);
  }
  // Minutes (L up to 64k): only when named (bench_linear.cpp).
  if (named("linear")) {
    v.linear = linear_table(args.quick, settings);
  }
  return v;
}

}  // namespace mha::bench

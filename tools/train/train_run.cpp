// mha-train's run: the task (data and model) from the settings, joining a
// data-parallel job, the header lines, training with progress lines, and
// the report after training (accuracy, or validation loss, a sample and
// attention maps).
#include <fmt/core.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>

#include "core/blas_threads.h"
#include "mha/version.h"
#include "train/train_tool.h"

namespace mha::train_tool {

namespace {

namespace train = mha::train;
namespace dist = mha::distributed;

/// Prints progress lines: redrawn in place on a terminal, whole lines at a
/// throttled rate otherwise (train::ProgressThrottle decides which).
class ProgressPrinter {
 public:
  ProgressPrinter(bool quiet, int64_t steps)
      : quiet_(quiet),
        interactive_(isatty(fileno(stdout)) != 0),
        throttle_(interactive_, steps) {}

  void operator()(const train::Progress& progress) {
    if (quiet_ || !throttle_.should_show(progress, now_s())) {
      return;
    }
    const auto line = train::format_progress(progress);
    const bool keep = progress.val_loss || progress.checkpointed ||
                      progress.step == progress.steps;
    if (interactive_) {
      // Redraw the line; keep it when it reports something.
      fmt::print("\r{}\x1b[K{}", line, keep ? "\n" : "");
    } else {
      fmt::print("{}\n", line);
    }
    std::fflush(stdout);
  }

  /// Ends a line left open by an interrupted redraw.
  void finish() {
    if (!quiet_ && interactive_) {
      fmt::print("\r\x1b[K");
    }
  }

 private:
  static double now_s() {
    return std::chrono::duration<double>(
               std::chrono::steady_clock::now().time_since_epoch())
        .count();
  }

  bool quiet_;
  bool interactive_;
  train::ProgressThrottle throttle_;
};

int64_t count_parameters(torch::nn::Module& module) {
  int64_t count = 0;
  for (const auto& parameter : module.parameters()) {
    count += parameter.numel();
  }
  return count;
}

/// "mha-train", or "mha-train [rank r]" in a job.
std::string who(const Config& config) {
  return config.job ? fmt::format("mha-train [rank {}]", config.rank)
                    : std::string(kTool);
}

/// The charlm report: validation loss, a sample, the attention maps.
int report_charlm(const Args& args, const Config& config,
                  train::CharLMTask& task) {
  const double baseline = task.unigram_baseline();
  const double val = task.validation_loss();
  fmt::print(
      "validation loss {:.4f} nats/char vs unigram baseline {:.4f}: {:.4f} "
      "below\n",
      val, baseline, baseline - val);
  if (task.documents().batching() != train::CharBatching::kWindows &&
      args.compare_batches > 0) {
    const auto t = task.compare_document_layouts(args.compare_batches);
    fmt::print(
        "packed vs padded: {:.0f} vs {:.0f} document characters/s, {:.2f}x "
        "(forward + backward of the same {} batches, {} characters in {} "
        "documents; padding {:.1f}% of the padded positions)\n",
        t.packed_tokens_per_s, t.padded_tokens_per_s,
        t.packed_tokens_per_s / std::max(t.padded_tokens_per_s, 1e-9),
        t.batches, t.tokens, t.documents,
        100.0 * (1.0 - static_cast<double>(t.tokens) /
                           static_cast<double>(
                               std::max<int64_t>(t.padded_positions, 1))));
  }
  const auto sampling =
      train::SamplingOptions()
          .temperature(args.temperature)
          .top_k(args.top_k)
          .seed(train::derive_seed(args.seed, 0, train::SeedStream::kSampling));
  std::string sample;
  const auto sample_start = std::chrono::steady_clock::now();
  try {
    sample =
        task.sample(args.prompt, args.sample_len, sampling, !args.no_kv_cache);
  } catch (const c10::Error& e) {
    fmt::print(stderr, "{}: {}\n", kTool, e.what_without_backtrace());
    return 2;
  }
  const std::chrono::duration<double> sample_time =
      std::chrono::steady_clock::now() - sample_start;
  fmt::print(
      "sample (temperature {:g}, top-k {}; {} characters in {:.2f} s, {}):"
      "\n{}\n",
      args.temperature, args.top_k, args.sample_len, sample_time.count(),
      args.no_kv_cache ? "recomputed every step" : "KV cache", sample);
  if (args.plot_dir.empty()) {
    return 0;
  }
  try {
    const auto paths = task.plot_attention(args.plot_dir, config.plot_length);
    std::string listed;
    for (const auto& path : paths) {
      listed += " " + path;
    }
    fmt::print(
        "attention maps ({} layers x {} heads, {} validation "
        "characters):{}\n",
        paths.size(), task.lm()->options.n_head(), config.plot_length, listed);
  } catch (const c10::Error& e) {
    fmt::print(stderr, "mha-train: {}\n", e.what_without_backtrace());
    return 1;
  }
  return 0;
}

/// The add report: exact match on held-out additions by greedy decoding
/// through the decoder's cache, and a few examples.
int report_addition(const Args& args, train::AdditionTask& task) {
  const auto start = std::chrono::steady_clock::now();
  const auto matches = task.accuracy(args.eval_sequences);
  const std::chrono::duration<double> decode_time =
      std::chrono::steady_clock::now() - start;
  fmt::print(
      "held-out exact match: {:.2f}% of {} additions ({:.3f}% of answer "
      "tokens), greedy decoding through the decoder's cache in {:.2f} s\n",
      100.0 * static_cast<double>(matches.exact) /
          static_cast<double>(matches.sequences),
      matches.sequences,
      100.0 * static_cast<double>(matches.correct_tokens) /
          static_cast<double>(std::max<int64_t>(matches.tokens, 1)),
      decode_time.count());
  fmt::print("examples:\n{}", task.examples(3));
  return 0;
}

}  // namespace

bool set_threads(int threads) {
  at::set_num_threads(threads);
  return mha::detail::set_openblas_threads(threads);
}

namespace {

/// --attention's kind.
AttentionKind attention_kind(const std::string& name) {
  return name == "linear"      ? AttentionKind::kLinear
         : name == "performer" ? AttentionKind::kPerformer
         : name == "linformer" ? AttentionKind::kLinformer
                               : AttentionKind::kSoftmax;
}

}  // namespace

std::unique_ptr<train::TrainTask> make_task(const Args& args,
                                            const Config& config) {
  try {
    train::validate(config.options);
    if (config.charlm) {
      auto text = train::read_text_file(args.text_path);
      auto corpus =
          train::make_char_corpus(text, args.val_fraction, args.context);
      const auto model_options =
          train::CharLMOptions(corpus.vocab.size(), args.context)
              .n_embd(config.d_model)
              .n_head(config.heads)
              .n_layer(config.layers)
              .dropout(config.dropout)
              .rotary(args.positions == "rotary")
              .attention_kind(attention_kind(args.attention));
      const auto documents =
          train::CharDocumentOptions()
              .batching(args.packed   ? train::CharBatching::kPacked
                        : args.padded ? train::CharBatching::kPadded
                                      : train::CharBatching::kWindows)
              .min_len(args.doc_min_len.value_or(0))
              .max_len(args.doc_max_len.value_or(0))
              .block(args.doc_block);
      return std::make_unique<train::CharLMTask>(
          std::move(corpus), model_options, config.batch, args.seed,
          config.device, documents);
    }
    if (config.addition) {
      const auto data = train::AdditionDataOptions().max_digits(args.digits);
      const auto model_options =
          train::Seq2SeqTransformerOptions(
              train::kAddVocabSize, data.source_length(), data.target_length())
              .d_model(config.d_model)
              .nhead(config.heads)
              .num_encoder_layers(config.layers)
              .num_decoder_layers(config.layers)
              .dim_feedforward(config.ff)
              .dropout(config.dropout);
      return std::make_unique<train::AdditionTask>(
          data, model_options, config.batch, args.seed, config.device);
    }
    const auto data = train::DigitDataOptions(args.task_name == "sort"
                                                  ? train::DigitRule::kSort
                                                  : train::DigitRule::kReverse)
                          .min_len(args.min_len)
                          .max_len(args.max_len);
    const auto model_options =
        train::DigitTransformerOptions(args.max_len)
            .d_model(config.d_model)
            .nhead(config.heads)
            .num_layers(config.layers)
            .dim_feedforward(config.ff)
            .dropout(config.dropout)
            .attention_kind(attention_kind(args.attention))
            .projected_length(args.projected_length);
    return std::make_unique<train::DigitTask>(data, model_options, config.batch,
                                              args.seed, config.device);
  } catch (const c10::Error& e) {
    fmt::print(stderr, "{}: {}\n", kTool, e.what_without_backtrace());
    return nullptr;
  }
}

std::optional<dist::ProcessGroup> join_job(const Args& args,
                                           const Config& config) {
  std::optional<dist::ProcessGroup> group;
  if (config.job) {
    group.emplace(*config.job, dist::ProcessGroupOptions()
                                   .backend(config.backend)
                                   .timeout(config.timeout)
                                   .interface(args.interface));
  }
  return group;
}

void print_header(const Args& args, const Config& config,
                  train::TrainTask& task, bool openblas,
                  const std::string& runtime_note) {
  const auto* char_task = dynamic_cast<train::CharLMTask*>(&task);
  const auto& options = config.options;
  fmt::print(
      "mha-train: {} | LibTorch {} | device {} | threads {}{} | seed {}\n",
      task.name(), mha::torch_version(), config.device.str(), args.threads,
      openblas ? fmt::format(" (OpenBLAS {} too)", mha::detail::openblas_core())
               : "",
      args.seed);
  if (!runtime_note.empty()) {
    fmt::print("environment set by mha-train: {}\n", runtime_note);
  }
  if (const auto& job = config.job) {
    const int64_t batch = config.batch;
    fmt::print(
        "data-parallel: {} process{} ({} at {}:{}), {} sequences each per "
        "step\n",
        job->world_size, job->world_size == 1 ? "" : "es",
        dist::backend_name(config.backend), job->master_addr, job->master_port,
        batch % job->world_size == 0
            ? fmt::format("{}", batch / job->world_size)
            : fmt::format("{}-{}", batch / job->world_size,
                          batch / job->world_size + 1));
  }
  fmt::print(
      "model: {} parameters | {} steps of {} sequences | lr {:g} -> {:g}, "
      "warmup {} | out {}\n",
      count_parameters(task.model()), options.steps(), config.batch,
      options.lr(), options.min_lr(), options.warmup_steps(),
      options.out_dir());
  if (args.attention != "softmax") {
    fmt::print("attention: {} (MultiHeadAttentionOptions::attention_kind)\n",
               args.attention);
  }
  if (char_task != nullptr) {
    fmt::print(
        "text: {} ({} characters, {} distinct); unigram baseline {:.4f} "
        "nats/char\n",
        args.text_path,
        char_task->corpus().train.size(0) + char_task->corpus().val.size(0),
        char_task->corpus().vocab.size(), char_task->unigram_baseline());
    const auto& documents = char_task->documents();
    if (documents.batching() != train::CharBatching::kWindows) {
      fmt::print(
          "documents: lengths {}-{} (a row's last one cut to fit), {}\n",
          documents.min_len(), documents.max_len(),
          documents.batching() == train::CharBatching::kPacked
              ? fmt::format("packed into rows of {} characters; causal "
                            "document mask in blocks of {}, positions "
                            "restarting per document",
                            args.context, documents.block())
              : std::string("one per row, padded to the longest; padding "
                            "masked"));
    }
  }
  std::fflush(stdout);
}

std::optional<int> train(const Args& args, const Config& config,
                         train::TrainTask& task, dist::ProcessGroup* group,
                         train::TrainResult& result, double& seconds) {
  ProgressPrinter printer(args.quiet || config.rank != 0,
                          config.options.steps());
  const auto start = std::chrono::steady_clock::now();
  try {
    result = train::train(task, config.options, std::ref(printer), group);
  } catch (const c10::Error& e) {
    printer.finish();
    fmt::print(stderr, "{}: {}\n", who(config), e.what_without_backtrace());
    return 1;
  }
  if (config.rank != 0) {
    return 0;  // rank 0 evaluates, samples and reports
  }
  seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start)
          .count();
  printer.finish();
  return std::nullopt;
}

int report(const Args& args, const Config& config, train::TrainTask& task,
           const train::TrainResult& result, double seconds) {
  const auto& options = config.options;
  const train::RunFiles files(options.out_dir());
  if (result.last_step < result.first_step) {
    fmt::print("nothing to do: the checkpoint is at step {} of {}\n",
               result.first_step - 1, options.steps());
  } else {
    const int64_t steps = result.last_step - result.first_step + 1;
    fmt::print(
        "trained steps {}-{} in {} ({:.1f} ms/step); checkpoint {}, loss "
        "curve {} and {}\n",
        result.first_step, result.last_step, train::format_duration(seconds),
        1e3 * seconds / static_cast<double>(steps), files.checkpoint_dir,
        files.loss_csv, files.loss_svg);
  }
  if (result.last_step < options.steps() &&
      result.last_step >= result.first_step) {
    fmt::print("stopped at step {} (--stop-at); continue with --resume\n",
               result.last_step);
    return 0;
  }
  if (auto* add_task = dynamic_cast<train::AdditionTask*>(&task)) {
    return report_addition(args, *add_task);
  }
  if (auto* digit_task = dynamic_cast<train::DigitTask*>(&task)) {
    const auto accuracy = digit_task->accuracy(args.eval_sequences);
    fmt::print(
        "held-out accuracy: {:.2f}% of {} sequences exactly right ({:.3f}% of "
        "digits)\n",
        100.0 * accuracy.sequence, accuracy.num_sequences,
        100.0 * accuracy.token);
    return 0;
  }
  return report_charlm(args, config, dynamic_cast<train::CharLMTask&>(task));
}

}  // namespace mha::train_tool

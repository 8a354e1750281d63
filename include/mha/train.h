// Training toy models with mha: the pieces of mha-train, written to be read
// as a model for your own training loops.
//
//   * Three toy tasks: digit sequences to reverse or sort (an
//     mha::TransformerEncoder with a key padding mask), a small GPT-style
//     character language model (pre-norm blocks of causal
//     mha::MultiHeadAttention and an MLP, the output head tied to the token
//     embedding), and adding two numbers with an encoder–decoder
//     mha::Transformer (teacher forcing; greedy decoding through the
//     decoder's cache).
//   * One training loop for all: AdamW, linear warmup + cosine learning rate,
//     gradient clipping, periodic validation, checkpoints and exact resume.
//   * The loss curve as CSV and as an SVG plot.
//
// Randomness. Every batch is a pure function of (seed, step): the loop never
// draws data from a stream that runs across steps, so a run resumed at step k
// sees the same batches as the uninterrupted run. What does run across steps,
// the dropout masks drawn from LibTorch's default CPU generator, is saved in
// checkpoints and restored. On the CPU a resumed run therefore reproduces the
// uninterrupted run's losses bit for bit (same seed, settings and threads).
// On CUDA the CUDA generator is not saved: resume works but is not exact.
//
// Glossary: N batch, L sequence length (digit tasks), T context length (the
// character model), E model width, V vocabulary size.
#pragma once

// One header per concept, under mha/train/:
#include "mha/train/checkpoint.h"  // RunFiles, save_checkpoint, load_checkpoint
#include "mha/train/data.h"        // seeds, digit sequences, character data
#include "mha/train/loop.h"        // TrainOptions, train()
#include "mha/train/models.h"      // DigitTransformer, CharLM, generate
#include "mha/train/optim.h"       // LrSchedule, AdamW
#include "mha/train/progress.h"    // Progress, ProgressThrottle, format_*
#include "mha/train/report.h"      // LossRecord, loss CSV and SVG
#include "mha/train/seq2seq.h"     // AdditionTask, Seq2SeqTransformer
#include "mha/train/tasks.h"       // TrainTask, DigitTask, CharLMTask

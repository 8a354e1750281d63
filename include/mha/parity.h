// Parity checking: proves that mha::MultiHeadAttention computes what
// torch::nn::MultiheadAttention computes (outputs, weights and gradients),
// and what an independent float64 implementation of the formula computes;
// likewise mha::TransformerEncoderLayer against
// torch::nn::TransformerEncoderLayer (post-norm, seq-first, eps 1e-5, with
// biases: the options LibTorch's layer has; rows with other options are
// checked against the float64 reference alone), and
// mha::TransformerDecoderLayer against torch::nn::TransformerDecoderLayer
// under the same conditions.
//
// Where LibTorch's module is known to be wrong or to refuse an input (a bool
// attn_mask is added as 0/1; a 3-D attn_mask fails; kdim != vdim fails an
// assert; a float key_padding_mask is not applied; fully masked
// rows give NaN), a case is checked against the float64 reference alone and
// reported as a known reference difference (Status::kRefDiff).
#pragma once

#include <torch/torch.h>

#include <functional>
#include <map>
#include <string>
#include <tuple>
#include <vector>

#include "mha/multi_head_attention.h"
#include "mha/transformer.h"
#include "mha/transformer_decoder.h"

namespace mha::parity {

/// Kinds of mask a case can use.
enum class MaskKind { kNone, kBool, kFloat };

/// One configuration to check. Lengths and sizes are in elements.
struct Case {
  /// Row name, e.g. "causal-self" (mha-parity prints it with the dtype).
  std::string name;
  /// Checks a TransformerEncoderLayer (self-attention over the query; the
  /// attention fields below apply to its self_attn, attn_mask is src_mask,
  /// key_padding_mask is src_key_padding_mask) instead of a
  /// MultiHeadAttention.
  bool encoder_layer = false;
  /// Checks a TransformerDecoderLayer: the query is tgt, the key is memory
  /// (N, S, E) (value = key), attn_mask is memory_mask, key_padding_mask is
  /// memory_key_padding_mask, is_causal is tgt_is_causal; the attention
  /// fields apply to both self_attn and multihead_attn.
  bool decoder_layer = false;
  /// Checks a whole Transformer (2 encoder and 2 decoder layers, final
  /// norms): the query is tgt, the key is src (N, S, E);
  /// key_padding_mask is src_key_padding_mask and memory_key_padding_mask,
  /// attn_mask is memory_mask, is_causal is tgt_is_causal.
  bool transformer = false;
  int64_t dim_feedforward = 16;  ///< layers and Transformer only
  bool gelu = false;             ///< layers only: gelu, else relu
  bool norm_first = false;       ///< layers only
  double layer_norm_eps = 1e-5;  ///< layers only
  int64_t batch = 2;             ///< N
  int64_t tgt_len = 5;           ///< L
  int64_t src_len = 7;           ///< S (ignored for self-attention: S = L)
  int64_t embed_dim = 8;         ///< E
  int64_t num_heads = 2;         ///< H
  c10::optional<int64_t> kdim;   ///< default embed_dim
  c10::optional<int64_t> vdim;   ///< default embed_dim
  bool self_attention = false;   ///< key and value left undefined
  /// Biases in the projections (PyTorch's `bias`).
  bool bias = true;
  /// Learned key and value rows appended (PyTorch's `add_bias_kv`).
  bool add_bias_kv = false;
  /// A zero key and value appended (PyTorch's `add_zero_attn`).
  bool add_zero_attn = false;
  /// Inputs (N, L, E) if true, else (L, N, E).
  bool batch_first = true;
  bool unbatched = false;  ///< query (L, E); batch must be 1
  /// The (N, S) key padding mask's kind (bool: true = padded).
  MaskKind key_padding_mask = MaskKind::kNone;
  /// The attention mask's kind (bool: true = blocked; float: added).
  MaskKind attn_mask = MaskKind::kNone;
  bool attn_mask_3d = false;  ///< (N*H, L, S) instead of (L, S)
  /// Query i attends keys j <= i only.
  bool is_causal = false;
  /// Block every key of the first query row (through the masks in use, or a
  /// padding mask when none is): exercises the fully-masked-row rule.
  bool fully_masked_row = false;
  /// Return and compare the attention weights.
  bool need_weights = true;
  /// Weights averaged over heads (N, L, S), else per head (N, H, L, S).
  bool average_attn_weights = true;
  /// FlexAttention (mha/flex_attention.h) row: "" none; "block-causal"
  /// (is_causal as a causal BlockMask of 8-row blocks), "documents" (three
  /// packed documents, causal, as create_document_block_mask; the
  /// references get the same mask as a float attn_mask), "softcap" (the
  /// module's score_mod: 2 · tanh(score / 2), with is_causal), "alibi"
  /// (ALiBi's bias as a score_mod capturing the slopes, with is_causal);
  /// "block-causal-fused", "softcap-fused", "alibi-fused": the same as
  /// fused mods (fused_mask_mod / fused_score_mod).
  /// torch::nn is the reference where it computes the same (block-causal,
  /// documents), the float64 reference (which applies the score_mod) always.
  std::string flex;
  /// dtype of inputs and parameters (float32, float64; bfloat16 and float16,
  /// float16 on the CPU with LibTorch 2.x only).
  torch::ScalarType dtype = torch::kFloat32;
  /// Called on the mha attention module (an encoder layer's self_attn) after
  /// both references took its weights and before it runs: lets a test plant
  /// a fault that the check must catch.
  std::function<void(MultiHeadAttentionImpl&)> tamper;
};

/// Elementwise tolerance: |mha - reference| <= atol + rtol * |reference|.
struct Tolerance {
  /// Absolute part of the tolerance.
  double atol = 0.0;
  /// Relative part, times |reference|.
  double rtol = 0.0;
};

/// The tolerance used for results computed in `dtype`.
Tolerance tolerance_for(torch::ScalarType dtype);

/// Outcome of a case.
enum class Status { kPass, kFail, kRefDiff };

/// "PASS", "FAIL" or "REF-DIFF".
const char* to_string(Status status);

/// Errors of one compared tensor (output, weights, a gradient).
struct Comparison {
  std::string what;  ///< e.g. "output", "grad query", "grad out_proj.weight"
  double max_abs = 0.0;  ///< max |mha - reference|
  double max_rel = 0.0;  ///< max |mha - reference| / (|reference| + atol)
  bool within = true;    ///< every element within the tolerance
};

/// Errors against one reference, worst over every compared tensor.
struct ReferenceResult {
  bool used = false;  ///< this reference was compared
  /// Largest max |mha - reference| over parts.
  double max_abs = 0.0;
  /// Largest max |mha - reference| / (|reference| + atol) over parts.
  double max_rel = 0.0;
  /// Every part within the tolerance.
  bool within = true;
  /// One entry per compared tensor.
  std::vector<Comparison> parts;
};

/// The result of one case.
struct CaseResult {
  /// The case's name and dtype, e.g. "causal-self/f32".
  std::string name;
  /// PASS, FAIL or REF-DIFF (torch::nn differs where it is known wrong).
  Status status = Status::kFail;
  /// The tolerance both references were judged with.
  Tolerance tolerance;
  ReferenceResult torch_nn;  ///< mha vs torch::nn's module (if it has the
                             ///< case's options)
  ReferenceResult float64;   ///< mha vs the float64 reference
  std::string compared;      ///< e.g. "out+w+grads"
  std::string note;          ///< why REF-DIFF / FAIL, or how inputs were passed
  /// Attention weights of the first batch element, for pictures: (H, L, S')
  /// per head or (1, L, S') averaged, float64 on the CPU; undefined when the
  /// case has no weights (or that reference did not run or threw).
  torch::Tensor weights;           ///< mha's
  torch::Tensor torch_nn_weights;  ///< torch::nn's (may hold NaN)
  torch::Tensor float64_weights;   ///< the float64 reference's
};

/// The default matrix: at least 30 named cases in float32 and float64.
std::vector<Case> default_cases();

/// Runs one case on `device` with random weights and inputs from `seed`.
/// Never throws for a failing comparison; throws c10::Error for an invalid
/// case (e.g. unbatched with batch != 1).
CaseResult run_case(const Case& spec, const torch::Device& device,
                    uint64_t seed);

/// Canonical inputs of a case (batch-first, batched).
struct Inputs {
  torch::Tensor query;             ///< (N, L, E)
  torch::Tensor key;               ///< (N, S, kdim)
  torch::Tensor value;             ///< (N, S, vdim)
  torch::Tensor key_padding_mask;  ///< (N, S) or undefined
  torch::Tensor attn_mask;         ///< (L, S) or (N*H, L, S) or undefined
  /// Query i attends keys j <= i only.
  bool is_causal = false;
};

/// Independent float64 multi-head attention written plainly from the
/// formula (per batch element and head, basic ops), on the parameters of
/// `module` and canonical batch-first inputs. Masks follow mha's rules
/// (bool true = blocked, float added, fully masked rows give weights 0).
/// `params` are float64 copies of the module's parameters by name (the
/// caller may ask for their gradients).
/// Returns (output (N, L, E), weights per head (N, H, L, S')).
std::tuple<torch::Tensor, torch::Tensor> reference_attention(
    const MultiHeadAttentionOptions& options,
    const std::map<std::string, torch::Tensor>& params, const Inputs& inputs);

/// Independent float64 encoder layer from basic ops: layer norm written
/// out, reference_attention for self_attn (query = key = value =
/// inputs.query), relu or exact gelu. `params` by PyTorch name
/// (self_attn.in_proj_weight, linear1.weight, norm1.weight, ...).
/// Returns the output (N, L, E).
torch::Tensor reference_encoder_layer(
    const TransformerEncoderLayerOptions& options, bool gelu,
    const std::map<std::string, torch::Tensor>& params, const Inputs& inputs);

/// Independent float64 decoder layer from basic ops, as
/// reference_encoder_layer: self_attn over inputs.query (tgt) with
/// inputs.is_causal as tgt_is_causal and no other mask; multihead_attn from
/// it to inputs.key = inputs.value (memory) with inputs.attn_mask and
/// inputs.key_padding_mask; norm1..3, linear1/2 by PyTorch name.
/// Returns the output (N, L, E).
torch::Tensor reference_decoder_layer(
    const TransformerDecoderLayerOptions& options, bool gelu,
    const std::map<std::string, torch::Tensor>& params, const Inputs& inputs);

/// Independent float64 Transformer: reference_encoder_layer for every
/// encoder layer on inputs.key (src, with inputs.key_padding_mask as
/// src_key_padding_mask), the encoder's final norm, then
/// reference_decoder_layer for every decoder layer (memory masks as there),
/// the decoder's final norm. `params` by PyTorch name (encoder.layers.0.*,
/// encoder.norm.*, decoder.layers.0.*, decoder.norm.*). Returns the output
/// (N, L, E).
torch::Tensor reference_transformer(
    const TransformerOptions& options, bool gelu,
    const std::map<std::string, torch::Tensor>& params, const Inputs& inputs);

// ------------------------------------------------- recorded references ---

/// A reference file recorded from a Python model (scripts/
/// record_reference.py; format in docs/porting.md, "Prove your port"
/// model"): a safetensors file with the input and output of one attention
/// layer, and either the model directory it came from or the layer's
/// tensors and config.json.
struct RecordedReference {
  /// The file read.
  std::string path;
  /// __metadata__: format, version, config, layer, stack, model_dir.
  std::map<std::string, std::string> metadata;
  /// Every tensor of the file by name.
  torch::OrderedDict<std::string, torch::Tensor> tensors;
};

/// Reads a reference file. Throws c10::Error naming the file for one that
/// is not safetensors, lacks __metadata__ format "mha-attention-reference",
/// or lacks hidden_states and output (or step0.hidden_states and
/// step0.output).
RecordedReference read_reference(const std::string& path);

/// The mha module the reference's model has at its layer: from model_dir
/// (relative to the file's directory) when the metadata names one, else
/// from the metadata's config and the file's tensors (mha::hf).
MultiHeadAttention reference_module(const RecordedReference& reference);

/// The result of checking mha against a reference file.
struct RecordedCheck {
  std::string name;     ///< the file's name
  Tolerance tolerance;  ///< 1e-5 + 1e-4 |ref| in float32/64, else the dtype's
  std::vector<Comparison> parts;  ///< output, weights (per step if cached)
  /// Every part within the tolerance (the row PASSes).
  bool within = true;
  /// The element farthest outside (or nearest to) the tolerance, e.g.
  /// "output[1, 3, 7]: mha 0.1234 vs reference 0.1240".
  std::string worst;
  /// Query rows left out because the attention_mask marks them padding
  /// (their values carry no meaning; DESIGN.md).
  int64_t skipped_rows = 0;
  std::string note;  ///< what ran: model type, layer, causal, rows
};

/// Runs mha on the reference's recorded inputs (hidden_states,
/// attention_mask as key_padding_mask, position_ids as forward's positions,
/// the family's causality) and compares with its recorded output and
/// per-head weights, on `device`. A file of decoding steps (step0.*,
/// step1.*, ...: hidden_states, output, weights, position_ids; one
/// attention_mask (N, all tokens)) runs them in order through one KVCache
/// with forward_cached, each step with the mask's columns so far as
/// key_padding_mask. Query rows the attention_mask marks padding are left
/// out of the comparison (skipped_rows).
/// A layer that is not a MultiHeadAttention runs as its own module, from
/// the file's model_dir (required there), outputs compared (neither
/// returns weights): deepseek_v2 / deepseek_v3 as MultiHeadLatentAttention
/// (hf::load_latent_attention; steps through one LatentCache), and
/// qwen3_next's linear_attention layers as GatedDeltaNet
/// (hf::load_gated_delta_net; steps through one GatedDeltaNetState, no
/// attention_mask). Such a file may hold both a forward and steps; the
/// attention_mask then belongs to the forward.
/// `tamper`, when given, is called on a MultiHeadAttention before it runs,
/// `tamper_module` on the module of any kind (a test plants a fault that
/// the check must catch).
/// Throws c10::Error for a malformed file or a model mha::hf cannot build.
RecordedCheck check_reference(
    const std::string& path, const torch::Device& device = torch::kCPU,
    const std::function<void(MultiHeadAttentionImpl&)>& tamper = {},
    const std::function<void(torch::nn::Module&)>& tamper_module = {});

}  // namespace mha::parity

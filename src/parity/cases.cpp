// mha::parity's default matrix of cases and its tolerances per dtype
// (mha/parity.h).
#include "mha/parity.h"

namespace mha::parity {

Tolerance tolerance_for(torch::ScalarType dtype) {
  switch (dtype) {
    case torch::kFloat64:
      return {1e-10, 1e-8};
    case torch::kFloat32:
      return {2e-5, 1e-4};
    case torch::kBFloat16:
      return {5e-2, 5e-2};
    case torch::kFloat16:
      return {5e-3, 5e-3};
    default:
      TORCH_CHECK(false, "tolerance_for: dtype must be floating, but got ",
                  dtype);
  }
}

const char* to_string(Status status) {
  switch (status) {
    case Status::kPass:
      return "PASS";
    case Status::kFail:
      return "FAIL";
    case Status::kRefDiff:
      return "REF-DIFF";
  }
  return "?";
}

std::vector<Case> default_cases() {
  std::vector<Case> cases;
  auto add_case = [&](std::string name, auto&& configure) {
    for (auto dtype : {torch::kFloat32, torch::kFloat64}) {
      Case c;
      configure(c);
      c.dtype = dtype;
      c.name = name + (dtype == torch::kFloat32 ? "/f32" : "/f64");
      cases.push_back(c);
    }
  };
  add_case("self", [](Case& c) { c.self_attention = true; });
  add_case("cross", [](Case&) {});
  add_case("cross-L!=S-heads1", [](Case& c) { c.num_heads = 1; });
  add_case("kdim-vdim", [](Case& c) {
    c.kdim = 6;
    c.vdim = 6;
  });
  add_case("kdim!=vdim!=E", [](Case& c) {
    c.kdim = 5;
    c.vdim = 3;
  });
  add_case("bias-off", [](Case& c) { c.bias = false; });
  add_case("add_bias_kv", [](Case& c) { c.add_bias_kv = true; });
  add_case("add_zero_attn", [](Case& c) { c.add_zero_attn = true; });
  add_case("bias_kv+zero_attn+padding", [](Case& c) {
    c.add_bias_kv = true;
    c.add_zero_attn = true;
    c.key_padding_mask = MaskKind::kBool;
  });
  add_case("padding-bool",
           [](Case& c) { c.key_padding_mask = MaskKind::kBool; });
  add_case("padding-float",
           [](Case& c) { c.key_padding_mask = MaskKind::kFloat; });
  add_case("attn2d-float", [](Case& c) { c.attn_mask = MaskKind::kFloat; });
  add_case("attn2d-bool", [](Case& c) { c.attn_mask = MaskKind::kBool; });
  add_case("attn3d-float", [](Case& c) {
    c.attn_mask = MaskKind::kFloat;
    c.attn_mask_3d = true;
  });
  add_case("attn3d-bool", [](Case& c) {
    c.attn_mask = MaskKind::kBool;
    c.attn_mask_3d = true;
  });
  add_case("both-masks", [](Case& c) {
    c.attn_mask = MaskKind::kFloat;
    c.key_padding_mask = MaskKind::kBool;
  });
  add_case("causal-self", [](Case& c) {
    c.self_attention = true;
    c.is_causal = true;
  });
  add_case("causal+padding-L!=S", [](Case& c) {
    c.is_causal = true;
    c.key_padding_mask = MaskKind::kBool;
  });
  add_case("weights-per-head", [](Case& c) { c.average_attn_weights = false; });
  add_case("no-weights", [](Case& c) { c.need_weights = false; });
  add_case("seq-first", [](Case& c) {
    c.batch_first = false;
    c.key_padding_mask = MaskKind::kBool;
  });
  add_case("unbatched", [](Case& c) {
    c.unbatched = true;
    c.batch = 1;
    c.attn_mask = MaskKind::kFloat;
  });
  add_case("L=1-batch1", [](Case& c) {
    c.tgt_len = 1;
    c.batch = 1;
  });
  add_case("fully-masked-padding", [](Case& c) { c.fully_masked_row = true; });
  add_case("fully-masked-attn-no-weights", [](Case& c) {
    c.fully_masked_row = true;
    c.attn_mask = MaskKind::kFloat;
    c.need_weights = false;
  });
  add_case("encoder-relu", [](Case& c) { c.encoder_layer = true; });
  add_case("encoder-gelu+padding", [](Case& c) {
    c.encoder_layer = true;
    c.gelu = true;
    c.key_padding_mask = MaskKind::kBool;
  });
  add_case("encoder-seq-first+src_mask", [](Case& c) {
    c.encoder_layer = true;
    c.batch_first = false;
    c.attn_mask = MaskKind::kFloat;
  });
  add_case("encoder-causal+padding", [](Case& c) {
    c.encoder_layer = true;
    c.is_causal = true;
    c.key_padding_mask = MaskKind::kBool;
  });
  add_case("encoder-fully-masked", [](Case& c) {
    c.encoder_layer = true;
    c.fully_masked_row = true;
  });
  add_case("encoder-norm_first-gelu+padding", [](Case& c) {
    c.encoder_layer = true;
    c.norm_first = true;
    c.gelu = true;
    c.key_padding_mask = MaskKind::kBool;
  });
  add_case("encoder-bias-off-eps1e-3+causal", [](Case& c) {
    c.encoder_layer = true;
    c.bias = false;
    c.layer_norm_eps = 1e-3;
    c.is_causal = true;
  });
  add_case("decoder-causal+memory-padding", [](Case& c) {
    c.decoder_layer = true;
    c.is_causal = true;
    c.key_padding_mask = MaskKind::kBool;
  });
  add_case("decoder-gelu-seq-first+memory_mask", [](Case& c) {
    c.decoder_layer = true;
    c.gelu = true;
    c.batch_first = false;
    c.attn_mask = MaskKind::kFloat;
  });
  add_case("decoder-fully-masked-memory", [](Case& c) {
    c.decoder_layer = true;
    c.is_causal = true;
    c.fully_masked_row = true;
  });
  add_case("decoder-norm_first-gelu+causal", [](Case& c) {
    c.decoder_layer = true;
    c.norm_first = true;
    c.gelu = true;
    c.is_causal = true;
    c.key_padding_mask = MaskKind::kBool;
  });
  add_case("decoder-bias-off-unbatched", [](Case& c) {
    c.decoder_layer = true;
    c.bias = false;
    c.unbatched = true;
    c.batch = 1;
    c.is_causal = true;
  });
  add_case("transformer-causal+padding", [](Case& c) {
    c.transformer = true;
    c.is_causal = true;
    c.key_padding_mask = MaskKind::kBool;
  });
  add_case("transformer-gelu-seq-first+memory_mask", [](Case& c) {
    c.transformer = true;
    c.gelu = true;
    c.batch_first = false;
    c.is_causal = true;
    c.attn_mask = MaskKind::kFloat;
  });
  add_case("transformer-norm_first-bias-off+padding", [](Case& c) {
    c.transformer = true;
    c.norm_first = true;
    c.bias = false;
    c.is_causal = true;
    c.key_padding_mask = MaskKind::kBool;
  });
  // FlexAttention (Case::flex): block masks against the masks they stand
  // for, score mods against the float64 reference. Last, so that the rows
  // above keep their seeds.
  add_case("flex-block-causal", [](Case& c) {
    c.self_attention = true;
    c.tgt_len = 20;
    c.flex = "block-causal";
  });
  add_case("flex-documents+padding", [](Case& c) {
    c.self_attention = true;
    c.tgt_len = 21;
    c.flex = "documents";
    c.key_padding_mask = MaskKind::kBool;
    c.need_weights = false;
  });
  add_case("flex-softcap-causal", [](Case& c) {
    c.self_attention = true;
    c.tgt_len = 12;
    c.is_causal = true;
    c.flex = "softcap";
  });
  add_case("flex-alibi-causal-per-head", [](Case& c) {
    c.self_attention = true;
    c.tgt_len = 12;
    c.is_causal = true;
    c.flex = "alibi";
    c.average_attn_weights = false;
  });
  // The same as fused mods (mha::fused_score_mod / fused_mask_mod): the
  // module's CPU core runs them in its tile loop.
  add_case("flex-block-causal-fused", [](Case& c) {
    c.self_attention = true;
    c.tgt_len = 20;
    c.flex = "block-causal-fused";
  });
  add_case("flex-softcap-causal-fused", [](Case& c) {
    c.self_attention = true;
    c.tgt_len = 12;
    c.is_causal = true;
    c.flex = "softcap-fused";
  });
  add_case("flex-alibi-causal-per-head-fused", [](Case& c) {
    c.self_attention = true;
    c.tgt_len = 12;
    c.is_causal = true;
    c.flex = "alibi-fused";
    c.average_attn_weights = false;
  });
  return cases;
}

}  // namespace mha::parity

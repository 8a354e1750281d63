// Example: one attention layer of a Hugging Face transformers checkpoint,
// built by mha::hf with the family's conventions (heads, key/value heads,
// rotary embedding, biases...) read from config.json.
//
// Usage: hf_layer MODEL_DIR [LAYER] [REFERENCE]
//   MODEL_DIR  a checkpoint directory as save_pretrained writes it
//              (config.json, model.safetensors or pytorch_model.bin)
//   LAYER      the layer index (default 0)
//   REFERENCE  optional: hidden_states, output (and attention_mask,
//              position_ids) of that layer recorded from transformers, as
//              mha's scripts/record_reference.py writes them
// Checks: for a causal model, decoding token by token through the KV cache
// gives the full forward's output; with REFERENCE, the output equals the one
// transformers recorded. Exits 1 when a check fails.
//
// Glossary: N batch, L tokens, E hidden size.
#include <mha/mha.h>

#include <fstream>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

namespace {

int failures = 0;

void check(bool ok, const std::string& what) {
  std::cout << (ok ? "ok:     " : "FAILED: ") << what << '\n';
  failures += ok ? 0 : 1;
}

std::string read_text(const std::string& path) {
  std::ifstream in(path);
  TORCH_CHECK(in, "cannot read ", path);
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2 || argc > 4) {
    std::cerr << "usage: hf_layer MODEL_DIR [LAYER] [REFERENCE]\n";
    return 2;
  }
  const std::string model_dir = argv[1];
  const int64_t layer = argc > 2 ? std::stoll(argv[2]) : 0;
  const bool causal =
      mha::hf::causal_attention(read_text(model_dir + "/config.json"));

  // The layer's attention with the checkpoint's weights, in float32.
  auto attn = mha::hf::load_attention(model_dir, layer);
  attn->to(torch::kFloat32);
  std::cout << "layer " << layer << " of " << model_dir << ": " << *attn
            << (causal ? ", causal" : ", bidirectional") << '\n';
  torch::NoGradGuard no_grad;

  // 1. A decoder's attention over 6 tokens at once equals the same tokens
  //    fed one at a time through a KV cache.
  const int64_t E = attn->options.embed_dim();
  torch::manual_seed(0);
  const auto x = torch::randn({1, 6, E});  // (N, L, E)
  const auto full = std::get<0>(attn->forward(
      x, {}, {}, {}, /*need_weights=*/false, {}, /*average_attn_weights=*/true,
      /*is_causal=*/causal));  // (N, L, E)
  std::cout << "output of 6 random tokens: mean " << full.mean().item<double>()
            << ", std " << full.std().item<double>() << '\n';
  if (causal) {
    auto cache = attn->make_kv_cache(/*batch_size=*/1, /*capacity=*/6);
    std::vector<torch::Tensor> steps;
    for (int64_t t = 0; t < 6; ++t) {
      steps.push_back(std::get<0>(
          attn->forward_cached(x.narrow(1, t, 1), cache)));  // (N, 1, E)
    }
    const double err = (torch::cat(steps, 1) - full).abs().max().item<double>();
    std::cout << "cached decoding vs full forward: max abs " << err << '\n';
    check(err < 1e-5,
          "token-by-token decoding through the KV cache equals "
          "the full causal forward");
  }

  // 2. The output transformers recorded for this layer.
  if (argc > 3) {
    const auto ref = mha::read_state_dict(argv[3]);
    const auto hidden = ref["hidden_states"];  // (N, L, E)
    const int64_t N = hidden.size(0), L = hidden.size(1);
    // attention_mask: 1 = token (Hugging Face); mha wants true = padding.
    const auto keep = ref.contains("attention_mask")
                          ? ref["attention_mask"] != 0
                          : torch::ones({N, L}, torch::kBool);  // (N, L)
    const auto positions = ref.contains("position_ids")
                               ? ref["position_ids"].to(torch::kLong)
                               : torch::Tensor();  // (N, L)
    const bool padded = !keep.all().item<bool>();
    const auto out = std::get<0>(
        attn->forward(hidden.to(torch::kFloat32), {}, {},
                      padded ? mha::from_keep_mask(keep) : torch::Tensor(),
                      /*need_weights=*/false, {}, /*average_attn_weights=*/true,
                      /*is_causal=*/causal, positions));  // (N, L, E)
    // Padding rows carry no meaning: compare the tokens only.
    const auto diff =
        (out - ref["output"].to(torch::kFloat32)).abs() * keep.unsqueeze(-1);
    const double err = diff.max().item<double>();
    std::cout << "output vs transformers (" << keep.sum().item<int64_t>()
              << " tokens): max abs " << err << '\n';
    check(err < 1e-4,
          "the layer's output equals the recorded transformers "
          "output");
  }

  std::cout << (failures == 0 ? "hf_layer: all checks passed\n"
                              : "hf_layer: a check failed\n");
  return failures == 0 ? 0 : 1;
}

// Example: self-attention over a padded batch with a causal mask, checked
// against torch::nn::MultiheadAttention with the same weights, and the
// weights of one sequence drawn as a heatmap SVG (one panel per head).
//
// Usage: attention_masks [heatmap.svg]   (default: attention.svg)
// Exits 1 when a check fails.
//
// Glossary: N batch, L query length, S key length (= L here), E embed_dim,
// H num_heads.
#include <mha/mha.h>

#include <cmath>
#include <fstream>
#include <iostream>
#include <iterator>
#include <string>

namespace {

int failures = 0;

void check(bool ok, const std::string& what) {
  std::cout << (ok ? "ok:     " : "FAILED: ") << what << '\n';
  failures += ok ? 0 : 1;
}

std::size_t count_of(const std::string& text, const std::string& needle) {
  std::size_t count = 0;
  for (auto at = text.find(needle); at != std::string::npos;
       at = text.find(needle, at + needle.size())) {
    ++count;
  }
  return count;
}

}  // namespace

int main(int argc, char** argv) {
  const std::string svg_path = argc > 1 ? argv[1] : "attention.svg";
  torch::manual_seed(0);
  constexpr int64_t N = 2, L = 5, E = 16, H = 4;
  mha::MultiHeadAttention attn(mha::MultiHeadAttentionOptions(E, H));
  attn->eval();

  // Sequence 0 has 5 tokens, sequence 1 has 3 followed by 2 pads.
  // key_padding_mask: true = padding (blocked), as torch::nn.
  const auto lengths = torch::tensor({5, 3});
  const auto key_padding_mask =
      torch::arange(L).unsqueeze(0) >= lengths.unsqueeze(1);  // (N, S) bool
  const auto x = torch::randn({N, L, E});                     // (N, L, E)

  // is_causal: query i sees keys j <= i. Per-head weights (N, H, L, S).
  torch::NoGradGuard no_grad;
  auto [out, weights] = attn->forward(x, {}, {}, key_padding_mask,
                                      /*need_weights=*/true, /*attn_mask=*/{},
                                      /*average_attn_weights=*/false,
                                      /*is_causal=*/true);

  // 1. Every blocked position (causal or padding) has weight exactly 0 and
  //    every row sums to 1 (no row is fully masked: key 0 is always open).
  const auto blocked = mha::causal_mask(L, L).unsqueeze(0) |
                       key_padding_mask.unsqueeze(1);  // (N, L, S)
  const auto blocked_per_head = blocked.unsqueeze(1).expand_as(weights);
  check(weights.masked_select(blocked_per_head).abs().max().item<float>() == 0,
        "weights are 0 at every padded or future key");
  check(torch::allclose(weights.sum(-1), torch::ones({N, H, L}), 0, 1e-5),
        "each query's weights sum to 1");

  // 2. The same weights in torch::nn::MultiheadAttention (sequence-first;
  //    its attn_mask given as a float -inf mask: LibTorch 1.13 adds a bool
  //    attn_mask as 0/1 instead of blocking).
  torch::nn::MultiheadAttention reference(
      torch::nn::MultiheadAttentionOptions(E, H));
  reference->eval();
  mha::copy_weights(attn, reference);
  const auto float_causal =
      torch::zeros({L, L}).masked_fill(mha::causal_mask(L, L), -INFINITY);
  const auto xt = x.transpose(0, 1);  // (L, N, E)
  auto [ref_out, ref_weights] =
      reference(xt, xt, xt, key_padding_mask, /*need_weights=*/true,
                float_causal);  // (L, N, E), (N, L, S) averaged over heads
  const double out_err =
      (out - ref_out.transpose(0, 1)).abs().max().item<double>();
  const double w_err =
      (weights.mean(1) - ref_weights).abs().max().item<double>();
  std::cout << "max abs difference to torch::nn: output " << out_err
            << ", weights " << w_err << '\n';
  check(out_err < 1e-5 && w_err < 1e-6,
        "output and weights equal torch::nn::MultiheadAttention's");

  // 3. The heatmap of sequence 1: one panel per head, blocked cells hatched.
  mha::plot::HeatmapOptions options;
  options.row_labels = {"The", "cat", "sat", "<pad>", "<pad>"};
  options.col_labels = options.row_labels;
  options.title = "causal + padding, sequence 1";
  mha::plot::write_heatmap_svg(weights[1], svg_path, options);  // (H, L, S)
  std::ifstream in(svg_path);
  const std::string svg((std::istreambuf_iterator<char>(in)),
                        std::istreambuf_iterator<char>());
  const auto masked_cells = count_of(svg, "class=\"cell masked\"");
  const auto expected =
      static_cast<std::size_t>(H * blocked[1].sum().item<int64_t>());
  std::cout << "wrote " << svg_path << ": " << masked_cells
            << " hatched cells\n";
  check(masked_cells == expected, "the heatmap hatches exactly the " +
                                      std::to_string(expected) +
                                      " blocked cells");
  std::cout << mha::plot::heatmap_text(weights[1][0]);

  std::cout << (failures == 0 ? "attention_masks: all checks passed\n"
                              : "attention_masks: a check failed\n");
  return failures == 0 ? 0 : 1;
}

// The module's input side (module_inputs.h): the checks of forward's and
// the projected-key/value methods' arguments, the batch-first layout, the
// mask's 4-D view and the input projection.
//
// Glossary: N batch, L target (query) length, S source (key) length, E
// embed_dim, H num_heads, D head_dim = E / H, Hkv num_kv_heads, Ekv = Hkv·D,
// T any length.
#include "modules/module_inputs.h"

#include <cstring>

#include "core/attention_core.h"
#include "core/blas_gemm.h"
#include "core/blocked_attention.h"
#include "mha/masks.h"
#include "modules/projection.h"

namespace mha::detail {

namespace {

/// Outputs of at most this many elements get their bias rows copied on the
/// calling thread; larger ones by ATen's parallel copy, as in addmm.
/// Measured (2 threads, OMP_WAIT_POLICY=PASSIVE, LibTorch 1.13): a
/// 256 x 768 output 15 µs on this thread against 18 µs in parallel (plus,
/// after an idle spell, the wake-up of ATen's other thread); 2048 x 1536
/// 585 against 407 µs, 8192 x 768 1066 against 665 µs.
constexpr int64_t kCopyHereElements = int64_t{1} << 20;

/// Copies the bias b (F') into every row of y (rows, F') (contiguous rows).
void copy_bias_rows(const torch::Tensor& b, const torch::Tensor& y) {
  const auto row_bytes = static_cast<size_t>(y.size(1) * y.element_size());
  const auto* bias = static_cast<const char*>(b.data_ptr());
  auto* row = static_cast<char*>(y.data_ptr());
  for (int64_t r = 0; row_bytes > 0 && r < y.size(0); ++r, row += row_bytes) {
    std::memcpy(row, bias, row_bytes);
  }
}

/// The rows of a product of `rows` rows that one oneDNN call computes
/// (onednn_product): an even number of chunks (two threads share them evenly)
/// of at most about 512 rows, multiples of 8. A function of the row count
/// alone, never of the threads. Measured (scratch programs, 2 threads,
/// PASSIVE, float32, medians of 9; LibTorch 1.13 / 2.14):
/// 4096 x 512 x 1536, the in-projection at (4, 1024, 512, 8), took 18.6 /
/// 18.5 ms in chunks of 512 rows, 19.3 / 19.3 in 256 and 23.8 / 22.3 in
/// 64, against 32.4 / 33.6 in at::addmm; 256 x 256 x 768 0.38 / 0.39 ms in
/// two chunks of 128 against 0.53 / 0.52 in one; the weight gradient's
/// 1536 x 4096 x 512 16.6 ms in chunks of 256 rows, 20.9 in 512 (three
/// chunks for two threads: 1.13).
int64_t onednn_chunk_rows(int64_t rows) {
  constexpr int64_t kMostRows = 512;
  const int64_t chunks = (rows + kMostRows - 1) / kMostRows;
  const int64_t even = std::max<int64_t>(2, (chunks + 1) / 2 * 2);
  const int64_t per_chunk = (rows + even - 1) / even;
  return std::max<int64_t>(8, (per_chunk + 7) / 8 * 8);
}

/// Rows [start, start + count) of m.
StridedMatrix matrix_rows(StridedMatrix m, int64_t start, int64_t count) {
  m.data = static_cast<float*>(m.data) + start * m.row_stride;
  m.rows = count;
  return m;
}

/// A new contiguous c (m, n) = a (m, k) · b (k, n) + bias (n) (or without
/// it where bias is undefined), of `options` (float32, CPU; a and b its
/// memory), through oneDNN's dnnl_sgemm: in chunks of onednn_chunk_rows(m)
/// rows of a and c, one single-threaded call each (for_each_item; the bias
/// rows copied into each chunk first), spread over OpenBLAS's threads where
/// the blocked core's items run there (openblas_item_threads), else over
/// ATen's. Each chunk's shape, and so every value's rounding, is a function
/// of m, k and n: the result does not depend on the thread count. Returns
/// an undefined tensor, with nothing allocated, where the dtype is not
/// float32, oneDNN cannot be held to one thread per call
/// (onednn_products_available) or does not take the layout.
///
/// Why: the projections were at::addmm's calls, OpenBLAS's product, while
/// oneDNN's runs 1.7-2x faster on the modules' shapes on this machine
/// (measured at onednn_chunk_rows); its rows round differently (a
/// different order of the k products), within float32's rounding of
/// addmm's. OpenBLAS's threads over ATen's: mha-bench, 1.13, 2 threads,
/// PASSIVE, two alternating rounds of 9 repetitions: (4, 1024, 512, 8)
/// forward+backward 199.9 / 207.7 ms against 260.6 / 257.3 on ATen's
/// (245.6 with addmm), inference 57.9 / 52.8 against 68.4 / 56.3 (73.9);
/// (1, 8192, 256, 4) forward+backward 1086 / 1039 against 1163 / 1114
/// (1219), inference 252 / 265 against 280 / 284 (280).
torch::Tensor onednn_product(const StridedMatrix& a, const StridedMatrix& b,
                             const torch::Tensor& bias,
                             const torch::TensorOptions& options) {
  const int64_t m = a.rows, n = b.cols;
  if (m == 0 || options.dtype() != torch::kFloat32 ||
      !onednn_products_available()) {
    return {};
  }
  const int64_t chunk = onednn_chunk_rows(m);
  const int64_t chunks = (m + chunk - 1) / chunk;
  const int64_t last = m - (chunks - 1) * chunk;
  // The layout of c's first rows: the checks read no memory.
  const auto c_rows = [n](int64_t count) {
    return StridedMatrix{nullptr, count, n, n, 1};
  };
  if (!onednn_gemm_takes(matrix_rows(a, 0, std::min(chunk, m)), b,
                         c_rows(std::min(chunk, m))) ||
      !onednn_gemm_takes(matrix_rows(a, 0, last), b, c_rows(last))) {
    return {};
  }
  auto c = at::empty({m, n}, options);
  const auto cm = matrix_of(c);
  for_each_item(
      chunks, 0, c.options(),
      [&](int64_t i, torch::Tensor&) {
        const int64_t start = i * chunk, count = std::min(chunk, m - start);
        if (bias.defined()) {
          copy_bias_rows(bias, c.narrow(0, start, count));
        }
        onednn_gemm_matrix(matrix_rows(a, start, count), b, 1,
                           bias.defined() ? 1 : 0,
                           matrix_rows(cm, start, count));
      },
      openblas_item_threads() >= 2 ? ItemThreads::kOpenBlas
                                   : ItemThreads::kAten,
      /*one_omp_thread=*/true);
  return c;
}

/// y (rows, F') = x2d (rows, F) · wᵀ + b: through oneDNN in fixed chunks of
/// rows where onednn_product takes it (float32), else as at::addmm(b, x2d,
/// w.t()), with the bias rows copied first (on this thread when small);
/// records no gradient itself (ProjectionFunction does that).
torch::Tensor addmm_rows(const torch::Tensor& x2d, const torch::Tensor& w,
                         const torch::Tensor& b) {
  if (auto y =
          onednn_product(matrix_of(x2d), matrix_of(w).t(), b, x2d.options());
      y.defined()) {
    return y;
  }
  if (!b.defined()) {
    return at::mm(x2d, w.t());
  }
  auto y = at::empty({x2d.size(0), w.size(0)}, x2d.options());
  if (y.numel() > kCopyHereElements) {
    y.copy_(b.expand_as(y));  // ATen's parallel copy, as addmm's
  } else {
    copy_bias_rows(b, y);
  }
  gemm_matrix(y.scalar_type(), matrix_of(x2d), matrix_of(w).t(), 1,
              /*beta=*/1, matrix_of(y));
  return y;
}

/// addmm_rows under autograd: forward as addmm_rows, backward the gradients
/// of AddmmBackward0 (PyTorch's tools/autograd/derivatives.yaml, addmm with
/// beta = alpha = 1, and FunctionsManual.cpp's mm_mat1_backward /
/// mm_mat2_backward): x2d's gradient grad · w and w's gradᵀ · x2d through
/// onednn_product where it takes them (float32, first derivatives), else the
/// same at::mm calls on the same layouts; b's summed as the autograd engine
/// sums a broadcast input's (at::sum_to). Where oneDNN is not used
/// (float64, no oneDNN, create_graph), every gradient is addmm's bit for
/// bit, and like addmm's may change with OpenBLAS's thread count (measured:
/// float64 at 1 and 3 threads, in the last bits).
class ProjectionFunction
    : public torch::autograd::Function<ProjectionFunction> {
 public:
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx,
                               const torch::Tensor& x2d, const torch::Tensor& w,
                               const torch::Tensor& b, bool has_bias) {
    // Without a bias b is a stand-in (autograd functions take no undefined
    // tensor in 1.13) that gets no gradient.
    ctx->save_for_backward({x2d, w});
    return addmm_rows(x2d, w, has_bias ? b : torch::Tensor());
  }

  static torch::autograd::variable_list backward(
      torch::autograd::AutogradContext* ctx,
      torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto &x2d = saved[0], &w = saved[1];
    const auto& grad = grads[0];  // (rows, F')
    torch::Tensor grad_x, grad_w, grad_b;
    // The layout test both mm_*_backward functions make on the operand
    // whose gradient they compute.
    const auto column_major = [](const torch::Tensor& m) {
      return m.stride(0) == 1 && m.stride(1) == m.size(0);
    };
    if (ctx->needs_input_grad(0)) {
      // Under create_graph (grad mode on here) the product must be
      // recorded for a second derivative: at::mm's.
      if (!torch::GradMode::is_enabled()) {
        grad_x =
            onednn_product(matrix_of(grad), matrix_of(w), {}, grad.options());
      }
      if (!grad_x.defined()) {
        // mm_mat1_backward with mat2 = wᵀ: a column-major x2d (one row of
        // one feature) takes the transposed product.
        grad_x = column_major(x2d) ? w.t().mm(grad.t()).t() : grad.mm(w);
      }
    }
    if (ctx->needs_input_grad(1)) {
      if (!torch::GradMode::is_enabled()) {
        grad_w = onednn_product(matrix_of(grad).t(), matrix_of(x2d), {},
                                grad.options());
      }
      if (!grad_w.defined()) {
        // mm_mat2_backward with mat2 = wᵀ, column-major when w is row-major
        // (a module's weight): (gradᵀ · x2d)ᵀ, else x2dᵀ · grad; either
        // transposed back by wᵀ's own backward.
        grad_w = column_major(w.t()) ? grad.t().mm(x2d) : x2d.t().mm(grad).t();
      }
    }
    if (ctx->needs_input_grad(2)) {
      grad_b = at::sum_to(grad, at::IntArrayRef{grad.size(1)});
    }
    return {grad_x, grad_w, grad_b, torch::Tensor()};
  }
};

}  // namespace

torch::Tensor project(const torch::Tensor& x, const torch::Tensor& w,
                      const torch::Tensor& b) {
  if (x.dim() != 3) {
    return torch::nn::functional::linear(x, w, b);
  }
  if (!x.is_contiguous() && x.transpose(0, 1).is_contiguous()) {
    return project(x.transpose(0, 1), w, b).transpose(0, 1);
  }
  const auto rows = x.size(0) * x.size(1);
  auto x2d = x.reshape({rows, x.size(2)});  // (N·T, F), a view if contiguous
  const bool records_grad = torch::GradMode::is_enabled() &&
                            (x.requires_grad() || w.requires_grad() ||
                             (b.defined() && b.requires_grad()));
  torch::Tensor y;
  const bool bias_ok =
      !b.defined() ||
      (b.device().is_cpu() && b.dim() == 1 && b.is_contiguous() &&
       b.size(0) == w.size(0) && b.scalar_type() == x.scalar_type());
  if (x.device().is_cpu() && w.device().is_cpu() && w.dim() == 2 &&
      w.size(1) == x.size(2) && w.scalar_type() == x.scalar_type() && bias_ok &&
      direct_gemm_available(x.scalar_type())) {
    // Anything else (other devices, dtypes or shapes, which addmm reports)
    // takes at::addmm (at::mm without a bias).
    y = !records_grad ? addmm_rows(x2d, w, b)
        : b.defined() ? ProjectionFunction::apply(x2d, w, b, true)
                      : ProjectionFunction::apply(
                            x2d, w, at::empty({0}, x2d.options()), false);
  } else {
    y = b.defined() ? at::addmm(b, x2d, w.t()) : at::mm(x2d, w.t());
  }
  return y.view({x.size(0), x.size(1), w.size(0)});  // (N, T, F')
}

/// (N, T, E) → (N, H, T, D).
torch::Tensor split_heads(const torch::Tensor& x, int64_t num_heads) {
  const auto N = x.size(0);
  const auto T = x.size(1);
  return x.view({N, T, num_heads, -1}).transpose(1, 2);  // (N, H, T, D)
}

/// Rows [start, start + count) of t, or t itself when undefined (no bias).
torch::Tensor rows_of(const torch::Tensor& t, int64_t start, int64_t count) {
  return t.defined() ? t.narrow(0, start, count) : t;
}

/// Checks the inputs of forward and brings them to (N, T, features).
BatchFirstInputs to_batch_first(const MultiHeadAttentionImpl& m,
                                const torch::Tensor& query,
                                const torch::Tensor& key_in,
                                const torch::Tensor& value_in,
                                const torch::Tensor& key_padding_mask) {
  const int64_t E = m.options.embed_dim();
  TORCH_CHECK(query.defined(), "MultiHeadAttention: query is undefined");
  TORCH_CHECK(key_in.defined() == value_in.defined(),
              "MultiHeadAttention: key and value must both be given (cross-"
              "attention) or both be undefined (self-attention), but got ",
              key_in.defined() ? "key without value" : "value without key");
  const bool self_attention = !key_in.defined();
  const auto& key = self_attention ? query : key_in;
  const auto& value = self_attention ? query : value_in;
  const char* layout = m.options.batch_first() ? "(N, L, E)" : "(L, N, E)";
  TORCH_CHECK(query.dim() == 3 || query.dim() == 2,
              "MultiHeadAttention: query must be ", layout,
              " batched or (L, E) unbatched, but got ", query.sizes());
  TORCH_CHECK(key.dim() == query.dim() && value.dim() == query.dim(),
              "MultiHeadAttention: key and value must have query's ",
              query.dim(), " dims, but got key ", key.sizes(), " and value ",
              value.sizes());
  TORCH_CHECK(query.size(-1) == E,
              "MultiHeadAttention: query must have embed_dim = ", E,
              " features in its last dim, but got ", query.sizes());
  TORCH_CHECK(key.size(-1) == m.kdim(),
              "MultiHeadAttention: key must have kdim = ", m.kdim(),
              " features in its last dim, but got ", key.sizes(),
              self_attention ? " (key is the query: self-attention needs "
                               "kdim == embed_dim)"
                             : "");
  TORCH_CHECK(value.size(-1) == m.vdim(),
              "MultiHeadAttention: value must have vdim = ", m.vdim(),
              " features in its last dim, but got ", value.sizes(),
              self_attention ? " (value is the query: self-attention needs "
                               "vdim == embed_dim)"
                             : "");
  const auto dtype = query.scalar_type();
  TORCH_CHECK(torch::isFloatingType(dtype),
              "MultiHeadAttention: query must be floating, but got dtype ",
              dtype);
  const auto param_dtype = m.out_proj->weight.scalar_type();
  TORCH_CHECK(dtype == param_dtype,
              "MultiHeadAttention: query must have the "
              "parameters' dtype ",
              param_dtype, ", but got dtype ", dtype);
  TORCH_CHECK(key.scalar_type() == dtype && value.scalar_type() == dtype,
              "MultiHeadAttention: key and value must have query's dtype ",
              dtype, ", but got key ", key.scalar_type(), " and value ",
              value.scalar_type());
  const auto device = query.device();
  TORCH_CHECK(device == m.out_proj->weight.device(),
              "MultiHeadAttention: query must be on the parameters' device ",
              m.out_proj->weight.device(), ", but got device ", device);
  TORCH_CHECK(key.device() == device && value.device() == device,
              "MultiHeadAttention: key and value must be on query's device ",
              device, ", but got key on ", key.device(), " and value on ",
              value.device());

  BatchFirstInputs in;
  in.batched = query.dim() == 3;
  if (!in.batched) {
    in.query = query.unsqueeze(0);  // (1, L, E)
    in.key = key.unsqueeze(0);      // (1, S, kdim)
    in.value = value.unsqueeze(0);  // (1, S, vdim)
  } else if (m.options.batch_first()) {
    in.query = query;
    in.key = key;
    in.value = value;
  } else {
    in.query = query.transpose(0, 1);  // (L, N, E) → (N, L, E)
    in.key = key.transpose(0, 1);      // (N, S, kdim)
    in.value = value.transpose(0, 1);  // (N, S, vdim)
  }
  const auto N = in.query.size(0);
  const auto S = in.key.size(1);
  TORCH_CHECK(in.key.size(0) == N && in.value.size(0) == N,
              "MultiHeadAttention: key and value must have query's batch size "
              "N = ",
              N, ", but got query ", query.sizes(), ", key ", key.sizes(),
              ", value ", value.sizes());
  TORCH_CHECK(in.value.size(1) == S,
              "MultiHeadAttention: value must have key's length S = ", S,
              ", but got key ", key.sizes(), " and value ", value.sizes());

  check_mask(key_padding_mask, "key_padding_mask", dtype, device);
  if (key_padding_mask.defined()) {
    if (in.batched) {
      TORCH_CHECK(key_padding_mask.dim() == 2 &&
                      key_padding_mask.size(0) == N &&
                      key_padding_mask.size(1) == S,
                  "key_padding_mask must be (N, S) = (", N, ", ", S,
                  "), but got ", key_padding_mask.sizes());
      in.key_padding_mask = key_padding_mask;
    } else {
      TORCH_CHECK(key_padding_mask.dim() == 1 && key_padding_mask.size(0) == S,
                  "key_padding_mask must be (S) = (", S,
                  ") for unbatched input, but got ", key_padding_mask.sizes());
      in.key_padding_mask = key_padding_mask.unsqueeze(0);  // (1, S)
    }
  }
  return in;
}

/// Checks attn_mask and views it as (L, S) or (N, H, L, S).
torch::Tensor attn_mask_4d(const torch::Tensor& attn_mask, int64_t N, int64_t H,
                           int64_t L, int64_t S, bool batched,
                           torch::ScalarType dtype,
                           const torch::Device& device) {
  if (!attn_mask.defined()) {
    return attn_mask;
  }
  check_mask(attn_mask, "attn_mask", dtype, device);
  if (attn_mask.dim() == 2) {
    TORCH_CHECK(attn_mask.size(0) == L && attn_mask.size(1) == S,
                "attn_mask must be (L, S) = (", L, ", ", S, ") or (",
                batched ? "N*num_heads" : "num_heads", ", L, S) = (",
                batched ? N * H : H, ", ", L, ", ", S, "), but got ",
                attn_mask.sizes());
    return attn_mask;  // (L, S)
  }
  TORCH_CHECK(attn_mask.dim() == 3 && attn_mask.size(0) == N * H &&
                  attn_mask.size(1) == L && attn_mask.size(2) == S,
              "attn_mask must be (L, S) = (", L, ", ", S, ") or (",
              batched ? "N*num_heads" : "num_heads", ", L, S) = (", N * H, ", ",
              L, ", ", S, "), but got ", attn_mask.sizes());
  return attn_mask.view({N, H, L, S});  // (N, H, L, S)
}

/// The input projection: one GEMM for self-attention, two when key is value.
Projected project_inputs(const MultiHeadAttentionImpl& m,
                         const torch::Tensor& query, const torch::Tensor& key,
                         const torch::Tensor& value, bool self_attention,
                         bool key_is_value) {
  const int64_t E = m.options.embed_dim();
  const auto& b = m.in_proj_bias;
  if (!m.packed_in_proj()) {
    // in_proj_bias rows: query [0, Eq), key [Eq, Eq + Ekv), value
    // [Eq + Ekv, ...); Eq = H·D (2·H·D with output_gate)
    const int64_t Eq = m.q_proj_weight.size(0);
    const int64_t Ekv = m.num_kv_heads() * m.head_dim;
    return {detail::project(query, m.q_proj_weight, rows_of(b, 0, Eq)),
            detail::project(key, m.k_proj_weight, rows_of(b, Eq, Ekv)),
            detail::project(value, m.v_proj_weight, rows_of(b, Eq + Ekv, Ekv)),
            torch::Tensor()};
  }
  const auto& w = m.in_proj_weight;
  if (self_attention) {
    auto qkv = detail::project(query, w, b);  // (N, L, 3E)
    auto parts = qkv.chunk(3, /*dim=*/-1);
    return {parts[0], parts[1], parts[2], qkv};  // (N, L, E) each
  }
  auto q =
      detail::project(query, rows_of(w, 0, E), rows_of(b, 0, E));  // (N, L, E)
  if (key_is_value) {
    auto kv = detail::project(key, rows_of(w, E, 2 * E),
                              rows_of(b, E, 2 * E));  // (N, S, 2E)
    auto parts = kv.chunk(2, /*dim=*/-1);
    return {q, parts[0], parts[1], torch::Tensor()};
  }
  return {q, detail::project(key, rows_of(w, E, E), rows_of(b, E, E)),
          detail::project(value, rows_of(w, 2 * E, E), rows_of(b, 2 * E, E)),
          torch::Tensor()};
}

/// project_key_value and forward_projected take no option that places keys
/// at positions or appends key rows.
void check_projectable(const MultiHeadAttentionImpl& m, const char* caller) {
  const auto& o = m.options;
  const char* option = o.add_bias_kv()     ? "add_bias_kv"
                       : o.add_zero_attn() ? "add_zero_attn"
                       : o.rotary()        ? "rotary"
                       : o.window()        ? "window"
                       : o.position_bias() != PositionBias::kNone
                           ? "position_bias"
                       : o.qk_norm() != QKNorm::kNone ? "qk_norm"
                       : o.attention_sinks()          ? "attention_sinks"
                       : o.output_gate()              ? "output_gate"
                       : o.attention_chunk_size()     ? "attention_chunk_size"
                       : o.attn_temperature_tuning() ? "attn_temperature_tuning"
                                                     : nullptr;
  TORCH_CHECK(option == nullptr, "MultiHeadAttention::", caller,
              ": the option ", option,
              " is not supported (it gives keys positions or extra rows)");
}

torch::Tensor sequence_input(const torch::Tensor& x, int64_t embed_dim,
                             bool batch_first, const torch::Tensor& weight,
                             const char* who) {
  TORCH_CHECK(x.defined() && x.dim() == 3 && x.size(2) == embed_dim, who,
              ": x must be ", batch_first ? "(N, L, E)" : "(L, N, E)",
              " with E = ", embed_dim, ", but got ",
              x.defined() ? x.sizes() : c10::IntArrayRef{});
  TORCH_CHECK(
      x.scalar_type() == weight.scalar_type() && x.device() == weight.device(),
      who, ": x must have the parameters' dtype ", weight.scalar_type(),
      " and device ", weight.device(), ", but has ", x.scalar_type(), " on ",
      x.device());
  return batch_first ? x : x.transpose(0, 1);
}

/// x (N, T, F) in the module's layout ((T, N, F) if !batch_first, (T, F)
/// unbatched) as (N, T, F), after the checks of forward for `name`.
torch::Tensor batch_first_input(const MultiHeadAttentionImpl& m,
                                const torch::Tensor& x, const char* name,
                                int64_t features, const char* feature_name) {
  TORCH_CHECK(x.defined(), "MultiHeadAttention: ", name, " is undefined");
  const char* layout = m.options.batch_first() ? "(N, T, " : "(T, N, ";
  TORCH_CHECK((x.dim() == 3 || x.dim() == 2) && x.size(-1) == features,
              "MultiHeadAttention: ", name, " must be ", layout, feature_name,
              ") batched or (T, ", feature_name, ") unbatched with ",
              feature_name, " = ", features, ", but got ", x.sizes());
  const auto& weight = m.out_proj->weight;
  TORCH_CHECK(x.scalar_type() == weight.scalar_type(),
              "MultiHeadAttention: ", name, " must have the parameters' dtype ",
              weight.scalar_type(), ", but got dtype ", x.scalar_type());
  TORCH_CHECK(x.device() == weight.device(), "MultiHeadAttention: ", name,
              " must be on the parameters' device ", weight.device(),
              ", but got device ", x.device());
  if (x.dim() == 2) {
    return x.unsqueeze(0);  // (1, T, F)
  }
  return m.options.batch_first() ? x : x.transpose(0, 1);  // (N, T, F)
}

}  // namespace mha::detail

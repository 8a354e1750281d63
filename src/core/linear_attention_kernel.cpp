// The causal form of linear attention on the CPU (core/linear_attention_core.h:
// causal_products): one item per head on mha's threads, each walking its
// sequence block by block with its running sums in that thread's scratch,
// every product a direct gemm call (core/blas_gemm.h); its backward is three
// more walks of the same kind (two of them from the end).
//
// Why: the ATen form (every block's sums and (C, C) products as batched
// tensors, groups of 16 blocks one after another) made whole-sequence
// temporaries and an elementwise pass over them per step. Here a head's
// temporaries are its (Fa, Fc) sums and one (C, C) block of products,
// kept in the cache from block to block. Side by side at (1, 4, L, 64),
// elu features (LibTorch 1.13, 2 threads): forward 8.8 against 41.6 ms at
// L = 8k, 18.4 against 83.9 at 16k; forward+backward 33 against 254 and
// 64 against 297 (docs/linear.md).
//
// Glossary: N leading items (batch x heads), T rows, C block length,
// B = ceil(T / C) blocks, Fa the features of a and b, Fc those of c.
#include <torch/torch.h>

#include <algorithm>
#include <cstdint>

#include "core/attention_core.h"  // for_each_item
#include "core/blas_gemm.h"
#include "core/linear_attention_core.h"

namespace mha::detail {
namespace {

/// The state (rows x cols, row-major) times the decay factors f: along its
/// rows (row i times f[i]) or its columns (column j times f[j]).
template <typename scalar_t>
void decay_state(scalar_t* state, int64_t rows, int64_t cols, const scalar_t* f,
                 bool along_rows) {
  for (int64_t i = 0; i < rows; ++i) {
    scalar_t* row = state + i * cols;
    if (along_rows) {
      const scalar_t x = f[i];
      for (int64_t j = 0; j < cols; ++j) {
        row[j] *= x;
      }
    } else {
      for (int64_t j = 0; j < cols; ++j) {
        row[j] *= f[j];
      }
    }
  }
}

/// Zeroes the products a row may not see in an (n, n) row-major block:
/// forward, row i sees columns j <= i; reverse, j >= i.
template <typename scalar_t>
void mask_block(scalar_t* w, int64_t n, bool reverse) {
  for (int64_t i = 0; i < n; ++i) {
    scalar_t* row = w + i * n;
    if (reverse) {
      std::fill(row, row + i, scalar_t(0));
    } else {
      std::fill(row + i + 1, row + n, scalar_t(0));
    }
  }
}

/// Row-major matrix `rows` x x.size(2) of item n of x (N, T, X) from row r0
/// (unit stride along X).
template <typename scalar_t>
StridedMatrix rows_of(const torch::Tensor& x, int64_t n, int64_t r0,
                      int64_t rows) {
  auto* data = x.data_ptr<scalar_t>() + n * x.stride(0) + r0 * x.stride(1);
  return {data, rows, x.size(2), x.stride(1), 1};
}

/// One item's walk (see causal_products): `state` (Fa x Fc, holding the
/// starting sums), `w` (C x C) and `o` (C x Fc, for normalize) from the
/// thread's scratch.
template <typename scalar_t>
void walk_item(const CausalProducts& p, int64_t n, scalar_t* state, scalar_t* w,
               scalar_t* o, const torch::Tensor& out,
               const torch::Tensor& den) {
  const auto dtype = p.a.scalar_type();
  const int64_t T = p.a.size(1), Fa = p.a.size(2), Fc = p.c.size(2);
  const int64_t C = p.block, B = (T + C - 1) / C;
  const int64_t Fd = p.decay_rows ? Fa : Fc;
  const scalar_t* decay =
      p.decay.defined() ? p.decay.data_ptr<scalar_t>() + n * B * Fd : nullptr;
  const StridedMatrix sums{state, Fa, Fc, Fc, 1};
  for (int64_t step = 0; step < B; ++step) {
    const int64_t blk = p.reverse ? B - 1 - step : step;
    const int64_t r0 = blk * C, rows = std::min(C, T - r0);
    if (decay != nullptr && !p.reverse) {
      // Forward: the sums of the blocks before blk, to blk's offsets.
      decay_state(state, Fa, Fc, decay + blk * Fd, p.decay_rows);
    }
    const auto a_blk = rows_of<scalar_t>(p.a, n, r0, rows);
    const auto b_blk = rows_of<scalar_t>(p.b, n, r0, rows);
    const auto c_blk = rows_of<scalar_t>(p.c, n, r0, rows);
    const auto o_blk = p.normalize ? StridedMatrix{o, rows, Fc, Fc, 1}
                                   : rows_of<scalar_t>(out, n, r0, rows);
    const StridedMatrix w_blk{w, rows, rows, rows, 1};
    // The other blocks through the sums, then the block's own rows.
    gemm_matrix(dtype, a_blk, sums, 1.0, 0.0, o_blk);
    gemm_matrix(dtype, a_blk, b_blk.t(), 1.0, 0.0, w_blk);
    mask_block(w, rows, p.reverse);
    gemm_matrix(dtype, w_blk, c_blk, 1.0, 1.0, o_blk);
    gemm_matrix(dtype, b_blk.t(), c_blk, 1.0, 1.0, sums);
    if (p.normalize) {
      // Each row over its last column, the denominator: 0 where it is 0
      // (a row that sees no key).
      auto* y = out.data_ptr<scalar_t>() + n * out.stride(0);
      auto* d = den.data_ptr<scalar_t>() + n * den.stride(0);
      for (int64_t i = 0; i < rows; ++i) {
        const scalar_t* row = o + i * Fc;
        scalar_t* y_row = y + (r0 + i) * out.stride(1);
        const scalar_t q = row[Fc - 1];
        d[r0 + i] = q;
        for (int64_t j = 0; j + 1 < Fc; ++j) {
          y_row[j] = q == scalar_t(0) ? scalar_t(0) : row[j] / q;
        }
      }
    }
    if (decay != nullptr && p.reverse && blk > 0) {
      // Reverse: the sums of blk and later blocks, to blk - 1's offsets.
      decay_state(state, Fa, Fc, decay + blk * Fd, p.decay_rows);
    }
  }
}

}  // namespace

void check_first_derivatives_only(const char* what) {
  TORCH_CHECK(!torch::GradMode::is_enabled(), what,
              " has first derivatives only; a backward with "
              "create_graph=true through it is not supported");
}

bool causal_products_apply(const torch::Tensor& x) {
  return x.device().is_cpu() && (x.scalar_type() == torch::kFloat32 ||
                                 x.scalar_type() == torch::kFloat64);
}

torch::Tensor causal_products(const CausalProducts& in,
                              torch::Tensor* state_out, torch::Tensor* den) {
  CausalProducts p = in;
  const auto unit_rows = [](const torch::Tensor& x) {
    return x.stride(-1) == 1 ? x : x.contiguous();
  };
  p.a = unit_rows(p.a);
  p.b = unit_rows(p.b);
  p.c = unit_rows(p.c);
  if (p.decay.defined()) {
    p.decay = p.decay.contiguous();
  }
  TORCH_INTERNAL_ASSERT(
      p.a.dim() == 3 && p.b.sizes() == p.a.sizes() && p.c.dim() == 3 &&
          p.c.size(0) == p.a.size(0) && p.c.size(1) == p.a.size(1) &&
          p.block >= 1 && causal_products_apply(p.a) &&
          p.b.scalar_type() == p.a.scalar_type() &&
          p.c.scalar_type() == p.a.scalar_type() &&
          p.normalize == (den != nullptr) && !(p.normalize && p.reverse),
      "causal_products: unaligned inputs");
  const int64_t N = p.a.size(0), T = p.a.size(1);
  const int64_t Fa = p.a.size(2), Fc = p.c.size(2);
  auto out = at::empty({N, T, p.normalize ? Fc - 1 : Fc}, p.a.options());
  if (p.normalize) {
    *den = at::empty({N, T}, p.a.options());
  }
  auto states = state_out != nullptr ? at::empty({N, Fa, Fc}, p.a.options())
                                     : torch::Tensor();
  const int64_t C = std::min(p.block, std::max<int64_t>(T, 1));
  p.block = C;
  const int64_t scratch = Fa * Fc + C * C + (p.normalize ? C * Fc : 0);
  for_each_item(
      N, scratch, p.a.options(), [&](int64_t n, torch::Tensor& space) {
        AT_DISPATCH_FLOATING_TYPES(p.a.scalar_type(), "causal_products", [&] {
          auto* state = space.data_ptr<scalar_t>();
          if (p.state_in.defined()) {
            const auto from = p.state_in[n].contiguous();
            std::copy_n(from.data_ptr<scalar_t>(), Fa * Fc, state);
          } else {
            std::fill_n(state, Fa * Fc, scalar_t(0));
          }
          if (T > 0) {
            auto* w = state + Fa * Fc;
            walk_item<scalar_t>(p, n, state, w, w + C * C, out,
                                p.normalize ? *den : torch::Tensor());
          }
          if (states.defined()) {
            std::copy_n(state, Fa * Fc, states[n].data_ptr<scalar_t>());
          }
        });
      });
  if (state_out != nullptr) {
    *state_out = states;
  }
  return out;
}

namespace {

/// The gradient of the walk's numerator and denominator (N, T, E + 1) from
/// that of the normalized rows y = num / den, g (N, T, E): g / den, and
/// -(g · y) / den last; 0 in rows whose denominator is 0 (their y is 0
/// whatever num is).
torch::Tensor products_gradient(const torch::Tensor& g_in,
                                const torch::Tensor& y,
                                const torch::Tensor& den) {
  const auto g = g_in.contiguous();
  const int64_t N = y.size(0), T = y.size(1), E = y.size(2);
  auto out = at::empty({N, T, E + 1}, y.options());  // (N, T, E + 1)
  AT_DISPATCH_FLOATING_TYPES(y.scalar_type(), "products_gradient", [&] {
    const auto* gp = g.data_ptr<scalar_t>();
    const auto* yp = y.data_ptr<scalar_t>();
    const auto* dp = den.data_ptr<scalar_t>();
    auto* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, N * T, 1024, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const scalar_t q = dp[r];
        scalar_t* o = op + r * (E + 1);
        if (q == scalar_t(0)) {
          std::fill_n(o, E + 1, scalar_t(0));
          continue;
        }
        const scalar_t* gr = gp + r * E;
        const scalar_t* yr = yp + r * E;
        scalar_t dot = 0;
        for (int64_t e = 0; e < E; ++e) {
          o[e] = gr[e] / q;
          dot += gr[e] * yr[e];
        }
        o[E] = -dot / q;
      }
    });
  });
  return out;
}

/// Autograd wrapper of causal linear attention's walk: y = num / den of
/// the forward causal_products(q, k, [v, 1]) (normalized in the walk),
/// and the sums after it, both differentiable (a segment's sums carry
/// gradients to the segment before it when training by segments). Backward
/// walks three times (CausalProducts' docstring has the equations); the
/// gradient of the sums after enters the two reverse walks as their
/// starting sums, and the walk for dv gives that of the starting sums as
/// its sums after. The decay factors are constants.
class CausalProductsFunction
    : public torch::autograd::Function<CausalProductsFunction> {
 public:
  static torch::autograd::variable_list forward(
      torch::autograd::AutogradContext* ctx, const torch::Tensor& q,
      const torch::Tensor& k, const torch::Tensor& v,
      const torch::Tensor& decay_or_empty,
      const torch::Tensor& state_in_or_empty, int64_t block) {
    const auto decay =
        decay_or_empty.numel() > 0 ? decay_or_empty : torch::Tensor();
    const auto state_in =
        state_in_or_empty.numel() > 0 ? state_in_or_empty : torch::Tensor();
    const int64_t N = q.size(0), T = v.size(-2), E = v.size(-1);
    auto v1 = at::empty({N, T, E + 1}, v.options());  // [v, 1]
    auto v1_sizes = v.sizes().vec();
    v1_sizes.back() = E + 1;
    v1.view(v1_sizes).narrow(-1, 0, E).copy_(v);
    v1.select(-1, E).fill_(1);
    torch::Tensor state, den;
    CausalProducts walk{q,
                        k,
                        v1,
                        decay,
                        /*decay_rows=*/true,
                        /*reverse=*/false,
                        block,
                        state_in};
    walk.normalize = true;
    auto y = causal_products(walk, &state, &den);  // (N, T, E)
    ctx->save_for_backward({q, k, v1, y, den});
    ctx->saved_data["decay"] = decay_or_empty;
    ctx->saved_data["state_in"] = state_in_or_empty;
    ctx->saved_data["block"] = block;
    ctx->saved_data["value_sizes"] = v.sizes();
    return {y, state};
  }

  static torch::autograd::variable_list backward(
      torch::autograd::AutogradContext* ctx,
      torch::autograd::variable_list grads) {
    // The walks below record nothing.
    check_first_derivatives_only(
        "linear attention: the causal form on the CPU (float32, float64)");
    const auto saved = ctx->get_saved_variables();
    const auto &q = saved[0], &k = saved[1], &v1 = saved[2];
    const auto tensor_of = [&](const char* name) {
      auto t = ctx->saved_data.at(name).toTensor();
      return t.numel() > 0 ? t : torch::Tensor();
    };
    const auto decay = tensor_of("decay");
    const auto state_in = tensor_of("state_in");
    const int64_t block = ctx->saved_data.at("block").toInt();
    const auto& y = saved[3];
    const int64_t N = y.size(0), T = y.size(1), E = y.size(2);
    // The gradient of the sums after the walk (N, F, E + 1), or none.
    const auto& g_state = grads[1];
    if (!grads[0].defined() && !g_state.defined()) {
      return {torch::Tensor(), torch::Tensor(), torch::Tensor(),
              torch::Tensor(), torch::Tensor(), torch::Tensor()};
    }
    // The gradient of [num, den] (N, T, E + 1).
    const auto g = grads[0].defined() ? products_gradient(grads[0], y, saved[4])
                                      : at::zeros({N, T, E + 1}, y.options());
    torch::Tensor dq, dk, dv, d_state_in;
    if (ctx->needs_input_grad(0)) {
      // dq_t = Σ_{j <= t} (g_t · v1_j) D(t, j) k_j, and g_t through the
      // starting sums: a forward walk with sums Σ v1 kᵀ (E + 1, F).
      dq = causal_products(
          {g, v1, k, decay, /*decay_rows=*/false, /*reverse=*/false, block,
           state_in.defined() ? state_in.transpose(1, 2) : torch::Tensor()},
          nullptr);
    }
    if (ctx->needs_input_grad(1)) {
      // dk_j = Σ_{t >= j} (v1_j · g_t) D(t, j) q_t + D(end, j) (G v1_j),
      // G the gradient of the sums after: from the end, starting from Gᵀ.
      dk = causal_products(
          {v1, g, q, decay, /*decay_rows=*/false,
           /*reverse=*/true, block,
           g_state.defined() ? g_state.transpose(1, 2) : torch::Tensor()},
          nullptr);
    }
    const bool state_grad = state_in.defined() && ctx->needs_input_grad(4);
    if (ctx->needs_input_grad(2) || state_grad) {
      // dv_j = Σ_{t >= j} (q_t · D(t, j) k_j) g_t + (D(end, j) k_j)ᵀ G over
      // v's E columns (v1's last is constant): from the end, starting from
      // G. Its sums after, Σ_t D(t, 0) q_t g_tᵀ + D(end, 0) G, times the
      // first block's decay, are the starting sums' gradient (all E + 1
      // columns: the walk takes g's last one only then).
      torch::Tensor walked;
      const auto columns = state_grad ? g : g.narrow(-1, 0, E);
      auto start = g_state;
      if (start.defined() && !state_grad) {
        start = start.narrow(-1, 0, E);
      }
      auto out =
          causal_products({k, q, columns, decay,
                           /*decay_rows=*/true, /*reverse=*/true, block, start},
                          state_grad ? &walked : nullptr);
      if (ctx->needs_input_grad(2)) {
        dv = out.narrow(-1, 0, E).reshape(
            ctx->saved_data.at("value_sizes").toIntVector());
      }
      if (state_grad) {
        d_state_in = decay.defined() ? walked * decay.select(1, 0).unsqueeze(-1)
                                     : walked;
      }
    }
    return {dq, dk, dv, torch::Tensor(), d_state_in, torch::Tensor()};
  }
};

}  // namespace

torch::Tensor causal_linear_products(const torch::Tensor& q,
                                     const torch::Tensor& k,
                                     const torch::Tensor& v,
                                     const torch::Tensor& decay,
                                     const torch::Tensor& state_in,
                                     int64_t block, torch::Tensor* state_out) {
  // Absent constants travel as empty tensors: LibTorch 1.13's
  // Function::apply needs every tensor argument defined.
  const auto none = at::empty({0}, q.options());
  auto outs = CausalProductsFunction::apply(
      q, k, v, decay.defined() ? decay : none,
      state_in.defined() ? state_in : none, block);
  if (state_out != nullptr) {
    *state_out = outs[1];
  }
  return outs[0];
}

}  // namespace mha::detail

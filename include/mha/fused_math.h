// Fused mods: the math a fused mod is written with (namespace mha::fused;
// the values are fused.h's, which includes this header). Each function takes
// any of the four families: numbers, packs, duals and tensors.
#pragma once

#include <torch/torch.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <type_traits>
#include <vector>

namespace mha::fused {

// ------------------------------------------------------ float32 lanes ---
/// \cond internal

/// The bits of x as another type of its width.
template <class To, class From>
inline To bits_as(From x) {
  static_assert(sizeof(To) == sizeof(From), "bits_as: widths differ");
  To r;
  std::memcpy(&r, &x, sizeof(To));
  return r;
}

/// e^x in float32 without a branch: Cody-Waite reduction x = n ln2 + r,
/// Cephes' expf polynomial for e^r, 2^n from the exponent bits; 0 below
/// -87.3 (-inf included), +inf above 88.7, NaN stays NaN.
inline float exp_lane(float x) {
  constexpr float kLowest = -87.33654f, kHighest = 88.72283f;
  constexpr float kRound = 12582912.0f;  // 1.5 * 2^23: adds round to nearest
  float y = x < kLowest ? kLowest : x;
  y = y > kHighest ? kHighest : y;
  const float n = (y * 1.44269504088896341f + kRound) - kRound;
  float r = y - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * (r * r) + (r + 1.0f);
  // 2^n as 2^(n - 1) * 2 for n > 0, so that n = 128 (x up to 88.72) does
  // not overflow the exponent bits.
  const int32_t half = n > 0.0f ? 1 : 0;
  const float two_n = bits_as<float>((static_cast<int32_t>(n) - half + 127) *
                                     (int32_t{1} << 23));
  const float e = p * two_n * (half != 0 ? 2.0f : 1.0f);
  return x < kLowest
             ? 0.0f
             : (x > kHighest ? std::numeric_limits<float>::infinity() : e);
}

/// ln x in float32 without a branch: x = m 2^e with m in [sqrt(1/2),
/// sqrt(2)), Cephes' logf polynomial for ln m; NaN below 0, -inf at 0.
inline float log_lane(float x) {
  const bool tiny = x < std::numeric_limits<float>::min();  // denormal, 0, <0
  const float scaled = tiny ? x * 8388608.0f : x;           // * 2^23
  const int32_t bits = bits_as<int32_t>(scaled);
  float e = static_cast<float>(((bits >> 23) & 0xff) - 126) - (tiny ? 23 : 0);
  float m = bits_as<float>((bits & 0x007fffff) | 0x3f000000);  // [0.5, 1)
  const bool low = m < 0.707106781186547524f;
  e = low ? e - 1.0f : e;
  m = low ? m + m - 1.0f : m - 1.0f;
  const float z = m * m;
  float y = 7.0376836292e-2f;
  y = y * m - 1.1514610310e-1f;
  y = y * m + 1.1676998740e-1f;
  y = y * m - 1.2420140846e-1f;
  y = y * m + 1.4249322787e-1f;
  y = y * m - 1.6668057665e-1f;
  y = y * m + 2.0000714765e-1f;
  y = y * m - 2.4999993993e-1f;
  y = y * m + 3.3333331174e-1f;
  y = y * m * z;
  y = y + e * -2.12194440e-4f;
  y = y - 0.5f * z;
  const float result = (m + y) + e * 0.693359375f;
  const float inf = std::numeric_limits<float>::infinity();
  return x == 0.0f
             ? -inf
             : (x < 0.0f || x != x ? std::numeric_limits<float>::quiet_NaN()
                                   : (x == inf ? inf : result));
}

/// tanh x in float32 without a branch: Cephes' tanhf polynomial below
/// |x| = 0.625, 1 - 2 / (e^2|x| + 1) with x's sign above.
inline float tanh_lane(float x) {
  const float a = std::fabs(x);
  const float z = x * x;
  float p = -5.70498872745e-3f;
  p = p * z + 2.06390887954e-2f;
  p = p * z - 5.37397155531e-2f;
  p = p * z + 1.33314422036e-1f;
  p = p * z - 3.33332819422e-1f;
  const float small = p * z * x + x;
  const float large = std::copysign(1.0f - 2.0f / (exp_lane(a + a) + 1.0f), x);
  return a < 0.625f ? small : large;
}

inline float sigmoid_lane(float x) { return 1.0f / (1.0f + exp_lane(-x)); }

inline double exp_lane(double x) { return std::exp(x); }
inline double log_lane(double x) { return std::log(x); }
inline double tanh_lane(double x) { return std::tanh(x); }
inline double sigmoid_lane(double x) { return 1.0 / (1.0 + std::exp(-x)); }
template <class T>
inline T sqrt_lane(T x) {
  return std::sqrt(x);
}
template <class T>
inline T abs_lane(T x) {
  return x < 0 ? -x : (x == 0 ? T(0) : x);  // NaN stays NaN
}

/// \endcond
// -------------------------------------------------------- the functions ---

/// The value one of the unary functions gives x of any family: a tensor's
/// ATen op, a dual's value and derivative, a pack lane by lane (an index
/// pack's lanes as scores), a number's lane function (integers as double).
#define MHA_FUSED_UNARY(name, tensor_op, derivative)                     \
  template <class X>                                                     \
  inline auto name(const X& x) {                                         \
    if constexpr (kIsTensor<X>) {                                        \
      return TensorValue{tensor_op(x.t)};                                \
    } else if constexpr (kIsDual<X>) {                                   \
      const auto v = name(x.v);                                          \
      const auto& u = x.v;                                               \
      const auto& du = x.d;                                              \
      (void)u;                                                           \
      return Dual<Plain<decltype(v)>>{v, derivative};                    \
    } else if constexpr (kIsScorePack<X>) {                              \
      using T = LanesT<X>;                                               \
      Pack<T> r;                                                         \
      for (int i = 0; i < kLanes<T>; ++i) {                              \
        r.v[i] = name##_lane(x.v[i]);                                    \
      }                                                                  \
      return r;                                                          \
    } else if constexpr (kIsIndexPack<X>) {                              \
      return name(as_value<Pack<LanesT<X>>>(x));                         \
    } else {                                                             \
      static_assert(kIsNumber<X>, #name ": not a value of a fused mod"); \
      if constexpr (std::is_floating_point_v<Plain<X>>) {                \
        return name##_lane(x);                                           \
      } else {                                                           \
        return name##_lane(static_cast<double>(x));                      \
      }                                                                  \
    }                                                                    \
  }

// Derivatives as ATen's autograd computes them (derivatives.yaml).
MHA_FUSED_UNARY(exp, torch::exp, du* v)
MHA_FUSED_UNARY(log, torch::log, du / u)
MHA_FUSED_UNARY(tanh, torch::tanh, du*(1 - v * v))
MHA_FUSED_UNARY(sigmoid, torch::sigmoid, du*(v*(1 - v)))
MHA_FUSED_UNARY(sqrt, torch::sqrt, du / (2 * v))
#undef MHA_FUSED_UNARY

// ---------------------------------------------------------------- where ---

/// The pack (or number) type that where / min / max give for a and b with
/// lanes of T: scores where either is a score pack or a floating number,
/// indices otherwise.
template <class T, class A, class B>
using SelectPack = std::conditional_t<kIsScorePack<A> || kIsScorePack<B> ||
                                          std::is_floating_point_v<Plain<A>> ||
                                          std::is_floating_point_v<Plain<B>>,
                                      Pack<T>, IndexPack<T>>;

/// cond ? a : b element by element. cond: a bool, a mask pack or a bool
/// tensor; a and b: values of any family or numbers. Its derivative is
/// the chosen branch's.
template <class C, class A, class B>
inline auto where(const C& cond, const A& a, const B& b) {
  if constexpr (kIsTensor<C> || kIsTensor<A> || kIsTensor<B>) {
    torch::Tensor like;
    if constexpr (kIsTensor<C>) {
      like = cond.t;
    } else {
      like = first_tensor(a, b);
    }
    return TensorValue{torch::where(as_tensor(cond, like).to(torch::kBool),
                                    tensor_operand(a), tensor_operand(b))};
  } else if constexpr (kIsDual<A> || kIsDual<B>) {
    using V = DualValue<A, B>;
    const auto x = as_dual<V>(a), y = as_dual<V>(b);
    return Dual<V>{where(cond, x.v, y.v), where(cond, x.d, y.d)};
  } else if constexpr (kIsMaskPack<C>) {
    using T = LanesT<C>;
    using R = SelectPack<T, A, B>;
    using E = Plain<decltype(std::declval<R>().v[0])>;
    R r;
    for (int i = 0; i < kLanes<T>; ++i) {
      r.v[i] =
          cond.v[i] ? static_cast<E>(lane(a, i)) : static_cast<E>(lane(b, i));
    }
    return r;
  } else if constexpr (kIsPack<A> || kIsPack<B>) {
    static_assert(kIsNumber<C>, "where: the condition is not a mask");
    using T = PairLanes<A, B>;
    using R = SelectPack<T, A, B>;
    return cond ? as_value<R>(a) : as_value<R>(b);
  } else {
    static_assert(kIsNumber<C> && kIsNumber<A> && kIsNumber<B>,
                  "where: not values of a fused mod");
    using R = std::common_type_t<Plain<A>, Plain<B>>;
    return cond ? static_cast<R>(a) : static_cast<R>(b);
  }
}

/// |x|; an index pack's or integer's stays integer. Derivative sgn(x) (0 at
/// 0), as ATen's abs.
template <class X>
inline auto abs(const X& x) {
  if constexpr (kIsTensor<X>) {
    return TensorValue{torch::abs(x.t)};
  } else if constexpr (kIsDual<X>) {
    using V = Plain<decltype(x.v)>;
    const auto sign = where(x.v > 0, as_value<V>(1), as_value<V>(0)) -
                      where(x.v < 0, as_value<V>(1), as_value<V>(0));
    return Dual<V>{abs(x.v), x.d * sign};
  } else if constexpr (kIsPack<X>) {
    static_assert(!kIsMaskPack<X>, "abs: of a mask");
    Plain<X> r;
    for (int i = 0; i < kLanes<LanesT<X>>; ++i) {
      r.v[i] = abs_lane(x.v[i]);
    }
    return r;
  } else {
    static_assert(kIsNumber<X>, "abs: not a value of a fused mod");
    return abs_lane(x);
  }
}

// ------------------------------------------------------- min, max, clamp ---

namespace detail {
/// Whether the linked LibTorch's autograd passes clamp's derivative at its
/// bounds (1.13: d clamp(x, lo, hi) / dx = 1 at x = lo or hi) or gives 0
/// there (2.14): probed once, with autograd, on the first call (made by
/// fused_score_mod on the caller's thread); the dual forms of clamp and of
/// min / max against a constant follow it. (`const`: the same answer on
/// every call, so that the compiler keeps it out of a loop.)
#if defined(__GNUC__) || defined(__clang__)
__attribute__((const))
#endif
bool clamp_passes_at_bounds();

/// clamp_passes_at_bounds without `const`, for the first call (the
/// compiler may drop a `const` function's call whose result goes unused).
bool probe_clamp_passes_at_bounds();

/// min (is_min) or max of two values of one family: NaN propagates; at a
/// tie of two duals each gives half its derivative (ATen's minimum /
/// maximum), against a constant the dual's derivative passes at the tie
/// (clamp_max / clamp_min).
template <bool is_min, class A, class B>
inline auto extremum(const A& a, const B& b) {
  auto first = [](const auto& x, const auto& y) {  // x wins: mask or bool
    return is_min ? (x < y) | (x != x) : (x > y) | (x != x);
  };
  if constexpr (kIsTensor<A> && kIsTensor<B>) {
    return TensorValue{is_min ? torch::minimum(a.t, b.t)
                              : torch::maximum(a.t, b.t)};
  } else if constexpr (kIsTensor<A> || kIsTensor<B>) {
    if constexpr (kIsTensor<A>) {
      return TensorValue{is_min ? a.t.clamp_max(b) : a.t.clamp_min(b)};
    } else {
      return TensorValue{is_min ? b.t.clamp_max(a) : b.t.clamp_min(a)};
    }
  } else if constexpr (kIsDual<A> && kIsDual<B>) {
    using V = DualValue<A, B>;
    const auto a_wins = first(a.v, b.v), b_wins = first(b.v, a.v);
    const V half_sum = (a.d + b.d) * 0.5;
    return Dual<V>{where(a_wins, a.v, b.v),
                   where(a_wins, a.d, where(b_wins, b.d, half_sum))};
  } else if constexpr (kIsDual<A> || kIsDual<B>) {
    using V = DualValue<A, B>;
    Dual<V> x;
    V c;
    if constexpr (kIsDual<A>) {
      x = a;
      c = as_value<V>(b);
    } else {
      x = b;
      c = as_value<V>(a);
    }
    const auto keeps = (is_min ? x.v <= c : x.v >= c) | (x.v != x.v);
    // At the tie: clamp_max / clamp_min's derivative (see
    // clamp_passes_at_bounds).
    const auto passes = clamp_passes_at_bounds()
                            ? keeps
                            : (is_min ? x.v < c : x.v > c) | (x.v != x.v);
    return Dual<V>{where(keeps, x.v, c), where(passes, x.d, as_value<V>(0))};
  } else {
    return where(first(a, b), a, b);
  }
}
}  // namespace detail

/// The smaller of a and b, element by element (NaN propagates).
template <class A, class B>
inline auto min(const A& a, const B& b) {
  return detail::extremum<true>(a, b);
}
/// The larger of a and b, element by element (NaN propagates).
template <class A, class B>
inline auto max(const A& a, const B& b) {
  return detail::extremum<false>(a, b);
}
/// x limited to [lo, hi] (numbers), as torch.clamp: hi where lo > hi, NaN
/// stays NaN; the derivative passes where lo < x < hi, and at x = lo or hi
/// as the linked LibTorch's autograd does (1.13 passes it, 2.14 gives 0).
template <class X>
inline auto clamp(const X& x, double lo, double hi) {
  if constexpr (kIsTensor<X>) {
    return TensorValue{torch::clamp(x.t, lo, hi)};
  } else if constexpr (kIsDual<X>) {
    using V = Plain<decltype(x.v)>;
    const auto inside = detail::clamp_passes_at_bounds()
                            ? (x.v >= lo) & (x.v <= hi)
                            : (x.v > lo) & (x.v < hi);
    return Dual<V>{as_value<V>(clamp(x.v, lo, hi)),
                   where(inside, x.d, as_value<V>(0))};
  } else {
    const auto above = where(x < lo, lo, x);
    return where(above > hi, hi, above);
  }
}

// --------------------------------------------------------------- lookup ---

namespace detail {
/// A CPU table's data as lookup reads it.
struct TableView {
  const char* data = nullptr;
  torch::ScalarType dtype = torch::kFloat;
  int dims = 0;
  int64_t sizes[8] = {};
  int64_t strides[8] = {};  // in elements
};

inline TableView table_view(const torch::Tensor& table, int indices) {
  TORCH_CHECK(table.defined(), "mha::fused::lookup: the table is undefined");
  TORCH_CHECK(table.device().is_cpu(),
              "mha::fused::lookup: the CPU core reads the table from host "
              "memory, but got a table on ",
              table.device());
  TORCH_CHECK(table.dim() == indices && indices <= 8,
              "mha::fused::lookup: a table of ", table.dim(), " dims ",
              table.sizes(), " takes as many indices, but got ", indices);
  const auto dtype = table.scalar_type();
  TORCH_CHECK(dtype == torch::kFloat || dtype == torch::kDouble ||
                  dtype == torch::kLong || dtype == torch::kInt ||
                  dtype == torch::kBool,
              "mha::fused::lookup: the table must be float32, float64, int64, "
              "int32 or bool, but got ",
              dtype);
  TableView view;
  view.data = static_cast<const char*>(table.data_ptr());
  view.dtype = dtype;
  view.dims = indices;
  for (int d = 0; d < indices; ++d) {
    view.sizes[d] = table.size(d);
    view.strides[d] = table.stride(d);
  }
  return view;
}

[[noreturn]] inline void lookup_out_of_range(const TableView& view, int dim,
                                             int64_t index) {
  TORCH_CHECK(false, "mha::fused::lookup: index ", index, " of dim ", dim,
              " is out of range for the table's size ", view.sizes[dim]);
  std::abort();
}

/// The element offset of index `i` of dim `dim`, checked.
inline int64_t table_offset(const TableView& view, int dim, int64_t i) {
  if (static_cast<uint64_t>(i) >= static_cast<uint64_t>(view.sizes[dim])) {
    lookup_out_of_range(view, dim, i);
  }
  return i * view.strides[dim];
}

/// Not 0 after a lookup of a Table at a plain index out of range on this
/// thread (which then reads offset 0): the CPU kernels clear it before each
/// run of keys and raise the error after it (fused_kernels.h), so that the
/// loop over keys has no branch and stays vectorised. (uint16_t: GCC 12
/// keeps neither a bool's nor an int's OR in a vector register there.)
inline thread_local uint16_t table_index_missed = 0;

/// table_offset without a branch: offset 0 and table_index_missed set for an
/// index out of range. (The stride is read either way: a load under a
/// condition is not vectorised.)
inline int64_t table_offset_or_miss(const TableView& view, int dim, int64_t i) {
  const bool inside =
      static_cast<uint64_t>(i) < static_cast<uint64_t>(view.sizes[dim]);
  table_index_missed |= static_cast<uint16_t>(!inside);
  return (inside ? i : 0) * view.strides[dim];
}

template <class R>
inline R table_read(const TableView& view, int64_t offset) {
  switch (view.dtype) {
    case torch::kFloat:
      return static_cast<R>(reinterpret_cast<const float*>(view.data)[offset]);
    case torch::kDouble:
      return static_cast<R>(reinterpret_cast<const double*>(view.data)[offset]);
    case torch::kLong:
      return static_cast<R>(
          reinterpret_cast<const int64_t*>(view.data)[offset]);
    case torch::kInt:
      return static_cast<R>(
          reinterpret_cast<const int32_t*>(view.data)[offset]);
    default:
      return static_cast<R>(reinterpret_cast<const bool*>(view.data)[offset]);
  }
}

}  // namespace detail

/// A captured tensor made ready for lookup once (its checks, and a
/// contiguous float64 copy of its values, at construction), so that a
/// lookup by plain indices in the CPU core costs a bounds check and a load
/// of one type, which the compiler hoists out of the loop over keys where
/// the indices do not change along it (a head's slope): capture
/// `mha::fused::Table(tensor)` instead of the tensor where a mod reads it
/// for every score (ALiBi slopes, document ids, T5 biases). Keeps the
/// tensor alive (a later change to it is not seen by the copy); its tensor
/// form reads the tensor itself.
class Table {
 public:
  /// Throws c10::Error as lookup does for a table it cannot read.
  explicit Table(torch::Tensor tensor)
      : tensor_(std::move(tensor)),
        view_(detail::table_view(tensor_, static_cast<int>(tensor_.dim()))) {
    const auto dense = tensor_.detach().to(torch::kDouble).contiguous();
    // At least one value: an index out of range reads offset 0 (lookup).
    auto values = std::make_shared<std::vector<double>>(
        dense.data_ptr<double>(), dense.data_ptr<double>() + dense.numel());
    if (values->empty()) {
      values->push_back(0.0);
    }
    values_ = std::move(values);
    data_ = values_->data();
    dense_ = view_;
    int64_t stride = 1;
    for (int d = view_.dims - 1; d >= 0; --d) {
      dense_.strides[d] = stride;
      stride *= view_.sizes[d];
    }
  }
  /// The tensor.
  const torch::Tensor& tensor() const { return tensor_; }
  /// Its data as the CPU kernels read it.
  const detail::TableView& view() const { return view_; }
  /// Its values as float64, contiguous (the strides of dense_view()).
  const double* values() const { return data_; }
  /// The sizes and contiguous strides of values().
  const detail::TableView& dense_view() const { return dense_; }

 private:
  torch::Tensor tensor_;
  detail::TableView view_;
  detail::TableView dense_;
  std::shared_ptr<const std::vector<double>> values_;
  const double* data_ = nullptr;  // values_'s, one load away
};

namespace detail {
/// A table's view: made now from a tensor (checked), or a Table's own.
inline TableView view_of(const torch::Tensor& table, int indices) {
  return table_view(table, indices);
}
/// Throws the error of a lookup with `indices` indices in `table`, whose
/// number of dims differs.
[[noreturn]] inline void wrong_number_of_indices(const Table& table,
                                                 int indices) {
  table_view(table.tensor(), indices);  // throws, naming both
  std::abort();
}
inline const TableView& view_of(const Table& table, int indices) {
  if (table.view().dims != indices) {
    // noreturn: the compiler may keep the check out of a loop over keys.
    wrong_number_of_indices(table, indices);
  }
  return table.view();
}
inline const torch::Tensor& tensor_of(const torch::Tensor& t) { return t; }
inline const torch::Tensor& tensor_of(const Table& t) { return t.tensor(); }

template <class... I>
inline constexpr bool kAnyTensor = (kIsTensor<I> || ...);
template <class... I>
inline constexpr bool kAnyIndexPack = (kIsIndexPack<I> || ...);
template <class... I>
struct FirstPackLanes {
  using type = void;
};
template <class I0, class... I>
struct FirstPackLanes<I0, I...> {
  using type = std::conditional_t<kIsIndexPack<I0>, LanesT<I0>,
                                  typename FirstPackLanes<I...>::type>;
};
}  // namespace detail

/// table[i...]: a captured tensor (or Table) read at scalar or packed indices,
/// one index per dim of the table. Integer indices give a double; an index pack
/// gives a Pack<T>; tensor indices (the tensor form) give table.detach()[i...]
/// on the indices' device. No gradient flows into the table (a table that needs
/// one: write an eager ScoreMod). The CPU forms read float32, float64, int64,
/// int32 or bool tables in host memory. Throws c10::Error for an index out of
/// range (naming it), a table of another dtype, device or number of dims;
/// but a Table read at plain indices, the form the CPU core's kernels run,
/// reads element 0 for an index out of range and the kernel raises the
/// c10::Error after its run of keys (naming the mod and the query row):
/// called by hand, check such indices first.
template <class Tab, class... I,
          std::enable_if_t<std::is_same_v<Plain<Tab>, torch::Tensor> ||
                               std::is_same_v<Plain<Tab>, Table>,
                           int> = 0>
inline auto lookup(const Tab& table, const I&... i) {
  static_assert(sizeof...(I) > 0, "lookup: at least one index");
  if constexpr (detail::kAnyTensor<I...>) {
    torch::Tensor like;
    ((like = kIsTensor<I> && !like.defined()
                 ? as_tensor(i, detail::tensor_of(table))
                 : like),
     ...);
    std::vector<torch::Tensor> indices{as_tensor(i, like).to(torch::kLong)...};
    std::vector<at::indexing::TensorIndex> index(indices.begin(),
                                                 indices.end());
    return TensorValue{
        detail::tensor_of(table).detach().to(like.device()).index(index)};
  } else if constexpr (detail::kAnyIndexPack<I...>) {
    using T = typename detail::FirstPackLanes<I...>::type;
    const auto& view = detail::view_of(table, sizeof...(I));
    int64_t offset[kLanes<T>] = {};
    int dim = 0;
    (
        [&](const auto& index) {
          for (int l = 0; l < kLanes<T>; ++l) {
            offset[l] += detail::table_offset(
                view, dim, static_cast<int64_t>(lane(index, l)));
          }
          ++dim;
        }(i),
        ...);
    Pack<T> r;
    for (int l = 0; l < kLanes<T>; ++l) {
      r.v[l] = detail::table_read<T>(view, offset[l]);
    }
    return r;
  } else if constexpr (std::is_same_v<Plain<Tab>, Table>) {
    // The float64 copy: one type to load (see Table).
    detail::view_of(table, sizeof...(I));  // checks the number of indices
    int64_t offset = 0;
    int dim = 0;
    ((offset += detail::table_offset_or_miss(table.dense_view(), dim++,
                                             static_cast<int64_t>(i))),
     ...);
    return table.values()[offset];
  } else {
    const auto& view = detail::view_of(table, sizeof...(I));
    int64_t offset = 0;
    int dim = 0;
    ((offset += detail::table_offset(view, dim++, static_cast<int64_t>(i))),
     ...);
    return detail::table_read<double>(view, offset);
  }
}

}  // namespace mha::fused

// Fused mods: the values and the math a fused score or mask function is
// written with (mha::fused_score_mod / fused_mask_mod, flex_attention.h).
//
// A fused mod is a generic C++ lambda whose parameters are all `auto`. The
// library instantiates it four times, on four families of values, so that
// one text serves every path:
//   - plain numbers (float / double scores, int64_t indices, bool masks);
//   - packs: Pack<T> (kLanes<T> scores side by side: one 64-byte register),
//     IndexPack<T> (the matching key positions), MaskPack<T> (a mask per
//     lane). The CPU core calls the mod on a run of keys of one query row,
//     a pack at a time, inside its tile loop (fused_kernels.h);
//   - Dual<V> (a value and its derivative by the score): backward's
//     derivative of the mod, without a derivative written by the user;
//   - TensorValue (a torch::Tensor): the mod's tensor form, which every
//     other path (CUDA, other dtypes, the materialised reference) calls.
// Plain numbers mix with all of them (`30 * tanh(s / 30)`): integer literals
// next to scores stay floating; `/` and `%` on indices are C++'s (truncating:
// for the non-negative indices mods see, Python's // and %).
//
// The derivative at kinks follows ATen's autograd (torch/csrc/autograd/
// FunctionsManual.cpp, tools/autograd/derivatives.yaml): clamp / min / max
// with a number pass the gradient at the bound (clamp_min, clamp_max); min /
// max of two score-dependent values split it in half at a tie (minimum,
// maximum); abs has derivative 0 at 0; where takes the chosen branch's.
//
// float lanes: exp, log and tanh are branch-free polynomials (the
// coefficients of Cephes' expf, logf and tanhf, S. Moshier), so that the
// compiler vectorises them: relative error about 1e-7, as ATen's own
// vectorised float functions. double lanes call the C library per lane.
#pragma once

#include <torch/torch.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

namespace mha::fused {

/// Lanes of a pack of T: 64 bytes (16 floats, 8 doubles).
template <class T>
inline constexpr int kLanes = static_cast<int>(64 / sizeof(T));

/// kLanes<T> scores (float or double).
template <class T>
struct Pack {
  T v[kLanes<T>];  ///< the lanes
};

/// kLanes<T> key positions, int64, beside a Pack<T> of scores.
template <class T>
struct IndexPack {
  int64_t v[kLanes<T>];  ///< the lanes
};

/// The integer type of T's width: a MaskPack<T>'s lanes.
template <class T>
using MaskLane = std::conditional_t<sizeof(T) == 4, int32_t, int64_t>;

/// kLanes<T> masks, each lane 0 or 1 (1 = true).
template <class T>
struct MaskPack {
  MaskLane<T> v[kLanes<T>];  ///< the lanes, 0 or 1
};

/// A value and its derivative by the score (forward-mode differentiation):
/// V is T or Pack<T>.
template <class V>
struct Dual {
  V v;  ///< the value
  V d;  ///< its derivative by the score
};

/// The tensor form's values: any tensor (scores, indices or masks).
struct TensorValue {
  torch::Tensor t;  ///< the tensor
};

// ------------------------------------------------------------- traits ---
/// \cond internal

template <class X>
using Plain = std::remove_cv_t<std::remove_reference_t<X>>;

template <class X>
struct LanesOf {
  using type = void;
};
template <class T>
struct LanesOf<Pack<T>> {
  using type = T;
};
template <class T>
struct LanesOf<IndexPack<T>> {
  using type = T;
};
template <class T>
struct LanesOf<MaskPack<T>> {
  using type = T;
};
/// The T of a pack, or void for anything else.
template <class X>
using LanesT = typename LanesOf<Plain<X>>::type;

template <class X>
inline constexpr bool kIsNumber = std::is_arithmetic_v<Plain<X>>;
template <class X>
inline constexpr bool kIsPack = !std::is_void_v<LanesT<X>>;
template <class X>
inline constexpr bool kIsScorePack =
    kIsPack<X>&& std::is_same_v<Plain<X>, Pack<LanesT<X>>>;
template <class X>
inline constexpr bool kIsIndexPack =
    kIsPack<X>&& std::is_same_v<Plain<X>, IndexPack<LanesT<X>>>;
template <class X>
inline constexpr bool kIsMaskPack =
    kIsPack<X>&& std::is_same_v<Plain<X>, MaskPack<LanesT<X>>>;
template <class X>
struct IsDual : std::false_type {};
template <class V>
struct IsDual<Dual<V>> : std::true_type {};
template <class X>
inline constexpr bool kIsDual = IsDual<Plain<X>>::value;
template <class X>
inline constexpr bool kIsTensor = std::is_same_v<Plain<X>, TensorValue>;

/// The lane type two operands share: the T of their packs (the same T
/// where both are packs), with a number beside a pack; void otherwise.
template <class A, class B>
using PairLanes = std::conditional_t<
    kIsPack<A> && kIsPack<B>,
    std::conditional_t<std::is_same_v<LanesT<A>, LanesT<B>>, LanesT<A>, void>,
    std::conditional_t<
        kIsPack<A> && kIsNumber<B>, LanesT<A>,
        std::conditional_t<kIsNumber<A> && kIsPack<B>, LanesT<B>, void>>>;

/// Lane i of x: a pack's element, or a number itself.
template <class X>
inline auto lane(const X& x, int i) {
  if constexpr (kIsPack<X>) {
    return x.v[i];
  } else {
    (void)i;
    return x;
  }
}

// ------------------------------------------------------ pack operators ---

/// Operands of floating lane arithmetic: packs of one T (not masks) or
/// numbers, with a score pack among them, or an index pack beside a
/// floating number.
template <class A, class B>
inline constexpr bool kFloatingLanes =
    !std::is_void_v<PairLanes<A, B>> && !kIsMaskPack<A> && !kIsMaskPack<B> &&
    (kIsScorePack<A> || kIsScorePack<B> ||
     (kIsIndexPack<A> && std::is_floating_point_v<Plain<B>>) ||
     (std::is_floating_point_v<Plain<A>> && kIsIndexPack<B>));
/// Operands of integer lane arithmetic: an index pack beside an index pack
/// or an integer.
template <class A, class B>
inline constexpr bool kIndexLanes =
    !std::is_void_v<PairLanes<A, B>> &&
    ((kIsIndexPack<A> && (kIsIndexPack<B> || std::is_integral_v<Plain<B>>)) ||
     (std::is_integral_v<Plain<A>> && kIsIndexPack<B>));
/// Operands of a lane comparison: packs of one T (not masks) or numbers.
template <class A, class B>
inline constexpr bool kComparableLanes =
    !std::is_void_v<PairLanes<A, B>> && !kIsMaskPack<A> && !kIsMaskPack<B>;
/// Operands of a lane logical op: a mask pack beside a mask pack or a bool.
template <class A, class B>
inline constexpr bool kMaskLanes =
    !std::is_void_v<PairLanes<A, B>> &&
    ((kIsMaskPack<A> && (kIsMaskPack<B> || kIsNumber<B>)) ||
     (kIsNumber<A> && kIsMaskPack<B>));

#define MHA_FUSED_LANE_OP(op, Condition, Result, Element)                 \
  template <class A, class B, std::enable_if_t<Condition<A, B>, int> = 0> \
  inline Result<PairLanes<A, B>> operator op(const A& a, const B& b) {    \
    using T = PairLanes<A, B>;                                            \
    Result<T> r;                                                          \
    for (int i = 0; i < kLanes<T>; ++i) {                                 \
      r.v[i] = static_cast<Element>(lane(a, i) op lane(b, i));            \
    }                                                                     \
    return r;                                                             \
  }

// Score lanes: each operand converted to T first (an index to its value).
#define MHA_FUSED_FLOAT_OP(op)                                                 \
  template <class A, class B, std::enable_if_t<kFloatingLanes<A, B>, int> = 0> \
  inline Pack<PairLanes<A, B>> operator op(const A& a, const B& b) {           \
    using T = PairLanes<A, B>;                                                 \
    Pack<T> r;                                                                 \
    for (int i = 0; i < kLanes<T>; ++i) {                                      \
      r.v[i] = static_cast<T>(lane(a, i)) op static_cast<T>(lane(b, i));       \
    }                                                                          \
    return r;                                                                  \
  }
MHA_FUSED_FLOAT_OP(+)
MHA_FUSED_FLOAT_OP(-)
MHA_FUSED_FLOAT_OP(*)
MHA_FUSED_FLOAT_OP(/)
#undef MHA_FUSED_FLOAT_OP

MHA_FUSED_LANE_OP(+, kIndexLanes, IndexPack, int64_t)
MHA_FUSED_LANE_OP(-, kIndexLanes, IndexPack, int64_t)
MHA_FUSED_LANE_OP(*, kIndexLanes, IndexPack, int64_t)
MHA_FUSED_LANE_OP(/, kIndexLanes, IndexPack, int64_t)
MHA_FUSED_LANE_OP(%, kIndexLanes, IndexPack, int64_t)
MHA_FUSED_LANE_OP(<, kComparableLanes, MaskPack, MaskLane<T>)
MHA_FUSED_LANE_OP(<=, kComparableLanes, MaskPack, MaskLane<T>)
MHA_FUSED_LANE_OP(>, kComparableLanes, MaskPack, MaskLane<T>)
MHA_FUSED_LANE_OP(>=, kComparableLanes, MaskPack, MaskLane<T>)
MHA_FUSED_LANE_OP(==, kComparableLanes, MaskPack, MaskLane<T>)
MHA_FUSED_LANE_OP(!=, kComparableLanes, MaskPack, MaskLane<T>)
MHA_FUSED_LANE_OP(&, kMaskLanes, MaskPack, MaskLane<T>)
MHA_FUSED_LANE_OP(|, kMaskLanes, MaskPack, MaskLane<T>)
MHA_FUSED_LANE_OP(^, kMaskLanes, MaskPack, MaskLane<T>)
#undef MHA_FUSED_LANE_OP

template <class T>
inline Pack<T> operator-(const Pack<T>& a) {
  Pack<T> r;
  for (int i = 0; i < kLanes<T>; ++i) {
    r.v[i] = -a.v[i];
  }
  return r;
}
template <class T>
inline IndexPack<T> operator-(const IndexPack<T>& a) {
  IndexPack<T> r;
  for (int i = 0; i < kLanes<T>; ++i) {
    r.v[i] = -a.v[i];
  }
  return r;
}
template <class T>
inline MaskPack<T> operator!(const MaskPack<T>& a) {
  MaskPack<T> r;
  for (int i = 0; i < kLanes<T>; ++i) {
    r.v[i] = a.v[i] ^ 1;
  }
  return r;
}

// ------------------------------------------------------ dual operators ---

/// x as a value of type V (a number, or a Pack<T> whose lanes are x's).
template <class V, class X>
inline V as_value(const X& x) {
  if constexpr (std::is_same_v<Plain<X>, V>) {
    return x;
  } else if constexpr (std::is_arithmetic_v<V>) {
    return static_cast<V>(x);
  } else {
    using T = LanesT<V>;
    V r;
    for (int i = 0; i < kLanes<T>; ++i) {
      r.v[i] = static_cast<T>(lane(x, i));
    }
    return r;
  }
}

template <class X>
struct DualOf {
  using type = void;
};
template <class V>
struct DualOf<Dual<V>> {
  using type = V;
};
/// The V of a dual operand, or of the other one.
template <class A, class B>
using DualValue =
    std::conditional_t<kIsDual<A>, typename DualOf<Plain<A>>::type,
                       typename DualOf<Plain<B>>::type>;
/// x as Dual<V>: a dual itself, or a constant (derivative 0).
template <class V, class X>
inline Dual<V> as_dual(const X& x) {
  if constexpr (kIsDual<X>) {
    return x;
  } else {
    return {as_value<V>(x), as_value<V>(0)};
  }
}
/// Operands of dual arithmetic: a dual beside a dual or a value of its
/// family (not a tensor or a mask).
template <class A, class B>
inline constexpr bool kDualOperands = (kIsDual<A> ||
                                       kIsDual<B>)&&!kIsTensor<A> &&
                                      !kIsTensor<B> && !kIsMaskPack<A> &&
                                      !kIsMaskPack<B>;

template <class A, class B, std::enable_if_t<kDualOperands<A, B>, int> = 0>
inline auto operator+(const A& a, const B& b) {
  using V = DualValue<A, B>;
  const auto x = as_dual<V>(a), y = as_dual<V>(b);
  return Dual<V>{x.v + y.v, x.d + y.d};
}
template <class A, class B, std::enable_if_t<kDualOperands<A, B>, int> = 0>
inline auto operator-(const A& a, const B& b) {
  using V = DualValue<A, B>;
  const auto x = as_dual<V>(a), y = as_dual<V>(b);
  return Dual<V>{x.v - y.v, x.d - y.d};
}
template <class A, class B, std::enable_if_t<kDualOperands<A, B>, int> = 0>
inline auto operator*(const A& a, const B& b) {
  using V = DualValue<A, B>;
  const auto x = as_dual<V>(a), y = as_dual<V>(b);
  return Dual<V>{x.v * y.v, x.d * y.v + x.v * y.d};
}
template <class A, class B, std::enable_if_t<kDualOperands<A, B>, int> = 0>
inline auto operator/(const A& a, const B& b) {
  using V = DualValue<A, B>;
  const auto x = as_dual<V>(a), y = as_dual<V>(b);
  const V q = x.v / y.v;
  return Dual<V>{q, (x.d - q * y.d) / y.v};
}
template <class V>
inline Dual<V> operator-(const Dual<V>& a) {
  return {-a.v, -a.d};
}
// Comparisons of duals compare their values.
#define MHA_FUSED_DUAL_COMPARE(op)                                            \
  template <class A, class B, std::enable_if_t<kDualOperands<A, B>, int> = 0> \
  inline auto operator op(const A& a, const B& b) {                           \
    using V = DualValue<A, B>;                                                \
    return as_dual<V>(a).v op as_dual<V>(b).v;                                \
  }
MHA_FUSED_DUAL_COMPARE(<)
MHA_FUSED_DUAL_COMPARE(<=)
MHA_FUSED_DUAL_COMPARE(>)
MHA_FUSED_DUAL_COMPARE(>=)
MHA_FUSED_DUAL_COMPARE(==)
MHA_FUSED_DUAL_COMPARE(!=)
#undef MHA_FUSED_DUAL_COMPARE

// ---------------------------------------------------- tensor operators ---

/// x as a tensor operand: a TensorValue's tensor, or a number as a Scalar.
inline const torch::Tensor& tensor_operand(const TensorValue& x) { return x.t; }
template <class X, std::enable_if_t<kIsNumber<X>, int> = 0>
inline torch::Scalar tensor_operand(const X& x) {
  return torch::Scalar(x);
}
/// x as a tensor on `like`'s device (numbers: 0-dim tensors of their kind).
template <class X>
inline torch::Tensor as_tensor(const X& x, const torch::Tensor& like) {
  if constexpr (kIsTensor<X>) {
    return x.t;
  } else if constexpr (std::is_same_v<Plain<X>, bool>) {
    return torch::scalar_tensor(x, like.options().dtype(torch::kBool));
  } else if constexpr (std::is_integral_v<Plain<X>>) {
    return torch::scalar_tensor(static_cast<int64_t>(x),
                                like.options().dtype(torch::kLong));
  } else {
    return torch::scalar_tensor(static_cast<double>(x),
                                like.options().dtype(torch::kDouble));
  }
}
template <class A, class B>
inline constexpr bool kTensorOperands = (kIsTensor<A> &&
                                         (kIsTensor<B> || kIsNumber<B>)) ||
                                        (kIsNumber<A> && kIsTensor<B>);

/// The tensor the operands of a tensor op have: the first TensorValue's.
template <class A, class B>
inline const torch::Tensor& first_tensor(const A& a, const B& b) {
  if constexpr (kIsTensor<A>) {
    (void)b;
    return a.t;
  } else {
    return b.t;
  }
}
/// Whether x is an integer operand (an integer tensor or number).
template <class X>
inline bool integral_operand(const X& x) {
  if constexpr (kIsTensor<X>) {
    return !x.t.is_floating_point() && !x.t.is_complex();
  } else {
    return std::is_integral_v<Plain<X>>;
  }
}

#define MHA_FUSED_TENSOR_OP(op, expression)                    \
  template <class A, class B,                                  \
            std::enable_if_t<kTensorOperands<A, B>, int> = 0>  \
  inline TensorValue operator op(const A& a, const B& b) {     \
    const auto& like = first_tensor(a, b);                     \
    const auto x = as_tensor(a, like), y = as_tensor(b, like); \
    return {expression};                                       \
  }
MHA_FUSED_TENSOR_OP(+, x + y)
MHA_FUSED_TENSOR_OP(-, x - y)
MHA_FUSED_TENSOR_OP(*, x* y)
// C++'s `/` and `%` on integers truncate: so do the tensor forms.
MHA_FUSED_TENSOR_OP(/, integral_operand(a) && integral_operand(b)
                           ? torch::div(x, y, "trunc")
                           : torch::div(x, y))
MHA_FUSED_TENSOR_OP(%, torch::fmod(x, y))
MHA_FUSED_TENSOR_OP(<, x.lt(y))
MHA_FUSED_TENSOR_OP(<=, x.le(y))
MHA_FUSED_TENSOR_OP(>, x.gt(y))
MHA_FUSED_TENSOR_OP(>=, x.ge(y))
MHA_FUSED_TENSOR_OP(==, x.eq(y))
MHA_FUSED_TENSOR_OP(!=, x.ne(y))
MHA_FUSED_TENSOR_OP(&, x.logical_and(y))
MHA_FUSED_TENSOR_OP(|, x.logical_or(y))
MHA_FUSED_TENSOR_OP(^, x.logical_xor(y))
#undef MHA_FUSED_TENSOR_OP

inline TensorValue operator-(const TensorValue& a) { return {-a.t}; }
inline TensorValue operator!(const TensorValue& a) {
  return {a.t.logical_not()};
}

/// \endcond

}  // namespace mha::fused

#include "mha/fused_math.h"

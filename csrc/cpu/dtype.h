// Storage types of the CPU twins and their conversions to the accumulation type, written as
// plain integer and float arithmetic so that `#pragma omp simd` loops vectorise through them.
#ifndef MSHPC_CPU_DTYPE_H
#define MSHPC_CPU_DTYPE_H

#include <cstdint>
#include <cstring>

#include "../mshpc_kernels.h"

namespace mshpc {

// An enum, not a struct: GCC vectorises loads and stores of scalar types only.
enum class bf16 : uint16_t {};
using f16 = _Float16;

template <class T> struct acc_of { using type = float; };
template <> struct acc_of<double> { using type = double; };
template <class T> using acc_t = typename acc_of<T>::type;

inline float to_acc(bf16 v) {
  uint32_t u = uint32_t(static_cast<uint16_t>(v)) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}
inline float to_acc(f16 v) { return float(v); }
inline float to_acc(float v) { return v; }
inline double to_acc(double v) { return v; }

// Round to nearest even, as torch does; NaN stays a quiet NaN.
inline bf16 to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  bool nan = (u & 0x7FFFFFFFu) > 0x7F800000u;
  return bf16(uint16_t(nan ? 0x7FC0u : rounded));
}

template <class T> inline T from_acc(acc_t<T> v);
template <> inline bf16 from_acc<bf16>(float v) { return to_bf16(v); }
template <> inline f16 from_acc<f16>(float v) { return f16(v); }
template <> inline float from_acc<float>(float v) { return v; }
template <> inline double from_acc<double>(double v) { return v; }

// Calls f(T{}) with T the storage type of `dtype`; false for an unknown code.
template <class F> bool visit_dtype(int dtype, F&& f) {
  switch (dtype) {
    case MSHPC_F32: f(float{}); return true;
    case MSHPC_F64: f(double{}); return true;
    case MSHPC_BF16: f(bf16{}); return true;
    case MSHPC_F16: f(f16{}); return true;
  }
  return false;
}

// Rows [first, last) of the `parts` fixed blocks that partial sums are taken over.
inline int64_t part_begin(int64_t part, int64_t parts, int64_t rows) { return rows * part / parts; }

}  // namespace mshpc

#endif

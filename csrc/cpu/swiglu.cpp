// CPU twin of csrc/cuda/swiglu.cu: y = silu(gate) * up (Shazeer 2020, "GLU Variants Improve
// Transformer", eq. 5 with Swish_1 = SiLU) from x = [gate | up] along each row, and its backward.
#include "dtype.h"
#include "simd_exp.h"

namespace mshpc {
namespace {

// sigmoid through simd_exp, so the loops below vectorise; exp(-g) saturates (clamped) rather
// than overflowing, and silu(g) = g * sigmoid(g) then tends to 0 or g as it should.
template <class A> inline A sigmoid(A g) { return A(1) / (A(1) + simd_exp(-g)); }

// x: (rows, 2 * cols), each row [gate | up]; y: (rows, cols).
template <class T> void swiglu_fwd(const T* x, T* y, int64_t rows, int64_t cols) {
  using A = acc_t<T>;
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < rows; ++i) {
    const T* gate = x + i * 2 * cols;
    const T* up = gate + cols;
    T* yi = y + i * cols;
#pragma omp simd
    for (int64_t j = 0; j < cols; ++j) {
      A g = to_acc(gate[j]);
      yi[j] = from_acc<T>(g * sigmoid(g) * A(to_acc(up[j])));
    }
  }
}

// dgate = dy * up * silu'(gate), silu'(g) = sigmoid(g) * (1 + g * (1 - sigmoid(g)));
// dup = dy * silu(gate). dx has x's layout, [dgate | dup] per row.
template <class T> void swiglu_bwd(const T* dy, const T* x, T* dx, int64_t rows, int64_t cols) {
  using A = acc_t<T>;
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < rows; ++i) {
    const T* gate = x + i * 2 * cols;
    const T* up = gate + cols;
    const T* dyi = dy + i * cols;
    T* dgate = dx + i * 2 * cols;
    T* dup = dgate + cols;
#pragma omp simd
    for (int64_t j = 0; j < cols; ++j) {
      A g = to_acc(gate[j]), u = to_acc(up[j]), d = to_acc(dyi[j]);
      A s = sigmoid(g);
      dgate[j] = from_acc<T>(d * u * s * (A(1) + g * (A(1) - s)));
      dup[j] = from_acc<T>(d * g * s);
    }
  }
}

}  // namespace
}  // namespace mshpc

extern "C" const char* mshpc_swiglu_fwd_cpu(const void* x, void* y, int dtype, int64_t rows, int64_t cols,
                                             void* /*stream*/) {
  using namespace mshpc;
  bool ok = visit_dtype(dtype, [&](auto t) {
    using T = decltype(t);
    swiglu_fwd(static_cast<const T*>(x), static_cast<T*>(y), rows, cols);
  });
  return ok ? nullptr : "swiglu: unsupported dtype";
}

extern "C" const char* mshpc_swiglu_bwd_cpu(const void* dy, const void* x, void* dx, int dtype, int64_t rows,
                                             int64_t cols, void* /*stream*/) {
  using namespace mshpc;
  bool ok = visit_dtype(dtype, [&](auto t) {
    using T = decltype(t);
    swiglu_bwd(static_cast<const T*>(dy), static_cast<const T*>(x), static_cast<T*>(dx), rows, cols);
  });
  return ok ? nullptr : "swiglu backward: unsupported dtype";
}

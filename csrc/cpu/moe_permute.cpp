// CPU twin of csrc/cuda/moe_permute.cu: a mixture of experts' tokens into expert order and back
// (the layout is in csrc/mshpc_kernels.h). Each token's rows are read and written by one
// iteration of the outer loop, so the OpenMP threads never share an output row.
#include <algorithm>
#include <vector>

#include "dtype.h"

namespace mshpc {
namespace {

template <class T> void permute_fwd(const T* x, const int64_t* pos, T* xp, int64_t tokens, int64_t k, int64_t cols) {
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t j = 0; j < k; ++j) {
      const int64_t r = pos[t * k + j];
      if (r >= 0) std::memcpy(xp + r * cols, x + t * cols, sizeof(T) * size_t(cols));
    }
  }
}

template <class T> void permute_bwd(const T* dxp, const int64_t* pos, T* dx, int64_t tokens, int64_t k, int64_t cols) {
  using A = acc_t<T>;
#pragma omp parallel
  {
    std::vector<A> acc(static_cast<size_t>(cols));
#pragma omp for schedule(static)
    for (int64_t t = 0; t < tokens; ++t) {
      std::fill(acc.begin(), acc.end(), A(0));
      for (int64_t j = 0; j < k; ++j) {
        const int64_t r = pos[t * k + j];
        if (r < 0) continue;
        const T* row = dxp + r * cols;
#pragma omp simd
        for (int64_t c = 0; c < cols; ++c) acc[c] += to_acc(row[c]);
      }
      T* out = dx + t * cols;
#pragma omp simd
      for (int64_t c = 0; c < cols; ++c) out[c] = from_acc<T>(acc[c]);
    }
  }
}

template <class T>
void unpermute_fwd(const T* y, const int64_t* pos, const acc_t<T>* w, T* out, int64_t tokens, int64_t k, int64_t cols) {
  using A = acc_t<T>;
#pragma omp parallel
  {
    std::vector<A> acc(static_cast<size_t>(cols));
#pragma omp for schedule(static)
    for (int64_t t = 0; t < tokens; ++t) {
      std::fill(acc.begin(), acc.end(), A(0));
      for (int64_t j = 0; j < k; ++j) {
        const int64_t r = pos[t * k + j];
        if (r < 0) continue;
        const A wj = w[t * k + j];
        const T* row = y + r * cols;
#pragma omp simd
        for (int64_t c = 0; c < cols; ++c) acc[c] += wj * to_acc(row[c]);
      }
      T* o = out + t * cols;
#pragma omp simd
      for (int64_t c = 0; c < cols; ++c) o[c] = from_acc<T>(acc[c]);
    }
  }
}

template <class T>
void unpermute_bwd(const T* dout, const T* y, const int64_t* pos, const acc_t<T>* w, T* dy, acc_t<T>* dw,
                   int64_t tokens, int64_t k, int64_t cols) {
  using A = acc_t<T>;
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < tokens; ++t) {
    const T* g = dout + t * cols;
    for (int64_t j = 0; j < k; ++j) {
      const int64_t r = pos[t * k + j];
      if (r < 0) {
        dw[t * k + j] = A(0);
        continue;
      }
      const A wj = w[t * k + j];
      const T* row = y + r * cols;
      T* d = dy + r * cols;
      A dot = A(0);
#pragma omp simd reduction(+ : dot)
      for (int64_t c = 0; c < cols; ++c) {
        const A gc = to_acc(g[c]);
        dot += gc * to_acc(row[c]);
        d[c] = from_acc<T>(wj * gc);
      }
      dw[t * k + j] = dot;
    }
  }
}

}  // namespace
}  // namespace mshpc

extern "C" const char* mshpc_moe_permute_fwd_cpu(const void* x, const int64_t* pos, void* xp, int dtype, int64_t tokens,
                                                  int64_t k, int64_t cols, void* /*stream*/) {
  using namespace mshpc;
  bool ok = visit_dtype(dtype, [&](auto t) {
    using T = decltype(t);
    permute_fwd(static_cast<const T*>(x), pos, static_cast<T*>(xp), tokens, k, cols);
  });
  return ok ? nullptr : "moe_permute: unsupported dtype";
}

extern "C" const char* mshpc_moe_permute_bwd_cpu(const void* dxp, const int64_t* pos, void* dx, int dtype,
                                                  int64_t tokens, int64_t k, int64_t cols, void* /*stream*/) {
  using namespace mshpc;
  bool ok = visit_dtype(dtype, [&](auto t) {
    using T = decltype(t);
    permute_bwd(static_cast<const T*>(dxp), pos, static_cast<T*>(dx), tokens, k, cols);
  });
  return ok ? nullptr : "moe_permute backward: unsupported dtype";
}

extern "C" const char* mshpc_moe_unpermute_fwd_cpu(const void* y, const int64_t* pos, const void* w, void* out,
                                                    int dtype, int64_t tokens, int64_t k, int64_t cols,
                                                    void* /*stream*/) {
  using namespace mshpc;
  bool ok = visit_dtype(dtype, [&](auto t) {
    using T = decltype(t);
    unpermute_fwd(static_cast<const T*>(y), pos, static_cast<const acc_t<T>*>(w), static_cast<T*>(out), tokens, k,
                  cols);
  });
  return ok ? nullptr : "moe_unpermute: unsupported dtype";
}

extern "C" const char* mshpc_moe_unpermute_bwd_cpu(const void* dout, const void* y, const int64_t* pos,
                                                    const void* w, void* dy, void* dw, int dtype, int64_t tokens,
                                                    int64_t k, int64_t cols, void* /*stream*/) {
  using namespace mshpc;
  bool ok = visit_dtype(dtype, [&](auto t) {
    using T = decltype(t);
    unpermute_bwd(static_cast<const T*>(dout), static_cast<const T*>(y), pos, static_cast<const acc_t<T>*>(w),
                  static_cast<T*>(dy), static_cast<acc_t<T>*>(dw), tokens, k, cols);
  });
  return ok ? nullptr : "moe_unpermute backward: unsupported dtype";
}

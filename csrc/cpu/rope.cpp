// CPU twin of csrc/cuda/rope.cu: rotary embedding (Su et al. 2021, RoFormer eq. 34) in
// GPT-NeoX's rotate-half pairing, (x[i], x[i + hd/2]), over a strided (b, s, h, hd) input.
#include "dtype.h"

namespace mshpc {
namespace {

template <class T>
void rope(const T* x, T* y, const acc_t<T>* cos, const acc_t<T>* sin, int64_t b, int64_t s,
          int64_t h, int64_t hd, int64_t stride_b, int64_t stride_s, int64_t stride_h, bool inverse) {
  using A = acc_t<T>;
  const int64_t half = hd / 2;
  const A sign = inverse ? A(-1) : A(1);  // R(-theta) = R(theta)^T: the backward
#pragma omp parallel for collapse(2) schedule(static)
  for (int64_t bi = 0; bi < b; ++bi) {
    for (int64_t si = 0; si < s; ++si) {
      const A* c = cos + si * half;
      const A* sn = sin + si * half;
      for (int64_t hi = 0; hi < h; ++hi) {
        const T* xr = x + bi * stride_b + si * stride_s + hi * stride_h;
        T* yr = y + ((bi * s + si) * h + hi) * hd;
#pragma omp simd
        for (int64_t i = 0; i < half; ++i) {
          A x1 = to_acc(xr[i]), x2 = to_acc(xr[i + half]);
          A si_ = sign * sn[i];
          yr[i] = from_acc<T>(x1 * c[i] - x2 * si_);
          yr[i + half] = from_acc<T>(x1 * si_ + x2 * c[i]);
        }
      }
    }
  }
}

}  // namespace
}  // namespace mshpc

extern "C" const char* mshpc_rope_cpu(const void* x, void* y, const void* cos, const void* sin,
                                       int dtype, int64_t b, int64_t s, int64_t h, int64_t hd,
                                       int64_t stride_b, int64_t stride_s, int64_t stride_h,
                                       int inverse, void* /*stream*/) {
  using namespace mshpc;
  if (hd % 2 != 0) return "rope: the head dim must be even";
  bool ok = visit_dtype(dtype, [&](auto t) {
    using T = decltype(t);
    using A = acc_t<T>;
    rope(static_cast<const T*>(x), static_cast<T*>(y), static_cast<const A*>(cos),
         static_cast<const A*>(sin), b, s, h, hd, stride_b, stride_s, stride_h, inverse != 0);
  });
  return ok ? nullptr : "rope: unsupported dtype";
}

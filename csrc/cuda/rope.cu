// Rotary embedding (Su et al. 2021, RoFormer eq. 34) in GPT-NeoX's rotate-half pairing,
// (x[i], x[i + hd/2]), over a strided (b, s, h, hd) input.
//
// A thread rotates V consecutive pairs: 16-byte loads of x[i..i+V) and x[i+hd/2..), 16-byte
// stores of y, the tables' V entries read alongside (small: L1/L2-resident). The (b, s, h)
// position of an item is found by division once per V pairs, in 32 bits whenever the item
// count allows (a 64-bit division is a long instruction sequence on the GPU).
#include "dtype.cuh"

namespace mshpc {
namespace {

constexpr int kThreads = 256;

template <class T, int V, class I>
__global__ void rope_kernel(const T* __restrict__ x, T* __restrict__ y, const acc_t<T>* __restrict__ cos,
                            const acc_t<T>* __restrict__ sin, I items, I s, I h, I half, int64_t stride_b,
                            int64_t stride_s, int64_t stride_h, acc_t<T> sign) {
  using A = acc_t<T>;
  const I per_row = half / V;  // half % V == 0: the launcher's choice of V
  for (I e = I(blockIdx.x) * blockDim.x + threadIdx.x; e < items; e += I(gridDim.x) * blockDim.x) {
    const I i = (e % per_row) * V, row = e / per_row;  // row = (bi * s + si) * h + hi
    const I hi = row % h, rest = row / h, si = rest % s, bi = rest / s;
    const T* xr = x + int64_t(bi) * stride_b + int64_t(si) * stride_s + int64_t(hi) * stride_h;
    T* yr = y + int64_t(row) * 2 * half;
    A x1[V], x2[V], c[V], sn[V];
    load_vec<V>(xr + i, x1);
    load_vec<V>(xr + i + half, x2);
    load_vec<V>(cos + int64_t(si) * half + i, c);
    load_vec<V>(sin + int64_t(si) * half + i, sn);
#pragma unroll
    for (int u = 0; u < V; ++u) {
      const A x1u = x1[u], sgn = sign * sn[u];
      x1[u] = x1u * c[u] - x2[u] * sgn;
      x2[u] = x1u * sgn + x2[u] * c[u];
    }
    store_vec<V>(yr + i, x1);
    store_vec<V>(yr + i + half, x2);
  }
}

template <class T, int V>
void launch(const void* x, void* y, const void* cos, const void* sin, int64_t items, int64_t s, int64_t h,
            int64_t half, int64_t stride_b, int64_t stride_s, int64_t stride_h, acc_t<T> sign, cudaStream_t st) {
  using A = acc_t<T>;
  const auto* xt = static_cast<const T*>(x);
  const auto* ct = static_cast<const A*>(cos);
  const auto* snt = static_cast<const A*>(sin);
  const unsigned grid = stride_grid(items, kThreads);
  if (items < (int64_t(1) << 31)) {  // then e + the grid's stride stays below 2^32: no wrap
    rope_kernel<T, V, uint32_t><<<grid, kThreads, 0, st>>>(xt, static_cast<T*>(y), ct, snt, uint32_t(items), uint32_t(s),
                                                           uint32_t(h), uint32_t(half), stride_b, stride_s, stride_h, sign);
  } else {
    rope_kernel<T, V, int64_t><<<grid, kThreads, 0, st>>>(xt, static_cast<T*>(y), ct, snt, items, s, h, half, stride_b,
                                                          stride_s, stride_h, sign);
  }
}

}  // namespace
}  // namespace mshpc

extern "C" const char* mshpc_rope_cuda(const void* x, void* y, const void* cos, const void* sin,
                                        int dtype, int64_t b, int64_t s, int64_t h, int64_t hd,
                                        int64_t stride_b, int64_t stride_s, int64_t stride_h,
                                        int inverse, void* stream) {
  using namespace mshpc;
  if (hd % 2 != 0) return "rope: the head dim must be even";
  const int64_t half = hd / 2, pairs = b * s * h * half;
  if (pairs == 0) return nullptr;
  const char* err = "rope: unsupported dtype";
  visit_dtype(dtype, [&](auto t) {
    using T = decltype(t);
    using A = acc_t<T>;
    constexpr int V = kVec<T>;
    const auto st = static_cast<cudaStream_t>(stream);
    const A sign = inverse ? A(-1) : A(1);
    // whole aligned vectors: every row start of x (its strides), of y and of the tables
    const bool vec = vec_aligned(x, half, V) && stride_b % V == 0 && stride_s % V == 0 && stride_h % V == 0 &&
                     vec_aligned(y, half, V) && vec_aligned(cos, half, V) && vec_aligned(sin, half, V);
    if (vec) {
      launch<T, V>(x, y, cos, sin, pairs / V, s, h, half, stride_b, stride_s, stride_h, sign, st);
    } else {
      launch<T, 1>(x, y, cos, sin, pairs, s, h, half, stride_b, stride_s, stride_h, sign, st);
    }
    err = launch_error();
  });
  return err;
}

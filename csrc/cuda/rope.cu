// Rotary embedding (Su et al. 2021, RoFormer eq. 34) in GPT-NeoX's rotate-half pairing,
// (x[i], x[i + hd/2]), over a strided (b, s, h, hd) input; one thread per pair.
#include "dtype.cuh"

namespace mshpc {
namespace {

constexpr int kThreads = 256;

template <class T>
__global__ void rope_kernel(const T* x, T* y, const acc_t<T>* cos, const acc_t<T>* sin, int64_t pairs,
                            int64_t s, int64_t h, int64_t half, int64_t stride_b, int64_t stride_s,
                            int64_t stride_h, acc_t<T> sign) {
  using A = acc_t<T>;
  for (int64_t e = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; e < pairs; e += int64_t(gridDim.x) * blockDim.x) {
    const int64_t i = e % half, row = e / half;  // row = (bi * s + si) * h + hi
    const int64_t hi = row % h, si = (row / h) % s, bi = row / (h * s);
    const T* xr = x + bi * stride_b + si * stride_s + hi * stride_h;
    T* yr = y + row * 2 * half;
    const A c = cos[si * half + i], sn = sign * sin[si * half + i];
    const A x1 = to_acc(xr[i]), x2 = to_acc(xr[i + half]);
    yr[i] = from_acc<T>(x1 * c - x2 * sn);
    yr[i + half] = from_acc<T>(x1 * sn + x2 * c);
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
  const int64_t pairs = b * s * h * (hd / 2);
  if (pairs == 0) return nullptr;
  const int64_t blocks = (pairs + kThreads - 1) / kThreads < 65535 * 16 ? (pairs + kThreads - 1) / kThreads : 65535 * 16;
  const char* err = "rope: unsupported dtype";
  visit_dtype(dtype, [&](auto t) {
    using T = decltype(t);
    using A = acc_t<T>;
    rope_kernel<T><<<unsigned(blocks), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
        static_cast<const T*>(x), static_cast<T*>(y), static_cast<const A*>(cos), static_cast<const A*>(sin),
        pairs, s, h, hd / 2, stride_b, stride_s, stride_h, inverse ? A(-1) : A(1));
    err = launch_error();
  });
  return err;
}

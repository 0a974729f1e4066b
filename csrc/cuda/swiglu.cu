// y = silu(gate) * up (Shazeer 2020, "GLU Variants Improve Transformer", eq. 5 with Swish_1 =
// SiLU) from x = [gate | up] along each row, forward and backward.
//
// Memory-bound (a few flops per 2-byte element): rows walked by blockIdx.y and 16-byte column
// groups by blockIdx.x, so every access is a coalesced 128-bit one and no thread divides an
// index; rows whose width or base does not allow whole aligned vectors take V = 1.
#include "dtype.cuh"

namespace mshpc {
namespace {

constexpr int kThreads = 256;

template <class A> __device__ __forceinline__ A sigmoid(A g) { return A(1) / (A(1) + exp(-g)); }

// Row i: gate at x + i * 2 cols, up cols further on, y at i * cols; V columns per step.
template <class T, int V>
__global__ void swiglu_fwd_kernel(const T* __restrict__ x, T* __restrict__ y, int64_t rows, int64_t cols) {
  using A = acc_t<T>;
  const int64_t groups = cols / V;  // cols % V == 0: the launcher's choice of V
  for (int64_t i = blockIdx.y; i < rows; i += gridDim.y) {
    const T* gate = x + i * 2 * cols;
    for (int64_t c = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; c < groups; c += int64_t(gridDim.x) * blockDim.x) {
      A g[V], u[V], out[V];
      load_vec<V>(gate + c * V, g);
      load_vec<V>(gate + cols + c * V, u);
#pragma unroll
      for (int k = 0; k < V; ++k) out[k] = g[k] * sigmoid(g[k]) * u[k];
      store_vec<V>(y + i * cols + c * V, out);
    }
  }
}

// dgate = dy * up * silu'(gate), silu'(g) = sigmoid(g) * (1 + g * (1 - sigmoid(g))); dup = dy * silu(gate).
template <class T, int V>
__global__ void swiglu_bwd_kernel(const T* __restrict__ dy, const T* __restrict__ x, T* __restrict__ dx,
                                  int64_t rows, int64_t cols) {
  using A = acc_t<T>;
  const int64_t groups = cols / V;
  for (int64_t i = blockIdx.y; i < rows; i += gridDim.y) {
    const int64_t g_at = i * 2 * cols;
    for (int64_t c = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; c < groups; c += int64_t(gridDim.x) * blockDim.x) {
      A g[V], u[V], d[V], dg[V], du[V];
      load_vec<V>(x + g_at + c * V, g);
      load_vec<V>(x + g_at + cols + c * V, u);
      load_vec<V>(dy + i * cols + c * V, d);
#pragma unroll
      for (int k = 0; k < V; ++k) {
        A s = sigmoid(g[k]);
        dg[k] = d[k] * u[k] * s * (A(1) + g[k] * (A(1) - s));
        du[k] = d[k] * g[k] * s;
      }
      store_vec<V>(dx + g_at + c * V, dg);
      store_vec<V>(dx + g_at + cols + c * V, du);
    }
  }
}

// Vectors when every row of each pointer starts 16-byte aligned; whole rows either way.
bool vectorised(int64_t cols, int64_t vec, const void* a, const void* b, const void* c = nullptr) {
  return vec_aligned(a, cols, vec) && vec_aligned(b, cols, vec) && (c == nullptr || vec_aligned(c, cols, vec));
}

}  // namespace
}  // namespace mshpc

extern "C" const char* mshpc_swiglu_fwd_cuda(const void* x, void* y, int dtype, int64_t rows, int64_t cols,
                                              void* stream) {
  using namespace mshpc;
  if (rows * cols == 0) return nullptr;
  const char* err = "swiglu: unsupported dtype";
  visit_dtype(dtype, [&](auto t) {
    using T = decltype(t);
    constexpr int V = kVec<T>;
    const auto st = static_cast<cudaStream_t>(stream);
    if (vectorised(cols, V, x, y)) {
      swiglu_fwd_kernel<T, V><<<row_grid(rows, cols / V, kThreads), kThreads, 0, st>>>(
          static_cast<const T*>(x), static_cast<T*>(y), rows, cols);
    } else {
      swiglu_fwd_kernel<T, 1><<<row_grid(rows, cols, kThreads), kThreads, 0, st>>>(
          static_cast<const T*>(x), static_cast<T*>(y), rows, cols);
    }
    err = launch_error();
  });
  return err;
}

extern "C" const char* mshpc_swiglu_bwd_cuda(const void* dy, const void* x, void* dx, int dtype, int64_t rows,
                                              int64_t cols, void* stream) {
  using namespace mshpc;
  if (rows * cols == 0) return nullptr;
  const char* err = "swiglu backward: unsupported dtype";
  visit_dtype(dtype, [&](auto t) {
    using T = decltype(t);
    constexpr int V = kVec<T>;
    const auto st = static_cast<cudaStream_t>(stream);
    if (vectorised(cols, V, dy, x, dx)) {
      swiglu_bwd_kernel<T, V><<<row_grid(rows, cols / V, kThreads), kThreads, 0, st>>>(
          static_cast<const T*>(dy), static_cast<const T*>(x), static_cast<T*>(dx), rows, cols);
    } else {
      swiglu_bwd_kernel<T, 1><<<row_grid(rows, cols, kThreads), kThreads, 0, st>>>(
          static_cast<const T*>(dy), static_cast<const T*>(x), static_cast<T*>(dx), rows, cols);
    }
    err = launch_error();
  });
  return err;
}

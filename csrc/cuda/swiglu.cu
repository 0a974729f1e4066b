// y = silu(gate) * up (Shazeer 2020, "GLU Variants Improve Transformer", eq. 5 with Swish_1 =
// SiLU) from x = [gate | up] along each row, forward and backward.
#include "dtype.cuh"

namespace mshpc {
namespace {

constexpr int kThreads = 256;

template <class A> __device__ __forceinline__ A sigmoid(A g) { return A(1) / (A(1) + exp(-g)); }

// Grid-stride over the (rows, cols) outputs: element e reads gate at row * 2 cols + col and up
// cols further on.
template <class T>
__global__ void swiglu_fwd_kernel(const T* x, T* y, int64_t numel, int64_t cols) {
  using A = acc_t<T>;
  for (int64_t e = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; e < numel; e += int64_t(gridDim.x) * blockDim.x) {
    const int64_t g_at = (e / cols) * 2 * cols + e % cols;
    A g = to_acc(x[g_at]);
    y[e] = from_acc<T>(g * sigmoid(g) * A(to_acc(x[g_at + cols])));
  }
}

// dgate = dy * up * silu'(gate), silu'(g) = sigmoid(g) * (1 + g * (1 - sigmoid(g))); dup = dy * silu(gate).
template <class T>
__global__ void swiglu_bwd_kernel(const T* dy, const T* x, T* dx, int64_t numel, int64_t cols) {
  using A = acc_t<T>;
  for (int64_t e = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; e < numel; e += int64_t(gridDim.x) * blockDim.x) {
    const int64_t g_at = (e / cols) * 2 * cols + e % cols;
    A g = to_acc(x[g_at]), u = to_acc(x[g_at + cols]), d = to_acc(dy[e]);
    A s = sigmoid(g);
    dx[g_at] = from_acc<T>(d * u * s * (A(1) + g * (A(1) - s)));
    dx[g_at + cols] = from_acc<T>(d * g * s);
  }
}

int64_t grid(int64_t numel) {
  const int64_t blocks = (numel + kThreads - 1) / kThreads;
  return blocks < 65535 * 16 ? blocks : 65535 * 16;
}

}  // namespace
}  // namespace mshpc

extern "C" const char* mshpc_swiglu_fwd_cuda(const void* x, void* y, int dtype, int64_t rows, int64_t cols,
                                              void* stream) {
  using namespace mshpc;
  const int64_t numel = rows * cols;
  if (numel == 0) return nullptr;
  const char* err = "swiglu: unsupported dtype";
  visit_dtype(dtype, [&](auto t) {
    using T = decltype(t);
    swiglu_fwd_kernel<T><<<unsigned(grid(numel)), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
        static_cast<const T*>(x), static_cast<T*>(y), numel, cols);
    err = launch_error();
  });
  return err;
}

extern "C" const char* mshpc_swiglu_bwd_cuda(const void* dy, const void* x, void* dx, int dtype, int64_t rows,
                                              int64_t cols, void* stream) {
  using namespace mshpc;
  const int64_t numel = rows * cols;
  if (numel == 0) return nullptr;
  const char* err = "swiglu backward: unsupported dtype";
  visit_dtype(dtype, [&](auto t) {
    using T = decltype(t);
    swiglu_bwd_kernel<T><<<unsigned(grid(numel)), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
        static_cast<const T*>(dy), static_cast<const T*>(x), static_cast<T*>(dx), numel, cols);
    err = launch_error();
  });
  return err;
}

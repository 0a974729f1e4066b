// y = gelu(x + bias) in GPT-2's tanh form, forward and backward (torch's derivative formula).
#include "dtype.cuh"

namespace mshpc {
namespace {

constexpr int kThreads = 256;
constexpr double kBeta = 0.7978845608028654;  // sqrt(2 / pi)
constexpr double kKappa = 0.044715;

template <class A> __device__ __forceinline__ A gelu(A x) {
  return A(0.5) * x * (A(1) + tanh(A(kBeta) * (x + A(kKappa) * x * x * x)));
}

template <class A> __device__ __forceinline__ A gelu_grad(A x) {
  A x2 = x * x;
  A t = tanh(A(kBeta) * (x + A(kKappa) * x2 * x));
  return A(0.5) * (A(1) + t) + A(0.5) * x * (A(1) - t * t) * A(kBeta) * (A(1) + A(3 * kKappa) * x2);
}

// Grid-stride over all elements: the column of element e is e % cols.
template <class T>
__global__ void bias_gelu_fwd_kernel(const T* x, const acc_t<T>* bias, T* y, int64_t numel, int64_t cols) {
  using A = acc_t<T>;
  for (int64_t e = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; e < numel; e += int64_t(gridDim.x) * blockDim.x) {
    A v = to_acc(x[e]);
    y[e] = from_acc<T>(gelu(bias != nullptr ? v + bias[e % cols] : v));
  }
}

// One block per partial-sum block of rows; a thread owns columns j = tid, tid + blockDim...,
// so its bias-gradient sums need no atomics (deterministic).
template <class T>
__global__ void bias_gelu_bwd_kernel(const T* dy, const T* x, const acc_t<T>* bias, T* dx,
                                     acc_t<T>* db_parts, int64_t parts, int64_t rows, int64_t cols) {
  using A = acc_t<T>;
  const int64_t p = blockIdx.x;
  A* db = db_parts != nullptr ? db_parts + p * cols : nullptr;
  for (int64_t j = threadIdx.x; j < cols; j += blockDim.x) {
    A acc = 0;
    for (int64_t i = part_begin(p, parts, rows); i < part_begin(p + 1, parts, rows); ++i) {
      const int64_t e = i * cols + j;
      A v = to_acc(x[e]);
      A d = A(to_acc(dy[e])) * gelu_grad(bias != nullptr ? v + bias[j] : v);
      dx[e] = from_acc<T>(d);
      acc += d;
    }
    if (db != nullptr) db[j] = acc;
  }
}

}  // namespace
}  // namespace mshpc

extern "C" const char* mshpc_bias_gelu_fwd_cuda(const void* x, const void* bias, void* y, int dtype,
                                                 int64_t rows, int64_t cols, void* stream) {
  using namespace mshpc;
  const int64_t numel = rows * cols;
  if (numel == 0) return nullptr;
  const int64_t blocks = (numel + kThreads - 1) / kThreads < 65535 * 16 ? (numel + kThreads - 1) / kThreads : 65535 * 16;
  const char* err = "bias_gelu: unsupported dtype";
  visit_dtype(dtype, [&](auto t) {
    using T = decltype(t);
    bias_gelu_fwd_kernel<T><<<unsigned(blocks), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
        static_cast<const T*>(x), static_cast<const acc_t<T>*>(bias), static_cast<T*>(y), numel, cols);
    err = launch_error();
  });
  return err;
}

extern "C" const char* mshpc_bias_gelu_bwd_cuda(const void* dy, const void* x, const void* bias,
                                                 void* dx, void* dbias_parts, int dtype, int64_t parts,
                                                 int64_t rows, int64_t cols, void* stream) {
  using namespace mshpc;
  if (parts == 0) return nullptr;
  const char* err = "bias_gelu backward: unsupported dtype";
  visit_dtype(dtype, [&](auto t) {
    using T = decltype(t);
    using A = acc_t<T>;
    bias_gelu_bwd_kernel<T><<<unsigned(parts), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
        static_cast<const T*>(dy), static_cast<const T*>(x), static_cast<const A*>(bias),
        static_cast<T*>(dx), static_cast<A*>(dbias_parts), parts, rows, cols);
    err = launch_error();
  });
  return err;
}

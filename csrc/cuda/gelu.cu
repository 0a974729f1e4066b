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

// Column groups of V by blockIdx.x, rows by blockIdx.y (grid-stride both): a thread reads its
// V bias values once, then streams 16-byte vectors of x and y down its column group.
template <class T, int V>
__global__ void bias_gelu_fwd_kernel(const T* __restrict__ x, const acc_t<T>* __restrict__ bias,
                                     T* __restrict__ y, int64_t rows, int64_t cols) {
  using A = acc_t<T>;
  const int64_t groups = cols / V;  // cols % V == 0: the launcher's choice of V
  for (int64_t c = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; c < groups; c += int64_t(gridDim.x) * blockDim.x) {
    A b[V];
#pragma unroll
    for (int k = 0; k < V; ++k) b[k] = bias != nullptr ? bias[c * V + k] : A(0);
    for (int64_t i = blockIdx.y; i < rows; i += gridDim.y) {
      A v[V];
      load_vec<V>(x + i * cols + c * V, v);
#pragma unroll
      for (int k = 0; k < V; ++k) v[k] = gelu(v[k] + b[k]);
      store_vec<V>(y + i * cols + c * V, v);
    }
  }
}

// Rows of a batch in flight per thread in the backward: R independent 16-byte loads of each
// input before the first use, so the few threads of a partial-sum block keep memory busy.
constexpr int kRowsInFlight = 4;

// Block (x, p): one column group of V per thread, rows of partial-sum block p (blockIdx.y) in
// order; its dbias sums stay in registers and go to its own slots of row p of the parts buffer
// (no atomics, the same order every run: deterministic).
template <class T, int V>
__global__ void bias_gelu_bwd_kernel(const T* __restrict__ dy, const T* __restrict__ x,
                                     const acc_t<T>* __restrict__ bias, T* __restrict__ dx,
                                     acc_t<T>* __restrict__ db_parts, int64_t parts, int64_t rows, int64_t cols) {
  using A = acc_t<T>;
  const int64_t c = int64_t(blockIdx.x) * blockDim.x + threadIdx.x, p = blockIdx.y;
  if (c >= cols / V) return;  // no barrier below: a thread past the row may leave
  A b[V], acc[V];
#pragma unroll
  for (int k = 0; k < V; ++k) {
    b[k] = bias != nullptr ? bias[c * V + k] : A(0);
    acc[k] = 0;
  }
  const int64_t end = part_begin(p + 1, parts, rows);
  for (int64_t i = part_begin(p, parts, rows); i < end; i += kRowsInFlight) {
    A d[kRowsInFlight][V], v[kRowsInFlight][V];
#pragma unroll
    for (int r = 0; r < kRowsInFlight; ++r) {
      if (i + r < end) {
        load_vec<V>(dy + (i + r) * cols + c * V, d[r]);
        load_vec<V>(x + (i + r) * cols + c * V, v[r]);
      }
    }
#pragma unroll
    for (int r = 0; r < kRowsInFlight; ++r) {
      if (i + r < end) {
#pragma unroll
        for (int k = 0; k < V; ++k) {
          d[r][k] *= gelu_grad(v[r][k] + b[k]);
          acc[k] += d[r][k];  // rows in order, as the CPU twin sums them
        }
        store_vec<V>(dx + (i + r) * cols + c * V, d[r]);
      }
    }
  }
  if (db_parts != nullptr) {
#pragma unroll
    for (int k = 0; k < V; ++k) db_parts[p * cols + c * V + k] = acc[k];
  }
}

}  // namespace
}  // namespace mshpc

extern "C" const char* mshpc_bias_gelu_fwd_cuda(const void* x, const void* bias, void* y, int dtype,
                                                 int64_t rows, int64_t cols, void* stream) {
  using namespace mshpc;
  if (rows * cols == 0) return nullptr;
  const char* err = "bias_gelu: unsupported dtype";
  visit_dtype(dtype, [&](auto t) {
    using T = decltype(t);
    using A = acc_t<T>;
    constexpr int V = kVec<T>;
    const auto st = static_cast<cudaStream_t>(stream);
    const auto* xt = static_cast<const T*>(x);
    const auto* bt = static_cast<const A*>(bias);
    if (vec_aligned(x, cols, V) && vec_aligned(y, cols, V)) {
      bias_gelu_fwd_kernel<T, V><<<row_grid(rows, cols / V, kThreads), kThreads, 0, st>>>(xt, bt, static_cast<T*>(y), rows, cols);
    } else {
      bias_gelu_fwd_kernel<T, 1><<<row_grid(rows, cols, kThreads), kThreads, 0, st>>>(xt, bt, static_cast<T*>(y), rows, cols);
    }
    err = launch_error();
  });
  return err;
}

extern "C" const char* mshpc_bias_gelu_bwd_cuda(const void* dy, const void* x, const void* bias,
                                                 void* dx, void* dbias_parts, int dtype, int64_t parts,
                                                 int64_t rows, int64_t cols, void* stream) {
  using namespace mshpc;
  if (parts == 0 || cols == 0) return nullptr;
  const char* err = "bias_gelu backward: unsupported dtype";
  visit_dtype(dtype, [&](auto t) {
    using T = decltype(t);
    using A = acc_t<T>;
    constexpr int V = kVec<T>;
    const auto st = static_cast<cudaStream_t>(stream);
    const auto* dyt = static_cast<const T*>(dy);
    const auto* xt = static_cast<const T*>(x);
    const auto* bt = static_cast<const A*>(bias);
    auto* dxt = static_cast<T*>(dx);
    auto* dbt = static_cast<A*>(dbias_parts);
    if (vec_aligned(dy, cols, V) && vec_aligned(x, cols, V) && vec_aligned(dx, cols, V)) {
      const dim3 grid(unsigned((cols / V + kThreads - 1) / kThreads), unsigned(parts));
      bias_gelu_bwd_kernel<T, V><<<grid, kThreads, 0, st>>>(dyt, xt, bt, dxt, dbt, parts, rows, cols);
    } else {
      const dim3 grid(unsigned((cols + kThreads - 1) / kThreads), unsigned(parts));
      bias_gelu_bwd_kernel<T, 1><<<grid, kThreads, 0, st>>>(dyt, xt, bt, dxt, dbt, parts, rows, cols);
    }
    err = launch_error();
  });
  return err;
}

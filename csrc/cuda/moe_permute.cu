// A mixture of experts' tokens into expert order and back (the layout is in
// csrc/mshpc_kernels.h): one thread block per token (grid-stride), its threads over 16-byte
// column groups. A token's block reads and writes only its own rows, so nothing is atomic and
// every sum runs in the same order each time: deterministic, as the CPU twin.
//
// Memory-bound copies and weighted sums; rows whose width or base does not allow whole aligned
// vectors take V = 1.
#include "dtype.cuh"

namespace mshpc {
namespace {

constexpr int kThreads = 256;

template <class T, int V>
__global__ void permute_fwd_kernel(const T* __restrict__ x, const int64_t* __restrict__ pos, T* __restrict__ xp,
                                   int64_t tokens, int64_t k, int64_t cols) {
  using A = acc_t<T>;
  const int64_t groups = cols / V;
  for (int64_t t = blockIdx.x; t < tokens; t += gridDim.x) {
    for (int64_t c = threadIdx.x; c < groups; c += blockDim.x) {
      A v[V];
      load_vec<V>(x + t * cols + c * V, v);
      for (int64_t j = 0; j < k; ++j) {
        const int64_t r = pos[t * k + j];
        if (r >= 0) store_vec<V>(xp + r * cols + c * V, v);
      }
    }
  }
}

// permute_bwd (w == nullptr: every weight 1) and unpermute_fwd: out[t] = sum_j w[t, j] * in[pos[t, j]].
template <class T, int V>
__global__ void gather_sum_kernel(const T* __restrict__ in, const int64_t* __restrict__ pos,
                                  const acc_t<T>* __restrict__ w, T* __restrict__ out, int64_t tokens, int64_t k,
                                  int64_t cols) {
  using A = acc_t<T>;
  const int64_t groups = cols / V;
  for (int64_t t = blockIdx.x; t < tokens; t += gridDim.x) {
    for (int64_t c = threadIdx.x; c < groups; c += blockDim.x) {
      A acc[V];
#pragma unroll
      for (int u = 0; u < V; ++u) acc[u] = A(0);
      for (int64_t j = 0; j < k; ++j) {
        const int64_t r = pos[t * k + j];
        if (r < 0) continue;
        const A wj = w != nullptr ? w[t * k + j] : A(1);
        A v[V];
        load_vec<V>(in + r * cols + c * V, v);
#pragma unroll
        for (int u = 0; u < V; ++u) acc[u] += wj * v[u];
      }
      store_vec<V>(out + t * cols + c * V, acc);
    }
  }
}

// dy[pos[t, j]] = w[t, j] * dout[t] and dw[t, j] = <dout[t], y[pos[t, j]]>, the dot product summed
// per thread, then over the block (block_sum: every thread of the block takes part in it).
template <class T, int V>
__global__ void unpermute_bwd_kernel(const T* __restrict__ dout, const T* __restrict__ y,
                                     const int64_t* __restrict__ pos, const acc_t<T>* __restrict__ w,
                                     T* __restrict__ dy, acc_t<T>* __restrict__ dw, int64_t tokens, int64_t k,
                                     int64_t cols) {
  using A = acc_t<T>;
  const int64_t groups = cols / V;
  for (int64_t t = blockIdx.x; t < tokens; t += gridDim.x) {
    for (int64_t j = 0; j < k; ++j) {
      const int64_t r = pos[t * k + j];
      if (r < 0) {  // uniform over the block: r depends on (t, j) only
        if (threadIdx.x == 0) dw[t * k + j] = A(0);
        continue;
      }
      const A wj = w[t * k + j];
      A dot = A(0);
      for (int64_t c = threadIdx.x; c < groups; c += blockDim.x) {
        A g[V], v[V], d[V];
        load_vec<V>(dout + t * cols + c * V, g);
        load_vec<V>(y + r * cols + c * V, v);
#pragma unroll
        for (int u = 0; u < V; ++u) {
          dot += g[u] * v[u];
          d[u] = wj * g[u];
        }
        store_vec<V>(dy + r * cols + c * V, d);
      }
      dot = block_sum(dot);
      if (threadIdx.x == 0) dw[t * k + j] = dot;
    }
  }
}

template <class T> bool vectorised(int64_t cols, const void* a, const void* b, const void* c = nullptr) {
  constexpr int V = kVec<T>;
  return vec_aligned(a, cols, V) && vec_aligned(b, cols, V) && (c == nullptr || vec_aligned(c, cols, V));
}

unsigned token_grid(int64_t tokens) { return stride_grid(tokens * kThreads, kThreads); }

}  // namespace
}  // namespace mshpc

extern "C" const char* mshpc_moe_permute_fwd_cuda(const void* x, const int64_t* pos, void* xp, int dtype,
                                                   int64_t tokens, int64_t k, int64_t cols, void* stream) {
  using namespace mshpc;
  if (tokens * k * cols == 0) return nullptr;
  const char* err = "moe_permute: unsupported dtype";
  visit_dtype(dtype, [&](auto t) {
    using T = decltype(t);
    const auto st = static_cast<cudaStream_t>(stream);
    const T* in = static_cast<const T*>(x);
    T* out = static_cast<T*>(xp);
    if (vectorised<T>(cols, in, out)) {
      permute_fwd_kernel<T, kVec<T>><<<token_grid(tokens), kThreads, 0, st>>>(in, pos, out, tokens, k, cols);
    } else {
      permute_fwd_kernel<T, 1><<<token_grid(tokens), kThreads, 0, st>>>(in, pos, out, tokens, k, cols);
    }
    err = launch_error();
  });
  return err;
}

namespace {
const char* gather_sum(const void* in_p, const int64_t* pos, const void* w, void* out_p, int dtype, int64_t tokens,
                       int64_t k, int64_t cols, void* stream, const char* unsupported) {
  using namespace mshpc;
  if (tokens * cols == 0) return nullptr;
  const char* err = unsupported;
  visit_dtype(dtype, [&](auto t) {
    using T = decltype(t);
    using A = acc_t<T>;
    const auto st = static_cast<cudaStream_t>(stream);
    const T* in = static_cast<const T*>(in_p);
    const A* wt = static_cast<const A*>(w);
    T* out = static_cast<T*>(out_p);
    if (vectorised<T>(cols, in, out)) {
      gather_sum_kernel<T, kVec<T>><<<token_grid(tokens), kThreads, 0, st>>>(in, pos, wt, out, tokens, k, cols);
    } else {
      gather_sum_kernel<T, 1><<<token_grid(tokens), kThreads, 0, st>>>(in, pos, wt, out, tokens, k, cols);
    }
    err = launch_error();
  });
  return err;
}
}  // namespace

extern "C" const char* mshpc_moe_permute_bwd_cuda(const void* dxp, const int64_t* pos, void* dx, int dtype,
                                                   int64_t tokens, int64_t k, int64_t cols, void* stream) {
  return gather_sum(dxp, pos, nullptr, dx, dtype, tokens, k, cols, stream, "moe_permute backward: unsupported dtype");
}

extern "C" const char* mshpc_moe_unpermute_fwd_cuda(const void* y, const int64_t* pos, const void* w, void* out,
                                                     int dtype, int64_t tokens, int64_t k, int64_t cols,
                                                     void* stream) {
  return gather_sum(y, pos, w, out, dtype, tokens, k, cols, stream, "moe_unpermute: unsupported dtype");
}

extern "C" const char* mshpc_moe_unpermute_bwd_cuda(const void* dout, const void* y, const int64_t* pos,
                                                     const void* w, void* dy, void* dw, int dtype, int64_t tokens,
                                                     int64_t k, int64_t cols, void* stream) {
  using namespace mshpc;
  if (tokens * k == 0) return nullptr;
  const char* err = "moe_unpermute backward: unsupported dtype";
  visit_dtype(dtype, [&](auto t) {
    using T = decltype(t);
    using A = acc_t<T>;
    const auto st = static_cast<cudaStream_t>(stream);
    const T* g = static_cast<const T*>(dout);
    const T* in = static_cast<const T*>(y);
    T* d = static_cast<T*>(dy);
    const A* wt = static_cast<const A*>(w);
    A* dwt = static_cast<A*>(dw);
    if (vectorised<T>(cols, g, in, d)) {
      unpermute_bwd_kernel<T, kVec<T>><<<token_grid(tokens), kThreads, 0, st>>>(g, in, pos, wt, d, dwt, tokens, k, cols);
    } else {
      unpermute_bwd_kernel<T, 1><<<token_grid(tokens), kThreads, 0, st>>>(g, in, pos, wt, d, dwt, tokens, k, cols);
    }
    err = launch_error();
  });
  return err;
}

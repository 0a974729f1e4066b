// Storage types of the CUDA kernels and their conversions to the accumulation type. Plain
// CUDA headers only: this folder is compile-checked with nvcc where torch's are unavailable.
#ifndef MSHPC_CUDA_DTYPE_CUH
#define MSHPC_CUDA_DTYPE_CUH

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>
#include <string.h>

#include "../mshpc_kernels.h"

namespace mshpc {

template <class T> struct acc_of { using type = float; };
template <> struct acc_of<double> { using type = double; };
template <class T> using acc_t = typename acc_of<T>::type;

__device__ __forceinline__ float to_acc(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float to_acc(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_acc(float v) { return v; }
__device__ __forceinline__ double to_acc(double v) { return v; }

template <class T> __device__ __forceinline__ T from_acc(acc_t<T> v);
template <> __device__ __forceinline__ __nv_bfloat16 from_acc<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }
template <> __device__ __forceinline__ __half from_acc<__half>(float v) { return __float2half_rn(v); }
template <> __device__ __forceinline__ float from_acc<float>(float v) { return v; }
template <> __device__ __forceinline__ double from_acc<double>(double v) { return v; }

// Calls f(T{}) with T the storage type of `dtype`; false for an unknown code.
template <class F> bool visit_dtype(int dtype, F&& f) {
  switch (dtype) {
    case MSHPC_F32: f(float{}); return true;
    case MSHPC_F64: f(double{}); return true;
    case MSHPC_BF16: f(__nv_bfloat16{}); return true;
    case MSHPC_F16: f(__half{}); return true;
  }
  return false;
}

// Rows [part_begin(p), part_begin(p + 1)) form partial-sum block p (the CPU twin's blocks).
__host__ __device__ __forceinline__ int64_t part_begin(int64_t part, int64_t parts, int64_t rows) {
  return rows * part / parts;
}

// Sum of v over the block (blockDim.x a multiple of 32, at most 1024); every thread gets it.
template <class A> __device__ A block_sum(A v) {
  __shared__ A warp_sums[32];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  for (int o = 16; o > 0; o /= 2) v += __shfl_xor_sync(0xffffffffu, v, o);
  __syncthreads();  // warp_sums may still be read by a previous call
  if (lane == 0) warp_sums[warp] = v;
  __syncthreads();
  v = lane < blockDim.x / 32 ? warp_sums[lane] : A(0);
  for (int o = 16; o > 0; o /= 2) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// Elements of T in one 16-byte access (LDG.128/STG.128: a quarter of a warp's 512-byte request
// per instruction, four times fewer instructions than 4-byte accesses for fp32, eight for bf16).
template <class T> constexpr int kVec = 16 / int(sizeof(T));

// Whether every 16-byte vector of a tensor lies aligned: the base 16-byte aligned (torch's
// allocations are, a view's offset may not be) and each row a whole number of vectors.
inline bool vec_aligned(const void* p, int64_t row_elems, int64_t vec) {
  return reinterpret_cast<uintptr_t>(p) % 16 == 0 && row_elems % vec == 0;
}

// Loads V consecutive elements from p into out, as 16-byte accesses when V elements of T make
// whole 16-byte vectors (the caller guarantees p is then 16-byte aligned), else one by one.
template <int V, class T>
__device__ __forceinline__ void load_vec(const T* __restrict__ p, acc_t<T> (&out)[V]) {
  if constexpr ((V * sizeof(T)) % 16 == 0) {
    constexpr int per = 16 / int(sizeof(T));
#pragma unroll
    for (int q = 0; q < V / per; ++q) {
      uint4 raw = reinterpret_cast<const uint4*>(p)[q];
      T e[per];
      memcpy(e, &raw, 16);
#pragma unroll
      for (int u = 0; u < per; ++u) out[q * per + u] = to_acc(e[u]);
    }
  } else {
#pragma unroll
    for (int u = 0; u < V; ++u) out[u] = to_acc(p[u]);
  }
}

// Stores V values (rounded once to T) at p; 16-byte accesses as load_vec.
template <int V, class T>
__device__ __forceinline__ void store_vec(T* __restrict__ p, const acc_t<T> (&in)[V]) {
  if constexpr ((V * sizeof(T)) % 16 == 0) {
    constexpr int per = 16 / int(sizeof(T));
#pragma unroll
    for (int q = 0; q < V / per; ++q) {
      T e[per];
#pragma unroll
      for (int u = 0; u < per; ++u) e[u] = from_acc<T>(in[q * per + u]);
      uint4 raw;
      memcpy(&raw, e, 16);
      reinterpret_cast<uint4*>(p)[q] = raw;
    }
  } else {
#pragma unroll
    for (int u = 0; u < V; ++u) p[u] = from_acc<T>(in[u]);
  }
}

// Multiprocessors of the current device (the launchers run with the tensors' device current).
inline int sm_count() {
  int dev = 0, sms = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess) {
    return 132;  // an H100/H200's count: a grid size only, never a correctness matter
  }
  return sms;
}

// Blocks for a grid-stride loop over `work` items, `threads` per block: enough to keep every
// multiprocessor full (2048 resident threads each on sm_80/sm_90), no more than the work needs.
inline unsigned stride_grid(int64_t work, int threads) {
  const int64_t full = int64_t(sm_count()) * (2048 / threads), need = (work + threads - 1) / threads;
  return unsigned(need < full ? (need > 0 ? need : 1) : full);
}

// Grid for kernels that walk rows with blockIdx.y and `groups` column groups per row with
// blockIdx.x (both grid-stride, so no per-element division): x just covers a row, y fills the
// device with rows (at most 65,535 rows in flight; the loop takes the rest).
inline dim3 row_grid(int64_t rows, int64_t groups, int threads) {
  const int64_t full = int64_t(sm_count()) * (2048 / threads);
  int64_t gx = (groups + threads - 1) / threads;
  gx = gx < 1 ? 1 : (gx < full ? gx : full);
  int64_t gy = full / gx;
  gy = gy < 1 ? 1 : (gy < rows ? gy : rows);
  return dim3(unsigned(gx), unsigned(gy < 65535 ? gy : 65535));
}

inline const char* launch_error() {
  cudaError_t err = cudaGetLastError();
  return err == cudaSuccess ? nullptr : cudaGetErrorString(err);
}

}  // namespace mshpc

#endif

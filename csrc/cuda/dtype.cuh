// Storage types of the CUDA kernels and their conversions to the accumulation type. Plain
// CUDA headers only: this folder is compile-checked with nvcc where torch's are unavailable.
#ifndef MSHPC_CUDA_DTYPE_CUH
#define MSHPC_CUDA_DTYPE_CUH

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

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

inline const char* launch_error() {
  cudaError_t err = cudaGetLastError();
  return err == cudaSuccess ? nullptr : cudaGetErrorString(err);
}

}  // namespace mshpc

#endif

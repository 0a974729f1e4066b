// Multi-tensor AdamW and LAMB: one launch over every chunk of every tensor in a table (the
// layout is in mshpc_kernels.h); each block finds its tensor by binary search over the chunk
// offsets, so the tensor count is unbounded and no per-launch argument list limits it.
#include "dtype.cuh"

namespace mshpc {
namespace {

constexpr int kThreads = 512;

struct Chunk {
  int64_t tensor, first, count;
};

__device__ Chunk find_chunk(const int64_t* table, int64_t n, int64_t c, int64_t chunk_numel) {
  const int64_t* numel = table + 4 * n;
  const int64_t* begin = table + 5 * n;
  int64_t lo = 0, hi = n - 1;
  while (lo < hi) {
    int64_t mid = (lo + hi + 1) / 2;
    if (begin[mid] <= c) lo = mid; else hi = mid - 1;
  }
  const int64_t first = (c - begin[lo]) * chunk_numel;
  return Chunk{lo, first, min(numel[lo] - first, chunk_numel)};
}

template <int slot> __device__ __forceinline__ float* ptr(const int64_t* table, int64_t t) {
  return reinterpret_cast<float*>(table[4 * t + slot]);
}

// One element's AdamW step, in the lerp form torch uses for the first moment.
struct AdamWStep {
  float b1, b2, omb2, bc2_sqrt, eps, step, decay;
  __device__ __forceinline__ void operator()(float& p, float g, float& m, float& v) const {
    m = m + b1 * (g - m);
    v = v * b2 + omb2 * g * g;
    p = p * decay - step * (m / (sqrtf(v) / bc2_sqrt + eps));
  }
};

// 16-byte accesses (four elements a thread a step) when the chunk's four tensors start 16-byte
// aligned (a chunk's first element is a multiple of chunk_numel, so the tensors' bases decide;
// the test is uniform over the block), then the chunk's last count % 4 elements one by one.
__global__ void adamw_kernel(const int64_t* table, const float* step_and_decay, int64_t n,
                             int64_t chunk_numel, float b1, float b2, float omb2, float bc2_sqrt, float eps) {
  const Chunk k = find_chunk(table, n, blockIdx.x, chunk_numel);
  float* p = ptr<0>(table, k.tensor) + k.first;
  const float* g = ptr<1>(table, k.tensor) + k.first;
  float* m = ptr<2>(table, k.tensor) + k.first;
  float* v = ptr<3>(table, k.tensor) + k.first;
  const AdamWStep op{b1, b2, omb2, bc2_sqrt, eps, step_and_decay[2 * k.tensor], step_and_decay[2 * k.tensor + 1]};
  const uintptr_t bases = reinterpret_cast<uintptr_t>(p) | reinterpret_cast<uintptr_t>(g) |
                          reinterpret_cast<uintptr_t>(m) | reinterpret_cast<uintptr_t>(v);
  const int64_t vectors = bases % 16 == 0 ? k.count / 4 : 0;
  for (int64_t q = threadIdx.x; q < vectors; q += blockDim.x) {
    float4 pq = reinterpret_cast<const float4*>(p)[q], gq = reinterpret_cast<const float4*>(g)[q];
    float4 mq = reinterpret_cast<const float4*>(m)[q], vq = reinterpret_cast<const float4*>(v)[q];
    op(pq.x, gq.x, mq.x, vq.x);
    op(pq.y, gq.y, mq.y, vq.y);
    op(pq.z, gq.z, mq.z, vq.z);
    op(pq.w, gq.w, mq.w, vq.w);
    reinterpret_cast<float4*>(m)[q] = mq;
    reinterpret_cast<float4*>(v)[q] = vq;
    reinterpret_cast<float4*>(p)[q] = pq;
  }
  for (int64_t j = 4 * vectors + threadIdx.x; j < k.count; j += blockDim.x) op(p[j], g[j], m[j], v[j]);
}

__global__ void lamb_direction_kernel(const int64_t* table, const float* weight_decay, int64_t n,
                                      int64_t chunk_numel, float b1, float omb1, float b2, float omb2,
                                      float bc1, float bc2, float eps, float* chunk_norms) {
  const Chunk k = find_chunk(table, n, blockIdx.x, chunk_numel);
  const float* p = ptr<0>(table, k.tensor) + k.first;
  float* g = ptr<1>(table, k.tensor) + k.first;
  float* m = ptr<2>(table, k.tensor) + k.first;
  float* v = ptr<3>(table, k.tensor) + k.first;
  const float wd = weight_decay[k.tensor];
  float w2 = 0, r2 = 0;
  for (int64_t j = threadIdx.x; j < k.count; j += blockDim.x) {
    float mj = m[j] * b1 + g[j] * omb1;
    float vj = v[j] * b2 + g[j] * g[j] * omb2;
    m[j] = mj;
    v[j] = vj;
    float r = (mj / bc1) / (sqrtf(vj / bc2) + eps) + wd * p[j];
    g[j] = r;
    w2 += p[j] * p[j];
    r2 += r * r;
  }
  w2 = block_sum(w2);
  r2 = block_sum(r2);
  if (threadIdx.x == 0) {
    chunk_norms[2 * blockIdx.x] = w2;
    chunk_norms[2 * blockIdx.x + 1] = r2;
  }
}

// One thread per tensor sums its chunks in order: the norms do not depend on scheduling.
__global__ void sum_chunk_norms_kernel(const int64_t* table, int64_t n, const float* chunk_norms, float* norms) {
  const int64_t t = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (t >= n) return;
  const int64_t* begin = table + 5 * n;
  float w2 = 0, r2 = 0;
  for (int64_t c = begin[t]; c < begin[t + 1]; ++c) {
    w2 += chunk_norms[2 * c];
    r2 += chunk_norms[2 * c + 1];
  }
  norms[2 * t] = w2;
  norms[2 * t + 1] = r2;
}

__global__ void lamb_apply_kernel(const int64_t* table, const float* scale, int64_t n, int64_t chunk_numel) {
  const Chunk k = find_chunk(table, n, blockIdx.x, chunk_numel);
  float* p = ptr<0>(table, k.tensor) + k.first;
  const float* r = ptr<1>(table, k.tensor) + k.first;
  const float s = scale[k.tensor];
  for (int64_t j = threadIdx.x; j < k.count; j += blockDim.x) p[j] -= s * r[j];
}

}  // namespace
}  // namespace mshpc

extern "C" const char* mshpc_adamw_cuda(const int64_t* table, const float* step_and_decay, int64_t n,
                                         int64_t n_chunks, int64_t chunk_numel, double beta1, double beta2,
                                         double eps, double bias_correction2, void* stream) {
  if (n_chunks == 0) return nullptr;
  mshpc::adamw_kernel<<<unsigned(n_chunks), mshpc::kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      table, step_and_decay, n, chunk_numel, float(1 - beta1), float(beta2), float(1 - beta2),
      float(sqrt(bias_correction2)), float(eps));
  return mshpc::launch_error();
}

extern "C" const char* mshpc_lamb_direction_cuda(const int64_t* table, const float* weight_decay,
                                                  int64_t n, int64_t n_chunks, int64_t chunk_numel,
                                                  double beta1, double beta2, double eps,
                                                  double bias_correction1, double bias_correction2,
                                                  float* chunk_norms, float* norms, void* stream) {
  if (n == 0) return nullptr;
  cudaStream_t st = static_cast<cudaStream_t>(stream);
  if (n_chunks > 0) {
    mshpc::lamb_direction_kernel<<<unsigned(n_chunks), mshpc::kThreads, 0, st>>>(
        table, weight_decay, n, chunk_numel, float(beta1), float(1 - beta1), float(beta2), float(1 - beta2),
        float(bias_correction1), float(bias_correction2), float(eps), chunk_norms);
  }
  mshpc::sum_chunk_norms_kernel<<<unsigned((n + 255) / 256), 256, 0, st>>>(table, n, chunk_norms, norms);
  return mshpc::launch_error();
}

extern "C" const char* mshpc_lamb_apply_cuda(const int64_t* table, const float* scale, int64_t n,
                                              int64_t n_chunks, int64_t chunk_numel, void* stream) {
  if (n_chunks == 0) return nullptr;
  mshpc::lamb_apply_kernel<<<unsigned(n_chunks), mshpc::kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      table, scale, n, chunk_numel);
  return mshpc::launch_error();
}

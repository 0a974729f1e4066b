// CPU twin of csrc/cuda/optim.cu: multi-tensor AdamW and LAMB over a table of fp32 tensors,
// one parallel loop over all tensors' chunks (the CUDA version: one launch).
#include <cmath>

#include "dtype.h"

namespace mshpc {
namespace {

// A view of the table described in mshpc_kernels.h.
struct Table {
  const int64_t* t;
  int64_t n;
  float* param(int64_t i) const { return reinterpret_cast<float*>(t[4 * i]); }
  float* grad(int64_t i) const { return reinterpret_cast<float*>(t[4 * i + 1]); }
  float* exp_avg(int64_t i) const { return reinterpret_cast<float*>(t[4 * i + 2]); }
  float* exp_avg_sq(int64_t i) const { return reinterpret_cast<float*>(t[4 * i + 3]); }
  int64_t numel(int64_t i) const { return t[4 * n + i]; }
  int64_t chunk_begin(int64_t i) const { return t[5 * n + i]; }
};

// Calls f(tensor, first element, element count) for every chunk, in parallel over chunks.
template <class F> void for_each_chunk(const Table& tab, int64_t n_chunks, int64_t chunk_numel, F&& f) {
#pragma omp parallel for schedule(dynamic, 4)
  for (int64_t c = 0; c < n_chunks; ++c) {
    int64_t lo = 0, hi = tab.n - 1;  // the tensor whose chunk range holds c
    while (lo < hi) {
      int64_t mid = (lo + hi + 1) / 2;
      if (tab.chunk_begin(mid) <= c) lo = mid; else hi = mid - 1;
    }
    int64_t first = (c - tab.chunk_begin(lo)) * chunk_numel;
    int64_t count = tab.numel(lo) - first < chunk_numel ? tab.numel(lo) - first : chunk_numel;
    f(lo, c, first, count);
  }
}

}  // namespace
}  // namespace mshpc

using mshpc::Table;

extern "C" const char* mshpc_adamw_cpu(const int64_t* table, const float* step_and_decay, int64_t n,
                                        int64_t n_chunks, int64_t chunk_numel, double beta1, double beta2,
                                        double eps, double bias_correction2, void* /*stream*/) {
  const Table tab{table, n};
  // torch.optim.AdamW's order: decay the weight, lerp m, update v, then
  // p -= lr / bc1 * m / (sqrt(v) / sqrt(bc2) + eps)
  const float b1 = float(1 - beta1), b2 = float(beta2), omb2 = float(1 - beta2);
  const float bc2_sqrt = float(std::sqrt(bias_correction2)), epsf = float(eps);
  mshpc::for_each_chunk(tab, n_chunks, chunk_numel, [&](int64_t t, int64_t, int64_t first, int64_t count) {
    float* p = tab.param(t) + first;
    const float* g = tab.grad(t) + first;
    float* m = tab.exp_avg(t) + first;
    float* v = tab.exp_avg_sq(t) + first;
    const float step = step_and_decay[2 * t], decay = step_and_decay[2 * t + 1];
#pragma omp simd
    for (int64_t j = 0; j < count; ++j) {
      float pj = p[j] * decay;
      float mj = m[j] + b1 * (g[j] - m[j]);
      float vj = v[j] * b2 + omb2 * g[j] * g[j];
      m[j] = mj;
      v[j] = vj;
      p[j] = pj - step * (mj / (std::sqrt(vj) / bc2_sqrt + epsf));
    }
  });
  return nullptr;
}

extern "C" const char* mshpc_lamb_direction_cpu(const int64_t* table, const float* weight_decay,
                                                 int64_t n, int64_t n_chunks, int64_t chunk_numel,
                                                 double beta1, double beta2, double eps,
                                                 double bias_correction1, double bias_correction2,
                                                 float* chunk_norms, float* norms, void* /*stream*/) {
  const Table tab{table, n};
  const float b1 = float(beta1), omb1 = float(1 - beta1), b2 = float(beta2), omb2 = float(1 - beta2);
  const float bc1 = float(bias_correction1), bc2 = float(bias_correction2), epsf = float(eps);
  mshpc::for_each_chunk(tab, n_chunks, chunk_numel, [&](int64_t t, int64_t c, int64_t first, int64_t count) {
    const float* p = tab.param(t) + first;
    float* g = tab.grad(t) + first;
    float* m = tab.exp_avg(t) + first;
    float* v = tab.exp_avg_sq(t) + first;
    const float wd = weight_decay[t];
    float w2 = 0, r2 = 0;
#pragma omp simd reduction(+ : w2, r2)
    for (int64_t j = 0; j < count; ++j) {
      float mj = m[j] * b1 + g[j] * omb1;
      float vj = v[j] * b2 + g[j] * g[j] * omb2;
      m[j] = mj;
      v[j] = vj;
      float r = (mj / bc1) / (std::sqrt(vj / bc2) + epsf) + wd * p[j];
      g[j] = r;
      w2 += p[j] * p[j];
      r2 += r * r;
    }
    chunk_norms[2 * c] = w2;
    chunk_norms[2 * c + 1] = r2;
  });
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < n; ++t) {
    float w2 = 0, r2 = 0;
    for (int64_t c = tab.chunk_begin(t); c < tab.chunk_begin(t + 1); ++c) {
      w2 += chunk_norms[2 * c];
      r2 += chunk_norms[2 * c + 1];
    }
    norms[2 * t] = w2;
    norms[2 * t + 1] = r2;
  }
  return nullptr;
}

extern "C" const char* mshpc_lamb_apply_cpu(const int64_t* table, const float* scale, int64_t n,
                                             int64_t n_chunks, int64_t chunk_numel, void* /*stream*/) {
  const Table tab{table, n};
  mshpc::for_each_chunk(tab, n_chunks, chunk_numel, [&](int64_t t, int64_t, int64_t first, int64_t count) {
    float* p = tab.param(t) + first;
    const float* r = tab.grad(t) + first;
    const float s = scale[t];
#pragma omp simd
    for (int64_t j = 0; j < count; ++j) p[j] -= s * r[j];
  });
  return nullptr;
}

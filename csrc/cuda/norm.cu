// Fused residual add + RMSNorm/LayerNorm, forward and backward; one block per row. The row's
// passes re-read it from L1/L2 rather than holding it in registers, which serves any width.
#include <type_traits>

#include "dtype.cuh"

namespace mshpc {
namespace {

constexpr int kThreads = 256;

template <class TX, class T>
__global__ void add_norm_fwd_kernel(const TX* x, const T* r, const acc_t<T>* w, const acc_t<T>* b,
                                    T* sum, T* y, acc_t<T>* mean_out, acc_t<T>* rstd_out,
                                    int64_t cols, double eps, bool rms) {
  using A = acc_t<T>;
  const int64_t o = int64_t(blockIdx.x) * cols;
  const T* s = r != nullptr ? sum + o : reinterpret_cast<const T*>(x + o);
  A s1 = 0, s2 = 0;
  for (int64_t j = threadIdx.x; j < cols; j += blockDim.x) {
    A a;
    if (r != nullptr) {
      T v = from_acc<T>(A(to_acc(x[o + j])) + to_acc(r[o + j]));  // statistics of the stored sum
      sum[o + j] = v;
      a = to_acc(v);
    } else {
      a = to_acc(x[o + j]);
    }
    s1 += a;
    s2 += a * a;
  }
  s1 = block_sum(s1);
  s2 = block_sum(s2);
  A mean = 0, var;
  if (rms) {
    var = s2 / A(cols);
  } else {
    mean = s1 / A(cols);
    A sq = 0;  // two-pass variance, stable where E[x^2] - mean^2 is not; each thread re-reads
    for (int64_t j = threadIdx.x; j < cols; j += blockDim.x) {  // what it wrote
      A d = to_acc(s[j]) - mean;
      sq += d * d;
    }
    var = block_sum(sq) / A(cols);
  }
  const A rstd = A(1) / sqrt(var + A(eps));
  for (int64_t j = threadIdx.x; j < cols; j += blockDim.x) {
    A v = (to_acc(s[j]) - mean) * rstd * w[j];
    y[o + j] = from_acc<T>(b != nullptr ? v + b[j] : v);
  }
  if (threadIdx.x == 0) {
    if (mean_out != nullptr) mean_out[blockIdx.x] = mean;
    rstd_out[blockIdx.x] = rstd;
  }
}

// One block per partial-sum block of rows: dx row by row, and this block's (cols,) share of
// dweight/dbias accumulated in its own row of the parts buffers (no atomics: deterministic).
template <class T>
__global__ void add_norm_bwd_kernel(const T* dy, const T* dsum, const T* s, const acc_t<T>* w,
                                    const acc_t<T>* mean, const acc_t<T>* rstd, T* dx,
                                    acc_t<T>* dw_parts, acc_t<T>* db_parts, int64_t parts,
                                    int64_t rows, int64_t cols, bool rms) {
  using A = acc_t<T>;
  const int64_t p = blockIdx.x;
  A* dw = dw_parts + p * cols;
  A* db = rms ? nullptr : db_parts + p * cols;
  for (int64_t j = threadIdx.x; j < cols; j += blockDim.x) {
    dw[j] = 0;
    if (db != nullptr) db[j] = 0;
  }
  for (int64_t i = part_begin(p, parts, rows); i < part_begin(p + 1, parts, rows); ++i) {
    const int64_t o = i * cols;
    const A mu = rms ? A(0) : mean[i], rs = rstd[i];
    A sum_g = 0, sum_gx = 0;
    for (int64_t j = threadIdx.x; j < cols; j += blockDim.x) {
      A g = A(to_acc(dy[o + j])) * w[j];
      sum_g += g;
      sum_gx += g * (to_acc(s[o + j]) - mu) * rs;
    }
    const A mg = rms ? A(0) : block_sum(sum_g) / A(cols);
    const A mgx = block_sum(sum_gx) / A(cols);
    for (int64_t j = threadIdx.x; j < cols; j += blockDim.x) {
      A d = to_acc(dy[o + j]);
      A xhat = (to_acc(s[o + j]) - mu) * rs;
      A v = rs * (d * w[j] - mg - xhat * mgx);
      dx[o + j] = from_acc<T>(dsum != nullptr ? v + to_acc(dsum[o + j]) : v);
      dw[j] += d * xhat;  // column j is only ever touched by this thread of this block
      if (db != nullptr) db[j] += d;
    }
  }
}

}  // namespace
}  // namespace mshpc

extern "C" const char* mshpc_add_norm_fwd_cuda(const void* x, int x_dtype, const void* residual,
                                                int dtype, const void* weight, const void* bias,
                                                void* sum, void* y, void* mean, void* rstd,
                                                int64_t rows, int64_t cols, double eps, int rms,
                                                void* stream) {
  using namespace mshpc;
  if (residual == nullptr && x_dtype != dtype) return "add_norm: without a residual x must have the output dtype";
  if (rows == 0) return nullptr;
  const char* err = "add_norm: unsupported dtype";
  visit_dtype(dtype, [&](auto t) {
    using T = decltype(t);
    using A = acc_t<T>;
    visit_dtype(x_dtype, [&](auto tx) {
      using TX = decltype(tx);
      if constexpr (std::is_same<acc_t<TX>, A>::value) {
        add_norm_fwd_kernel<TX, T><<<unsigned(rows), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
            static_cast<const TX*>(x), static_cast<const T*>(residual), static_cast<const A*>(weight),
            static_cast<const A*>(bias), static_cast<T*>(sum), static_cast<T*>(y), static_cast<A*>(mean),
            static_cast<A*>(rstd), cols, eps, rms != 0);
        err = launch_error();
      }
    });
  });
  return err;
}

extern "C" const char* mshpc_add_norm_bwd_cuda(const void* dy, const void* dsum, const void* s,
                                                int dtype, const void* weight, const void* mean,
                                                const void* rstd, void* dx, void* dweight_parts,
                                                void* dbias_parts, int64_t parts, int64_t rows,
                                                int64_t cols, int rms, void* stream) {
  using namespace mshpc;
  if (parts == 0) return nullptr;
  const char* err = "add_norm backward: unsupported dtype";
  visit_dtype(dtype, [&](auto t) {
    using T = decltype(t);
    using A = acc_t<T>;
    add_norm_bwd_kernel<T><<<unsigned(parts), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
        static_cast<const T*>(dy), static_cast<const T*>(dsum), static_cast<const T*>(s),
        static_cast<const A*>(weight), static_cast<const A*>(mean), static_cast<const A*>(rstd),
        static_cast<T*>(dx), static_cast<A*>(dweight_parts), static_cast<A*>(dbias_parts), parts, rows,
        cols, rms != 0);
    err = launch_error();
  });
  return err;
}

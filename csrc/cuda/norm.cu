// Fused residual add + RMSNorm/LayerNorm, forward and backward.
//
// Rows of up to 8,192 columns (fp32, bf16, fp16; 4,096 fp64) that are whole 16-byte vectors live
// in registers: each thread loads its few 16-byte vectors of a row at once (all of a row's bytes
// in flight together), and the statistics' second pass and the output read
// them there, so each tensor crosses HBM exactly once. The block is sized to the row (a warp for
// narrow rows, so narrow rows get many blocks per multiprocessor). Wider rows, rows that are not
// whole aligned vectors at V = 1 either, and an x whose dtype differs from the output's take the
// general kernels below them, which re-read the row from L1/L2 and serve any width.
#include <initializer_list>
#include <tuple>
#include <type_traits>

#include "dtype.cuh"

namespace mshpc {
namespace {

constexpr int kThreads = 256;

constexpr int kPacks = 4;         // vectors of a row per thread in the forward, held in registers
constexpr int kMaxThreads = 512;  // threads per row at most (so at most 128 registers each)
// The backward holds five arrays of a thread's values (dy, xhat, dsum, dweight, dbias) besides
// the weight: 2-byte types (8 to a vector) hold 2 vectors so that all fit in 128 registers.
template <class T> constexpr int kBwdPacks = sizeof(T) == 2 ? 2 : 4;

// Threads for a row of `groups` vectors: `packs` vectors each, in whole warps.
int row_threads(int64_t groups, int packs) {
  const int64_t t = (groups + packs - 1) / packs;
  return int(t < 32 ? 32 : (t + 31) / 32 * 32);
}

// Vector k of this thread: group k * blockDim.x + threadIdx.x of the row (coalesced per k).
__device__ __forceinline__ int64_t group_of(int k) { return int64_t(k) * blockDim.x + threadIdx.x; }

// One block per row, the row in registers (v), each input read once.
template <class T, int V>
__global__ void __launch_bounds__(kMaxThreads)
add_norm_fwd_rows_kernel(const T* __restrict__ x, const T* __restrict__ r, const acc_t<T>* __restrict__ w,
                         const acc_t<T>* __restrict__ b, T* __restrict__ sum, T* __restrict__ y,
                         acc_t<T>* __restrict__ mean_out, acc_t<T>* __restrict__ rstd_out, int64_t cols,
                         double eps, bool rms) {
  using A = acc_t<T>;
  const int64_t o = int64_t(blockIdx.x) * cols, groups = cols / V;
  A v[kPacks][V], rv[kPacks][V];
#pragma unroll
  for (int k = 0; k < kPacks; ++k) {  // every load issued before the first use
    if (group_of(k) < groups) {
      load_vec<V>(x + o + group_of(k) * V, v[k]);
      if (r != nullptr) load_vec<V>(r + o + group_of(k) * V, rv[k]);
    }
  }
  A s1 = 0, s2 = 0;
#pragma unroll
  for (int k = 0; k < kPacks; ++k) {
    if (group_of(k) >= groups) continue;
    if (r != nullptr) {
#pragma unroll
      for (int u = 0; u < V; ++u) v[k][u] = to_acc(from_acc<T>(v[k][u] + rv[k][u]));  // statistics of the stored sum
      store_vec<V>(sum + o + group_of(k) * V, v[k]);
    }
#pragma unroll
    for (int u = 0; u < V; ++u) {
      s1 += v[k][u];
      s2 += v[k][u] * v[k][u];
    }
  }
  A mean = 0, var;
  if (rms) {
    var = block_sum(s2) / A(cols);
  } else {
    mean = block_sum(s1) / A(cols);
    A sq = 0;  // two-pass variance, stable where E[x^2] - mean^2 is not; from registers
#pragma unroll
    for (int k = 0; k < kPacks; ++k) {
      if (group_of(k) >= groups) continue;
#pragma unroll
      for (int u = 0; u < V; ++u) sq += (v[k][u] - mean) * (v[k][u] - mean);
    }
    var = block_sum(sq) / A(cols);
  }
  const A rstd = A(1) / sqrt(var + A(eps));
#pragma unroll
  for (int k = 0; k < kPacks; ++k) {
    if (group_of(k) >= groups) continue;
    A wv[V], bv[V];
    load_vec<V>(w + group_of(k) * V, wv);
    if (b != nullptr) load_vec<V>(b + group_of(k) * V, bv);
#pragma unroll
    for (int u = 0; u < V; ++u) {
      A out = (v[k][u] - mean) * rstd * wv[u];
      v[k][u] = b != nullptr ? out + bv[u] : out;
    }
    store_vec<V>(y + o + group_of(k) * V, v[k]);
  }
  if (threadIdx.x == 0) {
    if (mean_out != nullptr) mean_out[blockIdx.x] = mean;
    rstd_out[blockIdx.x] = rstd;
  }
}

// One block per partial-sum block of rows, rows in order; a thread keeps its columns' weight,
// and their dweight/dbias sums, in registers across the rows, and writes the sums once to its
// own slots of row p of the parts buffers (no atomics: deterministic).
template <class T, int V, int P = kBwdPacks<T>>
__global__ void __launch_bounds__(kMaxThreads)
add_norm_bwd_rows_kernel(const T* __restrict__ dy, const T* __restrict__ dsum, const T* __restrict__ s,
                         const acc_t<T>* __restrict__ w, const acc_t<T>* __restrict__ mean,
                         const acc_t<T>* __restrict__ rstd, T* __restrict__ dx, acc_t<T>* __restrict__ dw_parts,
                         acc_t<T>* __restrict__ db_parts, int64_t parts, int64_t rows, int64_t cols, bool rms) {
  using A = acc_t<T>;
  const int64_t p = blockIdx.x, groups = cols / V;
  A wv[P][V], dw[P][V], db[P][V];
#pragma unroll
  for (int k = 0; k < P; ++k) {
    if (group_of(k) < groups) load_vec<V>(w + group_of(k) * V, wv[k]);
#pragma unroll
    for (int u = 0; u < V; ++u) dw[k][u] = db[k][u] = 0;
  }
  for (int64_t i = part_begin(p, parts, rows); i < part_begin(p + 1, parts, rows); ++i) {
    const int64_t o = i * cols;
    const A mu = rms ? A(0) : mean[i], rs = rstd[i];
    A d[P][V], xh[P][V], ds[P][V];
#pragma unroll
    for (int k = 0; k < P; ++k) {  // the row's loads, dsum's too, before the reductions
      if (group_of(k) < groups) {
        load_vec<V>(dy + o + group_of(k) * V, d[k]);
        load_vec<V>(s + o + group_of(k) * V, xh[k]);
        if (dsum != nullptr) load_vec<V>(dsum + o + group_of(k) * V, ds[k]);
      }
    }
    A sum_g = 0, sum_gx = 0;
#pragma unroll
    for (int k = 0; k < P; ++k) {
      if (group_of(k) >= groups) continue;
#pragma unroll
      for (int u = 0; u < V; ++u) {
        xh[k][u] = (xh[k][u] - mu) * rs;
        const A g = d[k][u] * wv[k][u];
        sum_g += g;
        sum_gx += g * xh[k][u];
      }
    }
    const A mg = rms ? A(0) : block_sum(sum_g) / A(cols);
    const A mgx = block_sum(sum_gx) / A(cols);
#pragma unroll
    for (int k = 0; k < P; ++k) {
      if (group_of(k) >= groups) continue;
      A out[V];
#pragma unroll
      for (int u = 0; u < V; ++u) {
        const A v = rs * (d[k][u] * wv[k][u] - mg - xh[k][u] * mgx);
        out[u] = dsum != nullptr ? v + ds[k][u] : v;
        dw[k][u] += d[k][u] * xh[k][u];
        db[k][u] += d[k][u];
      }
      store_vec<V>(dx + o + group_of(k) * V, out);
    }
  }
#pragma unroll
  for (int k = 0; k < P; ++k) {
    if (group_of(k) >= groups) continue;
#pragma unroll
    for (int u = 0; u < V; ++u) {
      dw_parts[p * cols + group_of(k) * V + u] = dw[k][u];
      if (!rms) db_parts[p * cols + group_of(k) * V + u] = db[k][u];
    }
  }
}

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

// Vector width V for the register-row kernels when every row of every given pointer is whole
// aligned 16-byte vectors and the row fits; V = 1 when only the width fits; 0: the general kernels.
template <class T> int row_vec(int64_t cols, int packs, std::initializer_list<const void*> ptrs) {
  const int64_t fits = int64_t(kMaxThreads) * packs;
  bool aligned = true;
  for (const void* q : ptrs) aligned = aligned && (q == nullptr || vec_aligned(q, cols, kVec<T>));
  if (aligned && cols / kVec<T> <= fits) return kVec<T>;
  return cols <= fits ? 1 : 0;
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
      const auto st = static_cast<cudaStream_t>(stream);
      const int vec = std::is_same<TX, T>::value ? row_vec<T>(cols, kPacks, {x, residual, weight, bias, residual ? sum : nullptr, y}) : 0;
      if constexpr (std::is_same<TX, T>::value) {
        constexpr int V = kVec<T>;
        auto args = std::make_tuple(static_cast<const T*>(x), static_cast<const T*>(residual), static_cast<const A*>(weight),
                                    static_cast<const A*>(bias), static_cast<T*>(sum), static_cast<T*>(y),
                                    static_cast<A*>(mean), static_cast<A*>(rstd), cols, eps, rms != 0);
        if (vec == V) {
          std::apply([&](auto... a) { add_norm_fwd_rows_kernel<T, V><<<unsigned(rows), row_threads(cols / V, kPacks), 0, st>>>(a...); }, args);
          err = launch_error();
          return;
        }
        if (vec == 1) {
          std::apply([&](auto... a) { add_norm_fwd_rows_kernel<T, 1><<<unsigned(rows), row_threads(cols, kPacks), 0, st>>>(a...); }, args);
          err = launch_error();
          return;
        }
      }
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
    constexpr int V = kVec<T>;
    const auto st = static_cast<cudaStream_t>(stream);
    auto args = std::make_tuple(static_cast<const T*>(dy), static_cast<const T*>(dsum), static_cast<const T*>(s),
                                static_cast<const A*>(weight), static_cast<const A*>(mean), static_cast<const A*>(rstd),
                                static_cast<T*>(dx), static_cast<A*>(dweight_parts), static_cast<A*>(dbias_parts), parts,
                                rows, cols, rms != 0);
    const int vec = row_vec<T>(cols, kBwdPacks<T>, {dy, dsum, s, weight, dx});
    if (vec == V) {
      std::apply([&](auto... a) { add_norm_bwd_rows_kernel<T, V><<<unsigned(parts), row_threads(cols / V, kBwdPacks<T>), 0, st>>>(a...); }, args);
    } else if (vec == 1) {
      std::apply([&](auto... a) { add_norm_bwd_rows_kernel<T, 1><<<unsigned(parts), row_threads(cols, kBwdPacks<T>), 0, st>>>(a...); }, args);
    } else {
      std::apply([&](auto... a) { add_norm_bwd_kernel<T><<<unsigned(parts), kThreads, 0, st>>>(a...); }, args);
    }
    err = launch_error();
  });
  return err;
}

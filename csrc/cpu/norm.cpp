// CPU twin of csrc/cuda/norm.cu: fused residual add + RMSNorm/LayerNorm, forward and backward.
// One row per iteration of an OpenMP loop; each row's passes are `omp simd` loops over a row
// that stays in cache.
#include <cmath>
#include <type_traits>

#include "dtype.h"

namespace mshpc {
namespace {

// Pass 1: s = x + residual, rounded to T as stored (the statistics see what backward will).
template <class TX, class T>
void add_row(const TX* x, const T* r, T* s, int64_t cols, acc_t<T>& sum, acc_t<T>& sumsq) {
  using A = acc_t<T>;
  A s1 = 0, s2 = 0;
  if (r != nullptr) {
#pragma omp simd reduction(+ : s1, s2)
    for (int64_t j = 0; j < cols; ++j) {
      T v = from_acc<T>(A(to_acc(x[j])) + to_acc(r[j]));
      s[j] = v;
      A a = to_acc(v);
      s1 += a;
      s2 += a * a;
    }
  } else {
#pragma omp simd reduction(+ : s1, s2)
    for (int64_t j = 0; j < cols; ++j) {
      A a = to_acc(x[j]);
      s1 += a;
      s2 += a * a;
    }
  }
  sum = s1;
  sumsq = s2;
}

template <class T>
void norm_row(const T* s, const acc_t<T>* w, const acc_t<T>* b, T* y, int64_t cols, double eps,
              bool rms, acc_t<T> sum, acc_t<T> sumsq, acc_t<T>* mean_out, acc_t<T>* rstd_out) {
  using A = acc_t<T>;
  A mean = 0, var;
  if (rms) {
    var = sumsq / A(cols);
  } else {
    mean = sum / A(cols);
    A sq = 0;  // two-pass variance: E[(x - mean)^2], stable where E[x^2] - mean^2 is not
#pragma omp simd reduction(+ : sq)
    for (int64_t j = 0; j < cols; ++j) {
      A d = to_acc(s[j]) - mean;
      sq += d * d;
    }
    var = sq / A(cols);
  }
  A rstd = A(1) / std::sqrt(var + A(eps));
#pragma omp simd
  for (int64_t j = 0; j < cols; ++j) {
    A v = (to_acc(s[j]) - mean) * rstd * w[j];
    y[j] = from_acc<T>(b != nullptr ? v + b[j] : v);
  }
  if (mean_out != nullptr) *mean_out = mean;
  *rstd_out = rstd;
}

template <class TX, class T>
void add_norm_fwd(const TX* x, const T* r, const acc_t<T>* w, const acc_t<T>* b, T* sum, T* y,
                  acc_t<T>* mean, acc_t<T>* rstd, int64_t rows, int64_t cols, double eps, bool rms) {
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < rows; ++i) {
    const int64_t o = i * cols;
    acc_t<T> s1, s2;
    add_row(x + o, r != nullptr ? r + o : nullptr, sum != nullptr ? sum + o : nullptr, cols, s1, s2);
    const T* s = r != nullptr ? sum + o : reinterpret_cast<const T*>(x + o);
    norm_row(s, w, b, y + o, cols, eps, rms, s1, s2, mean != nullptr ? mean + i : nullptr, rstd + i);
  }
}

// dx = rstd * (g - mean(g) - xhat * mean(g * xhat)) for LayerNorm, without the mean(g) term
// for RMSNorm, where g = dy * w and xhat the normalised input (Ba et al. 2016; Zhang & Sennrich
// 2019); plus dsum, the gradient that reached the sum output directly.
template <class T>
void norm_bwd_row(const T* dy, const T* dsum, const T* s, const acc_t<T>* w, acc_t<T> mean,
                  acc_t<T> rstd, T* dx, acc_t<T>* dw, acc_t<T>* db, int64_t cols) {
  using A = acc_t<T>;
  A sum_g = 0, sum_gx = 0;
#pragma omp simd reduction(+ : sum_g, sum_gx)
  for (int64_t j = 0; j < cols; ++j) {
    A g = A(to_acc(dy[j])) * w[j];
    sum_g += g;
    sum_gx += g * (to_acc(s[j]) - mean) * rstd;
  }
  const A mg = db != nullptr ? sum_g / A(cols) : A(0);  // RMSNorm has no mean term
  const A mgx = sum_gx / A(cols);
#pragma omp simd
  for (int64_t j = 0; j < cols; ++j) {
    A d = to_acc(dy[j]);
    A xhat = (to_acc(s[j]) - mean) * rstd;
    A v = rstd * (d * w[j] - mg - xhat * mgx);
    dx[j] = from_acc<T>(dsum != nullptr ? v + to_acc(dsum[j]) : v);
    dw[j] += d * xhat;
    if (db != nullptr) db[j] += d;
  }
}

template <class T>
void add_norm_bwd(const T* dy, const T* dsum, const T* s, const acc_t<T>* w, const acc_t<T>* mean,
                  const acc_t<T>* rstd, T* dx, acc_t<T>* dw_parts, acc_t<T>* db_parts,
                  int64_t parts, int64_t rows, int64_t cols, bool rms) {
#pragma omp parallel for schedule(static)
  for (int64_t p = 0; p < parts; ++p) {
    acc_t<T>* dw = dw_parts + p * cols;
    acc_t<T>* db = rms ? nullptr : db_parts + p * cols;
    for (int64_t j = 0; j < cols; ++j) {
      dw[j] = 0;
      if (db != nullptr) db[j] = 0;
    }
    for (int64_t i = part_begin(p, parts, rows); i < part_begin(p + 1, parts, rows); ++i) {
      const int64_t o = i * cols;
      norm_bwd_row(dy + o, dsum != nullptr ? dsum + o : nullptr, s + o, w, rms ? acc_t<T>(0) : mean[i],
                   rstd[i], dx + o, dw, db, cols);
    }
  }
}

}  // namespace
}  // namespace mshpc

extern "C" const char* mshpc_add_norm_fwd_cpu(const void* x, int x_dtype, const void* residual,
                                               int dtype, const void* weight, const void* bias,
                                               void* sum, void* y, void* mean, void* rstd,
                                               int64_t rows, int64_t cols, double eps, int rms,
                                               void* /*stream*/) {
  using namespace mshpc;
  if (residual == nullptr && x_dtype != dtype) return "add_norm: without a residual x must have the output dtype";
  const char* err = "add_norm: unsupported dtype";
  visit_dtype(dtype, [&](auto t) {
    using T = decltype(t);
    using A = acc_t<T>;
    visit_dtype(x_dtype, [&](auto tx) {
      using TX = decltype(tx);
      if constexpr (std::is_same_v<acc_t<TX>, A>) {  // an f64 x only with an f64 residual
        add_norm_fwd(static_cast<const TX*>(x), static_cast<const T*>(residual),
                     static_cast<const A*>(weight), static_cast<const A*>(bias), static_cast<T*>(sum),
                     static_cast<T*>(y), static_cast<A*>(mean), static_cast<A*>(rstd), rows, cols, eps,
                     rms != 0);
        err = nullptr;
      }
    });
  });
  return err;
}

extern "C" const char* mshpc_add_norm_bwd_cpu(const void* dy, const void* dsum, const void* s,
                                               int dtype, const void* weight, const void* mean,
                                               const void* rstd, void* dx, void* dweight_parts,
                                               void* dbias_parts, int64_t parts, int64_t rows,
                                               int64_t cols, int rms, void* /*stream*/) {
  using namespace mshpc;
  bool ok = visit_dtype(dtype, [&](auto t) {
    using T = decltype(t);
    using A = acc_t<T>;
    add_norm_bwd(static_cast<const T*>(dy), static_cast<const T*>(dsum), static_cast<const T*>(s),
                 static_cast<const A*>(weight), static_cast<const A*>(mean), static_cast<const A*>(rstd),
                 static_cast<T*>(dx), static_cast<A*>(dweight_parts), static_cast<A*>(dbias_parts), parts,
                 rows, cols, rms != 0);
  });
  return ok ? nullptr : "add_norm backward: unsupported dtype";
}

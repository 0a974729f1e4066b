// exp that `#pragma omp simd` loops vectorise, shared by the CPU twins of the activations.
#ifndef MSHPC_CPU_SIMD_EXP_H
#define MSHPC_CPU_SIMD_EXP_H

#include <cmath>
#include <cstdint>
#include <cstring>

namespace mshpc {

// exp for the simd loops (libm's expf does not vectorise): Cody-Waite reduction by ln 2 and
// Cephes' degree-6 polynomial for e^r on |r| <= ln2/2 (relative error ~1e-7).
inline float simd_exp(float x) {
  x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);  // not fmin/fmax: their NaN rules block vectors
  float n = std::floor(x * 1.44269504088896341f + 0.5f);
  float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  // Estrin's scheme, not Horner's: three short chains instead of one of six dependent steps, so
  // the out-of-order core keeps more loop iterations in flight (the loops are latency-bound)
  float r2 = r * r;
  float p01 = 5.0000001201e-1f + r * 1.6666665459e-1f;
  float p23 = 4.1665795894e-2f + r * 8.3334519073e-3f;
  float p45 = 1.3981999507e-3f + r * 1.9875691500e-4f;
  float p = p01 + r2 * (p23 + r2 * p45);
  p = p * r2 + r + 1.0f;
  int32_t bits = (int32_t(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}
inline double simd_exp(double x) { return std::exp(x); }

}  // namespace mshpc

#endif

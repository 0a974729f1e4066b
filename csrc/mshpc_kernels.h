/* The plain C face of mshpc's kernels: raw pointers, sizes and dtype codes, no torch types.
 *
 * Every operation exists twice with one signature: NAME_cuda (csrc/cuda/, compiled by nvcc) and
 * NAME_cpu (csrc/cpu/, C++ with OpenMP), so the torch binding (csrc/binding/ops.cpp) picks one
 * by device and calls it the same way. Each returns NULL on success or a static message. The
 * CPU twins ignore `stream`; the CUDA launchers enqueue on it (a cudaStream_t) and return at
 * once.
 *
 * Floating-point "accumulation" arguments (weights, biases, statistics, rotary tables, partial
 * sums) are `acc` typed: double when dtype is MSHPC_F64, float otherwise.
 */
#ifndef MSHPC_KERNELS_H
#define MSHPC_KERNELS_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

enum mshpc_dtype { MSHPC_F32 = 0, MSHPC_F64 = 1, MSHPC_BF16 = 2, MSHPC_F16 = 3 };

/* Declares NAME_cuda and NAME_cpu with the same parameters. */
#define MSHPC_TWINS(name, ...)                  \
  const char* name##_cuda(__VA_ARGS__);         \
  const char* name##_cpu(__VA_ARGS__);

/* sum = x + residual (stored in dtype), y = norm(sum) * weight (+ bias), per row of `cols`.
 * rms: RMSNorm (mean unused, may be NULL); else LayerNorm. residual NULL: the input is x itself
 * (x_dtype must equal dtype) and sum is not written. mean, rstd: (rows,) acc, for backward. */
MSHPC_TWINS(mshpc_add_norm_fwd, const void* x, int x_dtype, const void* residual, int dtype,
            const void* weight, const void* bias, void* sum, void* y, void* mean, void* rstd,
            int64_t rows, int64_t cols, double eps, int rms, void* stream)

/* Gradients of add_norm: dx = d(norm)/d(sum) . dy + dsum (dsum may be NULL), in dtype; the
 * weight and bias gradients as `parts` partial sums (parts, cols) acc, each over a fixed block
 * of rows (deterministic; the caller sums them). s is the normalised input (sum, or x). */
MSHPC_TWINS(mshpc_add_norm_bwd, const void* dy, const void* dsum, const void* s, int dtype,
            const void* weight, const void* mean, const void* rstd, void* dx, void* dweight_parts,
            void* dbias_parts, int64_t parts, int64_t rows, int64_t cols, int rms, void* stream)

/* y = gelu_tanh(x + bias) over rows of `cols` (bias: (cols,) acc, or NULL). */
MSHPC_TWINS(mshpc_bias_gelu_fwd, const void* x, const void* bias, void* y, int dtype,
            int64_t rows, int64_t cols, void* stream)

/* dx = dy * gelu_tanh'(x + bias); dbias as `parts` partial sums (parts, cols) acc, or NULL. */
MSHPC_TWINS(mshpc_bias_gelu_bwd, const void* dy, const void* x, const void* bias, void* dx,
            void* dbias_parts, int dtype, int64_t parts, int64_t rows, int64_t cols, void* stream)

/* SwiGLU's gate: y = silu(gate) * up, for x (rows, 2 * cols) holding [gate | up] in each row and
 * y (rows, cols). */
MSHPC_TWINS(mshpc_swiglu_fwd, const void* x, void* y, int dtype, int64_t rows, int64_t cols, void* stream)

/* dx (rows, 2 * cols) = [dy * up * silu'(gate) | dy * silu(gate)] for dy (rows, cols). */
MSHPC_TWINS(mshpc_swiglu_bwd, const void* dy, const void* x, void* dx, int dtype, int64_t rows,
            int64_t cols, void* stream)

/* Rotary embedding in the rotate-half pairing: for x (b, s, h, hd) with the given strides of
 * its first three dims (the last is contiguous), y (contiguous, same shape) rotates each pair
 * (x[i], x[i + hd/2]) at position p by the angle with cos/sin[p, i] ((s, hd/2) acc).
 * inverse rotates by minus the angle: the backward. */
MSHPC_TWINS(mshpc_rope, const void* x, void* y, const void* cos, const void* sin, int dtype,
            int64_t b, int64_t s, int64_t h, int64_t hd, int64_t stride_b, int64_t stride_s,
            int64_t stride_h, int inverse, void* stream)

/* Mixture of experts: tokens to expert order and back. pos (tokens, k) int64 holds, for each
 * token's j-th routed expert, the row of the permuted tensor it occupies, or -1 when the capacity
 * dropped it; the kept rows are exactly [0, rows) and each is named once. Every output row is
 * written by one thread block from its own inputs (gathers, no atomics): deterministic.
 *
 * permute: xp[pos[t, j]] = x[t] (rows of `cols`).
 * permute_bwd: dx[t] = sum_j dxp[pos[t, j]] over the kept j, summed in acc, 0 if none.
 * unpermute: out[t] = sum_j w[t, j] * y[pos[t, j]], w (tokens, k) acc (the router's weights).
 * unpermute_bwd: dy[pos[t, j]] = w[t, j] * dout[t]; dw[t, j] = <dout[t], y[pos[t, j]]> (acc; 0
 * for a dropped j). */
MSHPC_TWINS(mshpc_moe_permute_fwd, const void* x, const int64_t* pos, void* xp, int dtype, int64_t tokens,
            int64_t k, int64_t cols, void* stream)
MSHPC_TWINS(mshpc_moe_permute_bwd, const void* dxp, const int64_t* pos, void* dx, int dtype, int64_t tokens,
            int64_t k, int64_t cols, void* stream)
MSHPC_TWINS(mshpc_moe_unpermute_fwd, const void* y, const int64_t* pos, const void* w, void* out, int dtype,
            int64_t tokens, int64_t k, int64_t cols, void* stream)
MSHPC_TWINS(mshpc_moe_unpermute_bwd, const void* dout, const void* y, const int64_t* pos, const void* w,
            void* dy, void* dw, int dtype, int64_t tokens, int64_t k, int64_t cols, void* stream)

/* Multi-tensor optimizer steps over n fp32 tensors in one launch. `table` (on the tensors'
 * device) holds int64s: 4 * n addresses (param, grad, exp_avg, exp_avg_sq for each tensor),
 * then n element counts, then n + 1 chunk offsets (tensor t covers chunks [off[t], off[t+1])
 * of `chunk_numel` elements). */

/* AdamW (Loshchilov & Hutter 2019, Algorithm 2), as torch.optim.AdamW computes it.
 * step_and_decay: (n, 2) float on the device, lr / bias_correction1 and 1 - lr * weight_decay
 * of each tensor (its group's lr and decay, worked out in double on the host, as torch does). */
MSHPC_TWINS(mshpc_adamw, const int64_t* table, const float* step_and_decay, int64_t n,
            int64_t n_chunks, int64_t chunk_numel, double beta1, double beta2, double eps,
            double bias_correction2, void* stream)

/* LAMB's first half (You et al. 2019, Algorithm 2): advance the moments, write the direction
 * r = m_hat / (sqrt(v_hat) + eps) + wd * w into the grad slot, and the squared norms
 * (||w||^2, ||r||^2) of each tensor into norms (n, 2) float, through chunk_norms
 * (n_chunks, 2) float scratch, summed in chunk order (deterministic). */
MSHPC_TWINS(mshpc_lamb_direction, const int64_t* table, const float* weight_decay /* (n,) */, int64_t n,
            int64_t n_chunks, int64_t chunk_numel, double beta1, double beta2, double eps,
            double bias_correction1, double bias_correction2, float* chunk_norms, float* norms,
            void* stream)

/* LAMB's second half: param -= scale[t] * r, with r in the grad slot; scale: (n,) float. */
MSHPC_TWINS(mshpc_lamb_apply, const int64_t* table, const float* scale, int64_t n,
            int64_t n_chunks, int64_t chunk_numel, void* stream)

#undef MSHPC_TWINS

#ifdef __cplusplus
}
#endif

#endif

// The torch binding: schemas of the mshpc:: custom operators and their CPU and CUDA
// implementations, which check and prepare tensors, then call the plain C launcher (CUDA) or
// its CPU twin through the same signature (csrc/mshpc_kernels.h). Autograd formulas and fake
// (meta) implementations are registered from Python (mshpc/kernels/ops.py).
#include <ATen/ATen.h>
#include <torch/library.h>

#ifdef MSHPC_WITH_CUDA
// c10's stream and guard only: ATen/cuda/CUDAContext.h would pull in cuBLAS and cuSPARSE headers
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#endif

#include <algorithm>
#include <cmath>
#include <optional>
#include <vector>

#include "../mshpc_kernels.h"

namespace {

#ifdef MSHPC_WITH_CUDA
#define MSHPC_PICK(tensor, name) ((tensor).is_cuda() ? name##_cuda : name##_cpu)
#else
#define MSHPC_PICK(tensor, name) name##_cpu
#endif

// Runs on the tensor's device: makes it current and returns its current stream (NULL on CPU).
struct OnDevice {
#ifdef MSHPC_WITH_CUDA
  std::optional<c10::cuda::CUDAGuard> guard;
#endif
  void* stream = nullptr;
  explicit OnDevice(const at::Tensor& t) {
#ifdef MSHPC_WITH_CUDA
    if (t.is_cuda()) {
      guard.emplace(t.device());
      stream = c10::cuda::getCurrentCUDAStream(t.device().index()).stream();
    }
#endif
  }
};

void check(const char* err, const char* op) { TORCH_CHECK(err == nullptr, "mshpc::", op, ": ", err); }

int dtype_code(at::ScalarType t, const char* op) {
  switch (t) {
    case at::kFloat: return MSHPC_F32;
    case at::kDouble: return MSHPC_F64;
    case at::kBFloat16: return MSHPC_BF16;
    case at::kHalf: return MSHPC_F16;
    default: TORCH_CHECK(false, "mshpc::", op, ": unsupported dtype ", t, " (float32, float64, bfloat16, float16)");
  }
}

at::ScalarType acc_type(at::ScalarType t) { return t == at::kDouble ? at::kDouble : at::kFloat; }

// `t` as a contiguous tensor of dtype `type` (no copy when it already is one).
at::Tensor as(const at::Tensor& t, at::ScalarType type) { return t.to(type).contiguous(); }

const void* ptr_or_null(const std::optional<at::Tensor>& t) { return t && t->defined() ? t->data_ptr() : nullptr; }

// Partial-sum blocks for weight/bias gradients: few enough to sum cheaply, enough to fill the
// device; a fixed count per device kind, so results do not depend on the thread count. On CUDA
// 4 per multiprocessor: the norms' backward walks a block's rows one after another, and a
// narrow row (8 KB of bf16 at 4,096 columns) needs 4 resident blocks to keep enough bytes in
// flight; (4 * 132, cols) fp32 parts are 8.6 MB at 4,096 columns, summed in microseconds.
int64_t grad_parts(const at::Tensor& t, int64_t rows) {
  int64_t parts = 32;
#ifdef MSHPC_WITH_CUDA
  int sms = 0;
  if (t.is_cuda() && cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, t.device().index()) == cudaSuccess) {
    parts = 4 * int64_t(sms);
  }
#endif
  return std::max<int64_t>(1, std::min(rows, parts));
}

// ---------------------------------------------------------------- residual add + norm

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> add_norm(
    const at::Tensor& x_in, const std::optional<at::Tensor>& residual_in, const at::Tensor& weight,
    const std::optional<at::Tensor>& bias, double eps, bool rms) {
  const int64_t cols = weight.numel();
  TORCH_CHECK(x_in.dim() >= 1 && x_in.size(-1) == cols, "mshpc::add_norm: x's last dim must be ", cols);
  const bool has_res = residual_in.has_value() && residual_in->defined();
  const at::ScalarType type = has_res ? at::promote_types(x_in.scalar_type(), residual_in->scalar_type())
                                      : x_in.scalar_type();
  const at::ScalarType acc = acc_type(type);
  // x keeps a narrower dtype of the same accumulation type (a bf16 branch output into an fp32
  // stream); anything else is brought to the stream's dtype
  const at::ScalarType x_type = has_res && acc_type(x_in.scalar_type()) == acc ? x_in.scalar_type() : type;
  at::Tensor x = as(x_in, x_type);
  at::Tensor residual = has_res ? as(*residual_in, type) : at::Tensor();
  at::Tensor w = as(weight, acc);
  at::Tensor b = bias && bias->defined() ? as(*bias, acc) : at::Tensor();
  const int64_t rows = x.numel() / cols;
  at::Tensor y = at::empty(x.sizes(), x.options().dtype(type));
  at::Tensor sum = has_res ? at::empty(x.sizes(), x.options().dtype(type)) : at::empty({0}, x.options().dtype(type));
  at::Tensor mean = at::empty({rms ? 0 : rows}, x.options().dtype(acc));
  at::Tensor rstd = at::empty({rows}, x.options().dtype(acc));
  OnDevice on(x);
  check(MSHPC_PICK(x, mshpc_add_norm_fwd)(
            x.data_ptr(), dtype_code(x_type, "add_norm"), has_res ? residual.data_ptr() : nullptr,
            dtype_code(type, "add_norm"), w.data_ptr(), b.defined() ? b.data_ptr() : nullptr,
            has_res ? sum.data_ptr() : nullptr, y.data_ptr(), rms ? nullptr : mean.data_ptr(), rstd.data_ptr(),
            rows, cols, eps, rms, on.stream),
        "add_norm");
  return {y, sum, mean, rstd};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> add_norm_backward(
    const at::Tensor& dy_in, const std::optional<at::Tensor>& dsum_in, const at::Tensor& s,
    const at::Tensor& weight, const at::Tensor& mean, const at::Tensor& rstd, bool rms) {
  const int64_t cols = weight.numel();
  const at::ScalarType type = s.scalar_type(), acc = acc_type(type);
  TORCH_CHECK(s.is_contiguous(), "mshpc::add_norm_backward: the saved input must be contiguous");
  at::Tensor dy = as(dy_in, type);
  at::Tensor dsum = dsum_in && dsum_in->defined() ? as(*dsum_in, type) : at::Tensor();
  at::Tensor w = as(weight, acc);
  const int64_t rows = s.numel() / cols, parts = grad_parts(s, rows);
  at::Tensor dx = at::empty(s.sizes(), s.options());
  at::Tensor dw_parts = at::empty({parts, cols}, s.options().dtype(acc));
  at::Tensor db_parts = at::empty({rms ? 0 : parts, cols}, s.options().dtype(acc));
  OnDevice on(s);
  check(MSHPC_PICK(s, mshpc_add_norm_bwd)(
            dy.data_ptr(), dsum.defined() ? dsum.data_ptr() : nullptr, s.data_ptr(), dtype_code(type, "add_norm"),
            w.data_ptr(), rms ? nullptr : mean.data_ptr(), rstd.data_ptr(), dx.data_ptr(), dw_parts.data_ptr(),
            rms ? nullptr : db_parts.data_ptr(), rows == 0 ? 0 : parts, rows, cols, rms, on.stream),
        "add_norm_backward");
  // the parts are summed by torch in a fixed order: deterministic on every device
  at::Tensor dweight = (rows == 0 ? dw_parts.zero_() : dw_parts).sum(0).to(weight.scalar_type());
  at::Tensor dbias = rms ? at::empty({0}, dw_parts.options()) : (rows == 0 ? db_parts.zero_() : db_parts).sum(0);
  return {dx, dweight, dbias};
}

// ---------------------------------------------------------------- bias + GeLU

at::Tensor bias_gelu(const at::Tensor& x_in, const std::optional<at::Tensor>& bias) {
  at::Tensor x = x_in.contiguous();
  const at::ScalarType type = x.scalar_type();
  const int64_t cols = x.dim() == 0 ? 1 : x.size(-1);
  TORCH_CHECK(!bias || !bias->defined() || bias->numel() == cols, "mshpc::bias_gelu: bias must have ", cols, " elements");
  at::Tensor b = bias && bias->defined() ? as(*bias, acc_type(type)) : at::Tensor();
  at::Tensor y = at::empty_like(x);
  OnDevice on(x);
  check(MSHPC_PICK(x, mshpc_bias_gelu_fwd)(x.data_ptr(), b.defined() ? b.data_ptr() : nullptr, y.data_ptr(),
                                           dtype_code(type, "bias_gelu"), cols == 0 ? 0 : x.numel() / cols, cols,
                                           on.stream),
        "bias_gelu");
  return y;
}

std::tuple<at::Tensor, at::Tensor> bias_gelu_backward(const at::Tensor& dy_in, const at::Tensor& x_in,
                                                      const std::optional<at::Tensor>& bias) {
  at::Tensor x = x_in.contiguous();
  const at::ScalarType type = x.scalar_type(), acc = acc_type(type);
  const int64_t cols = x.dim() == 0 ? 1 : x.size(-1);
  const int64_t rows = cols == 0 ? 0 : x.numel() / cols;
  const bool has_bias = bias && bias->defined();
  at::Tensor dy = as(dy_in, type);
  at::Tensor b = has_bias ? as(*bias, acc) : at::Tensor();
  const int64_t parts = grad_parts(x, rows);
  at::Tensor dx = at::empty_like(x);
  at::Tensor db_parts = at::empty({has_bias ? parts : 0, cols}, x.options().dtype(acc));
  OnDevice on(x);
  check(MSHPC_PICK(x, mshpc_bias_gelu_bwd)(dy.data_ptr(), x.data_ptr(), has_bias ? b.data_ptr() : nullptr,
                                           dx.data_ptr(), has_bias ? db_parts.data_ptr() : nullptr,
                                           dtype_code(type, "bias_gelu"), rows == 0 ? 0 : parts, rows, cols,
                                           on.stream),
        "bias_gelu_backward");
  at::Tensor dbias = has_bias ? (rows == 0 ? db_parts.zero_() : db_parts).sum(0).to(bias->scalar_type())
                              : at::empty({0}, x.options());
  return {dx, dbias};
}

// ---------------------------------------------------------------- SwiGLU gate

// The gate's width: half of x's last dim, which holds [gate | up].
int64_t swiglu_cols(const at::Tensor& x, const char* op) {
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) % 2 == 0, "mshpc::", op, ": x's last dim must be even ([gate | up]), got ",
              x.dim() == 0 ? 0 : x.size(-1));
  return x.size(-1) / 2;
}

at::Tensor swiglu(const at::Tensor& x_in) {
  at::Tensor x = x_in.contiguous();
  const int64_t cols = swiglu_cols(x, "swiglu");
  std::vector<int64_t> shape = x.sizes().vec();
  shape.back() = cols;
  at::Tensor y = at::empty(shape, x.options());
  OnDevice on(x);
  check(MSHPC_PICK(x, mshpc_swiglu_fwd)(x.data_ptr(), y.data_ptr(), dtype_code(x.scalar_type(), "swiglu"),
                                        cols == 0 ? 0 : y.numel() / cols, cols, on.stream),
        "swiglu");
  return y;
}

at::Tensor swiglu_backward(const at::Tensor& dy_in, const at::Tensor& x_in) {
  at::Tensor x = x_in.contiguous();
  const int64_t cols = swiglu_cols(x, "swiglu_backward");
  TORCH_CHECK(dy_in.numel() * 2 == x.numel(), "mshpc::swiglu_backward: dy must have half of x's elements");
  at::Tensor dy = as(dy_in, x.scalar_type());
  at::Tensor dx = at::empty_like(x);
  OnDevice on(x);
  check(MSHPC_PICK(x, mshpc_swiglu_bwd)(dy.data_ptr(), x.data_ptr(), dx.data_ptr(),
                                        dtype_code(x.scalar_type(), "swiglu_backward"),
                                        cols == 0 ? 0 : dy.numel() / cols, cols, on.stream),
        "swiglu_backward");
  return dx;
}

// ---------------------------------------------------------------- mixture of experts: permute, unpermute

// pos: (tokens, k) int64 on x's device, each kept entry naming one row of the permuted tensor.
void check_pos(const at::Tensor& pos, const at::Tensor& x, int64_t tokens, const char* op) {
  TORCH_CHECK(pos.dim() == 2 && pos.size(0) == tokens && pos.scalar_type() == at::kLong && pos.is_contiguous() &&
                  pos.device() == x.device(),
              "mshpc::", op, ": pos must be a contiguous int64 (tokens, k) tensor on the rows' device");
}

// x (tokens, cols) -> xp (rows, cols): xp[pos[t, j]] = x[t].
at::Tensor moe_permute(const at::Tensor& x_in, const at::Tensor& pos, int64_t rows) {
  TORCH_CHECK(x_in.dim() == 2, "mshpc::moe_permute: x must be (tokens, cols)");
  at::Tensor x = x_in.contiguous();
  check_pos(pos, x, x.size(0), "moe_permute");
  at::Tensor xp = at::empty({rows, x.size(1)}, x.options());
  OnDevice on(x);
  check(MSHPC_PICK(x, mshpc_moe_permute_fwd)(x.data_ptr(), pos.data_ptr<int64_t>(), xp.data_ptr(),
                                             dtype_code(x.scalar_type(), "moe_permute"), x.size(0), pos.size(1),
                                             x.size(1), on.stream),
        "moe_permute");
  return xp;
}

// dxp (rows, cols) -> dx (tokens, cols): dx[t] = sum_j dxp[pos[t, j]].
at::Tensor moe_permute_backward(const at::Tensor& dxp_in, const at::Tensor& pos) {
  TORCH_CHECK(dxp_in.dim() == 2, "mshpc::moe_permute_backward: dxp must be (rows, cols)");
  at::Tensor dxp = dxp_in.contiguous();
  check_pos(pos, dxp, pos.size(0), "moe_permute_backward");
  at::Tensor dx = at::empty({pos.size(0), dxp.size(1)}, dxp.options());
  OnDevice on(dxp);
  check(MSHPC_PICK(dxp, mshpc_moe_permute_bwd)(dxp.data_ptr(), pos.data_ptr<int64_t>(), dx.data_ptr(),
                                               dtype_code(dxp.scalar_type(), "moe_permute_backward"), pos.size(0),
                                               pos.size(1), dxp.size(1), on.stream),
        "moe_permute_backward");
  return dx;
}

// y (rows, cols), w (tokens, k) -> out (tokens, cols): out[t] = sum_j w[t, j] * y[pos[t, j]].
at::Tensor moe_unpermute(const at::Tensor& y_in, const at::Tensor& pos, const at::Tensor& w_in) {
  TORCH_CHECK(y_in.dim() == 2, "mshpc::moe_unpermute: y must be (rows, cols)");
  at::Tensor y = y_in.contiguous();
  check_pos(pos, y, pos.size(0), "moe_unpermute");
  TORCH_CHECK(w_in.sizes() == pos.sizes(), "mshpc::moe_unpermute: w must be (tokens, k) like pos");
  at::Tensor w = as(w_in, acc_type(y.scalar_type()));
  at::Tensor out = at::empty({pos.size(0), y.size(1)}, y.options());
  OnDevice on(y);
  check(MSHPC_PICK(y, mshpc_moe_unpermute_fwd)(y.data_ptr(), pos.data_ptr<int64_t>(), w.data_ptr(), out.data_ptr(),
                                               dtype_code(y.scalar_type(), "moe_unpermute"), pos.size(0),
                                               pos.size(1), y.size(1), on.stream),
        "moe_unpermute");
  return out;
}

std::tuple<at::Tensor, at::Tensor> moe_unpermute_backward(const at::Tensor& dout_in, const at::Tensor& y_in,
                                                          const at::Tensor& pos, const at::Tensor& w_in) {
  at::Tensor y = y_in.contiguous();
  at::Tensor dout = as(dout_in, y.scalar_type());
  check_pos(pos, y, dout.size(0), "moe_unpermute_backward");
  TORCH_CHECK(dout.dim() == 2 && dout.size(1) == y.size(1), "mshpc::moe_unpermute_backward: dout must be (tokens, cols)");
  const at::ScalarType acc = acc_type(y.scalar_type());
  at::Tensor w = as(w_in, acc);
  at::Tensor dy = at::empty_like(y);
  at::Tensor dw = at::empty(pos.sizes(), y.options().dtype(acc));
  OnDevice on(y);
  check(MSHPC_PICK(y, mshpc_moe_unpermute_bwd)(dout.data_ptr(), y.data_ptr(), pos.data_ptr<int64_t>(), w.data_ptr(),
                                               dy.data_ptr(), dw.data_ptr(),
                                               dtype_code(y.scalar_type(), "moe_unpermute_backward"), pos.size(0),
                                               pos.size(1), y.size(1), on.stream),
        "moe_unpermute_backward");
  return {dy, dw};
}

// ---------------------------------------------------------------- rotary embedding

at::Tensor rope(const at::Tensor& x_in, const at::Tensor& cos, const at::Tensor& sin, bool inverse) {
  TORCH_CHECK(x_in.dim() == 4, "mshpc::rope: x must be (batch, seq, heads, head_dim)");
  at::Tensor x = x_in.stride(3) == 1 ? x_in : x_in.contiguous();  // any strides but the last
  const int64_t b = x.size(0), s = x.size(1), h = x.size(2), hd = x.size(3);
  TORCH_CHECK(cos.size(0) >= s && cos.size(1) == hd / 2 && sin.sizes() == cos.sizes(),
              "mshpc::rope: cos and sin must be (>= seq, head_dim / 2)");
  const at::ScalarType type = x.scalar_type(), acc = acc_type(type);
  at::Tensor c = as(cos.narrow(0, 0, s), acc), sn = as(sin.narrow(0, 0, s), acc);
  at::Tensor y = at::empty({b, s, h, hd}, x.options());
  OnDevice on(x);
  check(MSHPC_PICK(x, mshpc_rope)(x.data_ptr(), y.data_ptr(), c.data_ptr(), sn.data_ptr(), dtype_code(type, "rope"),
                                  b, s, h, hd, x.stride(0), x.stride(1), x.stride(2), inverse, on.stream),
        "rope");
  return y;
}

// ---------------------------------------------------------------- multi-tensor optimizers

constexpr int64_t kChunkNumel = 1 << 16;

struct Table {
  at::Tensor table, per_tensor;  // per_tensor: the launcher's per-tensor floats
  int64_t n = 0, n_chunks = 0;
};

// The launchers' table (layout in mshpc_kernels.h) on the tensors' device, after checking that
// every list has one fp32 contiguous tensor of the parameter's size per parameter. An empty
// list stands for an unused slot; `per_tensor` floats go to the device alongside.
Table build_table(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                  at::TensorList exp_avg_sqs, const std::vector<float>& per_tensor, const char* op) {
  const int64_t n = params.size();
  at::Tensor host = at::empty({6 * n + 1}, at::kLong);
  at::Tensor floats = at::empty({int64_t(per_tensor.size())}, at::kFloat);
  std::copy(per_tensor.begin(), per_tensor.end(), floats.data_ptr<float>());
  int64_t* t = host.data_ptr<int64_t>();
  int64_t chunks = 0;
  for (int64_t i = 0; i < n; ++i) {
    const at::Tensor& p = params[i];
    at::TensorList lists[4] = {params, grads, exp_avgs, exp_avg_sqs};
    for (int slot = 0; slot < 4; ++slot) {
      if (lists[slot].empty()) {
        t[4 * i + slot] = 0;
        continue;
      }
      const at::Tensor& u = lists[slot][i];
      TORCH_CHECK(u.scalar_type() == at::kFloat && u.is_contiguous() && u.numel() == p.numel() &&
                      u.device() == params[0].device(),
                  "mshpc::", op, ": tensor ", i, " of list ", slot, " must be contiguous float32 with ",
                  p.numel(), " elements on ", params[0].device());
      t[4 * i + slot] = reinterpret_cast<int64_t>(u.data_ptr());
    }
    t[4 * n + i] = p.numel();
    t[5 * n + i] = chunks;
    chunks += (p.numel() + kChunkNumel - 1) / kChunkNumel;
  }
  t[6 * n] = chunks;
  const at::Device device = n > 0 ? params[0].device() : at::Device(at::kCPU);
  if (device.is_cpu()) return {host, floats, n, chunks};
  // pinned, so the copy is asynchronous; the host allocator keeps the buffer until it is done
  return {host.pin_memory().to(device, /*non_blocking=*/true), floats.pin_memory().to(device, true), n, chunks};
}

void multi_tensor_adamw(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                        at::TensorList exp_avg_sqs, at::ArrayRef<double> lrs, at::ArrayRef<double> weight_decays,
                        double beta1, double beta2, double eps, int64_t step) {
  if (params.empty()) return;
  TORCH_CHECK(lrs.size() == params.size() && weight_decays.size() == params.size(),
              "mshpc::multi_tensor_adamw: one lr and one weight decay per tensor");
  const double bc1 = 1 - std::pow(beta1, double(step)), bc2 = 1 - std::pow(beta2, double(step));
  std::vector<float> step_and_decay(2 * params.size());
  for (size_t i = 0; i < params.size(); ++i) {  // in double, as torch.optim.AdamW's Python does
    step_and_decay[2 * i] = float(lrs[i] / bc1);
    step_and_decay[2 * i + 1] = float(1 - lrs[i] * weight_decays[i]);
  }
  Table tab = build_table(params, grads, exp_avgs, exp_avg_sqs, step_and_decay, "multi_tensor_adamw");
  OnDevice on(params[0]);
  check(MSHPC_PICK(params[0], mshpc_adamw)(tab.table.data_ptr<int64_t>(), tab.per_tensor.data_ptr<float>(), tab.n,
                                          tab.n_chunks, kChunkNumel, beta1, beta2, eps, bc2, on.stream),
        "multi_tensor_adamw");
}

at::Tensor multi_tensor_lamb_direction(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                                       at::TensorList exp_avg_sqs, at::ArrayRef<double> weight_decays,
                                       double beta1, double beta2, double eps, int64_t step) {
  if (params.empty()) return at::zeros({0, 2}, at::kFloat);
  TORCH_CHECK(int64_t(weight_decays.size()) == int64_t(params.size()), "mshpc::multi_tensor_lamb_direction: one weight decay per tensor");
  Table tab = build_table(params, grads, exp_avgs, exp_avg_sqs,
                          std::vector<float>(weight_decays.begin(), weight_decays.end()), "multi_tensor_lamb_direction");
  at::Tensor chunk_norms = at::empty({tab.n_chunks, 2}, params[0].options());
  at::Tensor norms = at::empty({tab.n, 2}, params[0].options());
  OnDevice on(params[0]);
  check(MSHPC_PICK(params[0], mshpc_lamb_direction)(
            tab.table.data_ptr<int64_t>(), tab.per_tensor.data_ptr<float>(), tab.n, tab.n_chunks, kChunkNumel,
            beta1, beta2, eps, 1 - std::pow(beta1, double(step)), 1 - std::pow(beta2, double(step)),
            chunk_norms.data_ptr<float>(), norms.data_ptr<float>(), on.stream),
        "multi_tensor_lamb_direction");
  return norms;
}

void multi_tensor_lamb_apply(at::TensorList params, at::TensorList updates, const at::Tensor& scales) {
  if (params.empty()) return;
  Table tab = build_table(params, updates, {}, {}, {}, "multi_tensor_lamb_apply");
  at::Tensor s = scales.to(params[0].device(), at::kFloat).contiguous();
  TORCH_CHECK(s.numel() == tab.n, "mshpc::multi_tensor_lamb_apply: one scale per tensor");
  OnDevice on(params[0]);
  check(MSHPC_PICK(params[0], mshpc_lamb_apply)(tab.table.data_ptr<int64_t>(), s.data_ptr<float>(), tab.n,
                                               tab.n_chunks, kChunkNumel, on.stream),
        "multi_tensor_lamb_apply");
}

}  // namespace

TORCH_LIBRARY(mshpc, m) {
  m.def("add_norm(Tensor x, Tensor? residual, Tensor weight, Tensor? bias, float eps, bool rms) -> "
        "(Tensor y, Tensor sum, Tensor mean, Tensor rstd)");
  m.def("add_norm_backward(Tensor dy, Tensor? dsum, Tensor s, Tensor weight, Tensor mean, Tensor rstd, "
        "bool rms) -> (Tensor dx, Tensor dweight, Tensor dbias)");
  m.def("bias_gelu(Tensor x, Tensor? bias) -> Tensor");
  m.def("bias_gelu_backward(Tensor dy, Tensor x, Tensor? bias) -> (Tensor dx, Tensor dbias)");
  m.def("swiglu(Tensor x) -> Tensor");
  m.def("swiglu_backward(Tensor dy, Tensor x) -> Tensor");
  m.def("rope(Tensor x, Tensor cos, Tensor sin, bool inverse) -> Tensor");
  m.def("moe_permute(Tensor x, Tensor pos, SymInt rows) -> Tensor");
  m.def("moe_permute_backward(Tensor dxp, Tensor pos) -> Tensor");
  m.def("moe_unpermute(Tensor y, Tensor pos, Tensor w) -> Tensor");
  m.def("moe_unpermute_backward(Tensor dout, Tensor y, Tensor pos, Tensor w) -> (Tensor dy, Tensor dw)");
  m.def("multi_tensor_adamw(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] exp_avgs, "
        "Tensor(c!)[] exp_avg_sqs, float[] lrs, float[] weight_decays, float beta1, float beta2, float eps, "
        "int step) -> ()");
  m.def("multi_tensor_lamb_direction(Tensor[] params, Tensor(a!)[] grads, Tensor(b!)[] exp_avgs, "
        "Tensor(c!)[] exp_avg_sqs, float[] weight_decays, float beta1, float beta2, float eps, int step) "
        "-> Tensor");
  m.def("multi_tensor_lamb_apply(Tensor(a!)[] params, Tensor[] updates, Tensor scales) -> ()");
}

#define MSHPC_IMPLS(key)                                                    \
  TORCH_LIBRARY_IMPL(mshpc, key, m) {                                       \
    m.impl("add_norm", &add_norm);                                          \
    m.impl("add_norm_backward", &add_norm_backward);                        \
    m.impl("bias_gelu", &bias_gelu);                                        \
    m.impl("bias_gelu_backward", &bias_gelu_backward);                      \
    m.impl("swiglu", &swiglu);                                              \
    m.impl("swiglu_backward", &swiglu_backward);                            \
    m.impl("rope", &rope);                                                  \
    m.impl("moe_permute", &moe_permute);                                    \
    m.impl("moe_permute_backward", &moe_permute_backward);                  \
    m.impl("moe_unpermute", &moe_unpermute);                                \
    m.impl("moe_unpermute_backward", &moe_unpermute_backward);              \
    m.impl("multi_tensor_adamw", &multi_tensor_adamw);                      \
    m.impl("multi_tensor_lamb_direction", &multi_tensor_lamb_direction);    \
    m.impl("multi_tensor_lamb_apply", &multi_tensor_lamb_apply);            \
  }

MSHPC_IMPLS(CPU)
#ifdef MSHPC_WITH_CUDA
MSHPC_IMPLS(CUDA)
#endif

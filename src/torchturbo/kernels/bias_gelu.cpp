// Fused bias + GELU (exact, erf form) for CPU: forward y = gelu(x + b) and its input gradient.
//
// Eager PyTorch runs `F.gelu(x + b)` as two kernels with a full-size temporary between them, and
// its backward as an add-backward plus a gelu_backward. Here each direction is one pass over
// memory. Built by torchturbo.kernels._build with torch.utils.cpp_extension.load and registered
// as plain operators under torchturbo_cpu::; bias_gelu.py wraps them in the torch.library custom
// op torchturbo::bias_gelu, which adds autograd, the fake (meta) kernel and the other devices.
// Only the headers needed (not <torch/extension.h>, which pulls in all of ATen and pybind11):
// this roughly halves the cold compile time.
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <type_traits>

#if defined(__x86_64__) && defined(__GLIBC__)
// glibc's libmvec has a SIMD expf, but <math.h> only announces it under -ffast-math, which would
// also break NaN/inf semantics. Redeclaring it with the simd attribute lets gcc vectorize the
// loops below (16 lanes with AVX-512) while keeping IEEE arithmetic everywhere else.
extern "C" __attribute__((simd("notinbranch"))) float expf(float) noexcept;
#endif

namespace {

// erf(u) given e = exp(-u * u): the backward needs that exponential for the normal density too,
// so each direction costs one exp per element. float: Abramowitz & Stegun 7.1.26
// (|error| < 1.5e-7), the formula of PyTorch's own AVX-512 erf; it vectorizes, whereas libmvec's
// erff, more exact, measured ~2x slower here. double (gradcheck): std::erf, exact to rounding; it
// ignores e, whose computation the compiler then drops (exp is pure under -fno-math-errno).
inline float erf_given_exp(float u, float e) {
  const float t = 1.0f / (1.0f + 0.3275911f * std::fabs(u));
  const float poly =
      ((((1.061405429f * t - 1.453152027f) * t + 1.421413741f) * t - 0.284496736f) * t +
       0.254829592f) * t;
  return std::copysign(1.0f - poly * e, u);
}
inline double erf_given_exp(double u, double) { return std::erf(u); }
inline float exp_(float v) { return expf(v); }
inline double exp_(double v) { return std::exp(v); }

// Rows per parallel chunk: about 32K elements, so thread start-up stays negligible.
int64_t grain_rows(int64_t cols) { return std::max<int64_t>(1, 32768 / std::max<int64_t>(cols, 1)); }

void check_inputs(const at::Tensor& x, const at::Tensor& bias) {
  TORCH_CHECK(x.is_cpu() && bias.is_cpu(), "bias_gelu: CPU tensors expected");
  TORCH_CHECK(bias.dim() == 1, "bias_gelu: bias must be 1-D, got ", bias.dim(), "-D");
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == bias.size(0), "bias_gelu: x.size(-1)=",
              x.dim() ? x.size(-1) : 0, " must equal bias.size(0)=", bias.size(0));
  TORCH_CHECK(x.scalar_type() == bias.scalar_type(), "bias_gelu: x and bias dtypes differ");
}

// The maths on spans of acc_t (float or double), where gcc vectorizes it.
template <typename acc_t>
void forward_span(const acc_t* __restrict x, const acc_t* __restrict b, acc_t* __restrict y,
                  int64_t n) {
  const acc_t half = 0.5, one = 1, inv_sqrt2 = M_SQRT1_2;
  for (int64_t j = 0; j < n; ++j) {
    const acc_t v = x[j] + b[j];
    const acc_t u = v * inv_sqrt2;
    y[j] = half * v * (one + erf_given_exp(u, exp_(-u * u)));
  }
}

template <typename acc_t>
void backward_span(const acc_t* __restrict g, const acc_t* __restrict x,
                   const acc_t* __restrict b, acc_t* __restrict gx, int64_t n) {
  // d/dv [v * Phi(v)] = Phi(v) + v * phi(v), the formula of PyTorch's own gelu_backward.
  const acc_t half = 0.5, one = 1, inv_sqrt2 = M_SQRT1_2;
  const acc_t inv_sqrt_2pi = 0.5 * M_2_SQRTPI * M_SQRT1_2;
  for (int64_t j = 0; j < n; ++j) {
    const acc_t v = x[j] + b[j];
    const acc_t u = v * inv_sqrt2;
    const acc_t e = exp_(-u * u);  // exp(-v^2 / 2)
    const acc_t cdf = half * (one + erf_given_exp(u, e));
    gx[j] = g[j] * (cdf + v * e * inv_sqrt_2pi);
  }
}

// Reduced-precision types (bf16) go through float tiles on the stack: converting inside the
// maths loop kept gcc from vectorizing the backward (it ran 3x slower than eager).
constexpr int64_t kTile = 256;

template <typename scalar_t>
void load_tile(const scalar_t* src, at::opmath_type<scalar_t>* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = src[i];
}

template <typename scalar_t>
void store_tile(const at::opmath_type<scalar_t>* src, scalar_t* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = scalar_t(src[i]);
}

template <typename scalar_t>
void forward_kernel(const scalar_t* x, const scalar_t* b, scalar_t* y, int64_t rows,
                    int64_t cols) {
  using acc_t = at::opmath_type<scalar_t>;
  at::parallel_for(0, rows, grain_rows(cols), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      if constexpr (std::is_same_v<scalar_t, acc_t>) {
        forward_span<acc_t>(x + r * cols, b, y + r * cols, cols);
      } else {
        acc_t xs[kTile], bs[kTile], ys[kTile];
        for (int64_t j = 0; j < cols; j += kTile) {
          const int64_t n = std::min(kTile, cols - j);
          load_tile(x + r * cols + j, xs, n);
          load_tile(b + j, bs, n);
          forward_span<acc_t>(xs, bs, ys, n);
          store_tile(ys, y + r * cols + j, n);
        }
      }
    }
  });
}

template <typename scalar_t>
void backward_kernel(const scalar_t* g, const scalar_t* x, const scalar_t* b, scalar_t* gx,
                     int64_t rows, int64_t cols) {
  using acc_t = at::opmath_type<scalar_t>;
  at::parallel_for(0, rows, grain_rows(cols), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      if constexpr (std::is_same_v<scalar_t, acc_t>) {
        backward_span<acc_t>(g + r * cols, x + r * cols, b, gx + r * cols, cols);
      } else {
        acc_t gs[kTile], xs[kTile], bs[kTile], outs[kTile];
        for (int64_t j = 0; j < cols; j += kTile) {
          const int64_t n = std::min(kTile, cols - j);
          load_tile(g + r * cols + j, gs, n);
          load_tile(x + r * cols + j, xs, n);
          load_tile(b + j, bs, n);
          backward_span<acc_t>(gs, xs, bs, outs, n);
          store_tile(outs, gx + r * cols + j, n);
        }
      }
    }
  });
}

}  // namespace

at::Tensor bias_gelu_forward(at::Tensor x, at::Tensor bias) {
  check_inputs(x, bias);
  x = x.contiguous();
  bias = bias.contiguous();
  auto y = at::empty_like(x, at::MemoryFormat::Contiguous);
  const int64_t cols = bias.size(0);
  const int64_t rows = cols ? x.numel() / cols : 0;
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "bias_gelu_forward", [&] {
    forward_kernel<scalar_t>(x.data_ptr<scalar_t>(), bias.data_ptr<scalar_t>(),
                             y.data_ptr<scalar_t>(), rows, cols);
  });
  return y;
}

at::Tensor bias_gelu_backward(at::Tensor grad, at::Tensor x, at::Tensor bias) {
  check_inputs(x, bias);
  TORCH_CHECK(grad.sizes() == x.sizes() && grad.scalar_type() == x.scalar_type(),
              "bias_gelu_backward: grad must match x in shape and dtype");
  grad = grad.contiguous();
  x = x.contiguous();
  bias = bias.contiguous();
  auto gx = at::empty_like(x, at::MemoryFormat::Contiguous);
  const int64_t cols = bias.size(0);
  const int64_t rows = cols ? x.numel() / cols : 0;
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "bias_gelu_backward", [&] {
    backward_kernel<scalar_t>(grad.data_ptr<scalar_t>(), x.data_ptr<scalar_t>(),
                              bias.data_ptr<scalar_t>(), gx.data_ptr<scalar_t>(), rows, cols);
  });
  return gx;
}

TORCH_LIBRARY(torchturbo_cpu, m) {
  m.def("bias_gelu_forward(Tensor x, Tensor bias) -> Tensor");
  m.def("bias_gelu_backward(Tensor grad, Tensor x, Tensor bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(torchturbo_cpu, CPU, m) {
  m.impl("bias_gelu_forward", &bias_gelu_forward);
  m.impl("bias_gelu_backward", &bias_gelu_backward);
}

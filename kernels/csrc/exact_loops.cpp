// Compiled loops of the exact CPU kernels (kernels/compiled_loops.py builds and loads this file).
//
// Each function here computes, element by element, the same sequence of exactly rounded IEEE operations
// (add, mul, copy) as the torch-op composition it replaces in cpu_exact.py / fixed_order.py, so its output has
// the same bits by construction -- never a reassociated sum, never a fused multiply-add (built with
// -ffp-contract=off and without -ffast-math). What it saves is the per-op cost of those compositions: one call
// and one pass over memory instead of a dozen aten calls, each with its own dispatch, allocation and
// TensorIterator set-up, which is most of the exact path's price on small models.
//
// `#pragma omp simd` (element-wise loops only, each iteration its own element): the compiler then vectorises a loop it
// left scalar for fear that its pointers overlap (they never do here). A vector lane computes the same correctly
// rounded IEEE operation as a scalar one, so the bits are the same; never on a loop that sums across iterations.
//
// Thread count: every output element is computed by one thread from its own inputs, so no bit depends on how
// at::parallel_for splits the work.
#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <ATen/ScalarOps.h>  // attention_query_rows' scale, as torch.mul wraps a Python float
#include <ATen/TensorIterator.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__SSE2__)
#include <xmmintrin.h>  // transpose_into's 4 x 4 squares
#endif
#include <ATen/core/dispatch/Dispatcher.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

// MKL's per-thread thread count, its C entry point (mkl_set_num_threads_local is the Fortran one, which takes a
// pointer), in libtorch where torch is built with MKL. Declared weak on ELF hosts (null where torch has no MKL);
// elsewhere not used.
#if defined(__ELF__)
extern "C" int MKL_Set_Num_Threads_Local(int) __attribute__((weak));
#define VEXACT_MKL_LOCAL_THREADS(n) (MKL_Set_Num_Threads_Local != nullptr ? MKL_Set_Num_Threads_Local(n) : -1)
#else
#define VEXACT_MKL_LOCAL_THREADS(n) (-1)
#endif

namespace {

constexpr int64_t kGrain = 1 << 14;  // output elements per parallel task (below it: one thread)

// Sum `width` values by halving (fixed_order.tree_sum): level 1 adds x[j] + x[j + half] where both exist and
// x[j] + 0 where the partner is padding (so -0.0 becomes +0.0, as an add of real zero padding does); each later
// level adds the two halves of the scratch row. Here `run` adjacent outputs are summed side by side: `buf` holds
// `half` rows of `run` values.
//
// `zero_last`: the last value is first added to +0.0 (the unpadded last chunk of a weight gradient on views: its
// GEMM's result + 0.0, as zero padding gives), in the same pass. The last value is always a level-1 partner (half <
// width), so its pair adds x[j] + (x[last] + 0): the two additions, each rounded, of the separate passes.
template <typename T>
void tree_single(const T* x, int64_t width, int64_t s_width, T* buf, T* out, bool zero_last = false) {
  // One output (run == 1): the levels are loops along the row itself (vector adds where the row is contiguous).
  const int64_t half = int64_t(1) << (63 - __builtin_clzll(uint64_t(width - 1)));
  const int64_t paired = width - half;
  const int64_t plain = zero_last ? paired - 1 : paired;  // the pairs without the last value
  for (int64_t j = 0; j < plain; ++j) buf[j] = x[j * s_width] + x[(j + half) * s_width];
  if (zero_last) buf[plain] = x[plain * s_width] + (x[(width - 1) * s_width] + T(0));
  for (int64_t j = paired; j < half; ++j) buf[j] = x[j * s_width] + T(0);
  for (int64_t h = half / 2; h >= 1; h /= 2) {
    for (int64_t j = 0; j < h; ++j) buf[j] = buf[j] + buf[j + h];
  }
  *out = buf[0];
}

template <typename T>
void tree_run(const T* x, int64_t width, int64_t s_width, int64_t run, int64_t s_run, T* buf, T* out,
              bool zero_last = false) {
  if (run == 1) return tree_single(x, width, s_width, buf, out, zero_last);
  const int64_t half = int64_t(1) << (63 - __builtin_clzll(uint64_t(width - 1)));
  const int64_t paired = width - half;
  for (int64_t j = 0; j < paired; ++j) {
    const T* a = x + j * s_width;
    const T* b = x + (j + half) * s_width;
    T* row = buf + j * run;
    if (zero_last && j == paired - 1) {
      for (int64_t r = 0; r < run; ++r) row[r] = a[r * s_run] + (b[r * s_run] + T(0));
    } else {
      for (int64_t r = 0; r < run; ++r) row[r] = a[r * s_run] + b[r * s_run];
    }
  }
  for (int64_t j = paired; j < half; ++j) {
    const T* a = x + j * s_width;
    T* row = buf + j * run;
    for (int64_t r = 0; r < run; ++r) row[r] = a[r * s_run] + T(0);
  }
  for (int64_t h = half / 2; h >= 1; h /= 2) {
    for (int64_t j = 0; j < h; ++j) {
      T* row = buf + j * run;
      const T* other = buf + (j + h) * run;
      for (int64_t r = 0; r < run; ++r) row[r] = row[r] + other[r];
    }
  }
  std::copy(buf, buf + run, out);
}

}  // namespace

// fixed_order.tree_sum(x, dim) for width >= 2, fp32 or fp64, any strides, into `out` (contiguous, the shape of x
// without `dim`; undefined: a fresh tensor), which it returns. The last remaining dim is the "run" summed side by
// side (contiguous in x: vector adds). `zero_last`: x's last entry along `dim` + 0.0 first (tree_run).
at::Tensor tree_sum_into(const at::Tensor& x, int64_t dim, c10::optional<at::Tensor> out_or_none, bool zero_last) {
  at::Tensor out = out_or_none.has_value() ? *out_or_none : at::Tensor();
  TORCH_CHECK(x.device().is_cpu(), "tree_sum: a CPU tensor, got ", x.device());
  const int64_t nd = x.dim();
  TORCH_CHECK(nd >= 1, "tree_sum: a tensor with at least one dim");
  const int64_t d = dim < 0 ? dim + nd : dim;
  TORCH_CHECK(d >= 0 && d < nd, "tree_sum: dim ", dim, " out of range for ", nd, " dims");
  const int64_t width = x.size(d);
  TORCH_CHECK(width >= 2, "tree_sum: width >= 2 (a width of 1 is a select)");
  std::vector<int64_t> sizes, strides;  // the output's dims, with x's strides
  for (int64_t k = 0; k < nd; ++k) {
    if (k != d) {
      sizes.push_back(x.size(k));
      strides.push_back(x.stride(k));
    }
  }
  if (!out.defined()) {
    out = at::empty(sizes, x.options().memory_format(at::MemoryFormat::Contiguous));
  } else {
    TORCH_CHECK(out.sizes() == at::IntArrayRef(sizes) && out.is_contiguous() && out.scalar_type() == x.scalar_type(),
                "tree_sum: out must be contiguous, of x's dtype and x's shape without dim");
  }
  if (out.numel() == 0) return out;
  const int64_t run = sizes.empty() ? 1 : sizes.back();
  const int64_t s_run = sizes.empty() ? 1 : strides.back();
  const int64_t runs = out.numel() / run;
  const int64_t s_width = x.stride(d);
  const int64_t outer_dims = sizes.empty() ? 0 : int64_t(sizes.size()) - 1;
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "tree_sum", [&] {
    const scalar_t* base = x.data_ptr<scalar_t>();
    scalar_t* dst = out.data_ptr<scalar_t>();
    const int64_t half = int64_t(1) << (63 - __builtin_clzll(uint64_t(width - 1)));
    const int64_t grain = std::max<int64_t>(1, kGrain / std::max<int64_t>(1, run * width));
    at::parallel_for(0, runs, grain, [&](int64_t first, int64_t last) {
      std::vector<scalar_t> buf(half * run);
      for (int64_t i = first; i < last; ++i) {
        int64_t offset = 0, rest = i;  // the run's start in x: its index over the outer dims, last dim fastest
        for (int64_t k = outer_dims - 1; k >= 0; --k) {
          offset += (rest % sizes[k]) * strides[k];
          rest /= sizes[k];
        }
        tree_run<scalar_t>(base + offset, width, s_width, run, s_run, buf.data(), dst + i * run, zero_last);
      }
    });
  });
  return out;
}

at::Tensor tree_sum(const at::Tensor& x, int64_t dim) { return tree_sum_into(x, dim, c10::nullopt, false); }

// ----------------------------------------------------------------------------------------------------- chunked math
// cpu_elementwise.unary's loop after the guard chose the library function (torch.exp / log / cos / sqrt: the ATen op
// called here): x flattened, zero-padded to a multiple of `multiple`, and the op called once per `chunk` elements --
// the same calls on the same slices as the Python loop. The chunks are spread over threads: each chunk is still one
// call of the op on one thread (inside a parallel region ATen runs an op serially, and a chunk is below its grain
// anyway), so no element's bits depend on the thread count. `inplace`: x is scratch the caller gives up (the result
// may be written into it). Returns the result with x's shape (a view of the padded buffer where there is padding).
namespace {

// While alive (where `active`): this thread's OpenMP and MKL thread counts 1 (thread-local settings of this thread
// only, restored on exit). Where torch has no MKL, only OpenMP's count changes.
class OneThreadHere {
 public:
  explicit OneThreadHere(bool active) : active_(active) {
    if (!active_) return;
#ifdef _OPENMP
    omp_before_ = omp_get_max_threads();
    omp_set_num_threads(1);
#endif
    mkl_before_ = VEXACT_MKL_LOCAL_THREADS(1);
  }
  ~OneThreadHere() {
    if (!active_) return;
#ifdef _OPENMP
    omp_set_num_threads(omp_before_);
#endif
    if (mkl_before_ >= 0) VEXACT_MKL_LOCAL_THREADS(mkl_before_);
  }
  OneThreadHere(const OneThreadHere&) = delete;
  OneThreadHere& operator=(const OneThreadHere&) = delete;

 private:
  bool active_;
  int omp_before_ = 1;
  int mkl_before_ = -1;  // MKL's setting before (0: its global one); -1: no MKL setter
};

// The library function `which` over `flat` into `out` (both 1-D, `padded` elements, a multiple of the vector width):
// one call per `chunk` elements, the chunks spread over threads.
void chunked_calls(const at::Tensor& flat, const at::Tensor& out, int64_t which, int64_t chunk) {
  const int64_t padded = flat.numel(), chunks = (padded + chunk - 1) / chunk;
  auto run = [&](int64_t first, int64_t last) {
    at::NoGradGuard no_grad;  // grad mode is per thread and on in a pool worker, where an out= call refuses inputs
                              // that require grad; these calls are an op's forward, never differentiated through
    for (int64_t c = first; c < last; ++c) {
      const int64_t start = c * chunk, stop = std::min(padded, start + chunk);
      at::Tensor in_c = flat.slice(0, start, stop), out_c = out.slice(0, start, stop);
      switch (which) {
        case 0: at::exp_out(out_c, in_c); break;
        case 1: at::log_out(out_c, in_c); break;
        case 2: at::cos_out(out_c, in_c); break;
        default: at::sqrt_out(out_c, in_c); break;
      }
    }
  };
  if (chunks == 1) {
    // Below aten's own grain (at::internal::GRAIN_SIZE) on this thread alone: aten's exp and MKL's vector math
    // under it each split even a few thousand elements over the threads (two forks and joins, which cost more than
    // the call at 2 threads; as inside any at::parallel_for body, where they run on one thread). An elementwise
    // function: which thread computes an element changes no bit (the guard probed it at every thread count).
    const OneThreadHere one_thread(padded < at::internal::GRAIN_SIZE);
    run(0, 1);
  } else {
    at::parallel_for(0, chunks, 1, run);
  }
}

int64_t round_up(int64_t n, int64_t multiple) { return ((std::max<int64_t>(n, 1) + multiple - 1) / multiple) * multiple; }

}  // namespace

at::Tensor unary_chunked(const at::Tensor& x, int64_t which, int64_t chunk, int64_t multiple, bool inplace) {
  TORCH_CHECK(x.device().is_cpu(), "unary_chunked: a CPU tensor");
  TORCH_CHECK(which >= 0 && which < 4, "unary_chunked: which is 0 (exp), 1 (log), 2 (cos) or 3 (sqrt)");
  TORCH_CHECK(chunk > 0 && multiple > 0 && chunk % multiple == 0, "unary_chunked: chunk a multiple of `multiple`");
  at::Tensor flat = x.contiguous().view(-1);
  const int64_t total = flat.numel();
  const int64_t padded = round_up(total, multiple);
  if (padded != total) {
    at::Tensor grown = at::empty({padded}, flat.options());
    grown.slice(0, 0, total).copy_(flat);
    grown.slice(0, total, padded).zero_();
    flat = grown;
  }
  const bool fresh = flat.data_ptr() != x.data_ptr();
  at::Tensor out = (inplace || fresh) ? flat : at::empty_like(flat);
  chunked_calls(flat, out, which, chunk);
  return out.slice(0, 0, total).view(x.sizes());
}

namespace {

// The checks of token_logprobs_forward and _backward: fp32 logits [..., V >= 2], int64 targets [...] inside [0, V).
void check_token_logprobs(const char* op, const at::Tensor& logits, const at::Tensor& targets) {
  TORCH_CHECK(logits.scalar_type() == at::kFloat && logits.dim() >= 1, op, ": fp32 logits");
  TORCH_CHECK(targets.scalar_type() == at::kLong, op, ": int64 targets");
  const int64_t v = logits.size(-1);
  TORCH_CHECK(v >= 2, op, ": a vocabulary of at least 2");
  TORCH_CHECK(targets.sizes() == logits.sizes().slice(0, logits.dim() - 1), op,
              ": targets shaped as the logits without their last dim");
  const at::Tensor tc = targets.contiguous();
  const int64_t* t = tc.data_ptr<int64_t>();
  for (int64_t r = 0; r < tc.numel(); ++r) {
    TORCH_CHECK(t[r] >= 0 && t[r] < v, op, ": target ", t[r], " outside [0, ", v, ")");
  }
}

}  // namespace

// cpu_exact._token_logprobs_exact on fp32 logits [..., V] (V >= 2) and int64 targets [...], where the guard chose the
// library exp and log: shifted = x - amax(x) (the ATen amax), picked = shifted[target], the chunked exp of the
// flattened shifted logits (zero-padded to `multiple`), each row's halving tree, the chunked log of the row sums
// (zero-padded likewise), and picked - log. The same operations on the same values as the torch ops.
// Returns what the VJP needs too: {out, each row's max [...], each row's log normalizer [...]}
// (cpu_exact._token_logprobs_with_saved's values); token_logprobs_forward returns out alone.
std::vector<at::Tensor> token_logprobs_forward_saving(const at::Tensor& logits, const at::Tensor& targets,
                                                      int64_t chunk, int64_t multiple) {
  check_token_logprobs("token_logprobs_forward", logits, targets);
  const int64_t v = logits.size(-1);
  const at::Tensor xc = logits.contiguous(), tc = targets.contiguous();
  const at::Tensor row_max = at::amax(logits, {-1}, false).contiguous();  // on the logits as given, as the torch op
  const int64_t rows = tc.numel(), total = rows * v;
  const int64_t padded = round_up(total, multiple), padded_rows = round_up(rows, multiple);
  at::Tensor shifted = at::empty({padded}, xc.options());
  at::Tensor sums = at::empty({padded_rows}, xc.options());
  at::Tensor picked = at::empty({rows}, xc.options());
  const float* x = xc.data_ptr<float>();
  const float* m = row_max.data_ptr<float>();
  const int64_t* t = tc.data_ptr<int64_t>();
  float* sh = shifted.data_ptr<float>();
  float* pk = picked.data_ptr<float>();
  const int64_t grain = std::max<int64_t>(1, kGrain / v);
  at::parallel_for(0, rows, grain, [&](int64_t first, int64_t last) {
    for (int64_t r = first; r < last; ++r) {
      const float* xr = x + r * v;
      float* o = sh + r * v;
      for (int64_t j = 0; j < v; ++j) o[j] = xr[j] - m[r];
      pk[r] = o[t[r]];
    }
  });
  std::fill(sh + total, sh + padded, 0.0f);
  chunked_calls(shifted, shifted, 0, chunk);  // exp in place
  float* su = sums.data_ptr<float>();
  at::parallel_for(0, rows, grain, [&](int64_t first, int64_t last) {
    std::vector<float> buf(v);
    for (int64_t r = first; r < last; ++r) tree_single(sh + r * v, v, 1, buf.data(), su + r);
  });
  std::fill(su + rows, su + padded_rows, 0.0f);
  chunked_calls(sums, sums, 1, chunk);  // log in place
  at::Tensor out = at::empty(tc.sizes(), xc.options());
  float* o = out.data_ptr<float>();
  for (int64_t r = 0; r < rows; ++r) o[r] = pk[r] - su[r];
  return {out, row_max, sums.slice(0, 0, rows).view(tc.sizes())};
}

at::Tensor token_logprobs_forward(const at::Tensor& logits, const at::Tensor& targets, int64_t chunk,
                                  int64_t multiple) {
  return token_logprobs_forward_saving(logits, targets, chunk, multiple)[0];
}

// cpu_exact._token_logprobs_vjp from token_logprobs_forward_saving's row max and log normalizer: d logits =
// exp((x - max) - log normalizer) * -g, then g added at each row's target. The two subtractions rounded one by one
// (x - max is the forward's shifted logits, bit for bit), the chunked exp of the flattened result (zero-padded to
// `multiple`), the product and the add: the torch ops' values, in one buffer instead of three passes.
at::Tensor token_logprobs_backward(const at::Tensor& logits, const at::Tensor& row_max,
                                   const at::Tensor& log_normalizer, const at::Tensor& targets, const at::Tensor& grad,
                                   int64_t chunk, int64_t multiple) {
  check_token_logprobs("token_logprobs_backward", logits, targets);
  const int64_t v = logits.size(-1), rows = targets.numel(), total = rows * v;
  for (const at::Tensor* row : {&row_max, &log_normalizer, &grad}) {
    TORCH_CHECK(row->scalar_type() == at::kFloat && row->numel() == rows,
                "token_logprobs_backward: fp32 max, log normalizer and grad, one per row");
  }
  const at::Tensor xc = logits.contiguous(), tc = targets.contiguous(), mc = row_max.contiguous(),
                   lc = log_normalizer.contiguous(), gc = grad.contiguous();
  const int64_t padded = round_up(total, multiple);
  at::Tensor buf = at::empty({padded}, xc.options());
  const float *x = xc.data_ptr<float>(), *m = mc.data_ptr<float>(), *l = lc.data_ptr<float>(),
              *g = gc.data_ptr<float>();
  const int64_t* t = tc.data_ptr<int64_t>();
  float* b = buf.data_ptr<float>();
  const int64_t grain = std::max<int64_t>(1, kGrain / v);
  at::parallel_for(0, rows, grain, [&](int64_t first, int64_t last) {
    for (int64_t r = first; r < last; ++r) {
      const float* xr = x + r * v;
      float* o = b + r * v;
      for (int64_t j = 0; j < v; ++j) {
        const float shifted = xr[j] - m[r];
        o[j] = shifted - l[r];
      }
    }
  });
  std::fill(b + total, b + padded, 0.0f);
  chunked_calls(buf, buf, 0, chunk);  // exp in place
  at::parallel_for(0, rows, grain, [&](int64_t first, int64_t last) {
    for (int64_t r = first; r < last; ++r) {
      float* o = b + r * v;
      const float minus_g = -g[r];
      for (int64_t j = 0; j < v; ++j) o[j] *= minus_g;
      o[t[r]] += g[r];
    }
  });
  return buf.slice(0, 0, total).view(xc.sizes());
}

// ----------------------------------------------------------------------------------------------------- rms_norm
// cpu_exact's RMSNorm, forward and VJP, row by row on fp32 values (the caller upcasts and rounds back): the same
// exactly rounded operations in the same order. D = the row length.

// forward, around the library sqrt (a probed host function, called by the caller between the two passes):
// mean_square = tree(x * x) / D + eps per row ([rows]), then, with inv_rms = 1 / sqrt(mean_square), out =
// (x * inv_rms) * w.
at::Tensor rms_norm_mean_square(const at::Tensor& x, double eps) {
  TORCH_CHECK(x.scalar_type() == at::kFloat, "rms_norm_mean_square: fp32");
  const at::Tensor xc = x.contiguous();
  const int64_t d = x.size(-1), rows = x.numel() / std::max<int64_t>(d, 1);
  TORCH_CHECK(d >= 1, "rms_norm_mean_square: rows of at least one element");
  at::Tensor mean = at::empty(x.sizes().slice(0, x.dim() - 1), x.options());
  const float* in = xc.data_ptr<float>();
  float* m = mean.data_ptr<float>();
  const float eps_f = static_cast<float>(eps), d_f = static_cast<float>(d);
  at::parallel_for(0, rows, std::max<int64_t>(1, kGrain / d), [&](int64_t first, int64_t last) {
    std::vector<float> sq(d), buf(d);
    for (int64_t row = first; row < last; ++row) {
      const float* xr = in + row * d;
      for (int64_t j = 0; j < d; ++j) sq[j] = xr[j] * xr[j];
      float total = sq[0];
      if (d > 1) tree_single(sq.data(), d, 1, buf.data(), &total);
      m[row] = total / d_f + eps_f;
    }
  });
  return mean;
}

at::Tensor rms_norm_scale(const at::Tensor& x, const at::Tensor& inv_rms, const at::Tensor& weight) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && inv_rms.scalar_type() == at::kFloat &&
                  weight.scalar_type() == at::kFloat, "rms_norm_scale: fp32");
  const at::Tensor xc = x.contiguous(), rc = inv_rms.contiguous(), wc = weight.contiguous();
  const int64_t d = x.size(-1), rows = x.numel() / std::max<int64_t>(d, 1);
  TORCH_CHECK(rc.numel() == rows && wc.numel() == d, "rms_norm_scale: shapes");
  at::Tensor out = at::empty_like(xc);
  const float* in = xc.data_ptr<float>();
  const float* r = rc.data_ptr<float>();
  const float* w = wc.data_ptr<float>();
  float* o = out.data_ptr<float>();
  at::parallel_for(0, rows, std::max<int64_t>(1, kGrain / d), [&](int64_t first, int64_t last) {
    for (int64_t row = first; row < last; ++row) {
      const float* xr = in + row * d;
      float* orow = o + row * d;
      for (int64_t j = 0; j < d; ++j) orow[j] = (xr[j] * r[row]) * w[j];
    }
  });
  return out;
}

// VJP: gw = g * w, dot = tree(gw * x) / D, grad_x = inv * (gw - (x * (inv * inv)) * dot), and grad_w = the tree over
// all rows (in row order) of (g * x) * inv. Returns (grad_x, grad_w); either may be skipped (an empty tensor).
std::vector<at::Tensor> rms_norm_backward(const at::Tensor& grad, const at::Tensor& x, const at::Tensor& inv_rms,
                                          const at::Tensor& weight, bool need_x, bool need_w) {
  TORCH_CHECK(grad.scalar_type() == at::kFloat && x.scalar_type() == at::kFloat &&
                  inv_rms.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat,
              "rms_norm_backward: fp32");
  const at::Tensor gc = grad.contiguous(), xc = x.contiguous(), rc = inv_rms.contiguous(), wc = weight.contiguous();
  const int64_t d = x.size(-1), rows = x.numel() / std::max<int64_t>(d, 1);
  TORCH_CHECK(gc.numel() == xc.numel() && rc.numel() == rows && wc.numel() == d, "rms_norm_backward: shapes");
  at::Tensor grad_x = need_x ? at::empty_like(xc) : at::empty({0}, x.options());
  at::Tensor terms = need_w ? at::empty({rows, d}, x.options()) : at::empty({0}, x.options());
  const float* g = gc.data_ptr<float>();
  const float* xs = xc.data_ptr<float>();
  const float* r = rc.data_ptr<float>();
  const float* w = wc.data_ptr<float>();
  float* gx = need_x ? grad_x.data_ptr<float>() : nullptr;
  float* tw = need_w ? terms.data_ptr<float>() : nullptr;
  const float d_f = static_cast<float>(d);
  at::parallel_for(0, rows, std::max<int64_t>(1, kGrain / d), [&](int64_t first, int64_t last) {
    std::vector<float> gw(d), prod(d), buf(d);
    for (int64_t row = first; row < last; ++row) {
      const float* grow = g + row * d;
      const float* xrow = xs + row * d;
      const float inv = r[row];
      if (need_x) {
        for (int64_t j = 0; j < d; ++j) gw[j] = grow[j] * w[j];
        for (int64_t j = 0; j < d; ++j) prod[j] = gw[j] * xrow[j];
        float dot = prod[0];
        if (d > 1) tree_single(prod.data(), d, 1, buf.data(), &dot);
        dot = dot / d_f;
        const float inv_sq = inv * inv;
        float* out = gx + row * d;
        for (int64_t j = 0; j < d; ++j) out[j] = inv * (gw[j] - (xrow[j] * inv_sq) * dot);
      }
      if (need_w) {
        float* trow = tw + row * d;
        for (int64_t j = 0; j < d; ++j) trow[j] = (grow[j] * xrow[j]) * inv;
      }
    }
  });
  at::Tensor grad_w = at::empty({0}, x.options());
  if (need_w) grad_w = rows > 1 ? tree_sum(terms, 0) : terms.select(0, 0);
  return {grad_x, grad_w};
}

// ----------------------------------------------------------------------------------------------------- SwiGLU
// cpu_exact's SwiGLU around its exp (the library's, chunked, under the guard): the forward's add, divide and
// multiply, and the VJP's chain, element by element in the torch ops' order. fp32 in and out.

namespace {

// From e = exp(-gate) (overwritten with 1 + e, which the backward needs): (silu = gate / (1 + e), out = silu * up);
// without `up` (nullptr), silu only (out undefined).
std::vector<at::Tensor> silu_and_product(const at::Tensor& gate, at::Tensor& exp_neg, const at::Tensor* up) {
  at::Tensor silu = at::empty_like(gate), out;
  const float* g = gate.data_ptr<float>();
  const float* u = nullptr;
  float* o = nullptr;
  if (up != nullptr) {
    out = at::empty_like(gate);
    u = up->data_ptr<float>();
    o = out.data_ptr<float>();
  }
  float* e = exp_neg.data_ptr<float>();
  float* s = silu.data_ptr<float>();
  at::parallel_for(0, gate.numel(), kGrain, [&](int64_t first, int64_t last) {
    if (o != nullptr) {
#pragma omp simd
      for (int64_t i = first; i < last; ++i) {
        const float d = e[i] + 1.0f;
        const float q = g[i] / d;
        e[i] = d;
        s[i] = q;
        o[i] = q * u[i];
      }
    } else {
#pragma omp simd
      for (int64_t i = first; i < last; ++i) {
        const float d = e[i] + 1.0f;
        e[i] = d;
        s[i] = g[i] / d;
      }
    }
  });
  return {silu, out};
}

// exp(-g) for a contiguous fp32 g, as cpu_elementwise.unary computes it: -g into a buffer zero-padded to `multiple`
// (the negation unary is given), its chunked exp in place; a view of the buffer, g's shape.
at::Tensor exp_of_negated(const at::Tensor& g, int64_t chunk, int64_t multiple) {
  const int64_t total = g.numel(), padded = round_up(total, multiple);
  at::Tensor buffer = at::empty({padded}, g.options());
  const float* gp = g.data_ptr<float>();
  float* e = buffer.data_ptr<float>();
  at::parallel_for(0, total, kGrain, [&](int64_t first, int64_t last) {
    for (int64_t i = first; i < last; ++i) e[i] = -gp[i];
  });
  std::fill(e + total, e + padded, 0.0f);
  chunked_calls(buffer, buffer, 0, chunk);
  return buffer.slice(0, 0, total).view(g.sizes());
}

}  // namespace

// From e = exp(-gate) (overwritten with 1 + e, which the backward needs): returns (silu = gate / (1 + e),
// out = silu * up).
std::vector<at::Tensor> silu_mul_forward(const at::Tensor& gate, at::Tensor& exp_neg, const at::Tensor& up) {
  TORCH_CHECK(gate.scalar_type() == at::kFloat && exp_neg.scalar_type() == at::kFloat &&
                  up.scalar_type() == at::kFloat, "silu_mul_forward: fp32");
  TORCH_CHECK(gate.is_contiguous() && exp_neg.is_contiguous() && up.is_contiguous() &&
                  gate.numel() == exp_neg.numel() && gate.numel() == up.numel(), "silu_mul_forward: contiguous, same size");
  return silu_and_product(gate, exp_neg, &up);
}

// The whole forward where the guard chose the library exp: exp(-gate) as cpu_elementwise.unary computes it, then
// silu_mul_forward's loop. Returns (out, 1 + exp(-gate) (a view of the buffer, gate's shape), silu).
// bf16 gate and up: the fp32 steps on the gate upcast (exact), then the output as cpu_exact's torch ops make it --
// silu rounded to bf16 times up, in bf16 -- by the same two aten calls (their rounding, NaNs included).
std::vector<at::Tensor> silu_mul_exp_forward(const at::Tensor& gate, const at::Tensor& up, int64_t chunk,
                                             int64_t multiple) {
  const auto dtype = gate.scalar_type();
  TORCH_CHECK((dtype == at::kFloat || dtype == at::kBFloat16) && up.scalar_type() == dtype &&
                  gate.sizes() == up.sizes(),
              "silu_mul_exp_forward: fp32 or bf16 gate and up of one dtype and shape");
  const at::Tensor g = gate.to(at::kFloat).contiguous();
  at::Tensor denom = exp_of_negated(g, chunk, multiple);
  if (dtype == at::kBFloat16) {
    const at::Tensor silu = silu_and_product(g, denom, nullptr)[0];
    return {at::mul(silu.to(dtype), up), denom, silu};
  }
  const at::Tensor u = up.contiguous();
  std::vector<at::Tensor> parts = silu_and_product(g, denom, &u);
  return {parts[1], denom, parts[0]};
}

// The VJP with sig = 1 / denom: grad_gate = ((((1 - sig) * gate) + 1) * sig) * grad * up, grad_up = silu * grad;
// either may be skipped (an empty tensor). grad, gate, up and silu in one dtype: fp32, or bf16 (silu: the forward's
// silu rounded to bf16, as the forward's product used it), each value upcast exactly; denom fp32. Every step in fp32,
// as the torch ops compute it; a bf16 gradient is the fp32 result rounded by aten's own conversion (its rounding,
// NaNs included).
namespace {

template <typename T>
void silu_mul_backward_loop(const T* g, const T* x, const T* u, const float* d, const T* s, float* gg, float* gu,
                            int64_t count) {
  at::parallel_for(0, count, kGrain, [&](int64_t first, int64_t last) {
    if (gg != nullptr) {
#pragma omp simd
      for (int64_t i = first; i < last; ++i) {
        const float sig = 1.0f / d[i];
        float t = 1.0f - sig;
        t = t * static_cast<float>(x[i]);
        t = t + 1.0f;
        t = t * sig;
        t = t * static_cast<float>(g[i]);
        gg[i] = t * static_cast<float>(u[i]);
      }
    }
    if (gu != nullptr) {
#pragma omp simd
      for (int64_t i = first; i < last; ++i) gu[i] = static_cast<float>(s[i]) * static_cast<float>(g[i]);
    }
  });
}

}  // namespace

std::vector<at::Tensor> silu_mul_backward(const at::Tensor& grad, const at::Tensor& gate, const at::Tensor& up,
                                          const at::Tensor& denom, const at::Tensor& silu, bool need_gate,
                                          bool need_up) {
  const at::ScalarType dtype = grad.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "silu_mul_backward: fp32 or bf16, got ", dtype);
  for (const at::Tensor* t : {&grad, &gate, &up, &silu}) {
    TORCH_CHECK(t->scalar_type() == dtype && t->is_contiguous() && t->numel() == grad.numel(),
                "silu_mul_backward: grad, gate, up and silu of one dtype, contiguous, same size");
  }
  TORCH_CHECK(denom.scalar_type() == at::kFloat && denom.is_contiguous() && denom.numel() == grad.numel(),
              "silu_mul_backward: fp32 denom, contiguous, same size");
  const auto fp32_out = [&](bool need) { return need ? at::empty(grad.sizes(), denom.options()) : at::Tensor(); };
  at::Tensor grad_gate = fp32_out(need_gate), grad_up = fp32_out(need_up);
  float* gg = need_gate ? grad_gate.data_ptr<float>() : nullptr;
  float* gu = need_up ? grad_up.data_ptr<float>() : nullptr;
  const float* d = denom.data_ptr<float>();
  if (dtype == at::kFloat) {
    silu_mul_backward_loop<float>(grad.data_ptr<float>(), gate.data_ptr<float>(), up.data_ptr<float>(), d,
                                  silu.data_ptr<float>(), gg, gu, grad.numel());
  } else {
    using bf16 = c10::BFloat16;
    silu_mul_backward_loop<bf16>(grad.data_ptr<bf16>(), gate.data_ptr<bf16>(), up.data_ptr<bf16>(), d,
                                 silu.data_ptr<bf16>(), gg, gu, grad.numel());
  }
  const auto result = [&](const at::Tensor& t) {
    if (!t.defined()) return at::empty({0}, grad.options());
    return dtype == at::kFloat ? t : t.to(dtype);
  };
  return {result(grad_gate), result(grad_up)};
}

// ----------------------------------------------------------------------------------------------------- rope
// kernels.native.rope's torch ops element by element. x [B, T, H, hd] (fp32 or bf16, upcast exactly; unit last
// stride), cos and sin [B, T, hd / 2] fp32 (unit last stride, any other strides): out[..., j] = x1 * c - x2 * s and
// out[..., half + j] = x2 * c + x1 * s, each product rounded, then the difference or sum, in fp32; a bf16 result by
// aten's own conversion (the torch ops' .to: its rounding, NaNs included).
// rope_backward: autograd's VJP of those ops on grad [B, T, H, hd]: grad_x1 = (g2 * s + g1 * c) + 0.0 and grad_x2 =
// (g2 * c + (-g1) * s) + 0.0 -- each sum in the order autograd accumulates a slice's two gradients (the add's branch
// first), the negation from the difference's backward, and the + 0.0 where the two slices' gradients meet in zeros
// (-0.0 becomes +0.0); then the conversion back to x's dtype.
namespace {

template <typename T, bool kBackward>
at::Tensor rope_loop(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  const int64_t batch = x.size(0), length = x.size(1), heads = x.size(2), dim = x.size(3), half = dim / 2;
  at::Tensor out = at::empty(x.sizes(), x.options().dtype(at::kFloat).memory_format(at::MemoryFormat::Contiguous));
  const T* xp = x.data_ptr<T>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t xs0 = x.stride(0), xs1 = x.stride(1), xs2 = x.stride(2);
  const int64_t cs0 = cos.stride(0), cs1 = cos.stride(1), ss0 = sin.stride(0), ss1 = sin.stride(1);
  const int64_t rows = batch * length * heads;
  at::parallel_for(0, rows, std::max<int64_t>(1, kGrain / std::max<int64_t>(1, dim)), [&](int64_t first,
                                                                                         int64_t last) {
    for (int64_t row = first; row < last; ++row) {
      const int64_t h = row % heads, t = (row / heads) % length, b = row / (heads * length);
      const T* x1 = xp + b * xs0 + t * xs1 + h * xs2;
      const T* x2 = x1 + half;
      const float* c = cp + b * cs0 + t * cs1;
      const float* s = sp + b * ss0 + t * ss1;
      float* o1 = op + row * dim;
      float* o2 = o1 + half;
      if (kBackward) {
#pragma omp simd
        for (int64_t j = 0; j < half; ++j) {
          const float g1 = static_cast<float>(x1[j]), g2 = static_cast<float>(x2[j]);
          const float from_add = g2 * s[j], from_sub = g1 * c[j];
          const float to_x2 = g2 * c[j], negated = (-g1) * s[j];
          o1[j] = (from_add + from_sub) + 0.0f;
          o2[j] = (to_x2 + negated) + 0.0f;
        }
      } else {
#pragma omp simd
        for (int64_t j = 0; j < half; ++j) {
          const float a = static_cast<float>(x1[j]), b2 = static_cast<float>(x2[j]);
          const float ac = a * c[j], bs = b2 * s[j], bc = b2 * c[j], as = a * s[j];
          o1[j] = ac - bs;
          o2[j] = bc + as;
        }
      }
    }
  });
  return x.scalar_type() == at::kFloat ? out : out.to(x.scalar_type());
}

at::Tensor rope_dispatch(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, bool backward,
                         const char* name) {
  TORCH_CHECK(x.dim() == 4 && x.size(3) % 2 == 0, name, ": x [B, T, H, hd] with an even hd");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, name, ": fp32 or bf16 x");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.dim() == 3 &&
                  sin.dim() == 3 && (cos.size(0) == x.size(0) || cos.size(0) == 1) &&
                  (cos.size(1) == x.size(1) || cos.size(1) == 1) && cos.size(2) == x.size(3) / 2 &&
                  sin.sizes() == cos.sizes(),
              name, ": fp32 cos and sin [B or 1, T or 1, hd / 2]");
  const at::Tensor xc = x.stride(3) == 1 ? x : x.contiguous();
  // a table broadcast over B or T: stride 0 there
  const std::vector<int64_t> table{x.size(0), x.size(1), x.size(3) / 2};
  const at::Tensor cc = (cos.stride(2) == 1 ? cos : cos.contiguous()).expand(table);
  const at::Tensor sc = (sin.stride(2) == 1 ? sin : sin.contiguous()).expand(table);
  if (x.scalar_type() == at::kFloat) {
    return backward ? rope_loop<float, true>(xc, cc, sc) : rope_loop<float, false>(xc, cc, sc);
  }
  return backward ? rope_loop<c10::BFloat16, true>(xc, cc, sc) : rope_loop<c10::BFloat16, false>(xc, cc, sc);
}

}  // namespace

at::Tensor rope_forward(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  return rope_dispatch(x, cos, sin, false, "rope_forward");
}

at::Tensor rope_backward(const at::Tensor& grad, const at::Tensor& cos, const at::Tensor& sin) {
  return rope_dispatch(grad, cos, sin, true, "rope_backward");
}

// ----------------------------------------------------------------------------------------------------- embedding
// cpu_exact._sum_rows_by_token (the embedding's VJP): out[v] = the halving tree, in position order, of the rows whose
// token is v, zero-padded to the width of v's chunk. Chunks as there: the tokens that occur, by count descending
// (ties by token id), max(1, budget / width) tokens per chunk, width = the count of the chunk's first token. (Zero
// padding changes no value of a tree sum, only -0.0 into +0.0, so the width is kept exactly.) fp32 rows [count, D].
// `dtype`: the result's (fp32, or the weight's: the sums of the tokens that occur, fp32 rows side by side, rounded
// by aten's own conversion and written into zeros of that dtype -- the values of converting the fp32 result, without
// the vocabulary-wide fp32 buffer and its conversion).
at::Tensor sum_rows_by_token(const at::Tensor& tokens, const at::Tensor& rows, int64_t vocab, int64_t budget,
                             c10::optional<at::ScalarType> dtype) {
  TORCH_CHECK(tokens.scalar_type() == at::kLong && tokens.dim() == 1, "sum_rows_by_token: int64 tokens [count]");
  TORCH_CHECK(rows.scalar_type() == at::kFloat && rows.dim() == 2 && rows.size(0) == tokens.numel(),
              "sum_rows_by_token: fp32 rows [count, D]");
  const at::Tensor tc = tokens.contiguous(), rc = rows.contiguous();
  const int64_t count = tc.numel(), d = rc.size(1);
  const bool compact = dtype.has_value() && *dtype != at::kFloat;
  at::Tensor out = at::zeros({vocab, d}, rc.options().dtype(dtype.value_or(at::kFloat)));
  if (count == 0 || d == 0) return out;
  const int64_t* tok = tc.data_ptr<int64_t>();
  std::vector<int64_t> counts(vocab, 0);
  for (int64_t i = 0; i < count; ++i) {
    TORCH_CHECK(tok[i] >= 0 && tok[i] < vocab, "sum_rows_by_token: token ", tok[i], " outside [0, ", vocab, ")");
    ++counts[tok[i]];
  }
  std::vector<int64_t> first(vocab + 1, 0);  // token v's rows are members[first[v] .. first[v + 1]), in position order
  for (int64_t v = 0; v < vocab; ++v) first[v + 1] = first[v] + counts[v];
  std::vector<int64_t> members(count), filled(first.begin(), first.end() - 1);
  for (int64_t i = 0; i < count; ++i) members[filled[tok[i]]++] = i;
  std::vector<int64_t> present, row_of(vocab, 0);  // row_of[v]: v's row of the fp32 result (compact: by token id)
  for (int64_t v = 0; v < vocab; ++v) {
    if (counts[v] > 0) {
      row_of[v] = compact ? int64_t(present.size()) : v;
      present.push_back(v);
    }
  }
  const at::Tensor index = compact ? at::tensor(present, tc.options()) : at::Tensor();
  std::stable_sort(present.begin(), present.end(), [&](int64_t a, int64_t b) { return counts[a] > counts[b]; });
  std::vector<int64_t> width(vocab, 0);
  for (size_t start = 0; start < present.size();) {
    const int64_t w = counts[present[start]];
    const size_t take = size_t(std::max<int64_t>(1, budget / w));
    for (size_t k = start; k < std::min(present.size(), start + take); ++k) width[present[k]] = w;
    start += take;
  }
  const at::Tensor sums = compact ? at::empty({int64_t(present.size()), d}, rc.options()) : out;
  const float* in = rc.data_ptr<float>();
  float* dst = sums.data_ptr<float>();
  at::parallel_for(0, int64_t(present.size()), 1, [&](int64_t lo, int64_t hi) {
    std::vector<float> laid, buf;
    for (int64_t p = lo; p < hi; ++p) {
      const int64_t v = present[p], w = width[v];
      float* o = dst + row_of[v] * d;
      if (w == 1) {  // a width of one is the row itself (no + 0)
        std::copy(in + members[first[v]] * d, in + (members[first[v]] + 1) * d, o);
        continue;
      }
      laid.assign(w * d, 0.0f);
      for (int64_t r = 0; r < counts[v]; ++r) {
        std::copy(in + members[first[v] + r] * d, in + (members[first[v] + r] + 1) * d, laid.data() + r * d);
      }
      buf.resize(w * d);
      tree_run<float>(laid.data(), w, d, d, 1, buf.data(), o);
    }
  });
  return compact ? out.index_copy_(0, index, sums.to(out.scalar_type())) : out;
}

// ----------------------------------------------------------------------------------------------------- layouts
// Copies that lay out GEMM operands (gemm_tiles.zero_padded, gemm_weight_gradient._chunks_transposed): pure data
// movement, so the same bits as the torch-op copies whatever the order; one call instead of an allocation, a copy per
// region and a zero fill per padding region.

namespace {

// out[i * out_row + j] = in[j * in_row + i * in_col] for j < rows, i < cols: a transposing copy in 32 x 32 blocks,
// so that both sides touch a few cache lines at a time (a column-by-column copy read one line per element).
// An fp32 source whose i runs along its rows (in_col == 1) moves 4 x 4 squares through SSE registers (part of
// every x86-64 CPU): four 16-byte loads, four shuffles, four stores instead of sixteen scalar moves. The same values.
template <typename T>
void transpose_into(const T* in, int64_t in_row, int64_t in_col, int64_t rows, int64_t cols, T* out,
                    int64_t out_row) {
  constexpr int64_t kBlock = 32;
  for (int64_t i0 = 0; i0 < cols; i0 += kBlock) {
    const int64_t i1 = std::min(cols, i0 + kBlock);
    for (int64_t j0 = 0; j0 < rows; j0 += kBlock) {
      const int64_t j1 = std::min(rows, j0 + kBlock);
      int64_t i = i0;
#if defined(__SSE2__)
      if constexpr (std::is_same_v<T, float>) {
        if (in_col == 1) {
          for (; i + 4 <= i1; i += 4) {
            int64_t j = j0;
            for (; j + 4 <= j1; j += 4) {
              const float* src = in + j * in_row + i;
              __m128 r0 = _mm_loadu_ps(src), r1 = _mm_loadu_ps(src + in_row);
              __m128 r2 = _mm_loadu_ps(src + 2 * in_row), r3 = _mm_loadu_ps(src + 3 * in_row);
              _MM_TRANSPOSE4_PS(r0, r1, r2, r3);
              float* dst = out + i * out_row + j;
              _mm_storeu_ps(dst, r0);
              _mm_storeu_ps(dst + out_row, r1);
              _mm_storeu_ps(dst + 2 * out_row, r2);
              _mm_storeu_ps(dst + 3 * out_row, r3);
            }
            for (; j < j1; ++j) {
              for (int64_t c = 0; c < 4; ++c) out[(i + c) * out_row + j] = in[j * in_row + i + c];
            }
          }
        }
      }
#endif
      for (; i < i1; ++i) {
        T* dst = out + i * out_row;
        const T* src = in + i * in_col;
        for (int64_t j = j0; j < j1; ++j) dst[j] = src[j * in_row];
      }
    }
  }
}

// Where the `index`-th combination of dims 0..last of an out tensor of `shape` (last dim fastest) sits in src:
// its element offset, or -1 where it lies outside src (padding).
// (src's sizes and strides, and `shape`, read once per call into plain arrays: read from the tensor per row, they cost
// more than the row's copy.)
struct SrcLayout {
  std::vector<int64_t> sizes, strides, shape;
  SrcLayout(const at::Tensor& src, at::IntArrayRef out_shape)
      : sizes(src.sizes().vec()), strides(src.strides().vec()), shape(out_shape.vec()) {}
};

int64_t src_offset(const SrcLayout& layout, int64_t index, int64_t last) {
  int64_t offset = 0;
  for (int64_t k = last; k >= 0; --k) {
    const int64_t i = index % layout.shape[k];
    index /= layout.shape[k];
    if (i >= layout.sizes[k]) return -1;
    offset += i * layout.strides[k];
  }
  return offset;
}

}  // namespace

// A fresh contiguous tensor of `shape` (same rank as src, each dim >= src's), src in its leading corner, zero
// elsewhere (as torch.constant_pad_nd with zeros after each dim's end); src may have any strides.
at::Tensor padded_copy(const at::Tensor& src, at::IntArrayRef shape) {
  const int64_t nd = src.dim();
  TORCH_CHECK(int64_t(shape.size()) == nd && nd >= 1, "padded_copy: shape of the same rank as src");
  for (int64_t k = 0; k < nd; ++k) TORCH_CHECK(shape[k] >= src.size(k), "padded_copy: shape smaller than src");
  at::Tensor out = at::empty(shape, src.options().memory_format(at::MemoryFormat::Contiguous));
  if (out.numel() == 0) return out;
  const int64_t cols = shape[nd - 1], src_cols = src.size(nd - 1), s_col = src.stride(nd - 1);
  const int64_t rows = out.numel() / cols;
  const SrcLayout layout(src, shape);
  if (nd >= 2 && s_col != 1 && src.stride(nd - 2) == 1 && src.size(nd - 2) > 1) {
    // the last two dims transposed (a .transpose(-1, -2) view): blocked transposes per matrix, then the zeros
    const int64_t mat_rows = shape[nd - 2], src_rows = src.size(nd - 2), mats = out.numel() / (mat_rows * cols);
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, src.scalar_type(), "padded_copy_t", [&] {
      const scalar_t* base = src.data_ptr<scalar_t>();
      scalar_t* dst = out.data_ptr<scalar_t>();
      at::parallel_for(0, mats, std::max<int64_t>(1, kGrain / (mat_rows * cols)), [&](int64_t first, int64_t last) {
        for (int64_t mat = first; mat < last; ++mat) {
          scalar_t* o = dst + mat * mat_rows * cols;
          const int64_t offset = src_offset(layout, mat, nd - 3);
          if (offset < 0) {
            std::fill(o, o + mat_rows * cols, scalar_t(0));
            continue;
          }
          // out row r, column c = src[r, c]: src rows are read along their stride-1 dim (nd - 2)
          transpose_into(base + offset, s_col, 1, src_cols, src_rows, o, cols);
          for (int64_t r = 0; r < src_rows; ++r) std::fill(o + r * cols + src_cols, o + (r + 1) * cols, scalar_t(0));
          std::fill(o + src_rows * cols, o + mat_rows * cols, scalar_t(0));
        }
      });
    });
    return out;
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, src.scalar_type(), "padded_copy", [&] {
    const scalar_t* base = src.data_ptr<scalar_t>();
    scalar_t* dst = out.data_ptr<scalar_t>();
    at::parallel_for(0, rows, std::max<int64_t>(1, kGrain / cols), [&](int64_t first, int64_t last) {
      for (int64_t row = first; row < last; ++row) {
        scalar_t* o = dst + row * cols;
        const int64_t offset = src_offset(layout, row, nd - 2);
        int64_t copied = 0;
        if (offset >= 0) {
          const scalar_t* in = base + offset;
          if (s_col == 1) {
            std::copy(in, in + src_cols, o);
          } else {
            for (int64_t j = 0; j < src_cols; ++j) o[j] = in[j * s_col];
          }
          copied = src_cols;
        }
        std::fill(o + copied, o + cols, scalar_t(0));
      }
    });
  });
  return out;
}

// [chunks, width, block]: src [M, N] cut into `block`-row chunks, each transposed; out[c, i, j] = src[c * block + j,
// i], zero where src has no element (rows past M, columns from N to width).
at::Tensor chunks_transposed(const at::Tensor& src, int64_t block, int64_t chunks, int64_t width) {
  TORCH_CHECK(src.dim() == 2, "chunks_transposed: a 2-D tensor");
  const int64_t m = src.size(0), n = src.size(1), s_row = src.stride(0), s_col = src.stride(1);
  TORCH_CHECK(chunks * block >= m && width >= n, "chunks_transposed: too few chunks or columns");
  at::Tensor out = at::empty({chunks, width, block}, src.options().memory_format(at::MemoryFormat::Contiguous));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, src.scalar_type(), "chunks_transposed", [&] {
    const scalar_t* base = src.data_ptr<scalar_t>();
    scalar_t* dst = out.data_ptr<scalar_t>();
    at::parallel_for(0, chunks, std::max<int64_t>(1, kGrain / std::max<int64_t>(1, width * block)),
                     [&](int64_t first, int64_t last) {
      for (int64_t c = first; c < last; ++c) {
        const int64_t rows = std::min(block, m - c * block);  // rows of src in this chunk
        scalar_t* chunk = dst + c * width * block;
        transpose_into(base + c * block * s_row, s_row, s_col, rows, n, chunk, block);
        for (int64_t i = 0; i < n; ++i) std::fill(chunk + i * block + rows, chunk + (i + 1) * block, scalar_t(0));
        std::fill(chunk + n * block, chunk + width * block, scalar_t(0));
      }
    });
  });
  return out;
}

// ----------------------------------------------------------------------------------------------------- GEMM tiles
// cpu_exact._tiled_matmul after its plan (operand, tile heights) is made, for a shape class
// whose guard verdict is the plain library GEMM: the same operand layouts, the same at::bmm call (the ATen op
// torch.bmm is), the same views, so the same bits. What they save is the Python between those calls.
namespace {

constexpr int64_t kAlignment = 64;  // cpu_exact.ALIGNMENT

bool aligned_contiguous(const at::Tensor& t) {
  return t.is_contiguous() && reinterpret_cast<std::uintptr_t>(t.data_ptr()) % kAlignment == 0;
}

// gemm_tiles.zero_padded: a clone (strides preserved) when nothing is padded, else the padded copy.
at::Tensor zero_padded(const at::Tensor& x, at::IntArrayRef shape) {
  return x.sizes() == shape ? x.clone() : padded_copy(x, shape);
}

}  // namespace

// x [M, K] fp32 @ operand [1, K, N_pad] (shared by every tile) in `block`-row tiles -> [M, n] (a view).
at::Tensor tiled_matmul(const at::Tensor& x, const at::Tensor& operand, int64_t block, int64_t n) {
  const int64_t rows = x.size(0), k = x.size(1), n_pad = operand.size(2);
  const int64_t blocks = (rows + block - 1) / block;
  at::Tensor padded;
  if (blocks * block != rows) {
    padded = zero_padded(x, {blocks * block, k});
  } else {
    padded = aligned_contiguous(x) ? x : x.clone(at::MemoryFormat::Contiguous);
  }
  at::Tensor out = at::bmm(padded.view({blocks, block, k}), operand.expand({blocks, k, n_pad}));
  out = out.view({blocks * block, n_pad});
  return n_pad == n ? out.slice(0, 0, rows) : out.slice(0, 0, rows).slice(1, 0, n);
}

namespace {

// torch's oneDNN linear (mkldnn::_linear_pointwise, no bias, no activation) on a packed weight over `rows` [R, K] --
// as they are, or (blocks > 0) as `blocks` tiles [blocks, R / blocks, K] in one call, or (blocks > 0 and each_tile)
// one call per tile [R / blocks, K], their outputs stacked -- as [R, N]: the op call(s) packed_linear and
// packed_linears make (gemm_packed.PACKED_CALLS).
at::Tensor packed_rows_linear(const at::Tensor& rows, const at::Tensor& packed, int64_t blocks, bool each_tile) {
  const int64_t padded = rows.size(0), k = rows.size(1);
  static const c10::OperatorHandle linear =
      c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  auto call = [&](const at::Tensor& input) {
    std::vector<c10::IValue> stack{input, packed, c10::IValue(), std::string("none"),
                                   c10::List<std::optional<at::Scalar>>(), std::string("")};
    linear.callBoxed(&stack);
    return stack[0].toTensor();
  };
  if (blocks > 0 && each_tile) {
    const int64_t block = padded / blocks;
    std::vector<at::Tensor> tiles;
    tiles.reserve(blocks);
    for (int64_t t = 0; t < blocks; ++t) tiles.push_back(call(rows.narrow(0, t * block, block)));
    return blocks == 1 ? tiles[0] : at::cat(tiles, 0);
  }
  if (blocks > 0) return call(rows.view({blocks, padded / blocks, k})).view({padded, -1});
  return call(rows);
}

}  // namespace

// gemm_packed._packed_run's call after its plan (a decode step's GEMM on a weight packed once): the M rows of x
// [..., K] copied into `buffer` [R, K] (the kept zero-padded input, R >= M, its rows from M on zero already: the
// caller's), torch's oneDNN linear (mkldnn::_linear_pointwise, no bias, no activation) on the packed weight over the
// buffer -- as it is, or (blocks > 0) as `blocks` tiles [blocks, R / blocks, K], in one call or (each_tile) one per
// tile -- and the first M rows and n columns of its output, viewed as [..., n]. The same copy and the same op call on the same operands as the Python steps, so
// the same bits; what it saves is their Python (a decode step makes one such call per linear layer).
at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& buffer, const at::Tensor& packed, int64_t blocks,
                         int64_t n, bool each_tile) {
  TORCH_CHECK(x.dim() >= 1 && buffer.dim() == 2 && buffer.is_contiguous() && x.size(-1) == buffer.size(1) &&
                  buffer.size(1) > 0 && x.numel() / buffer.size(1) <= buffer.size(0) &&
                  x.scalar_type() == buffer.scalar_type(),
              "packed_linear: x [..., K] and a contiguous buffer [R >= x's rows, K] of its dtype");
  const int64_t padded = buffer.size(0), k = buffer.size(1), rows = x.numel() / k;
  TORCH_CHECK(blocks >= 0 && (blocks == 0 || padded % blocks == 0), "packed_linear: blocks must divide R");
  buffer.narrow(0, 0, rows).copy_(x.reshape({rows, k}));
  at::Tensor out = packed_rows_linear(buffer, packed, blocks, each_tile).narrow(0, 0, rows);
  if (out.size(1) != n) out = out.narrow(1, 0, n);
  std::vector<int64_t> sizes = x.sizes().vec();
  sizes.back() = n;
  return out.view(sizes);
}

namespace {

// x's M rows [M, K] as a GEMM's input: copied into `buffer` where one is given (the kept zero-padded input [R, K], its
// rows from M on zero already: the caller's), else as they are (a contiguous copy where they are not contiguous and
// aligned, as gemm_tiles.aligned_contiguous makes). `op`: the caller's name, for its errors.
at::Tensor rows_input(const at::Tensor& x, const c10::optional<at::Tensor>& buffer, const char* op) {
  const int64_t k = x.size(-1), rows = x.numel() / k;
  at::Tensor input = x.reshape({rows, k});
  if (buffer.has_value()) {
    TORCH_CHECK(buffer->dim() == 2 && buffer->is_contiguous() && buffer->size(1) == k && buffer->size(0) >= rows &&
                    buffer->scalar_type() == x.scalar_type(),
                op, ": a contiguous buffer [R >= x's rows, K] of x's dtype");
    buffer->narrow(0, 0, rows).copy_(input);
    return *buffer;
  }
  return aligned_contiguous(input) ? input : input.clone(at::MemoryFormat::Contiguous);
}

// Each weight's output from `out` [M, sum of pads] (its first M rows already): its `widths[i]` columns from the sum of
// the `pads` before it, a contiguous copy viewed as x's leading shape [..., widths[i]].
std::vector<at::Tensor> weight_outputs(const at::Tensor& out, const at::Tensor& x, const std::vector<int64_t>& widths,
                                       const std::vector<int64_t>& pads) {
  std::vector<int64_t> sizes = x.sizes().vec();
  std::vector<at::Tensor> outputs;
  int64_t start = 0;
  for (size_t i = 0; i < widths.size(); ++i) {
    sizes.back() = widths[i];
    outputs.push_back(out.narrow(1, start, widths[i]).contiguous().view(sizes));
    start += pads[i];
  }
  return outputs;
}

}  // namespace

// fused_linears._fused_call's steps (a decode step's linear layers of one input on their weights packed as one): x's
// rows as the GEMM's input (rows_input); torch's oneDNN linear on the packed weights over them -- as they are, or
// (blocks > 0) as `blocks` tiles, in one call or (each_tile) one per tile -- and each weight's output
// (weight_outputs). The same copies and the same op call on the same operands as the Python steps, so the same bits;
// what it saves is their Python.
std::vector<at::Tensor> packed_linears(const at::Tensor& x, const c10::optional<at::Tensor>& buffer,
                                       const at::Tensor& packed, int64_t blocks, std::vector<int64_t> widths,
                                       std::vector<int64_t> pads, bool each_tile) {
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) > 0 && widths.size() == pads.size() && !widths.empty(),
              "packed_linears: x [..., K] and a width and padded width per weight");
  const at::Tensor input = rows_input(x, buffer, "packed_linears");
  TORCH_CHECK(blocks >= 0 && (blocks == 0 || input.size(0) % blocks == 0), "packed_linears: blocks must divide R");
  const int64_t rows = x.numel() / x.size(-1);
  return weight_outputs(packed_rows_linear(input, packed, blocks, each_tile).narrow(0, 0, rows), x, widths, pads);
}

// gemm_linear's laid-out call of a decode step's tiles (form "one call": the canonical call itself, one at::bmm
// of the tiles [blocks, R / blocks, K] against the operand laid out once per tile [blocks, K, N]) after its plan, on
// one weight or (fused_linears) several laid out as one: x's rows as the GEMM's input (rows_input); the bmm; then,
// for one weight (one width), the first M rows and n columns of its output as a view [..., n] -- for several, each
// weight's output (weight_outputs). The same copies and the same op call on the same operands as the Python steps,
// so the same bits; what it saves is their Python.
std::vector<at::Tensor> bmm_linears(const at::Tensor& x, const c10::optional<at::Tensor>& buffer,
                                    const at::Tensor& operand, int64_t blocks, std::vector<int64_t> widths,
                                    std::vector<int64_t> pads) {
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) > 0 && widths.size() == pads.size() && !widths.empty() &&
                  operand.dim() == 3 && operand.size(0) == blocks && operand.size(1) == x.size(-1),
              "bmm_linears: x [..., K], an operand [blocks, K, N] and a width and padded width per weight");
  const at::Tensor input = rows_input(x, buffer, "bmm_linears");
  const int64_t padded = input.size(0), k = x.size(-1), rows = x.numel() / k;
  TORCH_CHECK(blocks > 0 && padded % blocks == 0, "bmm_linears: blocks must divide R");
  const at::Tensor out =
      at::bmm(input.view({blocks, padded / blocks, k}), operand).view({padded, operand.size(2)}).narrow(0, 0, rows);
  if (widths.size() > 1) return weight_outputs(out, x, widths, pads);
  std::vector<int64_t> sizes = x.sizes().vec();
  sizes.back() = widths[0];
  return {(out.size(1) == widths[0] ? out : out.narrow(1, 0, widths[0])).view(sizes)};
}

// One GEMM per tile: out[t] = a_tiles[t] @ operand[0], each an at::mm of one fixed shape ([h, K] @ [K, N], the call
// gemm_laid_out's per-tile loops make; a one-tile at::bmm ran several times slower in bf16 on the AMD EPYC:
// oneDNN's batched path lays the operand out on every call), the tiles shared out between the threads by
// at::parallel_for. A tile runs on one thread inside the parallel region (oneDNN and MKL run a call made inside an
// OpenMP region on the calling thread), so its bits cannot depend on how the tiles are divided, on the thread count or
// on the other tiles; gemm_laid_out checks them at first use against the canonical call, per class and thread
// count. column_blocks > 1: each tile from `whole_tiles` on runs as that many GEMMs of consecutive column blocks of the
// operand (N split in blocks of ceil(N / column_blocks) columns), each into its columns of the tile's output, and the
// items (the whole tiles, then the (tile, block) pairs) are shared out instead -- so an odd tile count still gives two
// threads even shares (five tiles: two whole ones each and half of the fifth); the same first-use checks cover the
// whole tiles and the column blocks (a GEMM whose bits follow its column count fails them). With one item (or one
// thread) no region is opened: the calls run one after another, as the Python loop makes them. `one_thread` (a
// blas-1-thread class, whose canonical call runs at 1 thread): each GEMM with OpenMP's and MKL's thread-local counts
// 1 (OneThreadHere), as that call sees them. Without it a call inside the region still runs on its thread, but oneDNN
// plans it for the process's thread count: its bf16 GEMMs on an Intel Xeon with AMX then block the reduction as the
// 2-thread call does, not as the 1-thread canonical call (llama100m's input gradients through its MLP and LM head
// failed their first-use check, and ran the canonical call, copying the weight once per tile on every call).
at::Tensor tile_gemms(const at::Tensor& a_tiles, const at::Tensor& operand, int64_t column_blocks, bool one_thread,
                      int64_t whole_tiles) {
  TORCH_CHECK(a_tiles.dim() == 3 && a_tiles.is_contiguous(), "tile_gemms: contiguous [T, h, K] tiles");
  TORCH_CHECK(operand.dim() == 3 && operand.size(0) == 1 &&
                  (operand.is_contiguous() || operand.transpose(1, 2).is_contiguous()) &&
                  operand.size(1) == a_tiles.size(2) && operand.scalar_type() == a_tiles.scalar_type(),
              "tile_gemms: a [1, K, N] operand of the tiles' dtype, contiguous or a transposed batch");
  const int64_t tiles = a_tiles.size(0), n = operand.size(2);
  TORCH_CHECK(column_blocks >= 1 && column_blocks <= std::max<int64_t>(n, 1),
              "tile_gemms: column_blocks must be from 1 to the operand's N");
  TORCH_CHECK(whole_tiles >= 0 && whole_tiles <= tiles, "tile_gemms: whole_tiles must be from 0 to the tile count");
  if (column_blocks == 1) whole_tiles = tiles;
  const int64_t width = (n + column_blocks - 1) / column_blocks, pairs = (tiles - whole_tiles) * column_blocks;
  const int64_t items = whole_tiles + pairs, threads = at::get_num_threads();
  // where both kinds divide evenly, each thread's run of items (at::parallel_for hands out equal consecutive runs) is
  // its share of the whole tiles, then its share of the pairs; else the whole tiles, then the pairs
  const bool interleaved = whole_tiles % threads == 0 && pairs % threads == 0;
  const int64_t whole_each = whole_tiles / threads, run = items / threads;
  at::Tensor out = at::empty({tiles, a_tiles.size(1), n}, a_tiles.options());
  const auto gemm = [&](int64_t first, int64_t last) {
    at::NoGradGuard no_grad;  // grad mode is per thread: a worker's is on (an out= call then refuses inputs that
                              // require grad); the tiles are an op's forward, never differentiated through here
    const OneThreadHere one_thread_here(one_thread);
    const at::Tensor matrix = operand.select(0, 0);
    for (int64_t item = first; item < last; ++item) {
      int64_t pair = item - whole_tiles;  // the item's index among the pairs, or negative: a whole tile
      if (interleaved) {
        const int64_t share = item / run, place = item % run;  // the item's thread share, its place in it
        pair = place < whole_each ? -1 - (share * whole_each + place) : share * (run - whole_each) + place - whole_each;
      }
      if (pair < 0) {
        const int64_t t = interleaved ? -1 - pair : item;
        at::Tensor dst = out.select(0, t);
        at::mm_out(dst, a_tiles.select(0, t), matrix);
        continue;
      }
      const int64_t t = whole_tiles + pair / column_blocks, lo = (pair % column_blocks) * width;
      const int64_t cols = std::min(width, n - lo);
      if (cols <= 0) continue;
      at::Tensor columns = out.select(0, t).narrow(1, lo, cols);
      at::mm_out(columns, a_tiles.select(0, t), matrix.narrow(1, lo, cols));
    }
  };
  if (items == 1 || threads == 1) {
    gemm(0, items);
  } else {
    at::parallel_for(0, items, 1, gemm);
  }
  return out;
}

// HostGuard.bmm's blas-1-thread path (a GEMM class right at 1 thread only) with the tiles shared out between the
// threads: a [T, R, K] @ b [T, K, N] as one bmm per thread over consecutive tiles, each inside the parallel region on
// its own thread with OpenMP's and MKL's thread-local counts 1 (OneThreadHere: the library sees one thread, as in the
// 1-thread call the guard probed). The class's probe found a tile's rows to have the same bits in calls of any tile
// count at 1 thread; the guard still checks this call against the 1-thread one at first use (same_bits). One tile,
// or one thread: the 1-thread call itself.
at::Tensor split_bmm(const at::Tensor& a, const at::Tensor& b) {
  TORCH_CHECK(a.dim() == 3 && b.dim() == 3 && a.size(0) == b.size(0) && a.size(2) == b.size(1) &&
                  a.scalar_type() == b.scalar_type(),
              "split_bmm: a [T, R, K] and b [T, K, N] of one dtype");
  at::Tensor out = at::empty({a.size(0), a.size(1), b.size(2)}, a.options());
  const auto run = [&](int64_t first, int64_t last) {
    at::NoGradGuard no_grad;  // (as tile_gemms: a worker's grad mode is on, and an out= call refuses such inputs)
    const OneThreadHere one_thread(true);
    at::Tensor part = out.narrow(0, first, last - first);
    at::bmm_out(part, a.narrow(0, first, last - first), b.narrow(0, first, last - first));
  };
  if (a.size(0) <= 1 || at::get_num_threads() == 1) {
    run(0, a.size(0));
  } else {
    at::parallel_for(0, a.size(0), 1, run);
  }
  return out;
}

// The weight gradients' GEMMs shared out between the threads by their cost (multiply-adds), largest first, each to
// the thread with the least work so far: whatever their sizes, the threads get near-even shares (a plain split of
// llama100m's slabs of 256, 256 and 64 rows, or of a 256-token chunk's slabs and a 64-token chunk's, gave one thread
// four times the other's work). Each task runs on one thread, inside the parallel region (as in tile_gemms), so no
// bit depends on which thread runs it; with one task or one thread they run in order on the calling thread.
namespace {

template <typename Run>
void spread_by_cost(const std::vector<int64_t>& costs, const Run& run) {
  const int64_t tasks = static_cast<int64_t>(costs.size()), threads = at::get_num_threads();
  if (tasks <= 1 || threads == 1) {
    at::NoGradGuard no_grad;  // out= calls refuse inputs that require grad where grad mode is on
    for (int64_t t = 0; t < tasks; ++t) run(t);
    return;
  }
  std::vector<int64_t> order(tasks);
  for (int64_t t = 0; t < tasks; ++t) order[t] = t;
  std::stable_sort(order.begin(), order.end(), [&](int64_t x, int64_t y) { return costs[x] > costs[y]; });
  std::vector<std::vector<int64_t>> shares(threads);
  std::vector<int64_t> load(threads, 0);
  for (const int64_t t : order) {
    const int64_t j = std::min_element(load.begin(), load.end()) - load.begin();
    shares[j].push_back(t);
    load[j] += costs[t];
  }
  at::parallel_for(0, threads, 1, [&](int64_t first, int64_t last) {
    at::NoGradGuard no_grad;  // as in tile_gemms: a worker thread's grad mode is on
    for (int64_t j = first; j < last; ++j) {
      for (const int64_t t : shares[j]) run(t);
    }
  });
}

}  // namespace

// A weight gradient's chunks in slabs (gemm_weight_gradient._reduction_slabs): a [M, N] and b [M, K] in `block`-row
// chunks, the last chunk's rows zero-padded to `last_length` (>= its rows; every other chunk is whole), and for each
// chunk c and each `slab`-row slab of the N output rows, parts[c, lo : lo + cols] = chunk c of a's slab columns, seen
// transposed, @ chunk c of b (gemm_weight_gradient._slab_products makes the same at::mm calls in Python). The
// (chunk, slab) pairs are shared out between the threads by cost, each GEMM on one thread (spread_by_cost), so no bit
// depends on how the threads divide them. Returns the partial products [chunks, N, K], which the caller adds by the
// canonical halving tree; gemm_weight_gradient checks the spread at first use against the pairs in turn. `out`: where
// the products go (contiguous [chunks, N, K] of a's dtype; undefined: a fresh tensor), so that a one-chunk caller
// writes its result tensor itself (a view of a fresh [1, N, K] would not be accumulated into in place by autograd).
// column_blocks > 1: each pair's GEMM as that many GEMMs of consecutive blocks of its output columns (b's K columns:
// a GEMM of other columns, the same reduction over the chunk's tokens), for a reduction of too few pairs to give the
// threads even shares (one chunk of one slab: every bf16 gradient of a layer of at most 256 outputs ran on one
// thread); gemm_weight_gradient checks them at first use against the whole pairs in turn on one thread.
at::Tensor reduction_slab_mms(const at::Tensor& a, const at::Tensor& b, int64_t block, int64_t last_length,
                              int64_t slab, c10::optional<at::Tensor> out, int64_t column_blocks) {
  TORCH_CHECK(a.dim() == 2 && b.dim() == 2 && a.size(0) == b.size(0) && a.stride(1) == 1 && b.is_contiguous() &&
                  a.scalar_type() == b.scalar_type() && block >= 1 && slab >= 1,
              "reduction_slab_mms: a [M, N] with unit column stride and a contiguous b [M, K] of its dtype");
  const int64_t m = a.size(0), n = a.size(1), k = b.size(1);
  TORCH_CHECK(column_blocks >= 1 && column_blocks <= std::max<int64_t>(k, 1),
              "reduction_slab_mms: column_blocks must be from 1 to b's K");
  const int64_t chunks = (m + block - 1) / block, slabs = (n + slab - 1) / slab;
  const int64_t width = (k + column_blocks - 1) / column_blocks, pairs = chunks * slabs;
  const int64_t tail_first = (chunks - 1) * block, tail_rows = m - tail_first;
  TORCH_CHECK(last_length >= tail_rows, "reduction_slab_mms: the last chunk is longer than last_length");
  at::Tensor parts = out.has_value() ? *out : at::empty({chunks, n, k}, a.options());
  TORCH_CHECK(parts.sizes() == at::IntArrayRef({chunks, n, k}) && parts.is_contiguous() &&
                  parts.scalar_type() == a.scalar_type(),
              "reduction_slab_mms: out must be a contiguous [chunks, N, K] of a's dtype");
  const at::Tensor b_tail = tail_rows < last_length ? padded_copy(b.narrow(0, tail_first, tail_rows), {last_length, k})
                                                    : b.narrow(0, tail_first, tail_rows);
  // a task: one (chunk, slab) pair's GEMM, or with column_blocks > 1 one block of its output columns (b's columns)
  std::vector<int64_t> costs(pairs * column_blocks);
  for (int64_t t = 0; t < pairs * column_blocks; ++t) {
    const int64_t pair = t / column_blocks, c = pair / slabs, lo = (pair % slabs) * slab;
    const int64_t cols = std::max<int64_t>(0, std::min(width, k - (t % column_blocks) * width));
    costs[t] = std::min(slab, n - lo) * (c == chunks - 1 ? last_length : block) * cols;
  }
  spread_by_cost(costs, [&](int64_t t) {
    const int64_t pair = t / column_blocks, c = pair / slabs, lo = (pair % slabs) * slab, cols = std::min(slab, n - lo);
    const int64_t first_col = (t % column_blocks) * width, out_cols = std::min(width, k - first_col);
    if (out_cols <= 0) return;
    const bool is_last = c == chunks - 1;
    const int64_t rows = is_last ? tail_rows : block, length = is_last ? last_length : block;
    const at::Tensor region = a.narrow(0, c * block, rows).narrow(1, lo, cols);
    const at::Tensor left = rows == length ? region : padded_copy(region, {length, cols});
    const at::Tensor right = is_last ? b_tail : b.narrow(0, c * block, block);
    at::Tensor dst = parts.select(0, c).narrow(0, lo, cols);
    if (column_blocks == 1) {
      at::mm_out(dst, left.t(), right);
    } else {
      at::Tensor dst_cols = dst.narrow(1, first_col, out_cols);
      at::mm_out(dst_cols, left.t(), right.narrow(1, first_col, out_cols));
    }
  });
  return parts;
}

// gemm_weight_gradient._transposed_matmul_views after its decisions: a.T @ b for a [M, N] and b [M, K] (aligned,
// contiguous, one dtype), reduced over M in chunks of `block` rows. Per slab of `slab` output rows: the whole chunks'
// GEMMs in one at::bmm on views, the last, partial chunk's GEMM on its rows zero-padded to `padded_to` (or, where
// padded_to is its length, on its real rows, the result + 0.0 where `unpadded_tail`), then the halving tree over the
// chunks in order -- the calls the Python function makes, on the same operands, in the same order. Each slab's
// result is written into its rows of the output: a one-chunk slab's GEMM writes there itself, a tree its sum (with
// the unpadded tail's + 0.0 in the tree's first pass: tree_sum_into), so no slab is copied.
at::Tensor transposed_views(const at::Tensor& a, const at::Tensor& b, int64_t block, int64_t padded_to,
                            bool unpadded_tail, int64_t slab) {
  TORCH_CHECK(a.dim() == 2 && b.dim() == 2 && a.size(0) == b.size(0) && a.is_contiguous() && b.is_contiguous() &&
                  a.scalar_type() == b.scalar_type() && block >= 1 && slab >= 1,
              "transposed_views: contiguous a [M, N] and b [M, K] of one dtype");
  const int64_t rows = a.size(0), n = a.size(1), k = b.size(1);
  const int64_t whole = rows / block, tail = rows % block, body = whole * block;
  TORCH_CHECK(padded_to >= tail, "transposed_views: padded_to shorter than the last chunk");
  const int64_t chunks = whole + (tail > 0 ? 1 : 0);
  const at::Tensor b_tail = padded_to > tail ? padded_copy(b.narrow(0, body, tail), {padded_to, k})
                                             : b.narrow(0, body, tail);
  at::Tensor out = at::empty({n, k}, a.options());
  for (int64_t first = 0; first < n; first += slab) {  // one slab: the whole output
    const int64_t cols = std::min(n, first + slab) - first;
    at::Tensor dst = out.narrow(0, first, cols);  // contiguous: whole rows of a contiguous [n, k]
    // the chunks' products: straight into the output where there is one chunk, else into parts for the tree
    at::Tensor parts = chunks == 1 ? dst.unsqueeze(0) : at::empty({chunks, cols, k}, a.options());
    if (whole > 0) {
      const at::Tensor views = a.narrow(0, 0, body).view({whole, block, n}).narrow(2, first, cols).transpose(1, 2);
      at::Tensor part = parts.narrow(0, 0, whole);
      at::bmm_out(part, views, b.narrow(0, 0, body).view({whole, block, k}));
    }
    if (tail > 0) {
      at::Tensor a_tail = a.narrow(0, body, tail).narrow(1, first, cols);
      if (padded_to > tail) a_tail = padded_copy(a_tail, {padded_to, cols});
      at::Tensor part = parts.narrow(0, whole, 1);
      at::bmm_out(part, a_tail.t().unsqueeze(0), b_tail.unsqueeze(0));
      if (unpadded_tail && chunks == 1) part.add_(0.0);
    }
    if (chunks > 1) tree_sum_into(parts, 0, dst, unpadded_tail && tail > 0);
  }
  return out;
}

// ----------------------------------------------------------------------------------------------------- attention
// The row-wise steps of cpu_attention._attention_probs around its exp, on the same fp32 values, in two passes. The
// scores come from the scores GEMM as [B, Hkv, RB, KB, R, C] (contiguous); a row is one query row of one row tile
// (its `real` first rows: a decode step's tile holds fewer real rows than its height) and its columns the first
// `width` keys (masked keys beyond `vis` up to `width`, a multiple of 16). Key j of row (b, ., r, i) is visible
// when j <= q_start[b or 0] + row_t[r * block + i].
namespace {

struct AttentionShape {
  int64_t batch, heads, row_blocks, key_blocks, block, real, width, key_block;
  bool uniform_start;
};

inline int64_t query_position(const AttentionShape& s, const int64_t* starts, const int64_t* row_t, int64_t b,
                              int64_t r, int64_t i) {
  return starts[s.uniform_start ? 0 : b] + row_t[r * s.block + i];
}

// The max of x[0 .. n) (-inf for none), NaN if any is NaN (as amax). A max is exact in any order but for the sign of
// a zero maximum, which no caller's result keeps (x - max of a zero x is +-0, whose exp is 1): so four running
// maxima in SSE lanes where the CPU has them (every x86-64 one), and a NaN flag beside them.
inline float row_max(const float* x, int64_t n) {
  float m = -std::numeric_limits<float>::infinity();
  bool nan = false;
  int64_t j = 0;
#if defined(__SSE2__)
  __m128 lanes = _mm_set1_ps(m), unordered = _mm_setzero_ps();
  for (; j + 4 <= n; j += 4) {
    const __m128 v = _mm_loadu_ps(x + j);
    unordered = _mm_or_ps(unordered, _mm_cmpunord_ps(v, v));
    lanes = _mm_max_ps(lanes, v);
  }
  alignas(16) float part[4];
  _mm_store_ps(part, lanes);
  for (const float value : part) m = value > m ? value : m;
  nan = _mm_movemask_ps(unordered) != 0;
#endif
  for (; j < n; ++j) {
    nan = nan || std::isnan(x[j]);
    m = x[j] > m ? x[j] : m;
  }
  return nan ? std::numeric_limits<float>::quiet_NaN() : m;
}

}  // namespace

// Pass 1: masked scores (-inf where hidden), the row max (NaN-propagating, as amax), and the shifted scores
// score - max where visible, 0 where hidden (the exp input of cpu_exact: exp(0) = 1 is zeroed in pass 2). Returns
// [B, Hkv, RB, real, width] fp32.
at::Tensor attention_shifted(const at::Tensor& scores, int64_t batch, int64_t heads, int64_t row_blocks,
                             int64_t key_blocks, int64_t block, int64_t real, int64_t width, int64_t key_block,
                             const at::Tensor& starts, const at::Tensor& row_t, bool uniform_start) {
  TORCH_CHECK(scores.scalar_type() == at::kFloat && scores.is_contiguous(), "attention_shifted: contiguous fp32");
  TORCH_CHECK(scores.numel() == batch * heads * row_blocks * key_blocks * block * key_block,
              "attention_shifted: scores shape");
  TORCH_CHECK(width <= key_blocks * key_block && real <= block, "attention_shifted: width / real");
  const at::Tensor starts_c = starts.to(at::kLong).contiguous(), row_t_c = row_t.to(at::kLong).contiguous();
  const AttentionShape s{batch, heads, row_blocks, key_blocks, block, real, width, key_block, uniform_start};
  at::Tensor out = at::empty({batch, heads, row_blocks, real, width}, scores.options());
  const float* src = scores.data_ptr<float>();
  float* dst = out.data_ptr<float>();
  const int64_t* st = starts_c.data_ptr<int64_t>();
  const int64_t* rt = row_t_c.data_ptr<int64_t>();
  const int64_t rows = batch * heads * row_blocks * real;
  at::parallel_for(0, rows, std::max<int64_t>(1, kGrain / std::max<int64_t>(1, width)), [&](int64_t first,
                                                                                             int64_t last) {
    for (int64_t row = first; row < last; ++row) {
      const int64_t i = row % real, r = (row / real) % row_blocks, bh = row / (real * row_blocks);
      const int64_t b = bh / heads;
      const int64_t pos = query_position(s, st, rt, b, r, i);
      // score of key j: tile j / C, column j % C, of this (bh, r) pair's tiles, row i; keys from `limit` on are
      // hidden (-inf, which changes no max)
      const float* tiles = src + (bh * row_blocks + r) * key_blocks * block * key_block + i * key_block;
      const int64_t limit = std::min<int64_t>(width, std::max<int64_t>(pos + 1, 0));
      float* o = dst + row * width;
      for (int64_t t = 0; t * key_block < limit; ++t) {
        const int64_t cols = std::min(key_block, limit - t * key_block);
        std::copy(tiles + t * block * key_block, tiles + t * block * key_block + cols, o + t * key_block);
      }
      const float m = row_max(o, limit);
      for (int64_t j = 0; j < limit; ++j) o[j] = o[j] - m;
      std::fill(o + limit, o + width, 0.0f);
    }
  });
  return out;
}

// Pass 2, on e = exp(shifted) (in place): e *= visible (1.0 or 0.0: hidden keys' exp(0) = 1 becomes 0), the
// halving tree of each key tile's columns (a tile's first `width - t * C` columns for the last, partial tile),
// the tree over the tiles (none for one tile), and the probability tiles for the P @ V GEMMs,
// [B*Hkv*RB*KB, block, C], zero outside the real rows and visible columns. Returns (tiles, the row sums padded
// to `block` rows with 1.0 [B, Hkv, RB, block, 1], the row sums of the real rows [B, Hkv, RB, real, 1]).
// `normalize`: e's rows are then divided by their sums in place (the normalised probabilities a backward keeps).
std::vector<at::Tensor> attention_tiles(at::Tensor e, int64_t batch, int64_t heads, int64_t row_blocks,
                                        int64_t key_blocks, int64_t block, int64_t real, int64_t width,
                                        int64_t key_block, const at::Tensor& starts, const at::Tensor& row_t,
                                        bool uniform_start, bool normalize) {
  TORCH_CHECK(e.scalar_type() == at::kFloat && e.is_contiguous(), "attention_tiles: contiguous fp32");
  TORCH_CHECK(e.numel() == batch * heads * row_blocks * real * width, "attention_tiles: shape");
  const at::Tensor starts_c = starts.to(at::kLong).contiguous(), row_t_c = row_t.to(at::kLong).contiguous();
  const AttentionShape s{batch, heads, row_blocks, key_blocks, block, real, width, key_block, uniform_start};
  at::Tensor tiles = at::empty({batch * heads * row_blocks * key_blocks, block, key_block}, e.options());
  at::Tensor denom_rows = at::empty({batch, heads, row_blocks, block, 1}, e.options());
  at::Tensor denom = at::empty({batch, heads, row_blocks, real, 1}, e.options());
  float* p = e.data_ptr<float>();
  float* t_out = tiles.data_ptr<float>();
  float* d_rows = denom_rows.data_ptr<float>();
  float* d_real = denom.data_ptr<float>();
  const int64_t* st = starts_c.data_ptr<int64_t>();
  const int64_t* rt = row_t_c.data_ptr<int64_t>();
  const int64_t pairs = batch * heads * row_blocks;  // (bh, r): one row tile and its key tiles
  const int64_t used = (width + key_block - 1) / key_block;
  const int64_t tile_size = block * key_block;
  at::parallel_for(0, pairs, std::max<int64_t>(1, kGrain / std::max<int64_t>(1, real * width)), [&](int64_t first,
                                                                                                   int64_t last) {
    std::vector<float> buf(std::max<int64_t>(key_block, key_blocks));
    std::vector<float> per_tile(key_blocks);
    for (int64_t pair = first; pair < last; ++pair) {
      const int64_t r = pair % row_blocks, b = pair / (heads * row_blocks);
      float* pair_tiles = t_out + pair * key_blocks * tile_size;
      for (int64_t i = 0; i < real; ++i) {
        const int64_t pos = query_position(s, st, rt, b, r, i);
        float* row = p + (pair * real + i) * width;
        const int64_t limit = std::min<int64_t>(width, std::max<int64_t>(pos + 1, 0));
        // times 1.0 or 0.0, as the torch ops: a multiply, even by 1, flushes a subnormal where the FPU's
        // denormals-are-zero mode is on
        for (int64_t j = 0; j < width; ++j) row[j] = row[j] * (j < limit ? 1.0f : 0.0f);
        for (int64_t t = 0; t < used; ++t) {
          const int64_t cols = std::min(key_block, width - t * key_block);
          if (cols == 1) {
            per_tile[t] = row[t * key_block];
          } else {
            tree_single(row + t * key_block, cols, 1, buf.data(), &per_tile[t]);
          }
          float* dst = pair_tiles + t * tile_size + i * key_block;
          std::copy(row + t * key_block, row + t * key_block + cols, dst);
          std::fill(dst + cols, dst + key_block, 0.0f);
        }
        float total = per_tile[0];
        if (used > 1) tree_single(per_tile.data(), used, 1, buf.data(), &total);
        d_real[pair * real + i] = total;
        d_rows[pair * block + i] = total;
        // the row / its sum, in place, after the tiles took their copy: the division cpu_exact makes of the
        // probabilities it saves for the backward (columns past the visible keys are not part of them)
        if (normalize) {
          for (int64_t j = 0; j < width; ++j) row[j] = row[j] / total;
        }
      }
      for (int64_t t = 0; t < key_blocks; ++t) {  // rows past the real ones, and tiles past the visible ones
        float* tile = pair_tiles + t * tile_size;
        if (t >= used) {
          std::fill(tile, tile + tile_size, 0.0f);
        } else {
          std::fill(tile + real * key_block, tile + tile_size, 0.0f);
        }
      }
      for (int64_t i = real; i < block; ++i) d_rows[pair * block + i] = 1.0f;
    }
  });
  return {tiles, denom_rows, denom};
}

// The attention backward's dS = P * (dP - rowsum(dO * O)) (cpu_attention._ExactAttention.backward), in dP's buffer:
// per row, the products dO * O, their halving tree over the head dim (compiled_loops.tree_sum over the last dim),
// then (dP - sum) * P for every key. fp32 [BH, R, *] with unit stride in the last dim; returns d_p.
at::Tensor attention_grad_scores(at::Tensor d_p, const at::Tensor& d_out, const at::Tensor& out_rows,
                                 const at::Tensor& p) {
  TORCH_CHECK(d_p.dim() == 3 && d_out.dim() == 3 && out_rows.dim() == 3 && p.dim() == 3,
              "attention_grad_scores: 3-D tensors");
  for (const at::Tensor* t : std::initializer_list<const at::Tensor*>{&d_p, &d_out, &out_rows, &p}) {
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->stride(2) == 1, "attention_grad_scores: fp32, unit last stride");
  }
  const int64_t bh = d_p.size(0), rows = d_p.size(1), keys = d_p.size(2), dim = d_out.size(2);
  TORCH_CHECK(d_out.size(0) == bh && d_out.size(1) == rows && out_rows.sizes() == d_out.sizes() &&
                  p.sizes() == d_p.sizes() && dim >= 2,
              "attention_grad_scores: shapes");
  float* dp = d_p.data_ptr<float>();
  const float* go = d_out.data_ptr<float>();
  const float* o = out_rows.data_ptr<float>();
  const float* pp = p.data_ptr<float>();
  at::parallel_for(0, bh * rows, std::max<int64_t>(1, kGrain / std::max<int64_t>(1, keys + dim)),
                   [&](int64_t first, int64_t last) {
    std::vector<float> prod(dim), buf(dim);
    for (int64_t row = first; row < last; ++row) {
      const int64_t i = row / rows, r = row % rows;
      const float* go_row = go + i * d_out.stride(0) + r * d_out.stride(1);
      const float* o_row = o + i * out_rows.stride(0) + r * out_rows.stride(1);
      for (int64_t j = 0; j < dim; ++j) prod[j] = go_row[j] * o_row[j];
      float sum;
      tree_single(prod.data(), dim, 1, buf.data(), &sum);
      float* dp_row = dp + i * d_p.stride(0) + r * d_p.stride(1);
      const float* p_row = pp + i * p.stride(0) + r * p.stride(1);
      for (int64_t j = 0; j < keys; ++j) dp_row[j] = (dp_row[j] - sum) * p_row[j];
    }
  });
  return d_p;
}

// cpu_attention.attention_exact after its tiles are laid out (a forward without a gradient: a decode step's, a
// prefill's), where the guard's verdict for both GEMM classes is torch's own bmm and its exp the library's: the
// scores GEMM of the row tiles against the key tiles, attention_shifted, the chunked exp, attention_tiles, the P @ V
// GEMM, the tree over key tiles, the division by the row sums and the output's layout [B, T, Hq, hd] in `dtype` --
// the same at:: calls on the same views as _attention_probs, _attention_forward and to_output, so the same bits.
// What it saves is their Python (some thirty tensor calls an attention call).
namespace {

// attention_forward's steps; `saving`: the probabilities of the real rows are then divided by their sums in place
// (attention_tiles' `normalize`, after the tiles took their copy: the output is the same) and returned with the
// output rows, as cpu_attention._ExactAttention.forward keeps them for the backward.
std::vector<at::Tensor> attention_forward_steps(const at::Tensor& q_rows, const at::Tensor& k_rows,
                                                const at::Tensor& v_rows, int64_t batch, int64_t heads,
                                                int64_t row_blocks, int64_t key_blocks, int64_t block, int64_t rows,
                                                int64_t visible, int64_t key_block, int64_t col_block,
                                                const at::Tensor& starts, const at::Tensor& row_t, bool uniform_start,
                                                int64_t q_len, int64_t group, int64_t chunk, int64_t multiple,
                                                at::ScalarType dtype, bool saving) {
  TORCH_CHECK(q_rows.dim() == 3 && k_rows.dim() == 3 && v_rows.dim() == 3 && q_rows.size(0) == batch * heads &&
                  q_rows.size(1) == row_blocks * block && k_rows.size(1) == key_blocks * key_block &&
                  v_rows.sizes() == k_rows.sizes() && rows <= row_blocks * block && visible >= 1,
              "attention_forward: q rows [B*Hkv, RB*R, hd], k and v rows [B*Hkv, KB*C, hd]");
  const int64_t pairs = batch * heads, d = q_rows.size(2);
  const auto row_tiles = [&](const at::Tensor& per_row) {  // _AttentionTiles.row_tiles
    const int64_t width = per_row.size(-1);
    return per_row.view({pairs, row_blocks, 1, block, width})
        .expand({-1, -1, key_blocks, -1, -1})
        .reshape({-1, block, width});
  };
  const auto key_tiles = [&](const at::Tensor& per_key) {  // _AttentionTiles.key_tiles
    const int64_t width = per_key.size(-1);
    return per_key.view({pairs, 1, key_blocks, key_block, width})
        .expand({-1, row_blocks, -1, -1, -1})
        .reshape({-1, key_block, width});
  };
  const at::Tensor scores = at::bmm(row_tiles(q_rows), key_tiles(k_rows).transpose(1, 2));
  const int64_t real = row_blocks == 1 ? rows : block;
  const int64_t width = ((visible + col_block - 1) / col_block) * col_block;
  const at::Tensor shifted = attention_shifted(scores, batch, heads, row_blocks, key_blocks, block, real, width,
                                               key_block, starts, row_t, uniform_start);
  const at::Tensor probs = unary_chunked(shifted, 0, chunk, multiple, true);  // exp, in place
  const std::vector<at::Tensor> parts = attention_tiles(probs, batch, heads, row_blocks, key_blocks, block, real,
                                                        width, key_block, starts, row_t, uniform_start, saving);
  const at::Tensor partial =
      at::bmm(parts[0], key_tiles(v_rows)).view({batch, heads, row_blocks, key_blocks, block, d});
  const at::Tensor summed = key_blocks > 1
                                ? tree_sum_into(partial.permute({0, 1, 2, 4, 5, 3}), -1, c10::nullopt, false)
                                : partial.select(3, 0);
  const at::Tensor out_rows = at::div(summed, parts[1]).view({pairs, row_blocks * block, d});
  const at::Tensor out = out_rows.view({batch, heads, -1, d})
                             .narrow(2, 0, rows)
                             .reshape({batch, heads, q_len, group, d})
                             .permute({0, 2, 1, 3, 4})
                             .reshape({batch, q_len, heads * group, d})
                             .to(dtype);
  if (!saving) return {out};
  return {out, out_rows, probs.narrow(-1, 0, visible)};
}

}  // namespace

at::Tensor attention_forward(const at::Tensor& q_rows, const at::Tensor& k_rows, const at::Tensor& v_rows,
                             int64_t batch, int64_t heads, int64_t row_blocks, int64_t key_blocks, int64_t block,
                             int64_t rows, int64_t visible, int64_t key_block, int64_t col_block,
                             const at::Tensor& starts, const at::Tensor& row_t, bool uniform_start, int64_t q_len,
                             int64_t group, int64_t chunk, int64_t multiple, at::ScalarType dtype) {
  return attention_forward_steps(q_rows, k_rows, v_rows, batch, heads, row_blocks, key_blocks, block, rows, visible,
                                 key_block, col_block, starts, row_t, uniform_start, q_len, group, chunk, multiple,
                                 dtype, false)[0];
}

// attention_forward, also returning what cpu_attention._ExactAttention.forward keeps for the backward: (output, the
// output rows [B*Hkv, RB*R, hd] before their layout, the normalised probabilities of the real rows and visible keys
// [B, Hkv, RB, real, visible] -- a view of the exp's buffer, divided by the row sums in place as
// _attention_probs(normalized=True) divides them).
std::vector<at::Tensor> attention_forward_saving(const at::Tensor& q_rows, const at::Tensor& k_rows,
                                                 const at::Tensor& v_rows, int64_t batch, int64_t heads,
                                                 int64_t row_blocks, int64_t key_blocks, int64_t block, int64_t rows,
                                                 int64_t visible, int64_t key_block, int64_t col_block,
                                                 const at::Tensor& starts, const at::Tensor& row_t,
                                                 bool uniform_start, int64_t q_len, int64_t group, int64_t chunk,
                                                 int64_t multiple, at::ScalarType dtype) {
  return attention_forward_steps(q_rows, k_rows, v_rows, batch, heads, row_blocks, key_blocks, block, rows, visible,
                                 key_block, col_block, starts, row_t, uniform_start, q_len, group, chunk, multiple,
                                 dtype, true);
}

// cpu_attention._AttentionTiles' layouts between the model's [B, T, Hq, hd] / [B, L, Hkv, hd] and the tiles' fp32 rows
// [B*Hkv, rows, hd] (row r = t * group + g of KV head h holds query head h * group + g at step t): the same values
// as its permuted copies, in one loop each. A conversion to another dtype is aten's own, as there.
namespace {

// out [B*Hkv, out_rows, hd] fp32 contiguous: row r < min(t_len * group, out_rows) of pair (b, h) from src[b, r /
// group, h * group + r % group] (src [B, T, Hq, hd], any float dtype and strides; converted exactly), zero after.
// A KV cache's rows (key_rows) are the case group = 1: row l of head h is the cache's position l.
at::Tensor heads_to_rows(const at::Tensor& src, int64_t kv_heads, int64_t out_rows) {
  const int64_t batch = src.size(0), t_len = src.size(1), q_heads = src.size(2), dim = src.size(3);
  at::Tensor out = at::empty({batch * kv_heads, out_rows, dim}, src.options().dtype(at::kFloat));
  if (out.numel() == 0) return out;
  const int64_t group = q_heads / kv_heads, rows = std::min(t_len * group, out_rows);
  TORCH_CHECK(group * kv_heads == q_heads, "heads_to_rows: ", q_heads, " heads in groups of ", kv_heads);
  const int64_t s0 = src.stride(0), s1 = src.stride(1), s2 = src.stride(2), s3 = src.stride(3);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, src.scalar_type(), "heads_to_rows", [&] {
    const scalar_t* base = src.data_ptr<scalar_t>();
    float* dst = out.data_ptr<float>();
    at::parallel_for(0, batch * kv_heads, std::max<int64_t>(1, kGrain / (out_rows * dim)), [&](int64_t first,
                                                                                            int64_t last) {
      for (int64_t pair = first; pair < last; ++pair) {
        const int64_t b = pair / kv_heads, h = pair % kv_heads;
        float* o = dst + pair * out_rows * dim;
        for (int64_t r = 0; r < rows; ++r, o += dim) {
          const scalar_t* in = base + b * s0 + (r / group) * s1 + (h * group + r % group) * s2;
          if (s3 == 1) {
            for (int64_t j = 0; j < dim; ++j) o[j] = static_cast<float>(in[j]);
          } else {
            for (int64_t j = 0; j < dim; ++j) o[j] = static_cast<float>(in[j * s3]);
          }
        }
        std::fill(o, dst + (pair + 1) * out_rows * dim, 0.0f);
      }
    });
  });
  return out;
}

}  // namespace

// _AttentionTiles._query_rows: q [B, T, Hq, hd] -> fp32 [B*Hkv, row_len, hd] times `scale`, zero padding rows -- the
// same at:: calls on the same views (aten's mul with the scale as a wrapped number, which is what torch.mul makes of a
// Python float), so the same bits; what it saves is their Python.
at::Tensor attention_query_rows(const at::Tensor& q, int64_t kv_heads, int64_t row_len, double scale) {
  TORCH_CHECK(q.dim() == 4 && kv_heads > 0 && q.size(2) % kv_heads == 0, "attention_query_rows: q [B, T, Hq, hd]");
  const int64_t batch = q.size(0), t_len = q.size(1), dim = q.size(3), group = q.size(2) / kv_heads;
  const int64_t rows = t_len * group;
  TORCH_CHECK(row_len >= rows, "attention_query_rows: row_len shorter than the queries' rows");
  at::Tensor out = at::empty({batch, kv_heads, row_len, dim}, q.options().dtype(at::kFloat));
  at::Tensor written = out.narrow(2, 0, rows).view({batch, kv_heads, t_len, group, dim});
  at::mul_out(written, q.view({batch, t_len, kv_heads, group, dim}).permute({0, 2, 1, 3, 4}),
              at::native::wrapped_scalar_tensor(at::Scalar(scale)));
  if (rows < row_len) out.narrow(2, rows, row_len - rows).zero_();  // zeros only where no query is written
  return out.view({batch * kv_heads, row_len, dim});
}

// _AttentionTiles.from_output: grad [B, T, Hq, hd] -> fp32 [B*Hkv, row_len, hd], zero padding rows.
at::Tensor attention_from_output(const at::Tensor& grad, int64_t kv_heads, int64_t row_len) {
  TORCH_CHECK(grad.dim() == 4, "attention_from_output: grad [B, T, Hq, hd]");
  TORCH_CHECK(kv_heads > 0 && row_len >= grad.size(1) * (grad.size(2) / kv_heads),
              "attention_from_output: row_len shorter than the gradient's rows");
  return heads_to_rows(grad, kv_heads, row_len);
}

// _AttentionTiles.to_output: fp32 rows [B*Hkv, n >= T * group, hd] (unit last stride, any other strides) -> [B, T,
// Hq, hd] in `dtype` (aten's conversion of the fp32 result), each value first times `scale` where one is given (the
// fp32 product, as `rows * scale`).
at::Tensor attention_to_output(const at::Tensor& rows, int64_t batch, int64_t q_len, int64_t q_heads,
                               c10::optional<double> scale, at::ScalarType dtype) {
  TORCH_CHECK(rows.dim() == 3 && rows.scalar_type() == at::kFloat && rows.stride(2) == 1 && batch > 0 &&
                  rows.size(0) % batch == 0,
              "attention_to_output: fp32 rows [B*Hkv, n, hd] with a unit last stride");
  const int64_t kv_heads = rows.size(0) / batch, dim = rows.size(2), group = q_heads / kv_heads;
  TORCH_CHECK(group * kv_heads == q_heads && rows.size(1) >= q_len * group, "attention_to_output: heads or rows");
  at::Tensor out = at::empty({batch, q_len, q_heads, dim}, rows.options());
  if (out.numel() == 0) return dtype == at::kFloat ? out : out.to(dtype);
  const float* base = rows.data_ptr<float>();
  float* dst = out.data_ptr<float>();
  const int64_t s0 = rows.stride(0), s1 = rows.stride(1);
  const bool scaled = scale.has_value();
  const float factor = scaled ? static_cast<float>(*scale) : 1.0f;
  at::parallel_for(0, batch * q_len * q_heads, std::max<int64_t>(1, kGrain / dim), [&](int64_t first, int64_t last) {
    for (int64_t i = first; i < last; ++i) {  // output row (b, t, head)
      const int64_t head = i % q_heads, t = (i / q_heads) % q_len, b = i / (q_heads * q_len);
      const float* in = base + (b * kv_heads + head / group) * s0 + (t * group + head % group) * s1;
      float* o = dst + i * dim;
      if (scaled) {
#pragma omp simd
        for (int64_t j = 0; j < dim; ++j) o[j] = in[j] * factor;
      } else {
        std::copy(in, in + dim, o);
      }
    }
  });
  return dtype == at::kFloat ? out : out.to(dtype);
}

// _AttentionTiles.to_cache: fp32 keys [B*Hkv, n, hd] (the first n positions) -> [B, L, Hkv, hd] in `dtype`, zero after
// n. fp32: one loop; another dtype: the same aten copy into the cache's layout as the Python (its conversion).
at::Tensor attention_to_cache(const at::Tensor& keys, int64_t batch, int64_t cache_len, at::ScalarType dtype) {
  TORCH_CHECK(keys.dim() == 3 && keys.scalar_type() == at::kFloat && batch > 0 && keys.size(0) % batch == 0,
              "attention_to_cache: fp32 keys [B*Hkv, n, hd]");
  const int64_t heads = keys.size(0) / batch, n = keys.size(1), dim = keys.size(2);
  const int64_t kept = std::min(cache_len, n);
  at::Tensor out = at::empty({batch, cache_len, heads, dim}, keys.options().dtype(dtype));
  if (out.numel() == 0) return out;
  if (dtype != at::kFloat) {
    out.narrow(1, 0, kept).copy_(keys.view({batch, heads, n, dim}).narrow(2, 0, kept).permute({0, 2, 1, 3}));
    if (kept < cache_len) out.narrow(1, kept, cache_len - kept).zero_();
    return out;
  }
  const float* base = keys.data_ptr<float>();
  float* dst = out.data_ptr<float>();
  const int64_t s0 = keys.stride(0), s1 = keys.stride(1), s2 = keys.stride(2);
  at::parallel_for(0, batch * cache_len, std::max<int64_t>(1, kGrain / (heads * dim)), [&](int64_t first,
                                                                                        int64_t last) {
    for (int64_t i = first; i < last; ++i) {  // cache row (b, l)
      const int64_t l = i % cache_len, b = i / cache_len;
      float* o = dst + i * heads * dim;
      for (int64_t h = 0; h < heads; ++h, o += dim) {
        if (l >= kept) {
          std::fill(o, o + dim, 0.0f);
          continue;
        }
        const float* in = base + (b * heads + h) * s0 + l * s1;
        for (int64_t j = 0; j < dim; ++j) o[j] = in[j * s2];
      }
    }
  });
  return out;
}

// cpu_attention._AttentionTiles._key_rows: a KV cache [B, L, H, hd] (any float dtype, any strides) as fp32 rows
// [B*H, key_len, hd] -- position l < min(L, key_len) is the cache's row l converted to fp32 (exact), zeros after --
// in one pass instead of a permuted, converting copy and a fill.
at::Tensor key_rows(const at::Tensor& cache, int64_t key_len) {
  TORCH_CHECK(cache.device().is_cpu() && cache.dim() == 4, "key_rows: a CPU cache [B, L, H, hd]");
  return heads_to_rows(cache, cache.size(2), key_len);
}

// kv_rows: the positions a KV cache write changed, copied into the cache's fp32 rows again [B*H, key_len, hd] (what
// key_rows laid out: the same conversion, so the same values as a fresh key_rows of the written cache). Entry i of
// positions [B', T] (with batch_index broadcast to it) is cache row (batch_index, positions); one at or past min(L,
// key_len) is not in the rows. A negative index counts from the end, as the write's indexing does.
void key_rows_at(at::Tensor& rows, const at::Tensor& cache, const at::Tensor& batch_index,
                 const at::Tensor& positions) {
  TORCH_CHECK(cache.device().is_cpu() && cache.dim() == 4 && rows.dim() == 3 && rows.is_contiguous() &&
                  rows.scalar_type() == at::kFloat,
              "key_rows_at: a CPU cache [B, L, H, hd] and its contiguous fp32 rows [B*H, key_len, hd]");
  const int64_t batch = cache.size(0), length = cache.size(1), heads = cache.size(2), dim = cache.size(3);
  const int64_t key_len = rows.size(1), kept = std::min(length, key_len);
  TORCH_CHECK(rows.size(0) == batch * heads && rows.size(2) == dim, "key_rows_at: rows do not match the cache");
  const at::Tensor b_idx = batch_index.expand_as(positions).contiguous().to(at::kLong);
  const at::Tensor p_idx = positions.contiguous().to(at::kLong);
  const int64_t count = p_idx.numel();
  const int64_t* bs = b_idx.data_ptr<int64_t>();
  const int64_t* ps = p_idx.data_ptr<int64_t>();
  const int64_t s_b = cache.stride(0), s_l = cache.stride(1), s_h = cache.stride(2), s_d = cache.stride(3);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, cache.scalar_type(), "key_rows_at", [&] {
    const scalar_t* base = cache.data_ptr<scalar_t>();
    float* dst = rows.data_ptr<float>();
    for (int64_t i = 0; i < count; ++i) {
      const int64_t b = bs[i] < 0 ? bs[i] + batch : bs[i];
      const int64_t p = ps[i] < 0 ? ps[i] + length : ps[i];
      if (p >= kept) continue;
      for (int64_t h = 0; h < heads; ++h) {
        const scalar_t* in = base + b * s_b + p * s_l + h * s_h;
        float* o = dst + ((b * heads + h) * key_len + p) * dim;
        for (int64_t j = 0; j < dim; ++j) o[j] = static_cast<float>(in[j * s_d]);
      }
    }
  });
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("unary_chunked", &unary_chunked, "cpu_elementwise.unary's chunk loop on the library function, same bits");
  m.def("token_logprobs_forward", &token_logprobs_forward, "cpu_exact._token_logprobs_exact (fp32), same bits");
  m.def("token_logprobs_forward_saving", &token_logprobs_forward_saving,
        "cpu_exact._token_logprobs_with_saved (fp32): out, row max, log normalizer; same bits");
  m.def("token_logprobs_backward", &token_logprobs_backward, "cpu_exact._token_logprobs_vjp (fp32), same bits");
  m.def("tree_sum", &tree_sum, "fixed_order.tree_sum for width >= 2 (fp32/fp64, any strides), same bits");
  m.def("tree_sum_into", &tree_sum_into, "tree_sum into out (None: fresh), the last entry + 0.0 first if zero_last",
        py::arg("x"), py::arg("dim"), py::arg("out") = py::none(), py::arg("zero_last") = false);
  m.def("rms_norm_mean_square", &rms_norm_mean_square, "cpu_exact's RMSNorm up to its sqrt, same bits");
  m.def("rms_norm_scale", &rms_norm_scale, "cpu_exact's RMSNorm after its sqrt, same bits");
  m.def("rms_norm_backward", &rms_norm_backward, "cpu_exact's RMSNorm VJP on fp32 rows, same bits");
  m.def("silu_mul_forward", &silu_mul_forward, "cpu_exact's SwiGLU after its exp (fp32), same bits");
  m.def("silu_mul_exp_forward", &silu_mul_exp_forward, "cpu_exact's SwiGLU forward with its chunked exp (fp32)");
  m.def("silu_mul_backward", &silu_mul_backward, "cpu_exact's SwiGLU VJP (fp32 or bf16), same bits");
  m.def("rope_forward", &rope_forward, "kernels.native.rope's torch ops in one pass (fp32 or bf16 x), same bits");
  m.def("rope_backward", &rope_backward, "autograd's VJP of kernels.native.rope in one pass, same bits");
  m.def("sum_rows_by_token", &sum_rows_by_token, "cpu_exact._sum_rows_by_token (fp32 rows), same bits",
        py::arg("tokens"), py::arg("rows"), py::arg("vocab"), py::arg("budget"), py::arg("dtype") = py::none());
  m.def("padded_copy", &padded_copy, "src zero-padded to shape (a fresh contiguous tensor), same bits");
  m.def("chunks_transposed", &chunks_transposed, "cpu_exact._chunks_transposed, same bits");
  m.def("tiled_matmul", &tiled_matmul, "cpu_exact._tiled_matmul after its plan (library GEMM), same bits");
  m.def("packed_linear", &packed_linear, "gemm_packed._packed_run's steps after its plan, same bits");
  m.def("packed_linears", &packed_linears, "fused_linears._fused_call's steps, same bits");
  m.def("bmm_linears", &bmm_linears, "a laid-out plan's canonical call of its tiles (one weight or several), same bits");
  m.def("tile_gemms", &tile_gemms, "one at::mm per tile (or per column block of it) with a shared operand, spread over "
        "threads", py::arg("a_tiles"), py::arg("operand"), py::arg("column_blocks") = 1, py::arg("one_thread") = false,
        py::arg("whole_tiles") = 0);
  m.def("split_bmm", &split_bmm, "a bmm at 1 thread per thread over consecutive tiles (HostGuard.bmm's blas-1-thread path)");
  m.def("reduction_slab_mms", &reduction_slab_mms,
        "one at::mm per (chunk, slab) of a weight gradient on views, the pairs spread over threads", py::arg("a"),
        py::arg("b"), py::arg("block"), py::arg("last_length"), py::arg("slab"), py::arg("out") = py::none(),
        py::arg("column_blocks") = 1);
  m.def("attention_shifted", &attention_shifted, "cpu_attention._attention_probs up to its exp, same bits");
  m.def("attention_tiles", &attention_tiles, "cpu_attention._attention_probs after its exp, same bits");
  m.def("attention_forward", &attention_forward,
        "cpu_attention.attention_exact after its tiles (library GEMMs), same bits");
  m.def("attention_forward_saving", &attention_forward_saving,
        "attention_forward, also returning the output rows and normalised probabilities a backward keeps");
  m.def("attention_grad_scores", &attention_grad_scores, "cpu_attention._ExactAttention.backward's dS, same bits");
  m.def("transposed_views", &transposed_views,
        "gemm_weight_gradient._transposed_matmul_views after its plan, same bits");
  m.def("attention_query_rows", &attention_query_rows, "cpu_attention._AttentionTiles._query_rows, same bits");
  m.def("attention_from_output", &attention_from_output, "cpu_attention._AttentionTiles.from_output, same values");
  m.def("attention_to_output", &attention_to_output, "cpu_attention._AttentionTiles.to_output (times scale), same bits",
        py::arg("rows"), py::arg("batch"), py::arg("q_len"), py::arg("q_heads"), py::arg("scale"), py::arg("dtype"));
  m.def("attention_to_cache", &attention_to_cache, "cpu_attention._AttentionTiles.to_cache, same values");
  m.def("key_rows", &key_rows, "cpu_attention._AttentionTiles._key_rows (a cache as fp32 rows), same bits");
  m.def("key_rows_at", &key_rows_at, "kv_rows: written cache positions copied into its fp32 rows, same values");
}

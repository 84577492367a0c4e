// Compiled loops of the exact CPU kernels (kernels/compiled_loops.py builds and loads this file).
//
// Each function here computes, element by element, the same sequence of exactly rounded IEEE operations
// (add, mul, copy) as the torch-op composition it replaces in cpu_exact.py / fixed_order.py, so its output has
// the same bits by construction -- never a reassociated sum, never a fused multiply-add (built with
// -ffp-contract=off and without -ffast-math). What it saves is the per-op cost of those compositions: one call
// and one pass over memory instead of a dozen aten calls, each with its own dispatch, allocation and
// TensorIterator set-up, which is most of the exact path's price on small models.
//
// Thread count: every output element is computed by one thread from its own inputs, so no bit depends on how
// at::parallel_for splits the work.
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace {

constexpr int64_t kGrain = 1 << 14;  // output elements per parallel task (below it: one thread)

// Sum `width` values by halving (fixed_order.tree_sum): level 1 adds x[j] + x[j + half] where both exist and
// x[j] + 0 where the partner is padding (so -0.0 becomes +0.0, as an add of real zero padding does); each later
// level adds the two halves of the scratch row. Here `run` adjacent outputs are summed side by side: `buf` holds
// `half` rows of `run` values.
template <typename T>
void tree_single(const T* x, int64_t width, int64_t s_width, T* buf, T* out) {
  // One output (run == 1): the levels are loops along the row itself (vector adds where the row is contiguous).
  const int64_t half = int64_t(1) << (63 - __builtin_clzll(uint64_t(width - 1)));
  const int64_t paired = width - half;
  for (int64_t j = 0; j < paired; ++j) buf[j] = x[j * s_width] + x[(j + half) * s_width];
  for (int64_t j = paired; j < half; ++j) buf[j] = x[j * s_width] + T(0);
  for (int64_t h = half / 2; h >= 1; h /= 2) {
    for (int64_t j = 0; j < h; ++j) buf[j] = buf[j] + buf[j + h];
  }
  *out = buf[0];
}

template <typename T>
void tree_run(const T* x, int64_t width, int64_t s_width, int64_t run, int64_t s_run, T* buf, T* out) {
  if (run == 1) return tree_single(x, width, s_width, buf, out);
  const int64_t half = int64_t(1) << (63 - __builtin_clzll(uint64_t(width - 1)));
  const int64_t paired = width - half;
  for (int64_t j = 0; j < paired; ++j) {
    const T* a = x + j * s_width;
    const T* b = x + (j + half) * s_width;
    T* row = buf + j * run;
    for (int64_t r = 0; r < run; ++r) row[r] = a[r * s_run] + b[r * s_run];
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

// fixed_order.tree_sum(x, dim) for width >= 2, fp32 or fp64, any strides; a fresh contiguous tensor (the shape of
// x without `dim`). The last remaining dim is the "run" summed side by side (contiguous in x: vector adds).
at::Tensor tree_sum(const at::Tensor& x, int64_t dim) {
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
  at::Tensor out = at::empty(sizes, x.options().memory_format(at::MemoryFormat::Contiguous));
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
        tree_run<scalar_t>(base + offset, width, s_width, run, s_run, buf.data(), dst + i * run);
      }
    });
  });
  return out;
}

// ----------------------------------------------------------------------------------------------------- attention
// The row-wise steps of cpu_exact._attention_probs around its exp, on the same fp32 values, in two passes. The
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
  const float neg_inf = -std::numeric_limits<float>::infinity();
  at::parallel_for(0, rows, std::max<int64_t>(1, kGrain / std::max<int64_t>(1, width)), [&](int64_t first,
                                                                                             int64_t last) {
    for (int64_t row = first; row < last; ++row) {
      const int64_t i = row % real, r = (row / real) % row_blocks, bh = row / (real * row_blocks);
      const int64_t b = bh / heads;
      const int64_t pos = query_position(s, st, rt, b, r, i);
      // score of key j: tile j / C, column j % C, of this (bh, r) pair's tiles, row i
      const float* tiles = src + (bh * row_blocks + r) * key_blocks * block * key_block + i * key_block;
      float* o = dst + row * width;
      float m = neg_inf;  // the row max; NaN if any score is NaN (as amax)
      bool nan = false;
      for (int64_t j = 0; j < width; ++j) {
        const float v = j <= pos ? tiles[(j / key_block) * block * key_block + j % key_block] : neg_inf;
        o[j] = v;
        nan = nan || std::isnan(v);
        m = v > m ? v : m;
      }
      if (nan) m = std::numeric_limits<float>::quiet_NaN();
      for (int64_t j = 0; j < width; ++j) o[j] = j <= pos ? o[j] - m : 0.0f;
    }
  });
  return out;
}

// Pass 2, on e = exp(shifted) (in place): e *= visible (1.0 or 0.0: hidden keys' exp(0) = 1 becomes 0), the
// halving tree of each key tile's columns (a tile's first `width - t * C` columns for the last, partial tile),
// the tree over the tiles (none for one tile), and the probability tiles for the P @ V GEMMs,
// [B*Hkv*RB*KB, block, C], zero outside the real rows and visible columns. Returns (tiles, the row sums padded
// to `block` rows with 1.0 [B, Hkv, RB, block, 1], the row sums of the real rows [B, Hkv, RB, real, 1]).
std::vector<at::Tensor> attention_tiles(at::Tensor e, int64_t batch, int64_t heads, int64_t row_blocks,
                                        int64_t key_blocks, int64_t block, int64_t real, int64_t width,
                                        int64_t key_block, const at::Tensor& starts, const at::Tensor& row_t,
                                        bool uniform_start) {
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
        for (int64_t j = 0; j < width; ++j) row[j] = row[j] * (j <= pos ? 1.0f : 0.0f);
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

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("tree_sum", &tree_sum, "fixed_order.tree_sum for width >= 2 (fp32/fp64, any strides), same bits");
  m.def("attention_shifted", &attention_shifted, "cpu_exact._attention_probs up to its exp, same bits");
  m.def("attention_tiles", &attention_tiles, "cpu_exact._attention_probs after its exp, same bits");
}

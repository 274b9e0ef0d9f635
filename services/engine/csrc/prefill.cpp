// Prompt rows' attention read straight from the paged K/V cache (`paged_prefill`), for a step's prompt pieces
// at once: the CPU counterpart of triton_ops' kernel. Row i of a piece (position p0 + i) attends to positions
// [0, p0 + i] of its sequence through the block table.
//
// A unit of work is (piece, KV head, up to ROWS query rows). It first lays the keys it needs out in tiles of 16
// positions, dimension-major (a tile's 16 dot products are then 16 lanes of one vector, no horizontal sums),
// and in bfloat16 the values as pairs of positions (vdpbf16ps multiplies two positions' values by their two
// weights in one instruction). Each query row then takes its scores tile by tile from position 0, its softmax
// and its weighted values, alone: a row's output depends only on its own query and keys, never on how the
// prompt was cut into pieces or which rows share the step (a prefix-cache hit gives the tokens of a miss).
//
// Needs AVX-512 (float32) or AVX-512 BF16 (bfloat16) and a head size a multiple of 16; `prefill_supported`
// says whether this build runs a dtype, and the engine attends pieces with PyTorch's SDPA otherwise.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t ROWS = 32;   // query rows per unit of work
constexpr int64_t TILE = 16;   // positions per key tile (one vector of scores)

#if defined(__AVX512F__)

inline __m512 exp512(__m512 x) {  // e^x for x <= 0, to ~1e-7 relative (2^n * a degree-6 polynomial)
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.f));
  const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 p = _mm512_set1_ps(1.3534167e-4f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3394291e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6180037e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5503406e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022652e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

inline __mmask16 first(int64_t n) { return n >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << n) - 1); }

// s[0, len) <- exp(s - max) in place, zero in the rest of the last tile; returns their sum.
inline float softmax_weights(float* s, int64_t len) {
  __m512 peak = _mm512_set1_ps(-INFINITY);
  for (int64_t j = 0; j < len; j += 16)
    peak = _mm512_max_ps(peak, _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), first(len - j), s + j));
  const __m512 mx = _mm512_set1_ps(_mm512_reduce_max_ps(peak));
  __m512 sum = _mm512_setzero_ps();
  for (int64_t j = 0; j < len; j += 16) {
    const __mmask16 m = first(len - j);
    const __m512 e = _mm512_maskz_mov_ps(m, exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, s + j), mx)));
    _mm512_storeu_ps(s + j, e);
    sum = _mm512_add_ps(sum, e);
  }
  return _mm512_reduce_add_ps(sum);
}

// Key tiles covering positions [0, n): an even count (the score loop takes two at a time).
inline int64_t even_tiles(int64_t n) { return (n + 2 * TILE - 1) / (2 * TILE) * 2; }

// Where position j of a sequence sits in a [Hkv, S, D] cache's head.
struct Pages {
  const int64_t* table;
  int64_t block_size;
  int64_t slot(int64_t j) const { return table[j / block_size] * block_size + j % block_size; }
};

// Positions [0, L) of one KV head's cache rows (`words` 32-bit words each: a float32 number or a pair of
// bfloat16 ones) as tiles [t][word][16] (lane i: position 16t + i), the last tiles padded with position L - 1.
void pack_keys(const uint32_t* k, Pages pg, int64_t L, int64_t words, std::vector<uint32_t>& kt) {
  const int64_t tiles = even_tiles(L);
  kt.resize(tiles * words * TILE);
  for (int64_t t = 0; t < tiles; ++t)
    for (int64_t lane = 0; lane < TILE; ++lane) {
      const uint32_t* row = k + pg.slot(std::min(t * TILE + lane, L - 1)) * words;
      uint32_t* dst = kt.data() + t * words * TILE + lane;
      for (int64_t w = 0; w < words; ++w) dst[w * TILE] = row[w];
    }
}

// How a path's numbers meet: a score step multiplies one vector of a key tile (16 positions) by one broadcast
// piece of the query; a value step multiplies `N` vectors of values (16 dimensions each) by one broadcast piece
// of the weights. Keys are packed in tiles of 16 positions, padded to an even number of tiles.
//
// float32: a key step one dimension; values read from the cache as they are, a step one
// position.
struct F32Path {
  using T = float;
  using W = float;
  using Vec = __m512;
  struct Values {
    const float* v;
    Pages pg;
    int64_t D;
  };
  static int64_t key_steps(int64_t D) { return D; }
  static Vec load(const uint32_t* p) { return _mm512_loadu_ps(reinterpret_cast<const float*>(p)); }
  static Vec load(const float* p) { return _mm512_loadu_ps(p); }
  static Vec query(const T* q, int64_t step) { return _mm512_set1_ps(q[step]); }
  static __m512 fma(__m512 acc, Vec a, Vec b) { return _mm512_fmadd_ps(a, b, acc); }
  static Values pack_values(const T* v, Pages pg, int64_t, int64_t D, std::vector<uint32_t>&) { return {v, pg, D}; }
  static const W* weights(const float* s, int64_t, std::vector<W>&) { return s; }
  static int64_t value_steps(int64_t len) { return len; }
  static const float* values(const Values& vals, int64_t step, int64_t c0) {
    return vals.v + vals.pg.slot(step) * vals.D + c0 * 16;
  }
  static Vec weight(const W* w, int64_t step) { return _mm512_set1_ps(w[step]); }
  static void store(T* o, __m512 x) { _mm512_storeu_ps(o, x); }
};

#if defined(__AVX512BF16__)
inline uint32_t bf16_bits(float f) {  // round to nearest even
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
}

// bfloat16 by vdpbf16ps: a key lane holds two dimensions' numbers, a step is one pair of dimensions;
// values as pairs of positions [pair][c][16] (lane i: v_{2pair}[16c+i] and v_{2pair+1}[16c+i]), a step one pair
// of positions, whose weights are rounded to bfloat16 (as flash attention on a GPU rounds them before its second
// product).
struct Bf16Path {
  using T = c10::BFloat16;
  using W = uint32_t;
  using Vec = __m512bh;
  struct Values {
    const uint32_t* pairs;
    int64_t blocks;  // D / 16
  };
  static int64_t key_steps(int64_t D) { return D / 2; }
  static Vec load(const uint32_t* p) { return (__m512bh)_mm512_loadu_si512(p); }
  static Vec query(const T* q, int64_t step) {
    uint32_t pair;
    std::memcpy(&pair, q + 2 * step, 4);
    return (__m512bh)_mm512_set1_epi32(pair);
  }
  static __m512 fma(__m512 acc, Vec a, Vec b) { return _mm512_dpbf16_ps(acc, a, b); }
  static Values pack_values(const T* v, Pages pg, int64_t L, int64_t D, std::vector<uint32_t>& vp) {
    const int64_t blocks = D / 16, npairs = (L + 1) / 2;
    vp.resize(npairs * blocks * 16);
    for (int64_t jp = 0; jp < npairs; ++jp) {
      const uint16_t* a = reinterpret_cast<const uint16_t*>(v + pg.slot(2 * jp) * D);
      const uint16_t* b = 2 * jp + 1 < L ? reinterpret_cast<const uint16_t*>(v + pg.slot(2 * jp + 1) * D) : a;
      for (int64_t c = 0; c < blocks; ++c) {
        const __m512i x = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + 16 * c)));
        const __m512i y = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 16 * c)));
        _mm512_storeu_si512(vp.data() + (jp * blocks + c) * 16, _mm512_or_si512(x, _mm512_slli_epi32(y, 16)));
      }
    }
    return {vp.data(), blocks};
  }
  // w2[jp]: weights 2jp and 2jp+1 as a bfloat16 pair (the one at len, if any, is 0: `softmax_weights` zeroed it)
  static const W* weights(const float* s, int64_t len, std::vector<W>& w2) {
    const int64_t npairs = (len + 1) / 2;
    w2.resize(npairs);
    for (int64_t jp = 0; jp < npairs; ++jp) w2[jp] = bf16_bits(s[2 * jp]) | (bf16_bits(s[2 * jp + 1]) << 16);
    return w2.data();
  }
  static int64_t value_steps(int64_t len) { return (len + 1) / 2; }
  static const uint32_t* values(const Values& vals, int64_t step, int64_t c0) {
    return vals.pairs + (step * vals.blocks + c0) * 16;
  }
  static Vec weight(const W* w, int64_t step) { return (__m512bh)_mm512_set1_epi32(w[step]); }
  static void store(T* o, __m512 x) {
    alignas(64) float t[16];
    _mm512_store_ps(t, x);
    uint16_t* out = reinterpret_cast<uint16_t*>(o);
    for (int i = 0; i < 16; ++i) out[i] = static_cast<uint16_t>(bf16_bits(t[i]));
  }
};
#endif

constexpr int MAX_HEADS = 4;  // query heads of one KV head a row takes at once (each key and value vector loaded
                              // once for all of them)

// A thread's buffers, kept across units.
template <typename P>
struct Scratch {
  std::vector<uint32_t> keys;
  std::vector<uint32_t> values;
  std::vector<float> scores;  // [MAX_HEADS][stride]
  std::vector<typename P::W> weights[MAX_HEADS];
  int64_t stride = 0;
};

// s[h][16t ..] = scale * q_h . k over key tiles [0, tiles) (an even count), two tiles at a time.
template <typename P, int GC>
void scores(const typename P::T* const* q, const uint32_t* kt, int64_t tiles, int64_t D, float scale,
            float* const* s) {
  const int64_t steps = P::key_steps(D), size = steps * TILE;
  const __m512 vscale = _mm512_set1_ps(scale);
  for (int64_t t = 0; t < tiles; t += 2) {
    const uint32_t* a = kt + t * size;
    const uint32_t* b = a + size;
    __m512 acc[2][GC];
    for (int h = 0; h < GC; ++h) acc[0][h] = acc[1][h] = _mm512_setzero_ps();
    for (int64_t p = 0; p < steps; ++p) {
      const typename P::Vec ka = P::load(a + p * TILE), kb = P::load(b + p * TILE);
      for (int h = 0; h < GC; ++h) {
        const typename P::Vec qh = P::query(q[h], p);
        acc[0][h] = P::fma(acc[0][h], ka, qh);
        acc[1][h] = P::fma(acc[1][h], kb, qh);
      }
    }
    for (int h = 0; h < GC; ++h) {
      _mm512_storeu_ps(s[h] + t * TILE, _mm512_mul_ps(acc[0][h], vscale));
      _mm512_storeu_ps(s[h] + (t + 1) * TILE, _mm512_mul_ps(acc[1][h], vscale));
    }
  }
}

// out_h[16 (c0 + i) ..] for i < N: sum over the value steps of w_h * values, times inv_h.
template <typename P, int GC, int N>
void weigh(const typename P::Values& vals, const typename P::W* const* w, int64_t steps, int64_t c0,
           const float* inv, typename P::T* const* out) {
  __m512 acc[GC][N];
  for (int h = 0; h < GC; ++h)
    for (int i = 0; i < N; ++i) acc[h][i] = _mm512_setzero_ps();
  for (int64_t j = 0; j < steps; ++j) {
    const auto* row = P::values(vals, j, c0);
    typename P::Vec v[N];
    for (int i = 0; i < N; ++i) v[i] = P::load(row + 16 * i);
    for (int h = 0; h < GC; ++h) {
      const typename P::Vec p = P::weight(w[h], j);
      for (int i = 0; i < N; ++i) acc[h][i] = P::fma(acc[h][i], v[i], p);
    }
  }
  for (int h = 0; h < GC; ++h)
    for (int i = 0; i < N; ++i) P::store(out[h] + (c0 + i) * 16, _mm512_mul_ps(acc[h][i], _mm512_set1_ps(inv[h])));
}

// GC query heads of one row (one KV head's): their outputs over positions [0, len).
template <typename P, int GC>
void attend_heads(const typename P::T* const* q, const uint32_t* kt, const typename P::Values& vals,
                  int64_t len, int64_t D, float scale, Scratch<P>& s, typename P::T* const* out) {
  const int64_t tiles = even_tiles(len);
  float* rows[GC];
  const typename P::W* w[GC];
  float inv[GC];
  for (int h = 0; h < GC; ++h) rows[h] = s.scores.data() + h * s.stride;
  scores<P, GC>(q, kt, tiles, D, scale, rows);
  for (int h = 0; h < GC; ++h) {
    inv[h] = 1.f / softmax_weights(rows[h], len);
    w[h] = P::weights(rows[h], len, s.weights[h]);
  }
  const int64_t steps = P::value_steps(len), blocks = D / 16;
  int64_t c = 0;
  for (; c + 4 <= blocks; c += 4) weigh<P, GC, 4>(vals, w, steps, c, inv, out);
  for (; c < blocks; ++c) weigh<P, GC, 1>(vals, w, steps, c, inv, out);
}

// info [C, 3]: a piece's first row in the step, first position, rows; tables [C, width].
template <typename P>
void prefill(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
             const torch::Tensor& info, const torch::Tensor& tables, torch::Tensor& out, int64_t block_size,
             int64_t H, int64_t Hkv, int64_t D, float scale) {
  using T = typename P::T;
  const int64_t C = info.size(0), S = k_cache.size(1), G = H / Hkv;
  const int64_t* in = info.data_ptr<int64_t>();
  std::vector<int64_t> units;  // piece, KV head, first row within the piece
  int64_t in_max = 1;  // the most positions a row sees
  for (int64_t c = 0; c < C; ++c) in_max = std::max(in_max, in[3 * c + 1] + in[3 * c + 2]);
  for (int64_t c = 0; c < C; ++c)
    for (int64_t kh = 0; kh < Hkv; ++kh)
      for (int64_t r = 0; r < in[3 * c + 2]; r += ROWS) units.insert(units.end(), {c, kh, r});
  const T* Q = q.data_ptr<T>();
  const T* K = k_cache.data_ptr<T>();
  const T* V = v_cache.data_ptr<T>();
  T* O = out.data_ptr<T>();
  const int64_t qs = q.stride(0), os = out.stride(0), width = tables.size(1);
  const int64_t* tb = tables.data_ptr<int64_t>();
  at::parallel_for(0, static_cast<int64_t>(units.size() / 3), 1, [&](int64_t begin, int64_t end) {
    Scratch<P> s;
    s.stride = even_tiles(in_max) * TILE;
    s.scores.resize(MAX_HEADS * s.stride);
    for (int64_t u = begin; u < end; ++u) {
      const int64_t c = units[3 * u], kh = units[3 * u + 1], r0 = units[3 * u + 2];
      const int64_t row0 = in[3 * c], pos0 = in[3 * c + 1], rows = std::min(ROWS, in[3 * c + 2] - r0);
      const Pages pg{tb + c * width, block_size};
      const int64_t L = pos0 + r0 + rows;  // positions the unit's last row sees
      pack_keys(reinterpret_cast<const uint32_t*>(K + kh * S * D), pg, L, P::key_steps(D), s.keys);
      const typename P::Values vals = P::pack_values(V + kh * S * D, pg, L, D, s.values);
      for (int64_t r = r0; r < r0 + rows; ++r)
        for (int64_t g = 0; g < G; g += MAX_HEADS) {
          const int gc = static_cast<int>(std::min<int64_t>(MAX_HEADS, G - g));
          const T* qh[MAX_HEADS];
          T* oh[MAX_HEADS];
          for (int h = 0; h < gc; ++h) {
            qh[h] = Q + (row0 + r) * qs + (kh * G + g + h) * D;
            oh[h] = O + (row0 + r) * os + (kh * G + g + h) * D;
          }
          const int64_t len = pos0 + r + 1;
          switch (gc) {
            case 1: attend_heads<P, 1>(qh, s.keys.data(), vals, len, D, scale, s, oh); break;
            case 2: attend_heads<P, 2>(qh, s.keys.data(), vals, len, D, scale, s, oh); break;
            case 3: attend_heads<P, 3>(qh, s.keys.data(), vals, len, D, scale, s, oh); break;
            default: attend_heads<P, 4>(qh, s.keys.data(), vals, len, D, scale, s, oh); break;
          }
        }
    }
  });
}

#endif  // __AVX512F__

}  // namespace

bool prefill_supported(torch::ScalarType dtype, int64_t head_dim) {
  if (head_dim <= 0 || head_dim % 16) return false;
#if defined(__AVX512BF16__)
  if (dtype == torch::kBFloat16) return true;
#endif
#if defined(__AVX512F__)
  if (dtype == torch::kFloat32) return true;
#endif
  return false;
}

void paged_prefill(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                   const torch::Tensor& info, const torch::Tensor& tables, torch::Tensor& out, int64_t block_size,
                   int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double scale) {
  TORCH_CHECK(prefill_supported(q.scalar_type(), head_dim), "paged_prefill: not built for ", q.scalar_type(),
              " with head size ", head_dim);
  TORCH_CHECK(q.stride(1) == 1 && out.stride(1) == 1 && k_cache.is_contiguous() && v_cache.is_contiguous(),
              "paged_prefill: rows must be contiguous");
  TORCH_CHECK(info.is_contiguous() && tables.is_contiguous() && info.size(1) == 3, "paged_prefill: bad plan");
  TORCH_CHECK(k_cache.scalar_type() == q.scalar_type() && out.scalar_type() == q.scalar_type(),
              "paged_prefill: q, cache and out must share a dtype");
#if defined(__AVX512F__)
#if defined(__AVX512BF16__)
  if (q.scalar_type() == torch::kBFloat16) {
    prefill<Bf16Path>(q, k_cache, v_cache, info, tables, out, block_size, num_heads, num_kv_heads, head_dim,
                      static_cast<float>(scale));
    return;
  }
#endif
  prefill<F32Path>(q, k_cache, v_cache, info, tables, out, block_size, num_heads, num_kv_heads, head_dim,
                   static_cast<float>(scale));
#endif
}

void register_prefill(pybind11::module& m) {
  m.def("prefill_supported", &prefill_supported);
  m.def("paged_prefill", &paged_prefill, pybind11::call_guard<pybind11::gil_scoped_release>());
}

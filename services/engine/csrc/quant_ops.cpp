// Quantized linear layers for the CPU (services/engine/quant.py): y = x W^T.
//
//   q8: w = s * q              q int8 [N, K], s float32 [N] (one scale per output channel)
//   q4: w = d * q + m          q uint8 [N, K/2] in blocks of 32 input columns, as GGUF's Q4_1 stores them
//                              (byte j of a block holds element j in its low nibble and element j + 16 in its
//                              high nibble), d and m float16 [N, K/32]
//
// A decode step multiplies a few rows by each matrix, so its cost is reading the weights: these read 1
// (q8) or 0.625 (q4) bytes per weight instead of bfloat16's 2. The float micro-kernel dequantizes NB weight
// rows a vector at a time in registers and multiplies them with MB activation rows, so each weight is read
// and dequantized once per MB rows; arithmetic is float32 whatever the activations' storage type.
// Where the CPU has AVX-512 VNNI, q8 runs as int8 x int8 instead (W8A8): each activation row is quantized
// per block of 32 (symmetric, its own scale), and `vpdpbusd` does 64 multiply-adds per instruction; the
// lm_head, which keeps finer activations, as int8 x int16 (`vpdpwssd`, 32 per instruction). Where it
// has AVX-512 BF16, q4 is held in a layout of the kernel's own (16 rows interleaved, see linear_q4p) and
// multiplies bfloat16 activations (`vdpbf16ps`, 32 per instruction).
// Every kernel asks for the weights a few tiles ahead of use (software prefetch): the matrices of a decode
// step are small and each is read once, so the hardware prefetcher alone leaves the memory bus idle at each
// start (measured: int8 over SmolLM2's matrices at one row 5.3 -> 3.4 ms, at 16 rows 17.8 -> 12.3 ms).

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>

namespace {

constexpr int64_t BLOCK = 32;

inline float half_to_float(uint16_t h) {
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  return static_cast<float>(c10::Half(h, c10::Half::from_bits()));
#endif
}

struct Q8 {
  const int8_t* q;
  const float* s;
  int64_t k;
  float scale(int64_t n, int64_t) const { return s[n]; }
  float offset(int64_t, int64_t) const { return 0.f; }
  int code(int64_t n, int64_t i) const { return q[n * k + i]; }
};

struct Q4 {
  const uint8_t* q;
  const uint16_t* d;
  const uint16_t* m;
  int64_t k;
  float scale(int64_t n, int64_t b) const { return half_to_float(d[n * (k / BLOCK) + b]); }
  float offset(int64_t n, int64_t b) const { return half_to_float(m[n * (k / BLOCK) + b]); }
  int code(int64_t n, int64_t i) const {
    const int64_t j = i % BLOCK;
    const uint8_t byte = q[n * (k / 2) + (i / BLOCK) * (BLOCK / 2) + j % 16];
    return j < 16 ? (byte & 0xf) : (byte >> 4);
  }
};

// Weights a few tiles ahead are asked for before they are needed: the hardware prefetcher ramps up on each
// matrix again, and a decode step's matrices are small (a few hundred KB), read once each from memory.
// Distances in tiles (measured best of 0-64 on an AVX-512 EPYC): the float kernel's tiles, the W8A8 kernel's
// (4 rows of int8 each); linear_q4p's in groups of 16 rows (AHEAD_Q4P).
constexpr int64_t AHEAD = 4, AHEAD8 = 2;

// Items [0, n) over the threads: each takes its own contiguous share front to back (so the weights it asks the
// memory for ahead are the ones it will use next), and a thread done with its share takes what is left of the
// others', an item at a time. A thread the OS takes off its core for a while (a small machine also runs the
// gateway, NATS and the clients) then holds back one item, not the rest of its share: the others do it.
// f(item, end of the share it belongs to). Items should take microseconds: each costs an atomic increment.
template <typename F>
void balanced_for(int64_t n, const F& f) {
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), n);
  if (threads <= 1 || at::in_parallel_region()) {
    for (int64_t i = 0; i < n; ++i) f(i, n);
    return;
  }
  std::unique_ptr<std::atomic<int64_t>[]> next(new std::atomic<int64_t>[threads]);
  std::vector<int64_t> ends(threads);
  for (int64_t t = 0; t < threads; ++t) {
    next[t].store(t * n / threads, std::memory_order_relaxed);
    ends[t] = (t + 1) * n / threads;
  }
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      for (int64_t s = 0; s < threads; ++s) {
        const int64_t share = (t + s) % threads;
        for (int64_t i; (i = next[share].fetch_add(1, std::memory_order_relaxed)) < ends[share];) f(i, ends[share]);
      }
  });
}

constexpr int64_t ITEM_BYTES = 32 << 10;  // of weights (times the rows that use them) per balanced_for item

// Tiles [0, tiles) of a matrix over the threads by balanced_for, in items of about ITEM_BYTES; ``tile_bytes``: one
// tile's weight bytes times the rows multiplied by them. f(tile, end of the share it belongs to).
template <typename F>
void balanced_tiles(int64_t tiles, int64_t tile_bytes, const F& f) {
  const int64_t per = std::max<int64_t>(1, ITEM_BYTES / std::max<int64_t>(1, tile_bytes));
  balanced_for((tiles + per - 1) / per, [&](int64_t item, int64_t share_end) {
    const int64_t end = std::min(tiles, share_end * per);
    for (int64_t t = item * per; t < std::min(tiles, (item + 1) * per); ++t) f(t, end);
  });
}

// ``y`` [rows, n] float32 in ``x``'s dtype and shape with its last dimension n: a kernel's result.
inline torch::Tensor as_output(const torch::Tensor& y, const torch::Tensor& x, int64_t n) {
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = n;
  return y.to(x.scalar_type()).reshape(shape);
}

inline void prefetch(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t off = 0; off < bytes; off += 64) _mm_prefetch(c + off, _MM_HINT_T0);
}

// The packed bytes of weight rows [n, n + count).
inline void prefetch_rows(const Q8& w, int64_t n, int64_t count) { prefetch(w.q + n * w.k, count * w.k); }

inline void prefetch_rows(const Q4& w, int64_t n, int64_t count) {
  prefetch(w.q + n * (w.k / 2), count * (w.k / 2));
  prefetch(w.d + n * (w.k / BLOCK), count * (w.k / BLOCK) * 2);
  prefetch(w.m + n * (w.k / BLOCK), count * (w.k / BLOCK) * 2);
}

template <typename Fmt>
inline float weight(const Fmt& w, int64_t n, int64_t i) {  // (Q8: any block size divides K; blocks of 32)
  return w.scale(n, i / BLOCK) * w.code(n, i) + w.offset(n, i / BLOCK);
}

// One output: row x (float32, K values) times weight row n, in plain C++ (edges and CPUs without AVX2).
template <typename Fmt>
inline float dot(const Fmt& w, const float* x, int64_t n) {
  float sum = 0.f;
  for (int64_t b = 0; b < w.k / BLOCK; ++b) {
    const float s = w.scale(n, b), o = w.offset(n, b);
    float part = 0.f, xs = 0.f;
    for (int64_t j = 0; j < BLOCK; ++j) {
      part += x[b * BLOCK + j] * w.code(n, b * BLOCK + j);
      xs += x[b * BLOCK + j];
    }
    sum += s * part + o * xs;
  }
  return sum;
}

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#if defined(__AVX512F__)
using V = __m512;
constexpr int W = 16, MB_MAX = 8, NB = 2;
inline V vzero() { return _mm512_setzero_ps(); }
inline V vload(const float* p) { return _mm512_loadu_ps(p); }
inline V vset(float f) { return _mm512_set1_ps(f); }
inline V vmul(V a, V b) { return _mm512_mul_ps(a, b); }
inline V vfma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
inline float vsum(V v) { return _mm512_reduce_add_ps(v); }
inline V codes8(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
inline V codes4(const uint8_t* p, bool high) {
  __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  if (high) v = _mm512_srli_epi32(v, 4);
  return _mm512_cvtepi32_ps(_mm512_and_si512(v, _mm512_set1_epi32(0xf)));
}
#else
using V = __m256;
constexpr int W = 8, MB_MAX = 2, NB = 2;
inline V vzero() { return _mm256_setzero_ps(); }
inline V vload(const float* p) { return _mm256_loadu_ps(p); }
inline V vset(float f) { return _mm256_set1_ps(f); }
inline V vmul(V a, V b) { return _mm256_mul_ps(a, b); }
inline V vfma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
inline float vsum(V v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
inline V codes8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline V codes4(const uint8_t* p, bool high) {
  __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  if (high) v = _mm256_srli_epi32(v, 4);
  return _mm256_cvtepi32_ps(_mm256_and_si256(v, _mm256_set1_epi32(0xf)));
}
#endif

// Vector c (elements c*W .. c*W+W-1) of block b of weight row n, dequantized.
inline V chunk(const Q8& w, int64_t n, int64_t b, int c, V scale, V) {  // scale: the row's, whatever the block
  return vmul(scale, codes8(w.q + n * w.k + b * BLOCK + c * W));
}

inline V chunk(const Q4& w, int64_t n, int64_t b, int c, V scale, V offset) {
  const int first = c * W;  // elements 0..15 are the low nibbles of the block's 16 bytes, 16..31 the high
  return vfma(codes4(w.q + n * (w.k / 2) + b * (BLOCK / 2) + first % 16, first >= 16), scale, offset);
}

// y[i, n0 + j] for i < MB, j < NB: MB x NB accumulators, each weight vector used by MB rows.
template <int MB, typename Fmt>
void tile(const Fmt& w, const float* x, int64_t k, int64_t n0, float* y, int64_t ldy) {
  V acc[MB][NB];
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NB; ++j) acc[i][j] = vzero();
  for (int64_t b = 0; b < k / BLOCK; ++b) {
    V scale[NB], offset[NB];
    for (int j = 0; j < NB; ++j) {
      scale[j] = vset(w.scale(n0 + j, b));
      offset[j] = vset(w.offset(n0 + j, b));
    }
    for (int c = 0; c < BLOCK / W; ++c) {
      V wv[NB];
      for (int j = 0; j < NB; ++j) wv[j] = chunk(w, n0 + j, b, c, scale[j], offset[j]);
      for (int i = 0; i < MB; ++i) {
        const V xv = vload(x + i * k + b * BLOCK + c * W);
        for (int j = 0; j < NB; ++j) acc[i][j] = vfma(xv, wv[j], acc[i][j]);
      }
    }
  }
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NB; ++j) y[i * ldy + n0 + j] = vsum(acc[i][j]);
}

// Rows in tiles of MB_MAX, the rest in halving tiles (a batch of 3 runs as 2 + 1).
template <int MB, typename Fmt>
void rows_from(const Fmt& w, const float* x, int64_t rows, int64_t k, int64_t n0, float* y, int64_t ldy) {
  int64_t i = 0;
  for (; i + MB <= rows; i += MB) tile<MB>(w, x + i * k, k, n0, y + i * ldy, ldy);
  if constexpr (MB > 1) {
    if (i < rows) rows_from<MB / 2>(w, x + i * k, rows - i, k, n0, y + i * ldy, ldy);
  }
}

template <typename Fmt>
void rows_tile(const Fmt& w, const float* x, int64_t rows, int64_t k, int64_t n0, float* y, int64_t ldy) {
  rows_from<MB_MAX>(w, x, rows, k, n0, y, ldy);
}
#else
constexpr int NB = 1;
template <typename Fmt>
void rows_tile(const Fmt& w, const float* x, int64_t rows, int64_t k, int64_t n0, float* y, int64_t ldy) {
  for (int64_t i = 0; i < rows; ++i) y[i * ldy + n0] = dot(w, x + i * k, n0);
}
#endif

template <typename Fmt>
torch::Tensor linear(const Fmt& w, const torch::Tensor& x, int64_t n) {
  const int64_t k = w.k;
  TORCH_CHECK(x.size(-1) == k, "the input has ", x.size(-1), " columns, the weight ", k);
  const torch::Tensor xf = x.reshape({-1, k}).to(torch::kFloat32).contiguous();
  const int64_t rows = xf.size(0);
  torch::Tensor y = torch::empty({rows, n}, xf.options());
  const float* xp = xf.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t tiles = n / NB;
  balanced_tiles(tiles, NB * k * rows, [&](int64_t t, int64_t end) {
    if (t + AHEAD < end) prefetch_rows(w, (t + AHEAD) * NB, NB);
    rows_tile(w, xp, rows, k, t * NB, yp, n);
  });
  for (int64_t c = tiles * NB; c < n; ++c)  // the columns a whole tile does not cover
    for (int64_t i = 0; i < rows; ++i) yp[i * n + c] = dot(w, xp + i * k, c);
  return as_output(y, x, n);
}

template <typename Fmt>
torch::Tensor dequant(const Fmt& w, int64_t n, torch::ScalarType dtype) {
  torch::Tensor out = torch::empty({n, w.k}, torch::dtype(torch::kFloat32));
  float* p = out.data_ptr<float>();
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      for (int64_t i = 0; i < w.k; ++i) p[r * w.k + i] = weight(w, r, i);
  });
  return out.to(dtype);
}

Q8 q8_of(const torch::Tensor& q, const torch::Tensor& s) {
  TORCH_CHECK(q.scalar_type() == torch::kInt8 && q.is_contiguous() && q.dim() == 2, "q8: q must be contiguous int8 [N, K]");
  TORCH_CHECK(q.size(1) % BLOCK == 0, "q8: K must be a multiple of ", BLOCK);
  TORCH_CHECK(s.scalar_type() == torch::kFloat32 && s.is_contiguous() && s.numel() == q.size(0),
              "q8: s must be contiguous float32 [N]");
  return Q8{q.data_ptr<int8_t>(), s.data_ptr<float>(), q.size(1)};
}

Q4 q4_of(const torch::Tensor& q, const torch::Tensor& d, const torch::Tensor& m) {
  TORCH_CHECK(q.scalar_type() == torch::kUInt8 && q.is_contiguous() && q.dim() == 2, "q4: q must be contiguous uint8 [N, K / 2]");
  const int64_t k = q.size(1) * 2;
  TORCH_CHECK(k % BLOCK == 0, "q4: K must be a multiple of ", BLOCK);
  for (const auto* t : {&d, &m})
    TORCH_CHECK(t->scalar_type() == torch::kHalf && t->is_contiguous() && t->numel() == q.size(0) * (k / BLOCK),
                "q4: d and m must be contiguous float16 [N, K / 32]");
  return Q4{q.data_ptr<uint8_t>(), reinterpret_cast<const uint16_t*>(d.data_ptr<at::Half>()),
            reinterpret_cast<const uint16_t*>(m.data_ptr<at::Half>()), k};
}


#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512F__)
#define SWITCHBOARD_VNNI 1
// ---- W8A8 on AVX-512 VNNI ----------------------------------------------------------------------------
//
// Activations: each row, per block of 32, as int8 with its own scale dx (symmetric: dx = max |x| / 127,
// xq = round(x / dx)). vpdpbusd multiplies unsigned bytes by signed ones, so the weights go in as q + 128
// (their sign bit flipped) and the activations as they are; the extra 128 * sum(xq) * dx this adds is a
// property of the row alone, taken off once at the end. A vector of 64 bytes covers two blocks: lanes 0-7
// sum block b, lanes 8-15 block b + 1, so each lane's integer sum is scaled by its block's dx (a vector made
// once per row) and accumulated in float; the weight row's scale multiplies the total.

struct QuantRows {
  torch::Tensor xq;    // int8 [rows, K]
  torch::Tensor dx;    // float32 [rows, K / 64, 16]: each lane's block scale
  torch::Tensor bias;  // float32 [rows]: 128 * sum over blocks of dx * sum(xq), what the sign flip adds
};

QuantRows quantize_rows(const torch::Tensor& xf) {
  const int64_t rows = xf.size(0), k = xf.size(1), pairs = k / 64, blocks = k / BLOCK;
  QuantRows out{torch::empty({rows, k}, torch::dtype(torch::kInt8)),
                torch::empty({rows, pairs, 16}, torch::dtype(torch::kFloat32)), torch::empty({rows}, torch::kFloat32)};
  torch::Tensor parts = torch::empty({rows, blocks}, torch::kFloat32);
  const float* x = xf.data_ptr<float>();
  int8_t* q = out.xq.data_ptr<int8_t>();
  float* dx = out.dx.data_ptr<float>();
  float* part = parts.data_ptr<float>();
  at::parallel_for(0, rows * blocks, 256, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) {
      const float* xb = x + g * BLOCK;
      const __m512 lo = _mm512_loadu_ps(xb), hi = _mm512_loadu_ps(xb + 16);
      const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
      const float d = amax / 127.f;
      int sum = 0;
      if (d == 0.f) {
        std::memset(q + g * BLOCK, 0, BLOCK);
      } else {  // x / d rounded to nearest even (the default rounding mode), |x / d| <= 127
        const __m512 dv = _mm512_set1_ps(d);
        const __m512i a = _mm512_cvtps_epi32(_mm512_div_ps(lo, dv)), b = _mm512_cvtps_epi32(_mm512_div_ps(hi, dv));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(q + g * BLOCK), _mm512_cvtsepi32_epi8(a));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(q + g * BLOCK + 16), _mm512_cvtsepi32_epi8(b));
        sum = _mm512_reduce_add_epi32(_mm512_add_epi32(a, b));
      }
      part[g] = 128.f * d * static_cast<float>(sum);
      const int64_t row = g / blocks, block = g % blocks;
      float* lanes = dx + (row * pairs + block / 2) * 16 + (block % 2) * 8;
      for (int j = 0; j < 8; ++j) lanes[j] = d;
    }
  });
  float* bias = out.bias.data_ptr<float>();
  for (int64_t r = 0; r < rows; ++r) {
    float sum = 0.f;
    for (int64_t b = 0; b < blocks; ++b) sum += part[r * blocks + b];
    bias[r] = sum;
  }
  return out;
}

template <int MB, int NBV>
void tile_w8a8(const Q8& w, const int8_t* xq, const float* dx, const float* bias, int64_t n0, float* y, int64_t ldy) {
  const int64_t k = w.k, pairs = k / 64;
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  __m512 acc[MB][NBV];
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NBV; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int64_t p = 0; p < pairs; ++p) {
    __m512i wv[NBV];
    for (int j = 0; j < NBV; ++j) wv[j] = _mm512_xor_si512(_mm512_loadu_si512(w.q + (n0 + j) * k + p * 64), flip);
    for (int i = 0; i < MB; ++i) {
      const __m512i xv = _mm512_loadu_si512(xq + i * k + p * 64);
      const __m512 dv = _mm512_loadu_ps(dx + (i * pairs + p) * 16);
      for (int j = 0; j < NBV; ++j)
        acc[i][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_setzero_si512(), wv[j], xv)), dv,
                                    acc[i][j]);
    }
  }
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NBV; ++j) y[i * ldy + n0 + j] = (_mm512_reduce_add_ps(acc[i][j]) - bias[i]) * w.s[n0 + j];
}

template <int MB, int NBV>
void rows_w8a8(const Q8& w, const int8_t* xq, const float* dx, const float* bias, int64_t rows, int64_t n0, float* y,
               int64_t ldy) {
  const int64_t k = w.k, pairs = k / 64;
  int64_t i = 0;
  for (; i + MB <= rows; i += MB)
    tile_w8a8<MB, NBV>(w, xq + i * k, dx + i * pairs * 16, bias + i, n0, y + i * ldy, ldy);
  if constexpr (MB > 1) {
    if (i < rows) rows_w8a8<MB / 2, NBV>(w, xq + i * k, dx + i * pairs * 16, bias + i, rows - i, n0, y + i * ldy, ldy);
  }
}

// ---- W8A16 on AVX-512 VNNI (the lm_head) -----------------------------------------------------------------
//
// Where rounding activations to int8 costs answers (the lm_head: greedy tokens of the default model flipped),
// each row goes in as int16 with one scale, max |x| / 32767 (a relative step of 3e-5 of the row's largest
// value, finer than bfloat16's 4e-3), the weights' int8 codes sign-extended to int16, and `vpdpwssd` does 32
// multiply-adds per instruction into int32 (2 ops per 32 weights, against 8 for dequantizing to float32: at one
// row the float kernel was bound by arithmetic, this one by memory). A lane sums K / 16 products of at most
// 127 * 32767, exact in int32 for K < 8192 (wider rows take the float kernel).

constexpr int64_t W8A16_MAX_K = 8192;

struct Rows16 {
  torch::Tensor xq;  // int16 [rows, K]
  torch::Tensor s;   // float32 [rows]
};

Rows16 rows16(const torch::Tensor& xf) {
  const int64_t rows = xf.size(0), k = xf.size(1);
  Rows16 out{torch::empty({rows, k}, torch::kInt16), torch::empty({rows}, torch::kFloat32)};
  const float* x = xf.data_ptr<float>();
  int16_t* q = out.xq.data_ptr<int16_t>();
  float* s = out.s.data_ptr<float>();
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * k;
    __m512 peak = _mm512_setzero_ps();
    for (int64_t c = 0; c < k; c += 16) peak = _mm512_max_ps(peak, _mm512_abs_ps(_mm512_loadu_ps(xr + c)));
    s[r] = _mm512_reduce_max_ps(peak) / 32767.f;
    const __m512 inv = _mm512_set1_ps(s[r] == 0.f ? 0.f : 1.f / s[r]);
    for (int64_t c = 0; c < k; c += 16)  // rounded to nearest even, |q| <= 32767
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + r * k + c),
                          _mm512_cvtsepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(xr + c), inv))));
  }
  return out;
}

template <int MB, int NBV>
void tile_w8a16(const Q8& w, const int16_t* xq, const float* xs, int64_t n0, float* y, int64_t ldy) {
  const int64_t k = w.k;
  __m512i acc[MB][NBV];
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NBV; ++j) acc[i][j] = _mm512_setzero_si512();
  for (int64_t c = 0; c < k; c += 32) {
    __m512i wv[NBV];
    for (int j = 0; j < NBV; ++j)
      wv[j] = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.q + (n0 + j) * k + c)));
    for (int i = 0; i < MB; ++i) {
      const __m512i xv = _mm512_loadu_si512(xq + i * k + c);
      for (int j = 0; j < NBV; ++j) acc[i][j] = _mm512_dpwssd_epi32(acc[i][j], wv[j], xv);
    }
  }
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NBV; ++j)
      y[i * ldy + n0 + j] = _mm512_reduce_add_ps(_mm512_cvtepi32_ps(acc[i][j])) * (xs[i] * w.s[n0 + j]);
}

template <int MB, int NBV>
void rows_w8a16(const Q8& w, const int16_t* xq, const float* xs, int64_t rows, int64_t n0, float* y, int64_t ldy) {
  int64_t i = 0;
  for (; i + MB <= rows; i += MB) tile_w8a16<MB, NBV>(w, xq + i * w.k, xs + i, n0, y + i * ldy, ldy);
  if constexpr (MB > 1) {
    if (i < rows) rows_w8a16<MB / 2, NBV>(w, xq + i * w.k, xs + i, rows - i, n0, y + i * ldy, ldy);
  }
}

torch::Tensor linear_w8a16(const Q8& w, const torch::Tensor& x, int64_t n) {
  const int64_t k = w.k;
  TORCH_CHECK(x.size(-1) == k, "the input has ", x.size(-1), " columns, the weight ", k);
  if (k >= W8A16_MAX_K) return linear(w, x, n);
  const torch::Tensor xf = x.reshape({-1, k}).to(torch::kFloat32).contiguous();
  const int64_t rows = xf.size(0);
  Rows16 r16 = rows16(xf);
  torch::Tensor y = torch::empty({rows, n}, xf.options());
  const int16_t* xq = r16.xq.data_ptr<int16_t>();
  const float* xs = r16.s.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  constexpr int NBV = 4;
  const int64_t tiles = n / NBV;
  balanced_tiles(tiles, NBV * k * rows, [&](int64_t t, int64_t end) {
    if (t + AHEAD8 < end) prefetch_rows(w, (t + AHEAD8) * NBV, NBV);
    rows_w8a16<4, NBV>(w, xq, xs, rows, t * NBV, yp, n);
  });
  for (int64_t c = tiles * NBV; c < n; ++c) rows_w8a16<1, 1>(w, xq, xs, rows, c, yp, n);
  return as_output(y, x, n);
}

// The activations as linear_w8a16 quantizes them, dequantized (for tests).
torch::Tensor w8a16_activations(torch::Tensor x) {
  const torch::Tensor xf = x.reshape({-1, x.size(-1)}).to(torch::kFloat32).contiguous();
  if (xf.size(1) >= W8A16_MAX_K) return x.to(torch::kFloat32);
  Rows16 r16 = rows16(xf);
  return (r16.xq.to(torch::kFloat32) * r16.s.unsqueeze(1)).reshape(x.sizes());
}

// The activations as this kernel quantizes them, dequantized (for tests: the same numbers it multiplies).
torch::Tensor w8a8_activations(torch::Tensor x) {
  const torch::Tensor xf = x.reshape({-1, x.size(-1)}).to(torch::kFloat32).contiguous();
  TORCH_CHECK(xf.size(1) % 64 == 0, "w8a8: K must be a multiple of 64");
  QuantRows qr = quantize_rows(xf);
  const torch::Tensor codes = qr.xq.to(torch::kFloat32);
  const torch::Tensor scales = qr.dx.reshape({xf.size(0), -1, 2, 8}).select(3, 0).reshape({xf.size(0), -1, 1});
  return (codes.reshape({xf.size(0), -1, BLOCK}) * scales).reshape(x.sizes());
}

torch::Tensor linear_w8a8(const Q8& w, const torch::Tensor& x, int64_t n) {
  const int64_t k = w.k;
  TORCH_CHECK(x.size(-1) == k, "the input has ", x.size(-1), " columns, the weight ", k);
  if (k % 64) return linear(w, x, n);  // an odd number of blocks: the float kernel
  const torch::Tensor xf = x.reshape({-1, k}).to(torch::kFloat32).contiguous();
  const int64_t rows = xf.size(0);
  QuantRows qr = quantize_rows(xf);
  torch::Tensor y = torch::empty({rows, n}, xf.options());
  const int8_t* xq = qr.xq.data_ptr<int8_t>();
  const float* dx = qr.dx.data_ptr<float>();
  const float* bias = qr.bias.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  constexpr int NBV = 4;
  const int64_t tiles = n / NBV;
  balanced_tiles(tiles, NBV * k * rows, [&](int64_t t, int64_t end) {
    if (t + AHEAD8 < end) prefetch_rows(w, (t + AHEAD8) * NBV, NBV);
    rows_w8a8<4, NBV>(w, xq, dx, bias, rows, t * NBV, yp, n);
  });
  for (int64_t c = tiles * NBV; c < n; ++c) rows_w8a8<1, 1>(w, xq, dx, bias, rows, c, yp, n);
  return as_output(y, x, n);
}
#else
#define SWITCHBOARD_VNNI 0
#endif

#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512F__)
#define SWITCHBOARD_BF16 1
// ---- q4 with bfloat16 activations (AVX-512 BF16) -----------------------------------------------------
//
// Each activation row is rounded to bfloat16 once (what a bfloat16 model does to every activation), with each
// block's sum of the rounded values, and `vdpbf16ps` does 32 multiply-adds per instruction. The codes go in as
// the bfloat16 numbers 128 + q (bits 0x4300 | q, exact), so per block and row
//     sum_j x_j (d q_j + m) = d * sum_j x_j (128 + q_j) + (m - 128 d) * sum_j x_j.

struct Bf16Rows {
  torch::Tensor xb;  // bfloat16 [rows, K]
  torch::Tensor xs;  // float32 [rows, K / 32]: each block's sum of the rounded values
};

Bf16Rows bf16_rows(const torch::Tensor& xf) {
  const int64_t rows = xf.size(0), k = xf.size(1), blocks = k / BLOCK;
  Bf16Rows out{torch::empty({rows, k}, torch::kBFloat16), torch::empty({rows, blocks}, torch::kFloat32)};
  const float* x = xf.data_ptr<float>();
  uint16_t* xb = reinterpret_cast<uint16_t*>(out.xb.data_ptr<at::BFloat16>());
  float* xs = out.xs.data_ptr<float>();
  at::parallel_for(0, rows * blocks, 256, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) {
      const __m512i v = (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(x + g * BLOCK + 16), _mm512_loadu_ps(x + g * BLOCK));
      _mm512_storeu_si512(xb + g * BLOCK, v);
      const __m512 even = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));  // a 32-bit lane holds two bfloat16
      const __m512 odd = _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32(static_cast<int>(0xffff0000u))));
      xs[g] = _mm512_reduce_add_ps(_mm512_add_ps(even, odd));
    }
  });
  return out;
}

inline __m512 dot_bf16(__m512 acc, __m512i x, __m512i w) { return _mm512_dpbf16_ps(acc, (__m512bh)x, (__m512bh)w); }

// ---- q4 in the kernel's own layout (AVX-512 BF16) ----------------------------------------------------------
//
// The layout (quant.py's pack_q4 writes it): weight rows in groups of 16 (the last padded with zero rows), each
// group's K columns in octets of 8; an octet of a group is 64 bytes, and 32-bit lane i of them holds row i's 8
// codes: its low 16 bits those of columns 8o, 8o + 2, 8o + 4, 8o + 6 and its high 16 bits those of 8o + 1,
// 8o + 3, 8o + 5, 8o + 7 (code t in bits 4t..4t+3 of each half). Scales d and offsets m: float16
// [groups, K / 32, 16], lane i row i. So the 64 bytes shifted right by 4t within each 16-bit half, their low
// nibble kept and or'ed with 0x4300 (one vpternlogd), hold 16 rows' codes of columns (8o + 2t, 8o + 2t + 1) as
// the bfloat16 numbers 128 + q, the pairs `vdpbf16ps` multiplies by a broadcast pair of activations: 32
// multiply-adds for 2 integer operations and no horizontal sums (GGUF's layout, one row's block per vector: 32
// for ~8, and a reduction per output). Per block of 32 columns the 16 rows' sums are scaled by d at once, and the
// offset term (m - 128 d) * sum(x) added.

struct Q4P {
  const uint8_t* q;
  const uint16_t* d;
  const uint16_t* m;
  int64_t k;
};

constexpr int64_t GROUP = 16;

inline __m512i broadcast_pair(const uint16_t* x) {  // x[0], x[1] (bfloat16) in every 32-bit lane
  int32_t v;
  std::memcpy(&v, x, sizeof v);
  return _mm512_set1_epi32(v);
}

// Rows [0, MB) of x times weight group g: y[i, 16 g + lane]. ``ahead``: a later group's bytes, fetched
// along the way (nullptr: none).
template <int MB>
void tile_q4p(const Q4P& w, int64_t g, const uint16_t* xb, const float* xs, float* y, int64_t ldy, int64_t n,
              const uint8_t* ahead) {
  const int64_t k = w.k, blocks = k / BLOCK;
  const uint8_t* q = w.q + g * (k / 8) * 64;
  const uint16_t* dg = w.d + g * blocks * GROUP;
  const uint16_t* mg = w.m + g * blocks * GROUP;
  const __m512i nibble = _mm512_set1_epi16(0xf), base = _mm512_set1_epi16(0x4300);
  __m512 acc[MB], off[MB];
  for (int i = 0; i < MB; ++i) acc[i] = off[i] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    if (ahead != nullptr) prefetch(ahead + b * 256, 256);
    __m512 part[MB];
    for (int i = 0; i < MB; ++i) part[i] = _mm512_setzero_ps();
    for (int o = 0; o < 4; ++o) {
      const __m512i z = _mm512_loadu_si512(q + (b * 4 + o) * 64);
      const int64_t col = b * BLOCK + o * 8;
      for (int t = 0; t < 4; ++t) {
        const __m512i shifted = t == 0 ? z : _mm512_srli_epi16(z, 4 * t);
        const __m512i codes = _mm512_ternarylogic_epi32(shifted, nibble, base, 0xea);  // (s & 0xf) | 0x4300
        for (int i = 0; i < MB; ++i) part[i] = dot_bf16(part[i], broadcast_pair(xb + i * k + col + 2 * t), codes);
      }
    }
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(dg + b * GROUP)));
    const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(mg + b * GROUP)));
    const __m512 c = _mm512_fnmadd_ps(d, _mm512_set1_ps(128.f), m);
    for (int i = 0; i < MB; ++i) {
      acc[i] = _mm512_fmadd_ps(part[i], d, acc[i]);
      off[i] = _mm512_fmadd_ps(c, _mm512_set1_ps(xs[i * blocks + b]), off[i]);
    }
  }
  const int64_t left = std::min<int64_t>(GROUP, n - g * GROUP);
  const __mmask16 mask = static_cast<__mmask16>((1u << left) - 1);
  for (int i = 0; i < MB; ++i) _mm512_mask_storeu_ps(y + i * ldy + g * GROUP, mask, _mm512_add_ps(acc[i], off[i]));
}

constexpr int MB_Q4P = 4;

template <int MB>
void rows_q4p(const Q4P& w, int64_t g, const uint16_t* xb, const float* xs, int64_t rows, float* y, int64_t ldy,
              int64_t n, const uint8_t* ahead) {
  const int64_t k = w.k, blocks = k / BLOCK;
  int64_t i = 0;
  for (; i + MB <= rows; i += MB, ahead = nullptr)
    tile_q4p<MB>(w, g, xb + i * k, xs + i * blocks, y + i * ldy, ldy, n, ahead);
  if constexpr (MB > 1) {
    if (i < rows) rows_q4p<MB / 2>(w, g, xb + i * k, xs + i * blocks, rows - i, y + i * ldy, ldy, n, ahead);
  }
}

constexpr int64_t AHEAD_Q4P = 4;  // groups

torch::Tensor linear_q4p(const Q4P& w, const torch::Tensor& x, int64_t n) {
  const int64_t k = w.k;
  TORCH_CHECK(x.size(-1) == k, "the input has ", x.size(-1), " columns, the weight ", k);
  const torch::Tensor xf = x.reshape({-1, k}).to(torch::kFloat32).contiguous();
  const int64_t rows = xf.size(0), groups = (n + GROUP - 1) / GROUP;
  Bf16Rows br = bf16_rows(xf);
  torch::Tensor y = torch::empty({rows, n}, xf.options());
  const uint16_t* xb = reinterpret_cast<const uint16_t*>(br.xb.data_ptr<at::BFloat16>());
  const float* xs = br.xs.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  balanced_tiles(groups, GROUP * k / 2 * rows, [&](int64_t g, int64_t end) {
    const uint8_t* ahead = g + AHEAD_Q4P < end ? w.q + (g + AHEAD_Q4P) * (k / 8) * 64 : nullptr;
    rows_q4p<MB_Q4P>(w, g, xb, xs, rows, yp, n, n, ahead);
  });
  return as_output(y, x, n);
}
#else
#define SWITCHBOARD_BF16 0
#endif

}  // namespace

// int8_activations: W8A8 where the CPU has VNNI (else W8A16 whatever it says)
torch::Tensor q8_linear(torch::Tensor x, torch::Tensor q, torch::Tensor s, bool int8_activations) {
#if SWITCHBOARD_VNNI
  if (int8_activations) return linear_w8a8(q8_of(q, s), x, q.size(0));
  return linear_w8a16(q8_of(q, s), x, q.size(0));
#else
  return linear(q8_of(q, s), x, q.size(0));
#endif
}

bool q8_int8_activations() { return SWITCHBOARD_VNNI; }

// GGUF's layout (CPUs without AVX-512 BF16; with it the layers are packed for q4p_linear)
torch::Tensor q4_linear(torch::Tensor x, torch::Tensor q, torch::Tensor d, torch::Tensor m) {
  return linear(q4_of(q, d, m), x, q.size(0));
}

// The kernel's own layout for q4 (see linear_q4p): where the CPU has AVX-512 BF16.
bool q4_packed() { return SWITCHBOARD_BF16; }

torch::Tensor q4p_linear(torch::Tensor x, torch::Tensor q, torch::Tensor d, torch::Tensor m, int64_t n) {
#if SWITCHBOARD_BF16
  TORCH_CHECK(q.scalar_type() == torch::kUInt8 && q.is_contiguous() && d.is_contiguous() && m.is_contiguous() &&
              d.scalar_type() == torch::kHalf && m.scalar_type() == torch::kHalf, "q4p: packed uint8 q, float16 d and m");
  const int64_t k = x.size(-1), groups = (n + GROUP - 1) / GROUP;
  TORCH_CHECK(k % BLOCK == 0 && q.numel() == groups * GROUP * k / 2 && d.numel() == groups * GROUP * (k / BLOCK) &&
              m.numel() == d.numel(), "q4p: the packed weight is not [", n, ", ", k, "]");
  return linear_q4p(Q4P{q.data_ptr<uint8_t>(), reinterpret_cast<const uint16_t*>(d.data_ptr<at::Half>()),
                        reinterpret_cast<const uint16_t*>(m.data_ptr<at::Half>()), k}, x, n);
#else
  TORCH_CHECK(false, "q4p: this CPU has no AVX-512 BF16");
#endif
}

torch::Tensor q8_dequant(torch::Tensor q, torch::Tensor s, torch::ScalarType dtype) {
  return dequant(q8_of(q, s), q.size(0), dtype);
}

torch::Tensor q4_dequant(torch::Tensor q, torch::Tensor d, torch::Tensor m, torch::ScalarType dtype) {
  return dequant(q4_of(q, d, m), q.size(0), dtype);
}

// The activations and the weight as an int4 layer's kernel multiplies them (for tests): the weight dequantized
// exactly, the activations rounded to bfloat16 where the CPU has AVX-512 BF16 (q4p_linear).
std::vector<torch::Tensor> q4_operands(torch::Tensor x, torch::Tensor q, torch::Tensor d, torch::Tensor m) {
  torch::Tensor w = q4_dequant(q, d, m, torch::kFloat32);
  torch::Tensor xf = x.to(torch::kFloat32);
#if SWITCHBOARD_BF16
  xf = xf.to(torch::kBFloat16).to(torch::kFloat32);
#endif
  return {xf, w};
}

// The activations as q8_linear multiplies them (for tests).
#if SWITCHBOARD_VNNI
torch::Tensor q8_activations(torch::Tensor x, bool int8_activations) {
  return int8_activations ? w8a8_activations(x) : w8a16_activations(x);
}
#else
torch::Tensor q8_activations(torch::Tensor x, bool) { return x; }
#endif

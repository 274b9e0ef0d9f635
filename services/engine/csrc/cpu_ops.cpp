// CPU kernels for the engine's decoder step (services/engine/kernels.py builds and loads them).
//
// Each replaces a chain of small PyTorch operations whose cost on a CPU is dispatch and an OpenMP
// barrier per operation rather than arithmetic: RMSNorm (8 ops), residual add + RMSNorm, SiLU(gate) * up
// (3 ops), rotary embedding of q and k plus the K/V cache write (14 ops), attention of one new token
// per sequence over its paged KV cache (a gather of every cached position, a mask and SDPA), and the
// LoRA of a batch whose rows use different adapters (2 matrix products per adapter and projection). Arithmetic
// is in float32 whatever the storage type, as transformers' own RMSNorm does.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

template <typename T>
inline float f32(T x) { return static_cast<float>(x); }

// bfloat16 <-> float32 as bit operations (round to nearest even, NaN kept), so loops vectorize;
// c10's own conversion is a branchy call the compiler leaves scalar.
template <>
inline float f32(c10::BFloat16 x) {
  const uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

template <typename T>
inline T to(float f) { return static_cast<T>(f); }

template <>
inline c10::BFloat16 to(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  bits = std::isnan(f) ? 0x7fc00000u : bits + 0x7fffu + ((bits >> 16) & 1u);
  return c10::BFloat16(static_cast<uint16_t>(bits >> 16), c10::BFloat16::from_bits());
}

// Rows split across threads; each row of `cols` values handled by `fn(row)`.
template <typename Fn>
void rows(int64_t n, int64_t cols, Fn fn) {
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(cols, 1));
  at::parallel_for(0, n, grain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) fn(r);
  });
}

template <typename T>
void rms_row(const T* x, const T* w, T* out, int64_t h, float eps) {
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < h; ++i) sum += f32(x[i]) * f32(x[i]);
  const float scale = 1.f / std::sqrt(sum / static_cast<float>(h) + eps);
  for (int64_t i = 0; i < h; ++i) {
    const T normed = to<T>(f32(x[i]) * scale);  // transformers rounds to the storage type here
    out[i] = to<T>(f32(w[i]) * f32(normed));
  }
}

// exp(x) to ~2 ulp (Cephes' expf: x = n ln2 + r, a degree-6 polynomial in r, 2^n from the exponent
// bits); unlike std::exp it vectorizes, and softmax and SiLU spend most of their time in it.
inline float fast_exp(float x) {
  x = std::min(88.3762626647949f, std::max(-87.3365447504019f, x));
  const float n = std::nearbyint(x * 1.44269504088896341f);
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  int32_t bits;
  std::memcpy(&bits, &p, sizeof bits);
  bits += static_cast<int32_t>(n) << 23;
  std::memcpy(&p, &bits, sizeof p);
  return p;
}

inline float dot(const float* a, const float* b, int64_t n) {
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

// Four dot products against one vector in one pass: four independent accumulators keep the FMA
// units busy where one dot's reduction chain would wait on each add.
inline void dot4(const float* const* xs, const float* a, int64_t n, float* out) {  // every row alike
  float s0 = 0.f, s1 = 0.f, s2 = 0.f, s3 = 0.f;
  const float *x0 = xs[0], *x1 = xs[1], *x2 = xs[2], *x3 = xs[3];
#pragma omp simd reduction(+ : s0, s1, s2, s3)
  for (int64_t i = 0; i < n; ++i) {
    s0 += x0[i] * a[i];
    s1 += x1[i] * a[i];
    s2 += x2[i] * a[i];
    s3 += x3[i] * a[i];
  }
  out[0] = s0, out[1] = s1, out[2] = s2, out[3] = s3;
}

inline void axpy(float p, const float* x, float* y, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] += p * x[i];
}

// The row as float32: itself when stored as float32, else converted into `buffer`.
template <typename T>
inline const float* as_float(const T* x, float* buffer, int64_t n) {
  if constexpr (std::is_same_v<T, float>) {
    return x;
  } else {
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) buffer[i] = f32(x[i]);
    return buffer;
  }
}

template <typename T>
void silu_mul_row(const T* gate, const T* up, T* out, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const float g = f32(gate[i]);
    const T act = to<T>(g / (1.f + fast_exp(-g)));  // rounded like torch's silu output
    out[i] = to<T>(f32(act) * f32(up[i]));
  }
}

// s[j] = exp(s[j] - peak) in place; returns their sum.
inline float exp_sum(float* s, int64_t n, float peak) {
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t j = 0; j < n; ++j) {
    s[j] = fast_exp(s[j] - peak);
    sum += s[j];
  }
  return sum;
}

}  // namespace

torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && weight.is_contiguous(), "rms_norm: x [T, H] contiguous");
  auto out = torch::empty_like(x);
  const int64_t n = x.size(0), h = x.size(1);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
    const auto *px = x.data_ptr<scalar_t>(), *pw = weight.data_ptr<scalar_t>();
    auto* po = out.data_ptr<scalar_t>();
    rows(n, h, [&](int64_t r) { rms_row(px + r * h, pw, po + r * h, h, static_cast<float>(eps)); });
  });
  return out;
}

// residual += x (rounded to the storage type, as `h = h + x` is), then RMSNorm of the new residual.
torch::Tensor add_rms_norm(const torch::Tensor& x, torch::Tensor& residual, const torch::Tensor& weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && residual.is_contiguous() && x.sizes() == residual.sizes(),
              "add_rms_norm: x and residual [T, H] contiguous");
  auto out = torch::empty_like(x);
  const int64_t n = x.size(0), h = x.size(1);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "add_rms_norm", [&] {
    const auto *px = x.data_ptr<scalar_t>(), *pw = weight.data_ptr<scalar_t>();
    auto *pr = residual.data_ptr<scalar_t>(), *po = out.data_ptr<scalar_t>();
    rows(n, h, [&](int64_t r) {
      scalar_t* res = pr + r * h;
      const scalar_t* xr = px + r * h;
      for (int64_t i = 0; i < h; ++i) res[i] = to<scalar_t>(f32(res[i]) + f32(xr[i]));
      rms_row(res, pw, po + r * h, h, static_cast<float>(eps));
    });
  });
  return out;
}

// [T, 2I] (gate then up) -> [T, I]: silu(gate) * up.
torch::Tensor silu_mul(const torch::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.size(1) % 2 == 0, "silu_mul: x [T, 2I] contiguous");
  const int64_t n = x.size(0), inter = x.size(1) / 2;
  auto out = torch::empty({n, inter}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "silu_mul", [&] {
    const auto* px = x.data_ptr<scalar_t>();
    auto* po = out.data_ptr<scalar_t>();
    rows(n, inter, [&](int64_t r) {
      const scalar_t *gate = px + r * 2 * inter, *up = gate + inter;
      scalar_t* o = po + r * inter;
      silu_mul_row(gate, up, o, inter);
    });
  });
  return out;
}

namespace {

// Rotates each q and k head of one qkv row in place (cos, sin: the position's D/2 values).
template <typename T>
inline void rotate_row(T* row, const float* c, const float* s, int64_t heads, int64_t head_dim) {
  const int64_t half = head_dim / 2;
  for (int64_t head = 0; head < heads; ++head) {
    T* x = row + head * head_dim;
    for (int64_t i = 0; i < half; ++i) {
      const float a = f32(x[i]), b = f32(x[i + half]);
      x[i] = to<T>(a * c[i] - b * s[i]);
      x[i + half] = to<T>(b * c[i] + a * s[i]);
    }
  }
}

// One head vector as int8 codes and a float16 scale (services/engine/kv_cache.py: s = max |x| / 127 rounded
// to float16, codes = round(x / s), the same division as its PyTorch reference).
template <typename T>
inline void store_q8(const T* x, int8_t* codes, at::Half* scale, int64_t d) {
  float amax = 0.f;
  for (int64_t i = 0; i < d; ++i) amax = std::max(amax, std::fabs(f32(x[i])));
  const at::Half s16 = static_cast<at::Half>(amax / 127.f);
  const float s = static_cast<float>(s16);
  for (int64_t i = 0; i < d; ++i)
    codes[i] = s > 0.f ? static_cast<int8_t>(std::max(-127.f, std::min(127.f, std::nearbyint(f32(x[i]) / s)))) : 0;
  *scale = s16;
}

// Calls store(row r, its k heads, its v heads) for every qkv row after rotating it.
template <typename T, typename Store>
void rope_rows(torch::Tensor& qkv, const torch::Tensor& cos, const torch::Tensor& sin, const torch::Tensor& positions,
               int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, Store store) {
  TORCH_CHECK(qkv.dim() == 2 && qkv.stride(1) == 1, "rope_store: qkv [T, width] with unit column stride");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && cos.is_contiguous() && sin.is_contiguous(), "rope_store: cos/sin");
  const int64_t n = qkv.size(0), half = head_dim / 2, row_stride = qkv.stride(0), rotated = num_heads + num_kv_heads;
  const auto* pos = positions.data_ptr<int64_t>();
  const float *pc = cos.data_ptr<float>(), *ps = sin.data_ptr<float>();
  T* base = qkv.data_ptr<T>();
  rows(n, rotated * head_dim, [&](int64_t r) {
    T* row = base + r * row_stride;
    rotate_row(row, pc + pos[r] * half, ps + pos[r] * half, rotated, head_dim);
    const T* k = row + num_heads * head_dim;
    store(r, k, k + num_kv_heads * head_dim);
  });
}

}  // namespace

// qkv [T, (Hq + 2 Hkv) * D], rows possibly strided: rotates each q and k head in place with the
// rotary table (cos, sin [P, D/2] float32, the first half of transformers' duplicated cos/sin), then
// copies k and v into the caches [Hkv, S, D] at `slots` [T].
void rope_store(torch::Tensor& qkv, const torch::Tensor& cos, const torch::Tensor& sin, const torch::Tensor& positions,
                torch::Tensor& k_cache, torch::Tensor& v_cache, const torch::Tensor& slots, int64_t num_heads,
                int64_t num_kv_heads, int64_t head_dim) {
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "rope_store: caches contiguous");
  const int64_t num_slots = k_cache.size(1);
  const auto* slot = slots.data_ptr<int64_t>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, qkv.scalar_type(), "rope_store", [&] {
    auto *kc = k_cache.data_ptr<scalar_t>(), *vc = v_cache.data_ptr<scalar_t>();
    rope_rows<scalar_t>(qkv, cos, sin, positions, num_heads, num_kv_heads, head_dim,
                        [&](int64_t r, const scalar_t* k, const scalar_t* v) {
      for (int64_t h = 0; h < num_kv_heads; ++h) {
        std::copy(k + h * head_dim, k + (h + 1) * head_dim, kc + (h * num_slots + slot[r]) * head_dim);
        std::copy(v + h * head_dim, v + (h + 1) * head_dim, vc + (h * num_slots + slot[r]) * head_dim);
      }
    });
  });
}

// rope_store into an int8 cache: codes [Hkv, S, D] int8 and scales [Hkv, S] float16.
void rope_store_q8(torch::Tensor& qkv, const torch::Tensor& cos, const torch::Tensor& sin,
                   const torch::Tensor& positions, torch::Tensor& k_cache, torch::Tensor& v_cache,
                   torch::Tensor& k_scale, torch::Tensor& v_scale, const torch::Tensor& slots, int64_t num_heads,
                   int64_t num_kv_heads, int64_t head_dim) {
  TORCH_CHECK(k_cache.scalar_type() == at::kChar && k_cache.is_contiguous() && v_cache.is_contiguous() &&
              k_scale.scalar_type() == at::kHalf && k_scale.is_contiguous() && v_scale.is_contiguous(),
              "rope_store_q8: int8 caches and float16 scales, contiguous");
  const int64_t num_slots = k_cache.size(1);
  const auto* slot = slots.data_ptr<int64_t>();
  int8_t *kc = k_cache.data_ptr<int8_t>(), *vc = v_cache.data_ptr<int8_t>();
  at::Half *ks = k_scale.data_ptr<at::Half>(), *vs = v_scale.data_ptr<at::Half>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, qkv.scalar_type(), "rope_store_q8", [&] {
    rope_rows<scalar_t>(qkv, cos, sin, positions, num_heads, num_kv_heads, head_dim,
                        [&](int64_t r, const scalar_t* k, const scalar_t* v) {
      for (int64_t h = 0; h < num_kv_heads; ++h) {
        const int64_t at = h * num_slots + slot[r];
        store_q8(k + h * head_dim, kc + at * head_dim, ks + at, head_dim);
        store_q8(v + h * head_dim, vc + at * head_dim, vs + at, head_dim);
      }
    });
  });
}

namespace {

#if defined(__AVX512F__)
constexpr int64_t SCORE_MAX_GROUP = 8, SCORE_MAX_DIM = 128;

// Lane i of the result: the sum of v[i]'s 16 lanes (16 horizontal sums in 15 shuffle-and-add steps).
inline __m512 sum_lanes16(__m512* v) {
  __m512 w[8], x[4], y[2];
  for (int i = 0; i < 8; ++i)  // within 128-bit quarters: v[2i]'s and v[2i+1]'s lanes 0+2 and 1+3
    w[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i)  // each quarter: one sum each of v[4i .. 4i+3]
    x[i] = _mm512_add_ps(_mm512_shuffle_ps(w[2 * i], w[2 * i + 1], 0x44), _mm512_shuffle_ps(w[2 * i], w[2 * i + 1], 0xEE));
  for (int i = 0; i < 2; ++i)  // quarters 0+2 and 1+3
    y[i] = _mm512_add_ps(_mm512_shuffle_f32x4(x[2 * i], x[2 * i + 1], 0x44),
                         _mm512_shuffle_f32x4(x[2 * i], x[2 * i + 1], 0xEE));
  return _mm512_add_ps(_mm512_shuffle_f32x4(y[0], y[1], 0x88), _mm512_shuffle_f32x4(y[0], y[1], 0xDD));
}

// How a cache row's numbers meet a query in `lane_scores`: float32 rows 16 at a time by vfmadd; bfloat16 rows
// 32 at a time by vdpbf16ps (each pair's products exact in float32, summed).
struct F32Lanes {
  using Q = __m512;
  static constexpr int64_t width = 16;
  static Q load_q(const float* p) { return _mm512_loadu_ps(p); }
  static __m512 dot(__m512 acc, const float* row, Q q) { return _mm512_fmadd_ps(_mm512_loadu_ps(row), q, acc); }
};

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }

#if defined(__AVX512BF16__)
struct Bf16Lanes {
  using Q = __m512bh;
  static constexpr int64_t width = 32;
  static Q load_q(const c10::BFloat16* p) { return (__m512bh)_mm512_loadu_si512(p); }
  static __m512 dot(__m512 acc, const c10::BFloat16* row, Q q) {
    return _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(row), q);
  }
};
#endif

inline __m512 load16(const c10::BFloat16* p) {  // 16 bfloat16 numbers as float32
  return _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}

// scores[g * L + j] = scale * <q_g, k_j> for a KV group's query heads g over positions [0, L) of one KV head's
// cache rows `k` [S, d] through `table`, 16 positions at a time: each position's products summed in a vector
// (`Lanes`), the 16 positions' lanes across in one tree. Needs d a multiple of Lanes::width up to SCORE_MAX_DIM and
// group up to SCORE_MAX_GROUP.
template <typename T, typename Lanes>
void lane_scores(const T* q, const T* k, const int64_t* table, int64_t block_size, int64_t L, int64_t d,
                 int64_t group, float scale, float* scores) {
  typename Lanes::Q qv[SCORE_MAX_GROUP][SCORE_MAX_DIM / 16];
  const int64_t parts = d / Lanes::width;
  for (int64_t g = 0; g < group; ++g)
    for (int64_t c = 0; c < parts; ++c) qv[g][c] = Lanes::load_q(q + g * d + c * Lanes::width);
  const __m512 vscale = _mm512_set1_ps(scale);
  for (int64_t j0 = 0; j0 < L; j0 += 16) {
    const int64_t m = std::min<int64_t>(16, L - j0);
    const T* rows[16];
    for (int64_t r = 0; r < 16; ++r) {
      const int64_t pos = j0 + std::min(r, m - 1);  // past the end: the last row again, its lanes not stored
      rows[r] = k + (table[pos / block_size] * block_size + pos % block_size) * d;
    }
    for (int64_t g = 0; g < group; ++g) {
      __m512 acc[16];
      for (int r = 0; r < 16; ++r) {
        acc[r] = _mm512_setzero_ps();
        for (int64_t c = 0; c < parts; ++c) acc[r] = Lanes::dot(acc[r], rows[r] + c * Lanes::width, qv[g][c]);
      }
      _mm512_mask_storeu_ps(scores + g * L + j0, static_cast<__mmask16>((1u << m) - 1),
                            _mm512_mul_ps(sum_lanes16(acc), vscale));
    }
  }
}

// acc[g * d + i] = sum over j of weights[g * L + j] * v_j[i], for the group's query heads over positions [0, L) of
// one KV head's cache rows `v` [S, d] through `table`: each value row converted once, the accumulators of up to
// 16 vectors in registers (query heads in chunks of that many). Needs d a multiple of 16 up to SCORE_MAX_DIM.
template <typename T>
void lane_values(const float* weights, const T* v, const int64_t* table, int64_t block_size, int64_t L, int64_t d,
                 int64_t group, float* acc) {
  const int64_t parts = d / 16, chunk = std::max<int64_t>(1, 16 / parts);
  for (int64_t g0 = 0; g0 < group; g0 += chunk) {
    const int64_t heads = std::min(chunk, group - g0);
    __m512 a[16];
    for (int i = 0; i < 16; ++i) a[i] = _mm512_setzero_ps();
    for (int64_t j = 0; j < L; ++j) {
      const T* row = v + (table[j / block_size] * block_size + j % block_size) * d;
      for (int64_t c = 0; c < parts; ++c) {
        const __m512 x = load16(row + c * 16);
        for (int64_t g = 0; g < heads; ++g)
          a[g * parts + c] = _mm512_fmadd_ps(_mm512_set1_ps(weights[(g0 + g) * L + j]), x, a[g * parts + c]);
      }
    }
    for (int64_t g = 0; g < heads; ++g)
      for (int64_t c = 0; c < parts; ++c) _mm512_storeu_ps(acc + (g0 + g) * d + c * 16, a[g * parts + c]);
  }
}
#endif

// Whether lane_scores / lane_values run a T cache on this CPU: float32 with AVX-512, bfloat16 with AVX-512 BF16.
template <typename T>
constexpr bool has_lanes() {
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, c10::BFloat16>) return true;
#endif
#if defined(__AVX512F__)
  if constexpr (std::is_same_v<T, float>) return true;
#endif
  return false;
}

// Values by lane_values where it applies (as fast_scores); false: the caller's loop.
template <typename T>
bool fast_values(const float* weights, const T* v, const int64_t* table, int64_t block_size, int64_t L, int64_t d,
                 int64_t group, float* acc) {
#if defined(__AVX512F__)
  if constexpr (has_lanes<T>()) {
    if (d % 32 == 0 && d <= SCORE_MAX_DIM) {
      lane_values(weights, v, table, block_size, L, d, group, acc);
      return true;
    }
  }
#endif
  return false;
}

// Scores by lane_scores where it applies (a float32 or bfloat16 cache the CPU has lanes for, its shapes); false:
// the caller's loop.
template <typename T>
bool fast_scores(const T* q, const T* k, const int64_t* table, int64_t block_size, int64_t L, int64_t d, int64_t group,
                 float scale, float* scores) {
#if defined(__AVX512F__)
  if constexpr (has_lanes<T>()) {
    if (d % 32 == 0 && d <= SCORE_MAX_DIM && group <= SCORE_MAX_GROUP) {
#if defined(__AVX512BF16__)
      if constexpr (std::is_same_v<T, c10::BFloat16>) {
        lane_scores<T, Bf16Lanes>(q, k, table, block_size, L, d, group, scale, scores);
        return true;
      }
#endif
      if constexpr (std::is_same_v<T, float>) {
        lane_scores<T, F32Lanes>(q, k, table, block_size, L, d, group, scale, scores);
        return true;
      }
    }
  }
#endif
  return false;
}

// One new token per sequence attends to its cached positions [0, lens[b]) through its block table.
// read_k(index, buffer) / read_v: cache row `index` (kv head * slots + slot) as float32; k_rows / v_rows: the
// caches' rows as stored (a float32 or bfloat16 cache read straight from them, ``fast_scores`` / ``fast_values``),
// or null.
template <typename T, typename ReadK, typename ReadV>
torch::Tensor decode(const torch::Tensor& q, int64_t num_slots, const torch::Tensor& block_tables,
                     const torch::Tensor& lens, int64_t block_size, int64_t num_heads, int64_t num_kv_heads,
                     int64_t head_dim, double scale, ReadK read_k, ReadV read_v, const T* k_rows = nullptr,
                     const T* v_rows = nullptr) {
  TORCH_CHECK(q.dim() == 2 && q.stride(1) == 1, "paged_decode: q [N, Hq*D] with unit column stride");
  TORCH_CHECK(block_tables.is_contiguous() && lens.is_contiguous(), "paged_decode: tables and lens contiguous");
  const int64_t n = q.size(0), nb = block_tables.size(1), group = num_heads / num_kv_heads, d = head_dim;
  const int64_t q_stride = q.stride(0);
  auto out = torch::empty({n, num_heads * d}, q.options());
  const auto *tables = block_tables.data_ptr<int64_t>(), *len = lens.data_ptr<int64_t>();
  const T* pq = q.data_ptr<T>();
  T* po = out.data_ptr<T>();
  at::parallel_for(0, n * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(group * d), acc(group * d), row(d), scores;
    for (int64_t w = begin; w < end; ++w) {
      const int64_t b = w / num_kv_heads, kh = w % num_kv_heads, L = len[b];
      const int64_t* table = tables + b * nb;
      const T* qrow = pq + b * q_stride + kh * group * d;
      scores.assign(group * L, 0.f);
      if (k_rows == nullptr || !fast_scores(qrow, k_rows + kh * num_slots * d, table, block_size, L, d, group,
                                            static_cast<float>(scale), scores.data())) {
        for (int64_t i = 0; i < group * d; ++i) qf[i] = f32(qrow[i]) * static_cast<float>(scale);
        for (int64_t j = 0; j < L; ++j) {
          const float* kf = read_k(kh * num_slots + table[j / block_size] * block_size + j % block_size, row.data());
          for (int64_t g = 0; g < group; ++g) scores[g * L + j] = dot(qf.data() + g * d, kf, d);
        }
      }
      std::vector<float> total(group, 0.f);
      for (int64_t g = 0; g < group; ++g) {
        float* sg = scores.data() + g * L;
        float peak = -INFINITY;
        for (int64_t j = 0; j < L; ++j) peak = std::max(peak, sg[j]);
        total[g] = exp_sum(sg, L, peak);
      }
      if (v_rows == nullptr || !fast_values(scores.data(), v_rows + kh * num_slots * d, table, block_size, L, d, group,
                                            acc.data())) {
        std::fill(acc.begin(), acc.end(), 0.f);
        for (int64_t j = 0; j < L; ++j) {
          const float* vf = read_v(kh * num_slots + table[j / block_size] * block_size + j % block_size, row.data());
          for (int64_t g = 0; g < group; ++g) axpy(scores[g * L + j], vf, acc.data() + g * d, d);
        }
      }
      T* orow = po + b * num_heads * d + kh * group * d;
      for (int64_t g = 0; g < group; ++g)
        for (int64_t i = 0; i < d; ++i) orow[g * d + i] = to<T>(acc[g * d + i] / total[g]);
    }
  });
  return out;
}

}  // namespace

// q [N, Hq * D] (rows possibly strided), caches [Hkv, S, D] (so one head's block of positions is
// contiguous), block_tables [N, NB] int64, lens [N].
torch::Tensor paged_decode(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                           const torch::Tensor& block_tables, const torch::Tensor& lens, int64_t block_size,
                           int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double scale) {
  torch::Tensor out;
  const int64_t d = head_dim;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode", [&] {
    const auto *kc = k_cache.data_ptr<scalar_t>(), *vc = v_cache.data_ptr<scalar_t>();
    out = decode<scalar_t>(q, k_cache.size(1), block_tables, lens, block_size, num_heads, num_kv_heads, head_dim,
                           scale, [&](int64_t at, float* buf) { return as_float(kc + at * d, buf, d); },
                           [&](int64_t at, float* buf) { return as_float(vc + at * d, buf, d); }, kc, vc);
  });
  return out;
}

// paged_decode over an int8 cache: codes [Hkv, S, D] int8, scales [Hkv, S] float16.
torch::Tensor paged_decode_q8(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                              const torch::Tensor& k_scale, const torch::Tensor& v_scale,
                              const torch::Tensor& block_tables, const torch::Tensor& lens, int64_t block_size,
                              int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double scale) {
  TORCH_CHECK(k_cache.scalar_type() == at::kChar && k_scale.scalar_type() == at::kHalf,
              "paged_decode_q8: int8 caches and float16 scales");
  torch::Tensor out;
  const int64_t d = head_dim;
  const int8_t *kc = k_cache.data_ptr<int8_t>(), *vc = v_cache.data_ptr<int8_t>();
  const at::Half *ks = k_scale.data_ptr<at::Half>(), *vs = v_scale.data_ptr<at::Half>();
  auto read = [d](const int8_t* codes, const at::Half* scales) {
    return [=](int64_t at, float* buf) {
      const float s = static_cast<float>(scales[at]);
      const int8_t* c = codes + at * d;
#pragma omp simd
      for (int64_t i = 0; i < d; ++i) buf[i] = s * static_cast<float>(c[i]);
      return static_cast<const float*>(buf);
    };
  };
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode_q8", [&] {
    out = decode<scalar_t>(q, k_cache.size(1), block_tables, lens, block_size, num_heads, num_kv_heads, head_dim,
                           scale, read(kc, ks), read(vc, vs));
  });
  return out;
}

// LoRA of one projection group, every row with its own adapter (punica's SGMV): for row i and target
// t, y[i, cols of t] += (x[i] . A_t[j]) * Bt_t[j] summed over j in [off[i], off[i] + rank[i]).
// x [T, in], y [T, sum out_t] (unit column stride), A_t [R, in] and Bt_t [R, out_t] contiguous;
// rank 0: no adapter. Rows are grouped by adapter (in pieces of at most 16 rows) so that each task
// reads one adapter's matrices once for all its rows; each row's sums run in float32 in a fixed
// order, whatever else the batch holds.
void lora_apply(torch::Tensor& y, const torch::Tensor& x, const std::vector<torch::Tensor>& as,
                const std::vector<torch::Tensor>& bts, const torch::Tensor& row_off, const torch::Tensor& row_rank) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && y.dim() == 2 && y.stride(1) == 1, "lora_apply: x, y [T, *]");
  TORCH_CHECK(as.size() == bts.size() && !as.empty(), "lora_apply: one A and one Bt per target");
  const int64_t n = x.size(0), in = x.size(1), k = static_cast<int64_t>(as.size());
  std::vector<int64_t> col0(k + 1, 0);
  for (int64_t t = 0; t < k; ++t) {
    TORCH_CHECK(as[t].is_contiguous() && bts[t].is_contiguous() && as[t].size(1) == in, "lora_apply: A_t, Bt_t");
    col0[t + 1] = col0[t] + bts[t].size(1);
  }
  TORCH_CHECK(col0[k] == y.size(1), "lora_apply: y's width is the targets' outputs together");
  const auto *off = row_off.data_ptr<int64_t>(), *rank = row_rank.data_ptr<int64_t>();
  constexpr int64_t kPiece = 16;
  std::vector<std::vector<int64_t>> pieces;  // rows of one adapter, at most kPiece each
  {
    std::vector<int64_t> order;
    for (int64_t i = 0; i < n; ++i)
      if (rank[i] > 0) order.push_back(i);
    std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return off[a] < off[b]; });
    for (size_t p = 0; p < order.size(); ++p) {
      if (p == 0 || off[order[p]] != off[order[p - 1]] || pieces.back().size() == kPiece) pieces.emplace_back();
      pieces.back().push_back(order[p]);
    }
  }
  const int64_t tasks = static_cast<int64_t>(pieces.size()) * k;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "lora_apply", [&] {
    std::vector<const scalar_t*> pa(k), pb(k);
    for (int64_t t = 0; t < k; ++t) pa[t] = as[t].data_ptr<scalar_t>(), pb[t] = bts[t].data_ptr<scalar_t>();
    const auto* px = x.data_ptr<scalar_t>();
    auto* py = y.data_ptr<scalar_t>();
    at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> xf, row(std::max<int64_t>(in, col0[k])), h, acc;
      for (int64_t w = begin; w < end; ++w) {
        const std::vector<int64_t>& rows_of = pieces[w / k];
        const int64_t t = w % k, m = static_cast<int64_t>(rows_of.size()), first = rows_of[0];
        const int64_t r = rank[first], o = off[first], width = col0[t + 1] - col0[t];
        xf.resize(m * in);
        std::vector<const float*> xs(m);
        for (int64_t i = 0; i < m; ++i) xs[i] = as_float(px + rows_of[i] * x.stride(0), xf.data() + i * in, in);
        h.assign(m * r, 0.f);
        float four[4];
        for (int64_t j = 0; j < r; ++j) {
          const float* a = as_float(pa[t] + (o + j) * in, row.data(), in);
          for (int64_t i = 0; i < m; i += 4) {  // a last group of fewer than 4 repeats its first row
            const float* group[4] = {xs[i], xs[std::min(i + 1, m - 1)], xs[std::min(i + 2, m - 1)],
                                     xs[std::min(i + 3, m - 1)]};
            dot4(group, a, in, four);
            for (int64_t q = 0; q < 4 && i + q < m; ++q) h[(i + q) * r + j] = four[q];
          }
        }
        acc.assign(m * width, 0.f);
        for (int64_t j = 0; j < r; ++j) {
          const float* b = as_float(pb[t] + (o + j) * width, row.data(), width);
          for (int64_t i = 0; i < m; ++i) axpy(h[i * r + j], b, acc.data() + i * width, width);
        }
        for (int64_t i = 0; i < m; ++i) {
          scalar_t* yr = py + rows_of[i] * y.stride(0) + col0[t];
          const float* ar = acc.data() + i * width;
          for (int64_t c = 0; c < width; ++c) yr[c] = to<scalar_t>(f32(yr[c]) + ar[c]);
        }
      }
    });
  });
}

// quant_ops.cpp
torch::Tensor q8_linear(torch::Tensor x, torch::Tensor q, torch::Tensor s, bool int8_activations);
bool q8_int8_activations();
torch::Tensor q8_activations(torch::Tensor x, bool int8_activations);
torch::Tensor q4_linear(torch::Tensor x, torch::Tensor q, torch::Tensor d, torch::Tensor m);
std::vector<torch::Tensor> q4_operands(torch::Tensor x, torch::Tensor q, torch::Tensor d, torch::Tensor m);
torch::Tensor q8_dequant(torch::Tensor q, torch::Tensor s, torch::ScalarType dtype);
torch::Tensor q4_dequant(torch::Tensor q, torch::Tensor d, torch::Tensor m, torch::ScalarType dtype);
bool q4_packed();
torch::Tensor q4p_linear(torch::Tensor x, torch::Tensor q, torch::Tensor d, torch::Tensor m, int64_t n);
// layer_loop.cpp
void register_layer_loop(pybind11::module& m);
// prefill.cpp
void register_prefill(pybind11::module& m);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // every kernel runs without the GIL (tensors only): the engine's event loop keeps its heartbeats going
  // while a step runs on the engine's thread (a 4,096-token prompt's attention held it ~120 ms a call)
  const auto nogil = pybind11::call_guard<pybind11::gil_scoped_release>();
  m.def("rms_norm", &rms_norm, nogil);
  m.def("add_rms_norm", &add_rms_norm, nogil);
  m.def("silu_mul", &silu_mul, nogil);
  m.def("rope_store", &rope_store, nogil);
  m.def("paged_decode", &paged_decode, nogil);
  m.def("rope_store_q8", &rope_store_q8, nogil);
  m.def("paged_decode_q8", &paged_decode_q8, nogil);
  m.def("lora_apply", &lora_apply, nogil);
  m.def("q8_linear", &q8_linear, nogil);
  m.def("q4_linear", &q4_linear, nogil);
  m.def("q4_operands", &q4_operands, nogil);
  m.def("q8_dequant", &q8_dequant, nogil);
  m.def("q8_int8_activations", &q8_int8_activations, nogil);
  m.def("q8_activations", &q8_activations, nogil);
  m.def("q4_dequant", &q4_dequant, nogil);
  m.def("q4_packed", &q4_packed);
  m.def("q4p_linear", &q4p_linear, nogil);
  register_layer_loop(m);
  register_prefill(m);
}

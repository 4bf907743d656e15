// GGUF-block linears for the CPU edge (`--weights gguf`, edgekv/models/gguf_linear.py).
//
// The weights stay in the file's own blocks (Q4_K, Q5_0, Q6_K, Q8_0: the same bytes llama.cpp reads per token).
// `decode_row` is ggml's reference dequantization (float32, exact: every scale·code product fits float32), the
// tests' check against gguf-py. The product itself (below) never forms the float weights: it meets the integer
// codes with the activations and applies each chunk's scale to the partial sum.
//
// Built with -ffp-contract=off so that only the written FMAs fuse.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX512F__) || defined(__F16C__)
#include <immintrin.h>
#endif

namespace {

constexpr int kLanes = 16;  // float32 lanes of the accumulation (one AVX-512 register)
constexpr int64_t kMaxChunks = 1024;  // int8-activation Q4_K rows: up to 32,768 values (checked at the entry)
constexpr int64_t kAhead = 4096;  // bytes a weight stream is prefetched ahead (768 → 4096 doubled Q5_0's GB/s)

inline float fp16(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  return static_cast<float>(c10::Half(h, c10::Half::from_bits()));
#endif
}

enum Type : int64_t { Q8_0 = 8, Q5_0 = 6, Q4_K = 12, Q6_K = 14 };  // ggml's type ids

struct Layout {
  int values;  // per block
  int bytes;   // per block
};

Layout layout(int64_t type) {
  switch (type) {
    case Q8_0: return {32, 34};
    case Q5_0: return {32, 22};
    case Q4_K: return {256, 144};
    case Q6_K: return {256, 210};
  }
  TORCH_CHECK(false, "unsupported GGUF block type ", type);
}

// One block → `values` floats. Formulas as ggml's dequantize_row_* (reference C), in the same float order.
inline void decode_q8_0(const uint8_t* b, float* y) {
  const float d = fp16(b);
  const int8_t* q = reinterpret_cast<const int8_t*>(b + 2);
  for (int i = 0; i < 32; ++i) y[i] = d * static_cast<float>(q[i]);
}

inline void decode_q5_0(const uint8_t* b, float* y) {
  const float d = fp16(b);
  uint32_t qh;
  std::memcpy(&qh, b + 2, 4);
  const uint8_t* qs = b + 6;
  for (int j = 0; j < 16; ++j) {
    const int x0 = ((qs[j] & 0x0F) | (((qh >> j) << 4) & 0x10)) - 16;
    const int x1 = ((qs[j] >> 4) | ((qh >> (j + 12)) & 0x10)) - 16;
    y[j] = static_cast<float>(x0) * d;
    y[j + 16] = static_cast<float>(x1) * d;
  }
}

inline void scale_min_k4(int j, const uint8_t* q, uint8_t* sc, uint8_t* m) {
  if (j < 4) {
    *sc = q[j] & 63;
    *m = q[j + 4] & 63;
  } else {
    *sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
    *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}

inline void decode_q4_k(const uint8_t* b, float* y) {
  const float d = fp16(b), dmin = fp16(b + 2);
  const uint8_t* scales = b + 4;
  const uint8_t* q = b + 16;
  int is = 0;
  for (int j = 0; j < 256; j += 64) {
    uint8_t sc, m;
    scale_min_k4(is, scales, &sc, &m);
    const float d1 = d * sc, m1 = dmin * m;
    scale_min_k4(is + 1, scales, &sc, &m);
    const float d2 = d * sc, m2 = dmin * m;
    for (int l = 0; l < 32; ++l) *y++ = d1 * (q[l] & 0xF) - m1;
    for (int l = 0; l < 32; ++l) *y++ = d2 * (q[l] >> 4) - m2;
    q += 32;
    is += 2;
  }
}

inline void decode_q6_k(const uint8_t* b, float* y) {
  const uint8_t* ql = b;
  const uint8_t* qh = b + 128;
  const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
  const float d = fp16(b + 208);
  for (int n = 0; n < 256; n += 128) {
    for (int l = 0; l < 32; ++l) {
      const int is = l / 16;
      const int q1 = static_cast<int8_t>((ql[l] & 0xF) | (((qh[l] >> 0) & 3) << 4)) - 32;
      const int q2 = static_cast<int8_t>((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32;
      const int q3 = static_cast<int8_t>((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
      const int q4 = static_cast<int8_t>((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
      y[l] = d * sc[is] * q1;
      y[l + 32] = d * sc[is + 2] * q2;
      y[l + 64] = d * sc[is + 4] * q3;
      y[l + 96] = d * sc[is + 6] * q4;
    }
    y += 128;
    ql += 64;
    qh += 32;
    sc += 8;
  }
}

void decode_row(int64_t type, const uint8_t* row, int64_t k, float* y) {
  const Layout L = layout(type);
  for (int64_t v = 0; v < k; v += L.values, row += L.bytes, y += L.values) {
    switch (type) {
      case Q8_0: decode_q8_0(row, y); break;
      case Q5_0: decode_q5_0(row, y); break;
      case Q4_K: decode_q4_k(row, y); break;
      case Q6_K: decode_q6_k(row, y); break;
    }
  }
}

// ---------------------------------------------------------------------------------------------------------------
// The product works in the code domain: per 32-value chunk of a weight row, the integer codes (exact in bf16) meet
// 32 bf16 activations in one vdpbf16ps, and the chunk's scale multiplies that partial sum (Q4_K's min enters as
// −dmin·m times the chunk's activation sum). The weights are the file's exactly (d·q, never rounded to bf16); the
// only roundings are the float32 sums'. Output (m, n) is the same sequence of operations for a row whatever M,
// the tiling or the threads.

#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__)
constexpr bool kFast = true;

struct Tables {
  __m512i q5, q4, q6lo, q6hi;  // bf16 bit patterns of the codes' values: i − 16, i, i − 32 (i < 32 | i ≥ 32)
  Tables() {
    alignas(64) uint16_t t[4][32];
    auto bf = [](float f) { uint32_t u; std::memcpy(&u, &f, 4); return static_cast<uint16_t>(u >> 16); };  // exact
    for (int i = 0; i < 32; ++i) {
      t[0][i] = bf(static_cast<float>(i - 16));
      t[1][i] = bf(static_cast<float>(i));
      t[2][i] = bf(static_cast<float>(i - 32));
      t[3][i] = bf(static_cast<float>(i));
    }
    q5 = _mm512_load_si512(t[0]);
    q4 = _mm512_load_si512(t[1]);
    q6lo = _mm512_load_si512(t[2]);
    q6hi = _mm512_load_si512(t[3]);
  }
};
const Tables& tables() {
  static const Tables t;
  return t;
}

struct Chunk {
  __m512bh q;   // 32 codes' values as bf16
  __m512 s;     // per-lane scale of the partial sums (lane i holds values 2i, 2i + 1)
  float off;    // Q4_K: dmin·m, subtracted times the chunk's activation sum
};

template <int64_t T>
inline Chunk chunk(const uint8_t* row, int64_t c) {
  Chunk out;
  out.off = 0.f;
  if constexpr (T == Q5_0) {
    const uint8_t* b = row + c * 22;
    uint32_t qh;
    std::memcpy(&qh, b + 2, 4);
    const __m128i qs = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 6)), m4 = _mm_set1_epi8(0x0F);
    __m256i v = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(qs, 4), m4), _mm_and_si128(qs, m4));
    v = _mm256_mask_add_epi8(v, static_cast<__mmask32>(qh), v, _mm256_set1_epi8(16));
    out.q = (__m512bh)_mm512_permutexvar_epi16(_mm512_cvtepu8_epi16(v), tables().q5);
    out.s = _mm512_set1_ps(fp16(b));
  } else if constexpr (T == Q8_0) {
    const uint8_t* b = row + c * 34;
    const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 2));
    const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(q)));
    const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(q, 1)));
    out.q = _mm512_cvtne2ps_pbh(hi, lo);  // integers of 8 bits: exact in bf16
    out.s = _mm512_set1_ps(fp16(b));
  } else if constexpr (T == Q4_K) {
    const uint8_t* b = row + (c / 8) * 144;
    const int j = static_cast<int>(c % 8);
    uint8_t sc, m;
    scale_min_k4(j, b + 4, &sc, &m);
    const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 16 + 32 * (j / 2)));
    const __m256i v = _mm256_and_si256(j % 2 ? _mm256_srli_epi16(q, 4) : q, _mm256_set1_epi8(0x0F));
    out.q = (__m512bh)_mm512_permutexvar_epi16(_mm512_cvtepu8_epi16(v), tables().q4);
    out.s = _mm512_set1_ps(fp16(b) * sc);  // exact: 11 + 6 bits
    out.off = fp16(b + 2) * m;             // exact
  } else {  // Q6_K: chunk j of a super-block is group r = j % 4 of half h = j / 4 (ggml's y[l + 32·r])
    const uint8_t* b = row + (c / 8) * 210;
    const int j = static_cast<int>(c % 8), h = j / 4, r = j % 4;
    const __m256i ql = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 64 * h + 32 * (r & 1)));
    const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 128 + 32 * h));
    const __m256i m4 = _mm256_set1_epi8(0x0F), m3 = _mm256_set1_epi8(3);
    const __m256i lo = _mm256_and_si256(r < 2 ? ql : _mm256_srli_epi16(ql, 4), m4);
    const __m256i hi = _mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(2 * r)), m3);
    const __m256i v = _mm256_or_si256(lo, _mm256_slli_epi16(hi, 4));  // 0..63; shifts stay inside each byte
    out.q = (__m512bh)_mm512_permutex2var_epi16(tables().q6lo, _mm512_cvtepu8_epi16(v), tables().q6hi);
    const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192) + 8 * h + 2 * r;
    const float d = fp16(b + 208);
    out.s = _mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(d * sc[0]), _mm512_set1_ps(d * sc[1]));  // exact
  }
  return out;
}

// MT rows of x against NT weight rows, every 32-value chunk: acc += s ⊙ dot32(x, codes); then a fixed lane sum.
template <int64_t T, int MT, int NT>
inline void tile(const uint16_t* x, int64_t k, const float* xsum, const uint8_t* w, int64_t row_bytes,
                 float* out, int64_t ldo) {
  __m512 acc[MT][NT];
  float off[MT][NT];
  for (int m = 0; m < MT; ++m)
    for (int n = 0; n < NT; ++n) acc[m][n] = _mm512_setzero_ps(), off[m][n] = 0.f;
  const int64_t chunks = k / 32, step = row_bytes / chunks;  // ≈ bytes per chunk (Q6_K: 26.25): where to prefetch
  for (int64_t c = 0; c < chunks; ++c) {
    Chunk ch[NT];
    for (int n = 0; n < NT; ++n) {
      // ask for the row's bytes a few lines ahead (the streams are interleaved)
      _mm_prefetch(reinterpret_cast<const char*>(w + n * row_bytes + c * step + kAhead), _MM_HINT_T0);
      ch[n] = chunk<T>(w + n * row_bytes, c);
    }
    for (int m = 0; m < MT; ++m) {
      const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + m * k + 32 * c);
      for (int n = 0; n < NT; ++n) {
        acc[m][n] = _mm512_fmadd_ps(_mm512_dpbf16_ps(_mm512_setzero_ps(), xv, ch[n].q), ch[n].s, acc[m][n]);
        if constexpr (T == Q4_K) off[m][n] = std::fma(-ch[n].off, xsum[m * chunks + c], off[m][n]);
      }
    }
  }
  for (int m = 0; m < MT; ++m)
    for (int n = 0; n < NT; ++n) out[m * ldo + n] = _mm512_reduce_add_ps(acc[m][n]) + off[m][n];
}
#else
constexpr bool kFast = false;

// Portable: the row decoded to float32 (exact), products with the bf16 activations summed in float32 lanes.
template <int64_t T, int MT, int NT>
inline void tile(const uint16_t* x, int64_t k, const float*, const uint8_t* w, int64_t row_bytes, float* out,
                 int64_t ldo) {
  std::vector<float> wf(k);
  for (int n = 0; n < NT; ++n) {
    decode_row(T, w + n * row_bytes, k, wf.data());
    for (int m = 0; m < MT; ++m) {
      float acc[kLanes] = {};
      for (int64_t kk = 0; kk < k; kk += kLanes)
        for (int i = 0; i < kLanes; ++i)
          acc[i] = std::fma(static_cast<float>(c10::BFloat16(x[m * k + kk + i], c10::BFloat16::from_bits())),
                            wf[kk + i], acc[i]);
      float s = 0.f;
      for (int i = 0; i < kLanes; ++i) s += acc[i];
      out[m * ldo + n] = s;
    }
  }
}
#endif

// Weight rows in blocks of 4 over the threads: block(n0, NT) computes outputs n0 .. n0+NT−1 of every row of x, so
// that a block's weights are decoded once for all of them. NT is a compile-time constant (the tiles unroll on it).
template <typename Block>
void by_row_blocks(int64_t n_rows, const Block& block) {
  constexpr int64_t NB = 4;
  at::parallel_for(0, (n_rows + NB - 1) / NB, 8, [&](int64_t begin, int64_t end) {
    for (int64_t n0 = begin * NB; n0 < std::min(end * NB, n_rows); n0 += NB) {
      switch (std::min(NB, n_rows - n0)) {
        case 4: block(n0, std::integral_constant<int, 4>{}); break;
        case 3: block(n0, std::integral_constant<int, 3>{}); break;
        case 2: block(n0, std::integral_constant<int, 2>{}); break;
        default: block(n0, std::integral_constant<int, 1>{}); break;
      }
    }
  });
}

template <int64_t T>
void mm(const uint16_t* x, int64_t m_rows, int64_t k, const uint8_t* w, int64_t n_rows, int64_t row_bytes,
        float* y) {
  const int64_t chunks = k / 32;
  std::vector<float> xsum;  // Q4_K's min term: each 32-value chunk's activation sum, in a fixed order
  if (T == Q4_K) {
    xsum.resize(m_rows * chunks);
    for (int64_t i = 0; i < m_rows * chunks; ++i) {
      float s = 0.f;
      for (int j = 0; j < 32; ++j) s += static_cast<float>(c10::BFloat16(x[32 * i + j], c10::BFloat16::from_bits()));
      xsum[i] = s;
    }
  }
  by_row_blocks(n_rows, [&](int64_t n0, auto ntc) {
    constexpr int NT = decltype(ntc)::value;
    const uint8_t* wr = w + n0 * row_bytes;
    int64_t m = 0;
    for (; m + 4 <= m_rows; m += 4)
      tile<T, 4, NT>(x + m * k, k, xsum.data() + m * chunks, wr, row_bytes, y + m * n_rows + n0, n_rows);
    for (; m < m_rows; ++m)
      tile<T, 1, NT>(x + m * k, k, xsum.data() + m * chunks, wr, row_bytes, y + m * n_rows + n0, n_rows);
  });
}

// ---------------------------------------------------------------------------------------------------------------
// The int8-activation product (`--weights gguf-q8`, llama.cpp's arithmetic): each activation row is rounded to int8
// per 32 values (scale amax/127 in float32, round half to even; ggml's q8_0 with a float scale) and meets the
// weight codes in integer dot products (vpdpbusd: 64 code·activation products per instruction, exact in int32);
// each 32-value chunk's int32 sum is scaled once by the weight's and the activation's scales. The weights are the
// file's exactly; the activations carry the int8 rounding. Per row the same sequence of operations whatever M, the
// tiling or the threads.

struct Act {
  int64_t m_rows, k, pairs;    // pairs: 64-value steps
  std::vector<int8_t> q;       // [M, K] codes
  std::vector<float> d;        // [M, pairs, 16] the scale of each int32 lane's chunk
  std::vector<float> csum;     // [M, K/32] each chunk's codes summed, times its scale (Q4_K's min term)
  std::vector<int32_t> corr;   // [M, pairs, 16] −offset·(each lane's 4 codes summed): the unsigned codes' offset
};

inline float bf16f(uint16_t h) { uint32_t u = static_cast<uint32_t>(h) << 16; float f; std::memcpy(&f, &u, 4); return f; }

// x (bf16) → int8 codes per 32 values; `offset` is the weight codes' offset (their value is code − offset). The
// calling thread's buffers are reused: every entry is written, and a fresh megabyte per call cost its page faults.
const Act& quantize_act(const uint16_t* x, int64_t m_rows, int64_t k, int offset) {
  thread_local Act buffers;
  Act& a = buffers;  // a plain reference: inside the parallel loop below, `buffers` would name each worker's own
  a.m_rows = m_rows, a.k = k, a.pairs = k / 64;
  a.q.resize(m_rows * k);
  a.d.resize(m_rows * a.pairs * 16);
  a.csum.resize(m_rows * (k / 32));
  a.corr.resize(m_rows * a.pairs * 16);
  // rows in parallel (a prompt block's 64 × 4,864 took 0.8 ms on one thread as scalar code: 7 % of a TTFT)
  at::parallel_for(0, m_rows, 8, [&](int64_t m_begin, int64_t m_end) {
  for (int64_t m = m_begin; m < m_end; ++m) {
    for (int64_t c = 0; c < k / 32; ++c) {
      const uint16_t* xc = x + m * k + 32 * c;
      int8_t* q = a.q.data() + m * k + 32 * c;
#if defined(__AVX512F__) && defined(__AVX512BW__)
      // the same float operations as the scalar branch, 16 lanes at a time: identical codes and scales
      const __m512 lo = _mm512_castsi512_ps(_mm512_slli_epi32(
          _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(xc))), 16));
      const __m512 hi = _mm512_castsi512_ps(_mm512_slli_epi32(
          _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(xc + 16))), 16));
      const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
      const float dx = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
      const __m512 vinv = _mm512_set1_ps(inv);
      constexpr int kNearest = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
      const __m512i qlo = _mm512_cvtps_epi32(_mm512_roundscale_ps(_mm512_mul_ps(lo, vinv), kNearest));
      const __m512i qhi = _mm512_cvtps_epi32(_mm512_roundscale_ps(_mm512_mul_ps(hi, vinv), kNearest));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtepi32_epi8(qlo));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16), _mm512_cvtepi32_epi8(qhi));
      const int chunk_sum = _mm512_reduce_add_epi32(_mm512_add_epi32(qlo, qhi));
#else
      float amax = 0.f;
      for (int i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(bf16f(xc[i])));
      const float dx = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
      int chunk_sum = 0;
      for (int i = 0; i < 32; ++i) chunk_sum += q[i] = static_cast<int8_t>(std::nearbyint(bf16f(xc[i]) * inv));
#endif
      a.csum[m * (k / 32) + c] = static_cast<float>(chunk_sum) * dx;
      // lane (c % 2)·8 + l of pair c / 2 covers codes 4l..4l+3 of this chunk
      const int64_t at = (m * a.pairs + c / 2) * 16 + (c % 2) * 8;
#if defined(__AVX512F__) && defined(__AVX512BW__)
      const __m256i fours = _mm256_madd_epi16(  // codes summed in pairs (int16), then the pairs in pairs (int32)
          _mm256_maddubs_epi16(_mm256_set1_epi8(1), _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q))),
          _mm256_set1_epi16(1));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(a.corr.data() + at),
                          _mm256_mullo_epi32(fours, _mm256_set1_epi32(-offset)));
      _mm256_storeu_ps(a.d.data() + at, _mm256_set1_ps(dx));
#else
      for (int l = 0; l < 8; ++l) {
        a.d[at + l] = dx;
        a.corr[at + l] = -offset * (q[4 * l] + q[4 * l + 1] + q[4 * l + 2] + q[4 * l + 3]);
      }
#endif
    }
  }
  });
  return a;
}

template <int64_t T>
constexpr int kOffset = T == Q8_0 ? 128 : T == Q5_0 ? 16 : T == Q6_K ? 32 : 0;

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
constexpr bool kFastQ8 = true;

struct Pair {
  __m512i u;   // 64 unsigned codes: chunks 2p, 2p + 1
  __m512 s;    // per-lane weight scale (lanes 0–7: chunk 2p, 8–15: chunk 2p + 1; Q6_K: per 16 values)
};

inline __m512i lane_ids() { return _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0); }
inline __m512i lanes_of_pair() { return _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0); }

// A K-quant super-block's scales as floats, once per 4 pairs: Q4_K lanes 0–7 d·sc_j, 8–15 dmin·m_j (the 6-bit
// fields of scale_min_k4 unpacked 4 at a time); Q6_K lane i d·sc_i.
template <int64_t T>
inline __m512 superblock_scales(const uint8_t* b) {
  if constexpr (T == Q4_K) {
    uint32_t w[3], v[4];
    std::memcpy(w, b + 4, 12);
    v[0] = w[0] & 0x3F3F3F3F;                                             // sc 0..3
    v[1] = (w[2] & 0x0F0F0F0F) | (((w[0] >> 6) & 0x03030303) << 4);       // sc 4..7
    v[2] = w[1] & 0x3F3F3F3F;                                             // m 0..3
    v[3] = ((w[2] >> 4) & 0x0F0F0F0F) | (((w[1] >> 6) & 0x03030303) << 4);  // m 4..7
    const __m512 q = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(v))));
    return _mm512_mul_ps(q, _mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(fp16(b)), _mm512_set1_ps(fp16(b + 2))));
  } else {
    const __m512 q = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 192))));
    return _mm512_mul_ps(q, _mm512_set1_ps(fp16(b + 208)));  // exact: 11 + 8 bits
  }
}

template <int64_t T>
inline Pair pair(const uint8_t* row, int64_t p, __m512 sb) {  // sb: the super-block's scales (K-quants)
  Pair out;
  const __m512i m4 = _mm512_set1_epi8(0x0F);
  if constexpr (T == Q8_0) {
    const uint8_t* b = row + 2 * p * 34;
    const __m512i v = _mm512_inserti64x4(
        _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 2))),
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 36)), 1);
    out.u = _mm512_xor_si512(v, _mm512_set1_epi8(static_cast<char>(0x80)));  // q + 128
    out.s = _mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(fp16(b)), _mm512_set1_ps(fp16(b + 34)));
  } else if constexpr (T == Q5_0) {
    const uint8_t* b = row + 2 * p * 22;
    const __m256i qs = _mm256_set_m128i(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 28)),
                                        _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 6)));
    // 128-bit lanes: [chunk 0 low nibbles | chunk 0 high | chunk 1 low | chunk 1 high] = values in order
    __m512i v = _mm512_permutexvar_epi64(_mm512_set_epi64(3, 2, 3, 2, 1, 0, 1, 0), _mm512_castsi256_si512(qs));
    v = _mm512_and_si512(_mm512_srlv_epi64(v, _mm512_set_epi64(4, 4, 0, 0, 4, 4, 0, 0)), m4);
    uint32_t h0, h1;
    std::memcpy(&h0, b + 2, 4);
    std::memcpy(&h1, b + 24, 4);
    const __mmask64 hi = static_cast<__mmask64>(h0) | (static_cast<__mmask64>(h1) << 32);  // bit i: value i's 5th bit
    out.u = _mm512_mask_add_epi8(v, hi, v, _mm512_set1_epi8(16));
    out.s = _mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(fp16(b)), _mm512_set1_ps(fp16(b + 22)));
  } else if constexpr (T == Q4_K) {  // pair g of a super-block: 32 bytes, low nibbles chunk 2g, high 2g + 1
    const int g = static_cast<int>(p % 4);
    const __m512i v = _mm512_broadcast_i64x4(
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + (p / 4) * 144 + 16 + 32 * g)));
    out.u = _mm512_and_si512(_mm512_srlv_epi64(v, _mm512_set_epi64(4, 4, 4, 4, 0, 0, 0, 0)), m4);
    out.s = _mm512_permutexvar_ps(_mm512_add_epi32(_mm512_set1_epi32(2 * g), lanes_of_pair()), sb);  // d·sc
  } else {  // Q6_K: chunks j, j + 1 (j = 2·(p % 4)) are groups r, r + 1 of half h: ql's 64 bytes at 64h, qh's 32
    const uint8_t* b = row + (p / 4) * 210;
    const int j = static_cast<int>(2 * (p % 4)), h = j / 4, r = j % 4;
    __m512i ql = _mm512_loadu_si512(b + 64 * h);
    ql = _mm512_and_si512(r == 0 ? ql : _mm512_srli_epi16(ql, 4), m4);
    __m512i qh = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 128 + 32 * h)));
    qh = _mm512_srlv_epi64(qh, _mm512_set_epi64(2 * r + 2, 2 * r + 2, 2 * r + 2, 2 * r + 2, 2 * r, 2 * r, 2 * r, 2 * r));
    qh = _mm512_slli_epi16(_mm512_and_si512(qh, _mm512_set1_epi8(3)), 4);  // ≤ 48: stays inside each byte
    out.u = _mm512_or_si512(ql, qh);
    // the pair's four 16-value scales (8h + 2r ..), each over 4 lanes
    const __m512i at = _mm512_add_epi32(_mm512_set1_epi32(8 * h + 2 * r), _mm512_srli_epi32(lane_ids(), 2));
    out.s = _mm512_permutexvar_ps(at, sb);
  }
  return out;
}

// Weight row `row`'s pair p. A K-quant super-block's scales (`sb`) are unpacked at its first pair and kept for
// the next three; Q4_K's dmin·m of the super-block's 8 chunks go to mins[2p ..] for the min term.
template <int64_t T>
inline Pair next_pair(const uint8_t* row, int64_t p, __m512& sb, float* mins) {
  if constexpr (T == Q4_K || T == Q6_K) {
    if (p % 4 == 0) {
      sb = superblock_scales<T>(row + (p / 4) * (T == Q4_K ? 144 : 210));
      if constexpr (T == Q4_K) _mm256_storeu_ps(mins + 2 * p, _mm512_extractf32x8_ps(sb, 1));
    }
  }
  return pair<T>(row, p, sb);
}

// NT weight rows' pairs decoded once ([pairs][NT]), for prompt blocks: every 4-row tile of x then reads them from
// L1/L2 instead of decoding again (the same Pair values, so the same results as the streaming tile).
template <int64_t T, int NT>
void predecode(const uint8_t* w, int64_t row_bytes, int64_t pairs, Pair* buf, float* mins) {
  __m512 sb[NT];
  for (int n = 0; n < NT; ++n) sb[n] = _mm512_setzero_ps();
  for (int64_t p = 0; p < pairs; ++p)
    for (int n = 0; n < NT; ++n) buf[p * NT + n] = next_pair<T>(w + n * row_bytes, p, sb[n], mins + n * 2 * pairs);
}

// Σ_c a[c]·b[c] over n floats, in 16 lanes then a fixed lane sum (the same order for every row)
inline float dot_lanes(const float* a, const float* b, int64_t n) {
  __m512 acc = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc);
  const __mmask16 tail = static_cast<__mmask16>((1u << (n - i)) - 1);
  acc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(tail, a + i), _mm512_maskz_loadu_ps(tail, b + i), acc);
  return _mm512_reduce_add_ps(acc);
}

// Q4_K's min term, −Σ_c dmin·m_c · dx_c·Σq_c, is one dot over the row's chunks per output (dot_lanes), after the
// main loop: the tile keeps no second set of accumulators. `mins` ([NT][K/32] dmin·m) comes with `pre` or is
// gathered here while streaming.

template <int64_t T, int MT, int NT>
inline void tile_q8(const Act& a, int64_t m0, const uint8_t* w, int64_t row_bytes, float* out, int64_t ldo,
                    const Pair* pre = nullptr, const float* pre_mins = nullptr) {
  __m512 acc[MT][NT];
  for (int m = 0; m < MT; ++m)
    for (int n = 0; n < NT; ++n) acc[m][n] = _mm512_setzero_ps();
  const int64_t chunks = a.k / 32;
  alignas(64) float own_mins[T == Q4_K ? NT : 1][T == Q4_K ? kMaxChunks : 1];
  const int64_t step = row_bytes / a.pairs;  // ≈ bytes per pair (Q6_K: 52.5): only where to prefetch
  __m512 sb[NT];
  for (int n = 0; n < NT; ++n) sb[n] = _mm512_setzero_ps();
  for (int64_t p = 0; p < a.pairs; ++p) {
    Pair pw[NT];
    for (int n = 0; n < NT; ++n) {
      if (pre) {
        pw[n] = pre[p * NT + n];
        continue;
      }
      _mm_prefetch(reinterpret_cast<const char*>(w + n * row_bytes + p * step + kAhead), _MM_HINT_T0);
      pw[n] = next_pair<T>(w + n * row_bytes, p, sb[n], own_mins[T == Q4_K ? n : 0]);
    }
    for (int m = 0; m < MT; ++m) {
      const int64_t row = m0 + m, at = (row * a.pairs + p) * 16;
      const __m512i xq = _mm512_loadu_si512(a.q.data() + row * a.k + 64 * p);
      const __m512 dx = _mm512_loadu_ps(a.d.data() + at);
      const __m512i c0 = T == Q4_K ? _mm512_setzero_si512() : _mm512_loadu_si512(a.corr.data() + at);
      for (int n = 0; n < NT; ++n) {
        const __m512 dot = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(c0, pw[n].u, xq));  // exact integers
        acc[m][n] = _mm512_fmadd_ps(dot, _mm512_mul_ps(pw[n].s, dx), acc[m][n]);
      }
    }
  }
  for (int m = 0; m < MT; ++m)
    for (int n = 0; n < NT; ++n) {
      float y = _mm512_reduce_add_ps(acc[m][n]);
      if constexpr (T == Q4_K)
        y -= dot_lanes(a.csum.data() + (m0 + m) * chunks, pre ? pre_mins + n * chunks : own_mins[n], chunks);
      out[m * ldo + n] = y;
    }
}
#else
constexpr bool kFastQ8 = false;

// Portable: per 32-value chunk, the exact integer dot of the decoded codes with the int8 activations, scaled.
template <int64_t T, int MT, int NT>
inline void tile_q8(const Act& a, int64_t m0, const uint8_t* w, int64_t row_bytes, float* out, int64_t ldo,
                    const void* = nullptr, const float* = nullptr) {
  std::vector<float> wf(a.k);
  for (int n = 0; n < NT; ++n) {
    decode_row(T, w + n * row_bytes, a.k, wf.data());
    for (int m = 0; m < MT; ++m) {
      const int64_t row = m0 + m;
      float y = 0.f;
      for (int64_t c = 0; c < a.k / 32; ++c) {
        float s = 0.f;
        for (int i = 0; i < 32; ++i) s += wf[32 * c + i] * a.q[row * a.k + 32 * c + i];
        y += s * a.d[(row * a.pairs + c / 2) * 16 + (c % 2) * 8];
      }
      out[m * ldo + n] = y;
    }
  }
}
#endif

template <int64_t T>
void mm_q8(const uint16_t* x, int64_t m_rows, int64_t k, const uint8_t* w, int64_t n_rows, int64_t row_bytes,
           float* y) {
  const Act& a = quantize_act(x, m_rows, k, kOffset<T>);
  constexpr int MT = 4;
  by_row_blocks(n_rows, [&](int64_t n0, auto ntc) {
    constexpr int NT = decltype(ntc)::value;
    const uint8_t* wr = w + n0 * row_bytes;
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
    const bool prompt = m_rows > MT;  // prompt blocks: the block's weights decoded once (predecode), then every tile
    thread_local std::vector<Pair> buf;
    thread_local std::vector<float> mins;
    if (prompt) {
      buf.resize(a.pairs * NT);
      mins.resize(T == Q4_K ? NT * k / 32 : 0);
      predecode<T, NT>(wr, row_bytes, a.pairs, buf.data(), mins.data());
    }
    const Pair* pre = prompt ? buf.data() : nullptr;
    const float* mn = prompt ? mins.data() : nullptr;
#else
    const void* pre = nullptr;
    const float* mn = nullptr;
#endif
    int64_t m = 0;
    for (; m + MT <= m_rows; m += MT) tile_q8<T, MT, NT>(a, m, wr, row_bytes, y + m * n_rows + n0, n_rows, pre, mn);
    for (; m < m_rows; ++m) tile_q8<T, 1, NT>(a, m, wr, row_bytes, y + m * n_rows + n0, n_rows, pre, mn);
  });
}

}  // namespace

// y + bias (float32), rounded once to bf16 when asked: the linear's output without a round trip through Python.
// Rows in parallel; the rounding is round-to-nearest-even, as c10::BFloat16's (AVX-512 BF16's vcvtneps2bf16 where
// compiled: the same bits for every finite value).
torch::Tensor finish(float* yp, int64_t m_rows, int64_t n_rows, const c10::optional<torch::Tensor>& bias,
                     const torch::TensorOptions& options, bool bf16_out) {
  const float* b = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == torch::kFloat32 && bias->is_contiguous() && bias->numel() == n_rows,
                "bias: contiguous float32 [N]");
    b = bias->data_ptr<float>();
  }
  auto out = torch::empty({m_rows, n_rows}, options.dtype(bf16_out ? torch::kBFloat16 : torch::kFloat32));
  const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(n_rows, 1));
  if (!bf16_out) {
    float* op = out.data_ptr<float>();
    at::parallel_for(0, m_rows, grain, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin * n_rows; i < end * n_rows; ++i) op[i] = yp[i] + (b ? b[i % n_rows] : 0.f);
    });
    return out;
  }
  at::BFloat16* op = out.data_ptr<at::BFloat16>();
  at::parallel_for(0, m_rows, grain, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      const float* row = yp + m * n_rows;
      at::BFloat16* dst = op + m * n_rows;
      int64_t n = 0;
#if defined(__AVX512F__) && defined(__AVX512BF16__)
      for (; n + 16 <= n_rows; n += 16) {
        __m512 v = _mm512_loadu_ps(row + n);
        if (b) v = _mm512_add_ps(v, _mm512_loadu_ps(b + n));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + n), (__m256i)_mm512_cvtneps_pbh(v));
      }
#endif
      for (; n < n_rows; ++n) dst[n] = at::BFloat16(row[n] + (b ? b[n] : 0.f));
    }
  });
  return out;
}

// y[M, N] (float32, or bf16 with bf16_out) = x[M, K] (bf16, contiguous) · W[N, K]ᵀ (+ bias), W given as GGUF
// blocks: uint8 [N, K/values·bytes]; with bf16 activations (mm) or rounded to int8 per 32 values (mm_q8).
torch::Tensor product(const torch::Tensor& x, const torch::Tensor& w, int64_t type,
                      const c10::optional<torch::Tensor>& bias, bool bf16_out, bool int8_act) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kBFloat16 && x.is_contiguous(), "x: contiguous bf16 [M, K]");
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == torch::kUInt8 && w.is_contiguous(), "w: contiguous uint8 [N, bytes]");
  const Layout L = layout(type);
  const int64_t m_rows = x.size(0), k = x.size(1), n_rows = w.size(0);
  TORCH_CHECK(k % L.values == 0 && w.size(1) == k / L.values * L.bytes, "w's row bytes do not match K = ", k);
  if (int8_act) {
    TORCH_CHECK(k % 64 == 0, "the int8-activation kernels take K a multiple of 64, not ", k);
    TORCH_CHECK(type != Q4_K || k / 32 <= kMaxChunks, "the int8-activation Q4_K kernel takes K ≤ 32768, not ", k);
  }
  // the float32 products land in the calling thread's reused buffer (a fresh one per call cost its page faults)
  thread_local std::vector<float> buffer;
  buffer.resize(m_rows * n_rows);
  float* yp = buffer.data();
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  const uint8_t* wp = w.data_ptr<uint8_t>();
  auto run = [&](auto t) {
    constexpr int64_t T = decltype(t)::value;
    int8_act ? mm_q8<T>(xp, m_rows, k, wp, n_rows, w.size(1), yp) : mm<T>(xp, m_rows, k, wp, n_rows, w.size(1), yp);
  };
  switch (type) {
    case Q8_0: run(std::integral_constant<int64_t, Q8_0>{}); break;
    case Q5_0: run(std::integral_constant<int64_t, Q5_0>{}); break;
    case Q4_K: run(std::integral_constant<int64_t, Q4_K>{}); break;
    case Q6_K: run(std::integral_constant<int64_t, Q6_K>{}); break;
  }
  return finish(yp, m_rows, n_rows, bias, x.options(), bf16_out);
}

torch::Tensor gguf_mm(torch::Tensor x, torch::Tensor w, int64_t type, c10::optional<torch::Tensor> bias,
                      bool bf16_out) {
  return product(x, w, type, bias, bf16_out, false);
}

torch::Tensor gguf_mm_q8(torch::Tensor x, torch::Tensor w, int64_t type, c10::optional<torch::Tensor> bias,
                         bool bf16_out) {
  return product(x, w, type, bias, bf16_out, true);
}

// W's rows decoded to float32 [N, K], as ggml and gguf-py decode them (the tests' reference).
torch::Tensor gguf_dequantize(torch::Tensor w, int64_t type, int64_t k) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == torch::kUInt8 && w.is_contiguous(), "w: contiguous uint8 [N, bytes]");
  const Layout L = layout(type);
  TORCH_CHECK(k % L.values == 0 && w.size(1) == k / L.values * L.bytes, "w's row bytes do not match K = ", k);
  auto y = torch::empty({w.size(0), k}, torch::kFloat32);
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  const int64_t row_bytes = w.size(1);
  at::parallel_for(0, w.size(0), 16, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) decode_row(type, wp + n * row_bytes, k, yp + n * k);
  });
  return y;
}

// The decoder's small ops in one pass each (a decode step made ~3,000 aten calls a token outside the products:
// RMSNorm alone ~7 per norm × 49, ≈ 4 ms of a 44 ms step at 2 threads, measured by switching it off).

// Σ v² over a row in the order ATen's float sum takes (SumKernel.cpp's cascade_sum on a contiguous row, with
// `width`-float vectors: 8 on this project's AVX-512 machine, measured; fused_norm.py checks): vectors in 4 interleaved chains
// summed in a 4-level cascade of `step`-row blocks, leftover vectors into chain 0, the chains folded in order,
// then the scalar tail and the lanes left to right. The same floats in the same order give the same sum.
float aten_sum_of_squares(const uint16_t* row, int64_t n, int width) {
  constexpr int kChains = 4, kLevels = 4, kMaxWidth = 16;
  if (n < width) width = 1;  // ATen's scalar loop: the same cascade over single floats
  const int64_t vectors = n / width, rows = vectors / kChains;
  int64_t log2 = 1;  // ATen's CeilLog2 (1 for rows ≤ 2)
  while (rows > 2 && (int64_t(1) << log2) < rows) ++log2;
  const int64_t power = std::max<int64_t>(4, log2 / kLevels), step = int64_t(1) << power, mask = step - 1;
  float acc[kLevels][kChains][kMaxWidth] = {};
  auto add_vector = [&](float* into, int64_t v) {
    for (int l = 0; l < width; ++l) {
      const float x = bf16f(row[v * width + l]);
      into[l] += x * x;
    }
  };
  int64_t i = 0;
  for (; i + step <= rows;) {
    for (int64_t j = 0; j < step; ++j, ++i)
      for (int c = 0; c < kChains; ++c) add_vector(acc[0][c], i * kChains + c);
    for (int j = 1; j < kLevels; ++j) {
      for (int c = 0; c < kChains; ++c)
        for (int l = 0; l < width; ++l) {
          acc[j][c][l] += acc[j - 1][c][l];
          acc[j - 1][c][l] = 0.f;
        }
      if ((i & (mask << (j * power))) != 0) break;
    }
  }
  for (; i < rows; ++i)
    for (int c = 0; c < kChains; ++c) add_vector(acc[0][c], i * kChains + c);
  for (int j = 1; j < kLevels; ++j)
    for (int c = 0; c < kChains; ++c)
      for (int l = 0; l < width; ++l) acc[0][c][l] += acc[j][c][l];
  for (int64_t v = rows * kChains; v < vectors; ++v) add_vector(acc[0][0], v);
  for (int c = 1; c < kChains; ++c)
    for (int l = 0; l < width; ++l) acc[0][0][l] += acc[0][c][l];
  float sum = 0.f;
  for (int64_t k = vectors * width; k < n; ++k) sum += bf16f(row[k]) * bf16f(row[k]);
  for (int l = 0; l < width; ++l) sum += acc[0][0][l];
  return sum;
}

// Each bf16 row's Σx² (float32) in the order above: how fused_norm.py finds the width that reproduces ATen's sum.
torch::Tensor sum_of_squares(torch::Tensor x, int64_t width) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kBFloat16 && x.is_contiguous(), "x: contiguous bf16 [rows, n]");
  TORCH_CHECK(width == 8 || width == 16, "width: 8 or 16, not ", width);
  auto out = torch::empty({x.size(0)}, x.options().dtype(torch::kFloat32));
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  for (int64_t r = 0; r < x.size(0); ++r)
    out.data_ptr<float>()[r] = aten_sum_of_squares(xp + r * x.size(1), x.size(1), static_cast<int>(width));
  return out;
}

// RMSNorm of bf16 rows as transformers' Llama/Qwen2/Mistral norm computes it, in one call: y = bf16(w · bf16(x·r)),
// r = 1/sqrt(Σx²/n + eps) in float32, every operation as the aten ops round it and the sum in their order (above),
// so y is theirs bit for bit where ATen's float vectors are `width` wide.
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps, int64_t width) {
  TORCH_CHECK(x.scalar_type() == torch::kBFloat16 && x.is_contiguous(), "x: contiguous bf16");
  TORCH_CHECK(width == 8 || width == 16, "width: ATen's float vector width, 8 or 16, not ", width);
  const int64_t n = x.size(-1), rows = x.numel() / std::max<int64_t>(n, 1);
  TORCH_CHECK(w.scalar_type() == torch::kBFloat16 && w.is_contiguous() && w.numel() == n, "w: contiguous bf16 [", n, "]");
  auto out = torch::empty_like(x);
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
  at::BFloat16* op = out.data_ptr<at::BFloat16>();
  const float e = static_cast<float>(eps);
  at::parallel_for(0, rows, std::max<int64_t>(1, 65536 / std::max<int64_t>(n, 1)), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const uint16_t* row = xp + r * n;
      const float scale = 1.f / std::sqrt(aten_sum_of_squares(row, n, static_cast<int>(width)) /
                                          static_cast<float>(n) + e);
      for (int64_t j = 0; j < n; ++j) {
        const float normed = static_cast<float>(at::BFloat16(bf16f(row[j]) * scale));
        op[r * n + j] = at::BFloat16(bf16f(wp[j]) * normed);
      }
    }
  });
  return out;
}

// x[T, H, d] (bf16, rows of d contiguous) rotated in place as transformers' apply_rotary_pos_emb rotates it:
// x·cos + rotate_half(x)·sin with cos/sin [T, d] (bf16), each product and the sum rounded to bf16 as the model's
// bf16 ops round them, so the result is theirs bit for bit.
void rotary_(torch::Tensor x, torch::Tensor cos, torch::Tensor sin) {
  TORCH_CHECK(x.dim() == 3 && x.scalar_type() == torch::kBFloat16 && x.stride(2) == 1, "x: bf16 [T, H, d], d contiguous");
  const int64_t t = x.size(0), heads = x.size(1), d = x.size(2), half = d / 2;
  TORCH_CHECK(d % 2 == 0 && d <= 1024, "head size must be even and at most 1024, not ", d);
  for (const auto& c : {cos, sin})
    TORCH_CHECK(c.scalar_type() == torch::kBFloat16 && c.is_contiguous() && c.numel() == t * d, "cos/sin: contiguous bf16 [T, d]");
  auto bf = [](float v) { return static_cast<float>(at::BFloat16(v)); };
  uint16_t* xp = reinterpret_cast<uint16_t*>(x.data_ptr<at::BFloat16>());
  const uint16_t* cp = reinterpret_cast<const uint16_t*>(cos.data_ptr<at::BFloat16>());
  const uint16_t* sp = reinterpret_cast<const uint16_t*>(sin.data_ptr<at::BFloat16>());
  for (int64_t i = 0; i < t; ++i)
    for (int64_t h = 0; h < heads; ++h) {
      uint16_t* p = xp + i * x.stride(0) + h * x.stride(1);
      float v[1024];
      for (int64_t j = 0; j < d; ++j) v[j] = bf16f(p[j]);
      for (int64_t j = 0; j < d; ++j) {
        const float rot = j < half ? -v[j + half] : v[j - half];
        const float y = bf(bf(v[j] * bf16f(cp[i * d + j])) + bf(rot * bf16f(sp[i * d + j])));
        const at::BFloat16 b(y);
        std::memcpy(p + j, &b, 2);
      }
    }
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("fast_path", [] { return kFast; }, "whether the AVX-512 BF16 kernels were compiled in");
  m.def("fast_path_q8", [] { return kFastQ8; }, "whether the AVX-512 VNNI kernels were compiled in");
  m.def("gguf_mm_q8", &gguf_mm_q8, "as gguf_mm with x rounded to int8 per 32 values (llama.cpp's arithmetic)",
        py::arg("x"), py::arg("w"), py::arg("type"), py::arg("bias") = py::none(), py::arg("bf16_out") = false);
  m.def("gguf_mm", &gguf_mm, "x[M,K] bf16 · W[N,K]ᵀ (+ bias) with W in GGUF blocks, float32 out (or bf16)",
        py::arg("x"), py::arg("w"), py::arg("type"), py::arg("bias") = py::none(), py::arg("bf16_out") = false);
  m.def("gguf_dequantize", &gguf_dequantize, "GGUF blocks → float32 rows");
  m.def("sum_of_squares", &sum_of_squares, "each bf16 row's sum of squares in ATen's order for a vector width");
  m.def("rms_norm", &rms_norm, "RMSNorm of bf16 rows (transformers' formula and ATen's sum order, one call)");
  m.def("rotary_", &rotary_, "rotary embedding of bf16 [T, H, d] in place (transformers' formula, bit-equal)");
}

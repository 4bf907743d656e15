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
// per 32 values (scale amax/127 in float32, round half to even; ggml's q8_0 with a float scale); each weight
// scale-group's integer dot with them is exact in int32 (vpdpbusd: 64 code·activation products an instruction) and
// meets its float scales once: acc = fma(float(I), s·dx, acc), group after group (Q4_K then takes its min term,
// acc = acc − dmin·m · Σx̂). Per output the same sequence of operations whatever M, the tiling or the threads, on
// every machine (the portable loop below performs the same operations), so a row's result never depends on the
// rows computed with it: a spliced prefix equals the full prefill, a batch of clients each one alone.
//
// The weights are repacked once at load (gguf_pack_q8) into panels of 16 rows, the layout of a VNNI GEMM: per
// 32-value chunk, each group of 4 values of the 16 rows is one 64-byte vector (row r's 4 codes at bytes 4r..4r+3),
// so one vpdpbusd adds 4 products to each of 16 outputs, and a chunk's integer sums need no horizontal reduction.
// The codes keep the file's bits (Q5_0 4 + 1 bit plane, Q6_K 4 + 2 bit planes, Q4_K 4, Q8_0 8) and the file's
// scales (fp16, 6- and 8-bit sub-scales): a panel holds the file's bytes rearranged (Q4_K +2.8 %: its 6-bit sub-scales
// take a byte each; `panel_bytes`).
//
// Chunk record per panel (codes unsigned, value = code − offset):
//   Q8_0 544 B: 8 × 64 B codes (code + 128), 16 fp16 d
//   Q5_0 352 B: 4 × 64 B nibbles (vector v: low nibble group 2v, high nibble group 2v + 1), 8 × 8 B bit-4 masks,
//               16 fp16 d
//   Q4_K 288 B: 4 × 64 B nibbles, 16 B sc, 16 B m (6-bit);  after the chunks, per super-block 16 fp16 d, 16 dmin
//   Q6_K 416 B: 4 × 64 B nibbles, 8 × 8 B bit-4 masks, 8 × 8 B bit-5 masks, 2 × 16 int8 sc (values 0–15, 16–31);
//               after the chunks, per super-block 16 fp16 d

constexpr int64_t kPanel = 16;

template <int64_t T>
constexpr int64_t kRecord = T == Q8_0 ? 544 : T == Q5_0 ? 352 : T == Q4_K ? 288 : 416;
template <int64_t T>
constexpr int64_t kSuper = T == Q4_K ? 64 : T == Q6_K ? 32 : 0;  // per 256 values
template <int64_t T>
constexpr int kOffset = T == Q8_0 ? 128 : T == Q5_0 ? 16 : T == Q6_K ? 32 : 0;
template <int64_t T>
constexpr int kGroup = T == Q6_K ? 16 : 32;  // values per weight scale

template <int64_t T>
inline int64_t panel_bytes(int64_t k) { return k / 32 * kRecord<T> + k / 256 * kSuper<T>; }

// Byte offsets inside a chunk record (the layout above), named once for pack, plain_chunk, codes and scales.
constexpr int kBit4 = 256;      // Q5_0, Q6_K: bit 4 of the codes, 8 B per group of 4 values (vector v: 16v, 16v + 8)
constexpr int kBit5 = 320;      // Q6_K: bit 5, the same layout
constexpr int kSubScale = 256;  // Q4_K: each row's 6-bit sc
constexpr int kSubMin = 272;    // Q4_K: each row's 6-bit m
constexpr int kScaleLo = 384;   // Q6_K: each row's int8 sc of values 0–15
constexpr int kScaleHi = 400;   // Q6_K: of values 16–31
template <int64_t T>
constexpr int64_t kChunkScale = kRecord<T> - 32;  // Q8_0, Q5_0: each row's fp16 d, at the record's end
constexpr int kSuperMin = 32;  // Q4_K's super-block record: each row's fp16 dmin, after its 16 fp16 d

template <typename F>
void by_type(int64_t type, const F& f) {
  switch (type) {
    case Q8_0: f(std::integral_constant<int64_t, Q8_0>{}); break;
    case Q5_0: f(std::integral_constant<int64_t, Q5_0>{}); break;
    case Q4_K: f(std::integral_constant<int64_t, Q4_K>{}); break;
    case Q6_K: f(std::integral_constant<int64_t, Q6_K>{}); break;
    default: TORCH_CHECK(false, "unsupported GGUF block type ", type);
  }
}

// One file row's codes (unsigned, value = code − offset) and scale fields, as ggml's dequantize_row_* reads them.
struct RowCodes {
  std::vector<uint8_t> u;         // [K]
  std::vector<uint16_t> d;        // Q8_0/Q5_0: per chunk; K-quants: per super-block (fp16 bits)
  std::vector<uint16_t> dmin;     // Q4_K: per super-block
  std::vector<int16_t> sc, m;     // Q4_K: per chunk (6-bit sc, m); Q6_K: per 16 values (int8 sc)
};

inline uint16_t u16(const uint8_t* p) { uint16_t h; std::memcpy(&h, p, 2); return h; }

template <int64_t T>
void row_codes(const uint8_t* row, int64_t k, RowCodes& r) {
  r.u.assign(k, 0);
  r.d.clear(), r.dmin.clear(), r.sc.clear(), r.m.clear();
  if constexpr (T == Q8_0) {
    for (int64_t c = 0; c < k / 32; ++c) {
      const uint8_t* b = row + c * 34;
      r.d.push_back(u16(b));
      for (int l = 0; l < 32; ++l) r.u[32 * c + l] = static_cast<uint8_t>(b[2 + l] ^ 0x80);
    }
  } else if constexpr (T == Q5_0) {
    for (int64_t c = 0; c < k / 32; ++c) {
      const uint8_t* b = row + c * 22;
      r.d.push_back(u16(b));
      uint32_t qh;
      std::memcpy(&qh, b + 2, 4);
      for (int l = 0; l < 32; ++l)
        r.u[32 * c + l] = static_cast<uint8_t>(((l < 16 ? b[6 + l] : b[6 + l - 16] >> 4) & 0x0F) | (((qh >> l) & 1) << 4));
    }
  } else if constexpr (T == Q4_K) {
    for (int64_t s = 0; s < k / 256; ++s) {
      const uint8_t* b = row + s * 144;
      r.d.push_back(u16(b)), r.dmin.push_back(u16(b + 2));
      for (int j = 0; j < 8; ++j) {
        uint8_t sc, m;
        scale_min_k4(j, b + 4, &sc, &m);
        r.sc.push_back(sc), r.m.push_back(m);
        for (int l = 0; l < 32; ++l) r.u[256 * s + 32 * j + l] = (b[16 + 32 * (j / 2) + l] >> (4 * (j % 2))) & 0x0F;
      }
    }
  } else {
    for (int64_t s = 0; s < k / 256; ++s) {
      const uint8_t* b = row + s * 210;
      r.d.push_back(u16(b + 208));
      for (int j = 0; j < 8; ++j) {  // chunk j: group r of half h (ggml's y[128h + 32r + l])
        const int h = j / 4, g = j % 4;
        for (int l = 0; l < 32; ++l) {
          const int lo = (b[64 * h + l + 32 * (g & 1)] >> (g < 2 ? 0 : 4)) & 0x0F;
          const int hi = (b[128 + 32 * h + l] >> (2 * g)) & 3;
          r.u[256 * s + 32 * j + l] = static_cast<uint8_t>(lo | (hi << 4));
        }
        const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192) + 8 * h + 2 * g;
        r.sc.push_back(sc[0]), r.sc.push_back(sc[1]);
      }
    }
  }
}

// File rows [N, row bytes] → panels [ceil(N/16), panel_bytes]; rows past N are zeros (scale 0).
template <int64_t T>
torch::Tensor pack(const uint8_t* w, int64_t n_rows, int64_t row_bytes, int64_t k) {
  const int64_t panels = (n_rows + kPanel - 1) / kPanel, pb = panel_bytes<T>(k), chunks = k / 32;
  auto out = torch::zeros({panels, pb}, torch::kUInt8);
  uint8_t* o = out.data_ptr<uint8_t>();
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    RowCodes r;
    for (int64_t p = begin; p < end; ++p)
      for (int64_t i = 0; i < kPanel && p * kPanel + i < n_rows; ++i) {
        row_codes<T>(w + (p * kPanel + i) * row_bytes, k, r);
        uint8_t* panel = o + p * pb;
        for (int64_t c = 0; c < chunks; ++c) {
          uint8_t* rec = panel + c * kRecord<T>;
          const uint8_t* u = r.u.data() + 32 * c;
          for (int q = 0; q < 8; ++q)
            for (int l = 0; l < 4; ++l) {
              const uint8_t code = u[4 * q + l];
              const int at = 4 * static_cast<int>(i) + l;  // byte of row i's l-th code in a 64-byte vector
              if constexpr (T == Q8_0) {
                rec[64 * q + at] = code;
              } else {
                rec[64 * (q / 2) + at] |= static_cast<uint8_t>((code & 0x0F) << (4 * (q % 2)));
                if constexpr (T == Q5_0 || T == Q6_K) rec[kBit4 + 8 * q + at / 8] |= ((code >> 4) & 1) << (at % 8);
                if constexpr (T == Q6_K) rec[kBit5 + 8 * q + at / 8] |= ((code >> 5) & 1) << (at % 8);
              }
            }
          if constexpr (T == Q8_0 || T == Q5_0) std::memcpy(rec + kChunkScale<T> + 2 * i, &r.d[c], 2);
          if constexpr (T == Q4_K) rec[kSubScale + i] = static_cast<uint8_t>(r.sc[c]), rec[kSubMin + i] = static_cast<uint8_t>(r.m[c]);
          if constexpr (T == Q6_K) {
            rec[kScaleLo + i] = static_cast<uint8_t>(r.sc[2 * c]);
            rec[kScaleHi + i] = static_cast<uint8_t>(r.sc[2 * c + 1]);
          }
        }
        for (int64_t s = 0; s < k / 256 && kSuper<T> > 0; ++s) {
          uint8_t* sb = panel + chunks * kRecord<T> + s * kSuper<T>;
          std::memcpy(sb + 2 * i, &r.d[s], 2);
          if constexpr (T == Q4_K) std::memcpy(sb + kSuperMin + 2 * i, &r.dmin[s], 2);
        }
      }
  });
  return out;
}

// A panel's chunk as plain numbers (the portable product and the unpacking read it): codes [32][16 rows] and,
// per row, the scales as the fast path forms them (s = d·sc exactly, a second s for Q6_K's values 16–31, mn = dmin·m).
struct Plain {
  uint8_t u[32][kPanel];
  float sa[kPanel], sb[kPanel], mn[kPanel];
};

template <int64_t T>
void plain_chunk(const uint8_t* panel, int64_t c, int64_t chunks, Plain& P) {
  const uint8_t* rec = panel + c * kRecord<T>;
  for (int q = 0; q < 8; ++q)
    for (int at = 0; at < 64; ++at) {
      int code;
      if constexpr (T == Q8_0) {
        code = rec[64 * q + at];
      } else {
        code = (rec[64 * (q / 2) + at] >> (4 * (q % 2))) & 0x0F;
        if constexpr (T == Q5_0 || T == Q6_K) code |= ((rec[kBit4 + 8 * q + at / 8] >> (at % 8)) & 1) << 4;
        if constexpr (T == Q6_K) code |= ((rec[kBit5 + 8 * q + at / 8] >> (at % 8)) & 1) << 5;
      }
      P.u[4 * q + at % 4][at / 4] = static_cast<uint8_t>(code);
    }
  const uint8_t* sb = panel + chunks * kRecord<T> + (c / 8) * kSuper<T>;
  for (int i = 0; i < kPanel; ++i) {
    P.sb[i] = P.mn[i] = 0.f;
    if constexpr (T == Q8_0 || T == Q5_0) {
      P.sa[i] = fp16(rec + kChunkScale<T> + 2 * i);
    } else if constexpr (T == Q4_K) {
      P.sa[i] = fp16(sb + 2 * i) * static_cast<float>(rec[kSubScale + i]);
      P.mn[i] = fp16(sb + kSuperMin + 2 * i) * static_cast<float>(rec[kSubMin + i]);
    } else {
      P.sa[i] = fp16(sb + 2 * i) * static_cast<float>(static_cast<int8_t>(rec[kScaleLo + i]));
      P.sb[i] = fp16(sb + 2 * i) * static_cast<float>(static_cast<int8_t>(rec[kScaleHi + i]));
    }
  }
}

// Panels → the file's weights, float32 [N, K], as ggml computes them (the tests check it against gguf-py).
template <int64_t T>
torch::Tensor unpack(const uint8_t* panels, int64_t n_rows, int64_t k) {
  auto y = torch::empty({n_rows, k}, torch::kFloat32);
  float* yp = y.data_ptr<float>();
  const int64_t chunks = k / 32, pb = panel_bytes<T>(k);
  Plain P;
  for (int64_t p = 0; p * kPanel < n_rows; ++p)
    for (int64_t c = 0; c < chunks; ++c) {
      plain_chunk<T>(panels + p * pb, c, chunks, P);
      for (int i = 0; i < kPanel && p * kPanel + i < n_rows; ++i)
        for (int l = 0; l < 32; ++l) {
          const float q = static_cast<float>(static_cast<int>(P.u[l][i]) - kOffset<T>);
          float v = (T == Q6_K && l >= 16 ? P.sb[i] : P.sa[i]) * q;  // ggml: (d·sc)·q, then − dmin·m
          if constexpr (T == Q4_K) v -= P.mn[i];
          yp[(p * kPanel + i) * k + 32 * c + l] = v;
        }
    }
  return y;
}

struct Act {
  int64_t k, chunks;
  std::vector<int8_t> q;       // [M, K] codes
  std::vector<float> dx;       // [M, K/32] scales
  std::vector<float> csum;     // [M, K/32] each chunk's codes summed, times its scale (Q4_K's min term)
  std::vector<int32_t> corr;   // [M, K/G] −offset·(the codes of each weight scale-group summed): the offset's share
};

inline float bf16f(uint16_t h) { uint32_t u = static_cast<uint32_t>(h) << 16; float f; std::memcpy(&f, &u, 4); return f; }

// x (bf16) → int8 codes per 32 values; `offset`, `group`: the weight codes' offset and scale group. The calling
// thread's buffers are reused: every entry is written, and a fresh megabyte per call cost its page faults.
const Act& quantize_act(const uint16_t* x, int64_t m_rows, int64_t k, int offset, int group) {
  thread_local Act buffers;
  Act& a = buffers;  // a plain reference: inside the parallel loop below, `buffers` would name each worker's own
  a.k = k, a.chunks = k / 32;
  a.q.resize(m_rows * k);
  a.dx.resize(m_rows * a.chunks);
  a.csum.resize(m_rows * a.chunks);
  a.corr.resize(m_rows * (k / group));
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
      const int sum_lo = _mm512_reduce_add_epi32(qlo), sum_hi = _mm512_reduce_add_epi32(qhi);
#else
      float amax = 0.f;
      for (int i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(bf16f(xc[i])));
      const float dx = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
      int sum_lo = 0, sum_hi = 0;
      for (int i = 0; i < 32; ++i) {
        q[i] = static_cast<int8_t>(std::nearbyint(bf16f(xc[i]) * inv));
        (i < 16 ? sum_lo : sum_hi) += q[i];
      }
#endif
      a.dx[m * a.chunks + c] = dx;
      a.csum[m * a.chunks + c] = static_cast<float>(sum_lo + sum_hi) * dx;
      if (group == 16) {
        a.corr[m * (k / 16) + 2 * c] = -offset * sum_lo;
        a.corr[m * (k / 16) + 2 * c + 1] = -offset * sum_hi;
      } else {
        a.corr[m * a.chunks + c] = -offset * (sum_lo + sum_hi);
      }
    }
  }
  });
  return a;
}

// The tile loops over at most this many rows of x per weight panel pass (a prompt block re-reads the panel's
// decoded codes from cache for each).
constexpr int kTileRows = 4;

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
constexpr bool kFastQ8 = true;

// A panel's chunk decoded once for a prompt block: 8 × 64 B codes and the float scales, reused by every 4-row tile.
struct Decoded {
  __m512i u[8];
  __m512 sa, sb, mn;
};

inline __m512 scale_row(const uint8_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
inline __m512 u8_floats(const uint8_t* p) { return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))); }
inline __m512 i8_floats(const uint8_t* p) { return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))); }

inline __mmask64 mask_at(const uint8_t* p) { uint64_t m; std::memcpy(&m, p, 8); return m; }

// Codes of groups 2v, 2v + 1 of chunk record `rec`.
template <int64_t T>
inline void codes(const uint8_t* rec, int v, __m512i& u0, __m512i& u1) {
  if constexpr (T == Q8_0) {
    u0 = _mm512_loadu_si512(rec + 128 * v);
    u1 = _mm512_loadu_si512(rec + 128 * v + 64);
  } else {
    const __m512i nib = _mm512_loadu_si512(rec + 64 * v), m4 = _mm512_set1_epi8(0x0F);
    u0 = _mm512_and_si512(nib, m4);
    u1 = _mm512_and_si512(_mm512_srli_epi16(nib, 4), m4);
    if constexpr (T == Q5_0 || T == Q6_K) {
      const __m512i b4 = _mm512_set1_epi8(16);
      u0 = _mm512_mask_add_epi8(u0, mask_at(rec + kBit4 + 16 * v), u0, b4);
      u1 = _mm512_mask_add_epi8(u1, mask_at(rec + kBit4 + 16 * v + 8), u1, b4);
    }
    if constexpr (T == Q6_K) {
      const __m512i b5 = _mm512_set1_epi8(32);
      u0 = _mm512_mask_add_epi8(u0, mask_at(rec + kBit5 + 16 * v), u0, b5);
      u1 = _mm512_mask_add_epi8(u1, mask_at(rec + kBit5 + 16 * v + 8), u1, b5);
    }
  }
}

// The chunk's scales for the 16 rows: sa (values 0–15, and 16–31 but for Q6_K), sb (Q6_K's 16–31), mn (Q4_K).
template <int64_t T>
inline void scales(const uint8_t* panel, int64_t c, int64_t chunks, __m512& sa, __m512& sb, __m512& mn) {
  const uint8_t* rec = panel + c * kRecord<T>;
  const uint8_t* super = panel + chunks * kRecord<T> + (c / 8) * kSuper<T>;
  if constexpr (T == Q8_0 || T == Q5_0) {
    sa = scale_row(rec + kChunkScale<T>);
  } else if constexpr (T == Q4_K) {
    sa = _mm512_mul_ps(scale_row(super), u8_floats(rec + kSubScale));  // exact: 11 + 6 bits
    mn = _mm512_mul_ps(scale_row(super + kSuperMin), u8_floats(rec + kSubMin));
  } else {
    const __m512 d = scale_row(super);
    sa = _mm512_mul_ps(d, i8_floats(rec + kScaleLo));  // exact: 11 + 8 bits
    sb = _mm512_mul_ps(d, i8_floats(rec + kScaleHi));
  }
}

template <int64_t T>
inline void decode(const uint8_t* panel, int64_t c, int64_t chunks, Decoded& D) {
  const uint8_t* rec = panel + c * kRecord<T>;
  for (int v = 0; v < 4; ++v) codes<T>(rec, v, D.u[2 * v], D.u[2 * v + 1]);
  scales<T>(panel, c, chunks, D.sa, D.sb, D.mn);
}

// MT rows of x (from m0) against NV panels (16·NV outputs from n0), every chunk: the scale-groups' exact integer
// dots (vpdpbusd, seeded with the offset's share), then acc = fma(float(I), s·dx, acc) per group. `pre`: the
// panels' chunks decoded ([chunk][NV]) for a prompt block, else the codes stream from the panels.
template <int64_t T, int MT, int NV, bool PRE>
inline void tile_q8(const Act& a, int64_t m0, const uint8_t* panels, int64_t pb, const Decoded* pre, float* y,
                    int64_t n0, int64_t n_rows) {
  constexpr int H = T == Q6_K ? 2 : 1, VH = 4 / H;  // scale groups per chunk, 64 B vectors per group
  const int64_t chunks = a.chunks, k = a.k, groups = k / kGroup<T>;
  __m512 facc[MT][NV];
  for (int m = 0; m < MT; ++m)
    for (int v = 0; v < NV; ++v) facc[m][v] = _mm512_setzero_ps();
  for (int64_t c = 0; c < chunks; ++c) {
    __m512 sa[NV], sb[NV], mn[NV];
    for (int v = 0; v < NV; ++v) {
      if constexpr (PRE) {
        sa[v] = pre[c * NV + v].sa, sb[v] = pre[c * NV + v].sb, mn[v] = pre[c * NV + v].mn;
      } else {
        _mm_prefetch(reinterpret_cast<const char*>(panels + v * pb + c * kRecord<T> + kAhead), _MM_HINT_T0);
        scales<T>(panels + v * pb, c, chunks, sa[v], sb[v], mn[v]);
      }
    }
    for (int h = 0; h < H; ++h) {
      __m512i acc[MT][NV];
      for (int m = 0; m < MT; ++m) {
        const __m512i seed = _mm512_set1_epi32(a.corr[(m0 + m) * groups + c * H + h]);
        for (int v = 0; v < NV; ++v) acc[m][v] = seed;
      }
      for (int w = h * VH; w < (h + 1) * VH; ++w) {
        __m512i u0[NV], u1[NV];
        for (int v = 0; v < NV; ++v) {
          if constexpr (PRE) {
            u0[v] = pre[c * NV + v].u[2 * w], u1[v] = pre[c * NV + v].u[2 * w + 1];
          } else {
            codes<T>(panels + v * pb + c * kRecord<T>, w, u0[v], u1[v]);
          }
        }
        for (int m = 0; m < MT; ++m) {
          int32_t x0, x1;
          std::memcpy(&x0, a.q.data() + (m0 + m) * k + 32 * c + 8 * w, 4);
          std::memcpy(&x1, a.q.data() + (m0 + m) * k + 32 * c + 8 * w + 4, 4);
          const __m512i b0 = _mm512_set1_epi32(x0), b1 = _mm512_set1_epi32(x1);
          for (int v = 0; v < NV; ++v) {
            acc[m][v] = _mm512_dpbusd_epi32(acc[m][v], u0[v], b0);  // exact integers
            acc[m][v] = _mm512_dpbusd_epi32(acc[m][v], u1[v], b1);
          }
        }
      }
      for (int m = 0; m < MT; ++m) {
        const __m512 dx = _mm512_set1_ps(a.dx[(m0 + m) * chunks + c]);
        for (int v = 0; v < NV; ++v)
          facc[m][v] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[m][v]), _mm512_mul_ps(h ? sb[v] : sa[v], dx), facc[m][v]);
      }
    }
    if constexpr (T == Q4_K)
      for (int m = 0; m < MT; ++m) {
        const __m512 cs = _mm512_set1_ps(a.csum[(m0 + m) * chunks + c]);
        for (int v = 0; v < NV; ++v) facc[m][v] = _mm512_fnmadd_ps(mn[v], cs, facc[m][v]);
      }
  }
  for (int m = 0; m < MT; ++m)
    for (int v = 0; v < NV; ++v) {
      const int64_t first = n0 + kPanel * v, left = n_rows - first;
      if (left <= 0) continue;
      const __mmask16 keep = left >= kPanel ? 0xFFFF : static_cast<__mmask16>((1u << left) - 1);
      _mm512_mask_storeu_ps(y + (m0 + m) * n_rows + first, keep, facc[m][v]);
    }
}

template <int64_t T>
void mm_q8(const uint16_t* x, int64_t m_rows, int64_t k, const uint8_t* panels, int64_t n_rows, float* y) {
  if (m_rows == 0) return;  // the streaming tile below always takes at least one row
  const Act& a = quantize_act(x, m_rows, k, kOffset<T>, kGroup<T>);
  const int64_t pb = panel_bytes<T>(k), n_panels = (n_rows + kPanel - 1) / kPanel;
  // a decode step (M ≤ 2) streams 4 panels at once; larger blocks decode 2 panels' chunks once for every 4-row tile
  const bool stream = m_rows <= 2;
  const int64_t nv = stream ? 4 : 2, tiles = (n_panels + nv - 1) / nv;
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    thread_local std::vector<Decoded> buf;
    for (int64_t t = begin; t < end; ++t) {
      const int64_t p0 = t * nv, count = std::min(nv, n_panels - p0), n0 = p0 * kPanel;
      const uint8_t* first = panels + p0 * pb;
      auto run = [&](auto mt, auto nvc, const Decoded* pre, int64_t m0) {
        constexpr int MT = decltype(mt)::value, NV = decltype(nvc)::value;
        if (pre) tile_q8<T, MT, NV, true>(a, m0, first, pb, pre, y, n0, n_rows);
        else tile_q8<T, MT, NV, false>(a, m0, first, pb, pre, y, n0, n_rows);
      };
      using I1 = std::integral_constant<int, 1>;
      using I2 = std::integral_constant<int, 2>;
      using I3 = std::integral_constant<int, 3>;
      using I4 = std::integral_constant<int, 4>;
      if (stream) {
        auto rows = [&](auto nvc) { m_rows == 2 ? run(I2{}, nvc, nullptr, 0) : run(I1{}, nvc, nullptr, 0); };
        switch (count) {
          case 4: rows(I4{}); break;
          case 3: rows(I3{}); break;
          case 2: rows(I2{}); break;
          default: rows(I1{}); break;
        }
        continue;
      }
      buf.resize(a.chunks * 2);
      auto block = [&](auto nvc) {
        constexpr int NV = decltype(nvc)::value;
        for (int64_t c = 0; c < a.chunks; ++c)
          for (int v = 0; v < NV; ++v) decode<T>(first + v * pb, c, a.chunks, buf[c * NV + v]);
        int64_t m = 0;
        for (; m + kTileRows <= m_rows; m += kTileRows) run(I4{}, nvc, buf.data(), m);
        switch (m_rows - m) {
          case 3: run(I3{}, nvc, buf.data(), m); break;
          case 2: run(I2{}, nvc, buf.data(), m); break;
          case 1: run(I1{}, nvc, buf.data(), m); break;
          default: break;
        }
      };
      count == 2 ? block(I2{}) : block(I1{});
    }
  });
}
#else
constexpr bool kFastQ8 = false;

// Portable: the same operations in the same order, one output at a time.
template <int64_t T>
void mm_q8(const uint16_t* x, int64_t m_rows, int64_t k, const uint8_t* panels, int64_t n_rows, float* y) {
  const Act& a = quantize_act(x, m_rows, k, kOffset<T>, kGroup<T>);
  const int64_t pb = panel_bytes<T>(k), chunks = a.chunks, groups = k / kGroup<T>;
  constexpr int H = T == Q6_K ? 2 : 1;
  at::parallel_for(0, (n_rows + kPanel - 1) / kPanel, 1, [&](int64_t begin, int64_t end) {
    Plain P;
    std::vector<float> acc(m_rows * kPanel);
    for (int64_t p = begin; p < end; ++p) {
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t c = 0; c < chunks; ++c) {
        plain_chunk<T>(panels + p * pb, c, chunks, P);
        for (int64_t m = 0; m < m_rows; ++m)
          for (int i = 0; i < kPanel; ++i) {
            float& f = acc[m * kPanel + i];
            for (int h = 0; h < H; ++h) {
              int32_t dot = a.corr[m * groups + c * H + h];
              for (int l = 32 / H * h; l < 32 / H * (h + 1); ++l) dot += P.u[l][i] * a.q[m * k + 32 * c + l];
              const float s = (h ? P.sb[i] : P.sa[i]) * a.dx[m * chunks + c];
              f = std::fma(static_cast<float>(dot), s, f);
            }
            if constexpr (T == Q4_K) f = std::fma(-P.mn[i], a.csum[m * chunks + c], f);
          }
      }
      for (int64_t m = 0; m < m_rows; ++m)
        for (int i = 0; i < kPanel && p * kPanel + i < n_rows; ++i) y[m * n_rows + p * kPanel + i] = acc[m * kPanel + i];
    }
  });
}
#endif
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

// The float32 products land in the calling thread's reused buffer (a fresh one per call cost its page faults).
float* scratch(int64_t size) {
  thread_local std::vector<float> buffer;
  buffer.resize(size);
  return buffer.data();
}

// y[M, N] (float32, or bf16 with bf16_out) = x[M, K] (bf16, contiguous) · W[N, K]ᵀ (+ bias), W given as GGUF
// blocks: uint8 [N, K/values·bytes], with bf16 activations.
torch::Tensor gguf_mm(torch::Tensor x, torch::Tensor w, int64_t type, c10::optional<torch::Tensor> bias,
                      bool bf16_out) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kBFloat16 && x.is_contiguous(), "x: contiguous bf16 [M, K]");
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == torch::kUInt8 && w.is_contiguous(), "w: contiguous uint8 [N, bytes]");
  const Layout L = layout(type);
  const int64_t m_rows = x.size(0), k = x.size(1), n_rows = w.size(0);
  TORCH_CHECK(k % L.values == 0 && w.size(1) == k / L.values * L.bytes, "w's row bytes do not match K = ", k);
  float* yp = scratch(m_rows * n_rows);
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  by_type(type, [&](auto t) { mm<decltype(t)::value>(xp, m_rows, k, w.data_ptr<uint8_t>(), n_rows, w.size(1), yp); });
  return finish(yp, m_rows, n_rows, bias, x.options(), bf16_out);
}

void check_panels(const torch::Tensor& panels, int64_t type, int64_t k, int64_t n_rows) {
  TORCH_CHECK(panels.dim() == 2 && panels.scalar_type() == torch::kUInt8 && panels.is_contiguous(),
              "panels: contiguous uint8 [panels, bytes]");
  TORCH_CHECK(k % 64 == 0, "the int8-activation kernels take K a multiple of 64, not ", k);
  by_type(type, [&](auto t) {
    TORCH_CHECK(panels.size(1) == panel_bytes<decltype(t)::value>(k) && panels.size(0) == (n_rows + kPanel - 1) / kPanel,
                "panels of ", panels.size(1), " bytes × ", panels.size(0), " do not hold ", n_rows, " rows of K = ", k);
  });
}

// The same with x rounded to int8 per 32 values (llama.cpp's arithmetic), W as gguf_pack_q8's panels of N rows.
torch::Tensor gguf_mm_q8(torch::Tensor x, torch::Tensor panels, int64_t type, int64_t n_rows,
                         c10::optional<torch::Tensor> bias, bool bf16_out) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kBFloat16 && x.is_contiguous(), "x: contiguous bf16 [M, K]");
  const int64_t m_rows = x.size(0), k = x.size(1);
  check_panels(panels, type, k, n_rows);
  float* yp = scratch(m_rows * n_rows);
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  by_type(type, [&](auto t) { mm_q8<decltype(t)::value>(xp, m_rows, k, panels.data_ptr<uint8_t>(), n_rows, yp); });
  return finish(yp, m_rows, n_rows, bias, x.options(), bf16_out);
}

// GGUF blocks [N, row bytes] → the int8 product's panels (once at load).
torch::Tensor gguf_pack_q8(torch::Tensor w, int64_t type, int64_t k) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == torch::kUInt8 && w.is_contiguous(), "w: contiguous uint8 [N, bytes]");
  const Layout L = layout(type);
  TORCH_CHECK(k % 64 == 0 && w.size(1) == k / L.values * L.bytes, "w's row bytes do not match K = ", k,
              " (a multiple of 64)");
  torch::Tensor out;
  by_type(type, [&](auto t) { out = pack<decltype(t)::value>(w.data_ptr<uint8_t>(), w.size(0), w.size(1), k); });
  return out;
}

// Panels → the file's weights, float32 [N, K] (as gguf_dequantize of the blocks they came from).
torch::Tensor gguf_unpack_q8(torch::Tensor panels, int64_t type, int64_t k, int64_t n_rows) {
  check_panels(panels, type, k, n_rows);
  torch::Tensor out;
  by_type(type, [&](auto t) { out = unpack<decltype(t)::value>(panels.data_ptr<uint8_t>(), n_rows, k); });
  return out;
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
  m.attr("panel_rows") = kPanel;
  m.def("fast_path", [] { return kFast; }, "whether the AVX-512 BF16 kernels were compiled in");
  m.def("fast_path_q8", [] { return kFastQ8; }, "whether the AVX-512 VNNI kernels were compiled in");
  m.def("gguf_mm_q8", &gguf_mm_q8, "as gguf_mm with x rounded to int8 per 32 values (llama.cpp's arithmetic), W as panels",
        py::arg("x"), py::arg("panels"), py::arg("type"), py::arg("n"), py::arg("bias") = py::none(),
        py::arg("bf16_out") = false);
  m.def("gguf_pack_q8", &gguf_pack_q8, "GGUF blocks [N, bytes] → gguf_mm_q8's panels of 16 rows",
        py::arg("w"), py::arg("type"), py::arg("k"));
  m.def("gguf_unpack_q8", &gguf_unpack_q8, "panels → the file's weights, float32 [N, K]",
        py::arg("panels"), py::arg("type"), py::arg("k"), py::arg("n"));
  m.def("gguf_mm", &gguf_mm, "x[M,K] bf16 · W[N,K]ᵀ (+ bias) with W in GGUF blocks, float32 out (or bf16)",
        py::arg("x"), py::arg("w"), py::arg("type"), py::arg("bias") = py::none(), py::arg("bf16_out") = false);
  m.def("gguf_dequantize", &gguf_dequantize, "GGUF blocks → float32 rows");
  m.def("sum_of_squares", &sum_of_squares, "each bf16 row's sum of squares in ATen's order for a vector width");
  m.def("rms_norm", &rms_norm, "RMSNorm of bf16 rows (transformers' formula and ATen's sum order, one call)");
  m.def("rotary_", &rotary_, "rotary embedding of bf16 [T, H, d] in place (transformers' formula, bit-equal)");
}

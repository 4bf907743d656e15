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

constexpr int64_t kAhead = 768;  // bytes

// MT rows of x against NT weight rows, every 32-value chunk: acc += s ⊙ dot32(x, codes); then a fixed lane sum.
template <int64_t T, int MT, int NT>
inline void tile(const uint16_t* x, int64_t k, const float* xsum, const uint8_t* w, int64_t row_bytes,
                 float* out, int64_t ldo) {
  __m512 acc[MT][NT];
  float off[MT][NT];
  for (int m = 0; m < MT; ++m)
    for (int n = 0; n < NT; ++n) acc[m][n] = _mm512_setzero_ps(), off[m][n] = 0.f;
  const int64_t chunks = k / 32;
  for (int64_t c = 0; c < chunks; ++c) {
    Chunk ch[NT];
    for (int n = 0; n < NT; ++n) {
      // decode is memory-bound: ask for the row's bytes a few lines ahead (the streams are interleaved)
      _mm_prefetch(reinterpret_cast<const char*>(w + n * row_bytes + c * row_bytes / chunks + kAhead), _MM_HINT_T0);
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

template <int64_t T, int NT>
void rows_block(const uint16_t* x, int64_t m_rows, int64_t k, const float* xsum, const uint8_t* w,
                int64_t row_bytes, float* out, int64_t ldo) {
  const int64_t chunks = k / 32;
  int64_t m = 0;
  for (; m + 4 <= m_rows; m += 4) tile<T, 4, NT>(x + m * k, k, xsum + m * chunks, w, row_bytes, out + m * ldo, ldo);
  for (; m < m_rows; ++m) tile<T, 1, NT>(x + m * k, k, xsum + m * chunks, w, row_bytes, out + m * ldo, ldo);
}

template <int64_t T>
void mm(const uint16_t* x, int64_t m_rows, int64_t k, const uint8_t* w, int64_t n_rows, int64_t row_bytes,
        float* y) {
  std::vector<float> xsum;  // Q4_K's min term: each 32-value chunk's activation sum, in a fixed order
  if (T == Q4_K) {
    xsum.resize(m_rows * (k / 32));
    for (int64_t i = 0; i < m_rows * (k / 32); ++i) {
      float s = 0.f;
      for (int j = 0; j < 32; ++j) s += static_cast<float>(c10::BFloat16(x[32 * i + j], c10::BFloat16::from_bits()));
      xsum[i] = s;
    }
  }
  constexpr int64_t NB = 4;  // weight rows per tile: their chunks are decoded once for every row of x in a tile
  at::parallel_for(0, (n_rows + NB - 1) / NB, 8, [&](int64_t begin, int64_t end) {
    for (int64_t blk = begin; blk < end; ++blk) {
      const int64_t n0 = blk * NB, nt = std::min(NB, n_rows - n0);
      const uint8_t* wr = w + n0 * row_bytes;
      switch (nt) {
        case 4: rows_block<T, 4>(x, m_rows, k, xsum.data(), wr, row_bytes, y + n0, n_rows); break;
        case 3: rows_block<T, 3>(x, m_rows, k, xsum.data(), wr, row_bytes, y + n0, n_rows); break;
        case 2: rows_block<T, 2>(x, m_rows, k, xsum.data(), wr, row_bytes, y + n0, n_rows); break;
        default: rows_block<T, 1>(x, m_rows, k, xsum.data(), wr, row_bytes, y + n0, n_rows); break;
      }
    }
  });
}

}  // namespace

// y[M, N] (float32) = x[M, K] (bf16, contiguous) · W[N, K]ᵀ, W given as GGUF blocks: uint8 [N, K/values·bytes].
torch::Tensor gguf_mm(torch::Tensor x, torch::Tensor w, int64_t type) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kBFloat16 && x.is_contiguous(), "x: contiguous bf16 [M, K]");
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == torch::kUInt8 && w.is_contiguous(), "w: contiguous uint8 [N, bytes]");
  const Layout L = layout(type);
  const int64_t m_rows = x.size(0), k = x.size(1), n_rows = w.size(0);
  TORCH_CHECK(k % L.values == 0 && w.size(1) == k / L.values * L.bytes, "w's row bytes do not match K = ", k);
  auto y = torch::empty({m_rows, n_rows}, x.options().dtype(torch::kFloat32));
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  switch (type) {
    case Q8_0: mm<Q8_0>(xp, m_rows, k, wp, n_rows, w.size(1), yp); break;
    case Q5_0: mm<Q5_0>(xp, m_rows, k, wp, n_rows, w.size(1), yp); break;
    case Q4_K: mm<Q4_K>(xp, m_rows, k, wp, n_rows, w.size(1), yp); break;
    case Q6_K: mm<Q6_K>(xp, m_rows, k, wp, n_rows, w.size(1), yp); break;
  }
  return y;
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

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("fast_path", [] { return kFast; }, "whether the AVX-512 BF16 kernels were compiled in");
  m.def("gguf_mm", &gguf_mm, "x[M,K] bf16 · W[N,K]ᵀ with W in GGUF blocks, float32 out");
  m.def("gguf_dequantize", &gguf_dequantize, "GGUF blocks → float32 rows");
}

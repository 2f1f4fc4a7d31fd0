"""
Packed ternary inference: y = (x_q @ W_q^T) * gamma / s, 2-bit weights, int8 activations.

Why it can be fast. Generating one token (batch 1) reads every weight once and does 2
flops with it, so decoding runs at the speed weights stream from memory. A ternary
weight needs 2 bits, so a byte holds four: a 4096x4096 matrix is 4 MiB instead of 64 MiB
in fp32. 16x fewer bytes can be up to 16x faster, if unpacking costs less than it saves.

Why it can be exact. Activations are quantized per token to int8 (absmax, as in
bitlinear.py), each product is int8 x {-1, 0, 1} and the sums are int32, so every
implementation returns the *same integers*; the fp scale gamma / s is applied once, last.

The trick that makes unpacking almost free: a weight is stored as its code c = q + 1 in
{0, 1, 2}, which a shift and a mask turn into an unsigned byte. Then

    sum_k q_k x_k = sum_k c_k x_k - sum_k x_k

an unsigned x signed byte dot product (x86's VNNI instruction vpdpbusd) minus one sum per
token, with no per-weight subtraction. On NVIDIA GPUs, dp4a multiplies signed bytes, so
we subtract 1 from four codes at once (__vsub4) and use the weights directly.

Four implementations of one integer op, (M, K) int8 x packed (N, K) -> (M, N) int32, each
also a torch.library.custom_op with a fake (shape-only) implementation, so that a model
using them still compiles with torch.compile:
  reference  unpack to numbers and matmul: the definition, slow, used by the tests
  compile    the same math as one expression that torch.compile fuses into a single loop
  cpp        a C++ CPU kernel (AVX-512 VNNI or AVX2, chosen at run time, all cores)
  cuda       a CUDA GEMV for decode (dp4a), int8 tensor cores (torch._int_mm) for prefill
`ternary_linear` picks the fastest one that builds and says once when it falls back.
The same op takes a gamma per weight row (matrices fused into one, engine.fuse), one per
row and block of 256 columns (weight_scale='block', as llama.cpp's TQ2_0 scales), and
int8 rows times int16 activations (an LM head in 4x fewer bytes than fp32, pack_int8).

For training, the same numbers faster for bitlinear.py: int8 matmuls on int8 units, the
activation quantizer fused on CUDA, and values reused while the weights hold still.
"""
import contextlib
import functools
import os
import platform
import shutil
import threading
import warnings

import torch
import torch.nn.functional as F
from torch.utils.weak import WeakIdKeyDictionary

# ---------------------------------------------------------------- packing
# HF layout, transformers' offline BitNet format (export/import): W_q (N, K) -> uint8
# (R, K), R = ceil(N/4); byte (r, c) holds rows r, r+R, r+2R, r+3R of column c:
#
#     bits  7 6 | 5 4  | 3 2 | 1 0
#     row   3R+r| 2R+r | R+r |  r    (value = q + 1; rows past N are padded with q = 0)
#
# Kernel layout, packed along K: each row is cut into blocks of 256 columns, and block b
# is 64 bytes whose byte j holds columns 256b + j, +64, +128, +192:
#
#              byte j:  0    1    2   ...  63
#     bits 1:0  col  256b + 0    1    2   ...  63
#     bits 3:2  col  256b + 64   65   66  ... 127
#     bits 5:4  col  256b + 128 129  130  ... 191
#     bits 7:6  col  256b + 192 193  194  ... 255
#
# So a 64-byte load shifted right by 2i and masked with 3 in every byte is the codes of
# 64 *consecutive* columns, one AVX-512 register to multiply with 64 consecutive
# activations; a 32-bit word gives 4 consecutive columns per bit pair, one dp4a. K is
# padded with zero weights to a multiple of 256, so no kernel handles a ragged tail.
BLOCK = 256


def pack_hf(w_q):
    """(N, K) in {-1, 0, 1} -> uint8 (ceil(N/4), K), the HF layout."""
    N, R = w_q.shape[0], -(-w_q.shape[0] // 4)
    codes = F.pad(w_q.to(torch.int8) + 1, (0, 0, 0, 4 * R - N), value=1)
    c = codes.to(torch.uint8).view(4, R, -1)
    return c[0] | c[1] << 2 | c[2] << 4 | c[3] << 6


def unpack_hf(packed, N):
    """uint8 (ceil(N/4), K) in the HF layout -> int8 (N, K) in {-1, 0, 1}."""
    return torch.cat([packed >> 2 * i & 3 for i in range(4)])[:N].to(torch.int8) - 1


def pack(w_q):
    """(N, K) in {-1, 0, 1} -> uint8 (N, Kp/4), the kernel layout,
    Kp = K rounded up to 256."""
    N, K = w_q.shape
    codes = F.pad(w_q.to(torch.int8) + 1, (0, -K % BLOCK), value=1)
    c = codes.to(torch.uint8).view(N, -1, 4, 64)
    return (c[:, :, 0] | c[:, :, 1] << 2 | c[:, :, 2] << 4 | c[:, :, 3] << 6).view(N, -1)


def unpack(packed, K):
    """uint8 (N, Kp/4) in the kernel layout -> int8 (N, K) in {-1, 0, 1}."""
    shifts = torch.arange(0, 8, 2, dtype=torch.uint8, device=packed.device).view(1, 1, 4, 1)
    codes = packed.view(packed.shape[0], -1, 1, 64) >> shifts & 3  # (N, Kp/256, 4, 64)
    return codes.view(packed.shape[0], -1)[:, :K].to(torch.int8) - 1


# int8 rows are padded to whole steps of the C++ loop (64 columns), not to ternary blocks:
# SmolLM2's head, 576 columns, would read a third more bytes at 768
INT8_STEP = 64


def pack_int8(w):
    """An fp matrix (N, K) -> int8 rows (N, Kp), Kp = K rounded up to 64, and a scale
    per row (N,), absmax. For a matrix that is not ternary, an LM head: 4x fewer bytes
    than fp32. The ops below take such weights too, with per-token int16 activations."""
    scale = w.float().abs().amax(dim=1).clamp(min=1e-8) / 127
    w_q = (w.float() / scale[:, None]).round().to(torch.int8)
    return F.pad(w_q, (0, -w.shape[1] % INT8_STEP)), scale


def quantize(x, levels=127):
    """absmax per token, as in bitlinear.activation_quant: int8 x_q (M, K) and the scale
    s (M, 1); int16 with levels=32767."""
    # max|x| in one pass; exact in any dtype, so rounding it to fp32 after changes nothing
    amax = torch.linalg.vector_norm(x, float('inf'), dim=-1, keepdim=True).float()
    s = levels / amax.clamp(min=1e-5)
    x_q = (x.float() * s).round_().clamp_(-levels - 1, levels)
    return x_q.to(torch.int8 if levels < 128 else torch.int16), s


# ------------------------------------------------------- 1. reference, 2. torch.compile
# Each implementation is the whole op: float activations (M, K), packed weights, gamma
# (1,), one per weight row (N,; fused matrices, weight_scale='row'), or one per row and
# block of 256 columns (N, K/256; weight_scale='block') -> float (M, N). Quantize, integer
# matmul, then one fp multiply: float(acc) * (gamma / s), acc exact in fp32 (below 2^24).
# With block scales, each block's product times its gamma, the blocks added first to last,
# then divided by s: one division per output, as one per block would cost the C++ kernel
# as much as its integer work.

def _linear(mm, x, w, gamma):
    # int8 rows (an LM head) take int16 activations; sums exact in fp64
    if w.dtype == torch.int8:
        x_q, s = quantize(x, 32767)
        acc = x_q.double() @ w[:, :x.shape[1]].double().T
        return acc.float() * (gamma.float() / s)
    x_q, s = quantize(x)
    if gamma.dim() < 2:
        return mm(x_q, w).float() * (gamma.float() / s)
    y = None
    for b in range(gamma.shape[1]):  # block b: columns 256b.., bytes 64b.. of each row
        acc = mm(x_q[:, BLOCK * b:BLOCK * (b + 1)], w[:, BLOCK // 4 * b:BLOCK // 4 * (b + 1)])
        part = acc.float() * gamma[:, b].float()
        y = part if y is None else y + part
    return y / s


def _mm_double(x_q, w):
    # float64 holds every partial sum (at most 128 * K) exactly,
    # on any device, in any order
    return x_q.double() @ unpack(w, x_q.shape[1]).double().T


def linear_reference(x: torch.Tensor, w: torch.Tensor,
                     gamma: torch.Tensor) -> torch.Tensor:
    return _linear(_mm_double, x, w, gamma)


def _mm_fused(x_q, w):
    # broadcast (M, 1, K) x (1, N, K) and sum over K: inductor makes this one loop nest
    # that unpacks each weight in registers, so the (M, N, K) product is never in memory
    w_q = unpack(w, x_q.shape[1]).int()
    return (x_q.int()[:, None, :] * w_q[None]).sum(-1, dtype=torch.int32)


@functools.cache
def _compiled():
    return torch.compile(functools.partial(_linear, _mm_fused), dynamic=True)


def linear_compile(x: torch.Tensor, w: torch.Tensor,
                   gamma: torch.Tensor) -> torch.Tensor:
    return _compiled()(x, w, gamma)


# ---------------------------------------------------------------- 3. C++ CPU kernel
# The work is tiled in registers. Prefill (4 tokens or more): tiles of
# MR = 4 tokens x NR = 4 weight rows, so each unpacked weight register is used 4 times
# and each activation load 4 times. Decode (1-3 tokens) is a stream of weights from
# memory, and what makes it fast is reading that stream in order: one weight row at a
# time (NR = 1), with U = 4 blocks in flight on their own accumulators so that the
# multiply unit never waits on its previous result. (Four rows side by side are four
# streams 1 KiB apart: measured, that halves the rate at which memory delivers.) Threads
# split the weight rows; each streams contiguous memory.
CPP = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <chrono>
#include <numeric>
#define VNNI __attribute__((target("avx512f,avx512bw,avx512vnni")))
#define AVX2 __attribute__((target("avx2")))

// one 256-column block: x is MR rows of Kp int8, w NR rows of Kp/4 bytes
template <int MR, int NR>
VNNI inline void block_vnni(const int8_t* x, const uint8_t* w, int64_t Kp, int64_t k,
                            __m512i (&a)[MR][NR]) {
  __m512i v[NR];
  for (int n = 0; n < NR; n++) v[n] = _mm512_loadu_si512(w + n * Kp / 4 + k / 4);
  for (int i = 0; i < 4; i++) {  // bit pair i holds columns k + 64i .. k + 64i + 63
    __m512i c[NR];
    for (int n = 0; n < NR; n++)
      c[n] = _mm512_and_si512(_mm512_srli_epi16(v[n], 2 * i), _mm512_set1_epi8(3));
    for (int m = 0; m < MR; m++) {
      __m512i xv = _mm512_loadu_si512(x + m * Kp + k + 64 * i);
      // 64 unsigned codes x 64 signed activations, each 4 products summed into an int32
      for (int n = 0; n < NR; n++) a[m][n] = _mm512_dpbusd_epi32(a[m][n], c[n], xv);
    }
  }
}

// the same block without VNNI: two 32-byte halves per 64-byte block. u8 x s8 pairs are
// summed to int16 (at most 2 * 2 * 128: no saturation). One token (decode) adds the four
// bit pairs' int16 sums before widening them to int32 (at most 4 * 512 a lane): a third
// fewer instructions per weight; a tile of tokens widens each, short of registers for that
template <int MR, int NR>
AVX2 inline void block_avx2(const int8_t* x, const uint8_t* w, int64_t Kp, int64_t k,
                            __m256i (&a)[MR][NR]) {
  if constexpr (MR == 1) {
    for (int h = 0; h < 64; h += 32) {
      __m256i v[NR], p[NR];
      for (int n = 0; n < NR; n++) {
        v[n] = _mm256_loadu_si256((const __m256i*)(w + n * Kp / 4 + k / 4 + h));
        p[n] = _mm256_setzero_si256();
      }
      for (int i = 0; i < 4; i++) {
        __m256i xv = _mm256_loadu_si256((const __m256i*)(x + k + 64 * i + h));
        for (int n = 0; n < NR; n++) {
          __m256i c = _mm256_and_si256(_mm256_srli_epi16(v[n], 2 * i), _mm256_set1_epi8(3));
          p[n] = _mm256_add_epi16(p[n], _mm256_maddubs_epi16(c, xv));
        }
      }
      for (int n = 0; n < NR; n++)
        a[0][n] = _mm256_add_epi32(a[0][n], _mm256_madd_epi16(p[n], _mm256_set1_epi16(1)));
    }
    return;
  }
  for (int h = 0; h < 64; h += 32)
    for (int i = 0; i < 4; i++) {
      __m256i c[NR];
      for (int n = 0; n < NR; n++) {
        __m256i v = _mm256_loadu_si256((const __m256i*)(w + n * Kp / 4 + k / 4 + h));
        c[n] = _mm256_and_si256(_mm256_srli_epi16(v, 2 * i), _mm256_set1_epi8(3));
      }
      for (int m = 0; m < MR; m++) {
        __m256i xv = _mm256_loadu_si256((const __m256i*)(x + m * Kp + k + 64 * i + h));
        for (int n = 0; n < NR; n++) {
          __m256i p = _mm256_maddubs_epi16(c[n], xv);
          p = _mm256_madd_epi16(p, _mm256_set1_epi16(1));  // then pairs to int32
          a[m][n] = _mm256_add_epi32(a[m][n], p);
        }
      }
    }
}

VNNI inline int32_t hsum(__m512i a) { return _mm512_reduce_add_epi32(a); }
AVX2 inline int32_t hsum(__m256i a) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(a), _mm256_extracti128_si256(a, 1));
  s = _mm_hadd_epi32(s, s);
  return _mm_cvtsi128_si32(_mm_hadd_epi32(s, s));
}

// With a gamma per block (BLOCKS), the sums of blocks k / 256 .. + count - 1 go apart
// into acc[block][MR][NR], and their accumulators start again from zero
#define TAKE_SUMS(count, vec)                                                   \
  for (int u = 0; u < count; u++)                                               \
    for (int m = 0; m < MR; m++)                                                \
      for (int n = 0; n < NR; n++) {                                            \
        acc[((k / 256 + u) * MR + m) * NR + n] = hsum(a[u][m][n]);              \
        a[u][m][n] = vec{};                                                     \
      }

// MR tokens x NR rows over all of K, into acc (MR x NR) (or per block, BLOCKS);
// a lone row keeps U = 4 blocks in flight
#define TILE(name, isa, vec, block)                                             \
  template <int MR, int NR, bool BLOCKS>                                        \
  isa void name(const int8_t* x, const uint8_t* w, int64_t Kp, int32_t* acc) {  \
    constexpr int U = NR == 1 ? 4 : 1;                                          \
    vec a[U][MR][NR] = {};                                                      \
    int64_t k = 0;                                                              \
    for (; k + 256 * U <= Kp; k += 256 * U) {                                   \
      for (int u = 0; u < U; u++) block<MR, NR>(x, w, Kp, k + 256 * u, a[u]);   \
      if (BLOCKS) TAKE_SUMS(U, vec)                                             \
    }                                                                           \
    for (; k < Kp; k += 256) {                                                  \
      block<MR, NR>(x, w, Kp, k, a[0]);                                         \
      if (BLOCKS) TAKE_SUMS(1, vec)                                             \
    }                                                                           \
    if (!BLOCKS)                                                                \
      for (int m = 0; m < MR; m++)                                              \
        for (int n = 0; n < NR; n++) {                                          \
          int32_t s = 0;                                                        \
          for (int u = 0; u < U; u++) s += hsum(a[u][m][n]);                    \
          acc[m * NR + n] = s;                                                  \
        }                                                                       \
  }
TILE(tile_vnni, VNNI, __m512i, block_vnni)
TILE(tile_avx2, AVX2, __m256i, block_avx2)

using Tile = void (*)(const int8_t*, const uint8_t*, int64_t, int32_t*);
#define TILES(f, NR, B) {f<1, NR, B>, f<2, NR, B>, f<3, NR, B>, f<4, NR, B>}
// [sums per block][isa][NR == 4][MR - 1]
static const Tile tiles[2][2][2][4] = {
    {{TILES(tile_avx2, 1, false), TILES(tile_avx2, 4, false)},
     {TILES(tile_vnni, 1, false), TILES(tile_vnni, 4, false)}},
    {{TILES(tile_avx2, 1, true), TILES(tile_avx2, 4, true)},
     {TILES(tile_vnni, 1, true), TILES(tile_vnni, 4, true)}}};

int64_t simd() {  // 2: AVX-512 VNNI, 1: AVX2, 0: neither (use another path)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512bw")) return 2;
  return __builtin_cpu_supports("avx2") ? 1 : 0;
}

// absmax per token, then x_q = round(x * s), exactly as kernels.quantize does (torch
// evaluates 127 / t as (1 / t) * 127 and rounds half to even, as cvtps does), so every
// path agrees bit for bit; the saturating packs to int8 are the clamp to [-128, 127].
// sums: sum x_q of each block of 256 columns
AVX2 float quantize(const float* x, int64_t K, int8_t* q, int32_t* sums) {
  __m256 m = _mm256_setzero_ps();
  const __m256 abs = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) m = _mm256_max_ps(m, _mm256_and_ps(abs, _mm256_loadu_ps(x + k)));
  float lanes[8], amax = 0;
  _mm256_storeu_ps(lanes, m);
  for (float v : lanes) amax = std::max(amax, v);
  for (; k < K; k++) amax = std::max(amax, std::fabs(x[k]));
  const float s = (1.0f / std::max(amax, 1e-5f)) * 127.0f;
  const __m256 vs = _mm256_set1_ps(s);
  __m256i total = _mm256_setzero_si256();
  for (k = 0; k + 32 <= K; k += 32) {
    __m256i i[4];
    for (int j = 0; j < 4; j++) {
      i[j] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + k + 8 * j), vs));
      total = _mm256_add_epi32(total, i[j]);
    }
    // packs work in 128-bit lanes: the bytes come out as 4-byte groups 0 2 4 6 1 3 5 7
    __m256i b = _mm256_packs_epi16(_mm256_packs_epi32(i[0], i[1]),
                                   _mm256_packs_epi32(i[2], i[3]));
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    _mm256_storeu_si256((__m256i*)(q + k), _mm256_permutevar8x32_epi32(b, order));
    if ((k + 32) % 256 == 0) {  // a block ends
      sums[k / 256] = hsum(total);
      total = _mm256_setzero_si256();
    }
  }
  int32_t rest = hsum(total);  // the last block, when K is no multiple of 256
  for (; k < K; k++) {
    q[k] = (int8_t)std::min(std::max(std::nearbyint(x[k] * s), -128.0f), 127.0f);
    rest += q[k];
  }
  if (K % 256) sums[K / 256] = rest;
  return s;
}

// Y (M, N) = the op on X (M, K) float and W (N, Kp / 4) packed; G holds one gamma, one
// per row (per_row: fused matrices), or one per row and block of 256 columns (blocks)
void linear_into(const float* x, int64_t M, int64_t K, const uint8_t* W, int64_t N,
                 int64_t Kp, const float* G, bool per_row, bool blocks, int64_t isa,
                 float* Y) {
  TORCH_CHECK(isa == 1 || isa == 2, "this CPU has neither AVX2 nor AVX-512 VNNI");
  std::vector<int8_t> xq(M * Kp);  // zero-padded to whole blocks
  const int64_t nb = Kp / 256;
  // sum x, per token and block and in all: sum q x = sum c x - sum x
  std::vector<int32_t> Sb(M * nb), S(M);
  std::vector<float> s(M);
  for (int64_t m = 0; m < M; m++) {
    s[m] = quantize(x + m * K, K, &xq[m * Kp], &Sb[m * nb]);
    S[m] = std::accumulate(&Sb[m * nb], &Sb[m * nb] + nb, 0);
  }
  const int64_t gs = per_row;
  const int8_t* X = xq.data();
  // Decode streams a long row alone (one sequential read), short ones (up to 1024
  // columns: 1.2x faster at SmolLM2's 576) four at a time
  const int64_t R = M < 4 && Kp > 1024 ? 1 : 4;
  // threads split the weight rows, at least 32K weights each
  const int64_t grain = std::max<int64_t>(1, 32768 / Kp / R);
  at::parallel_for(0, (N + R - 1) / R, grain, [&](int64_t t0, int64_t t1) {
    std::vector<int32_t> acc(16 * (blocks ? nb : 1));
    for (int64_t n = R * t0, nr; n < std::min(R * t1, N); n += nr) {
      nr = N - n >= R ? R : 1;
      for (int64_t m = 0; m < M; m += 4) {
        int mr = std::min<int64_t>(4, M - m);
        tiles[blocks][isa - 1][nr == 4][mr - 1](X + m * Kp, W + n * Kp / 4, Kp, acc.data());
        for (int i = 0; i < mr; i++)
          for (int j = 0; j < nr; j++) {
            float& y = Y[(m + i) * N + n + j];
            if (!blocks) {
              y = float(acc[i * nr + j] - S[m + i]) * (G[gs * (n + j)] / s[m + i]);
              continue;
            }
            // each block's product times its gamma, added first to last, then / s
            float total = 0;
            for (int64_t b = 0; b < nb; b++) {
              const int32_t product = acc[(b * mr + i) * nr + j] - Sb[(m + i) * nb + b];
              const float part = float(product) * G[(n + j) * nb + b];
              total = b == 0 ? part : total + part;
            }
            y = total / s[m + i];
          }
      }
    }
  });
}

torch::Tensor linear(torch::Tensor x, torch::Tensor w, torch::Tensor gamma, int64_t isa) {
  auto xf = x.to(torch::kFloat).contiguous();
  auto g = gamma.to(torch::kFloat).contiguous();
  auto y = torch::empty({x.size(0), w.size(0)}, xf.options());
  linear_into(xf.data_ptr<float>(), x.size(0), x.size(1), w.data_ptr<uint8_t>(), w.size(0),
              4 * w.size(1), g.data_ptr<float>(), g.numel() > 1, g.dim() == 2, isa,
              y.data_ptr<float>());
  return y;
}

// The LM head (kernels.pack_int8): int8 rows times activations quantized per token to
// int16 (int8 cost SmolLM2 0.011 nats of held-out loss), exact integer sums as in the
// ternary path. 32 weights (AVX-512BW; 16 with AVX2) are widened to int16 and multiplied
// in pairs into int32 per instruction. A lane of the sum gains at most 4 * 32767 * 127
// per 64 columns (AVX2; half that with AVX-512), so a chunk of 4096 columns fits in
// int32; chunks are summed in int64.
float quantize16(const float* x, int64_t K, int16_t* q) {
  float amax = 0;
  for (int64_t k = 0; k < K; k++) amax = std::max(amax, std::fabs(x[k]));
  // as kernels.quantize(x, 32767)
  const float s = (1.0f / std::max(amax, 1e-5f)) * 32767.0f;
  for (int64_t k = 0; k < K; k++) q[k] = (int16_t)std::nearbyint(x[k] * s);
  return s;
}

VNNI int64_t dot16_avx512(const int16_t* x, const int8_t* w, int64_t Kp) {
  __m512i total = _mm512_setzero_si512();  // 8 int64 lanes
  for (int64_t c = 0; c < Kp; c += 4096) {
    __m512i a = _mm512_setzero_si512(), b = _mm512_setzero_si512();
    for (int64_t k = c; k < std::min(Kp, c + 4096); k += 64) {
      __m512i w0 = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i*)(w + k)));
      __m512i w1 = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i*)(w + k + 32)));
      a = _mm512_add_epi32(a, _mm512_madd_epi16(w0, _mm512_loadu_si512(x + k)));
      b = _mm512_add_epi32(b, _mm512_madd_epi16(w1, _mm512_loadu_si512(x + k + 32)));
    }
    a = _mm512_add_epi32(a, b);
    total = _mm512_add_epi64(total, _mm512_cvtepi32_epi64(_mm512_castsi512_si256(a)));
    total = _mm512_add_epi64(total, _mm512_cvtepi32_epi64(_mm512_extracti64x4_epi64(a, 1)));
  }
  return _mm512_reduce_add_epi64(total);
}

AVX2 int64_t dot16_avx2(const int16_t* x, const int8_t* w, int64_t Kp) {
  __m256i total = _mm256_setzero_si256();  // 4 int64 lanes
  for (int64_t c = 0; c < Kp; c += 4096) {
    __m256i a = _mm256_setzero_si256(), b = _mm256_setzero_si256();
    for (int64_t k = c; k < std::min(Kp, c + 4096); k += 32) {
      __m256i w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(w + k)));
      __m256i w1 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(w + k + 16)));
      __m256i x0 = _mm256_loadu_si256((const __m256i*)(x + k));
      __m256i x1 = _mm256_loadu_si256((const __m256i*)(x + k + 16));
      a = _mm256_add_epi32(a, _mm256_madd_epi16(w0, x0));
      b = _mm256_add_epi32(b, _mm256_madd_epi16(w1, x1));
    }
    a = _mm256_add_epi32(a, b);
    total = _mm256_add_epi64(total, _mm256_cvtepi32_epi64(_mm256_castsi256_si128(a)));
    total = _mm256_add_epi64(total, _mm256_cvtepi32_epi64(_mm256_extracti128_si256(a, 1)));
  }
  int64_t lanes[4];
  _mm256_storeu_si256((__m256i*)lanes, total);
  return lanes[0] + lanes[1] + lanes[2] + lanes[3];
}

// Y (M, N) = X (M, K) float times int8 rows W (N, Kp), a scale per row
void linear_w8_into(const float* x, int64_t M, int64_t K, const int8_t* W, int64_t N,
                    int64_t Kp, const float* G, int64_t isa, float* Y) {
  TORCH_CHECK(isa == 1 || isa == 2, "this CPU has neither AVX2 nor AVX-512 VNNI");
  std::vector<int16_t> xq(M * Kp);  // zero-padded, as the rows
  std::vector<float> s(M);
  for (int64_t m = 0; m < M; m++) s[m] = quantize16(x + m * K, K, &xq[m * Kp]);
  const int16_t* X = xq.data();
  auto dot = isa == 2 ? dot16_avx512 : dot16_avx2;
  at::parallel_for(0, N, std::max<int64_t>(1, 32768 / Kp), [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; n++)
      for (int m = 0; m < M; m++)
        Y[m * N + n] = float(dot(X + m * Kp, W + n * Kp, Kp)) * (G[n] / s[m]);
  });
}

torch::Tensor linear_w8(torch::Tensor x, torch::Tensor w, torch::Tensor scale, int64_t isa) {
  auto xf = x.to(torch::kFloat).contiguous();
  auto sc = scale.to(torch::kFloat).contiguous();
  auto y = torch::empty({x.size(0), w.size(0)}, xf.options());
  linear_w8_into(xf.data_ptr<float>(), x.size(0), x.size(1), w.data_ptr<int8_t>(), w.size(0),
                 w.size(1), sc.data_ptr<float>(), isa, y.data_ptr<float>());
  return y;
}

// ---- 5. a whole decode step (engine.FusedTransformer): one new token per row through
// every block and the head in one call, model.py's ops in its order, with nothing between
// them (eagerly, each op is a Python call and an ATen dispatch: about 75 a layer). The
// projections and the head are linear_into and linear_w8_into, the op's own numbers; the
// norms, RoPE, attention and the activation are the loops below, whose sums run in
// another order than torch's: the logits agree to rounding, and the greedy tokens are
// the same (tests/test_engine.py).

// nn.RMSNorm: x * rsqrt(mean(x^2) + eps) * w; without w (an Identity slot), a copy
void rms_norm(const float* x, const torch::Tensor& w, int64_t n, float eps, float* y) {
  if (w.numel() == 0) {
    std::copy(x, x + n, y);
    return;
  }
  double squares = 0;
  for (int64_t i = 0; i < n; i++) squares += double(x[i]) * x[i];
  const float r = 1.0f / std::sqrt(float(squares / n) + eps);
  const float* g = w.data_ptr<float>();
  for (int64_t i = 0; i < n; i++) y[i] = x[i] * r * g[i];
}

// model.apply_rope on one head in place: x * cos + (-x2, x1) * sin, pairs (i, i + hs/2)
void rope(float* x, const float* cos, const float* sin, int64_t hs) {
  const int64_t half = hs / 2;
  std::vector<float> y(hs);
  for (int64_t i = 0; i < hs; i++) {
    const float rotated = i < half ? -x[i + half] : x[i - half];
    y[i] = x[i] * cos[i] + rotated * sin[i];
  }
  std::copy(y.begin(), y.end(), x);
}

// a . b in 8 lanes (a float sum in one order cannot be vectorized by the compiler)
AVX2 float dot(const float* a, const float* b, int64_t n) {
  __m256 lanes = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    lanes = _mm256_add_ps(lanes, _mm256_mul_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i)));
  float part[8], total = 0;
  _mm256_storeu_ps(part, lanes);
  for (float v : part) total += v;
  for (; i < n; i++) total += a[i] * b[i];
  return total;
}

// softmax(q . k_t / sqrt(hs)) over the keys t < T it sees, times v_t, summed into y
void attend(const float* q, const float* keys, const float* values,
            const std::vector<char>& seen, int64_t T, int64_t hs, float* y) {
  const float scale = 1.0f / std::sqrt(float(hs));
  std::vector<float> p(T);
  float top = -INFINITY;
  for (int64_t t = 0; t < T; t++) {
    if (!seen[t]) continue;
    p[t] = dot(q, keys + t * hs, hs) * scale;
    top = std::max(top, p[t]);
  }
  float total = 0;
  for (int64_t t = 0; t < T; t++) {
    p[t] = seen[t] ? std::exp(p[t] - top) : 0.0f;
    total += p[t];
  }
  std::fill(y, y + hs, 0.0f);
  for (int64_t t = 0; t < T; t++)
    for (int64_t i = 0; i < hs && p[t] != 0; i++) y[i] += p[t] * values[t * hs + i];
  for (int64_t i = 0; i < hs; i++) y[i] /= total;
}

// bench.py's profile of a step: the seconds since the last lap added to times[part]
// (0 head, 1 projections, 2 attention, 3 the rest); with no times, nothing is timed
struct Laps {
  double* times;
  std::chrono::steady_clock::time_point last = std::chrono::steady_clock::now();
  void lap(int part) {
    if (!times) return;
    const auto now = std::chrono::steady_clock::now();
    times[part] += std::chrono::duration<double>(now - last).count();
    last = now;
  }
};
enum { HEAD, PROJECTIONS, ATTENTION, REST };

// Logits (B, V) of tokens (B,) at position pos. Each layer is 12 tensors, in the order
// of the block's forward: input_layernorm, qkv packed and its gammas, attn_sub_norm,
// o_proj and its gamma, post_attention_layernorm, gate_up and its gammas, ffn_sub_norm,
// down_proj and its gamma (a sub norm empty where it is an Identity). caches[l] is the
// layer's (2, B, n_kv_head, T_max, head_dim); valid (B, >= pos + 1), or empty, marks
// the real tokens of left-padded rows. shape: n_head, n_kv_head, head_dim, sliding
// window (0: none), relu2 (else SiLU), isa. times: float64 (4,) to add the parts' seconds
// to (Laps), or empty.
torch::Tensor decode_step(torch::Tensor tokens, torch::Tensor embedding,
                          std::vector<torch::Tensor> layers, std::vector<torch::Tensor> caches,
                          torch::Tensor valid, int64_t pos, torch::Tensor cos, torch::Tensor sin,
                          torch::Tensor norm, torch::Tensor head, torch::Tensor head_scale,
                          std::vector<int64_t> shape, double eps, torch::Tensor times) {
  Laps laps{times.numel() ? times.data_ptr<double>() : nullptr};
  const int64_t nh = shape[0], nkv = shape[1], hs = shape[2], window = shape[3];
  const bool relu2 = shape[4];
  const int64_t isa = shape[5];
  const int64_t B = tokens.size(0), C = embedding.size(1), V = head.size(0);
  const int64_t Q = nh * hs, KV = nkv * hs, H = layers[7].size(0) / 2;
  const int64_t T_max = caches[0].size(3);
  TORCH_CHECK(pos < T_max, "position ", pos, " is past the cache's ", T_max);
  for (const auto& t : layers)
    TORCH_CHECK(t.is_contiguous() && (t.numel() == 0 || t.scalar_type() == torch::kByte ||
                                      t.scalar_type() == torch::kFloat),
                "decode_step takes contiguous float32 norms and gammas, uint8 matrices");
  for (const auto& c : caches)
    TORCH_CHECK(c.is_contiguous() && c.scalar_type() == torch::kFloat && c.size(1) == B,
                "decode_step takes contiguous float32 caches of the batch's rows");
  auto project = [&](const float* x, int64_t K, const torch::Tensor& w,
                     const torch::Tensor& g, float* y) {
    linear_into(x, B, K, w.data_ptr<uint8_t>(), w.size(0), 4 * w.size(1),
                g.data_ptr<float>(), g.numel() > 1, g.dim() == 2, isa, y);
  };
  std::vector<float> x(B * C), h(B * C), qkv(B * (Q + 2 * KV)), sub(B * std::max(Q, H));
  std::vector<float> attended(B * Q), out(B * C), gate_up(B * 2 * H), gated(B * H);
  const float* E = embedding.data_ptr<float>();
  auto token_of = tokens.accessor<int64_t, 1>();
  for (int64_t b = 0; b < B; b++) {
    const int64_t token = token_of[b];
    TORCH_CHECK(0 <= token && token < embedding.size(0), "token ", token, " is out of range");
    std::copy(E + token * C, E + (token + 1) * C, &x[b * C]);
  }
  const float* c = cos.data_ptr<float>() + pos * hs;
  const float* s = sin.data_ptr<float>() + pos * hs;
  // the keys each row's query sees: its real tokens within the window, and itself
  std::vector<std::vector<char>> seen(B, std::vector<char>(pos + 1));
  auto real = valid.numel() ? valid : torch::ones({B, pos + 1}, torch::kBool);
  auto real_of = real.accessor<bool, 2>();
  for (int64_t b = 0; b < B; b++)
    for (int64_t t = 0; t <= pos; t++) {
      const bool is_real = real_of[b][t];
      seen[b][t] = t == pos || (is_real && (window == 0 || t > pos - window));
    }
  laps.lap(REST);
  for (size_t l = 0; l < caches.size(); l++) {
    const torch::Tensor* L = &layers[12 * l];
    float* cache = caches[l].data_ptr<float>();
    for (int64_t b = 0; b < B; b++) rms_norm(&x[b * C], L[0], C, eps, &h[b * C]);
    laps.lap(REST);
    project(h.data(), C, L[1], L[2], qkv.data());
    laps.lap(PROJECTIONS);
    for (int64_t b = 0; b < B; b++) {
      float* q = &qkv[b * (Q + 2 * KV)];
      float* k = q + Q;
      const float* v = k + KV;
      for (int64_t i = 0; i < nh; i++) rope(q + i * hs, c, s, hs);
      for (int64_t g = 0; g < nkv; g++) {
        rope(k + g * hs, c, s, hs);
        float* keys = cache + ((0 * B + b) * nkv + g) * T_max * hs;
        float* values = cache + ((1 * B + b) * nkv + g) * T_max * hs;
        std::copy(k + g * hs, k + (g + 1) * hs, keys + pos * hs);
        std::copy(v + g * hs, v + (g + 1) * hs, values + pos * hs);
      }
    }
    // the threads split the rows' heads; head i reads kv head i / (nh / nkv) (GQA)
    at::parallel_for(0, B * nh, 1, [&](int64_t j0, int64_t j1) {
      for (int64_t j = j0; j < j1; j++) {
        const int64_t b = j / nh, i = j % nh, g = i / (nh / nkv);
        const float* keys = cache + ((0 * B + b) * nkv + g) * T_max * hs;
        const float* values = cache + ((1 * B + b) * nkv + g) * T_max * hs;
        const float* q = &qkv[b * (Q + 2 * KV) + i * hs];
        attend(q, keys, values, seen[b], pos + 1, hs, &attended[b * Q + i * hs]);
      }
    });
    laps.lap(ATTENTION);
    for (int64_t b = 0; b < B; b++) rms_norm(&attended[b * Q], L[3], Q, eps, &sub[b * Q]);
    laps.lap(REST);
    project(sub.data(), Q, L[4], L[5], out.data());
    laps.lap(PROJECTIONS);
    for (int64_t i = 0; i < B * C; i++) x[i] = x[i] + out[i];
    for (int64_t b = 0; b < B; b++) rms_norm(&x[b * C], L[6], C, eps, &h[b * C]);
    laps.lap(REST);
    project(h.data(), C, L[7], L[8], gate_up.data());
    laps.lap(PROJECTIONS);
    at::parallel_for(0, B * H, 512, [&](int64_t j0, int64_t j1) {
      for (int64_t j = j0; j < j1; j++) {
        const int64_t b = j / H, i = j % H;
        const float g = gate_up[b * 2 * H + i], u = gate_up[b * 2 * H + H + i];
        const float active = relu2 ? std::max(g, 0.0f) * std::max(g, 0.0f)
                                   : g / (1.0f + std::exp(-g));
        gated[j] = active * u;
      }
    });
    for (int64_t b = 0; b < B; b++) rms_norm(&gated[b * H], L[9], H, eps, &sub[b * H]);
    laps.lap(REST);
    project(sub.data(), H, L[10], L[11], out.data());
    laps.lap(PROJECTIONS);
    for (int64_t i = 0; i < B * C; i++) x[i] = x[i] + out[i];
  }
  for (int64_t b = 0; b < B; b++) rms_norm(&x[b * C], norm, C, eps, &h[b * C]);
  auto logits = torch::empty({B, V}, embedding.options());
  laps.lap(REST);
  linear_w8_into(h.data(), B, C, head.data_ptr<int8_t>(), V, head.size(1),
                 head_scale.data_ptr<float>(), isa, logits.data_ptr<float>());
  laps.lap(HEAD);
  return logits;
}
"""


def built(name, *sources, **options):
    """torch's load_inline (which caches the build across runs), safe from a build killed
    halfway: torch leaves its `lock` file, and every later build would wait on it forever.
    Here each builder also holds an flock on a file beside it, which the operating system
    drops when its process dies; so whoever holds that flock and finds a `lock` knows it
    is a dead build's, removes it and says so in one line."""
    import fcntl
    from torch.utils.cpp_extension import _get_build_directory, load_inline
    folder = _get_build_directory(name, verbose=False)
    with open(os.path.join(folder, 'builder'), 'w') as builder:
        fcntl.flock(builder, fcntl.LOCK_EX)  # a live builder's turn first
        lock = os.path.join(folder, 'lock')
        if os.path.exists(lock):
            os.remove(lock)
            warnings.warn(f"kernels.py: removed {lock}, left by a build that was killed")
        return load_inline(name, *sources, **options)


@functools.cache
def cpp_extension():
    return built('nanobitnet_cpu', CPP, functions=['linear', 'linear_w8', 'simd', 'decode_step'],
                 extra_cflags=['-O3', '-fopenmp', '-ffp-contract=off'],
                 extra_ldflags=['-fopenmp'])


def linear_cpp(x: torch.Tensor, w: torch.Tensor, gamma: torch.Tensor) -> torch.Tensor:
    fn = cpp_extension().linear_w8 if w.dtype == torch.int8 else cpp_extension().linear
    return fn(x.contiguous(), w.contiguous(), gamma, cpp_extension().simd())


# ---------------------------------------------------------------- 4. CUDA kernel
# Decode (up to 16 tokens) is a GEMV of a few microseconds that streams every weight once,
# so the op is two kernels, no torch ops around them. quantize_rows: one block per token
# finds absmax, then writes the int8 row, padded with zeros to the packed K (a reduction
# over all of K that every weight row needs first: inside the GEMV, each of its N / 32
# blocks would redo it, for 16 tokens of K = 4096 8x more reads than the weights).
# ternary_gemv: a block of 8 warps owns 32 weight rows, 4 per warp. It copies the
# activations into shared memory once, a tile of 32 KiB at a time, and each lane then
# streams its rows' 16-byte words (a warp reads 512 contiguous bytes per row per step,
# 4 rows' loads in flight), unpacks each word once with __vsub4 (codes - 1) and multiplies
# it into every token of the batch with dp4a. The activations sit in shared memory in the
# order the lanes read them ([token][bit pair][16-byte word]), so a warp's reads are 32
# consecutive 16-byte words: no bank conflicts. It writes acc * (gamma / s) with the same
# fp32 operations as _linear, so the result is bit-identical. Batches above 16 go to the
# int8 tensor cores (torch._int_mm) with an unpacked copy of the weights made once
# (`unpacked`), and `rescale` applies the scales. This part needs no torch headers, so it
# compiles with plain nvcc without a GPU, and runs on the CPU too under a header that
# emulates CUDA's threads, barriers and shuffles (tests/test_cuda_emulated.py).
GEMV_CU = r"""
#include <cstdint>

__global__ void quantize_rows(const float* __restrict__ x, int8_t* __restrict__ xq,
                              float* __restrict__ s, int K, int Kp) {
  __shared__ float part[32];
  const float* xr = x + (size_t)blockIdx.x * K;
  float a = 0.f;
  for (int k = threadIdx.x; k < K; k += blockDim.x) a = fmaxf(a, fabsf(xr[k]));
  for (int o = 16; o > 0; o /= 2) a = fmaxf(a, __shfl_xor_sync(0xffffffffu, a, o));
  if (threadIdx.x % 32 == 0) part[threadIdx.x / 32] = a;
  __syncthreads();
  for (int i = 0; i < blockDim.x / 32; i++) a = fmaxf(a, part[i]);
  const float sc = (1.f / fmaxf(a, 1e-5f)) * 127.f;  // as torch computes 127 / t
  if (threadIdx.x == 0) s[blockIdx.x] = sc;
  // round half to even, as torch.round
  for (int k = threadIdx.x; k < Kp; k += blockDim.x)
    xq[(size_t)blockIdx.x * Kp + k] =
        k < K ? (int8_t)fminf(fmaxf(rintf(xr[k] * sc), -128.f), 127.f) : 0;
}

constexpr int WARPS = 8;           // warps per block
constexpr int ROWS = 4;            // weight rows per warp
constexpr int TILE_BYTES = 32768;  // activations in shared memory: MT tokens x KT columns

// MT tokens (1, 2, 4, 8 or 16; those past M are zeros) times 32 weight rows per block
template <int MT>
__global__ void ternary_gemv(const int8_t* __restrict__ x, const uint8_t* __restrict__ w,
                             const float* __restrict__ s, const float* __restrict__ gamma,
                             float* __restrict__ y, int M, int N, int Kp, int gs) {
  constexpr int KT = TILE_BYTES / MT;  // columns per tile, a multiple of 2048
  constexpr int J = KT / 64;           // 16-byte words of a weight row per tile
  __shared__ int4 xs[MT * 4 * J];      // [token][bit pair i][word j]: the ints word j meets
  const int lane = threadIdx.x % 32;
  const int n0 = (blockIdx.x * WARPS + threadIdx.x / 32) * ROWS;
  int acc[ROWS][MT] = {};
  for (int k0 = 0; k0 < Kp; k0 += KT) {
    const int jt = min(KT, Kp - k0) / 64;  // words per row in this tile
    __syncthreads();  // every warp is done with the previous tile
    // 16 activations u (columns k0 + 16 u ..) lie in 256-column block u / 16, at bit pair
    // i = u / 4 % 4 of word j = 4 (u / 16) + u % 4 of that block's 64 bytes
    for (int e = threadIdx.x; e < MT * 4 * jt; e += blockDim.x) {
      const int m = e / (4 * jt), u = e % (4 * jt);
      const int i = u / 4 % 4, j = u / 16 * 4 + u % 4;
      const int4* xr = reinterpret_cast<const int4*>(x + (size_t)m * Kp + k0);
      xs[(m * 4 + i) * J + j] = m < M ? __ldg(xr + u) : make_int4(0, 0, 0, 0);
    }
    __syncthreads();
    for (int j = lane; j < jt; j += 32) {
      uint4 v[ROWS];  // this word of each of the warp's rows, all loads in flight at once
#pragma unroll
      for (int r = 0; r < ROWS; r++) {
        const uint4* wr = reinterpret_cast<const uint4*>(w + (size_t)(n0 + r) * Kp / 4 + k0 / 4);
        v[r] = n0 + r < N ? __ldg(wr + j) : make_uint4(0, 0, 0, 0);
      }
#pragma unroll
      for (int i = 0; i < 4; i++) {
        int q[ROWS][4];  // bit pair i of the 4 ints of each row's word: weights - 1 .. 1
#pragma unroll
        for (int r = 0; r < ROWS; r++) {
          const unsigned words[4] = {v[r].x, v[r].y, v[r].z, v[r].w};
          for (int t = 0; t < 4; t++)
            q[r][t] = __vsub4((words[t] >> 2 * i) & 0x03030303u, 0x01010101u);
        }
#pragma unroll
        for (int m = 0; m < MT; m++) {
          const int4 a = xs[(m * 4 + i) * J + j];
#pragma unroll
          for (int r = 0; r < ROWS; r++) {
            acc[r][m] = __dp4a(q[r][0], a.x, acc[r][m]);
            acc[r][m] = __dp4a(q[r][1], a.y, acc[r][m]);
            acc[r][m] = __dp4a(q[r][2], a.z, acc[r][m]);
            acc[r][m] = __dp4a(q[r][3], a.w, acc[r][m]);
          }
        }
      }
    }
  }
#pragma unroll
  for (int r = 0; r < ROWS; r++)
#pragma unroll
    for (int m = 0; m < MT; m++) {
      for (int o = 16; o > 0; o /= 2) acc[r][m] += __shfl_down_sync(0xffffffffu, acc[r][m], o);
      // M * N may pass 2^31
      if (lane == 0 && n0 + r < N && m < M)
        y[(size_t)m * N + n0 + r] = (float)acc[r][m] * (gamma[gs * (n0 + r)] / s[m]);
    }
}

using Gemv = void (*)(const int8_t*, const uint8_t*, const float*, const float*, float*,
                      int, int, int, int);

Gemv gemv_for(int M) {  // the kernel for M <= 16 tokens: the smallest MT >= M
  return M <= 1 ? ternary_gemv<1> : M <= 2 ? ternary_gemv<2> : M <= 4 ? ternary_gemv<4>
       : M <= 8 ? ternary_gemv<8> : ternary_gemv<16>;
}

// y (M, N) = acc (M, N of lda) * (gamma / s), as _linear does it
__global__ void rescale(const int* __restrict__ acc, int lda, const float* __restrict__ s,
                        const float* __restrict__ gamma, float* __restrict__ y, int M, int N,
                        int gs) {
  const size_t e = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (e >= (size_t)M * N) return;
  const int m = e / N, n = e % N;
  y[e] = (float)acc[(size_t)m * lda + n] * (gamma[gs * n] / s[m]);
}
"""
LAUNCH_CU = r"""
#include <torch/extension.h>
#include <ATen/cuda/CUDAContext.h>

// x (M, K) -> x_q (M, Kp) int8 and s (M,) fp32, in one allocation
std::vector<torch::Tensor> quantize(torch::Tensor x, int64_t Kp) {
  x = x.to(torch::kFloat).contiguous();
  const int64_t M = x.size(0), K = x.size(1);
  auto bytes = torch::empty({M * Kp + 4 * M}, x.options().dtype(torch::kChar));
  auto xq = bytes.narrow(0, 0, M * Kp).view({M, Kp});
  auto s = bytes.narrow(0, M * Kp, 4 * M).view(torch::kFloat);
  quantize_rows<<<M, 256, 0, at::cuda::getCurrentCUDAStream()>>>(
      x.data_ptr<float>(), xq.data_ptr<int8_t>(), s.data_ptr<float>(), K, Kp);
  return {xq, s};
}

torch::Tensor gemv(torch::Tensor x, torch::Tensor w, torch::Tensor gamma) {
  const int M = x.size(0), N = w.size(0), Kp = 4 * w.size(1);
  TORCH_CHECK(M <= 16, "the GEMV takes up to 16 tokens");
  TORCH_CHECK(w.is_contiguous() && reinterpret_cast<uintptr_t>(w.data_ptr()) % 16 == 0,
              "packed weights must be contiguous and 16-byte aligned; pass a whole tensor");
  auto q = quantize(x, Kp);
  gamma = gamma.to(torch::kFloat).contiguous();
  auto y = torch::empty({M, N}, x.options().dtype(torch::kFloat));
  const dim3 grid((N + WARPS * ROWS - 1) / (WARPS * ROWS));
  gemv_for(M)<<<grid, 32 * WARPS, 0, at::cuda::getCurrentCUDAStream()>>>(
      q[0].data_ptr<int8_t>(), w.data_ptr<uint8_t>(), q[1].data_ptr<float>(),
      gamma.data_ptr<float>(), y.data_ptr<float>(), M, N, Kp, gamma.numel() > 1);
  return y;
}

torch::Tensor scale(torch::Tensor acc, torch::Tensor s, torch::Tensor gamma, int64_t N) {
  gamma = gamma.to(torch::kFloat).contiguous();
  const int64_t M = acc.size(0);
  auto y = torch::empty({M, N}, s.options());
  const int64_t blocks = (M * N + 255) / 256;
  rescale<<<blocks, 256, 0, at::cuda::getCurrentCUDAStream()>>>(
      acc.data_ptr<int>(), acc.size(1), s.data_ptr<float>(), gamma.data_ptr<float>(),
      y.data_ptr<float>(), M, N, gamma.numel() > 1);
  return y;
}
"""


@functools.cache
def cuda_extension():
    decl = ('std::vector<torch::Tensor> quantize(torch::Tensor x, int64_t Kp);\n'
            'torch::Tensor gemv(torch::Tensor x, torch::Tensor w, torch::Tensor gamma);\n'
            'torch::Tensor scale(torch::Tensor acc, torch::Tensor s, torch::Tensor gamma, '
            'int64_t N);')
    return built('nanobitnet_cuda', decl, cuda_sources=GEMV_CU + LAUNCH_CU,  # for this GPU
                 functions=['quantize', 'gemv', 'scale'], extra_cuda_cflags=['-O3'])


# Unpacked int8 copies of packed weights for the tensor cores, made on a weight's first
# batch above 16 tokens and kept while it lives: 1 byte per weight beside the packed
# quarter byte (still 1.6x fewer bytes than bf16), instead of unpacking on every call.
_unpacked = WeakIdKeyDictionary()


def unpacked(w):
    """Packed w (N, Kp/4) as int8 (N rounded up to 8, Kp), the shape torch._int_mm takes;
    made again if w was changed in place."""
    version, w8 = _unpacked.get(w, (None, None))
    if version != w._version:
        w8 = F.pad(unpack(w, 4 * w.shape[1]), (0, 0, 0, -w.shape[0] % 8))
        _unpacked[w] = (w._version, w8)
    return w8


def unpacked_bytes():
    """Bytes of the int8 copies `unpacked` keeps now, part of the weights' memory."""
    return sum(w8.nbytes for _, w8 in _unpacked.values())


def linear_cuda(x: torch.Tensor, w: torch.Tensor, gamma: torch.Tensor) -> torch.Tensor:
    if w.dtype == torch.int8:  # int8 rows: _linear's exact product
        return _linear(_mm_double, x, w, gamma)
    if gamma.dim() == 2:  # these kernels take one gamma per row; block scales compile
        return linear_compile(x, w, gamma)
    if x.shape[0] <= 16:
        return cuda_extension().gemv(x, w.contiguous(), gamma)
    # prefill is compute-bound: cuBLAS on the int8 tensor cores
    x_q, s = cuda_extension().quantize(x, 4 * w.shape[1])
    acc = torch._int_mm(x_q, unpacked(w).T)
    return cuda_extension().scale(acc, s, gamma, w.shape[0])


IMPLS = dict(reference=linear_reference, compile=linear_compile, cpp=linear_cpp,
             cuda=linear_cuda)


def linear_best(x: torch.Tensor, w: torch.Tensor, gamma: torch.Tensor) -> torch.Tensor:
    """The fastest implementation on this machine (`best`), chosen when it runs."""
    return IMPLS[best(x.device.type)](x, w, gamma)


# each one also as a custom op with a fake (shape-only) implementation, which
# torch.compile traces; eager calls skip the op's Python dispatch, which costs as much as
# a small decode GEMV (~10 us). 'best' makes its choice when it runs, so torch.compile
# never traces the choosing (which probes for compilers and builds the kernels)
OPS = {name: torch.library.custom_op(f'nanobitnet::linear_{name}', fn, mutates_args=(),
                                     device_types={'cpp': 'cpu', 'cuda': 'cuda'}.get(name))
       for name, fn in (IMPLS | dict(best=linear_best)).items()}
for op in OPS.values():
    op.register_fake(lambda x, w, gamma: x.new_empty(x.shape[0], w.shape[0],
                                                     dtype=torch.float32))


# ---------------------------------------------------------------- dispatch

def best(device_type):
    """The fastest implementation that works on this machine, with a one-time notice when
    the fast one cannot be built (no compiler, no CUDA toolkit, a CPU without AVX2)."""
    return choose(device_type)


@functools.cache
def choose(device_type):
    has_cxx = shutil.which(os.environ.get('CXX', 'c++')) is not None
    try:
        if device_type == 'cuda':
            from torch.utils.cpp_extension import CUDA_HOME
            if CUDA_HOME is None:
                raise RuntimeError("no CUDA toolkit (nvcc) found")
            cuda_extension()
            return 'cuda'
        if platform.machine().lower() not in ('x86_64', 'amd64'):
            raise RuntimeError("the C++ kernel is x86-only and this is "
                               f"{platform.machine()}")
        if not has_cxx:
            raise RuntimeError("no C++ compiler found (set CXX or install g++)")
        if not cpp_extension().simd():
            raise RuntimeError("this CPU has no AVX2")
        return 'cpp'
    except Exception as e:  # a failed build must not stop inference, only slow it down
        fallback = 'compile' if has_cxx or device_type == 'cuda' else 'reference'
        warnings.warn(f"kernels.py: {e}; using the slower {fallback!r} path")
        return fallback


def ternary_linear(x, w, gamma, impl=None):
    """y = (x_q @ W_q^T) * gamma / s: x (..., K) float, w packed (N, Kp/4) (or int8 rows
    (N, Kp), pack_int8), gamma (1,), (N,) or (N, K/256) (a gamma per row and block of
    256 columns) -> (..., N) in x's dtype, by `impl` (one of IMPLS) or the fastest
    available."""
    K, Kp = x.shape[-1], w.shape[1] * (1 if w.dtype == torch.int8 else 4)
    if not 0 <= Kp - K < BLOCK:
        raise ValueError(f"activations have K={K} but the weights were packed for "
                         f"K={Kp - BLOCK + 1}..{Kp}; "
                         f"pack W_q of shape (N, {K}) with kernels.pack")
    if gamma.dim() == 2 and gamma.shape[1] * BLOCK != K:
        raise ValueError(f"{gamma.shape[1]} gammas per row for K={K}; block scales need "
                         f"one per {BLOCK} columns and K a multiple of {BLOCK}")
    if torch.compiler.is_compiling():
        fn = OPS[impl or 'best']
    else:
        fn = IMPLS[impl or best(x.device.type)]
    y = fn(x.reshape(-1, K), w, gamma)  # (M, N) fp32
    return y.to(x.dtype).view(*x.shape[:-1], w.shape[0])


# ---------------------------------------------------------------- training (bitlinear.py)
# BitLinear's forward is an exact integer product, whatever computes it. What follows makes
# it fast with the same numbers: int8 matmuls on int8 units, the activation quantizer fused
# on CUDA, and values reused while the weights hold still.

# torch._int_mm is fast where there are int8 units: tensor cores, AVX-512 CPUs (VNNI). On an
# AVX2 CPU (AMD EPYC) it ran 18x slower than an fp32 matmul of the same integers
INT8_UNITS_ON_CPU = 'AVX512' in torch.backends.cpu.get_cpu_capability()


def int8_matmul(a, b):
    """a (M, K) @ b (N, K)^T for int8 codes, exact in int32 (returned as fp32):
    torch._int_mm on int8 units where the shapes allow, else an fp32 matmul, exact too
    while K * 128 < 2^24 (with autocast off: it would round to bf16)."""
    on_int8_units = a.is_cuda or INT8_UNITS_ON_CPU
    fits = a.shape[0] > 16 and a.shape[1] % 8 == 0 and b.shape[0] % 8 == 0
    if on_int8_units and fits:
        return torch._int_mm(a, b.t()).float()
    with torch.autocast(a.device.type, enabled=False):
        return a.float() @ b.float().t()


@functools.cache
def fused_quantize():
    """quantize as torch.compile fuses it: a reduction and one elementwise pass (eager:
    five), the same numbers. Made on first use: compiling costs seconds."""
    return torch.compile(quantize, dynamic=True)


def quantize_activations(x):
    """quantize (int8 codes, s), fused on CUDA; eager elsewhere (compiling takes about
    20 s a graph on a CPU, where the tests run)."""
    return fused_quantize()(x) if x.is_cuda else quantize(x)


# Between two optimizer steps the weights hold still: every micro-step's forward and
# backward, an evaluation, a rollout read the same values. Inside `holding_weights()`,
# what BitLinear computes through `reused` is kept for the next caller with the same
# tensor: each weight's W_q and gamma (quantized once, not once per micro-step or
# generated token), an input's int8 codes (q, k and v read one tensor: the first
# quantizes it, the others reuse its codes) and their dequantized copy in backward
# (their backwards saved those same codes). Outside it nothing is kept, so no change of a
# weight or an input (in place, through .data, a numpy view, any optimizer, a broadcast)
# can meet an old value. Inside it, a kept value is also dropped when its tensor changes
# storage, version, dtype or device; a change that bumps none of them (through .data, a
# numpy view, a fused optimizer) is the caller's to keep outside: train.py steps the
# optimizer between two holds. A hold is its thread's: another thread (generating, or
# training) keeps its own or none, and backward on a thread of autograd's own (CUDA)
# computes afresh.
holds = threading.local()  # .held: tensor -> (key, value) in this thread's hold, or None


@contextlib.contextmanager
def holding_weights():
    """Keep what `reused` computes in this thread until the block ends (a nested hold
    joins the outer)."""
    outer = getattr(holds, 'held', None)
    holds.held = WeakIdKeyDictionary() if outer is None else outer
    try:
        yield
    finally:
        holds.held = outer


def reused(t, compute, *key):
    """compute(); inside holding_weights(), the value computed before for this same tensor
    t (while it lives, unchanged) and key. Compiled code is traced, not kept; inference
    tensors keep no version counter."""
    # is_compiling first: torch.compile never reads `held`, so never guards (and
    # recompiles) on it
    if torch.compiler.is_compiling() or t.is_inference():
        return compute()
    held = getattr(holds, 'held', None)
    if held is None:
        return compute()
    key = (t.data_ptr(), t._version, t.dtype, t.device, *key)
    kept = held.get(t)
    if kept is None or kept[0] != key:
        kept = (key, compute())
        held[t] = kept
    return kept[1]

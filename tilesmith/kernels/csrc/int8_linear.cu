// int8 weight-only linear for decode shapes (M <= 16):
//   out[m, n] = bf16(sum_k x[m, k] * W[n, k]) * scale[n] + bias[n] + residual[m, n]
// x bf16 [M, K] (row stride sx), W int8 [N, K] (row stride sw), scale / bias [N] and residual [M, N] in
// fp32 / bf16 / fp16, out fp32 / bf16 / fp16. fp32 accumulation; the dot product is rounded to bf16
// before the epilogue, as the FX program's bf16 `mm` node is. The weight is streamed once from memory
// (58.7 MB at 4096 x 14336), so the kernels are built to keep as many 16-byte weight loads in flight as the
// SMs allow while the int8 -> fp32/bf16 conversion stays cheap (a byte permute into a float's mantissa:
// 2^23 + (w ^ 0x80), then one subtraction; exact).
//
// Kernels:
//  * fma:    one warp per ROWS weight rows over the whole K; each lane streams 16 weight bytes per step
//            (UNROLL steps in flight), x from L1; CUDA-core FMAs; warp-shuffle reduction.
//  * fma_splitk (M == 1): the same with K split between two warps of one block (reduced through shared
//            memory, no second launch). At 4096 x 14336 the fma grid is 2048 warps, about 15 per SM: the
//            occupancy is set by the grid, not by registers, so at most 64 KB of weight reads are in flight
//            per SM and fewer while a warp converts and multiplies; split-K doubles the warps (31 per SM, the
//            64-register limit) and the bytes in flight.
//  * mma:    tensor cores (mma.sync m16n8k16 bf16, sm_80+): one block of 8 warps per 8*NT weight rows,
//            K split across the warps (reduced through shared memory); the K order inside each 64-wide
//            block is permuted so that every lane loads 16 contiguous weight bytes and 32 contiguous
//            x bytes per row (a permutation of k applied to both operands leaves the dot product intact).
//  * scalar: any K, any alignment (element loads); the fallback the launcher picks when the vector
//            kernels' conditions (K % 16 == 0, 16-byte aligned rows) do not hold.
#include "common.cuh"
#include "int8_linear.h"

namespace tsk {


__device__ __forceinline__ float round_bf16(float v) { return __bfloat162float(__float2bfloat16_rn(v)); }

__device__ __forceinline__ void epilogue(const Int8LinearArgs& p, int m, int n, float acc) {
  float v = round_bf16(acc);
  if (p.scale) v = v * load_as_float(p.scale, p.scale_dtype, n);
  if (p.bias) v = v + load_as_float(p.bias, p.bias_dtype, n);
  if (p.res) v = v + load_as_float(p.res, p.res_dtype, static_cast<int64_t>(m) * p.sres + n);
  store_from_float(p.out, p.out_dtype, static_cast<int64_t>(m) * p.sout + n, v);
}

// 4 int8 in a word -> 4 exact floats: f = as_float(0x4B0000uu) - (2^23 + 128), uu = byte ^ 0x80.
__device__ __forceinline__ void i8x4_to_f32(uint32_t word, float (&f)[4]) {
  const uint32_t u = word ^ 0x80808080u;
  f[0] = __uint_as_float(__byte_perm(u, 0x4B000000u, 0x7650)) - 8388736.f;
  f[1] = __uint_as_float(__byte_perm(u, 0x4B000000u, 0x7651)) - 8388736.f;
  f[2] = __uint_as_float(__byte_perm(u, 0x4B000000u, 0x7652)) - 8388736.f;
  f[3] = __uint_as_float(__byte_perm(u, 0x4B000000u, 0x7653)) - 8388736.f;
}

// ------------------------------------------------------------------------------------------- fma path
// A block has kFmaGroups groups of ROWS weight rows; KSPLIT warps share each group's K range (warp
// `group + kFmaGroups * ks` takes the ks-th 1/KSPLIT of the chunks) and are reduced through shared memory.
constexpr int kFmaGroups = 4;

// KSPLIT > 1: 64 registers (4 blocks of 256 threads per SM: the 4096 x 14336 grid of 512 blocks in one wave).
template <int MT, int ROWS, int UNROLL, int KSPLIT>
__global__ void __launch_bounds__(32 * kFmaGroups * KSPLIT, KSPLIT > 1 ? 8 / KSPLIT : 1) int8_gemv_fma(Int8LinearArgs p) {
  __shared__ float red[KSPLIT > 1 ? KSPLIT : 1][kFmaGroups][MT][ROWS];
  const int lane = threadIdx.x & 31;
  const int group = (threadIdx.x >> 5) % kFmaGroups, ks = (threadIdx.x >> 5) / kFmaGroups;
  const int n0 = (blockIdx.x * kFmaGroups + group) * ROWS;
  if (KSPLIT == 1 && n0 >= p.N) return;  // (with KSPLIT > 1 every warp reaches the barrier below)
  const int chunks_all = p.K >> 4;  // 16 int8 per chunk
  const int per = (chunks_all + KSPLIT - 1) / KSPLIT;
  const int c_begin = KSPLIT == 1 ? 0 : min(chunks_all, ks * per);
  const int chunks = KSPLIT == 1 ? chunks_all : min(chunks_all, c_begin + per);  // this warp's end
  const int8_t* wrow[ROWS];
#pragma unroll
  for (int r = 0; r < ROWS; ++r) wrow[r] = p.w + static_cast<int64_t>(min(n0 + r, p.N - 1)) * p.sw;
  const bool active = KSPLIT == 1 || n0 < p.N;  // KSPLIT == 1 returned above otherwise
  float acc[MT][ROWS];
#pragma unroll
  for (int m = 0; m < MT; ++m)
#pragma unroll
    for (int r = 0; r < ROWS; ++r) acc[m][r] = 0.f;

  for (int base = c_begin + lane; active && base < chunks; base += 32 * UNROLL) {
    uint4 wv[UNROLL][ROWS];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const int c = base + u * 32;
#pragma unroll
      for (int r = 0; r < ROWS; ++r) wv[u][r] = c < chunks ? ld_stream(wrow[r] + c * 16) : make_uint4(0, 0, 0, 0);
    }
    // M == 1: the x chunks of all UNROLL steps are loaded up front too (L1 hits, latency overlapped).
    uint4 x1[MT == 1 ? UNROLL : 1][2];
    if constexpr (MT == 1) {
#pragma unroll
      for (int u = 0; u < UNROLL; ++u) {
        const int c = min(base + u * 32, chunks - 1);
        x1[u][0] = ld_cached(p.x + c * 16);
        x1[u][1] = ld_cached(p.x + c * 16 + 8);
      }
    }
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const int c = base + u * 32;
      if (c >= chunks) break;
      float wf[ROWS][16];
#pragma unroll
      for (int r = 0; r < ROWS; ++r) {
        float q[4];
        i8x4_to_f32(wv[u][r].x, q);
        wf[r][0] = q[0]; wf[r][1] = q[1]; wf[r][2] = q[2]; wf[r][3] = q[3];
        i8x4_to_f32(wv[u][r].y, q);
        wf[r][4] = q[0]; wf[r][5] = q[1]; wf[r][6] = q[2]; wf[r][7] = q[3];
        i8x4_to_f32(wv[u][r].z, q);
        wf[r][8] = q[0]; wf[r][9] = q[1]; wf[r][10] = q[2]; wf[r][11] = q[3];
        i8x4_to_f32(wv[u][r].w, q);
        wf[r][12] = q[0]; wf[r][13] = q[1]; wf[r][14] = q[2]; wf[r][15] = q[3];
      }
#pragma unroll
      for (int m = 0; m < MT; ++m) {
        if (m >= p.M) break;
        const uint16_t* xp = p.x + static_cast<int64_t>(m) * p.sx + c * 16;
        uint4 xa, xb;
        if constexpr (MT == 1) {
          xa = x1[u][0];
          xb = x1[u][1];
        } else {
          xa = ld_cached(xp);
          xb = ld_cached(xp + 8);
        }
        const uint32_t xw[8] = {xa.x, xa.y, xa.z, xa.w, xb.x, xb.y, xb.z, xb.w};
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          const float lo = bf16_lo(xw[j]), hi = bf16_hi(xw[j]);
#pragma unroll
          for (int r = 0; r < ROWS; ++r) {
            acc[m][r] = fmaf(lo, wf[r][2 * j], acc[m][r]);
            acc[m][r] = fmaf(hi, wf[r][2 * j + 1], acc[m][r]);
          }
        }
      }
    }
  }
  if constexpr (KSPLIT == 1) {
#pragma unroll
    for (int m = 0; m < MT; ++m) {
#pragma unroll
      for (int r = 0; r < ROWS; ++r) {
        const float v = warp_sum(acc[m][r]);
        if (m < p.M && n0 + r < p.N && lane == ((m * ROWS + r) & 31)) epilogue(p, m, n0 + r, v);
      }
    }
  } else {
#pragma unroll
    for (int m = 0; m < MT; ++m) {
#pragma unroll
      for (int r = 0; r < ROWS; ++r) {
        const float v = warp_sum(acc[m][r]);
        if (lane == 0) red[ks][group][m][r] = v;
      }
    }
    __syncthreads();
    if (ks == 0) {
#pragma unroll
      for (int m = 0; m < MT; ++m) {
#pragma unroll
        for (int r = 0; r < ROWS; ++r) {
          if (m < p.M && n0 + r < p.N && lane == ((m * ROWS + r) & 31)) {
            float v = red[0][group][m][r];
#pragma unroll
            for (int q = 1; q < KSPLIT; ++q) v += red[q][group][m][r];
            epilogue(p, m, n0 + r, v);
          }
        }
      }
    }
  }
}

// ------------------------------------------------------------------------------------------- mma path
__device__ __forceinline__ void mma_bf16_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#endif
}

// 4 int8 -> two bf16x2 words (low half = lower k). The converted floats are small integers, exact in bf16,
// whose low 16 bits are zero, so the bf16 bits are the high halves.
__device__ __forceinline__ void i8x4_to_bf16x4(uint32_t word, uint32_t& lo, uint32_t& hi) {
  float f[4];
  i8x4_to_f32(word, f);
  lo = __byte_perm(__float_as_uint(f[0]), __float_as_uint(f[1]), 0x7632);
  hi = __byte_perm(__float_as_uint(f[2]), __float_as_uint(f[3]), 0x7632);
}

constexpr int kMmaWarps = 8;

template <int NT, int UNROLL>
__global__ void __launch_bounds__(kMmaWarps * 32) int8_gemm_mma(Int8LinearArgs p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  __shared__ float red[kMmaWarps][NT][4][32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int n_base = blockIdx.x * 8 * NT;
  const int chunks = p.K >> 4;
  const int kblocks = (chunks + 3) >> 2;  // 64-wide K blocks
  const bool row_lo = g < p.M, row_hi = g + 8 < p.M;
  const uint16_t* x_lo = p.x + static_cast<int64_t>(row_lo ? g : 0) * p.sx;
  const uint16_t* x_hi = p.x + static_cast<int64_t>(row_hi ? g + 8 : 0) * p.sx;
  const int8_t* wrow[NT];
  bool wvalid[NT];
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
    const int n = n_base + nt * 8 + g;
    wvalid[nt] = n < p.N;
    wrow[nt] = p.w + static_cast<int64_t>(wvalid[nt] ? n : 0) * p.sw;
  }
  float acc[NT][4];
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.f;

  for (int kb0 = warp; kb0 < kblocks; kb0 += kMmaWarps * UNROLL) {
    uint4 wv[UNROLL][NT];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const int c = (kb0 + u * kMmaWarps) * 4 + t;  // this lane's 16-byte chunk
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
        wv[u][nt] = (c < chunks && wvalid[nt]) ? ld_stream(wrow[nt] + c * 16) : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const int c = (kb0 + u * kMmaWarps) * 4 + t;
      if (kb0 + u * kMmaWarps >= kblocks) break;
      const bool cv = c < chunks;
      uint4 xl0 = make_uint4(0, 0, 0, 0), xl1 = xl0, xh0 = xl0, xh1 = xl0;
      if (cv && row_lo) {
        xl0 = ld_cached(x_lo + c * 16);
        xl1 = ld_cached(x_lo + c * 16 + 8);
      }
      if (cv && row_hi) {
        xh0 = ld_cached(x_hi + c * 16);
        xh1 = ld_cached(x_hi + c * 16 + 8);
      }
      const uint32_t xl[8] = {xl0.x, xl0.y, xl0.z, xl0.w, xl1.x, xl1.y, xl1.z, xl1.w};
      const uint32_t xh[8] = {xh0.x, xh0.y, xh0.z, xh0.w, xh1.x, xh1.y, xh1.z, xh1.w};
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        const uint32_t ww[4] = {wv[u][nt].x, wv[u][nt].y, wv[u][nt].z, wv[u][nt].w};
#pragma unroll
        for (int s = 0; s < 4; ++s) {  // mma s covers physical k = 16t + 4s + {0,1,2,3} of this block
          uint32_t b0, b1;
          i8x4_to_bf16x4(ww[s], b0, b1);
          const uint32_t a[4] = {xl[2 * s], xh[2 * s], xl[2 * s + 1], xh[2 * s + 1]};
          mma_bf16_16816(acc[nt], a, b0, b1);
        }
      }
    }
  }
  // split-K reduction over the block's warps
#pragma unroll
  for (int nt = 0; nt < NT; ++nt)
#pragma unroll
    for (int i = 0; i < 4; ++i) red[warp][nt][i][lane] = acc[nt][i];
  __syncthreads();
  if (warp == 0) {
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      float c[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        float s = 0.f;
#pragma unroll
        for (int w2 = 0; w2 < kMmaWarps; ++w2) s += red[w2][nt][i][lane];
        c[i] = s;
      }
      // c0: (m = g, n = 2t), c1: (g, 2t + 1), c2: (g + 8, 2t), c3: (g + 8, 2t + 1)
      const int n = n_base + nt * 8 + 2 * t;
      if (g < p.M) {
        if (n < p.N) epilogue(p, g, n, c[0]);
        if (n + 1 < p.N) epilogue(p, g, n + 1, c[1]);
      }
      if (g + 8 < p.M) {
        if (n < p.N) epilogue(p, g + 8, n, c[2]);
        if (n + 1 < p.N) epilogue(p, g + 8, n + 1, c[3]);
      }
    }
  }
#else
  __trap();
#endif
}

// ---------------------------------------------------------------------------------------- scalar path
template <int MT>
__global__ void __launch_bounds__(128) int8_gemv_scalar(Int8LinearArgs p) {
  const int lane = threadIdx.x & 31;
  const int n = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
  if (n >= p.N) return;
  const int8_t* wr = p.w + static_cast<int64_t>(n) * p.sw;
  float acc[MT];
#pragma unroll
  for (int m = 0; m < MT; ++m) acc[m] = 0.f;
  for (int k = lane; k < p.K; k += 32) {
    const float wk = static_cast<float>(__ldg(wr + k));
#pragma unroll
    for (int m = 0; m < MT; ++m) {
      if (m >= p.M) break;
      const uint16_t xb = __ldg(p.x + static_cast<int64_t>(m) * p.sx + k);
      acc[m] = fmaf(__uint_as_float(static_cast<uint32_t>(xb) << 16), wk, acc[m]);
    }
  }
#pragma unroll
  for (int m = 0; m < MT; ++m) {
    const float v = warp_sum(acc[m]);
    if (m < p.M && lane == (m & 31)) epilogue(p, m, n, v);
  }
}

// ---------------------------------------------------------------------------------------------- launch
enum Int8Variant : int { kAuto = 0, kFma = 1, kMma = 2, kScalar = 3, kFmaSplitK = 4 };

// Auto (variant 0) runs fma_splitk rather than fma for M == 1 (false: fma, as before).
constexpr bool kAutoFmaSplitK = true;

template <int MT, int KSPLIT>
static cudaError_t launch_fma(const Int8LinearArgs& p, cudaStream_t stream) {
  constexpr int ROWS = 2, UNROLL = 4;
  const int groups = (p.N + ROWS - 1) / ROWS;
  int8_gemv_fma<MT, ROWS, UNROLL, KSPLIT>
      <<<(groups + kFmaGroups - 1) / kFmaGroups, 32 * kFmaGroups * KSPLIT, 0, stream>>>(p);
  return cudaGetLastError();
}

template <int MT>
static cudaError_t launch_scalar(const Int8LinearArgs& p, cudaStream_t stream) {
  constexpr int WARPS = 4;
  int8_gemv_scalar<MT><<<(p.N + WARPS - 1) / WARPS, WARPS * 32, 0, stream>>>(p);
  return cudaGetLastError();
}

static cudaError_t launch_mma(const Int8LinearArgs& p, cudaStream_t stream) {
  // 16 weight rows per block halves the x traffic of M > 8; 8 rows keep more blocks for small N.
  if (p.M > 8 && p.N >= 16 * 264) {
    int8_gemm_mma<2, 4><<<(p.N + 15) / 16, kMmaWarps * 32, 0, stream>>>(p);
  } else {
    int8_gemm_mma<1, 4><<<(p.N + 7) / 8, kMmaWarps * 32, 0, stream>>>(p);
  }
  return cudaGetLastError();
}

// Which kernel runs: the vector kernels need K % 16 == 0 and 16-byte aligned x / W rows; the tensor-core
// kernel needs sm_80+; the split-K form of fma exists for M == 1 (variant 4 runs fma above). Auto:
// fma_splitk (kAutoFmaSplitK) or fma for M == 1, fma for M == 2 (no padding waste, 2 rows of x reuse), mma above.
int int8_linear_pick(const Int8LinearArgs& p, int variant, int sm_major) {
  const bool vec_ok = (p.K % 16 == 0) && aligned16(p.x) && aligned16(p.w) && (p.sx % 8 == 0) && (p.sw % 16 == 0);
  if (!vec_ok || variant == kScalar) return kScalar;
  if (variant == kFma) return kFma;
  if (variant == kFmaSplitK) return p.M == 1 ? kFmaSplitK : kFma;
  if (variant == kMma) return sm_major >= 8 ? kMma : kFma;
  if (p.M == 1) return kAutoFmaSplitK ? kFmaSplitK : kFma;
  if (p.M == 2) return kFma;
  return sm_major < 8 ? kFma : kMma;
}

cudaError_t int8_linear_launch(const Int8LinearArgs& p, int variant, int sm_major, cudaStream_t stream) {
  if (p.M <= 0 || p.N <= 0) return cudaSuccess;
  const int kind = int8_linear_pick(p, variant, sm_major);
  if (kind == kMma) return launch_mma(p, stream);
  if (kind == kFmaSplitK) return launch_fma<1, 2>(p, stream);
  if (kind == kFma) {
    if (p.M <= 1) return launch_fma<1, 1>(p, stream);
    if (p.M <= 2) return launch_fma<2, 1>(p, stream);
    if (p.M <= 4) return launch_fma<4, 1>(p, stream);
    if (p.M <= 8) return launch_fma<8, 1>(p, stream);
    return launch_fma<16, 1>(p, stream);
  }
  if (p.M <= 1) return launch_scalar<1>(p, stream);
  if (p.M <= 4) return launch_scalar<4>(p, stream);
  return launch_scalar<16>(p, stream);
}

}  // namespace tsk

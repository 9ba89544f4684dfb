// Residual add + RMSNorm / LayerNorm over wide rows. One block per row: the row (x, and the residual r) is
// read once with 16-byte loads into registers, the residual sum h is written once when asked for, the
// statistics are block reductions (LayerNorm's variance is the exact two-pass sum of (h - mean)^2 from
// registers), and the normalized row is written once. fp32 arithmetic for every dtype.
//
//  * norm_kernel (variant 0): h is kept in registers in the tensor's own dtype, packed 16 bytes per vector
//    (h is rounded to the dtype anyway, so nothing is lost; a bf16 row of 4096 is 16 registers per thread at
//    128 threads instead of 32), the instantiations are capped at 64 registers (8 or more resident blocks of
//    128 threads per SM: 128 KB+ of row reads in flight, where 4 blocks of 128 registers gave 64 KB and long
//    idle phases), and each block reduction costs one barrier (every warp publishes its partial sum in its
//    own slot, every thread adds the slots in the same order).
//  * norm_kernel_v1 (variant 1): the previous kernel (fp32 registers, 3 barriers per reduction), kept to
//    compare against.
#include "common.cuh"
#include "norm.h"

namespace tsk {

template <int FLOATS>
struct NormThreads {
  static constexpr int value = FLOATS > 16 ? 512 : 1024;
};

// Blocks per SM the packed kernel asks ptxas to allow at its thread bound: 64 registers per thread for the
// vectorised instantiations with at most 4 packed vectors (16 data registers); the scalar paths and fp32 with
// 8 vectors (never picked for D <= 16384, where 4 vectors at 1024 threads hold the row) keep 128.
template <bool VEC, int NV, int FLOATS>
struct NormMinBlocks {
  static constexpr int value = (VEC && NV <= 4) ? 65536 / (NormThreads<FLOATS>::value * 64) : 1;
};

// Sum over the block with one barrier: `slots` holds 32 floats used by this reduction only (a kernel with
// two reductions gives each its own slots, so no barrier is needed before writing them). Every thread adds
// the warps' partial sums in the same order, so every thread gets the same value.
__device__ __forceinline__ float block_sum_1sync(float v, float* slots) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  v = warp_sum(v);
  if (nwarps == 1) return v;
  if (lane == 0) slots[warp] = v;
  __syncthreads();
  float t = 0.f;
  for (int w = 0; w < nwarps; ++w) t += slots[w];
  return t;
}

// Elements e .. e + VEC - 1 of one output row from h (fp32): (h - mean) * rstd * w + b (LayerNorm) or
// h * rstd [rounded] * w (RMSNorm), then stored; the weight and bias are read here. Shared by both kernels.
template <typename T, bool VEC, bool LN>
__device__ __forceinline__ void store_normalized(const NormArgs& p, T* out, long long e,
                                                 const float (&h)[Elem<T>::VEC], float mean, float rstd) {
  constexpr int V = Elem<T>::VEC;
  const T* w = static_cast<const T*>(p.w);
  const T* b = static_cast<const T*>(p.b);
  float wv[V], bv[V];
  if constexpr (VEC) {
    if (w) Elem<T>::unpack(ld_cached(w + e), wv);
    if (LN && b) Elem<T>::unpack(ld_cached(b + e), bv);
  } else {
#pragma unroll
    for (int k = 0; k < V; ++k) {
      const bool ok = e + k < p.D;
      wv[k] = (w && ok) ? Elem<T>::get(w, e + k) : 1.f;
      bv[k] = (LN && b && ok) ? Elem<T>::get(b, e + k) : 0.f;
    }
  }
  float o[V];
#pragma unroll
  for (int k = 0; k < V; ++k) {
    float y = LN ? (h[k] - mean) * rstd : h[k] * rstd;
    if (w) {
      if (!LN && p.round_before_weight) y = Elem<T>::round(y);
      y *= wv[k];
    }
    if (LN && b) y += bv[k];
    o[k] = y;
  }
  if constexpr (VEC) {
    st_stream(out + e, Elem<T>::pack(o));
  } else {
#pragma unroll
    for (int k = 0; k < V; ++k)
      if (e + k < p.D) Elem<T>::put(out, e + k, o[k]);
  }
}

template <typename T, int NV, bool VEC, bool LN>
__global__ void __launch_bounds__(NormThreads<NV * Elem<T>::VEC>::value, NormMinBlocks<VEC, NV, NV * Elem<T>::VEC>::value)
    norm_kernel(NormArgs p) {
  constexpr int V = Elem<T>::VEC;
  __shared__ float slots[2][32];
  const long long row = blockIdx.x;
  const long long step = static_cast<long long>(blockDim.x) * V;
  const long long e0 = static_cast<long long>(threadIdx.x) * V;
  const T* x = static_cast<const T*>(p.x) + row * p.sx;
  const T* r = p.r ? static_cast<const T*>(p.r) + row * p.sr : nullptr;
  uint4 hv[NV];  // h, rounded to T, packed (padding vectors and elements: 0)
  if constexpr (VEC) {
    uint4 xv[NV], rv[NV];
#pragma unroll
    for (int i = 0; i < NV; ++i) {  // every load issued before any is used
      const long long e = e0 + i * step;
      xv[i] = e < p.D ? ld_stream(x + e) : make_uint4(0, 0, 0, 0);
      if (r) rv[i] = e < p.D ? ld_stream(r + e) : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int i = 0; i < NV; ++i) {
      if (r) {
        float a[V], b[V];
        Elem<T>::unpack(xv[i], a);
        Elem<T>::unpack(rv[i], b);
#pragma unroll
        for (int k = 0; k < V; ++k) a[k] += b[k];
        hv[i] = Elem<T>::pack(a);  // the rounding of the FX add (round to nearest even)
      } else {
        hv[i] = xv[i];
      }
    }
  } else {
#pragma unroll
    for (int i = 0; i < NV; ++i) {
      float h[V];
#pragma unroll
      for (int k = 0; k < V; ++k) {
        const long long j = e0 + i * step + k;
        float v = j < p.D ? Elem<T>::get(x, j) : 0.f;
        if (r && j < p.D) v += Elem<T>::get(r, j);
        h[k] = v;
      }
      hv[i] = Elem<T>::pack(h);
    }
  }
  if (p.h) {
    T* h = static_cast<T*>(p.h) + row * p.sh;
#pragma unroll
    for (int i = 0; i < NV; ++i) {
      const long long e = e0 + i * step;
      if constexpr (VEC) {
        if (e < p.D) st_stream(h + e, hv[i]);
      } else {
        float f[V];
        Elem<T>::unpack(hv[i], f);
#pragma unroll
        for (int k = 0; k < V; ++k)
          if (e + k < p.D) Elem<T>::put(h, e + k, f[k]);
      }
    }
  }
  float sum = 0.f;
#pragma unroll
  for (int i = 0; i < NV; ++i) {
    float f[V];
    Elem<T>::unpack(hv[i], f);
#pragma unroll
    for (int k = 0; k < V; ++k) sum += LN ? f[k] : f[k] * f[k];  // padding elements are 0
  }
  const float inv_d = 1.f / static_cast<float>(p.D);
  float mean = 0.f, rstd;
  if constexpr (LN) {
    mean = block_sum_1sync(sum, slots[0]) * inv_d;
    float sq = 0.f;
#pragma unroll
    for (int i = 0; i < NV; ++i) {
      float f[V];
      Elem<T>::unpack(hv[i], f);
#pragma unroll
      for (int k = 0; k < V; ++k) {
        const bool ok = e0 + i * step + k < p.D;
        const float d = f[k] - mean;
        sq += ok ? d * d : 0.f;
      }
    }
    rstd = rsqrtf(block_sum_1sync(sq, slots[1]) * inv_d + p.eps);
  } else {
    rstd = rsqrtf(block_sum_1sync(sum, slots[0]) * inv_d + p.eps);
  }
  T* out = static_cast<T*>(p.out) + row * p.sout;
#pragma unroll
  for (int i = 0; i < NV; ++i) {
    const long long e = e0 + i * step;
    if (e >= p.D) continue;
    float hf[V];
    Elem<T>::unpack(hv[i], hf);
    store_normalized<T, VEC, LN>(p, out, e, hf, mean, rstd);
  }
}

// The previous kernel (variant 1): h in fp32 registers, block_sum with three barriers.
template <typename T, int NV, bool VEC, bool LN>
__global__ void __launch_bounds__(NormThreads<NV * Elem<T>::VEC>::value, 1) norm_kernel_v1(NormArgs p) {
  constexpr int V = Elem<T>::VEC;
  __shared__ float scratch[33];
  const long long row = blockIdx.x;
  const long long step = static_cast<long long>(blockDim.x) * V;
  const long long e0 = static_cast<long long>(threadIdx.x) * V;
  const T* x = static_cast<const T*>(p.x) + row * p.sx;
  const T* r = p.r ? static_cast<const T*>(p.r) + row * p.sr : nullptr;
  float v[NV][V];
  float sum = 0.f;
#pragma unroll
  for (int i = 0; i < NV; ++i) {
    const long long e = e0 + i * step;
    if constexpr (VEC) {
      if (e < p.D) {
        Elem<T>::unpack(ld_stream(x + e), v[i]);
        if (r) {
          float rv[V];
          Elem<T>::unpack(ld_stream(r + e), rv);
#pragma unroll
          for (int k = 0; k < V; ++k) v[i][k] = Elem<T>::round(v[i][k] + rv[k]);
        }
      } else {
#pragma unroll
        for (int k = 0; k < V; ++k) v[i][k] = 0.f;
      }
    } else {
#pragma unroll
      for (int k = 0; k < V; ++k) {
        const long long j = e + k;
        float h = j < p.D ? Elem<T>::get(x, j) : 0.f;
        if (r && j < p.D) h = Elem<T>::round(h + Elem<T>::get(r, j));
        v[i][k] = h;
      }
    }
#pragma unroll
    for (int k = 0; k < V; ++k) sum += LN ? v[i][k] : v[i][k] * v[i][k];  // padding elements are 0
  }
  if (p.h) {
    T* h = static_cast<T*>(p.h) + row * p.sh;
#pragma unroll
    for (int i = 0; i < NV; ++i) {
      const long long e = e0 + i * step;
      if constexpr (VEC) {
        if (e < p.D) st_stream(h + e, Elem<T>::pack(v[i]));
      } else {
#pragma unroll
        for (int k = 0; k < V; ++k)
          if (e + k < p.D) Elem<T>::put(h, e + k, v[i][k]);
      }
    }
  }
  const float inv_d = 1.f / static_cast<float>(p.D);
  float mean = 0.f, rstd;
  if constexpr (LN) {
    mean = block_sum(sum, scratch) * inv_d;
    float sq = 0.f;
#pragma unroll
    for (int i = 0; i < NV; ++i)
#pragma unroll
      for (int k = 0; k < V; ++k) {
        const bool ok = e0 + i * step + k < p.D;
        const float d = v[i][k] - mean;
        sq += ok ? d * d : 0.f;
      }
    rstd = rsqrtf(block_sum(sq, scratch) * inv_d + p.eps);
  } else {
    rstd = rsqrtf(block_sum(sum, scratch) * inv_d + p.eps);
  }
  T* out = static_cast<T*>(p.out) + row * p.sout;
#pragma unroll
  for (int i = 0; i < NV; ++i) {
    const long long e = e0 + i * step;
    if (e < p.D) store_normalized<T, VEC, LN>(p, out, e, v[i], mean, rstd);
  }
}

// ---------------------------------------------------------------------------------------------- launch
constexpr int kMaxFloats = 32;

static long long threads_for(int floats) { return floats > 16 ? 512 : 1024; }

long long norm_max_d(int dtype) {
  const int v = dtype == kF32 ? 4 : 8;
  long long best = 0;
  for (int nv = 1; nv * v <= kMaxFloats; nv *= 2) {
    const long long cap = threads_for(nv * v) * nv * v;
    best = cap > best ? cap : best;
  }
  return best;
}

template <typename T, int NV, bool VEC, bool LN>
static void launch_nv(const NormArgs& p, int variant, unsigned grid, int threads, cudaStream_t stream) {
  if (variant == 1) {
    norm_kernel_v1<T, NV, VEC, LN><<<grid, threads, 0, stream>>>(p);
  } else {
    norm_kernel<T, NV, VEC, LN><<<grid, threads, 0, stream>>>(p);
  }
}

template <typename T, bool VEC, bool LN>
static cudaError_t launch_typed(const NormArgs& p, int variant, cudaStream_t stream) {
  constexpr int V = Elem<T>::VEC;
  const long long nvec = (p.D + V - 1) / V;
  int nv = 4 * V <= kMaxFloats ? 4 : kMaxFloats / V;
  while (nv > 1 && (nvec + nv - 1) / nv < 128) nv /= 2;
  while (nv * V < kMaxFloats && (nvec + nv - 1) / nv > threads_for(nv * V)) nv *= 2;
  if ((nvec + nv - 1) / nv > threads_for(nv * V)) return cudaErrorInvalidValue;  // the binding refuses first
  const int threads = static_cast<int>(max(32LL, ((nvec + nv - 1) / nv + 31) / 32 * 32));
  const unsigned grid = static_cast<unsigned>(p.rows);
  switch (nv) {
    case 1: launch_nv<T, 1, VEC, LN>(p, variant, grid, threads, stream); break;
    case 2: launch_nv<T, 2, VEC, LN>(p, variant, grid, threads, stream); break;
    case 4:
      if constexpr (4 * V <= kMaxFloats) launch_nv<T, 4, VEC, LN>(p, variant, grid, threads, stream);
      break;
    default:
      if constexpr (8 * V <= kMaxFloats) launch_nv<T, 8, VEC, LN>(p, variant, grid, threads, stream);
      break;
  }
  return cudaGetLastError();
}

template <typename T>
static cudaError_t launch_dtype(const NormArgs& p, int variant, cudaStream_t stream) {
  constexpr int V = Elem<T>::VEC;
  bool vec = p.D % V == 0 && aligned16(p.x) && aligned16(p.out) && p.sx % V == 0 && p.sout % V == 0;
  if (p.r) vec = vec && aligned16(p.r) && p.sr % V == 0;
  if (p.h) vec = vec && aligned16(p.h) && p.sh % V == 0;
  if (p.w) vec = vec && aligned16(p.w);
  if (p.b) vec = vec && aligned16(p.b);
  if (p.layer_norm)
    return vec ? launch_typed<T, true, true>(p, variant, stream) : launch_typed<T, false, true>(p, variant, stream);
  return vec ? launch_typed<T, true, false>(p, variant, stream) : launch_typed<T, false, false>(p, variant, stream);
}

cudaError_t norm_launch(const NormArgs& p, int variant, cudaStream_t stream) {
  if (p.rows <= 0 || p.D <= 0) return cudaSuccess;
  if (p.dtype == kF32) return launch_dtype<float>(p, variant, stream);
  if (p.dtype == kBF16) return launch_dtype<__nv_bfloat16>(p, variant, stream);
  return launch_dtype<__half>(p, variant, stream);
}

}  // namespace tsk

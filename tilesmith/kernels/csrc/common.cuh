// Shared device helpers of Tilesmith's native kernels (CUDA C++, no torch headers).
//
// Conventions: every kernel accumulates in fp32; tensors of float / bf16 / fp16 are passed as raw pointers
// with a DType code; 16-byte vector accesses are used only when the launcher proved the base pointer,
// every row stride and the row length aligned (otherwise the scalar instantiation runs).
#pragma once

#include <cuda_runtime.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

namespace tsk {

enum DType : int { kF32 = 0, kBF16 = 1, kF16 = 2 };

// ---------------------------------------------------------------------------------------- conversions
__device__ __forceinline__ float bf16_lo(uint32_t w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float bf16_hi(uint32_t w) { return __uint_as_float(w & 0xffff0000u); }

__device__ __forceinline__ float h16_lo(uint32_t w) {
  return __half2float(__ushort_as_half(static_cast<unsigned short>(w & 0xffffu)));
}
__device__ __forceinline__ float h16_hi(uint32_t w) {
  return __half2float(__ushort_as_half(static_cast<unsigned short>(w >> 16)));
}

__device__ __forceinline__ uint32_t pack_bf16x2(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}
__device__ __forceinline__ uint32_t pack_f16x2(float lo, float hi) {
  __half2 v = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}

// Element access by dtype (the scalar paths and the small epilogues).
__device__ __forceinline__ float load_as_float(const void* p, int dtype, int64_t i) {
  if (dtype == kF32) return __ldg(static_cast<const float*>(p) + i);
  const unsigned short bits = __ldg(static_cast<const unsigned short*>(p) + i);
  if (dtype == kBF16) return __uint_as_float(static_cast<uint32_t>(bits) << 16);
  return __half2float(__ushort_as_half(bits));
}

__device__ __forceinline__ void store_from_float(void* p, int dtype, int64_t i, float v) {
  if (dtype == kF32) {
    static_cast<float*>(p)[i] = v;
  } else if (dtype == kBF16) {
    static_cast<__nv_bfloat16*>(p)[i] = __float2bfloat16_rn(v);
  } else {
    static_cast<__half*>(p)[i] = __float2half_rn(v);
  }
}

// Typed traits: T is float, __nv_bfloat16 or __half; VEC elements fill 16 bytes.
template <typename T> struct Elem;
template <> struct Elem<float> {
  static constexpr int VEC = 4;
  __device__ static __forceinline__ float get(const float* p, int64_t i) { return __ldg(p + i); }
  __device__ static __forceinline__ void put(float* p, int64_t i, float v) { p[i] = v; }
  __device__ static __forceinline__ void unpack(const uint4& u, float (&f)[4]) {
    f[0] = __uint_as_float(u.x); f[1] = __uint_as_float(u.y); f[2] = __uint_as_float(u.z); f[3] = __uint_as_float(u.w);
  }
  __device__ static __forceinline__ uint4 pack(const float (&f)[4]) {
    return make_uint4(__float_as_uint(f[0]), __float_as_uint(f[1]), __float_as_uint(f[2]), __float_as_uint(f[3]));
  }
  __device__ static __forceinline__ float round(float v) { return v; }
};
template <> struct Elem<__nv_bfloat16> {
  static constexpr int VEC = 8;
  __device__ static __forceinline__ float get(const __nv_bfloat16* p, int64_t i) {
    return __uint_as_float(static_cast<uint32_t>(__ldg(reinterpret_cast<const unsigned short*>(p) + i)) << 16);
  }
  __device__ static __forceinline__ void put(__nv_bfloat16* p, int64_t i, float v) { p[i] = __float2bfloat16_rn(v); }
  __device__ static __forceinline__ void unpack(const uint4& u, float (&f)[8]) {
    f[0] = bf16_lo(u.x); f[1] = bf16_hi(u.x); f[2] = bf16_lo(u.y); f[3] = bf16_hi(u.y);
    f[4] = bf16_lo(u.z); f[5] = bf16_hi(u.z); f[6] = bf16_lo(u.w); f[7] = bf16_hi(u.w);
  }
  __device__ static __forceinline__ uint4 pack(const float (&f)[8]) {
    return make_uint4(pack_bf16x2(f[0], f[1]), pack_bf16x2(f[2], f[3]), pack_bf16x2(f[4], f[5]),
                      pack_bf16x2(f[6], f[7]));
  }
  __device__ static __forceinline__ float round(float v) { return __bfloat162float(__float2bfloat16_rn(v)); }
};
template <> struct Elem<__half> {
  static constexpr int VEC = 8;
  __device__ static __forceinline__ float get(const __half* p, int64_t i) {
    return __half2float(__ushort_as_half(__ldg(reinterpret_cast<const unsigned short*>(p) + i)));
  }
  __device__ static __forceinline__ void put(__half* p, int64_t i, float v) { p[i] = __float2half_rn(v); }
  __device__ static __forceinline__ void unpack(const uint4& u, float (&f)[8]) {
    f[0] = h16_lo(u.x); f[1] = h16_hi(u.x); f[2] = h16_lo(u.y); f[3] = h16_hi(u.y);
    f[4] = h16_lo(u.z); f[5] = h16_hi(u.z); f[6] = h16_lo(u.w); f[7] = h16_hi(u.w);
  }
  __device__ static __forceinline__ uint4 pack(const float (&f)[8]) {
    return make_uint4(pack_f16x2(f[0], f[1]), pack_f16x2(f[2], f[3]), pack_f16x2(f[4], f[5]), pack_f16x2(f[6], f[7]));
  }
  __device__ static __forceinline__ float round(float v) { return __half2float(__float2half_rn(v)); }
};

// ------------------------------------------------------------------------------------- memory access
// 16-byte load of data read once (streamed): no L1 allocation, so what is reused (activations, weights
// of a norm) keeps the cache. Read-only path: the kernels never write what they read this way.
__device__ __forceinline__ uint4 ld_stream(const void* p) {
  uint4 v;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 750
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
#else
  v = __ldg(static_cast<const uint4*>(p));
#endif
  return v;
}

// 16-byte load of data that is reused (cached in L1 and L2).
__device__ __forceinline__ uint4 ld_cached(const void* p) { return __ldg(static_cast<const uint4*>(p)); }

// 16-byte store of a result nobody reads back in this kernel (evict-first streaming store).
__device__ __forceinline__ void st_stream(void* p, const uint4& v) { __stcs(static_cast<uint4*>(p), v); }

__host__ __device__ __forceinline__ bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

// ------------------------------------------------------------------------------------------ reductions
// NaN-propagating max (torch.amax semantics: any NaN makes the result NaN).
__device__ __forceinline__ float nan_max(float a, float b) { return (a > b || a != a) ? a : b; }

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// Sum over the block (blockDim.x a multiple of 32, at most 1024); every thread gets the result.
// `scratch` holds 33 floats of shared memory; the function ends with a barrier-safe read.
__device__ __forceinline__ float block_sum(float v, float* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  v = warp_sum(v);
  if (nwarps == 1) return v;
  __syncthreads();  // scratch may still be read by a previous reduction
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  if (warp == 0) {
    float t = lane < nwarps ? scratch[lane] : 0.f;
    t = warp_sum(t);
    if (lane == 0) scratch[32] = t;
  }
  __syncthreads();
  return scratch[32];
}

// Online-softmax statistics: running max m and sum s of exp(x - m). The identity is s == 0 (a thread
// that saw no finite-max element); a row whose elements are all -inf keeps s == 0 and ends as NaN, as
// torch.softmax does; NaN and +inf propagate to NaN like the eager max/sub/exp/sum/div chain.
struct MaxSum {
  float m, s;
};

__device__ __forceinline__ MaxSum combine(MaxSum a, MaxSum b) {
  if (a.s == 0.f) return b;
  if (b.s == 0.f) return a;
  const float m = nan_max(a.m, b.m);
  return {m, a.s * __expf(a.m - m) + b.s * __expf(b.m - m)};
}

__device__ __forceinline__ MaxSum warp_combine(MaxSum v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    MaxSum other{__shfl_xor_sync(0xffffffffu, v.m, o), __shfl_xor_sync(0xffffffffu, v.s, o)};
    v = combine(v, other);
  }
  return v;
}

// Block-wide combine of NSTAT independent statistics; scratch holds 2 * NSTAT * 33 floats.
template <int NSTAT>
__device__ __forceinline__ void block_combine(MaxSum (&v)[NSTAT], float* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
#pragma unroll
  for (int q = 0; q < NSTAT; ++q) v[q] = warp_combine(v[q]);
  if (nwarps == 1) return;
  __syncthreads();  // scratch may still be read by a previous reduction
  if (lane == 0) {
#pragma unroll
    for (int q = 0; q < NSTAT; ++q) {
      scratch[(2 * q) * 33 + warp] = v[q].m;
      scratch[(2 * q + 1) * 33 + warp] = v[q].s;
    }
  }
  __syncthreads();
  if (warp == 0) {
#pragma unroll
    for (int q = 0; q < NSTAT; ++q) {
      MaxSum t = lane < nwarps ? MaxSum{scratch[(2 * q) * 33 + lane], scratch[(2 * q + 1) * 33 + lane]}
                               : MaxSum{-INFINITY, 0.f};
      t = warp_combine(t);
      if (lane == 0) {
        scratch[(2 * q) * 33 + 32] = t.m;
        scratch[(2 * q + 1) * 33 + 32] = t.s;
      }
    }
  }
  __syncthreads();
#pragma unroll
  for (int q = 0; q < NSTAT; ++q) v[q] = MaxSum{scratch[(2 * q) * 33 + 32], scratch[(2 * q + 1) * 33 + 32]};
}

}  // namespace tsk

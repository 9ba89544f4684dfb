// GroupNorm (+ optional affine, + optional SiLU) over contiguous NCHW tensors. x is seen as [N, G, L]: each
// (n, g) group is one contiguous span of L = (C / G) * HW elements, normalized with its own mean and biased
// variance (fp32), then scaled per channel, activated and rounded once to the output dtype.
//
//  * gn_register_kernel (kernel 1, auto when the group fits): the group is read from DRAM exactly once, into
//    registers, and written once. One block holds up to 512 threads x NV 16-byte vectors; a group larger than
//    one block is split across a thread-block cluster of up to 8 blocks (sm_90), which merge their statistics
//    through distributed shared memory. At the benchmark shape (bf16 16x512x64x64, G = 32: 512 groups of
//    65536 elements = 128 KB) that is a cluster of 8 blocks of 128 threads x 8 vectors (16 KB per block,
//    4096 blocks). Why registers and not a second pass over L2: all 512 groups in flight are the whole 67 MB
//    tensor, more than the 50 MB L2, so a re-read would partly come from DRAM again; and why 128 threads x 8
//    vectors: the instantiations are capped at 64 registers (8 resident blocks of 128 threads per SM), of
//    which 32 hold data, so half the register file (128 KB per SM) can be reads in flight.
//  * gn_looped_kernel (kernel 2; 3 = its scalar instantiation): groups too large for the register kernel, or
//    a variant forcing it. Pass 1 streams the block's slice of the group (4 vectors per thread in flight) into
//    per-chunk exact statistics merged into per-thread (n, mean, M2); pass 2 re-reads the slice in reverse
//    order (the most recently read data first: L2 hits where the slice still is there) and writes. The scalar
//    instantiation takes any size and alignment (odd HW, C / G * HW not a multiple of 8, offset views).
//
// Statistics: each thread computes its elements' mean and M2 exactly (two passes over registers or over one
// chunk), then threads, warps, blocks and cluster ranks merge (n, mean, M2) with Chan et al.'s formula in a
// fixed order, so every block of a group ends with bit-identical mean and rstd. Normalization and SiLU follow
// the FX program Inductor receives: y = (x - mean) * (rstd * w[c]) + b[c] in fp32, optionally rounded to the
// dtype (round_mid), then y / (1 + exp(-y)) with __expf and __fdividef (ex2.approx / rcp.approx), rounded once.
#include <cooperative_groups.h>

#include <type_traits>

#include "common.cuh"
#include "group_norm.h"

namespace tsk {

constexpr int kGnMaxThreads = 512;  // register kernel: threads per block at most (64 registers at 2 blocks/SM)
constexpr int kGnMaxCluster = 8;    // portable cluster size
constexpr int kGnLoopThreads = 256;

// Division by a fixed 32-bit divisor with a multiply-high (Granlund-Montgomery, as PyTorch's IntDivider);
// exact for dividends below 2^31 (the binding keeps each group below 2^30 elements).
struct FastDiv {
  uint32_t d, m, s;
};

static FastDiv make_fastdiv(uint32_t d) {
  uint32_t s = 0;
  while (s < 32 && (1ull << s) < d) ++s;
  const uint64_t m = ((1ull << 32) * ((1ull << s) - d)) / d + 1;
  return {d, static_cast<uint32_t>(m), s};
}

__device__ __forceinline__ uint32_t fast_div(const FastDiv& f, uint32_t n) { return (__umulhi(n, f.m) + n) >> f.s; }

// ------------------------------------------------------------------------------------------- statistics
struct GnStats {
  float n, mean, m2;  // element count, mean, sum of squared deviations from the mean
};

__device__ __forceinline__ GnStats gn_merge(GnStats a, GnStats b) {
  if (b.n == 0.f) return a;
  if (a.n == 0.f) return b;
  const float n = a.n + b.n;
  const float fb = b.n / n;
  const float d = b.mean - a.mean;
  return {n, fmaf(d, fb, a.mean), a.m2 + b.m2 + d * d * a.n * fb};
}

__device__ __forceinline__ GnStats gn_shfl_down(const GnStats& s, int o) {
  return {__shfl_down_sync(0xffffffffu, s.n, o), __shfl_down_sync(0xffffffffu, s.mean, o),
          __shfl_down_sync(0xffffffffu, s.m2, o)};
}

__device__ __forceinline__ GnStats gn_shfl(const GnStats& s, int lane) {
  return {__shfl_sync(0xffffffffu, s.n, lane), __shfl_sync(0xffffffffu, s.mean, lane),
          __shfl_sync(0xffffffffu, s.m2, lane)};
}

// The block's statistics, identical in every thread: each warp reduces to its lane 0, which publishes in its
// own slot; after one barrier every thread merges the warps' statistics in warp order. `slots`: [3][32] floats
// used by this call only.
__device__ __forceinline__ GnStats gn_block_merge(GnStats s, float (*slots)[32]) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) s = gn_merge(s, gn_shfl_down(s, o));
  if (lane == 0) {
    slots[0][warp] = s.n;
    slots[1][warp] = s.mean;
    slots[2][warp] = s.m2;
  }
  __syncthreads();
  GnStats t{slots[0][0], slots[1][0], slots[2][0]};
  for (int w = 1; w < nwarps; ++w) t = gn_merge(t, GnStats{slots[0][w], slots[1][w], slots[2][w]});
  return t;
}

// The group's statistics from the cluster's blocks (CLUSTER; sm_90): every block publishes its statistics in
// its shared memory, one cluster barrier, then lane r of every warp reads rank r's through distributed shared
// memory and every thread merges ranks 0, 1, ... in order (bit-identical in every block). The arrive half of
// the exit barrier follows at once; gn_cluster_exit waits for it, so no block's shared memory goes away while
// another block may still read it.
template <bool CLUSTER>
__device__ __forceinline__ GnStats gn_cluster_merge(GnStats s, float* pub) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if constexpr (CLUSTER) {
    namespace cg = cooperative_groups;
    cg::cluster_group cluster = cg::this_cluster();
    if (threadIdx.x == 0) {
      pub[0] = s.n;
      pub[1] = s.mean;
      pub[2] = s.m2;
    }
    cluster.sync();
    const int lane = threadIdx.x & 31;
    const int size = static_cast<int>(cluster.num_blocks());
    GnStats mine{0.f, 0.f, 0.f};
    if (lane < size) {
      const float* remote = cluster.map_shared_rank(pub, lane);
      mine = GnStats{remote[0], remote[1], remote[2]};
    }
    GnStats t = gn_shfl(mine, 0);
    for (int r = 1; r < size; ++r) t = gn_merge(t, gn_shfl(mine, r));
    cluster.barrier_arrive();
    return t;
  }
#endif
  return s;
}

template <bool CLUSTER>
__device__ __forceinline__ void gn_cluster_exit() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if constexpr (CLUSTER) cooperative_groups::this_cluster().barrier_wait();
#endif
}

// Makes the compiler treat v as rewritten: it must unpack it again instead of keeping the unpacked floats of an
// earlier pass live (for bf16 at NV = 8 that CSE holds 64 floats and spills).
__device__ __forceinline__ void gn_opaque(uint4& v) {
  asm volatile("" : "+r"(v.x), "+r"(v.y), "+r"(v.z), "+r"(v.w));
}

// ---------------------------------------------------------------------------------------- normalization
// Per-channel factors of y = (x - mean) * scale + shift for absolute channel gc.
__device__ __forceinline__ void gn_coef(const GroupNormArgs& p, long long gc, float rstd, float& scale, float& shift) {
  scale = p.w ? rstd * load_as_float(p.w, p.w_dtype, gc) : rstd;
  shift = p.b ? load_as_float(p.b, p.b_dtype, gc) : 0.f;
}

template <typename T>
__device__ __forceinline__ float gn_finish(const GroupNormArgs& p, float y) {
  if (p.round_mid) y = Elem<T>::round(y);
  if (p.silu) y = __fdividef(y, 1.f + __expf(-y));  // -inf / inf and NaN give NaN, like the FX division
  return y;
}

// --------------------------------------------------------------------------------------- register kernel
// Block `blockIdx.x` handles rank `blockIdx.x % cluster` of group `blockIdx.x / cluster` (a cluster's blocks
// are consecutive): vectors [rank * per_block, (rank + 1) * per_block) of the group, thread t holding vectors
// t, t + blockDim.x, ... (each warp load covers 512 contiguous bytes). Requires L % VEC == 0, HW % VEC == 0
// (a vector lies in one channel) and 16-byte aligned x and out.
template <typename T, int NV, bool CLUSTER>
__global__ void __launch_bounds__(kGnMaxThreads, 2)
    gn_register_kernel(GroupNormArgs p, FastDiv hw, int L, int cluster, int per_block) {
  constexpr int V = Elem<T>::VEC;
  __shared__ float slots[3][32];
  __shared__ float pub[3];
  const long long group = blockIdx.x / cluster;
  const int rank = static_cast<int>(blockIdx.x % cluster);
  const int v0 = rank * per_block;
  const int v1 = min(L / V, v0 + per_block);
  const T* x = static_cast<const T*>(p.x) + group * L;
  // Thread t holds vectors first, first + blockDim.x, ...: the valid ones are a prefix of `valid` (< NV)
  // vectors, so one count replaces a predicate per vector (fewer live registers at NV = 8).
  const int first = v0 + static_cast<int>(threadIdx.x);
  const int stride = static_cast<int>(blockDim.x);
  const int valid = first < v1 ? min(NV, (v1 - first + stride - 1) / stride) : 0;
  uint4 xv[NV];
#pragma unroll
  for (int i = 0; i < NV; ++i)  // every load issued before any is used
    xv[i] = i < valid ? ld_stream(x + static_cast<long long>(first + i * stride) * V) : make_uint4(0, 0, 0, 0);
  float sum = 0.f;
#pragma unroll
  for (int i = 0; i < NV; ++i) {
    float f[V];
    Elem<T>::unpack(xv[i], f);
#pragma unroll
    for (int k = 0; k < V; ++k) sum += f[k];  // padding vectors are 0
  }
  const int count = valid * V;
#pragma unroll
  for (int i = 0; i < NV; ++i) gn_opaque(xv[i]);
  const float mean_t = count ? sum / static_cast<float>(count) : 0.f;
  float m2 = 0.f;
#pragma unroll
  for (int i = 0; i < NV; ++i) {
    float f[V];
    Elem<T>::unpack(xv[i], f);
#pragma unroll
    for (int k = 0; k < V; ++k) {
      const float d = i < valid ? f[k] - mean_t : 0.f;
      m2 = fmaf(d, d, m2);
    }
  }
#pragma unroll
  for (int i = 0; i < NV; ++i) gn_opaque(xv[i]);
  GnStats s = gn_block_merge(GnStats{static_cast<float>(count), mean_t, m2}, slots);
  s = gn_cluster_merge<CLUSTER>(s, pub);
  const float mean = s.mean;
  const float rstd = rsqrtf(s.m2 / s.n + p.eps);
  const long long c0 = (group % p.G) * (p.C / p.G);
  T* out = static_cast<T*>(p.out) + group * L;
#pragma unroll
  for (int i = 0; i < NV; ++i) {
    if (i >= valid) break;
    const int v = first + i * stride;
    float scale, shift;
    gn_coef(p, c0 + fast_div(hw, static_cast<uint32_t>(v * V)), rstd, scale, shift);
    float f[V];
    Elem<T>::unpack(xv[i], f);
#pragma unroll
    for (int k = 0; k < V; ++k) f[k] = gn_finish<T>(p, fmaf(f[k] - mean, scale, shift));
    st_stream(out + static_cast<long long>(v) * V, Elem<T>::pack(f));
  }
  gn_cluster_exit<CLUSTER>();
}

// ----------------------------------------------------------------------------------------- looped kernel
// Units are 16-byte vectors (VEC: same requirements as the register kernel) or single elements (any size and
// alignment). Block rank r of a group's cluster handles units [r * per_block, (r + 1) * per_block), in chunks
// of U units per thread (consecutive threads on consecutive units).
template <typename T, bool VEC>
struct GnUnit {
  static constexpr int W = VEC ? Elem<T>::VEC : 1;  // elements per unit
  static constexpr int U = VEC ? 4 : 8;             // units per thread per chunk (loads in flight)
  using Raw = typename std::conditional<VEC, uint4, float>::type;
  template <bool STREAM>
  __device__ static __forceinline__ Raw load(const T* x, int unit) {
    if constexpr (VEC) {
      return STREAM ? ld_stream(x + static_cast<long long>(unit) * W) : ld_cached(x + static_cast<long long>(unit) * W);
    } else {
      return Elem<T>::get(x, unit);
    }
  }
  __device__ static __forceinline__ void unpack(const Raw& r, float (&f)[W]) {
    if constexpr (VEC) {
      Elem<T>::unpack(r, f);
    } else {
      f[0] = r;
    }
  }
  __device__ static __forceinline__ void store(T* out, int unit, const float (&f)[W]) {
    if constexpr (VEC) {
      st_stream(out + static_cast<long long>(unit) * W, Elem<T>::pack(f));
    } else {
      Elem<T>::put(out, unit, f[0]);
    }
  }
};

template <typename T, bool VEC, bool CLUSTER>
__global__ void __launch_bounds__(kGnLoopThreads, 4)
    gn_looped_kernel(GroupNormArgs p, FastDiv hw, int L, int cluster, int per_block) {
  using Unit = GnUnit<T, VEC>;
  constexpr int W = Unit::W, U = Unit::U;
  __shared__ float slots[3][32];
  __shared__ float pub[3];
  const long long group = blockIdx.x / cluster;
  const int rank = static_cast<int>(blockIdx.x % cluster);
  const int u0 = rank * per_block;
  const int u1 = min(L / W, u0 + per_block);
  const int step = static_cast<int>(blockDim.x) * U;
  const int tid = static_cast<int>(threadIdx.x);
  const T* x = static_cast<const T*>(p.x) + group * L;
  GnStats acc{0.f, 0.f, 0.f};
  for (int base = u0; base < u1; base += step) {
    typename Unit::Raw raw[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int unit = base + u * static_cast<int>(blockDim.x) + tid;
      raw[u] = unit < u1 ? Unit::template load<false>(x, unit) : typename Unit::Raw{};
    }
    int count = 0;
    float sum = 0.f;
#pragma unroll
    for (int u = 0; u < U; ++u) {
      float f[W];
      Unit::unpack(raw[u], f);
#pragma unroll
      for (int k = 0; k < W; ++k) sum += f[k];  // padding units are 0
      count += base + u * static_cast<int>(blockDim.x) + tid < u1 ? W : 0;
    }
    if (count == 0) continue;
    const float m = sum / static_cast<float>(count);
    float m2 = 0.f;
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if (base + u * static_cast<int>(blockDim.x) + tid >= u1) continue;
      float f[W];
      Unit::unpack(raw[u], f);
#pragma unroll
      for (int k = 0; k < W; ++k) {
        const float d = f[k] - m;
        m2 = fmaf(d, d, m2);
      }
    }
    acc = gn_merge(acc, GnStats{static_cast<float>(count), m, m2});
  }
  GnStats s = gn_block_merge(acc, slots);
  s = gn_cluster_merge<CLUSTER>(s, pub);
  const float mean = s.mean;
  const float rstd = rsqrtf(s.m2 / s.n + p.eps);
  const long long c0 = (group % p.G) * (p.C / p.G);
  T* out = static_cast<T*>(p.out) + group * L;
  const int chunks = u1 > u0 ? (u1 - u0 + step - 1) / step : 0;
  for (int ch = chunks - 1; ch >= 0; --ch) {  // reverse: the most recently read data first
    const int base = u0 + ch * step;
    typename Unit::Raw raw[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int unit = base + u * static_cast<int>(blockDim.x) + tid;
      raw[u] = unit < u1 ? Unit::template load<true>(x, unit) : typename Unit::Raw{};
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int unit = base + u * static_cast<int>(blockDim.x) + tid;
      if (unit >= u1) continue;
      float scale, shift;
      gn_coef(p, c0 + fast_div(hw, static_cast<uint32_t>(unit * W)), rstd, scale, shift);
      float f[W];
      Unit::unpack(raw[u], f);
#pragma unroll
      for (int k = 0; k < W; ++k) f[k] = gn_finish<T>(p, fmaf(f[k] - mean, scale, shift));
      Unit::store(out, unit, f);
    }
  }
  gn_cluster_exit<CLUSTER>();
}

// ---------------------------------------------------------------------------------------------- launch
static long long div_up(long long a, long long b) { return (a + b - 1) / b; }

bool group_norm_pick(const GroupNormArgs& p, int variant, int sm_major, GroupNormConfig* cfg) {
  if (variant < 0 || variant > 4) return false;
  const int V = p.dtype == kF32 ? 4 : 8;
  const long long L = (p.C / p.G) * p.HW;
  const long long groups = p.N * p.G;
  // Every group starts at a multiple of L elements from x, so L % V == 0 and an aligned base align them all.
  const bool vec = L % V == 0 && p.HW % V == 0 && aligned16(p.x) && aligned16(p.out);
  const int max_cluster = sm_major >= 9 ? kGnMaxCluster : 1;
  if (vec && (variant == 0 || variant == 1 || variant == 4)) {
    const int nv = variant == 4 ? 4 : 8;
    const int preferred = variant == 4 ? 256 : 128;
    const long long nvec = L / V;
    int cl = 1;
    while (cl < max_cluster && static_cast<long long>(cl) * preferred * nv < nvec) cl *= 2;
    if (static_cast<long long>(cl) * kGnMaxThreads * nv >= nvec) {
      const long long per = div_up(nvec, cl);
      int v = nv;
      while (v > 1 && div_up(per, v) < 64) v /= 2;  // small groups: fewer vectors per thread, more threads
      const int threads = static_cast<int>(div_up(div_up(per, v), 32) * 32);
      *cfg = GroupNormConfig{1, cl, threads, v};
      return true;
    }
  }
  const int kernel = (variant == 3 || !vec) ? 3 : 2;
  const long long units = kernel == 2 ? L / V : L;
  const long long chunk = static_cast<long long>(kGnLoopThreads) * (kernel == 2 ? 4 : 8);
  // Split a group across a cluster while there are too few blocks to fill the GPU (~132 SMs x 8 blocks) and
  // each block keeps at least two chunks.
  int cl = 1;
  while (cl < max_cluster && groups * cl < 1024 && units >= 4LL * cl * chunk) cl *= 2;
  *cfg = GroupNormConfig{kernel, cl, kGnLoopThreads, 0};
  return true;
}

template <typename Kernel>
static cudaError_t launch(Kernel kernel, const GroupNormArgs& p, const GroupNormConfig& c, FastDiv hw, int L,
                          int per, cudaStream_t stream) {
  const unsigned grid = static_cast<unsigned>(p.N * p.G * c.cluster);
  if (c.cluster == 1) {
    kernel<<<grid, c.threads, 0, stream>>>(p, hw, L, 1, per);
    return cudaGetLastError();
  }
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(grid);
  cfg.blockDim = dim3(static_cast<unsigned>(c.threads));
  cfg.dynamicSmemBytes = 0;
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = static_cast<unsigned>(c.cluster);
  attr[0].val.clusterDim.y = 1;
  attr[0].val.clusterDim.z = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  return cudaLaunchKernelEx(&cfg, kernel, p, hw, L, c.cluster, per);
}

template <typename T>
static cudaError_t launch_dtype(const GroupNormArgs& p, const GroupNormConfig& c, cudaStream_t stream) {
  constexpr int V = Elem<T>::VEC;
  const int L = static_cast<int>((p.C / p.G) * p.HW);
  const FastDiv hw = make_fastdiv(static_cast<uint32_t>(p.HW));
  const bool cl = c.cluster > 1;
  if (c.kernel == 1) {
    const int per = static_cast<int>(div_up(L / V, c.cluster));
    switch (c.vectors) {
      case 1: return launch(cl ? gn_register_kernel<T, 1, true> : gn_register_kernel<T, 1, false>, p, c, hw, L, per, stream);
      case 2: return launch(cl ? gn_register_kernel<T, 2, true> : gn_register_kernel<T, 2, false>, p, c, hw, L, per, stream);
      case 4: return launch(cl ? gn_register_kernel<T, 4, true> : gn_register_kernel<T, 4, false>, p, c, hw, L, per, stream);
      case 8: return launch(cl ? gn_register_kernel<T, 8, true> : gn_register_kernel<T, 8, false>, p, c, hw, L, per, stream);
      default: return cudaErrorInvalidValue;
    }
  }
  if (c.kernel == 2) {
    const int per = static_cast<int>(div_up(L / V, c.cluster));
    return launch(cl ? gn_looped_kernel<T, true, true> : gn_looped_kernel<T, true, false>, p, c, hw, L, per, stream);
  }
  const int per = static_cast<int>(div_up(L, c.cluster));
  return launch(cl ? gn_looped_kernel<T, false, true> : gn_looped_kernel<T, false, false>, p, c, hw, L, per, stream);
}

cudaError_t group_norm_launch(const GroupNormArgs& p, const GroupNormConfig& c, cudaStream_t stream) {
  if (p.N * p.G <= 0 || p.C <= 0 || p.HW <= 0) return cudaSuccess;
  if (p.dtype == kF32) return launch_dtype<float>(p, c, stream);
  if (p.dtype == kBF16) return launch_dtype<__nv_bfloat16>(p, c, stream);
  return launch_dtype<__half>(p, c, stream);
}

}  // namespace tsk

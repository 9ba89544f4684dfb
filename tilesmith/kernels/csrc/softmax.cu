// Row softmax over long rows, with the common pre-ops (x * scale + bias, bias broadcast over rows) and the
// fused sum of two softmaxes. fp32 arithmetic for every dtype.
//
//  * register kernel (rows up to softmax_register_capacity): one block per row reads the row once with
//    16-byte loads into registers (NV vectors per thread), computes per-thread online statistics (max m,
//    sum of exp(x - m)), combines them across the block in one reduction (one pair per softmax, both
//    softmaxes of the fused sum in the same barrier sequence), rescales its exponentials by exp(m_t - m) / s
//    and writes the row once. Global traffic: every input byte read once, every output byte written once.
//  * staged kernel (sm_90+, 16-byte aligned rows of 32 KB or more per row pair, up to the register capacity):
//    the register kernel's arithmetic, fed by a pipeline instead of direct loads. One persistent block per SM
//    walks rows blockIdx.x, blockIdx.x + gridDim.x, ...; one thread keeps STAGES rows in flight with bulk
//    asynchronous copies (cp.async.bulk, the TMA engine, completion counted on an mbarrier) into a ring of
//    shared-memory stages. A row is copied from its stage into registers, the stage is refilled with the row
//    STAGES ahead as soon as the block reduction has shown every thread done with it, and the row is then
//    normalized and written from registers. Every SM keeps 2-3 rows (128-192 KB) of reads in flight while it
//    computes, instead of the register kernel's load / reduce / write phases of one or two resident blocks.
//  * looped kernel (any D): the same online statistics in a first pass over the row, a second pass that
//    recomputes and writes (the row is read twice; the second read is mostly served by L2).
// Special values follow torch.softmax: a row with a NaN, or with +inf, becomes all NaN; -inf elements give 0;
// a row of only -inf becomes NaN.
#include "common.cuh"
#include "softmax.h"

namespace tsk {

// x * scale + bias on one unpacked 16-byte vector starting at element e (the bias, if any, is 16-byte aligned).
template <typename T>
__device__ __forceinline__ void pre_op(float (&v)[Elem<T>::VEC], const T* bias, float scale, long long e) {
  constexpr int V = Elem<T>::VEC;
  if (bias) {
    float bv[V];
    Elem<T>::unpack(ld_cached(bias + e), bv);
#pragma unroll
    for (int k = 0; k < V; ++k) v[k] = __fadd_rn(__fmul_rn(v[k], scale), bv[k]);
  } else {
#pragma unroll
    for (int k = 0; k < V; ++k) v[k] = __fmul_rn(v[k], scale);
  }
}

template <typename T, bool VEC>
__device__ __forceinline__ void load_pre(const T* row, const T* bias, float scale, long long D, long long e,
                                         float (&v)[Elem<T>::VEC], bool& valid) {
  constexpr int V = Elem<T>::VEC;
  if constexpr (VEC) {
    valid = e < D;
    if (!valid) return;
    Elem<T>::unpack(ld_stream(row + e), v);
    pre_op<T>(v, bias, scale, e);
  } else {
    valid = e < D;
#pragma unroll
    for (int k = 0; k < V; ++k) {
      const long long i = e + k;
      float x = i < D ? Elem<T>::get(row, i) : 0.f;
      x = __fmul_rn(x, scale);
      if (bias && i < D) x = __fadd_rn(x, Elem<T>::get(bias, i));
      v[k] = x;
    }
  }
}

template <typename T, bool VEC>
__device__ __forceinline__ void store_row(T* row, long long D, long long e, const float (&v)[Elem<T>::VEC]) {
  constexpr int V = Elem<T>::VEC;
  if constexpr (VEC) {
    if (e < D) st_stream(row + e, Elem<T>::pack(v));
  } else {
#pragma unroll
    for (int k = 0; k < V; ++k)
      if (e + k < D) Elem<T>::put(row, e + k, v[k]);
  }
}

// Per-thread statistics of its NV vectors; the exponentials replace the values in place.
template <typename T, int NV, bool VEC>
__device__ __forceinline__ MaxSum thread_stats(float (&v)[NV][Elem<T>::VEC], const bool (&valid)[NV], long long D,
                                               long long e0, long long step) {
  constexpr int V = Elem<T>::VEC;
  float m = -INFINITY;
#pragma unroll
  for (int i = 0; i < NV; ++i)
#pragma unroll
    for (int k = 0; k < V; ++k)
      if (valid[i] && (VEC || e0 + i * step + k < D)) m = nan_max(m, v[i][k]);
  float s = 0.f;
  if (m == -INFINITY) {  // nothing, or only -inf: the identity; its elements end as 0 (or NaN if all are)
#pragma unroll
    for (int i = 0; i < NV; ++i)
#pragma unroll
      for (int k = 0; k < V; ++k) v[i][k] = 0.f;
    return {m, 0.f};
  }
#pragma unroll
  for (int i = 0; i < NV; ++i)
#pragma unroll
    for (int k = 0; k < V; ++k) {
      const bool ok = valid[i] && (VEC || e0 + i * step + k < D);
      const float ex = ok ? __expf(v[i][k] - m) : 0.f;
      v[i][k] = ex;
      s += ex;
    }
  return {m, s};
}

// Threads a block of the register kernel may have: 64 registers per thread at 1024 threads is too few for
// 32 resident floats (ptxas spills), so those instantiations are bounded to 512 threads (128 registers).
template <int FLOATS>
struct RegThreads {
  static constexpr int value = FLOATS > 16 ? 512 : 1024;
};

// The part the register and staged kernels share, from the pre-op values in registers to the written row:
// per-thread statistics, the block combine (its barriers also prove every thread done with its loads, when
// `after_combine` runs), the rescale and the store. Identical arithmetic in both kernels.
template <typename T, int NV, bool VEC, bool DUAL, typename AfterCombine>
__device__ __forceinline__ void finish_row(const SoftmaxArgs& p, long long row, float (&va)[NV][Elem<T>::VEC],
                                           float (&vb)[DUAL ? NV : 1][Elem<T>::VEC], const bool (&valid)[NV],
                                           float* scratch, AfterCombine after_combine) {
  constexpr int V = Elem<T>::VEC;
  const long long step = static_cast<long long>(blockDim.x) * V;
  const long long e0 = static_cast<long long>(threadIdx.x) * V;
  MaxSum st[DUAL ? 2 : 1];
  st[0] = thread_stats<T, NV, VEC>(va, valid, p.D, e0, step);
  if constexpr (DUAL) st[1] = thread_stats<T, NV, VEC>(vb, valid, p.D, e0, step);
  float own_m[DUAL ? 2 : 1];
#pragma unroll
  for (int q = 0; q < (DUAL ? 2 : 1); ++q) own_m[q] = st[q].m;
  block_combine<DUAL ? 2 : 1>(st, scratch);
  after_combine();
  const float fa = __expf(own_m[0] - st[0].m) / st[0].s;
  const float fb = DUAL ? __expf(own_m[DUAL ? 1 : 0] - st[DUAL ? 1 : 0].m) / st[DUAL ? 1 : 0].s : 0.f;
  T* out = static_cast<T*>(p.out) + row * p.sout;
#pragma unroll
  for (int i = 0; i < NV; ++i) {
    float o[V];
#pragma unroll
    for (int k = 0; k < V; ++k) o[k] = DUAL ? va[i][k] * fa + vb[DUAL ? i : 0][k] * fb : va[i][k] * fa;
    store_row<T, VEC>(out, p.D, e0 + i * step, o);
  }
}

template <typename T, int NV, bool VEC, bool DUAL>
__global__ void __launch_bounds__(RegThreads<NV * Elem<T>::VEC * (DUAL ? 2 : 1)>::value, 1)
    softmax_reg_kernel(SoftmaxArgs p) {
  constexpr int V = Elem<T>::VEC;
  __shared__ float scratch[2 * 2 * 33];
  const long long row = blockIdx.x;
  const long long step = static_cast<long long>(blockDim.x) * V;
  const long long e0 = static_cast<long long>(threadIdx.x) * V;
  const T* a = static_cast<const T*>(p.a) + row * p.sa;
  const T* b = DUAL ? static_cast<const T*>(p.b) + row * p.sb : nullptr;
  float va[NV][V], vb[DUAL ? NV : 1][V];
  bool valid[NV];
#pragma unroll
  for (int i = 0; i < NV; ++i) load_pre<T, VEC>(a, static_cast<const T*>(p.bias_a), p.scale_a, p.D, e0 + i * step,
                                                 va[i], valid[i]);
  if constexpr (DUAL) {
#pragma unroll
    for (int i = 0; i < NV; ++i) {
      bool ok;
      load_pre<T, VEC>(b, static_cast<const T*>(p.bias_b), p.scale_b, p.D, e0 + i * step, vb[i], ok);
    }
  }
  finish_row<T, NV, VEC, DUAL>(p, row, va, vb, valid, scratch, [] {});
}

// ------------------------------------------------------------------------------------------ staged kernel
// Bulk asynchronous copies (TMA, sm_90) into shared memory, completion tracked by mbarriers (PTX ISA 8.0).
constexpr int kMaxStages = 6;
// Row pairs (or single rows) smaller than this keep the register kernel (many resident blocks per SM).
constexpr long long kStagedMinBytes = 32 * 1024;
// Auto (variant 0) picks the staged kernel where it applies; false: the register kernel, as before.
constexpr bool kAutoStaged = true;

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
__device__ __forceinline__ void mbar_init(uint64_t* bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_u32(bar)), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_init_fence() {
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}
// Orders this CTA's earlier generic-proxy accesses of shared memory (made visible to this thread by a
// barrier) before the async-proxy writes of a bulk copy issued next.
__device__ __forceinline__ void fence_proxy_async_smem() {
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}
__device__ __forceinline__ void mbar_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_u32(bar)), "r"(bytes) : "memory");
}
__device__ __forceinline__ void bulk_load(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
               ::"r"(smem_u32(dst)), "l"(src), "r"(bytes), "r"(smem_u32(bar))
               : "memory");
}
__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
  uint32_t done = 0;
  do {
    asm volatile(
        "{\n\t.reg .pred p;\n\t"
        "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n\t"
        "selp.u32 %0, 1, 0, p;\n\t}"
        : "=r"(done)
        : "r"(smem_u32(bar)), "r"(parity)
        : "memory");
  } while (!done);
}
#endif

// One stage holds a's row at offset 0 and b's row at `row_bytes` (both multiples of 16 bytes).
template <typename T, int NV, bool DUAL>
__global__ void __launch_bounds__(RegThreads<NV * Elem<T>::VEC * (DUAL ? 2 : 1)>::value, 1)
    softmax_staged_kernel(SoftmaxArgs p, int stages, uint32_t row_bytes, uint32_t stage_bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  constexpr int V = Elem<T>::VEC;
  extern __shared__ __align__(128) unsigned char stage_mem[];
  __shared__ __align__(8) uint64_t full[kMaxStages];
  __shared__ float scratch[2 * 2 * 33];
  const long long step = static_cast<long long>(blockDim.x) * V;
  const long long e0 = static_cast<long long>(threadIdx.x) * V;
  const long long grid = gridDim.x;
  const uint32_t tx_bytes = row_bytes * (DUAL ? 2u : 1u);
  auto issue = [&](long long row, int s) {  // one thread: row -> stage s
    unsigned char* dst = stage_mem + static_cast<size_t>(s) * stage_bytes;
    mbar_expect_tx(&full[s], tx_bytes);
    bulk_load(dst, static_cast<const T*>(p.a) + row * p.sa, row_bytes, &full[s]);
    if constexpr (DUAL) bulk_load(dst + row_bytes, static_cast<const T*>(p.b) + row * p.sb, row_bytes, &full[s]);
  };
  if (threadIdx.x == 0) {
    for (int s = 0; s < stages; ++s) mbar_init(&full[s], 1);
    mbar_init_fence();
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int s = 0; s < stages; ++s) {
      const long long row = blockIdx.x + s * grid;
      if (row < p.rows) issue(row, s);
    }
  }
  int s = 0;
  uint32_t parity = 0;
  for (long long row = blockIdx.x; row < p.rows; row += grid) {
    mbar_wait(&full[s], parity);
    const unsigned char* base = stage_mem + static_cast<size_t>(s) * stage_bytes;
    const T* sa = reinterpret_cast<const T*>(base);
    const T* sb = reinterpret_cast<const T*>(base + row_bytes);
    float va[NV][V], vb[DUAL ? NV : 1][V];
    bool valid[NV];
#pragma unroll
    for (int i = 0; i < NV; ++i) {
      const long long e = e0 + i * step;
      valid[i] = e < p.D;
      if (valid[i]) {
        Elem<T>::unpack(*reinterpret_cast<const uint4*>(sa + e), va[i]);
        pre_op<T>(va[i], static_cast<const T*>(p.bias_a), p.scale_a, e);
        if constexpr (DUAL) {
          Elem<T>::unpack(*reinterpret_cast<const uint4*>(sb + e), vb[i]);
          pre_op<T>(vb[i], static_cast<const T*>(p.bias_b), p.scale_b, e);
        }
      }
    }
    const int stage = s;
    finish_row<T, NV, true, DUAL>(p, row, va, vb, valid, scratch, [&] {
      // block_combine's barriers: every thread has copied this stage into registers; refill it.
      const long long next = row + static_cast<long long>(stages) * grid;
      if (threadIdx.x == 0 && next < p.rows) {
        fence_proxy_async_smem();
        issue(next, stage);
      }
    });
    if (++s == stages) {
      s = 0;
      parity ^= 1u;
    }
  }
#else
  __trap();
#endif
}

// Online update of (m, s) with one vector of values (only the first `n` are elements of the row).
template <int V>
__device__ __forceinline__ void online_update(MaxSum& st, const float (&v)[V], int n) {
  float vm = -INFINITY;
#pragma unroll
  for (int k = 0; k < V; ++k)
    if (k < n) vm = nan_max(vm, v[k]);
  if (vm == -INFINITY) return;  // only -inf (or nothing): contributes 0
  const float m = nan_max(st.m, vm);
  float s = st.s == 0.f ? 0.f : st.s * __expf(st.m - m);
#pragma unroll
  for (int k = 0; k < V; ++k)
    if (k < n) s += __expf(v[k] - m);
  st = {m, s};
}

template <typename T, bool VEC, bool DUAL>
__global__ void __launch_bounds__(1024, 1) softmax_loop_kernel(SoftmaxArgs p) {
  constexpr int V = Elem<T>::VEC;
  __shared__ float scratch[2 * 2 * 33];
  const long long row = blockIdx.x;
  const long long step = static_cast<long long>(blockDim.x) * V;
  const T* a = static_cast<const T*>(p.a) + row * p.sa;
  const T* b = DUAL ? static_cast<const T*>(p.b) + row * p.sb : nullptr;
  MaxSum st[DUAL ? 2 : 1];
#pragma unroll
  for (int q = 0; q < (DUAL ? 2 : 1); ++q) st[q] = MaxSum{-INFINITY, 0.f};
  for (long long e = static_cast<long long>(threadIdx.x) * V; e < p.D; e += step) {
    const int n = static_cast<int>(min(static_cast<long long>(V), p.D - e));
    float v[V];
    bool ok;
    load_pre<T, VEC>(a, static_cast<const T*>(p.bias_a), p.scale_a, p.D, e, v, ok);
    online_update<V>(st[0], v, n);
    if constexpr (DUAL) {
      load_pre<T, VEC>(b, static_cast<const T*>(p.bias_b), p.scale_b, p.D, e, v, ok);
      online_update<V>(st[DUAL ? 1 : 0], v, n);
    }
  }
  block_combine<DUAL ? 2 : 1>(st, scratch);
  const float ia = 1.f / st[0].s;
  const float ib = DUAL ? 1.f / st[DUAL ? 1 : 0].s : 0.f;
  T* out = static_cast<T*>(p.out) + row * p.sout;
  for (long long e = static_cast<long long>(threadIdx.x) * V; e < p.D; e += step) {
    float v[V], o[V];
    bool ok;
    load_pre<T, VEC>(a, static_cast<const T*>(p.bias_a), p.scale_a, p.D, e, v, ok);
#pragma unroll
    for (int k = 0; k < V; ++k) o[k] = __expf(v[k] - st[0].m) * ia;
    if constexpr (DUAL) {
      load_pre<T, VEC>(b, static_cast<const T*>(p.bias_b), p.scale_b, p.D, e, v, ok);
#pragma unroll
      for (int k = 0; k < V; ++k) o[k] += __expf(v[k] - st[DUAL ? 1 : 0].m) * ib;
    }
    store_row<T, VEC>(out, p.D, e, o);
  }
}

// ---------------------------------------------------------------------------------------------- launch
// Floats a thread of the register kernel holds per row at most (NV vectors of V elements, x2 when fused).
constexpr int kMaxFloatsPerThread = 32;

static int vec_of(int dtype) { return dtype == kF32 ? 4 : 8; }

static long long max_threads_for(int floats) { return floats > 16 ? 512 : 1024; }

long long softmax_register_capacity(int dtype, bool dual) {
  const int v = vec_of(dtype), per = v * (dual ? 2 : 1);
  long long best = 0;
  for (int nv = 1; nv * per <= kMaxFloatsPerThread; nv *= 2) {
    const long long cap = max_threads_for(nv * per) * nv * v;
    best = cap > best ? cap : best;
  }
  return best;
}

// Device facts the staged kernel needs (current device; cached per device).
struct DeviceFacts {
  int sm_major = 0, sms = 0, smem_optin = 0;
};

static DeviceFacts device_facts() {
  static DeviceFacts cache[64];
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= 64) return {};
  DeviceFacts& f = cache[dev];
  if (f.sms == 0) {
    DeviceFacts g;
    if (cudaDeviceGetAttribute(&g.sm_major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess ||
        cudaDeviceGetAttribute(&g.sms, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess ||
        cudaDeviceGetAttribute(&g.smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev) != cudaSuccess) {
      cudaGetLastError();
      return {};
    }
    f = g;
  }
  return f;
}

// Staged-kernel plan for a vectorised row set: NV (vectors per thread), threads, stages; nv == 0: not eligible.
struct StagedPlan {
  int nv = 0, threads = 0, stages = 0, grid = 0;
  uint32_t row_bytes = 0, stage_bytes = 0;
};

template <typename T, bool DUAL>
static StagedPlan staged_plan(const SoftmaxArgs& p) {
  constexpr int V = Elem<T>::VEC;
  constexpr int PER = V * (DUAL ? 2 : 1);
  StagedPlan plan;
  const long long row_bytes = p.D * static_cast<long long>(sizeof(T));
  const long long stage_bytes = (row_bytes * (DUAL ? 2 : 1) + 127) / 128 * 128;
  if (stage_bytes < kStagedMinBytes) return plan;
  const DeviceFacts f = device_facts();
  if (f.sm_major < 9 || f.sms <= 0) return plan;
  const long long dyn = static_cast<long long>(f.smem_optin) - 1024;  // static shared memory: barriers, scratch
  const long long stages = min(static_cast<long long>(kMaxStages), dyn / stage_bytes);
  if (stages < 2) return plan;
  // As many threads as the row allows (up to the instantiation's bound): the fewest vectors per thread.
  const long long nvec = (p.D + V - 1) / V;
  for (int nv = 1; nv * PER <= kMaxFloatsPerThread && nv <= 4; nv *= 2) {
    const long long threads = ((nvec + nv - 1) / nv + 31) / 32 * 32;
    if (threads <= max_threads_for(nv * PER)) {
      if (threads < 64) return plan;  // block_combine's barriers are what release a stage
      plan.nv = nv;
      plan.threads = static_cast<int>(threads);
      break;
    }
  }
  if (plan.nv == 0) return plan;
  plan.stages = static_cast<int>(stages);
  plan.grid = static_cast<int>(min(p.rows, static_cast<long long>(f.sms)));
  plan.row_bytes = static_cast<uint32_t>(row_bytes);
  plan.stage_bytes = static_cast<uint32_t>(stage_bytes);
  return plan;
}

template <typename T, int NV, bool DUAL>
static cudaError_t launch_staged_nv(const SoftmaxArgs& p, const StagedPlan& plan, cudaStream_t stream) {
  const size_t dyn = static_cast<size_t>(plan.stages) * plan.stage_bytes;
  // Opt in to more than 48 KB of dynamic shared memory (per device and instantiation; no stream work, so it
  // is also allowed while a CUDA graph is being captured).
  cudaError_t err = cudaFuncSetAttribute(softmax_staged_kernel<T, NV, DUAL>,
                                         cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(dyn));
  if (err != cudaSuccess) return err;
  softmax_staged_kernel<T, NV, DUAL><<<plan.grid, plan.threads, dyn, stream>>>(p, plan.stages, plan.row_bytes,
                                                                              plan.stage_bytes);
  return cudaGetLastError();
}

template <typename T, bool DUAL>
static cudaError_t launch_staged(const SoftmaxArgs& p, const StagedPlan& plan, cudaStream_t stream) {
  constexpr int PER = Elem<T>::VEC * (DUAL ? 2 : 1);
  switch (plan.nv) {
    case 1: return launch_staged_nv<T, 1, DUAL>(p, plan, stream);
    case 2: return launch_staged_nv<T, 2, DUAL>(p, plan, stream);
    default:
      if constexpr (4 * PER <= kMaxFloatsPerThread) return launch_staged_nv<T, 4, DUAL>(p, plan, stream);
      return cudaErrorInvalidValue;
  }
}

// Register-kernel NV (vectors per thread) for this row length; 0: the row does not fit (looped kernel).
template <typename T, bool DUAL>
static int register_nv(long long D) {
  constexpr int V = Elem<T>::VEC;
  constexpr int PER = V * (DUAL ? 2 : 1);
  const long long nvec = (D + V - 1) / V;
  // NV vectors per thread: about 4 (16-byte loads in flight per thread), fewer for short rows so that a block
  // keeps at least 128 threads, more when the row needs more threads than the instantiation allows.
  int nv = 4 * PER <= kMaxFloatsPerThread ? 4 : kMaxFloatsPerThread / PER;
  while (nv > 1 && (nvec + nv - 1) / nv < 128) nv /= 2;
  while (nv * PER < kMaxFloatsPerThread && (nvec + nv - 1) / nv > max_threads_for(nv * PER)) nv *= 2;
  return (nvec + nv - 1) / nv <= max_threads_for(nv * PER) ? nv : 0;
}

enum SoftmaxKind : int { kRegister = 1, kLooped = 2, kStaged = 3 };

template <typename T, bool VEC, bool DUAL>
static int pick_typed(const SoftmaxArgs& p, int variant, StagedPlan* plan) {
  if constexpr (VEC) {
    if (variant == 3 || (variant == 0 && kAutoStaged)) {
      const StagedPlan sp = staged_plan<T, DUAL>(p);
      if (sp.nv > 0) {
        if (plan) *plan = sp;
        return kStaged;
      }
    }
  }
  if (variant == 2 || register_nv<T, DUAL>(p.D) == 0) return kLooped;
  return kRegister;
}

template <typename T, bool VEC, bool DUAL>
static cudaError_t launch_typed(const SoftmaxArgs& p, int variant, cudaStream_t stream) {
  constexpr int V = Elem<T>::VEC;
  constexpr int PER = V * (DUAL ? 2 : 1);
  const long long nvec = (p.D + V - 1) / V;
  const unsigned grid = static_cast<unsigned>(p.rows);
  StagedPlan plan;
  const int kind = pick_typed<T, VEC, DUAL>(p, variant, &plan);
  if (kind == kStaged) {
    if constexpr (VEC) return launch_staged<T, DUAL>(p, plan, stream);
  }
  if (kind == kLooped) {
    const int threads = static_cast<int>(min(1024LL, max(32LL, ((nvec + 3) / 4 + 31) / 32 * 32)));
    softmax_loop_kernel<T, VEC, DUAL><<<grid, threads, 0, stream>>>(p);
    return cudaGetLastError();
  }
  const int nv = register_nv<T, DUAL>(p.D);
  const int threads = static_cast<int>(max(32LL, ((nvec + nv - 1) / nv + 31) / 32 * 32));
  switch (nv) {
    case 1: softmax_reg_kernel<T, 1, VEC, DUAL><<<grid, threads, 0, stream>>>(p); break;
    case 2: softmax_reg_kernel<T, 2, VEC, DUAL><<<grid, threads, 0, stream>>>(p); break;
    case 4:
      if constexpr (4 * PER <= kMaxFloatsPerThread) softmax_reg_kernel<T, 4, VEC, DUAL><<<grid, threads, 0, stream>>>(p);
      break;
    default:
      if constexpr (8 * PER <= kMaxFloatsPerThread) softmax_reg_kernel<T, 8, VEC, DUAL><<<grid, threads, 0, stream>>>(p);
      break;
  }
  return cudaGetLastError();
}

template <typename T>
static bool vec_ok(const SoftmaxArgs& p) {
  constexpr int V = Elem<T>::VEC;
  const bool dual = p.b != nullptr;
  bool vec = p.D % V == 0 && aligned16(p.a) && aligned16(p.out) && p.sa % V == 0 && p.sout % V == 0;
  if (p.bias_a) vec = vec && aligned16(p.bias_a);
  if (dual) vec = vec && aligned16(p.b) && p.sb % V == 0 && (!p.bias_b || aligned16(p.bias_b));
  return vec;
}

template <typename T>
static cudaError_t launch_dtype(const SoftmaxArgs& p, int variant, cudaStream_t stream) {
  const bool dual = p.b != nullptr;
  if (vec_ok<T>(p)) return dual ? launch_typed<T, true, true>(p, variant, stream) : launch_typed<T, true, false>(p, variant, stream);
  return dual ? launch_typed<T, false, true>(p, variant, stream) : launch_typed<T, false, false>(p, variant, stream);
}

template <typename T>
static int pick_dtype(const SoftmaxArgs& p, int variant) {
  const bool dual = p.b != nullptr;
  if (vec_ok<T>(p)) return dual ? pick_typed<T, true, true>(p, variant, nullptr) : pick_typed<T, true, false>(p, variant, nullptr);
  return dual ? pick_typed<T, false, true>(p, variant, nullptr) : pick_typed<T, false, false>(p, variant, nullptr);
}

int softmax_pick(const SoftmaxArgs& p, int variant) {
  if (p.dtype == kF32) return pick_dtype<float>(p, variant);
  if (p.dtype == kBF16) return pick_dtype<__nv_bfloat16>(p, variant);
  return pick_dtype<__half>(p, variant);
}

cudaError_t softmax_launch(const SoftmaxArgs& p, int variant, cudaStream_t stream) {
  if (p.rows <= 0 || p.D <= 0) return cudaSuccess;
  if (p.dtype == kF32) return launch_dtype<float>(p, variant, stream);
  if (p.dtype == kBF16) return launch_dtype<__nv_bfloat16>(p, variant, stream);
  return launch_dtype<__half>(p, variant, stream);
}

}  // namespace tsk

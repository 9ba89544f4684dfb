// Row softmax over long rows, with the common pre-ops (x * scale + bias, bias broadcast over rows) and the
// fused sum of two softmaxes. fp32 arithmetic for every dtype.
//
//  * register kernel (rows up to softmax_register_capacity): one block per row reads the row once with
//    16-byte loads into registers (NV vectors per thread), computes per-thread online statistics (max m,
//    sum of exp(x - m)), combines them across the block in one reduction (one pair per softmax, both
//    softmaxes of the fused sum in the same barrier sequence), rescales its exponentials by exp(m_t - m) / s
//    and writes the row once. Global traffic: every input byte read once, every output byte written once.
//  * looped kernel (any D): the same online statistics in a first pass over the row, a second pass that
//    recomputes and writes (the row is read twice; the second read is mostly served by L2).
// Special values follow torch.softmax: a row with a NaN, or with +inf, becomes all NaN; -inf elements give 0;
// a row of only -inf becomes NaN.
#include "common.cuh"
#include "softmax.h"

namespace tsk {

template <typename T, bool VEC>
__device__ __forceinline__ void load_pre(const T* row, const T* bias, float scale, long long D, long long e,
                                         float (&v)[Elem<T>::VEC], bool& valid) {
  constexpr int V = Elem<T>::VEC;
  if constexpr (VEC) {
    valid = e < D;
    if (!valid) return;
    Elem<T>::unpack(ld_stream(row + e), v);
    if (bias) {
      float bv[V];
      Elem<T>::unpack(ld_cached(bias + e), bv);
#pragma unroll
      for (int k = 0; k < V; ++k) v[k] = __fadd_rn(__fmul_rn(v[k], scale), bv[k]);
    } else {
#pragma unroll
      for (int k = 0; k < V; ++k) v[k] = __fmul_rn(v[k], scale);
    }
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
  MaxSum st[DUAL ? 2 : 1];
  st[0] = thread_stats<T, NV, VEC>(va, valid, p.D, e0, step);
  if constexpr (DUAL) st[1] = thread_stats<T, NV, VEC>(vb, valid, p.D, e0, step);
  float own_m[DUAL ? 2 : 1];
#pragma unroll
  for (int q = 0; q < (DUAL ? 2 : 1); ++q) own_m[q] = st[q].m;
  block_combine<DUAL ? 2 : 1>(st, scratch);
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

template <typename T, bool VEC, bool DUAL>
static cudaError_t launch_typed(const SoftmaxArgs& p, int variant, cudaStream_t stream) {
  constexpr int V = Elem<T>::VEC;
  constexpr int PER = V * (DUAL ? 2 : 1);
  const long long nvec = (p.D + V - 1) / V;
  const unsigned grid = static_cast<unsigned>(p.rows);
  // NV vectors per thread: about 4 (16-byte loads in flight per thread), fewer for short rows so that a block
  // keeps at least 128 threads, more when the row needs more threads than the instantiation allows.
  int nv = 4 * PER <= kMaxFloatsPerThread ? 4 : kMaxFloatsPerThread / PER;
  while (nv > 1 && (nvec + nv - 1) / nv < 128) nv /= 2;
  while (nv * PER < kMaxFloatsPerThread && (nvec + nv - 1) / nv > max_threads_for(nv * PER)) nv *= 2;
  const bool fits = (nvec + nv - 1) / nv <= max_threads_for(nv * PER);
  if (variant == 2 || !fits) {
    const int threads = static_cast<int>(min(1024LL, max(32LL, ((nvec + 3) / 4 + 31) / 32 * 32)));
    softmax_loop_kernel<T, VEC, DUAL><<<grid, threads, 0, stream>>>(p);
    return cudaGetLastError();
  }
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
static cudaError_t launch_dtype(const SoftmaxArgs& p, int variant, cudaStream_t stream) {
  constexpr int V = Elem<T>::VEC;
  const bool dual = p.b != nullptr;
  bool vec = p.D % V == 0 && aligned16(p.a) && aligned16(p.out) && p.sa % V == 0 && p.sout % V == 0;
  if (p.bias_a) vec = vec && aligned16(p.bias_a);
  if (dual) vec = vec && aligned16(p.b) && p.sb % V == 0 && (!p.bias_b || aligned16(p.bias_b));
  if (vec) return dual ? launch_typed<T, true, true>(p, variant, stream) : launch_typed<T, true, false>(p, variant, stream);
  return dual ? launch_typed<T, false, true>(p, variant, stream) : launch_typed<T, false, false>(p, variant, stream);
}

cudaError_t softmax_launch(const SoftmaxArgs& p, int variant, cudaStream_t stream) {
  if (p.rows <= 0 || p.D <= 0) return cudaSuccess;
  if (p.dtype == kF32) return launch_dtype<float>(p, variant, stream);
  if (p.dtype == kBF16) return launch_dtype<__nv_bfloat16>(p, variant, stream);
  return launch_dtype<__half>(p, variant, stream);
}

}  // namespace tsk

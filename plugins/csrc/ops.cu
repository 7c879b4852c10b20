// CUDA kernels for MicroSpec's custom ops. plugins/ops.py holds the plain-torch reference of each op, which
// defines its exact semantics and the window state layout; plugins/check.py compares the two on the GPU.
// Every kernel runs on the current stream, allocates nothing but its outputs and never synchronises with the
// host, so all of them can be captured in CUDA graphs.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>  // not ATen/cuda/CUDAContext.h: that one needs the cuBLAS/cuSPARSE headers

#include <cstdint>
#include <tuple>

namespace {

constexpr int64_t kBig = int64_t(1) << 62;  // ops.BIG: every entry of `first` holds it between calls
constexpr int kWindowThreads = 1024;        // window ops: one block does the whole update of one window
constexpr int kGatherThreads = 128;         // gather_rows: one block per row
constexpr int kTopkThreads = 512;           // logsoftmax_topk: one block per row of logits
constexpr int kTopkMaxRows = 8192;          // packed rows held in shared memory (32 KB); plugins/cuda.py agrees
constexpr int kTopkMaxK = 32;               // logsoftmax_topk's k: each warp's k picks in shared memory (4 KB)
constexpr unsigned kFullMask = 0xffffffffu;

__device__ __forceinline__ int64_t imin(int64_t a, int64_t b) { return a < b ? a : b; }

// The contiguous run [lo, hi) of an n-long array that this thread owns. Runs are in thread order, so one
// block-wide scan over per-thread counts ranks a whole array in index order, whatever its length.
__device__ __forceinline__ void own_run(int64_t n, int64_t& lo, int64_t& hi) {
  int64_t per = (n + blockDim.x - 1) / blockDim.x;
  lo = imin(n, threadIdx.x * per);
  hi = imin(n, lo + per);
}

// Exclusive prefix sum of v over the threads of the block, in thread order; *total = the sum of all.
// blockDim.x must be a multiple of 32. Ends with a barrier, so it can be called again right away.
__device__ int block_scan(int v, int* total) {
  __shared__ int warp_sum[32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  int x = v;  // inclusive scan within the warp
  for (int o = 1; o < 32; o <<= 1) {
    int y = __shfl_up_sync(kFullMask, x, o);
    if (lane >= o) x += y;
  }
  if (lane == 31) warp_sum[warp] = x;
  __syncthreads();
  if (warp == 0) {
    int w = lane < nwarps ? warp_sum[lane] : 0;
    for (int o = 1; o < 32; o <<= 1) {
      int y = __shfl_up_sync(kFullMask, w, o);
      if (lane >= o) w += y;
    }
    if (lane < nwarps) warp_sum[lane] = w;  // inclusive over warps
  }
  __syncthreads();
  const int before = warp ? warp_sum[warp - 1] : 0;
  *total = warp_sum[nwarps - 1];
  __syncthreads();
  return before + x - v;
}

// ---- unique_first_rows: keep the first occurrence of each id in a row, -1 elsewhere ------------------------
// Block b dedups row b of ids [B, n] in the scratch of window batch[b] (first [slots, V+1]).
// Pass 1: first[id] = min index (atomicMin). Pass 2: an entry is first iff first[id] == its index; that entry
// also resets first[id] to BIG. A later duplicate reads either the first index or BIG, neither its own index,
// so the reset needs no extra barrier.
__global__ void __launch_bounds__(kWindowThreads)
unique_first_kernel(const int64_t* __restrict__ ids, int64_t n, int64_t* first, int64_t V, int64_t* out,
                    const int64_t* __restrict__ batch) {
  ids += blockIdx.x * n;
  out += blockIdx.x * n;
  first += batch[blockIdx.x] * (V + 1);
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
    int64_t id = ids[i];
    if (id >= 0 && id < V) atomicMin(reinterpret_cast<long long*>(first + id), static_cast<long long>(i));
  }
  __syncthreads();
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
    int64_t id = ids[i];
    bool keep = id >= 0 && id < V && first[id] == i;
    if (keep) first[id] = kBig;
    out[i] = keep ? id : -1;
  }
}

// ---- window_update_rows: one block per row, five phases separated by barriers ------------------------------
// Block b appends row b of new_ids [B, n] to window batch[b] of the state arrays (a leading window dimension).
// touched[2n] = [evicted entries, added entries] lives in the row's out_ids; its out_slots first serve as the
// list of newly active ids by rank, then receive the slots. Mirrors ops.window_update_rows step by step.
__global__ void __launch_bounds__(kWindowThreads)
window_update_kernel(int64_t* ring, int64_t W, int64_t* head, int* count, int64_t V, int64_t* slot_of,
                     int64_t* id_of, int64_t R, int64_t* first, const int64_t* __restrict__ new_ids, int64_t n,
                     int64_t* out_ids, int64_t* out_slots, const int64_t* __restrict__ batch) {
  const int64_t w = batch[blockIdx.x];
  ring += w * (W + 1);
  head += w;
  count += w * (V + 1);
  slot_of += w * (V + 1);
  id_of += w * (R + 1);
  first += w * (V + 1);
  new_ids += blockIdx.x * n;
  out_ids += blockIdx.x * 2 * n;
  out_slots += blockIdx.x * 2 * n;
  int64_t* touched = out_ids;
  int64_t* new_by_rank = out_slots;
  int64_t lo, hi;

  // 1. rank the valid entries; the last W of them go into the ring, overwriting (evicting) the oldest.
  // Kept ranks are at most W consecutive numbers, so their ring positions are distinct: each thread reads and
  // writes only its own positions.
  own_run(n, lo, hi);
  int mine = 0;
  for (int64_t i = lo; i < hi; ++i) mine += new_ids[i] >= 0 && new_ids[i] < V;
  int m;
  int64_t rank = block_scan(mine, &m);
  const int64_t h = *head;
  for (int64_t i = lo; i < hi; ++i) {
    const int64_t id = new_ids[i];
    int64_t evicted = -1, added = -1;
    if (id >= 0 && id < V) {
      if (rank >= m - W) {
        const int64_t pos = (h + rank) % W;
        evicted = ring[pos];
        ring[pos] = id;
        added = id;
        if (evicted >= 0) atomicSub(count + evicted, 1);
        atomicAdd(count + id, 1);
      }
      ++rank;
    }
    touched[i] = evicted;
    touched[n + i] = added;
  }
  __syncthreads();

  // 2. free the slots of ids whose count fell to 0 (repeats of one id write the same values)
  const int64_t n2 = 2 * n;
  own_run(n2, lo, hi);
  for (int64_t j = lo; j < hi; ++j) {
    const int64_t t = touched[j];
    if (t >= 0 && count[t] == 0) {
      const int64_t s = slot_of[t];
      if (s >= 0) {
        id_of[s] = -1;
        slot_of[t] = -1;
      }
    }
  }
  __syncthreads();

  // 3. ids in the window without a slot, first occurrence in touched order (as unique_first_kernel)
  for (int64_t j = lo; j < hi; ++j) {
    const int64_t t = touched[j];
    const int64_t c = t >= 0 && count[t] > 0 && slot_of[t] < 0 ? t : -1;
    touched[j] = c;
    if (c >= 0) atomicMin(reinterpret_cast<long long*>(first + c), static_cast<long long>(j));
  }
  __syncthreads();
  int fresh = 0;
  for (int64_t j = lo; j < hi; ++j) {
    const int64_t c = touched[j];
    if (c < 0) continue;
    if (first[c] == j) {
      first[c] = kBig;
      ++fresh;
    } else {
      touched[j] = -1;
    }
  }
  int num_new;
  int r = block_scan(fresh, &num_new);
  for (int64_t j = lo; j < hi; ++j)
    if (touched[j] >= 0) new_by_rank[r++] = touched[j];
  __syncthreads();

  // 4. the i-th free slot (in slot order) goes to the i-th new id (in order of appearance)
  own_run(R, lo, hi);
  int free_here = 0;
  for (int64_t s = lo; s < hi; ++s) free_here += id_of[s] < 0;
  int num_free;
  int f = block_scan(free_here, &num_free);
  for (int64_t s = lo; s < hi && f < num_new; ++s) {
    if (id_of[s] >= 0) continue;
    const int64_t c = new_by_rank[f++];
    id_of[s] = c;
    slot_of[c] = s;
  }
  __syncthreads();

  // 5. outputs: (id, slot) of each new id; padding is (0, R). New ids beyond the free slots get slot R, as in
  // the reference (cannot happen while R >= W + pinned ids).
  own_run(n2, lo, hi);
  for (int64_t j = lo; j < hi; ++j) {
    const int64_t c = touched[j];
    int64_t s = R;
    if (c >= 0) {
      s = slot_of[c];
      if (s < 0) {
        s = R;
        slot_of[c] = R;
      }
    }
    out_ids[j] = c >= 0 ? c : 0;
    out_slots[j] = s;
  }
  if (threadIdx.x == 0) {  // every thread read *head in phase 1, several barriers ago
    *head = h + m;
    count[V] = 0;
    ring[W] = -1;
    slot_of[V] = -1;
    id_of[R] = -1;
  }
}

// ---- gather_rows: dst[slots[i]] = src[ids[i]], 16-byte vectors, one block per row ----------------------------
// Rows aimed at the last row of dst (the padding sink) are skipped, as are out-of-range indices.
__global__ void __launch_bounds__(kGatherThreads)
gather_rows_kernel(const uint4* __restrict__ src, int64_t src_rows, int64_t src_stride, const int64_t* ids,
                   uint4* __restrict__ dst, int64_t dst_rows, int64_t dst_stride, const int64_t* slots,
                   int64_t row_vecs) {
  const int64_t id = ids[blockIdx.x], slot = slots[blockIdx.x];
  if (id < 0 || id >= src_rows || slot < 0 || slot >= dst_rows - 1) return;
  const uint4* s = src + id * src_stride;
  uint4* d = dst + slot * dst_stride;
#pragma unroll 4
  for (int64_t v = threadIdx.x; v < row_vecs; v += blockDim.x) d[v] = __ldg(s + v);
}

// ---- logsoftmax_topk: masked log-softmax over one row of logits, top-k, slot -> token id --------------------
struct MaxOp {
  template <typename T> __device__ T operator()(T a, T b) const { return a > b ? a : b; }
};
struct AddOp {
  template <typename T> __device__ T operator()(T a, T b) const { return a + b; }
};

// op over the threads of the block (identity: op's neutral element); ends with every thread holding the result
template <typename T, typename Op>
__device__ T block_reduce(T v, Op op, T identity, T* sm /* [33] */) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  for (int o = 16; o > 0; o >>= 1) v = op(v, __shfl_xor_sync(kFullMask, v, o));
  if (lane == 0) sm[warp] = v;
  __syncthreads();
  if (warp == 0) {
    T w = lane < nwarps ? sm[lane] : identity;
    for (int o = 16; o > 0; o >>= 1) w = op(w, __shfl_xor_sync(kFullMask, w, o));
    if (lane == 0) sm[32] = w;
  }
  __syncthreads();
  return sm[32];  // the next call writes sm[32] only after a barrier that every thread passes after this read
}

// One 64-bit key per candidate: the float's bits made order-preserving as an unsigned int (high half) and the
// complement of the slot (low half), so the maximum key is the largest value and, among equal values, the
// smallest slot. A slot already taken (stored as NaN) gets key 0 and ranks below -inf.
__device__ __forceinline__ unsigned long long topk_key(float v, int slot) {
  if (isnan(v)) return 0ull;  // a taken slot (logsoftmax_topk marks it NaN): below every real key, -inf's too
  unsigned u = __float_as_uint(v);
  u = (u & 0x80000000u) ? ~u : (u | 0x80000000u);
  return (static_cast<unsigned long long>(u) << 32) | (0xffffffffu - static_cast<unsigned>(slot));
}

// topk_key's inverses: the value (from the order-preserving bits; never asked of a taken slot's 0) and the slot
__device__ __forceinline__ float key_value(unsigned long long key) {
  const unsigned u = static_cast<unsigned>(key >> 32);
  return __uint_as_float((u & 0x80000000u) ? (u & 0x7fffffffu) : ~u);
}
__device__ __forceinline__ int key_slot(unsigned long long key) {
  return static_cast<int>(0xffffffffu - static_cast<unsigned>(key & 0xffffffffu));
}

// the largest key over the lanes of the warp, in every lane
__device__ __forceinline__ unsigned long long warp_max(unsigned long long v) {
  for (int o = 16; o > 0; o >>= 1) v = max(v, __shfl_xor_sync(kFullMask, v, o));
  return v;
}

// logsoftmax_topk's dynamic shared memory: the row's R floats, then (8-byte aligned) each warp's k picks
__host__ __device__ __forceinline__ int64_t picks_offset(int64_t R) { return (R + 1) / 2 * 2; }

template <typename scalar_t>
__global__ void __launch_bounds__(kTopkThreads)
logsoftmax_topk_kernel(const scalar_t* __restrict__ logits, int R, const int64_t* __restrict__ id_of, int k,
                       float* out_logp, int64_t* out_ids, int64_t id_rows) {
  id_of += static_cast<int64_t>(blockIdx.x) / id_rows * R;  // the id row of this logits row (ops.masked_topk)
  extern __shared__ float vals[];  // [R] the masked logits of this row
  __shared__ float fsm[33];
  const scalar_t* x = logits + static_cast<int64_t>(blockIdx.x) * R;
  float mx = -INFINITY;
  for (int i = threadIdx.x; i < R; i += blockDim.x) {
    // a NaN logit counts as -inf (a padding row's uninitialised inputs: its ids must still be real ones)
    const float v = id_of[i] >= 0 && !isnan(static_cast<float>(x[i])) ? static_cast<float>(x[i]) : -INFINITY;
    vals[i] = v;
    mx = fmaxf(mx, v);
  }
  mx = block_reduce(mx, MaxOp(), -INFINITY, fsm);
  float sum = 0.f;
  for (int i = threadIdx.x; i < R; i += blockDim.x) sum += expf(vals[i] - mx);
  const float lse = mx + logf(block_reduce(sum, AddOp(), 0.f, fsm));

  // the top k in two levels with no block-wide barrier per pick (k rounds of a block-wide argmax, two barriers
  // each, took ~18 us for 10 rows of ~6k slots on the H200): each warp picks the k best of the slots its lanes own
  // (k rounds of a warp argmax over the lanes' own bests; the lane holding the pick rescans its slots), then
  // warp 0 picks the k best of the warps' picks the same way. A key is unique (its slot is in it), so exactly one
  // lane holds each pick; a key of 0 (a warp owning fewer than k slots) is never picked while real keys remain.
  auto* picks = reinterpret_cast<unsigned long long*>(vals + picks_offset(R));  // [warps, k]
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  unsigned long long best = 0;
  for (int i = threadIdx.x; i < R; i += blockDim.x) best = max(best, topk_key(vals[i], i));
  for (int r = 0; r < k; ++r) {
    const unsigned long long key = warp_max(best);
    if (lane == 0) picks[warp * k + r] = key;
    if (key != 0 && best == key) {
      vals[key_slot(key)] = NAN;
      best = 0;
      for (int i = threadIdx.x; i < R; i += blockDim.x) best = max(best, topk_key(vals[i], i));
    }
  }
  __syncthreads();
  if (warp != 0) return;
  const int n = nwarps * k;
  best = 0;
  for (int j = lane; j < n; j += 32) best = max(best, picks[j]);
  // the r-th pick is kept by lane r (in a register: k <= kTopkMaxK = 32): the outputs, and the id_of
  // lookups they need, are written after the loop by every lane at once, not by one lane inside it (each lookup
  // a global load the whole warp would wait on, k times over)
  unsigned long long mine = 0;
  for (int r = 0; r < k; ++r) {
    const unsigned long long key = warp_max(best);
    if (lane == r) mine = key;
    if (best == key) {
      unsigned long long next = 0;
      for (int j = lane; j < n; j += 32) {
        if (picks[j] == key) picks[j] = 0;
        next = max(next, picks[j]);
      }
      best = next;
    }
  }
  if (lane < k) {
    const int64_t o = static_cast<int64_t>(blockIdx.x) * k + lane;
    if (mine == 0) {  // fewer than k slots in the row: -inf and id 0, as an empty slot's
      out_logp[o] = -INFINITY;
      out_ids[o] = 0;
    } else {
      const int slot = key_slot(mine);
      const int64_t id = id_of[slot];
      out_logp[o] = key_value(mine) - lse;
      out_ids[o] = id < 0 ? 0 : id;  // an empty slot only wins at -inf (ops.packed_head)
    }
  }
}

void check_long(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.is_cuda() && t.scalar_type() == at::kLong && t.is_contiguous(), name,
              " must be a contiguous int64 CUDA tensor");
}

// The arguments both window ops share: ids [B, n] and batch [B] (made contiguous), the scratch first [slots, V+1].
void check_rows(at::Tensor& ids, at::Tensor& batch, const at::Tensor& first, const char* op) {
  ids = ids.contiguous();
  batch = batch.contiguous();
  check_long(ids, "ids");
  check_long(batch, "batch");
  check_long(first, "first");
  TORCH_CHECK(ids.dim() == 2 && first.dim() == 2 && batch.dim() == 1 && batch.size(0) == ids.size(0), op,
              ": ids [B, n], first [slots, V+1], batch [B]");
}

}  // namespace

at::Tensor unique_first_rows(at::Tensor ids, at::Tensor first, at::Tensor batch) {
  check_rows(ids, batch, first, "unique_first_rows");
  const c10::cuda::CUDAGuard guard(ids.device());
  at::Tensor out = at::empty_like(ids);
  if (ids.numel() == 0) return out;
  unique_first_kernel<<<static_cast<unsigned>(ids.size(0)), kWindowThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
      ids.data_ptr<int64_t>(), ids.size(1), first.data_ptr<int64_t>(), first.size(1) - 1, out.data_ptr<int64_t>(),
      batch.data_ptr<int64_t>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

std::tuple<at::Tensor, at::Tensor> window_update_rows(at::Tensor ring, at::Tensor head, at::Tensor count,
                                                      at::Tensor slot_of, at::Tensor id_of, at::Tensor first,
                                                      at::Tensor new_ids, at::Tensor batch) {
  check_rows(new_ids, batch, first, "window_update_rows");
  check_long(ring, "ring");
  check_long(head, "head");
  check_long(slot_of, "slot_of");
  check_long(id_of, "id_of");
  TORCH_CHECK(count.is_cuda() && count.scalar_type() == at::kInt && count.is_contiguous(),
              "count must be a contiguous int32 CUDA tensor");
  TORCH_CHECK(ring.dim() == 2 && count.dim() == 2 && slot_of.dim() == 2 && id_of.dim() == 2 && head.dim() == 1,
              "window_update_rows: window state with a leading window dimension (see plugins/ops.py)");
  const int64_t S = ring.size(0), W = ring.size(1) - 1, V = count.size(1) - 1, R = id_of.size(1) - 1;
  const int64_t B = new_ids.size(0), n = new_ids.size(1);
  TORCH_CHECK(W > 0 && R > 0 && count.size(0) == S && slot_of.size(0) == S && id_of.size(0) == S &&
              first.size(0) == S && head.size(0) == S && slot_of.size(1) == V + 1 && first.size(1) == V + 1,
              "window state shapes do not match (see plugins/ops.py)");
  TORCH_CHECK(2 * n < (int64_t(1) << 31) && R < (int64_t(1) << 31), "window_update_rows: too many entries");
  const c10::cuda::CUDAGuard guard(ring.device());
  at::Tensor out_ids = at::empty({B, 2 * n}, new_ids.options());
  at::Tensor out_slots = at::empty({B, 2 * n}, new_ids.options());
  if (B == 0 || n == 0) return {out_ids, out_slots};
  window_update_kernel<<<static_cast<unsigned>(B), kWindowThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
      ring.data_ptr<int64_t>(), W, head.data_ptr<int64_t>(), count.data_ptr<int>(), V, slot_of.data_ptr<int64_t>(),
      id_of.data_ptr<int64_t>(), R, first.data_ptr<int64_t>(), new_ids.data_ptr<int64_t>(), n,
      out_ids.data_ptr<int64_t>(), out_slots.data_ptr<int64_t>(), batch.data_ptr<int64_t>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {out_ids, out_slots};
}

void gather_rows(at::Tensor src, at::Tensor ids, at::Tensor dst, at::Tensor slots) {
  ids = ids.contiguous();
  slots = slots.contiguous();
  check_long(ids, "ids");
  check_long(slots, "slots");
  TORCH_CHECK(src.is_cuda() && dst.is_cuda() && src.dim() == 2 && dst.dim() == 2 && ids.numel() == slots.numel(),
              "gather_rows: src, dst must be 2-D CUDA tensors and ids, slots of one length");
  TORCH_CHECK(src.scalar_type() == dst.scalar_type() && src.size(1) == dst.size(1),
              "gather_rows: src and dst rows differ");
  const int64_t es = src.element_size(), row_bytes = src.size(1) * es;
  const bool vec = src.stride(1) == 1 && dst.stride(1) == 1 && row_bytes % 16 == 0 &&
                   (src.stride(0) * es) % 16 == 0 && (dst.stride(0) * es) % 16 == 0 &&
                   reinterpret_cast<uintptr_t>(src.data_ptr()) % 16 == 0 &&
                   reinterpret_cast<uintptr_t>(dst.data_ptr()) % 16 == 0;
  if (!vec) {  // odd layouts: the reference itself
    dst.index_copy_(0, slots, src.index_select(0, ids));
    return;
  }
  if (ids.numel() == 0) return;
  const c10::cuda::CUDAGuard guard(src.device());
  gather_rows_kernel<<<static_cast<unsigned>(ids.numel()), kGatherThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
      static_cast<const uint4*>(src.data_ptr()), src.size(0), src.stride(0) * es / 16, ids.data_ptr<int64_t>(),
      static_cast<uint4*>(dst.data_ptr()), dst.size(0), dst.stride(0) * es / 16, slots.data_ptr<int64_t>(),
      row_bytes / 16);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// id_of [R]: one id row for every logits row (ops.packed_head); [B, R]: T / B consecutive logits rows each
// (ops.masked_topk: the rows of one request share its window's ids)
std::tuple<at::Tensor, at::Tensor> logsoftmax_topk(at::Tensor logits, at::Tensor id_of, int64_t k) {
  logits = logits.contiguous();
  id_of = id_of.contiguous();
  check_long(id_of, "id_of");
  TORCH_CHECK(logits.is_cuda() && logits.dim() == 2 && logits.size(1) == id_of.size(-1) && id_of.dim() <= 2,
              "logsoftmax_topk: logits must be [T, R] with id_of [R] or [B, R]");
  const int64_t T = logits.size(0), R = logits.size(1);
  const int64_t id_groups = id_of.dim() == 2 ? id_of.size(0) : 1;
  TORCH_CHECK(id_groups > 0 && T % id_groups == 0, "logsoftmax_topk: T must be a multiple of id_of's rows");
  const int64_t id_rows = T / id_groups > 0 ? T / id_groups : 1;
  TORCH_CHECK(R <= kTopkMaxRows && k >= 1 && k <= R && k <= kTopkMaxK, "logsoftmax_topk: needs R <= ",
              kTopkMaxRows, " and 1 <= k <= min(R, ", kTopkMaxK, ")");
  const c10::cuda::CUDAGuard guard(logits.device());
  at::Tensor logp = at::empty({T, k}, logits.options().dtype(at::kFloat));
  at::Tensor ids = at::empty({T, k}, id_of.options());
  if (T == 0) return {logp, ids};
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, logits.scalar_type(), "logsoftmax_topk", [&] {
    const size_t smem = picks_offset(R) * sizeof(float) + (kTopkThreads / 32) * k * sizeof(unsigned long long);
    logsoftmax_topk_kernel<scalar_t><<<static_cast<unsigned>(T), kTopkThreads, smem, c10::cuda::getCurrentCUDAStream()>>>(
        logits.data_ptr<scalar_t>(), static_cast<int>(R), id_of.data_ptr<int64_t>(), static_cast<int>(k),
        logp.data_ptr<float>(), ids.data_ptr<int64_t>(), id_rows);
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {logp, ids};
}

int64_t topk_max_rows() { return kTopkMaxRows; }
int64_t topk_max_k() { return kTopkMaxK; }

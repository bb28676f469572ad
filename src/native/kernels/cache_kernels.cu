// The GPU kernels of the device embedding cache, the device tables (static, uvm) and the
// HugeCTR slot combiner. Compiled at run time by NVRTC to PTX (triton_rec/gpu/kernels.py;
// no CUDA toolkit needed), loaded by the driver API (src/native/cuda_driver.hpp), in CI
// compiled for sm_80 and sm_90 without a device (tests/unit/test_gpu_kernels.py).
//
// The rules themselves are in array_cache_rules.hpp and hd.hpp, which the CPU twin
// (array_cache_twin.hpp) runs with one thread per key or set; here a warp takes a key (a
// query) or a set (a write). Every kernel is one launch per table per call, with no host
// synchronization inside: the cache's clock (and the TinyLFU aging) advance in the block
// that finishes last, counted in `done` (one counter per caller stream, zero between
// launches: the last block resets it).
#include "array_cache_rules.hpp"

namespace xc = triton_rec::xcache;

namespace {

constexpr int kWarp = 32;

// The cache clock this launch stamps with: meta[kClock] + 1, read once per block. The
// last block adds the 1 (tick_done): every block of a launch reads the same value.
__device__ int64_t block_tick(const int64_t* meta) {
  __shared__ int64_t tick;
  if (threadIdx.x == 0) tick = xc::load_fresh(meta + xc::kClock) + 1;
  __syncthreads();
  return tick;
}

// True in the block that finishes last (all other blocks' writes visible to it).
__device__ bool last_block(unsigned* done) {
  __shared__ bool last;
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    last = atomicAdd(done, 1u) == gridDim.x - 1;
  }
  __syncthreads();
  return last;
}

__device__ void add64(int64_t* p, int64_t v) {
  atomicAdd(reinterpret_cast<unsigned long long*>(p), static_cast<unsigned long long>(v));
}

// In the last block: advance the clock (a query or an insert), count the keys toward
// the TinyLFU aging and halve the sketch when due; reset `done` for the next launch.
__device__ void finish_launch(const xc::View& c, int64_t counted, bool tick, unsigned* done) {
  __shared__ int age;
  if (threadIdx.x == 0) {
    if (tick) xc::advance_clock(c);
    age = xc::count_keys(c, counted);
  }
  __syncthreads();
  if (age) {
    xc::halve_sketch(c, threadIdx.x, blockDim.x);
    __syncthreads();
    if (threadIdx.x == 0) xc::sketch_aged(c);
  }
  if (threadIdx.x == 0) *done = 0u;
}

}  // namespace

// Looks keys[0..n) up: out[i, :] the decoded vector (zeros for a miss), status[i] kHit,
// kMiss or kTorn. A warp per key.
extern "C" __global__ void trec_cache_query(xc::View c, const int64_t* keys, int64_t n, float* out,
                                            uint8_t* status, unsigned* done) {
  const int64_t tick = block_tick(c.meta);
  const xc::WarpGroup g;
  const int64_t per_block = blockDim.x / kWarp;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * per_block;
  for (int64_t i = blockIdx.x * per_block + threadIdx.x / kWarp; i < n; i += stride) {
    const uint8_t st = xc::query_key(g, c, keys[i], out + i * c.dim, tick);
    if (g.leader()) status[i] = st;
  }
  if (last_block(done)) finish_launch(c, n, true, done);
}

// Writes the sets sets[0..touched): set t gets keys[starts[t]..starts[t+1]) (distinct, in
// batch order) with rows rows[src[i]] (insert, update) by the rules of plan_set. A warp
// per set: its lane 0 decides, the warp copies. Counts go to result[kWriteCounts] and to
// the node-wide counters in meta. The caller holds the writer lock.
extern "C" __global__ void trec_cache_write(xc::View c, int32_t mode, const int64_t* keys,
                                            const int64_t* src, const int64_t* sets,
                                            const int64_t* starts, int64_t touched,
                                            const uint8_t* rows, int32_t* target, int64_t* result,
                                            unsigned* done) {
  const int64_t tick = block_tick(c.meta);
  const xc::WarpGroup g;
  const int64_t per_block = blockDim.x / kWarp;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * per_block;
  for (int64_t t = blockIdx.x * per_block + threadIdx.x / kWarp; t < touched; t += stride) {
    const int64_t s = sets[t], b = starts[t], count = starts[t + 1] - b;
    int64_t counts[xc::kWriteCounts] = {0, 0, 0, 0, 0, 0, 0};
    if (g.leader()) {
      xc::begin_write(c, s, &counts[xc::kWRecovered]);
      xc::plan_set(c, mode, s, keys + b, count, target + b, tick, counts);
    }
    g.sync();
    xc::copy_rows(g, c, s, src + b, count, target + b, rows);
    xc::fence();
    g.sync();
    if (g.leader()) {
      xc::end_write(c, s);
      constexpr int kMetaOf[xc::kWriteCounts] = {xc::kInserts,  xc::kUpdates,  xc::kEvictions,
                                                 xc::kRejected, xc::kOverflow, xc::kErased,
                                                 xc::kRecovered};
      for (int k = 0; k < xc::kWriteCounts; ++k) {
        if (counts[k] != 0) {
          add64(result + k, counts[k]);
          add64(c.meta + kMetaOf[k], counts[k]);
        }
      }
    }
  }
  if (last_block(done)) finish_launch(c, 0, mode == xc::kModeInsert, done);
}

// Empties the cache (ArrayEmbeddingCache.clear): every set healed, emptied and made even;
// the sketch zeroed and its count reset. A thread per set.
extern "C" __global__ void trec_cache_clear(xc::View c, int64_t* result) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  int64_t recovered = 0;
  for (int64_t s = first; s < c.num_sets; s += stride) {
    xc::begin_write(c, s, &recovered);
    for (int64_t w = 0; w < c.ways; ++w) c.valid[s * c.ways + w] = 0;
    xc::end_write(c, s);
  }
  if (c.sketch != nullptr) {
    unsigned* words = reinterpret_cast<unsigned*>(c.sketch);
    for (int64_t i = first; i < xc::kSketchRows * c.sketch_width / 4; i += stride) words[i] = 0u;
  }
  if (first == 0) xc::store_volatile(c.meta + xc::kIncs, 0);
  if (recovered != 0) {
    add64(result + xc::kWRecovered, recovered);
    add64(c.meta + xc::kRecovered, recovered);
  }
}

// Every set a dead writer left odd loses its ways and is made even
// (ArrayEmbeddingCache.repair). A thread per set; result[kWRecovered] counts them.
extern "C" __global__ void trec_cache_repair(xc::View c, int64_t* result) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  int64_t recovered = 0;
  for (int64_t s = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; s < c.num_sets;
       s += stride) {
    if (xc::load_fresh(c.seq + s) & 1) {
      xc::begin_write(c, s, &recovered);
      xc::end_write(c, s);
    }
  }
  if (recovered != 0) {
    add64(result + xc::kWRecovered, recovered);
    add64(c.meta + xc::kRecovered, recovered);
  }
}

// A whole table on the device (static: device memory; uvm: pinned host memory mapped into
// the device), in the node store's layout (hash_index.hpp): out[i, :] = the row of keys[i]
// decoded, or default_value with status kMiss when no slot holds it; kCorrupt for a slot
// that names a row outside the table (a corrupt index). A warp per key.
extern "C" __global__ void trec_table_lookup(const int64_t* slots, uint64_t capacity,
                                             const uint8_t* vectors, int64_t rows,
                                             int64_t precision, int64_t dim, int64_t row_bytes,
                                             const int64_t* keys, int64_t n, float* out,
                                             uint8_t* status, float default_value) {
  const int lane = threadIdx.x & (kWarp - 1);
  const int64_t per_block = blockDim.x / kWarp;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * per_block;
  for (int64_t i = blockIdx.x * per_block + threadIdx.x / kWarp; i < n; i += stride) {
    int64_t row = 0;
    if (lane == 0) row = triton_rec::probe_index(slots, capacity, keys[i]);
    row = static_cast<int64_t>(__shfl_sync(0xffffffffu, static_cast<long long>(row), 0));
    float* dst = out + i * dim;
    if (row >= 0 && row < rows) {
      triton_rec::decode_row_part(vectors + row * row_bytes, static_cast<uint32_t>(precision), dim,
                                  dst, lane, kWarp);
    } else {
      for (int64_t j = lane; j < dim; j += kWarp) dst[j] = default_value;
    }
    if (lane == 0)
      status[i] = row >= 0 && row < rows ? xc::kHit : row == -1 ? xc::kMiss : xc::kCorrupt;
  }
}

// HugeCTR's slot combiner (request_kernels.hpp combine_segments, the same sums in the same
// order): out[s, :] = sum of vectors[ptr[s]..ptr[s+1]), divided by the count when `mean`
// and the count is above 1; zeros for an empty slot. A thread per (slot, value).
extern "C" __global__ void trec_combine(const float* vectors, const int64_t* ptr, int64_t segments,
                                        int64_t dim, int32_t mean, float* out) {
  const int64_t total = segments * dim;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; e < total;
       e += stride) {
    const int64_t s = e / dim, d = e - s * dim;
    const int64_t a = ptr[s], b = ptr[s + 1];
    float acc = 0.0f;
    if (b > a) {
      acc = vectors[a * dim + d];
      for (int64_t r = a + 1; r < b; ++r) acc = __fadd_rn(acc, vectors[r * dim + d]);
      if (mean && b - a > 1) acc = __fdiv_rn(acc, static_cast<float>(b - a));
    }
    out[e] = acc;
  }
}

// The GPU kernels of the device embedding cache, the device tables (static, uvm) and the
// HugeCTR slot combiner. Compiled at run time by NVRTC to PTX (triton_rec/gpu/kernels.py;
// no CUDA toolkit needed), loaded by the driver API (src/native/cuda_driver.hpp), in CI
// compiled for sm_80 and sm_90 without a device (tests/unit/test_gpu_kernels.py).
//
// The rules themselves are in array_cache_rules.hpp and hd.hpp, which the CPU twin
// (array_cache_twin.hpp) runs with one thread per key or set; here a warp takes a key (a
// lookup) or a set (a write). A lookup is one launch for up to kLaunchTables tables (a
// request's), a write one launch per cache, with no host synchronization inside: the cache's clock
// (and the TinyLFU aging) advance in the block that finishes last, counted in `done` (one counter
// per caller stream, zero between launches: the last block resets it).
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

// In the last block: advance the clock (a query or an insert), count the keys toward
// the TinyLFU aging and halve the sketch when due. Every thread of the block calls it.
__device__ void finish_table(const xc::View& c, int64_t counted, bool tick) {
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
  __syncthreads();  // `age` is read by every thread before the next call writes it
}

// finish_table, then `done` reset for the next launch.
__device__ void finish_launch(const xc::View& c, int64_t counted, bool tick, unsigned* done) {
  finish_table(c, counted, tick);
  if (threadIdx.x == 0) *done = 0u;
}

}  // namespace

// Writes the sets sets[0..touched): set t gets keys[starts[t]..starts[t+1]) (distinct, in
// batch order) with rows rows[src[i]] (insert, update) by the rules of plan_set. A warp
// per set: its lane 0 takes the set (begin_write: its lock; `exclusive`: the caller holds
// the writer lock exclusively and heals what dead writers left) and decides, the warp
// copies. Counts go to result[kWriteCounts] and to the node-wide counters in meta; the
// keys of sets given up on (busy) to result[kWBusy], their targets kBusyTarget.
extern "C" __global__ void trec_cache_write(xc::View c, int32_t mode, int32_t exclusive,
                                            const int64_t* keys, const int64_t* src,
                                            const int64_t* sets, const int64_t* starts,
                                            int64_t touched, const uint8_t* rows, int32_t* target,
                                            int64_t* result, unsigned* done) {
  const int64_t tick = block_tick(c.meta);
  const xc::WarpGroup g;
  const int64_t per_block = blockDim.x / kWarp;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * per_block;
  for (int64_t t = blockIdx.x * per_block + threadIdx.x / kWarp; t < touched; t += stride) {
    const int64_t s = sets[t], b = starts[t], count = starts[t + 1] - b;
    int64_t counts[xc::kWriteCounts] = {0, 0, 0, 0, 0, 0, 0};
    int64_t taken = 1;
    if (g.leader()) {
      taken = xc::begin_write(c, s, exclusive != 0, &counts[xc::kWRecovered]);
      if (taken) {
        xc::plan_set(c, mode, s, keys + b, count, target + b, tick, counts);
      } else {
        xc::give_up_set(target + b, count, result);
      }
    }
    if (!g.broadcast(taken)) continue;  // the same in every lane
    g.sync();                           // lane 0's targets seen by every lane
    xc::copy_rows(g, c, s, src + b, count, target + b, rows);
    xc::fence();
    g.sync();
    if (g.leader()) {
      xc::end_write(c, s);
      xc::add_write_counts(c, counts, result);
    }
  }
  if (last_block(done)) finish_launch(c, 0, mode == xc::kModeInsert, done);
}

// Empties the cache (ArrayEmbeddingCache.clear; the caller holds the writer lock
// exclusively): every set healed, emptied and made even;
// the sketch zeroed and its count reset. A thread per set.
extern "C" __global__ void trec_cache_clear(xc::View c, int64_t* result) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  int64_t recovered = 0;
  for (int64_t s = first; s < c.num_sets; s += stride) {
    xc::begin_write(c, s, true, &recovered);
    for (int64_t w = 0; w < c.ways; ++w) c.valid[s * c.ways + w] = 0;
    xc::end_write(c, s);
  }
  if (c.sketch != nullptr) {
    unsigned* words = reinterpret_cast<unsigned*>(c.sketch);
    for (int64_t i = first; i < xc::kSketchRows * c.sketch_width / 4; i += stride) words[i] = 0u;
  }
  if (first == 0) xc::store_volatile(c.meta + xc::kIncs, 0);
  if (recovered != 0) {
    xc::add_fetch(result + xc::kWRecovered, recovered);
    xc::add_fetch(c.meta + xc::kRecovered, recovered);
  }
}

// Every set a dead writer left odd loses its ways and is made even
// (ArrayEmbeddingCache.repair; the caller holds the writer lock exclusively). A thread per set;
// result[kWRecovered] counts them.
extern "C" __global__ void trec_cache_repair(xc::View c, int64_t* result) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  int64_t recovered = 0;
  for (int64_t s = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; s < c.num_sets;
       s += stride) {
    if (xc::load_fresh(c.seq + s) & 1) {
      xc::begin_write(c, s, true, &recovered);
      xc::end_write(c, s);
    }
  }
  if (recovered != 0) {
    xc::add_fetch(result + xc::kWRecovered, recovered);
    xc::add_fetch(c.meta + xc::kRecovered, recovered);
  }
}

// Looks up the keys of `tables` tables (at most kLaunchTables) in one launch, so a request
// of many tables costs one launch, not one per table. For a cache: out = the decoded vector
// (zeros for a miss), status kHit, kMiss or kTorn; for a whole table (static: device
// memory; uvm: pinned host memory mapped into the device, in the node store's layout,
// hash_index.hpp): its row decoded, or the default value with kMiss, or kCorrupt for a
// slot that names a row outside the table (a corrupt index). targets[t] is table t; spans[2t] its
// first key in keys (ascending, the keys of table t up to spans[2t + 2]), spans[2t + 1] its first
// float in out; spans[2 * tables] one past the last key. A warp per key; each cache's clock
// advances once (in the last block), as one query of its keys does on the CPU twin; a table
// without keys is left alone, as the host skips a launch of no keys.
extern "C" __global__ void trec_lookup_tables(const xc::LookupTarget* targets, const int64_t* spans,
                                              int32_t tables, const int64_t* keys, float* out,
                                              uint8_t* status, unsigned* done) {
  __shared__ int64_t first[xc::kLaunchTables + 1], outs[xc::kLaunchTables],
      ticks[xc::kLaunchTables], row_bytes[xc::kLaunchTables];
  for (int t = threadIdx.x; t <= tables; t += blockDim.x) {
    first[t] = spans[2 * t];
    if (t == tables) break;
    outs[t] = spans[2 * t + 1];
    const xc::LookupTarget& tg = targets[t];  // a cache's clock: what its keys stamp with
    ticks[t] = tg.cache ? xc::load_fresh(tg.view.meta + xc::kClock) + 1 : 0;
    row_bytes[t] = tg.row_bytes();
  }
  __syncthreads();
  const xc::WarpGroup g;
  const int64_t per_block = blockDim.x / kWarp;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * per_block;
  for (int64_t i = first[0] + blockIdx.x * per_block + threadIdx.x / kWarp; i < first[tables];
       i += stride) {
    const int lo = xc::table_of(first, tables, i);
    // the table read into locals: the compiler keeps what it uses in registers (through
    // the array, every store to out would make it read the fields again)
    uint8_t st;
    if (targets[lo].cache) {
      const xc::View view = targets[lo].view;
      st = xc::query_key(g, view, keys[i], out + outs[lo] + (i - first[lo]) * view.dim, ticks[lo]);
    } else {
      const xc::WholeTable table = targets[lo].table;
      st = xc::whole_table_key(g, table, row_bytes[lo], keys[i],
                               out + outs[lo] + (i - first[lo]) * table.dim);
    }
    if (g.leader()) status[i] = st;
  }
  if (last_block(done)) {
    for (int t = 0; t < tables; ++t) {
      const int64_t n = first[t + 1] - first[t];
      if (targets[t].cache && n > 0) finish_table(targets[t].view, n, true);
    }
    if (threadIdx.x == 0) *done = 0u;
  }
}

// HugeCTR's slot combiner (request_kernels.hpp combine_segments, the same sums in the same
// order) for `tables` tables (at most kLaunchTables) in one launch: each slot's vectors
// summed, divided by their count when `mean` and the count is above 1; zeros for an empty
// slot. targets[t] is where table t's slots go; spans[3t] its first element (slot x value) of the
// launch, spans[3t + 1] its first float in vectors, spans[3t + 2] its first row pointer in ptr
// (segments + 1 of them, relative to its vectors); spans[3 * tables] one past the last
// element. A thread per element.
extern "C" __global__ void trec_combine_tables(const xc::CombineTarget* targets,
                                               const int64_t* spans, int32_t tables,
                                               const float* vectors, const int64_t* ptr) {
  __shared__ int64_t first[xc::kLaunchTables + 1];
  for (int t = threadIdx.x; t <= tables; t += blockDim.x) first[t] = spans[3 * t];
  __syncthreads();
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t e = first[0] + static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
       e < first[tables]; e += stride) {
    const int lo = xc::table_of(first, tables, e);
    const xc::CombineTarget c = targets[lo];  // in registers, as in trec_lookup_tables
    const int64_t local = e - first[lo], s = local / c.dim, d = local - s * c.dim;
    const float* v = vectors + spans[3 * lo + 1];
    const int64_t* p = ptr + spans[3 * lo + 2];
    const int64_t a = p[s], b = p[s + 1];
    float acc = 0.0f;
    if (b > a) {
      acc = v[a * c.dim + d];
      for (int64_t r = a + 1; r < b; ++r) acc = __fadd_rn(acc, v[r * c.dim + d]);
      if (c.mean && b - a > 1) acc = __fdiv_rn(acc, static_cast<float>(b - a));
    }
    c.out[local] = acc;
  }
}

// The rows the host answered for a cache's misses (their vectors written at their places in
// the request's answers, in pinned host memory mapped into the device) copied to the same
// places in device memory: row rows[i] (dim floats, from rows[i] * dim) for i < k. Only
// those rows cross the bus, where copying the table's whole answer there and back moved
// every hit too. A warp per row.
extern "C" __global__ void trec_scatter_rows(float* dst, const float* src, const int64_t* rows,
                                             int64_t k, int32_t dim) {
  const int64_t per_block = blockDim.x / kWarp;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * per_block;
  const int lane = static_cast<int>(threadIdx.x % kWarp);
  for (int64_t i = blockIdx.x * per_block + threadIdx.x / kWarp; i < k; i += stride) {
    const int64_t base = rows[i] * dim;
    for (int j = lane; j < dim; j += kWarp) dst[base + j] = src[base + j];
  }
}

// HugeCTR's combiner over a table's slots, on the host: what hot_paths.cpp and gpu_paths.cpp
// share, in a file of its own so the GPU paths' test (tests/native/gpu_host_paths.cpp) links
// it without the Triton API.
#include <stdexcept>
#include <vector>

#include "host.hpp"
#include "request_kernels.hpp"

namespace trec_host {

// Table t's slots of n samples combined (HugeCTR's combiner) from its `count` vectors with
// the segment pointers ptr[0..n * slots], into s.combined[t], set as s.embeddings[t] (the
// network's input).
void combine_table(const NativePlan& plan, Scratch& s, size_t t, int64_t n, const float* vectors,
                   int64_t count, const int64_t* ptr) {
  const int64_t dim = plan.table_dim(t);
  const int64_t segments = n * plan.slots[t];
  if (tr::one_row_per_segment(ptr, segments, count)) {
    s.embeddings[t] = vectors;  // one-hot: already the network's input, not copied
    return;
  }
  auto& combined = s.combined[t];
  combined.resize(static_cast<size_t>(segments * dim));
  if (!tr::combine_segments(vectors, count, dim, ptr, segments, plan.mean[t], combined.data())) {
    throw std::runtime_error("row pointers outside the table's keys");
  }
  s.embeddings[t] = combined.data();
}

// Where each table's vectors lie for the keys of a regrouped hugectr request, or in a
// dense request's EMBEDDINGS (s.key_starts: each table's keys): offsets in floats, one past
// the last table's end.
std::vector<int64_t> vector_offsets(const NativePlan& plan, const Scratch& s) {
  const size_t tables = plan.slots.size();
  std::vector<int64_t> voff(tables + 1, 0);
  for (size_t t = 0; t < tables; ++t) {
    voff[t + 1] = voff[t] + (s.key_starts[t + 1] - s.key_starts[t]) * plan.table_dim(t);
  }
  return voff;
}

void hps_starts(const NativePlan& plan, const int32_t* counts, std::vector<int64_t>* key_starts,
                std::vector<int64_t>* out_starts) {
  const size_t tables = plan.tables.size();
  key_starts->assign(tables + 1, 0);
  out_starts->assign(tables + 1, 0);
  for (size_t t = 0; t < tables; ++t) {
    (*key_starts)[t + 1] = (*key_starts)[t] + counts[t];
    (*out_starts)[t + 1] = (*out_starts)[t] + counts[t] * plan.tables[t].dim;
  }
}

}  // namespace trec_host

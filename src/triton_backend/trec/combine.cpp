// HugeCTR's combiner over a table's slots, on the host: what hot_paths.cpp and gpu_paths.cpp
// share, in a file of its own so the GPU paths' test (tests/native/gpu_host_paths.cpp) links
// it without the Triton API.
#include <stdexcept>

#include "host.hpp"
#include "request_kernels.hpp"

namespace trec_host {

// Table t's slots of n samples combined (HugeCTR's combiner) from its `count` vectors with
// the row pointers at s.ptrs[block...], into s.combined[t], appended to s.embeddings (the
// network's input). Returns the next table's block.
int64_t combine_table(const NativePlan& plan, Scratch& s, size_t t, int64_t n, const float* vectors,
                      int64_t count, int64_t block) {
  const int64_t dim = plan.table_dim(t);
  const int64_t segments = n * plan.slots[t];
  if (tr::one_row_per_segment(s.ptrs.data() + block, segments, count)) {
    s.embeddings.push_back(vectors);  // one-hot: already the network's input, not copied
    return block + segments + 1;
  }
  auto& combined = s.combined[t];
  combined.resize(static_cast<size_t>(segments * dim));
  if (!tr::combine_segments(vectors, count, dim, s.ptrs.data() + block, segments, plan.mean[t],
                            combined.data())) {
    throw std::runtime_error("row pointers outside the table's keys");
  }
  s.embeddings.push_back(combined.data());
  return block + segments + 1;
}

}  // namespace trec_host

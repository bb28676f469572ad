// The dense part of a HugeCTR network, natively (issue 14): the same layers and the same
// arithmetic as the numpy executor (triton_rec/dense/hugectr_network.py, the reference),
// in float32, one thread. The network arrives as a flat int64 program that the Python
// side encodes (HugeCTRNetwork.native_program: the single definition of the format);
// the program holds the addresses of the Python object's weight arrays, read only while
// the executor is made: every matrix a product reads is packed, here, for the CPU's kernel
// (gemm.hpp), and every other parameter copied, so a DenseNet holds all it reads and
// outlives the arrays it was made from (HugeCTRNetwork.native_net lets them go).
//
// Every tensor is a buffer of batch x (floats per sample), row-major, as numpy holds it.
// The products sum in float32 over k in order, so the results agree with numpy's within
// fp32 rounding (tests/unit/test_native_dense.py checks every test network), and a
// sample's answer does not depend on its batch.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "gemm.hpp"
#include "idle_pool.hpp"
#include "interaction.hpp"
#include "row_parts.hpp"

namespace triton_rec {

// The name of the PyCapsule that hands a std::shared_ptr<const DenseNet> from the Python
// module (bindings_dense_net.cpp, DenseNet.capsule) to the native Triton backend (plan.cpp).
inline constexpr const char* kDenseNetCapsule = "triton_rec.DenseNet";

// Op codes: the position of each type in NATIVE_LAYER_TYPES (hugectr_network.py).
enum class DenseOp : int64_t {
  kInnerProduct = 0,
  kMlp,
  kRelu,
  kSigmoid,
  kDropout,
  kConcat,
  kReshape,
  kInteraction,
  kMultiCross,
  kFmOrder2,
  kSlice,
  kWeightMultiply,
  kAdd,
  kElementwiseMultiply,
  kBatchNorm,
  kSigmoidLoss,
  kReduceSum,
  kCount
};

constexpr int64_t kDenseProgramMagic = 0x74726563646e7331;  // "trecdns1"

// sum_k a[k] * b[k] in eight interleaved partial sums (the compiler turns them into
// SIMD lanes; a single running sum would be one serial chain of additions). The order
// differs from numpy's, within float32 rounding, as numpy's BLAS order differs too.
inline float dot(const float* a, const float* b, int64_t n) {
  float acc[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
  int64_t k = 0;
  for (; k + 8 <= n; k += 8) {
    for (int j = 0; j < 8; ++j) acc[j] += a[k + j] * b[k + j];
  }
  float s = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
  for (; k < n; ++k) s += a[k] * b[k];
  return s;
}

struct DenseLayer {
  DenseOp op = DenseOp::kCount;
  std::vector<int64_t> ins, outs;
  std::vector<std::vector<int64_t>> in_shapes, out_shapes;  // per sample
  std::vector<const float*> params;
  std::vector<std::vector<int64_t>> param_shapes;
  std::vector<int64_t> attrs;
  std::vector<PackedMatrix> packed;   // the matrices its products read (pack_layer)
  std::vector<size_t> packed_params;  // the index in params of each
  bool relu = false;                  // an InnerProduct with the next ReLU in it (fuse_relus)
  bool concat_in = false;             // an Interaction reading a Concat's inputs (fuse_concat)
};

inline int64_t per_sample(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

class DenseNet {
 public:
  // Decodes a program (see HugeCTRNetwork.native_program) and packs its matrices for
  // `kernel` (the CPU's widest by default); throws std::invalid_argument on a malformed one.
  // max_threads: the most threads one call may split its rows across (row_parts.hpp;
  // 0: TRITON_REC_DENSE_THREADS, by default the usable cores).
  DenseNet(const int64_t* w, size_t n, const GemmKernel& kernel = gemm_kernel(),
           int max_threads = 0)
      : kernel_(&kernel), max_threads_(max_threads > 0 ? max_threads : dense_threads_from_env()) {
    size_t pos = 0;
    auto next = [&]() -> int64_t {
      if (pos >= n) throw std::invalid_argument("dense program truncated");
      return w[pos++];
    };
    auto list = [&]() {
      const int64_t k = next();
      if (k < 0 || static_cast<size_t>(k) > n) throw std::invalid_argument("bad list length");
      std::vector<int64_t> v(static_cast<size_t>(k));
      for (auto& x : v) x = next();
      return v;
    };
    if (next() != kDenseProgramMagic) throw std::invalid_argument("not a dense program");
    num_regs_ = next();
    widths_ = list();
    dense_reg_ = next();
    table_regs_ = list();
    out_regs_ = list();
    label_dim_ = next();
    const int64_t layers = next();
    for (int64_t l = 0; l < layers; ++l) {
      DenseLayer d;
      const int64_t op = next();
      if (op < 0 || op >= static_cast<int64_t>(DenseOp::kCount)) {
        throw std::invalid_argument("unknown dense op " + std::to_string(op));
      }
      d.op = static_cast<DenseOp>(op);
      d.ins = list();
      d.outs = list();
      for (size_t i = 0; i < d.ins.size(); ++i) d.in_shapes.push_back(list());
      for (size_t i = 0; i < d.outs.size(); ++i) d.out_shapes.push_back(list());
      const int64_t np = next();
      for (int64_t i = 0; i < np; ++i) {
        d.params.push_back(reinterpret_cast<const float*>(static_cast<uintptr_t>(next())));
        d.param_shapes.push_back(list());
      }
      d.attrs = list();
      for (int64_t r : d.ins) check_reg(r);
      for (int64_t r : d.outs) check_reg(r);
      pack_layer(&d);
      own_params(&d);
      layers_.push_back(std::move(d));
    }
    check_reg(dense_reg_);
    for (int64_t r : table_regs_) check_reg(r);
    for (int64_t r : out_regs_) check_reg(r);
    if (static_cast<int64_t>(widths_.size()) != num_regs_) {
      throw std::invalid_argument("dense program: one width per register expected");
    }
    fuse_relus();
    fuse_concat();
    assign_slots();
    for (const DenseLayer& d : layers_) macs_per_row_ += macs_per_row(d);
  }

  int64_t label_dim() const { return label_dim_; }
  // The rows of a call that give each of its threads a whole pass (kRowsPerPass): what a
  // caller that holds its inputs a chunk at a time feeds it at once (the native backend's
  // combine_and_predict), so its chunks cost no more than one call over the whole batch.
  int64_t chunk_rows() const { return kRowsPerPass * max_threads_; }
  const GemmKernel& kernel() const { return *kernel_; }
  int max_threads() const { return max_threads_; }
  // The op of each step it runs, after fuse_relus and fuse_concat.
  std::vector<int64_t> steps() const {
    std::vector<int64_t> ops;
    for (const DenseLayer& d : layers_) ops.push_back(static_cast<int64_t>(d.op));
    return ops;
  }
  int64_t dense_dim() const { return widths_[static_cast<size_t>(dense_reg_)]; }
  // Floats a sample of a workspace's activation buffers (assign_slots).
  int64_t workspace_floats() const {
    int64_t n = 0;
    for (int64_t w : slot_widths_) n += w;
    return n;
  }
  size_t num_tables() const { return table_regs_.size(); }
  // Floats per sample of table t's combined embeddings (slots x vec_size).
  int64_t table_width(size_t t) const { return widths_[static_cast<size_t>(table_regs_[t])]; }

  // Registers and temporaries of one thread, reused from call to call (no allocation
  // per request once they have grown to the batch size).
  struct Workspace {
    std::vector<std::vector<float>> regs;  // one buffer a slot (assign_slots)
    std::vector<const float*> ptr;
    std::vector<const float*> in;   // the inputs of the layer being run
    std::vector<float*> out;        // its outputs
    std::vector<float> tmp[2];      // MLP's hidden layers, MultiCross's projections
    std::vector<SlotSource> slots;  // the Interaction's embeddings
  };

  // out [batch, label_dim] from dense [batch, dense_dim] and, per table, the combined
  // embeddings [batch, slots, vec_size].
  // The rows are split across idle cores where the batch is worth it (row_parts.hpp):
  // each part runs the whole network on its rows, this thread taking parts too.
  void predict(int64_t batch, const float* dense, const std::vector<const float*>& embeddings,
               float* out, Workspace* ws) const {
    if (embeddings.size() != table_regs_.size()) {
      throw std::invalid_argument("dense network: wrong number of embedding inputs");
    }
    const IdleParts split(parts_worth(batch, macs_per_row_), max_threads_);
    const int parts = split.parts();
    if (parts == 1) {
      predict_rows(0, batch, dense, embeddings, out, ws);
      return;
    }
    const int64_t per = (batch + parts - 1) / parts;
    const std::thread::id caller = std::this_thread::get_id();
    RowPool::instance().run(parts, [&](int p) {
      const int64_t r0 = p * per, r1 = std::min(r0 + per, batch);
      if (r1 <= r0) return;
      if (std::this_thread::get_id() == caller) {
        predict_rows(r0, r1, dense, embeddings, out, ws);
        return;
      }
      const IdleLease<Workspace> own;  // a pool thread's part: a workspace of the process's
      predict_rows(r0, r1, dense, embeddings, out, own.get());
    });
  }

 private:
  // Multiply-adds of one sample in layer d (what parts_worth weighs a batch by).
  static int64_t macs_per_row(const DenseLayer& d) {
    int64_t macs = 0;
    const int64_t in = d.in_shapes.empty() ? 0 : per_sample(d.in_shapes[0]);
    for (const PackedMatrix& w : d.packed) macs += std::max<int64_t>(1, in / w.k()) * w.k() * w.n();
    if (d.op == DenseOp::kInteraction) {
      const int64_t dim = d.in_shapes[0].back();
      int64_t n = 1;
      for (size_t t = 1; t < d.in_shapes.size(); ++t) n += d.in_shapes[t][1];
      macs += n * (n - 1) / 2 * dim;
    }
    return macs;
  }

  // At most kRowsPerPass rows at a time: a workspace holds one pass's activations (those
  // alive together, assign_slots: 8 KB a sample for the MLPerf DLRM, 2.4 MB, not 0.5 GB
  // for a batch of 65,536, held by each part run at once: idle_pool.hpp), and they stay in
  // L2 between layers. Rows do not depend on their pass (every row is computed alike).
  static constexpr int64_t kRowsPerPass = 288;  // two of gemm.hpp's blocks of rows

  // Rows [r_begin, r_end) of the batch's inputs and output, a pass at a time.
  void predict_rows(int64_t r_begin, int64_t r_end, const float* dense,
                    const std::vector<const float*>& embeddings, float* out, Workspace* ws) const {
    thread_local std::vector<const float*> embs;  // the pass's rows of each table
    embs.resize(embeddings.size());
    for (int64_t r0 = r_begin; r0 < r_end; r0 += kRowsPerPass) {
      for (size_t t = 0; t < embeddings.size(); ++t) {
        embs[t] = embeddings[t] + r0 * table_width(t);
      }
      predict_pass(std::min(kRowsPerPass, r_end - r0), dense + r0 * dense_dim(), embs,
                   out + r0 * label_dim_, ws);
    }
  }

  void predict_pass(int64_t batch, const float* dense, const std::vector<const float*>& embeddings,
                    float* out, Workspace* ws) const {
    ws->regs.resize(slot_widths_.size());
    ws->ptr.assign(static_cast<size_t>(num_regs_), nullptr);
    ws->ptr[dense_reg_] = dense;
    for (size_t t = 0; t < table_regs_.size(); ++t) ws->ptr[table_regs_[t]] = embeddings[t];
    for (const DenseLayer& d : layers_) {
      ws->out.clear();
      for (int64_t r : d.outs) {
        const size_t slot = slot_of_[static_cast<size_t>(r)];
        auto& buf = ws->regs[slot];
        buf.resize(static_cast<size_t>(batch * slot_widths_[slot]));
        ws->ptr[r] = buf.data();
        ws->out.push_back(buf.data());
      }
      ws->in.clear();
      for (int64_t r : d.ins) ws->in.push_back(ws->ptr[r]);
      run(d, batch, ws);
    }
    if (out_regs_.size() == 1) {
      std::memcpy(out, ws->ptr[out_regs_[0]], sizeof(float) * batch * label_dim_);
      return;
    }
    // several tasks: each sample's outputs side by side
    for (int64_t b = 0; b < batch; ++b) {
      float* dst = out + b * label_dim_;
      for (int64_t r : out_regs_) {
        const int64_t w = widths_[r];
        std::memcpy(dst, ws->ptr[r] + b * w, sizeof(float) * w);
        dst += w;
      }
    }
  }

 private:
  void check_reg(int64_t r) const {
    if (r < 0 || r >= num_regs_) throw std::invalid_argument("dense program: bad register");
  }

  // The numpy executor's _sigmoid: 1 / (1 + exp(-clip(x, -88, 88))). The clip is
  // written with comparisons that let a NaN through, as np.clip does: std::min/std::max
  // turned a NaN into -88 (a prediction of 6e-39 instead of NaN).
  static float sigmoid(float x) {
    const float c = x < -88.0f ? -88.0f : (x > 88.0f ? 88.0f : x);
    const float z = std::exp(-c) + 1.0f;
    return 1.0f / z;
  }

  // np.maximum(x, 0): a NaN stays NaN (and -0 stays -0). `x > 0 ? x : 0` turned a NaN
  // into 0, so an overflow (inf - inf) vanished in the first ReLU and every sample
  // got the same finite prediction.
  static float relu_of(float x) { return x < 0.0f ? 0.0f : x; }

  // An InnerProduct whose output only the next layer, a ReLU, reads (HugeCTR's MLPs: fc
  // then relu) writes the ReLU's output itself, the ReLU applied as its sums are stored
  // (gemm.hpp), and the ReLU goes: one pass over the batch's activations less per layer.
  void fuse_relus() {
    std::vector<int64_t> reads(static_cast<size_t>(num_regs_), 0);
    for (const DenseLayer& d : layers_) {
      for (int64_t r : d.ins) ++reads[static_cast<size_t>(r)];
    }
    for (int64_t r : out_regs_) ++reads[static_cast<size_t>(r)];
    std::vector<DenseLayer> kept;
    for (size_t l = 0; l < layers_.size(); ++l) {
      DenseLayer& d = layers_[l];
      if (d.op == DenseOp::kInnerProduct && l + 1 < layers_.size()) {
        DenseLayer& next = layers_[l + 1];
        if (next.op == DenseOp::kRelu && next.ins.size() == 1 && next.ins[0] == d.outs[0] &&
            reads[static_cast<size_t>(d.outs[0])] == 1) {
          d.outs = next.outs;
          d.out_shapes = next.out_shapes;
          d.relu = true;
          ++l;
        }
      }
      kept.push_back(std::move(d));
    }
    layers_ = std::move(kept);
  }

  // A Concat along axis 1 of [1, slots_t, dim] inputs (per sample) whose output only an Interaction
  // reads (as its embeddings: DLRM's tables) is not copied: the Interaction reads each
  // slot where its table's output lies (one copy of a batch's embeddings less).
  void fuse_concat() {
    std::vector<int64_t> reads(static_cast<size_t>(num_regs_), 0);
    for (const DenseLayer& d : layers_) {
      for (int64_t r : d.ins) ++reads[static_cast<size_t>(r)];
    }
    for (int64_t r : out_regs_) ++reads[static_cast<size_t>(r)];
    std::vector<bool> dropped(layers_.size(), false);
    for (size_t l = 0; l < layers_.size(); ++l) {
      DenseLayer& c = layers_[l];
      if (c.op != DenseOp::kConcat || c.attrs.at(0) != 1 || c.outs.size() != 1 ||
          reads[static_cast<size_t>(c.outs[0])] != 1) {
        continue;
      }
      const auto& whole = c.out_shapes[0];  // [lead, slots, dim]
      bool slots_of_dim = whole.size() == 3;
      for (const auto& shape : c.in_shapes) {
        slots_of_dim =
            slots_of_dim && shape.size() == 3 && shape[0] == whole[0] && shape[2] == whole[2];
      }
      for (size_t m = l + 1; m < layers_.size() && slots_of_dim; ++m) {
        DenseLayer& x = layers_[m];
        if (x.op == DenseOp::kInteraction && x.ins.size() == 2 && x.ins[1] == c.outs[0] &&
            x.in_shapes[0][0] == whole[0]) {
          x.ins.resize(1);
          x.ins.insert(x.ins.end(), c.ins.begin(), c.ins.end());
          x.in_shapes.resize(1);
          x.in_shapes.insert(x.in_shapes.end(), c.in_shapes.begin(), c.in_shapes.end());
          x.concat_in = true;
          dropped[l] = true;
          break;
        }
      }
    }
    std::vector<DenseLayer> kept;
    for (size_t l = 0; l < layers_.size(); ++l) {
      if (!dropped[l]) kept.push_back(std::move(layers_[l]));
    }
    layers_ = std::move(kept);
  }

  // Which buffer of a workspace holds each register a step writes: a register's buffer
  // is free again after the last step that reads it (the network's outputs are read at
  // the end), and a step's outputs never share a buffer with its inputs. So a pass holds
  // the activations that are alive together, not all of them (the MLPerf DLRM: two
  // 1,024-wide ones at most, 8 KB a sample instead of 17 KB).
  void assign_slots() {
    const size_t n = static_cast<size_t>(num_regs_);
    const int64_t steps = static_cast<int64_t>(layers_.size());
    std::vector<int64_t> first(n, -1), last(n, -1);
    for (int64_t l = 0; l < steps; ++l) {
      const DenseLayer& d = layers_[static_cast<size_t>(l)];
      for (int64_t r : d.ins) last[static_cast<size_t>(r)] = l;
      for (int64_t r : d.outs) {
        if (first[static_cast<size_t>(r)] < 0) first[static_cast<size_t>(r)] = l;
      }
    }
    for (int64_t r : out_regs_) last[static_cast<size_t>(r)] = steps;
    for (size_t r = 0; r < n; ++r) last[r] = std::max(last[r], first[r]);  // written, unread
    slot_of_.assign(n, 0);
    slot_widths_.clear();
    std::vector<int64_t> holder;  // the register each slot holds now (-1: free)
    for (int64_t l = 0; l < steps; ++l) {
      for (int64_t& h : holder) {
        if (h >= 0 && last[static_cast<size_t>(h)] < l) h = -1;  // read for the last time
      }
      for (int64_t r : layers_[static_cast<size_t>(l)].outs) {
        if (first[static_cast<size_t>(r)] != l) continue;  // written before: keeps its slot
        size_t s = 0;
        while (s < holder.size() && holder[s] >= 0) ++s;
        if (s == holder.size()) {
          holder.push_back(-1);
          slot_widths_.push_back(0);
        }
        holder[s] = r;
        slot_of_[static_cast<size_t>(r)] = s;
        slot_widths_[s] = std::max(slot_widths_[s], widths_[static_cast<size_t>(r)]);
      }
    }
  }

  // The matrices of a layer's products, packed in the order run() reads them: an
  // InnerProduct's W (with b); each MLP layer's W_i (with b_i where it has one); each
  // MultiCross layer's U (no bias) and V (with b) when it projects.
  void pack_layer(DenseLayer* d) const {
    auto pack = [&](size_t w, const float* bias) {
      const auto& s = d->param_shapes.at(w);
      if (s.size() != 2) throw std::invalid_argument("dense program: a matrix is not 2-D");
      d->packed.emplace_back(d->params[w], bias, s[0], s[1], *kernel_);
      d->packed_params.push_back(w);
    };
    switch (d->op) {
      case DenseOp::kInnerProduct:
        pack(0, d->params.at(1));
        break;
      case DenseOp::kMlp: {
        const int64_t layers = d->attrs.at(0);
        for (int64_t i = 0; i < layers; ++i) {
          const bool bias = d->attrs.at(static_cast<size_t>(1 + layers + i)) != 0;
          pack(static_cast<size_t>(2 * i),
               bias ? d->params.at(static_cast<size_t>(2 * i + 1)) : nullptr);
        }
        break;
      }
      case DenseOp::kMultiCross:
        if (d->attrs.at(1) != 0) {
          for (int64_t l = 0; l < d->attrs.at(0); ++l) {
            pack(static_cast<size_t>(3 * l), nullptr);
            pack(static_cast<size_t>(3 * l + 1), d->params.at(static_cast<size_t>(3 * l + 2)));
          }
        }
        break;
      default:
        break;
    }
  }

  // After pack_layer: the parameters run() reads itself (all but the packed matrices,
  // whose packed copy holds their bias too) copied into the executor; the packed ones are
  // never read again (nullptr). Nothing of the program's arrays is read after this.
  void own_params(DenseLayer* d) {
    for (size_t i = 0; i < d->params.size(); ++i) {
      if (std::find(d->packed_params.begin(), d->packed_params.end(), i) !=
          d->packed_params.end()) {
        d->params[i] = nullptr;
        continue;
      }
      const int64_t count = per_sample(d->param_shapes[i]);
      if (count < 0) throw std::invalid_argument("dense program: a negative parameter shape");
      owned_.emplace_back(d->params[i], d->params[i] + count);
      d->params[i] = owned_.back().data();
    }
  }

  void run(const DenseLayer& d, int64_t batch, Workspace* ws) const {
    const std::vector<const float*>& in = ws->in;
    const std::vector<float*>& out = ws->out;
    const int64_t total_in = d.ins.empty() ? 0 : batch * per_sample(d.in_shapes[0]);
    switch (d.op) {
      case DenseOp::kInnerProduct: {
        const PackedMatrix& w = d.packed[0];
        w.run(total_in / w.k(), in[0], d.relu, out[0]);
        break;
      }
      case DenseOp::kMlp: {
        // attrs: n, relu[n], bias[n]; params W0, b0, W1, b1, ...
        const int64_t layers = d.attrs[0];
        const int64_t rows = batch * d.in_shapes[0][0];
        const float* x = in[0];
        for (int64_t i = 0; i < layers; ++i) {
          const PackedMatrix& w = d.packed[static_cast<size_t>(i)];
          auto& hidden = ws->tmp[i % 2];  // the layer before reads the other one
          float* y = i + 1 == layers ? out[0] : (hidden.resize(rows * w.n()), hidden.data());
          w.run(rows, x, d.attrs[1 + i] != 0, y);
          x = y;
        }
        break;
      }
      case DenseOp::kRelu:
        for (int64_t i = 0; i < total_in; ++i) out[0][i] = relu_of(in[0][i]);
        break;
      case DenseOp::kSigmoid:
      case DenseOp::kSigmoidLoss:
        for (int64_t i = 0; i < total_in; ++i) out[0][i] = sigmoid(in[0][i]);
        break;
      case DenseOp::kDropout:
      case DenseOp::kReshape:
        if (d.attrs.empty()) {  // a row-major reinterpretation: the same floats
          std::memcpy(out[0], in[0], sizeof(float) * total_in);
        } else {  // selected slots of [rows, S, V], in list order
          const auto& s = d.in_shapes[0];
          const int64_t rows = batch * s[0], slots = s[1], v = s[2];
          const int64_t picked = static_cast<int64_t>(d.attrs.size());
          for (int64_t r = 0; r < rows; ++r) {
            for (int64_t j = 0; j < picked; ++j) {
              std::memcpy(out[0] + (r * picked + j) * v, in[0] + (r * slots + d.attrs[j]) * v,
                          sizeof(float) * v);
            }
          }
        }
        break;
      case DenseOp::kConcat: {  // attrs: axis (1 for 2-D); the inputs' blocks side by side
        const size_t axis = static_cast<size_t>(d.attrs[0]);
        const auto& s0 = d.in_shapes[0];
        int64_t rows = batch;
        for (size_t i = 0; i < axis; ++i) rows *= s0[i];
        auto chunk = [&](size_t t) {  // floats of input t per row
          int64_t c = 1;
          for (size_t i = axis; i < d.in_shapes[t].size(); ++i) c *= d.in_shapes[t][i];
          return c;
        };
        // row by row: the output written once in order (input by input, DLRM's 26 tables
        // made 26 strided passes over it)
        float* y = out[0];
        for (int64_t r = 0; r < rows; ++r) {
          for (size_t t = 0; t < in.size(); ++t) {
            const int64_t w = chunk(t);
            std::memcpy(y, in[t] + r * w, sizeof(float) * w);
            y += w;
          }
        }
        break;
      }
      case DenseOp::kReduceSum: {  // attrs: axis (>= 1), kept with size 1
        const size_t axis = static_cast<size_t>(d.attrs[0]);
        const auto& s = d.in_shapes[0];
        int64_t outer = batch, inner = 1;
        for (size_t i = 0; i < axis; ++i) outer *= s[i];
        for (size_t i = axis + 1; i < s.size(); ++i) inner *= s[i];
        const int64_t mid = s[axis];
        for (int64_t o = 0; o < outer; ++o) {
          float* y = out[0] + o * inner;
          std::fill(y, y + inner, 0.0f);
          for (int64_t m = 0; m < mid; ++m) {
            const float* x = in[0] + (o * mid + m) * inner;
            for (int64_t i = 0; i < inner; ++i) y[i] += x[i];
          }
        }
        break;
      }
      case DenseOp::kInteraction: {
        const int64_t rows = batch * d.in_shapes[0][0], dim = d.in_shapes[0][1];
        auto& slots = ws->slots;
        slots.clear();
        if (d.concat_in) {  // each input [1, slots_t, dim]: its slots in order
          for (size_t t = 1; t < in.size(); ++t) {
            const int64_t s = d.in_shapes[t][1];
            for (int64_t j = 0; j < s; ++j) slots.push_back({in[t] + j * dim, s * dim});
          }
        } else {  // one [1, slots, dim] input
          slots.resize(static_cast<size_t>(d.in_shapes[1][1]));
          contiguous_slots(in[1], d.in_shapes[1][1], dim, slots.data());
        }
        interaction_rows(rows, dim, static_cast<int64_t>(slots.size()), d.out_shapes[0][1], in[0],
                         slots.data(), out[0]);
        break;
      }
      case DenseOp::kMultiCross: {
        const int64_t layers = d.attrs[0], proj = d.attrs[1];
        const int64_t rows = batch * d.in_shapes[0][0], dim = d.in_shapes[0][1];
        float* xl = out[0];  // x_l, computed in place in the output
        std::memcpy(xl, in[0], sizeof(float) * rows * dim);
        auto& t = ws->tmp[0];
        auto& u = ws->tmp[1];
        t.resize(rows * dim);
        u.resize(proj ? rows * proj : 0);
        for (int64_t l = 0; l < layers; ++l) {
          if (proj) {  // x0 * ((xl U) V + b) + xl
            d.packed[static_cast<size_t>(2 * l)].run(rows, xl, false, u.data());
            d.packed[static_cast<size_t>(2 * l + 1)].run(rows, u.data(), false, t.data());
            for (int64_t i = 0; i < rows * dim; ++i) xl[i] = in[0][i] * t[i] + xl[i];
          } else {  // x0 * (xl . w) + xl + b
            const float* w = d.params[2 * l];
            const float* b = d.params[2 * l + 1];
            for (int64_t r = 0; r < rows; ++r) {
              float* x = xl + r * dim;
              const float s = dot(x, w, dim);
              const float* x0 = in[0] + r * dim;
              for (int64_t k = 0; k < dim; ++k) x[k] = x0[k] * s + x[k] + b[k];
            }
          }
        }
        break;
      }
      case DenseOp::kFmOrder2: {
        const int64_t rows = batch * d.in_shapes[0][0];
        const int64_t width = d.in_shapes[0][1], dim = d.out_shapes[0][1], s = width / dim;
        for (int64_t r = 0; r < rows; ++r) {
          const float* x = in[0] + r * width;
          for (int64_t k = 0; k < dim; ++k) {
            float sum = 0.0f, sq = 0.0f;
            for (int64_t j = 0; j < s; ++j) sum += x[j * dim + k];
            for (int64_t j = 0; j < s; ++j) sq += x[j * dim + k] * x[j * dim + k];
            out[0][r * dim + k] = 0.5f * (sum * sum - sq);
          }
        }
        break;
      }
      case DenseOp::kSlice: {  // attrs: a0, b0, a1, b1, ... on the last dimension
        const int64_t width = d.in_shapes[0].back(), rows = total_in / width;
        for (size_t k = 0; k < out.size(); ++k) {
          const int64_t a = d.attrs[2 * k], w = d.attrs[2 * k + 1] - a;
          for (int64_t r = 0; r < rows; ++r) {
            std::memcpy(out[k] + r * w, in[0] + r * width + a, sizeof(float) * w);
          }
        }
        break;
      }
      case DenseOp::kWeightMultiply: {
        const int64_t s = d.param_shapes[0][0], e = d.param_shapes[0][1];
        const int64_t rows = total_in / s;
        for (int64_t r = 0; r < rows; ++r) {
          for (int64_t i = 0; i < s; ++i) {
            const float x = in[0][r * s + i];
            for (int64_t j = 0; j < e; ++j)
              out[0][(r * s + i) * e + j] = x * d.params[0][i * e + j];
          }
        }
        break;
      }
      case DenseOp::kAdd:
      case DenseOp::kElementwiseMultiply: {
        const bool add = d.op == DenseOp::kAdd;
        std::memcpy(out[0], in[0], sizeof(float) * total_in);
        for (size_t t = 1; t < in.size(); ++t) {
          for (int64_t i = 0; i < total_in; ++i) {
            out[0][i] = add ? out[0][i] + in[t][i] : out[0][i] * in[t][i];
          }
        }
        break;
      }
      case DenseOp::kBatchNorm: {  // params gamma, beta, mean, inv_std
        const int64_t n = d.in_shapes[0][1], rows = total_in / n;
        const float *g = d.params[0], *b = d.params[1], *mean = d.params[2], *inv = d.params[3];
        for (int64_t r = 0; r < rows; ++r) {
          for (int64_t k = 0; k < n; ++k) {
            out[0][r * n + k] = g[k] * ((in[0][r * n + k] - mean[k]) * inv[k]) + b[k];
          }
        }
        break;
      }
      default:
        throw std::invalid_argument("dense op not implemented");
    }
  }

  const GemmKernel* kernel_;
  int max_threads_;
  int64_t macs_per_row_ = 0;
  int64_t num_regs_ = 0, dense_reg_ = 0, label_dim_ = 0;
  std::vector<int64_t> widths_, table_regs_, out_regs_;
  std::vector<size_t> slot_of_;       // each register's workspace buffer (assign_slots)
  std::vector<int64_t> slot_widths_;  // floats a sample of each buffer
  std::vector<DenseLayer> layers_;
  std::vector<std::vector<float>> owned_;  // the parameters run() reads (own_params)
};

}  // namespace triton_rec

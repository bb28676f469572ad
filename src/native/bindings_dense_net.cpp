// The native dense executor of triton_rec._native (dense_net.hpp): DenseNet and its kernels,
// for tests and tools. Registered by bindings.cpp.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "dense_net.hpp"
#include "py_checks.hpp"

namespace py = pybind11;
namespace tr = triton_rec;
using namespace triton_rec::pycheck;  // NOLINT: the argument checks

// ============================================================================
// DenseNet: the native dense executor (dense_net.hpp), for tests and tools; the native
// Triton backend runs the same class on the request path.
// ============================================================================
namespace {

// The executor holds all it reads once made (dense_net.hpp), so the arrays the program
// points to are needed only by the constructor. Held by a shared_ptr that the native
// Triton backend shares through capsule() (src/triton_backend/trec/plan.cpp).
struct PyDenseNet {
  std::shared_ptr<const tr::DenseNet> ptr;
  const tr::DenseNet& net() const { return *ptr; }
};

// The HugeCTR layer type each op code of the program runs (DenseOp: the codes are defined
// there, once; exported as DENSE_OPS, which HugeCTRNetwork.native_program writes). Both loss
// layers that become a sigmoid at inference share one code.
struct LayerOp {
  const char* layer;
  tr::DenseOp op;
};
constexpr LayerOp kLayerOps[] = {
    {"InnerProduct", tr::DenseOp::kInnerProduct},
    {"MLP", tr::DenseOp::kMlp},
    {"ReLU", tr::DenseOp::kRelu},
    {"Sigmoid", tr::DenseOp::kSigmoid},
    {"Dropout", tr::DenseOp::kDropout},
    {"Concat", tr::DenseOp::kConcat},
    {"Reshape", tr::DenseOp::kReshape},
    {"Interaction", tr::DenseOp::kInteraction},
    {"MultiCross", tr::DenseOp::kMultiCross},
    {"FmOrder2", tr::DenseOp::kFmOrder2},
    {"Slice", tr::DenseOp::kSlice},
    {"WeightMultiply", tr::DenseOp::kWeightMultiply},
    {"Add", tr::DenseOp::kAdd},
    {"ElementwiseMultiply", tr::DenseOp::kElementwiseMultiply},
    {"BatchNorm", tr::DenseOp::kBatchNorm},
    {"BinaryCrossEntropyLoss", tr::DenseOp::kSigmoidLoss},
    {"MultiCrossEntropyLoss", tr::DenseOp::kSigmoidLoss},
    {"ReduceSum", tr::DenseOp::kReduceSum},
};

}  // namespace

void register_dense_net(py::module_& m) {
  py::dict ops;
  for (const LayerOp& o : kLayerOps) ops[o.layer] = static_cast<int64_t>(o.op);
  m.attr("DENSE_OPS") = ops;
  m.attr("DENSE_OP_COUNT") = static_cast<int64_t>(tr::DenseOp::kCount);
  m.attr("DENSE_PROGRAM_MAGIC") = tr::kDenseProgramMagic;
  py::class_<PyDenseNet>(m, "DenseNet",
                         "DenseNet(program: int64[N], owner=None, gemm='auto', threads=0) -- the "
                         "native executor of a HugeCTRNetwork.native_program(); `owner`, the "
                         "object holding the arrays the program points to, must live while it "
                         "is made (it keeps what it reads: packed matrices, copied parameters); "
                         "`gemm` names the matrix-product kernel (gemm_kernels()); `threads` "
                         "caps the threads one call splits its rows across (0: "
                         "TRITON_REC_DENSE_THREADS, by default the usable cores)")
      .def(py::init([](py::array_t<int64_t, py::array::c_style> program, const py::object& owner,
                       const std::string& gemm, int threads) {
             (void)owner;  // alive for the call: the constructor reads its arrays
             try {
               return new PyDenseNet{std::make_shared<const tr::DenseNet>(
                   program.data(), static_cast<size_t>(program.size()), tr::gemm_kernel(gemm),
                   threads)};
             } catch (const std::invalid_argument& e) {
               throw py::value_error(e.what());
             }
           }),
           py::arg("program"), py::arg("owner") = py::none(), py::arg("gemm") = "auto",
           py::arg("threads") = 0)
      .def(
          "capsule",
          [](const PyDenseNet& self) {
            auto* held = new std::shared_ptr<const tr::DenseNet>(self.ptr);
            PyObject* c = PyCapsule_New(held, tr::kDenseNetCapsule, [](PyObject* c) {
              delete static_cast<std::shared_ptr<const tr::DenseNet>*>(
                  PyCapsule_GetPointer(c, tr::kDenseNetCapsule));
            });
            if (c == nullptr) {
              delete held;
              throw py::error_already_set();
            }
            return py::reinterpret_steal<py::object>(c);
          },
          "A PyCapsule named triton_rec.DenseNet holding a std::shared_ptr<const DenseNet> "
          "of this executor: how the native Triton backend runs this very one.")
      .def_property_readonly(
          "threads", [](const PyDenseNet& self) { return self.net().max_threads(); },
          "The most threads one call splits its rows across.")
      .def_property_readonly(
          "gemm", [](const PyDenseNet& self) { return std::string(self.net().kernel().name); },
          "The kernel its matrix products run on.")
      .def_property_readonly(
          "workspace_floats", [](const PyDenseNet& self) { return self.net().workspace_floats(); },
          "Floats a sample of a thread's activation buffers: the activations alive together.")
      .def_property_readonly(
          "steps",
          [](const PyDenseNet& self) {
            py::list ops;
            for (int64_t op : self.net().steps()) ops.append(op);
            return ops;
          },
          "The op code of each step it runs (a ReLU or Concat folded into the step that "
          "produces or reads its tensor is not one).")
      .def(
          "predict",
          [](const PyDenseNet& self, py::array_t<float, py::array::c_style> dense,
             const py::list& embeddings) {
            const tr::DenseNet& net = self.net();
            if (dense.ndim() != 2 || dense.shape(1) != net.dense_dim()) {
              throw py::value_error("dense must be [batch, dense_dim]");
            }
            const int64_t batch = dense.shape(0);
            if (embeddings.size() != net.num_tables()) {
              throw py::value_error("one embedding array per table expected");
            }
            std::vector<py::array_t<float, py::array::c_style>> held;
            std::vector<const float*> emb;
            for (size_t t = 0; t < embeddings.size(); ++t) {
              held.emplace_back(py::array_t<float, py::array::c_style>::ensure(embeddings[t]));
              if (!held.back() || held.back().size() != batch * net.table_width(t)) {
                throw py::value_error("embeddings[" + std::to_string(t) +
                                      "] must be float32 [batch, slots, vec_size]");
              }
              emb.push_back(held.back().data());
            }
            py::array_t<float> out({batch, net.label_dim()});
            float* o = out.mutable_data();
            const float* d = dense.data();
            {
              py::gil_scoped_release release;
              // reused from call to call and given back once idle, as on the request path
              const tr::IdleLease<tr::DenseNet::Workspace> ws;
              net.predict(batch, d, emb, o, ws.get());
            }
            return out;
          },
          py::arg("dense"), py::arg("embeddings"),
          "predict(dense: float32[B, dense_dim], embeddings: list of float32[B, slots, vec]) "
          "-> float32[B, label_dim]");
  // Each kernel of DLRM's interaction on its own, for tests/unit/test_native_dense.py
  // (the executor itself takes the CPU's widest, interaction_rows).
  m.def(
      "interaction_kernels",
      []() {
        py::list k;
        k.append("auto");
        for (const tr::InteractionKernel& each : tr::interaction_kernels()) k.append(each.name);
        return k;
      },
      "The interaction kernels this CPU runs (names for interaction()).");
  m.def(
      "interaction",
      [](py::array_t<float, py::array::c_style> mlp, py::array_t<float, py::array::c_style> emb,
         const std::string& kernel) {
        if (mlp.ndim() != 2 || emb.ndim() != 3 || emb.shape(0) != mlp.shape(0) ||
            emb.shape(2) != mlp.shape(1)) {
          throw py::value_error("mlp and emb must be float32 [rows, dim] and [rows, slots, dim]");
        }
        const int64_t rows = mlp.shape(0), dim = mlp.shape(1), slots = emb.shape(1);
        const int64_t n = slots + 1, width = dim + n * (n - 1) / 2 + 1;
        tr::InteractionFn fn = nullptr;
        if (kernel == "auto") fn = tr::interaction_rows;
        for (const tr::InteractionKernel& each : tr::interaction_kernels()) {
          if (kernel == each.name) fn = each.fn;
        }
        if (fn == nullptr) throw py::value_error("no interaction kernel " + kernel + " here");
        py::array_t<float> out({rows, width});
        {
          py::gil_scoped_release release;
          std::vector<tr::SlotSource> sources(static_cast<size_t>(slots));
          tr::contiguous_slots(emb.data(), slots, dim, sources.data());
          fn(rows, dim, slots, width, mlp.data(), sources.data(), out.mutable_data());
        }
        return out;
      },
      py::arg("mlp"), py::arg("emb"), py::arg("kernel") = "auto",
      "interaction(mlp: float32[R, d], emb: float32[R, S, d], kernel) -> float32[R, width]: "
      "DLRM's interaction by one kernel (see interaction_kernels()).");
  m.def(
      "gemm_kernels",
      []() {
        py::list k;
        for (const tr::GemmKernel& g : tr::gemm_kernels()) k.append(g.name);
        return k;
      },
      "The matrix-product kernels this CPU runs, the widest (the default) first (gemm.hpp).");
}

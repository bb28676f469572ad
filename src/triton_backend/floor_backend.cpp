// Backend "trec_floor": the native floor of the served-overhead benchmark (issue 14). It
// does no lookup: it reads the inputs' metadata and counts, checks them and answers zeros
// of the answer's size in OUTPUT0 (FP32). What a request costs in it is what Triton plus a
// C++ backend cost, the lowest a native backend can reach. Two interfaces, by parameter:
// - `vec_sizes` ("16,8"): the `hps` interface, KEYS INT64 and NUMKEYS INT32 [T] or
//   [1, T]; sum_t NUMKEYS[t] * vec_sizes[t] floats;
// - `tables` and `slots` (total slots): the `hugectr` interface, DES, CATCOLUMN and
//   ROWINDEX INT32 with tables + samples x slots values; one float per sample. With
//   `middle` "EMBEDDINGS", the `dense` interface (DES, EMBEDDINGS, ROWINDEX) instead.
#include <chrono>
#include <cstring>
#include <string>
#include <vector>

#include "backend_util.hpp"
#include "triton_api.h"

namespace {

struct FloorModel {
  std::vector<int64_t> vec_sizes;    // the hps interface
  int64_t tables = 0, slots = 0;     // the hugectr interface (when vec_sizes is empty)
  std::string middle = "CATCOLUMN";  // or EMBEDDINGS: the dense interface
};

using trec_backend::now_ns;

TRITONSERVER_Error* invalid(const std::string& msg) {
  return TRITONSERVER_ErrorNew(TRITONSERVER_ERROR_INVALID_ARG, msg.c_str());
}

// The string value of config.pbtxt parameter `key` in the model config JSON (""
// if absent).
std::string parameter(const std::string& json, const std::string& key) {
  const size_t at = json.find("\"" + key + "\"");
  if (at == std::string::npos) return "";
  const std::string tag = "\"string_value\":\"";
  const size_t v = json.find(tag, at);
  if (v == std::string::npos) return "";
  const size_t end = json.find('"', v + tag.size());
  return end == std::string::npos ? "" : json.substr(v + tag.size(), end - v - tag.size());
}

bool parse_sizes(const std::string& text, std::vector<int64_t>* out) {
  size_t pos = 0;
  while (pos <= text.size()) {
    const size_t comma = std::min(text.find(',', pos), text.size());
    const std::string item = text.substr(pos, comma - pos);
    if (item.empty()) return false;
    int64_t v = 0;
    for (char c : item) {
      if (c < '0' || c > '9' || v > (int64_t{1} << 40)) return false;
      v = v * 10 + (c - '0');
    }
    if (v < 1) return false;
    out->push_back(v);
    pos = comma + 1;
  }
  return !out->empty();
}

// Copies a (possibly split) CPU input into `dst` (exactly `bytes` bytes).
TRITONSERVER_Error* read_input(TRITONBACKEND_Input* input, uint32_t buffers, uint64_t bytes,
                               char* dst) {
  return trec_backend::read_cpu(input, buffers, bytes, dst)
             ? nullptr
             : invalid("input is not readable from CPU memory in the size its tensor has");
}

// The request's input `name`, or an error naming it (the server's own error is freed).
TRITONSERVER_Error* find_input(TRITONBACKEND_Request* request, const char* name,
                               TRITONBACKEND_Input** input) {
  *input = nullptr;
  if (auto* e = TRITONBACKEND_RequestInput(request, name, input)) TRITONSERVER_ErrorDelete(e);
  return *input != nullptr ? nullptr : invalid(std::string("missing input ") + name);
}

// One float per sample of a whole-model (or dense) request: (len(ROWINDEX) - tables) / slots.
TRITONSERVER_Error* samples(TRITONBACKEND_Request* request, const FloorModel& m, int64_t* floats) {
  TRITONBACKEND_Input* input = nullptr;
  for (const char* name : {"DES", m.middle.c_str(), "ROWINDEX"}) {  // ROWINDEX last: kept
    if (auto* e = find_input(request, name, &input)) return e;
  }
  const char* name = nullptr;
  TRITONSERVER_DataType type = TRITONSERVER_TYPE_INVALID;
  const int64_t* shape = nullptr;
  uint32_t dims = 0, buffers = 0;
  uint64_t bytes = 0;
  if (auto* e =
          TRITONBACKEND_InputProperties(input, &name, &type, &shape, &dims, &bytes, &buffers)) {
    return e;
  }
  if (type != TRITONSERVER_TYPE_INT32) return invalid("ROWINDEX must be INT32");
  const int64_t rows = static_cast<int64_t>(bytes / 4);
  if (rows <= m.tables || (rows - m.tables) % m.slots != 0) {
    return invalid("ROWINDEX has " + std::to_string(rows) + " values, not " +
                   std::to_string(m.tables) + " + samples x " + std::to_string(m.slots));
  }
  *floats = (rows - m.tables) / m.slots;
  return nullptr;
}

// The floats of the answer to one request, or an error naming what is wrong.
TRITONSERVER_Error* answer_size(TRITONBACKEND_Request* request, const FloorModel& m,
                                int64_t* floats) {
  if (m.vec_sizes.empty()) return samples(request, m, floats);
  TRITONBACKEND_Input* keys = nullptr;
  TRITONBACKEND_Input* numkeys = nullptr;
  if (auto* e = find_input(request, "KEYS", &keys)) return e;
  if (auto* e = find_input(request, "NUMKEYS", &numkeys)) return e;
  const char* name = nullptr;
  TRITONSERVER_DataType type = TRITONSERVER_TYPE_INVALID;
  const int64_t* shape = nullptr;
  uint32_t dims = 0, buffers = 0;
  uint64_t key_bytes = 0, count_bytes = 0;
  if (auto* e =
          TRITONBACKEND_InputProperties(keys, &name, &type, &shape, &dims, &key_bytes, &buffers)) {
    return e;
  }
  if (type != TRITONSERVER_TYPE_INT64) return invalid("KEYS must be INT64");
  if (auto* e = TRITONBACKEND_InputProperties(numkeys, &name, &type, &shape, &dims, &count_bytes,
                                              &buffers)) {
    return e;
  }
  if (type != TRITONSERVER_TYPE_INT32) return invalid("NUMKEYS must be INT32");
  const size_t tables = m.vec_sizes.size();
  if (count_bytes != 4 * tables) {
    return invalid("NUMKEYS has " + std::to_string(count_bytes / 4) + " counts but the model has " +
                   std::to_string(tables) + " tables");
  }
  std::vector<int32_t> counts(tables);
  if (auto* e = read_input(numkeys, buffers, count_bytes, reinterpret_cast<char*>(counts.data()))) {
    return e;
  }
  int64_t total = 0, out = 0;
  for (size_t t = 0; t < tables; ++t) {
    if (counts[t] < 0) return invalid("NUMKEYS[" + std::to_string(t) + "] is negative");
    total += counts[t];
    out += int64_t{counts[t]} * m.vec_sizes[t];
  }
  if (total * 8 != static_cast<int64_t>(key_bytes)) {
    return invalid("NUMKEYS sums to " + std::to_string(total) + " but KEYS has " +
                   std::to_string(key_bytes / 8) + " keys");
  }
  *floats = out;
  return nullptr;
}

// Sends the zeros (or the error) for one request; false if the request failed.
bool respond(TRITONBACKEND_Request* request, const FloorModel& m) {
  TRITONBACKEND_Response* response = nullptr;
  if (auto* e = TRITONBACKEND_ResponseNew(&response, request)) {
    TRITONSERVER_ErrorDelete(e);
    return false;
  }
  int64_t floats = 0;
  TRITONSERVER_Error* err = answer_size(request, m, &floats);
  if (err == nullptr) {
    TRITONBACKEND_Output* output = nullptr;
    err = TRITONBACKEND_ResponseOutput(response, &output, "OUTPUT0", TRITONSERVER_TYPE_FP32,
                                       &floats, 1);
    void* buffer = nullptr;
    TRITONSERVER_MemoryType type = TRITONSERVER_MEMORY_CPU;
    int64_t type_id = 0;
    const uint64_t bytes = static_cast<uint64_t>(floats) * 4;
    if (err == nullptr) err = TRITONBACKEND_OutputBuffer(output, &buffer, bytes, &type, &type_id);
    if (err == nullptr && type == TRITONSERVER_MEMORY_GPU) {
      err = TRITONSERVER_ErrorNew(TRITONSERVER_ERROR_UNSUPPORTED, "GPU output buffer");
    }
    if (err == nullptr && bytes > 0) std::memset(buffer, 0, bytes);
  }
  const bool ok = err == nullptr;
  TRITONSERVER_Error* sent =
      TRITONBACKEND_ResponseSend(response, TRITONSERVER_RESPONSE_COMPLETE_FINAL, err);
  if (err != nullptr) TRITONSERVER_ErrorDelete(err);
  if (sent != nullptr) TRITONSERVER_ErrorDelete(sent);
  return ok;
}

}  // namespace

extern "C" {

__attribute__((visibility("default"))) TRITONSERVER_Error* TRITONBACKEND_ModelInitialize(
    TRITONBACKEND_Model* model) {
  TRITONSERVER_Message* message = nullptr;
  if (auto* e = TRITONBACKEND_ModelConfig(model, 1, &message)) return e;
  const char* base = nullptr;
  size_t size = 0;
  TRITONSERVER_Error* e = TRITONSERVER_MessageSerializeToJson(message, &base, &size);
  const std::string json = e == nullptr ? std::string(base, size) : std::string();
  TRITONSERVER_MessageDelete(message);
  if (e != nullptr) return e;
  auto* state = new FloorModel();
  std::vector<int64_t> tables, slots;
  const bool hps = !parameter(json, "vec_sizes").empty();
  const bool ok = hps ? parse_sizes(parameter(json, "vec_sizes"), &state->vec_sizes)
                      : parse_sizes(parameter(json, "tables"), &tables) &&
                            parse_sizes(parameter(json, "slots"), &slots) && tables.size() == 1 &&
                            slots.size() == 1;
  if (!ok) {
    delete state;
    return invalid(
        "trec_floor: config.pbtxt parameter vec_sizes must be a list like \"16,8\" (hps "
        "interface), or tables and slots numbers (hugectr interface)");
  }
  if (!hps) state->tables = tables[0], state->slots = slots[0];
  if (!parameter(json, "middle").empty()) state->middle = parameter(json, "middle");
  return TRITONBACKEND_ModelSetState(model, state);
}

__attribute__((visibility("default"))) TRITONSERVER_Error* TRITONBACKEND_ModelFinalize(
    TRITONBACKEND_Model* model) {
  void* state = nullptr;
  if (auto* e = TRITONBACKEND_ModelState(model, &state)) return e;
  delete static_cast<FloorModel*>(state);
  return nullptr;
}

__attribute__((visibility("default"))) TRITONSERVER_Error* TRITONBACKEND_ModelInstanceExecute(
    TRITONBACKEND_ModelInstance* instance, TRITONBACKEND_Request** requests,
    const uint32_t request_count) {
  const uint64_t start = now_ns();
  TRITONBACKEND_Model* model = nullptr;
  void* state = nullptr;
  if (auto* e = TRITONBACKEND_ModelInstanceModel(instance, &model)) return e;
  if (auto* e = TRITONBACKEND_ModelState(model, &state)) return e;
  const auto& m = *static_cast<const FloorModel*>(state);
  uint64_t answered = 0;
  for (uint32_t r = 0; r < request_count; ++r) {
    const uint64_t t0 = now_ns();
    const bool ok = respond(requests[r], m);
    const uint64_t t1 = now_ns();
    answered += ok;
    if (auto* e = TRITONBACKEND_ModelInstanceReportStatistics(instance, requests[r], ok, t0, t0, t1,
                                                              t1)) {
      TRITONSERVER_ErrorDelete(e);
    }
    if (auto* e = TRITONBACKEND_RequestRelease(requests[r], TRITONSERVER_REQUEST_RELEASE_ALL)) {
      TRITONSERVER_ErrorDelete(e);
    }
  }
  const uint64_t end = now_ns();
  if (answered > 0) {
    if (auto* e = TRITONBACKEND_ModelInstanceReportBatchStatistics(instance, answered, start, start,
                                                                   end, end)) {
      TRITONSERVER_ErrorDelete(e);
    }
  }
  return nullptr;
}

}  // extern "C"

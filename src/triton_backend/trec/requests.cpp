// A request's inputs, and sending a response.
#include "host.hpp"

namespace trec_host {

// Fills the properties of `in->input` (and its name); Triton's error if unreadable.
TRITONSERVER_Error* describe(In* in, const char** name) {
  return TRITONBACKEND_InputProperties(in->input, name, &in->type, &in->shape, &in->dims,
                                       &in->bytes, &in->buffers);
}

// The input `name` and its properties; false if it is absent or unreadable.
bool find(TRITONBACKEND_Request* request, const char* name, In* in) {
  if (auto* e = TRITONBACKEND_RequestInput(request, name, &in->input)) return drop(e), false;
  const char* n = nullptr;
  if (auto* e = describe(in, &n)) return drop(e), false;
  return true;
}

// The data of `in`: Triton's own buffer when it is one piece in CPU memory, else a copy
// in `copy`; nullptr if it cannot be read.
const void* data_of(const In& in, std::vector<char>* copy) {
  static const int64_t empty = 0;
  if (in.bytes == 0) return &empty;
  if (in.buffers == 1) {
    const void* b = nullptr;
    uint64_t size = 0;
    TRITONSERVER_MemoryType mt = TRITONSERVER_MEMORY_CPU;
    int64_t mt_id = 0;
    if (auto* e = TRITONBACKEND_InputBuffer(in.input, 0, &b, &size, &mt, &mt_id)) {
      return drop(e), nullptr;
    }
    return mt == TRITONSERVER_MEMORY_GPU || size != in.bytes ? nullptr : b;
  }
  copy->resize(in.bytes);
  return read_cpu(in.input, in.buffers, in.bytes, copy->data()) ? copy->data() : nullptr;
}

// Sends `err` (owned) or the filled response; false if the request failed.
bool send(TRITONBACKEND_Response* response, TRITONSERVER_Error* err) {
  const bool ok = err == nullptr;
  drop(TRITONBACKEND_ResponseSend(response, TRITONSERVER_RESPONSE_COMPLETE_FINAL, err));
  drop(err);
  return ok;
}

}  // namespace trec_host

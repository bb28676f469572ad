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

// The output `name` of `response` and its buffer of `bytes` in CPU memory.
TRITONSERVER_Error* output_buffer(TRITONBACKEND_Response* response, const char* name,
                                  TRITONSERVER_DataType type, const int64_t* shape, uint32_t dims,
                                  uint64_t bytes, void** buffer) {
  TRITONBACKEND_Output* output = nullptr;
  TRITONSERVER_MemoryType mt = TRITONSERVER_MEMORY_CPU;
  int64_t mt_id = 0;
  TRITONSERVER_Error* err =
      TRITONBACKEND_ResponseOutput(response, &output, name, type, shape, dims);
  if (err == nullptr) err = TRITONBACKEND_OutputBuffer(output, buffer, bytes, &mt, &mt_id);
  if (err == nullptr && mt == TRITONSERVER_MEMORY_GPU) {
    err = error(TRITONSERVER_ERROR_UNSUPPORTED, "GPU output buffer");
  }
  return err;
}

}  // namespace trec_host

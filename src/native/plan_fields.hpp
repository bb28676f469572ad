// The fields of a native plan (triton_rec/serving/native_plan.py: NativePlan and the
// dataclasses inside it) as the native backend reads them (src/triton_backend/trec/plan.cpp),
// named here once: plan.cpp reads every field by these names, bindings.cpp exports them as
// triton_rec._native.PLAN_FIELDS, and tests/unit/test_native_plan.py holds each list equal
// to its dataclass's fields (a field renamed on one side only fails there, and a plan that
// lacks a field fails the model's load naming it).
#pragma once

namespace triton_rec {
namespace plan_fields {

// A dataclass of the plan: its name and its fields, in declaration order.
struct PlanType {
  const char* name;
  const char* const* fields;
  int count;
};

// NativePlan: what one instance's requests are answered with.
namespace native_plan {
enum : int {
  kind,
  tables,
  max_batch_size,
  output,
  info_outputs,
  device_id,
  gpu,
  maxnum,
  slots,
  mean,
  dense_dim,
  label_dim,
  limits,
  dense_net,
  key_type,
  dense_gpu,
  vec_sizes,
  kCount
};
inline constexpr const char* kNames[kCount] = {
    "kind",   "tables",    "max_batch_size", "output",    "info_outputs", "device_id",
    "gpu",    "maxnum",    "slots",          "mean",      "dense_dim",    "label_dim",
    "limits", "dense_net", "key_type",       "dense_gpu", "vec_sizes"};
}  // namespace native_plan

// TablePlan: how the native path reads one table.
namespace table_plan {
enum : int {
  vec_size,
  precision,
  default_value,
  stats,
  cache,
  index,
  vectors,
  device,
  device_cache,
  device_table,
  misses,
  finish,
  kCount
};
inline constexpr const char* kNames[kCount] = {
    "vec_size", "precision", "default_value", "stats",        "cache",  "index",
    "vectors",  "device",    "device_cache",  "device_table", "misses", "finish"};
}  // namespace table_plan

// GpuPlan: the plan's GPU (its device and the kernels' module).
namespace gpu_plan {
enum : int { device, image, kCount };
inline constexpr const char* kNames[kCount] = {"device", "image"};
}  // namespace gpu_plan

// DeviceCachePlan: a device cache's state arrays and geometry (array_cache_rules.hpp).
namespace device_cache_plan {
enum : int { arrays, num_sets, ways, dim, precision, policy, sketch_width, kCount };
inline constexpr const char* kNames[kCount] = {"arrays",    "num_sets", "ways",        "dim",
                                               "precision", "policy",   "sketch_width"};
}  // namespace device_cache_plan

// DeviceTablePlan: a whole table on a GPU (its index slots and rows).
namespace device_table_plan {
enum : int { slots, capacity, vectors, rows, kCount };
inline constexpr const char* kNames[kCount] = {"slots", "capacity", "vectors", "rows"};
}  // namespace device_table_plan

// DenseGpuPlan: the network as CUDA graphs (DenseGraphs.native_plan).
namespace dense_gpu_plan {
enum : int { device, host_max_batch, dense_in, emb_in, buckets, kCount };
inline constexpr const char* kNames[kCount] = {"device", "host_max_batch", "dense_in", "emb_in",
                                               "buckets"};
}  // namespace dense_gpu_plan

// PlanLimits: the most elements of each input of a hugectr or dense request.
namespace plan_limits {
enum : int { des, cat, rows, kCount };
inline constexpr const char* kNames[kCount] = {"des", "cat", "rows"};
}  // namespace plan_limits

inline constexpr PlanType kNativePlan{"NativePlan", native_plan::kNames, native_plan::kCount};
inline constexpr PlanType kTablePlan{"TablePlan", table_plan::kNames, table_plan::kCount};
inline constexpr PlanType kGpuPlan{"GpuPlan", gpu_plan::kNames, gpu_plan::kCount};
inline constexpr PlanType kDeviceCachePlan{"DeviceCachePlan", device_cache_plan::kNames,
                                           device_cache_plan::kCount};
inline constexpr PlanType kDeviceTablePlan{"DeviceTablePlan", device_table_plan::kNames,
                                           device_table_plan::kCount};
inline constexpr PlanType kDenseGpuPlan{"DenseGpuPlan", dense_gpu_plan::kNames,
                                        dense_gpu_plan::kCount};
inline constexpr PlanType kPlanLimits{"PlanLimits", plan_limits::kNames, plan_limits::kCount};

// Every type of the plan, for the export.
inline constexpr const PlanType* kPlanTypes[] = {
    &kNativePlan,      &kTablePlan,    &kGpuPlan,   &kDeviceCachePlan,
    &kDeviceTablePlan, &kDenseGpuPlan, &kPlanLimits};

}  // namespace plan_fields
}  // namespace triton_rec

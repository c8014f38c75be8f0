// The part of torch every kernel module needs, in place of <torch/extension.h> (cpp_build.py puts this first in
// each translation unit and tells torch to add nothing): tensors, ATen's thread pool, the three factory ops the
// kernels call, and pybind11 with torch's tensor casters and error translation for the bindings torch
// generates. <torch/extension.h> also pulls in the whole C++ frontend (nn, optim, data), whose parsing was ~75%
// of each kernel's build time.
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/add.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/utils/pybind.h>

namespace torch {
using namespace at;  // the kernels' torch::Tensor, torch::empty, torch::kFloat: ATen's, as <torch/types.h> has it
// <torch/types.h>'s dtype names the kernels use
constexpr auto kUInt8 = at::kByte;
constexpr auto kInt64 = at::kLong;
constexpr auto kFloat16 = at::kHalf;
constexpr auto kFloat32 = at::kFloat;
}  // namespace torch

// A step's (token, expert) pairs grouped by expert, for the CPU mixture-of-experts kernels (moe_experts_cpu.cpp,
// bf16 weights; quant_moe_cpu.cpp, packed GGUF experts): pair p = t * k + j is token t's j-th chosen expert.
// Concatenated before either kernel's source (one translation unit each, no include path).
#include <algorithm>
#include <numeric>
#include <vector>

namespace {

// The pairs of one expert: `order[begin:end]` of the expert-sorted order.
struct ExpertGroup {
  int64_t expert, begin, end;
};

// `order` := the pairs sorted by (expert, token) (stable: tokens increasing within an expert); returns the groups of
// equal experts, experts increasing. Every id must lie in [0, num_experts).
std::vector<ExpertGroup> group_by_expert(const int64_t* ids, int64_t num_pairs, int64_t num_experts,
                                         std::vector<int64_t>& order) {
  order.resize(num_pairs);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return ids[a] < ids[b]; });
  std::vector<ExpertGroup> groups;
  for (int64_t i = 0; i < num_pairs; ++i) {
    const int64_t e = ids[order[i]];
    TORCH_CHECK(e >= 0 && e < num_experts, "expert id ", e, " outside 0..", num_experts - 1);
    if (groups.empty() || groups.back().expert != e) groups.push_back({e, i, i});
    groups.back().end = i + 1;
  }
  return groups;
}

}  // namespace

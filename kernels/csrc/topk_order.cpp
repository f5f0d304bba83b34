/* Which experts torch.topk picks among exactly tied router scores (kernels/README.md).
 *
 * mm_topk_softmax (cpu_gemm.c) ranks a token's experts by their router logits. Where the K-th
 * largest logit is tied with one left out, any choice among the tied experts is a valid top-K, but
 * transformers takes torch.topk's, and greedy tokens then depend on which. torch's CPU topk selects
 * with the C++ standard library (std::nth_element, then std::sort of the first K - 1, or
 * std::partial_sort where K * 64 <= E) over (value, index) pairs, the larger value first and NaN
 * above everything. Those algorithms' results among equal keys follow from their comparisons alone,
 * so running the same standard algorithms with the same comparison over the same sequence picks the
 * same experts. tests/test_cpu_kernels.py checks the ids against torch.topk on rows full of ties.
 *
 * Logits stand in for torch's probabilities: softmax keeps their order, and equal logits give equal
 * probabilities. (Two logits a float32 ulp or so apart can round to one probability; those are not
 * told apart here.)
 *
 * Built with -fno-exceptions and plain arrays: the object needs nothing from the C++ runtime, and
 * the C library links it as it is. Compiled only where a C++ compiler is present; elsewhere ties go
 * to the lower expert. */

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <utility>

namespace {

typedef std::pair<double, int64_t> scored; /* (torch's accumulate type for float32, index) */

bool ranks_before(const scored &x, const scored &y) {
    return (std::isnan(x.first) && !std::isnan(y.first)) || x.first > y.first;
}

} // namespace

/* ids[0..k) <- the indices torch.topk(v[0..n), k) returns, in its order. 0, or -1 without memory. */
extern "C" __attribute__((visibility("default"))) int mm_torch_topk_order(const float *v, int64_t n, int64_t k,
                                                                           int64_t *ids) {
    if (k <= 0 || n <= 0) return 0;
    if (k > n) k = n;
    scored local[256];
    scored *q = n <= 256 ? local : static_cast<scored *>(std::malloc(sizeof(scored) * n));
    if (q == nullptr) return -1;
    for (int64_t j = 0; j < n; j++) q[j] = scored(v[j], j);
    if (k * 64 <= n) {
        std::partial_sort(q, q + k, q + n, ranks_before);
    } else {
        std::nth_element(q, q + k - 1, q + n, ranks_before);
        std::sort(q, q + k - 1, ranks_before);
    }
    for (int64_t j = 0; j < k; j++) ids[j] = q[j].second;
    if (q != local) std::free(q);
    return 0;
}

// Causal attention of many new tokens per request over the paged KV cache on
// CPU: prefill, chunked prefill, prefill after a prefix-cache hit.
//
// Tensors:
//   query, out       [T, num_heads, D]; request i owns rows qsl[i]:qsl[i+1]
//                    (rows may be strided, the last dim contiguous).
//   kv_cache         [num_blocks, num_kv_heads, block_size, 2*D] (chunkattn.h).
//   query_start_loc  [R+1] int32/int64, seq_lens [R] int32/int64 (context incl.
//                    the new tokens), block_table [R, max_blocks] int32.
//   Request i's new tokens are the last (qsl[i+1]-qsl[i]) of its seq_lens[i]
//   tokens; new token t sees keys 0 .. seq_len - num_new + t.
//
// Work decomposition (G = num_heads / num_kv_heads): items (request, kv head,
// query tile). A tile is prefill_tile_rows / G (CpuTuning, kernels.h)
// consecutive new tokens x the G query heads of the kv head, i.e. a
// [tokens*G, D] query matrix attended, flash attention style, against the
// request's chunks up to the tile's last position (attend_lanes:
// matrix-matrix register tiles, online softmax, the causal mask only on
// chunks that cross the diagonal). Items are handed out on torch's intra-op
// pool, costliest (longest context) requests first, the tiles of one
// (request, kv head) one after the other so its context is read from DRAM
// about once, and, when requests share cached blocks, one head of every
// request before the next head, so that a shared prefix is too; where the
// lanes tile multiplies a packed V^T (AMX), the shared blocks' V^T is packed
// once for all requests before the items run (PackedVt). A thread
// claims its next item before running the current one and prefetches that
// item's query rows; a tile skips the keys past the causal limit of each of
// its lane vectors.
#include <ATen/Dispatch.h>

#include <algorithm>
#include <unordered_set>

#include "chunkattn.h"
#include "common/attention_variant_args.h"
#include "common/partial_state.h"
#include "cpu/driver_utils.h"
#include "cpu/kernels.h"

namespace chunkattn {

namespace {

using cpu::AttnJob;
using cpu::KernelTable;
using cpu::KvView;

std::vector<int64_t> to_int64(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.dim() == 1 && (t.scalar_type() == at::kInt || t.scalar_type() == at::kLong),
              "chunkattn: ", name, " must be a 1-D int32/int64 CPU tensor");
  const torch::Tensor c = t.to(at::kLong).contiguous();
  const int64_t* p = c.data_ptr<int64_t>();
  return std::vector<int64_t>(p, p + c.numel());
}

// Whether two requests have the same first cached block (a whole block of
// context before their new tokens).
bool share_cached_blocks(const std::vector<int64_t>& qsl, const std::vector<int64_t>& lens, const int32_t* table,
                         int64_t table_stride, int64_t block_size) {
  std::unordered_set<int32_t> first_blocks;
  for (size_t i = 0; i < lens.size(); ++i)
    if (lens[i] - (qsl[i + 1] - qsl[i]) >= block_size && !first_blocks.insert(table[i * table_stride]).second)
      return true;
  return false;
}

// The blocks that two or more of the requests `reader(i)` names read, sorted.
// (Keys past a reader's seq_len in a block it reads are finite, as for every
// tile: masked, their P is 0.)
template <class Reader>
std::vector<int32_t> blocks_read_twice(const std::vector<int64_t>& lens, const int32_t* table, int64_t table_stride,
                                       int64_t block_size, const Reader& reader) {
  std::vector<int32_t> reads;
  for (size_t i = 0; i < lens.size(); ++i) {
    if (!reader(i)) continue;
    for (int64_t c = 0; c * block_size < lens[i]; ++c) reads.push_back(table[i * table_stride + c]);
  }
  std::sort(reads.begin(), reads.end());
  std::vector<int32_t> blocks;
  for (size_t a = 0; a < reads.size();) {
    size_t b = a;
    while (b < reads.size() && reads[b] == reads[a]) ++b;
    if (b - a >= 2) blocks.push_back(reads[a]);
    a = b;
  }
  return blocks;
}

// Packs V^T of `blocks` for every KV head into the calling thread's driver
// scratch (kSharedVtSlot), which stays valid until its next call.
constexpr int kSharedVtSlot = 3;  // the items use slots 0-2
cpu::PackedVt pack_shared_vt(const cpu::KernelTable& kern, const KvView& kv, int64_t num_kv_heads, int64_t head_size,
                             const std::vector<int32_t>& blocks) {
  cpu::PackedVt packed;
  packed.blocks = blocks.data();
  packed.num_blocks = static_cast<int>(blocks.size());
  packed.block_bytes = cpu::packed_vt_bytes(head_size, kv.block_size);
  const int64_t count = num_kv_heads * packed.num_blocks;
  char* data = reinterpret_cast<char*>(
      cpu::driver_scratch().get(kSharedVtSlot, static_cast<size_t>(count * packed.block_bytes / sizeof(float))));
  packed.data = data;
  at::parallel_for(0, count, 1, [&](int64_t begin, int64_t end) {
    for (int64_t x = begin; x < end; ++x)
      kern.pack_vt(kv, blocks[x % packed.num_blocks], static_cast<int>(x / packed.num_blocks),
                   data + x * packed.block_bytes);
  });
  return packed;
}

template <typename qscalar_t>
void paged_prefill_impl(torch::Tensor& out, const torch::Tensor& query, const torch::Tensor& kv_cache,
                        const std::vector<int64_t>& qsl, const std::vector<int64_t>& lens,
                        const torch::Tensor& block_table, const AttentionVariant& variant) {
  const float scale = variant.scale;
  const int64_t window = variant.sliding_window;
  const int64_t num_heads = query.size(1), D = query.size(2);
  const int64_t num_kv_heads = kv_cache.size(1), block_size = kv_cache.size(2);
  const int64_t group = num_heads / num_kv_heads;
  const int64_t num_reqs = static_cast<int64_t>(lens.size());
  const KernelTable& kern = cpu::select_kernels(kv_cache.scalar_type(), D);
  const KvView kv{kv_cache.data_ptr(), kv_cache.stride(0), kv_cache.stride(1), static_cast<int>(block_size)};
  const int32_t* table = block_table.data_ptr<int32_t>();
  const int64_t table_stride = block_table.stride(0);
  const qscalar_t* q_data = query.data_ptr<qscalar_t>();
  qscalar_t* out_data = out.data_ptr<qscalar_t>();
  const int64_t q_s0 = query.stride(0), q_s1 = query.stride(1);
  const int64_t o_s0 = out.stride(0), o_s1 = out.stride(1);
  // Rows per item: enough that each K/V element loaded serves several lane
  // vectors and the context is re-read few times, few enough that short
  // prompts still spread over the threads; the balance is the CPU's (tuned).
  const int64_t tile_tokens = std::max<int64_t>(1, cpu::cpu_tuning().prefill_tile_rows / group);

  struct Item {
    int32_t req, head;
    int64_t t0, t1;  // new tokens [t0, t1) of the request
    double cost;  // of the item's (request, head) group
  };
  std::vector<double> request_cost(num_reqs, 0.0);  // of each of its (request, kv head) groups: all its tiles
  for (int64_t i = 0; i < num_reqs; ++i) {
    const int64_t num_new = qsl[i + 1] - qsl[i];
    TORCH_CHECK(num_new >= 0 && num_new <= lens[i], "chunkattn: request ", i, " has ", num_new,
                " new tokens but seq_len ", lens[i]);
    TORCH_CHECK((lens[i] + block_size - 1) / block_size <= block_table.size(1), "chunkattn: request ", i,
                " needs more blocks than the block table has");
    const int64_t ctx = lens[i] - num_new;
    for (int64_t t0 = 0; t0 < num_new; t0 += tile_tokens) {
      const int64_t t1 = std::min(num_new, t0 + tile_tokens);
      request_cost[i] += static_cast<double>((t1 - t0) * group) * (ctx + t1);
    }
  }
  // Requests that share cached blocks (a burst behind one system prompt;
  // prefix caching shares from the first block on) go head-major: one KV head
  // of every request before the next head, so each head's shared blocks are
  // read back to back while the previous request left them in the caches.
  // Request-major, each request would stream every head of the prefix from
  // DRAM again once the prefix exceeds the last-level cache (on a Zen 4, 15%
  // of the time of 32 x 64 new tokens behind 2048 shared fp32 tokens of 32
  // heads). Without sharing, request-major reads each request's blocks whole
  // (all heads of a block are adjacent), which is a few percent faster.
  // Within a (request, head), last tiles first (they see the most keys), its
  // tiles adjacent, so the threads taking them read that context while it is
  // still in the caches.
  std::vector<Item> items;
  auto push_group = [&](int64_t i, int32_t h) {
    const int64_t num_new = qsl[i + 1] - qsl[i];
    if (num_new == 0) return;
    for (int64_t t0 = (num_new - 1) / tile_tokens * tile_tokens; t0 >= 0; t0 -= tile_tokens)
      items.push_back({static_cast<int32_t>(i), h, t0, std::min(num_new, t0 + tile_tokens), request_cost[i]});
  };
  const bool shared = share_cached_blocks(qsl, lens, table, table_stride, block_size);
  std::vector<int32_t> shared_blocks;
  cpu::PackedVt shared_vt;
  if (shared && cpu::takes_packed_vt(kern, block_size)) {
    // Only the lanes tile reads packed V^T: requests whose items all run `direct` gain nothing from it.
    auto runs_lanes = [&](size_t i) {
      return !kern.runs_direct(std::min(qsl[i + 1] - qsl[i], tile_tokens) * group);
    };
    shared_blocks = blocks_read_twice(lens, table, table_stride, block_size, runs_lanes);
    shared_vt = pack_shared_vt(kern, kv, num_kv_heads, D, shared_blocks);
  }
  if (shared) {
    for (int32_t h = 0; h < num_kv_heads; ++h)
      for (int64_t i = 0; i < num_reqs; ++i) push_group(i, h);
  } else {
    for (int64_t i = 0; i < num_reqs; ++i)
      for (int32_t h = 0; h < num_kv_heads; ++h) push_group(i, h);
  }
  // Costliest (request, head) groups first, keeping each group's tiles
  // together and equal-cost groups in the order above.
  std::stable_sort(items.begin(), items.end(), [](const Item& a, const Item& b) { return a.cost > b.cost; });

  // The query rows of an item are scattered rows of a tensor far larger than
  // the caches, so reading them stalls; each item prefetches those of the
  // item its thread runs next.
  auto query_row = [&](const Item& it, int64_t t, int64_t g) {
    return q_data + (qsl[it.req] + t) * q_s0 + (it.head * group + g) * q_s1;
  };
  cpu::parallel_items_with_next(static_cast<int64_t>(items.size()), [&](int64_t idx, int64_t next_idx) {
    const Item& it = items[idx];
    if (next_idx >= 0) {
      const Item& next = items[next_idx];
      for (int64_t t = next.t0; t < next.t1; ++t)
        for (int64_t g = 0; g < group; ++g) cpu::prefetch_l2(query_row(next, t, g), D * sizeof(qscalar_t));
    }
    const int64_t num_new = qsl[it.req + 1] - qsl[it.req];
    const int64_t ctx = lens[it.req] - num_new;
    const int64_t rows = (it.t1 - it.t0) * group;
    cpu::DriverScratch& scr = cpu::driver_scratch();
    float* q = scr.get(0, rows * D);
    float* o = scr.get(1, rows * D);
    float* mn = scr.get(2, 5 * rows);
    float* m = mn;
    float* n = mn + rows;
    float* q_pos = mn + 2 * rows;
    float* first_key = mn + 3 * rows;
    float* slopes = mn + 4 * rows;
    for (int64_t t = it.t0; t < it.t1; ++t) {
      for (int64_t g = 0; g < group; ++g) {
        const int64_t r = (t - it.t0) * group + g;
        cpu::load_scaled(query_row(it, t, g), D, scale, q + r * D);
        q_pos[r] = static_cast<float>(ctx + t);
        first_key[r] = static_cast<float>(ctx + t - window + 1);
        if (variant.alibi_slopes) slopes[r] = variant.alibi_slopes[it.head * group + g];
      }
    }
    AttnJob job{q, static_cast<int>(rows), table + it.req * table_stride, static_cast<int>(ctx + it.t1), it.head,
                q_pos, o, m, n};
    job.q_scale = scale;
    job.softcap = variant.logits_soft_cap;
    if (variant.alibi_slopes) job.alibi_slopes = slopes;
    if (shared_vt.num_blocks > 0) job.packed_vt = &shared_vt;
    // Every row sees its own key, so a window always leaves one.
    if (window > 0) cpu::trim_to_window(job, first_key, q_pos, static_cast<int>(block_size));
    (kern.runs_direct(rows) ? kern.direct : kern.lanes)(kv, job);
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t t = it.t0 + r / group, g = r % group;
      // Every row sees at least its own key, so n[r] > 0.
      PartialState total{m[r], n[r]};
      const float sink_scale = variant.sinks ? merge_sink<NaturalExp>(total, variant.sinks[it.head * group + g]) : 1.f;
      cpu::stream_row(o + r * D, D, out_data + (qsl[it.req] + t) * o_s0 + (it.head * group + g) * o_s1,
                      sink_scale / total.n);
    }
    cpu::stream_fence();
  });
}

}  // namespace

void paged_prefill(torch::Tensor& out, const torch::Tensor& query, const torch::Tensor& kv_cache,
                   const torch::Tensor& query_start_loc, const torch::Tensor& seq_lens,
                   const torch::Tensor& block_table, double scale, int64_t sliding_window,
                   double logits_soft_cap, const std::optional<torch::Tensor>& sinks,
                   const std::optional<torch::Tensor>& alibi_slopes) {
  cpu::check_query_out_cache(out, query, kv_cache, "num_tokens");
  TORCH_CHECK(query.size(1) % kv_cache.size(1) == 0, "chunkattn: num_heads must be a multiple of num_kv_heads");
  TORCH_CHECK(block_table.dim() == 2 && block_table.scalar_type() == at::kInt && block_table.stride(1) == 1,
              "chunkattn: block_table must be int32 [num_reqs, max_blocks] with contiguous rows");
  const std::vector<int64_t> qsl = to_int64(query_start_loc, "query_start_loc");
  std::vector<int64_t> lens = to_int64(seq_lens, "seq_lens");
  TORCH_CHECK(!qsl.empty() && qsl.size() >= lens.size() + 1 && qsl[0] >= 0, "chunkattn: query_start_loc must have num_reqs + 1 entries");
  TORCH_CHECK(static_cast<int64_t>(lens.size()) <= block_table.size(0), "chunkattn: block_table has fewer rows than requests");
  TORCH_CHECK(qsl[lens.size()] <= query.size(0), "chunkattn: query_start_loc points past the query rows");
  const AttentionVariant variant =
      attention_variant(scale, sliding_window, logits_soft_cap, sinks, alibi_slopes, query);
  if (lens.empty()) return;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, query.scalar_type(), "chunkattn_paged_prefill", [&] {
    paged_prefill_impl<scalar_t>(out, query, kv_cache, qsl, lens, block_table, variant);
  });
}

}  // namespace chunkattn

// K/V block addressing, the producer's hook: where key block n_block of one (batch entry, kv head)
// lives and how it reaches its shared-memory stage. Every K and V load of the forward and backward
// producers goes through it; the consumers only ever see stages.
//
// ContiguousKVBlocks: each entry's keys are consecutive rows of (rows, headdim, kv head, batch) tensors; one
// TMA copy per block.
// PagedKVBlocks (KV caches, flash_attn_with_kvcache): K/V are pages (page_size, headdim, kv head, page) and key
// j of entry b lives in page page_table[b][j / page_size], row j % page_size. Where every block lies inside one
// page (pages a multiple of kBlockN, or a contiguous cache: one page of max_seqlen rows per entry) a block is one
// TMA copy, as for contiguous K/V. Otherwise it is copied in chunks of kChunkRows keys, each chunk one TMA copy
// per panel of the stage's swizzle atom (16 rows x 64 16-bit columns: 2 KB, contiguous in the stage), from the
// chunk's own page, so pages of any multiple of kChunkRows (16 .. 256) land in the same stages.
// PageBlocks: which of the two a kernel holds. kAny decides per launch (whole_blocks); kWhole / kChunked hold one
// walk only, for kernels whose other code would cost the first one registers (the e4m3 cache's: code present but
// not run made its whole-block decode 11-15% slower: docs/perf-notes.md, S2). The launcher picks between them by
// the same test. kChunked kernels gather (kGather): a warp copies each block's rows and scales with cp.async, 16
// bytes per lane and copy, instead of one TMA box per 16-row chunk and panel (faster in pages of 16, with or
// without TMA boxes for the data: docs/perf-notes.md, session 5, X2 and X6).
// Chunks past the entry's last key take a page coordinate past the tensor (TMA fills zeros, counts the bytes):
// the page table is never read past the entry's pages.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cute/arch/copy_sm80.hpp>
#include <cutlass/fast_math.h>

#include <type_traits>

namespace flashhopper::sm90 {

using namespace cute;

enum class PageBlocks { kAny, kWhole, kChunked };

struct ContiguousKVBlocks {
  static constexpr bool kPaged = false;
  static constexpr PageBlocks kBlocks = PageBlocks::kWhole;  // (one copy per block)
  static constexpr bool kGather = false;
  struct Params {};

  CUTE_DEVICE ContiguousKVBlocks(Params const&, int /*batch*/, int /*seqlen_k*/) {}

  // One TMA copy: block n_block of `blocks` ((TMA, n) partitioned source) into `stage`, through tensor map
  // `desc` (the params' own, or the batch entry's: common/seqlen.h).
  // mcast: the CTAs of the cluster the copy lands in (a multicast copy's share of the block; 1: this CTA).
  template <class TmaCopy, class Blocks, class Stage>
  CUTE_DEVICE void load(TmaCopy const& tma, TmaDescriptor const* desc, uint64_t& barrier, Blocks const& blocks,
                        int n_block, Stage&& stage, TMA::CacheHintSm90 hint, uint16_t mcast = 1) const {
    copy(tma.with(desc, barrier, mcast > 1 ? mcast : uint16_t(0), hint), blocks(_, n_block), stage);
  }
};

inline constexpr int kPageChunkRows = 16;
struct NoPageCompanion {  // load_paged's default companion: nothing
  CUTE_DEVICE void operator()(int, int, int, int) const {}
};
template <PageBlocks kBlocks_ = PageBlocks::kAny>
struct PagedKVBlocks {
  static constexpr bool kPaged = true;
  static constexpr PageBlocks kBlocks = kBlocks_;
  static constexpr bool kGather = kBlocks == PageBlocks::kChunked;
  static constexpr int kChunkRows = kPageChunkRows;
  struct Params {
    int const* page_table = nullptr;  // int32 (batch, pages per entry), or nullptr: entry b's one page is b
    int64_t table_stride = 0;         // elements between entries' rows of the table
    cutlass::FastDivmod page_size{1};  // rows per page (a multiple of kChunkRows where an entry spans pages)
    int num_pages = 0;                // pages in the cache: a chunk at this page reads zeros
    bool whole_blocks = false;        // every kBlockN-key block lies inside one page
  };

  int const* table_;
  cutlass::FastDivmod page_size_;
  int num_pages_, batch_, seqlen_k_;
  bool whole_blocks_;

  CUTE_DEVICE PagedKVBlocks(Params const& p, int batch, int seqlen_k)
      : table_(p.page_table != nullptr ? p.page_table + batch * p.table_stride : nullptr),
        page_size_(p.page_size),
        num_pages_(p.num_pages),
        batch_(batch),
        seqlen_k_(seqlen_k),
        whole_blocks_(p.whole_blocks) {}

  // Whether this kernel's blocks each lie inside one page (compile-time unless kAny).
  CUTE_HOST_DEVICE static constexpr bool whole(Params const& p) {
    if constexpr (kBlocks == PageBlocks::kAny) {
      return p.whole_blocks;
    } else {
      return kBlocks == PageBlocks::kWhole;
    }
  }
  CUTE_DEVICE bool whole() const {
    if constexpr (kBlocks == PageBlocks::kAny) {
      return whole_blocks_;
    } else {
      return kBlocks == PageBlocks::kWhole;
    }
  }

  // The page and the row in it of the chunk starting at key `key`.
  CUTE_DEVICE void locate(int key, int& page, int& row) const {
    if (key >= seqlen_k_) {  // past the entry's keys: no table read, zeros
      page = num_pages_;
      row = 0;
      return;
    }
    int idx;
    page_size_(idx, row, key);
    page = table_ != nullptr ? table_[idx] : batch_;
  }

  // Block n_block (kBlockN keys) of one kv head into `stage` ((kBlockN, headdim) smem tensor): `pages` /
  // `block_pages` are the kv head's (page_size, headdim, page) tensor as the atoms `tma` ((kChunkRows, kPanel)
  // boxes) and `tma_block` (a whole block, tile BlockTile) see it.
  // kUpfront: all the chunks' table reads before the first copy (needs 2 x kBlockN / 16 producer registers).
  // companion(page, row, stage_row, rows): a copy of the same rows of another tensor on the same barrier (an e4m3
  // cache's per-token scales): for a whole block below the entry's end one, else one per chunk of kChunkRows rows,
  // page = num_pages for a chunk past the entry's keys. Blocks copied chunk by chunk call it only with
  // kChunkCompanion, else leave that tensor to the caller (each copy is one more request for the TMA unit, whose
  // rate bounds small boxes).
  using NoCompanion = NoPageCompanion;
  template <int kBlockN, int kPanel, class BlockTile, bool kUpfront, bool kChunkCompanion, class TmaCopy, class TmaBlock, class Pages,
            class BlockPages, class Stage, class Companion = NoCompanion>
  CUTE_DEVICE void load_paged(TmaCopy const& tma, TmaBlock const& tma_block, uint64_t& barrier, Pages const& pages,
                              BlockPages const& block_pages, int n_block, Stage&& stage, TMA::CacheHintSm90 hint,
                              Companion&& companion = {}) const {
    static_assert(kBlockN % kChunkRows == 0);
    if (whole()) {
      int page, row;
      locate(n_block * kBlockN, page, row);  // row: a multiple of kBlockN
      Tensor g = local_tile(block_pages(_, _, page), BlockTile{}, make_coord(row / kBlockN, _0{}));
      auto parts = tma_partition(tma_block, _0{}, Layout<_1>{}, group_modes<0, 2>(stage), group_modes<0, 2>(g));
      copy(tma_block.with(barrier, 0, hint), get<0>(parts), get<1>(parts));
      if constexpr (!std::is_same_v<std::decay_t<Companion>, NoCompanion>) {
        if ((n_block + 1) * kBlockN <= seqlen_k_) {  // (then inside the page: whole blocks never cross one)
          companion(page, row, 0, kBlockN);
        } else {
          CUTE_UNROLL
          for (int c = 0; c < kBlockN / kChunkRows; ++c) {
            bool const past = n_block * kBlockN + c * kChunkRows >= seqlen_k_;
            companion(past ? num_pages_ : page, row + c * kChunkRows, c * kChunkRows, kChunkRows);
          }
        }
      }
      return;
    }
    if constexpr (kBlocks == PageBlocks::kAny) {
    // kUpfront: the chunks' table reads first, all independent and branch-free (clamped to the last key, then
    // replaced for chunks past it), so that one load latency covers all of them; the producer thread that issues
    // every copy is what bounds blocks in pages of 16 (docs/perf-notes.md, session 8). Else (2 registers) each
    // chunk's read goes out, branch-free too, before the previous chunk's copies. Issuing the copies is this one
    // thread's work: 2 x kBlockN / 16 x panels per K/V block pair.
    constexpr int kChunks = kBlockN / kChunkRows;
    constexpr int kKept = kUpfront ? kChunks : 2;
    int page[kKept], chunk[kKept];
    auto fetch = [&](int c, int slot) {
      int const key = n_block * kBlockN + c * kChunkRows;
      int idx, row;
      page_size_(idx, row, cute::min(key, seqlen_k_ - 1));
      page[slot] = table_ != nullptr ? __ldg(table_ + idx) : batch_;
      chunk[slot] = row / kChunkRows;
      if (key >= seqlen_k_) page[slot] = num_pages_, chunk[slot] = 0;  // zeros, no table read
    };
    if constexpr (!kUpfront) fetch(0, 0);
    if constexpr (kUpfront) {
      int const first = n_block * kBlockN;
      auto chunks = [&](auto paged) {
        CUTE_UNROLL
        for (int c = 0; c < kChunks; ++c) {
          int idx, row;
          page_size_(idx, row, cute::min(first + c * kChunkRows, seqlen_k_ - 1));
          chunk[c] = row / kChunkRows;
          if constexpr (decltype(paged)::value) {
            page[c] = __ldg(table_ + idx);
          } else {
            page[c] = batch_;
          }
        }
      };
      if (table_ != nullptr) {
        chunks(cute::true_type{});
      } else {
        chunks(cute::false_type{});
      }
      CUTE_UNROLL
      for (int c = 0; c < kChunks; ++c) {
        if (first + c * kChunkRows >= seqlen_k_) page[c] = num_pages_, chunk[c] = 0;  // zeros, no table read
      }
    }
    CUTE_UNROLL
    for (int c = 0; c < kChunks; ++c) {
      int const slot = kUpfront ? c : c % 2;
      if constexpr (!kUpfront) {
        if (c + 1 < kChunks) fetch(c + 1, (c + 1) % 2);
      }
      Tensor g = local_tile(pages(_, _, page[slot]), Shape<Int<kChunkRows>, Int<kPanel>>{},
                            make_coord(chunk[slot], _));                                          // (16, P, panels)
      Tensor s = local_tile(stage, Shape<Int<kChunkRows>, Int<kPanel>>{}, make_coord(c, _));  // (16, P, panels)
      auto parts = tma_partition(tma, _0{}, Layout<_1>{}, group_modes<0, 2>(s), group_modes<0, 2>(g));
      copy(tma.with(barrier, 0, hint), get<0>(parts), get<1>(parts));
      if constexpr (kChunkCompanion) companion(page[slot], chunk[slot] * kChunkRows, c * kChunkRows, kChunkRows);
    }
    }
  }

  // kGather: block n_block's rows into `stage` ((kBlockN, headdim) smem tensor, any swizzle of 16-byte units), copied
  // by the 32 lanes of one warp (this one: lane), each 16-row chunk from its page: row r of page g at
  // src + g x page_stride + r x row_stride (src: the kv head's first row). Rows past the entry's keys become zeros.
  // scale_src (or nullptr): the same rows of a float array (g x scale_page_stride + r, kv head applied) into
  // scale_dst[0, kBlockN), 4 per copy. The copies complete on whichever barrier the caller arrives on afterwards
  // (cp.async.mbarrier.arrive); their writes are the generic proxy's (a WGMMA reader fences first).
  template <int kBlockN, class T, class Stage>
  CUTE_DEVICE void gather(T const* src, int64_t row_stride, int64_t page_stride, int n_block, Stage&& stage, int lane,
                          float const* scale_src = nullptr, int64_t scale_page_stride = 0,
                          float* scale_dst = nullptr) const {
    constexpr int kChunks = kBlockN / kChunkRows;
    constexpr int kVec = 16 / int(sizeof(T));                    // elements per copy
    constexpr int kVecs = int(size<1>(std::decay_t<Stage>{})) / kVec;  // copies per row
    constexpr int kRowsPerPass = 32 / kVecs;                     // rows one copy of every lane covers
    static_assert(kChunks <= 32 && 32 % kVecs == 0 && kChunkRows % kRowsPerPass == 0);
    // Lane c < kChunks looks up chunk c's page (independent loads); the others' copies come by shuffle.
    int page, row;
    locate(n_block * kBlockN + (lane % kChunks) * kChunkRows, page, row);
    int const first_key = n_block * kBlockN;
    int const lane_row = lane / kVecs, lane_col = (lane % kVecs) * kVec;
#pragma unroll 1
    for (int c = 0; c < kChunks; ++c) {
      int const pg = __shfl_sync(0xffffffffu, page, c), r0 = __shfl_sync(0xffffffffu, row, c);
      T const* chunk = src + int64_t(pg) * page_stride + int64_t(r0 + lane_row) * row_stride + lane_col;
      CUTE_UNROLL
      for (int i = 0; i < kChunkRows / kRowsPerPass; ++i) {
        int const r = c * kChunkRows + i * kRowsPerPass + lane_row;  // the stage's row
        bool const in = first_key + r < seqlen_k_;
        T const* g = in ? chunk + int64_t(i * kRowsPerPass) * row_stride : src;  // (not read past the keys)
        SM80_CP_ASYNC_CACHEGLOBAL_ZFILL<cute::uint128_t>::copy(*reinterpret_cast<cute::uint128_t const*>(g),
                                                              *reinterpret_cast<cute::uint128_t*>(&stage(r, lane_col)), in);
      }
    }
    if (scale_src != nullptr) {
      static_assert(kBlockN / 4 <= 32 && kChunkRows % 4 == 0);
      int const c = cute::min(lane * 4 / kChunkRows, kChunks - 1);
      int const pg = __shfl_sync(0xffffffffu, page, c), r0 = __shfl_sync(0xffffffffu, row, c);
      if (lane < kBlockN / 4) {
        bool const in = first_key + lane * 4 < seqlen_k_;
        float const* g = in ? scale_src + int64_t(pg) * scale_page_stride + r0 + (lane * 4) % kChunkRows : scale_src;
        SM80_CP_ASYNC_CACHEGLOBAL_ZFILL<cute::uint128_t>::copy(
            *reinterpret_cast<cute::uint128_t const*>(g), *reinterpret_cast<cute::uint128_t*>(scale_dst + lane * 4), in);
      }
    }
  }
};

}  // namespace flashhopper::sm90

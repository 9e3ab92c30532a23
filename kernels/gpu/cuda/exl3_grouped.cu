// EXL3 grouped product in 16-slot tiles: out[slot] = a[slot] @ T[expert of the slot's tile] in float32, T the
// decoded trellis tiles (kernels/quant/exl3.py), a the rotated float16 rows (kernels/gpu/hadamard.py). The contract
// is kernels/gpu/moe.py's `_grouped_kernel` for EXL3 weights at block_m = 16 (decode and prompt rows alike); this
// file is its hand-written CUDA form, because the Triton one decodes each weight from two gathered words and ran
// several times slower than exllamav3's kernel.
//
// How it is fast (the format is laid out for this: exllamav3's encoder stores each 16x16 tile in tensor-core
// fragment order, so lane t of a warp owns trellis steps 8t..8t+7, exactly its B-fragment elements of the two
// m16n8k16 products that cover the tile):
// - each warp streams its part of K through shared memory with cp.async, several groups of K tiles in flight;
// - a lane reads the three 32-bit words that hold its eight 16-bit states, funnel-shifts them into one 64-bit span
//   starting at its first state's first bit, and cuts the eight states out at shifts known at compile time;
// - codebooks: mul1 = byte sum of state x 0x83DCD12D by one dp4a whose accumulator 0x6400 makes it the float16
//   1024 + sum, then one half2 fma; 3inst / mcg = one multiply(-add), one lop3, one half2 add of the two halves.
//   Both round once, as the torch twin does, so a decoded tile equals the twin's bit for bit;
// - the two products run on tensor cores (float16 in, float32 accumulate).
// Its time against exllamav3's kernel on the same tensors: docs/benchmarks.md, "Expert products"; the tile shape was
// chosen by bench.kernels' exl3builds.
// Products of K <= 1,024 (the MoE's down projection a virtual shard holds) run a second build, 2 warps on K and 4
// output tiles a block (kernels/gpu/exl3_cuda.py's SHORT_K_BUILD, chosen by bench.kernels' exl3shard).
//
// Exactness (docs/design.md section 5.1): a block is 16 rows (slots) of one weight and 32 outputs; its warps take
// fixed equal parts of K and their partials are added in warp order. The K order of every output therefore depends
// on K alone, never on how many rows, tiles or experts share the launch, and a row never reads another's. Two
// callers: the MoE's slot grid (a table gives each 16-slot tile its expert; gate and up as one pair launch) and a
// stack of weights with the same rows count each (`exl3_dense`, the GEMM's decode rows); all run the same tile code.

#include <cuda_fp16.h>
#include <stdint.h>
#ifndef TWINSPARK_DEVICE_ONLY  // the kernels alone: a build check for another GPU without torch's headers
#include <torch/extension.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace {

// The tile shape (bench/ builds variants with -D to compare them; a build's shape is fixed, so its K order is too).
#ifndef TS_WARPS
#define TS_WARPS 8
#endif
#ifndef TS_N_TILES
#define TS_N_TILES 2
#endif
#ifndef TS_UNROLL
#define TS_UNROLL 4
#endif
#ifndef TS_STAGES
#define TS_STAGES 6
#endif
#ifndef TS_MIN_BLOCKS  // blocks per SM the register budget is cut for (0: the compiler's choice)
#define TS_MIN_BLOCKS 0
#endif
#if TS_MIN_BLOCKS > 0
#define TS_BOUNDS __launch_bounds__(TS_WARPS * 32, TS_MIN_BLOCKS)
#else
#define TS_BOUNDS __launch_bounds__(TS_WARPS * 32)
#endif
constexpr int WARPS = TS_WARPS;      // K parts per block, one per warp
constexpr int N_TILES = TS_N_TILES;  // 16-wide output tiles per block
constexpr int UNROLL = TS_UNROLL;    // K tiles per pipeline group
constexpr int STAGES = TS_STAGES;    // pipeline groups in flight per warp

// Groups a warp keeps in flight at a rate: STAGES, or fewer where the copies and the warps' partials would pass the
// 48 KiB of static shared memory ptxas allows a block (sm_90 and sm_121 alike: at 8 warps, 3.0 bits and up needed
// 50-62 KiB with 6 groups; tests/kernels/test_exl3_cuda_build.py). The depth of the copies only: the K order, so
// the bits, are the same at any depth.
template <int BITS2>
__host__ __device__ constexpr int pipe_stages() {
  constexpr int part = (WARPS - 1) * N_TILES * 8 * 32 * 4;     // the partials' bytes (`part` below)
  constexpr int per_stage = WARPS * UNROLL * N_TILES * 16 * BITS2;  // one group of every warp's words, bytes
  constexpr int fit = (48 * 1024 - part) / per_stage;
  static_assert(fit >= 2, "the pipeline needs two groups in flight");
  return fit < STAGES ? fit : STAGES;
}

template <int BITS2>  // bits per weight x 2 (half rates: odd steps carry one more bit)
struct Rate {
  static constexpr int LO = BITS2 / 2;
  static constexpr bool HALF = BITS2 & 1;
  static constexpr int WORDS = 4 * BITS2;   // 32-bit words per tile (16 x bits int16)
  static constexpr int BITS = 128 * BITS2;  // stream bits per tile
  // Stream bit where step j's bits end; its state is the 16 bits before.
  __device__ static constexpr int end_bit(int j) { return (j + 1) * LO + (HALF ? (j + 1) / 2 : 0); }
  // From lane t's first state to its i-th: steps 8t+1..8t+i (8t is even, so the odd ones are known).
  __device__ static constexpr int delta(int i) { return i * LO + (HALF ? (i + 1) / 2 : 0); }
};

__device__ __forceinline__ uint32_t pack_halves(uint32_t lo, uint32_t hi) { return __byte_perm(lo, hi, 0x5410); }

template <int CB>  // 0 = 3inst, 1 = mcg, 2 = mul1 (kernels/gpu/wtiles.py's ids)
__device__ __forceinline__ uint32_t decode_pair(uint32_t s0, uint32_t s1) {
  if constexpr (CB == 2) {
    const uint32_t h = pack_halves(__dp4a(s0 * 0x83DCD12Du, 0x01010101u, 0x6400u),
                                   __dp4a(s1 * 0x83DCD12Du, 0x01010101u, 0x6400u));
    const half2 scale = __halves2half2(__ushort_as_half(0x1EEE), __ushort_as_half(0x1EEE));
    const half2 bias = __halves2half2(__ushort_as_half(0xC931), __ushort_as_half(0xC931));
    const half2 v = __hfma2(*reinterpret_cast<const half2*>(&h), scale, bias);
    return *reinterpret_cast<const uint32_t*>(&v);
  } else {
    uint32_t x0 = CB == 1 ? s0 * 0xCBAC1FEDu : s0 * 89226354u + 64248484u;
    uint32_t x1 = CB == 1 ? s1 * 0xCBAC1FEDu : s1 * 89226354u + 64248484u;
    x0 = (x0 & 0x8FFF8FFFu) ^ 0x3B603B60u;
    x1 = (x1 & 0x8FFF8FFFu) ^ 0x3B603B60u;
    const uint32_t lo = pack_halves(x0, x1), hi = __byte_perm(x0, x1, 0x7632);
    const half2 v = __hadd2(*reinterpret_cast<const half2*>(&lo), *reinterpret_cast<const half2*>(&hi));
    return *reinterpret_cast<const uint32_t*>(&v);
  }
}

__device__ __forceinline__ void copy16_async(void* smem, const void* gmem) {
  const uint32_t dst = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(gmem));
}
__device__ __forceinline__ void commit_async() { asm volatile("cp.async.commit_group;\n" ::); }
template <int PENDING>
__device__ __forceinline__ void wait_async() { asm volatile("cp.async.wait_group %0;\n" ::"n"(PENDING)); }

// The lane's B fragments of one tile: b[0], b[1] for output columns 0..7, b[2], b[3] for 8..15.
// `tile` is the tile's words in shared memory; the lane's three start at `first_word` (circular: a tile's first
// states wrap around its end).
template <int CB, int BITS2>
__device__ __forceinline__ void decode_tile(const uint32_t* tile, int first_word, int offset, uint32_t b[4]) {
  using R = Rate<BITS2>;
  const int w1 = first_word + 1 == R::WORDS ? 0 : first_word + 1, w2 = w1 + 1 == R::WORDS ? 0 : w1 + 1;
  const uint32_t w0v = tile[first_word], w1v = tile[w1], w2v = tile[w2];
  const uint32_t hi = __funnelshift_l(w1v, w0v, offset), lo = __funnelshift_l(w2v, w1v, offset);
  const uint64_t span = (uint64_t(hi) << 32) | lo;  // bit 63 = the lane's first state's first bit
  uint32_t s[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) s[i] = uint32_t(span >> (48 - R::delta(i))) & 0xFFFFu;
#pragma unroll
  for (int i = 0; i < 4; ++i) b[i] = decode_pair<CB>(s[2 * i], s[2 * i + 1]);
}

__device__ __forceinline__ void mma(float c[4], const uint32_t a[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

template <int CB, int BITS2>
__global__ void TS_BOUNDS exl3_grouped_kernel(
    const half* __restrict__ a, const uint32_t* __restrict__ w, float* __restrict__ out,
    const int* __restrict__ pair_of_slot, const int* __restrict__ expert_of_block, int num_experts, int n, int k,
    int dense_rows, int64_t se, int64_t sn, int64_t sk, const uint32_t* __restrict__ w2, int64_t slots) {
  using R = Rate<BITS2>;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
  // A pair of weights of one layout on one slot grid (the MoE's gate and up): grid z = 1 is the second, its rows
  // and outputs `slots` rows further on. Each block's arithmetic is that of a launch on its weight alone.
  if (blockIdx.z) {
    w = w2;
    a += slots * k;
    out += slots * n;
  }
  // Grouped (dense_rows == 0): block b is slots 16b.. of the slot grid, its expert from the table, a slot empty when
  // its pair is -1. Dense (a batch of `dense_rows` rows per weight, stacked): block b is rows 16t.. of weight e,
  // t and e from b; rows past dense_rows are empty. Empty rows read zeros and are not written.
  int expert;
  int64_t slot0;
  bool has_g, has_g8;
  if (dense_rows == 0) {
    expert = expert_of_block[blockIdx.x];
    if (expert >= num_experts) return;  // an unused tile of the upper bound
    slot0 = int64_t(blockIdx.x) * 16;
    has_g = pair_of_slot[slot0 + g] >= 0;
    has_g8 = pair_of_slot[slot0 + g + 8] >= 0;
  } else {
    const int tiles = (dense_rows + 15) / 16, row0 = (blockIdx.x % tiles) * 16;
    expert = blockIdx.x / tiles;
    slot0 = int64_t(expert) * dense_rows + row0;
    has_g = row0 + g < dense_rows;
    has_g8 = row0 + g + 8 < dense_rows;
  }
  const int tile_n0 = blockIdx.y * N_TILES;
  const int k_tiles = k >> 4, per_warp = k_tiles / WARPS, kt0 = warp * per_warp;
  const uint32_t* row_g = reinterpret_cast<const uint32_t*>(a + (has_g ? slot0 + g : 0) * k);
  const uint32_t* row_g8 = reinterpret_cast<const uint32_t*>(a + (has_g8 ? slot0 + g + 8 : 0) * k);
  const uint32_t* w_e = w + expert * se + tile_n0 * sn;
  int first = R::end_bit(8 * lane) - 16;
  if (first < 0) first += R::BITS;
  const int first_word = first >> 5, offset = first & 31;

  // Each warp streams its part of K through shared memory, PIPE groups of UNROLL K tiles deep (cp.async: the
  // loads of later groups are in flight while a group is decoded). A K tile's N_TILES output tiles are adjacent in
  // memory: one run of N_TILES * WORDS words, 16-byte aligned (16 x bits int16 per tile, bits a multiple of 0.5).
  constexpr int RUN = N_TILES * R::WORDS, RUN_CHUNKS = RUN / 4, CHUNKS = UNROLL * RUN_CHUNKS;
  constexpr int PIPE = pipe_stages<BITS2>();
  __shared__ __align__(16) uint32_t words[WARPS][PIPE][UNROLL * RUN];
  const int groups = per_warp / UNROLL;
  auto issue = [&](int group) {
    if (group < groups) {
      uint32_t* dst = words[warp][group % PIPE];
      const uint32_t* src = w_e + int64_t(kt0 + group * UNROLL) * sk;
#pragma unroll
      for (int chunk = lane; chunk < CHUNKS; chunk += 32) {
        const int u = chunk / RUN_CHUNKS, within = 4 * (chunk % RUN_CHUNKS);
        copy16_async(dst + u * RUN + within, src + u * sk + within);
      }
    }
    commit_async();  // an empty group when past the end: the wait below counts groups
  };
#pragma unroll
  for (int group = 0; group < PIPE - 1; ++group) issue(group);

  auto a_fragments = [&](int group, uint32_t af[UNROLL][4]) {
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const int col = (kt0 + group * UNROLL + u) * 8 + c;  // half2 index of (row, 16 (kt + u) + 2c)
      af[u][0] = has_g ? __ldg(row_g + col) : 0u;
      af[u][1] = has_g8 ? __ldg(row_g8 + col) : 0u;
      af[u][2] = has_g ? __ldg(row_g + col + 4) : 0u;
      af[u][3] = has_g8 ? __ldg(row_g8 + col + 4) : 0u;
    }
  };
  float acc[N_TILES][2][4] = {};
  uint32_t af[UNROLL][4], af_next[UNROLL][4];
  a_fragments(0, af);
  for (int group = 0; group < groups; ++group) {
    wait_async<PIPE - 2>();
    __syncwarp();  // every lane's copies of this group have landed, and the group before is read by all
    issue(group + PIPE - 1);
    if (group + 1 < groups) a_fragments(group + 1, af_next);
    const uint32_t* stage = words[warp][group % PIPE];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
#pragma unroll
      for (int j = 0; j < N_TILES; ++j) {
        uint32_t b[4];
        decode_tile<CB, BITS2>(stage + u * RUN + j * R::WORDS, first_word, offset, b);
        mma(acc[j][0], af[u], b[0], b[1]);
        mma(acc[j][1], af[u], b[2], b[3]);
      }
    }
#pragma unroll
    for (int u = 0; u < UNROLL; ++u)
#pragma unroll
      for (int i = 0; i < 4; ++i) af[u][i] = af_next[u][i];
  }
  wait_async<0>();

  // The warps' partials, added in warp order by warp 0.
  __shared__ float part[WARPS - 1][N_TILES * 8][32];
  if (warp > 0) {
#pragma unroll
    for (int j = 0; j < N_TILES; ++j)
#pragma unroll
      for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int r = 0; r < 4; ++r) part[warp - 1][(j * 2 + h) * 4 + r][lane] = acc[j][h][r];
  }
  __syncthreads();
  if (warp > 0) return;
#pragma unroll
  for (int j = 0; j < N_TILES; ++j)
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        float v = acc[j][h][r];
#pragma unroll
        for (int p = 0; p < WARPS - 1; ++p) v += part[p][(j * 2 + h) * 4 + r][lane];
        const int row = g + (r >= 2 ? 8 : 0), col = (tile_n0 + j) * 16 + h * 8 + 2 * c + (r & 1);
        if (dense_rows == 0 || (r >= 2 ? has_g8 : has_g)) out[(slot0 + row) * n + col] = v;
      }
}

// The (codebook, 2 x bits) instantiations: 2.0 to 4.0 bits per weight, the half rates too, in exllamav3's default
// codebook (mul1); whole rates in the others. kernels/gpu/exl3_cuda.py keeps the same list (RATES) and sends other
// rates to the Triton kernel.
#define TWINSPARK_EXL3_RATES(X) \
  X(2, 4) X(2, 5) X(2, 6) X(2, 7) X(2, 8) X(0, 4) X(0, 6) X(0, 8) X(1, 4) X(1, 6) X(1, 8)

#ifdef TWINSPARK_DEVICE_ONLY
// Every instantiation, for tests/kernels/test_exl3_cuda_build.py's per-architecture build (no torch, no host code).
#define TWINSPARK_EXL3_KERNEL(CB, B2) reinterpret_cast<const void*>(&exl3_grouped_kernel<CB, B2>),
const void* const every_kernel[] = {TWINSPARK_EXL3_RATES(TWINSPARK_EXL3_KERNEL)};
#undef TWINSPARK_EXL3_KERNEL
}  // namespace
#else
template <int CB, int BITS2>
void launch(const torch::Tensor& a, const torch::Tensor& w, torch::Tensor& out, const int* pairs, const int* experts,
            int64_t blocks, int64_t num_experts, int64_t n, int64_t k, int64_t dense_rows, const torch::Tensor* w2) {
  const dim3 grid(blocks, n / (16 * N_TILES), w2 ? 2 : 1);
  const auto words = [](const torch::Tensor& t) { return reinterpret_cast<const uint32_t*>(t.data_ptr<int16_t>()); };
  // Strides in 32-bit words (every int16 stride of a trellis is even: 16 x bits words per tile).
  exl3_grouped_kernel<CB, BITS2><<<grid, WARPS * 32, 0, c10::cuda::getCurrentCUDAStream()>>>(
      reinterpret_cast<const half*>(a.data_ptr<at::Half>()), words(w), out.data_ptr<float>(), pairs, experts,
      int(num_experts), int(n), int(k), int(dense_rows), w.stride(0) / 2, w.stride(2) / 2, w.stride(1) / 2,
      w2 ? words(*w2) : nullptr, w2 ? a.size(0) / 2 : 0);
}

void check(const torch::Tensor& a, const torch::Tensor& w, const torch::Tensor& out, int64_t bits2) {
  const int64_t k = a.size(1), n = out.size(1);
  TORCH_CHECK(a.is_cuda() && a.scalar_type() == at::kHalf && a.is_contiguous(), "a: contiguous float16 on CUDA");
  TORCH_CHECK(w.scalar_type() == at::kShort && w.stride(3) == 1 && w.size(3) == 8 * bits2, "w: int16 trellis");
  TORCH_CHECK(reinterpret_cast<uintptr_t>(w.data_ptr()) % 16 == 0, "w: 16-byte aligned (cp.async)");
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.is_contiguous(), "out: contiguous float32");
  TORCH_CHECK(k % (16 * WARPS * UNROLL) == 0 && n % (16 * N_TILES) == 0, "k must be a multiple of ",
              16 * WARPS * UNROLL, ", n of ", 16 * N_TILES);
}

void dispatch(const torch::Tensor& a, const torch::Tensor& w, torch::Tensor& out, const int* pairs,
              const int* experts, int64_t blocks, int64_t num_experts, int64_t codebook, int64_t bits2,
              int64_t dense_rows, const torch::Tensor* w2 = nullptr) {
  const int64_t k = a.size(1), n = out.size(1);
#define TWINSPARK_EXL3_RATE(CB, B2) \
  if (codebook == CB && bits2 == B2) \
    return launch<CB, B2>(a, w, out, pairs, experts, blocks, num_experts, n, k, dense_rows, w2);
  TWINSPARK_EXL3_RATES(TWINSPARK_EXL3_RATE)
#undef TWINSPARK_EXL3_RATE
  TORCH_CHECK(false, "no EXL3 CUDA kernel for codebook ", codebook, " at ", bits2 / 2.0, " bits");
}

}  // namespace

// a [slots, k] float16; w [experts, k / 16, n / 16, 16 x bits] int16; out [slots, n] float32.
void exl3_grouped(torch::Tensor a, torch::Tensor w, torch::Tensor out, torch::Tensor pair_of_slot,
                  torch::Tensor expert_of_block, int64_t num_experts, int64_t codebook, int64_t bits2) {
  check(a, w, out, bits2);
  TORCH_CHECK(pair_of_slot.size(0) >= expert_of_block.size(0) * 16, "16 slots per tile");
  dispatch(a, w, out, pair_of_slot.data_ptr<int>(), expert_of_block.data_ptr<int>(), expert_of_block.size(0),
           num_experts, codebook, bits2, 0);
}

// The same for two stacks of one layout on one slot grid (the MoE's gate and up): a [2 x slots, k], the first
// weight's rows then the second's; out [2 x slots, n] alike.
void exl3_grouped_pair(torch::Tensor a, torch::Tensor w, torch::Tensor w2, torch::Tensor out,
                       torch::Tensor pair_of_slot, torch::Tensor expert_of_block, int64_t num_experts,
                       int64_t codebook, int64_t bits2) {
  check(a, w, out, bits2);
  TORCH_CHECK(w2.sizes() == w.sizes() && w2.strides() == w.strides() && w2.scalar_type() == w.scalar_type(),
              "w2: the layout of w");
  TORCH_CHECK(reinterpret_cast<uintptr_t>(w2.data_ptr()) % 16 == 0, "w2: 16-byte aligned (cp.async)");
  TORCH_CHECK(a.size(0) % 2 == 0 && a.size(0) / 2 >= expert_of_block.size(0) * 16 &&
                  pair_of_slot.size(0) >= expert_of_block.size(0) * 16,
              "a: two grids of 16 slots per tile");
  dispatch(a, w, out, pair_of_slot.data_ptr<int>(), expert_of_block.data_ptr<int>(), expert_of_block.size(0),
           num_experts, codebook, bits2, 0, &w2);
}

// a [experts x rows, k] float16: `rows` rows per weight of the stack w; out [experts x rows, n] float32.
void exl3_dense(torch::Tensor a, torch::Tensor w, torch::Tensor out, int64_t rows, int64_t codebook, int64_t bits2) {
  check(a, w, out, bits2);
  TORCH_CHECK(rows > 0 && a.size(0) == w.size(0) * rows, "a: rows per weight x weights");
  dispatch(a, w, out, nullptr, nullptr, w.size(0) * ((rows + 15) / 16), w.size(0), codebook, bits2, rows);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("exl3_grouped", &exl3_grouped, "EXL3 grouped product for decode-class slot tiles");
  m.def("exl3_grouped_pair", &exl3_grouped_pair, "the grouped product of two stacks of one layout in one launch");
  m.def("exl3_dense", &exl3_dense, "EXL3 product of each weight of a stack with its own rows");
}
#endif  // TWINSPARK_DEVICE_ONLY

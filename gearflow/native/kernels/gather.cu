// Zero-copy gathers of replay rows straight out of mapped host memory.
//
// Source: one column of a gearflow table (gearflow/replay/storage.py), i.e. a
// C-contiguous byte array [P * S, row_bytes] in the table's shared-memory
// segment, registered with cudaHostRegister(cudaHostRegisterMapped |
// cudaHostRegisterPortable) (gearflow/native/hostmem.py). `src` is the *device*
// pointer of row 0 of that column; every load below crosses the host link
// (PCIe / NVLink-C2C), so the kernels keep several 16-byte loads in flight per
// thread. Step t of partition p is row p * S + t % S: a window of T steps that
// starts at absolute step `start` reads rows p * S + (start + j) % S, j < T,
// wrapping around the partition's ring.
//
// Dtypes: byte pointers for rows (a row is row_bytes bytes of any column
// dtype), int64 ("long long") partitions / starts / rows / sizes, int32
// lengths, bool mask (1 byte). Strides: dst is C-contiguous [B, T, row_bytes]
// (windows) or [N, row_bytes] (rows), so output row r starts at r * row_bytes.
//
// Alignment and load width: the rows and windows kernels exist in five variants, the stacks
// kernel in the first four, named by the bytes each load moves: _v16 (uint4), _v8 (uint2),
// _v4 (unsigned int), _v1 (unsigned char), and _va (uint4 loads at any alignment). The wrapper
// (gearflow/native/gather.py, plan_gather) takes the widest W such that the src base pointer,
// the dst pointer and row_bytes are all multiples of W; then every row of src and dst starts
// W-aligned and a row is exactly row_bytes / W units. Where W < 16 and rows are >= 64 bytes
// (e.g. 28225-byte rows, every row starting at another offset mod 16) it takes _va instead:
// each row (or piece) is read with 16-byte loads from its first 16-byte-aligned source address
// on, its head and tail (< 16 bytes each) byte by byte, and each loaded word is stored with the
// widest store the destination's alignment there allows (the loads cross the host link; the
// stores go to device memory, an order of magnitude faster). Small rows keep _vW.
//
// Pieces: a row of the rows/windows kernels is copied in pieces of `piece` bytes (a multiple
// of W, 16 for _va; the wrapper's default 8 KiB), each a work item of its own, so that a batch
// of a few hundred 28 KiB rows is a few thousand independent work items in flight over the
// link, not a few hundred. A row of at most `piece` bytes is one piece (as before pieces).
//
// Launch geometry: block = (TX, TY, 1) with TX * TY == 256, TX = threads per work item = the
// power of two >= the item's units (capped at 256), TY = items per block; grid = (ceil(items /
// TY) capped at 65535, 1, 1), items = rows * pieces per row. Each block walks items
// blockIdx.x * TY + threadIdx.y, then + gridDim.x * TY, ... (grid-stride), and the TX threads of
// an item copy its units lane, lane + TX, ... No shared memory, no __syncthreads, no atomics:
// any grid is correct.
//
// Streams: the kernels are launched on the caller's CuPy stream (the current
// stream, or the `stream=` the wrapper is given); nothing here synchronizes.
// Read the partitions' RESERVE counters only after that stream has finished
// the gather (seqlock check, gearflow/native/gather.py:torn_items).
//
// Robustness: an item whose partition is outside [0, num_parts) or whose start
// is negative is written as padding (zeros, mask false) and a row index
// outside [0, num_rows) as zeros: a bad index never reads outside the column.
// Host-side index arrays are validated by the wrapper before the launch.
//
// Compiled by CuPy with NVRTC (no #include needed) and, in the tests, by
// `nvcc --ptx` for sm_80 and sm_90.

typedef long long i64;

#define GF_GATHER_THREADS 256

// Copy n units of type V from src to dst, lanes `lane`, `lane + lanes`, ...;
// four loads in flight per thread before their stores (host-link latency).
// Most frames a stacked column stacks (K; gearflow/replay/spec.py MAX_STACK).
#define GF_MAX_STACK 256
// Bytes read over the host link, counted by the tests' CPU emulation (nothing on a GPU).
#ifndef GF_COUNT_READ
#define GF_COUNT_READ(bytes) ((void)0)
#endif

template <typename V>
__device__ __forceinline__ void gf_copy_units(const V* __restrict__ src, V* __restrict__ dst,
                                              i64 n, int lane, int lanes)
{
    i64 i = lane;
    const i64 step = lanes;
    for (; i + 3 * step < n; i += 4 * step) {
        const V a = src[i];
        const V b = src[i + step];
        const V c = src[i + 2 * step];
        const V d = src[i + 3 * step];
        dst[i] = a;
        dst[i + step] = b;
        dst[i + 2 * step] = c;
        dst[i + 3 * step] = d;
    }
    for (; i < n; i += step) dst[i] = src[i];
}

template <typename V>
__device__ __forceinline__ void gf_zero_units(V* __restrict__ dst, i64 n, int lane, int lanes)
{
    V zero;
    unsigned char* z = reinterpret_cast<unsigned char*>(&zero);
    for (int k = 0; k < (int)sizeof(V); ++k) z[k] = 0;
    for (i64 i = lane; i < n; i += lanes) dst[i] = zero;
}

// One loaded 16-byte word into dst at any alignment: the widest stores the alignment allows.
__device__ __forceinline__ void gf_store16(unsigned char* __restrict__ dst, const uint4 v, int align)
{
    if (align == 0) {
        *reinterpret_cast<uint4*>(dst) = v;
    } else if ((align & 7) == 0) {
        uint2* d = reinterpret_cast<uint2*>(dst);
        d[0].x = v.x; d[0].y = v.y; d[1].x = v.z; d[1].y = v.w;
    } else if ((align & 3) == 0) {
        unsigned int* d = reinterpret_cast<unsigned int*>(dst);
        d[0] = v.x; d[1] = v.y; d[2] = v.z; d[3] = v.w;
    } else {
        const unsigned int w[4] = {v.x, v.y, v.z, v.w};
        for (int k = 0; k < 16; ++k) dst[k] = (unsigned char)(w[k >> 2] >> (8 * (k & 3)));
    }
}

// dst[0:n) = src[0:n) for any alignment of either (the _va variant): the bytes before src's
// first 16-byte boundary and after its last one byte by byte, the words between with uint4
// loads (four in flight per thread) and gf_store16; lanes `lane`, `lane + lanes`, ...
__device__ __forceinline__ void gf_copy_any(const unsigned char* __restrict__ src, unsigned char* __restrict__ dst,
                                            i64 n, int lane, int lanes)
{
    i64 head = (i64)((16 - ((unsigned long long)src & 15)) & 15);
    head = head < n ? head : n;
    const i64 words = (n - head) / 16;
    const i64 body_end = head + words * 16;
    for (i64 i = lane; i < head; i += lanes) dst[i] = src[i];
    for (i64 i = body_end + lane; i < n; i += lanes) dst[i] = src[i];
    const uint4* __restrict__ s = reinterpret_cast<const uint4*>(src + head);
    unsigned char* __restrict__ d = dst + head;
    const int align = (int)((unsigned long long)d & 15);  // the same for every word of the range
    i64 w = lane;
    const i64 step = lanes;
    for (; w + 3 * step < words; w += 4 * step) {
        const uint4 a = s[w];
        const uint4 b = s[w + step];
        const uint4 c = s[w + 2 * step];
        const uint4 e = s[w + 3 * step];
        gf_store16(d + 16 * w, a, align);
        gf_store16(d + 16 * (w + step), b, align);
        gf_store16(d + 16 * (w + 2 * step), c, align);
        gf_store16(d + 16 * (w + 3 * step), e, align);
    }
    for (; w < words; w += step) gf_store16(d + 16 * w, s[w], align);
}

// dst[0:n) = 0 at any alignment (padding of the _va variant).
__device__ __forceinline__ void gf_zero_any(unsigned char* __restrict__ dst, i64 n, int lane, int lanes)
{
    for (i64 i = lane; i < n; i += lanes) dst[i] = 0;
}

// The copy of bytes [lo, lo + n) of a row (a piece) by variant: V the load type, or the _va path
// (Any = true, V = uint4): lo is a multiple of sizeof(V) for the _vW variants.
template <typename V, bool Any>
__device__ __forceinline__ void gf_copy_piece(const unsigned char* __restrict__ src, unsigned char* __restrict__ dst,
                                              i64 n, int lane, int lanes)
{
    if (Any) {
        gf_copy_any(src, dst, n, lane, lanes);
    } else {
        gf_copy_units(reinterpret_cast<const V*>(src), reinterpret_cast<V*>(dst), n / (i64)sizeof(V), lane, lanes);
    }
}

template <typename V, bool Any>
__device__ __forceinline__ void gf_zero_piece(unsigned char* __restrict__ dst, i64 n, int lane, int lanes)
{
    if (Any) {
        gf_zero_any(dst, n, lane, lanes);
    } else {
        gf_zero_units(reinterpret_cast<V*>(dst), n / (i64)sizeof(V), lane, lanes);
    }
}

// dst[b, j, :] = src row parts[b] * S + (starts[b] + j) % S  for j < min(lengths[b], T)
// dst[b, j, :] = 0                                           otherwise (padding)
// mask[b, j]   = j < min(lengths[b], T)
//   src     device pointer of the column's row 0 (mapped host memory), row_bytes per row
//   parts   int64[B], partition of each item, in [0, num_parts)
//   starts  int64[B], absolute first step of each item, >= 0
//   lengths int32[B], steps in each item (clamped to [0, T])
//   dst     [B, T, row_bytes] bytes, C-contiguous;  mask bool[B, T]
template <typename V, bool Any>
__device__ __forceinline__ void gf_gather_windows(
    const unsigned char* __restrict__ src, i64 row_bytes, i64 S, i64 num_parts,
    const i64* __restrict__ parts, const i64* __restrict__ starts,
    const int* __restrict__ lengths, i64 B, int T,
    unsigned char* __restrict__ dst, bool* __restrict__ mask, i64 piece)
{
    const int lane = threadIdx.x;
    const int lanes = blockDim.x;
    const i64 pieces = (row_bytes + piece - 1) / piece;  // work items per output row
    const i64 items = B * (i64)T * pieces;
    for (i64 w = (i64)blockIdx.x * blockDim.y + threadIdx.y; w < items; w += (i64)gridDim.x * blockDim.y) {
        const i64 r = w / pieces;                          // output row (b, j)
        const i64 lo = (w - r * pieces) * piece;           // this piece's first byte in the row
        const i64 n = row_bytes - lo < piece ? row_bytes - lo : piece;
        const i64 b = r / T;
        const int j = (int)(r - b * T);
        const i64 p = parts[b];
        const i64 start = starts[b];
        int len = lengths[b];
        len = len < 0 ? 0 : (len > T ? T : len);
        const bool valid = j < len && p >= 0 && p < num_parts && start >= 0;
        unsigned char* out = dst + r * row_bytes + lo;
        if (valid) {
            const i64 row = p * S + (start + j) % S;
            gf_copy_piece<V, Any>(src + row * row_bytes + lo, out, n, lane, lanes);
        } else {
            gf_zero_piece<V, Any>(out, n, lane, lanes);
        }
        if (lane == 0 && lo == 0) mask[r] = valid;
    }
}

// dst[i, :] = src row rows[i]  (zeros for a row outside [0, num_rows))
//   rows int64[N]; dst [N, row_bytes] bytes, C-contiguous; in pieces of `piece` bytes.
// Transitions are this with rows = p * S + start % S (first step) and
// p * S + (start + length - 1) % S (last step, the n-step bootstrap row).
template <typename V, bool Any>
__device__ __forceinline__ void gf_gather_rows(
    const unsigned char* __restrict__ src, i64 row_bytes, i64 num_rows,
    const i64* __restrict__ rows, i64 N, unsigned char* __restrict__ dst, i64 piece)
{
    const int lane = threadIdx.x;
    const int lanes = blockDim.x;
    const i64 pieces = (row_bytes + piece - 1) / piece;
    const i64 items = N * pieces;
    for (i64 w = (i64)blockIdx.x * blockDim.y + threadIdx.y; w < items; w += (i64)gridDim.x * blockDim.y) {
        const i64 r = w / pieces;
        const i64 lo = (w - r * pieces) * piece;
        const i64 n = row_bytes - lo < piece ? row_bytes - lo : piece;
        const i64 row = rows[r];
        unsigned char* out = dst + r * row_bytes + lo;
        if (row >= 0 && row < num_rows) {
            gf_copy_piece<V, Any>(src + row * row_bytes + lo, out, n, lane, lanes);
        } else {
            gf_zero_piece<V, Any>(out, n, lane, lanes);
        }
    }
}

// Stacked-frame columns (gearflow/replay/spec.py, `uint8[4,84,84] stack=4`): a row of the
// column is one frame (row_bytes = one frame's bytes) and the segment's step_offset block,
// uint8[P * S], holds each step's offset in its episode, capped at 255. The K-frame stack of
// step t is steps t - min(K-1-f, offsets[row of t]) for f < K (oldest first): before an
// episode's start its first frame repeats.
//
// Each source frame is read over the host link ONCE per window, and written to every output
// slot that holds it (up to K of them): source row i in [0, T + K - 1) of item b is the
// frame of step s = starts[b] + i - (K - 1) (the oldest a stack of the window reaches, up
// to its last step). The output (j, f) holds step start + j - min(K-1-f, offset[start+j]),
// which is always in [start - (K-1), start + j], so the (T + K - 1) rows cover every slot;
// a frame no slot holds (before an episode's start, or in another episode) is not read.
// Row i reads the offset bytes of the K candidate steps j in [i - (K-1), i] once, then per
// unit one load and a store into each slot that holds the frame.
// Row i also zero-fills the padding steps j = i >= n (all K slots). Reads: (n + K - 1)
// frames per window at most instead of n * K (R2D2's 80-step windows of 4 frames: 83
// frames instead of 320).
//
// dst[b, j, f, :] = frame f of the stack of step starts[b] + j   for j < min(lengths[b], T)
// dst[b, j, f, :] = 0                                             otherwise (padding)
//   src      device pointer of the column's row 0, row_bytes (one frame) per row
//   offsets  device pointer of step_offset (uint8[num_parts * S]), 1-byte aligned
//   parts    int64[B] in [0, num_parts);  starts int64[B] >= 0;  lengths int32[B]
//   dst      [B, T, K, row_bytes] bytes, C-contiguous (a transition's obs: T = 1, lengths 1;
//            its next_obs: starts + lengths - 1). No mask: the windows kernel of the
//            item's other columns writes it (or the caller, when every column is stacked).
//   rows     the launch covers B * (T + K - 1) source rows (gather.py: stack_rows)
// A step index made negative by a torn offset byte stays inside its partition's ring (the
// item is then redrawn by the seqlock check): no index reads outside the column.
template <typename V>
__device__ __forceinline__ void gf_gather_stacks(
    const unsigned char* __restrict__ src, i64 row_bytes, i64 S, i64 num_parts,
    const unsigned char* __restrict__ offsets, i64 K, const i64* __restrict__ parts,
    const i64* __restrict__ starts, const int* __restrict__ lengths, i64 B, int T,
    unsigned char* __restrict__ dst)
{
    const i64 units = row_bytes / (i64)sizeof(V);
    const int lane = threadIdx.x;
    const int lanes = blockDim.x;
    const i64 per_item = (i64)T + K - 1;                  // source rows per window
    const i64 rows = B * per_item;
    const i64 frame_units = units;                        // output slot (b, j, f) is one frame
    for (i64 r = (i64)blockIdx.x * blockDim.y + threadIdx.y; r < rows;
         r += (i64)gridDim.x * blockDim.y) {
        const i64 b = r / per_item;
        const i64 i = r - b * per_item;                   // source row: step start + i - (K-1)
        const i64 p = parts[b];
        const i64 start = starts[b];
        int n = lengths[b];
        n = n < 0 ? 0 : (n > T ? T : n);
        const bool item_ok = p >= 0 && p < num_parts && start >= 0 && K >= 1;
        V* item_out = reinterpret_cast<V*>(dst + b * (i64)T * K * row_bytes);
        if (i < T && (i >= n || !item_ok)) {              // padding step j = i: all K slots zero
            for (i64 f = 0; f < K; ++f) gf_zero_units(item_out + (i * K + f) * frame_units, units, lane, lanes);
        }
        if (!item_ok) continue;
        const i64 s = start + i - (K - 1);                // the source step this row reads
        // Step t = start + j holds s in its slots f with t - min(K-1-f, d_t) == s, where
        // g = t - s = j - i + K - 1 in [0, K-1]: none if g > d_t, the one slot f = K-1-g if
        // g < d_t, and f in [0, K-1-g] (the episode's first frame repeated) if g == d_t.
        i64 j0 = i - (K - 1);
        if (j0 < 0) j0 = 0;
        const i64 j1 = i < n - 1 ? i : (i64)n - 1;
        unsigned char depth[GF_MAX_STACK];                 // d_t of the steps j0..j1 (each read once)
        bool held = false;
        for (i64 j = j0; j <= j1; ++j) {
            const i64 t = start + j;
            depth[j - j0] = offsets[p * S + t % S];       // the step's offset in its episode (capped)
            held = held || (j - i + K - 1) <= (i64)depth[j - j0];
        }
        if (!held) continue;                               // no slot holds this frame: not read
        i64 m = s % S;
        if (m < 0) m += S;                                 // a window that starts < K-1 steps in
        const V* in = reinterpret_cast<const V*>(src + (p * S + m) * row_bytes);
        for (i64 u = lane; u < units; u += lanes) {
            const V v = in[u];                             // the one read of this unit
            GF_COUNT_READ(sizeof(V));
            for (i64 j = j0; j <= j1; ++j) {
                const i64 g = j - i + K - 1;
                const i64 d = depth[j - j0];
                if (g > d) continue;
                const i64 f_lo = g < d ? K - 1 - g : 0;
                for (i64 f = f_lo; f <= K - 1 - g; ++f) item_out[(j * K + f) * frame_units + u] = v;
            }
        }
    }
}

// extern "C" entry points, one per load width (see the header comment).
#define GF_DEFINE_ROWS(SUFFIX, V, ANY)                                                       \
    extern "C" __global__ void __launch_bounds__(GF_GATHER_THREADS)                          \
    gather_windows_##SUFFIX(const unsigned char* __restrict__ src, i64 row_bytes, i64 S,     \
                            i64 num_parts, const i64* __restrict__ parts,                    \
                            const i64* __restrict__ starts, const int* __restrict__ lengths, \
                            i64 B, int T, unsigned char* __restrict__ dst,                   \
                            bool* __restrict__ mask, i64 piece)                              \
    {                                                                                        \
        gf_gather_windows<V, ANY>(src, row_bytes, S, num_parts, parts, starts, lengths, B, T, \
                                  dst, mask, piece);                                         \
    }                                                                                        \
    extern "C" __global__ void __launch_bounds__(GF_GATHER_THREADS)                          \
    gather_rows_##SUFFIX(const unsigned char* __restrict__ src, i64 row_bytes, i64 num_rows, \
                         const i64* __restrict__ rows, i64 N, unsigned char* __restrict__ dst, \
                         i64 piece)                                                          \
    {                                                                                        \
        gf_gather_rows<V, ANY>(src, row_bytes, num_rows, rows, N, dst, piece);               \
    }

#define GF_DEFINE_STACKS(SUFFIX, V)                                                          \
    extern "C" __global__ void __launch_bounds__(GF_GATHER_THREADS)                          \
    gather_stacks_##SUFFIX(const unsigned char* __restrict__ src, i64 row_bytes, i64 S,      \
                           i64 num_parts, const unsigned char* __restrict__ offsets, i64 K,  \
                           const i64* __restrict__ parts, const i64* __restrict__ starts,    \
                           const int* __restrict__ lengths, i64 B, int T,                    \
                           unsigned char* __restrict__ dst)                                  \
    {                                                                                        \
        gf_gather_stacks<V>(src, row_bytes, S, num_parts, offsets, K, parts, starts, lengths, \
                            B, T, dst);                                                      \
    }

GF_DEFINE_ROWS(v16, uint4, false)
GF_DEFINE_ROWS(v8, uint2, false)
GF_DEFINE_ROWS(v4, unsigned int, false)
GF_DEFINE_ROWS(v1, unsigned char, false)
GF_DEFINE_ROWS(va, uint4, true)
GF_DEFINE_STACKS(v16, uint4)
GF_DEFINE_STACKS(v8, uint2)
GF_DEFINE_STACKS(v4, unsigned int)
GF_DEFINE_STACKS(v1, unsigned char)

// Proportional prioritized selection over a device priority vector.
//
// State (owned by the caller, all on one device, C-contiguous):
//   masses      float64[N]   m_i = p_i ** alpha for a live slot with p_i > 0, else 0
//   chunk_sums  float64[NC]  NC = ceil(N / GF_CHUNK); chunk_sums[k] = sum of
//                            masses[k * GF_CHUNK : (k + 1) * GF_CHUNK] (0 past N)
//   prefix      float64[NC]  inclusive prefix sum of chunk_sums (scratch, per sample)
// This is a two-level sum tree with fanout GF_CHUNK = 4096: a priority update
// re-sums the chunk of each updated slot (chunk_sums over the updated slots; the
// wrapper re-sums all chunks instead when the update has >= NC slots), a sample
// scans the NC chunk sums (2,442 at N = 10^7) in one block and then searches
// one chunk of 4096 masses per target.
//
// Search rule (the same as gearflow.replay.selectors.SumTree.find): at each
// level take the *last element with nonzero mass whose exclusive prefix sum is
// <= the remaining target*. That is the element whose mass interval holds the
// target; for a target at or past the end of the mass actually present
// (rounding: the prefix, the chunk sums and the in-chunk sums are added in
// different orders), it is the last nonzero element. So a zero-mass slot is
// never returned while the total is > 0, and the remaining target never goes
// negative.
//
// Stratified targets, as PrioritizedSelector: target_i = (i + u_i) * (total / B)
// with u_i uniform in [0, 1) (drawn by the caller, so a CPU reference given the
// same u returns the same slots).
//
// Dtypes: int64 ("long long") slots / sizes, float64 masses / sums / u /
// probabilities, float32 importance weights, priorities float64 or float32
// (two scatter kernels). Strides: every array is 1-D and contiguous.
//
// Launch geometry: every block has GF_THREADS = 256 threads (x only).
//   set_priorities_f64/_f32  grid = ceil(K / 256) (capped), one thread per update, grid-stride
//   chunk_sums               grid = min(count, 65535), one block per chunk, grid-stride
//   scan_chunk_sums          grid = 1
//   sample_proportional      grid = min(B, 65535), one block per target, grid-stride
//   sample_uniform           grid = ceil(B / 256) (capped), one thread per draw
//   importance_weights       grid = 1
// Kernels that use shared memory loop over their work per *block*, so every
// thread of a block reaches every __syncthreads.
//
// Streams: launched on the caller's CuPy stream (current stream or the
// wrapper's `stream=`); the kernels of one operation are ordered by that
// stream and nothing here synchronizes with the host.
//
// Compiled by CuPy with NVRTC (no #include needed) and, in the tests, by
// `nvcc --ptx` for sm_80 and sm_90.

typedef long long i64;

#define GF_THREADS 256
#define GF_PER_THREAD 16
#define GF_CHUNK (GF_THREADS * GF_PER_THREAD)
#define GF_DBL_MAX 1.7976931348623157e308

// Sum of masses[first : first + GF_PER_THREAD] (0 past N), added in index order.
__device__ __forceinline__ double gf_thread_sum(const double* __restrict__ masses, i64 N, i64 first)
{
    double s = 0.0;
    for (int e = 0; e < GF_PER_THREAD; ++e) {
        const i64 i = first + e;
        if (i < N) s += masses[i];
    }
    return s;
}

// Number of i in [0, n) with a[i] <= x, for nondecreasing a.
__device__ __forceinline__ i64 gf_upper_bound(const double* __restrict__ a, i64 n, double x)
{
    i64 lo = 0, hi = n;
    while (lo < hi) {
        const i64 mid = lo + (hi - lo) / 2;
        if (a[mid] <= x) lo = mid + 1; else hi = mid;
    }
    return lo;
}

// First i in [0, n) with a[i] >= x (n if none), for nondecreasing a.
__device__ __forceinline__ i64 gf_lower_bound(const double* __restrict__ a, i64 n, double x)
{
    i64 lo = 0, hi = n;
    while (lo < hi) {
        const i64 mid = lo + (hi - lo) / 2;
        if (a[mid] < x) lo = mid + 1; else hi = mid;
    }
    return lo;
}

// Exclusive prefix sum of v over the block's GF_THREADS threads (Hillis-Steele
// in shared memory, a fixed order of additions). `sh` holds GF_THREADS doubles.
// Every thread of the block must call it.
__device__ __forceinline__ double gf_block_exclusive_scan(double v, double* sh)
{
    const int t = threadIdx.x;
    sh[t] = v;
    __syncthreads();
    for (int offset = 1; offset < GF_THREADS; offset <<= 1) {
        const double add = t >= offset ? sh[t - offset] : 0.0;
        __syncthreads();
        sh[t] += add;
        __syncthreads();
    }
    const double inclusive = sh[t];
    __syncthreads();  // sh is reused by the caller
    return inclusive - v;
}

// Priority update: masses[slots[i]] = p_i ** alpha (0 for p_i == 0), for i < K
// with skip[i] false. The wrapper sets skip[i] when a later entry names the same
// slot (so the last update of a slot wins, deterministically, and every slot is
// written by one thread); skip may be NULL when slots are known to be distinct.
// A slot outside [0, N) is not written and a priority that is negative, NaN or
// infinite is stored as mass 0; both are counted in *invalid (uint64), which
// the wrapper returns without synchronizing.
#define GF_DEFINE_SET_PRIORITIES(NAME, P)                                                  \
    extern "C" __global__ void __launch_bounds__(GF_THREADS)                               \
    NAME(double* __restrict__ masses, i64 N, const i64* __restrict__ slots,                \
         const P* __restrict__ priorities, const bool* __restrict__ skip, i64 K,           \
         double alpha, unsigned long long* __restrict__ invalid)                           \
    {                                                                                      \
        for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < K;                    \
             i += (i64)gridDim.x * blockDim.x) {                                           \
            if (skip != 0 && skip[i]) continue;                                            \
            const i64 s = slots[i];                                                        \
            const double p = (double)priorities[i];                                        \
            const bool ok = p >= 0.0 && p <= GF_DBL_MAX; /* false for NaN and inf */       \
            if (s < 0 || s >= N || !ok) atomicAdd(invalid, 1ULL);                          \
            if (s < 0 || s >= N) continue;                                                 \
            masses[s] = (ok && p > 0.0) ? pow(p, alpha) : 0.0;                             \
        }                                                                                  \
    }

GF_DEFINE_SET_PRIORITIES(set_priorities_f64, double)
GF_DEFINE_SET_PRIORITIES(set_priorities_f32, float)

// Chunk sums. With slots == NULL: out[g] = sum of chunk g for g < count (all
// chunks: count = NC). Otherwise: refresh the chunk of each slot, k = slots[g] /
// GF_CHUNK for g < count (slots outside [0, N) skipped; a chunk named twice is
// written twice with the same value). Per thread: 16 consecutive masses in
// order; per block: a fixed tree in shared memory, so a chunk's sum is the
// same bits whichever call computed it.
extern "C" __global__ void __launch_bounds__(GF_THREADS)
chunk_sums(const double* __restrict__ masses, i64 N, const i64* __restrict__ slots, i64 count,
           double* __restrict__ out)
{
    __shared__ double sh[GF_THREADS];
    const int t = threadIdx.x;
    for (i64 g = blockIdx.x; g < count; g += gridDim.x) {  // uniform per block
        i64 k = g;
        if (slots != 0) {
            const i64 s = slots[g];
            if (s < 0 || s >= N) continue;  // uniform per block: no thread reaches a barrier alone
            k = s / GF_CHUNK;
        }
        sh[t] = gf_thread_sum(masses, N, k * GF_CHUNK + (i64)t * GF_PER_THREAD);
        __syncthreads();
        for (int half = GF_THREADS / 2; half > 0; half >>= 1) {
            if (t < half) sh[t] += sh[t + half];
            __syncthreads();
        }
        if (t == 0) out[k] = sh[0];
        __syncthreads();
    }
}

// prefix[k] = sums[0] + ... + sums[k] for k < n. One block: thread t adds a
// contiguous run of ceil(n / 256) sums, the runs are scanned across the block,
// then each thread writes its run's prefixes.
extern "C" __global__ void __launch_bounds__(GF_THREADS)
scan_chunk_sums(const double* __restrict__ sums, i64 n, double* __restrict__ prefix)
{
    __shared__ double sh[GF_THREADS];
    const i64 per = (n + GF_THREADS - 1) / GF_THREADS;
    const i64 lo = (i64)threadIdx.x * per;
    const i64 hi = lo + per < n ? lo + per : n;
    double run = 0.0;
    for (i64 i = lo; i < hi; ++i) run += sums[i];
    run = gf_block_exclusive_scan(run, sh);
    for (i64 i = lo; i < hi; ++i) {
        run += sums[i];
        prefix[i] = run;
    }
}

// Stratified proportional sampling, one block per target i < B:
//   total  = prefix[NC - 1]
//   target = (i + u[i]) * (total / B), clamped to [0, total]
//   chunk  k: last chunk with nonzero sum whose exclusive prefix <= target
//   thread t of chunk k: last 16-mass run with nonzero sum whose exclusive
//          prefix (within the chunk) <= target - prefix before k
//   slot: last nonzero mass of that run whose exclusive prefix <= what is left
// slots[i] = the slot, probabilities[i] = masses[slot] / total. With total <= 0
// (or inconsistent chunk sums: a stale cache) the result is slot -1, probability 0.
extern "C" __global__ void __launch_bounds__(GF_THREADS)
sample_proportional(const double* __restrict__ masses, i64 N, const double* __restrict__ prefix,
                    i64 num_chunks, const double* __restrict__ u, i64 B,
                    i64* __restrict__ slots, double* __restrict__ probabilities)
{
    __shared__ double sh[GF_THREADS];
    __shared__ i64 sh_chunk;
    __shared__ double sh_rest;
    __shared__ int sh_thread;
    const int t = threadIdx.x;
    const double total = prefix[num_chunks - 1];
    for (i64 i = blockIdx.x; i < B; i += gridDim.x) {  // uniform per block
        if (!(total > 0.0)) {
            if (t == 0) {
                slots[i] = -1;
                probabilities[i] = 0.0;
            }
            continue;
        }
        if (t == 0) {
            double target = ((double)i + u[i]) * (total / (double)B);
            target = target < 0.0 ? 0.0 : (target > total ? total : target);
            i64 k = gf_upper_bound(prefix, num_chunks - 1, target);
            const double before_k = k > 0 ? prefix[k - 1] : 0.0;
            if (!(prefix[k] > before_k)) k = gf_lower_bound(prefix, k, prefix[k]);  // zero-mass chunk: step back
            sh_chunk = k;
            sh_rest = target - (k > 0 ? prefix[k - 1] : 0.0);
            sh_thread = -1;
        }
        __syncthreads();
        const i64 k = sh_chunk;
        const double rest = sh_rest;
        const i64 first = k * GF_CHUNK + (i64)t * GF_PER_THREAD;
        const double mine = gf_thread_sum(masses, N, first);
        const double before = gf_block_exclusive_scan(mine, sh);
        if (mine > 0.0 && before <= rest) atomicMax(&sh_thread, t);  // last eligible run
        __syncthreads();
        if (t == sh_thread) {
            const double left = rest - before;
            double run = 0.0;
            i64 pick = -1;
            for (int e = 0; e < GF_PER_THREAD && first + e < N; ++e) {
                const double m = masses[first + e];
                if (m > 0.0 && run <= left) pick = first + e;
                run += m;
            }
            slots[i] = pick;
            probabilities[i] = pick >= 0 ? masses[pick] / total : 0.0;
        } else if (t == 0 && sh_thread < 0) {
            slots[i] = -1;
            probabilities[i] = 0.0;
        }
        __syncthreads();  // shared state is rewritten for the next target
    }
}

// Uniform draws with replacement: pick = min(floor(u[i] * n), n - 1);
// slots[i] = live ? live[pick] : pick; probabilities[i] = 1 / n.
extern "C" __global__ void __launch_bounds__(GF_THREADS)
sample_uniform(const double* __restrict__ u, i64 B, i64 n, const i64* __restrict__ live,
               i64* __restrict__ slots, double* __restrict__ probabilities)
{
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < B;
         i += (i64)gridDim.x * blockDim.x) {
        i64 pick = (i64)(u[i] * (double)n);
        pick = pick < 0 ? 0 : (pick >= n ? n - 1 : pick);
        slots[i] = live != 0 ? live[pick] : pick;
        probabilities[i] = 1.0 / (double)n;
    }
}

// Importance weights, one block for the whole batch:
//   w_i = (num_live * P_i) ** -beta / max_k (num_live * P_k) ** -beta   (float32 out)
extern "C" __global__ void __launch_bounds__(GF_THREADS)
importance_weights(const double* __restrict__ probabilities, i64 B, double num_live, double beta,
                   float* __restrict__ weights)
{
    __shared__ double sh[GF_THREADS];
    const int t = threadIdx.x;
    double top = 0.0;
    for (i64 i = t; i < B; i += GF_THREADS) {
        const double w = pow(num_live * probabilities[i], -beta);
        top = w > top ? w : top;
    }
    sh[t] = top;
    __syncthreads();
    for (int half = GF_THREADS / 2; half > 0; half >>= 1) {
        if (t < half) sh[t] = sh[t + half] > sh[t] ? sh[t + half] : sh[t];
        __syncthreads();
    }
    const double mx = sh[0];
    for (i64 i = t; i < B; i += GF_THREADS) {
        weights[i] = (float)(pow(num_live * probabilities[i], -beta) / mx);
    }
}

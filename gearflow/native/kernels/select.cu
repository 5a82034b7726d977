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

// The largest of every thread's v over the block (sh: GF_THREADS doubles of shared memory),
// returned to every thread; every thread of the block must call it.
__device__ __forceinline__ double gf_block_max(double* sh, double v)
{
    const int t = threadIdx.x;
    sh[t] = v;
    __syncthreads();
    for (int half = GF_THREADS / 2; half > 0; half >>= 1) {
        if (t < half) sh[t] = sh[t + half] > sh[t] ? sh[t + half] : sh[t];
        __syncthreads();
    }
    return sh[0];
}

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
    const double mx = gf_block_max(sh, top);
    for (i64 i = t; i < B; i += GF_THREADS) {
        weights[i] = (float)(pow(num_live * probabilities[i], -beta) / mx);
    }
}

// ============================================================================ the device replay's kernels
// What a DeviceReplay (gearflow/native/device_replay.py) launches: per sample one fused draw
// (draw_items) and one batch finish (finish_batch) around the kind's gather kernels; per
// priority write-back three launches with no host synchronization (mark_updates, apply_updates_*,
// chunk_sums over the marked slots); per batch of ingested/evicted items one apply_ingest (plus
// the chunk re-sums). They find their arrays through two descriptors in device memory, every
// field 8 bytes (pointers and int64), in the order of gearflow/native/select.py REPLAY_FIELDS and
// DRAW_FIELDS (a test reads the structs below and compares):
struct gf_replay {
    double* masses;                  // [N]  p ** alpha of a live slot (uniform selector: 1); 0 when dead
    double* sums;                    // [NC] chunk sums of masses
    double* live;                    // [N]  1 per live slot, 0 when dead (uniform selector: masses itself)
    double* live_sums;               // [NC] chunk sums of live
    i64* start;                      // [N]  record mirrors: the slot's item's absolute first step,
    i64* seq;                        // [N]  its sequence number in its partition (-1: none yet),
    int* length;                     // [N]  and its steps
    unsigned long long* winner;      // [N]  update de-duplication: (call tag | entry) of a slot's last entry
    unsigned long long* prio_status; // [2]  running totals: priorities applied, priorities refused
    const volatile i64* counters;    // [P, counter_fields] the segment's counters (mapped host memory)
    i64 N, NC, P, R, counter_fields, reserve_field, trusted_steps;
};
struct gf_draw {                     // one buffer set: a batch's draw and its outputs, [B] each
    i64* slots; double* probs; i64* parts; i64* starts; i64* seqs; int* lengths;  // draw + record
    i64* keys; float* weights; double* probabilities;  // the batch's outputs (torch views them)
    unsigned char* flags;            // bit 0: impossible slot (redraw), bit 1: torn (evict, redraw)
    volatile i64* status;            // [4] mapped pinned host memory: impossible rows, torn rows,
                                     //     and prio_status as of this batch (applied, refused)
};

// Uniforms for the draws without a host array: u_i = (splitmix64(seed ^ splitmix64(counter << 32
// + i)) >> 11) / 2^53, in [0, 1); gearflow/native/select.py uniforms() is the reference.
__device__ __forceinline__ unsigned long long gf_mix(unsigned long long x)
{
    x += 0x9E3779B97F4A7C15ULL;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL;
    return x ^ (x >> 31);
}

__device__ __forceinline__ double gf_uniform(unsigned long long seed, unsigned long long counter, i64 i)
{
    const unsigned long long bits = gf_mix(seed ^ gf_mix((counter << 32) + (unsigned long long)i));
    return (double)(bits >> 11) * (1.0 / 9007199254740992.0);
}

// Level 1 of the fused draw: the block's scan of a chunk-sum vector (thread t adds chunks
// [lo, hi), in order), the total into *total (shared) and this thread's run and exclusive prefix.
__device__ __forceinline__ void gf_scan_runs(const double* __restrict__ sums, i64 lo, i64 hi, double* sh,
                                             double* total, double* run, double* before)
{
    double r = 0.0;
    for (i64 k = lo; k < hi; ++k) r += sums[k];
    const double b = gf_block_exclusive_scan(r, sh);
    if (threadIdx.x == GF_THREADS - 1) *total = b + r;
    __syncthreads();
    *run = r;
    *before = b;
}

// One block per draw i < count, into row rows[i] of d (rows == NULL: row i): a slot drawn
// proportionally to masses, stratified over the count draws (target (i + u_i) * total / count,
// u_i = u[i], or gf_uniform(seed, counter, i) when u == NULL); with no mass at all, proportionally
// to live (uniform over the live slots, probability 1 / live slots: the CPU selector's rule).
// Search: the block scans the chunk sums (level 1: the last thread run, then the last chunk in it,
// with mass whose prefix <= the target), then the chunk's masses (level 2, as sample_proportional);
// no prefix array, no second launch. The drawn slot's record is copied out of the mirrors into
// the row (parts = slot / R, starts, seqs, lengths; -1 / 0 where the slot is impossible: -1 when
// rounding found no slot). Nothing else reads the mirrors: the gather, the keys and the seqlock
// check use the row's record.
extern "C" __global__ void __launch_bounds__(GF_THREADS)
draw_items(const gf_replay* __restrict__ st, const gf_draw* __restrict__ d, const i64* __restrict__ rows,
           i64 count, const double* __restrict__ u, unsigned long long seed, unsigned long long counter)
{
    __shared__ double sh[GF_THREADS];
    __shared__ double sh_total;
    __shared__ int sh_thread;
    __shared__ i64 sh_chunk;
    __shared__ double sh_rest;
    const int t = threadIdx.x;
    const i64 N = st->N, NC = st->NC;
    const i64 per = (NC + GF_THREADS - 1) / GF_THREADS;  // chunk sums per thread
    const i64 lo = (i64)t * per < NC ? (i64)t * per : NC;
    const i64 hi = lo + per < NC ? lo + per : NC;
    for (i64 i = blockIdx.x; i < count; i += gridDim.x) {  // uniform per block
        const i64 row = rows != 0 ? rows[i] : i;
        const double* m = st->masses;
        const double* sums = st->sums;
        double run, before;
        gf_scan_runs(sums, lo, hi, sh, &sh_total, &run, &before);
        double total = sh_total;
        if (!(total > 0.0)) {  // no mass at all (every live priority 0): uniform over the live slots
            m = st->live;
            sums = st->live_sums;
            gf_scan_runs(sums, lo, hi, sh, &sh_total, &run, &before);
            total = sh_total;
        }
        const double ui = u != 0 ? u[i] : gf_uniform(seed, counter, i);
        double target = ((double)i + ui) * (total / (double)count);
        target = target < 0.0 ? 0.0 : (target > total ? total : target);
        if (t == 0) {
            sh_thread = -1;
            sh_chunk = -1;
            sh_rest = 0.0;
        }
        __syncthreads();
        if (run > 0.0 && before <= target) atomicMax(&sh_thread, t);  // the last run holding the target
        __syncthreads();
        if (t == sh_thread) {  // level 1: the last chunk with mass whose prefix <= the target
            double acc = before;
            for (i64 k = lo; k < hi; ++k) {
                if (sums[k] > 0.0 && acc <= target) {
                    sh_chunk = k;
                    sh_rest = target - acc;
                }
                acc += sums[k];
            }
        }
        __syncthreads();
        const i64 k = sh_chunk;
        const double rest = sh_rest;
        const i64 first = k * GF_CHUNK + (i64)t * GF_PER_THREAD;
        const double mine = k >= 0 ? gf_thread_sum(m, N, first) : 0.0;
        const double in_before = gf_block_exclusive_scan(mine, sh);
        if (t == 0) sh_thread = -1;
        __syncthreads();
        if (mine > 0.0 && in_before <= rest) atomicMax(&sh_thread, t);  // level 2: the last run
        __syncthreads();
        const int picker = sh_thread;
        if (t == picker || (picker < 0 && t == 0)) {
            i64 pick = -1;
            if (picker >= 0) {
                const double left = rest - in_before;
                double acc = 0.0;
                for (int e = 0; e < GF_PER_THREAD && first + e < N; ++e) {
                    const double me = m[first + e];
                    if (me > 0.0 && acc <= left) pick = first + e;
                    acc += me;
                }
            }
            const bool ok = pick >= 0 && pick < N;
            d->slots[row] = pick;
            d->probs[row] = ok ? m[pick] / total : 0.0;
            d->parts[row] = ok ? pick / st->R : -1;
            d->starts[row] = ok ? st->start[pick] : 0;
            d->seqs[row] = ok ? st->seq[pick] : -1;
            d->lengths[row] = ok ? st->length[pick] : 0;
        }
        __syncthreads();  // shared state is rewritten for the next draw
    }
}

// The batch's outputs and checks, after its gather (one block, B rows): the seqlock rule on the
// row's record against RESERVE read now from the segment (volatile: after the gather kernels,
// which the stream ordered before this one), start < RESERVE[part] - trusted_steps, as
// gearflow/replay/layout.py torn_items; keys = seq * P + part; probabilities copied; IS weights
// (num_live * P) ** -beta / their batch max (float32; 0 on an impossible row); flags; then the
// counts and prio_status into the status word in host memory, which the host reads after the
// batch's event. An impossible or torn row is redrawn by the host, never returned.
extern "C" __global__ void __launch_bounds__(GF_THREADS)
finish_batch(const gf_replay* __restrict__ st, const gf_draw* __restrict__ d, i64 B, double num_live, double beta)
{
    __shared__ double sh[GF_THREADS];
    __shared__ unsigned long long sh_bad[2];
    const int t = threadIdx.x;
    if (t < 2) sh_bad[t] = 0ULL;
    __syncthreads();
    double top = 0.0;
    for (i64 b = t; b < B; b += GF_THREADS) {
        const i64 s = d->slots[b];
        const i64 p = d->parts[b];
        const bool valid = s >= 0 && s < st->N && p >= 0 && p < st->P;
        bool torn = false;
        if (valid) {
            const i64 reserve = st->counters[p * st->counter_fields + st->reserve_field];
            torn = d->starts[b] < reserve - st->trusted_steps;
        }
        d->flags[b] = (unsigned char)((valid ? 0 : 1) | (torn ? 2 : 0));
        if (!valid) atomicAdd(&sh_bad[0], 1ULL);
        if (torn) atomicAdd(&sh_bad[1], 1ULL);
        d->keys[b] = valid ? d->seqs[b] * st->P + p : -1;
        const double prob = d->probs[b];
        d->probabilities[b] = prob;
        const double w = valid && prob > 0.0 ? pow(num_live * prob, -beta) : 0.0;
        top = w > top ? w : top;
    }
    const double mx = gf_block_max(sh, top);
    for (i64 b = t; b < B; b += GF_THREADS) {
        const double prob = d->probs[b];
        const double w = d->flags[b] & 1 || !(prob > 0.0) ? 0.0 : pow(num_live * prob, -beta);
        d->weights[b] = (float)(mx > 0.0 ? w / mx : 0.0);
    }
    __syncthreads();
    if (t == 0) {
        d->status[0] = (i64)sh_bad[0];
        d->status[1] = (i64)sh_bad[1];
        d->status[2] = (i64)st->prio_status[0];
        d->status[3] = (i64)st->prio_status[1];
        __threadfence_system();  // the host reads the word after the batch's event
    }
}

// Priority write-back by key, step 1 of 3: entry i's key names slot p * R + (key / P) % R with
// p = key % P; the entry is held when that slot is live and its mirrored seq is key / P (keys
// of evicted items, and negative keys, are ignored: slots_out[i] = -1). Each held slot keeps
// the largest (tag | i) of its entries in winner (atomicMax): the last entry of a repeated key
// wins, decided on the device. tag = the call's number << 32, above every earlier call's, so
// winner is never cleared. One thread per entry.
extern "C" __global__ void __launch_bounds__(GF_THREADS)
mark_updates(const gf_replay* __restrict__ st, const i64* __restrict__ keys, i64 K, unsigned long long tag,
             i64* __restrict__ slots_out)
{
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < K; i += (i64)gridDim.x * blockDim.x) {
        const i64 key = keys[i];
        i64 slot = -1;
        if (key >= 0) {
            const i64 seq = key / st->P;
            const i64 s = (key % st->P) * st->R + seq % st->R;
            if (s < st->N && st->live[s] > 0.0 && st->seq[s] == seq) {
                slot = s;
                atomicMax(&st->winner[s], tag | (unsigned long long)i);
            }
        }
        slots_out[i] = slot;
    }
}

// Step 2 of 3: entry i, when it won its slot, sets masses[slot] = p ** alpha (0 for p == 0) and
// counts in prio_status[0]; a priority that is negative, NaN or infinite is never applied (its
// slot keeps its mass) and is counted in prio_status[1], held or not. alpha < 0: check and count
// only (the uniform selector: masses stay 1). slots_out[i] ends -1 for every entry that changed
// no mass, so step 3, chunk_sums(masses, slots_out), re-sums only the changed chunks.
#define GF_DEFINE_APPLY_UPDATES(NAME, P)                                                    \
    extern "C" __global__ void __launch_bounds__(GF_THREADS)                               \
    NAME(const gf_replay* __restrict__ st, i64* __restrict__ slots, const P* __restrict__ priorities, \
         i64 K, unsigned long long tag, double alpha)                                      \
    {                                                                                      \
        for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < K;                    \
             i += (i64)gridDim.x * blockDim.x) {                                           \
            const double p = (double)priorities[i];                                        \
            const i64 s = slots[i];                                                        \
            if (!(p >= 0.0 && p <= GF_DBL_MAX)) { /* false for NaN and inf */              \
                atomicAdd(&st->prio_status[1], 1ULL);                                      \
                slots[i] = -1;                                                             \
                continue;                                                                  \
            }                                                                              \
            if (s < 0) continue;                                                           \
            if (st->winner[s] != (tag | (unsigned long long)i) || alpha < 0.0) {           \
                slots[i] = -1;                                                             \
                if (alpha < 0.0 && st->winner[s] == (tag | (unsigned long long)i))         \
                    atomicAdd(&st->prio_status[0], 1ULL);                                  \
                continue;                                                                  \
            }                                                                              \
            st->masses[s] = p > 0.0 ? pow(p, alpha) : 0.0;                                 \
            atomicAdd(&st->prio_status[0], 1ULL);                                          \
        }                                                                                  \
    }

GF_DEFINE_APPLY_UPDATES(apply_updates_f64, double)
GF_DEFINE_APPLY_UPDATES(apply_updates_f32, float)

// Ingest and eviction as the table reported them, de-duplicated on the host (one entry per slot,
// its last): entries is int64 [6, count] in mapped host memory (read in place, no copy), rows
// slot, raw priority (float64 bits), start, seq, length, live (1: ingested, 0: evicted). An
// ingested slot gets masses = p ** alpha (0 for p == 0; alpha < 0: 1, the uniform selector),
// live = 1 and its record; an evicted one masses = live = 0 (its record stays until the slot is
// reused). Then chunk_sums over the entries' slots (row 0) for masses and for live.
extern "C" __global__ void __launch_bounds__(GF_THREADS)
apply_ingest(const gf_replay* __restrict__ st, const i64* __restrict__ entries, i64 count, double alpha)
{
    for (i64 j = (i64)blockIdx.x * blockDim.x + threadIdx.x; j < count; j += (i64)gridDim.x * blockDim.x) {
        const i64 s = entries[j];
        if (s < 0 || s >= st->N) continue;
        if (entries[5 * count + j] != 0) {
            const double p = __longlong_as_double(entries[count + j]);
            st->masses[s] = alpha < 0.0 ? 1.0 : (p > 0.0 ? pow(p, alpha) : 0.0);
            st->live[s] = 1.0;
            st->start[s] = entries[2 * count + j];
            st->seq[s] = entries[3 * count + j];
            st->length[s] = (int)entries[4 * count + j];
        } else {
            st->masses[s] = 0.0;
            st->live[s] = 0.0;
        }
    }
}

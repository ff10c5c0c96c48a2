// One CTA per piece: a piece is one span (or one slice of a long span) of a batched copy.
//
// Why a kernel at all: on one GPU the copy engines moved whole 4.5 MB rows at about 800 GB/s,
// while SMs reach the card's ~2 TB/s copy rate; and 95,343 small spans cost the driver far
// more per descriptor than one launch over a table. The host splits long spans into pieces
// of at most a fixed size, so no thread ever searches for its span.
//
// table layout (uint64, n pieces): dst[n], src[n], len[n].
// gate: a post's Gate in device memory (0: none). The host closes the post's word of pinned
// host memory when the post missed its deadline; a copy then writes no piece it had not begun
// (kvxfer/cuda/copy.py, Copier.fence). Why a watcher: reads of host memory from the GPU are
// served about one at a time (~1 us each, measured on an H100), so when every CTA read the host
// word before each piece, the copy ran at 4-16 GB/s instead of ~1,400. Now block 0 of a gated
// launch is the watcher: one thread reads the host word and mirrors it into the Gate, and the
// other blocks read the mirror, an L2 hit.
// kvxfer_copy_few takes up to FEW spans by value (no table to upload: the fixed cost of a
// one-block post is one launch); kvxfer_mm8 hashes what it reads (and copies it when dst is
// set) with kvxfer.integrity's mm8 definition, so a verified copy reads its bytes once.
// Regenerate the embedded PTX after editing: python -m kvxfer.cuda._build

#define THREADS 512
#define UNROLL 4

#define FEW 16

// host: the device address of the host's word; state: 0 before the watcher's first reading of
// it, then 1 (open) or 2 (closed); finished: worker blocks done. The watcher puts state and
// finished back to 0 once every worker is done, so the next launch on this gate starts afresh
// (launches on one gate are serialized: one stream, and the gate's event is recycled only once
// the launch has ended).
struct Gate {
    unsigned long long host, state, finished;
};

#define WAIT_FOR_WATCHER_NS 50000ull

__device__ __forceinline__ unsigned long long now_ns()
{
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

// The watcher (block 0, thread 0): reads the host's word until it closes, publishing each
// reading, and waits for the workers before resetting the gate.
__device__ void watch(Gate* g, unsigned long long workers)
{
    if (threadIdx.x) return;
    volatile Gate* v = g;
    const volatile unsigned long long* host = (const volatile unsigned long long*)v->host;
    unsigned long long state = 1;
    for (;;) {
        if (state == 1 && *host) state = 2;
        v->state = state;
        __threadfence();
        if (v->finished >= workers) break;
        __nanosleep(500);
    }
    v->state = 0;
    v->finished = 0;
    __threadfence();
}

// True once the post's gate is closed. A worker that starts before the watcher's first
// reading waits for it (a post closed before it runs moves nothing); if the watcher is not
// running after WAIT_FOR_WATCHER_NS (it could not be scheduled), the worker reads the host's
// word itself: slower, never wrong, never a hang.
__device__ __forceinline__ bool closed(const Gate* g)
{
    if (!g) return false;
    const volatile Gate* v = g;
    unsigned long long state = v->state;
    if (state) return state == 2;
    const unsigned long long t0 = now_ns();
    while (!(state = v->state)) {
        if (now_ns() - t0 > WAIT_FOR_WATCHER_NS) return *(const volatile unsigned long long*)v->host != 0;
        __nanosleep(200);
    }
    return state == 2;
}

// A worker block is done with the gate: counted once all its threads are past their last read.
__device__ __forceinline__ void leave(Gate* g)
{
    if (!g) return;
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
        atomicAdd(&g->finished, 1ull);
    }
}

// Copy one piece with the whole CTA: head bytes to 16-byte alignment, vectors, then the tail.
__device__ __forceinline__ void copy_piece(unsigned char* d, const unsigned char* s, unsigned long long len)
{
    if (((unsigned long long)d ^ (unsigned long long)s) & 15ull) {
        // Source and destination disagree modulo 16: no vector access can serve both.
        for (unsigned long long i = threadIdx.x; i < len; i += blockDim.x) d[i] = s[i];
        return;
    }
    unsigned long long head = (16ull - ((unsigned long long)d & 15ull)) & 15ull;
    if (head > len) head = len;
    if (threadIdx.x < head) d[threadIdx.x] = s[threadIdx.x];
    unsigned long long body = (len - head) >> 4;
    uint4* dv = (uint4*)(d + head);
    const uint4* sv = (const uint4*)(s + head);
    unsigned long long i = threadIdx.x;
    for (; i + (UNROLL - 1) * THREADS < body; i += UNROLL * THREADS) {
        uint4 r[UNROLL];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) r[u] = sv[i + u * THREADS];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) dv[i + u * THREADS] = r[u];
    }
    for (; i < body; i += THREADS) dv[i] = sv[i];
    unsigned long long done = head + (body << 4);
    unsigned long long tail = len - done;
    if (threadIdx.x < tail) d[done + threadIdx.x] = s[done + threadIdx.x];
}

extern "C" __global__ void __launch_bounds__(THREADS)
kvxfer_batch_copy(const unsigned long long* __restrict__ table, unsigned long long n, Gate* gate)
{
    const unsigned w = gate ? 1u : 0u;  // a gated launch has one more block: the watcher
    if (blockIdx.x < w) return watch(gate, gridDim.x - w);
    for (unsigned long long p = blockIdx.x - w; p < n; p += gridDim.x - w) {
        if (closed(gate)) break;
        copy_piece((unsigned char*)table[p], (const unsigned char*)table[n + p], table[2 * n + p]);
    }
    leave(gate);
}

// A few spans by value. Span i owns pieces first[i] .. first[i+1]-1 of `piece` bytes each.
struct Few {
    unsigned long long n, piece, first[FEW + 1], dst[FEW], src[FEW], len[FEW];
    Gate* gate;
};

extern "C" __global__ void __launch_bounds__(THREADS)
kvxfer_copy_few(const __grid_constant__ Few f)
{
    const unsigned w = f.gate ? 1u : 0u;
    if (blockIdx.x < w) return watch(f.gate, gridDim.x - w);
    for (unsigned long long p = blockIdx.x - w; p < f.first[f.n]; p += gridDim.x - w) {
        if (closed(f.gate)) break;
        unsigned long long i = 0;
        while (i + 1 < f.n && f.first[i + 1] <= p) ++i;
        unsigned long long off = (p - f.first[i]) * f.piece;
        unsigned long long len = f.len[i] - off;
        if (len > f.piece) len = f.piece;
        copy_piece((unsigned char*)(f.dst[i] + off), (const unsigned char*)(f.src[i] + off), len);
    }
    leave(f.gate);
}

// mm8 (kvxfer/integrity/mm8.py): a cell is cut in 1024-byte chunks (the last zero-padded), chunk
// s gives y[s] = int8(chunk) . K (8 int32), and the cell's sum is sum_s sum_j y[s][j] * R[s][j]
// modulo 2^64; the host then mixes it with the length. The sum is linear, so CTAs add their
// parts with one atomic each. Table (uint64, n pieces): dst, src, len, meta = s0 << 32 | cell;
// a piece starts s0 chunks into its cell, 16-byte aligned (the host checks). dst 0: hash only.
#define DTHREADS 256
#define CHUNK 1024

// The 16 bytes at `off` of a piece of `len` bytes (zeros past its end). Loads and stores are
// separate so that a copying kernel issues all its loads before it stores any: a store right
// after its own load waits for that load, and the next load waits behind the store (the
// compiler keeps the order, since source and destination may alias), which had made the
// copying mm8 latency-bound at half the speed of the one that only hashes.
__device__ __forceinline__ uint4 load16(const unsigned char* s, unsigned long long off, unsigned long long len)
{
    uint4 v = make_uint4(0, 0, 0, 0);
    if (off + 16 <= len) {
        v = *(const uint4*)(s + off);
    } else if (off < len) {
        unsigned b[16];
#pragma unroll
        for (int i = 0; i < 16; ++i) b[i] = off + i < len ? s[off + i] : 0;
        v.x = b[0] | b[1] << 8 | b[2] << 16 | b[3] << 24;
        v.y = b[4] | b[5] << 8 | b[6] << 16 | b[7] << 24;
        v.z = b[8] | b[9] << 8 | b[10] << 16 | b[11] << 24;
        v.w = b[12] | b[13] << 8 | b[14] << 16 | b[15] << 24;
    }
    return v;
}

// Store what load16 gave for the same `off` (nothing past the piece's end).
__device__ __forceinline__ void store16(unsigned char* d, unsigned long long off, unsigned long long len, uint4 v)
{
    if (off + 16 <= len) {
        *(uint4*)(d + off) = v;
    } else if (off < len) {
        const unsigned w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (int i = 0; i < 16; ++i)
            if (off + i < len) d[off + i] = (unsigned char)(w[i >> 2] >> (8 * (i & 3)));
    }
}

// This thread's share of chunk c's weighted sketch: sum_j (16 bytes . K[.., j]) * R[c][j].
__device__ __forceinline__ unsigned long long sketch16(uint4 v, const int (&k)[8][4], const long long* rw)
{
    unsigned long long acc = 0;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
        int y = __dp4a((int)v.x, k[j][0], 0);
        y = __dp4a((int)v.y, k[j][1], y);
        y = __dp4a((int)v.z, k[j][2], y);
        y = __dp4a((int)v.w, k[j][3], y);
        acc += (unsigned long long)((long long)y * rw[j]);
    }
    return acc;
}

extern "C" __global__ void __launch_bounds__(DTHREADS)
kvxfer_mm8(const unsigned long long* __restrict__ table, unsigned long long n,
           const unsigned int* __restrict__ kp, const long long* __restrict__ r,
           unsigned long long* __restrict__ out)
{
    const unsigned lane = threadIdx.x & 63u;  // the 16 bytes this thread owns in every chunk
    const unsigned sub = threadIdx.x >> 6;    // which of the 4 chunks of a sweep
    int k[8][4];
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
        for (int w = 0; w < 4; ++w) k[j][w] = (int)kp[j * 256 + lane * 4 + w];
    __shared__ unsigned long long part[DTHREADS / 32];
    for (unsigned long long p = blockIdx.x; p < n; p += gridDim.x) {
        unsigned char* d = (unsigned char*)table[p];
        const unsigned char* s = (const unsigned char*)table[n + p];
        const unsigned long long len = table[2 * n + p], meta = table[3 * n + p];
        const long long* rw0 = r + (meta >> 32) * 8;
        unsigned long long acc = 0;
        // Two chunks in flight per thread: both loads are issued before either is hashed.
        for (unsigned long long c = sub; c * CHUNK < len; c += 8) {
            const uint4 v0 = load16(s, c * CHUNK + lane * 16, len);
            const uint4 v1 = load16(s, (c + 4) * CHUNK + lane * 16, len);
            if (d) {
                store16(d, c * CHUNK + lane * 16, len, v0);
                store16(d, (c + 4) * CHUNK + lane * 16, len, v1);
            }
            acc += sketch16(v0, k, rw0 + c * 8);
            if ((c + 4) * CHUNK < len) acc += sketch16(v1, k, rw0 + (c + 4) * 8);
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
        if ((threadIdx.x & 31u) == 0) part[threadIdx.x >> 5] = acc;
        __syncthreads();
        if (threadIdx.x == 0) {
            unsigned long long t = 0;
            for (int w = 0; w < DTHREADS / 32; ++w) t += part[w];
            atomicAdd(out + (meta & 0xffffffffull), t);
        }
        __syncthreads();
    }
}

// mm8 on the tensor cores (sm_80+), copying what it hashes when dst is set: the same sums as
// kvxfer_mm8, at the copy's pace instead of a third of it (a __dp4a and a 64-bit product per
// 16 bytes made kvxfer_mm8 compute-bound at 640-670 GB/s on an H200).
//
// A tile is 16 chunks (rows) of a piece. Warp w owns the 64-byte column slices w and w + 8 of
// every chunk; lane (g = lane >> 2, t = lane & 3) loads 16 bytes at t * 16 of its slices in
// rows g and g + 8, and feeds them as the A fragments of two mma.m16n8k32 (s8): the 16 bytes
// x, y, z, w of a row go to (a0 | a1, a2 | a3) as (x, y) and (z, w). Which byte meets which
// sketch entry is fixed by the B fragments, packed on the host (kvxfer/cuda/_mm8_model.py,
// pack_b: bp[slice][lane][4], word k = sketch bytes slice*64 + t*16 + 4k .. +3 of column g).
// The int32 products of one chunk are exact (< 2^24); each lane weights its 4 results (rows
// g, g + 8; columns 2t, 2t + 1) by R[s0 + chunk][col] modulo 2^64, and the block adds its
// lanes' sums into the cell with one atomic, as kvxfer_mm8 does.
#define TILE 16

__device__ __forceinline__ void mma8(int (&c)[4], unsigned a0, unsigned a1, unsigned a2, unsigned a3,
                                     unsigned b0, unsigned b1)
{
    asm volatile("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};\n"
                 : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

extern "C" __global__ void __launch_bounds__(DTHREADS)
kvxfer_mm8_tc(const unsigned long long* __restrict__ table, unsigned long long n,
              const unsigned int* __restrict__ bp, const long long* __restrict__ r,
              unsigned long long* __restrict__ out, Gate* gate)
{
    const unsigned wb = gate ? 1u : 0u;
    if (blockIdx.x < wb) return watch(gate, gridDim.x - wb);
    const unsigned lane = threadIdx.x & 31u, warp = threadIdx.x >> 5;
    const unsigned g = lane >> 2, t = lane & 3u;
    unsigned b[2][4];
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int k = 0; k < 4; ++k) b[h][k] = bp[((warp + 8 * h) * 32 + lane) * 4 + k];
    __shared__ unsigned long long part[DTHREADS / 32];
    __shared__ int stop;
    for (unsigned long long p = blockIdx.x - wb; p < n; p += gridDim.x - wb) {
        if (threadIdx.x == 0) stop = closed(gate);
        __syncthreads();
        if (stop) break;  // the whole block: the gate was read once for it
        unsigned char* d = (unsigned char*)table[p];
        const unsigned char* s = (const unsigned char*)table[n + p];
        const unsigned long long len = table[2 * n + p], meta = table[3 * n + p];
        const long long* rw = r + (meta >> 32) * 8;
        const unsigned long long chunks = (len + CHUNK - 1) / CHUNK;
        unsigned long long acc = 0;
        // Tile c + TILE is loaded while tile c is stored and hashed (two tiles in flight).
        uint4 next[2][2];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const unsigned long long off = (warp + 8 * h) * 64 + t * 16;
            next[h][0] = load16(s, g * CHUNK + off, len);
            next[h][1] = load16(s, (g + 8) * CHUNK + off, len);
        }
        for (unsigned long long c = 0; c < chunks; c += TILE) {
            uint4 v[2][2];
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                v[h][0] = next[h][0];
                v[h][1] = next[h][1];
            }
            if (c + TILE < chunks) {
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const unsigned long long off = (warp + 8 * h) * 64 + t * 16;
                    next[h][0] = load16(s, (c + TILE + g) * CHUNK + off, len);
                    next[h][1] = load16(s, (c + TILE + g + 8) * CHUNK + off, len);
                }
            }
            if (d) {
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const unsigned long long off = (warp + 8 * h) * 64 + t * 16;
                    store16(d, (c + g) * CHUNK + off, len, v[h][0]);
                    store16(d, (c + g + 8) * CHUNK + off, len, v[h][1]);
                }
            }
            int y[4] = {0, 0, 0, 0};
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                mma8(y, v[h][0].x, v[h][1].x, v[h][0].y, v[h][1].y, b[h][0], b[h][1]);
                mma8(y, v[h][0].z, v[h][1].z, v[h][0].w, v[h][1].w, b[h][2], b[h][3]);
            }
            if (c + g < chunks) {
                const long long* w = rw + (c + g) * 8 + 2 * t;
                acc += (unsigned long long)((long long)y[0] * w[0]) + (unsigned long long)((long long)y[1] * w[1]);
            }
            if (c + g + 8 < chunks) {
                const long long* w = rw + (c + g + 8) * 8 + 2 * t;
                acc += (unsigned long long)((long long)y[2] * w[0]) + (unsigned long long)((long long)y[3] * w[1]);
            }
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
        if (lane == 0) part[warp] = acc;
        __syncthreads();
        if (threadIdx.x == 0) {
            unsigned long long tot = 0;
            for (int w = 0; w < DTHREADS / 32; ++w) tot += part[w];
            atomicAdd(out + (meta & 0xffffffffull), tot);
        }
        __syncthreads();
    }
    leave(gate);
}

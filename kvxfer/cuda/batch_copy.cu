// One CTA per piece: a piece is one span (or one slice of a long span) of a batched copy.
//
// Why a kernel at all: on one GPU the copy engines moved whole 4.5 MB rows at about 800 GB/s,
// while SMs reach the card's ~2 TB/s copy rate; and 95,343 small spans cost the driver far
// more per descriptor than one launch over a table. The host splits long spans into pieces
// of at most a fixed size, so no thread ever searches for its span.
//
// table layout (uint64, n pieces): dst[n], src[n], len[n].
// Regenerate the embedded PTX after editing: python -m kvxfer.cuda._build

#define THREADS 512
#define UNROLL 4

extern "C" __global__ void __launch_bounds__(THREADS)
kvxfer_batch_copy(const unsigned long long* __restrict__ table, unsigned long long n)
{
    for (unsigned long long p = blockIdx.x; p < n; p += gridDim.x) {
        unsigned char* d = (unsigned char*)table[p];
        const unsigned char* s = (const unsigned char*)table[n + p];
        unsigned long long len = table[2 * n + p];
        if (((unsigned long long)d ^ (unsigned long long)s) & 15ull) {
            // Source and destination disagree modulo 16: no vector access can serve both.
            for (unsigned long long i = threadIdx.x; i < len; i += THREADS) d[i] = s[i];
            continue;
        }
        // Head bytes up to 16-byte alignment, then 16-byte vectors, then the tail.
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
}

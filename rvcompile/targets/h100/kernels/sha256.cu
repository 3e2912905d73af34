// SHA-256 (FIPS 180-4, standard padding) of many pieces of device memory, one thread per piece:
// piece i is bytes [i * piece_size, min((i + 1) * piece_size, total)) of data (the last piece may
// be shorter, even empty when total is 0 and count 1); its 32-byte digest goes to digests + 32 i,
// as hashlib.sha256 gives it. The runtime runs it over a weights section once uploaded, before
// anything else runs on those bytes (runtime/executors/device_hash.py); pieces are independent,
// SHA-256 is sequential within one, hence a thread per piece. Grid (ceil(count / THREADS)).
// A thread whose piece starts 16-byte aligned reads it in 16-byte loads, the next 64-byte block
// loaded while the current one is compressed (few threads per SM: latency, not bandwidth, is what
// a thread waits on); otherwise, and for the tail (< 64 bytes), byte loads.
#include "common.cuh"

namespace {
constexpr int THREADS = 64;  // artifacts/piece_hash.py THREADS: the runtime's block

__constant__ uint32_t K256[64] = {
    0x428a2f98u, 0x71374491u, 0xb5c0fbcfu, 0xe9b5dba5u, 0x3956c25bu, 0x59f111f1u, 0x923f82a4u,
    0xab1c5ed5u, 0xd807aa98u, 0x12835b01u, 0x243185beu, 0x550c7dc3u, 0x72be5d74u, 0x80deb1feu,
    0x9bdc06a7u, 0xc19bf174u, 0xe49b69c1u, 0xefbe4786u, 0x0fc19dc6u, 0x240ca1ccu, 0x2de92c6fu,
    0x4a7484aau, 0x5cb0a9dcu, 0x76f988dau, 0x983e5152u, 0xa831c66du, 0xb00327c8u, 0xbf597fc7u,
    0xc6e00bf3u, 0xd5a79147u, 0x06ca6351u, 0x14292967u, 0x27b70a85u, 0x2e1b2138u, 0x4d2c6dfcu,
    0x53380d13u, 0x650a7354u, 0x766a0abbu, 0x81c2c92eu, 0x92722c85u, 0xa2bfe8a1u, 0xa81a664bu,
    0xc24b8b70u, 0xc76c51a3u, 0xd192e819u, 0xd6990624u, 0xf40e3585u, 0x106aa070u, 0x19a4c116u,
    0x1e376c08u, 0x2748774cu, 0x34b0bcb5u, 0x391c0cb3u, 0x4ed8aa4au, 0x5b9cca4fu, 0x682e6ff3u,
    0x748f82eeu, 0x78a5636fu, 0x84c87814u, 0x8cc70208u, 0x90befffau, 0xa4506cebu, 0xbef9a3f7u,
    0xc67178f2u};

__device__ __forceinline__ uint32_t rotr(uint32_t x, int n) { return __funnelshift_r(x, x, n); }

// big-endian word from 4 bytes read as a little-endian uint32
__device__ __forceinline__ uint32_t bswap(uint32_t x) { return __byte_perm(x, 0, 0x0123); }

// One 64-byte block w[0..15] (big-endian words) into the state h.
__device__ __forceinline__ void compress(uint32_t h[8], uint32_t w[16]) {
    uint32_t a = h[0], b = h[1], c = h[2], d = h[3], e = h[4], f = h[5], g = h[6], k = h[7];
#pragma unroll
    for (int t = 0; t < 64; ++t) {
        if (t >= 16) {  // the message schedule, rolling over 16 words
            const uint32_t w15 = w[(t - 15) & 15], w2 = w[(t - 2) & 15];
            const uint32_t s0 = rotr(w15, 7) ^ rotr(w15, 18) ^ (w15 >> 3);
            const uint32_t s1 = rotr(w2, 17) ^ rotr(w2, 19) ^ (w2 >> 10);
            w[t & 15] += s0 + w[(t - 7) & 15] + s1;
        }
        const uint32_t t1 = k + (rotr(e, 6) ^ rotr(e, 11) ^ rotr(e, 25)) + ((e & f) ^ (~e & g)) +
                            K256[t] + w[t & 15];
        const uint32_t t2 = (rotr(a, 2) ^ rotr(a, 13) ^ rotr(a, 22)) + ((a & b) ^ (a & c) ^ (b & c));
        k = g; g = f; f = e; e = d + t1;
        d = c; c = b; b = a; a = t1 + t2;
    }
    h[0] += a; h[1] += b; h[2] += c; h[3] += d; h[4] += e; h[5] += f; h[6] += g; h[7] += k;
}

__device__ __forceinline__ void words_from(const uint4 q[4], uint32_t w[16]) {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        w[4 * j] = bswap(q[j].x); w[4 * j + 1] = bswap(q[j].y);
        w[4 * j + 2] = bswap(q[j].z); w[4 * j + 3] = bswap(q[j].w);
    }
}

__device__ __forceinline__ void load_block(const uint4* p, uint4 q[4]) {
#pragma unroll
    for (int j = 0; j < 4; ++j) q[j] = __ldg(p + j);
}
}  // namespace

extern "C" __global__ void __launch_bounds__(THREADS)
sha256_pieces(const uint8_t* __restrict__ data, long long piece_size, long long total, int count,
              uint8_t* __restrict__ digests) {
    pdl_wait();
    pdl_launch_dependents();
    const int i = blockIdx.x * THREADS + threadIdx.x;
    if (i >= count) return;
    const long long start = (long long)i * piece_size;
    const long long len = start < total ? min(piece_size, total - start) : 0;
    const uint8_t* p = data + start;
    uint32_t h[8] = {0x6a09e667u, 0xbb67ae85u, 0x3c6ef372u, 0xa54ff53au,
                     0x510e527fu, 0x9b05688cu, 0x1f83d9abu, 0x5be0cd19u};
    uint32_t w[16];
    const long long blocks = len / 64;
    if ((reinterpret_cast<uintptr_t>(p) & 15) == 0) {
        const uint4* v = reinterpret_cast<const uint4*>(p);
        uint4 next[4];
        if (blocks > 0) load_block(v, next);
        for (long long b = 0; b < blocks; ++b) {
            words_from(next, w);
            if (b + 1 < blocks) load_block(v + 4 * (b + 1), next);  // in flight while compressing
            compress(h, w);
        }
    } else {
        for (long long b = 0; b < blocks; ++b) {
            const uint8_t* q = p + 64 * b;
#pragma unroll
            for (int j = 0; j < 16; ++j)
                w[j] = (uint32_t)q[4 * j] << 24 | (uint32_t)q[4 * j + 1] << 16 |
                       (uint32_t)q[4 * j + 2] << 8 | (uint32_t)q[4 * j + 3];
            compress(h, w);
        }
    }
    // the tail: r < 64 bytes, 0x80, zeros, the length in bits (64-bit big-endian); two blocks
    // when the tail leaves fewer than 8 bytes for the length (r >= 56). An array of its own: its
    // bytes land at indices known only at run time, which would put the main loop's w in local
    // memory too.
    const int r = (int)(len - 64 * blocks);
    const uint8_t* q = p + 64 * blocks;
    uint32_t tail[16];
#pragma unroll
    for (int j = 0; j < 16; ++j) tail[j] = 0;
    for (int j = 0; j < r; ++j) tail[j >> 2] |= (uint32_t)q[j] << (24 - 8 * (j & 3));
    tail[r >> 2] |= 0x80u << (24 - 8 * (r & 3));
    if (r >= 56) {
        compress(h, tail);
#pragma unroll
        for (int j = 0; j < 16; ++j) tail[j] = 0;
    }
    const unsigned long long bits = (unsigned long long)len * 8;
    tail[14] = (uint32_t)(bits >> 32);
    tail[15] = (uint32_t)bits;
    compress(h, tail);
    uint4* out = reinterpret_cast<uint4*>(digests + 32 * (size_t)i);
    out[0] = make_uint4(bswap(h[0]), bswap(h[1]), bswap(h[2]), bswap(h[3]));
    out[1] = make_uint4(bswap(h[4]), bswap(h[5]), bswap(h[6]), bswap(h[7]));
}

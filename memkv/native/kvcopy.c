/* memkv's copies between its blocks and an engine's paged KV cache, on the CPU.
 *
 * A load or a save moves slabs (one layer of one block, ~128 KiB for Llama-3-8B)
 * made of chunks that change place on the way (memkv's [2, H, N, D] against the
 * paged cache's [H, 2, N, D], ...). Copying the chunks here, not with one numpy
 * call per slab, saves the interpreter's work per slab (a 4096-token load is 4,064
 * slabs); non-temporal stores save the destination's read-for-ownership (the
 * bytes are not read again by this core soon: measured 90 -> 70 ms per 512 MiB on
 * one core). The slab's CRC32 is computed here too, over bytes in cache, by the
 * function the caller passes (ISA-L's crc32_gzip_refl: zlib's polynomial and values).
 *
 * Plain C with SSE2 on x86-64 (the baseline of every x86-64 CPU), memcpy elsewhere.
 */
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#if defined(__x86_64__)
#include <emmintrin.h>
#include <xmmintrin.h>
#endif

typedef uint32_t (*memkv_crc_fn)(uint32_t crc, const unsigned char *buf, uint64_t len);

enum { MEMKV_CRC_NONE = 0, MEMKV_CRC_SOURCE_SLAB = 1, MEMKV_CRC_CHUNKS = 2 };

static void copy_stream(unsigned char *dst, const unsigned char *src, size_t n)
{
#if defined(__x86_64__)
    if (((uintptr_t)dst & 15) == 0 && (n & 63) == 0) {
        for (size_t i = 0; i < n; i += 64) {
            _mm_prefetch((const char *)(src + i + 1024), _MM_HINT_T0); /* the source streams */
            __m128i a = _mm_loadu_si128((const __m128i *)(src + i));
            __m128i b = _mm_loadu_si128((const __m128i *)(src + i + 16));
            __m128i c = _mm_loadu_si128((const __m128i *)(src + i + 32));
            __m128i d = _mm_loadu_si128((const __m128i *)(src + i + 48));
            _mm_stream_si128((__m128i *)(dst + i), a);
            _mm_stream_si128((__m128i *)(dst + i + 16), b);
            _mm_stream_si128((__m128i *)(dst + i + 32), c);
            _mm_stream_si128((__m128i *)(dst + i + 48), d);
        }
        return;
    }
#endif
    memcpy(dst, src, n);
}

/* For each slab s of n: chunk i (of nchunks, chunk bytes each) goes from
 * src[s] + src_off[i] to dst[s] + dst_off[i].
 *
 * crc_mode MEMKV_CRC_SOURCE_SLAB: crcs[s] continues over the source slab's
 * nchunks * chunk contiguous bytes, after its copy (they are in cache then).
 * MEMKV_CRC_CHUNKS: crcs[s] continues over each chunk in the order of i, right
 * after it is copied (for a destination that is contiguous in that order).
 */
void memkv_copy_slabs(size_t n, const uint64_t *src, const uint64_t *dst, uint32_t *crcs,
                      size_t nchunks, size_t chunk, const int64_t *src_off,
                      const int64_t *dst_off, memkv_crc_fn crc, int crc_mode)
{
    for (size_t s = 0; s < n; s++) {
        const unsigned char *a = (const unsigned char *)(uintptr_t)src[s];
        unsigned char *b = (unsigned char *)(uintptr_t)dst[s];
        uint32_t c = crc_mode != MEMKV_CRC_NONE ? crcs[s] : 0;
        for (size_t i = 0; i < nchunks; i++) {
            const unsigned char *from = a + src_off[i];
            copy_stream(b + dst_off[i], from, chunk);
            if (crc_mode == MEMKV_CRC_CHUNKS)
                c = crc(c, from, chunk);
        }
        if (crc_mode == MEMKV_CRC_SOURCE_SLAB)
            c = crc(c, a, nchunks * chunk);
        if (crc_mode != MEMKV_CRC_NONE)
            crcs[s] = c;
    }
#if defined(__x86_64__)
    _mm_sfence(); /* the streamed stores are visible before the caller goes on */
#endif
}

/* How fast this machine reads memory in blocks of a given size, visited in random order: the
 * access pattern of paged decode attention (a block's K rows are contiguous, the next block is
 * anywhere in the pool), without its arithmetic: one float of every 64-byte line is read, which
 * brings the whole line from memory. Reads ~1 GiB with every thread, 4 times.
 *
 *     cc -O3 -march=native -fopenmp benchmarks/kernels/block_read.c -o /tmp/block_read
 *     OMP_NUM_THREADS=2 /tmp/block_read 6144     # K of one block of 16 tokens, 3 KV heads x 64
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

static double now(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

int main(int argc, char **argv)
{
    const size_t block = argc > 1 ? (size_t)atol(argv[1]) : 6144, total = (size_t)1 << 30;
    if (block < 64 || block % 64 || block > total) {
        fprintf(stderr, "block size: a multiple of 64 bytes, at most 1 GiB\n");
        return 2;
    }
    const size_t blocks = total / block;
    char *buf = aligned_alloc(4096, total);
    int64_t *order = malloc(blocks * sizeof *order);
    if (buf == NULL || order == NULL)
        return 1;
    for (size_t i = 0; i < total; i += 4096)
        buf[i] = 1; /* fault every page in before timing */
    for (size_t i = 0; i < blocks; i++)
        order[i] = (int64_t)i;
    srand(1);
    for (size_t i = blocks - 1; i > 0; i--) {
        const size_t j = (size_t)rand() % (i + 1);
        const int64_t t = order[i];
        order[i] = order[j];
        order[j] = t;
    }
    for (int rep = 0; rep < 4; rep++) {
        const double t0 = now();
        float sink = 0;
#pragma omp parallel reduction(+ : sink)
        {
#pragma omp for schedule(static)
            for (size_t b = 0; b < blocks; b++)
                for (size_t o = 0; o < block; o += 64)
                    sink += *(const float *)(buf + order[b] * block + o);
        }
        printf("blocks of %zu bytes: %.1f GB/s%s\n", block, blocks * block / (now() - t0) / 1e9,
               sink == 12345.0f ? " " : "");
    }
    return 0;
}

// bench_tokenizer.c -- encoding speed of tokenizer.c on one core (not a test; prints a number to compare).
//
//   cc -O2 -std=c11 -Wall -Wextra -I. dev/bench_tokenizer.c tokenizer.c -o bench_tokenizer
//   python3 -c "import export; open('/tmp/tok.bin','wb').write(export.tokenizer_blob('test/data/tokenizer'))"
//   ./bench_tokenizer /tmp/tok.bin SOME_1MB_SOURCE_FILE [reps]
//
// Encodes the whole file in one tokenizer_encode call, `reps` times, and reports the best run in tokens/s and
// MB/s, plus decoding speed. Token counts depend on the vocabulary: the synthetic 4k test vocab makes ~2x more
// (shorter) tokens per byte than Laguna's 100k one, so compare MB/s across vocabularies.
#define _POSIX_C_SOURCE 199309L
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "tokenizer.h"

static unsigned char *read_file(const char *path, size_t *n) {
    FILE *f = fopen(path, "rb");
    if (!f) { fprintf(stderr, "cannot open %s\n", path); exit(1); }
    fseek(f, 0, SEEK_END);
    long size = ftell(f);
    fseek(f, 0, SEEK_SET);
    unsigned char *buf = malloc((size_t)size + 1);
    if (!buf || fread(buf, 1, (size_t)size, f) != (size_t)size) { fprintf(stderr, "cannot read %s\n", path); exit(1); }
    fclose(f);
    *n = (size_t)size;
    return buf;
}

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

int main(int argc, char **argv) {
    if (argc < 3) { fprintf(stderr, "usage: %s TOKENIZER_BLOB TEXT_FILE [reps=5]\n", argv[0]); return 1; }
    int reps = argc > 3 ? atoi(argv[3]) : 5;
    size_t nblob, ntext;
    unsigned char *blob = read_file(argv[1], &nblob);
    char *text = (char *)read_file(argv[2], &ntext);
    Tokenizer t;
    char err[512];
    if (tokenizer_init(&t, blob, nblob, err, sizeof(err)) != 0) { fprintf(stderr, "%s\n", err); return 1; }
    double best = 1e30;
    int n = 0, *ids = NULL;
    for (int r = 0; r < reps; r++) {
        free(ids);
        double t0 = now();
        if (tokenizer_encode(&t, text, ntext, &ids, &n, err, sizeof(err)) != 0) { fprintf(stderr, "%s\n", err); return 1; }
        double dt = now() - t0;
        if (dt < best) best = dt;
    }
    printf("encode: %zu bytes -> %d tokens in %.1f ms: %.2f M tokens/s, %.1f MB/s (best of %d, one core)\n",
           ntext, n, best * 1e3, n / best / 1e6, ntext / best / 1e6, reps);
    double t0 = now();
    size_t len;
    char *back = tokenizer_decode(&t, ids, n, &len);
    double dt = now() - t0;
    printf("decode: %d tokens in %.1f ms: %.1f M tokens/s, round trip %s\n", n, dt * 1e3, n / dt / 1e6,
           len == ntext && memcmp(back, text, len) == 0 ? "exact" : "DIFFERS");
    free(back);
    free(ids);
    free(text);
    free(blob);
    tokenizer_free(&t);
    return 0;
}

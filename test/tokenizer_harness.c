// tokenizer_harness.c -- drives tokenizer.c for test/test_tokenizer.py: many cases per process, so the fuzz
// sweep is fast. Build: cc -O2 -std=c11 -Wall -Wextra -I. test/tokenizer_harness.c tokenizer.c -o harness
//
//   harness BLOB encode CASES   CASES = records {u32 len; bytes}; prints one line per record:
//                               the ids separated by spaces, or "ERR <message>"
//   harness BLOB pieces CASES   like encode, but prints the pre-tokenizer's pieces as "start:end" byte offsets
//   harness BLOB decode CASES   CASES = records {u32 n; i32 ids[n]}; prints the hex of the decoded bytes per
//                               record, after checking that streaming one id at a time gives the same bytes
//   harness BLOB chat CASES     CASES = records {u32 n_msgs, add_generation_prompt, enable_thinking;
//                               n_msgs x (role, content, reasoning) as {u32 len; bytes}, len 0xFFFFFFFF = NULL}
//                               prints the hex of the rendered prompt per record, or "ERR <message>"
//   harness BLOB info           vocab size, bos/eos, a few token ids
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

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

typedef struct { const unsigned char *p, *end; } Cursor;

static uint32_t get_u32(Cursor *c) {
    if (c->end - c->p < 4) { fprintf(stderr, "truncated cases file\n"); exit(1); }
    uint32_t v;
    memcpy(&v, c->p, 4);   // little-endian host assumed (x86/arm)
    c->p += 4;
    return v;
}

// a string field; NULL for len 0xFFFFFFFF. Returns a malloc'd NUL-terminated copy.
static char *get_str(Cursor *c, uint32_t *len_out) {
    uint32_t len = get_u32(c);
    if (len == 0xFFFFFFFFu) return NULL;
    if ((size_t)(c->end - c->p) < len) { fprintf(stderr, "truncated cases file\n"); exit(1); }
    char *s = malloc((size_t)len + 1);
    memcpy(s, c->p, len);
    s[len] = 0;
    c->p += len;
    if (len_out) *len_out = len;
    return s;
}

static void print_hex(const char *s, size_t n) {
    for (size_t i = 0; i < n; i++) printf("%02x", (unsigned char)s[i]);
    printf("\n");
}

int main(int argc, char **argv) {
    if (argc < 3) { fprintf(stderr, "usage: harness BLOB encode|decode|chat|info [CASES]\n"); return 1; }
    size_t nblob, ncases = 0;
    unsigned char *blob = read_file(argv[1], &nblob);
    Tokenizer t;
    char err[512];
    if (tokenizer_init(&t, blob, nblob, err, sizeof(err)) != 0) { printf("ERR %s\n", err); free(blob); return 2; }
    free(blob);   // the tokenizer keeps its own copies
    const char *cmd = argv[2];
    unsigned char *cases = argc > 3 ? read_file(argv[3], &ncases) : NULL;
    Cursor c = {cases, cases + ncases};
    if (strcmp(cmd, "info") == 0) {
        printf("vocab %d bos %d eos %d chat %d eot %d think %d\n", tokenizer_vocab_size(&t), t.bos_id, t.eos_id,
               t.has_chat, tokenizer_token_id(&t, "</assistant>"), tokenizer_token_id(&t, "<think>"));
    } else if (strcmp(cmd, "encode") == 0) {
        while (c.p < c.end) {
            uint32_t len = 0;
            char *s = get_str(&c, &len);
            int *ids, n;
            if (tokenizer_encode(&t, s, len, &ids, &n, err, sizeof(err)) != 0) {
                for (char *q = err; *q; q++) if (*q == '\n') *q = ' ';
                printf("ERR %s\n", err);
            } else {
                for (int i = 0; i < n; i++) printf(i ? " %d" : "%d", ids[i]);
                printf("\n");
                free(ids);
            }
            free(s);
        }
    } else if (strcmp(cmd, "pieces") == 0) {
        while (c.p < c.end) {
            uint32_t len = 0;
            char *s = get_str(&c, &len);
            size_t *b;
            int n;
            if (tokenizer_pretokenize(&t, s, len, &b, &n, err, sizeof(err)) != 0) {
                for (char *q = err; *q; q++) if (*q == '\n') *q = ' ';
                printf("ERR %s\n", err);
            } else {
                for (int i = 0; i < n; i++) printf(i ? " %zu:%zu" : "%zu:%zu", b[2 * i], b[2 * i + 1]);
                printf("\n");
                free(b);
            }
            free(s);
        }
    } else if (strcmp(cmd, "decode") == 0) {
        while (c.p < c.end) {
            uint32_t n = get_u32(&c);
            int *ids = malloc((size_t)n * sizeof(int) + 1);
            for (uint32_t i = 0; i < n; i++) ids[i] = (int)get_u32(&c);
            size_t len;
            char *whole = tokenizer_decode(&t, ids, (int)n, &len);
            // streaming, one id at a time, must give the same bytes and only ever emit whole characters
            TokenDecoder d;
            tokenizer_decoder_init(&d, &t);
            size_t used = 0;
            int ok = 1;
            for (uint32_t i = 0; i <= n && ok; i++) {
                size_t k;
                const char *piece = i < n ? tokenizer_decode_next(&d, ids[i], &k) : tokenizer_decode_flush(&d, &k);
                if (used + k > len || memcmp(whole + used, piece, k) != 0) ok = 0;
                if (k > 0 && ((unsigned char)piece[0] & 0xC0) == 0x80) ok = 0;   // starts mid-character
                used += k;
            }
            tokenizer_decoder_free(&d);
            if (!ok || used != len) printf("STREAM MISMATCH\n");
            else print_hex(whole, len);
            free(whole);
            free(ids);
        }
    } else if (strcmp(cmd, "chat") == 0) {
        while (c.p < c.end) {
            uint32_t n = get_u32(&c), gen = get_u32(&c), think = get_u32(&c);
            ChatMessage *msgs = calloc((size_t)n + 1, sizeof(ChatMessage));
            for (uint32_t i = 0; i < n; i++) {
                msgs[i].role = get_str(&c, NULL);
                msgs[i].content = get_str(&c, NULL);
                msgs[i].reasoning = get_str(&c, NULL);
            }
            char *out = tokenizer_render_chat(&t, msgs, (int)n, (int)gen, (int)think, err, sizeof(err));
            if (!out) {
                for (char *q = err; *q; q++) if (*q == '\n') *q = ' ';
                printf("ERR %s\n", err);
            } else {
                print_hex(out, strlen(out));
                free(out);
            }
            for (uint32_t i = 0; i < n; i++) {
                free((char *)msgs[i].role);
                free((char *)msgs[i].content);
                free((char *)msgs[i].reasoning);
            }
            free(msgs);
        }
    } else {
        fprintf(stderr, "unknown command %s\n", cmd);
        return 1;
    }
    free(cases);
    tokenizer_free(&t);
    return 0;
}

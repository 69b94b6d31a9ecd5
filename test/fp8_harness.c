/* The e4m3 and bf16 rounding helpers of laguna.h for test/test_kv_fp8.py. stdin: fp32 bit patterns, one hex word a
 * line; stdout: first the 256 codes decoded (fp8_e4m3_value, fp32 bits in hex), then per input "code value-bits
 * bf16-bits" where code is fp8_e4m3_bits(x), value fp8_e4m3_round(x) and bf16 bf16_round(x).
 * With the argument "fp16", the q8 / q4 scale helpers for test/test_quant.py: the 65,536 fp16 codes decoded
 * (fp16_value, fp32 bits), then per input fp16_bits(x). */
#include <stdio.h>
#include <string.h>

#include "laguna.h"

static unsigned bits_of(float f) { unsigned u; memcpy(&u, &f, 4); return u; }

int main(int argc, char **argv) {
    unsigned u;
    if (argc > 1 && !strcmp(argv[1], "fp16")) {
        for (unsigned h = 0; h < 65536; h++) printf("%08x\n", bits_of(fp16_value((uint16_t)h)));
        while (scanf("%x", &u) == 1) {
            float f;
            memcpy(&f, &u, 4);
            printf("%04x\n", fp16_bits(f));
        }
        return 0;
    }
    for (int c = 0; c < 256; c++) printf("%08x\n", bits_of(fp8_e4m3_value((uint8_t)c)));
    while (scanf("%x", &u) == 1) {
        float f;
        memcpy(&f, &u, 4);
        printf("%02x %08x %08x\n", fp8_e4m3_bits(f), bits_of(fp8_e4m3_round(f)), bits_of(bf16_round(f)));
    }
    return 0;
}

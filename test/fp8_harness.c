/* The e4m3 and bf16 rounding helpers of laguna.h for test/test_kv_fp8.py. stdin: fp32 bit patterns, one hex word a
 * line; stdout: first the 256 codes decoded (fp8_e4m3_value, fp32 bits in hex), then per input "code value-bits
 * bf16-bits" where code is fp8_e4m3_bits(x), value fp8_e4m3_round(x) and bf16 bf16_round(x). */
#include <stdio.h>
#include <string.h>

#include "laguna.h"

static unsigned bits_of(float f) { unsigned u; memcpy(&u, &f, 4); return u; }

int main(void) {
    for (int c = 0; c < 256; c++) printf("%08x\n", bits_of(fp8_e4m3_value((uint8_t)c)));
    unsigned u;
    while (scanf("%x", &u) == 1) {
        float f;
        memcpy(&f, &u, 4);
        printf("%02x %08x %08x\n", fp8_e4m3_bits(f), bits_of(fp8_e4m3_round(f)), bits_of(bf16_round(f)));
    }
    return 0;
}

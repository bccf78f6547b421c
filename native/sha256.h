/* SHA-256 (FIPS 180-4) and HMAC-SHA256 (RFC 2104), for --detach's signed records. The vector tests
 * (tests/test_supervise_detach.py) drive them through `--sha256` and `--hmac-sha256 KEYHEX`. */
#ifndef DSH_SHA256_H
#define DSH_SHA256_H

#include <stddef.h>

struct sha256 {
    unsigned int h[8];
    unsigned char block[64];
    size_t used;              /* bytes in block[] */
    unsigned long long bytes; /* message length so far */
};

/* HMAC keeps only the two hash states after absorbing K^ipad and K^opad: the key itself is not
 * kept, and each MAC costs the message's blocks plus two. */
struct hmac {
    struct sha256 inner, outer;
};

void wipe(void *p, size_t n);
void sha256_init(struct sha256 *s);
void sha256_update(struct sha256 *s, const void *data, size_t n);
void sha256_final(struct sha256 *s, unsigned char out[32]);
void hmac_init(struct hmac *m, const unsigned char *key, size_t n);
void hmac_hex(const struct hmac *m, const void *data, size_t n, char hex[64]);
int digest_stdin(const char *key_hex);

#endif

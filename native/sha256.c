/* SHA-256 (FIPS 180-4) and HMAC-SHA256 (RFC 2104), for --detach's signed records. */
#include "common.h"
#include "sha256.h"

/* Section 4.2.2: the first 32 bits of the fractional parts of the cube roots of the first 64 primes. */
static const unsigned int sha256_k[64] = {
    0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5,
    0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174,
    0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da,
    0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7, 0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967,
    0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85,
    0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070,
    0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
    0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7, 0xc67178f2,
};


/* Overwrites secret bytes in a way the compiler may not drop as a dead store: explicit_bzero where
 * libc has it (musl, glibc 2.25 and later), else through a volatile pointer. */
void wipe(void *p, size_t n)
{
#if defined(__GLIBC__) && (__GLIBC__ < 2 || (__GLIBC__ == 2 && __GLIBC_MINOR__ < 25))
    volatile unsigned char *v = p;
    while (n--)
        *v++ = 0;
#else
    explicit_bzero(p, n);
#endif
}

#define ROTR(x, n) (((x) >> (n)) | ((x) << (32 - (n))))

/* Section 6.2.2: one 512-bit block into the state. */
static void sha256_block(unsigned int h[8], const unsigned char *p)
{
    unsigned int w[64];
    for (int t = 0; t < 16; t++)
        w[t] = (unsigned int)p[4 * t] << 24 | (unsigned int)p[4 * t + 1] << 16 | (unsigned int)p[4 * t + 2] << 8 |
               (unsigned int)p[4 * t + 3];
    for (int t = 16; t < 64; t++) {
        unsigned int s0 = ROTR(w[t - 15], 7) ^ ROTR(w[t - 15], 18) ^ (w[t - 15] >> 3);
        unsigned int s1 = ROTR(w[t - 2], 17) ^ ROTR(w[t - 2], 19) ^ (w[t - 2] >> 10);
        w[t] = w[t - 16] + s0 + w[t - 7] + s1;
    }
    unsigned int a = h[0], b = h[1], c = h[2], d = h[3], e = h[4], f = h[5], g = h[6], hh = h[7];
    for (int t = 0; t < 64; t++) {
        unsigned int t1 = hh + (ROTR(e, 6) ^ ROTR(e, 11) ^ ROTR(e, 25)) + ((e & f) ^ (~e & g)) + sha256_k[t] + w[t];
        unsigned int t2 = (ROTR(a, 2) ^ ROTR(a, 13) ^ ROTR(a, 22)) + ((a & b) ^ (a & c) ^ (b & c));
        hh = g;
        g = f;
        f = e;
        e = d + t1;
        d = c;
        c = b;
        b = a;
        a = t1 + t2;
    }
    h[0] += a;
    h[1] += b;
    h[2] += c;
    h[3] += d;
    h[4] += e;
    h[5] += f;
    h[6] += g;
    h[7] += hh;
    wipe(w, sizeof w); /* the message schedule of a key block is key material */
}

void sha256_init(struct sha256 *s)
{
    static const unsigned int h0[8] = {0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a,
                                       0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19}; /* 5.3.3 */
    memcpy(s->h, h0, sizeof h0);
    s->used = 0;
    s->bytes = 0;
}

void sha256_update(struct sha256 *s, const void *data, size_t n)
{
    const unsigned char *p = data;
    s->bytes += n;
    while (n > 0) {
        size_t take = 64 - s->used < n ? 64 - s->used : n;
        memcpy(s->block + s->used, p, take);
        s->used += take;
        p += take;
        n -= take;
        if (s->used == 64) {
            sha256_block(s->h, s->block);
            s->used = 0;
        }
    }
}

/* Section 5.1.1: a 1 bit, zeros up to 56 bytes into a block, the length in bits (64-bit big-endian). */
void sha256_final(struct sha256 *s, unsigned char out[32])
{
    unsigned long long bits = s->bytes * 8;
    s->block[s->used++] = 0x80;
    if (s->used > 56) {
        memset(s->block + s->used, 0, 64 - s->used);
        sha256_block(s->h, s->block);
        s->used = 0;
    }
    memset(s->block + s->used, 0, 56 - s->used);
    for (int k = 0; k < 8; k++)
        s->block[56 + k] = (unsigned char)(bits >> (56 - 8 * k));
    sha256_block(s->h, s->block);
    for (int k = 0; k < 32; k++)
        out[k] = (unsigned char)(s->h[k / 4] >> (24 - 8 * (k % 4)));
    wipe(s, sizeof *s);
}

void hmac_init(struct hmac *m, const unsigned char *key, size_t n)
{
    unsigned char block[64], hashed[32];
    memset(block, 0, sizeof block);
    if (n > sizeof block) { /* RFC 2104: a key longer than a block is hashed first */
        struct sha256 s;
        sha256_init(&s);
        sha256_update(&s, key, n);
        sha256_final(&s, hashed);
        key = hashed;
        n = sizeof hashed;
    }
    memcpy(block, key, n);
    for (int k = 0; k < 64; k++)
        block[k] ^= 0x36;
    sha256_init(&m->inner);
    sha256_update(&m->inner, block, sizeof block);
    for (int k = 0; k < 64; k++)
        block[k] ^= 0x36 ^ 0x5c;
    sha256_init(&m->outer);
    sha256_update(&m->outer, block, sizeof block);
    wipe(block, sizeof block);
    wipe(hashed, sizeof hashed);
}

/* The MAC of DATA as 64 lowercase hex digits (no terminator); M is left as it was. */
void hmac_hex(const struct hmac *m, const void *data, size_t n, char hex[64])
{
    struct sha256 s = m->inner;
    unsigned char digest[32];
    sha256_update(&s, data, n);
    sha256_final(&s, digest);
    s = m->outer;
    sha256_update(&s, digest, sizeof digest);
    sha256_final(&s, digest);
    for (int k = 0; k < 32; k++) {
        hex[2 * k] = "0123456789abcdef"[digest[k] >> 4];
        hex[2 * k + 1] = "0123456789abcdef"[digest[k] & 15];
    }
}

/* Test aids: `--sha256` prints the SHA-256 of stdin, `--hmac-sha256 KEYHEX` its HMAC-SHA256, both in
 * lowercase hex, so that the tests check this code against the standard vectors. */
int digest_stdin(const char *key_hex)
{
    unsigned char key[256];
    size_t key_len = 0;
    if (key_hex != NULL) {
        size_t n = strlen(key_hex);
        if (n % 2 || n / 2 > sizeof key)
            die("--hmac-sha256 wants an even number of hex digits, at most %zu", 2 * sizeof key);
        for (size_t k = 0; k < n; k += 2) {
            char pair[3] = {key_hex[k], key_hex[k + 1], '\0'}, *end;
            key[key_len++] = (unsigned char)strtoul(pair, &end, 16);
            if (*end != '\0')
                die("--hmac-sha256: not a hex digit in '%s'", key_hex);
        }
    }
    size_t len = 0, cap = 65536;
    unsigned char *data = malloc(cap);
    for (;;) {
        if (data == NULL)
            die("out of memory");
        ssize_t r = read(0, data + len, cap - len);
        if (r < 0 && errno == EINTR)
            continue;
        if (r < 0)
            die("read: %s", strerror(errno));
        if (r == 0)
            break;
        len += (size_t)r;
        if (len == cap)
            data = realloc(data, cap *= 2);
    }
    char hex[65];
    if (key_hex != NULL) {
        struct hmac m;
        hmac_init(&m, key, key_len);
        hmac_hex(&m, data, len, hex);
        wipe(&m, sizeof m);
    } else {
        struct sha256 s;
        unsigned char digest[32];
        sha256_init(&s);
        sha256_update(&s, data, len);
        sha256_final(&s, digest);
        for (int k = 0; k < 32; k++)
            snprintf(hex + 2 * k, 3, "%02x", digest[k]);
    }
    wipe(key, sizeof key);
    hex[64] = '\0';
    printf("%s\n", hex);
    free(data);
    return 0;
}

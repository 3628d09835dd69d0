/* SHA-256 and HMAC-SHA256 (sd/hmac.h) against the published test vectors: FIPS 180-2's
 * examples (one block, two blocks, a million 'a's, fed in uneven pieces) and RFC 4231's HMAC
 * cases 1, 2, 3, 6 and 7 (keys shorter than, and longer than, a block). */
#include "check.h"
#include "sd/hmac.h"

#include <stdio.h>
#include <string.h>

static void hex(const uint8_t *d, char *out)
{
    for (int i = 0; i < SD_SHA256_BYTES; i++)
        sprintf(out + 2 * i, "%02x", d[i]);
}

static void sha(const char *msg, size_t len, size_t piece, const char *want)
{
    struct sd_sha256 s;
    uint8_t d[SD_SHA256_BYTES];
    char h[65];
    sd_sha256_init(&s);
    for (size_t at = 0; at < len; at += piece)
        sd_sha256_update(&s, msg + at, len - at < piece ? len - at : piece);
    sd_sha256_final(&s, d);
    hex(d, h);
    TH_CHECK(strcmp(h, want) == 0, "sha256 of %zu bytes in pieces of %zu: %s", len, piece, h);
}

static void mac(const void *key, size_t klen, const void *msg, size_t mlen, const char *want)
{
    struct sd_hmac m;
    uint8_t d[SD_SHA256_BYTES];
    char h[65];
    sd_hmac_init(&m, key, klen);
    sd_hmac_update(&m, msg, mlen);
    sd_hmac_final(&m, d);
    hex(d, h);
    TH_CHECK(strcmp(h, want) == 0, "hmac with a %zu-byte key: %s", klen, h);
}

int main(void)
{
    sha("abc", 3, 3, "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
    sha("", 0, 1, "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
    const char *two = "abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq";
    for (size_t piece = 1; piece < 70; piece += 13)
        sha(two, strlen(two), piece,
            "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1");
    static char million[1000000];
    memset(million, 'a', sizeof(million));
    sha(million, sizeof(million), 4093,
        "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0");

    uint8_t k1[20], k3[20], d3[50], k6[131];
    memset(k1, 0x0b, sizeof(k1));
    memset(k3, 0xaa, sizeof(k3));
    memset(d3, 0xdd, sizeof(d3));
    memset(k6, 0xaa, sizeof(k6));
    mac(k1, 20, "Hi There", 8, "b0344c61d8db38535ca8afceaf0bf12b881dc200c9833da726e9376c2e32cff7");
    mac("Jefe", 4, "what do ya want for nothing?", 28,
        "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843");
    mac(k3, 20, d3, 50, "773ea91e36800e46854db8ebd09181a72959098b3ef8c122d9635514ced565fe");
    const char *m6 = "Test Using Larger Than Block-Size Key - Hash Key First";
    mac(k6, 131, m6, strlen(m6),
        "60e431591ee0b67f0d8a26aacbf5b77f8e0bc6213728c5140546040f0ee37f54");
    const char *m7 = "This is a test using a larger than block-size key and a larger than "
                     "block-size data. The key needs to be hashed before being used by the HMAC "
                     "algorithm.";
    mac(k6, 131, m7, strlen(m7),
        "9b09ffa71b942fcb27635fbcd5b0e944bfdc63644f0713938a7f51535c3a35e2");

    uint8_t a[32] = {1, 2, 3}, b[32] = {1, 2, 3};
    TH_CHECK(sd_mem_equal(a, b, 32), "equal buffers");
    b[31] ^= 1;
    TH_CHECK(!sd_mem_equal(a, b, 32), "buffers differing in the last byte");
    return th_summary("test_hmac");
}

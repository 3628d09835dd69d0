/* An independent daemon's key (daemon/cluster/meet_key.c): its id is the first 32 bits of
 * SHA-256("shardd daemon key\0" || public key), computed here with libcrypto's SHA-256 (a second
 * implementation); a signature over what a hello or a welcome says verifies with its key, and
 * fails when any field it covers differs (role, either nonce, id, job, fabric address, ports),
 * under another key, with a key that does not name the id, or truncated. */
#include "check.h"
#include "cluster/meet_key.h"
#include "sd/status.h"

#include <openssl/sha.h>
#include <string.h>

static uint32_t id_by_libcrypto(const uint8_t *pub)
{
    static const char label[] = "shardd daemon key";
    uint8_t buf[sizeof(label) + SD_MEET_KEY], d[SHA256_DIGEST_LENGTH];
    memcpy(buf, label, sizeof(label));
    memcpy(buf + sizeof(label), pub, SD_MEET_KEY);
    SHA256(buf, sizeof(buf), d);
    return (uint32_t)d[0] << 24 | (uint32_t)d[1] << 16 | (uint32_t)d[2] << 8 | d[3];
}

int main(void)
{
    struct sd_meet_key a, b;
    TH_CHECK(sd_meet_key_new(&a) == SD_OK && sd_meet_key_new(&b) == SD_OK, "two key pairs");
    TH_CHECK(a.id == id_by_libcrypto(a.pub) && b.id == id_by_libcrypto(b.pub),
             "ids %08x %08x: not the keys' hashes", a.id, b.id);
    TH_CHECK(a.id != b.id && a.id != 0 && a.id != UINT32_MAX, "ids %08x %08x", a.id, b.id);
    uint8_t nc[SD_MEET_NONCE], nm[SD_MEET_NONCE], fab[52];
    for (int i = 0; i < SD_MEET_NONCE; i++) {
        nc[i] = (uint8_t)i;
        nm[i] = (uint8_t)(255 - i);
    }
    memset(fab, 0x42, sizeof(fab));
    struct sd_meet_said s = {.role = 'h',
                             .nc = nc,
                             .nm = nm,
                             .id = a.id,
                             .job = "job",
                             .fab = fab,
                             .fab_len = sizeof(fab),
                             .hb_port = 1000,
                             .peer_port = 7701};
    uint8_t sig[SD_MEET_SIG];
    TH_CHECK(sd_meet_key_sign(&a, &s, sig), "sign");
    TH_CHECK(sd_meet_key_verify(a.pub, SD_MEET_KEY, sig, SD_MEET_SIG, &s), "verify");
    /* every field the signature covers, changed */
    struct sd_meet_said t;
    uint8_t other[SD_MEET_NONCE], fab2[52];
    memcpy(other, nc, sizeof(other));
    other[5] ^= 1;
    memcpy(fab2, fab, sizeof(fab2));
    fab2[51] ^= 1;
    for (int f = 0; f < 9; f++) {
        t = s;
        switch (f) {
        case 0:
            t.role = 'w';
            break;
        case 1:
            t.nc = other;
            break;
        case 2:
            t.nm = other;
            break;
        case 3:
            t.job = "jab";
            break;
        case 4:
            t.fab = fab2;
            break;
        case 5:
            t.fab_len = 51;
            break;
        case 6:
            t.hb_port = 1001;
            break;
        case 7:
            t.peer_port = 7702;
            break;
        case 8:
            t.id = a.id ^ 1;
            break;
        }
        TH_CHECK(!sd_meet_key_verify(a.pub, SD_MEET_KEY, sig, SD_MEET_SIG, &t),
                 "a signature verified with field %d changed", f);
    }
    /* another key: its own signature does not name a's id; a's signature is not b's */
    uint8_t sig_b[SD_MEET_SIG];
    TH_CHECK(sd_meet_key_sign(&b, &s, sig_b), "sign with b");
    TH_CHECK(!sd_meet_key_verify(b.pub, SD_MEET_KEY, sig_b, SD_MEET_SIG, &s),
             "b's key verified as a's id");
    TH_CHECK(!sd_meet_key_verify(b.pub, SD_MEET_KEY, sig, SD_MEET_SIG, &s),
             "a's signature, b's key");
    t = s;
    t.id = b.id;
    TH_CHECK(!sd_meet_key_verify(b.pub, SD_MEET_KEY, sig, SD_MEET_SIG, &t),
             "a's signature verified under b's key and id");
    sig[0] ^= 1;
    TH_CHECK(!sd_meet_key_verify(a.pub, SD_MEET_KEY, sig, SD_MEET_SIG, &s), "a flipped bit");
    sig[0] ^= 1;
    TH_CHECK(!sd_meet_key_verify(a.pub, SD_MEET_KEY - 1, sig, SD_MEET_SIG, &s) &&
                 !sd_meet_key_verify(a.pub, SD_MEET_KEY, sig, SD_MEET_SIG - 1, &s) &&
                 !sd_meet_key_verify(NULL, 0, NULL, 0, &s),
             "short keys or signatures verified");
    sd_meet_key_free(&a);
    sd_meet_key_free(&b);
    return th_summary("test_meet_key");
}

/* An independent daemon's identity (cluster_int.h, "meet_key"): an Ed25519 key pair made at each
 * start (OpenSSL's libcrypto), whose public key names the daemon: its id, on the wire, is the
 * first 32 bits of the key's SHA-256. Every hello and welcome signs, with the private key, what it
 * says of its daemon (its id, its fabric address, its ports) over both nonces of its connection
 * and the job it is for, and carries the public key: the other end checks the signature and that
 * the key hashes to the id. So an id is claimed only by the daemon holding its key: a process
 * that holds one job's secret can prove that job's token, but not that it is another daemon,
 * and what a daemon met under an id is bound to that key (meet.c: a link proving the key is what
 * a slot's addresses are taken from). Claiming an id with another key takes about 2^32 key
 * pairs until one hashes to it; a daemon refuses such a key while the id's slot is in use. */
#include "cluster/meet_key.h"
#include "sd/hmac.h"
#include "sd/status.h"

#include <openssl/evp.h>
#include <string.h>

#define KEY_LABEL "shardd daemon key"

int sd_meet_key_new(struct sd_meet_key *k)
{
    for (int tries = 0; tries < 16; tries++) {
        EVP_PKEY *pkey = NULL;
        EVP_PKEY_CTX *c = EVP_PKEY_CTX_new_id(EVP_PKEY_ED25519, NULL);
        bool ok = c != NULL && EVP_PKEY_keygen_init(c) == 1 && EVP_PKEY_keygen(c, &pkey) == 1;
        EVP_PKEY_CTX_free(c);
        size_t len = SD_MEET_KEY;
        ok = ok && EVP_PKEY_get_raw_public_key(pkey, k->pub, &len) == 1 && len == SD_MEET_KEY;
        if (!ok) {
            EVP_PKEY_free(pkey);
            return SD_EIO;
        }
        k->id = sd_meet_key_id(k->pub);
        if (k->id != 0 && k->id != UINT32_MAX) {
            k->pkey = pkey;
            return SD_OK;
        }
        EVP_PKEY_free(pkey); /* (an id that means none) */
    }
    return SD_EIO;
}

void sd_meet_key_free(struct sd_meet_key *k)
{
    EVP_PKEY_free(k->pkey);
    k->pkey = NULL;
}

uint32_t sd_meet_key_id(const uint8_t key[SD_MEET_KEY])
{
    struct sd_sha256 h;
    uint8_t d[SD_SHA256_BYTES];
    sd_sha256_init(&h);
    sd_sha256_update(&h, KEY_LABEL, sizeof(KEY_LABEL));
    sd_sha256_update(&h, key, SD_MEET_KEY);
    sd_sha256_final(&h, d);
    return (uint32_t)d[0] << 24 | (uint32_t)d[1] << 16 | (uint32_t)d[2] << 8 | d[3];
}

/* what is signed: a label, the role, both nonces, the job, and what it says of its daemon */
static size_t said_bytes(const struct sd_meet_said *s, uint8_t *out, size_t cap)
{
    size_t n = 0, job = s->job != NULL ? strnlen(s->job, 64) : 0;
    uint32_t f[3] = {s->id, s->hb_port, s->peer_port};
    size_t need = sizeof(KEY_LABEL) + 1 + 2 * SD_MEET_NONCE + job + 1 + sizeof(f) + s->fab_len;
    if (need > cap)
        return 0;
    memcpy(out + n, KEY_LABEL, sizeof(KEY_LABEL));
    n += sizeof(KEY_LABEL);
    out[n++] = (uint8_t)s->role;
    memcpy(out + n, s->nc, SD_MEET_NONCE);
    n += SD_MEET_NONCE;
    memcpy(out + n, s->nm, SD_MEET_NONCE);
    n += SD_MEET_NONCE;
    memcpy(out + n, s->job != NULL ? s->job : "", job);
    n += job;
    out[n++] = 0;
    memcpy(out + n, f, sizeof(f));
    n += sizeof(f);
    memcpy(out + n, s->fab, s->fab_len);
    return n + s->fab_len;
}

bool sd_meet_key_sign(const struct sd_meet_key *k, const struct sd_meet_said *s,
                      uint8_t sig[SD_MEET_SIG])
{
    uint8_t msg[1024];
    size_t n = said_bytes(s, msg, sizeof(msg)), len = SD_MEET_SIG;
    EVP_MD_CTX *m = n > 0 && k->pkey != NULL ? EVP_MD_CTX_new() : NULL;
    bool ok = m != NULL && EVP_DigestSignInit(m, NULL, NULL, NULL, k->pkey) == 1 &&
              EVP_DigestSign(m, sig, &len, msg, n) == 1 && len == SD_MEET_SIG;
    EVP_MD_CTX_free(m);
    return ok;
}

bool sd_meet_key_verify(const uint8_t *key, size_t key_len, const uint8_t *sig, size_t sig_len,
                        const struct sd_meet_said *s)
{
    uint8_t msg[1024];
    if (key_len != SD_MEET_KEY || sig_len != SD_MEET_SIG || sd_meet_key_id(key) != s->id)
        return false;
    size_t n = said_bytes(s, msg, sizeof(msg));
    EVP_PKEY *pk = n > 0 ? EVP_PKEY_new_raw_public_key(EVP_PKEY_ED25519, NULL, key, key_len) : NULL;
    EVP_MD_CTX *m = pk != NULL ? EVP_MD_CTX_new() : NULL;
    bool ok = m != NULL && EVP_DigestVerifyInit(m, NULL, NULL, NULL, pk) == 1 &&
              EVP_DigestVerify(m, sig, sig_len, msg, n) == 1;
    EVP_MD_CTX_free(m);
    EVP_PKEY_free(pk);
    return ok;
}

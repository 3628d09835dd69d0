/* The cluster's secret and the MACs of the handshake (auth.h). */
#include "cluster/auth.h"
#include "sd/safe_fs.h"
#include "sd/status.h"

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

/* Is the coordinator's host a loopback address (every daemon on this machine)? */
static bool coordinator_local(const char *spec)
{
    char host[128];
    const char *colon = strrchr(spec, ':');
    if (colon == NULL || (size_t)(colon - spec) >= sizeof(host))
        return false;
    memcpy(host, spec, (size_t)(colon - spec));
    host[colon - spec] = '\0';
    struct in_addr a4;
    struct in6_addr a6;
    if (inet_pton(AF_INET, host, &a4) == 1)
        return (ntohl(a4.s_addr) >> 24) == 127;
    return inet_pton(AF_INET6, host, &a6) == 1 && IN6_IS_ADDR_LOOPBACK(&a6);
}

/* 32 random bytes into path, mode 0600, unless another daemon made it first */
static int make_secret(const char *path, char *err, size_t errlen)
{
    char tmp[SD_PATH_MAX + 32];
    snprintf(tmp, sizeof(tmp), "%s", path);
    char *slash = strrchr(tmp, '/');
    if (slash != NULL && slash != tmp) { /* its directory (/etc/shardd), one level */
        *slash = '\0';
        if (mkdir(tmp, 0755) != 0 && errno != EEXIST) {
            snprintf(err, errlen, "making the cluster secret %s: its directory %s: %s", path, tmp,
                     strerror(errno));
            return -errno;
        }
    }
    snprintf(tmp, sizeof(tmp), "%s.%d", path, (int)getpid());
    uint8_t key[32];
    int st = sd_fs_random(key, sizeof(key));
    int fd = st == 0 ? open(tmp, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW, 0600) : -1;
    if (fd < 0 || sd_fs_write_all(fd, key, sizeof(key)) != 0 || fsync(fd) != 0) {
        int e = st != 0 ? -st : errno;
        snprintf(err, errlen, "making the cluster secret %s: %s", path, strerror(e));
        if (fd >= 0) {
            close(fd);
            unlink(tmp);
        }
        return -e;
    }
    close(fd);
    /* link, not rename: the first daemon's secret stays, the others read it */
    int rc = link(tmp, path) == 0 || errno == EEXIST ? 0 : -errno;
    unlink(tmp);
    if (rc != 0)
        snprintf(err, errlen, "making the cluster secret %s: %s", path, strerror(-rc));
    return rc;
}

int sd_auth_load(const struct sd_config *cfg, struct sd_auth *a, char *err, size_t errlen)
{
    const char *path = cfg->cluster_secret_file;
    memset(a, 0, sizeof(*a));
    if (path[0] != '/') {
        snprintf(err, errlen, "cluster_secret_file '%s' is not an absolute path", path);
        return SD_ECONFIG;
    }
    int fd = open(path, O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK);
    if (fd < 0 && errno == ENOENT && coordinator_local(cfg->coordinator)) {
        int st = make_secret(path, err, errlen);
        if (st != 0)
            return SD_ECONFIG;
        fd = open(path, O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK);
    }
    if (fd < 0) {
        snprintf(err, errlen,
                 "cluster_secret_file %s: %s (every daemon of a cluster needs the same secret: "
                 "head -c 32 /dev/urandom > %s; chmod 600 %s; copy it to every node)",
                 path, strerror(errno), path, path);
        return SD_ECONFIG;
    }
    struct stat st;
    ssize_t n = -1;
    const char *why = NULL;
    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode))
        why = "not a regular file";
    else if (st.st_uid != geteuid())
        why = "not owned by the daemon's user";
    else if (st.st_mode & 077)
        why = "readable by others than the daemon's user (chmod 600 it)";
    else if ((n = read(fd, a->key, sizeof(a->key))) < 16)
        why = "shorter than 16 bytes";
    close(fd);
    if (why != NULL) {
        snprintf(err, errlen, "cluster_secret_file %s is %s", path, why);
        memset(a, 0, sizeof(*a));
        return SD_ECONFIG;
    }
    a->key_len = (size_t)n;
    return SD_OK;
}

int sd_auth_nonce(uint8_t out[SD_AUTH_NONCE])
{
    return sd_fs_random(out, SD_AUTH_NONCE) == 0 ? SD_OK : SD_EIO;
}

static void put_u64(struct sd_hmac *m, uint64_t v)
{
    uint8_t b[8];
    for (int i = 0; i < 8; i++)
        b[i] = (uint8_t)(v >> (8 * i));
    sd_hmac_update(m, b, 8);
}

static void put_bytes(struct sd_hmac *m, const void *p, size_t len)
{
    put_u64(m, len); /* each field with its length: no two hellos hash alike */
    sd_hmac_update(m, p, len);
}

static void start(struct sd_hmac *m, const struct sd_auth *a, const char *label, const uint8_t *nc,
                  const uint8_t *nm)
{
    sd_hmac_init(m, a->key, a->key_len);
    put_bytes(m, label, strlen(label));
    put_bytes(m, nc, SD_AUTH_NONCE);
    put_bytes(m, nm, SD_AUTH_NONCE);
}

void sd_auth_hello_mac(const struct sd_auth *a, const uint8_t *nc, const uint8_t *nm,
                       const Shard__PeerHello *h, uint8_t out[SD_SHA256_BYTES])
{
    struct sd_hmac m;
    start(&m, a, "shardd hello", nc, nm);
    put_u64(&m, h->node);
    put_u64(&m, h->protocol_version);
    put_u64(&m, h->config_digest);
    put_bytes(&m, h->fabric_addr.data, h->fabric_addr.len);
    put_bytes(&m, h->version ? h->version : "", h->version ? strlen(h->version) : 0);
    put_bytes(&m, h->config_summary ? h->config_summary : "",
              h->config_summary ? strlen(h->config_summary) : 0);
    put_u64(&m, h->hb_port);
    put_u64(&m, h->was);
    put_u64(&m, h->peer);
    put_u64(&m, h->peer_port);
    put_u64(&m, h->known);
    put_bytes(&m, h->job ? h->job : "", h->job ? strlen(h->job) : 0);
    put_u64(&m, h->you);
    sd_hmac_final(&m, out);
}

void sd_auth_welcome_mac(const struct sd_auth *a, const uint8_t *nc, const uint8_t *nm,
                         uint8_t out[SD_SHA256_BYTES])
{
    struct sd_hmac m;
    start(&m, a, "shardd welcome", nc, nm);
    sd_hmac_final(&m, out);
}

void sd_auth_hb_key(const struct sd_auth *a, const uint8_t *nc, const uint8_t *nm,
                    uint8_t out[SD_SHA256_BYTES])
{
    struct sd_hmac m;
    start(&m, a, "shardd heartbeat", nc, nm);
    sd_hmac_final(&m, out);
}

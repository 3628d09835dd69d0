/* The heartbeat thread (daemon/cluster/heartbeat.c) against forgers: two threads on loopback
 * hear each other with the session key of their handshake; a datagram of the old format, one
 * with a wrong MAC, a correct one replayed (a sequence number already heard) and one MAC'd with
 * the key of an earlier session are dropped and counted, and a peer heard only through them
 * stays silent (its last_seen does not move). The MACs are computed here from the datagram's
 * documented layout (magic "SDHB", node, sequence number, HMAC-SHA256's first 16 bytes). */
#include "check.h"
#include "harness.h"
#include "cluster/heartbeat.h"
#include "sd/hmac.h"
#include "sd/util.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

struct dgram {
    uint32_t magic, node;
    uint64_t seq;
    uint8_t mac[16];
};

static void sign(struct dgram *d, const uint8_t *key)
{
    struct sd_hmac h;
    uint8_t full[SD_SHA256_BYTES];
    sd_hmac_init(&h, key, SD_SHA256_BYTES);
    sd_hmac_update(&h, d, 16);
    sd_hmac_final(&h, full);
    memcpy(d->mac, full, 16);
}

static void send_to(int fd, uint16_t port, const void *p, size_t len)
{
    struct sockaddr_in to = {.sin_family = AF_INET, .sin_port = htons(port)};
    inet_pton(AF_INET, "127.0.0.1", &to.sin_addr);
    TH_CHECK(sendto(fd, p, len, 0, (struct sockaddr *)&to, sizeof(to)) == (ssize_t)len, "sendto");
}

static void ticks(struct sd_heartbeat *a, struct sd_heartbeat *b, int ms)
{
    for (int t = 0; t < ms; t += 10) {
        sd_heartbeat_tick(a);
        sd_heartbeat_tick(b);
        usleep(10000);
    }
}

int main(void)
{
    struct sd_heartbeat *h0, *h1;
    uint16_t p0 = 0, p1 = 0;
    struct sd_heartbeat_param hp = {
        .n = 2, .interval_ms = 20, .stall_ms = 10000, .bind_addr = "127.0.0.1"};
    struct sd_heartbeat_param hp1 = hp;
    hp1.self = 1;
    TH_CHECK(sd_heartbeat_start(&h0, &hp, &p0) == 0 && sd_heartbeat_start(&h1, &hp1, &p1) == 0,
             "two heartbeat threads");
    uint8_t key[SD_SHA256_BYTES], old_key[SD_SHA256_BYTES];
    memset(key, 0x5a, sizeof(key));
    memset(old_key, 0x33, sizeof(old_key));
    struct sockaddr_in lo = {.sin_family = AF_INET};
    inet_pton(AF_INET, "127.0.0.1", &lo.sin_addr);
    sd_heartbeat_set_peer(h0, 1, (struct sockaddr *)&lo, p1, key, UINT32_MAX);
    sd_heartbeat_set_peer(h1, 0, (struct sockaddr *)&lo, p0, key, UINT32_MAX);
    ticks(h0, h1, 300);
    uint64_t sent, recv0, drop0;
    sd_heartbeat_counts(h0, &sent, &recv0, &drop0);
    TH_CHECK(recv0 > 3 && drop0 == 0 && sd_heartbeat_last_seen(h0, 1) > 0,
             "node 0 hears node 1: %llu received, %llu dropped", (unsigned long long)recv0,
             (unsigned long long)drop0);

    /* node 1 stops (its thread no longer vouches: no ticks); a forger speaks for it */
    sd_heartbeat_stop(h1);
    usleep(100000);
    uint64_t seen = sd_heartbeat_last_seen(h0, 1), r0, d0;
    sd_heartbeat_counts(h0, &sent, &r0, &d0);
    int fd = socket(AF_INET, SOCK_DGRAM, 0);
    TH_CHECK(bind(fd, (struct sockaddr *)&lo, sizeof(lo)) == 0, "the forger's socket on loopback");
    uint8_t old_format[24] = {0x42, 0x48, 0x44, 0x53, 1, 0, 0, 0};
    send_to(fd, p0, old_format, sizeof(old_format));
    struct dgram d = {.magic = 0x53444842u, .node = 1, .seq = 1ull << 40};
    memset(d.mac, 0xee, sizeof(d.mac)); /* a wrong MAC */
    send_to(fd, p0, &d, sizeof(d));
    d.seq = 2; /* a correct MAC on a number already heard: a replay */
    sign(&d, key);
    send_to(fd, p0, &d, sizeof(d));
    d.seq = 1ull << 41; /* a correct MAC of an earlier session's key */
    sign(&d, old_key);
    send_to(fd, p0, &d, sizeof(d));
    for (int i = 0; i < 20; i++) {
        sd_heartbeat_tick(h0);
        usleep(10000);
    }
    uint64_t r1, d1;
    sd_heartbeat_counts(h0, &sent, &r1, &d1);
    TH_CHECK(d1 - d0 == 4 && r1 == r0, "4 forged datagrams: %llu dropped, %llu received",
             (unsigned long long)(d1 - d0), (unsigned long long)(r1 - r0));
    TH_CHECK(sd_heartbeat_last_seen(h0, 1) == seen, "the forged datagrams made node 1 look alive");
    /* and the check is not one that drops everything: the right key and a new number pass */
    d.seq = 1ull << 42;
    sign(&d, key);
    send_to(fd, p0, &d, sizeof(d));
    for (int i = 0; i < 20; i++) {
        sd_heartbeat_tick(h0);
        usleep(10000);
    }
    sd_heartbeat_counts(h0, &sent, &r1, &d1);
    TH_CHECK(r1 == r0 + 1 && sd_heartbeat_last_seen(h0, 1) > seen,
             "a datagram with the session's key and a new number is heard");
    close(fd);
    sd_heartbeat_stop(h0);

    /* independent daemons: both call themselves node 1, and each numbers the other its own
     * way (5 and 7); each datagram names its sender as the receiver knows it */
    struct sd_heartbeat_param hi = {
        .self = 1, .n = 8, .interval_ms = 20, .stall_ms = 10000, .bind_addr = "127.0.0.1"};
    struct sd_heartbeat *ha, *hb;
    uint16_t pa = 0, pb = 0;
    TH_CHECK(sd_heartbeat_start(&ha, &hi, &pa) == 0 && sd_heartbeat_start(&hb, &hi, &pb) == 0,
             "two independent daemons' heartbeat threads");
    sd_heartbeat_set_peer(ha, 5, (struct sockaddr *)&lo, pb, key, 7); /* b knows a as 7 */
    sd_heartbeat_set_peer(hb, 7, (struct sockaddr *)&lo, pa, key, 5); /* a knows b as 5 */
    ticks(ha, hb, 300);
    uint64_t ra, da;
    sd_heartbeat_counts(ha, &sent, &ra, &da);
    TH_CHECK(sd_heartbeat_last_seen(ha, 5) > 0 && sd_heartbeat_last_seen(hb, 7) > 0 && da == 0,
             "each hears the other under its own number (%llu received, %llu dropped)",
             (unsigned long long)ra, (unsigned long long)da);
    /* one that names itself as the sender knows itself (1): not a peer's, dropped */
    sd_heartbeat_set_peer(hb, 7, (struct sockaddr *)&lo, pa, key, UINT32_MAX);
    usleep(50000);
    sd_heartbeat_counts(ha, &sent, &ra, &da);
    ticks(ha, hb, 200);
    uint64_t ra2, da2;
    sd_heartbeat_counts(ha, &sent, &ra2, &da2);
    TH_CHECK(da2 > da && ra2 == ra, "datagrams naming the sender's own number: %llu dropped",
             (unsigned long long)(da2 - da));
    sd_heartbeat_stop(ha);
    sd_heartbeat_stop(hb);
    return th_summary("test_heartbeat");
}

/* Speaking shardd's daemon-to-daemon protocol from a test (peer.h). */
#include "peer.h"
#include "check.h"
#include "sd/frame.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

Shard__PeerMsg *th_peer_recv(int fd, int timeout_ms)
{
    uint8_t *buf = NULL;
    size_t n = 0;
    if (sd_frame_recv(fd, &buf, &n, NULL, 0, NULL, 1 << 20, timeout_ms) != 0)
        return NULL;
    Shard__PeerMsg *m = shard__peer_msg__unpack(NULL, n, buf);
    free(buf);
    return m;
}

void th_peer_send(int fd, Shard__PeerMsg *m)
{
    TH_CHECK(sd_frame_send(fd, &m->base, NULL, 0, 2000) == 0, "a message to the daemon");
}

void th_peer_config(struct sd_config *cfg, const char *nodes, const char *const *extra)
{
    char err[512];
    sd_config_defaults(cfg);
    if (nodes != NULL)
        TH_CHECK(sd_config_set(cfg, "nodes", nodes, err, sizeof(err)) == 0, "%s", err);
    for (int i = 0; extra != NULL && extra[i] != NULL && extra[i + 1] != NULL; i += 2) {
        char name[64];
        snprintf(name, sizeof(name), "%s", extra[i] + 2);
        for (char *c = name; *c; c++)
            *c = *c == '-' ? '_' : *c;
        TH_CHECK(sd_config_set(cfg, name, extra[i + 1], err, sizeof(err)) == 0, "%s", err);
    }
}

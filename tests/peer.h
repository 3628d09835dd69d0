/* Speaking shardd's daemon-to-daemon protocol from a test (a process on the network that is not
 * a daemon, or that holds a secret it should not use): frames on a control link, and the
 * configuration the daemons under test run with. */
#ifndef TH_PEER_H
#define TH_PEER_H

#include "sd/config.h"
#include "shard.pb-c.h"

/* the next message on fd within timeout_ms (NULL: none, or not one) */
Shard__PeerMsg *th_peer_recv(int fd, int timeout_ms);
/* m on fd (a failed check if it cannot go) */
void th_peer_send(int fd, Shard__PeerMsg *m);
/* cfg: the defaults, nodes (NULL: as they are), and the options of extra ("--name value"
 * pairs, as the daemons were given them) */
void th_peer_config(struct sd_config *cfg, const char *nodes, const char *const *extra);

#endif

/* The node's network service (net_service.c): the transport and the control plane a node's
 * jobs share, and the standing receives for peers' pull requests, which it hands to the job
 * they name (fetch.c serves them). reg->net is NULL on a single node; struct sd_net is
 * net_service.c's own. */
#ifndef SD_NET_SERVICE_H
#define SD_NET_SERVICE_H

#include <stdbool.h>
#include <stdint.h>

struct sd_cluster;
struct sd_job;
struct sd_net;
struct sd_registry;
struct sd_req_msg;
struct sd_transport;

/* serves a peer's pull request for a job of this node (fetch.c's sd_fetch_on_request): the
 * service hands requests up without knowing who serves them */
typedef void (*sd_net_serve_fn)(struct sd_job *job, const struct sd_req_msg *m);

int sd_net_start(struct sd_registry *reg, struct sd_transport *tp, struct sd_cluster *cl,
                 sd_net_serve_fn serve);
/* the cluster, once started (it needs the registry's events first) */
void sd_net_set_cluster(struct sd_registry *reg, struct sd_cluster *cl);
/* standing receives for pull requests, once the cluster formed (idempotent) */
int sd_net_post_requests(struct sd_registry *reg);
/* after the transport was quiesced and every job freed */
void sd_net_stop(struct sd_registry *reg);
/* true while transfers beyond the standing request receives are in flight */
bool sd_net_busy(const struct sd_registry *reg);
/* a job was confirmed: serve the requests that came for it too early */
void sd_net_job_confirmed(struct sd_registry *reg, uint32_t job_tag);
/* the one way to the control plane: NULL on a single node (net NULL) or before it started */
struct sd_cluster *sd_net_cluster(const struct sd_net *net);
/* the transport (net not NULL) */
struct sd_transport *sd_net_transport(const struct sd_net *net);

#endif

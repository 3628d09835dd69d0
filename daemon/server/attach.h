/* attach.c: a client's session set up on its connection, its ring drained into the job's
 * operations, and its end. */
#ifndef SD_ATTACH_H
#define SD_ATTACH_H

#include "shard.pb-c.h"

#include <stdbool.h>

struct sd_conn;
struct sd_session;

int sd_session_create(struct sd_conn *c, const Shard__Attach *msg);
/* Leave the job (if any) and free the session; reason appears in the job's error. */
void sd_session_destroy(struct sd_session *s, const char *reason);
/* Drain the ring; returns true if any entry was consumed or a stalled one went through. */
bool sd_session_progress(struct sd_session *s);

#endif

/* A Register message as a model description (common's sd_model): the one place a client's
 * model crosses from the wire into the daemon, so that it can be fuzzed alone (tests/fuzz). */
#ifndef SD_MODEL_MSG_H
#define SD_MODEL_MSG_H

#include "sd/model.h"
#include "shard.pb-c.h"

#include <stddef.h>
#include <stdint.h>

/* Copy msg into *m and validate it (sd_model_validate): at most max_tensors tensors and
 * max_units units. SD_OK, or an error with err saying what is wrong; *m is freed on error. */
int sd_model_from_register(const Shard__Register *msg, uint64_t max_tensors, uint64_t max_units,
                           struct sd_model *m, char *err, size_t len);
void sd_model_free(struct sd_model *m);
/* One parameter group's hyperparameters as the wire carries them (Register.groups,
 * RegisterReply.groups; kind is the optimizer's), and back. */
void sd_hparams_to_msg(const struct sd_hparams *h, int kind, Shard__Optimizer *out);
struct sd_hparams sd_hparams_from_msg(const Shard__Optimizer *q);

#endif

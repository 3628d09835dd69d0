#include "sd/model_msg.h"
#include "sd/status.h"
#include "sd/util.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

void sd_model_free(struct sd_model *m)
{
    free(m->tensors);
    free(m->groups);
    m->tensors = NULL;
    m->groups = NULL;
    m->n_tensors = 0;
    m->n_groups = 0;
}

void sd_hparams_to_msg(const struct sd_hparams *h, int kind, Shard__Optimizer *out)
{
    shard__optimizer__init(out);
    out->kind = (uint32_t)kind;
    out->lr = h->lr;
    out->beta1 = h->beta1;
    out->beta2 = h->beta2;
    out->eps = h->eps;
    out->weight_decay = h->weight_decay;
    out->momentum = h->momentum;
}

struct sd_hparams sd_hparams_from_msg(const Shard__Optimizer *q)
{
    return (struct sd_hparams){.lr = q->lr,
                               .beta1 = q->beta1,
                               .beta2 = q->beta2,
                               .eps = q->eps,
                               .weight_decay = q->weight_decay,
                               .momentum = q->momentum};
}

int sd_model_from_register(const Shard__Register *msg, uint64_t max_tensors, uint64_t max_units,
                           struct sd_model *m, char *err, size_t len)
{
    memset(m, 0, sizeof(*m));
    uint64_t max_t = SD_MIN(max_tensors, (uint64_t)SD_MAX_TENSORS);
    if (msg->n_tensors == 0 || msg->n_tensors > max_t) {
        snprintf(err, len, "model has %zu tensors; expected 1..%llu (max_tensors)", msg->n_tensors,
                 (unsigned long long)max_t);
        return SD_EINVAL;
    }
    for (size_t i = 0; i < msg->n_tensors; i++)
        if (msg->tensors[i]->unit >= max_units) {
            snprintf(err, len,
                     "tensor %zu: unit %u, but a model has at most %llu units (max_units)", i,
                     msg->tensors[i]->unit, (unsigned long long)max_units);
            return SD_EINVAL;
        }
    if (msg->optimizer == NULL) {
        snprintf(err, len, "model has no optimizer settings");
        return SD_EINVAL;
    }
    if (msg->plan == NULL || strlen(msg->plan) >= sizeof(m->plan)) {
        snprintf(err, len, "plan is missing or longer than %zu bytes", sizeof(m->plan) - 1);
        return SD_EINVAL;
    }
    m->tensors = calloc(msg->n_tensors, sizeof(*m->tensors));
    if (m->tensors == NULL) {
        snprintf(err, len, "out of memory for %zu tensor descriptions", msg->n_tensors);
        return SD_ENOMEM;
    }
    m->n_tensors = (uint32_t)msg->n_tensors;
    for (size_t i = 0; i < msg->n_tensors; i++) {
        const Shard__TensorDesc *t = msg->tensors[i];
        struct sd_tensor_desc *d = &m->tensors[i];
        if (t->name == NULL || strlen(t->name) >= SD_MAX_NAME || t->n_dims > SD_MAX_DIMS) {
            snprintf(err, len, "tensor %zu: name longer than %d bytes or more than %d dims", i,
                     SD_MAX_NAME - 1, SD_MAX_DIMS);
            sd_model_free(m);
            return SD_EINVAL;
        }
        snprintf(d->name, sizeof(d->name), "%s", t->name);
        d->ndim = (uint32_t)t->n_dims;
        for (size_t k = 0; k < t->n_dims; k++)
            d->dims[k] = t->dims[k];
        d->dtype = t->dtype < SD_DTYPE_COUNT ? (int)t->dtype : -1;
        d->unit = t->unit;
        d->group = t->group;
    }
    const Shard__Optimizer *o = msg->optimizer;
    m->optim = (struct sd_optim){.kind = (int)o->kind,
                                 .lr = o->lr,
                                 .beta1 = o->beta1,
                                 .beta2 = o->beta2,
                                 .eps = o->eps,
                                 .weight_decay = o->weight_decay,
                                 .momentum = o->momentum,
                                 .max_grad_norm = o->max_grad_norm};
    if (msg->n_groups > SD_MAX_GROUPS) {
        snprintf(err, len, "model has %zu parameter groups; at most %d", msg->n_groups,
                 SD_MAX_GROUPS);
        sd_model_free(m);
        return SD_EINVAL;
    }
    if (msg->n_groups > 0) {
        m->groups = calloc(msg->n_groups, sizeof(*m->groups));
        if (m->groups == NULL) {
            snprintf(err, len, "out of memory for %zu parameter groups", msg->n_groups);
            sd_model_free(m);
            return SD_ENOMEM;
        }
        m->n_groups = (uint32_t)msg->n_groups;
        for (size_t g = 0; g < msg->n_groups; g++)
            m->groups[g] = sd_hparams_from_msg(msg->groups[g]);
        /* group 0's are the optimizer's */
        m->optim.lr = m->groups[0].lr;
        m->optim.beta1 = m->groups[0].beta1;
        m->optim.beta2 = m->groups[0].beta2;
        m->optim.eps = m->groups[0].eps;
        m->optim.weight_decay = m->groups[0].weight_decay;
        m->optim.momentum = m->groups[0].momentum;
    }
    m->skip_unused = msg->skip_unused;
    m->bcast_bytes = msg->bcast_bytes;
    snprintf(m->plan, sizeof(m->plan), "%s", msg->plan);
    int st = sd_model_validate(m, err, len);
    if (st != SD_OK)
        sd_model_free(m);
    return st;
}

/* The local ranks' waiting calls (barrier.h). */
#include "barrier.h"
#include "sd/status.h"

#include <stdlib.h>

int sd_barrier_init(struct sd_barrier *b, uint32_t n)
{
    *b = (struct sd_barrier){.n = n};
    b->req = calloc(n > 0 ? n : 1, sizeof(*b->req));
    return b->req != NULL ? SD_OK : SD_ENOMEM;
}

void sd_barrier_fini(struct sd_barrier *b)
{
    free(b->req);
    *b = (struct sd_barrier){0};
}

bool sd_barrier_arrive(struct sd_barrier *b, uint32_t r, uint64_t tag, uint64_t now)
{
    if (r >= b->n || b->req[r].parked)
        return false;
    b->req[r] = (struct sd_req){.tag = tag, .since_ns = now, .parked = true};
    if (b->arrived++ == 0)
        b->first_ns = now;
    return true;
}

bool sd_barrier_waits(const struct sd_barrier *b, uint32_t r)
{
    return r < b->n && b->req[r].parked;
}

bool sd_barrier_full(const struct sd_barrier *b)
{
    return b->n > 0 && b->arrived == b->n;
}

bool sd_barrier_take(struct sd_barrier *b, uint32_t r, struct sd_req *out)
{
    if (!sd_barrier_waits(b, r))
        return false;
    *out = b->req[r];
    b->req[r].parked = false;
    b->arrived--;
    return true;
}

bool sd_barrier_overdue(const struct sd_barrier *b, uint64_t now, uint64_t timeout, bool *present)
{
    if (b->arrived == 0 || b->arrived == b->n || now - b->first_ns <= timeout)
        return false;
    for (uint32_t r = 0; r < b->n; r++)
        present[r] = b->req[r].parked;
    return true;
}

/* The gather pool's allocator: offsets inside one pre-allocated region, first fit, no malloc
 * after init. Pure: no I/O, no job, testable alone. */
#ifndef SD_SLOT_POOL_H
#define SD_SLOT_POOL_H

#include <stdint.h>

struct sd_extent {
    uint64_t off, len;
};
struct sd_slot_pool {
    uint64_t capacity;
    uint32_t n_used, max_used;
    struct sd_extent *used; /* sorted by offset */
};
int sd_slot_pool_init(struct sd_slot_pool *p, uint64_t capacity, uint32_t max_extents);
void sd_slot_pool_fini(struct sd_slot_pool *p);
/* Returns 0 and the offset, or SD_ENOSPC. align must be a power of two. */
int sd_slot_pool_alloc(struct sd_slot_pool *p, uint64_t len, uint64_t align, uint64_t *off_p);
void sd_slot_pool_free(struct sd_slot_pool *p, uint64_t off);
/* Mark [off, off + len) used (rebuilding the list from places decided elsewhere). */
int sd_slot_pool_take(struct sd_slot_pool *p, uint64_t off, uint64_t len);
uint64_t sd_slot_pool_used_bytes(const struct sd_slot_pool *p);

#endif

/* The write guard of the gather pool: the pool is mapped private and read-only, and a write
 * into it (a torch optimizer's in-place update of a gathered weight, a stray pointer) does not
 * kill the process with SIGSEGV. A process-wide SIGSEGV handler, installed once, lets such a
 * write land in a private copy of the page and records where it went; the context's next call
 * drops the private copies and fails, naming what was written. Faults outside every guarded
 * pool go to the handler that was there before (or kill the process as before). */
#ifndef SD_CLIENT_WGUARD_H
#define SD_CLIENT_WGUARD_H

#include <stddef.h>
#include <stdint.h>

/* Guard [base, base + bytes), mapped PROT_READ and MAP_PRIVATE; returns the guard's id, or -1
 * when it cannot be guarded (writes then fault as they would without it). */
int sd_wguard_add(const void *base, size_t bytes);
/* The first address written since the last take, or 0; when there was a write, the range reads
 * the shared memory again and is read-only again. */
uintptr_t sd_wguard_take(int id, const void *base, size_t bytes);
/* Before the range is unmapped. */
void sd_wguard_remove(int id);

#endif

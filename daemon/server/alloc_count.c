/* Counting the daemon's allocation calls, to prove that a frozen schedule serves fetch,
 * release, push and step without allocating (DESIGN.md section 4). The executable wraps the C
 * library's allocator (glibc's __libc_* entry points), counting per thread. Under
 * AddressSanitizer the sanitizer owns the allocator: nothing is counted and
 * sd_alloc_counted says so. */
#include "stats.h"

#include <malloc.h>
#include <stddef.h>
#include <stdlib.h>

#if defined(__SANITIZE_ADDRESS__) || defined(SD_NO_ALLOC_COUNT)

const bool sd_alloc_counted = false;
uint64_t sd_alloc_calls(void)
{
    return 0;
}

#else

extern void *__libc_malloc(size_t n);
extern void *__libc_calloc(size_t n, size_t size);
extern void *__libc_realloc(void *p, size_t n);
extern void *__libc_memalign(size_t align, size_t n);
extern void __libc_free(void *p);

static __thread uint64_t calls;
const bool sd_alloc_counted = true;

uint64_t sd_alloc_calls(void)
{
    return calls;
}

void *malloc(size_t n)
{
    calls++;
    return __libc_malloc(n);
}

void *calloc(size_t n, size_t size)
{
    calls++;
    return __libc_calloc(n, size);
}

void *realloc(void *p, size_t n)
{
    calls++;
    return __libc_realloc(p, n);
}

void free(void *p)
{
    if (p != NULL)
        calls++;
    __libc_free(p);
}

void *memalign(size_t align, size_t n)
{
    calls++;
    return __libc_memalign(align, n);
}

void *aligned_alloc(size_t align, size_t n)
{
    calls++;
    return __libc_memalign(align, n);
}

int posix_memalign(void **p, size_t align, size_t n)
{
    calls++;
    if (align < sizeof(void *) || (align & (align - 1)) != 0)
        return 22; /* EINVAL */
    void *m = __libc_memalign(align, n);
    if (m == NULL)
        return 12; /* ENOMEM */
    *p = m;
    return 0;
}

#endif

/* The write guard of the gather pool (wguard.h). */
#include "wguard.h"

#include <signal.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#define MAX_GUARDS 64

/* One guarded pool. lo == 0: the entry is free. Written by the threads that map and unmap,
 * read by the handler, which may run on any thread at any time: every field is atomic. */
static struct guard {
    _Atomic uintptr_t lo, hi;
    _Atomic uintptr_t first_fault; /* the first address written since the last take, or 0 */
} guards[MAX_GUARDS];

static struct sigaction previous;
static atomic_bool installed;
static long page_bytes;

/* Not ours: hand the fault to whoever had the signal before. With the default action, put it
 * back and return: the instruction faults again and the process dies as it would have. */
static void chain(int sig, siginfo_t *si, void *uc)
{
    if (previous.sa_flags & SA_SIGINFO) {
        if (previous.sa_sigaction != NULL) {
            previous.sa_sigaction(sig, si, uc);
            return;
        }
    } else if (previous.sa_handler != SIG_DFL && previous.sa_handler != SIG_IGN) {
        previous.sa_handler(sig);
        return;
    }
    signal(sig, SIG_DFL);
}

static void on_segv(int sig, siginfo_t *si, void *uc)
{
    uintptr_t a = (uintptr_t)si->si_addr;
    if (si->si_code == SEGV_ACCERR)
        for (int i = 0; i < MAX_GUARDS; i++) {
            struct guard *g = &guards[i];
            uintptr_t lo = atomic_load(&g->lo);
            if (lo == 0 || a < lo || a >= atomic_load(&g->hi))
                continue;
            /* a write into a read-only private mapping: let it land in a private copy of the
             * page, which the next call of the context discards */
            uintptr_t page = a & ~(uintptr_t)(page_bytes - 1);
            if (mprotect((void *)page, (size_t)page_bytes, PROT_READ | PROT_WRITE) != 0)
                break;
            uintptr_t none = 0;
            atomic_compare_exchange_strong(&g->first_fault, &none, a);
            return;
        }
    chain(sig, si, uc);
}

int sd_wguard_add(const void *base, size_t bytes)
{
    if (!atomic_load(&installed)) {
        page_bytes = sysconf(_SC_PAGESIZE);
        struct sigaction sa;
        memset(&sa, 0, sizeof(sa));
        sa.sa_sigaction = on_segv;
        sa.sa_flags = SA_SIGINFO | SA_ONSTACK;
        sigemptyset(&sa.sa_mask);
        bool no = false;
        if (atomic_compare_exchange_strong(&installed, &no, true) &&
            sigaction(SIGSEGV, &sa, &previous) != 0) {
            atomic_store(&installed, false);
            return -1;
        }
    }
    for (int i = 0; i < MAX_GUARDS; i++) {
        /* claim the entry with a low bound that no address reaches, then fill it in */
        uintptr_t none = 0;
        if (!atomic_compare_exchange_strong(&guards[i].lo, &none, UINTPTR_MAX))
            continue;
        atomic_store(&guards[i].first_fault, 0);
        atomic_store(&guards[i].hi, (uintptr_t)base + bytes);
        atomic_store(&guards[i].lo, (uintptr_t)base);
        return i;
    }
    return -1; /* more pools than entries: that one goes unguarded (a write faults) */
}

uintptr_t sd_wguard_take(int id, const void *base, size_t bytes)
{
    if (id < 0 || id >= MAX_GUARDS)
        return 0;
    uintptr_t a = atomic_exchange(&guards[id].first_fault, 0);
    if (a == 0)
        return 0;
    /* drop the private copies (the pages read the shared memory again) and make the whole
     * range read-only once more */
    madvise((void *)base, bytes, MADV_DONTNEED);
    mprotect((void *)base, bytes, PROT_READ);
    return a;
}

void sd_wguard_remove(int id)
{
    if (id < 0 || id >= MAX_GUARDS)
        return;
    atomic_store(&guards[id].lo, 0);
}

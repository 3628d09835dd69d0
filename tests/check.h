/* Checks and the closing line, for every test. Depends on nothing but libc, so that the unit
 * tests of the daemon's pure pieces link only the piece they test. */
#ifndef TH_CHECK_H
#define TH_CHECK_H

#include <stdio.h>

extern int th_passed, th_failed;

#define TH_CHECK(cond, ...)                                                                        \
    do {                                                                                           \
        if (cond) {                                                                                \
            th_passed++;                                                                           \
        } else {                                                                                   \
            th_failed++;                                                                           \
            fprintf(stderr, "FAIL %s:%d: %s: ", __FILE__, __LINE__, #cond);                        \
            fprintf(stderr, __VA_ARGS__);                                                          \
            fprintf(stderr, "\n");                                                                 \
        }                                                                                          \
    } while (0)

/* Print the closing line ("NAME: N passed, N failed") and return the process exit code. */
int th_summary(const char *name);

#endif

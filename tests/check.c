#include "check.h"

int th_passed, th_failed;

int th_summary(const char *name)
{
    printf("%s: %d passed, %d failed\n", name, th_passed, th_failed);
    return th_failed ? 1 : 0;
}

#include "sd/ring.h"

const char *sd_op_name(int op)
{
    static const char *const names[SD_OP_COUNT] = {"nop",  "fetch", "release", "push",
                                                   "step", "init",  "ready",   "drop",
                                                   "save", "write", "written", "read"};
    return op >= 0 && op < SD_OP_COUNT ? names[op] : "unknown-op";
}

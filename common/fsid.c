/* A thread's filesystem identity (sd/fsid.h). */
#include "sd/fsid.h"
#include "sd/status.h"

#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

/* the raw system calls: glibc's wrappers of setgroups (and setuid & co.) change every thread */
static long sys_setfsuid(uid_t uid)
{
    return syscall(SYS_setfsuid, uid);
}

static long sys_setfsgid(gid_t gid)
{
    return syscall(SYS_setfsgid, gid);
}

static long sys_setgroups(uint32_t n, const gid_t *groups)
{
    return syscall(SYS_setgroups, (size_t)n, groups);
}

void sd_fsid_current(struct sd_fsid *id_p)
{
    memset(id_p, 0, sizeof(*id_p));
    /* an invalid id changes nothing and returns the current one */
    id_p->uid = (uid_t)sys_setfsuid((uid_t)-1);
    id_p->gid = (gid_t)sys_setfsgid((gid_t)-1);
    long n = syscall(SYS_getgroups, SD_FSID_MAX_GROUPS, id_p->groups);
    id_p->n_groups = n > 0 ? (uint32_t)n : 0;
}

void sd_fsid_leave(const struct sd_fsid *saved)
{
    sys_setfsuid(saved->uid); /* first: the capabilities come back with uid 0 */
    sys_setfsgid(saved->gid);
    sys_setgroups(saved->n_groups, saved->groups);
}

int sd_fsid_enter(const struct sd_fsid *id, struct sd_fsid *saved_p)
{
    sd_fsid_current(saved_p);
    if (id->n_groups > SD_FSID_MAX_GROUPS)
        return SD_EINVAL;
    /* a process that cannot switch acts for its own uid as it is */
    if (id->uid == saved_p->uid && !sd_fsid_can_switch())
        return SD_OK;
    /* groups first: setgroups needs CAP_SETGID, which a filesystem uid change keeps, but the
     * order is the one that leaves the thread nothing of both identities on a failure */
    if (sys_setgroups(id->n_groups, id->groups) != 0)
        return SD_EPERM;
    sys_setfsgid(id->gid);
    sys_setfsuid(id->uid);
    struct sd_fsid now;
    sd_fsid_current(&now);
    if (now.uid != id->uid || now.gid != id->gid) {
        sd_fsid_leave(saved_p);
        return SD_EPERM;
    }
    return SD_OK;
}

static bool can_switch;
static pthread_once_t can_switch_once = PTHREAD_ONCE_INIT;

static void read_caps(void)
{
    FILE *f = fopen("/proc/self/status", "r");
    char line[256];
    unsigned long long eff = 0;
    bool found = false;
    while (f != NULL && fgets(line, sizeof(line), f) != NULL)
        if (sscanf(line, "CapEff: %llx", &eff) == 1) {
            found = true;
            break;
        }
    if (f != NULL)
        fclose(f);
    /* CAP_SETGID is 6, CAP_SETUID 7 */
    can_switch = found ? (eff & (1ULL << 6)) && (eff & (1ULL << 7)) : geteuid() == 0;
}

bool sd_fsid_can_switch(void)
{
    pthread_once(&can_switch_once, read_caps);
    return can_switch;
}

bool sd_fsid_can_act_as(uid_t uid)
{
    return uid == geteuid() || sd_fsid_can_switch();
}

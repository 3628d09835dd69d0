/* A thread's filesystem identity (DESIGN.md section 4, least privilege): the uid, gid and
 * supplementary groups the kernel checks a path operation against and gives a file it creates.
 *
 * shardd runs as root (or a service user with CAP_SETUID and CAP_SETGID) beside its users, and
 * every file a job's checkpoint reads or writes is touched with the job owner's rights, never
 * the daemon's: the thread doing the work takes the owner's identity for the time of it
 * (setfsuid/setfsgid and the thread's own groups, raw system calls that change this thread only,
 * unlike glibc's setuid family, which changes every thread of the process). When the filesystem
 * uid changes from 0 to another, the kernel drops the filesystem capabilities (CAP_DAC_OVERRIDE,
 * CAP_FOWNER, CAP_CHOWN, ...) from the thread's effective set, and gives them back on the way
 * back. */
#ifndef SD_FSID_H
#define SD_FSID_H

#include <stdbool.h>
#include <stdint.h>
#include <sys/types.h>

#define SD_FSID_MAX_GROUPS 64

struct sd_fsid {
    uid_t uid;
    gid_t gid;
    uint32_t n_groups;
    gid_t groups[SD_FSID_MAX_GROUPS];
};

/* This thread's identity. */
void sd_fsid_current(struct sd_fsid *id_p);
/* Take id on this thread (saved_p: the one to go back to). SD_OK, or SD_EPERM when the process
 * may not (no CAP_SETUID/CAP_SETGID), with the thread unchanged. */
int sd_fsid_enter(const struct sd_fsid *id, struct sd_fsid *saved_p);
/* Back to saved (what sd_fsid_enter gave). */
void sd_fsid_leave(const struct sd_fsid *saved);
/* May this process act with uid's rights: it is that uid, or it holds CAP_SETUID and CAP_SETGID
 * (root has both). */
bool sd_fsid_can_act_as(uid_t uid);
/* Does this process hold CAP_SETUID and CAP_SETGID in its effective set? */
bool sd_fsid_can_switch(void);

#endif

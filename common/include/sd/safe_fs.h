/* Filesystem work on names a client or a peer supplied (DESIGN.md section 4, least privilege).
 *
 * A checkpoint directory is opened once by its path (with the rights of the thread's filesystem
 * identity, sd/fsid.h); everything in it is reached relative to that directory's fd by one
 * name component, resolved with openat2(RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS |
 * RESOLVE_NO_MAGICLINKS) (openat with O_NOFOLLOW where the kernel has no openat2: the same for
 * one component). Files a caller supplied are opened O_NONBLOCK (a FIFO cannot block the
 * opener), checked with fstat to be regular files of the expected owner and size, and only then
 * read. Files are created with O_CREAT | O_EXCL, temporary directories under unpredictable names
 * with a mkdirat that fails on EEXIST, and removal goes through unlinkat below a directory fd,
 * so a symlink planted anywhere is never followed. Errors are negative errno values. */
#ifndef SD_SAFE_FS_H
#define SD_SAFE_FS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/stat.h>
#include <sys/types.h>

#define SD_FS_ANY_OWNER ((uid_t)-1)

/* Is name one path component (not empty, no '/', not "." or "..")? */
bool sd_fs_name_ok(const char *name);
/* The directory at path (symlinks in it are followed with this thread's rights, as a shell's cd
 * would; a relative path is the process's working directory's: the daemon takes absolute ones
 * only), made with mode when create and its last component is missing. An O_DIRECTORY fd, or a
 * negative errno. */
int sd_fs_dir_open(const char *path, bool create, mode_t mode);
/* name below dirfd (one component, never a symlink): an fd, or a negative errno (-EINVAL for a
 * name that is not one component, -ELOOP for a symlink). */
int sd_fs_openat(int dirfd, const char *name, int flags, mode_t mode);
/* The subdirectory name of dirfd: an O_DIRECTORY fd, or a negative errno. */
int sd_fs_subdir(int dirfd, const char *name);
/* Open name below dirfd to read a file someone else supplied: O_NONBLOCK and extra_flags
 * (O_DIRECT, say), then refused unless it is a regular file owned by owner (SD_FS_ANY_OWNER:
 * anyone) of at most max_bytes (0: any size). err says which check failed. An fd, or a negative
 * errno (-EINVAL for a file of the wrong kind or size, -EPERM for one of another owner). */
int sd_fs_open_input(int dirfd, const char *name, uid_t owner, uint64_t max_bytes, int extra_flags,
                     struct stat *st_p, char *err, size_t errlen);
/* A whole small input file (checked as sd_fs_open_input does) into a NUL-terminated malloc'd
 * buffer. */
int sd_fs_read_input(int dirfd, const char *name, uid_t owner, uint64_t max_bytes, char **buf_p,
                     size_t *len_p, char *err, size_t errlen);
/* A new directory prefix + 16 random hex digits below dirfd (mkdirat, a new name on EEXIST);
 * its name into name (len bytes) and an O_DIRECTORY fd of it, or a negative errno. */
int sd_fs_mkdtemp(int dirfd, const char *prefix, mode_t mode, char *name, size_t len);
/* n random bytes from the kernel (getrandom) */
int sd_fs_random(void *buf, size_t n);
/* Remove name below dirfd: a directory is emptied with unlinkat (its files; a subdirectory is
 * removed only when empty: nothing is followed) and removed; a file or symlink is unlinked
 * itself, never what it points to. */
int sd_fs_remove(int dirfd, const char *name);
/* fsync of name below dirfd (a directory or a file), or of dirfd itself when name is NULL */
int sd_fs_fsync(int dirfd, const char *name);
/* Write len bytes to fd (EINTR and short writes retried). */
int sd_fs_write_all(int fd, const void *p, size_t len);

#endif

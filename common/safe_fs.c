/* Filesystem work on names a client or a peer supplied (sd/safe_fs.h). */
#include "sd/safe_fs.h"
#include "sd/status.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <linux/openat2.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <sys/syscall.h>
#include <unistd.h>

bool sd_fs_name_ok(const char *name)
{
    return name != NULL && name[0] != '\0' && strchr(name, '/') == NULL && strcmp(name, ".") != 0 &&
           strcmp(name, "..") != 0;
}

int sd_fs_dir_open(const char *path, bool create, mode_t mode)
{
    if (path == NULL || path[0] == '\0')
        return -EINVAL;
    if (create && mkdir(path, mode) != 0 && errno != EEXIST)
        return -errno;
    int fd = open(path, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    return fd >= 0 ? fd : -errno;
}

int sd_fs_openat(int dirfd, const char *name, int flags, mode_t mode)
{
    if (!sd_fs_name_ok(name))
        return -EINVAL;
    struct open_how how = {.flags = (uint64_t)(flags | O_CLOEXEC),
                           .mode = (flags & O_CREAT) ? mode : 0,
                           .resolve =
                               RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS};
    long fd = syscall(SYS_openat2, dirfd, name, &how, sizeof(how));
    if (fd >= 0)
        return (int)fd;
    if (errno != ENOSYS)
        return -errno;
    /* no openat2 (Linux before 5.6): one component with O_NOFOLLOW is resolved the same */
    int f = openat(dirfd, name, flags | O_CLOEXEC | O_NOFOLLOW, mode);
    return f >= 0 ? f : -errno;
}

int sd_fs_subdir(int dirfd, const char *name)
{
    return sd_fs_openat(dirfd, name, O_RDONLY | O_DIRECTORY, 0);
}

static const char *kind_name(mode_t m)
{
    return S_ISDIR(m)    ? "a directory"
           : S_ISFIFO(m) ? "a FIFO"
           : S_ISSOCK(m) ? "a socket"
           : S_ISCHR(m)  ? "a character device"
           : S_ISBLK(m)  ? "a block device"
           : S_ISLNK(m)  ? "a symbolic link"
                         : "not a regular file";
}

/* the checks of sd_fs_open_input on what fstat(at) said */
static int input_check(const struct stat *st, const char *name, uid_t owner, uint64_t max_bytes,
                       char *err, size_t errlen)
{
    if (!S_ISREG(st->st_mode)) {
        snprintf(err, errlen, "%s is %s, not a regular file", name, kind_name(st->st_mode));
        return -EINVAL;
    }
    if (owner != SD_FS_ANY_OWNER && st->st_uid != owner) {
        snprintf(err, errlen, "%s belongs to uid %u, not to the job's uid %u", name,
                 (unsigned)st->st_uid, (unsigned)owner);
        return -EPERM;
    }
    if (max_bytes != 0 && (uint64_t)st->st_size > max_bytes) {
        snprintf(err, errlen, "%s has %lld bytes, more than the %llu this reader takes", name,
                 (long long)st->st_size, (unsigned long long)max_bytes);
        return -EFBIG;
    }
    return 0;
}

int sd_fs_open_input(int dirfd, const char *name, uid_t owner, uint64_t max_bytes, int extra_flags,
                     struct stat *st_p, char *err, size_t errlen)
{
    struct stat before, st;
    if (!sd_fs_name_ok(name)) {
        snprintf(err, errlen, "'%s' is not a file name", name);
        return -EINVAL;
    }
    /* refused before it is opened: opening a device can act on it */
    if (fstatat(dirfd, name, &before, AT_SYMLINK_NOFOLLOW) != 0) {
        int e = errno;
        snprintf(err, errlen, "%s: %s", name, strerror(e));
        return -e;
    }
    int st_err = input_check(&before, name, owner, max_bytes, err, errlen);
    if (st_err != 0)
        return st_err;
    int fd = sd_fs_openat(dirfd, name, O_RDONLY | O_NONBLOCK | extra_flags, 0);
    if (fd < 0) {
        snprintf(err, errlen, "%s: %s", name, strerror(-fd));
        return fd;
    }
    if (fstat(fd, &st) != 0) {
        int e = errno;
        close(fd);
        snprintf(err, errlen, "%s: %s", name, strerror(e));
        return -e;
    }
    if (st.st_dev != before.st_dev || st.st_ino != before.st_ino) {
        close(fd);
        snprintf(err, errlen, "%s was replaced while it was opened", name);
        return -EAGAIN;
    }
    if ((st_err = input_check(&st, name, owner, max_bytes, err, errlen)) != 0) {
        close(fd);
        return st_err;
    }
    if (st_p != NULL)
        *st_p = st;
    return fd;
}

int sd_fs_read_input(int dirfd, const char *name, uid_t owner, uint64_t max_bytes, char **buf_p,
                     size_t *len_p, char *err, size_t errlen)
{
    struct stat st;
    int fd = sd_fs_open_input(dirfd, name, owner, max_bytes, 0, &st, err, errlen);
    if (fd < 0)
        return fd;
    size_t cap = (size_t)st.st_size + 1, len = 0;
    char *buf = malloc(cap);
    if (buf == NULL) {
        close(fd);
        snprintf(err, errlen, "%s: out of memory for %zu bytes", name, cap);
        return -ENOMEM;
    }
    /* no more than fstat said (plus one byte to see that it grew): a file that grows while it
     * is read does not grow the buffer */
    while (len < cap) {
        ssize_t n = read(fd, buf + len, cap - len);
        if (n < 0 && errno == EINTR)
            continue;
        if (n < 0) {
            int e = errno;
            snprintf(err, errlen, "%s: %s", name, strerror(e));
            free(buf);
            close(fd);
            return -e;
        }
        if (n == 0)
            break;
        len += (size_t)n;
    }
    close(fd);
    if (len == cap) {
        snprintf(err, errlen, "%s grew while it was read", name);
        free(buf);
        return -EAGAIN;
    }
    buf[len] = '\0';
    *buf_p = buf;
    *len_p = len;
    return 0;
}

int sd_fs_random(void *buf, size_t n)
{
    size_t got = 0;
    while (got < n) {
        ssize_t r = getrandom((uint8_t *)buf + got, n - got, 0);
        if (r < 0 && errno == EINTR)
            continue;
        if (r < 0)
            return -errno;
        got += (size_t)r;
    }
    return 0;
}

int sd_fs_mkdtemp(int dirfd, const char *prefix, mode_t mode, char *name, size_t len)
{
    for (int attempt = 0; attempt < 16; attempt++) {
        uint8_t r[8];
        int st = sd_fs_random(r, sizeof(r));
        if (st != 0)
            return st;
        int n = snprintf(name, len, "%s%02x%02x%02x%02x%02x%02x%02x%02x", prefix, r[0], r[1], r[2],
                         r[3], r[4], r[5], r[6], r[7]);
        if (n < 0 || (size_t)n >= len || !sd_fs_name_ok(name))
            return -ENAMETOOLONG;
        if (mkdirat(dirfd, name, mode) == 0)
            return sd_fs_subdir(dirfd, name);
        if (errno != EEXIST)
            return -errno;
    }
    return -EEXIST;
}

int sd_fs_remove(int dirfd, const char *name)
{
    int fd = sd_fs_subdir(dirfd, name);
    if (fd == -ELOOP || fd == -ENOTDIR) /* a symlink or a file: itself only */
        return unlinkat(dirfd, name, 0) == 0 ? 0 : -errno;
    if (fd < 0)
        return fd;
    int lfd = dup(fd);
    DIR *d = lfd >= 0 ? fdopendir(lfd) : NULL;
    if (d == NULL) {
        int e = errno;
        if (lfd >= 0)
            close(lfd);
        close(fd);
        return -e;
    }
    struct dirent *de;
    while ((de = readdir(d)) != NULL) {
        if (strcmp(de->d_name, ".") == 0 || strcmp(de->d_name, "..") == 0)
            continue;
        if (unlinkat(fd, de->d_name, 0) != 0 && errno == EISDIR)
            unlinkat(fd, de->d_name, AT_REMOVEDIR); /* an empty one only: nothing recursive */
    }
    closedir(d);
    close(fd);
    return unlinkat(dirfd, name, AT_REMOVEDIR) == 0 ? 0 : -errno;
}

int sd_fs_fsync(int dirfd, const char *name)
{
    if (name == NULL)
        return fsync(dirfd) == 0 ? 0 : -errno;
    int fd = sd_fs_openat(dirfd, name, O_RDONLY, 0);
    if (fd < 0)
        return fd;
    int st = fsync(fd) == 0 ? 0 : -errno;
    close(fd);
    return st;
}

int sd_fs_write_all(int fd, const void *p, size_t len)
{
    const uint8_t *b = p;
    while (len > 0) {
        ssize_t n = write(fd, b, len < ((size_t)1 << 30) ? len : ((size_t)1 << 30));
        if (n < 0 && errno == EINTR)
            continue;
        if (n < 0)
            return -errno;
        b += n;
        len -= (size_t)n;
    }
    return 0;
}

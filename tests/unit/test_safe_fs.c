/* The file layer a root daemon uses on names users supply (sd/safe_fs.h), the filesystem
 * identity its threads take (sd/fsid.h), and the commit of a checkpoint (sd_ckpt_commit):
 *  - one name component only, never through a symlink; inputs that are FIFOs, sockets,
 *    directories, devices, another uid's or too large are refused without blocking or reading;
 *  - a temporary directory's name is new each time and mkdirat never takes an existing one;
 *    removal unlinks what a symlink is, never what it points to;
 *  - a thread that takes uid 61001 cannot create in a root-only directory, creates files that
 *    61001 owns, hands its identity to the threads it starts, and is root again after; other
 *    threads stay root meanwhile;
 *  - a commit over a checkpoint of the same step keeps the old one until LATEST is written:
 *    with the filesystem full (a 1 MiB tmpfs) the old one is back in place, LATEST untouched,
 *    the new one back under its temporary name. */
#include "check.h"
#include "harness.h"
#include "sd/ckpt.h"
#include "sd/fsid.h"
#include "sd/safe_fs.h"
#include "sd/status.h"
#include "sd/util.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mount.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <sys/un.h>
#include <unistd.h>

#define USER 61001

static char base[64];

static void write_file(const char *path, const char *text)
{
    FILE *f = fopen(path, "w");
    TH_CHECK(f != NULL, "create %s: %s", path, strerror(errno));
    if (f != NULL) {
        fputs(text, f);
        fclose(f);
    }
}

static void test_names(int dfd)
{
    char p[256];
    snprintf(p, sizeof(p), "%s/file", base);
    write_file(p, "x");
    snprintf(p, sizeof(p), "%s/link", base);
    TH_CHECK(symlink("/etc/passwd", p) == 0, "symlink");
    int fd = sd_fs_openat(dfd, "file", O_RDONLY, 0);
    TH_CHECK(fd >= 0, "a plain file: %s", strerror(-fd));
    if (fd >= 0)
        close(fd);
    TH_CHECK(sd_fs_openat(dfd, "link", O_RDONLY, 0) == -ELOOP, "a symlink is not followed");
    TH_CHECK(sd_fs_openat(dfd, "../etc", O_RDONLY, 0) == -EINVAL, "a name with a slash");
    TH_CHECK(sd_fs_openat(dfd, "..", O_RDONLY, 0) == -EINVAL, "'..'");
    TH_CHECK(sd_fs_openat(dfd, "", O_RDONLY, 0) == -EINVAL, "an empty name");
    TH_CHECK(sd_fs_openat(dfd, "file", O_WRONLY | O_CREAT | O_EXCL, 0600) == -EEXIST,
             "O_EXCL over an existing file");
    fd = sd_fs_openat(dfd, "link", O_WRONLY | O_CREAT | O_EXCL, 0600);
    TH_CHECK(fd == -EEXIST || fd == -ELOOP, "O_CREAT through a symlink: %d", fd);
    struct stat st;
    TH_CHECK(stat("/etc/passwd", &st) == 0 && st.st_size > 0, "/etc/passwd untouched");
}

static void test_inputs(int dfd)
{
    char p[256], err[256];
    snprintf(p, sizeof(p), "%s/fifo", base);
    TH_CHECK(mkfifo(p, 0600) == 0, "mkfifo");
    snprintf(p, sizeof(p), "%s/sock", base);
    int s = socket(AF_UNIX, SOCK_STREAM, 0);
    struct sockaddr_un a = {.sun_family = AF_UNIX};
    snprintf(a.sun_path, sizeof(a.sun_path), "%s/sock", base);
    TH_CHECK(bind(s, (struct sockaddr *)&a, sizeof(a)) == 0, "bind a socket file");
    snprintf(p, sizeof(p), "%s/sub", base);
    mkdir(p, 0700);
    snprintf(p, sizeof(p), "%s/big", base);
    write_file(p, "0123456789");
    bool root = geteuid() == 0;
    if (root) {
        snprintf(p, sizeof(p), "%s/null", base);
        TH_CHECK(mknod(p, S_IFCHR | 0600, makedev(1, 3)) == 0, "mknod");
    }
    struct {
        const char *name, *word;
        uid_t owner;
        uint64_t max;
    } cases[] = {{"fifo", "a FIFO", SD_FS_ANY_OWNER, 0},
                 {"sock", "a socket", SD_FS_ANY_OWNER, 0},
                 {"sub", "a directory", SD_FS_ANY_OWNER, 0},
                 {"null", "a character device", SD_FS_ANY_OWNER, 0},
                 {"link", "a symbolic link", SD_FS_ANY_OWNER, 0},
                 {"big", "more than the 4", SD_FS_ANY_OWNER, 4},
                 {"big", "not to the job's uid 4242", 4242, 0}};
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        if (!root && strcmp(cases[i].name, "null") == 0)
            continue;
        double t0 = th_now_s();
        int fd = sd_fs_open_input(dfd, cases[i].name, cases[i].owner, cases[i].max, 0, NULL, err,
                                  sizeof(err));
        TH_CHECK(fd < 0 && strstr(err, cases[i].word) != NULL, "input %s: %d '%s' (want '%s')",
                 cases[i].name, fd, err, cases[i].word);
        TH_CHECK(th_now_s() - t0 < 1.0, "refusing %s took %.2f s", cases[i].name, th_now_s() - t0);
        if (fd >= 0)
            close(fd);
    }
    close(s);
    char *buf = NULL;
    size_t len = 0;
    int st = sd_fs_read_input(dfd, "big", SD_FS_ANY_OWNER, 10, &buf, &len, err, sizeof(err));
    TH_CHECK(st == 0 && len == 10 && memcmp(buf, "0123456789", 10) == 0 && buf[10] == '\0',
             "reading a file of exactly the bound: %d '%s'", st, err);
    free(buf);
}

static void test_tmp_and_remove(int dfd)
{
    char a[64], b[64], p[256];
    int fa = sd_fs_mkdtemp(dfd, ".tmp-x-", 0750, a, sizeof(a));
    int fb = sd_fs_mkdtemp(dfd, ".tmp-x-", 0750, b, sizeof(b));
    TH_CHECK(fa >= 0 && fb >= 0 && strcmp(a, b) != 0 && strlen(a) == 7 + 16,
             "two temporary directories: '%s' '%s'", a, b);
    /* a file in one, a symlink to a file outside in the other: removing both leaves the
     * outside file */
    int f = sd_fs_openat(fa, "data", O_WRONLY | O_CREAT | O_EXCL, 0600);
    TH_CHECK(f >= 0, "a file in the temporary directory");
    if (f >= 0)
        close(f);
    snprintf(p, sizeof(p), "%s/outside", base);
    write_file(p, "keep me");
    TH_CHECK(symlinkat(p, fb, "data") == 0, "a symlink in the other");
    TH_CHECK(sd_fs_remove(dfd, a) == 0 && sd_fs_remove(dfd, b) == 0, "removing both");
    struct stat st;
    TH_CHECK(fstatat(dfd, a, &st, AT_SYMLINK_NOFOLLOW) != 0 &&
                 fstatat(dfd, b, &st, AT_SYMLINK_NOFOLLOW) != 0,
             "both are gone");
    TH_CHECK(stat(p, &st) == 0 && st.st_size == 7, "the file the symlink named is intact");
    /* a symlink named like a temporary directory, to a directory: only the link goes */
    snprintf(p, sizeof(p), "%s/victim", base);
    mkdir(p, 0700);
    char q[256];
    snprintf(q, sizeof(q), "%s/victim/keep", base);
    write_file(q, "x");
    TH_CHECK(symlinkat(p, dfd, ".tmp-x-link") == 0, "a planted symlink");
    TH_CHECK(sd_fs_remove(dfd, ".tmp-x-link") == 0, "removing the planted symlink");
    TH_CHECK(stat(q, &st) == 0, "the directory it named keeps its file");
    close(fa);
    close(fb);
}

/* ---- identity */

struct id_probe {
    uid_t fsuid;
};

static void *probe(void *arg)
{
    struct sd_fsid now;
    sd_fsid_current(&now);
    ((struct id_probe *)arg)->fsuid = now.uid;
    return NULL;
}

static void test_fsid(void)
{
    if (geteuid() != 0) {
        printf("not root: the identity checks do not run\n");
        return;
    }
    char ro[256], mine[256];
    snprintf(ro, sizeof(ro), "%s/rootonly", base);
    mkdir(ro, 0755);
    snprintf(mine, sizeof(mine), "%s/user", base);
    mkdir(mine, 0700);
    TH_CHECK(chown(mine, USER, USER) == 0, "chown");
    struct sd_fsid id = {.uid = USER, .gid = USER, .n_groups = 1, .groups = {USER}}, saved;
    TH_CHECK(sd_fsid_can_switch() && sd_fsid_can_act_as(USER), "root can act as another uid");
    TH_CHECK(sd_fsid_enter(&id, &saved) == SD_OK, "taking uid %d", USER);
    struct id_probe other = {0}, child = {0};
    int dfd = sd_fs_dir_open(ro, false, 0);
    int made = dfd >= 0 ? mkdirat(dfd, "x", 0700) : -1;
    TH_CHECK(made != 0 && errno == EACCES, "uid %d made a directory in a root-only one", USER);
    int mfd = sd_fs_dir_open(mine, false, 0);
    int f = mfd >= 0 ? sd_fs_openat(mfd, "f", O_WRONLY | O_CREAT | O_EXCL, 0640) : -1;
    struct stat st;
    TH_CHECK(f >= 0 && fstat(f, &st) == 0 && st.st_uid == USER && st.st_gid == USER,
             "a file created as uid %d is its", USER);
    pthread_t t;
    pthread_create(&t, NULL, probe, &child); /* started under the identity: takes it */
    pthread_join(t, NULL);
    TH_CHECK(child.fsuid == USER, "a thread started meanwhile has fsuid %u", child.fsuid);
    sd_fsid_leave(&saved);
    struct sd_fsid now;
    sd_fsid_current(&now);
    TH_CHECK(now.uid == 0 && now.gid == 0, "back to root: %u/%u", now.uid, now.gid);
    pthread_create(&t, NULL, probe, &other);
    pthread_join(t, NULL);
    TH_CHECK(other.fsuid == 0, "a thread started after has fsuid %u", other.fsuid);
    TH_CHECK(mkdirat(dfd, "y", 0700) == 0, "root again makes a directory there");
    if (f >= 0)
        close(f);
    if (mfd >= 0)
        close(mfd);
    if (dfd >= 0)
        close(dfd);
}

/* ---- the commit */

static void manifest(int dirfd, const char *sub, const char *text)
{
    int d = sd_fs_subdir(dirfd, sub);
    int f = d >= 0 ? sd_fs_openat(d, "MANIFEST", O_WRONLY | O_CREAT | O_TRUNC, 0640) : -1;
    TH_CHECK(f >= 0 && sd_fs_write_all(f, text, strlen(text)) == 0, "a manifest in %s", sub);
    if (f >= 0)
        close(f);
    if (d >= 0)
        close(d);
}

static char *read_at(int dirfd, const char *path)
{
    char *buf = NULL;
    size_t len;
    char err[256];
    const char *slash = strchr(path, '/');
    int d = slash ? -1 : dirfd;
    if (slash) {
        char sub[64];
        snprintf(sub, sizeof(sub), "%.*s", (int)(slash - path), path);
        d = sd_fs_subdir(dirfd, sub);
        path = slash + 1;
    }
    if (d >= 0 &&
        sd_fs_read_input(d, path, SD_FS_ANY_OWNER, 1 << 20, &buf, &len, err, sizeof(err)) != 0)
        buf = NULL;
    if (slash && d >= 0)
        close(d);
    return buf;
}

static void test_commit(void)
{
    char dir[256], err[512];
    snprintf(dir, sizeof(dir), "%s/ck", base);
    mkdir(dir, 0755);
    int dfd = sd_fs_dir_open(dir, false, 0);
    mkdirat(dfd, ".tmp-j-a", 0750);
    manifest(dfd, ".tmp-j-a", "old");
    int st = sd_ckpt_commit(dfd, dir, ".tmp-j-a", "step-00000002", err, sizeof(err));
    char *latest = read_at(dfd, "LATEST");
    TH_CHECK(st == 0 && latest && strcmp(latest, "step-00000002\n") == 0, "a first commit: %s",
             err);
    free(latest);
    /* the same step again: replaced, the old one gone */
    mkdirat(dfd, ".tmp-j-b", 0750);
    manifest(dfd, ".tmp-j-b", "new");
    st = sd_ckpt_commit(dfd, dir, ".tmp-j-b", "step-00000002", err, sizeof(err));
    char *m = read_at(dfd, "step-00000002/MANIFEST");
    struct stat sb;
    TH_CHECK(st == 0 && m && strcmp(m, "new") == 0 &&
                 fstatat(dfd, ".tmp-j-b", &sb, AT_SYMLINK_NOFOLLOW) != 0,
             "the same step again: %s, manifest '%s'", err, m ? m : "");
    free(m);
    /* a symlink where the checkpoint goes is not replaced */
    mkdirat(dfd, ".tmp-j-c", 0750);
    manifest(dfd, ".tmp-j-c", "x");
    TH_CHECK(symlinkat("/etc", dfd, "step-00000003") == 0, "symlink: %s", strerror(errno));
    st = sd_ckpt_commit(dfd, dir, ".tmp-j-c", "step-00000003", err, sizeof(err));
    TH_CHECK(st == SD_EEXIST && fstatat(dfd, ".tmp-j-c", &sb, AT_SYMLINK_NOFOLLOW) == 0,
             "a symlink in the checkpoint's place: %d '%s'", st, err);
    close(dfd);

    if (geteuid() != 0)
        return;
    /* a full filesystem: LATEST cannot be written, the old checkpoint of the step stays */
    char small[256];
    snprintf(small, sizeof(small), "%s/small", base);
    mkdir(small, 0755);
    if (mount("none", small, "tmpfs", 0, "size=64k,nr_inodes=64") != 0) {
        TH_CHECK(false, "mounting a small tmpfs: %s", strerror(errno));
        return;
    }
    dfd = sd_fs_dir_open(small, false, 0);
    mkdirat(dfd, ".tmp-j-a", 0750);
    manifest(dfd, ".tmp-j-a", "old");
    st = sd_ckpt_commit(dfd, small, ".tmp-j-a", "step-00000005", err, sizeof(err));
    TH_CHECK(st == 0, "a first commit on the small filesystem: %s", err);
    mkdirat(dfd, ".tmp-j-b", 0750);
    manifest(dfd, ".tmp-j-b", "new");
    /* fill it: the next file of a page fails */
    int fill = sd_fs_openat(dfd, "fill", O_WRONLY | O_CREAT | O_EXCL, 0600);
    char page[4096] = {0};
    while (fill >= 0 && write(fill, page, sizeof(page)) == sizeof(page))
        ;
    if (fill >= 0)
        close(fill);
    st = sd_ckpt_commit(dfd, small, ".tmp-j-b", "step-00000005", err, sizeof(err));
    m = read_at(dfd, "step-00000005/MANIFEST");
    char *n = read_at(dfd, ".tmp-j-b/MANIFEST");
    latest = read_at(dfd, "LATEST");
    TH_CHECK(st == -ENOSPC && strstr(err, "writing LATEST") && strstr(err, "No space left") &&
                 strstr(err, "kept"),
             "a full filesystem: %d '%s'", st, err);
    TH_CHECK(m && strcmp(m, "old") == 0, "the old checkpoint is back in place: '%s'",
             m ? m : "(none)");
    TH_CHECK(n && strcmp(n, "new") == 0, "the new one is back under its temporary name");
    TH_CHECK(latest && strcmp(latest, "step-00000005\n") == 0, "LATEST still names it");
    printf("commit on a full filesystem: %s\n", err);
    free(m);
    free(n);
    free(latest);
    close(dfd);
    umount(small);
}

static void test_utf8(void)
{
    static const struct {
        const char *s;
        bool ok;
    } cases[] = {{"fc0.weight", true},
                 {"caf\xc3\xa9", true},
                 {"\xe2\x82\xac", true},
                 {"\xf0\x9f\x98\x80", true},
                 {"\xff\xfe", false},
                 {"\xc0\xaf", false /* overlong '/' */},
                 {"\xed\xa0\x80", false /* a surrogate */},
                 {"\xf4\x90\x80\x80", false /* past U+10FFFF */},
                 {"\xe2\x82", false /* cut */},
                 {"\x80", false}};
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++)
        TH_CHECK(sd_utf8_valid(cases[i].s, strlen(cases[i].s)) == cases[i].ok, "utf-8 case %zu", i);
}

int main(void)
{
    test_utf8();
    snprintf(base, sizeof(base), "/tmp/shardd-safefs-XXXXXX");
    if (mkdtemp(base) == NULL)
        return 1;
    chmod(base, 0755);
    if (geteuid() == 0 &&
        (unshare(CLONE_NEWNS) != 0 || mount(NULL, "/", NULL, MS_REC | MS_PRIVATE, NULL) != 0))
        TH_CHECK(false, "a private mount namespace: %s", strerror(errno));
    int dfd = sd_fs_dir_open(base, false, 0);
    TH_CHECK(dfd >= 0, "open %s", base);
    test_names(dfd);
    test_inputs(dfd);
    test_tmp_and_remove(dfd);
    close(dfd);
    test_fsid();
    test_commit();
    char cmd[128];
    snprintf(cmd, sizeof(cmd), "rm -rf '%s'", base);
    if (system(cmd) != 0)
        fprintf(stderr, "could not remove %s\n", base);
    return th_summary("test_safe_fs");
}

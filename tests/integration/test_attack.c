/* Two local users against a daemon that runs as root (issue 36), replayed as an attacker would,
 * each attack refused with a clear message, and nothing outside the attacker's own tree created,
 * changed or deleted, the other user's jobs and checkpoints intact:
 *  - saves into directories the user may not write (/etc/..., root's, bob's): not created;
 *  - symlinks planted in her own save directory where the checkpoint and LATEST go, and a
 *    symlink swapped in and out while saves run: nothing of root's is touched, every file in
 *    her tree is hers;
 *  - a symlink named like a save's temporary directory, to bob's checkpoint, and a leftover
 *    directory holding a link to his data: the cleanup removes her links, bob's files stay;
 *  - loads through symlinks or hard links to bob's files and to a root-only file: refused
 *    before a byte is read (no checksum of them is printed);
 *  - a FIFO, a socket and a device as MANIFEST, a FIFO as LATEST, a 40 MB manifest: refused
 *    within a second while status keeps answering and bob trains undisturbed;
 *  - bob registering her paused job's name, a resume timeout of 1e13 ms, her `shardctl drop`:
 *    refused; root's drop frees it;
 *  - a checkpoint's lr of 1e39, a tensor name that is not UTF-8, a full filesystem: refused
 *    with what was wrong; her files are hers and she reads them.
 * Then the same under a daemon running as a service user with CAP_SETUID and CAP_SETGID only,
 * and, without them, a clear refusal of other users' checkpoint work. Needs root. */
#include "harness.h"
#include "shard.h"
#include "sd/safe_fs.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <jansson.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mount.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#define SVC   61000
#define ALICE 61001
#define BOB   61002
#define GROUP 61100

static char base[64];
static const char *sock;
static int round_no; /* names per round: the attacks run once per daemon */

static void pathf(char *out, size_t len, const char *fmt, const char *leaf)
{
    snprintf(out, len, fmt, base, leaf);
}

/* ---- acting as a user */

static void become(uid_t uid)
{
    gid_t g = GROUP;
    if (setgroups(1, &g) != 0 || setgid(uid) != 0 || setuid(uid) != 0)
        _exit(99);
}

static pid_t spawn_as(uid_t uid, const char *const *argv, const char *log)
{
    pid_t pid = fork();
    if (pid == 0) {
        int fd = open(log, O_WRONLY | O_CREAT | O_APPEND, 0644);
        if (fd >= 0) {
            dup2(fd, 1);
            dup2(fd, 2);
            close(fd);
        }
        become(uid);
        execv(argv[0], (char *const *)argv);
        _exit(127);
    }
    return pid;
}

static int as_user(uid_t uid, int (*fn)(void *), void *arg)
{
    pid_t pid = fork();
    if (pid == 0) {
        become(uid);
        _exit(fn(arg));
    }
    int st;
    waitpid(pid, &st, 0);
    return WIFEXITED(st) ? WEXITSTATUS(st) : 128;
}

/* mlp_train as uid: world 1, zero3, a small model unless extra says otherwise; its exit code,
 * its output in log */
static int train_as(uid_t uid, const char *job, const char *const *extra, char *log, size_t len)
{
    snprintf(log, len, "%s/logs/%s-%d-%d.log", base, job, round_no, (int)uid);
    unlink(log);
    const char *argv[48] = {
        th_mlp_train_path(), "--socket", sock,     "--job", job,      "--rank", "0",
        "--world",           "1",        "--plan", "zero3", "--quiet"};
    int n = 12;
    bool hidden = false;
    for (int i = 0; extra && extra[i] && n < 44; i++) {
        hidden |= strcmp(extra[i], "--hidden") == 0;
        argv[n++] = extra[i];
    }
    if (!hidden) {
        argv[n++] = "--hidden";
        argv[n++] = "16";
        argv[n++] = "--layers";
        argv[n++] = "2";
    }
    argv[n] = NULL;
    return th_wait(spawn_as(uid, argv, log), 60000);
}

static bool log_has(const char *log, const char *word)
{
    char *t = th_read_file(log, NULL);
    bool has = t != NULL && strstr(t, word) != NULL;
    free(t);
    return has;
}

static char *log_text(const char *log)
{
    char *t = th_read_file(log, NULL);
    return t ? t : strdup("(no log)");
}

/* ---- what a tree holds: names, owners, sizes, modes and modification times */

static void sig_walk(const char *path, uint64_t *h, int depth)
{
    DIR *d = opendir(path);
    if (d == NULL || depth > 8) {
        if (d)
            closedir(d);
        return;
    }
    struct dirent *de;
    while ((de = readdir(d)) != NULL) {
        if (strcmp(de->d_name, ".") == 0 || strcmp(de->d_name, "..") == 0)
            continue;
        char p[1024];
        snprintf(p, sizeof(p), "%s/%s", path, de->d_name);
        struct stat st;
        if (lstat(p, &st) != 0)
            continue;
        uint64_t v[] = {(uint64_t)st.st_ino, st.st_uid, (uint64_t)st.st_size, st.st_mode,
                        (uint64_t)st.st_mtim.tv_sec * 1000000000ull + (uint64_t)st.st_mtim.tv_nsec};
        for (const char *c = de->d_name; *c; c++)
            *h = (*h ^ (uint8_t)*c) * 1099511628211ull;
        for (size_t i = 0; i < 5; i++)
            *h = (*h ^ v[i]) * 1099511628211ull;
        if (S_ISDIR(st.st_mode))
            sig_walk(p, h, depth + 1);
    }
    closedir(d);
}

static uint64_t tree_sig(const char *path)
{
    uint64_t h = 14695981039346656037ull;
    sig_walk(path, &h, 0);
    return h;
}

/* entries under path not owned by uid, counted (and the first named) */
static int foreign_entries(const char *path, uid_t uid, char *first, size_t len)
{
    DIR *d = opendir(path);
    int n = 0;
    struct dirent *de;
    while (d != NULL && (de = readdir(d)) != NULL) {
        if (strcmp(de->d_name, ".") == 0 || strcmp(de->d_name, "..") == 0)
            continue;
        char p[1024];
        snprintf(p, sizeof(p), "%s/%s", path, de->d_name);
        struct stat st;
        if (lstat(p, &st) != 0)
            continue;
        if (st.st_uid != uid && n++ == 0)
            snprintf(first, len, "%.400s (uid %u)", p, (unsigned)st.st_uid);
        if (S_ISDIR(st.st_mode)) {
            char sub[512] = "";
            int m = foreign_entries(p, uid, sub, sizeof(sub));
            if (m > 0 && n == 0)
                snprintf(first, len, "%s", sub);
            n += m;
        }
    }
    if (d)
        closedir(d);
    return n;
}

/* ---- the planting a user does in her own tree */

struct plant {
    const char *what; /* symlink, fifo, dir, socket, big, rm, copy-edit */
    char a[512], b[512];
};

static int do_plant(void *arg)
{
    struct plant *p = arg;
    if (strcmp(p->what, "symlink") == 0)
        return symlink(p->a, p->b) != 0;
    if (strcmp(p->what, "fifo") == 0)
        return mkfifo(p->a, 0600) != 0;
    if (strcmp(p->what, "dir") == 0)
        return mkdir(p->a, 0750) != 0 && errno != EEXIST;
    if (strcmp(p->what, "rm") == 0)
        return unlink(p->a) != 0;
    if (strcmp(p->what, "socket") == 0) {
        int s = socket(AF_UNIX, SOCK_STREAM, 0);
        struct sockaddr_un u = {.sun_family = AF_UNIX};
        if (strlen(p->a) >= sizeof(u.sun_path))
            return 3;
        memcpy(u.sun_path, p->a, strlen(p->a) + 1);
        return bind(s, (struct sockaddr *)&u, sizeof(u)) != 0;
    }
    if (strcmp(p->what, "big") == 0) { /* 40 MB of a JSON array that never ends */
        FILE *f = fopen(p->a, "w");
        if (f == NULL)
            return 1;
        fputs("{\"extents\": [", f);
        for (int i = 0; i < 40 * 1024; i++)
            for (int j = 0; j < 32; j++)
                fputs("{\"state\": \"master\", \"x\": 1},", f);
        fclose(f);
        return 0;
    }
    if (strcmp(p->what, "read") == 0) { /* she reads her own file */
        int fd = open(p->a, O_RDONLY);
        char c;
        int ok = fd >= 0 && read(fd, &c, 1) == 1;
        if (fd >= 0)
            close(fd);
        return !ok;
    }
    return 2;
}

static void plant(uid_t uid, const char *what, const char *a, const char *b)
{
    struct plant p = {.what = what};
    snprintf(p.a, sizeof(p.a), "%s", a);
    snprintf(p.b, sizeof(p.b), "%s", b ? b : "");
    TH_CHECK(as_user(uid, do_plant, &p) == 0, "uid %u: %s %s %s", (unsigned)uid, what, a,
             b ? b : "");
}

/* ---- a poller: status answers throughout */

static atomic_int polling;
static double worst_status_s;

static void *poller(void *arg)
{
    (void)arg;
    while (atomic_load(&polling)) {
        double t0 = th_now_s();
        char *s = th_admin(sock, "status");
        double took = th_now_s() - t0;
        if (took > worst_status_s)
            worst_status_s = took;
        free(s);
        usleep(20000);
    }
    return NULL;
}

static long rss_kb(pid_t pid)
{
    char path[64], line[256];
    snprintf(path, sizeof(path), "/proc/%d/status", (int)pid);
    FILE *f = fopen(path, "r");
    long kb = -1;
    while (f && fgets(line, sizeof(line), f))
        if (sscanf(line, "VmRSS: %ld", &kb) == 1)
            break;
    if (f)
        fclose(f);
    return kb;
}

/* ---- the attacks */

static void foreign_dirs(void)
{
    char p[5][512], log[512];
    snprintf(p[0], sizeof(p[0]), "/etc/shardd-attack-%d-%d", (int)getpid(), round_no);
    snprintf(p[1], sizeof(p[1]), "/etc/systemd/system/shardd-attack-%d-%d.service.d", (int)getpid(),
             round_no);
    pathf(p[2], sizeof(p[2]), "%s/rootonly/%s", "x");
    pathf(p[3], sizeof(p[3]), "%s/root700/%s", "x");
    pathf(p[4], sizeof(p[4]), "%s/bob/%s", "x");
    for (int i = 0; i < 5; i++) {
        const char *args[] = {"--steps", "2", "--save-every", "2", "--save-dir", p[i], NULL};
        int rc = train_as(ALICE, "alice-foreign", args, log, sizeof(log));
        struct stat st;
        bool exists = lstat(p[i], &st) == 0;
        TH_CHECK(rc != 0 && !exists &&
                     (log_has(log, "Permission denied") || log_has(log, "No such file")),
                 "alice saving into %s: exit %d, %s: %s", p[i], rc,
                 exists ? "it was created" : "not created", log_text(log));
        if (exists && i < 2)
            rmdir(p[i]);
    }
    printf("saves into /etc, root's, root-only and bob's directories: refused, none created\n");
}

static void planted_links(void)
{
    char ck[512], victim[512], sub[512], a[600], b[600], log[512];
    pathf(ck, sizeof(ck), "%s/alice/%s", "ck");
    pathf(victim, sizeof(victim), "%s/rootonly/%s", "victim");
    pathf(sub, sizeof(sub), "%s/rootonly/%s", "sub");
    plant(ALICE, "dir", ck, NULL);
    snprintf(b, sizeof(b), "%s/step-00000002", ck);
    plant(ALICE, "symlink", sub, b);
    snprintf(b, sizeof(b), "%s/LATEST", ck);
    plant(ALICE, "symlink", victim, b);
    char rootonly[512];
    pathf(rootonly, sizeof(rootonly), "%s/%s", "rootonly");
    uint64_t before = tree_sig(rootonly);
    const char *args[] = {"--steps", "2", "--save-every", "2", "--save-dir", ck, NULL};
    int rc = train_as(ALICE, "alice-ck", args, log, sizeof(log));
    TH_CHECK(rc != 0 && log_has(log, "File exists"), "a symlink where step 2 goes: exit %d: %s", rc,
             log_text(log));
    snprintf(a, sizeof(a), "%s/step-00000002", ck);
    plant(ALICE, "rm", a, NULL);
    const char *args4[] = {"--steps", "4", "--save-every", "2", "--save-dir", ck, NULL};
    rc = train_as(ALICE, "alice-ck", args4, log, sizeof(log));
    TH_CHECK(rc == 0, "saves once the link is gone: %s", log_text(log));
    struct stat st;
    snprintf(a, sizeof(a), "%s/LATEST", ck);
    TH_CHECK(lstat(a, &st) == 0 && S_ISREG(st.st_mode) && st.st_uid == ALICE,
             "LATEST is a file of alice's now (the link replaced, not followed)");
    TH_CHECK(tree_sig(rootonly) == before, "root's directory changed");
    char first[512] = "";
    pathf(a, sizeof(a), "%s/%s", "alice");
    int foreign = foreign_entries(a, ALICE, first, sizeof(first));
    TH_CHECK(foreign == 0, "%d entries in alice's tree are not hers: %s", foreign, first);
    /* she reads her own checkpoint */
    snprintf(a, sizeof(a), "%s/step-00000004/MANIFEST", ck);
    plant(ALICE, "read", a, NULL);
    snprintf(a, sizeof(a), "%s/step-00000004/data-0.bin", ck);
    TH_CHECK(lstat(a, &st) == 0 && st.st_uid == ALICE && st.st_gid == ALICE,
             "her data file is hers (uid %u gid %u)", (unsigned)st.st_uid, (unsigned)st.st_gid);
    plant(ALICE, "read", a, NULL);
    printf("symlinks at step-00000002 and LATEST: refused ('File exists'), then replaced; "
           "root's files untouched\n");
}

/* alice swaps a symlink to a root directory in for her save directory, over and over, while
 * her saves run */
static void swap_loop(void)
{
    char dir[512], real[512], target[512], rootonly[512], flag[512], log[512];
    pathf(dir, sizeof(dir), "%s/alice/%s", "swap");
    pathf(real, sizeof(real), "%s/alice/%s", "swap.real");
    pathf(target, sizeof(target), "%s/rootonly/%s", "sub");
    pathf(rootonly, sizeof(rootonly), "%s/%s", "rootonly");
    pathf(flag, sizeof(flag), "%s/%s", "stop-swap");
    plant(ALICE, "dir", dir, NULL);
    uint64_t before = tree_sig(rootonly);
    pid_t swapper = fork();
    if (swapper == 0) {
        become(ALICE);
        struct stat st;
        while (stat(flag, &st) != 0) { /* a flag file ends it */
            if (rename(dir, real) == 0) {
                if (symlink(target, dir) == 0) {
                    usleep(500);
                    unlink(dir);
                }
                rename(real, dir);
            }
            usleep(300);
        }
        _exit(0);
    }
    int saves = 0, runs = 0;
    double end = th_now_s() + 3.0;
    while (th_now_s() < end) {
        const char *args[] = {"--steps", "6", "--save-every", "1", "--save-dir", dir, NULL};
        int rc = train_as(ALICE, "alice-swap", args, log, sizeof(log));
        runs++;
        saves += rc == 0 ? 6 : 0;
    }
    FILE *f = fopen(flag, "w");
    if (f)
        fclose(f);
    th_wait(swapper, 10000);
    unlink(flag);
    TH_CHECK(tree_sig(rootonly) == before, "root's directory changed during the swap loop");
    char first[512] = "", home[512];
    pathf(home, sizeof(home), "%s/%s", "alice");
    int foreign = foreign_entries(home, ALICE, first, sizeof(first));
    TH_CHECK(foreign == 0, "after the swap loop %d entries in alice's tree are not hers: %s",
             foreign, first);
    printf("a symlink swapped in for the save directory during %d runs (%d saves through): "
           "root's directory unchanged, alice's tree all hers\n",
           runs, saves);
}

static void tmp_links_to_bob(void)
{
    char ck[512], bobck[512], bobtree[512], a[700], b[700], log[512];
    pathf(ck, sizeof(ck), "%s/alice/%s", "ck");
    pathf(bobck, sizeof(bobck), "%s/bob/%s", "ck");
    pathf(bobtree, sizeof(bobtree), "%s/%s", "bob");
    uint64_t before = tree_sig(bobtree);
    snprintf(a, sizeof(a), "%s/step-00000004", bobck);
    snprintf(b, sizeof(b), "%s/.tmp-alice-ck-0000000000000000", ck);
    plant(ALICE, "symlink", a, b);
    snprintf(b, sizeof(b), "%s/.tmp-alice-ck-1111111111111111", ck);
    plant(ALICE, "dir", b, NULL);
    snprintf(a, sizeof(a), "%s/step-00000004/data-0.bin", bobck);
    snprintf(b, sizeof(b), "%s/.tmp-alice-ck-1111111111111111/data-0.bin", ck);
    plant(ALICE, "symlink", a, b);
    const char *args[] = {"--steps", "2", "--save-every", "2", "--save-dir", ck, NULL};
    int rc = train_as(ALICE, "alice-ck", args, log, sizeof(log));
    TH_CHECK(rc == 0, "alice's save beside her planted links: %s", log_text(log));
    struct stat st;
    snprintf(b, sizeof(b), "%s/.tmp-alice-ck-0000000000000000", ck);
    bool link_gone = lstat(b, &st) != 0;
    snprintf(b, sizeof(b), "%s/.tmp-alice-ck-1111111111111111", ck);
    bool dir_gone = lstat(b, &st) != 0;
    TH_CHECK(link_gone && dir_gone, "the planted leftovers were %sremoved",
             link_gone && dir_gone ? "" : "not ");
    TH_CHECK(tree_sig(bobtree) == before, "bob's checkpoint changed");
    snprintf(a, sizeof(a), "%s/step-00000004/MANIFEST", bobck);
    TH_CHECK(lstat(a, &st) == 0 && st.st_uid == BOB, "bob's MANIFEST is there");
    printf("links named like alice's temporary directories, to bob's checkpoint: the links "
           "removed, bob's files unchanged\n");
}

static void copy_as_root(const char *from, const char *to, uid_t owner)
{
    char *t;
    size_t n;
    t = th_read_file(from, &n);
    FILE *f = t ? fopen(to, "wb") : NULL;
    TH_CHECK(f != NULL && fwrite(t, 1, n, f) == n, "copy %s to %s", from, to);
    if (f)
        fclose(f);
    free(t);
    TH_CHECK(chown(to, owner, owner) == 0, "chown %s", to);
}

/* alice loads dir (her job must fail); the words its output must hold */
static void load_refused(const char *what, const char *dir, const char *const *words)
{
    char log[512];
    const char *args[] = {"--steps", "12", "--load", dir, NULL};
    double t0 = th_now_s();
    int rc = train_as(ALICE, "alice-load", args, log, sizeof(log));
    double took = th_now_s() - t0;
    bool all = true;
    for (int i = 0; words[i] != NULL; i++)
        all &= log_has(log, words[i]);
    TH_CHECK(rc != 0 && all, "%s: exit %d, want '%s': %s", what, rc, words[0], log_text(log));
    TH_CHECK(!log_has(log, "crc32c"), "%s: a checksum was printed: %s", what, log_text(log));
    TH_CHECK(took < 3.0, "%s: refused after %.2f s", what, took);
    char *t = log_text(log);
    char *nl = strchr(t, '\n');
    if (nl)
        *nl = '\0';
    printf("%s: refused in %.2f s: %.220s\n", what, took, t);
    free(t);
}

static void loads_through_links(void)
{
    char e[512], p[700], q[700], bobck[512], secret[512], mine[512];
    pathf(bobck, sizeof(bobck), "%s/bob/ck/%s", "step-00000004");
    pathf(secret, sizeof(secret), "%s/rootonly/%s", "secret");
    pathf(mine, sizeof(mine), "%s/alice/ck/%s", "step-00000004");
    /* symlinks to bob's MANIFEST and data */
    pathf(e, sizeof(e), "%s/alice/%s", "evil1");
    plant(ALICE, "dir", e, NULL);
    snprintf(p, sizeof(p), "%s/MANIFEST", bobck);
    snprintf(q, sizeof(q), "%s/MANIFEST", e);
    plant(ALICE, "symlink", p, q);
    snprintf(p, sizeof(p), "%s/data-0.bin", bobck);
    snprintf(q, sizeof(q), "%s/data-0.bin", e);
    plant(ALICE, "symlink", p, q);
    const char *w1[] = {"symbolic link", NULL};
    load_refused("a MANIFEST linked to bob's", e, w1);
    /* her copy of a manifest bob let everyone read, with a hard link to his data */
    pathf(e, sizeof(e), "%s/alice/%s", "evil2");
    plant(ALICE, "dir", e, NULL);
    snprintf(p, sizeof(p), "%s/MANIFEST", bobck);
    snprintf(q, sizeof(q), "%s/MANIFEST", e);
    copy_as_root(p, q, ALICE);
    snprintf(p, sizeof(p), "%s/data-0.bin", bobck);
    snprintf(q, sizeof(q), "%s/data-0.bin", e);
    TH_CHECK(link(p, q) == 0, "a hard link to bob's data (as protected_hardlinks=0 allows)");
    const char *w2[] = {"belongs to uid 61002", NULL};
    load_refused("a hard link to bob's data", e, w2);
    /* her own manifest over a root-only file: by symlink, and by hard link */
    pathf(e, sizeof(e), "%s/alice/%s", "evil3");
    plant(ALICE, "dir", e, NULL);
    snprintf(p, sizeof(p), "%s/MANIFEST", mine);
    snprintf(q, sizeof(q), "%s/MANIFEST", e);
    copy_as_root(p, q, ALICE);
    snprintf(q, sizeof(q), "%s/data-0.bin", e);
    plant(ALICE, "symlink", secret, q);
    load_refused("data linked to a root-only file", e, w1);
    unlink(q);
    TH_CHECK(link(secret, q) == 0, "a hard link to the root-only file");
    const char *w3[] = {"belongs to uid 0", NULL};
    load_refused("data hard-linked to a root-only file", e, w3);
}

/* alice's directory dir with a special file as leaf (a fifo, socket, device or big manifest):
 * her load of it is refused saying word */
static void special(const char *dir, const char *leaf, const char *what, const char *word,
                    const char *title)
{
    char e[512], q[700];
    pathf(e, sizeof(e), "%s/alice/%s", dir);
    plant(ALICE, "dir", e, NULL);
    snprintf(q, sizeof(q), "%s/%s", e, leaf);
    if (strcmp(what, "device") == 0) /* mknod is root's: as a device left in her directory */
        TH_CHECK(mknod(q, S_IFCHR | 0666, makedev(1, 3)) == 0 && chown(q, ALICE, ALICE) == 0,
                 "a device node in alice's directory");
    else
        plant(ALICE, what, q, NULL);
    const char *words[] = {word, NULL};
    load_refused(title, e, words);
}

static void special_files(pid_t daemon_pid)
{
    atomic_store(&polling, 1);
    worst_status_s = 0;
    pthread_t t;
    pthread_create(&t, NULL, poller, NULL);
    /* bob trains meanwhile */
    char boblog[512];
    snprintf(boblog, sizeof(boblog), "%s/logs/bob-busy-%d.log", base, round_no);
    const char *bargv[] = {th_mlp_train_path(),
                           "--socket",
                           sock,
                           "--job",
                           "bob-busy",
                           "--world",
                           "1",
                           "--plan",
                           "zero3",
                           "--steps",
                           "60",
                           "--hidden",
                           "16",
                           "--layers",
                           "2",
                           "--compute-ms",
                           "5",
                           "--quiet",
                           NULL};
    pid_t bob = spawn_as(BOB, bargv, boblog);
    long rss0 = rss_kb(daemon_pid);

    special("fifo1", "MANIFEST", "fifo", "a FIFO", "a FIFO as MANIFEST");
    special("fifo2", "LATEST", "fifo", "a FIFO", "a FIFO as LATEST");
    special("sock1", "MANIFEST", "socket", "a socket", "a socket as MANIFEST");
    special("dev1", "MANIFEST", "device", "a character device", "a device as MANIFEST");
    special("big1", "MANIFEST", "big", "bytes, more than the", "a 40 MB manifest");
    long rss1 = rss_kb(daemon_pid);

    TH_CHECK(th_wait(bob, 120000) == 0, "bob's training beside the attacks: %s", log_text(boblog));
    atomic_store(&polling, 0);
    pthread_join(t, NULL);
    printf("status answered within %.3f s at worst; daemon RSS %ld -> %ld KiB\n", worst_status_s,
           rss0, rss1);
    /* 1 s on a quiet machine; ctest runs beside other tests on 2 cores (test_hostile's margin) */
    TH_CHECK(worst_status_s < 5.0, "status took %.3f s at worst", worst_status_s);
#if !defined(__SANITIZE_ADDRESS__)
    TH_CHECK(rss1 - rss0 < 32 * 1024, "the daemon grew from %ld to %ld KiB", rss0, rss1);
#endif
}

struct reg_args {
    const char *job;
    const char *name;
    uint64_t resume_ms;
};

static int register_one(void *arg)
{
    struct reg_args *r = arg;
    static uint64_t dims[1] = {16};
    shard_tensor_t t = {.name = r->name, .ndim = 1, .dims = dims, .dtype = SHARD_FP32};
    float init[16] = {0};
    const float *ip[1] = {init};
    shard_model_t m = {.job = r->job,
                       .rank = 0,
                       .world = 1,
                       .plan = "zero3",
                       .tensors = &t,
                       .n_tensors = 1,
                       .optimizer = {.name = "sgd", .lr = 0.1f},
                       .init = ip,
                       .resume_timeout_ms = r->resume_ms};
    shard_ctx_t *ctx = NULL;
    int st = shard_attach(sock, &ctx);
    if (st == 0)
        st = shard_register(ctx, &m);
    printf("  register '%s': %s\n", r->job, st ? shard_last_error(ctx) : "ok");
    fflush(stdout);
    if (ctx)
        shard_detach(ctx);
    return st == 0 ? 0 : (-st) & 0xff;
}

struct drop_args {
    const char *job;
    int status;
};

static int drop_as(void *arg)
{
    struct drop_args *d = arg;
    char *text = NULL;
    int st = shard_admin(sock, "drop", d->job, &text);
    printf("  drop '%s': %d %s\n", d->job, st, text ? text : "");
    fflush(stdout);
    shard_free(text);
    return st == d->status ? 0 : 1;
}

struct recover_args {
    const char *job, *dir;
    int status;
    const char *word;
};

/* shardctl checkpoint --job: the status and a word of the answer as expected */
static int recover_as(void *arg)
{
    struct recover_args *r = arg;
    char *text = NULL;
    int st = shard_checkpoint_job(sock, r->job, r->dir, &text);
    const char *t = text ? text : shard_last_error(NULL);
    printf("  checkpoint --job %s %s: %d %.300s\n", r->job, r->dir, st, t ? t : "");
    bool ok = st == r->status && t != NULL && strstr(t, r->word) != NULL;
    shard_free(text);
    return ok ? 0 : 1;
}

static const char *job_state(const char *name, bool *paused)
{
    static char state[32];
    json_t *doc = th_admin_json(sock, "jobs");
    json_t *jobs = json_object_get(doc, "jobs");
    state[0] = '\0';
    *paused = false;
    for (size_t i = 0; i < json_array_size(jobs); i++) {
        json_t *j = json_array_get(jobs, i);
        const char *jn = json_string_value(json_object_get(j, "name"));
        const char *js = json_string_value(json_object_get(j, "state"));
        if (jn == NULL || strcmp(jn, name) != 0)
            continue;
        snprintf(state, sizeof(state), "%s", js ? js : "");
        *paused |= json_is_true(json_object_get(json_object_get(j, "resume"), "paused"));
    }
    json_decref(doc);
    return state;
}

static void resume_attacks(void)
{
    char logs[2][512], bobck[512], log[512];
    pathf(bobck, sizeof(bobck), "%s/bob/%s", "ck");
    char job[64];
    snprintf(job, sizeof(job), "alice-p%d", round_no);
    pid_t r[2];
    for (int i = 0; i < 2; i++) {
        char rank[8];
        snprintf(rank, sizeof(rank), "%d", i);
        snprintf(logs[i], sizeof(logs[i]), "%s/logs/%s-%d.log", base, job, i);
        const char *argv[] = {th_mlp_train_path(),
                              "--socket",
                              sock,
                              "--job",
                              job,
                              "--rank",
                              rank,
                              "--world",
                              "2",
                              "--plan",
                              "zero3",
                              "--steps",
                              "100000",
                              "--hidden",
                              "16",
                              "--layers",
                              "2",
                              "--compute-ms",
                              "2",
                              "--quiet",
                              "--resume-timeout-ms",
                              "60000",
                              NULL};
        r[i] = spawn_as(ALICE, argv, logs[i]);
    }
    usleep(1500000);
    kill(r[1], SIGKILL);
    usleep(300000);
    kill(r[0], SIGKILL);
    th_wait(r[0], 5000);
    th_wait(r[1], 5000);
    usleep(300000);
    bool paused;
    job_state(job, &paused);
    TH_CHECK(paused, "alice's job %s is paused after its ranks were killed", job);
    /* bob takes the name with a checkpoint to load */
    const char *args[] = {"--steps", "12", "--load", bobck, NULL};
    int rc = train_as(BOB, job, args, log, sizeof(log));
    TH_CHECK(rc != 0 && log_has(log, "belongs to uid 61001"),
             "bob registering alice's paused job with load=: exit %d: %s", rc, log_text(log));
    job_state(job, &paused);
    TH_CHECK(paused, "alice's job is still paused after bob's attempt");
    struct reg_args big = {.job = "bob-forever", .name = "w", .resume_ms = 10000000000000ull};
    TH_CHECK(as_user(BOB, register_one, &big) != 0, "a resume timeout of 1e13 ms was taken");
    json_t *st = th_admin_json(sock, "status");
    json_t *kept = json_object_get(json_object_get(st, "paused_bytes_by_uid"), "61001");
    TH_CHECK(json_integer_value(kept) > 0, "status counts alice's paused bytes");
    json_decref(st);
    /* a checkpoint of the paused job from its state: with its owner's rights, by its owner */
    char mine[512], etc[128];
    pathf(mine, sizeof(mine), "%s/alice/%s", "recovered");
    snprintf(etc, sizeof(etc), "/etc/shardd-attack-r%d-%d", (int)getpid(), round_no);
    struct recover_args rec = {.job = job, .dir = etc, .status = -EACCES, .word = "Permission"};
    TH_CHECK(as_user(ALICE, recover_as, &rec) == 0, "alice's recovery into /etc");
    rec.status = -EACCES; /* root asks: the files are still touched with alice's rights */
    TH_CHECK(recover_as(&rec) == 0, "root's recovery of alice's job into /etc");
    struct stat est;
    TH_CHECK(lstat(etc, &est) != 0, "a recovery created %s", etc);
    rec = (struct recover_args){.job = job, .dir = mine, .status = SHARD_ENOJOB, .word = "no job"};
    TH_CHECK(as_user(BOB, recover_as, &rec) == 0, "bob's recovery of alice's job");
    rec = (struct recover_args){.job = job, .dir = mine, .status = 0, .word = "step"};
    TH_CHECK(as_user(ALICE, recover_as, &rec) == 0, "alice's recovery into her home");
    char first[512] = "";
    TH_CHECK(foreign_entries(mine, ALICE, first, sizeof(first)) == 0,
             "the recovered checkpoint has files not alice's: %s", first);
    struct drop_args d = {.job = job, .status = SHARD_EPERM};
    TH_CHECK(as_user(ALICE, drop_as, &d) == 0, "alice's shardctl drop is refused (root's)");
    char *text = NULL;
    int s = shard_admin(sock, "drop", job, &text);
    TH_CHECK(s == 0 && text && strstr(text, "\"dropped\""), "root drops it: %d %s", s,
             text ? text : "");
    shard_free(text);
    usleep(200000);
    const char *state = job_state(job, &paused);
    TH_CHECK(!paused, "after the drop the job is %s", state);
    st = th_admin_json(sock, "status");
    kept = json_object_get(json_object_get(st, "paused_bytes_by_uid"), "61001");
    TH_CHECK(kept == NULL, "alice keeps no paused bytes after the drop");
    json_decref(st);
    printf("bob's registration of alice's paused job: refused; 1e13 ms: refused; alice's drop: "
           "refused; root's drop: done\n");
}

static int edit_lr(const char *path)
{
    size_t n;
    char *t = th_read_file(path, &n);
    if (t == NULL)
        return -1;
    char *lr = strstr(t, "\"lr\": ");
    FILE *f = fopen(path, "w");
    if (lr == NULL || f == NULL) {
        free(t);
        if (f)
            fclose(f);
        return -1;
    }
    char *end = lr + 6 + strcspn(lr + 6, ",\n}");
    fwrite(t, 1, (size_t)(lr - t), f);
    fputs("\"lr\": 1e39", f);
    fputs(end, f);
    fclose(f);
    free(t);
    return 0;
}

static void integrity(void)
{
    char e[512], p[700], q[700], mine[512], log[512];
    pathf(mine, sizeof(mine), "%s/alice/ck/%s", "step-00000004");
    pathf(e, sizeof(e), "%s/alice/%s", "lr");
    plant(ALICE, "dir", e, NULL);
    snprintf(p, sizeof(p), "%s/MANIFEST", mine);
    snprintf(q, sizeof(q), "%s/MANIFEST", e);
    copy_as_root(p, q, ALICE);
    TH_CHECK(edit_lr(q) == 0, "writing lr 1e39 into %s", q);
    snprintf(p, sizeof(p), "%s/data-0.bin", mine);
    snprintf(q, sizeof(q), "%s/data-0.bin", e);
    copy_as_root(p, q, ALICE);
    const char *wl[] = {"lr is inf", NULL};
    load_refused("a checkpoint with lr 1e39", e, wl);

    struct reg_args bad = {.job = "alice-utf8", .name = "w\xff\xfe"};
    char out[512];
    snprintf(out, sizeof(out), "%s/logs/utf8-%d.log", base, round_no);
    fflush(stdout);
    int saved = dup(1);
    int fd = open(out, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    dup2(fd, 1);
    int rc = as_user(ALICE, register_one, &bad);
    fflush(stdout);
    dup2(saved, 1);
    close(saved);
    close(fd);
    TH_CHECK(rc != 0 && log_has(out, "not UTF-8"), "a tensor name that is not UTF-8: %s",
             log_text(out));

    /* a full filesystem */
    char small[512];
    pathf(small, sizeof(small), "%s/alice/%s", "small");
    mkdir(small, 0755);
    TH_CHECK(mount("none", small, "tmpfs", 0, "size=256k") == 0 && chown(small, ALICE, ALICE) == 0,
             "a 256 KiB tmpfs in alice's home: %s", strerror(errno));
    const char *args[] = {"--steps", "2",        "--save-every", "2", "--save-dir",
                          small,     "--hidden", "384",          NULL};
    rc = train_as(ALICE, "alice-full", args, log, sizeof(log));
    TH_CHECK(rc != 0 && log_has(log, "No space left on device"),
             "a save onto a full filesystem: %s", log_text(log));
    char left[64] = "";
    DIR *d = opendir(small);
    struct dirent *de;
    while (d && (de = readdir(d)) != NULL)
        if (de->d_name[0] != '.' || strncmp(de->d_name, ".tmp-", 5) == 0)
            snprintf(left, sizeof(left), "%.60s", de->d_name);
    if (d)
        closedir(d);
    TH_CHECK(left[0] == '\0', "the failed save left '%s'", left);
    umount(small);
    rmdir(small);
    printf("lr 1e39, a name not UTF-8, a full filesystem: refused with what was wrong\n");
}

/* every attack against the daemon at sock */
static void attacks(pid_t daemon_pid)
{
    char log[512], bobck[512], bobtree[512];
    round_no++;
    pathf(bobck, sizeof(bobck), "%s/bob/%s", "ck");
    pathf(bobtree, sizeof(bobtree), "%s/%s", "bob");
    const char *args[] = {"--steps", "4", "--save-every", "2", "--save-dir", bobck, NULL};
    TH_CHECK(train_as(BOB, "bob-ck", args, log, sizeof(log)) == 0, "bob saves: %s", log_text(log));
    /* bob lets everyone read his checkpoint (the links below need something to aim at) */
    char p[700];
    const char *names[] = {"MANIFEST", "data-0.bin"};
    for (int i = 0; i < 2; i++) {
        snprintf(p, sizeof(p), "%s/step-00000004/%s", bobck, names[i]);
        chmod(p, 0644);
    }
    snprintf(p, sizeof(p), "%s/step-00000004", bobck);
    chmod(p, 0755);
    chmod(bobck, 0755);
    uint64_t bob_before = tree_sig(bobtree);
    foreign_dirs();
    planted_links();
    swap_loop();
    tmp_links_to_bob();
    loads_through_links();
    special_files(daemon_pid);
    resume_attacks();
    integrity();
    TH_CHECK(tree_sig(bobtree) == bob_before, "bob's tree changed during the attacks");
    const char *load[] = {"--steps", "6", "--load", bobck, NULL};
    TH_CHECK(train_as(BOB, "bob-again", load, log, sizeof(log)) == 0,
             "bob loads his checkpoint after the attacks: %s", log_text(log));
}

/* a daemon that cannot act as its users: their checkpoint work is refused, saying why */
static void no_caps(void)
{
    char log[512], ck[512];
    round_no++;
    pathf(ck, sizeof(ck), "%s/alice/%s", "nocap");
    const char *args[] = {"--steps", "2", "--save-every", "2", "--save-dir", ck, NULL};
    int rc = train_as(ALICE, "alice-nocap", args, log, sizeof(log));
    TH_CHECK(rc != 0 && log_has(log, "without CAP_SETUID and CAP_SETGID") &&
                 log_has(log, "uid 61001"),
             "a service daemon without the capabilities: %s", log_text(log));
    char mine[512];
    pathf(mine, sizeof(mine), "%s/alice/%s", "ck");
    const char *load[] = {"--steps", "6", "--load", mine, NULL};
    rc = train_as(ALICE, "alice-nocap-load", load, log, sizeof(log));
    TH_CHECK(rc != 0 && log_has(log, "without CAP_SETUID and CAP_SETGID"),
             "a load without the capabilities: %s", log_text(log));
    struct stat st;
    TH_CHECK(lstat(ck, &st) != 0, "nothing was created in alice's home");
    char *t = log_text(log);
    printf("a service daemon without CAP_SETUID/CAP_SETGID refuses alice's checkpoints: %.200s\n",
           t);
    free(t);
}

static void setup(void)
{
    snprintf(base, sizeof(base), "/tmp/shardd-attack-XXXXXX");
    if (mkdtemp(base) == NULL)
        exit(1);
    chmod(base, 0755);
    char p[512];
    /* (the users run these; the build may lie where they cannot reach: a clone under /root) */
    pathf(p, sizeof(p), "%s/%s", "bin");
    if (th_binaries_reachable(p) != 0)
        exit(1);
    const char *dirs[] = {"rootonly", "rootonly/sub", "root700", "alice", "bob", "logs"};
    const mode_t modes[] = {0755, 0755, 0700, 0750, 0755, 0777};
    const uid_t owners[] = {0, 0, 0, ALICE, BOB, 0};
    for (int i = 0; i < 6; i++) {
        pathf(p, sizeof(p), "%s/%s", dirs[i]);
        mkdir(p, modes[i]);
        chmod(p, modes[i]);
        TH_CHECK(chown(p, owners[i], owners[i]) == 0, "chown %s", p);
    }
    pathf(p, sizeof(p), "%s/rootonly/%s", "victim");
    FILE *f = fopen(p, "w");
    fputs("root's file\n", f);
    fclose(f);
    pathf(p, sizeof(p), "%s/rootonly/%s", "secret");
    f = fopen(p, "w");
    for (int i = 0; i < 4096; i++)
        fputc(rand() & 0xff, f);
    fclose(f);
    chmod(p, 0600);
}

int main(void)
{
    if (geteuid() != 0) {
        printf("SKIP: not root: the attacks need two users and a root daemon\n");
        return 77;
    }
    /* mounts (a full filesystem) stay in this test and the daemons it starts */
    if (unshare(CLONE_NEWNS) != 0 || mount(NULL, "/", NULL, MS_REC | MS_PRIVATE, NULL) != 0) {
        printf("cannot make a mount namespace: %s\n", strerror(errno));
        return 1;
    }
    setvbuf(stdout, NULL, _IOLBF, 0); /* nothing buffered is written again by a child */
    srand((unsigned)getpid());
    setup();
    const char *extra[] = {"--allowed-gid", "61100", "--register-timeout-ms", "3000", NULL};
    struct th_daemon d;
    printf("== a daemon as root\n");
    TH_CHECK(th_daemon_start(&d, extra) == 0, "start shardd");
    chmod(d.dir, 0711);
    sock = d.sock;
    attacks(d.pid);
    TH_CHECK(th_daemon_stop(&d) == 0, "shardd (root) did not shut down cleanly");

    printf("== a daemon as a service user with CAP_SETUID and CAP_SETGID\n");
    const char *caps[] = {"/usr/bin/setpriv",
                          "--reuid=61000",
                          "--regid=61000",
                          "--groups=61100",
                          "--inh-caps=+setuid,+setgid",
                          "--ambient-caps=+setuid,+setgid",
                          NULL};
    TH_CHECK(th_daemon_start_as(&d, caps, SVC, extra) == 0, "start shardd as uid 61000");
    chmod(d.dir, 0711);
    sock = d.sock;
    char p[700];
    pathf(p, sizeof(p), "%s/bob/%s", "ck");
    char cmd[1600];
    snprintf(cmd, sizeof(cmd), "rm -rf '%s' '%s/alice/'* '%s/alice/'.tmp-*", p, base, base);
    if (system(cmd) != 0)
        fprintf(stderr, "could not clear the homes\n");
    attacks(d.pid);
    TH_CHECK(th_daemon_stop(&d) == 0, "shardd (service user) did not shut down cleanly");

    printf("== a daemon as a service user without them\n");
    const char *nocaps[] = {"/usr/bin/setpriv", "--reuid=61000", "--regid=61000", "--groups=61100",
                            NULL};
    TH_CHECK(th_daemon_start_as(&d, nocaps, SVC, extra) == 0, "start shardd as uid 61000");
    chmod(d.dir, 0711);
    sock = d.sock;
    no_caps();
    TH_CHECK(th_daemon_stop(&d) == 0, "shardd (no capabilities) did not shut down cleanly");

    int rc = th_summary("test_attack");
    if (rc == 0) {
        snprintf(cmd, sizeof(cmd), "rm -rf '%s'", base);
        if (system(cmd) != 0)
            fprintf(stderr, "could not remove %s\n", base);
    } else {
        fprintf(stderr, "kept %s\n", base);
    }
    return rc;
}

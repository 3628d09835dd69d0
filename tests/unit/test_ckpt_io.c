/* The checkpoint data files' I/O (sd/ckpt.h): crc32c of pieces combined against the crc of the
 * whole; the threaded writer against the bytes and crcs of its sources (extents crossing its
 * 4 MiB chunks, spanning several, empty ones, 1 to 8 threads); the reader of ranges with
 * O_DIRECT (unaligned extents, the last ending mid-block) against the sources, a flipped byte
 * refused naming the extent and a cut file naming the extent it cuts. On the build tree's disk, on
 * /dev/shm (tmpfs), and on a ramfs mounted in a private mount namespace, which refuses O_DIRECT:
 * both fall back to buffered I/O. */
#include "check.h"
#include "sd/ckpt.h"
#include "sd/status.h"

#include <errno.h>
#include <fcntl.h>
#include <sched.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <unistd.h>

static uint64_t rng = 0x9e3779b97f4a7c15ull;
static uint64_t next_u64(void)
{
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return rng;
}

static void test_crc(void)
{
    TH_CHECK(sd_crc32c(0, "123456789", 9) == 0xe3069283u, "crc32c check value");
    static uint8_t buf[200000];
    for (size_t i = 0; i < sizeof(buf); i++)
        buf[i] = (uint8_t)next_u64();
    int bad = 0;
    for (int t = 0; t < 300; t++) {
        size_t len = next_u64() % sizeof(buf), cut = len ? next_u64() % (len + 1) : 0;
        uint32_t whole = sd_crc32c(0, buf, len);
        uint32_t a = sd_crc32c(0, buf, cut), b = sd_crc32c(0, buf + cut, len - cut);
        bad += sd_crc32c_combine(a, b, len - cut) != whole;
    }
    TH_CHECK(bad == 0, "%d of 300 combined crcs differ from the crc of the whole", bad);
    TH_CHECK(sd_crc32c_combine(0x12345678u, 0, 0) == 0x12345678u, "appending nothing");
}

/* n extents of one tensor, sizes in elements from the list, their sources at odd addresses */
struct layout {
    uint64_t n, numel;
    struct sd_ckpt_extent *xs;
    const void **src;
    float *pool;
};

static void make_layout(struct layout *l, const uint64_t *sizes, uint64_t n)
{
    l->n = n;
    l->numel = 0;
    for (uint64_t i = 0; i < n; i++)
        l->numel += sizes[i];
    l->pool = malloc((l->numel + 1024) * sizeof(float));
    for (uint64_t i = 0; i < l->numel + 1024; i++)
        l->pool[i] = (float)(int32_t)next_u64() / 1024.0f;
    l->xs = calloc(n + 1, sizeof(*l->xs));
    l->src = calloc(n + 1, sizeof(*l->src));
    uint64_t at = 0;
    for (uint64_t i = 0; i < n; i++) {
        l->xs[i] = (struct sd_ckpt_extent){
            .begin = at, .end = at + sizes[i], .file_off = at * sizeof(float)};
        l->src[i] = l->pool + 3 + at; /* 12 bytes past an aligned start */
        at += sizes[i];
    }
}

static void free_layout(struct layout *l)
{
    free(l->pool);
    free(l->xs);
    free((void *)l->src);
}

/* A runner as the daemon's file pool is one (sd_ckpt_io.runner): here the items run on the
 * calling thread, last first, each under a thread number of its own choosing. */
struct backwards {
    uint32_t calls, max_threads;
    uint64_t items;
};

static void run_backwards(void *ctx, uint32_t threads, uint64_t n, sd_ckpt_par_fn *fn, void *arg)
{
    struct backwards *b = ctx;
    b->calls++;
    b->max_threads = threads > b->max_threads ? threads : b->max_threads;
    for (uint64_t i = n; i-- > 0; b->items++)
        fn(arg, (uint32_t)((i * 7) % threads), i);
}

/* write l into dir/name with threads (through runner, else the writer's own) and check the file
 * and the crcs */
static void check_write(const char *dir, const char *name, struct layout *l, uint32_t threads,
                        bool direct, bool expect_direct, const struct sd_ckpt_runner *runner)
{
    char path[512];
    snprintf(path, sizeof(path), "%s/%s", dir, name);
    int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0600);
    TH_CHECK(fd >= 0, "%s: %s", path, strerror(errno));
    if (fd < 0)
        return;
    struct sd_ckpt_io io = {.threads = threads, .direct = direct, .runner = runner};
    bool used = false;
    int st = sd_ckpt_write_extents(fd, l->xs, l->src, l->n, &io, &used);
    close(fd);
    TH_CHECK(st == SD_OK, "%s, %u threads: %s", path, threads, sd_status_str(st));
    TH_CHECK(used == (direct && expect_direct), "%s: O_DIRECT used %d, expected %d", path, used,
             direct && expect_direct);
    struct stat sb;
    TH_CHECK(stat(path, &sb) == 0 && (uint64_t)sb.st_size == l->numel * sizeof(float),
             "%s: %lld bytes, expected %llu", path, (long long)sb.st_size,
             (unsigned long long)(l->numel * sizeof(float)));
    float *back = malloc(l->numel * sizeof(float) + 1);
    fd = open(path, O_RDONLY);
    ssize_t got = 0, n;
    while (fd >= 0 &&
           (n = read(fd, (uint8_t *)back + got, l->numel * sizeof(float) - (size_t)got)) > 0)
        got += n;
    if (fd >= 0)
        close(fd);
    uint64_t bad_bytes = 0, bad_crc = 0;
    for (uint64_t i = 0; i < l->n; i++) {
        size_t bytes = (l->xs[i].end - l->xs[i].begin) * sizeof(float);
        bad_bytes += memcmp(back + l->xs[i].begin, l->src[i], bytes) != 0;
        bad_crc += l->xs[i].crc != sd_crc32c(0, l->src[i], bytes);
    }
    TH_CHECK(got == (ssize_t)(l->numel * sizeof(float)) && bad_bytes == 0,
             "%s, %u threads: %llu extents differ from their sources", path, threads,
             (unsigned long long)bad_bytes);
    TH_CHECK(bad_crc == 0, "%s, %u threads: %llu extents' crcs are wrong", path, threads,
             (unsigned long long)bad_crc);
    free(back);
}

/* l (one tensor, extents of at most SD_CKPT_EXTENT_ELEMS) as a checkpoint in dir: read ranges
 * back through the reader, with O_DIRECT asked for */
static void check_read(const char *dir, struct layout *l)
{
    struct sd_ckpt ck = {.n_states = 1, .n_tensors = 1, .n_files = 1, .n_extents = l->n};
    snprintf(ck.path, sizeof(ck.path), "%s", dir);
    ck.dir_fd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    ck.dir_open = ck.dir_fd >= 0;
    ck.owner = SD_FS_ANY_OWNER;
    struct sd_ckpt_tensor t = {.name = "w", .ndim = 1, .dims = {l->numel}, .numel = l->numel};
    char files[1][64] = {"data.bin"};
    ck.tensors = &t;
    ck.files = files;
    ck.extents = l->xs;
    ck.by_key = calloc(l->n + 1, sizeof(uint64_t));
    for (uint64_t i = 0; i < l->n; i++)
        ck.by_key[i] = i;
    float *dst = malloc(l->numel * sizeof(float) + 1);
    struct sd_ckpt_reader rd;
    char err[1024];
    int st = sd_ckpt_reader_init(&rd, &ck, err, sizeof(err)), bad = 0;
    rd.direct = true;
    for (int trial = 0; st == SD_OK && trial < 40; trial++) {
        uint64_t b = next_u64() % l->numel, e = b + 1 + next_u64() % (l->numel - b);
        if (trial == 0) /* everything: every extent whole, the last one ending mid-block */
            b = 0, e = l->numel;
        if (trial == 1) /* the last element alone */
            b = l->numel - 1, e = l->numel;
        st = sd_ckpt_read(&rd, 0, 0, b, e, dst, err, sizeof(err));
        bad += st == SD_OK && memcmp(dst, l->pool + 3 + b, (e - b) * sizeof(float)) != 0;
    }
    TH_CHECK(st == SD_OK && bad == 0, "%s: reads: %s; %d of 40 ranges differ", dir,
             st == SD_OK ? "ok" : err, bad);
    TH_CHECK(rd.bytes_read > 0, "%s: nothing read", dir);
    sd_ckpt_reader_free(&rd);

    /* one flipped byte in extent 2 */
    char path[512];
    snprintf(path, sizeof(path), "%s/data.bin", dir);
    int fd = open(path, O_RDWR);
    uint8_t byte = 0;
    off_t at = (off_t)l->xs[2].file_off + 5;
    if (fd >= 0 && pread(fd, &byte, 1, at) == 1) {
        byte ^= 0x10;
        TH_CHECK(pwrite(fd, &byte, 1, at) == 1, "flipping a byte of %s", path);
    }
    if (fd >= 0)
        close(fd);
    st = sd_ckpt_reader_init(&rd, &ck, err, sizeof(err));
    rd.direct = true;
    if (st == SD_OK)
        st = sd_ckpt_read(&rd, 0, 0, l->xs[2].begin, l->xs[2].begin + 1, dst, err, sizeof(err));
    TH_CHECK(st == SD_EIO && strstr(err, "extent 2 in data.bin is corrupt") != NULL,
             "%s: a flipped byte: %s, %s", dir, sd_status_str(st), err);
    sd_ckpt_reader_free(&rd);

    /* the file cut 5 bytes into its last extent */
    const struct sd_ckpt_extent *last = &l->xs[l->n - 1];
    TH_CHECK(truncate(path, (off_t)last->file_off + 5) == 0, "truncating %s", path);
    st = sd_ckpt_reader_init(&rd, &ck, err, sizeof(err));
    rd.direct = true;
    if (st == SD_OK)
        st = sd_ckpt_read(&rd, 0, 0, last->end - 1, last->end, dst, err, sizeof(err));
    TH_CHECK(st == SD_EIO && strstr(err, "the file ends early") != NULL &&
                 strstr(err, "extent 8") != NULL,
             "%s: a cut file: %s, %s", dir, sd_status_str(st), err);
    sd_ckpt_reader_free(&rd);
    free(dst);
    free(ck.by_key);
    if (ck.dir_open)
        close(ck.dir_fd);
}

static void test_dir(const char *dir, bool has_direct)
{
    /* packed extents around the 4 MiB chunks (1M elements): crossing one boundary, spanning
     * several chunks (write only), empty, tiny, ending mid-block */
    static const uint64_t big[] = {3, 1048576 - 3, 1048576, 0, 2500000, 7, 1048000, 1, 333333};
    static const uint64_t small[] = {1000, 1048576, 17, 0, 1048576, 524288, 1048575, 5, 999999};
    struct layout l;
    make_layout(&l, big, sizeof(big) / sizeof(big[0]));
    for (uint32_t th = 1; th <= 8; th *= 2)
        check_write(dir, "big.bin", &l, th, true, has_direct, NULL);
    check_write(dir, "big.bin", &l, 3, false, has_direct, NULL);
    struct backwards b = {0};
    struct sd_ckpt_runner runner = {.run = run_backwards, .ctx = &b};
    check_write(dir, "big.bin", &l, 4, true, has_direct, &runner);
    uint64_t bytes = l.numel * sizeof(float);
    TH_CHECK(b.calls == 1 && b.max_threads == 4 &&
                 b.items == (bytes + SD_CKPT_IO_CHUNK - 1) / SD_CKPT_IO_CHUNK,
             "the runner ran the writer's chunks: %u calls, %u threads, %llu items", b.calls,
             b.max_threads, (unsigned long long)b.items);
    free_layout(&l);

    make_layout(&l, small, sizeof(small) / sizeof(small[0]));
    check_write(dir, "data.bin", &l, 4, true, has_direct, NULL);
    check_read(dir, &l);
    /* not packed: refused */
    l.xs[1].file_off += 4;
    char path[512];
    snprintf(path, sizeof(path), "%s/bad.bin", dir);
    int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0600);
    struct sd_ckpt_io io = {.threads = 2, .direct = true};
    TH_CHECK(sd_ckpt_write_extents(fd, l.xs, l.src, l.n, &io, NULL) == SD_EINVAL,
             "extents with a gap are refused");
    close(fd);
    free_layout(&l);
    unlink(path);
    snprintf(path, sizeof(path), "%s/big.bin", dir);
    unlink(path);
    snprintf(path, sizeof(path), "%s/data.bin", dir);
    unlink(path);
}

int main(void)
{
    test_crc();
    char disk[] = "ckpt_io.XXXXXX"; /* in ctest's working directory: the build tree's disk */
    char shm[] = "/dev/shm/ckpt_io.XXXXXX";
    if (mkdtemp(disk) != NULL) {
        test_dir(disk, true);
        rmdir(disk);
    }
    if (mkdtemp(shm) != NULL) {
        char probe[600];
        snprintf(probe, sizeof(probe), "%s/probe", shm);
        int p = open(probe, O_WRONLY | O_CREAT | O_DIRECT, 0600); /* tmpfs took it since 6.6 */
        bool direct = p >= 0;
        if (p >= 0)
            close(p);
        unlink(probe);
        test_dir(shm, direct);
        rmdir(shm);
    }
    /* ramfs refuses O_DIRECT: everything falls back to buffered I/O */
    char ram[] = "/tmp/ckpt_io_ramfs.XXXXXX";
    if (geteuid() != 0) {
        printf("not root: the ramfs case (no O_DIRECT) is not run\n");
    } else if (mkdtemp(ram) != NULL) {
        bool ok = unshare(CLONE_NEWNS) == 0 &&
                  mount(NULL, "/", NULL, MS_REC | MS_PRIVATE, NULL) == 0 &&
                  mount("none", ram, "ramfs", 0, NULL) == 0;
        TH_CHECK(ok, "mounting a ramfs on %s: %s", ram, strerror(errno));
        if (ok) {
            test_dir(ram, false);
            umount(ram);
        }
        /* a full filesystem (a 1 MiB tmpfs): every thread's write fails, the first error is
         * returned, nothing hangs */
        if (ok && mount("none", ram, "tmpfs", 0, "size=1m") == 0) {
            static const uint64_t sizes[] = {1048576, 1048576, 1048576, 5, 1048576};
            struct layout l;
            make_layout(&l, sizes, sizeof(sizes) / sizeof(sizes[0]));
            char path[512];
            snprintf(path, sizeof(path), "%s/full.bin", ram);
            int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0600);
            struct sd_ckpt_io io = {.threads = 4, .direct = true};
            int st = fd >= 0 ? sd_ckpt_write_extents(fd, l.xs, l.src, l.n, &io, NULL) : SD_EIO;
            TH_CHECK(st == -ENOSPC, "a full filesystem: %s", sd_status_str(st));
            if (fd >= 0)
                close(fd);
            free_layout(&l);
            umount(ram);
        } else if (ok) {
            TH_CHECK(false, "mounting a 1 MiB tmpfs on %s: %s", ram, strerror(errno));
        }
        rmdir(ram);
    }
    return th_summary("test_ckpt_io");
}

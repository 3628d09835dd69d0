/* Checkpoints: moving the data files' bytes on several threads (sd/ckpt.h).
 *
 * A node's data file is written as a stream of 4 MiB chunks at aligned offsets. A thread takes
 * the next chunk, gathers the pieces of the extents that fall in it into its own aligned buffer
 * (the copy leaves the bytes hot in its cache for the crc) and writes the buffer with one pwrite,
 * with O_DIRECT where the filesystem has it: the disk reads the buffer itself, where a buffered
 * write would copy every byte into the page cache first. An extent that crosses chunks has its
 * crc from the pieces (sd_crc32c_combine). */
#include "sd/ckpt.h"
#include "sd/status.h"
#include "sd/util.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

struct par {
    sd_ckpt_par_fn *fn;
    void *arg;
    uint64_t n;
    atomic_uint_fast64_t next;
};

struct par_thread {
    struct par *p;
    uint32_t thread;
};

static void *par_run(void *v)
{
    struct par_thread *t = v;
    for (uint64_t i; (i = atomic_fetch_add(&t->p->next, 1)) < t->p->n;)
        t->p->fn(t->p->arg, t->thread, i);
    return NULL;
}

/* A thread starts with a copy of its creator's credentials (Linux copies the calling task's
 * on clone): the threads started here open files with the caller's filesystem identity
 * (sd/fsid.h), as the caller would. */
void sd_ckpt_parallel(uint32_t threads, uint64_t n, sd_ckpt_par_fn *fn, void *arg)
{
    struct par p = {.fn = fn, .arg = arg, .n = n};
    atomic_init(&p.next, 0);
    threads = (uint32_t)SD_MIN(SD_MAX(threads, 1), SD_MAX(n, 1));
    pthread_t tid[SD_CKPT_MAX_THREADS];
    struct par_thread pt[SD_CKPT_MAX_THREADS];
    uint32_t started = 0;
    for (uint32_t t = 1; t < threads && t < SD_CKPT_MAX_THREADS; t++) {
        pt[started] = (struct par_thread){.p = &p, .thread = t};
        if (pthread_create(&tid[started], NULL, par_run, &pt[started]) != 0)
            break; /* fewer threads do the same work */
        started++;
    }
    struct par_thread self = {.p = &p, .thread = 0};
    par_run(&self);
    for (uint32_t t = 0; t < started; t++)
        pthread_join(tid[t], NULL);
}

/* ---- writing a data file */

struct wfile {
    int fd;
    const struct sd_ckpt_extent *xs;
    const void *const *src;
    uint64_t n, total;
    uint8_t **buf;      /* [threads] SD_CKPT_IO_CHUNK bytes each, aligned */
    uint32_t *head;     /* [n] crc of extent i's piece in the chunk where it starts */
    uint32_t *cont;     /* [chunks] crc of the piece of the extent running into chunk j */
    uint64_t *cont_len; /* [chunks] its length; 0: chunk j starts with an extent */
    atomic_bool direct;
    atomic_int status;
    /* one write at a time: a file's writes (buffered, or extending ones with O_DIRECT) hold its
     * inode lock anyway, and the kernel's waiters spin on it, taking the core that another
     * thread would gather its next chunk on; here they sleep */
    pthread_mutex_t write_lock;
};

static uint64_t x_bytes(const struct sd_ckpt_extent *x)
{
    return (x->end - x->begin) * sizeof(float);
}

static int pwrite_all(int fd, const uint8_t *p, size_t len, uint64_t off)
{
    while (len > 0) {
        ssize_t n = pwrite(fd, p, len, (off_t)off);
        if (n < 0 && errno == EINTR)
            continue;
        if (n < 0)
            return -errno;
        if (n == 0)
            return SD_EIO;
        p += n;
        off += (uint64_t)n;
        len -= (size_t)n;
    }
    return SD_OK;
}

static void write_chunk(void *arg, uint32_t thread, uint64_t j)
{
    struct wfile *w = arg;
    if (atomic_load(&w->status) != SD_OK)
        return;
    uint64_t lo = j * SD_CKPT_IO_CHUNK, hi = SD_MIN(w->total, lo + SD_CKPT_IO_CHUNK);
    uint8_t *buf = w->buf[thread];
    /* the first extent that ends after lo */
    uint64_t a = 0, z = w->n;
    while (a < z) {
        uint64_t mid = a + (z - a) / 2;
        if (w->xs[mid].file_off + x_bytes(&w->xs[mid]) <= lo)
            a = mid + 1;
        else
            z = mid;
    }
    for (uint64_t i = a; i < w->n && w->xs[i].file_off < hi; i++) {
        const struct sd_ckpt_extent *x = &w->xs[i];
        uint64_t b = SD_MAX(lo, x->file_off), e = SD_MIN(hi, x->file_off + x_bytes(x));
        memcpy(buf + (b - lo), (const uint8_t *)w->src[i] + (b - x->file_off), e - b);
        uint32_t crc = sd_crc32c(0, buf + (b - lo), e - b);
        if (x->file_off >= lo) {
            w->head[i] = crc;
        } else {
            w->cont[j] = crc;
            w->cont_len[j] = e - b;
        }
    }
    size_t len = hi - lo;
    int st = SD_EINVAL;
    if (atomic_load(&w->direct)) {
        size_t padded = (len + SD_CKPT_IO_ALIGN - 1) / SD_CKPT_IO_ALIGN * SD_CKPT_IO_ALIGN;
        memset(buf + len, 0, padded - len); /* past the end of the file: cut by the ftruncate */
        pthread_mutex_lock(&w->write_lock);
        st = pwrite_all(w->fd, buf, padded, lo);
        pthread_mutex_unlock(&w->write_lock);
        if (st == SD_EINVAL) { /* alignment this filesystem refuses: go on buffered */
            atomic_store(&w->direct, false);
            int fl = fcntl(w->fd, F_GETFL);
            if (fl >= 0)
                fcntl(w->fd, F_SETFL, fl & ~O_DIRECT);
        }
    }
    if (st == SD_EINVAL && !atomic_load(&w->direct)) {
        pthread_mutex_lock(&w->write_lock);
        st = pwrite_all(w->fd, buf, len, lo);
        pthread_mutex_unlock(&w->write_lock);
    }
    if (st != SD_OK) {
        int ok = SD_OK;
        atomic_compare_exchange_strong(&w->status, &ok, st);
    }
}

int sd_ckpt_write_extents(int fd, struct sd_ckpt_extent *xs, const void *const *src, uint64_t n,
                          const struct sd_ckpt_io *io, bool *direct_p)
{
    uint64_t total = 0;
    for (uint64_t i = 0; i < n; i++) {
        if (xs[i].file_off != total)
            return SD_EINVAL; /* not packed in file order */
        total += x_bytes(&xs[i]);
    }
    uint64_t chunks = (total + SD_CKPT_IO_CHUNK - 1) / SD_CKPT_IO_CHUNK;
    uint32_t threads = (uint32_t)SD_MIN(SD_MAX(io->threads, 1), SD_MAX(chunks, 1));
    threads = SD_MIN(threads, SD_CKPT_MAX_THREADS);
    struct wfile w = {.fd = fd, .xs = xs, .src = src, .n = n, .total = total};
    w.buf = calloc(threads, sizeof(*w.buf));
    w.head = calloc(n + 1, sizeof(*w.head));
    w.cont = calloc(chunks + 1, sizeof(*w.cont));
    w.cont_len = calloc(chunks + 1, sizeof(*w.cont_len));
    int st = w.buf && w.head && w.cont && w.cont_len ? SD_OK : SD_ENOMEM;
    for (uint32_t t = 0; st == SD_OK && t < threads; t++)
        if (posix_memalign((void **)&w.buf[t], SD_CKPT_IO_ALIGN, SD_CKPT_IO_CHUNK) != 0)
            st = SD_ENOMEM;
    bool direct = false;
    if (st == SD_OK && io->direct) {
        int fl = fcntl(fd, F_GETFL);
        direct = fl >= 0 && fcntl(fd, F_SETFL, fl | O_DIRECT) == 0; /* EINVAL: not here */
    }
    atomic_init(&w.direct, direct);
    atomic_init(&w.status, st);
    pthread_mutex_init(&w.write_lock, NULL);
    if (st == SD_OK && io->runner != NULL)
        io->runner->run(io->runner->ctx, threads, chunks, write_chunk, &w);
    else if (st == SD_OK)
        sd_ckpt_parallel(threads, chunks, write_chunk, &w);
    pthread_mutex_destroy(&w.write_lock);
    st = atomic_load(&w.status);
    direct = atomic_load(&w.direct);
    if (st == SD_OK && direct && ftruncate(fd, (off_t)total) != 0) /* the last chunk's padding */
        st = -errno;
    if (direct) { /* what follows on fd (fsync) wants no alignment */
        int fl = fcntl(fd, F_GETFL);
        if (fl >= 0)
            fcntl(fd, F_SETFL, fl & ~O_DIRECT);
    }
    for (uint64_t i = 0; st == SD_OK && i < n; i++) {
        uint64_t j = xs[i].file_off / SD_CKPT_IO_CHUNK, left = x_bytes(&xs[i]);
        uint32_t crc = w.head[i];
        left -= SD_MIN(left, (j + 1) * SD_CKPT_IO_CHUNK - xs[i].file_off);
        for (j++; left > 0 && j < chunks; j++) {
            crc = sd_crc32c_combine(crc, w.cont[j], w.cont_len[j]);
            left -= w.cont_len[j];
        }
        xs[i].crc = crc;
    }
    for (uint32_t t = 0; w.buf != NULL && t < threads; t++)
        free(w.buf[t]);
    free(w.buf);
    free(w.head);
    free(w.cont);
    free(w.cont_len);
    if (direct_p != NULL)
        *direct_p = direct;
    return st;
}

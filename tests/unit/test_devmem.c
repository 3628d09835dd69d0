/* libshard's importers by memory kind (client/devmem.c, devmem_dev.c): each kind a daemon may
 * name gets its importer or a refusal that says what is missing, never a crash; the host
 * importer maps a memfd and keeps a read-only mapping read-only. Where this libshard carries the
 * CUDA or HIP importer and the machine has no such GPU (CI), opening it fails naming the driver
 * or the device; on a GPU machine it opens. */
#include "check.h"
#include "devmem.h"

#include <fcntl.h>
#include <setjmp.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

static sigjmp_buf faulted;

static void on_segv(int sig)
{
    (void)sig;
    siglongjmp(faulted, 1);
}

static void test_host(void)
{
    char err[512] = "";
    const struct shard_devmem *m = shard_devmem_open("host", 0, "", err, sizeof(err));
    TH_CHECK(m != NULL && m->host && m->memfds && m->stream_write == NULL, "host importer: %s",
             err);
    if (m == NULL)
        return;
    int fd = memfd_create("devmem-test", MFD_CLOEXEC);
    TH_CHECK(fd >= 0 && ftruncate(fd, 8192) == 0, "memfd");
    void *rw = NULL, *ro = NULL;
    TH_CHECK(m->map(fd, 8192, false, &rw, err, sizeof(err)) == 0, "map read-write: %s", err);
    TH_CHECK(m->map(fd, 8192, true, &ro, err, sizeof(err)) == 0, "map read-only: %s", err);
    char src[100];
    for (int i = 0; i < 100; i++)
        src[i] = (char)i;
    TH_CHECK(m->copy((char *)rw + 4000, src, 100, err, sizeof(err)) == 0, "copy in: %s", err);
    TH_CHECK(memcmp((char *)ro + 4000, src, 100) == 0, "the read-only view sees the bytes");
    TH_CHECK(m->zero(rw, 8192, err, sizeof(err)) == 0 && ((char *)ro)[4050] == 0, "zero");
    struct sigaction sa = {.sa_handler = on_segv}, old;
    sigaction(SIGSEGV, &sa, &old);
    volatile int wrote = 0;
    if (sigsetjmp(faulted, 1) == 0) {
        ((volatile char *)ro)[0] = 1;
        wrote = 1;
    }
    sigaction(SIGSEGV, &old, NULL);
    TH_CHECK(!wrote, "a write through the read-only mapping went through");
    m->unmap(rw, 8192);
    m->unmap(ro, 8192);
    close(fd);
}

/* a kind this libshard or this machine cannot import: NULL and a message naming `want` */
static void expect_refused_or_open(const char *kind, const char *want)
{
    char err[512] = "";
    const struct shard_devmem *m = shard_devmem_open(kind, 0, "", err, sizeof(err));
    if (m != NULL) { /* a machine with this GPU and its driver */
        TH_CHECK(strcmp(m->name, kind) == 0 && !m->host && m->stream_write != NULL,
                 "%s importer: name %s", kind, m->name);
        printf("%s: opened (a %s device is here)\n", kind, kind);
        /* a daemon on a GPU this process does not import on (one device per process) */
        const char *other = "GPU-00000000-0000-0000-0000-0000000000ff";
        TH_CHECK(shard_devmem_open(kind, 0, other, err, sizeof(err)) == NULL &&
                     strstr(err, other) != NULL,
                 "another GPU's memory refused naming it: '%s'", err);
        return;
    }
    TH_CHECK(err[0] != '\0' && strstr(err, want) != NULL, "%s refused: '%s' (want '%s')", kind, err,
             want);
    printf("%s: %s\n", kind, err);
}

int main(void)
{
    test_host();
    char err[512] = "";
    TH_CHECK(shard_devmem_open("quantum", 0, "", err, sizeof(err)) == NULL &&
                 strstr(err, "quantum") != NULL,
             "an unknown kind: '%s'", err);
    const struct shard_devmem *e = shard_devmem_open("emu-gpu", 0, "", err, sizeof(err));
    TH_CHECK(e != NULL && !e->host && e->memfds && e->stream_write == NULL, "emu-gpu importer");
    /* CUDA: built with CUDA's headers, refused naming libcuda or the device where no NVIDIA GPU
     * is; built without, refused naming the headers */
#ifdef SHARD_CLIENT_CUDA
    expect_refused_or_open("cuda", "cuda");
#else
    expect_refused_or_open("cuda", "CUDA's headers");
#endif
#ifdef SHARD_CLIENT_HIP
    expect_refused_or_open("hip", "hip");
#else
    expect_refused_or_open("hip", "HIP's headers");
#endif
    return th_summary("test_devmem");
}
